"""Training from Python on the host backend: a student layer learns a teacher layer's outputs
with libmoe's AdamW (the loss falls), and AdamW over a caller-owned parameter and its state."""
import array
import random
import unittest

import libmoe

N, H, F, E, K = 64, 8, 16, 4, 2


class TrainTest(unittest.TestCase):
    def test_student_learns_teacher(self):
        cfg = dict(hidden=H, ffn_hidden=F, num_experts=E, top_k=K, init_std=0.3)
        with libmoe.Runtime("host", seed=1) as trt, libmoe.Runtime("host", seed=2) as rt:
            teacher = libmoe.Layer(trt, **cfg)
            student = libmoe.Layer(rt, **cfg)
            opt = libmoe.AdamW(rt, lr=2e-2, weight_decay=0.0)
            opt.add_layer(student, prefix="moe.")
            rng = random.Random(3)
            x = array.array("f", [rng.gauss(0, 1) for _ in range(N * H)])
            target = teacher.forward(x).tolist()
            teacher.release_slot(0)
            y = array.array("f", bytes(4 * N * H))
            dy = array.array("f", bytes(4 * N * H))
            losses = []
            for _ in range(80):
                student.discard_grad()
                student.forward(x, y)
                losses.append(sum((a - b) ** 2 for a, b in zip(y, target)) / (N * H))
                for i, (a, b) in enumerate(zip(y, target)):
                    dy[i] = 2 * (a - b) / (N * H)
                student.backward(dy, need_dx=False)
                opt.step()
            self.assertEqual(opt.step_count, 80)
            self.assertLess(losses[-1], 0.3 * losses[0], losses[::10])
            names = [s.name for s in opt.states()]
            self.assertEqual(names[:3], ["moe.router.weight.master", "moe.router.weight.exp_avg",
                                         "moe.router.weight.exp_avg_sq"])

    def test_user_parameter(self):
        with libmoe.Runtime("host") as rt:
            value = array.array("f", [0.0] * 4)
            grad = array.array("f", [0.0] * 4)
            opt = libmoe.AdamW(rt, lr=0.1, weight_decay=0.0)
            opt.add_param("head", value, grad)
            goal = [1.0, -1.0, 0.5, 2.0]
            for _ in range(100):
                for i in range(4):
                    grad[i] = 2 * (value[i] - goal[i])
                opt.step()
            for v, g in zip(value, goal):
                self.assertAlmostEqual(v, g, delta=0.1)
            opt.step_count = 7
            self.assertEqual(opt.step_count, 7)
            with self.assertRaisesRegex(libmoe.ArgumentError, "grad has shape"):
                opt.add_param("bad", array.array("f", [0.0] * 4), array.array("f", [0.0] * 3))
            with self.assertRaisesRegex(libmoe.Error, "head"):
                opt.add_param("head", array.array("f", [0.0]), array.array("f", [0.0]))

    def test_closing_a_registered_layer_closes_the_optimizer(self):
        with libmoe.Runtime("host") as rt:
            layer = libmoe.Layer(rt, hidden=H, ffn_hidden=F, num_experts=E, top_k=K)
            opt = libmoe.AdamW(rt)
            opt.add_layer(layer)
            layer.close()
            self.assertTrue(opt.closed)


if __name__ == "__main__":
    unittest.main()
