"""libmoe.torch: libmoe's MoE layer as a PyTorch module on CUDA tensors (needs PyTorch; import it
on its own: `from libmoe.torch import MoELayer`).

    moe = MoELayer(hidden=4096, ffn_hidden=1408, num_experts=64, top_k=2)   # on cuda
    y = moe(x)                    # x [..., H] bf16 on the layer's GPU; autograd runs backward

On a host runtime (runtime=libmoe.Runtime("host")) the same module takes f32 CPU tensors: the
reference backend, for tests without a GPU.

Zero copies: the module's parameters (router.weight [H,E], experts.w1 [E,H,2,F],
experts.w2 [E,F,H], bf16 on CUDA) are torch tensors viewing libmoe's own buffers, so a PyTorch
optimizer's in-place update is libmoe's update, and load_state_dict writes into libmoe.
Every call runs on PyTorch's current stream (the runtime's stream is set per call), forward and
backward alike; the layer's backward adds the aux and z loss gradients itself (their values are
in stats()), so the loss given to backward() leaves them out.

Gradients, two ways (grads=):
  "torch"  (default) each backward returns the parameter gradients to autograd as bf16
           tensors, which accumulates them into p.grad for any torch.optim optimizer;
  "libmoe" they accumulate in libmoe's f32 buffers (libmoe_grad(name) views them) for
           libmoe's AdamW (adamw()), with fp32 master weights; p.grad stays None.
The module cannot be moved or cast (.to, .cuda, .float): its tensors are libmoe's memory.

torch.compile: with PyTorch 2.4 or later the layer is the custom operators libmoe::layer_forward
and libmoe::layer_backward while Dynamo traces, so torch.compile(model, fullgraph=True) keeps
each layer as one node of the graph; eager calls and older PyTorch use an autograd Function.
CUDA graphs cannot record the layer (its forward waits for the device once, for the routing
counts): called while the current stream is capturing, it raises Error(UNSUPPORTED).
"""
import itertools
import struct
import weakref

import torch

import libmoe

from .enums import Device, DType, ParamKind
from .runtime import CUDA_STREAM_LEGACY

# PyTorch's current CUDA stream as an address: the private call Inductor's generated code uses
# (no Stream object per call), else the public API
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)

# True while the current CUDA stream records a CUDA graph
_is_capturing = getattr(torch.cuda, "is_current_stream_capturing", lambda: False)
_CAPTURE_MESSAGE = (
    "libmoe's CUDA layer cannot be captured in a CUDA graph: its forward waits for the device "
    "once (the routing counts come to the host to size the expert GEMMs), so "
    "torch.compile(mode='reduce-overhead') and torch.cuda.graph cannot record it")

_CAI_TYPESTR = {DType.F32: "<f4", DType.BF16: "<i2"}  # bf16 is read back as int16, then viewed
_TORCH_DTYPE = {DType.F32: torch.float32, DType.BF16: torch.bfloat16}


class _Buffer:
    """A libmoe device tensor as a __cuda_array_interface__ PyTorch can import (torch.as_tensor
    holds a reference to this object, and so to the libmoe tensor and its layer)."""

    def __init__(self, t):
        self.tensor = t
        self.__cuda_array_interface__ = {
            "shape": t.shape, "typestr": _CAI_TYPESTR[t.dtype], "data": (t.data_ptr, False),
            "strides": None, "version": 2}


def torch_view(t):
    """A torch tensor viewing libmoe tensor t's memory (f32 or bf16, device or host), no copy;
    it keeps t, and so its layer, alive."""
    if t.device == Device.HOST:
        return torch.frombuffer(t.memoryview().cast("B"), dtype=_TORCH_DTYPE[t.dtype]) \
            .view(t.shape)
    view = torch.as_tensor(_Buffer(t), device=torch.device("cuda", t.device_index))
    return view.view(torch.bfloat16) if t.dtype == DType.BF16 else view


