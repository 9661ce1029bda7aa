"""What the Python wrapper costs on the GPU: one training step of the MoE layer (gradients
discarded, forward, backward with dx) through libmoe.Layer (ctypes, torch tensors in and out)
and through libmoe.torch.MoELayer (autograd; libmoe's gradients, then PyTorch's, which adds
their bf16 conversion), beside the same step from C (step_bench, and bench_moe's layer figure)
and PyTorch's eager layer of bench/torch_moe.py, in the same call.

Timing, as step_bench.c: ms is the median of 10 back-to-back steps between CUDA events on the
stream (recorded without waiting in between, as a training loop issues its steps), after
warm-up steps (at least 2 and at least WARM_S seconds of them); wall_ms the host time of 20
back-to-back steps over 20, the stream synchronised at both ends (where the per-call host cost
shows). Inputs are step_bench's own draws (splitmix64 + Box-Muller, seeds 1 and 2), and both
layers start from the runtime's default seed, so both sides route the same tokens to the same
experts: max_load (the layer's busiest expert in the last step) shows it. Each shape runs on a
stream of its own (non-blocking, as step_bench's), not on PyTorch's legacy default stream.

With --quick: issue 42's three shapes only, without PyTorch's eager layer, and for each
wrapper the host time of a step split into the C calls (libmoe's own entry points, timed around
each call) and the Python around them ("ffi_host_split" lines), and torch.profiler's table of
MoELayer's step (host time per operator and Python function) on stderr, which device_check.sh
keeps in ffi.log.

Usage: torch_bench.py [--quick] OUT_MD C_JSONL...  (device_check.sh passes step_bench's and
bench_moe's JSON lines). Prints JSON lines and writes OUT_MD, the results file for
bench/results/ffi.md.
Shapes: N tokens, H hidden, F expert FFN width, E experts, K top-k.
"""
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import numpy
import torch

import libmoe
from libmoe.torch import MoELayer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch_moe  # noqa: E402  (bench/torch_moe.py: PyTorch's layer and its timing)

LAYER_SHAPES = [(16384, 4096, 1408, 64, 2), (16384, 2048, 8192, 8, 2),
                (32768, 4096, 14336, 8, 2)]  # bench_moe's layer shapes
SMALL_SHAPES = [(512, 256, 512, 16, 2), (2048, 1024, 1408, 64, 2)]
SHAPES = SMALL_SHAPES + LAYER_SHAPES
QUICK_SHAPES = SMALL_SHAPES + LAYER_SHAPES[:1]
WARM, WARM_S, ITERS, WALL = 2, 0.5, 10, 20
GPU = torch.cuda.get_device_name(0)
TODAY = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def shape_name(n, h, f, e, k):
    return f"N={n} H={h} F={f} E={e} K={k}"


def emit(impl, shape, variant, ms, wall_ms, bench="ffi_layer_step", **extra):
    rec = {"impl": impl, "bench": bench, "shape": shape, "variant": variant,
           "ms": round(ms, 4), "wall_ms": round(wall_ms, 4), "gpu": GPU, "date": TODAY, **extra}
    print(json.dumps(rec), flush=True)
    return rec


def timed(step):
    """(median event ms, wall ms per step) of step() on the current stream."""
    start, done = time.perf_counter(), 0
    while done < WARM or time.perf_counter() - start < WARM_S:  # an idle GPU starts slow
        step()
        torch.cuda.synchronize()
        done += 1
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(ITERS)]
    for s, e in events:
        s.record()
        step()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    t0 = time.perf_counter()
    for _ in range(WALL):
        step()
    torch.cuda.synchronize()
    return statistics.median(times), (time.perf_counter() - t0) * 1e3 / WALL


def step_bench_normal(rows, cols, seed):
    """step_bench.c's fill(): element i is Box-Muller of the splitmix64 draws 2i and 2i + 1 of
    `seed`, as float32, then rounded to bf16 on the GPU."""
    n = rows * cols
    golden = numpy.uint64(0x9E3779B97F4A7C15)

    def uniform(draw):  # draw: the 0-based index of each draw in the sequence
        z = numpy.uint64(seed) + (draw + numpy.uint64(1)) * golden
        z = (z ^ (z >> numpy.uint64(30))) * numpy.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> numpy.uint64(27))) * numpy.uint64(0x94D049BB133111EB)
        bits = (z ^ (z >> numpy.uint64(31))) >> numpy.uint64(11)
        return (bits.astype(numpy.float64) + 0.5) * 2.0 ** -53

    draws = numpy.arange(n, dtype=numpy.uint64) * numpy.uint64(2)
    u1 = uniform(draws)
    u2 = uniform(draws + numpy.uint64(1))
    values = numpy.sqrt(-2.0 * numpy.log(u1)) * numpy.cos(6.283185307179586 * u2)
    host = torch.from_numpy(values.astype(numpy.float32).reshape(rows, cols))
    return host.to(device="cuda").to(torch.bfloat16)


