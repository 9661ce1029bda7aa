"""PyTorch counterparts of bench_moe, on the same shapes, in the same run (JSON lines).

Measures with CUDA events, median of many runs after warm-up, random bf16 inputs (router
inputs rotate over 3 buffers like bench_moe). Also re-measures the two ceilings the floors
use: HBM bandwidth (device-to-device copy, bytes read + written) and the bf16 GEMM rate
(8192^3 on random data).

Shape legend: N tokens, H hidden, E experts, K top-k, T tokens per expert, F expert width.
"""
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as Fn

DEV = "cuda"
BF = torch.bfloat16
GPU = torch.cuda.get_device_name(0)
SUSTAIN_MS = 3000.0
TODAY = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def emit(bench, shape, variant, ms, **extra):
    rec = {"impl": "torch " + torch.__version__, "bench": bench, "shape": shape,
           "variant": variant, "ms": round(ms, 4), "gpu": GPU, "date": TODAY}
    rec.update(extra)
    print(json.dumps(rec), flush=True)


def median_ms(fn, warm=5, iters=50, setup=None):
    """fn(i) timed between events; setup(i), if given, runs before each start event."""
    for i in range(warm):
        if setup:
            setup(i)
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        if setup:
            setup(i)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def ceilings():
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = median_ms(lambda i: b.copy_(a), 3, 20)
    emit("ceiling_hbm", "2 GiB d2d copy", "copy", ms, tbps=round(2 * a.numel() / ms * 1e-9, 2))
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=BF)
    y = torch.randn(8192, 8192, device=DEV, dtype=BF)
    ms = median_ms(lambda i: x @ y, 3, 20)
    emit("ceiling_gemm", "8192^3 bf16", "matmul", ms, tflops=round(2 * 8192**3 / ms * 1e-9, 1))


# ---- router -------------------------------------------------------------------------------

def router_fwd(x, wg, k):
    logits = (x @ wg).float()
    probs = torch.softmax(logits, dim=-1)
    topv, topi = torch.topk(probs, k, dim=-1)
    w = topv / topv.sum(-1, keepdim=True)
    counts = torch.bincount(topi.flatten(), minlength=wg.shape[1])
    pmean = probs.mean(0)
    lse = torch.logsumexp(logits, dim=-1)
    z = (lse * lse).mean()
    ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1).mean()
    return logits, topi, w, counts, pmean, z, ent


def bench_router():
    shapes = [(65536, 4096, 64, 2), (65536, 7168, 256, 8), (512, 256, 16, 2), (1024, 512, 32, 2),
              (2048, 1024, 64, 2), (4096, 2048, 64, 4)]
    for n, h, e, k in shapes:
        shape = f"N={n} H={h} E={e} K={k}"
        xs = [torch.randn(n, h, device=DEV, dtype=BF) for _ in range(3)]
        wg = (torch.randn(h, e, device=DEV) / h**0.5).to(BF)
        iters = 30 if n >= 65536 else 200
        with torch.no_grad():
            ms = median_ms(lambda i: router_fwd(xs[i % 3], wg, k), 5, iters)
        emit("router_fwd", shape, "eager", ms)

        # backward through the same graph (autograd), aux and z terms included
        xg = [x.clone().requires_grad_(True) for x in xs]
        wgg = wg.clone().requires_grad_(True)
        g_w = torch.randn(n, k, device=DEV)
        state = {}

        def setup(i):
            logits, topi, w, counts, pmean, z, _ = router_fwd(xg[i % 3], wgg, k)
            f = counts.float() / (n * k)
            loss = (w * g_w).sum() + 0.01 * e * (f * pmean).sum() + 0.001 * z
            state["loss"] = loss

        ms = median_ms(lambda i: state["loss"].backward(), 5, iters, setup=setup)
        emit("router_bwd", shape, "autograd", ms)
        del xs, xg


# ---- experts --------------------------------------------------------------------------------

def grouped_swiglu(xp, w1, w2, offs):
    """w1 [E, 2F, H], w2 [E, H, F] (stored transposed, as torch._grouped_mm wants them)."""
    hpre = torch._grouped_mm(xp, w1.transpose(-2, -1), offs=offs)
    g, u = hpre.chunk(2, dim=-1)
    act = Fn.silu(g) * u
    return torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)


