#!/usr/bin/env python3
"""Chaos trials: kill -9 or SIGSTOP one rank of a training loop at a random moment and check
that every survivor exits on its own, soon, naming the lost rank.

Each trial launches `mpirun -np 4 --enable-recovery` (the launcher then lets the survivors
finish instead of killing them when the victim dies) on fault_rank (a loop on an ep, dp or pp
mesh, cycling over the trials), waits until every rank is set up, sleeps a random moment,
signals a random rank, and then requires of every other rank:
  - it exits by itself with MOE_EXIT_PEER_LOST (75), within the mesh's timeout plus SLACK_S
    of the signal (each rank's exit status is written by a shell around it: the launcher's
    own status ignores the ranks' under --enable-recovery);
  - its log names the victim ("world rank V does not answer"), and no crash.
A stopped victim is continued once the survivors are out (or the wait gave up: a survivor
still inside MPI would then touch memory the resumed peer writes into), then killed. Every
trial has a hard wall-clock limit; mpirun is always reaped (its process group killed at the
limit). Victims and moments come from a seeded generator, so a failing trial can be re-run.

Usage: chaos.py --mpirun MPIRUN --rank PROGRAM --signal kill|stop [--trials N] [--seed S]
                [--timeout-ms MS] [--meshes ep,dp,pp] [--workdir DIR]
Prints one line per trial and a summary; exits 1 when any trial fails.
"""
import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NP = 4
SLACK_S = 3.0        # beyond the timeout: the watch's grace periods, teardown, exit
START_LIMIT_S = 60   # mpirun start and mesh set-up, on a loaded 2-core machine
STOP_AFTER_S = 10    # for mpirun to end once every rank is out


def wait_for(pred, limit_s, step_s=0.02):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def trial(args, n, rng):
    mesh = args.meshes[n % len(args.meshes)]
    victim = rng.randrange(NP)
    delay = rng.uniform(0.2, 1.0)
    d = os.path.join(args.workdir, f"trial{n:02d}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    # the status lands by rename: the file the harness sees is never empty
    wrapper = ('"$0" "$@"; echo $? > "$3/rc.$OMPI_COMM_WORLD_RANK.tmp" && '
               'mv "$3/rc.$OMPI_COMM_WORLD_RANK.tmp" "$3/rc.$OMPI_COMM_WORLD_RANK"')
    cmd = [args.mpirun, "-np", str(NP), "--oversubscribe", "--enable-recovery", "sh", "-c",
           wrapper, args.rank, mesh, str(args.timeout_ms), d]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    out = open(os.path.join(d, "mpirun.out"), "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    problems = []
    exits = {}
    pids = {}
    try:
        def all_ready():
            for r in range(NP):
                text = read(os.path.join(d, f"ready.{r}")).strip()
                if not text.isdigit():
                    return False
                pids[r] = int(text)
            return True
        if not wait_for(all_ready, START_LIMIT_S):
            problems.append("the ranks did not all set up within %d s" % START_LIMIT_S)
            return mesh, victim, delay, None, problems
        time.sleep(delay)
        sig = signal.SIGKILL if args.signal == "kill" else signal.SIGSTOP
        t_sig = time.monotonic()
        os.kill(pids[victim], sig)
        survivors = [r for r in range(NP) if r != victim]
        limit = args.timeout_ms / 1000.0 + SLACK_S

        def survivors_out():
            for r in survivors:
                if r not in exits and os.path.exists(os.path.join(d, f"rc.{r}")):
                    exits[r] = time.monotonic() - t_sig
            return len(exits) == len(survivors)
        wait_for(survivors_out, limit + 2.0)
        if args.signal == "stop":
            os.kill(pids[victim], signal.SIGCONT)
            wait_for(survivors_out, 2.0)  # a survivor still inside MPI meets the resumed peer
            try:
                os.kill(pids[victim], signal.SIGKILL)
            except ProcessLookupError:
                pass
        for r in survivors:
            rc_text = read(os.path.join(d, f"rc.{r}")).strip()
            log = read(os.path.join(d, f"rank.{r}.log"))
            if r not in exits:
                problems.append(f"rank {r} did not exit (log: {log.strip()[-300:]!r})")
                continue
            if rc_text != "75":
                problems.append(f"rank {r} exited with {rc_text} (log: {log.strip()[-300:]!r})")
            if exits[r] > limit:
                problems.append(f"rank {r} exited {exits[r]:.2f} s after the signal (limit "
                                f"{limit:.1f} s)")
            if f"world rank {victim} does not answer" not in log:
                problems.append(f"rank {r}'s message does not name world rank {victim}: "
                                f"{log.strip()[-400:]!r}")
        return mesh, victim, delay, exits, problems
    finally:
        try:
            proc.wait(timeout=STOP_AFTER_S)
        except subprocess.TimeoutExpired:
            problems.append("mpirun did not end once the ranks were out: killed")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--rank", required=True, help="the fault_rank program")
    ap.add_argument("--signal", choices=("kill", "stop"), required=True)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout-ms", type=int, default=2000)
    ap.add_argument("--meshes", default="ep,dp,pp")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    args.meshes = args.meshes.split(",")
    keep = args.workdir is not None
    if not keep:
        args.workdir = tempfile.mkdtemp(prefix="moe-chaos-")
    os.makedirs(args.workdir, exist_ok=True)
    rng = random.Random(args.seed)
    passed, worst, t0 = 0, 0.0, time.monotonic()
    for n in range(args.trials):
        start = time.monotonic()
        mesh, victim, delay, exits, problems = trial(args, n, rng)
        took = time.monotonic() - start
        span = ""
        if exits:
            span = f"; survivors out {min(exits.values()):.2f}-{max(exits.values()):.2f} s later"
            worst = max(worst, max(exits.values()))
        verdict = "ok" if not problems else "FAIL: " + "; ".join(problems)
        print(f"trial {n:2d} {args.signal} {mesh} rank {victim} at {delay:.2f} s{span} "
              f"({took:.1f} s): {verdict}", flush=True)
        passed += not problems
    print(f"chaos: {passed} of {args.trials} trials passed ({args.signal}, meshes "
          f"{','.join(args.meshes)}, timeout {args.timeout_ms} ms, seed {args.seed}); slowest "
          f"survivor exit {worst:.2f} s after the signal; {time.monotonic() - t0:.0f} s in all",
          flush=True)
    if passed == args.trials and not keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    elif passed != args.trials:
        print(f"chaos: trial logs kept in {args.workdir}", flush=True)
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
