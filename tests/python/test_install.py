"""`pip install ./python` works offline with Debian's setuptools (no build isolation, no index),
installs the pure-Python package, and the installed copy loads libmoe and runs."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def installer():
    """Debian's interpreter (python3-pip, -setuptools, -wheel), else this one."""
    def runs(exe, *args):
        return subprocess.run([exe, *args], capture_output=True).returncode == 0

    for exe in ("/usr/bin/python3", sys.executable):
        if exe and os.path.exists(exe) and runs(exe, "-c", "import setuptools, wheel") and \
                runs(exe, "-m", "pip", "--version"):
            return exe
    return None


class InstallTest(unittest.TestCase):
    def test_pip_install(self):
        exe = installer()
        if exe is None:
            self.skipTest("no interpreter with pip, setuptools and wheel "
                          "(scripts/setup-deps.sh --tests installs them)")
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "src")  # pip builds in place: keep the tree clean
            shutil.copytree(os.path.join(ROOT, "python"), src,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
            target = os.path.join(tmp, "site")
            r = subprocess.run([exe, "-m", "pip", "install", "--quiet", "--no-build-isolation",
                                "--no-index", "--no-deps", "--target", target, src],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertTrue(os.path.isfile(os.path.join(target, "libmoe", "torch.py")))
            code = ("import libmoe; rt = libmoe.Runtime('host'); "
                    "print(libmoe.__file__, libmoe.__version__, rt.backend.name)")
            r = subprocess.run([exe, "-c", code], capture_output=True, text=True, cwd=tmp,
                               env=dict(os.environ, PYTHONPATH=target))
            self.assertEqual(r.returncode, 0, r.stderr)
            path, version, backend = r.stdout.split()
            self.assertTrue(path.startswith(target), path)
            self.assertEqual(backend, "HOST")


if __name__ == "__main__":
    unittest.main()