class _SlotToken(bytearray):
    """A microbatch slot holding a forward's saved state until its backward. The eager path
    keeps it on the autograd ctx as it is; the custom op hands it through a compiled graph as
    a CPU int64 tensor viewing its 16 bytes (int64 slot, int64 generation; as_tensor()). Whatever
    drops the last reference (the autograd graph freed, a forward under no_grad, the tensor's
    storage collected), the slot is released unless a backward consumed it: the generation
    tells a stale token from the slot's current holder."""

    def __init__(self, module, slot, generation):
        super().__init__()  # the bytes only where a tensor views them (as_tensor)
        self.module, self.slot, self.generation = module, slot, generation

    def as_tensor(self):
        self[:] = struct.pack("<qq", self.slot, self.generation)
        return torch.frombuffer(self, dtype=torch.int64)  # keeps the token alive, no copy

    def __del__(self):
        if self.module._held.get(self.slot) == self.generation:
            self.module._release(self.slot)


def _forward(module, x):
    """y = layer(x) for a dense [N, H] x on PyTorch's current stream, and the token of the
    slot holding its saved state."""
    module._use_current_stream()
    y = torch.empty_like(x)
    token = module._acquire()
    try:
        module.layer.forward(x, y, token.slot)
    except BaseException:
        module._release(token.slot)
        raise
    return y, token


def _backward(module, token, dy, need_dx, need_grads):
    """(dx or None, the parameters' gradients as autograd takes them, None where unneeded or
    with grads="libmoe") of the forward that token names; consumes the slot."""
    module._use_current_stream()
    dy = dy.contiguous()
    dx = torch.empty_like(dy) if need_dx else None
    slot = module._consume(token)
    to_torch = module.grads == "torch"
    try:
        if to_torch:  # libmoe's buffers then hold this backward's gradients alone
            module.layer.discard_grad()
        module.layer.backward(dy, dx, slot, need_dx=need_dx)
    finally:
        module._free.append(slot)  # backward frees the slot, also when it fails
    if not to_torch:
        return dx, module._no_grads
    # a copy also where the dtype matches: libmoe's buffers are rewritten by the next backward
    return dx, [g.to(p.dtype, copy=True) if need else None for g, p, need in
                zip(module._grad_views, module._trainable, need_grads)]


class _MoEFunction(torch.autograd.Function):
    """Eager autograd: the token lives on ctx, so a graph freed without a backward releases
    the slot."""

    @staticmethod
    def forward(ctx, x, module, *params):
        y, token = _forward(module, x)
        if any(ctx.needs_input_grad):
            ctx.token, ctx.module = token, module
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        dx, grads = _backward(ctx.module, ctx.token, dy, ctx.needs_input_grad[0],
                              ctx.needs_input_grad[2:])
        return (dx, None, *grads)


# ---- the custom op, for torch.compile ---------------------------------------------------------
# Where PyTorch has torch.library.custom_op (2.4 and later), the layer is also two operators,
# libmoe::layer_forward and libmoe::layer_backward, with fake implementations (shapes only) and
# the autograd formula registered, so a compiled graph holds them as single nodes instead of
# breaking at every layer. MoELayer uses them while torch.compile traces it, and the autograd
# Function above in eager mode, where it costs less per call. Operators take tensors and plain
# values only: a layer is named by its id in _MODULES, the slot by its token tensor.

_MODULES = weakref.WeakValueDictionary()  # op id -> MoELayer
_next_id = itertools.count(1)
HAS_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library,
                                                                "register_autograd")


