"""What the Python wrapper costs on the GPU: one training step of the MoE layer (gradients
discarded, forward, backward with dx) through libmoe.Layer (ctypes, torch tensors in and out)
and through libmoe.torch.MoELayer (autograd; libmoe's gradients, then PyTorch's, which adds
their bf16 conversion), beside the same step from C and PyTorch's eager layer of
bench/torch_moe.py, in the same call.

The C step runs twice: as step_bench (its own process, the C API alone) and, with --c-loop
LIB (step_bench.c built as a shared object), as step_bench_steps() called once per block of
steps on the wrapper's own layer and tensors in this process, so that the C figure and the
wrappers' share the process, the GPU's clock and the routing. An empty autograd Function on
the same CUDA tensors (forward and backward that launch nothing but their outputs'
allocation) gives what PyTorch itself costs per forward + backward() call.

Timing: the variants of a shape take turns, ROUNDS rounds of PER back-to-back steps each
(the stream synchronised at both ends of a round), wall_ms the median over the rounds of the
host time per step; ms the median of 10 steps between CUDA events on the stream. Before that,
warm-up steps of each variant (at least 2 and WARM_S seconds in all). The overhead of a
wrapper is its wall_ms less the in-process C loop's, in µs per step. Inputs are step_bench's
own draws (splitmix64 + Box-Muller, seeds 1 and 2), and the layer starts from the runtime's
default seed, so step_bench and this process route the same tokens alike (max_load shows it).
Each shape runs on a stream of its own (non-blocking, as step_bench's).

With --quick: issue 42's three shapes only, and for each wrapper the host time of a step split
into libmoe's C calls (timed around each call), the wrapper's Python around them, and (for
MoELayer) PyTorch's autograd outside the wrapper ("ffi_host_split" lines); torch.profiler's
table of MoELayer's step goes to stderr (device_check.sh keeps it in ffi.log).

Usage: torch_bench.py [--quick] [--c-loop LIB] OUT_MD C_JSONL...  (device_check.sh passes
step_bench's and bench_moe's JSON lines). Prints JSON lines and writes OUT_MD, the results file
for bench/results/ffi.md.
Shapes: N tokens, H hidden, F expert FFN width, E experts, K top-k.
"""
import ctypes as C
import datetime
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

import numpy
import torch

import libmoe
import libmoe.torch as libmoe_torch
from libmoe.torch import MoELayer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch_moe  # noqa: E402  (bench/torch_moe.py: PyTorch's layer and its timing)

LAYER_SHAPES = [(16384, 4096, 1408, 64, 2), (16384, 2048, 8192, 8, 2),
                (32768, 4096, 14336, 8, 2)]  # bench_moe's layer shapes
SMALL_SHAPES = [(512, 256, 512, 16, 2), (2048, 1024, 1408, 64, 2)]
SHAPES = SMALL_SHAPES + LAYER_SHAPES
QUICK_SHAPES = SMALL_SHAPES + LAYER_SHAPES[:1]
WARM, WARM_S, ITERS, ROUNDS, PER = 2, 0.5, 10, 7, 20
GPU = torch.cuda.get_device_name(0)
TODAY = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
C_IN_PROCESS = "C API, in process"
LAYER, MODULE, MODULE_TORCH = ("libmoe.Layer (ctypes)", "MoELayer, libmoe grads",
                               "MoELayer, torch grads")
EMPTY = "empty autograd Function"
EMPTY4 = "4 empty autograd Functions, one backward()"
C_THREAD = "C API, in process, from a second thread"
EAGER = "eager (bench/torch_moe.py)"


def shape_name(n, h, f, e, k):
    return f"N={n} H={h} F={f} E={e} K={k}"


def emit(rec):
    print(json.dumps(rec), flush=True)
    return rec


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


def load_c_loop(path):
    """step_bench_steps(layer, x, y, dy, dx, count) from step_bench.c built as a shared object."""
    lib = C.CDLL(path)
    fn = lib.step_bench_steps
    fn.argtypes = [C.c_void_p] + [C.c_void_p] * 4 + [C.c_int]
    fn.restype = C.c_int
    return fn


def measure(variants):
    """{variant: (event ms, wall ms per step)}: warm-up, then ROUNDS rounds in turn."""
    start, done = time.perf_counter(), 0
    while done < WARM or time.perf_counter() - start < WARM_S:  # an idle GPU starts slow
        for block in variants.values():
            block(1)
        torch.cuda.synchronize()
        done += 1
    walls = {v: [] for v in variants}
    for _ in range(ROUNDS):
        for v, block in variants.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            block(PER)
            torch.cuda.synchronize()
            walls[v].append((time.perf_counter() - t0) * 1e3 / PER)
    out = {}
    for v, block in variants.items():
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(ITERS)]
        torch.cuda.synchronize()
        for s, e in events:
            s.record()
            block(1)
            e.record()
        torch.cuda.synchronize()
        out[v] = (statistics.median(s.elapsed_time(e) for s, e in events),
                  statistics.median(walls[v]))
    return out


