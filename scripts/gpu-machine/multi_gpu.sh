#!/usr/bin/env bash
# The distributed layer on one machine with 2+ GPUs, one MPI rank per GPU (NCCL), in one call:
#   info   GPUs (nvidia-smi -L, topology), driver, MPI, NCCL header version
#   build  Release, default architectures, MOE_CUDA=ON, examples off: test_dist_layer_np2, test_comm_device,
#          bench_dist_layer (each target on its own)
#   layer  the distributed layer against one rank on the concatenated batch, every mesh of
#          NGPU ranks, CUDA backend, NCCL communicators (bf16 bounds)
#   comm   communicators on device buffers: staged MPI, then NCCL (one rank per GPU);
#          NCCL_DEBUG=VERSION prints the NCCL library version
#   bench  bench_dist_layer on the GPUs (MOE_BENCH_BACKEND=cuda): per shape, step / blocked /
#          in-flight times for 1, 2, 4 chunks, the layer's all-to-all bus bandwidth (1 chunk)
#          and a plain all-to-all of the same bytes (libmoe's ep communicator; plain NCCL)
#   layer_mpi  the layer test again over staged MPI (one rank per GPU), for comparison
# Every part runs on its own under `timeout`, all of them within a global budget
# (MOE_MULTI_BUDGET_S, default 340 s from the start): a failing or hanging part does not stop
# the others. mpirun -np NGPU --bind-to none, NCCL_NVLS_ENABLE=0 (NVLink multicast stays off).
# Usage (repository root, deps unpacked): bash scripts/gpu-machine/multi_gpu.sh [parts...]
#   parts: info build layer comm bench layer_mpi (default: all, in that order)
# Files under $OUT: summary.txt (= stdout), info.txt, build.log, tests.log, bench.jsonl,
# bench.log, results/dist-layer.md (bench/write_results.py of bench.jsonl). Exit status: 0
# when every part that ran passed (skips count as passed).
set -u
cd "$(dirname "$0")/../.." || exit 1
source scripts/gpu-machine/env.sh
BUDGET=${MOE_MULTI_BUDGET_S:-340}
S="$OUT/summary.txt"
LOG="$OUT/tests.log"
: >"$S"
: >"$LOG"
parts=${*:-info build layer comm bench layer_mpi}
has() { [[ " $parts " == *" $1 "* ]]; }
say() { echo "$*" | tee -a "$S"; }
status=0

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "$NGPU" -ge 1 ] 2>/dev/null || NGPU=1
MPI=(mpirun -np "$NGPU" --bind-to none -x NCCL_NVLS_ENABLE)

# seconds left of the budget
left() { echo $((BUDGET - SECONDS)); }

# run NAME LIMIT_S CMD...: under timeout (capped by the budget), output appended to tests.log,
# one verdict line to the summary; the last output goes to $TMPOUT for grepping
TMPOUT=$(mktemp)
run() {
  local name=$1 lim=$2
  shift 2
  local l
  l=$(left)
  if [ "$l" -lt 15 ]; then
    say "$name: NOT RUN (budget of ${BUDGET}s spent)"
    status=1
    : >"$TMPOUT"
    return 1
  fi
  [ "$lim" -gt "$l" ] && lim=$l
  local t0=$SECONDS
  timeout -k 10 "$lim" "$@" >"$TMPOUT" 2>&1
  local rc=$? v
  case $rc in
    0) v=PASS ;;
    77) v=SKIP ;;
    124 | 137) v="TIMEOUT (${lim}s)" ;;
    *) v=FAIL ;;
  esac
  { echo "===== $name: rc=$rc, $((SECONDS - t0)) s: $*"; cat "$TMPOUT"; } >>"$LOG"
  say "$name: $v rc=$rc $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || status=1
  return "$rc"
}

say "multi_gpu.sh $(date -u +%FT%TZ) tree=$(basename "$PWD") commit=$(git rev-parse --short HEAD 2>/dev/null) NGPU=$NGPU"

if has info; then
  {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvidia-smi topo -m
    mpirun --version | head -1
    nvcc --version 2>/dev/null | tail -2
  } >"$OUT/info.txt" 2>&1
  nvidia-smi -L 2>&1 | tee -a "$S"
  nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -1 | sed 's/^/driver /' | tee -a "$S"
  nvidia-smi topo -m 2>&1 | head -$((NGPU + 1)) | tee -a "$S"
