"""Handle lifetime: 1,000 create/destroy cycles leak neither handles nor memory, whether handles
are closed explicitly, by `with`, or by the garbage collector; a runtime closes its children
first; a closed handle raises INVALID_HANDLE instead of reaching libmoe."""
import array
import gc
import os
import unittest

import libmoe

CYCLES = 1000
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def cycle_closed():
    with libmoe.Runtime("host") as rt:
        layer = libmoe.Layer(rt, hidden=8, ffn_hidden=8, num_experts=4, top_k=2)
        opt = libmoe.AdamW(rt)
        opt.add_layer(layer)
        t = rt.tensor((4, 8))
        layer.forward(t)
        layer.release_slot(0)
        with libmoe.Schedule(2, 2, 1):
            pass


def cycle_collected():
    rt = libmoe.Runtime("host")
    layer = libmoe.Layer(rt, hidden=8, ffn_hidden=8, num_experts=4, top_k=2)
    libmoe.AdamW(rt).add_layer(layer)
    rt.tensor((4, 8))
    libmoe.Schedule(3, 4, 0)
    del rt, layer


class LifetimeTest(unittest.TestCase):
    def check_no_leak(self, cycle):
        base_handles = libmoe.live_handles()
        for _ in range(100):  # warm-up: allocator pools, ctypes caches
            cycle()
        gc.collect()
        before = rss_bytes()
        for _ in range(CYCLES):
            cycle()
        gc.collect()
        grown = rss_bytes() - before
        self.assertEqual(libmoe.live_handles(), base_handles)
        # a leaked layer is ~10 KiB here: 1,000 of them would be ~10 MiB
        self.assertLess(grown, 2 << 20, f"RSS grew by {grown} bytes over {CYCLES} cycles")

    def test_closed_cycles(self):
        self.check_no_leak(cycle_closed)

    def test_collected_cycles(self):
        self.check_no_leak(cycle_collected)

    def test_runtime_closes_children_first(self):
        rt = libmoe.Runtime("host")
        layer = libmoe.Layer(rt, hidden=8, ffn_hidden=8, num_experts=4, top_k=2)
        t = rt.tensor((2, 8))
        n = libmoe.live_handles()
        rt.close()
        self.assertTrue(layer.closed and t.closed)
        self.assertEqual(libmoe.live_handles(), n - 3)
        for call in (lambda: layer.forward(array.array("f", [0.0] * 16)), layer.zero_grad,
                     lambda: rt.axis("ep")):
            with self.assertRaises(libmoe.Error) as cm:
                call()
            self.assertEqual(cm.exception.status, libmoe.Status.INVALID_HANDLE)
        rt.close()  # a second close is a no-op
        with self.assertRaisesRegex(libmoe.Error, "the layer is closed: its runtime "
                                    "was closed") as cm:
            layer.forward(array.array("f", [0.0] * 16))
        with self.assertRaisesRegex(libmoe.Error, "the tensor is closed: its runtime was "
                                    "closed"):
            layer.params["router.weight"].value.desc  # noqa: B018 - a view of the layer

    def test_a_handle_closed_itself_says_so(self):
        rt = libmoe.Runtime("host")
        layer = libmoe.Layer(rt, hidden=8, ffn_hidden=8, num_experts=4, top_k=2)
        layer.close()
        rt.close()
        with self.assertRaises(libmoe.Error) as cm:
            layer.zero_grad()
        self.assertEqual(cm.exception.message, "the layer is closed")

    def test_views_keep_their_layer_alive(self):
        with libmoe.Runtime("host") as rt:
            layer = libmoe.Layer(rt, hidden=8, ffn_hidden=8, num_experts=4, top_k=2)
            w = layer.param("router.weight")
            before = w.tolist()
            del layer
            gc.collect()
            self.assertEqual(w.tolist(), before)  # the layer lives on through its view


if __name__ == "__main__":
    unittest.main()
