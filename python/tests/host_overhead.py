"""Python-side cost per fwd+bwd step on the host backend at a tiny shape: the wrapper's step
minus the same C calls made with prebuilt descriptors (the floor). Also cProfile of the step."""
import array, ctypes as C, cProfile, pstats, sys, time
import libmoe
from libmoe import _structs as S
N, H, F, E, K = 4, 8, 8, 4, 2
REPS = 3000
rt = libmoe.Runtime("host", seed=1)
layer = libmoe.Layer(rt, hidden=H, ffn_hidden=F, num_experts=E, top_k=K)
x = array.array("f", [0.1 * (i % 7) for i in range(N * H)])
y, dy, dx = (array.array("f", bytes(4 * N * H)) for _ in range(3))
def step():
    layer.discard_grad(); layer.forward(x, y); layer.backward(dy, dx)
lib = libmoe.library()
xd, _ = libmoe.as_tensor(x); yd, _ = libmoe.as_tensor(y); dyd, _ = libmoe.as_tensor(dy); dxd, _ = libmoe.as_tensor(dx)
xd, yd, dyd, dxd = (libmoe.tensor.rows_of(d, H) for d in (xd, yd, dyd, dxd))
raw = lib.cdll
ptr = layer.ptr
def floor():
    raw.moe_layer_discard_grad(C.c_void_p(ptr)); raw.moe_layer_forward(C.c_void_p(ptr), 0, C.byref(xd), C.byref(yd)); raw.moe_layer_backward(C.c_void_p(ptr), 0, C.byref(dyd), C.byref(dxd))
def med(f):
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(REPS): f()
        ts.append((time.perf_counter() - t) / REPS * 1e6)
    return sorted(ts)[2]
for f in (step, floor): f()
a, b = med(step), med(floor)
print(f"libmoe.Layer step {a:.1f} us, C calls alone {b:.1f} us, wrapper {a-b:.1f} us")
try:
    import torch
    from libmoe.torch import MoELayer
    m = MoELayer(H, F, E, K, runtime=rt)
    xt = torch.randn(N, H, requires_grad=True)
    def mstep():
        y = m(xt); y.backward(torch.ones_like(y))
    mstep()
    c = med(mstep)
    tx, ty, tdy, tdx = (torch.zeros(N, H) for _ in range(4))
    def tstep():
        layer.discard_grad(); layer.forward(tx, ty); layer.backward(tdy, tdx)
    tstep()
    t = med(tstep)
    print(f"libmoe.Layer step on torch tensors {t:.1f} us, wrapper {t-b:.1f} us")
    # the torch-only floor: an autograd Function that does nothing but allocate like MoELayer
    class Nop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *p):
            ctx.save_for_backward(*p); return torch.empty_like(x)
        @staticmethod
        def backward(ctx, dy): return (torch.empty_like(dy),) + tuple(torch.empty_like(q) for q in ctx.saved_tensors)
    ps = list(m.parameters())
    def nstep():
        y = Nop.apply(xt.reshape(-1, H), *ps); y.backward(torch.ones_like(y))
    nop = med(nstep)
    print(f"MoELayer step {c:.1f} us (torch {torch.__version__}), over the C calls {c-b:.1f} us; an empty autograd Function step {nop:.1f} us")
    if "--profile" in sys.argv:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(2000): mstep()
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
except ImportError:
    pass
if "--profile" in sys.argv:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(2000): step()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
