#!/usr/bin/env python3
"""moe_elastic's agents on simulated hosts (docs/elastic.md, "Agents and the leader"): three
hosts of two slots, each a session of its own (simhost.py) running `moe_elastic --agent`, with
mpirun's remote launcher pointed at sim_rsh.sh, which starts orted in the named host's session;
a private three-member etcd cluster started here. The job is fake_rank's (4 ranks, ep=2 x pp=2;
every rank sleeps in the first incarnation, later ones finish at once). Trials:
  host    a host holding ranks, not the leader's, killed (every process of its session): its
          slots fail (host_lost), the leader relaunches on the other two hosts, done;
  leader  the leader's host killed: another agent becomes leader, ends what is left of the
          incarnation, relaunches on the two hosts left, done;
  member  one etcd member (the first in every list) killed for good during the run: no failure,
          done.
Each must end with every surviving agent exiting 0, the failed slots exactly the lost host's,
and no process of any host's session left, within one deadline (120 s from the fault).
A failing trial prints what the test saw: each rank's process and session at the fault, the
killed host's session before and after the kill (and whether its ranks survived it), and, for a
host still running at the deadline, the job's keys in etcd with their leases' TTLs left and each
running agent's threads (wchan) and stacks (gdb, where installed); then every host's events, the
agents' and mpirun's last log lines. Each host has its own TMPDIR (simhost.py --tmp).

Usage: hosts_trials.py --launcher moe_elastic --fake fake_rank --mpirun MPIRUN --work DIR
       [--only host leader member] [--repeat N]
Exits 1 when a trial fails, 77 (skip) without etcd.
"""
import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from records import rows
from session import alive, session_left

HERE = os.path.dirname(os.path.abspath(__file__))
p = argparse.ArgumentParser()
p.add_argument("--launcher", required=True)
p.add_argument("--fake", required=True)
p.add_argument("--mpirun", required=True)
p.add_argument("--work", required=True)
p.add_argument("--only", nargs="*")
p.add_argument("--repeat", type=int, default=1, help="run each trial this many times")
a = p.parse_args()
if not shutil.which("etcd"):
    print("skipped: no etcd (Debian package etcd-server; scripts/setup-deps.sh --tests)")
    sys.exit(77)
