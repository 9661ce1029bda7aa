"""Tensors without copies: every array-like a wrapper accepts becomes a moe_tensor_t here, in one
place, and every moe_tensor_t libmoe hands out becomes a libmoe.Tensor.

Accepted, in this order of preference:
  libmoe.Tensor                 (libmoe-allocated storage or a view of a layer's parameter)
  torch.Tensor                  (read through data_ptr/shape/dtype: the cheapest path per call)
  __cuda_array_interface__      (CuPy, Numba, JAX; v2 and v3 dicts)
  __dlpack__                    (any DLPack producer; device from __dlpack_device__)
  the buffer protocol           (array.array, memoryview, bytearray, numpy, ctypes arrays)
libmoe takes dense row-major tensors of f32 or bf16: strided, offset-free views are refused,
as are other dtypes (float16 included). bf16 arrives as the CUDA array interface's "<V2" (the
ml_dtypes convention PyTorch also exports), DLPack's bfloat type, or 2-byte unsigned integers
holding the bits (buffer format "H").

Shape, dtype, device and writability are checked by check() before any C call, so a mismatch
raises ArgumentError naming the argument instead of reaching libmoe.
"""
import ctypes as C
import struct

from . import _native
from . import _structs as S
from ._handle import Handle
from .enums import Device, DType, to_enum
from .errors import ArgumentError

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3
_DL_FLOAT, _DL_BFLOAT = 2, 4


class _DLDevice(C.Structure):
    _fields_ = [("device_type", C.c_int32), ("device_id", C.c_int32)]


class _DLDataType(C.Structure):
    _fields_ = [("code", C.c_uint8), ("bits", C.c_uint8), ("lanes", C.c_uint16)]


class DLTensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("device", _DLDevice), ("ndim", C.c_int32),
                ("dtype", _DLDataType), ("shape", C.POINTER(C.c_int64)),
                ("strides", C.POINTER(C.c_int64)), ("byte_offset", C.c_uint64)]


class DLManagedTensor(C.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", C.c_void_p), ("deleter", C.c_void_p)]


class _DLVersion(C.Structure):
    _fields_ = [("major", C.c_uint32), ("minor", C.c_uint32)]


class DLManagedTensorVersioned(C.Structure):
    _fields_ = [("version", _DLVersion), ("manager_ctx", C.c_void_p), ("deleter", C.c_void_p),
                ("flags", C.c_uint64), ("dl_tensor", DLTensor)]


_DL_READ_ONLY = 1
_capsule_pointer = C.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = C.c_void_p
_capsule_pointer.argtypes = [C.py_object, C.c_char_p]
_capsule_name = C.pythonapi.PyCapsule_GetName
_capsule_name.restype = C.c_char_p
_capsule_name.argtypes = [C.py_object]


class _PyBuffer(C.Structure):
    """CPython's Py_buffer, to read the address of any buffer, read-only ones too (ctypes'
    from_buffer takes writable ones only)."""
    _fields_ = [("buf", C.c_void_p), ("obj", C.c_void_p), ("len", C.c_ssize_t),
                ("itemsize", C.c_ssize_t), ("readonly", C.c_int), ("ndim", C.c_int),
                ("format", C.c_char_p), ("shape", C.c_void_p), ("strides", C.c_void_p),
                ("suboffsets", C.c_void_p), ("internal", C.c_void_p)]


_get_buffer = C.pythonapi.PyObject_GetBuffer
_get_buffer.restype = C.c_int
_get_buffer.argtypes = [C.py_object, C.POINTER(_PyBuffer), C.c_int]
_release_buffer = C.pythonapi.PyBuffer_Release
_release_buffer.restype = None
_release_buffer.argtypes = [C.POINTER(_PyBuffer)]

_TYPESTR = {"<f4": DType.F32, "f4": DType.F32, "<V2": DType.BF16, "V2": DType.BF16,
            "<u2": DType.BF16, "u2": DType.BF16}
_BUFFER_FORMAT = {"f": DType.F32, "<f": DType.F32, "=f": DType.F32, "H": DType.BF16,
                  "<H": DType.BF16, "=H": DType.BF16}
_TORCH_DTYPE = {"torch.float32": DType.F32, "torch.bfloat16": DType.BF16}

# names of the element types libmoe refuses, so a message says "float16", not a code
_DL_TYPE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque", 4: "bfloat", 5: "complex",
                  6: "bool"}
_TYPESTR_KINDS = {"f": "float", "i": "int", "u": "uint", "c": "complex", "b": "bool",
                  "V": "void"}
_BUFFER_NAMES = {"e": "float16", "d": "float64", "b": "int8", "B": "uint8", "c": "char",
                 "h": "int16", "i": "int32", "I": "uint32", "l": "int64", "L": "uint64",
                 "q": "int64", "Q": "uint64", "n": "ssize_t", "N": "size_t", "?": "bool"}


