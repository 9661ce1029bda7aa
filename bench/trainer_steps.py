#!/usr/bin/env python3
"""One JSON line (the format of bench/torch_trainer.py's) from a moe_train metrics file.

The medians over the steps after the first `--skip` (warm-up: cuBLAS heuristics, allocator
growth) of the step time, tokens/s, MFU and rank 0's phases (forward, backward, loss,
optimizer, pipeline wait, and the MoE layers' share of forward and backward), for bench/write_results.py's trainer.md:

    python3 bench/trainer_steps.py metrics.jsonl --shape "L=4 H=1024 ..." --variant "1 rank"
"""
import argparse
import json
import statistics

PHASES = ("forward", "backward", "loss", "optimizer", "pipeline_wait", "moe_forward",
          "moe_backward")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("--shape", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--commit", default="")
    a = ap.parse_args()
    with open(a.metrics) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    timed = steps[a.skip:]
    if not timed:
        raise SystemExit(f"{a.metrics}: {len(steps)} steps, none after the {a.skip} skipped")
    med = lambda key: statistics.median(s[key] for s in timed)  # noqa: E731
    rec = {"impl": "libmoe", "bench": "trainer_step", "shape": a.shape, "variant": a.variant,
           "ms": round(1e3 * med("step_s"), 3), "tokens_per_s": round(med("tokens_per_s"), 1),
           "mfu": round(med("mfu"), 4), "steps": len(timed), "loss": round(timed[-1]["loss"], 4),
           "phases_ms": {p: round(1e3 * statistics.median(s["phases_rank0_s"][p] for s in timed), 3)
                         for p in PHASES if p in timed[0]["phases_rank0_s"]}}
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
