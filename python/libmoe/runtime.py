"""The runtime (include/moe/core.h, mesh.h): a backend, optionally the 4D process mesh under
mpirun, logging, streams, and libmoe-allocated tensors."""
import ctypes as C

from . import _native
from . import _structs as S
from ._config import fill
from ._handle import Handle
from .enums import Axis, Backend, Device, DType, LogLevel, to_enum
from .errors import ArgumentError
from .tensor import Tensor, as_tensor


def _mesh_config(mesh):
    """A MeshConfig from a dict of moe_mesh_config_t fields (tp, ep, dp, pp, rank_order, comm,
    mpi_comm: the address of an MPI_Comm, e.g. mpi4py's MPI._addressof(comm), timeout_ms)."""
    if isinstance(mesh, S.MeshConfig):
        return mesh
    return fill(_native.lib().moe_mesh_config_default(), dict(mesh), "mesh")


# MOE_EXIT_PEER_LOST: the exit status for a program whose runtime lost a peer (async_error())
EXIT_PEER_LOST = 75
CUDA_STREAM_LEGACY = 0x1  # cudaStreamLegacy: what stream 0 means to PyTorch and CuPy


def stream_pointer(stream):
    """The cudaStream_t to hand libmoe for None (the runtime's own stream), an int address, or
    an object carrying one (torch.cuda.Stream's cuda_stream, CuPy's ptr). 0, the legacy default
    stream, becomes cudaStreamLegacy: libmoe reads NULL as "the runtime's own stream"."""
    if stream is None:
        return None
    if not isinstance(stream, int):
        for attr in ("cuda_stream", "ptr", "handle"):
            value = getattr(stream, attr, None)
            if isinstance(value, int):
                stream = value
                break
        else:
            stream = None
    if isinstance(stream, int):
        return stream or CUDA_STREAM_LEGACY
    raise ArgumentError(f"{type(stream).__name__} is not a CUDA stream (an int address, or an "
                        "object with cuda_stream or ptr)")


