#!/usr/bin/env python3
"""Write bench/results/<benchmark>.md from the JSON lines of one run.

Reads the JSON lines that bench_moe, bench/torch_moe.py, bench_dist_layer and ckpt_bench
print (other lines are skipped) and writes one Markdown file per benchmark that has libmoe
measurements in them: router.md, experts.md, layer.md, layer-sustained.md, checkpoint.md,
dist-layer.md, trainer.md (bench/trainer_steps.py beside bench/torch_trainer.py). Each file
says what the benchmark measures, the command, date, GPU, commit and software, and tables
of libmoe's medians beside PyTorch's from the same input (several lines of one measurement,
e.g. two rounds, are all shown; ratios use their median). A new run replaces the files:

    python3 bench/write_results.py --commit 45b4cf8 --out bench/results \\
        bench_libmoe_all.jsonl bench_torch_all.jsonl

Options: --date and --gpu default to the first JSON line's "date" and "gpu" (bench_moe and
torch_moe.py print them; ckpt_bench and bench_dist_layer do not); --software names the stack
(CUDA, driver, MPI...); --only router,layer writes only those files; --command NAME=TEXT and
--note NAME=TEXT replace a file's command line or add a note to it (NAME: the file's name
without .md); scripts/gpu-machine/env.sh's write_results passes the machine's metadata.

Shape legend: N tokens, H hidden, E experts, K top-k, T tokens per expert, F expert width.
"""
import argparse
import decimal
import json
import math
import os
import statistics
import sys
from collections import OrderedDict

BENCHES = ("router", "experts", "layer", "layer-sustained", "checkpoint", "dist-layer",
           "trainer")

# what each file's "command" line says unless --command replaces it
# (the checkpoint's is rebuilt from its summary line)
COMMANDS = {
    "router": "`bench_moe router`, then `python3 bench/torch_moe.py router`",
    "experts": "`bench_moe experts`, then `python3 bench/torch_moe.py experts`",
    "layer": "`bench_moe layer`, then `python3 bench/torch_moe.py layer`",
    "layer-sustained": "`bench_moe layer`, then `python3 bench/torch_moe.py layer`",
    "dist-layer": "`mpirun -np P bench_dist_layer N H F E K iters`",
    "trainer": "`bash scripts/gpu-machine/trainer.sh` (moe_train, then bench/torch_trainer.py)",
}

FLOORS = ("The floor is the time the work takes at the H200's ceilings as bench_moe counts it:\n"
          "bytes that must move / 4.3 TB/s (hbm) or FLOPs / 790 TFLOP/s (tc).")

# ---- formatting ------------------------------------------------------------------------------


def num(v, digits=5):
    """A figure to `digits` significant digits, with no more decimals than the JSON gave
    (numbers are read as Decimal, which keeps them)."""
    if v is None:
        return "—"
    if v == 0:
        return "0"
    given = -v.as_tuple().exponent if isinstance(v, decimal.Decimal) else 0
    decimals = min(given, max(0, digits - 1 - math.floor(math.log10(abs(v)))))
    return f"{v:.{decimals}f}"


def nums(vals):
    return ", ".join(num(v) for v in vals) if vals else "—"


def ratio(a, b):
    """a / b of the medians, as "1.23x"; "—" when either side is missing."""
    if not a or not b:
        return "—"
    r = statistics.median(a) / statistics.median(b)
    return f"{r:.2f}x" if r < 10 else f"{r:.1f}x"


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ---- input -----------------------------------------------------------------------------------


def read_records(paths):
    recs = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    r = json.loads(line, parse_float=decimal.Decimal)
                except ValueError:
                    continue
                if "error" in r:
                    print(f"{path}: {r.get('impl', '?')} {r.get('bench')}: {r['error']}",
                          file=sys.stderr)
                    continue
                recs.append(r)
    return recs


def is_torch(r):
    return str(r.get("impl", "")).startswith("torch")


