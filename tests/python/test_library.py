"""Loading libmoe.so and the package's contract with the C API: where the library came from,
the failure message, the version check, statuses, and that SIGNATURES covers every MOE_API
function of include/moe (so the package wraps the whole public API)."""
import os
import re
import subprocess
import sys
import unittest

import libmoe
from libmoe import _native

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PKG = os.path.join(ROOT, "python", "libmoe")


def read(*path):
    with open(os.path.join(*path), encoding="utf-8") as f:
        return f.read()


def header_functions():
    names = set()
    for h in os.listdir(os.path.join(ROOT, "include", "moe")):
        text = read(ROOT, "include", "moe", h)
        names.update(re.findall(r"MOE_API\b[^;{]*?\b(moe_\w+)\s*\(", text, re.S))
    return names


# where the package under test came from: the source tree, or an installed wheel (test_wheel.py
# runs these tests in a venv, with the library inside the package and no MOE_LIBRARY)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(libmoe.__file__)))
BUNDLED = any(n.startswith("libmoe.so") for n in os.listdir(os.path.join(PACKAGE_ROOT, "libmoe")))


def run_python(code, **env):
    full = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full)


class LibraryTest(unittest.TestCase):
    def test_loaded_library_says_where_from(self):
        lib = libmoe.library()
        self.assertTrue(os.path.isfile(lib.path), lib.path)
        self.assertIn(libmoe.ENV_VAR if os.environ.get(libmoe.ENV_VAR) else
                      "bundled with the package", lib.how)
        self.assertIn(lib.path, repr(lib))
        self.assertIs(libmoe.load(), lib)
        with self.assertRaisesRegex(libmoe.Error, "already loaded"):
            libmoe.load("/nonexistent/libmoe.so")

    def test_version_matches_header_and_library(self):
        core = read(ROOT, "include", "moe", "core.h")
        parts = [re.search(rf"#define MOE_VERSION_{p} (\d+)", core).group(1)
                 for p in ("MAJOR", "MINOR", "PATCH")]
        self.assertEqual(libmoe.__version__, ".".join(parts))
        self.assertEqual(libmoe.version(), ".".join(parts))

    def test_not_found_lists_attempts(self):
        r = run_python("import libmoe; libmoe.Runtime('host')", MOE_LIBRARY="/nonexistent/x.so")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("LibraryNotFound", r.stderr)
        self.assertIn("/nonexistent/x.so (MOE_LIBRARY=/nonexistent/x.so)", r.stderr)
        r = run_python("import libmoe; libmoe.load('/nope/libmoe.so')")
        self.assertIn("/nope/libmoe.so (the path given to libmoe.load())", r.stderr)

    def test_explicit_path_and_loader_rules(self):
        path = libmoe.library().path
        code = "import libmoe; print(libmoe.library().path, libmoe.library().how, sep='|')"
        r = run_python(f"import libmoe; libmoe.load({path!r}); " + code.split("; ", 1)[1],
                       MOE_LIBRARY="")
        self.assertEqual(r.stdout.strip(), f"{path}|the path given to libmoe.load()", r.stderr)
        r = run_python(code, MOE_LIBRARY="", LD_LIBRARY_PATH=os.path.dirname(path))
        self.assertEqual(r.stdout.split("|")[0], path, r.stderr)
        # the package's own copy comes before the loader's rules
        self.assertIn("bundled with the package" if BUNDLED else "dynamic loader", r.stdout)

    def test_version_mismatch_is_refused(self):
        r = run_python("import libmoe._native as n; n.API_MINOR = 99; "
                       "import libmoe; libmoe.library()")
        self.assertIn("this package is written for 0.99.x", r.stderr)

    def test_statuses(self):
        for s in libmoe.Status:
            self.assertTrue(libmoe.status_string(s))
        err = libmoe.Error(libmoe.Status.TIMEOUT, "slow", "moe_x")
        self.assertEqual(str(err), "moe_x: timeout: slow")
        newer = libmoe.Error(99, "a status a newer libmoe added")
        self.assertEqual((newer.status, str(newer)), (99, "status 99: a status a newer libmoe "
                                                          "added"))
        self.assertTrue(issubclass(libmoe.ArgumentError, ValueError))

    def test_signatures_cover_the_public_api(self):
        declared = header_functions()
        self.assertGreater(len(declared), 60)
        self.assertEqual(sorted(declared - set(_native.SIGNATURES)), [],
                         "public functions without a ctypes signature in _native.SIGNATURES")
        self.assertEqual(sorted(set(_native.SIGNATURES) - declared), [],
                         "signatures of functions no header declares")
        source = "".join(read(PKG, f) for f in os.listdir(PKG)
                         if f.endswith(".py") and f != "_native.py")
        # helpers whose work the package does in Python: descriptors, element counts, dtype
        # names, whole-tensor checkpoint entries; moe_last_error is read by _native itself
        in_python = {"moe_tensor_view", "moe_tensor_numel", "moe_dtype_size", "moe_dtype_name",
                     "moe_ckpt_tensor_whole", "moe_last_error"}
        unused = sorted(n for n in declared - in_python if n not in source)
        self.assertEqual(unused, [], "public functions no wrapper calls")

    def test_a_function_the_library_lacks_raises_unsupported(self):
        lib = libmoe.library()
        stub = lib._bind("moe_not_in_this_library", _native.STATUS, [])
        with self.assertRaises(libmoe.Error) as cm:
            stub()
        self.assertEqual(cm.exception.status, libmoe.Status.UNSUPPORTED)

    def test_torch_module_is_guarded(self):
        r = run_python("import libmoe; import libmoe.torch")
        try:
            import torch  # noqa: F401
        except ImportError:
            self.assertIn("No module named 'torch'", r.stderr)
        else:
            self.skipTest("PyTorch is installed: tests/python/torch_check.py covers it")


if __name__ == "__main__":
    unittest.main()
