"""libmoe.torch on a GPU: MoELayer against a plain PyTorch implementation of the same layer, the
zero-copy, stream and slot contracts, the generic array paths, and two small models that train.

The reference is the layer's math (docs/moe-layer.md) in fp32 on the same bf16 parameter values
and inputs, with autograd for the backward; libmoe's results must be within the bf16 bound
the CUDA tests use (relative norm error <= 1e-2, tests/backend/test_cuda_layer.c). A near-tie can
flip one token's expert between the two: the routing is compared first (tokens per expert) and
the inputs redrawn, up to 3 times, when it differs.

With --host the same checks run on libmoe's host backend (f32 CPU tensors, bound 1e-5; the
CUDA-only ones skipped): tests/python/test_torch_cpu.py runs that where PyTorch is installed, so
the GPU run meets no untried code.

Prints one JSON line per check ({"check", "ok", ...}); exits 1 when one fails, 77 without a GPU.
Shapes: N tokens, H hidden, F expert FFN width, E experts, K top-k.
Usage (device_check.sh runs it): MOE_LIBRARY=<build>/libmoe.so PYTHONPATH=python \
    python3 tests/python/torch_check.py [--host] [--only compile]
"""
import json
import math
import sys
import traceback

import torch
import torch.nn.functional as Fn

import libmoe
from libmoe.torch import HAS_CUSTOM_OP, MoELayer

failures = []


class Mode:
    """Where the checks run: the CUDA backend on bf16 GPU tensors (the default), or the host
    backend on f32 CPU tensors (--host)."""

    def __init__(self, host):
        self.host = host
        self.dev = "cpu" if host else "cuda"
        self.dtype = torch.float32 if host else torch.bfloat16
        self.bound = 1e-5 if host else 1e-2  # fp32 on both sides, or the CUDA tests' bf16 bound
        self.runtime = libmoe.Runtime("host") if host else None

    def layer(self, h, f, e, k, seed=0, **config):
        rt = libmoe.Runtime("host", seed=seed) if self.host else None
        return MoELayer(h, f, e, k, runtime=rt, seed=None if self.host else seed, **config)

    def randn(self, *shape, generator=None):
        return torch.randn(*shape, device=self.dev, generator=generator).to(self.dtype)

    def sync(self):
        if not self.host:
            torch.cuda.synchronize()


M = None  # the Mode of this run


def emit(check, ok, **fields):
    rec = {"check": check, "ok": bool(ok), **fields}
    print(json.dumps(rec), flush=True)
    if not ok:
        failures.append(check)


def rel(a, b):
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den else (a - b).norm().item()


def reference(x, wg, w1, w2, k, score_fn="softmax", renormalize=True):
    """fp32 layer on fp32 leaf tensors: y [N,H], aux, z, tokens per expert."""
    n, e = x.shape[0], wg.shape[1]
    logits = x @ wg
    if score_fn == "softmax":
        s = torch.softmax(logits, dim=-1)
        q = s
    else:
        s = torch.sigmoid(logits)
        q = s / s.sum(-1, keepdim=True)
    topv, topi = torch.topk(s, k, dim=-1)
    w = topv / topv.sum(-1, keepdim=True) if renormalize else topv
    y = torch.zeros_like(x)
    for ex in range(e):
        tok, slot = (topi == ex).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        act = Fn.silu(xe @ w1[ex, :, 0, :]) * (xe @ w1[ex, :, 1, :])
        y = y.index_add(0, tok, (act @ w2[ex]) * w[tok, slot].unsqueeze(1))
    counts = torch.bincount(topi.flatten(), minlength=e)
    aux = e * ((counts.float() / (n * k)).detach() * q.mean(0)).sum()
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return y, aux, z, counts


def leaf(t):
    return t.detach().float().clone().requires_grad_(True)


# ---- forward and backward against the reference --------------------------------------------