class Series:
    """Measurements of one input keyed by (side, bench, shape, variant), in input order."""

    def __init__(self, recs):
        self.ms = OrderedDict()
        self.tflops = {}
        self.floor = {}
        self.shapes = OrderedDict()      # bench -> shapes in order
        self.variants = OrderedDict()    # (bench, shape) -> libmoe variants in order
        for r in recs:
            if "ms" not in r or "shape" not in r:
                continue
            side = "torch" if is_torch(r) else "libmoe"
            key = (side, r["bench"], r["shape"], r["variant"])
            self.ms.setdefault(key, []).append(r["ms"])
            if r.get("tflops"):
                self.tflops.setdefault(key, []).append(r["tflops"])
            if "floor_ms" in r:
                self.floor[key[1:]] = (r["floor_ms"], r.get("floor", ""))
            self.shapes.setdefault(r["bench"], OrderedDict())[r["shape"]] = None
            if side == "libmoe":
                self.variants.setdefault(key[1:3], OrderedDict())[r["variant"]] = None

    def get(self, side, bench, shape, variant):
        return self.ms.get((side, bench, shape, variant), [])

    def torch_key(self, bench, shape):
        """The key of PyTorch's figures for (bench, shape), whatever its variant name."""
        return next((k for k in self.ms if k[:3] == ("torch", bench, shape)), None)

    def torch(self, bench, shape):
        return self.ms.get(self.torch_key(bench, shape), [])

    def libmoe_shapes(self, bench):
        return [s for s in self.shapes.get(bench, {}) if (bench, s) in self.variants]

    def variant_list(self, bench):
        """Every libmoe variant of bench over its shapes, in order of appearance."""
        out = OrderedDict()
        for (b, _), vs in self.variants.items():
            if b == bench:
                out.update(vs)
        return list(out)

    def floor_cell(self, bench, shape, variant=None):
        """The floor of (bench, shape) for variant, by default its first (the same for every
        variant but the router backward's two)."""
        variant = variant or list(self.variants[(bench, shape)])[0]
        f = self.floor.get((bench, shape, variant))
        return f"{num(f[0])} {f[1]}" if f else "—"

    def has_torch(self, benches):
        return any(side == "torch" and b in benches for (side, b, _, _) in self.ms)


def ms_tflops(series, key):
    """The milliseconds of one key with its TFLOP/s in brackets."""
    ms = series.ms.get(key)
    if not ms:
        return "—"
    tf = series.tflops.get(key)
    return f"{nums(ms)} ({', '.join(f'{t:.0f}' for t in tf)})" if tf else nums(ms)


# ---- one section per benchmark ---------------------------------------------------------------


def remarks(series, recs, benches):
    """The run's own ceilings where torch_moe.py re-measured them, and whether PyTorch ran;
    each sentence with a leading space, to follow FLOORS."""
    out = ""
    hbm = [r["tbps"] for r in recs if r.get("bench") == "ceiling_hbm" and "tbps" in r]
    gemm = [r["tflops"] for r in recs if r.get("bench") == "ceiling_gemm" and "tflops" in r]
    if hbm or gemm:
        out += (" The ceilings re-measured by torch_moe.py in this run: HBM "
                f"{nums(hbm)} TB/s (2 GiB device copy), bf16 GEMM {nums(gemm)} TFLOP/s (8192^3).")
    if not series.has_torch(benches):
        out += " PyTorch was not measured in this run."
    return out


