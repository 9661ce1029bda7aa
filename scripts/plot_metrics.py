#!/usr/bin/python3
"""Plot a moe_train metrics file (JSON lines, one object per step) as one PNG.

  scripts/plot_metrics.py METRICS.jsonl [OUT.png]

Top panel: training loss and validation loss in bits per byte against steps, with the
unigram baseline the run has to beat. Below it, one heatmap per MoE layer: the share of the
layer's routed slots each expert took at each step (a balanced router is a flat 1/E band).
Needs matplotlib: Debian's python3-matplotlib, which scripts/setup-deps.sh installs for the
system's /usr/bin/python3 (hence that interpreter above: a python3 earlier on PATH, such as
pyenv's, does not see Debian's packages).
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) == 3 else path.rsplit(".", 1)[0] + ".png"
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        sys.exit(f"{path}: no metrics")
    steps = [r["step"] for r in rows]
    layers = len(rows[0]["layers"])
    fig, axes = plt.subplots(1 + layers, 1, figsize=(9, 3 + 1.6 * layers), squeeze=False,
                             gridspec_kw={"height_ratios": [2.2] + [1] * layers})
    ax = axes[0][0]
    ax.plot(steps, [r["train_bpb"] for r in rows], lw=0.8, label="train")
    val = [(r["step"], r["val_bpb"]) for r in rows if r.get("val_bpb") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.axhline(rows[0]["unigram_bpb"], color="gray", ls="--", lw=0.8, label="unigram baseline")
    ax.set_ylabel("bits per byte")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    for l in range(layers):
        ax = axes[1 + l][0]
        share = []
        for r in rows:
            counts = r["layers"][l]["tokens_per_expert"]
            total = sum(counts) or 1
            share.append([c / total for c in counts])
        experts = len(share[0])
        grid = [[share[s][e] for s in range(len(rows))] for e in range(experts)]
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=0,
                       vmax=max(2.0 / experts, max(max(g) for g in grid)),
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, experts - 0.5))
        ax.set_ylabel(f"layer {l}\nexpert")
        fig.colorbar(im, ax=ax, label="load share")
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    last = rows[-1]
    bpb = last.get("val_bpb") or last["train_bpb"]
    print(f"{out}: {len(rows)} steps, last {bpb:.3f} bpb "
          f"({100 * bpb / last['unigram_bpb']:.1f}% of the unigram baseline)")
    return 0 if math.isfinite(bpb) else 1


if __name__ == "__main__":
    sys.exit(main())
