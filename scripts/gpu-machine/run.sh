#!/usr/bin/env bash
# The CUDA backend on the GPU machine, in one call: build, GPU tests, compute-sanitizer, the
# benchmarks (bench_moe beside bench/torch_moe.py) and bench/results/*.md from them; logs,
# JSON lines and $OUT/results/*.md under $OUT. scripts/gpu-machine/README.md has the details.
# Usage (from the repository root, deps unpacked): bash scripts/gpu-machine/run.sh [phases...]
#   build     Release build of the GPU tests and bench_moe (the default architectures)
#   tests     test_cuda_ops, test_cuda_layer
#   sanitize  compute-sanitizer memcheck and racecheck on them ($MOE_SANITIZE_TOOLS,
#             $MOE_SANITIZE_TESTS pick fewer)
#   bench     bench_moe, parts $MOE_BENCH_PART (router experts layer; default all)
#   torch     bench/torch_moe.py, the same parts
#   dist      the distributed layer test on the CUDA backend (2 and 4 ranks sharing the GPU)
#   ckpt      ckpt_bench, then bench/torch_ckpt.py (PyTorch's saves of the same state,
#             $MOE_TORCH_CKPT_RUNS timed saves a method, default 3: a torch.save of 8 GiB
#             takes ~17 s): $MOE_CKPT_GIB GiB (default 8) into $MOE_CKPT_DIR (default /tmp)
#   profile   ncu's time of every kernel of one layer step, layer shapes $MOE_PROFILE_SHAPES
#             (default 0 1), summed by bench/kernel_times.py into $OUT/profile.txt
#   trace     CUPTI's timeline of the same layer steps (bench/trace.c), $OUT/trace.txt
# Default: build tests sanitize bench torch. After the phases, the JSON lines of bench, torch
# and ckpt become $OUT/results/<benchmark>.md (bench/write_results.py), to copy into
# bench/results/. The profiled and traced step follows $MOE_PROFILE_WARMUP steps (default 2).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source scripts/gpu-machine/env.sh
phases=${*:-build tests sanitize bench torch}
has() { [[ " $phases " == *" $1 "* ]] && echo "[$(date -u +%H:%M:%S)] $1"; }
status=0
results_args=() # extra bench/write_results.py arguments the phases add

