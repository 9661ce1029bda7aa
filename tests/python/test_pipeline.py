"""Pipeline schedules from Python (inspected and printed) and the executor on a single stage
running a libmoe layer through Python callbacks, with a failing callback's exception raised
from train_step."""
import array
import random
import unittest

import libmoe
from libmoe import PipeOp

N, H = 16, 8


class ScheduleTest(unittest.TestCase):
    def test_inspect_and_print(self):
        with libmoe.Schedule(2, 2, 0) as s:
            self.assertEqual(str(s), "stage 0/2 m=2: F0 >act0@1 F1 >act1@1 <grad0@1 B0 "
                                     "<grad1@1 B1")
            self.assertEqual(len(s), 8)
            self.assertEqual(s[0], libmoe.Action(PipeOp.FORWARD, 0, -1, 0))
            self.assertEqual(s[-1], libmoe.Action(PipeOp.BACKWARD, 1, -1, 0))
            self.assertEqual(s.info, libmoe.ScheduleInfo(2, 2, 0, 2, 1))  # F0 F1 before B0
            with self.assertRaises(IndexError):
                s[8]
        for stage in range(4):
            s = libmoe.Schedule(4, 8, stage, virtual_stages=2)
            compute = [a for a in s if a.op in (PipeOp.FORWARD, PipeOp.BACKWARD)]
            self.assertEqual(len(compute), 2 * 8 * 2)
            self.assertEqual(s.info.virtual_stages, 2)
            self.assertIn(" v=2", str(s))
        self.assertEqual(libmoe.op_string(PipeOp.SEND_ACT), "send_act")
        with self.assertRaises(libmoe.Error) as cm:
            libmoe.Schedule(2, 3, 0, virtual_stages=2)  # m not divisible by the stages
        self.assertEqual(cm.exception.status, libmoe.Status.INVALID_ARGUMENT)


class ExecutorTest(unittest.TestCase):
    def test_single_stage_trains(self):
        m = 2
        rng = random.Random(8)
        data = [array.array("f", [rng.gauss(0, 1) for _ in range(N * H)]) for _ in range(m)]
        goal = [array.array("f", [0.5 * v for v in d]) for d in data]
        with libmoe.Runtime("host", seed=3) as rt:
            layer = libmoe.Layer(rt, hidden=H, ffn_hidden=16, num_experts=4, top_k=2,
                                 max_microbatches=m, init_std=0.3)
            opt = libmoe.AdamW(rt, lr=2e-2, weight_decay=0.0)
            opt.add_layer(layer)
            calls = []

            def forward(chunk, mb, x, y):
                self.assertIsNone(x)  # the first stage reads its own data
                calls.append(("F", chunk, mb))
                layer.forward(data[mb], y, slot=mb)

            def loss(mb, y, dy):
                yv, dv = y.memoryview().cast("B").cast("f"), dy.memoryview().cast("B").cast("f")
                total = 0.0
                for i, (a, b) in enumerate(zip(yv, goal[mb])):
                    total += (a - b) ** 2 / (N * H)
                    dv[i] = 2 * (a - b) / (N * H)
                return total

            def backward(chunk, mb, dy, dx):
                self.assertIsNone(dx)
                calls.append(("B", chunk, mb))
                layer.backward(dy, slot=mb, need_dx=False)

            with libmoe.Pipeline(rt, (N, H), forward, backward, loss, microbatches=m,
                                 zero_grad=layer.zero_grad, optimizer=opt) as pipe:
                self.assertEqual(pipe.schedule.info.microbatches, m)
                losses = [pipe.train_step() for _ in range(40)]
                self.assertLess(losses[-1], 0.5 * losses[0])
                self.assertEqual(calls[:4], [("F", 0, 0), ("B", 0, 0), ("F", 0, 1),
                                             ("B", 0, 1)])
                self.assertEqual(opt.step_count, 40)
                st = pipe.stats()
                self.assertEqual((st.stages, st.microbatches), (1, m))

                def failing(chunk, mb, x, y):
                    raise KeyError("no data for microbatch")

                pipe2 = libmoe.Pipeline(rt, (N, H), failing, backward, loss, microbatches=m,
                                        abandon=lambda c, mb: layer.release_slot(mb))
                with self.assertRaises(KeyError) as cm:
                    pipe2.train_step()
                self.assertIsInstance(cm.exception.__cause__, libmoe.Error)
                self.assertEqual(opt.step_count, 40)  # no step after a failed batch


if __name__ == "__main__":
    unittest.main()
