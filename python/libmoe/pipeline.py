"""Pipeline parallelism (include/moe/pipeline.h): the 1F1B schedule of a stage as a list of
actions to inspect and print, and the executor that runs it with Python stage callbacks."""
import ctypes as C
import dataclasses

from . import _native
from . import _structs as S
from ._config import fill, record, record_type
from ._handle import Handle
from .enums import PipeOp, Status
from .errors import ArgumentError, Error
from .tensor import Tensor

PipelineStats = record_type(
    "PipelineStats", S.PipelineStats,
    doc="Timings of the most recent train_step on this rank (moe_pipeline_stats_t).")


@dataclasses.dataclass(frozen=True)
class Action:
    op: PipeOp
    microbatch: int
    peer: int   # the peer stage of a transfer; -1 for compute
    chunk: int  # the model chunk on this stage (interleaved); 0 otherwise


@dataclasses.dataclass(frozen=True)
class ScheduleInfo:
    stages: int
    microbatches: int
    stage: int
    warmup: int
    virtual_stages: int


def op_string(op):
    """The C library's short name of an op ("F", "B", "send_act", ...)."""
    return _native.lib().moe_pipeline_op_string(int(op)).decode()


class Schedule(Handle):
    """The 1F1B action list of one stage (interleaved when virtual_stages > 1). len(), indexing
    and iteration give Actions; str() is the C library's one-line rendering."""

    kind = "schedule"

    def __init__(self, stages, microbatches, stage, virtual_stages=1, *, _borrowed=None):
        lib = _native.lib()
        self._lib = lib
        if _borrowed is not None:  # a pipeline's own schedule
            super().__init__(_borrowed[0], None, parent=_borrowed[1])
            return
        ptr = C.c_void_p()
        if virtual_stages == 1:
            lib.moe_pipeline_schedule_create(stages, microbatches, stage, C.byref(ptr))
        else:
            lib.moe_pipeline_schedule_create_interleaved(stages, microbatches, stage,
                                                         virtual_stages, C.byref(ptr))
        super().__init__(ptr.value, lib.moe_pipeline_schedule_destroy)

    def __len__(self):
        n = C.c_int32()
        self._lib.moe_pipeline_schedule_length(self.ptr, C.byref(n))
        return n.value

    def __getitem__(self, index):
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"action {index} of a schedule of {n}")
        a = S.PipelineAction()
        self._lib.moe_pipeline_schedule_action(self.ptr, index, C.byref(a))
        return Action(PipeOp(a.op), a.microbatch, a.peer, a.chunk)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def info(self):
        stages, m, stage, warmup, v = (C.c_int32() for _ in range(5))
        self._lib.moe_pipeline_schedule_info(self.ptr, C.byref(stages), C.byref(m),
                                             C.byref(stage), C.byref(warmup))
        self._lib.moe_pipeline_schedule_virtual_stages(self.ptr, C.byref(v))
        return ScheduleInfo(stages.value, m.value, stage.value, warmup.value, v.value)

    def __str__(self):
        needed = C.c_size_t()
        self._lib.moe_pipeline_schedule_to_string(self.ptr, None, 0, C.byref(needed))
        buf = C.create_string_buffer(needed.value)
        self._lib.moe_pipeline_schedule_to_string(self.ptr, buf, len(buf), None)
        return buf.value.decode()


def _view(ptr):
    """A libmoe.Tensor viewing a descriptor libmoe passes to a callback (valid during it)."""
    return None if not ptr else Tensor(S.Tensor.from_buffer_copy(ptr.contents))