EXPERT_SHAPES = [(64, 512, 2048, 1408), (64, 512, 4096, 1408), (32, 1024, 7168, 2048),
                 (128, 256, 2048, 768), (8, 4096, 4096, 14336), (16, 2048, 2048, 8192),
                 (8, 4096, 2048, 8192), (64, 1536, 2048, 1408)]
LOADS = ("", " routed", " uneven", " skewed", " hot")


def expert_rows(el, t, load, replay=None):
    """bench_moe's loads (its expert_rows has the definitions), the same integer arithmetic:
    expert e holds popularity rank e * 37 % el; every remainder goes to rank 0's expert."""
    r, tail = el * t, el // 4
    ranks = [e * 37 % el for e in range(el)]
    rows = []
    for rank in ranks:
        u = (rank + 0.5) / el
        n = t
        if load == " routed":
            n = int(t + 2.5 * math.sqrt(t) * (2 * u - 1))
        elif load == " uneven":
            n = int(t * (0.25 + 1.5 * u))
        elif load == " hot":
            n = r // 4 if rank == 0 else (r - r // 4) // (el - 1)
        elif load == " skewed":
            n = 0 if rank < el - tail or rank == el - 1 else t // 64
        rows.append(n)
    if load == " skewed":
        w = [(1 << 40) // (16 * rank + el) if rank < el - tail else 0 for rank in ranks]
        head = r - sum(rows)
        rows = [head * w[e] // sum(w) if w[e] else rows[e] for e in range(el)]
    if replay is not None:
        counted = sum(replay)
        rows = [c * r // counted if counted else t for c in replay]
    rows[ranks.index(0)] += r - sum(rows)
    return rows


def replay_counts(path, el):
    """The per-expert counts of each layer with el experts in the last line of a trainer
    metrics file (MOE_BENCH_COUNTS), as bench_moe reads them."""
    last = None
    with open(path) as f:
        for line in f:
            if '"tokens_per_expert"' in line:
                last = line
    if last is None:
        return []
    layers = [ly["tokens_per_expert"] for ly in json.loads(last)["layers"]]
    return [[int(c) for c in ly] for ly in layers if len(ly) == el]


def bench_experts():
    """Forward, and backward as (forward + backward) - forward through autograd, on bench_moe's
    shapes and loads (the same row counts)."""
    counts_file = os.environ.get("MOE_BENCH_COUNTS")
    for el, t, h, f in EXPERT_SHAPES:
        xp = torch.randn(el * t, h, device=DEV, dtype=BF)
        w1 = (torch.randn(el, 2 * f, h, device=DEV, dtype=BF) / h**0.5)
        w2 = (torch.randn(el, h, f, device=DEV, dtype=BF) / f**0.5)
        dy = torch.randn(el * t, h, device=DEV, dtype=BF)
        xg, w1g, w2g = (v.clone().requires_grad_(True) for v in (xp, w1, w2))
        flops = 6.0 * el * t * h * f
        loads = [(load, expert_rows(el, t, load)) for load in LOADS]
        if counts_file:
            loads += [(f" replay L{i}", expert_rows(el, t, "", c))
                      for i, c in enumerate(replay_counts(counts_file, el))]
        for load, rows in loads:
            shape = f"E={el} T={t} H={h} F={f}{load}"
            offs = torch.tensor(rows, device=DEV).cumsum(0).to(torch.int32)
            with torch.no_grad():
                ms = median_ms(lambda i: grouped_swiglu(xp, w1, w2, offs), 3, 20)
            emit("experts_fwd", shape, "torch._grouped_mm", ms,
                 tflops=round(flops / ms * 1e-9, 1), max_over_mean=round(max(rows) / t, 2))

            def step(i):
                xg.grad = w1g.grad = w2g.grad = None
                grouped_swiglu(xg, w1g, w2g, offs).backward(dy)

            ms_all = median_ms(step, 3, 10)
            emit("experts_bwd", shape, "torch._grouped_mm (fwd+bwd - fwd)", ms_all - ms,
                 tflops=round(2 * flops / (ms_all - ms) * 1e-9, 1))
        del xp, w1, w2, dy, xg, w1g, w2g
        torch.cuda.empty_cache()


# ---- layer ---------------------------------------------------------------------------------

class TorchMoE(torch.nn.Module):
    """Router (softmax top-k, renormalised, aux + z loss), stable sort permute,
    grouped_mm SwiGLU, weighted combine; the same math as libmoe's layer."""

    def __init__(self, h, f, e, k):
        super().__init__()
        self.e, self.k = e, k
        self.wg = torch.nn.Parameter(torch.randn(h, e, device=DEV, dtype=BF) * 0.02)
        self.w1 = torch.nn.Parameter(torch.randn(e, 2 * f, h, device=DEV, dtype=BF) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(e, h, f, device=DEV, dtype=BF) * 0.02)

    def forward(self, x):
        n = x.shape[0]
        logits, topi, w, counts, pmean, z, _ = router_fwd(x, self.wg, self.k)
        self.last_counts = counts  # tokens per expert of the last forward (bench/torch_trainer.py)
        aux = self.e * ((counts.float() / (n * self.k)) * pmean).sum()
        flat = topi.flatten()
        order = torch.argsort(flat, stable=True)
        xp = x[order // self.k]
        offs = torch.cumsum(counts, 0).to(torch.int32)
        out = grouped_swiglu(xp, self.w1, self.w2, offs)
        y = torch.zeros_like(x)
        contrib = out * w.flatten()[order].unsqueeze(1).to(out.dtype)
        y.index_add_(0, order // self.k, contrib)
        return y, 0.01 * aux + 0.001 * z


def skew_routing(m, x, alpha):
    """bench_moe's skewed routing: a constant last feature of x and router weights in its row
    of -alpha * tau * ln(1 + e), tau = 0.02 sqrt(H) the spread of the other logits (x and the
    weights N(0, 1) and N(0, 0.02^2)); returns the busiest expert's load over the mean."""
    h, e = m.wg.shape
    tau = 0.02 * h**0.5
    with torch.no_grad():
        m.wg[h - 1] = (-alpha * tau * torch.log1p(torch.arange(e, device=DEV))).to(BF)
        x[:, h - 1] = 1.0
        counts = router_fwd(x, m.wg, m.k)[3].float()
    return (counts.max() / counts.mean()).item()


def bench_layer():
    # the skew's alpha a shape, as bench_moe's
    for (n, h, f, e, k), alpha in zip([(16384, 4096, 1408, 64, 2), (16384, 2048, 8192, 8, 2),
                                       (32768, 4096, 14336, 8, 2)], [0.08, 0.4, 0.4]):
        shape = f"N={n} H={h} F={f} E={e} K={k}"
        m = TorchMoE(h, f, e, k)
        x = torch.randn(n, h, device=DEV, dtype=BF, requires_grad=True)
        dy = torch.randn(n, h, device=DEV, dtype=BF)

        def step(i):  # a training step's share: grads set to None (the default), fwd, bwd
            m.zero_grad(set_to_none=True)
            x.grad = None
            y, loss = m(x)
            torch.autograd.backward([y, loss], [dy, torch.ones_like(loss)])

        ms = median_ms(step, 2, 10)
        emit("layer_fwd_bwd", shape, "eager", ms)
        with torch.no_grad():
            ms_fwd = median_ms(lambda i: m(x), 2, 10)
        emit("layer_fwd", shape, "eager", ms_fwd)
        # again after SUSTAIN_MS of steps, at the clock the power cap holds the GPU to (bench_moe)
        ms = median_ms(step, int(SUSTAIN_MS / ms) + 2, 20)
        emit("layer_fwd_bwd_sustained", shape, "eager", ms)
        ratio = skew_routing(m, x, alpha)
        ms = median_ms(step, 2, 10)
        emit("layer_fwd_bwd", shape + " skewed", "eager", ms, max_over_mean=round(ratio, 2))
        with torch.no_grad():
            ms_fwd = median_ms(lambda i: m(x), 2, 10)
        emit("layer_fwd", shape + " skewed", "eager", ms_fwd, max_over_mean=round(ratio, 2))
        del m, x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    parts = {"ceilings": ceilings, "router": bench_router, "experts": bench_experts,
             "layer": bench_layer}
    for name, fn in parts.items():
        if what in ("all", name):
            try:
                fn()
            except Exception as exc:  # report and go on: one failure must not hide the rest
                print(json.dumps({"impl": "torch", "bench": name, "error": repr(exc)}), flush=True)
            torch.cuda.empty_cache()
