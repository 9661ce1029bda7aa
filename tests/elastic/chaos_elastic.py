#!/usr/bin/env python3
"""Chaos trials of elastic training: the bundled trainer on 4 ranks (the tiny config, a
checkpoint every --ckpt-every steps) under moe_elastic, to --steps steps, with ranks lost at
random moments (a seeded generator: a failing trial can be re-run):

  kill      kill -9 one random rank, between 0.2 and 2 s into training (between steps, inside
            a collective or a checkpoint write: wherever the moment falls)
  stop      SIGSTOP one random rank (its lease expires; the launcher SIGKILLs it)
  double    kill -9 two ranks at once
  recovery  kill -9 one rank, then one rank of the next incarnation as soon as it is up
            (during its start, checkpoint load or first steps)

Trials alternate between one spare slot (the mesh is kept) and none (the mesh shrinks to the
largest valid one), and every two trials between the --meshes (default ep=2 x pp=2, which
shrinks to ep=2, and ep=4, which shrinks to ep=2: its experts resharded from 4 ranks to 2).
Every trial must:
  - end by itself with the launcher's exit 0 and its "done" event at the target step;
  - blame the killed or stopped slots in its first failure event; a stopped rank within the
    lease TTL + 1.5 s (etcd's expiry check, the launcher's poll, one step);
  - resume every restart from a checkpoint step (a multiple of --ckpt-every, at most the
    step reached): only complete checkpoints are ever loaded;
  - log every step 1..steps, each loss equal to the uninterrupted run's (on the trial's first
    mesh) at that step: bitwise while the mesh is kept, within 1e-5 relative at the first step
    after each resume on a new mesh (later steps on it are reported as their largest
    difference);
  - leave no process of its session behind, and keep Open MPI's noise lines out of the
    launcher's output (they stay in its mpirun log).
Then the launcher's limits (min world, max restarts, a job that does not fit: exit 3, 4, 2),
and --restart trials: the launcher killed (SIGKILL) once a checkpoint past step 2 x
--ckpt-every is committed, its mpirun, ranks and etcd gone within 15 s, the newest complete
checkpoint corrupted (a byte of a data file flipped), and the same command again: it must move
that step aside (a checkpoint_rejected event), resume from the one before, finish with every
loss equal to the uninterrupted run's, and keep the first run's metrics rows (not truncated).
Prints one line per trial, then trials / recovered / time-to-recover (signal to the first
step of the recovered incarnation) median and max; exits 1 when any trial fails, 77 (skip)
without etcd.

Usage: chaos_elastic.py --launcher moe_elastic --trainer moe_train --mpirun MPIRUN
         --config tiny.json --work DIR [--kill N] [--stop N] [--double N] [--recovery N]
         [--seed S] [--steps N] [--ckpt-every K] [--ttl-ms MS] [--meshes M...]
"""
import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

from records import rows, uninterrupted_losses
from session import alive, session_left

p = argparse.ArgumentParser()
p.add_argument("--launcher", required=True)
p.add_argument("--trainer", required=True)
p.add_argument("--mpirun", required=True)
p.add_argument("--config", required=True)
p.add_argument("--work", required=True)
for kind, n in (("kill", 20), ("stop", 10), ("double", 3), ("recovery", 3), ("restart", 3)):
    p.add_argument(f"--{kind}", type=int, default=n)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--steps", type=int, default=300)
p.add_argument("--ckpt-every", type=int, default=10)
p.add_argument("--ttl-ms", type=int, default=2000)
p.add_argument("--meshes", nargs="+", default=["ep=2,pp=2", "ep=4"])
a = p.parse_args()

TRIAL_LIMIT_S = 300
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


def trainer_args(d, mesh):
    return [a.trainer, "--config", a.config, "--mesh", mesh, "--steps", str(a.steps),
            "--ckpt-dir", os.path.join(d, "ckpt"), "--ckpt-every", str(a.ckpt_every),
            "--metrics", os.path.join(d, "metrics.jsonl")]


def wait_event(events, pred, limit_s):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        for e in rows(events):
            if pred(e):
                return e
        time.sleep(0.02)
    return None


def reference(mesh):
    d = os.path.join(a.work, "reference-" + mesh.replace(",", "-").replace("=", ""))
    cmd = [a.mpirun, "-np", "4", "--oversubscribe"] + trainer_args(d, mesh)
    return uninterrupted_losses(cmd, d, ENV, 600)


