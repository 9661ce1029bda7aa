#!/usr/bin/env python3
"""One JSON line (the format of bench/torch_trainer.py's) from a moe_train metrics file.

The medians over the steps after the first `--skip` (warm-up: cuBLAS heuristics, allocator
growth) of the step time, tokens/s, MFU and rank 0's phases (forward, backward, loss,
optimizer, pipeline wait, and the MoE layers' share of forward and backward), each MoE
layer's load (the busiest expert's slots over the mean), and with --config (the trainer's
effective config) the optimizer's bandwidth on the bytes it must move: per parameter the
gradient norm reads the f32 gradient (4 bytes), AdamW reads gradient, master and both moments
(16) and writes master, moments and the bf16 value (14), for bench/write_results.py's
trainer.md:

    python3 bench/trainer_steps.py metrics.jsonl --shape "L=4 H=1024 ..." --variant "1 rank" \
        [--config effective.json]
"""
import argparse
import json
import statistics

PHASES = ("forward", "backward", "loss", "optimizer", "pipeline_wait", "moe_forward",
          "moe_backward")

OPTIMIZER_BYTES = 4 + 16 + 14  # per parameter: the norm's read, AdamW's reads and writes


def trainer_params(m):
    """The trainer's trainable parameters (examples/trainer/model.c): per block the norms,
    Wqkv, Wo, the router and the experts' w1 [E,H,2F] and w2 [E,F,H]; the embeddings, the
    final norm and the head."""
    h, e, f = m["hidden"], m["experts"], m["ffn_hidden"]
    block = 2 * h + 4 * h * h + h * e + 3 * h * f * e
    return m["layers"] * block + 256 * h + m["context"] * h + h + h * 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("--shape", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--commit", default="")
    ap.add_argument("--config", help="the effective config (moe_train --print-config)")
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
                         for p in PHASES if p in timed[0]["phases_rank0_s"]},
           "max_over_mean": [round(statistics.median(s["layers"][i]["max_over_mean"] for s in timed), 2)
                             for i in range(len(timed[0].get("layers", [])))]}
    if a.config:
        with open(a.config) as f:
            params = trainer_params(json.load(f)["model"])
        rec["optimizer_params"] = params
        rec["optimizer_tbps"] = round(OPTIMIZER_BYTES * params / rec["phases_ms"]["optimizer"] * 1e-9, 3)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