def compare(name, n, h, f, e, k, score_fn="softmax", renormalize=True, grads="libmoe"):
    m = M.layer(h, f, e, k, seed=7, grads=grads, score_fn=score_fn, renormalize=renormalize,
                init_std=0.05)
    cfg = m.layer.config
    for draw in range(3):
        gen = torch.Generator(device=M.dev).manual_seed(100 * draw + n)
        x = M.randn(n, h, generator=gen).requires_grad_(True)
        dy = M.randn(n, h, generator=gen)
        m.zero_grad()
        x.grad = None
        y = m(x)
        y.backward(dy)
        M.sync()
        st = m.stats()
        xr, wg, w1, w2 = (leaf(t) for t in (x, m.router.weight, m.experts.w1, m.experts.w2))
        yr, aux, z, counts = reference(xr, wg, w1, w2, k, score_fn, renormalize)
        if tuple(counts.tolist()) == tuple(st.tokens_per_expert):
            break
    else:
        emit(f"layer {name}", False, error="routing differs from the reference in 3 draws")
        return
    loss = (yr * dy.float()).sum() + cfg["aux_loss_coef"] * aux + cfg["z_loss_coef"] * z
    loss.backward()
    if grads == "libmoe":
        got = {n_: m.libmoe_grad(n_) for n_ in ("router.weight", "experts.w1", "experts.w2")}
    else:
        got = {"router.weight": m.router.weight.grad, "experts.w1": m.experts.w1.grad,
               "experts.w2": m.experts.w2.grad}
    errs = {"y": rel(y, yr), "dx": rel(x.grad, xr.grad),
            "router.weight": rel(got["router.weight"], wg.grad),
            "experts.w1": rel(got["experts.w1"], w1.grad),
            "experts.w2": rel(got["experts.w2"], w2.grad),
            "aux_loss": abs(st.aux_loss - aux.item()) / abs(aux.item()),
            "z_loss": abs(st.z_loss - z.item()) / abs(z.item())}
    emit(f"layer {name}", all(v <= M.bound for v in errs.values()),
         shape=f"N={n} H={h} F={f} E={e} K={k}", score_fn=score_fn, grads=grads, draws=draw + 1,
         bound=M.bound, **{k_: float(f"{v:.3g}") for k_, v in errs.items()})


# ---- contracts -------------------------------------------------------------------------------

def check_zero_copy():
    m = M.layer(256, 256, 8, 2, seed=1)
    p = m.layer.params
    same = all(getattr(getattr(m, a), b).data_ptr() == p[f"{a}.{b}"].value.data_ptr
               for a, b in (("router", "weight"), ("experts", "w1"), ("experts", "w2")))
    x = M.randn(64, 256)
    with torch.no_grad():
        m.experts.w2.zero_()  # written through the view: libmoe's experts now output zero
        y = m(x)
    M.sync()
    keys = sorted(m.state_dict())
    emit("zero-copy parameters", same and y.abs().max().item() == 0 and
         keys == ["experts.w1", "experts.w2", "router.weight"], state_dict=keys)
    try:
        m.to(torch.float64)
        moved = True
    except RuntimeError:
        moved = False
    m.to(M.dev)  # already there: allowed
    emit("module refuses a cast", not moved)


def check_streams():
    if M.host:
        return
    m = M.layer(512, 512, 16, 2, seed=2)
    x = M.randn(1024, 512)
    dy = M.randn(1024, 512)

    def step():
        xg = x.clone().requires_grad_(True)
        m.zero_grad()
        y = m(xg)
        y.backward(dy)
        return y.detach().clone(), xg.grad.clone(), m.router.weight.grad.clone()

    base = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = step()
        stream_used = m.runtime.stream == side.cuda_stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    err = max(rel(a, b) for a, b in zip(base, on_side))
    bitwise = all(torch.equal(a, b) for a, b in zip(base, on_side))
    emit("current stream", stream_used and err <= 1e-3, runtime_stream_is_torch_stream=stream_used,
         max_rel_err_vs_default_stream=err, bitwise_equal=bitwise)


