#!/usr/bin/env python3
"""The bundled trainer under mpirun (host backend), as CTest runs it.

  run_trainer.py MODE --mpirun MPIEXEC --trainer moe_train --compare compare_checkpoints
                 --config tiny.json --work DIR [--example-config FILE --steps N]

MODE:
  equivalence  the same config and seed on meshes of 1, 2, 4, 8 and 16 ranks (ep, dp, pp,
               tp, interleaved pp, and tp=2,ep=2,dp=2,pp=2 using all four axes) give the
               losses of the 1-rank run for 3 steps and its parameters and optimizer state
               after them (compare_checkpoints), within 1e-5 relative.
  resume       6 steps straight vs 3 steps, checkpoint, --resume to 6 on the same mesh
               (ep=2): losses of steps 4..6 and the final state bitwise equal; the step-3
               checkpoint resumed on another mesh (dp=2, pp=2): the first loss within 1e-5 of
               the uninterrupted run's step 4; every metrics row has checkpoint_stall, above
               zero on the steps that save. A resume that replays steps leaves each step
               once in the metrics file; --resume on a finished run says so; --ckpt-dir
               without --ckpt-every saves after the last step and prints it; a fresh run over
               old checkpoints stops; an unreachable S3 mirror ends the run with exit 0 and
               one warning.
  flags        bad flags, values, keys, meshes, config files and data fail naming them (exit
               2); --help exits 0; --print-config prints JSON that reads back to the same
               config, and prints a mesh other than the world's.
  train        the example config (--example-config) for --steps steps on 4 ranks
               (pp=2, ep=2): the final validation bits per byte <= 80% of the unigram baseline;
               then scripts/plot_metrics.py draws the metrics when matplotlib is present.
  widths       the default config with only the sizes set, at H = 64, 256 and 1024 (1 rank,
               25 steps, the default warm-up): the first loss within 10% of ln 256 (the
               initialisation predicts near-uniform bytes at every width) and the mean of the
               last 5 losses below 75% of it.
  plan         the memory plan (--plan) against the run's peak resident memory on rank 0,
               within 15%, on 1 rank and on 4 (ep=2, pp=2); a model that cannot fit is refused
               before training (exit 2) naming its largest term and the knob that shrinks it.
"""
import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["equivalence", "resume", "flags", "train", "widths", "plan"])
p.add_argument("--mpirun", required=True)
p.add_argument("--trainer", required=True)
p.add_argument("--compare", required=True)
p.add_argument("--config", required=True)
p.add_argument("--work", required=True)
p.add_argument("--example-config")
p.add_argument("--steps", type=int, default=0)
a = p.parse_args()
failures = []


def mpirun(np, args, expect=0, capture=True, env=None):
    cmd = [a.mpirun, "-np", str(np), "--oversubscribe", a.trainer] + args
    r = subprocess.run(cmd, capture_output=capture, text=True, timeout=600, env=env)
    if expect is not None and r.returncode != expect:
        print(r.stdout, r.stderr)
        raise SystemExit(f"FAIL: {' '.join(cmd)} exited {r.returncode}, expected {expect}")
    return r


