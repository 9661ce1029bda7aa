#!/usr/bin/env bash
# The bundled trainer at real sizes on one GPU (issue 39's two models, only their sizes set,
# every other key at its default): build moe_train, then for each model its memory plan
# (--plan) and 200 steps on the CUDA backend on docs/ with metrics; $OUT/sizes.txt holds the
# digest (loss and validation against the unigram baseline, per-layer max/mean load,
# entropy, the device memory in use against the plan), $OUT/<model>.jsonl the metrics.
# mpirun runs with --bind-to none, as trainer.sh does: the layers' initialisation is
# multi-threaded, and with Open MPI's default (one rank bound to one core) the set-up of the
# 2.3 G-parameter model did not reach step 1 within 75 s. MOE_SIZES_TIMEOUT_S (default 400)
# bounds each run; MOE_SIZES_ARGS adds flags to every run (e.g. a balancing variant).
# Usage (from the repository root, deps unpacked): bash scripts/gpu-machine/sizes.sh [models]
#   models: fine coarse (default both, in this order), and the recipes 100m and 1b
#   (examples/trainer/configs/gpu-100m.json, gpu-1b-fine.json)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source scripts/gpu-machine/env.sh
models=${*:-fine coarse}
declare -A size=(
  [fine]="--model.layers 4 --model.hidden 2048 --model.experts 64 --model.top_k 6 --model.ffn_hidden 1408 --model.context 1024 --batch 16"
  [coarse]="--model.layers 2 --model.hidden 4096 --model.experts 8 --model.top_k 2 --model.ffn_hidden 14336 --model.context 2048 --batch 8"
  [100m]="--config examples/trainer/configs/gpu-100m.json"
  [1b]="--config examples/trainer/configs/gpu-1b-fine.json"
)
echo "[$(date -u +%H:%M:%S)] build"
MOE_CUDA_ARCH=${MOE_CUDA_ARCH:-90a} device_configure -DMOE_BUILD_TESTS=OFF >"$OUT/build.log" 2>&1 &&
  cmake --build "$B" -j16 --target moe_train >>"$OUT/build.log" 2>&1 ||
  { echo "BUILD FAILED"; grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; }
status=0
for m in $models; do
  echo "[$(date -u +%H:%M:%S)] $m"
  args=(${size[$m]} --backend cuda --steps 200 --eval-every 100 --data docs ${MOE_SIZES_ARGS:-})
  mpirun -np 1 --bind-to none "$B/examples/moe_train" "${args[@]}" --plan 2>&1 | grep -v '^data: docs/' \
    >"$OUT/$m.plan.txt"
  timeout "${MOE_SIZES_TIMEOUT_S:-400}" mpirun -np 1 --bind-to none "$B/examples/moe_train" "${args[@]}" \
    --log.progress_every 20 --metrics "$OUT/$m.jsonl" 2>&1 | grep -v '^data: docs/' >"$OUT/$m.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=1
  {
    echo "== $m rc=$rc"
    grep -E 'total' "$OUT/$m.plan.txt"
    grep -E '^(mesh|memory|step|done)|failed|error' "$OUT/$m.log"
    [ -s "$OUT/$m.jsonl" ] && python3 - "$OUT/$m.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
worst = [max(l["max_over_mean"] for l in r["layers"]) for r in rows]
late = sorted(w for r, w in zip(rows, worst) if r["step"] >= 100)
print(f"steps {len(rows)}; median step {sorted(r['step_s'] for r in rows)[len(rows) // 2]:.3f} s; "
      f"worst layer max/mean from step 100: median {late[len(late) // 2] if late else float('nan'):.2f}, "
      f"highest {late[-1] if late else float('nan'):.2f}; "
      f"device in use {max(r.get('device_used_mb_rank0', 0) for r in rows):.0f} MiB")
# the curve every 20 steps: training loss (nats) and the worst layer's max/mean
print("  curve " + " ".join(f"{r['step']}:{r['loss']:.3f}/{w:.2f}" for r, w in zip(rows, worst)
                           if r["step"] % 20 == 0 or r["step"] == 1))
for r in rows:
    if r["val_bpb"] is not None:
        print(f"  step {r['step']}: val {r['val_bpb']:.3f} bpb = "
              f"{100 * r['val_bpb'] / r['unigram_bpb']:.1f}% of the unigram baseline")
PY
  } | tee -a "$OUT/sizes.txt"
done
exit $status
