#!/usr/bin/env python3
"""Straggler trials: the bundled trainer on 4 ranks (the tiny config, ep=2 x pp=2, a checkpoint
every --ckpt-every steps) under moe_elastic, with one slot made slow by the trainer's test hook
(test.slow_slot, test.slow_ms: that rank sleeps at the start of every training step, as a slow
device would; it keeps running, so its lease and process look healthy), after one
uninterrupted reference run:

  replace  --straggler-policy replace and one spare: the slow slot must be found (a straggler
           event naming it) within 20 steps of the incarnation's first step, the incarnation
           ended once the next checkpoint committed (a failure with reason "straggler" that
           blames that slot alone), the run resumed from that checkpoint on the spare with the
           mesh unchanged, finished at the target step, every step logged once with a loss
           bitwise equal to the reference's, the metrics rows of the slow incarnation showing
           the slow rank's busy time above the others', and no process left behind;
  warn     the default policy, no spare: the straggler event (action: none) and nothing else;
           the run finishes in one incarnation, its losses bitwise equal to the reference's;
  healthy  no slow slot, the default rule: no straggler event (the rule's false positives on
           this machine, whatever its load).

Exits 1 when a trial fails, 77 (skip) without etcd.

Usage: straggler_elastic.py --launcher moe_elastic --trainer moe_train --mpirun MPIRUN
         --config tiny.json --work DIR [--steps N] [--ckpt-every K] [--slow-ms MS]
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

from records import rows, uninterrupted_losses
from session import session_left

p = argparse.ArgumentParser()
p.add_argument("--launcher", required=True)
p.add_argument("--trainer", required=True)
p.add_argument("--mpirun", required=True)
p.add_argument("--config", required=True)
p.add_argument("--work", required=True)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--ckpt-every", type=int, default=10)
p.add_argument("--slow-ms", type=float, default=30)
p.add_argument("--slow-slot", type=int, default=2)
a = p.parse_args()

MESH = "ep=2,pp=2"
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
FOUND_WITHIN = 20  # steps from the incarnation's first step to the straggler event


def trainer_args(d):
    return [a.trainer, "--config", a.config, "--mesh", MESH, "--steps", str(a.steps),
            "--ckpt-dir", os.path.join(d, "ckpt"), "--ckpt-every", str(a.ckpt_every),
            "--metrics", os.path.join(d, "metrics.jsonl")]


def reference():
    d = os.path.join(a.work, "reference")
    cmd = [a.mpirun, "-np", "4", "--oversubscribe"] + trainer_args(d)
    return uninterrupted_losses(cmd, d, ENV, 300)


def run(name, spares, extra, slow):
    """The launcher on the job until it ends; returns (exit code, events, metrics rows,
    problems)."""
    d = os.path.join(a.work, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    events = os.path.join(d, "events.jsonl")
    cmd = [a.launcher, "--slots", "4", "--spares", str(spares), "--ttl-ms", "2000",
           "--grace-ms", "1000", "--max-restarts", "2", "--events", events, "--mpirun-log",
           os.path.join(d, "mpirun.log"), "--mpirun", a.mpirun, "--mpirun-arg",
           "--oversubscribe", "--job", name] + extra + ["--"] + trainer_args(d)
    if slow:
        cmd += ["--test.slow_slot", str(a.slow_slot), "--test.slow_ms", str(a.slow_ms)]
    env = dict(ENV, OMPI_MCA_orte_tmpdir_base=os.path.join(d, "mpi-session"))
    problems = []
    with open(os.path.join(d, "launcher.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            problems.append("the launcher did not end within 240 s")
    left = session_left(proc.pid)
    if left:
        problems.append(f"processes left behind: {left}")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    if rc != 0:
        problems.append(f"launcher exit {rc}")
    ev = rows(events)
    done = [e for e in ev if e["event"] == "done"]
    if not done or done[0]["step"] != a.steps:
        problems.append(f"no done event at step {a.steps}")
    return ev, rows(os.path.join(d, "metrics.jsonl")), problems


def check_losses(mr, ref, problems):
    steps = [r["step"] for r in mr]
    if sorted(steps) != list(range(1, a.steps + 1)):
        problems.append(f"steps logged {steps[:3]}...{steps[-3:]} ({len(steps)} rows), not "
                        f"each of 1..{a.steps} once")
    for r in mr:
        if r["loss"] != ref.get(r["step"]):
            problems.append(f"step {r['step']}: loss {r['loss']!r} != {ref.get(r['step'])!r}")
            break


def report(name, problems, summary):
    print(f"  {name}: {summary}: {'ok' if not problems else 'FAIL'}", flush=True)
    for q in problems:
        print("     ", q)
    return not problems


def replace_trial(ref):
    ev, mr, problems = run("replace", 1, ["--straggler-policy", "replace"], True)
    found = [e for e in ev if e["event"] == "straggler"]
    failures = [e for e in ev if e["event"] == "failure"]
    first = next((e for e in ev if e["event"] == "first_step" and e["incarnation"] == 0), None)
    launches = [e for e in ev if e["event"] == "launch"]
    resumed = [e["step"] for e in ev if e["event"] == "resumed" and e["incarnation"] == 1]
    summary = "no straggler event"
    if not found:
        problems.append("the slow slot was never found")
    else:
        f = found[0]
        summary = (f"found slot {f['slot']} at step {f['step']} (busy {f['busy_s'] * 1e3:.1f} ms,"
                   f" median {f['median_s'] * 1e3:.1f} ms, {f['slowdown']:.1f}x)")
        if len(found) != 1 or f["slot"] != a.slow_slot or f["incarnation"] != 0:
            problems.append(f"straggler events {found}; the slow slot is {a.slow_slot}")
        if first and f["step"] - first["step"] >= FOUND_WITHIN:
            problems.append(f"found at step {f['step']}, more than {FOUND_WITHIN} steps after "
                            f"the first ({first['step']})")
        if f["action"] != "replace after the next checkpoint":
            problems.append(f"action {f['action']!r}")
    if len(failures) != 1 or failures[0]["reason"] != "straggler" or \
            [b["slot"] for b in failures[0]["blamed"]] != [a.slow_slot]:
        problems.append(f"failures {failures}: want one, reason straggler, blaming slot "
                        f"{a.slow_slot} alone")
    if len(launches) != 2 or a.slow_slot in launches[-1]["mesh"]["slots"] or \
            4 not in launches[-1]["mesh"]["slots"] or \
            [launches[-1]["mesh"][k] for k in ("tp", "ep", "dp", "pp")] != [1, 2, 1, 2]:
        problems.append(f"launches {[l['mesh'] for l in launches]}: want the second on the "
                        f"spare (slot 4) with the mesh unchanged")
    else:
        summary += f", relaunched on slots {launches[-1]['mesh']['slots']}"
    if found and (len(resumed) != 1 or resumed[0] % a.ckpt_every or
                  resumed[0] <= found[0]["step"] - 1 - a.ckpt_every):
        problems.append(f"resumed at {resumed}: want the first checkpoint after the finding")
    elif resumed:
        lost = [e["steps_lost"] for e in ev if e["event"] == "recovery"]
        summary += f", resumed at step {resumed[0]} ({lost[0] if lost else '?'} steps run again)"
    check_losses(mr, ref, problems)
    # the rows of the slow incarnation name the slow rank: world rank = position of the slot
    slow_rank = a.slow_slot
    last = min([found[0]["step"]] + resumed) if found else 0
    slow_rows = [r for r in mr if r["step"] <= last]
    bad = [r["step"] for r in slow_rows
           if max(range(4), key=lambda k: r["busy_s"][k]) != slow_rank]
    if not slow_rows:
        problems.append("no metrics rows of the slow incarnation")
    elif len(bad) > len(slow_rows) // 4:
        problems.append(f"metrics: rank {slow_rank} not the busiest at steps {bad}")
    return report("replace", problems, summary)


def warn_trial(ref):
    ev, mr, problems = run("warn", 0, [], True)
    found = [e for e in ev if e["event"] == "straggler"]
    failures = [e for e in ev if e["event"] == "failure"]
    if len(found) != 1 or found[0]["slot"] != a.slow_slot or \
            not found[0]["action"].startswith("none"):
        problems.append(f"straggler events {found}: want one for slot {a.slow_slot}, no action")
    if failures:
        problems.append(f"failures under the warn policy: {failures}")
    check_losses(mr, ref, problems)
    return report("warn", problems, f"{len(found)} straggler event, {len(failures)} failures")


def healthy_trial(ref):
    ev, mr, problems = run("healthy", 1, [], False)
    found = [e for e in ev if e["event"] == "straggler"]
    if found:
        problems.append(f"straggler events in a healthy run: {found}")
    check_losses(mr, ref, problems)
    worst = max((r["busy_max_over_median"] for r in mr), default=0)
    return report("healthy", problems, f"{len(found)} straggler events, worst busy max/median "
                  f"{worst:.2f}")


if not shutil.which("etcd"):
    print("skipped: no etcd (Debian package etcd-server; scripts/setup-deps.sh --tests)")
    sys.exit(77)
t0 = time.monotonic()
ref = reference()
ok = [replace_trial(ref), warn_trial(ref), healthy_trial(ref)]
print(f"trials {len(ok)}  passed {sum(ok)}  in {time.monotonic() - t0:.1f} s")
sys.exit(0 if all(ok) else 1)