def router_body(series, recs):
    fwd = series.libmoe_shapes("router_fwd")
    if not fwd:
        return None
    rows = []
    for s in fwd:
        fused = series.get("libmoe", "router_fwd", s, "fused")
        gemm = series.get("libmoe", "router_fwd", s, "gemm+select")
        stream = [nums(series.get("libmoe", "router_fwd_stream", s, v))
                  for v in ("fused", "gemm+select")]
        faster = min((v for v in (fused, gemm) if v), key=statistics.median, default=[])
        torch = series.torch("router_fwd", s)
        rows.append([s, nums(fused), nums(gemm), " / ".join(stream),
                     nums(series.get("libmoe", "router_select_only", s, "select")),
                     series.floor_cell("router_fwd", s), nums(torch), ratio(torch, faster)])
    fwd_table = table(["shape", "fused ms", "GEMM + selection ms",
                       "back to back, fused / GEMM + selection", "selection alone ms",
                       "floor ms", "PyTorch ms", "PyTorch / faster path"], rows)
    rows = []
    for s in series.libmoe_shapes("router_bwd"):
        write = series.get("libmoe", "router_bwd", s, "write dx")
        torch = series.torch("router_bwd", s)
        rows.append([s, nums(write), nums(series.get("libmoe", "router_bwd", s, "add to dx")),
                     series.floor_cell("router_bwd", s, "write dx"), nums(torch),
                     ratio(torch, write)])
    bwd_table = table(["shape", "write dx ms", "add to dx ms", "floor ms (write dx)",
                       "PyTorch ms", "PyTorch / write dx"], rows)
    return f"""\
The router of one MoE layer on the CUDA backend. Forward: the logits GEMM x·Wg, softmax, top-k,
renormalised weights, per-expert counts and the aux-loss and z-loss statistics. Backward:
d logits, dx and dWg with the aux and z terms. PyTorch, eager, in the same run: `x@wg ->
softmax -> topk -> renorm -> bincount / mean / logsumexp / entropy`, its backward autograd of
weights·g + aux + z. x rotates over 3 buffers, so consecutive runs read different inputs.

Two forward paths: the fused kernel (logits GEMM on the tensor cores and the selection in one
launch, E <= 64) and cuBLAS's logits GEMM followed by the selection kernel. Auto picks one by
shape (kernels/tuning.h); `MOE_CUDA_ROUTER=fused|gemm` forces one. Each is the median of 30
(N = 65536) or 200 runs, each between CUDA events, after 5 warm-up runs; "back to back" is the
mean of as many runs between one pair of events (a dependent launch may overlap the previous
run's end); "selection alone" is the selection kernel on given logits. Backward: "write dx" is
the layer's call (the router is dx's first writer), "add to dx" adds into it.
{FLOORS}{remarks(series, recs, ("router_fwd", "router_bwd"))}

## Forward

{fwd_table}

## Backward

{bwd_table}
"""


MODES = ("loop", "streams", "batched", "grouped", "hopper")  # bench_moe's GEMM issue modes


def experts_body(series, recs):
    if not series.libmoe_shapes("experts_fwd"):
        return None
    picks = {r["shape"]: r["picks"] for r in recs if r.get("bench") == "experts_pick"}
    out = []
    for bench, title, torch_head in (
            ("experts_fwd", "Forward", "torch._grouped_mm ms (TFLOP/s)"),
            ("experts_bwd", "Backward", "torch._grouped_mm (fwd+bwd − fwd) ms (TFLOP/s)")):
        variants = series.variant_list(bench)
        rows = []
        for s in series.libmoe_shapes(bench):
            row = [s] + [ms_tflops(series, ("libmoe", bench, s, v)) for v in variants]
            row.append(series.floor_cell(bench, s))
            first = list(series.variants[(bench, s)])[0]
            modes = {v: series.get("libmoe", bench, s, v) for v in series.variants[(bench, s)]
                     if v in MODES}
            best = min((v for v in modes if modes[v]), key=lambda v: statistics.median(modes[v]),
                       default=None)
            pick = picks.get(s)
            against = ratio(modes.get(pick) if pick else series.get("libmoe", bench, s, first),
                            modes.get(best))
            row += [best or "—"] + ([pick] if picks else []) + [against,
                    ms_tflops(series, series.torch_key(bench, s)),
                    ratio(series.torch(bench, s), series.get("libmoe", bench, s, first))]
            rows.append(row)
        head = ["shape"] + [f"{v} ms (TFLOP/s)" for v in variants] + ["floor ms"]
        head += (["fastest mode", "auto takes", "its column / fastest"] if picks else
                 ["fastest mode", f"{variants[0]} / fastest"])
        head += [torch_head,
                 "PyTorch / " + variants[0]]
        out.append(f"## {title}\n\n{table(head, rows)}\n")
    return f"""\
The SwiGLU expert FFN of one GPU's experts on the CUDA backend, rows already grouped by expert:
out = (silu(x·W1g) * (x·W1u))·W2 for E experts of T rows each (TFLOP/s = 6·E·T·H·F / time,
both GEMMs, SwiGLU included in the time); backward: 4 GEMMs and SwiGLU's derivative (twice the
FLOPs). Each GEMM issue mode is a column (auto: the mode the backend picks; loop: one cuBLAS
call per expert; streams: the same on side streams; batched: one strided-batched call, equal
rows only; grouped: one `cublasGemmGroupedBatchedEx` a GEMM kind over the real row counts;
hopper: the grouped sm_90a kernels for the four GEMMs whose M is the expert's rows, the dW GEMMs
on cuBLAS; "auto, SwiGLU GEMMs": auto with the opt-in `MOE_CUDA_SWIGLU_GEMM=1`, on Hopper).
The backward writes the weight gradients (fp32, beta = 0: the layer's backward after the
gradients were discarded, as PyTorch's with them set to None); "auto, dW +=" adds into them
(gradient accumulation). "fastest mode": the fastest of the GEMM issue modes (auto and its
variants aside). Auto runs first in each load, and where it takes the same path as a mode's
column the two figures have differed by up to 15% (the clock under the power cap moves within
a load); so where bench_moe reports the mode auto takes ("auto takes"), that mode's own column
is read against the fastest, else auto's time.
Loads, the same total rows (bench_moe.c's expert_rows; expert e holds popularity rank
e·37 mod E): equal rows; "routed", T + 2.5·sqrt(T)·[-1, 1) rows by rank, about the spread of
random top-k routing; "uneven", [0.25, 1.75)·T rows by rank; "skewed", heavy-tailed as early
training routes: the first three quarters of the ranks share the rows Zipf-like as
1 / (rank + E/16) (the busiest expert 4.3–6.3× the mean), the last quarter near-empty (T/64
rows, the last none); "hot", one expert a quarter of the rows, the others even; "skewed,
fresh counts", skewed with a few rows moved between neighbouring experts before every run (the
per-expert GEMMs' shapes change from run to run, as a training step's routing does; libmoe's
modes alone); "replay Ll",
layer l's per-expert counts from a trainer metrics file (`MOE_BENCH_COUNTS`) scaled to the
total. The trainer's fine-grained model (16384 tokens, top-6 of 64 experts, H = 2048,
F = 1408) is the E=64 T=1536 shape. Median of 20 (forward) or 10 (backward) runs after 3
warm-up runs, CUDA events. PyTorch in the same run on the same row counts: two
`torch._grouped_mm` calls with SwiGLU between them; its backward is autograd's forward +
backward less the forward (median of 10 and of 20).
{FLOORS}{remarks(series, recs, ("experts_fwd",))}

{out[0]}
{out[1]}"""


