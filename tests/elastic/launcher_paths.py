#!/usr/bin/env python3
"""The launcher's failure paths that a real training run does not produce on demand, driven
with fake_rank (tests/elastic/fake_rank.c) on 4 slots and a spare:
  hang    rank 2 keeps its lease while the others report a lost peer and exit 75: blamed as
          "hung" 2 TTLs later;
  fail    rank 1 reports exit code 1 with a cause: blamed at once, with the cause;
  silent  rank 3 never joins: blamed as "never registered" after the start timeout (15 s: on
          a loaded 2-core CI machine mpirun and four ranks were seen to take over 5 s to
          register, and then every rank was blamed);
  early   rank 3 exits a second after it started, before it registered: blamed (its process
          gone) within the TTL, the registered ranks not;
Each must: blame exactly that rank's slot, relaunch on the spare and finish (exit 0), and leave
no process of its session behind. Then, with every rank sleeping after its step:
  mpirun    mpirun killed: no rank blamed, relaunched on the same slots, done; no zombie child
            of the launcher once the next incarnation is up;
  etcd      the private etcd killed: reported at once (etcd_exited), restarted, the run ends
            done with no failure;
  member    a private three-member etcd (--etcd-members 3), the member first in every
            client's list killed: reported (etcd_exited, restarted), no failure, done;
  quorum    the same cluster, its two members that are not the raft leader stopped for 3 s (no
            quorum: the leader steps down): etcd_unreachable within 2.5 s, etcd_reachable once
            they continue, no failure, done (a lost quorum stops no rank);
  launcher  a second launcher on the same job folder is refused (exit 2, naming the holder);
            the launcher killed with SIGKILL: its mpirun, ranks and etcd end within 15 s; the
            same command again on the folder runs (the events file appended, not truncated).
  unreachable  --etcd where nobody listens: exit 1, the message naming the endpoint;
  root      as root without OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM): exit 2, the message naming them.
The launcher's own output never holds Open MPI's noise lines.

Usage: launcher_paths.py --launcher moe_elastic --fake fake_rank --mpirun MPIRUN --work DIR
Exits 1 when a path fails, 77 (skip) without etcd.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from records import rows
from session import alive, session_left

p = argparse.ArgumentParser()
p.add_argument("--launcher", required=True)
p.add_argument("--fake", required=True)
p.add_argument("--mpirun", required=True)
p.add_argument("--work", required=True)
p.add_argument("--only", nargs="*", help="run only these paths")
a = p.parse_args()


def wanted(name):
    return not a.only or name in a.only
if not shutil.which("etcd"):
    print("skipped: no etcd (Debian package etcd-server; scripts/setup-deps.sh --tests)")
    sys.exit(77)
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
TTL_S = 2.0
failed = 0


def wait_event(events, pred, limit_s=60):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        for e in rows(events):
            if pred(e):
                return e
        time.sleep(0.05)
    return None


def command(d, mode, rank, job, extra=()):
    return [a.launcher, "--slots", "4", "--spares", "1", "--ttl-ms", str(int(TTL_S * 1000)),
            "--grace-ms", "500", "--start-timeout-ms", "15000", "--events",
            os.path.join(d, "events.jsonl"), "--mpirun-log", os.path.join(d, "mpirun.log"),
            "--mpirun", a.mpirun, "--mpirun-arg", "--oversubscribe", "--job", job, *extra,
            "--", a.fake, "--mode", mode, "--on-rank", str(rank), "--ckpt-dir",
            os.path.join(d, "ckpt")]


def start(d, cmd, name="launcher.log"):
    log = open(os.path.join(d, name), "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True), log


def finish(proc, limit_s=120):
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        return proc.wait()


def fresh(mode):
    d = os.path.join(a.work, mode)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def zombie_children(pid):
    z = []
    for q in filter(str.isdigit, os.listdir("/proc")):
        try:
            f = open(f"/proc/{q}/stat").read()
        except OSError:
            continue
        fields = f[f.rindex(")") + 2:].split()
        if fields[0] == "Z" and int(fields[1]) == pid:
            z.append(int(q))
    return z


def noisy(d):
    text = open(os.path.join(d, "launcher.log")).read()
    return "PMIX ERROR: BAD-PARAM" in text or "] Read -1, expected" in text


def verdict(name, ok, what):
    global failed
    print(f"  {name}: {what}: {'ok' if ok else 'FAIL'}", flush=True)
    failed += not ok


for mode, rank, how in (("hang", 2, "hung"), ("fail", 1, "exit code 1"),
                        ("silent", 3, "never registered"),
                        ("early", 3, "process gone before it registered")):
    if not wanted(mode):
        continue
    d = fresh(mode)
    proc, log = start(d, command(d, mode, rank, mode))
    rc = finish(proc)
    log.close()
    ev = rows(os.path.join(d, "events.jsonl"))
    fails = [e for e in ev if e["event"] == "failure"]
    blamed = [(b["slot"], b["how"], b.get("detail", "")) for b in fails[0]["blamed"]] if fails else []
    left = session_left(proc.pid)
    done = [e for e in ev if e["event"] == "done"]
    ok = (rc == 0 and len(fails) == 1 and [b[:2] for b in blamed] == [(rank, how)] and done
          and done[0]["incarnations"] == 2 and not left and not noisy(d))
    if mode == "fail":
        ok = ok and "loss is NaN" in blamed[0][2]
    detect = None
    if mode == "early" and fails:
        launch = [e for e in ev if e["event"] == "launch"][0]
        detect = fails[0]["t"] - launch["t"]
        ok = ok and detect < 1.0 + TTL_S + 1.5  # it exits 1 s after its start
    verdict(mode, ok, f"exit {rc}, blamed {blamed}, done {bool(done)}, left {left}"
            + (f", found {detect:.2f} s after the launch" if detect else ""))


def mpirun_path():
    global failed
    d = fresh("mpirun")
    events = os.path.join(d, "events.jsonl")
    proc, log = start(d, command(d, "sleep", -1, "mpirun"))
    up = wait_event(events, lambda e: e["event"] == "ranks_up" and e["incarnation"] == 0)
    launch0 = wait_event(events, lambda e: e["event"] == "launch" and e["incarnation"] == 0, 1)
    zombies = None
    if up and launch0:
        os.kill(launch0["mpirun_pid"], signal.SIGKILL)
        up1 = wait_event(events, lambda e: e["event"] == "ranks_up" and e["incarnation"] == 1)
        launch1 = wait_event(events, lambda e: e["event"] == "launch" and e["incarnation"] == 1, 1)
        if up1 and launch1:
            time.sleep(0.3)
            # a child that exits just now is a zombie until the next poll (100 ms): only one
            # still there half a second later was left unreaped
            first = set(zombie_children(proc.pid))
            time.sleep(0.5)
            zombies = [z for z in zombie_children(proc.pid) if z in first and
                       z != launch1["mpirun_pid"]]
    rc = finish(proc)
    log.close()
    ev = rows(events)
    fails = [e for e in ev if e["event"] == "failure"]
    meshes = [e["mesh"]["slots"] for e in ev if e["event"] == "launch"]
    ok = (rc == 0 and len(fails) == 1 and fails[0]["reason"] == "mpirun exited" and
          fails[0]["blamed"] == [] and len(meshes) == 2 and meshes[0] == meshes[1] and
          zombies == [] and not session_left(proc.pid) and not noisy(d))
    verdict("mpirun", ok, f"exit {rc}, failures {[(f['reason'], f['blamed']) for f in fails]}, "
            f"slots {meshes}, zombies {zombies}")


# etcd killed: reported, restarted, done
def etcd_path():
    global failed
    d = fresh("etcd")
    events = os.path.join(d, "events.jsonl")
    proc, log = start(d, command(d, "etcd", -1, "etcd") + ["--wait-s", "4"])
    st = wait_event(events, lambda e: e["event"] == "start")
    up = wait_event(events, lambda e: e["event"] == "ranks_up")
    killed_at = None
    if st and up:
        killed_at = time.time()
        os.kill(st["etcd_pid"], signal.SIGKILL)
    rc = finish(proc)
    log.close()
    ev = rows(events)
    gone = [e for e in ev if e["event"] == "etcd_exited"]
    ok = (rc == 0 and gone and gone[0]["restarted"] and gone[0]["t"] - killed_at < 1.0 and
          not [e for e in ev if e["event"] == "failure"] and [e for e in ev if e["event"] == "done"]
          and not session_left(proc.pid))
    verdict("etcd", ok, f"exit {rc}, etcd_exited {[(e['how'], e['restarted']) for e in gone]}"
            + (f" {gone[0]['t'] - killed_at:.2f} s after the kill" if gone and killed_at else ""))


def etcd_status(url):
    import urllib.request
    req = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}",
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=2).read())


# a three-member private etcd: one member lost changes nothing; a lost quorum is reported
def cluster_path(name):
    d = fresh(name)
    events = os.path.join(d, "events.jsonl")
    proc, log = start(d, command(d, "etcd", -1, name, ["--etcd-members", "3"])
                      + ["--wait-s", "9" if name == "quorum" else "4"])
    st = wait_event(events, lambda e: e["event"] == "start")
    up = wait_event(events, lambda e: e["event"] == "ranks_up")
    hit_at, what = None, "not up"
    if st and up and name == "member":
        hit_at = time.time()
        os.kill(st["etcd_pids"][0], signal.SIGKILL)
        what = "member 0 killed"
    elif st and up:
        urls = st["etcd"].split(",")
        leader = etcd_status(urls[0])["leader"]
        followers = [i for i, u in enumerate(urls) if etcd_status(u)["header"]["member_id"] != leader]
        stopped = [st["etcd_pids"][i] for i in followers]
        hit_at = time.time()
        for q in stopped:
            os.kill(q, signal.SIGSTOP)
        time.sleep(3)
        for q in stopped:
            os.kill(q, signal.SIGCONT)
        what = f"members {followers} stopped for 3 s"
    rc = finish(proc)
    log.close()
    ev = rows(events)
    fails = [e for e in ev if e["event"] == "failure"]
    done = [e for e in ev if e["event"] == "done"]
    ok = rc == 0 and not fails and done and not session_left(proc.pid) and hit_at is not None
    if name == "member":
        gone = [e for e in ev if e["event"] == "etcd_exited"]
        ok = ok and gone and gone[0]["restarted"] and gone[0]["member"] == 0
        what += f", etcd_exited {[(e['member'], e['restarted']) for e in gone]}"
    else:
        down = [e for e in ev if e["event"] == "etcd_unreachable"]
        back = [e for e in ev if e["event"] == "etcd_reachable"]
        ok = ok and down and back and down[0]["t"] - hit_at < 2.5
        what += (f", unreachable {down[0]['t'] - hit_at:.2f} s after" if down and hit_at else
                 ", never unreachable") + (f", back after {back[0]['down_s']:.2f} s" if back else "")
    verdict(name, ok, f"exit {rc}, {what}, failures {len(fails)}, done {bool(done)}")


# a second launcher on the folder is refused; the launcher killed leaves nothing; run again
def launcher_path():
    global failed
    d = fresh("launcher")
    events = os.path.join(d, "events.jsonl")
    proc, log = start(d, command(d, "sleep", -1, "launcher"))
    up = wait_event(events, lambda e: e["event"] == "ranks_up")
    st = wait_event(events, lambda e: e["event"] == "start", 1)
    launch0 = wait_event(events, lambda e: e["event"] == "launch", 1)
    second = subprocess.run(command(d, "none", -1, "other"), capture_output=True, text=True, env=env,
                            timeout=60)
    refused = second.returncode == 2 and "in use by moe_elastic" in second.stderr
    left = ["not up"]
    if up and st and launch0:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        pids = [st["etcd_pid"], launch0["mpirun_pid"]] + [r["pid"] for r in up["ranks"]]
        end = time.monotonic() + 15
        while time.monotonic() < end and any(alive(q) for q in pids):
            time.sleep(0.1)
        left = [q for q in pids if alive(q)] + session_left(launch0["mpirun_pid"])
        for q in left:
            os.kill(q, signal.SIGKILL)
    log.close()
    proc2, log = start(d, command(d, "none", -1, "launcher"))
    rc2 = finish(proc2)
    log.close()
    starts = [e for e in rows(events) if e["event"] == "start"]
    done = [e for e in rows(events) if e["event"] == "done"]
    ok = refused and not left and rc2 == 0 and len(starts) == 2 and done
    verdict("launcher", ok, f"second launcher exit {second.returncode} "
            f"({second.stderr.strip().splitlines()[-1] if second.stderr.strip() else ''!r}); after "
            f"SIGKILL left {left}; the same command again: exit {rc2}, starts {len(starts)}")


# as root without Open MPI's two variables mpirun refuses to start: the launcher names the cause
def root_path():
    if os.geteuid() != 0:
        return
    d = fresh("root")
    bare = {k: v for k, v in env.items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    r = subprocess.run(command(d, "none", -1, "root"), capture_output=True, text=True, env=bare,
                       timeout=60)
    verdict("root", r.returncode == 2 and "OMPI_ALLOW_RUN_AS_ROOT=1" in r.stderr,
            f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''!r}")


# an etcd that does not answer: exit 1 at once, the message naming it
def unreachable_path():
    d = fresh("unreachable")
    r = subprocess.run(command(d, "none", -1, "unreachable", ["--etcd", "http://127.0.0.1:9"]),
                       capture_output=True, text=True, env=env, timeout=60)
    verdict("unreachable", r.returncode == 1 and "etcd at http://127.0.0.1:9 unreachable" in
            r.stderr, f"exit {r.returncode}: "
            f"{r.stderr.strip().splitlines()[0] if r.stderr.strip() else ''!r}")


for name, path in (("mpirun", mpirun_path), ("etcd", etcd_path),
                   ("member", lambda: cluster_path("member")),
                   ("quorum", lambda: cluster_path("quorum")), ("launcher", launcher_path),
                   ("root", root_path), ("unreachable", unreachable_path)):
    if wanted(name):
        path()
sys.exit(1 if failed else 0)
