"""The bundled trainer's model and training step in PyTorch, for bench/results/trainer.md.

The same byte-level MoE language model as examples/trainer/model.h: embedding + position
embedding, L x (RMSNorm -> causal multi-head attention (SDPA) -> residual -> RMSNorm -> MoE
-> residual), RMSNorm, LM head, cross-entropy (+ each layer's aux and z terms). The MoE layer
is bench/torch_moe.py's TorchMoE (softmax top-k router, stable-sort permute, grouped_mm
SwiGLU, weighted combine: libmoe's math), called with bf16 copies of fp32 master weights.
Dense parts run under bf16 autocast with fp32 masters.

Read from the trainer's effective config (`moe_train --config X --print-config`), so both
sides train the same thing:
- the data: the corpus of `data.paths` read as data.c reads it (files in path order, folders
  in name order, dot files and links inside folders skipped), the same held-out tail, and the
  batch of step t the trainer's (sequence g starts where data.c's counter-based generator of
  (seed, t, g) puts it): the same bytes, step for step;
- the initial distributions (not the values): weights N(0, init_std^2), the output
  projection's init_std / sqrt(2L), embeddings N(0, 1), norm gains 1;
- the optimizer: AdamW (fused) with the config's lr, betas, eps and weight decay on every
  parameter, the global gradient norm clipped to optim.grad_clip (foreach), the lr schedule
  of src/optim/schedule.c (linear warm-up, then constant, linear or cosine to train.steps).

One step = forward, loss, backward, clipping, optimizer step, zero_grad. Median of the steps
after `--warmup` (the rest of train.steps), with CUDA events between the phases; each MoE
layer's forward is timed between events too (its share of the forward), and its load (the
busiest expert's slots over the mean) is read after the step. `--compile` runs the model
under torch.compile (the default mode); a failure to compile is printed as a record with
"error". MFU with the trainer's model FLOPs (examples/trainer/model.c) over --peak TFLOP/s.

    python3 bench/torch_trainer.py effective.json [--compile] [--warmup 5] [--peak 774]
"""
import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as Fn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_moe import TorchMoE  # noqa: E402  (the MoE layer bench_moe is compared with)

DEV = "cuda"
BF = torch.bfloat16
VOCAB = 256
MASK = (1 << 64) - 1


# ---- the trainer's data (examples/trainer/data.c) -------------------------------------------

def read_corpus(paths):
    out = bytearray()

    def add(path, top):
        if os.path.islink(path) and not top:
            return  # the target is read under its own name
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out.extend(f.read())
        elif os.path.isdir(path):
            for name in sorted(n for n in os.listdir(path) if not n.startswith(".")):
                add(os.path.join(path, name), False)
        elif not os.path.exists(path):
            raise SystemExit(f"data.paths: {path}: no such file or directory")

    for p in paths:
        add(p, True)
    return bytes(out)


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK
    return z ^ (z >> 31)


def train_batch(corpus, train_size, seed, step, batch, t):
    """data.c's corpus_train_sequence for sequences 0..batch-1 of step `step` (1-based)."""
    span = train_size - t
    key = mix64(seed ^ 0x5eedda7a)
    tok, tgt = bytearray(), bytearray()
    for g in range(batch):
        r = mix64(key ^ mix64((step * 0x9e3779b97f4a7c15 + g) & MASK))
        at = r % span
        tok += corpus[at:at + t]
        tgt += corpus[at + 1:at + t + 1]
    as_tensor = lambda b: torch.frombuffer(bytes(b), dtype=torch.uint8).long().view(batch, t)  # noqa: E731
    return as_tensor(tok), as_tensor(tgt)


def resolve_width_defaults(m, o):
    """A 0 in model.init_std or optim.lr means the width's default (--print-config keeps the 0):
    examples/trainer/config.c's trainer_init_std and trainer_lr."""
    h = m["hidden"]
    if m["init_std"] <= 0:
        m["init_std"] = math.sqrt(2.0 / (5.0 * h))
    if o["lr"] <= 0:
        o["lr"] = 3e-3 * min(1.0, math.sqrt(256.0 / h))


def lr_rate(o, steps, step):
    """src/optim/schedule.c's moe_lr_schedule_rate for 1-based `step`."""
    lr, warm = o["lr"], o["warmup_steps"]
    if step <= warm:
        return lr * step / warm
    if o["decay"] == "constant":
        return lr
    p = min(1.0, (step - warm) / (steps - warm))
    lo = o["min_lr_ratio"] * lr
    return lr - (lr - lo) * p if o["decay"] == "linear" else lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * p))


# ---- the model ------------------------------------------------------------------------------

class MasterMoE(torch.nn.Module):
    """TorchMoE with fp32 master weights: each forward runs it on bf16 copies (autograd
    carries the gradient back to the masters), as autocast does for the dense layers."""

    def __init__(self, h, f, e, k, std):
        super().__init__()
        self.moe = TorchMoE(h, f, e, k).float()
        with torch.no_grad():
            for p in self.moe.parameters():
                p.normal_(0, std)

    def forward(self, x):
        params = {n: p.to(BF) for n, p in self.moe.named_parameters()}
        return torch.func.functional_call(self.moe, params, (x.to(BF),))