def layer_body(series, recs):
    if not series.libmoe_shapes("layer_fwd_bwd"):
        return None
    out = []
    for bench, title in (("layer_fwd_bwd", "Forward + backward"), ("layer_fwd", "Forward alone")):
        variants = series.variant_list(bench)
        rows = []
        for s in series.libmoe_shapes(bench):
            first = list(series.variants[(bench, s)])[0]
            torch = series.torch(bench, s)
            rows.append([s] + [nums(series.get("libmoe", bench, s, v)) for v in variants] +
                        [series.floor_cell(bench, s), nums(torch),
                         ratio(torch, series.get("libmoe", bench, s, first))])
        head = (["shape"] + [f"{v} ms" for v in variants] +
                ["floor ms", "PyTorch ms", "PyTorch / " + (variants[0] if variants else "libmoe")])
        out.append(f"## {title}\n\n{table(head, rows)}\n")
    return f"""\
One MoE layer on one GPU (CUDA backend, the public API): router, permute, SwiGLU experts,
combine; "forward + backward" is one training step's share of the layer
(`moe_layer_discard_grad`, forward, backward), "forward alone" the forward and the release of
its saved state. Each expert GEMM issue mode is a column (auto: the mode the backend picks;
hopper: the grouped sm_90a expert kernels, without padding; "auto, SwiGLU GEMMs": auto with the
opt-in `MOE_CUDA_SWIGLU_GEMM=1`, on Hopper). Median of 10 steps after 2 warm-up steps, CUDA
events, random bf16 x and dy; real top-k routing gives the experts uneven row counts. The
"skewed" rows make expert popularity Zipf-like, as early training does: x gets a constant last
feature and the router weights in its row -alpha·tau·ln(1 + e) for expert e (tau the spread of
the other logits), in both implementations alike. PyTorch in the same run: the same math in eager mode (router,
stable argsort permute, `torch._grouped_mm` SwiGLU, `index_add_` combine, autograd for the
backward; `zero_grad(set_to_none=True)` and `x.grad = None` per step). The sustained figure
(after 3 s of steps, at the clock the power cap holds the card to) is in layer-sustained.md.
{FLOORS}{remarks(series, recs, ("layer_fwd_bwd", "layer_fwd"))}

{out[0]}
{out[1]}"""