if has build; then
  device_configure >"$OUT/build.log" 2>&1 &&
    cmake --build "$B" -j16 --target test_cuda_ops test_cuda_layer bench_moe >>"$OUT/build.log" 2>&1 ||
    { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
  echo "build ok"
fi
T="$B/tests"

if has tests; then
  for t in test_cuda_ops test_cuda_layer; do
    "$T/$t" >/tmp/$t.log 2>&1
    rc=$?
    { echo "== $t rc=$rc"; cat /tmp/$t.log; } >>"$OUT/tests.log"
    echo "$t: rc=$rc"
    grep -E "FAILED|PASSED|ERROR|seed|bitwise|differently" /tmp/$t.log | head -20
    [ $rc -eq 0 ] || status=1
  done
fi

if has dist; then
  cmake --build "$B" -j16 --target test_dist_layer_np2 test_dist_layer_np4 >>"$OUT/build.log" 2>&1
  (cd "$B" && ctest -R dist_layer_cuda --output-on-failure) >"$OUT/dist.log" 2>&1 || status=1
  grep -E "tests passed|Passed|Failed|Skipped" "$OUT/dist.log"
fi

# racecheck reports hazards inside cuBLAS's kernels (nvjet_*) in every run: vendor code we
# cannot read or change. Those alone pass (counted in the log); any other hazard, a sanitizer
# error or a failed test fails. (The sanitizer's --kernel-name-exclude kns=nvjet crashes it.)
if has sanitize; then
  for tool in ${MOE_SANITIZE_TOOLS:-memcheck racecheck}; do
    for t in ${MOE_SANITIZE_TESTS:-test_cuda_ops test_cuda_layer}; do
      log=/tmp/sanitize_${tool}_$t.log
      timeout 240 compute-sanitizer --tool $tool --error-exitcode 99 "$T/$t" >"$log" 2>&1
      rc=$?
      if [ $tool = racecheck ] && [ $rc -eq 99 ] && grep -q "PASSED" "$log" &&
        ! grep -q -E "FAILED|Internal Sanitizer Error|Target application returned an error" "$log" &&
        ! grep "Race reported" "$log" | grep -q -v nvjet; then
        echo "  racecheck $t: $(grep -c 'Race reported' "$log") hazard reports, all inside cuBLAS (nvjet)"
        rc=0
      fi
      { echo "== $tool $t rc=$rc"; cat "$log"; } >>"$OUT/sanitize.log"
      echo "compute-sanitizer $tool $t: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
      [ $rc -eq 0 ] || { status=1; grep -m5 -A8 -E "Invalid|Race|Error" "$log"; }
    done
  done
fi

# one JSON file per part and implementation, and a one-line-per-measurement digest on stdout
if has bench; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
  for part in ${MOE_BENCH_PART:-all}; do
    "$B/bench/bench_moe" "$part" >"$OUT/bench_libmoe_$part.jsonl" || status=1
    python3 bench/brief.py "$OUT/bench_libmoe_$part.jsonl"
  done
fi

if has torch; then
  for part in ${MOE_BENCH_PART:-all}; do
    PYTHONUNBUFFERED=1 python3 bench/torch_moe.py "$part" >"$OUT/bench_torch_$part.jsonl" || status=1
    python3 bench/brief.py "$OUT/bench_torch_$part.jsonl"
  done
fi

if has ckpt; then
  dir=${MOE_CKPT_DIR:-/tmp}
  cmake --build "$B" -j16 --target ckpt_bench >>"$OUT/build.log" 2>&1 &&
    "$B/bench/ckpt_bench" --gib "${MOE_CKPT_GIB:-8}" --runs 5 --dir "$dir" | tee "$OUT/bench_ckpt.jsonl" ||
    status=1
  # PyTorch's saves of the same state into the same directory, same run
  PYTHONUNBUFFERED=1 python3 bench/torch_ckpt.py --gib "${MOE_CKPT_GIB:-8}" --runs "${MOE_TORCH_CKPT_RUNS:-3}" --dir "$dir" |
    tee "$OUT/bench_torch_ckpt.jsonl" || status=1
  results_args+=(--note "checkpoint=\`$dir\`: $(findmnt -n -r -o FSTYPE,SOURCE -T "$dir" 2>/dev/null || echo ?)")
fi

# kernel_times FILE LABEL ARGS...: ncu's time of every kernel of `ncu ARGS` (ncu options, then
# the program), summed by kernel (bench/kernel_times.py) and appended to $OUT/FILE; kernels run
# one at a time under ncu, so these are their own times without launches or gaps
kernel_times() {
  local file=$1 label=$2 rc
  shift 2
  timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$@" \
    >/tmp/kernel_times.csv 2>/tmp/kernel_times.err
  rc=$?
  { echo "== $label (ncu rc=$rc)"; python3 bench/kernel_times.py /tmp/kernel_times.csv 2>&1 ||
    tail -20 /tmp/kernel_times.err; } | tee -a "$OUT/$file"
  return $rc
}

if has profile; then
  for i in ${MOE_PROFILE_SHAPES:-0 1}; do
    kernel_times profile.txt "layer shape $i" --profile-from-start off "$B/bench/bench_moe" \
      profile "$i" || status=1
  done
fi

# trace: CUPTI's timeline of one layer step (bench_moe profile) per shape in
# $MOE_PROFILE_SHAPES, summarised by bench/trace_summary.py
if has trace; then
  if cmake --build "$B" -j16 --target moe_trace >>"$OUT/build.log" 2>&1; then
    for i in ${MOE_PROFILE_SHAPES:-0 1}; do
      CUDA_INJECTION64_PATH=$B/bench/libmoe_trace.so MOE_TRACE_OUT=/tmp/trace.csv \
        "$B/bench/bench_moe" profile "$i" || status=1
      { echo "== layer shape $i"; python3 bench/trace_summary.py /tmp/trace.csv; } | tee -a "$OUT/trace.txt"
      cp /tmp/trace.csv "$OUT/trace_$i.csv"
    done
  else
    echo "no moe_trace (CUPTI not found)"
    status=1
  fi
fi

jsonl=("$OUT"/bench_*.jsonl)
if [ -e "${jsonl[0]}" ]; then
  write_results "${results_args[@]}" "${jsonl[@]}" || status=1
fi
exit $status
