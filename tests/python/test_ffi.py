"""FFI: load libmoe.so with ctypes, as a user of another language would, create a host
runtime and a layer, run forward, and check the output against a naive
y[t] = sum_k w[t,k] * FFN_e(x[t]) computed here from the layer's own parameters.

Usage: test_ffi.py PATH/TO/libmoe.so
"""
import ctypes as C
import math
import random
import sys

lib = C.CDLL(sys.argv[1])

MAX_DIMS = 4


class Tensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int), ("ndim", C.c_int32),
                ("shape", C.c_int64 * MAX_DIMS), ("device", C.c_int), ("device_index", C.c_int32)]


class RuntimeConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("backend", C.c_int), ("device_index", C.c_int32),
                ("deterministic", C.c_int32), ("seed", C.c_uint64), ("log_level", C.c_int),
                ("log_fn", C.c_void_p), ("log_user_data", C.c_void_p), ("mesh", C.c_void_p)]


class LayerConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("hidden", C.c_int64), ("ffn_hidden", C.c_int64),
                ("num_experts", C.c_int32), ("top_k", C.c_int32), ("score_fn", C.c_int),
                ("renormalize", C.c_int32), ("capacity_factor", C.c_float),
                ("aux_loss_coef", C.c_float), ("z_loss_coef", C.c_float),
                ("expert_bias", C.c_int32), ("expert_bias_rate", C.c_float),
                ("max_microbatches", C.c_int32), ("placement", C.c_int),
                ("a2a_chunks", C.c_int32), ("init_std", C.c_float),
                ("init_stream", C.c_uint64)]


class ParamInfo(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("name", C.c_char_p), ("kind", C.c_int),
                ("value", Tensor), ("grad", Tensor), ("global_shape", C.c_int64 * MAX_DIMS),
                ("shard_offset", C.c_int64 * MAX_DIMS), ("expert_dim", C.c_int32),
                ("tp_dim", C.c_int32)]


lib.moe_runtime_config_default.restype = RuntimeConfig
lib.moe_layer_config_default.restype = LayerConfig
lib.moe_last_error.restype = C.c_char_p
lib.moe_status_string.restype = C.c_char_p
lib.moe_version_string.restype = C.c_char_p


def ok(status):
    if status != 0:
        raise RuntimeError("%s: %s" % (lib.moe_status_string(status).decode(),
                                       lib.moe_last_error().decode()))


# the struct sizes the header promises match what ctypes lays out
assert lib.moe_runtime_config_default().struct_size == C.sizeof(RuntimeConfig)
assert lib.moe_layer_config_default().struct_size == C.sizeof(LayerConfig)

rc = lib.moe_runtime_config_default()
rc.backend = 1  # MOE_BACKEND_HOST
rt = C.c_void_p()
ok(lib.moe_runtime_create(C.byref(rc), C.byref(rt)))

N, H, F, E, K = 10, 6, 5, 4, 2
lc = lib.moe_layer_config_default()
lc.hidden, lc.ffn_hidden, lc.num_experts, lc.top_k = H, F, E, K
lc.init_std = 0.5
layer = C.c_void_p()
ok(lib.moe_layer_create(rt, C.byref(lc), C.byref(layer)))

# a failing call reports a status and a message instead of crashing
bad = LayerConfig.from_buffer_copy(lc)
bad.top_k = E + 1
status = lib.moe_layer_create(rt, C.byref(bad), C.byref(C.c_void_p()))
assert status == 1 and b"top_k is 5" in lib.moe_last_error(), lib.moe_last_error()


def param(i):
    info = ParamInfo()
    info.struct_size = C.sizeof(ParamInfo)
    ok(lib.moe_layer_param(layer, i, C.byref(info)))
    n = 1
    for d in range(info.value.ndim):
        n *= info.value.shape[d]
    return info.name.decode(), C.cast(info.value.data, C.POINTER(C.c_float))[:n]


names = [param(i)[0] for i in range(3)]
assert names == ["router.weight", "experts.w1", "experts.w2"], names
wg, w1, w2 = (param(i)[1] for i in range(3))

rng = random.Random(11)
x = (C.c_float * (N * H))(*[rng.gauss(0, 1) for _ in range(N * H)])
y = (C.c_float * (N * H))()
shape = (C.c_int64 * 2)(N, H)
xt, yt = Tensor(), Tensor()
ok(lib.moe_tensor_view(x, 0, 0, 2, shape, C.byref(xt)))
ok(lib.moe_tensor_view(y, 0, 0, 2, shape, C.byref(yt)))
ok(lib.moe_layer_forward(layer, 0, C.byref(xt), C.byref(yt)))


def naive(t):
    logits = [sum(x[t * H + c] * wg[c * E + e] for c in range(H)) for e in range(E)]
    m = max(logits)
    p = [math.exp(v - m) for v in logits]
    s = sum(p)
    p = [v / s for v in p]
    top = sorted(range(E), key=lambda e: (-p[e], e))[:K]
    wsum = sum(p[e] for e in top)
    out = [0.0] * H
    for e in top:
        act = []
        for j in range(F):
            g = sum(x[t * H + c] * w1[((e * H + c) * 2 + 0) * F + j] for c in range(H))
            u = sum(x[t * H + c] * w1[((e * H + c) * 2 + 1) * F + j] for c in range(H))
            act.append(g / (1 + math.exp(-g)) * u)
        for c in range(H):
            out[c] += p[e] / wsum * sum(act[j] * w2[(e * F + j) * H + c] for j in range(F))
    return out


ref = [v for t in range(N) for v in naive(t)]
num = sum((a - b) ** 2 for a, b in zip(y, ref))
den = sum(b * b for b in ref)
err = math.sqrt(num / den)
print("libmoe %s via ctypes: forward rel err vs naive Python %.2e" % (
    lib.moe_version_string().decode(), err))
assert den > 0 and err < 1e-5, err

ok(lib.moe_layer_destroy(layer))
ok(lib.moe_runtime_destroy(rt))