def _dlpack_type_name(code, bits, lanes):
    name = "bool" if code == 6 else f"{_DL_TYPE_NAMES.get(code, f'type code {code} ')}{bits}"
    return name if lanes == 1 else f"{name}x{lanes}"


def _typestr_name(typestr):
    kind, size = typestr.lstrip("<>|="), 0
    if kind[1:].isdigit():
        kind, size = kind[0], int(kind[1:])
    return f"{_TYPESTR_KINDS.get(kind, kind)}{8 * size or ''} (typestr {typestr!r})"


def _buffer_format_name(fmt):
    return f"{_BUFFER_NAMES.get(fmt.lstrip('<>=@!'), fmt)} (buffer format {fmt!r})"


def _descriptor(data, dtype, device, shape, device_index=0):
    if not 1 <= len(shape) <= S.MAX_DIMS:
        raise ArgumentError(f"a tensor has 1..{S.MAX_DIMS} dimensions; this one has "
                            f"{len(shape)} (shape {tuple(shape)})")
    desc = S.Tensor()
    desc.data = data or None
    desc.dtype = dtype
    desc.ndim = len(shape)
    for i, n in enumerate(shape):
        desc.shape[i] = n
    desc.device = device
    desc.device_index = device_index
    return desc


def _contiguous_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _require_dense(shape, strides, itemsize, what):
    """strides in bytes (None: dense). Size-1 dimensions may carry any stride."""
    if strides is None:
        return
    dense = _contiguous_strides(shape, itemsize)
    if any(n != 1 and s != d for n, s, d in zip(shape, strides, dense)):
        raise ArgumentError(f"{what} is not dense row-major (strides {tuple(strides)} bytes, "
                            f"shape {tuple(shape)}); pass a contiguous copy")


def _dtype_of(table, key, what, name=str):
    """The DType of key, or ArgumentError naming the element type (name(key))."""
    try:
        return table[key]
    except KeyError:
        raise ArgumentError(f"{what} has element type {name(key)}; libmoe takes f32 or "
                            "bf16") from None


class Tensor(Handle):
    """A moe_tensor_t with the object that keeps its memory alive. With runtime, the storage is
    libmoe's (Runtime.tensor) and close() frees it; otherwise the tensor is a view (a
    parameter, a gradient, a pipeline callback's argument) that keeps owner alive and closes
    with it."""

    kind = "tensor"

    def __init__(self, desc, owner=None, runtime=None):
        self._desc = desc
        if runtime is not None:
            rt_ptr, lib = runtime.ptr, _native.lib()
            super().__init__(desc.data or 0,
                             lambda _data: lib.moe_tensor_free(rt_ptr, C.byref(desc)),
                             parent=runtime)
        else:
            super().__init__(desc.data or 0, None, parent=owner)

    @property
    def desc(self):
        """The moe_tensor_t (raises once the tensor is closed)."""
        self.ptr  # noqa: B018 - the closed check
        return self._desc

    @property
    def shape(self):
        return tuple(self._desc.shape[i] for i in range(self._desc.ndim))

    @property
    def dtype(self):
        return DType(self._desc.dtype)

    @property
    def device(self):
        return Device(self._desc.device)

    @property
    def device_index(self):
        return self._desc.device_index

    @property
    def data_ptr(self):
        return self.desc.data or 0

    @property
    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self):
        return self.numel * self.dtype.itemsize

    def __len__(self):
        return self.shape[0]

    def memoryview(self):
        """A writable memoryview of host memory with this shape (format "f" for f32, "H" for
        bf16 bits). It keeps the tensor alive."""
        if self.device != Device.HOST:
            raise ArgumentError("memoryview() needs a host tensor; this one is on cuda")
        if self.numel == 0:
            return memoryview(bytearray()).cast("B").cast(
                "f" if self.dtype == DType.F32 else "H", self.shape)
        raw = (C.c_char * self.nbytes).from_address(self.data_ptr)
        raw.keep = self
        return memoryview(raw).cast("B").cast("f" if self.dtype == DType.F32 else "H",
                                              self.shape)

    def tolist(self):
        """The elements as a flat list of Python floats (host tensors; bf16 widened)."""
        flat = self.memoryview().cast("B").cast("f" if self.dtype == DType.F32 else "H")
        if self.dtype == DType.F32:
            return flat.tolist()
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in flat]

    @property
    def __cuda_array_interface__(self):
        if self.device != Device.CUDA:
            raise AttributeError("a host tensor has no __cuda_array_interface__")
        return {"shape": self.shape, "typestr": "<f4" if self.dtype == DType.F32 else "<V2",
                "data": (self.data_ptr, False), "strides": None, "version": 3,
                "stream": None}

    def __repr__(self):
        state = "closed" if self.closed else f"{self.device.name.lower()}:{self.device_index}"
        return (f"<libmoe.Tensor {self.dtype.name.lower()}{list(self.shape)} {state}>")