def layer_sustained_body(series, recs):
    bench = "layer_fwd_bwd_sustained"
    shapes = series.libmoe_shapes(bench)
    if not shapes:
        return None
    rows = []
    for s in shapes:
        variant = list(series.variants[(bench, s)])[0]
        lib = series.get("libmoe", bench, s, variant)
        torch = series.torch(bench, s)
        rows.append([s, f"{nums(lib)} ({variant})", nums(torch), ratio(torch, lib),
                     series.floor_cell(bench, s),
                     nums(series.get("libmoe", "layer_fwd_bwd", s, variant)),
                     nums(series.torch("layer_fwd_bwd", s))])
    tab = table(["shape", "libmoe ms", "PyTorch ms", "PyTorch / libmoe", "floor ms",
                 "usual figure, libmoe ms", "usual figure, PyTorch ms"], rows)
    return f"""\
The layer's forward + backward step (as in layer.md) timed after 3 s of steps: the median of
20 steps once the card's power cap has lowered its clock, the state a training job runs in
(the usual figure's 12 steps end before the clock has settled at the smaller shapes). libmoe
with the backend's default expert GEMM mode, PyTorch eager, in the same run; the usual figure
of the same run beside them.
{FLOORS}{remarks(series, recs, (bench,))}

{tab}
"""


def checkpoint_body(recs, commands):
    # one ckpt_bench run: its ckpt_save lines, then its summary (which repeats the plain copy)
    runs, saves = [], []
    for r in recs:
        if r.get("bench") == "ckpt_save":
            saves.append(r)
        elif r.get("bench") == "ckpt_summary":
            runs.append({"saves": saves, "summary": r})
            saves = []
    if not runs:
        return None
    torch_runs = [r for r in recs if r.get("bench") == "torch_ckpt_summary"]
    parts = []
    for i, run in enumerate(runs):
        s = run["summary"]
        cmd = (f"`ckpt_bench --gib {s['bytes'] / 2**30:g} --runs {s['runs']} "
               f"--tensors {s['tensors']} --chunk-mib {s['chunk_mib']} --qd {s['qd']} "
               f"--block-mib {s['block_mib']} "
               f"--backend {s['backend']} --dir {s['dir']}`")
        if "checkpoint" not in commands:
            commands["checkpoint"] = cmd
        met = {True: "met", False: "not met"}
        summary = table(
            ["stall s (median)", "training step after the save s (median)",
             "same step without a save s", "durable s (median)", "write GB/s",
             "dd GB/s, before / after", "write / better dd", "plain D2H copy GB/s",
             "stall <= 0.01 s", "write >= 0.9 dd"],
            [[num(s["stall_median_s"]), num(s.get("step_median_s")), num(s.get("base_step_s")),
              num(s["durable_median_s"]),
              num(s["write_GBps"]), f"{num(s['dd_before_GBps'])} / {num(s['dd_after_GBps'])}",
              num(s["vs_dd"]), num(s.get("d2h_ref_GBps")),
              met.get(s.get("stall_target_met"), "—"),
              met.get(s.get("write_target_met"), "—")]])
        saves = table(["save", "stall s", "step s", "step - step without a save, s",
                       "durable s", "write GB/s", "O_DIRECT"],
                      [[r["run"], num(r["stall_s"]), num(r.get("step_s")),
                        num(r.get("step_delay_s")), num(r["durable_s"]),
                        num(r["write_GBps"]), "yes" if r.get("direct_io") else "no"]
                       for r in run["saves"]])
        title = f"## Run {i + 1}: {cmd}\n\n" if len(runs) > 1 else ""
        parts.append(
            f"{title}{s['backend']} backend, {s['bytes'] / 2**30:g} GiB in {s['tensors']} bf16 "
            f"tensors, {s['chunk_mib']} MiB chunks, queue depth {s['qd']}, {s['block_mib']} MiB "
            f"I/O blocks, O_DIRECT {'on' if s.get('direct_io') else 'off'}, directory "
            f"`{s['dir']}`.\n\n{summary}\n\n{saves}\n")
    return f"""\
A checkpoint save of a model's state on the runtime's device (the GPU with the CUDA backend):
the caller's stall (the time inside `moe_ckpt_save_async`, which starts the device-to-pinned
copy on a copy stream and returns), the training step that runs right after it (an MoE
layer's forwards and backwards, then AdamW, whose update waits for the copy) against the same
step without a save, and the time until the checkpoint is durable (commit marker fsynced),
against `dd oflag=direct conv=fsync` writing the same bytes into the same directory before
and after the saves, and a plain device-to-pinned copy of the state (what a blocking snapshot
costs). One warm-up save, then the timed saves; medians over them.
""" + torch_note(runs, torch_runs) + "\n" + "\n".join(parts) + torch_table(runs, torch_runs)