HOSTS, SLOTS, TTL_MS = ["host0", "host1", "host2"], 2, 2000
failed = 0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def etcd_cluster(d, n=3):
    ports = [(free_port(), free_port()) for _ in range(n)]
    cluster = ",".join(f"m{i}=http://127.0.0.1:{pp}" for i, (_, pp) in enumerate(ports))
    procs = []
    for i, (cp, pp) in enumerate(ports):
        log = open(os.path.join(d, f"etcd-m{i}.log"), "w")
        procs.append(subprocess.Popen(
            ["etcd", "--name", f"m{i}", "--data-dir", os.path.join(d, f"etcd-m{i}"),
             "--listen-client-urls", f"http://127.0.0.1:{cp}",
             "--advertise-client-urls", f"http://127.0.0.1:{cp}",
             "--listen-peer-urls", f"http://127.0.0.1:{pp}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}",
             "--initial-cluster", cluster, "--initial-cluster-token", d],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    endpoints = ",".join(f"http://127.0.0.1:{cp}" for cp, _ in ports)
    # ready once a write commits (a leader elected); the agents would wait for it too
    body = json.dumps({"key": "cmVhZHk=", "value": "MQ=="}).encode()
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{ports[0][0]}/v3/kv/put", data=body,
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    return endpoints, procs


def all_events(d):
    return {h: rows(os.path.join(d, h + ".jsonl")) for h in HOSTS}


def wait_for(pred, limit_s=60):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        r = pred()
        if r:
            return r
        time.sleep(0.05)
    return None


def leader_of(d):
    for h, ev in all_events(d).items():
        if any(e["event"] == "leader" for e in ev):
            return h
    return None


def kill_session(sid):
    # again until none is left: a process forked while the list was read escapes one pass
    end = time.monotonic() + 5
    while session_left(sid) and time.monotonic() < end:
        for q in session_left(sid):
            try:
                os.kill(q, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)


def etcd_call(endpoints, path, body):
    """One request to the first member that answers; None when none does."""
    for ep in endpoints.split(","):
        try:
            req = urllib.request.Request(ep + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(req, timeout=1).read())
        except (OSError, ValueError):
            continue
    return None


def etcd_keys(endpoints, job):
    """The job's keys: (key, value, lease, the lease's TTL left in s), or None without etcd."""
    b64 = lambda b: base64.b64encode(b).decode()
    pfx = f"/moe/{job}/".encode()
    r = etcd_call(endpoints, "/v3/kv/range",
                  {"key": b64(pfx), "range_end": b64(pfx[:-1] + bytes([pfx[-1] + 1]))})
    if r is None:
        return None
    out = []
    for kv in r.get("kvs", []):
        lease = int(kv.get("lease", 0))
        ttl = None
        if lease:
            t = etcd_call(endpoints, "/v3/lease/timetolive", {"ID": lease})
            ttl = t.get("TTL") if t else None
        out.append((base64.b64decode(kv["key"]).decode(),
                    base64.b64decode(kv.get("value", "")).decode(errors="replace")[:160], lease, ttl))
    return out


def proc_stat(pid):
    """(command, state, ppid, session) of pid, or None when it is gone."""
    try:
        st = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    f = st[st.rindex(")") + 2:].split()
    return st[st.index("(") + 1:st.rindex(")")], f[0], int(f[1]), int(f[3])


def describe(pid, sids):
    """pid, its command, state, parent and session (named by its host when it is one)."""
    s = proc_stat(pid)
    if not s:
        return f"{pid} gone"
    return f"{pid} {s[0]} {s[1]} ppid {s[2]} session {sids.get(s[3], s[3])}"


def threads(pid):
    """Each thread of pid: its name, state and where it sleeps in the kernel (wchan)."""
    out = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return out
    for t in tids:
        try:
            wchan = open(f"/proc/{pid}/task/{t}/wchan").read().strip()
        except OSError:
            wchan = "?"
        s = proc_stat(f"{pid}/task/{t}")
        if s:
            out.append(f"thread {t} {s[0]} {s[1]} wchan {wchan or '-'}")
    return out


def backtrace(pid):
    """Every thread's stack of a live process through gdb, where gdb is installed."""
    if not shutil.which("gdb"):
        return ["(no gdb)"]
    try:
        r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                           capture_output=True, text=True, timeout=30)
        return [l[:200] for l in r.stdout.splitlines() if l.startswith(("#", "Thread"))]
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"(gdb: {e})"]


def tail(path, n=15):
    try:
        return open(path, errors="replace").read().splitlines()[-n:]
    except OSError:
        return ["(none)"]


times = {}


