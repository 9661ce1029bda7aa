#!/usr/bin/env bash
# The bundled trainer on the CUDA backend, in one call: build, the CUDA model against the host
# model (test_trainer_cuda), moe_train on one rank with bench/trainer.json (MoE layers
# dominate: L=4 H=1024 E=32 K=2 F=2048 T=256, 32 sequences a step), the same on 2 ranks sharing
# the GPU through MPI (ep=2), bench/torch_trainer.py on the same model and batch, and
# test_trainer_cuda under compute-sanitizer memcheck; $OUT/results/trainer.md from the runs
# (bench/write_results.py).
# Usage (from the repository root, deps unpacked): bash scripts/gpu-machine/trainer.sh [phases]
#   phases: build test one torch two sanitize (default: all, in this order); ops: the backend's
#   test_cuda_ops (the optimizer's ops: the gradient norm's sum of squares) after test
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source scripts/gpu-machine/env.sh
phases=${*:-build test one torch two sanitize}
has() { [[ " $phases " == *" $1 "* ]] && echo "[$(date -u +%H:%M:%S)] $1"; }
status=0
cfg=bench/trainer.json
# the model of bench/trainer.json, for bench/torch_trainer.py and the tables' shape
read -r L H HEADS T E K F B < <(python3 -c "
import json; c = json.load(open('$cfg')); m = c['model']
print(m['layers'], m['hidden'], m['heads'], m['context'], m['experts'], m['top_k'],
      m['ffn_hidden'], c['train']['batch'])")
shape="L=$L H=$H heads=$HEADS T=$T E=$E K=$K F=$F B=$B"
mpi=(mpirun --oversubscribe --bind-to none)
: >"$OUT/trainer.log"

if has build; then
  device_configure >"$OUT/build.log" 2>&1 &&
    cmake --build "$B" -j16 --target moe_train test_trainer_cuda test_cuda_ops >>"$OUT/build.log" 2>&1 ||
    { echo "BUILD FAILED"; grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; }
  echo "build ok"
fi

if has test; then
  timeout 120 "$B/tests/test_trainer_cuda" >/tmp/test_trainer_cuda.log 2>&1
  rc=$?
  { echo "== test_trainer_cuda rc=$rc"; cat /tmp/test_trainer_cuda.log; } >>"$OUT/trainer.log"
  echo "test_trainer_cuda: rc=$rc"
  grep -E "step|grad rel|PASSED|FAILED|ERROR|seed" /tmp/test_trainer_cuda.log | head -40
  [ $rc -eq 0 ] || status=1
fi

if has ops; then
  timeout 120 "$B/tests/test_cuda_ops" >/tmp/test_cuda_ops.log 2>&1
  rc=$?
  { echo "== test_cuda_ops rc=$rc"; cat /tmp/test_cuda_ops.log; } >>"$OUT/trainer.log"
  echo "test_cuda_ops: rc=$rc"
  grep -E "sum_squares|PASSED|FAILED|ERROR" /tmp/test_cuda_ops.log | head -10
  [ $rc -eq 0 ] || status=1
fi

# run_trainer <variant> <ranks> <config>: moe_train for the config's steps, its metrics'
# medians as one JSON line in $OUT/bench_trainer.jsonl
run_trainer() {
  local variant=$1 ranks=$2 config=$3 metrics=/tmp/trainer_metrics_$2.jsonl
  timeout 180 "${mpi[@]}" -np "$ranks" "$B/examples/moe_train" --config "$config" \
    --data docs --metrics "$metrics" >/tmp/trainer_$ranks.log 2>&1
  local rc=$?
  { echo "== moe_train $variant rc=$rc"; cat /tmp/trainer_$ranks.log; } >>"$OUT/trainer.log"
  echo "moe_train $variant: rc=$rc"
  grep -E "^(mesh|step|done)|failed|error" /tmp/trainer_$ranks.log | head -12
  if [ $rc -eq 0 ]; then
    python3 bench/trainer_steps.py "$metrics" --shape "$shape" --variant "$variant" |
      tee -a "$OUT/bench_trainer.jsonl"
  else
    status=1
  fi
}

if has one; then
  run_trainer "1 rank" 1 "$cfg"
fi

if has torch; then
  timeout 180 python3 bench/torch_trainer.py "$L" "$H" "$HEADS" "$T" "$E" "$K" "$F" "$B" \
    >/tmp/torch_trainer.log 2>&1
  rc=$?
  { echo "== torch_trainer rc=$rc"; cat /tmp/torch_trainer.log; } >>"$OUT/trainer.log"
  echo "torch_trainer: rc=$rc"
  grep '^{' /tmp/torch_trainer.log | tee -a "$OUT/bench_trainer.jsonl"
  [ $rc -eq 0 ] || { status=1; tail -15 /tmp/torch_trainer.log; }
fi

if has two; then
  # ep=2 on one GPU: each rank half the batch and half the experts; the peak per rank is half
  # the GPU's, so MFU is against the one GPU's 774 TFLOP/s
  python3 -c "
import json; c = json.load(open('$cfg'))
c['mesh'] = {'ep': 2}; c.setdefault('log', {})['peak_tflops'] = 387
json.dump(c, open('/tmp/trainer_ep2.json', 'w'))"
  run_trainer "2 ranks sharing the GPU (ep=2, MPI)" 2 /tmp/trainer_ep2.json
fi

# last: memcheck is the slowest part (the measurements come back even when it runs out)
if has sanitize; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 "$B/tests/test_trainer_cuda" \
    >/tmp/sanitize_trainer.log 2>&1
  rc=$?
  { echo "== memcheck test_trainer_cuda rc=$rc"; cat /tmp/sanitize_trainer.log; } >>"$OUT/trainer.log"
  echo "compute-sanitizer memcheck test_trainer_cuda: rc=$rc $(grep 'ERROR SUMMARY' /tmp/sanitize_trainer.log | tail -1)"
  [ $rc -eq 0 ] || { status=1; grep -m5 -A8 -E "Invalid|Error" /tmp/sanitize_trainer.log; }
fi

if [ -s "$OUT/bench_trainer.jsonl" ]; then
  write_results --only trainer "$OUT/bench_trainer.jsonl" || status=1
fi
exit $status