def check_slots_and_accumulation():
    m = M.layer(256, 512, 8, 2, seed=3, max_microbatches=2, grads="libmoe")
    xa = M.randn(128, 256)
    xb = M.randn(96, 256)
    dya, dyb = torch.randn_like(xa), torch.randn_like(xb)
    with torch.no_grad():  # forwards without backward must not hold slots
        for _ in range(3):
            m(xa)
    m.zero_grad()
    m(xa).backward(dya)
    ga = m.libmoe_grad("experts.w1").clone()
    m.zero_grad()
    m(xb).backward(dyb)
    gb = m.libmoe_grad("experts.w1").clone()
    m.zero_grad()
    ya, yb = m(xa), m(xb)  # two microbatches in flight, backwards in reverse order
    yb.backward(dyb)
    ya.backward(dya)
    both = m.libmoe_grad("experts.w1")
    err_lib = rel(both, ga + gb)
    t = M.layer(256, 512, 8, 2, seed=3, grads="torch")
    t.zero_grad()
    t(xa).backward(dya)
    once = t.experts.w1.grad.float().clone()
    t(xa).backward(dya)  # autograd accumulates into p.grad
    err_torch = rel(t.experts.w1.grad.float(), 2 * once)
    M.sync()
    emit("slots and accumulation", err_lib <= 1e-5 and err_torch <= M.bound,
         libmoe_accumulation_err=err_lib, torch_accumulation_err=err_torch)


class _CudaArray:
    def __init__(self, t):
        self.t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


class _DLPackOnly:
    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def check_generic_paths():
    """libmoe.Layer fed through the CUDA array interface and DLPack gives the torch path's y."""
    m = M.layer(256, 256, 8, 2, seed=4)
    layer = m.layer
    if not M.host:
        m.runtime.set_stream(torch.cuda.current_stream())
    x = M.randn(200, 256)
    wraps = [lambda t: t, _DLPackOnly] + ([] if M.host else [_CudaArray])
    outs = []
    for wrap in wraps:
        y = torch.empty_like(x)
        layer.forward(wrap(x), wrap(y))
        layer.release_slot(0)
        outs.append(y)
    M.sync()
    emit("array interface and DLPack", all(torch.equal(outs[0], o) for o in outs[1:]),
         paths=len(outs))


def check_errors():
    m = M.layer(128, 128, 4, 2, seed=5)
    other = torch.float64 if M.host else torch.float32
    cases = {"wrong dtype": torch.randn(8, 128, device=M.dev, dtype=other),
             "wrong hidden": M.randn(8, 64)}
    if not M.host:
        cases["host input"] = torch.randn(8, 128, dtype=M.dtype)
    raised = {}
    for what, x in cases.items():
        try:
            m(x)
            raised[what] = None
        except libmoe.ArgumentError as exc:
            raised[what] = str(exc)
    try:
        libmoe.Layer(m.runtime, hidden=128, ffn_hidden=128, num_experts=4, top_k=9)
        status = None
    except libmoe.Error as exc:
        status = exc.status.name
    emit("errors before the call", all(raised.values()) and status == "INVALID_ARGUMENT",
         messages=raised, bad_config_status=status)


# ---- training ------------------------------------------------------------------------------

def train(grads, steps=150, h=256, batch=1024):
    if M.host:  # the host backend is the slow reference: a smaller model
        steps, h, batch = 100, 32, 128
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.GELU(),
                                  torch.nn.Linear(h, h)).to(M.dev, M.dtype)
    moe = M.layer(h, 2 * h, 8, 2, grads=grads, seed=6, init_std=0.02)
    first = torch.nn.Linear(h, h).to(M.dev, M.dtype)
    last = torch.nn.Linear(h, h).to(M.dev, M.dtype)
    dense = list(first.parameters()) + list(last.parameters())
    if grads == "torch":
        opt = torch.optim.AdamW(dense + list(moe.parameters()), lr=2e-3)
        moe_opt = None
    else:
        opt = torch.optim.AdamW(dense, lr=2e-3)
        moe_opt = moe.adamw(lr=2e-3)
    losses = []
    for _ in range(steps):
        x = M.randn(batch, h)
        with torch.no_grad():
            target = teacher(x)
        opt.zero_grad(set_to_none=True)
        moe.zero_grad()
        hid = first(x)
        y = last(hid + moe(hid))
        loss = Fn.mse_loss(y.float(), target.float())
        loss.backward()
        opt.step()
        if moe_opt is not None:
            moe_opt.step()
        losses.append(loss.item())
    start, end = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    emit(f"training, {grads} gradients", end < 0.5 * start and math.isfinite(end),
         loss_first10=round(start, 5), loss_last10=round(end, 5), steps=steps)