class _Timed:
    """Wraps a callable, adding its host time to acc[key]."""

    def __init__(self, acc, key, fn):
        self.acc, self.key, self.fn = acc, key, fn

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.acc[self.key] += time.perf_counter() - t


def host_split(name, variant, layer, step, module=False, steps=200):
    """Host µs per step inside libmoe's entry points, in the wrapper's Python around them, and
    (module) in PyTorch outside the wrapper (autograd's apply, its engine and the hand-over to
    its CUDA thread), over steps back-to-back steps after the stream drained."""
    acc = {"c": 0.0, "discard": 0.0, "wrapper": 0.0}
    patched = [(layer, "_forward", "c"), (layer, "_backward", "c"),
               (layer._lib, "moe_layer_discard_grad", "discard")]
    if module:
        patched += [(libmoe_torch, "_forward", "wrapper"), (libmoe_torch, "_backward", "wrapper")]
    originals = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patched]
    for obj, attr, key in patched:
        setattr(obj, attr, _Timed(acc, key, getattr(obj, attr)))
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for obj, attr, fn in originals:
            setattr(obj, attr, fn)
    us = {k: 1e6 * v / steps for k, v in acc.items()}
    total_us = 1e6 * total / steps
    rec = {"bench": "ffi_host_split", "shape": name, "variant": variant,
           "host_us_per_step": round(total_us, 1),
           "c_calls_us": round(us["c"] + us["discard"], 1)}
    if module:  # forward and backward are called inside the wrapper, discard_grad outside it
        rec["python_us"] = round(us["wrapper"] - us["c"], 1)
        rec["torch_us"] = round(total_us - us["wrapper"] - us["discard"], 1)
    else:
        rec["python_us"] = round(total_us - us["c"] - us["discard"], 1)
    return emit(rec)


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


class _Empty(torch.autograd.Function):
    """PyTorch's own cost of a forward and backward() through an autograd Function: outputs
    allocated like MoELayer's, nothing launched."""

    @staticmethod
    def forward(ctx, x, *params):
        return torch.empty_like(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        return (torch.empty_like(dy),) + (None,) * len(ctx.needs_input_grad[1:])


class _Worker:
    """A persistent second thread that runs a block of steps on request and waits for the
    next, as PyTorch's autograd engine runs backward nodes on its CUDA device thread."""

    def __init__(self):
        self._jobs, self._done = queue.Queue(), queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="bench worker").start()

    def _loop(self):
        while True:
            block, count = self._jobs.get()
            try:
                torch.cuda.set_device(0)  # as autograd's device thread does (a no-op later)
                block(count)
                self._done.put(None)
            except BaseException as exc:  # handed to the caller
                self._done.put(exc)

    def run(self, block):
        def on_worker(count):
            self._jobs.put((block, count))
            exc = self._done.get()
            if exc is not None:
                raise exc
        return on_worker


