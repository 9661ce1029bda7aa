#!/usr/bin/env bash
# The bundled trainer on the CUDA backend, in one call: build, the fused attention against the
# host attention (test_attention_cuda), the CUDA model against the host model
# (test_trainer_cuda), the backend's ops against the host twins (test_cuda_ops: the
# optimizer's passes among them), then for each model of bench/trainer/ (small, fine, coarse)
# moe_train on one rank beside bench/torch_trainer.py in PyTorch eager on the same model, bytes
# and optimizer settings (the trainer's effective config, `moe_train --print-config`);
# $OUT/results/trainer.md from those runs (bench/write_results.py); the two tests under
# compute-sanitizer memcheck (SANITIZE_TESTS names fewer); then the PyTorch side under
# torch.compile, and the results again.
# Usage (from the repository root, deps unpacked): bash scripts/gpu-machine/trainer.sh [phases]
#   phases: build test ops bench sanitize compile (default: all, in this order); two: the small
#   model on 2 ranks sharing the GPU (ep=2, MPI). MODELS="small fine" limits bench/compile.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source scripts/gpu-machine/env.sh
phases=${*:-build test ops bench sanitize compile}
models=${MODELS:-small fine coarse}
has() { [[ " $phases " == *" $1 "* ]] && echo "[$(date -u +%H:%M:%S)] $1"; }
status=0
mpi=(mpirun --oversubscribe --bind-to none)
jsonl="$OUT/bench_trainer.jsonl"
: >"$OUT/trainer.log"

if has build; then
  device_configure >"$OUT/build.log" 2>&1 &&
    cmake --build "$B" -j16 --target moe_train test_trainer_cuda test_attention_cuda \
      test_cuda_ops >>"$OUT/build.log" 2>&1 ||
    { echo "BUILD FAILED"; grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; }
  echo "build ok"
fi

# run_test <name> <grep pattern>: a test binary, its log into trainer.log
run_test() {
  timeout 120 "$B/tests/$1" >/tmp/$1.log 2>&1
  local rc=$?
  { echo "== $1 rc=$rc"; cat /tmp/$1.log; } >>"$OUT/trainer.log"
  echo "$1: rc=$rc"
  grep -E "$2|FAILED|ERROR" /tmp/$1.log | head -40
  [ $rc -eq 0 ] || status=1
}
if has test; then
  run_test test_attention_cuda "heads|PASSED|seed"
  run_test test_trainer_cuda "step|grad rel|PASSED|seed"
fi
has ops && run_test test_cuda_ops "adamw|sum_squares|PASSED"

# shape_of <effective config>: the tables' shape, as bench/torch_trainer.py names it
shape_of() {
  python3 -c "
import json; c = json.load(open('$1')); m = c['model']
print(f\"L={m['layers']} H={m['hidden']} heads={m['heads']} T={m['context']} E={m['experts']} \"
      f\"K={m['top_k']} F={m['ffn_hidden']} B={c['train']['batch']}\")"
}

# run_trainer <variant> <ranks> <config> [env...]: moe_train for the config's steps, its
# metrics' medians as one JSON line in $jsonl
run_trainer() {
  local variant=$1 ranks=$2 config=$3 metrics=/tmp/trainer_metrics.jsonl eff=/tmp/trainer_eff.json
  shift 3
  "$B/examples/moe_train" --config "$config" --print-config >"$eff" || { status=1; return; }
  timeout 180 env "$@" "${mpi[@]}" -np "$ranks" "$B/examples/moe_train" --config "$config" \
    --metrics "$metrics" >/tmp/trainer.log 2>&1
  local rc=$?
  { echo "== moe_train $config $variant rc=$rc"; cat /tmp/trainer.log; } >>"$OUT/trainer.log"
  echo "moe_train $config $variant: rc=$rc"
  grep -E "^(mesh|step|done)|failed|error" /tmp/trainer.log | head -8
  if [ $rc -eq 0 ]; then
    python3 bench/trainer_steps.py "$metrics" --shape "$(shape_of "$eff")" --variant "$variant" \
      --config "$eff" | tee -a "$jsonl"
  else
    status=1
  fi
}

# run_torch <config> [--compile]: bench/torch_trainer.py on the trainer's effective config
run_torch() {
  local eff=/tmp/torch_eff.json
  "$B/examples/moe_train" --config "$1" --print-config >"$eff" || { status=1; return; }
  timeout "${TORCH_TIMEOUT:-150}" python3 bench/torch_trainer.py "$eff" ${2:-} >/tmp/torch_trainer.log 2>&1
  local rc=$?
  { echo "== torch_trainer $1 ${2:-} rc=$rc"; cat /tmp/torch_trainer.log; } >>"$OUT/trainer.log"
  echo "torch_trainer $1 ${2:-}: rc=$rc"
  grep '^{' /tmp/torch_trainer.log | tee -a "$jsonl"
  [ $rc -eq 0 ] || { status=1; tail -5 /tmp/torch_trainer.log; }
}

if has bench; then
  for m in $models; do
    run_trainer "1 rank" 1 "bench/trainer/$m.json"
    # the fine model's experts also on the Hopper grouped GEMM (the expert engine's path)
    [ "$m" = fine ] && run_trainer "1 rank, MOE_CUDA_EXPERT_GEMM=hopper" 1 "bench/trainer/$m.json" \
      MOE_CUDA_EXPERT_GEMM=hopper
    run_torch "bench/trainer/$m.json"
  done
  [ -s "$jsonl" ] && { write_results --only trainer "$jsonl" || status=1; }
fi

# memcheck before the compiled runs: the compiles take longest
if has sanitize; then
  for t in ${SANITIZE_TESTS:-test_attention_cuda test_trainer_cuda}; do
    timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool memcheck --error-exitcode 99 \
      "$B/tests/$t" >/tmp/sanitize_$t.log 2>&1
    rc=$?
    { echo "== memcheck $t rc=$rc"; cat /tmp/sanitize_$t.log; } >>"$OUT/trainer.log"
    echo "compute-sanitizer memcheck $t: rc=$rc $(grep 'ERROR SUMMARY' /tmp/sanitize_$t.log | tail -1)"
    [ $rc -eq 0 ] || { status=1; grep -m5 -A8 -E "Invalid|Error" /tmp/sanitize_$t.log; }
  done
fi

if has compile; then
  for m in $models; do run_torch "bench/trainer/$m.json" --compile; done
fi

if has two; then
  # ep=2 on one GPU: each rank half the batch and half the experts; the peak per rank is half
  # the GPU's, so MFU is against the one GPU's 774 TFLOP/s
  python3 -c "
import json; c = json.load(open('bench/trainer/small.json'))
c['mesh'] = {'ep': 2}; c.setdefault('log', {})['peak_tflops'] = 387
json.dump(c, open('/tmp/trainer_ep2.json', 'w'))"
  run_trainer "2 ranks sharing the GPU (ep=2, MPI)" 2 /tmp/trainer_ep2.json
fi

if [ -s "$jsonl" ]; then
  write_results --only trainer "$jsonl" || status=1
fi
exit $status