class Runtime(Handle):
    """A libmoe runtime. Keyword arguments are moe_runtime_config_t fields (backend,
    device_index, deterministic, seed, log_level), defaulting to the C defaults.
    mesh: a dict of moe_mesh_config_t fields (e.g. {"ep": 4}); creating the runtime is then
    collective over the MPI world. log: a callable(level: LogLevel, message: str), called from
    any libmoe thread."""

    kind = "runtime"

    def __init__(self, backend="auto", *, mesh=None, log=None, **config):
        lib = _native.lib()
        cfg = fill(lib.moe_runtime_config_default(), dict(backend=backend, **config), "Runtime",
                   fixed=("log_user_data",))
        keep = [cfg]
        if log is not None:
            callback = S.LOG_FN(lambda level, msg, _u: log(LogLevel(level),
                                                            msg.decode(errors="replace")))
            cfg.log_fn = callback
            keep.append(callback)
        if mesh is not None:
            mesh_cfg = _mesh_config(mesh)
            cfg.mesh = C.pointer(mesh_cfg)
            keep.append(mesh_cfg)
        ptr = C.c_void_p()
        lib.moe_runtime_create(C.byref(cfg), C.byref(ptr))
        super().__init__(ptr.value, lib.moe_runtime_destroy, keep=keep)
        self._keep = keep
        self._lib = lib
        backend_out, device, index, dtype = S.enum_t(), S.enum_t(), C.c_int32(), S.enum_t()
        lib.moe_runtime_backend(self.ptr, C.byref(backend_out))
        lib.moe_runtime_device(self.ptr, C.byref(device), C.byref(index))
        lib.moe_runtime_compute_dtype(self.ptr, C.byref(dtype))
        self.backend = Backend(backend_out.value)
        self.device = Device(device.value)
        self.device_index = index.value
        self.compute_dtype = DType(dtype.value)
        self.stream = None

    # ---- mesh ------------------------------------------------------------------------------

    def axis(self, axis):
        """(rank, size) of this process along the axis ("tp", "ep", "dp", "pp", "edp",
        "world"); a runtime without a mesh is a world of one."""
        rank, size = C.c_int32(), C.c_int32()
        self._lib.moe_runtime_axis(self.ptr, int(to_enum(Axis, axis)), C.byref(rank),
                                   C.byref(size))
        return rank.value, size.value

    @property
    def rank(self):
        return self.axis(Axis.WORLD)[0]

    @property
    def world_size(self):
        return self.axis(Axis.WORLD)[1]

    def async_error(self):
        """(Status, message) of the mesh's first failure, (Status.SUCCESS, "") while every peer
        answers. After a failure the runtime is poisoned: later collectives raise ABORTED, and
        close() raises it too; the program should then exit with libmoe.EXIT_PEER_LOST
        (docs/mesh.md, "When a peer fails"). Never blocks."""
        buf = C.create_string_buffer(1024)
        status = self._lib.moe_runtime_get_async_error(self.ptr, buf, len(buf))
        return status, buf.value.decode(errors="replace")

    def wait_stats(self):
        """(wait_seconds, waits): the time this rank has spent blocked waiting in libmoe's
        communication since the runtime was made, and how many waits; a step's wall time minus
        the growth of wait_seconds is the rank's busy time (moe_runtime_wait_stats)."""
        stats = S.RuntimeWaitStats(struct_size=C.sizeof(S.RuntimeWaitStats))
        self._lib.moe_runtime_wait_stats(self.ptr, C.byref(stats))
        return stats.wait_seconds, stats.waits

    # ---- streams and logging -----------------------------------------------------------------

    def set_stream(self, stream):
        """Enqueue libmoe's work on this CUDA stream (an address, torch.cuda.Stream, CuPy
        stream; 0 is the legacy default stream); None selects the runtime's own. Ignored by the
        host backend. Changing it costs a workspace reallocation: keep one stream per layer."""
        pointer = stream_pointer(stream)
        self._lib.moe_runtime_set_stream(self.ptr, pointer)
        self.stream = pointer

    def get_stream(self):
        """The cudaStream_t libmoe enqueues on now (an address: the one set, else the
        runtime's own), to order other work with libmoe's; None on the host backend."""
        out = C.c_void_p()
        self._lib.moe_runtime_get_stream(self.ptr, C.byref(out))
        return out.value

    def synchronize(self):
        self._lib.moe_runtime_synchronize(self.ptr)

    def set_log(self, level, log=None):
        """Change the level and the callback (None: stderr)."""
        callback = S.LOG_FN() if log is None else S.LOG_FN(
            lambda lv, msg, _u: log(LogLevel(lv), msg.decode(errors="replace")))
        self._lib.moe_runtime_set_log(self.ptr, int(to_enum(LogLevel, level)), callback, None)
        self._keep.append(callback)  # libmoe may call an older one until this returns

    # ---- tensors ---------------------------------------------------------------------------

    def tensor(self, shape, dtype=None, device=None):
        """A libmoe-allocated tensor (uninitialised) on the runtime's device by default, in its
        compute dtype by default; device="host" on the CUDA backend gives pinned memory."""
        dtype = self.compute_dtype if dtype is None else to_enum(DType, dtype)
        device = self.device if device is None else to_enum(Device, device)
        shape = tuple(int(n) for n in shape)
        desc = S.Tensor()
        dims = (C.c_int64 * max(len(shape), 1))(*shape)
        self._lib.moe_tensor_alloc(self.ptr, int(dtype), int(device), len(shape), dims,
                                   C.byref(desc))
        return Tensor(desc, runtime=self)

    def copy(self, dst, src):
        """dst <- src for equal element counts on any devices, converting f32 <-> bf16.
        Synchronous with respect to the host."""
        d, keep_d = as_tensor(dst, "dst", writable=True)
        s, keep_s = as_tensor(src, "src")
        self._lib.moe_tensor_copy(self.ptr, C.byref(d), C.byref(s))
        del keep_d, keep_s
        return dst
