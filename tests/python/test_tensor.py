"""Tensor conversion: the buffer protocol, the CUDA array interface and DLPack become
moe_tensor_t descriptors without copies, and every mismatch (dtype, layout, device, shape,
writability) raises ArgumentError before libmoe is called. Device objects are fakes carrying
host pointers: the descriptor and the validation are tested, never a GPU path (such a pointer
is not valid device memory, so the layer must refuse it on the host backend before the call)."""
import array
import ctypes as C
import unittest

import libmoe
from libmoe import tensor as T

try:
    import numpy
except ImportError:  # CI has the standard library alone
    numpy = None

H = 4


class FakeCudaArray:
    """__cuda_array_interface__ v3 over host memory (a stand-in for CuPy or Numba)."""

    def __init__(self, shape, typestr="<f4", strides=None, read_only=False):
        self.buf = (C.c_char * 256)()
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": strides,
                                         "data": (C.addressof(self.buf), read_only),
                                         "version": 3, "stream": None}


class FakeDLPack:
    """A DLPack producer over host memory: __dlpack__ returns a "dltensor" capsule whose
    deleter the capsule's destructor would call (none here: the memory is the object's)."""

    def __init__(self, shape, device_type=2, code=2, bits=32, strides=None):
        self.buf = (C.c_char * 256)()
        self.shape = (C.c_int64 * len(shape))(*shape)
        self.strides = None if strides is None else (C.c_int64 * len(strides))(*strides)
        m = T.DLManagedTensor()
        m.dl_tensor.data = C.addressof(self.buf)
        m.dl_tensor.device.device_type, m.dl_tensor.device.device_id = device_type, 0
        m.dl_tensor.ndim = len(shape)
        m.dl_tensor.dtype.code, m.dl_tensor.dtype.bits, m.dl_tensor.dtype.lanes = code, bits, 1
        m.dl_tensor.shape = self.shape
        m.dl_tensor.strides = self.strides
        self.managed = m
        self.device = (device_type, 0)
        self.streams = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        new = C.pythonapi.PyCapsule_New
        new.restype, new.argtypes = C.py_object, [C.c_void_p, C.c_char_p, C.c_void_p]
        return new(C.addressof(self.managed), b"dltensor", None)


