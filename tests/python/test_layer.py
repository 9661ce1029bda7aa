"""The layer through the package on the host backend: forward against a naive
y[t] = sum_k w[t,k] * FFN_e(x[t]) computed here from the layer's own parameters, backward
against central finite differences of a scalar loss, parameters by name, statistics, slots."""
import array
import math
import random
import unittest

import libmoe

N, H, F, E, K = 10, 6, 5, 4, 2


def naive_forward(x, wg, w1, w2, n=N):
    """softmax router, top-k renormalised, SwiGLU experts (w1 [E,H,2,F], w2 [E,F,H])."""
    y = []
    for t in range(n):
        xt = x[t * H:(t + 1) * H]
        logits = [sum(xt[c] * wg[c * E + e] for c in range(H)) for e in range(E)]
        m = max(logits)
        p = [math.exp(v - m) for v in logits]
        p = [v / sum(p) for v in p]
        top = sorted(range(E), key=lambda e: (-p[e], e))[:K]
        wsum = sum(p[e] for e in top)
        out = [0.0] * H
        for e in top:
            act = []
            for j in range(F):
                g = sum(xt[c] * w1[((e * H + c) * 2 + 0) * F + j] for c in range(H))
                u = sum(xt[c] * w1[((e * H + c) * 2 + 1) * F + j] for c in range(H))
                act.append(g / (1 + math.exp(-g)) * u)
            for c in range(H):
                out[c] += p[e] / wsum * sum(act[j] * w2[(e * F + j) * H + c] for j in range(F))
        y.extend(out)
    return y


def rel_err(a, b):
    num = sum((u - v) ** 2 for u, v in zip(a, b))
    den = sum(v * v for v in b)
    return math.sqrt(num / den)


