"""The wheel: scripts/python-wheel.sh builds it offline from this build's libmoe.so, it installs
with pip into a plain `python -m venv` without an index, imports there with no MOE_LIBRARY and
no PYTHONPATH (the library inside the package, its RUNPATH starting with $ORIGIN), and the
package's tests (tests/python/test_*.py but this one and the source install's) pass against
the installed copy."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile

import libmoe

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
SONAME = "libmoe.so.{}.{}".format(*libmoe.__version__.split(".")[:2])
NOT_HERE = ("test_wheel.py", "test_install.py")  # this test, and the source tree's install


def builder():
    """An interpreter with build, setuptools and wheel (Debian's), or None."""
    for exe in ("/usr/bin/python3", sys.executable):
        if os.path.exists(exe) and subprocess.run(
                [exe, "-c", "import build, setuptools, wheel"], capture_output=True).returncode == 0:
            return exe
    return None


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise AssertionError(f"{cmd} exited {r.returncode}:\n{r.stdout}{r.stderr}")
    return r.stdout


class WheelTest(unittest.TestCase):
    def test_wheel_in_a_plain_venv(self):
        python = builder()
        if python is None or not shutil.which("patchelf"):
            self.skipTest("no python3-build/-wheel or patchelf (scripts/setup-deps.sh --tests)")
        with tempfile.TemporaryDirectory() as tmp:
            out = run(["bash", os.path.join(ROOT, "scripts", "python-wheel.sh"),
                       os.environ["MOE_LIBRARY"], os.path.join(tmp, "dist")],
                      env=dict(os.environ, PYTHON=python))
            wheel = out.split()[-1]
            self.assertRegex(os.path.basename(wheel),
                             rf"^libmoe-{libmoe.__version__}-py3-none-linux_\w+\.whl$")
            with zipfile.ZipFile(wheel) as z:
                self.assertIn(f"libmoe/{SONAME}", z.namelist())
            self.assertEqual(os.listdir(os.path.join(ROOT, "python", "libmoe")).count(SONAME),
                             0, "the build left the library in the source tree")

            venv = os.path.join(tmp, "venv")
            run([sys.executable, "-m", "venv", venv])  # plain: no system site-packages
            vpy = os.path.join(venv, "bin", "python")
            run([vpy, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", wheel])
            env = {k: v for k, v in os.environ.items() if k not in ("MOE_LIBRARY", "PYTHONPATH")}
            where = run([vpy, "-c", "import libmoe; lib = libmoe.library(); "
                                    "print(lib.path, lib.how, sep='|')"], env=env, cwd=tmp)
            path, how = where.strip().split("|")
            self.assertTrue(path.startswith(venv) and path.endswith(SONAME), path)
            self.assertEqual(how, "bundled with the package")
            rpath = run(["patchelf", "--print-rpath", path]).strip()
            self.assertTrue(rpath.startswith("$ORIGIN"), rpath)

            for test in sorted(glob.glob(os.path.join(HERE, "test_*.py"))):
                if os.path.basename(test) in NOT_HERE:
                    continue
                with self.subTest(test=os.path.basename(test)):
                    r = subprocess.run([vpy, test], capture_output=True, text=True, env=env,
                                       cwd=tmp)
                    self.assertEqual(r.returncode, 0, r.stdout + r.stderr[-4000:])


if __name__ == "__main__":
    unittest.main()