# ---- conversion ---------------------------------------------------------------------------

def _from_torch(obj, what):
    dtype = _dtype_of(_TORCH_DTYPE, str(obj.dtype), what)
    shape = tuple(obj.shape)
    if not obj.is_contiguous():
        raise ArgumentError(f"{what} is not contiguous; pass {what}.contiguous()")
    if obj.device.type == "cuda":
        device, index = Device.CUDA, obj.device.index or 0
    elif obj.device.type == "cpu":
        device, index = Device.HOST, 0
    else:
        raise ArgumentError(f"{what} is on {obj.device}; libmoe takes cpu or cuda tensors")
    return _descriptor(obj.data_ptr(), dtype, device, shape, index), obj, False


def _from_cuda_array_interface(cai, obj, what):
    shape = tuple(cai["shape"])
    dtype = _dtype_of(_TYPESTR, cai["typestr"], what, _typestr_name)
    _require_dense(shape, cai.get("strides"), dtype.itemsize, what)
    ptr, read_only = cai["data"]
    # the interface names no device: the pointer belongs to the current CUDA context, which
    # check() compares with the runtime's device only where an index is known
    return _descriptor(ptr, dtype, Device.CUDA, shape, -1), obj, bool(read_only)


def _from_dlpack(obj, what, stream):
    kind, index = obj.__dlpack_device__()
    if kind not in (_DL_CPU, _DL_CUDA, _DL_CUDA_HOST):
        raise ArgumentError(f"{what} is on DLPack device type {kind}; libmoe takes cpu or cuda")
    # for CUDA data the stream says where the consumer works (-1: the caller orders the work)
    capsule = obj.__dlpack__(stream=stream if kind == _DL_CUDA else None)
    return from_dlpack_capsule(capsule, what)


def from_dlpack_capsule(capsule, what="tensor"):
    """A descriptor of a DLPack capsule ("dltensor" or "dltensor_versioned"); the capsule stays
    unconsumed, so its destructor frees the producer's tensor once the capsule is collected."""
    name = _capsule_name(capsule)
    if name == b"dltensor":
        managed = DLManagedTensor.from_address(_capsule_pointer(capsule, name))
        read_only = False
    elif name == b"dltensor_versioned":
        managed = DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, name))
        if managed.version.major != 1:
            raise ArgumentError(f"{what}: DLPack {managed.version.major}.x is not supported")
        read_only = bool(managed.flags & _DL_READ_ONLY)
    else:
        raise ArgumentError(f"{what}: {name!r} is not an unconsumed DLPack capsule")
    t = managed.dl_tensor
    dtype = _dtype_of({(_DL_FLOAT, 32, 1): DType.F32, (_DL_BFLOAT, 16, 1): DType.BF16},
                      (t.dtype.code, t.dtype.bits, t.dtype.lanes), what,
                      lambda key: f"{_dlpack_type_name(*key)} (DLPack)")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None
    if t.strides:
        strides = tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim))
    _require_dense(shape, strides, dtype.itemsize, what)
    device = Device.CUDA if t.device.device_type == _DL_CUDA else Device.HOST
    index = t.device.device_id if device == Device.CUDA else 0
    return _descriptor((t.data or 0) + t.byte_offset, dtype, device, shape, index), capsule, \
        read_only


def _buffer_address(view):
    """The address of a C-contiguous memoryview's first byte; the view holds the export, so
    the address stays valid while the view lives."""
    if not view.readonly:
        return C.addressof(C.c_char.from_buffer(view))
    info = _PyBuffer()
    if _get_buffer(view, C.byref(info), 0) != 0:  # PyBUF_SIMPLE; raises on failure
        raise ArgumentError("the buffer gave no address")
    try:
        return info.buf or 0
    finally:
        _release_buffer(C.byref(info))


def _from_buffer(obj, what, refused=None):
    """refused: why an earlier interface of obj (DLPack) declined, for the message."""
    try:
        view = memoryview(obj)
    except TypeError:
        if refused is not None:
            raise ArgumentError(f"{what}: {refused}") from None
        raise ArgumentError(f"{what} ({type(obj).__name__}) is not an array libmoe can read: "
                            "pass a libmoe.Tensor, a torch tensor, an object with "
                            "__cuda_array_interface__ or __dlpack__, or a buffer") from None
    dtype = _dtype_of(_BUFFER_FORMAT, view.format, what, _buffer_format_name)
    if not view.c_contiguous:
        raise ArgumentError(f"{what} is not C-contiguous; pass a contiguous copy")
    shape = view.shape if view.ndim else (1,)
    address = _buffer_address(view) if view.nbytes else 0
    return _descriptor(address, dtype, Device.HOST, shape), view, view.readonly