class Pipeline(Handle):
    """The 1F1B executor of this rank's pp stage. act_shape: the shape of a stage boundary
    tensor per microbatch. Callbacks (Python callables, run on the calling thread):
      forward(chunk, microbatch, x, y)    x None on the first stage; y: the output to fill
      loss(microbatch, y, dy) -> float    last stage: fill dy = d loss / d y
      backward(chunk, microbatch, dy, dx) dx None on the first stage
      zero_grad(), step(grad_scale), abandon(chunk, microbatch)   optional
    x, y, dy, dx are libmoe.Tensor views valid during the call. optimizer: an AdamW stepped
    after each batch when step is not given. Other keyword arguments are
    moe_pipeline_config_t fields (microbatches, act_dtype, prepost, lr, grad_scale,
    timeout_ms, virtual_stages, issue) with the C defaults. An exception in a callback fails
    the batch on every rank; train_step re-raises it."""

    kind = "pipeline"

    def __init__(self, runtime, act_shape, forward, backward, loss=None, *, zero_grad=None,
                 step=None, abandon=None, optimizer=None, **config):
        lib = _native.lib()
        cfg = fill(lib.moe_pipeline_config_default(), config, "Pipeline", fixed=("optimizer",))
        shape = tuple(act_shape)
        if not 1 <= len(shape) <= S.MAX_DIMS:
            raise ArgumentError(f"act_shape has {len(shape)} dimensions; expected 1..4")
        cfg.act_ndim = len(shape)
        for i, n in enumerate(shape):
            cfg.act_shape[i] = n
        if optimizer is not None:
            cfg.optimizer = optimizer.ptr
        self._failure = None
        cbs = S.PipelineCallbacks()
        cbs.forward = S.FORWARD_FN(self._guard(
            lambda _u, c, mb, x, y: forward(c, mb, _view(x), _view(y))))
        cbs.backward = S.BACKWARD_FN(self._guard(
            lambda _u, c, mb, dy, dx: backward(c, mb, _view(dy), _view(dx))))
        if loss is not None:
            def loss_cb(_u, mb, y, dy, value):
                value[0] = float(loss(mb, _view(y), _view(dy)))
            cbs.loss = S.LOSS_FN(self._guard(loss_cb))
        if zero_grad is not None:
            cbs.zero_grad = S.ZERO_GRAD_FN(self._guard(lambda _u: zero_grad()))
        if step is not None:
            cbs.step = S.STEP_FN(self._guard(lambda _u, scale: step(scale)))
        if abandon is not None:
            cbs.abandon = S.ABANDON_FN(self._guard(lambda _u, c, mb: abandon(c, mb)))
        ptr = C.c_void_p()
        lib.moe_pipeline_create(runtime.ptr, C.byref(cfg), C.byref(cbs), C.byref(ptr))
        super().__init__(ptr.value, lib.moe_pipeline_destroy, parent=runtime,
                         keep=(cbs, optimizer))
        self._lib = lib
        self.runtime = runtime
        self.optimizer = optimizer

    def _guard(self, fn):
        """A C callback: fn's exception becomes a failure status, kept for train_step."""
        def callback(*args):
            try:
                fn(*args)
            except BaseException as exc:  # noqa: B036 - C frames cannot carry it
                if self._failure is None:
                    self._failure = exc
                return exc.status if isinstance(exc, Error) else Status.INTERNAL
            return Status.SUCCESS
        return callback

    def train_step(self):
        """Run one global batch; returns the mean loss over its microbatches. Collective."""
        loss = C.c_double()
        self._failure = None
        try:
            self._lib.moe_pipeline_train_step(self.ptr, C.byref(loss))
        except Error as exc:
            failure, self._failure = self._failure, None
            if failure is not None:
                raise failure from exc
            raise
        return loss.value

    @property
    def schedule(self):
        out = C.c_void_p()
        self._lib.moe_pipeline_get_schedule(self.ptr, C.byref(out))
        return Schedule(0, 0, 0, _borrowed=(out.value, self))

    def stats(self):
        st = S.PipelineStats(struct_size=C.sizeof(S.PipelineStats))
        self._lib.moe_pipeline_stats(self.ptr, C.byref(st))
        return record(PipelineStats, st)