fi

if has build; then
  t0=$SECONDS
  device_configure -DMOE_BUILD_EXAMPLES=OFF >"$OUT/build.log" 2>&1 || { say "configure: FAILED"; status=1; }
  grep -E "libmoe .*CUDA=" "$OUT/build.log" | tee -a "$S"
  for t in test_dist_layer_np2 test_comm_device bench_dist_layer; do
    l=$(left)
    [ "$l" -gt 240 ] && l=240
    timeout "$l" cmake --build "$B" -j32 --target "$t" >>"$OUT/build.log" 2>&1 ||
      { say "build $t: FAILED"; status=1; grep -E "error|Error" "$OUT/build.log" | tail -5 | tee -a "$S"; }
  done
  say "build: $((SECONDS - t0))s"
fi
# NCCL version of the header the build used
inc=$(sed -n 's/^MOE_NCCL_INCLUDE:PATH=//p' "$B/CMakeCache.txt" 2>/dev/null)
if [ -n "$inc" ] && [ -f "$inc/nccl.h" ]; then
  say "nccl.h: $(grep -E '^#define NCCL_(MAJOR|MINOR|PATCH) ' "$inc/nccl.h" | awk '{printf "%s ", $3}')($inc)"
fi
T=$B/tests

if has layer; then
  # every mesh of NGPU ranks (NGPU = 2: (1,2,1,1), (2,1,1,1), (1,1,2,1)) x every scenario
  run "layer NCCL (test_dist_layer, cuda, $NGPU ranks)" 180 \
    env MOE_TEST_BACKEND=cuda MOE_TEST_COMM=nccl \
    "${MPI[@]}" -x MOE_TEST_BACKEND -x MOE_TEST_COMM "$T/test_dist_layer_np2"
  grep -hE "^world|rel err|Abort|error" "$TMPOUT" | sort | uniq | head -8 | tee -a "$S"
fi

if has comm; then
  run "comm device (test_comm_device, staged MPI + NCCL, $NGPU ranks)" 90 \
    env NCCL_DEBUG=VERSION "${MPI[@]}" -x NCCL_DEBUG "$T/test_comm_device"
  grep -hE "device buffers|NCCL part|NCCL version|failed|error" "$TMPOUT" | sort | uniq | head -8 | tee -a "$S"
fi

if has bench; then
  : >"$OUT/bench.jsonl"
  : >"$OUT/bench.log"
  # N H F E K iters (N tokens per rank; E experts over NGPU ranks)
  shapes=("4096 4096 1408 16 2 10" "8192 4096 1408 16 8 5" "16384 7168 2048 16 8 5")
  for shape in "${shapes[@]}"; do
    # shellcheck disable=SC2086
    run "bench_dist_layer cuda $shape" 110 \
      env MOE_BENCH_BACKEND=cuda "${MPI[@]}" -x MOE_BENCH_BACKEND "$B/bench/bench_dist_layer" $shape
    grep -h '^{' "$TMPOUT" | tee -a "$OUT/bench.jsonl" | tee -a "$S"
    { echo "===== $shape"; grep -v '^{' "$TMPOUT"; } >>"$OUT/bench.log"
    grep -hE "^rank [0-9]+:|\.c:[0-9]+:" "$TMPOUT" | head -4 | tee -a "$S"
  done
  list=$(printf '%s; ' "${shapes[@]}")
  cmd="\`MOE_BENCH_BACKEND=cuda mpirun -np $NGPU --bind-to none bench_dist_layer N H F E K iters\`"
  write_results --only dist-layer --command "dist-layer=$cmd, N H F E K iters = ${list%; }" \
    "$OUT/bench.jsonl" || status=1
fi

if has layer_mpi; then
  run "layer staged MPI (test_dist_layer, cuda, $NGPU ranks)" 120 \
    env MOE_TEST_BACKEND=cuda MOE_TEST_COMM=mpi \
    "${MPI[@]}" -x MOE_TEST_BACKEND -x MOE_TEST_COMM "$T/test_dist_layer_np2"
  grep -hE "^world|rel err" "$TMPOUT" | sort | uniq | head -6 | tee -a "$S"
fi

rm -f "$TMPOUT"
say "done in ${SECONDS}s, status $status"
exit $status