_torch_types = set()  # the tensor types seen: one set lookup instead of a module test per call


def _is_torch_tensor(obj):
    if type(obj) in _torch_types:
        return True
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        _torch_types.add(type(obj))
        return True
    return False


def as_tensor(obj, what="tensor", *, writable=False, stream=-1):
    """(descriptor, keepalive) for obj: the descriptor is valid while keepalive is referenced.
    writable: the C call writes into it. stream: the CUDA stream a DLPack producer is asked to
    order its work before (-1: none; the caller orders it)."""
    if isinstance(obj, Tensor):
        desc, keep, read_only = obj.desc, obj, False
    elif _is_torch_tensor(obj):
        desc, keep, read_only = _from_torch(obj, what)
    elif hasattr(obj, "__cuda_array_interface__"):
        desc, keep, read_only = _from_cuda_array_interface(obj.__cuda_array_interface__, obj,
                                                           what)
    elif hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        try:
            desc, keep, read_only = _from_dlpack(obj, what, stream)
        except BufferError as exc:
            # NumPy will not export a read-only array through DLPack; its buffer says so
            desc, keep, read_only = _from_buffer(obj, what, refused=exc)
    else:
        desc, keep, read_only = _from_buffer(obj, what)
    if writable and read_only:
        raise ArgumentError(f"{what} is read-only; libmoe writes into it")
    return desc, keep


class ActivationDescriptors:
    """The [N, width] activation descriptors of one handle (a layer), validated once per
    argument and kind of tensor: a torch tensor's descriptor is built and checked on the first
    call with its (argument, dtype, device, shape), then reused with only its contiguity
    checked and its data pointer refilled. Other arrays take the full path (as_tensor, rows_of,
    check) on every call. stream: a callable giving the stream a DLPack producer is asked to
    order its work before. Used by one thread at a time, as the handle is."""

    _LIMIT = 64  # shapes remembered (a model with varying sequence lengths cycles through some)

    def __init__(self, width, stream=lambda: -1, **expect):
        self.width, self.stream, self.expect, self._cached = width, stream, expect, {}

    def get(self, obj, what, *, writable=False, rows=None):
        """(ctypes reference to the descriptor, object keeping the memory alive, rows N)."""
        is_torch = type(obj) in _torch_types or _is_torch_tensor(obj)
        if is_torch:
            key = (what, obj.dtype, obj.device, obj.shape)
            entry = self._cached.get(key)
            if entry is not None and obj.is_contiguous():
                desc, ref, n = entry
                desc.data = obj.data_ptr() or None
                if rows is not None and n != rows:
                    check(desc, what, shape=(rows, self.width))
                return ref, obj, n
        desc, keep = as_tensor(obj, what, writable=writable, stream=self.stream())
        desc = rows_of(desc, self.width)
        check(desc, what, shape=(rows, self.width), **self.expect)
        n = desc.shape[0]
        if is_torch:
            if len(self._cached) >= self._LIMIT:
                self._cached.clear()
            self._cached[key] = (desc, C.byref(desc), n)
            return self._cached[key][1], keep, n
        return C.byref(desc), keep, n


def rows_of(desc, width):
    """A one-dimensional descriptor (array.array is flat) viewed as [n / width, width]; others
    unchanged."""
    if desc.ndim == 1 and width > 0 and desc.shape[0] % width == 0:
        return _descriptor(desc.data, desc.dtype, desc.device, (desc.shape[0] // width, width),
                           desc.device_index)
    return desc


def check(desc, what, *, dtype=None, device=None, device_index=None, shape=None):
    """Raise ArgumentError unless desc matches: shape entries None match any extent. A CUDA
    descriptor of unknown device (the CUDA array interface names none) takes device_index."""
    dtype = None if dtype is None else to_enum(DType, dtype)
    device = None if device is None else to_enum(Device, device)
    if dtype is not None and desc.dtype != dtype:
        raise ArgumentError(f"{what} is {DType(desc.dtype).name.lower()}; expected "
                            f"{DType(dtype).name.lower()}")
    if device is not None and desc.device != device:
        raise ArgumentError(f"{what} is in {Device(desc.device).name.lower()} memory; this "
                            f"runtime needs {Device(device).name.lower()} memory")
    if (device_index is not None and desc.device == Device.CUDA and desc.device_index >= 0
            and desc.device_index != device_index):
        raise ArgumentError(f"{what} is on cuda:{desc.device_index}; this runtime uses "
                            f"cuda:{device_index}")
    if shape is not None:
        got = tuple(desc.shape[i] for i in range(desc.ndim))
        if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
            want = tuple("*" if w is None else w for w in shape)
            raise ArgumentError(f"{what} has shape {got}; expected {want}")
    if desc.device == Device.CUDA and desc.device_index < 0 and device_index is not None:
        desc.device_index = device_index