if HAS_CUSTOM_OP:
    import inspect
    from typing import List, Tuple

    # Marked unsafe for CUDA graphs where PyTorch knows the tag (its graph partitioning then
    # leaves the operators out of mode="reduce-overhead"'s graphs): the forward waits for the
    # device, and both keep host state (the slots)
    _unsafe = getattr(getattr(torch, "Tag", None), "cudagraph_unsafe", None)
    _op_tags = {"tags": (_unsafe,)} if _unsafe is not None and "tags" in \
        inspect.signature(torch.library.custom_op).parameters else {}

    @torch.library.custom_op("libmoe::layer_forward", mutates_args=(), **_op_tags)
    def _op_forward(x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, op_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        y, token = _forward(_MODULES[op_id], x.contiguous())
        return y, token.as_tensor()

    @_op_forward.register_fake
    def _(x, router_weight, w1, w2, op_id):
        return torch.empty_like(x), torch.empty(2, dtype=torch.int64)

    @torch.library.custom_op("libmoe::layer_backward", mutates_args=(), **_op_tags)
    def _op_backward(dy: torch.Tensor, token: torch.Tensor, op_id: int,
                     need_dx: bool) -> List[torch.Tensor]:
        module = _MODULES[op_id]
        dx, grads = _backward(module, token, dy, need_dx, (True,) * len(module._trainable))
        # an operator returns tensors only, none aliasing another: empty ones stand for "none"
        return [dy.new_empty(0) if t is None else t for t in [dx, *grads]]

    @_op_backward.register_fake
    def _(dy, token, op_id, need_dx):
        module = _MODULES[op_id]
        # shapes from the parameters' metadata: under FakeTensorMode only dy makes tensors
        grads = [dy.new_empty(p.shape, dtype=p.dtype) if module.grads == "torch" else
                 dy.new_empty(0) for p in module._trainable]
        return [torch.empty_like(dy) if need_dx else dy.new_empty(0)] + grads

    def _setup_context(ctx, inputs, output):
        ctx.op_id = inputs[-1]
        ctx.save_for_backward(output[1])
        ctx.mark_non_differentiable(output[1])

    def _autograd_backward(ctx, dy, _dtoken):
        (token,) = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        out = torch.ops.libmoe.layer_backward(dy.contiguous(), token, ctx.op_id, need_dx)
        grads = [g if need and _MODULES[ctx.op_id].grads == "torch" else None
                 for g, need in zip(out[1:], ctx.needs_input_grad[1:4])]
        return (out[0] if need_dx else None, *grads, None)

    torch.library.register_autograd("libmoe::layer_forward", _autograd_backward,
                                    setup_context=_setup_context)


# True while torch.compile traces (Dynamo knows this function); absent before PyTorch 2.3
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _container(root, dotted):
    """The submodule that holds the last part of a dotted name, created as needed, so that
    libmoe's "router.weight" is the module's router.weight."""
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    return mod, leaf


class MoELayer(torch.nn.Module):
    """libmoe's MoE layer as an nn.Module. hidden, ffn_hidden, num_experts, top_k and the other
    keyword arguments are libmoe.Layer's (moe_layer_config_t with the C defaults;
    max_microbatches: forwards that may await their backward at once). runtime: a
    libmoe.Runtime to share between layers (CUDA, or host for f32 CPU tensors); by default a
    CUDA one is made on `device` (default: the current CUDA device) with `seed`. grads:
    "torch" or "libmoe" (module text)."""

    def __init__(self, hidden, ffn_hidden, num_experts, top_k, *, grads="torch", runtime=None,
                 device=None, seed=None, **config):
        super().__init__()
        if grads not in ("torch", "libmoe"):
            raise ValueError(f"grads is {grads!r}; expected 'torch' or 'libmoe'")
        if runtime is None:
            index = torch.device(device if device is not None else "cuda").index
            index = torch.cuda.current_device() if index is None else index
            runtime = libmoe.Runtime("cuda", device_index=index, seed=seed)
        self.runtime = runtime
        self._dtype = _TORCH_DTYPE[runtime.compute_dtype]
        self._on_cuda = runtime.device == Device.CUDA
        self._device_type = "cuda" if self._on_cuda else "cpu"
        self._device_index = runtime.device_index
        self.grads = grads
        self.layer = libmoe.Layer(runtime, hidden=hidden, ffn_hidden=ffn_hidden,
                                  num_experts=num_experts, top_k=top_k, **config)
        self._hidden = self.layer.hidden
        self._free = list(range(self.layer.config["max_microbatches"]))[::-1]
        self._held = {}  # slot -> generation of the token holding it
        self._generation = itertools.count(1)
        self._op_id = next(_next_id)
        _MODULES[self._op_id] = self
        self._trainable, self._grad_views = [], []
        for name, p in self.layer.params.items():
            owner, leaf = _container(self, name)
            view = torch_view(p.value)
            if p.kind == ParamKind.BUFFER:
                owner.register_buffer(leaf, view, persistent=True)
                continue
            param = torch.nn.Parameter(view)
            owner.register_parameter(leaf, param)
            self._trainable.append(param)
            self._grad_views.append(torch_view(p.grad))
        self._no_grads = [None] * len(self._trainable)  # a backward's, with grads="libmoe"

    # ---- autograd --------------------------------------------------------------------------

    def forward(self, x):
        h = self._hidden
        if x.shape[-1] != h or x.dtype != self._dtype or x.is_cuda != self._on_cuda:
            self._refuse(x)
        flat_in = x.dim() == 2
        flat = (x if flat_in else x.reshape(-1, h)).contiguous()
        if HAS_CUSTOM_OP and _is_compiling is not None and _is_compiling():
            y, _token = torch.ops.libmoe.layer_forward(flat, *self._trainable, self._op_id)
        else:
            y = _MoEFunction.apply(flat, self, *self._trainable)
        return y if flat_in else y.view(x.shape)

    def _refuse(self, x):
        rt = self.runtime
        if x.shape[-1] != self._hidden:
            raise libmoe.ArgumentError(f"x has shape {tuple(x.shape)}; the last dimension must "
                                       f"be hidden ({self._hidden})")
        raise libmoe.ArgumentError(
            f"x is {x.dtype} on {x.device}; this MoELayer takes {self._dtype} on "
            f"{self._device_type}" + (f":{rt.device_index}" if rt.device == Device.CUDA else ""))

    def _use_current_stream(self):
        """Run libmoe on PyTorch's current stream (set only when it changed: the runtime may be
        shared with other layers). Refuses a CUDA graph capture, which libmoe's forward cannot
        join: it waits for the device (the routing counts size the expert GEMMs)."""
        if not self._on_cuda:
            return
        if _is_capturing():
            raise libmoe.Error(libmoe.Status.UNSUPPORTED, _CAPTURE_MESSAGE)
        stream = _raw_stream(self._device_index) or CUDA_STREAM_LEGACY
        if stream != self.runtime.stream:
            self.runtime.set_stream(stream)

    def _acquire(self):
        """A token for a free slot."""
        if not self._free:
            n = self.layer.config["max_microbatches"]
            raise libmoe.Error(libmoe.Status.INVALID_ARGUMENT,
                               f"all {n} microbatch slots hold a forward awaiting its backward; "
                               "create the layer with a larger max_microbatches")
        slot = self._free.pop()
        self._held[slot] = generation = next(self._generation)
        return _SlotToken(self, slot, generation)

    def _consume(self, token):
        """The slot of a token (a _SlotToken or its tensor) whose backward runs now."""
        if isinstance(token, _SlotToken):
            slot, generation = token.slot, token.generation
        else:
            slot, generation = token.tolist()
        if self._held.get(slot) != generation:
            raise libmoe.Error(libmoe.Status.INVALID_ARGUMENT,
                               "this forward's saved state is gone (its backward ran already, "
                               "or its slot was released)")
        del self._held[slot]
        return slot

    def _release(self, slot):
        """Give back a slot whose forward will see no backward."""
        self._held.pop(slot, None)
        if not self.layer.closed:
            self.layer.release_slot(slot)
        self._free.append(slot)

    # ---- gradients, optimizer, statistics -----------------------------------------------------

    def zero_grad(self, set_to_none=True):
        """PyTorch's zero_grad over the layer's own three parameters (no walk over submodules),
        and with grads="libmoe" libmoe's (set_to_none: discard_grad, the next backward writes
        the gradients)."""
        for p in self._trainable:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()
        if self.grads == "libmoe":
            (self.layer.discard_grad if set_to_none else self.layer.zero_grad)()

    def libmoe_grad(self, name):
        """The f32 gradient libmoe accumulates for a parameter, as a torch view."""
        return torch_view(self.layer.grad(name))

    def adamw(self, **config):
        """A libmoe AdamW over this layer's parameters (for grads="libmoe"); keyword arguments
        as libmoe.AdamW's."""
        opt = libmoe.AdamW(self.runtime, **config)
        opt.add_layer(self.layer)
        return opt

    def stats(self):
        """libmoe.LayerStats of the most recent forward (aux_loss, z_loss, loads, drops)."""
        return self.layer.stats()

    def _apply(self, fn, recurse=True):
        for t in list(self.parameters()) + list(self.buffers()):
            if fn(t) is not t:
                raise RuntimeError("MoELayer's tensors are libmoe's memory on "
                                   f"cuda:{self.runtime.device_index}; it cannot be moved or "
                                   "cast")
        return self

    def extra_repr(self):
        c = self.layer.config
        return (f"hidden={c['hidden']}, ffn_hidden={c['ffn_hidden']}, "
                f"num_experts={c['num_experts']}, top_k={c['top_k']}, grads={self.grads!r}")
