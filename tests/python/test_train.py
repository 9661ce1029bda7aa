"""Training from Python on the host backend: a student layer learns a teacher layer's outputs
with libmoe's AdamW (the loss falls), AdamW over a caller-owned parameter and its state, the
learning-rate schedule, gradient clipping, state owners and seeded layers."""
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

    def test_schedule_clipping_and_state_owners(self):
        self.assertAlmostEqual(libmoe.lr_schedule_rate(1.0, 5, warmup_steps=10), 0.5)
        cosine = dict(decay="cosine", warmup_steps=0, decay_steps=100, min_lr_ratio=0.1)
        self.assertAlmostEqual(libmoe.lr_schedule_rate(1.0, 50, **cosine), 0.55, places=5)
        self.assertAlmostEqual(libmoe.lr_schedule_rate(1.0, 100, **cosine), 0.1, places=5)
        with self.assertRaises(libmoe.Error) as cm:
            libmoe.lr_schedule_rate(1.0, 5, decay="linear", warmup_steps=10, decay_steps=5)
        self.assertEqual(cm.exception.status, libmoe.Status.INVALID_ARGUMENT)
        with libmoe.Runtime("host") as rt:
            layer = libmoe.Layer(rt, hidden=H, ffn_hidden=F, num_experts=E, top_k=K)
            opt = libmoe.AdamW(rt, lr=0.1)
            self.assertEqual(opt.last_step(), (0.0, None))
            opt.add_layer(layer)
            head = (array.array("f", [0.0] * 4), array.array("f", [1.0] * 4))
            opt.add_param("head", *head)
            opt.set_grad_clip(1e-3)
            opt.set_lr_schedule("linear", warmup_steps=2, decay_steps=10)
            layer.forward(array.array("f", [0.5] * (N * H)))
            layer.backward(array.array("f", [1.0] * (N * H)), need_dx=False)
            opt.step()
            lr, norm = opt.last_step()
            self.assertAlmostEqual(lr, 0.05)  # step 1 of 2 warm-up steps
            self.assertGreater(norm, 1e-3)    # measured before clipping to 1e-3
            opt.step(lr=0.3)                  # a given rate bypasses the schedule
            self.assertAlmostEqual(opt.last_step()[0], 0.3)
            owners = [opt.state_owner(i) for i in range(len(opt.states()))]
            self.assertEqual(owners[0], (libmoe.ParamKind.DENSE, layer))   # router.weight
            self.assertEqual(owners[3], (libmoe.ParamKind.EXPERT, layer))  # experts.w1
            self.assertEqual(owners[-1], (libmoe.ParamKind.DENSE, None))   # head

    def test_seeded_layers_start_different(self):
        cfg = dict(hidden=H, ffn_hidden=F, num_experts=E, top_k=K)
        with libmoe.Runtime("host", seed=4) as rt:
            a, b = libmoe.Layer(rt, **cfg), libmoe.Layer(rt, init_stream=1, **cfg)
            c = libmoe.Layer(rt, init_stream=1, **cfg)
            w = [x.param("experts.w1").tolist() for x in (a, b, c)]
            self.assertNotEqual(w[0], w[1])
            self.assertEqual(w[1], w[2])

    def test_closing_a_registered_layer_closes_the_optimizer(self):
        with libmoe.Runtime("host") as rt:
            layer = libmoe.Layer(rt, hidden=H, ffn_hidden=F, num_experts=E, top_k=K)
            opt = libmoe.AdamW(rt)
            opt.add_layer(layer)
            layer.close()
            self.assertTrue(opt.closed)


if __name__ == "__main__":
    unittest.main()
