#!/usr/bin/env python3
"""The launcher's failure paths that a real training run does not produce on demand, driven
with fake_rank (tests/elastic/fake_rank.c) on 4 slots and a spare:
  hang    rank 2 keeps its lease while the others report a lost peer and exit 75: blamed as
          "hung" 2 TTLs later;
  fail    rank 1 reports exit code 1 with a cause: blamed at once, with the cause;
  silent  rank 3 never joins: blamed as "never registered" after the start timeout (15 s: on
          a loaded 2-core CI machine mpirun and four ranks were seen to take over 5 s to
          register, and then every rank was blamed).
Each must: blame exactly that rank's slot, relaunch on the spare and finish (exit 0), and leave
no process of its session behind.

Usage: launcher_paths.py --launcher moe_elastic --fake fake_rank --mpirun MPIRUN --work DIR
Exits 1 when a path fails, 77 (skip) without etcd.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

from session import session_left

p = argparse.ArgumentParser()
p.add_argument("--launcher", required=True)
p.add_argument("--fake", required=True)
p.add_argument("--mpirun", required=True)
p.add_argument("--work", required=True)
a = p.parse_args()
if not shutil.which("etcd"):
    print("skipped: no etcd (Debian package etcd-server; scripts/setup-deps.sh --tests)")
    sys.exit(77)
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
failed = 0
for mode, rank, how in (("hang", 2, "hung"), ("fail", 1, "exit code 1"),
                        ("silent", 3, "never registered")):
    d = os.path.join(a.work, mode)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    events = os.path.join(d, "events.jsonl")
    cmd = [a.launcher, "--slots", "4", "--spares", "1", "--ttl-ms", "2000", "--grace-ms", "500",
           "--start-timeout-ms", "15000", "--events", events, "--mpirun", a.mpirun,
           "--mpirun-arg", "--oversubscribe", "--job", mode, "--", a.fake, "--mode", mode,
           "--on-rank", str(rank)]
    with open(os.path.join(d, "launcher.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
    ev = [json.loads(l) for l in open(events)]
    fails = [e for e in ev if e["event"] == "failure"]
    blamed = [(b["slot"], b["how"], b.get("detail", "")) for b in fails[0]["blamed"]] if fails else []
    left = session_left(proc.pid)
    done = [e for e in ev if e["event"] == "done"]
    ok = (rc == 0 and len(fails) == 1 and [b[:2] for b in blamed] == [(rank, how)] and done
          and done[0]["incarnations"] == 2 and not left)
    if mode == "fail":
        ok = ok and "loss is NaN" in blamed[0][2]
    print(f"  {mode}: exit {rc}, blamed {blamed}, done {bool(done)}, left {left}: "
          f"{'ok' if ok else 'FAIL'}")
    failed += not ok
sys.exit(1 if failed else 0)