class _Residual(torch.nn.Module):
    """x + block(x) for each block, in order: the compile check's model."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _step(model, fn, x, dy):
    """Output, dx and every parameter gradient of one step of fn (model or its compiled
    form), and the tokens per expert of each MoE layer's forward in it."""
    model.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    y = fn(xg)
    y.backward(dy)
    M.sync()
    names = ["y", "dx"] + [n for n, _ in model.named_parameters()]
    # copies: a CUDA graph's replay rewrites its outputs
    values = [y.detach().clone(), xg.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    routing = [tuple(b.stats().tokens_per_expert) for b in model.blocks
               if isinstance(b, MoELayer)]
    return dict(zip(names, values)), routing


def _errors(got, want):
    return {n: rel(got[n], want[n]) for n in want}


def _worst(errs):
    name = max(errs, key=errs.get)
    return name, float(f"{errs[name]:.3g}")


def check_compile():
    """A 4-layer residual model of MoELayers under torch.compile(fullgraph=True): no graph break
    (torch._dynamo.explain), and the compiled step (the libmoe custom ops) equal to the eager
    one (the autograd Function) within the bound: output, dx and every parameter gradient.
    Then compiled steps and no_grad forwards beyond the slot count hold no slot.

    The comparison is made fair, as compare() makes it against the reference: compiled and
    eager must route alike (tokens per expert of every layer), else the inputs are redrawn, up
    to 3 times: where the residual stream differs in a last bf16 bit between the two, a
    near-tie can send one token to another expert in a later layer, and that expert's
    gradients then differ by a whole row, several percent (each layer's 512 slots hold 64 per
    expert here). Reported beside:
    eager against eager (libmoe's determinism), the aot_eager backend against eager (the
    operators without Inductor's code), the dense floor. The host backend compiles with
    aot_eager only (no Inductor C++ toolchain needed)."""
    if not HAS_CUSTOM_OP:
        emit("torch.compile", True, skip=f"PyTorch {torch.__version__} has no "
                                         "torch.library.custom_op: the autograd Function serves")
        return
    h, f, layers = 256, 512, 4
    backend = "aot_eager" if M.host else "inductor"
    model = _Residual(M.layer(h, f, 8, 2, seed=10 + i, max_microbatches=2)
                      for i in range(layers))
    gen = torch.Generator(device=M.dev).manual_seed(42)
    x, dy = M.randn(4, 64, h, generator=gen), M.randn(4, 64, h, generator=gen)

    torch._dynamo.reset()
    explain = torch._dynamo.explain(model)(x)
    compiled_model = torch.compile(model, fullgraph=True, backend=backend)
    first = None
    for draw in range(3):
        if draw:
            x, dy = M.randn(4, 64, h, generator=gen), M.randn(4, 64, h, generator=gen)
        eager, eager_routing = _step(model, model, x, dy)
        again, _ = _step(model, model, x, dy)
        compiled, compiled_routing = _step(model, compiled_model, x, dy)
        errs = _errors(compiled, eager)
        flips = [sum(abs(a - b) for a, b in zip(c, e)) // 2
                 for c, e in zip(compiled_routing, eager_routing)]
        if first is None:
            first = {"worst": _worst(errs), "slots_moved_per_layer": flips}
        if not any(flips):
            break
    repeat_errs = _errors(again, eager)
    bitwise = all(torch.equal(compiled[n], eager[n]) for n in eager)
    for _ in range(3):  # steady state: each step's slots come back
        _step(model, compiled_model, x, dy)
    with torch.no_grad():
        for _ in range(3):
            compiled_model(x)
    free = all(len(m._free) == 2 for m in model.blocks)
    aot_worst = None  # an OptimizedModule has no truth value: tested against None
    if not M.host:
        aot = torch.compile(model, fullgraph=True, backend="aot_eager")
        aot_worst = _worst(_errors(_step(model, aot, x, dy)[0], eager))
    dense_worst = _dense_floor(h, f, layers, x, dy, backend)
    err = max(errs.values())
    emit("torch.compile", explain.graph_break_count == 0 and err <= M.bound and free and
         not any(flips), graph_breaks=explain.graph_break_count, graphs=explain.graph_count,
         backend=backend, draws=draw + 1, routing_equal=not any(flips),
         max_rel_err_vs_eager=float(f"{err:.3g}"), worst_tensor=_worst(errs)[0],
         bitwise_equal_to_eager=bitwise, first_draw=first,
         eager_vs_eager=_worst(repeat_errs)[1], aot_eager_vs_eager=aot_worst,
         dense_floor_compiled_vs_eager=dense_worst, slots_free=free, layers=layers,
         bound=M.bound)


def _dense_floor(h, f, layers, x, dy, backend):
    """The largest relative difference between compiled and eager steps of the same residual
    model with dense SwiGLU blocks (PyTorch alone): what compiling changes without libmoe."""
    class SwiGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(h, 2 * f, bias=False)
            self.down = torch.nn.Linear(f, h, bias=False)

        def forward(self, x):
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(Fn.silu(gate) * up)

    torch.manual_seed(5)
    dense = _Residual(SwiGLU() for _ in range(layers)).to(M.dev, M.dtype)
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=0.05)
    eager, _ = _step(dense, dense, x, dy)
    compiled, _ = _step(dense, torch.compile(dense, fullgraph=True, backend=backend), x, dy)
    return _worst(_errors(compiled, eager))


