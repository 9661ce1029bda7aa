#!/usr/bin/env bash
# Everything the GPU machine runs for the CUDA backend, in one call:
#   build (sm_90, Release) -> GPU tests -> compute-sanitizer memcheck + racecheck on the test
#   binaries -> bench_moe -> bench/torch_moe.py, logs and JSON lines under $OUT.
# Usage (from the repository root, deps unpacked): bash scripts/gpu-machine/run.sh [phases...]
#   phases: build tests sanitize bench torch (default: all of them); dist: the distributed
#   layer test on the CUDA backend (2 and 4 ranks sharing the GPU through MPI); profile: ncu's
#   time of every kernel of one layer step, layer shapes $MOE_PROFILE_SHAPES (default 0 1),
#   summed by bench/kernel_times.py into $OUT/profile.txt; trace: the timeline of the same
#   layer steps (bench/trace.c, CUPTI) in $OUT/trace.txt, also of each $MOE_AB_TREE's bench_moe
#   when set (both after $MOE_PROFILE_WARMUP steps, default 2: bench_moe profile); algos:
#   bench/gemm_algos.c ($MOE_ALGOS_GROUP: one group); ab: bench_moe of this tree, of each
#   tree in $MOE_AB_TREE (source trees carried with the call) and of this one under each
#   environment of $MOE_AB_ENV (';'-separated), taking turns, 3 rounds, parts $MOE_BENCH_PART
#   (default router);
#   ncu: one kernel's counters; kernels: every kernel's own time in the router bench of some
#   shapes
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu-machine/env.sh
phases=${*:-build tests sanitize bench torch}
has() { [[ " $phases " == *" $1 "* ]] && echo "[$(date -u +%H:%M:%S)] $1"; }
status=0

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
# error or a failed test fails. (--kernel-name-exclude kns=nvjet instead crashed the sanitizer.)
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

# MOE_BENCH_PART: the parts to run (router experts layer, or all); one JSON file per part
# and implementation, and a one-line-per-measurement digest on stdout.
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
# algos: every cublasLt algorithm for the GEMMs whose default pick is far from the floor
if has algos; then
  cmake --build "$B" -j16 --target gemm_algos >>"$OUT/build.log" 2>&1 &&
    "$B/bench/gemm_algos" ${MOE_ALGOS_GROUP:-} >"$OUT/gemm_algos.jsonl" || status=1
  python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l); print(r["shape"], r["variant"], r["ms"], r["tflops"], r["waves"], r["same"],
      *(f"{k}={r[k]}" for k in ("id", "tile", "stages", "splitk", "cluster", "swizzle", "custom") if k in r))' "$OUT/gemm_algos.jsonl"
fi

# ab: the drift between device calls (up to 9%) is larger than many a change, so a change is
# measured against its base in the same call, the sides taking turns, $MOE_AB_ROUNDS rounds
# (default 3) of bench_moe with each of the parts (default router), or with the arguments
# $MOE_AB_ARGS instead (e.g. "layer 0": one layer shape)
# build_other TREE: TREE's bench_moe (a source tree carried with the call), in its own build
# directory, whose path it prints
build_other() {
  local bo=/tmp/build-device-ab-$(basename "$1")
  (cd "$1" && B=$bo && device_configure && cmake --build "$bo" -j16 --target bench_moe) \
    >>"$OUT/build.log" 2>&1 || { echo "AB BUILD FAILED ($1)" >&2; tail -20 "$OUT/build.log" >&2; return 1; }
  echo "$bo/bench/bench_moe"
}
# tree_sides: sides = this and each tree in $MOE_AB_TREE (space-separated; a side is named by
# the tree's folder), bin[side] its bench_moe (built), envs[side] empty
tree_sides() {
  sides=(this)
  declare -gA bin=([this]=$B/bench/bench_moe) envs=([this]=)
  for tree in ${MOE_AB_TREE:-}; do
    side=$(basename "$tree")
    bin[$side]=$(build_other "$tree") || return 1
    envs[$side]=
    sides+=("$side")
  done
}
if has ab; then
  # the other sides: the trees of $MOE_AB_TREE, and this binary under each environment of
  # $MOE_AB_ENV (e.g. "MOE_CUDA_ROUTER=gemm")
  tree_sides || exit 1
  [ -n "${MOE_AB_TREE:-}${MOE_AB_ENV:-}" ] || { echo "ab needs MOE_AB_TREE or MOE_AB_ENV"; exit 1; }
  # each ';'-separated environment of $MOE_AB_ENV is one more side, env1, env2, ...
  IFS=';' read -r -a ab_envs <<<"${MOE_AB_ENV:-}"
  for i in "${!ab_envs[@]}"; do
    side=env$((i + 1))
    bin[$side]=$B/bench/bench_moe envs[$side]=${ab_envs[$i]}
    sides+=("$side")
    echo "$side: ${ab_envs[$i]}"
  done
  if [ -n "${MOE_AB_ARGS:-}" ]; then runs=("$MOE_AB_ARGS"); else runs=(${MOE_BENCH_PART:-router}); fi
  for round in $(seq "${MOE_AB_ROUNDS:-3}"); do
    # the order of the sides reverses every round, so that drift within the call favours none
    order=("${sides[@]}")
    [ $((round % 2)) = 0 ] && order=($(printf '%s\n' "${sides[@]}" | tac))
    for side in "${order[@]}"; do
      for args in "${runs[@]}"; do
        env ${envs[$side]} "${bin[$side]}" $args >/tmp/ab.jsonl || status=1
        cat /tmp/ab.jsonl >>"$OUT/ab_$side.jsonl"
        python3 bench/brief.py /tmp/ab.jsonl | sed "s/^/$side $round  /"
      done
    done
  done