def run(name, np, mesh, extra=()):
    """Train with the test config; returns (metrics rows, checkpoint dir)."""
    d = os.path.join(a.work, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    metrics = os.path.join(d, "metrics.jsonl")
    mpirun(np, ["--config", a.config, "--mesh", mesh, "--ckpt-dir", os.path.join(d, "ckpt"),
                "--ckpt-every", "3", "--metrics", metrics] + list(extra))
    return [json.loads(l) for l in open(metrics)], os.path.join(d, "ckpt")


def compare(dir_a, dir_b, tol):
    cmd = [a.mpirun, "-np", "1", a.compare, dir_a, dir_b, repr(tol), "--config", a.config]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print("   ", r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr)
    if r.returncode != 0:
        failures.append(f"compare {dir_a} {dir_b}: {r.stdout}{r.stderr}")


def rel(x, ref):
    return abs(x - ref) / abs(ref)


def check_losses(name, rows, ref_rows, steps, tol):
    for r, q in zip(rows[:steps], ref_rows[:steps]):
        e = rel(r["loss"], q["loss"])
        ok = e == 0 if tol == 0 else e <= tol
        print(f"  {name} step {r['step']}: loss {r['loss']:.10f} vs {q['loss']:.10f} "
              f"(rel {e:.2e}) {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"{name}: step {r['step']} loss {r['loss']!r} vs {q['loss']!r}")


if a.mode == "equivalence":
    ref, ref_ck = run("mesh-1", 1, "tp=1,ep=1,dp=1,pp=1")
    meshes = [("ep2", 2, "ep=2", []), ("dp2", 2, "dp=2", []), ("pp2", 2, "pp=2", []),
              ("tp2", 2, "tp=2", []),
              ("pp2-interleaved", 2, "pp=2", ["--train.virtual_stages", "2"]),
              ("tp2-ep2-pp2", 8, "tp=2,ep=2,pp=2", []),
              ("tp2-ep2-dp2-pp2", 16, "tp=2,ep=2,dp=2,pp=2", [])]
    for name, np, mesh, extra in meshes:
        rows, ck = run(name, np, mesh, extra)
        check_losses(name, rows, ref, 3, 1e-5)
        compare(ck, ref_ck, 1e-5)

elif a.mode == "resume":
    straight, straight_ck = run("straight", 2, "ep=2", ["--steps", "6"])
    first, first_ck = run("first", 2, "ep=2", ["--steps", "3"])
    moved = os.path.join(a.work, "moved-ckpt")
    shutil.rmtree(moved, ignore_errors=True)
    shutil.copytree(first_ck, moved)
    replay_ck = os.path.join(a.work, "replay-ckpt")
    shutil.rmtree(replay_ck, ignore_errors=True)
    shutil.copytree(first_ck, replay_ck)
    metrics = os.path.join(a.work, "first", "metrics.jsonl")
    mpirun(2, ["--config", a.config, "--mesh", "ep=2", "--ckpt-dir", first_ck,
               "--ckpt-every", "3", "--metrics", metrics, "--steps", "6", "--resume"])
    resumed = [json.loads(l) for l in open(metrics)]
    check_losses("same mesh", resumed[3:], straight[3:], 3, 0)
    # every row reports the checkpoint stall; the rows of a save (steps 3 and 6) time the save
    for r in resumed:
        stall = r.get("phases_rank0_s", {}).get("checkpoint_stall")
        if stall is None or stall < 0 or (r["step"] % 3 == 0 and not stall > 0):
            failures.append(f"step {r['step']}: checkpoint_stall {stall!r}")
    compare(first_ck, straight_ck, 0)
    other = os.path.join(a.work, "other-mesh.jsonl")
    if os.path.exists(other):  # a resumed run appends: a previous run's rows would be read
        os.remove(other)
    mpirun(4, ["--config", a.config, "--mesh", "dp=2,pp=2", "--ckpt-dir", moved, "--metrics",
               other, "--steps", "4", "--resume"])
    rows = [json.loads(l) for l in open(other)]
    check_losses("ep=2 -> dp=2,pp=2", rows, straight[3:], 1, 1e-5)
    # a resume from step 3 with the metrics of all 6 steps (a run that stopped after step 6
    # but whose newest checkpoint is step 3): steps 4..6 are replayed and appear once
    replay = os.path.join(a.work, "replay.jsonl")
    shutil.copy(os.path.join(a.work, "straight", "metrics.jsonl"), replay)
    mpirun(2, ["--config", a.config, "--mesh", "ep=2", "--ckpt-dir", replay_ck, "--metrics",
               replay, "--steps", "6", "--resume"])
    rows = [json.loads(l) for l in open(replay)]
    if [r["step"] for r in rows] != list(range(1, 7)):
        failures.append(f"metrics after a replaying resume hold steps {[r['step'] for r in rows]}")
    else:
        check_losses("replayed", rows[3:], straight[3:], 3, 0)
    # a finished run says so
    r = mpirun(2, ["--config", a.config, "--mesh", "ep=2", "--ckpt-dir", first_ck,
                   "--steps", "6", "--resume"])
    if "the run is complete" not in r.stdout:
        failures.append(f"--resume on a finished run did not say so: {r.stdout!r}")
    # --ckpt-dir without --ckpt-every: one save, after the last step, and it is printed
    last_only = os.path.join(a.work, "last-only")
    shutil.rmtree(last_only, ignore_errors=True)
    r = mpirun(2, ["--config", a.config, "--mesh", "ep=2", "--ckpt-dir", last_only,
                   "--steps", "2"])
    saved = sorted(os.listdir(last_only)) if os.path.isdir(last_only) else []
    if not saved or not saved[-1].endswith("2") or "checkpoint: step 2 saved" not in r.stdout:
        failures.append(f"--ckpt-dir alone: {saved}, {r.stdout!r}")
    # a fresh run over a directory that holds checkpoints stops before training, naming it
    r = mpirun(2, ["--config", a.config, "--mesh", "ep=2", "--ckpt-dir", last_only,
                   "--steps", "2"], expect=2)
    if "pass --resume" not in r.stderr:
        failures.append(f"a fresh run over old checkpoints: {r.stderr!r}")
    # an unreachable S3 mirror: the run ends with exit 0 and one warning from the trainer
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    env = dict(os.environ, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
               MOE_CKPT_S3_MAX_RETRIES="1", MOE_CKPT_S3_RETRY_BASE_MS="50",
               MOE_CKPT_S3_RETRY_MAX_MS="200")
    no_s3 = os.path.join(a.work, "no-s3")
    shutil.rmtree(no_s3, ignore_errors=True)
    r = mpirun(2, ["--config", a.config, "--mesh", "ep=2", "--ckpt-dir", no_s3, "--steps", "2",
                   "--ckpt.s3_endpoint", f"http://127.0.0.1:{port}", "--ckpt.s3_bucket", "b"],
               env=env)
    if r.stderr.count("moe_train: warning: the S3 mirror failed") != 1 or "done:" not in r.stdout:
        failures.append(f"unreachable S3: {r.stdout!r} {r.stderr[-2000:]!r}")
    print("  metrics once per step, finished resume, save after the last step, old "
          "checkpoints without --resume, an unreachable S3 mirror checked")

elif a.mode == "flags":
    bad_key = os.path.join(a.work, "bad-key.json")
    os.makedirs(a.work, exist_ok=True)
    json.dump({"model": {"hiden": 8}}, open(bad_key, "w"))
    truncated, empty, small = (os.path.join(a.work, n) for n in ("truncated.json", "empty.json",
                                                                  "small.txt"))
    open(truncated, "w").write('{"model": {"layers": 2,\n "hidden": ')
    open(empty, "w").close()
    open(small, "w").write("x" * 10000)
    cases = [(["--backend", "gpu"], "train.backend"), (["--seed", "foo"], "--seed"),
             (["--steps", "3x"], "--steps"), (["--model.heads", "3"], "model.heads"),
             (["--frobnicate"], "--frobnicate"), (["--mesh", "ep=2"], "mpirun started 1"),
             (["--mesh", "xp=2"], "xp"), (["--config", bad_key], "model.hiden"),
             (["--mesh", "ep=2,pp=2,ep=1"], "ep given twice"),
             (["--data", "a", "--data", "b"], "--data: given twice"),
             (["--config", truncated], "line 2, column"), (["--config", empty], "empty file"),
             (["--data", small], "500 validation bytes")]
    for args, named in cases:
        r = mpirun(1, ["--config", a.config] + args, expect=2)
        ok = named in r.stderr
        print(f"  {' '.join(args)}: exit 2, {r.stderr.strip().splitlines()[0]!r} "
              f"{'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"{args}: message does not name {named!r}: {r.stderr!r}")
    r = mpirun(1, ["--help"])
    if "usage:" not in r.stdout:
        failures.append("--help printed no usage")
    printed = mpirun(1, ["--config", a.config, "--print-config", "--model.hidden", "24"]).stdout
    again_path = os.path.join(a.work, "printed.json")
    open(again_path, "w").write(printed)
    again = mpirun(1, ["--config", again_path, "--print-config"]).stdout
    if json.loads(printed) != json.loads(again) or json.loads(printed)["model"]["hidden"] != 24:
        failures.append("--print-config does not read back to the same config")
    # the effective config of a mesh other than this world's (its shape is still checked)
    r = mpirun(1, ["--config", a.config, "--mesh", "ep=2,pp=2", "--print-config"])
    if json.loads(r.stdout)["mesh"]["pp"] != 2 or json.loads(r.stdout)["mesh"]["tp"] != 1:
        failures.append(f"--print-config --mesh ep=2,pp=2: {r.stdout!r}")
    mpirun(1, ["--config", a.config, "--mesh", "ep=3", "--print-config"], expect=2)
    print("  --help, --print-config round trip checked")

elif a.mode == "train":
    d = os.path.join(a.work, "train")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    metrics = os.path.join(d, "metrics.jsonl")
    mpirun(4, ["--config", a.example_config, "--steps", str(a.steps), "--metrics", metrics],
           capture=False)
    last = [json.loads(l) for l in open(metrics)][-1]
    ratio = last["val_bpb"] / last["unigram_bpb"]
    print(f"  validation {last['val_bpb']:.4f} bpb = {100 * ratio:.1f}% of the unigram "
          f"baseline {last['unigram_bpb']:.4f}")
    if not ratio <= 0.8:
        failures.append(f"validation bpb {last['val_bpb']:.4f} is above 80% of the unigram "
                        f"baseline {last['unigram_bpb']:.4f}")
    # the plot is optional: only where this Python has matplotlib
    import importlib.util
    if importlib.util.find_spec("matplotlib"):
        plot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                            "plot_metrics.py")
        r = subprocess.run([sys.executable, plot, metrics, os.path.join(d, "metrics.png")],
                           capture_output=True, text=True, timeout=300)
        print("  plot:", (r.stdout + r.stderr).strip())
        if r.returncode != 0:
            failures.append("plot_metrics.py failed")
    else:
        print("  plot: skipped (no matplotlib in this Python)")

elif a.mode == "widths":
    for h in (64, 256, 1024):
        d = os.path.join(a.work, f"h{h}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        metrics = os.path.join(d, "metrics.jsonl")
        mpirun(1, ["--model.hidden", str(h), "--model.context", "16", "--model.ffn_hidden",
                   "64", "--batch", "2", "--train.microbatches", "1", "--steps", "25",
                   "--eval-every", "0", "--data.eval_batches", "1", "--metrics", metrics])
        loss = [json.loads(l)["loss"] for l in open(metrics)]
        first, last = loss[0], sum(loss[-5:]) / 5
        ok = abs(first / math.log(256) - 1) <= 0.1 and last < 0.75 * first
        print(f"  H={h}: loss {first:.3f} at step 1 (ln 256 = {math.log(256):.3f}), "
              f"{last:.3f} over steps 21-25 {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"H={h}: losses {loss}")

elif a.mode == "plan":
    # 32 experts of 256 x 256, top-1: the state (parameters, gradients, AdamW) dominates
    model = ["--model.hidden", "256", "--model.experts", "32", "--model.top_k", "1",
             "--model.ffn_hidden", "256", "--model.context", "16", "--train.microbatches", "2",
             "--batch", "8", "--steps", "3", "--optim.warmup_steps", "0", "--eval-every", "0",
             "--data.eval_batches", "1"]
    for np_, mesh in ((1, "ep=1"), (4, "ep=2,pp=2")):
        args = model + ["--mesh", mesh]
        printed = mpirun(np_, args + ["--plan"]).stdout
        total = next(float(l.split()[1]) for l in printed.splitlines()
                     if l.strip().startswith("total"))
        metrics = os.path.join(a.work, f"plan-{np_}.jsonl")
        os.makedirs(a.work, exist_ok=True)
        mpirun(np_, args + ["--metrics", metrics])
        peak = max(json.loads(l)["max_rss_mb_rank0"] for l in open(metrics))
        ok = abs(total / peak - 1) <= 0.15
        print(f"  {np_} rank(s), {mesh}: plan {total:.1f} MiB, peak RSS {peak:.1f} MiB "
              f"({100 * (total / peak - 1):+.1f}%) {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"{mesh}: plan {total} MiB vs peak {peak} MiB:\n{printed}")
    r = mpirun(1, ["--model.experts", "8192", "--model.hidden", "1024", "--model.ffn_hidden",
                   "4096"], expect=2)
    ok = "largest term is optimizer" in r.stderr and "mesh.ep" in r.stderr
    print(f"  8192 experts of 1024 x 4096: exit 2, {'named' if ok else 'FAIL'}")
    if not ok:
        failures.append(f"the refusal does not name the term and knob: {r.stderr!r}")

for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