def check_reduce_overhead():
    """torch.compile(mode="reduce-overhead") of the residual model: libmoe's forward waits for
    the device (moe_cuda_plan_op brings the routing counts to the host), so the layer cannot
    be recorded in a CUDA graph. What must hold: either PyTorch leaves the libmoe operators
    out of its graphs (MoELayer raises when called under a capture) and the step equals the
    eager one, or the step raises libmoe's UNSUPPORTED error naming the reason; never a wrong
    result or a broken capture."""
    if M.host or not HAS_CUSTOM_OP:
        return
    h, f, layers = 256, 512, 2
    model = _Residual(M.layer(h, f, 8, 2, seed=20 + i, max_microbatches=2)
                      for i in range(layers))
    gen = torch.Generator(device=M.dev).manual_seed(7)
    x, dy = M.randn(4, 64, h, generator=gen), M.randn(4, 64, h, generator=gen)
    eager, _ = _step(model, model, x, dy)
    torch._dynamo.reset()
    graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    try:
        runs = [_step(model, graphed, x, dy)[0] for _ in range(3)]  # warm-up, record, replay
    except Exception as exc:  # PyTorch may wrap libmoe's error in its own
        emit("reduce-overhead", "cannot be captured in a CUDA graph" in str(exc),
             outcome="refused", error=f"{type(exc).__name__}: {str(exc)[:400]}")
        return
    worst = max(max(_errors(r, eager).values()) for r in runs)
    emit("reduce-overhead", worst <= M.bound, outcome="ran: no capture reached libmoe",
         max_rel_err_vs_eager=float(f"{worst:.3g}"), bound=M.bound)


def main():
    global M
    host = "--host" in sys.argv[1:]
    if not host and not torch.cuda.is_available():
        print(json.dumps({"check": "gpu", "ok": False, "skip": "no CUDA device"}))
        return 77
    M = Mode(host)
    print(json.dumps({"torch": torch.__version__, "libmoe": libmoe.version(),
                      "library": libmoe.library().path,
                      "device": "host" if host else torch.cuda.get_device_name(0)}), flush=True)
    scale = 4 if host else 1  # the host backend is the slow reference: smaller shapes
    checks = [
        lambda: compare("softmax", 2048 // scale, 512 // scale, 1024 // scale, 16, 2),
        lambda: compare("softmax, torch grads", 2048 // scale, 512 // scale, 1024 // scale,
                        16, 2, grads="torch"),
        lambda: compare("sigmoid", 1024 // scale, 1024 // scale, 512 // scale, 64, 4,
                        score_fn="sigmoid"),
        lambda: compare("top-1", 512 // scale, 256 // scale, 256 // scale, 8, 1,
                        renormalize=False),
        check_zero_copy, check_streams, check_slots_and_accumulation, check_generic_paths,
        check_errors, lambda: train("torch"), lambda: train("libmoe"), check_compile,
        check_reduce_overhead,
    ]
    if "--only" in sys.argv[1:]:
        only = sys.argv[sys.argv.index("--only") + 1]
        checks = {"compile": [check_compile, check_reduce_overhead]}[only]
    for check in checks:
        try:
            check()
        except Exception as exc:  # one failure must not hide the rest
            emit("exception", False, error=repr(exc), trace=traceback.format_exc()[-1500:])
    print(json.dumps({"check": "summary", "ok": not failures, "failed": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