def trial(n, kind, spares, mesh, rng, ref):
    d = os.path.join(a.work, f"{kind}{n:02d}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    events = os.path.join(d, "events.jsonl")
    cmd = [a.launcher, "--slots", "4", "--spares", str(spares), "--ttl-ms", str(a.ttl_ms),
           "--grace-ms", "1000", "--max-restarts", "4", "--events", events, "--mpirun-log",
           os.path.join(d, "mpirun.log"), "--mpirun", a.mpirun, "--mpirun-arg",
           "--oversubscribe", "--job", f"{kind}{n}", "--"]
    cmd += trainer_args(d, mesh)
    env = dict(ENV, OMPI_MCA_orte_tmpdir_base=os.path.join(d, "mpi-session"))
    log = open(os.path.join(d, "launcher.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    problems, signalled, victims, stopped = [], None, [], []
    try:
        first = wait_event(events, lambda e: e["event"] == "first_step" and e["incarnation"] == 0, 90)
        up = wait_event(events, lambda e: e["event"] == "ranks_up" and e["incarnation"] == 0, 1)
        if not first or not up:
            problems.append("incarnation 0 never took a step")
        else:
            time.sleep(rng.uniform(0.2, 2.0))
            ranks = up["ranks"]
            picked = rng.sample(ranks, 2 if kind == "double" else 1)
            sig = signal.SIGSTOP if kind == "stop" else signal.SIGKILL
            signalled = time.time()
            for r in picked:
                os.kill(r["pid"], sig)
            victims = [r["slot"] for r in picked]
            if kind == "stop":
                stopped = [r["pid"] for r in picked]
            if kind == "recovery":
                up1 = wait_event(events, lambda e: e["event"] == "ranks_up" and
                                 e["incarnation"] == 1, 90)
                if not up1:
                    problems.append("incarnation 1 never came up")
                else:
                    time.sleep(rng.uniform(0.0, 0.5))
                    r = rng.choice(up1["ranks"])
                    try:
                        os.kill(r["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        try:
            rc = proc.wait(timeout=TRIAL_LIMIT_S)
        except subprocess.TimeoutExpired:
            rc = None
            problems.append(f"the launcher did not end within {TRIAL_LIMIT_S} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in stopped:  # a stopped victim left behind would hold its memory for ever
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    left = session_left(proc.pid)
    if left:
        problems.append(f"processes left behind: {left}")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    ev = rows(events)
    done = [e for e in ev if e["event"] == "done"]
    if any(m in open(os.path.join(d, "launcher.log")).read()
           for m in ("PMIX ERROR: BAD-PARAM", "] Read -1, expected")):
        problems.append("Open MPI's noise in the launcher's output")
    if rc is not None and rc != 0:
        problems.append(f"launcher exit {rc}")
    if not done or done[0]["step"] != a.steps:
        problems.append(f"no done event at step {a.steps}")
    failures = [e for e in ev if e["event"] == "failure"]
    detect_s = None
    if victims:
        if not failures:
            problems.append("no failure detected")
        else:
            blamed = {b["slot"] for b in failures[0]["blamed"]}
            if not set(victims) <= blamed:
                problems.append(f"slots {victims} lost, the failure blames {sorted(blamed)}")
            detect_s = failures[0]["t"] - signalled
            if kind == "stop" and detect_s > a.ttl_ms / 1000 + 1.5:
                problems.append(f"the stopped rank was detected after {detect_s:.2f} s")
    recovered_at = [e["t"] for e in ev if e["event"] == "first_step" and e["incarnation"] >= 1]
    ttr = recovered_at[-1] - signalled if recovered_at and signalled else None
    for e in ev:
        if e["event"] == "resumed" and e["incarnation"] >= 1:
            if e["step"] < 0 or e["step"] % a.ckpt_every:
                problems.append(f"incarnation {e['incarnation']} resumed at step {e['step']}")
    for e in ev:
        if e["event"] == "recovery" and e["steps_lost"] < 0:
            problems.append(f"recovery with {e['steps_lost']} steps lost")
    changed = any(e["event"] == "mesh" and e["changed"] for e in ev)
    mr = rows(os.path.join(d, "metrics.jsonl"))
    missing = sorted(set(range(1, a.steps + 1)) - {r["step"] for r in mr})
    if missing:
        problems.append(f"steps never logged: {missing[:5]}...")
    worst_later = 0.0
    prev = 0
    for i, r in enumerate(mr):
        resumed_here = i > 0 and r["step"] <= prev
        prev = r["step"]
        ref_loss = ref.get(r["step"])
        if ref_loss is None:
            continue
        rel = abs(r["loss"] - ref_loss) / abs(ref_loss)
        if not changed:
            if r["loss"] != ref_loss:
                problems.append(f"step {r['step']}: loss {r['loss']!r} != {ref_loss!r} (mesh kept)")
                break
        elif resumed_here and rel > 1e-5:
            problems.append(f"step {r['step']} after a resume: loss rel diff {rel:.2e} > 1e-5")
        elif not resumed_here:
            worst_later = max(worst_later, rel)
    meshes = [f"{e['ep']}x{e['dp']}x{e['pp']}/{e['world']}" for e in ev if e["event"] == "mesh"]
    print(f"  {kind}{n:02d} {mesh} spares={spares} victims={victims} "
          f"detect={detect_s if detect_s is None else round(detect_s, 2)}s "
          f"recover={ttr if ttr is None else round(ttr, 2)}s restarts={len(failures)} "
          f"meshes(ep x dp x pp/world)={meshes or ['kept']} "
          f"later-steps max rel={worst_later:.1e}: {'ok' if not problems else 'FAIL'}", flush=True)
    for q in problems:
        print("     ", q)
    return not problems, ttr


if not shutil.which("etcd"):
    print("skipped: no etcd (Debian package etcd-server; scripts/setup-deps.sh --tests)")
    sys.exit(77)
def limits():
    """The launcher's limits: a lost rank with --min-world 4 and no spare stops it with exit 3,
    with --max-restarts 0 exit 4 (both with a stop event and no process left); a trainer whose
    arguments do not fit the slots, exit 2 before anything starts."""
    ok = True
    for name, extra, want in (("min-world", ["--min-world", "4"], 3),
                              ("max-restarts", ["--max-restarts", "0"], 4)):
        d = os.path.join(a.work, f"limit-{name}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        events = os.path.join(d, "events.jsonl")
        cmd = [a.launcher, "--slots", "4", "--ttl-ms", str(a.ttl_ms), "--grace-ms", "1000",
               "--events", events, "--mpirun-log", os.path.join(d, "mpirun.log"), "--mpirun",
               a.mpirun, "--mpirun-arg", "--oversubscribe", "--job", name] + extra + ["--"] + trainer_args(d, a.meshes[0])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=ENV, start_new_session=True)
        up = wait_event(events, lambda e: e["event"] == "first_step", 90)
        if up:
            os.kill(wait_event(events, lambda e: e["event"] == "ranks_up", 1)["ranks"][1]["pid"],
                    signal.SIGKILL)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        stop = [e for e in rows(events) if e["event"] == "stop"]
        left = session_left(proc.pid)
        good = up and rc == want and stop and stop[0]["exit_code"] == want and not left
        print(f"  limit {name}: exit {rc} (want {want}), stop: "
              f"{stop[0]['reason'] if stop else None!r}: {'ok' if good else 'FAIL'}")
        ok &= bool(good)
    r = subprocess.run([a.launcher, "--slots", "3", "--mpirun-log", os.devnull, "--mpirun",
                        a.mpirun, "--mpirun-arg",
                        "--oversubscribe", "--"] + trainer_args(os.path.join(a.work, "bad"),
                                                                a.meshes[0]),
                       capture_output=True, text=True, env=ENV, timeout=120)
    good = r.returncode == 2 and "print-config" in r.stderr
    print(f"  limit bad job (mesh of 4 on 3 slots): exit {r.returncode}: "
          f"{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''!r}: "
          f"{'ok' if good else 'FAIL'}")
    return ok and good


def committed(ckpt):
    try:
        names = os.listdir(ckpt)
    except OSError:
        return []
    return sorted(int(n[5:]) for n in names if n.startswith("step-") and
                  os.path.exists(os.path.join(ckpt, n, "manifest.json")))


def restart_trial(n, mesh, ref):
    d = os.path.join(a.work, f"restart{n:02d}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    events = os.path.join(d, "events.jsonl")
    ckpt = os.path.join(d, "ckpt")
    cmd = [a.launcher, "--slots", "4", "--ttl-ms", str(a.ttl_ms), "--grace-ms", "1000",
           "--events", events, "--mpirun-log", os.path.join(d, "mpirun.log"), "--mpirun",
           a.mpirun, "--mpirun-arg", "--oversubscribe", "--job", f"restart{n}", "--"]
    cmd += trainer_args(d, mesh)
    problems = []
    log = open(os.path.join(d, "launcher.log"), "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV,
                            start_new_session=True)
    end = time.monotonic() + 90
    while time.monotonic() < end and not [s for s in committed(ckpt) if s > 2 * a.ckpt_every]:
        time.sleep(0.02)
    st = wait_event(events, lambda e: e["event"] == "start", 1)
    up = wait_event(events, lambda e: e["event"] == "ranks_up", 1)
    launch = wait_event(events, lambda e: e["event"] == "launch", 1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    pids = ([st["etcd_pid"]] if st else []) + ([launch["mpirun_pid"]] if launch else []) + \
        ([r["pid"] for r in up["ranks"]] if up else [])
    end = time.monotonic() + 15
    while time.monotonic() < end and any(alive(q) for q in pids):
        time.sleep(0.1)
    left = [q for q in pids if alive(q)]
    if left or not up:
        problems.append(f"after the launcher's SIGKILL: left {left}, ranks up {bool(up)}")
    for q in left:
        os.kill(q, signal.SIGKILL)
    first_rows = rows(os.path.join(d, "metrics.jsonl"))
    steps = committed(ckpt)
    bad = steps[-1] if steps else None
    if bad is not None:
        data = os.path.join(ckpt, f"step-{bad:012d}", "rank-00000.bin")
        with open(data, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=TRIAL_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    log.close()
    ev = rows(events)
    rejected = [e["step"] for e in ev if e["event"] == "checkpoint_rejected"]
    resumed = [e["step"] for e in ev if e["event"] == "resumed"]
    done = [e for e in ev if e["event"] == "done"]
    mr = rows(os.path.join(d, "metrics.jsonl"))
    if rc != 0 or not done or done[-1]["step"] != a.steps:
        problems.append(f"the same command again: exit {rc}, done {done[-1] if done else None}")
    if rejected != [bad]:
        problems.append(f"rejected {rejected}, the corrupted step was {bad}")
    if not resumed or resumed[-1] != (steps[-2] if len(steps) > 1 else 0):
        problems.append(f"resumed at {resumed}, checkpoints {steps}")
    # the rerun replays the steps after the checkpoint it resumed from: the trainer drops the
    # first run's rows of those steps, keeps every earlier one, and writes each step once
    kept = [r for r in first_rows if resumed and r["step"] <= resumed[-1]]
    if mr[:len(kept)] != kept or not first_rows:
        problems.append("the first run's metrics rows up to the resumed step were not kept")
    if len({r["step"] for r in mr}) != len(mr):
        problems.append("a step appears twice in the metrics file")
    missing = sorted(set(range(1, a.steps + 1)) - {r["step"] for r in mr})
    if missing:
        problems.append(f"steps never logged: {missing[:5]}...")
    for r in mr:
        if r["loss"] != ref.get(r["step"]):
            problems.append(f"step {r['step']}: loss {r['loss']!r} != {ref.get(r['step'])!r}")
            break
    print(f"  restart{n:02d} {mesh} checkpoints {steps[-3:]} corrupted {bad} resumed {resumed} "
          f"rejected {rejected}: {'ok' if not problems else 'FAIL'}", flush=True)
    for q in problems:
        print("     ", q)
    return not problems, None


refs = {mesh: reference(mesh) for mesh in a.meshes}
limits_ok = limits()
rng = random.Random(a.seed)
results = []
n = 0
for kind in ("kill", "stop", "double", "recovery"):
    for i in range(getattr(a, kind)):
        mesh = a.meshes[(n // 2) % len(a.meshes)]
        results.append(trial(n, kind, 1 if n % 2 == 0 else 0, mesh, rng, refs[mesh]))
        n += 1
for i in range(a.restart):
    mesh = a.meshes[i % len(a.meshes)]
    results.append(restart_trial(i, mesh, refs[mesh]))
ok = [r for r in results if r[0]]
times = [t for good, t in results if good and t is not None]
print(f"trials {len(results)}  recovered {len(ok)}  time-to-recover median "
      f"{statistics.median(times) if times else float('nan'):.2f} s  max "
      f"{max(times) if times else float('nan'):.2f} s")
sys.exit(0 if results and len(ok) == len(results) and limits_ok else 1)