fi

# ncu: the full counter set for one launch of kernel $MOE_NCU_KERNEL (a regex) in bench_moe
# $MOE_NCU_PART (default router; "router 5": one router shape), after skipping $MOE_NCU_SKIP
# launches of it: the details page in ncu.txt, executed instructions per SASS line in ncu_sass.csv
if has ncu; then
  timeout 300 ncu --clock-control none -k "regex:${MOE_NCU_KERNEL:?ncu needs MOE_NCU_KERNEL}" \
    --launch-skip "${MOE_NCU_SKIP:-0}" -c 1 --set full --import-source yes -f -o /tmp/ncu_kernel \
    "$B/bench/bench_moe" ${MOE_NCU_PART:-router} >/dev/null 2>"$OUT/ncu.err" || status=1
  ncu --import /tmp/ncu_kernel.ncu-rep --page details >"$OUT/ncu.txt" 2>>"$OUT/ncu.err"
  ncu --import /tmp/ncu_kernel.ncu-rep --page source --csv --print-source sass \
    >"$OUT/ncu_sass.csv" 2>>"$OUT/ncu.err"
  grep -E "Duration|Executed Instructions  |Issue Slots Busy|Registers Per|No Eligible|Achieved Occupancy" "$OUT/ncu.txt"
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

# kernels: the router bench of each router shape in $MOE_KERNELS_SHAPES (default the four small
# ones), to set against its event-timed figures, which also hold launches and gaps
if has kernels; then
  for i in ${MOE_KERNELS_SHAPES:-2 3 4 5}; do
    kernel_times kernels.txt "router shape $i" "$B/bench/bench_moe" router "$i" || status=1
  done
fi

if has profile; then
  for i in ${MOE_PROFILE_SHAPES:-0 1}; do
    kernel_times profile.txt "layer shape $i" --profile-from-start off "$B/bench/bench_moe" \
      profile "$i" || status=1
  done
fi
# trace: CUPTI's timeline of one layer step (bench_moe profile) per shape in $MOE_PROFILE_SHAPES,
# summarised by bench/trace_summary.py; with $MOE_AB_TREE also each tree's binary, alternating
if has trace; then
  cmake --build "$B" -j16 --target moe_trace >>"$OUT/build.log" 2>&1 || { echo "no moe_trace"; exit 1; }
  tree_sides || exit 1
  for i in ${MOE_PROFILE_SHAPES:-0 1}; do
    for side in "${sides[@]}"; do
      CUDA_INJECTION64_PATH=$B/bench/libmoe_trace.so MOE_TRACE_OUT=/tmp/trace.csv \
        "${bin[$side]}" profile "$i" || status=1
      { echo "== layer shape $i, $side"; python3 bench/trace_summary.py /tmp/trace.csv; } |
        tee -a "$OUT/trace.txt"
      cp /tmp/trace.csv "$OUT/trace_${i}_$side.csv"
    done
  done
fi
exit $status
