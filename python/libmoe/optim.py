"""AdamW (include/moe/optim.h): fp32 master weights and moments over layer and user parameters,
with the data-parallel gradient all-reduce."""
import ctypes as C

from . import _native
from . import _structs as S
from ._config import fill
from ._handle import Handle
from .enums import LrDecay, ParamKind, Status, to_enum
from .errors import Error
from .layer import param_from_info
from .tensor import as_tensor, check

LR_CONFIGURED = -1.0  # MOE_ADAMW_LR_CONFIGURED: the configured rate through the schedule


def _schedule(decay, warmup_steps, decay_steps, min_lr_ratio):
    return S.LrSchedule(decay=int(to_enum(LrDecay, decay)), warmup_steps=warmup_steps,
                        decay_steps=decay_steps, min_lr_ratio=min_lr_ratio)


def lr_schedule_rate(lr, step, decay="constant", warmup_steps=0, decay_steps=0,
                     min_lr_ratio=0.0):
    """The rate of step (1-based) under a schedule (moe_lr_schedule_rate); raises
    Error(INVALID_ARGUMENT) for an invalid schedule, rate or step."""
    s = _schedule(decay, warmup_steps, decay_steps, min_lr_ratio)
    rate = _native.lib().moe_lr_schedule_rate(C.byref(s), lr, step)
    if rate < 0:
        raise Error(Status.INVALID_ARGUMENT, f"lr {lr} at step {step} under {decay} decay "
                    f"(warmup {warmup_steps}, decay {decay_steps}, min ratio {min_lr_ratio}) "
                    "is invalid: optim.h gives the rules", "moe_lr_schedule_rate")
    return rate


class AdamW(Handle):
    """Keyword arguments are moe_adamw_config_t fields with the C defaults (lr, beta1, beta2,
    eps, weight_decay). Registered layers and parameters stay alive while the optimizer lives,
    and closing a registered layer closes the optimizer first."""

    kind = "optimizer"

    def __init__(self, runtime, **config):
        lib = _native.lib()
        cfg = fill(lib.moe_adamw_config_default(), config, "AdamW")
        ptr = C.c_void_p()
        lib.moe_adamw_create(runtime.ptr, C.byref(cfg), C.byref(ptr))
        self._registered = []  # what libmoe keeps pointers into
        self._layers = {}      # C handle -> registered Layer, for state_owner
        super().__init__(ptr.value, lib.moe_adamw_destroy, parent=runtime,
                         keep=(self._registered,))
        self._lib = lib
        self.runtime = runtime
        self.lr = cfg.lr

    def add_layer(self, layer, prefix=None):
        """Register every trainable parameter of layer as prefix + name."""
        self._lib.moe_adamw_add_layer(self.ptr, layer.ptr,
                                      None if prefix is None else prefix.encode())
        self._registered.append(layer)
        self._layers[layer.ptr] = layer
        layer._adopt(self._finalizer)  # destroyed before the layer

    def add_param(self, name, value, grad, kind="dense"):
        """Register a caller-owned parameter: value in the compute dtype, grad f32, equal
        shapes, on the runtime's device. libmoe keeps pointers to both: they stay referenced
        here and must not be reallocated."""
        rt = self.runtime
        v, keep_v = as_tensor(value, "value", writable=True)
        g, keep_g = as_tensor(grad, "grad", writable=True)
        check(v, "value", dtype=rt.compute_dtype, device=rt.device, device_index=rt.device_index)
        check(g, "grad", dtype="f32", device=rt.device, device_index=rt.device_index,
              shape=tuple(v.shape[i] for i in range(v.ndim)))
        self._lib.moe_adamw_add_param(self.ptr, name.encode(), int(to_enum(ParamKind, kind)),
                                      C.byref(v), C.byref(g))
        self._registered.extend((keep_v, keep_g))

    def start_grad_sync(self, layer=None):
        """Start the data-parallel all-reduce of layer's gradients (None: all not started)."""
        self._lib.moe_adamw_start_grad_sync(self.ptr, None if layer is None else layer.ptr)

    def step(self, lr=None, grad_scale=1.0):
        """One update of every registered parameter; lr None uses the configured rate.
        Collective with a mesh."""
        self._lib.moe_adamw_step(self.ptr, LR_CONFIGURED if lr is None else lr, grad_scale)

    @property
    def step_count(self):
        steps = C.c_int64()
        self._lib.moe_adamw_step_count(self.ptr, C.byref(steps))
        return steps.value

    @step_count.setter
    def step_count(self, steps):
        self._lib.moe_adamw_set_step_count(self.ptr, steps)

    def set_grad_clip(self, max_grad_norm):
        """Clip the global gradient norm to max_grad_norm (inf: measure only; 0: off)."""
        self._lib.moe_adamw_set_grad_clip(self.ptr, max_grad_norm)

    def set_lr_schedule(self, decay="constant", warmup_steps=0, decay_steps=0, min_lr_ratio=0.0):
        """Warm-up, then constant, linear or cosine decay of the configured rate."""
        s = _schedule(decay, warmup_steps, decay_steps, min_lr_ratio)
        self._lib.moe_adamw_set_lr_schedule(self.ptr, C.byref(s))

    def last_step(self):
        """(lr, grad_norm) of the last step: the rate it used (0 before the first) and the
        global gradient norm before clipping (None when not measured: no grad clip set)."""
        lr, norm = C.c_float(), C.c_double()
        self._lib.moe_adamw_last_step(self.ptr, C.byref(lr), C.byref(norm))
        return lr.value, None if norm.value < 0 else norm.value

    def state_owner(self, index):
        """(kind, layer) of optimizer state index: DENSE or EXPERT, and the registered Layer
        it belongs to (None for a parameter from add_param)."""
        kind, layer = S.enum_t(), C.c_void_p()
        self._lib.moe_adamw_state_owner(self.ptr, index, C.byref(kind), C.byref(layer))
        return ParamKind(kind.value), self._layers.get(layer.value)

    def states(self):
        """The optimizer state for checkpoints: a Param per "<name>.master", ".exp_avg",
        ".exp_avg_sq" of every registered parameter, in registration order."""
        count = C.c_int32()
        self._lib.moe_adamw_num_states(self.ptr, C.byref(count))
        out = []
        for i in range(count.value):
            info = S.ParamInfo(struct_size=C.sizeof(S.ParamInfo))
            self._lib.moe_adamw_state(self.ptr, i, C.byref(info))
            out.append(param_from_info(info, self))
        return out
