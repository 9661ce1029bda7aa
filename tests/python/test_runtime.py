"""The runtime from Python: backends and their queries, the log callback (at creation and after
set_log), streams on the host backend, axes without a mesh, and configuration errors."""
import os
import re
import unittest

import libmoe

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class RuntimeTest(unittest.TestCase):
    def test_host_backend(self):
        with libmoe.Runtime("host", seed=3, deterministic=True) as rt:
            self.assertEqual((rt.backend, rt.device, rt.device_index, rt.compute_dtype),
                             (libmoe.Backend.HOST, libmoe.Device.HOST, 0, libmoe.DType.F32))
            self.assertEqual((rt.axis("ep"), rt.axis(libmoe.Axis.WORLD)), ((0, 1), (0, 1)))
            self.assertEqual((rt.rank, rt.world_size), (0, 1))
            rt.set_stream(None)  # the host backend ignores streams
            self.assertIsNone(rt.get_stream())  # and has none
            rt.synchronize()
            self.assertEqual(rt.async_error(), (libmoe.Status.SUCCESS, ""))
            self.assertEqual(rt.wait_stats(), (0.0, 0))  # a world of one never waits
        with libmoe.Runtime() as rt:  # auto: the host backend on a machine without a GPU
            self.assertIn(rt.backend, (libmoe.Backend.HOST, libmoe.Backend.CUDA))

    def test_exit_status_matches_the_header(self):
        with open(os.path.join(ROOT, "include", "moe", "core.h"), encoding="utf-8") as f:
            value = re.search(r"#define MOE_EXIT_PEER_LOST (\d+)", f.read()).group(1)
        self.assertEqual(libmoe.EXIT_PEER_LOST, int(value))

    def test_log_callback(self):
        got = []
        with libmoe.Runtime("host", log_level="info",
                            log=lambda level, msg: got.append((level, msg))) as rt:
            self.assertTrue(any(level == libmoe.LogLevel.INFO and "runtime: backend host" in msg
                                for level, msg in got), got)
            later = []
            rt.set_log("debug", lambda level, msg: later.append(msg))
            rt.set_log("warn")  # back to stderr
        self.assertEqual(later, [])

    def test_config_errors(self):
        with self.assertRaisesRegex(TypeError, "no option 'backnd'"):
            libmoe.Runtime(backnd="host")
        with self.assertRaisesRegex(ValueError, "unknown Backend 'tpu'"):
            libmoe.Runtime("tpu")
        with self.assertRaisesRegex(ValueError, "unknown LogLevel value 7"):
            libmoe.Runtime("host", log_level=7)
        with self.assertRaises(libmoe.Error) as cm:  # refused by libmoe itself, whatever the GPUs
            libmoe.Runtime("cuda", device_index=999)
        self.assertEqual(cm.exception.call, "moe_runtime_create")
        with self.assertRaisesRegex(libmoe.ArgumentError, "not a CUDA stream"):
            with libmoe.Runtime("host") as rt:
                rt.set_stream(object())


if __name__ == "__main__":
    unittest.main()