def trial(name, run=0):
    global failed
    d = os.path.join(a.work, f"{name}-{run}" if a.repeat > 1 else name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    endpoints, etcd = etcd_cluster(d)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               SIM_HOSTS_DIR=d)
    hosts = {}
    # each host's own TMPDIR (simhost.py --tmp), short: Open MPI's sockets live there
    tmp = tempfile.mkdtemp(prefix="moe-simhosts-")
    for h in HOSTS:
        cmd = [sys.executable, os.path.join(HERE, "simhost.py"), "--dir", d, "--host", h,
               "--tmp", os.path.join(tmp, h), "--",
               a.launcher, "--agent", "--host", h, "--host-session", "--slots", str(SLOTS),
               "--ranks", "4", "--etcd", endpoints, "--ttl-ms", str(TTL_MS), "--grace-ms", "500",
               "--start-timeout-ms", "30000", "--job", name,
               "--events", os.path.join(d, h + ".jsonl"),
               "--mpirun-log", os.path.join(d, h + "-mpirun.log"), "--mpirun", a.mpirun,
               "--mpirun-arg", "--oversubscribe", "--mpirun-arg", "-mca",
               "--mpirun-arg", "plm_rsh_agent", "--mpirun-arg", os.path.join(HERE, "sim_rsh.sh"),
               "--", a.fake, "--mode", "sleep" if name != "member" else "etcd",
               "--wait-s", "6", "--ckpt-dir", os.path.join(d, "ckpt")]
        hosts[h] = subprocess.Popen(cmd, env=env, start_new_session=True)
        if h == HOSTS[0]:
            time.sleep(0.5)  # host0 stands first: the leader is known in the usual case
    what, lost = "", None
    t_fault = None
    escaped = []
    sids = {hosts[h].pid: h for h in HOSTS}  # each host's session id (simhost leads it)
    diag = []  # what the test saw, printed when the trial fails
    up = wait_for(lambda: [e for ev in all_events(d).values() for e in ev
                           if e["event"] == "ranks_up"], 60)
    lead = leader_of(d)
    if up and lead:
        up = up[0]
        launch = [e for e in all_events(d)[lead] if e["event"] == "launch"][0]
        slot_host = dict(zip(launch["mesh"]["slots"], launch["hosts"]))
        # where each rank of ranks_up runs: its process should be in its host's session
        ranks = [(r["slot"], r["rank"], r["pid"]) for r in up["ranks"]]
        diag.append("ranks at the fault (slot, rank, the launch's host: the process):")
        diag += [f"  slot {s} rank {k} on {slot_host.get(s)}: {describe(pid, sids)}"
                 for s, k, pid in ranks]
        if name == "host":
            lost = [h for h in HOSTS if h != lead and h in slot_host.values()][0]
        elif name == "leader":
            lost = lead
        if lost:
            before = session_left(hosts[lost].pid)
            diag.append(f"{lost}'s session before the kill: " +
                        "; ".join(describe(q, sids) for q in before))
            t_fault = time.time()
            kill_session(hosts[lost].pid)
            what = f"{lost} killed ({'the leader' if lost == lead else 'leader ' + lead})"
            diag.append(f"{lost}'s session after the kill: " +
                        ("; ".join(describe(q, sids) for q in session_left(hosts[lost].pid))
                         or "empty"))
            gone = [(s, pid) for s, k, pid in ranks if slot_host.get(s) == lost]
            diag.append(f"{lost}'s ranks after the kill: " +
                        "; ".join(f"slot {s}: " + (describe(pid, sids) if alive(pid) else
                                                   f"{pid} gone") for s, pid in gone))
            # a rank outside its host's session outlives the "host": said even when the leader
            # copes (it finds the host lost by its agent's key), and ended after the trial
            escaped = [pid for s, pid in gone if alive(pid)]
            if escaped:
                print(f"  note: {lost}'s ranks survived its kill: " +
                      "; ".join(describe(q, sids) for q in escaped), flush=True)
        else:
            t_fault = time.time()
            etcd[0].kill()
            what = "etcd member 0 killed"
    else:
        what = f"not up (ranks_up {bool(up)}, leader {lead})"
    codes = {}
    # one deadline for every host (a recovery takes seconds); a host still running then is
    # looked at live (its threads, its stacks, the job's keys in etcd) before it is killed
    end = time.monotonic() + 120
    for h, q in hosts.items():
        try:
            codes[h] = q.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[h] = "timeout"
    running = [h for h in HOSTS if codes[h] == "timeout"]
    if running:
        diag.append(f"still running at the deadline: {running}; the job's keys in etcd "
                    "(key = value [lease, TTL left s]):")
        keys = etcd_keys(endpoints, name)
        diag += [f"  {k} = {v}" + (f" [lease {l:x}, TTL {t}]" if l else "")
                 for k, v, l, t in keys] if keys is not None else ["  (etcd does not answer)"]
        for h in running:
            for q in session_left(hosts[h].pid):
                diag.append(f"  {h}: {describe(q, sids)}")
                s = proc_stat(q)
                if s and s[0] == "moe_elastic":
                    diag += [f"    {t}" for t in threads(q)]
                    diag += [f"    {t}" for t in backtrace(q)]
        for h in running:
            kill_session(hosts[h].pid)
    ev = all_events(d)
    flat = [e for h in HOSTS for e in ev[h]]
    done = [e for e in flat if e["event"] == "done"]
    fails = [e for e in flat if e["event"] == "failure"]
    slot_failed = sorted({e["slot"] for e in flat if e["event"] == "slot_failed"})
    host_lost = sorted({e["host"] for e in flat if e["event"] == "host_lost"})
    leaders = [h for h in HOSTS if any(e["event"] == "leader" for e in ev[h])]
    # an orted ended by mpirun's teardown (sim_rsh.sh's SIGTERM) may still be shutting down when
    # the agents exit, on a loaded machine: a few seconds for it; one that stays fails the trial
    wait_for(lambda: not any(session_left(hosts[h].pid) for h in HOSTS), 10)
    left = [q for h in HOSTS for q in session_left(hosts[h].pid)]
    if left:
        diag.append("left in the hosts' sessions: " + "; ".join(describe(q, sids) for q in left))
    ok = bool(done) and t_fault is not None and not left
    ok = ok and all(c == 0 for h, c in codes.items() if h != lost)
    if lost:
        its = sorted({x for e in flat if e["event"] == "host_lost" for x in e["slots"]})
        ok = ok and len(its) == SLOTS and slot_failed == its and host_lost == [lost]
        relaunch = [e for e in flat if e["event"] == "launch" and e["t"] > t_fault]
        ok = ok and relaunch and lost not in relaunch[-1]["hosts"]
    else:
        ok = ok and not fails and not slot_failed
    if name == "leader":
        ok = ok and len(leaders) == 2
    recover = None
    # the first step of an incarnation after the one the fault hit (that one's own first_step
    # may reach the file after the test read ranks_up)
    steps = sorted((e for e in flat if e["event"] == "first_step" and t_fault and up and
                    e["incarnation"] > up["incarnation"]), key=lambda e: e["t"])
    if steps:
        recover = steps[0]["t"] - t_fault
    for q in etcd:
        q.kill()
        q.wait()
    for q in escaped:
        if (proc_stat(q) or ("",))[0] == os.path.basename(a.fake)[:15]:  # not a reused pid
            try:
                os.kill(q, signal.SIGKILL)
            except OSError:
                pass
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"  {name}: {what}; exit codes {codes}; leaders {leaders}; host_lost {host_lost}; "
          f"slots failed {slot_failed}; failures {len(fails)}; done {bool(done)}; "
          f"fault to next step {recover if recover is None else round(recover, 2)} s; "
          f"left {left}: {'ok' if ok else 'FAIL'}", flush=True)
    if not ok:
        # what the leader saw: each host's events, its agent's and its mpirun's last lines
        for h in HOSTS:
            diag.append(f"{h} events:")
            diag += [f"  {json.dumps(e)[:300]}" for e in ev[h]]
            diag.append(f"{h} agent log (last lines):")
            diag += [f"  {l[:300]}" for l in tail(os.path.join(d, h + ".log"))]
            if os.path.exists(os.path.join(d, h + "-mpirun.log")):
                diag.append(f"{h} mpirun log (last lines):")
                diag += [f"  {l[:300]}" for l in tail(os.path.join(d, h + "-mpirun.log"))]
        print("\n".join("    " + l for l in diag), flush=True)
    failed += not ok
    host_found = [e["t"] - t_fault for e in flat if e["event"] == "host_lost" and t_fault]
    failure = [e["t"] - t_fault for e in flat if e["event"] == "failure" and t_fault]
    times.setdefault(name, []).append((ok, failure[0] if failure else None,
                                       host_found[0] if host_found else None, recover))


def med_max(v):
    v = sorted(x for x in v if x is not None)
    return f"{v[len(v) // 2]:.2f} / {v[-1]:.2f} s" if v else "-"


for name in ("host", "leader", "member"):
    for run in range(a.repeat):
        if not a.only or name in a.only:
            trial(name, run)
if a.repeat > 1:
    print("| trial | runs | passed | fault -> failure | fault -> host_lost | fault -> next step |")
    print("|---|---|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {len(t)} | {sum(x[0] for x in t)} | {med_max(x[1] for x in t)} | "
              f"{med_max(x[2] for x in t)} | {med_max(x[3] for x in t)} |")
sys.exit(1 if failed else 0)
