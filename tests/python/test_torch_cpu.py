"""libmoe.torch without a GPU, where PyTorch is installed (skipped otherwise, as on CI):
python/tests/torch_check.py --host runs the GPU check's checks on the host backend (MoELayer
against the plain PyTorch layer at fp32 bounds, zero-copy parameters, slots, DLPack, errors,
two models that train), and torch tensors with a layout libmoe refuses raise before the call."""
import os
import subprocess
import sys
import unittest

import libmoe

try:
    import torch
except ImportError:
    torch = None

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@unittest.skipIf(torch is None, "PyTorch is not installed")
class TorchOnHostTest(unittest.TestCase):
    def test_torch_check_on_the_host_backend(self):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "python", "tests",
                                                         "torch_check.py"), "--host"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn('"check": "summary", "ok": true', r.stdout)

    def test_refused_tensors(self):
        with libmoe.Runtime("host") as rt:
            layer = libmoe.Layer(rt, hidden=8, ffn_hidden=8, num_experts=4, top_k=2)
            with self.assertRaisesRegex(libmoe.ArgumentError, "not contiguous"):
                layer.forward(torch.zeros(8, 4).t())
            with self.assertRaisesRegex(libmoe.ArgumentError, "torch.float64"):
                layer.forward(torch.zeros(4, 8, dtype=torch.float64))
            desc, _ = libmoe.as_tensor(torch.zeros(4, 8))
            self.assertEqual((desc.device, desc.dtype), (libmoe.Device.HOST, libmoe.DType.F32))


if __name__ == "__main__":
    unittest.main()