def host_split(name, variant, layer, step, steps=200):
    """Host µs per step inside libmoe's entry points and outside them (the wrapper), over
    steps back-to-back steps after the stream drained."""
    inside = [0.0]
    originals = (layer._forward, layer._backward)
    lib = layer._lib

    def timed_call(fn):
        def call(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inside[0] += time.perf_counter() - t
        return call

    layer._forward, layer._backward = (timed_call(f) for f in originals)
    discard = lib.moe_layer_discard_grad
    lib.moe_layer_discard_grad = timed_call(discard)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        layer._forward, layer._backward = originals
        lib.moe_layer_discard_grad = discard
    rec = {"bench": "ffi_host_split", "shape": name, "variant": variant,
           "host_us_per_step": round(1e6 * total / steps, 1),
           "c_calls_us": round(1e6 * inside[0] / steps, 1),
           "python_us": round(1e6 * (total - inside[0]) / steps, 1)}
    print(json.dumps(rec), flush=True)


def profile_table(name, step, steps=50):
    """torch.profiler's host-side view of steps back-to-back steps, to stderr."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"== torch.profiler, MoELayer step, {name}, {steps} steps", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
          file=sys.stderr, flush=True)


def bench_shape(n, h, f, e, k, quick=False):
    name = shape_name(n, h, f, e, k)
    recs = []
    m = MoELayer(h, f, e, k, grads="libmoe")
    layer = m.layer
    x, dy = step_bench_normal(n, h, 1), step_bench_normal(n, h, 2)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    m.runtime.set_stream(torch.cuda.current_stream())

    def ctypes_step():
        layer.discard_grad()
        layer.forward(x, y)
        layer.backward(dy, dx)

    recs.append(emit("libmoe python", name, "libmoe.Layer (ctypes)", *timed(ctypes_step),
                     max_load=layer.stats().max_load))
    xg = x.clone().requires_grad_(True)

    def module_step():
        m.zero_grad(set_to_none=True)
        xg.grad = None
        m(xg).backward(dy)

    recs.append(emit("libmoe python", name, "MoELayer, libmoe grads", *timed(module_step)))
    if quick:
        host_split(name, "libmoe.Layer (ctypes)", layer, ctypes_step)
        host_split(name, "MoELayer, libmoe grads", layer, module_step)
        profile_table(name, module_step)
    m.grads = "torch"  # the same layer, gradients handed to autograd as bf16
    recs.append(emit("libmoe python", name, "MoELayer, torch grads", *timed(module_step)))
    m.zero_grad(set_to_none=True)
    m.runtime.close()  # frees the layer's GPU memory now, not when the collector finds it
    del m, layer, xg, y, dx
    torch.cuda.empty_cache()
    if quick:
        del x, dy
        return recs

    tm = torch_moe.TorchMoE(h, f, e, k)
    xt = x.clone().requires_grad_(True)

    def torch_step():
        tm.zero_grad(set_to_none=True)
        xt.grad = None
        out, loss = tm(xt)
        torch.autograd.backward([out, loss], [dy, torch.ones_like(loss)])

    recs.append(emit("torch " + torch.__version__, name, "eager (bench/torch_moe.py)",
                     *timed(torch_step)))
    del tm, xt, x, dy
    torch.cuda.empty_cache()
    return recs


def read_c(paths):
    """step_bench's lines by shape, and bench_moe's layer_fwd_bwd (variant auto) by shape."""
    c_api, bench_moe = {}, {}
    for path in paths:
        with open(path) as fh:
            for line in fh:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("impl") == "libmoe C":
                    c_api[r["shape"]] = r
                elif r.get("impl") == "libmoe" and r.get("bench") == "layer_fwd_bwd" \
                        and r.get("variant") == "auto":
                    bench_moe[r["shape"]] = r
    return c_api, bench_moe


def commit():
    if os.environ.get("MOE_COMMIT"):
        return os.environ["MOE_COMMIT"]
    try:
        return subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty",
                               "--abbrev=7"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarise(recs, c_api, bench_moe, out_md):
    rows = []
    for shape in (shape_name(*s) for s in SHAPES):
        c = c_api.get(shape)
        mine = {r["variant"]: r for r in recs if r["shape"] == shape}
        py = mine.get("libmoe.Layer (ctypes)")
        mod = mine.get("MoELayer, libmoe grads")
        tgrad = mine.get("MoELayer, torch grads")
        eager = mine.get("eager (bench/torch_moe.py)")
        bm = bench_moe.get(shape)
        if not (c and py and mod):
            continue
        over = {"bench": "ffi_overhead", "shape": shape,
                "ctypes_pct": round(100 * (py["ms"] / c["ms"] - 1), 2),
                "module_pct": round(100 * (mod["ms"] / c["ms"] - 1), 2),
                "ctypes_us_per_step": round(1e3 * (py["wall_ms"] - c["wall_ms"]), 1),
                "module_us_per_step": round(1e3 * (mod["wall_ms"] - c["wall_ms"]), 1)}
        print(json.dumps(over), flush=True)
        rows.append((shape, c, py, mod, tgrad, bm, eager, over))

    def f(v, digits=3):
        return "—" if v is None else f"{v:.{digits}f}"

    lines = [
        "# Python wrapper overhead (libmoe.Layer, libmoe.torch.MoELayer)", "",
        "One training step of the MoE layer on one GPU: gradients discarded, forward, backward "
        "with dx, random bf16 inputs. The C API (`bench/python/step_bench.c`) and the Python "
        "wrapper run the same calls on the same shapes, timed the same way; bench_moe's layer "
        "step (`layer.md`, expert GEMM mode auto) and PyTorch's eager layer "
        "(`bench/torch_moe.py`) are from the same call.", "",
        f"- command: `bash tests/python/device_check.sh` (build, `step_bench`, "
        f"`MOE_CUDA_EXPERT_GEMM=auto bench_moe layer`, `bench/python/torch_bench.py`)",
        f"- date: {TODAY[:10]}; GPU: {GPU}; commit: {commit()}",
        f"- software: PyTorch {torch.__version__}, CUDA {torch.version.cuda}, libmoe "
        f"{libmoe.version()}", "",
        "ms: median of 10 back-to-back steps between CUDA events on the stream, after at "
        f"least 2 and {WARM_S} s of warm-up steps; the same inputs and initial weights on both "
        "sides (step_bench's draws, the runtime's default seed), so both route alike: max load "
        "shows it. "
        "wall: host time of 20 back-to-back steps / 20 (stream synchronised at both ends): "
        "where the wrapper's per-call host cost shows when the GPU work is short.", "",
        "| shape | C API ms | libmoe.Layer ms | MoELayer ms | overhead (Layer / MoELayer) | "
        "C wall ms | MoELayer wall ms | host cost µs/step (Layer / MoELayer) | MoELayer, torch "
        "grads ms | bench_moe ms | PyTorch eager ms | max load (C / Layer) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, c, py, mod, tgrad, bm, eager, over in rows:
        lines.append(
            f"| {shape} | {f(c['ms'])} | {f(py['ms'])} | {f(mod['ms'])} | "
            f"{over['ctypes_pct']:+.1f}% / {over['module_pct']:+.1f}% | {f(c['wall_ms'])} | "
            f"{f(mod['wall_ms'])} | {over['ctypes_us_per_step']:.0f} / "
            f"{over['module_us_per_step']:.0f} | {f(tgrad and tgrad['ms'])} | "
            f"{f(bm and bm['ms'])} | {f(eager and eager['ms'])} | "
            f"{c.get('max_load', '—')} / {py.get('max_load', '—')} |")
    lines += ["", "The first two shapes are small (where the per-call cost matters); the last "
              "three are bench_moe's layer shapes. \"torch grads\" adds the conversion of "
              "libmoe's f32 gradients to the bf16 gradients PyTorch's optimizers take.", ""]
    with open(out_md, "w") as fh:
        fh.write("\n".join(lines))


def main():
    args = sys.argv[1:]
    quick = args[:1] == ["--quick"]
    out_md, c_paths = args[quick], args[quick + 1:]
    recs = []
    for shape in QUICK_SHAPES if quick else SHAPES:
        try:
            # a stream of its own, as step_bench's (both non-blocking): like for like
            with torch.cuda.stream(torch.cuda.Stream()):
                recs += bench_shape(*shape, quick=quick)
        except Exception as exc:  # report and go on: one failure must not hide the rest
            print(json.dumps({"bench": "ffi_layer_step", "shape": shape_name(*shape),
                              "error": repr(exc)}), flush=True)
            torch.cuda.empty_cache()
    c_api, bench_moe = read_c(c_paths)
    summarise(recs, c_api, bench_moe, out_md)


if __name__ == "__main__":
    main()