def bench_shape(n, h, f, e, k, c_loop, quick, worker):
    name = shape_name(n, h, f, e, k)
    m = MoELayer(h, f, e, k, grads="libmoe")
    layer = m.layer
    x, dy = step_bench_normal(n, h, 1), step_bench_normal(n, h, 2)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    m.runtime.set_stream(torch.cuda.current_stream())
    xg = x.clone().requires_grad_(True)

    def ctypes_step():
        layer.discard_grad()
        layer.forward(x, y)
        layer.backward(dy, dx)

    def module_step():
        m.zero_grad(set_to_none=True)
        xg.grad = None
        m(xg).backward(dy)

    def empty_step():
        xg.grad = None
        _Empty.apply(xg, *m._trainable).backward(dy)

    def empty4_step():  # PyTorch's cost per node where one backward() serves four
        xg.grad = None
        t = xg
        for _ in range(4):
            t = _Empty.apply(t, *m._trainable)
        t.backward(dy)

    def repeat(step):
        def block(count):
            for _ in range(count):
                step()
        return block

    def torch_grads(count):
        m.grads = "torch"  # the same layer, gradients handed to autograd as bf16
        try:
            for _ in range(count):
                module_step()
        finally:
            m.grads = "libmoe"

    variants = {}
    if c_loop is not None:
        descs = [libmoe.as_tensor(t)[0] for t in (x, y, dy, dx)]  # alive while refs are used
        refs = [C.addressof(d) for d in descs]

        def c_block(count):
            if c_loop(layer.ptr, *refs, count) != 0:
                raise libmoe.Error(libmoe.Status.BACKEND_ERROR, libmoe.library().last_error(),
                                   "step_bench_steps")
        variants[C_IN_PROCESS] = c_block
        if quick:
            variants[C_THREAD] = worker.run(c_block)
    variants[LAYER] = repeat(ctypes_step)
    variants[MODULE] = repeat(module_step)
    variants[MODULE_TORCH] = torch_grads
    variants[EMPTY] = repeat(empty_step)
    if quick:
        variants[EMPTY4] = repeat(empty4_step)
    timed = measure(variants)
    max_load = layer.stats().max_load  # of the last libmoe step: the same routing every step
    recs, splits = [], []
    for v, (ms, wall) in timed.items():
        rec = {"impl": "torch " + torch.__version__ if v in (EMPTY, EMPTY4) else "libmoe python",
               "bench": "ffi_layer_step", "shape": name, "variant": v, "ms": round(ms, 4),
               "wall_ms": round(wall, 4), "gpu": GPU, "date": TODAY}
        if v == LAYER:
            rec["max_load"] = max_load
        recs.append(emit(rec))
    if quick:
        splits.append(host_split(name, LAYER, layer, ctypes_step))
        splits.append(host_split(name, MODULE, layer, module_step, module=True))
        profile_table(name, module_step)
    m.zero_grad(set_to_none=True)
    m.runtime.close()  # frees the layer's GPU memory now, not when the collector finds it
    del m, layer, xg, y, dx
    torch.cuda.empty_cache()

    tm = torch_moe.TorchMoE(h, f, e, k)
    xt = x.clone().requires_grad_(True)

    def torch_step():
        tm.zero_grad(set_to_none=True)
        xt.grad = None
        out, loss = tm(xt)
        torch.autograd.backward([out, loss], [dy, torch.ones_like(loss)])

    ms, wall = measure({EAGER: repeat(torch_step)})[EAGER]
    recs.append(emit({"impl": "torch " + torch.__version__, "bench": "ffi_layer_step",
                      "shape": name, "variant": EAGER, "ms": round(ms, 4),
                      "wall_ms": round(wall, 4), "gpu": GPU, "date": TODAY}))
    del tm, xt, x, dy
    torch.cuda.empty_cache()
    return recs, splits


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


