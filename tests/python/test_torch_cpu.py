"""libmoe.torch without a GPU, where PyTorch is installed (skipped otherwise, as on CI):
tests/python/torch_check.py --host runs the GPU check's checks on the host backend (MoELayer
against the plain PyTorch layer at fp32 bounds, zero-copy parameters, slots, DLPack, errors,
two models that train), and torch tensors with a layout libmoe refuses raise before the call.
The check runs under this interpreter when it has PyTorch, else under Debian's /usr/bin/python3
when that one has it (python3-torch), so a CI whose python3 is another interpreter still runs
MoELayer."""
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


def torch_python():
    """An interpreter that imports torch: this one, else Debian's; None without one."""
    if torch is not None:
        return sys.executable
    debian = "/usr/bin/python3"
    if os.path.exists(debian) and subprocess.run([debian, "-c", "import torch"],
                                                 capture_output=True).returncode == 0:
        return debian
    return None


class TorchOnHostTest(unittest.TestCase):
    def test_torch_check_on_the_host_backend(self):
        python = torch_python()
        if python is None:
            self.skipTest("PyTorch is not installed (scripts/setup-deps.sh --tests installs "
                          "python3-torch)")
        # the package under test, also for Debian's interpreter (the source tree's, or the
        # installed wheel's under test_wheel.py)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(libmoe.__file__)))
        r = subprocess.run([python, os.path.join(ROOT, "tests", "python", "torch_check.py"),
                            "--host"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=package_root))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn('"check": "summary", "ok": true', r.stdout)

    @unittest.skipIf(torch is None, "PyTorch is not installed for this interpreter")
    def test_refused_tensors(self):
        with libmoe.Runtime("host") as rt:
            layer = libmoe.Layer(rt, hidden=8, ffn_hidden=8, num_experts=4, top_k=2)
            with self.assertRaisesRegex(libmoe.ArgumentError, "not contiguous"):
                layer.forward(torch.zeros(8, 4).t())
            with self.assertRaisesRegex(libmoe.ArgumentError, "torch.float64"):
                layer.forward(torch.zeros(4, 8, dtype=torch.float64))
            desc, _ = libmoe.as_tensor(torch.zeros(4, 8))
            self.assertEqual((desc.device, desc.dtype), (libmoe.Device.HOST, libmoe.DType.F32))

    @unittest.skipIf(torch is None, "PyTorch is not installed for this interpreter")
    def test_zero_grad_of_the_layers_own_parameters(self):
        from libmoe.torch import MoELayer
        m = MoELayer(8, 8, 4, 2, runtime=libmoe.Runtime("host"))
        m(torch.randn(6, 8, requires_grad=True)).sum().backward()
        self.assertTrue(all(p.grad is not None and p.grad.abs().sum() > 0
                            for p in m.parameters()))
        m.zero_grad(set_to_none=False)
        self.assertTrue(all(p.grad is not None and p.grad.abs().sum() == 0
                            for p in m.parameters()))
        m.zero_grad()
        self.assertTrue(all(p.grad is None for p in m.parameters()))
        self.assertEqual(len(m._free), 1)  # the backward gave the slot back


if __name__ == "__main__":
    unittest.main()
