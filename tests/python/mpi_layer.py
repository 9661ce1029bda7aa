"""The distributed layer from Python equals one process on the whole batch. Run under
`mpirun -np 4 python3 mpi_layer.py` (CTest does): a (tp 1, ep 2, dp 2, pp 1) mesh, dense rank
j = ep + 2*dp holds piece j of a global batch of 4 pieces; every rank also runs the reference,
a runtime without a mesh in the same process with the same seed, on the concatenated batch.
Checked (relative error <= 1e-5, host backend): y and dx of piece j, the aux and z losses, and
every parameter shard after two AdamW steps (grad_scale 1 distributed, averaging over the 4
replicas; 1/4 in the reference), which goes through the gradient all-reduces.
Exits non-zero on any rank's failure (mpirun reports it)."""
import array
import math
import random
import sys

import libmoe

H, F, E, K, PIECE = 8, 8, 4, 2, 6
MESH = dict(tp=1, ep=2, dp=2, pp=1)
D = MESH["ep"] * MESH["dp"]


def rel_err(got, ref):
    num = sum((a - b) ** 2 for a, b in zip(got, ref))
    den = sum(b * b for b in ref)
    return math.sqrt(num / den) if den else math.sqrt(num)


def expert_rows(values, ids, per_expert):
    return [v for e in ids for v in values[e * per_expert:(e + 1) * per_expert]]


def main():
    cfg = dict(hidden=H, ffn_hidden=F, num_experts=E, top_k=K, init_std=0.3)
    rng = random.Random(0)
    x = array.array("f", [rng.gauss(0, 1) for _ in range(D * PIECE * H)])
    dy = array.array("f", [rng.gauss(0, 1) for _ in range(D * PIECE * H)])
    with libmoe.Runtime("host", seed=5, mesh=MESH) as rt, \
            libmoe.Runtime("host", seed=5) as ref_rt:
        rank, world = rt.axis("world")
        assert world == 4, f"run under mpirun -np 4 (world is {world})"
        j = rt.axis("ep")[0] + MESH["ep"] * rt.axis("dp")[0]
        rows = slice(j * PIECE * H, (j + 1) * PIECE * H)
        layer, ref = libmoe.Layer(rt, **cfg), libmoe.Layer(ref_rt, **cfg)
        opt = libmoe.AdamW(rt, lr=1e-2)
        opt.add_layer(layer)
        ref_opt = libmoe.AdamW(ref_rt, lr=1e-2)
        ref_opt.add_layer(ref)
        errors = {}
        for step in range(2):
            layer.discard_grad()
            ref.discard_grad()
            y = layer.forward(x[rows]).tolist()
            y_ref = ref.forward(x).tolist()
            errors[f"y{step}"] = rel_err(y, y_ref[rows])
            st, st_ref = layer.stats(), ref.stats()
            errors[f"aux{step}"] = rel_err([st.aux_loss, st.z_loss],
                                           [st_ref.aux_loss, st_ref.z_loss])
            dx = layer.backward(dy[rows]).tolist()
            dx_ref = ref.backward(dy).tolist()
            errors[f"dx{step}"] = rel_err(dx, dx_ref[rows])
            opt.step(grad_scale=1.0)
            ref_opt.step(grad_scale=1.0 / D)
        for name, p in layer.params.items():
            want = ref.param(name).tolist()
            if p.expert_dim == 0:
                want = expert_rows(want, p.expert_ids, len(want) // E)
            errors[name] = rel_err(p.value.tolist(), want)
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        print(f"rank {rank} (piece {j}): worst relative error {max(errors.values()):.2e}"
              f"{' FAILED ' + repr(bad) if bad else ''}", flush=True)
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
