"""The asynchronous tiered checkpointer (include/moe/ckpt.h): save_async snapshots named, sharded
tensors and returns; background threads write them (and mirror them to S3); load_* restore the
newest (or a given) complete checkpoint, resharding when the mesh changed."""
import ctypes as C
import dataclasses

from . import _native
from . import _structs as S
from ._config import fill, record, record_type
from ._handle import Handle
from .enums import CkptTier, ParamKind, Status, to_enum
from .errors import Error
from .tensor import as_tensor

CkptStatus = record_type(
    "CkptStatus", S.CkptStatus,
    doc="Progress of the background work (moe_ckpt_status_t): state, last_committed_step, "
        "last_uploaded_step, pending_saves, pending_uploads, bytes_written, bytes_uploaded, "
        "last_stall_s, last_durable_s, direct_io, uploads_superseded, upload_failures, "
        "last_upload_error.")


@dataclasses.dataclass
class Entry:
    """One named tensor, or this rank's shard of it (moe_ckpt_tensor_t). global_shape None: not
    sharded; offset: where the shard starts, per dimension; expert_ids: the global expert of
    each index along expert_dim (None: contiguous from offset[expert_dim])."""
    name: str
    tensor: object
    global_shape: tuple = None
    offset: tuple = None
    expert_dim: int = -1
    expert_ids: tuple = None

    @classmethod
    def of_param(cls, param, prefix=""):
        """The entry of a layer or optimizer Param shard (its global shape and offsets)."""
        return cls(prefix + param.name, param.value, param.global_shape, param.shard_offset,
                   param.expert_dim, param.expert_ids or None)


def _entries(tensors, writable):
    """A ctypes array of moe_ckpt_tensor_t and the objects keeping it valid."""
    if isinstance(tensors, dict):
        tensors = [t if isinstance(t, Entry) else Entry(name, t) for name, t in tensors.items()]
    tensors = list(tensors)
    arr = (S.CkptTensor * max(len(tensors), 1))()
    keep = []
    for slot, e in zip(arr, tensors):
        desc, k = as_tensor(e.tensor, e.name, writable=writable)
        keep.append(k)
        slot.name = e.name.encode()
        slot.tensor = desc
        for i, n in enumerate(e.global_shape or ()):
            slot.global_shape[i] = n
        for i, n in enumerate(e.offset or ()):
            slot.offset[i] = n
        slot.expert_dim = e.expert_dim
        if e.expert_ids is not None:
            ids = (C.c_int32 * len(e.expert_ids))(*e.expert_ids)
            keep.append(ids)
            slot.expert_ids = ids
    return arr, len(tensors), keep


class TrainState(Handle):
    """A run's whole training state (moe/train_state.h): layers, optimizers and user tensors,
    saved and loaded in one call by Checkpointer.save_train_state / load_train_state. What is
    added stays alive while the set lives, and closing an added layer or optimizer closes the
    set first (libmoe's set points into them)."""

    kind = "training state"

    def __init__(self):
        lib = _native.lib()
        ptr = C.c_void_p()
        lib.moe_train_state_create(C.byref(ptr))
        self._keep = []
        super().__init__(ptr.value, lib.moe_train_state_destroy, keep=(self._keep,))
        self._lib = lib

    def add_layer(self, layer, prefix=None):
        """Every parameter and buffer of layer, as prefix + name."""
        self._lib.moe_train_state_add_layer(self.ptr, layer.ptr,
                                            None if prefix is None else prefix.encode())
        self._hold(layer)

    def add_adamw(self, optimizer, prefix=None):
        """Every optimizer state as prefix + its name, and the step count as prefix + "step"."""
        self._lib.moe_train_state_add_adamw(self.ptr, optimizer.ptr,
                                            None if prefix is None else prefix.encode())
        self._hold(optimizer)

    def add_tensor(self, entry, kind="dense"):
        """entry: an Entry over writable memory (loading writes into it); kind "dense" or
        "buffer" for a tensor replicated over tp, ep and dp, "expert" for one that differs over
        ep."""
        arr, _, keep = _entries([entry], writable=True)
        self._lib.moe_train_state_add_tensor(self.ptr, arr, int(to_enum(ParamKind, kind)))
        self._keep.append((arr, keep))

    def _hold(self, handle):
        self._keep.append(handle)
        handle._adopt(self._finalizer)


