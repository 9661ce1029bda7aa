"""The MoE layer (include/moe/layer.h): forward/backward per microbatch slot, parameters and
gradients by name, statistics of the last forward.

Shapes: N tokens (this rank), H hidden, E experts, K top-k, F expert FFN width.
"""
import ctypes as C
import dataclasses

from . import _native
from . import _structs as S
from ._config import as_dict, fill, record, record_type
from ._handle import Handle
from .enums import ParamKind
from .errors import ArgumentError
from .tensor import ActivationDescriptors, Tensor

LayerStats = record_type(
    "LayerStats", S.LayerStats, extra=("tokens_per_expert",),
    doc="Statistics of the layer's most recent forward (moe_layer_stats_t): tokens, slots, "
        "dropped_slots, dropped_ratio, max_load, mean_load, entropy, aux_loss, z_loss, "
        "capacity, and tokens_per_expert (E accepted slots per expert).")


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter shard (moe_param_info_t): value and grad are views of libmoe's buffers
    (grad is None for buffers such as the expert bias)."""
    name: str
    kind: ParamKind
    value: Tensor
    grad: object
    global_shape: tuple
    shard_offset: tuple
    expert_dim: int
    tp_dim: int
    expert_ids: tuple = ()  # global expert id of each index along expert_dim


def param_from_info(info, owner, expert_ids=()):
    """A Param of views into owner's (a layer's or an optimizer's) buffers."""
    nd = info.value.ndim
    value = Tensor(S.Tensor.from_buffer_copy(info.value), owner=owner)
    grad = None
    if info.grad.data:
        grad = Tensor(S.Tensor.from_buffer_copy(info.grad), owner=owner)
    return Param(info.name.decode(), ParamKind(info.kind), value, grad,
                 tuple(info.global_shape[:nd]), tuple(info.shard_offset[:nd]), info.expert_dim,
                 info.tp_dim, tuple(expert_ids))


class Layer(Handle):
    """A libmoe MoE layer on a runtime. Keyword arguments are moe_layer_config_t fields with
    the C defaults (hidden, ffn_hidden, num_experts, top_k required; score_fn "softmax" |
    "sigmoid", renormalize, capacity_factor, aux_loss_coef, z_loss_coef, expert_bias,
    expert_bias_rate, max_microbatches, placement "contiguous" | "round_robin", a2a_chunks,
    init_std, aux_global_batch). init_stream picks the stream of the runtime seed that draws
    the initial values (moe_layer_create_seeded; give each layer of a model its own).
    Creating it is collective over the runtime's mesh."""

    kind = "layer"

    def __init__(self, runtime, init_stream=0, **config):
        lib = _native.lib()
        cfg = fill(lib.moe_layer_config_default(), config, "Layer")
        ptr = C.c_void_p()
        if init_stream:  # its own initial values (moe_layer_create_seeded)
            lib.moe_layer_create_seeded(runtime.ptr, C.byref(cfg), init_stream, C.byref(ptr))
        else:
            lib.moe_layer_create(runtime.ptr, C.byref(cfg), C.byref(ptr))
        super().__init__(ptr.value, lib.moe_layer_destroy, parent=runtime)
        self._lib = lib
        self.runtime = runtime
        self.config = as_dict(cfg)
        self.hidden = cfg.hidden
        self.num_experts = cfg.num_experts
        count = C.c_int32()
        lib.moe_layer_num_params(self.ptr, C.byref(count))
        self.local_experts = 0
        params = []
        for i in range(count.value):
            info = S.ParamInfo(struct_size=C.sizeof(S.ParamInfo))
            lib.moe_layer_param(self.ptr, i, C.byref(info))
            ids = ()
            if info.expert_dim >= 0:
                self.local_experts = info.value.shape[info.expert_dim]
                ids = tuple(self.expert_id(e) for e in range(self.local_experts))
            params.append(param_from_info(info, self, ids))
        self.params = {p.name: p for p in params}
        self._slot_rows = {}  # slot -> N of the forward saved there, checked by backward
        # a DLPack producer is asked to order its work before the runtime's stream
        self._acts = ActivationDescriptors(self.hidden, lambda: runtime.stream or -1,
                                           dtype=runtime.compute_dtype, device=runtime.device,
                                           device_index=runtime.device_index)
        self._forward, self._backward = lib.moe_layer_forward, lib.moe_layer_backward

    # ---- compute ---------------------------------------------------------------------------

    def forward(self, x, y=None, slot=0):
        """y[N,H] = layer(x[N,H]); saves what backward needs under slot. y None allocates a
        libmoe tensor (pass y to avoid an allocation per call). Enqueued on the runtime's
        stream (CUDA). Returns y."""
        ptr = self.ptr  # a closed layer says so before its arguments are looked at
        get = self._acts.get
        xd, keep_x, n = get(x, "x")
        if y is None:
            y = self.runtime.tensor((n, self.hidden))
        yd, keep_y, _ = get(y, "y", writable=True, rows=n)
        self._forward(ptr, slot, xd, yd)
        self._slot_rows[slot] = n
        del keep_x, keep_y
        return y

    def backward(self, dy, dx=None, slot=0, need_dx=True):
        """Backward of the forward saved in slot: accumulates the parameter gradients (the
        aux and z loss terms included), frees the slot and returns dx[N,H] (allocated when
        None; need_dx=False skips it and returns None)."""
        ptr = self.ptr
        get = self._acts.get
        dyd, keep_dy, n = get(dy, "dy", rows=self._slot_rows.get(slot))
        dxd, keep_dx = None, None
        if need_dx:
            if dx is None:
                dx = self.runtime.tensor((n, self.hidden))
            dxd, keep_dx, _ = get(dx, "dx", writable=True, rows=n)
        self._backward(ptr, slot, dyd, dxd)
        self._slot_rows.pop(slot, None)
        del keep_dy, keep_dx
        return dx if need_dx else None

    def release_slot(self, slot=0):
        self._lib.moe_layer_release_slot(self.ptr, slot)
        self._slot_rows.pop(slot, None)

    def zero_grad(self):
        self._lib.moe_layer_zero_grad(self.ptr)

    def discard_grad(self):
        """Mark the gradients zero without touching them: the next backward writes them."""
        self._lib.moe_layer_discard_grad(self.ptr)

    # ---- parameters and statistics -------------------------------------------------------------

    def param(self, name):
        """The value (a view of libmoe's buffer) of the named parameter."""
        return self._param(name).value

    def grad(self, name):
        """The f32 gradient (a view) of the named parameter; None for buffers."""
        return self._param(name).grad

    def _param(self, name):
        try:
            return self.params[name]
        except KeyError:
            raise ArgumentError(f"the layer has no parameter {name!r}; it has "
                                f"{', '.join(self.params)}") from None

    def expert_id(self, local_expert):
        out = C.c_int32()
        self._lib.moe_layer_expert_id(self.ptr, local_expert, C.byref(out))
        return out.value

    def stats(self):
        """LayerStats of the most recent forward."""
        st = S.LayerStats(struct_size=C.sizeof(S.LayerStats))
        counts = (C.c_int64 * self.num_experts)()
        self._lib.moe_layer_stats(self.ptr, C.byref(st), counts)
        return record(LayerStats, st, tokens_per_expert=tuple(counts))
