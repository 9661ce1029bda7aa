"""What the elastic trials read back: the JSON-lines files the launcher and the trainer write
(events, metrics), and the losses of an uninterrupted run that a trial's losses are compared
with. Shared by the trial scripts of tests/elastic."""
import json
import os
import shutil
import subprocess
import sys


def rows(path):
    """The objects of a JSON-lines file, one a line; [] while it does not exist."""
    try:
        return [json.loads(l) for l in open(path) if l.strip()]
    except OSError:
        return []


def uninterrupted_losses(cmd, d, env, timeout_s):
    """Runs cmd (mpirun and the trainer, its metrics going to d/metrics.jsonl) in a fresh
    folder d and returns its loss by step; ends the test when the run fails."""
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if r.returncode != 0:
        sys.exit(f"FAIL: the uninterrupted run exited {r.returncode}: {r.stderr[-2000:]}")
    return {row["step"]: row["loss"] for row in rows(os.path.join(d, "metrics.jsonl"))}
