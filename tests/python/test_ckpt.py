"""The checkpointer from Python: save_async, wait/poll, status, list, load_latest / load_step
into other buffers, a layer's parameters through Entry.of_param, a whole training state
(TrainState), steps set aside, errors and abort."""
import array
import os
import socket
import tempfile
import time
import unittest

import libmoe


class CheckpointTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.rt = libmoe.Runtime("host", seed=4)
        # small chunks and buffered writes: tmpfs refuses O_DIRECT
        self.opts = dict(chunk_bytes=1 << 16, pinned_budget_bytes=1 << 17, use_direct_io=0)

    def tearDown(self):
        self.rt.close()
        self.tmp.cleanup()

    def test_save_wait_load(self):
        a = array.array("f", [float(i) for i in range(100)])
        b = array.array("H", [0x3f80 + i for i in range(10)])
        with libmoe.Checkpointer(self.rt, self.tmp.name, keep_last=2, **self.opts) as ck:
            for step in (1, 2, 3):
                a[0] = step
                ck.save_async(step, {"a": a, "b": b})
            self.assertTrue(ck.wait(timeout=30))
            self.assertTrue(ck.poll())
            st = ck.status()
            self.assertIsInstance(st, libmoe.CkptStatus)
            self.assertEqual((st.state, st.last_committed_step, st.pending_saves),
                             (libmoe.CkptState.IDLE, 3, 0))
            self.assertEqual(ck.list(), [2, 3])
            with self.assertRaises(libmoe.Error) as cm:
                ck.list("s3")
            self.assertEqual(cm.exception.status, libmoe.Status.UNSUPPORTED)
            self.assertEqual(ck.async_error(), (libmoe.Status.SUCCESS, ""))
            a2, b2 = array.array("f", bytes(400)), array.array("H", bytes(20))
            self.assertEqual(ck.load_latest({"a": a2, "b": b2}), 3)
            self.assertEqual((list(a2[1:]), a2[0], list(b2)), (list(a[1:]), 3.0, list(b)))
            ck.load_step(2, [libmoe.Entry("a", a2)])
            self.assertEqual(a2[0], 2.0)
            with self.assertRaises(libmoe.Error) as cm:
                ck.load_step(9, {"a": a2})
            self.assertEqual(cm.exception.status, libmoe.Status.NOT_FOUND)
            with self.assertRaises(libmoe.Error) as cm:
                ck.load_latest({"missing": a2})
            self.assertEqual(cm.exception.status, libmoe.Status.INVALID_ARGUMENT)
            with self.assertRaisesRegex(libmoe.Error, "step"):
                ck.save_async(3, {"a": a})  # not after the last step

    def test_layer_parameters_round_trip(self):
        cfg = dict(hidden=6, ffn_hidden=4, num_experts=4, top_k=2)
        layer = libmoe.Layer(self.rt, **cfg)
        with libmoe.Checkpointer(self.rt, self.tmp.name, **self.opts) as ck:
            ck.save_async(10, [libmoe.Entry.of_param(p, "l0.") for p in layer.params.values()])
            ck.wait()
            with libmoe.Runtime("host", seed=99) as other:
                fresh = libmoe.Layer(other, **cfg)
                before = fresh.param("experts.w2").tolist()
                self.assertNotEqual(before, layer.param("experts.w2").tolist())
                ck.load_latest([libmoe.Entry.of_param(p, "l0.")
                                for p in fresh.params.values()])
                for name in layer.params:
                    self.assertEqual(fresh.param(name).tolist(), layer.param(name).tolist())

    def test_train_state(self):
        cfg = dict(hidden=6, ffn_hidden=4, num_experts=4, top_k=2)
        layer = libmoe.Layer(self.rt, **cfg)
        opt = libmoe.AdamW(self.rt)
        opt.add_layer(layer)
        layer.forward(array.array("f", [0.3] * 24))
        layer.backward(array.array("f", [1.0] * 24), need_dx=False)
        opt.step()
        position = array.array("f", [42.0])
        with libmoe.Checkpointer(self.rt, self.tmp.name, **self.opts) as ck:
            state = libmoe.TrainState()
            state.add_layer(layer, "moe.")
            state.add_adamw(opt, "optim.")
            state.add_tensor(libmoe.Entry("data.position", position), kind="buffer")
            ck.save_train_state(5, state)
            ck.wait()
            with libmoe.Runtime("host", seed=8) as other:
                layer2 = libmoe.Layer(other, **cfg)
                opt2 = libmoe.AdamW(other)
                opt2.add_layer(layer2)
                position2 = array.array("f", [0.0])
                state2 = libmoe.TrainState()
                state2.add_layer(layer2, "moe.")
                state2.add_adamw(opt2, "optim.")
                state2.add_tensor(libmoe.Entry("data.position", position2), kind="buffer")
                self.assertEqual(ck.load_train_state(state2), 5)
                self.assertEqual((position2[0], opt2.step_count), (42.0, 1))
                for name in layer.params:
                    self.assertEqual(layer2.param(name).tolist(), layer.param(name).tolist())
                layer2.close()  # the set and the optimizer point into it: they close first
                self.assertTrue(state2.closed and opt2.closed)

    def test_set_aside_newer(self):
        a = array.array("f", [0.0] * 100)
        with libmoe.Checkpointer(self.rt, self.tmp.name, keep_last=0, **self.opts) as ck:
            for step in (1, 2, 3):
                a[0] = step
                ck.save_async(step, {"a": a})
            self.assertEqual(ck.set_aside_newer(1), 2)
            self.assertEqual(ck.list(), [1])
            self.assertEqual(ck.set_aside_newer(1), 0)
        # a later run: the steps a load passed over are trained and saved again
        with libmoe.Checkpointer(self.rt, self.tmp.name, keep_last=0, **self.opts) as ck:
            b = array.array("f", [0.0] * 100)
            self.assertEqual(ck.load_latest({"a": b}), 1)
            self.assertEqual(b[0], 1.0)
            ck.save_async(2, {"a": a})
            self.assertTrue(ck.wait(timeout=30))
            self.assertEqual(ck.list(), [1, 2])
            with self.assertRaises(libmoe.Error) as cm:
                ck.set_aside_newer(-2)
            self.assertEqual(cm.exception.status, libmoe.Status.INVALID_ARGUMENT)
        aside = sorted(n for n in os.listdir(self.tmp.name) if n.startswith(".rejected-step-"))
        self.assertEqual([n.split("-")[2] for n in aside], ["2", "3"])

    def test_close_within(self):
        ck = libmoe.Checkpointer(self.rt, self.tmp.name, **self.opts)
        ck.save_async(1, {"a": array.array("f", [1.0] * 1000)})
        ck.close_within(1)  # no mirror: nothing to wait for past the local save
        self.assertTrue(ck.closed)
        self.assertEqual(libmoe.Checkpointer(self.rt, self.tmp.name, **self.opts).list(), [1])
        with socket.socket() as s:  # a port nothing listens on: the mirror cannot upload
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ck = libmoe.Checkpointer(self.rt, self.tmp.name, s3_endpoint=f"http://127.0.0.1:{port}",
                                 s3_bucket="b", **self.opts)
        ck.save_async(2, {"a": array.array("f", [2.0] * 1000)})
        t0 = time.monotonic()
        with self.assertRaises(libmoe.Error) as cm:
            ck.close_within(300)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertIn(cm.exception.status, (libmoe.Status.TIMEOUT, libmoe.Status.REMOTE_ERROR))
        self.assertTrue(ck.closed)

    def test_bad_directory_and_abort(self):
        blocker = os.path.join(self.tmp.name, "file")
        open(blocker, "w").close()
        with self.assertRaises(libmoe.Error) as cm:
            libmoe.Checkpointer(self.rt, os.path.join(blocker, "sub"), **self.opts)
        self.assertEqual(cm.exception.status, libmoe.Status.IO_ERROR)
        ck = libmoe.Checkpointer(self.rt, self.tmp.name, **self.opts)
        ck.save_async(1, {"a": array.array("f", [1.0] * 1000)})
        ck.abort()
        self.assertTrue(ck.closed)
        ck.abort()  # a second abort is a no-op
        with self.assertRaisesRegex(TypeError, "no option 'bucket'"):
            libmoe.Checkpointer(self.rt, self.tmp.name, bucket="x")


if __name__ == "__main__":
    unittest.main()