def torch_note(runs, torch_runs):
    if not torch_runs:
        return ("PyTorch was not measured in this run; the references are dd and the plain "
                "copy of the same run.\n")
    methods = ", ".join(f"`{t['method']}`" for t in torch_runs)
    return ("PyTorch's saves of the same state into the same directory in the same run "
            f"(`bench/torch_ckpt.py`: {methods}) are in the last table.\n")


def torch_table(runs, torch_runs):
    if not torch_runs:
        return ""
    ours = runs[-1]["summary"]
    rows = [["libmoe `moe_ckpt_save_async`", num(ours["stall_median_s"]),
             num(ours["durable_median_s"]), "1", "1"]]
    for t in torch_runs:
        rows.append([f"{t['impl']} `{t['method']}`", num(t["stall_median_s"]),
                     num(t["durable_median_s"]), ratio([t["stall_median_s"]], [ours["stall_median_s"]]),
                     ratio([t["durable_median_s"]], [ours["durable_median_s"]])])
    gib = torch_runs[0]["bytes"] / 2**30
    return (f"\n## PyTorch, same state ({gib:g} GiB), same directory\n\n" +
            table(["save", "stall s (median)", "durable s (median)", "stall / libmoe's",
                   "durable / libmoe's"], rows) + "\n")


def dist_layer_body(recs):
    groups = OrderedDict()
    for r in recs:
        if r.get("bench") == "dist_layer":
            key = tuple((k, r[k]) for k in ("backend", "comm", "worker_thread", "ranks",
                                            "N", "H", "F", "E", "K") if k in r)
            groups.setdefault(key, []).append(r)
    plain = [r for r in recs if r.get("bench") == "plain_alltoall"]
    if not groups:
        return None
    thread = {-1: "default", 0: "off", 1: "on"}
    parts = []
    for key, rows in groups.items():
        k = dict(key)
        desc = [f"{k['ranks']} ranks", f"N={k['N']} H={k['H']} F={k['F']} E={k['E']} K={k['K']}"]
        if "backend" in k:
            desc.insert(0, f"{k['backend']} backend over {k.get('comm', '?')}")
        if "worker_thread" in k and k.get("backend") != "cuda":  # a host-backend setting
            desc.append(f"worker thread {thread.get(k['worker_thread'], k['worker_thread'])}")
        parts.append(f"### {', '.join(desc)}\n\n" + table(
            ["chunks", "step ms", "blocked ms", "in flight ms", "hidden vs 1 chunk",
             "step speedup vs 1 chunk", "layer all-to-all busbw GB/s"],
            [[r["chunks"], num(r.get("step_ms")), num(r.get("blocked_ms")),
              num(r.get("inflight_ms")), num(r.get("hidden_vs_1chunk")),
              num(r.get("step_speedup_vs_1chunk")),
              num(r.get("layer_a2a_busbw_GBps"))] for r in rows]) + "\n")
    if plain:
        parts.append("### A plain all-to-all of the same bytes\n\n" + table(
            ["backend, comm", "ranks", "N, H, K", "bytes per rank", "moe_comm ms",
             "moe_comm busbw GB/s", "NCCL ms", "NCCL busbw GB/s", "NCCL version"],
            [[f"{r['backend']}, {r['comm']}", r["ranks"], f"{r['N']}, {r['H']}, {r['K']}",
              r["bytes_per_rank"], num(r.get("moe_comm_ms")), num(r.get("moe_comm_busbw_GBps")),
              num(r.get("nccl_ms")), num(r.get("nccl_busbw_GBps")),
              r["nccl_version"] if r.get("nccl_version", -1) >= 0 else "—"]
             for r in plain]) + "\n")
    return """\
The distributed layer's expert-parallel all-to-all: a (1, P, 1, 1) mesh, N tokens per rank,
forward + backward of one layer with the all-to-alls split into 1, 2 or 4 chunks so that
transfers overlap the experts' work. Per chunk count, the median over the iterations of the
max over ranks: the step's wall time, the time blocked in all-to-all waits (exposed
communication), the all-to-alls' summed time in flight, the blocked time hidden against one
chunk (1 - blocked(C) / blocked(1)) and the step's speedup against one chunk, which is the
figure that counts on the CUDA backend (there blocked time also holds GPU compute). Worker
thread: the host backend's thread that computes a chunk's experts while the main thread drives
MPI (`MOE_A2A_THREAD`; default: on when MPI provides MPI_THREAD_FUNNELED). A plain all-to-all
of the layer's mean bytes per rank (libmoe's ep communicator, and with NCCL a plain NCCL
communicator) is the reference where the bench prints one; PyTorch is not measured by this
benchmark.

""" + "\n".join(parts)