class Checkpointer(Handle):
    """A checkpointer writing to dir. Keyword arguments are moe_ckpt_config_t fields with the
    C defaults (keep_last, chunk_bytes, pinned_budget_bytes, queue_depth, io_block_bytes,
    use_direct_io, s3_endpoint, s3_bucket, ...). Creating it is collective over the world;
    close() waits for queued saves and raises the first unreported background error."""

    kind = "checkpointer"

    def __init__(self, runtime, dir, **config):
        lib = _native.lib()
        cfg = fill(lib.moe_ckpt_config_default(), dict(dir=dir, **config), "Checkpointer")
        ptr = C.c_void_p()
        lib.moe_ckpt_create(runtime.ptr, C.byref(cfg), C.byref(ptr))
        super().__init__(ptr.value, lib.moe_ckpt_destroy, parent=runtime, keep=(cfg,))
        self._lib = lib
        self.dir = dir

    def save_async(self, step, tensors):
        """Snapshot tensors (a dict name -> array, or Entry objects) as checkpoint step and
        return once they are copied; the write continues in the background. Collective."""
        arr, count, keep = _entries(tensors, writable=False)
        self._lib.moe_ckpt_save_async(self.ptr, step, arr, count)
        self.fence()  # the copy may still read the arrays, which Python may free after this
        del keep

    def fence(self):
        """Order the next writes of every saved tensor after its snapshot copy (moe_ckpt_fence):
        host tensors are copied on return."""
        self._lib.moe_ckpt_fence(self.ptr)

    def save_train_state(self, step, state):
        """Save a TrainState as step (asynchronous, collective)."""
        self._lib.moe_ckpt_save_train_state(self.ptr, step, state.ptr)

    def load_train_state(self, state, step=-1):
        """Load a TrainState from step (-1: the newest); returns the step loaded. Collective."""
        got = C.c_int64(step)
        self._lib.moe_ckpt_load_train_state(self.ptr, step, state.ptr, C.byref(got))
        return got.value

    def poll(self, include_uploads=False):
        """True when every queued save is committed (and mirrored, with include_uploads), False
        while work remains; raises the first unreported background error."""
        return self._answer(self._lib.moe_ckpt_poll(self.ptr, int(include_uploads)),
                            "moe_ckpt_poll")

    def wait(self, include_uploads=False, timeout=None):
        """Block until done (True) or timeout seconds pass (False); None waits for ever.
        Collective with several ranks."""
        ms = -1 if timeout is None else int(timeout * 1000)
        return self._answer(self._lib.moe_ckpt_wait(self.ptr, int(include_uploads), ms),
                            "moe_ckpt_wait")

    def _answer(self, status, call):
        if status == Status.SUCCESS:
            return True
        if status in (Status.IN_PROGRESS, Status.TIMEOUT):
            return False
        raise Error(status, self._lib.last_error(), call)

    def status(self):
        st = S.CkptStatus(struct_size=C.sizeof(S.CkptStatus))
        self._lib.moe_ckpt_status(self.ptr, C.byref(st))
        return record(CkptStatus, st)

    def async_error(self):
        """(Status, message) of the first unreported background error, without clearing it;
        (Status.SUCCESS, "") when there is none."""
        buf = C.create_string_buffer(1024)
        status = self._lib.moe_ckpt_get_async_error(self.ptr, buf, len(buf))
        return status, buf.value.decode(errors="replace")

    def load_latest(self, tensors):
        """Load the newest complete checkpoint into tensors (written in place); returns its
        step. Raises Error(NOT_FOUND) when there is none. Collective."""
        arr, count, keep = _entries(tensors, writable=True)
        step = C.c_int64(-1)
        self._lib.moe_ckpt_load_latest(self.ptr, arr, count, C.byref(step))
        del keep
        return step.value

    def load_step(self, step, tensors):
        arr, count, keep = _entries(tensors, writable=True)
        self._lib.moe_ckpt_load_step(self.ptr, step, arr, count)
        del keep

    def list(self, tier="local"):
        """The steps of the complete checkpoints on a tier ("local" or "s3"), ascending."""
        tier = int(to_enum(CkptTier, tier))
        count = C.c_int32()
        self._lib.moe_ckpt_list(self.ptr, tier, None, 0, C.byref(count))
        steps = (C.c_int64 * max(count.value, 1))()
        self._lib.moe_ckpt_list(self.ptr, tier, steps, count.value, C.byref(count))
        return list(steps[:count.value])

    def set_aside_newer(self, step):
        """Set aside every complete local checkpoint newer than step (-1: all), as after a
        load that fell back past steps that failed verification: each is renamed to
        <dir>/.rejected-step-<N>-<unix time> and never listed or loaded again. Returns how
        many were set aside. Collective (moe_ckpt_set_aside_newer)."""
        count = C.c_int32()
        self._lib.moe_ckpt_set_aside_newer(self.ptr, int(step), C.byref(count))
        return count.value

    def close_within(self, upload_timeout_ms):
        """close() with its own bound on the wait for the newest step's S3 upload
        (moe_ckpt_destroy_within; close() waits 30 s or MOE_CKPT_DESTROY_TIMEOUT_MS): raises
        Error(TIMEOUT) naming the step when the bound cut the upload short. Collective."""
        exc = self._close_with(
            lambda ptr: self._lib.moe_ckpt_destroy_within(ptr, int(upload_timeout_ms)))
        if exc is not None:
            raise exc

    def abort(self):
        """Stop background work as soon as possible and free the checkpointer (not
        collective); abandoned writes are never committed."""
        self._close_with(self._lib.moe_ckpt_abort)