class LayerTest(unittest.TestCase):
    def setUp(self):
        self.rt = libmoe.Runtime("host", seed=11)
        self.layer = libmoe.Layer(self.rt, hidden=H, ffn_hidden=F, num_experts=E, top_k=K,
                                  init_std=0.5, max_microbatches=2)
        rng = random.Random(11)
        self.x = array.array("f", [rng.gauss(0, 1) for _ in range(N * H)])

    def tearDown(self):
        self.rt.close()

    def test_config_defaults_come_from_c(self):
        c = self.layer.config
        self.assertEqual((c["aux_loss_coef"], c["max_microbatches"], c["a2a_chunks"]),
                         (0.009999999776482582, 2, 2))
        self.assertEqual(c["score_fn"], libmoe.ScoreFn.SOFTMAX)
        with self.assertRaisesRegex(TypeError, "no option 'topk'"):
            libmoe.Layer(self.rt, hidden=H, ffn_hidden=F, num_experts=E, topk=K)
        with self.assertRaisesRegex(ValueError, "unknown ScoreFn 'tanh'"):
            libmoe.Layer(self.rt, hidden=H, ffn_hidden=F, num_experts=E, top_k=K,
                         score_fn="tanh")

    def test_forward_matches_naive(self):
        y = self.layer.forward(self.x)
        self.assertEqual(y.shape, (N, H))
        wg, w1, w2 = (self.layer.param(n).tolist()
                      for n in ("router.weight", "experts.w1", "experts.w2"))
        err = rel_err(y.tolist(), naive_forward(self.x, wg, w1, w2))
        self.assertLess(err, 1e-5)
        out = array.array("f", bytes(4 * N * H))  # a caller-provided output
        self.layer.release_slot(0)
        self.assertIs(self.layer.forward(self.x, out), out)
        self.assertEqual(list(out), y.tolist())

    def test_backward_matches_finite_differences(self):
        """loss = sum(dy * y) + aux and z terms, whose gradients backward adds itself."""
        rng = random.Random(5)
        dy = array.array("f", [rng.gauss(0, 1) for _ in range(N * H)])
        coef_aux, coef_z = self.layer.config["aux_loss_coef"], self.layer.config["z_loss_coef"]

        def loss(x):
            y = self.layer.forward(x, slot=1)
            self.layer.release_slot(1)
            st = self.layer.stats()
            return sum(a * b for a, b in zip(y.tolist(), dy)) + coef_aux * st.aux_loss + \
                coef_z * st.z_loss

        self.layer.zero_grad()
        self.layer.forward(self.x, slot=0)
        dx = self.layer.backward(dy, slot=0).tolist()
        eps = 1e-2
        for i in (0, 7, 23, 41):
            xp, xm = array.array("f", self.x), array.array("f", self.x)
            xp[i] += eps
            xm[i] -= eps
            fd = (loss(xp) - loss(xm)) / (2 * eps)
            self.assertAlmostEqual(dx[i], fd, delta=2e-2 * max(1.0, abs(fd)))
        wg = self.layer.param("router.weight").memoryview()
        gwg = self.layer.grad("router.weight").tolist()
        for (c, e) in ((0, 1), (3, 2)):
            saved = wg[c, e]
            wg[c, e] = saved + eps
            up = loss(self.x)
            wg[c, e] = saved - eps
            down = loss(self.x)
            wg[c, e] = saved
            fd = (up - down) / (2 * eps)
            self.assertAlmostEqual(gwg[c * E + e], fd, delta=2e-2 * max(1.0, abs(fd)))

    def test_params_by_name(self):
        self.assertEqual(list(self.layer.params), ["router.weight", "experts.w1", "experts.w2"])
        p = self.layer.params["experts.w1"]
        self.assertEqual((p.kind, p.value.shape, p.grad.dtype, p.global_shape, p.expert_dim),
                         (libmoe.ParamKind.EXPERT, (E, H, 2, F), libmoe.DType.F32,
                          (E, H, 2, F), 0))
        self.assertEqual(p.expert_ids, tuple(range(E)))
        with self.assertRaisesRegex(libmoe.ArgumentError, "no parameter 'router.bias'"):
            self.layer.param("router.bias")
        biased = libmoe.Layer(self.rt, hidden=H, ffn_hidden=F, num_experts=E, top_k=K,
                              expert_bias=True)
        bias = biased.params["router.expert_bias"]
        self.assertEqual((bias.kind, bias.grad), (libmoe.ParamKind.BUFFER, None))

    def test_stats(self):
        self.layer.forward(self.x)
        st = self.layer.stats()
        self.assertIsInstance(st, libmoe.LayerStats)
        self.assertEqual((st.tokens, st.slots, st.dropped_slots, st.capacity), (N, N * K, 0, -1))
        self.assertEqual(sum(st.tokens_per_expert), N * K)
        self.assertGreater(st.aux_loss, 0)

    def test_slots_and_errors(self):
        self.layer.forward(self.x, slot=0)
        with self.assertRaises(libmoe.Error) as cm:
            self.layer.forward(self.x, slot=0)  # in use
        self.assertEqual(cm.exception.status, libmoe.Status.INVALID_ARGUMENT)
        self.assertIn("slot", cm.exception.message)
        self.layer.release_slot(0)
        with self.assertRaisesRegex(libmoe.ArgumentError, r"x has shape \(7,\)"):
            self.layer.forward(array.array("f", [0.0] * 7))
        with self.assertRaisesRegex(libmoe.ArgumentError, "dy has shape"):
            self.layer.forward(self.x, slot=1)
            self.layer.backward(array.array("f", [0.0] * (2 * H)), slot=1)
        with self.assertRaisesRegex(libmoe.ArgumentError, "y has shape"):
            self.layer.forward(self.x, array.array("f", [0.0] * H), slot=0)
        self.layer.discard_grad()
        self.layer.backward(array.array("f", [1.0] * (N * H)), slot=1, need_dx=False)


if __name__ == "__main__":
    unittest.main()