def trainer_body(recs):
    steps = [r for r in recs if r.get("bench") == "trainer_step"]
    ours = [r for r in steps if not is_torch(r)]
    if not ours:
        return None
    parts = []

    def loads(r):  # each MoE layer's busiest expert over the mean, median over the steps
        v = r.get("max_over_mean") or []
        return " / ".join(num(x, 3) for x in v) if v else "—"

    for shape in OrderedDict((r["shape"], None) for r in steps):
        torch_runs = [r for r in steps if r["shape"] == shape and is_torch(r)]
        eager = next((r for r in torch_runs if r["variant"] == "eager"), None)
        rows = []
        for r in (r for r in ours if r["shape"] == shape):
            p = r["phases_ms"]
            with_moe = lambda ph: num(p[ph]) + (f" ({num(p['moe_' + ph])})"  # noqa: E731
                                                if "moe_" + ph in p else "")
            opt = num(p["optimizer"]) + (f" ({num(r['optimizer_tbps'], 3)})"
                                         if "optimizer_tbps" in r else "")
            rows.append([f"libmoe, {r['variant']}", num(r["ms"]), num(r["tokens_per_s"]),
                         f"{100 * r['mfu']:.1f}%", with_moe("forward"), with_moe("backward"),
                         num(p["loss"]), opt, loads(r),
                         ratio([r["ms"]], [eager["ms"]]) if eager else "—"])
        for r in torch_runs:
            name = f"{r['impl']} {r['variant']}"
            p = r["phases_ms"]
            fwd = num(p["forward"]) + (f" ({num(p['moe_forward'])})" if "moe_forward" in p else "")
            rows.append([name, num(r["ms"]), num(r["tokens_per_s"]), f"{100 * r['mfu']:.1f}%",
                         fwd + ", with the loss", num(p["backward"]), "—", num(p["optimizer"]),
                         loads(r), ratio([r["ms"]], [eager["ms"]]) if eager else "—"])
        parts.append(f"### {shape}\n\n" + table(
            ["run", "step ms", "tokens/s", "MFU", "forward ms (MoE)", "backward ms (MoE)",
             "loss ms", "optimizer ms (TB/s)", "load max/mean by layer", "step / PyTorch eager's"],
            rows) + "\n")
    return """\
The bundled trainer (examples/trainer/) on the CUDA backend: one training step (a global batch
of B sequences of T bytes: forward, loss, backward, gradient-norm clipping, AdamW with fp32
masters) of the byte-level MoE language model, libmoe's `moe_train --backend cuda` on the
configs of bench/trainer/ (small, fine, coarse) beside the same model in PyTorch in the same
call (bench/torch_trainer.py: SDPA attention, bench/torch_moe.py's MoE layer, bf16 autocast
with fp32 masters, fused AdamW, eager and under torch.compile). Both sides read the trainer's
effective config: the same bytes step for step (the trainer's windows of `docs/` from its
seed), the same AdamW settings, clipping and lr schedule, the same initial distributions (not
the same values: the routers start apart). Medians over the steps after 5 warm-up steps.
Phases: libmoe's are rank 0's, each phase's GPU work waited for at its end, in brackets the MoE
layers' share (docs/trainer.md); PyTorch's between CUDA events, in brackets its MoE layers'
forward. Optimizer: gradient norm, clipping and update; in brackets the bandwidth on the bytes
it must move (34 per parameter: the norm's read of the f32 gradient, AdamW's 16 read and 14
written) against the H200's 4.2 TB/s. Load: each MoE layer's busiest expert's slots over the
mean. MFU = the trainer's model FLOPs / step time / 774 TFLOP/s (the H200's measured bf16 GEMM
rate).

""" + "\n".join(parts)


