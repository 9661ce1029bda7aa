"""libmoe from Python: ctypes wrappers over the C API of libmoe.so (no compiled extension).

    import libmoe
    with libmoe.Runtime("host", seed=7) as rt:
        layer = libmoe.Layer(rt, hidden=64, ffn_hidden=128, num_experts=8, top_k=2)
        y = layer.forward(x)                 # x: [N, 64] f32 (any buffer, or a device array)
        dx = layer.backward(dy)              # accumulates layer.grad("router.weight"), ...
        opt = libmoe.AdamW(rt, lr=1e-3); opt.add_layer(layer); opt.step()

Handles close on close(), at the end of `with`, or when collected; failures raise
libmoe.Error(status, message). libmoe.torch (imported on its own, when PyTorch is installed)
has MoELayer, an nn.Module over the CUDA backend. libmoe.Member is a rank's membership
under the elastic launcher (Member.from_env(rank)). docs/python.md is the guide.
"""
from ._handle import live_handles
from ._native import ENV_VAR, Library, load
from ._native import lib as _lib
from ._version import __version__
from .ckpt import Checkpointer, CkptStatus, Entry, TrainState
from .elastic import Member
from .enums import (Axis, Backend, CkptState, CkptTier, CommBackend, Device, DType, ElasticPhase,
                    LogLevel, LrDecay, ParamKind, PipeIssue, PipeOp, Placement, ScoreFn, Status)
from .errors import ArgumentError, Error, LibraryNotFound
from .layer import Layer, LayerStats, Param
from .optim import AdamW, lr_schedule_rate
from .pipeline import Action, Pipeline, PipelineStats, Schedule, ScheduleInfo, op_string
from .runtime import EXIT_PEER_LOST, Runtime
from .tensor import Tensor, as_tensor


def library():
    """The loaded Library (path, how it was found, version), loading it if needed."""
    return _lib()


def version():
    """The loaded library's version string (moe_version_string)."""
    return _lib().moe_version_string().decode()


def status_string(status):
    return _lib().moe_status_string(int(status)).decode()


__all__ = [
    "AdamW", "Action", "ArgumentError", "Axis", "Backend", "Checkpointer", "CkptState",
    "CkptStatus", "CkptTier", "CommBackend", "DType", "Device", "ENV_VAR", "EXIT_PEER_LOST",
    "ElasticPhase", "Entry", "Error",
    "Layer", "LayerStats", "Library", "LibraryNotFound", "LogLevel", "LrDecay", "Member", "Param",
    "ParamKind",
    "PipeIssue", "PipeOp", "Pipeline", "PipelineStats", "Placement", "Runtime", "Schedule",
    "ScheduleInfo", "ScoreFn", "Status", "Tensor", "TrainState", "__version__", "as_tensor",
    "library", "live_handles", "load", "lr_schedule_rate", "op_string", "status_string",
    "version",
]
