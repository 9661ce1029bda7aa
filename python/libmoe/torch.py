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
"""
import torch

import libmoe

from .enums import Device, DType, ParamKind
from .runtime import stream_pointer

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


class _SlotLease:
    """A microbatch slot holding a forward's saved state until its backward. Dropped without a
    backward (the autograd graph freed), it releases the slot."""

    def __init__(self, module, slot):
        self.module, self.slot = module, slot

    def consume(self):
        slot, self.slot = self.slot, None
        return slot

    def __del__(self):
        if self.slot is not None:
            self.module._release(self.slot)


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module, *params):
        layer = module.layer
        module._use_current_stream(x.device)
        y = torch.empty_like(x)
        slot = module._acquire()
        try:
            layer.forward(x, y, slot)
        except BaseException:
            module._release(slot)
            raise
        if any(ctx.needs_input_grad):
            ctx.lease = _SlotLease(module, slot)
            ctx.module = module
        else:
            module._release(slot)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        module = ctx.module
        module._use_current_stream(dy.device)
        dy = dy.contiguous()
        need_dx = ctx.needs_input_grad[0]
        dx = torch.empty_like(dy) if need_dx else None
        to_torch = module.grads == "torch"
        if to_torch:  # libmoe's buffers then hold this backward's gradients alone
            module.layer.discard_grad()
        slot = ctx.lease.consume()
        try:
            module.layer.backward(dy, dx, slot, need_dx=need_dx)
        finally:
            module._free.append(slot)  # backward frees the slot, also when it fails
        grads = [None] * len(module._trainable)
        if to_torch:
            grads = [g.to(p.dtype) if need else None for g, p, need in
                     zip(module._grad_views, module._trainable, ctx.needs_input_grad[2:])]
        return (dx, None, *grads)


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
        self._device_type = "cuda" if runtime.device == Device.CUDA else "cpu"
        self.grads = grads
        self.layer = libmoe.Layer(runtime, hidden=hidden, ffn_hidden=ffn_hidden,
                                  num_experts=num_experts, top_k=top_k, **config)
        self._free = list(range(self.layer.config["max_microbatches"]))[::-1]
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

    # ---- autograd --------------------------------------------------------------------------

    def forward(self, x):
        h, rt = self.layer.hidden, self.runtime
        if x.shape[-1] != h:
            raise libmoe.ArgumentError(f"x has shape {tuple(x.shape)}; the last dimension must "
                                       f"be hidden ({h})")
        if x.dtype != self._dtype or x.device.type != self._device_type:
            raise libmoe.ArgumentError(
                f"x is {x.dtype} on {x.device}; this MoELayer takes {self._dtype} on "
                f"{self._device_type}" + (f":{rt.device_index}" if rt.device == Device.CUDA
                                          else ""))
        flat = x.reshape(-1, h).contiguous()
        y = _MoEFunction.apply(flat, self, *self._trainable)
        return y.view(x.shape)

    def _use_current_stream(self, device):
        if self.runtime.device != Device.CUDA:
            return
        stream = stream_pointer(torch.cuda.current_stream(device).cuda_stream)
        if stream != self.runtime.stream:  # the runtime may be shared with other layers
            self.runtime.set_stream(stream)

    def _acquire(self):
        if not self._free:
            n = self.layer.config["max_microbatches"]
            raise libmoe.Error(libmoe.Status.INVALID_ARGUMENT,
                               f"all {n} microbatch slots hold a forward awaiting its backward; "
                               "create the layer with a larger max_microbatches")
        return self._free.pop()

    def _release(self, slot):
        if not self.layer.closed:
            self.layer.release_slot(slot)
        self._free.append(slot)

    # ---- gradients, optimizer, statistics -----------------------------------------------------

    def zero_grad(self, set_to_none=True):
        """PyTorch's zero_grad, and with grads="libmoe" libmoe's (set_to_none: discard_grad,
        the next backward writes the gradients)."""
        super().zero_grad(set_to_none=set_to_none)
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