# ---- files -----------------------------------------------------------------------------------

TITLES = {
    "router": "Router forward and backward",
    "experts": "SwiGLU expert FFN",
    "layer": "MoE layer, one GPU",
    "layer-sustained": "MoE layer, one GPU, under sustained load",
    "checkpoint": "Checkpoint save",
    "dist-layer": "Distributed layer: all-to-all overlap",
    "trainer": "The bundled trainer on the CUDA backend, one GPU",
}


def header(name, meta, recs, commands, notes):
    rows = [["date", meta["date"]], ["GPU", meta["gpu"]], ["commit", meta["commit"]]]
    if meta.get("software"):
        rows.append(["software", meta["software"]])
    torch = next((r["impl"] for r in recs if is_torch(r) and r["impl"] != "torch"), None)
    if torch and name in ("router", "experts", "layer", "layer-sustained", "trainer"):
        rows.append(["PyTorch", torch.replace("torch ", "")])
    rows.append(["command", commands.get(name, COMMANDS.get(name, "—"))])
    text = f"# {TITLES[name]}\n\n{table(['', ''], rows)}\n"
    if notes.get(name):
        text += "\n" + "\n\n".join(notes[name]) + "\n"
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON lines of one run")
    ap.add_argument("--commit", required=True, help="the commit measured")
    ap.add_argument("--date", help="date of the run (default: the first JSON line's)")
    ap.add_argument("--gpu", help="GPU name (default: the first JSON line's)")
    ap.add_argument("--software", default="", help="CUDA, driver, MPI... as one line")
    ap.add_argument("--out", required=True, help="folder the .md files go to")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--command", action="append", default=[], metavar="NAME=TEXT")
    ap.add_argument("--note", action="append", default=[], metavar="NAME=TEXT")
    args = ap.parse_args()

    def pairs(items, what):
        out = {}
        for item in items:
            name, sep, text = item.partition("=")
            if not sep or name not in BENCHES:
                ap.error(f"--{what} {item!r}: want NAME=TEXT, NAME one of {', '.join(BENCHES)}")
            out.setdefault(name, []).append(text)
        return out

    commands = {k: v[-1] for k, v in pairs(args.command, "command").items()}
    notes = pairs(args.note, "note")
    only = [n for n in args.only.split(",") if n]
    for n in only:
        if n not in BENCHES:
            ap.error(f"--only {n}: not one of {', '.join(BENCHES)}")

    recs = read_records(args.files)
    series = Series(recs)
    first = lambda field: next((r[field] for r in recs if field in r), None)
    meta = {"commit": args.commit, "date": args.date or first("date"),
            "gpu": args.gpu or first("gpu"), "software": args.software}
    bodies = {
        "router": lambda: router_body(series, recs),
        "experts": lambda: experts_body(series, recs),
        "layer": lambda: layer_body(series, recs),
        "layer-sustained": lambda: layer_sustained_body(series, recs),
        "checkpoint": lambda: checkpoint_body(recs, commands),
        "dist-layer": lambda: dist_layer_body(recs),
        "trainer": lambda: trainer_body(recs),
    }
    os.makedirs(args.out, exist_ok=True)
    written = 0
    for name in BENCHES:
        if only and name not in only:
            continue
        body = bodies[name]()
        if body is None:
            continue
        for field in ("date", "gpu"):
            if not meta[field]:
                ap.error(f"{name}: the JSON lines have no {field}; pass --{field}")
        path = os.path.join(args.out, name + ".md")
        with open(path, "w") as f:
            f.write(header(name, meta, recs, commands, notes) + "\n" + body.rstrip() + "\n")
        print(path)
        written += 1
    if not written:
        sys.exit("no libmoe measurements of " + (", ".join(only) if only else "any benchmark") +
                 " in " + " ".join(args.files))


if __name__ == "__main__":
    main()