class Block(torch.nn.Module):
    def __init__(self, h, heads, f, e, k, std, std_out):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(h, eps=1e-5)
        self.wqkv = torch.nn.Linear(h, 3 * h, bias=False)
        self.wo = torch.nn.Linear(h, h, bias=False)
        self.norm2 = torch.nn.RMSNorm(h, eps=1e-5)
        self.moe = MasterMoE(h, f, e, k, std)
        with torch.no_grad():
            self.wqkv.weight.normal_(0, std)
            self.wo.weight.normal_(0, std_out)
        self.events = None  # (start, end) CUDA events around the MoE call, when timed

    def forward(self, x):
        b, t, h = x.shape
        qkv = self.wqkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, T, d]
        o = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
        h1 = x + self.wo(o.transpose(1, 2).reshape(b, t, h))
        xb = self.norm2(h1).reshape(b * t, h)
        if self.events:
            self.events[0].record()
        y, aux = self.moe(xb)
        if self.events:
            self.events[1].record()
        return h1 + y.view(b, t, h).to(h1.dtype), aux


class Model(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        L, h, std = m["layers"], m["hidden"], m["init_std"]
        self.embed = torch.nn.Embedding(VOCAB, h)  # N(0, 1), the trainer's embedding std
        self.pos = torch.nn.Parameter(torch.randn(m["context"], h))
        self.blocks = torch.nn.ModuleList(
            Block(h, m["heads"], m["ffn_hidden"], m["experts"], m["top_k"], std,
                  std / math.sqrt(2 * L)) for _ in range(L))
        self.norm_f = torch.nn.RMSNorm(h, eps=1e-5)
        self.head = torch.nn.Linear(h, VOCAB, bias=False)
        with torch.no_grad():
            self.head.weight.normal_(0, std)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos
        extra = 0
        for blk in self.blocks:
            x, aux = blk(x)
            extra = extra + aux
        logits = self.head(self.norm_f(x)).float()
        return Fn.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)) + extra


def model_flops_per_token(m):
    """examples/trainer/model.c's model_flops_per_token."""
    h, t = m["hidden"], m["context"]
    per_block = 4 * h * h + h * m["experts"] + m["top_k"] * 3 * h * m["ffn_hidden"]
    return 6 * (m["layers"] * per_block + h * VOCAB) + 6 * m["layers"] * 2 * t * h


# ---- the step -------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config", help="the trainer's effective config (moe_train --print-config)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak", type=float, default=774.0, help="TFLOP/s for MFU")
    a = ap.parse_args()
    c = json.load(open(a.config))
    m, tr, o, d = c["model"], c["train"], c["optim"], c["data"]
    resolve_width_defaults(m, o)
    L, batch, T, steps = m["layers"], tr["batch"], m["context"], tr["steps"]
    shape = (f"L={L} H={m['hidden']} heads={m['heads']} T={T} E={m['experts']} "
             f"K={m['top_k']} F={m['ffn_hidden']} B={batch}")
    variant = "compiled" if a.compile else "eager"
    rec = {"impl": "torch " + torch.__version__, "bench": "trainer_step", "shape": shape,
           "variant": variant, "gpu": torch.cuda.get_device_name(0),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
    corpus = read_corpus(d["paths"])
    train_size = len(corpus) - int(len(corpus) * d["val_fraction"])

    torch.manual_seed(tr["seed"])
    model = Model(m).to(DEV)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                            weight_decay=o["weight_decay"], fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_rate(o, steps, i + 1) / o["lr"])
    run = torch.compile(model) if a.compile else model
    for blk in model.blocks:  # the MoE layers' events stay out of the compiled graph
        blk.events = None if a.compile else [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = {n: [] for n in ("step", "forward", "backward", "optimizer", "moe_forward")}
    loads = [[] for _ in range(L)]
    n_slots = batch * T * m["top_k"]
    for step in range(1, steps + 1):
        tokens, targets = (x.to(DEV, non_blocking=True) for x in
                           train_batch(corpus, train_size, tr["seed"], step, batch, T))
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        try:
            with torch.autocast("cuda", dtype=BF):
                loss = run(tokens, targets)
        except Exception as exc:  # torch.compile's failures surface at the first call
            rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(json.dumps(rec), flush=True)
            return
        ev[1].record()
        loss.backward()
        ev[2].record()
        if o["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, o["grad_clip"], foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        ev[3].synchronize()
        if step <= a.warmup:
            continue
        times["forward"].append(ev[0].elapsed_time(ev[1]))
        times["backward"].append(ev[1].elapsed_time(ev[2]))
        times["optimizer"].append(ev[2].elapsed_time(ev[3]))
        times["step"].append(ev[0].elapsed_time(ev[3]))
        if not a.compile:
            times["moe_forward"].append(sum(b.events[0].elapsed_time(b.events[1])
                                            for b in model.blocks))
        for i, blk in enumerate(model.blocks):
            counts = getattr(blk.moe.moe, "last_counts", None)
            if counts is not None:
                loads[i].append(float(counts.max()) * m["experts"] / n_slots)
    med = {n: statistics.median(v) for n, v in times.items() if v}
    rec.update({"ms": round(med["step"], 3), "steps": len(times["step"]),
                "tokens_per_s": round(batch * T / med["step"] * 1e3, 1),
                "mfu": round(model_flops_per_token(m) * batch * T / (med["step"] * 1e-3)
                             / (a.peak * 1e12), 4),
                "phases_ms": {n: round(med[n], 3)
                              for n in ("forward", "backward", "optimizer", "moe_forward") if n in med},
                "max_over_mean": [round(statistics.median(v), 2) if v else None for v in loads],
                "loss": round(float(loss), 4)})
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
