"""The Python side's cost per training step (discard_grad, forward, backward with dx) on the
host backend, at a shape so small that libmoe's own work is a few microseconds:
  libmoe.Layer on array.array buffers and on torch tensors, and MoELayer (when PyTorch is
  installed), each minus the same three C calls made through ctypes with prebuilt
  descriptors (the floor), and an autograd Function that does nothing (PyTorch's own share).
Medians of 5 runs of 3,000 steps, in µs. --profile adds cProfile's top functions of each.
Usage: MOE_LIBRARY=<build>/libmoe.so PYTHONPATH=python python3 bench/python/host_overhead.py
       [--profile]
Shapes: N tokens, H hidden, F expert FFN width, E experts, K top-k."""
import array
import ctypes as C
import cProfile
import pstats
import sys
import time

import libmoe
from libmoe.tensor import rows_of

N, H, F, E, K = 4, 8, 8, 4, 2
REPS = 3000
PROFILE = "--profile" in sys.argv[1:]


def median_us(step):
    step()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(REPS):
            step()
        runs.append((time.perf_counter() - t) / REPS * 1e6)
    return sorted(runs)[2]


def profile(name, step):
    if PROFILE:
        print(f"--- cProfile: {name}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)


def main():
    rt = libmoe.Runtime("host", seed=1)
    layer = libmoe.Layer(rt, hidden=H, ffn_hidden=F, num_experts=E, top_k=K)
    x = array.array("f", [0.1 * (i % 7) for i in range(N * H)])
    y, dy, dx = (array.array("f", bytes(4 * N * H)) for _ in range(3))

    def buffer_step():
        layer.discard_grad()
        layer.forward(x, y)
        layer.backward(dy, dx)

    descs = [rows_of(libmoe.as_tensor(a)[0], H) for a in (x, y, dy, dx)]
    raw, ptr = libmoe.library().cdll, C.c_void_p(layer.ptr)
    xd, yd, dyd, dxd = (C.byref(d) for d in descs)

    def floor_step():
        raw.moe_layer_discard_grad(ptr)
        raw.moe_layer_forward(ptr, 0, xd, yd)
        raw.moe_layer_backward(ptr, 0, dyd, dxd)

    floor = median_us(floor_step)
    t = median_us(buffer_step)
    print(f"C calls alone {floor:.1f} us; libmoe.Layer on array.array {t:.1f} us "
          f"(wrapper {t - floor:.1f} us)")
    profile("libmoe.Layer on array.array", buffer_step)
    try:
        import torch
        from libmoe.torch import MoELayer
    except ImportError:
        return
    tx, ty, tdy, tdx = (torch.zeros(N, H) for _ in range(4))

    def tensor_step():
        layer.discard_grad()
        layer.forward(tx, ty)
        layer.backward(tdy, tdx)

    t = median_us(tensor_step)
    print(f"libmoe.Layer on torch tensors {t:.1f} us (wrapper {t - floor:.1f} us)")
    m = MoELayer(H, F, E, K, runtime=rt)
    xg = torch.randn(N, H, requires_grad=True)
    ones = torch.ones(N, H)

    def module_step():
        m(xg).backward(ones)

    t = median_us(module_step)

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *params):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            return (torch.empty_like(g), *(None for _ in m._trainable))

    def nothing_step():
        Nothing.apply(xg.reshape(-1, H), *m._trainable).backward(ones)

    nothing = median_us(nothing_step)
    print(f"MoELayer {t:.1f} us (torch {torch.__version__}; wrapper {t - floor:.1f} us, of "
          f"which an empty autograd Function {nothing:.1f} us)")
    profile("MoELayer", module_step)


if __name__ == "__main__":
    main()