def summarise(recs, splits, c_api, bench_moe, out_md, shapes):
    def f(v, digits=3):
        return "—" if v is None else f"{v:.{digits}f}"

    def us(a, b):
        return "—" if a is None or b is None else f"{1e3 * (a - b):+.0f}"

    rows = []
    for shape in (shape_name(*s) for s in shapes):
        mine = {r["variant"]: r for r in recs if r["shape"] == shape}
        if LAYER not in mine:
            continue
        c = c_api.get(shape, {})
        base = mine.get(C_IN_PROCESS, c)
        wall = {v: r.get("wall_ms") for v, r in mine.items()}
        over = {"bench": "ffi_overhead", "shape": shape, "against": (
            C_IN_PROCESS if C_IN_PROCESS in mine else "step_bench")}
        for key, v in (("layer", LAYER), ("module", MODULE), ("module_torch_grads", MODULE_TORCH)):
            if v in wall and base.get("wall_ms") is not None:
                over[f"{key}_us_per_step"] = round(1e3 * (wall[v] - base["wall_ms"]), 1)
        if C_THREAD in wall:  # the same C calls issued from a thread other than the main one
            over["c_second_thread_us_per_step"] = round(1e3 * (wall[C_THREAD] - base["wall_ms"]),
                                                        1)
        if EMPTY in wall:  # PyTorch's own share of MoELayer's figure
            over["empty_function_us_per_step"] = round(1e3 * wall[EMPTY], 1)
            if EMPTY4 in wall:  # a node's share when one backward() serves four
                over["empty_function_us_per_node_of_4"] = round(1e3 * wall[EMPTY4] / 4, 1)
        if c.get("wall_ms") is not None and base is not c:
            over["c_in_process_vs_step_bench_us"] = round(1e3 * (base["wall_ms"] - c["wall_ms"]),
                                                          1)
        emit(over)
        rows.append((shape, c, base, mine, bench_moe.get(shape)))

    def r(mine, v, key):
        return mine.get(v, {}).get(key)

    lines = [
        "# Python wrapper overhead (libmoe.Layer, libmoe.torch.MoELayer)", "",
        "One training step of the MoE layer on one GPU: gradients discarded, forward, backward "
        "with dx, step_bench's bf16 inputs. The C step runs as `bench/python/step_bench.c` (its "
        "own process) and as the same loop in C called from the benchmark's process on the "
        "wrappers' own layer and tensors (`step_bench_steps`), the variants taking turns; "
        "PyTorch's eager layer (`bench/torch_moe.py`) is from the same call.", "",
        "- command: `bash tests/python/device_check.sh build quick` (`step_bench`, "
        "`bench/python/torch_bench.py --quick --c-loop`)",
        f"- date: {TODAY[:10]}; GPU: {GPU}; commit: {commit()}",
        f"- software: PyTorch {torch.__version__}, CUDA {torch.version.cuda}, libmoe "
        f"{libmoe.version()}", "",
        f"wall: host time per step, the median over {ROUNDS} rounds of {PER} back-to-back steps "
        "(stream synchronised at both ends of a round), the variants in turn; ms: median of "
        f"{ITERS} steps between CUDA events. Overhead: a variant's wall less the in-process C "
        "loop's, µs per step. The empty autograd Function is PyTorch's own cost of a forward "
        "and a backward() call on these tensors (its outputs allocated, nothing launched): "
        "MoELayer pays it, the C step does not.", "",
        "| shape | C ms (step_bench) | C wall ms (step_bench / in process / second thread) | "
        "libmoe.Layer wall ms (µs over C) | MoELayer wall ms (µs over C) | MoELayer, torch grads "
        "wall ms (µs over C) | empty autograd Function wall ms (one / four in one backward) | "
        "PyTorch eager ms | max load (step_bench / Layer) |",
        "|---|---|---|---|---|---|---|---|---|"]
    for shape, c, base, mine, bm in rows:
        bw = base.get("wall_ms")
        lines.append(
            f"| {shape} | {f(c.get('ms'))} | {f(c.get('wall_ms'))} / "
            f"{f(r(mine, C_IN_PROCESS, 'wall_ms'))} / {f(r(mine, C_THREAD, 'wall_ms'))} | "
            f"{f(r(mine, LAYER, 'wall_ms'))} "
            f"({us(r(mine, LAYER, 'wall_ms'), bw)}) | {f(r(mine, MODULE, 'wall_ms'))} "
            f"({us(r(mine, MODULE, 'wall_ms'), bw)}) | {f(r(mine, MODULE_TORCH, 'wall_ms'))} "
            f"({us(r(mine, MODULE_TORCH, 'wall_ms'), bw)}) | {f(r(mine, EMPTY, 'wall_ms'))} / "
            f"{f(r(mine, EMPTY4, 'wall_ms'))} | "
            f"{f(r(mine, EAGER, 'ms'))} | {c.get('max_load', '—')} / "
            f"{r(mine, LAYER, 'max_load') or '—'} |")
    if splits:
        lines += ["", "Host time of a step, µs (`ffi_host_split`: 200 back-to-back steps, "
                  "libmoe's C calls timed around each call; for MoELayer the wrapper's Python "
                  "and PyTorch's autograd outside it apart):", "",
                  "| shape | variant | host µs/step | in libmoe's C calls | wrapper's Python | "
                  "PyTorch outside the wrapper |", "|---|---|---|---|---|---|"]
        for s in splits:
            lines.append(f"| {s['shape']} | {s['variant']} | {s['host_us_per_step']} | "
                         f"{s['c_calls_us']} | {s['python_us']} | {s.get('torch_us', '—')} |")
    lines += ["", "\"torch grads\" adds the conversion of libmoe's f32 gradients to the bf16 "
              "gradients PyTorch's optimizers take (three GPU copies a backward).", ""]
    with open(out_md, "w") as fh:
        fh.write("\n".join(lines))


def main():
    args = sys.argv[1:]
    quick = "--quick" in args
    if quick:
        args.remove("--quick")
    c_loop = None
    if "--c-loop" in args:
        i = args.index("--c-loop")
        c_loop = load_c_loop(args[i + 1])
        del args[i:i + 2]
    emit({"bench": "ffi_environment", "torch": torch.__version__,
          "python_threads": [t.name for t in threading.enumerate()]})
    shapes = QUICK_SHAPES if quick else SHAPES
    if "--shapes" in args:  # indices into the list, e.g. "1" or "0,2"
        i = args.index("--shapes")
        shapes = [shapes[int(j)] for j in args[i + 1].split(",")]
        del args[i:i + 2]
    out_md, c_paths = args[0], args[1:]
    worker = _Worker() if quick else None
    recs, splits = [], []
    for shape in shapes:
        try:
            # a stream of its own, as step_bench's (both non-blocking): like for like
            with torch.cuda.stream(torch.cuda.Stream()):
                shape_recs, shape_splits = bench_shape(*shape, c_loop=c_loop, quick=quick,
                                                       worker=worker)
            recs += shape_recs
            splits += shape_splits
        except Exception as exc:  # report and go on: one failure must not hide the rest
            emit({"bench": "ffi_layer_step", "shape": shape_name(*shape), "error": repr(exc)})
            torch.cuda.empty_cache()
    c_api, bench_moe = read_c(c_paths)
    summarise(recs, splits, c_api, bench_moe, out_md, shapes)


if __name__ == "__main__":
    main()
