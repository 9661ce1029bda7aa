"""The bundled trainer's model in PyTorch eager, for bench/results/trainer.md (JSON lines).

The same byte-level MoE language model as examples/trainer/model.h: embedding + position
embedding, L x (RMSNorm -> causal multi-head attention (SDPA) -> residual -> RMSNorm -> MoE
-> residual), RMSNorm, LM head, cross-entropy (+ each layer's aux and z terms). The MoE layer
is bench/torch_moe.py's TorchMoE (softmax top-k router, stable-sort permute, grouped_mm
SwiGLU, weighted combine: libmoe's math), called with bf16 copies of fp32 master weights.
Dense parts run under bf16 autocast with fp32 masters; AdamW (fused) on every parameter.

One training step = zero_grad, forward, backward, optimizer step on one batch of B sequences
of T random bytes (the speed does not depend on the bytes). Median of `iters` steps after
`warmup`, with CUDA events between the phases (forward, backward, optimizer).

    python3 bench/torch_trainer.py L H HEADS T E K F B [iters]
"""
import datetime
import json
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


class MasterMoE(torch.nn.Module):
    """TorchMoE with fp32 master weights: each forward runs it on bf16 copies (autograd
    carries the gradient back to the masters), as autocast does for the dense layers."""

    def __init__(self, h, f, e, k):
        super().__init__()
        self.moe = TorchMoE(h, f, e, k).float()

    def forward(self, x):
        params = {n: p.to(BF) for n, p in self.moe.named_parameters()}
        return torch.func.functional_call(self.moe, params, (x.to(BF),))


class Block(torch.nn.Module):
    def __init__(self, h, heads, f, e, k):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(h, eps=1e-5)
        self.wqkv = torch.nn.Linear(h, 3 * h, bias=False)
        self.wo = torch.nn.Linear(h, h, bias=False)
        self.norm2 = torch.nn.RMSNorm(h, eps=1e-5)
        self.moe = MasterMoE(h, f, e, k)

    def forward(self, x):
        b, t, h = x.shape
        qkv = self.wqkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, T, d]
        o = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
        h1 = x + self.wo(o.transpose(1, 2).reshape(b, t, h))
        y, aux = self.moe(self.norm2(h1).reshape(b * t, h))
        return h1 + y.view(b, t, h).to(h1.dtype), aux


class Model(torch.nn.Module):
    def __init__(self, layers, h, heads, t, f, e, k):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, h)
        self.pos = torch.nn.Parameter(torch.randn(t, h))
        self.blocks = torch.nn.ModuleList(Block(h, heads, f, e, k) for _ in range(layers))
        self.norm_f = torch.nn.RMSNorm(h, eps=1e-5)
        self.head = torch.nn.Linear(h, VOCAB, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos
        extra = 0
        for blk in self.blocks:
            x, aux = blk(x)
            extra = extra + aux
        logits = self.head(self.norm_f(x)).float()
        return Fn.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)) + extra


def main():
    args = [int(a) for a in sys.argv[1:]]
    layers, h, heads, t, e, k, f, batch = args[:8]
    iters = args[8] if len(args) > 8 else 20
    torch.manual_seed(0)
    model = Model(layers, h, heads, t, f, e, k).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    tokens = torch.randint(0, VOCAB, (batch, t), device=DEV)
    targets = torch.randint(0, VOCAB, (batch, t), device=DEV)
    times = {"step": [], "forward": [], "backward": [], "optimizer": []}
    for i in range(5 + iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=BF):
            loss = model(tokens, targets)
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt.step()
        ev[3].record()
        ev[3].synchronize()
        if i >= 5:
            times["forward"].append(ev[0].elapsed_time(ev[1]))
            times["backward"].append(ev[1].elapsed_time(ev[2]))
            times["optimizer"].append(ev[2].elapsed_time(ev[3]))
            times["step"].append(ev[0].elapsed_time(ev[3]))
    med = {n: statistics.median(v) for n, v in times.items()}
    shape = f"L={layers} H={h} heads={heads} T={t} E={e} K={k} F={f} B={batch}"
    rec = {"impl": "torch " + torch.__version__, "bench": "trainer_step", "shape": shape,
           "variant": "eager", "ms": round(med["step"], 3),
           "tokens_per_s": round(batch * t / med["step"] * 1e3, 1),
           "phases_ms": {n: round(med[n], 3) for n in ("forward", "backward", "optimizer")},
           "loss": round(float(loss), 4), "gpu": torch.cuda.get_device_name(0),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