class ConversionTest(unittest.TestCase):
    def test_buffers(self):
        a = array.array("f", [1.0] * 8)
        desc, keep = libmoe.as_tensor(a)
        self.assertEqual((desc.dtype, desc.ndim, desc.shape[0], desc.device),
                         (libmoe.DType.F32, 1, 8, libmoe.Device.HOST))
        self.assertEqual(desc.data, a.buffer_info()[0])  # no copy
        self.assertEqual(T.rows_of(desc, 4).shape[:2], [2, 4])
        m = memoryview(bytearray(16)).cast("f", (2, 2))
        self.assertEqual(libmoe.as_tensor(m)[0].shape[:2], [2, 2])
        bf16 = array.array("H", [0x3f80] * 4)
        self.assertEqual(libmoe.as_tensor(bf16)[0].dtype, libmoe.DType.BF16)

    def test_buffer_refusals(self):
        with self.assertRaisesRegex(libmoe.ArgumentError,
                                    r"x has element type float64 \(buffer format 'd'\)"):
            libmoe.as_tensor(array.array("d", [1.0]), "x")
        with self.assertRaisesRegex(libmoe.ArgumentError, "element type int32"):
            libmoe.as_tensor(array.array("i", [1]), "x")
        with self.assertRaisesRegex(libmoe.ArgumentError, "not C-contiguous"):
            libmoe.as_tensor(memoryview(array.array("f", [0.0] * 8))[::2], "x")
        ro = memoryview(bytes(8)).cast("f")
        desc, _ = libmoe.as_tensor(ro, "x")  # an input may be read-only
        self.assertNotEqual(desc.data, None)
        with self.assertRaisesRegex(libmoe.ArgumentError, "y is read-only; libmoe writes"):
            libmoe.as_tensor(ro, "y", writable=True)
        with self.assertRaisesRegex(libmoe.ArgumentError, "is not an array"):
            libmoe.as_tensor(object(), "x")
        with self.assertRaisesRegex(libmoe.ArgumentError, "1..4 dimensions"):
            libmoe.as_tensor(memoryview(bytearray(4 * 32)).cast("f", (2, 2, 2, 2, 2)), "x")

    @unittest.skipIf(numpy is None, "NumPy is not installed")
    def test_numpy(self):
        a = numpy.zeros((3, 4), dtype=numpy.float32)
        desc, keep = libmoe.as_tensor(a, "x")
        self.assertEqual((desc.shape[:2], desc.data), ([3, 4], a.ctypes.data))
        with self.assertRaisesRegex(libmoe.ArgumentError, "not (C-contiguous|dense)"):
            libmoe.as_tensor(a[:, ::2], "x")  # through DLPack where NumPy has it
        with self.assertRaisesRegex(libmoe.ArgumentError, "x has element type float64"):
            libmoe.as_tensor(a.astype(numpy.float64), "x")
        with self.assertRaisesRegex(libmoe.ArgumentError, "x has element type float16"):
            libmoe.as_tensor(a.astype(numpy.float16), "x")
        a.flags.writeable = False  # NumPy then refuses DLPack with a BufferError
        desc, _ = libmoe.as_tensor(a, "x")
        self.assertEqual(desc.data, a.ctypes.data)
        with self.assertRaisesRegex(libmoe.ArgumentError, "y is read-only; libmoe writes"):
            libmoe.as_tensor(a, "y", writable=True)
        with libmoe.Runtime("host") as rt:
            layer = libmoe.Layer(rt, hidden=4, ffn_hidden=8, num_experts=4, top_k=2)
            with self.assertRaisesRegex(libmoe.ArgumentError, "y is read-only"):
                layer.forward(numpy.zeros((3, 4), numpy.float32), a)

    def test_cuda_array_interface(self):
        f = FakeCudaArray((2, H))
        desc, keep = libmoe.as_tensor(f, "x")
        self.assertIs(keep, f)
        self.assertEqual((desc.device, desc.dtype, desc.shape[:2], desc.data),
                         (libmoe.Device.CUDA, libmoe.DType.F32, [2, H], C.addressof(f.buf)))
        self.assertEqual(libmoe.as_tensor(FakeCudaArray((3,), "<V2"))[0].dtype,
                         libmoe.DType.BF16)
        with self.assertRaisesRegex(libmoe.ArgumentError,
                                    r"element type float16 \(typestr '<f2'\)"):
            libmoe.as_tensor(FakeCudaArray((3,), "<f2"), "x")
        with self.assertRaisesRegex(libmoe.ArgumentError, "not dense"):
            libmoe.as_tensor(FakeCudaArray((2, 2), strides=(16, 4)), "x")
        libmoe.as_tensor(FakeCudaArray((2, 1), strides=(4, 400)))  # size-1 strides are free
        with self.assertRaisesRegex(libmoe.ArgumentError, "read-only"):
            libmoe.as_tensor(FakeCudaArray((2,), read_only=True), "y", writable=True)

    def test_dlpack(self):
        f = FakeDLPack((2, H))
        desc, keep = libmoe.as_tensor(f, "x", stream=7)
        self.assertEqual((desc.device, desc.dtype, desc.shape[:2], desc.data),
                         (libmoe.Device.CUDA, libmoe.DType.F32, [2, H], C.addressof(f.buf)))
        self.assertEqual(f.streams, [7])  # the consumer's stream reaches the producer
        bf = FakeDLPack((3,), code=4, bits=16)
        self.assertEqual(libmoe.as_tensor(bf)[0].dtype, libmoe.DType.BF16)
        host = FakeDLPack((3,), device_type=1)
        self.assertEqual(libmoe.as_tensor(host)[0].device, libmoe.Device.HOST)
        self.assertEqual(host.streams, [None])
        with self.assertRaisesRegex(libmoe.ArgumentError,
                                    r"x has element type float16 \(DLPack\); libmoe takes"):
            libmoe.as_tensor(FakeDLPack((3,), code=2, bits=16), "x")
        with self.assertRaisesRegex(libmoe.ArgumentError, r"element type int64 \(DLPack\)"):
            libmoe.as_tensor(FakeDLPack((3,), code=0, bits=64), "x")
        with self.assertRaisesRegex(libmoe.ArgumentError, "not dense"):
            libmoe.as_tensor(FakeDLPack((2, 2), strides=(1, 2)), "x")
        with self.assertRaisesRegex(libmoe.ArgumentError, "device type 8"):
            libmoe.as_tensor(FakeDLPack((2,), device_type=8), "x")


class ValidationTest(unittest.TestCase):
    """A host runtime refuses device arrays, and every argument is checked before the call."""

    def setUp(self):
        self.rt = libmoe.Runtime("host")
        self.layer = libmoe.Layer(self.rt, hidden=H, ffn_hidden=8, num_experts=4, top_k=2)

    def tearDown(self):
        self.rt.close()

    def test_device_arrays_on_a_host_runtime(self):
        for fake in (FakeCudaArray((2, H)), FakeDLPack((2, H))):
            with self.assertRaisesRegex(libmoe.ArgumentError,
                                        "x is in cuda memory; this runtime needs host memory"):
                self.layer.forward(fake)

    def test_dtype_and_shape(self):
        with self.assertRaisesRegex(libmoe.ArgumentError, "x is bf16; expected f32"):
            self.layer.forward(array.array("H", [0] * (2 * H)))
        with self.assertRaisesRegex(libmoe.ArgumentError, r"x has shape \(2, 3\)"):
            self.layer.forward(memoryview(bytearray(24)).cast("f", (2, 3)))

    def test_owned_tensors_and_copies(self):
        t = self.rt.tensor((2, 3))
        self.assertEqual((t.shape, t.dtype, t.device), ((2, 3), libmoe.DType.F32,
                                                        libmoe.Device.HOST))
        src = array.array("f", [1.5, -2.0, 0.25, 3.0, 1e-3, 7.0])
        self.rt.copy(t, src)
        self.assertEqual(t.tolist(), list(src))
        b = self.rt.tensor((6,), dtype="bf16")
        self.rt.copy(b, t)  # f32 -> bf16 rounds to nearest even
        self.assertEqual(b.tolist()[:4], [1.5, -2.0, 0.25, 3.0])
        self.assertAlmostEqual(b.tolist()[4], 1e-3, delta=1e-5)
        t.close()
        with self.assertRaises(libmoe.Error) as cm:
            t.memoryview()
        self.assertEqual(cm.exception.status, libmoe.Status.INVALID_HANDLE)


if __name__ == "__main__":
    unittest.main()
