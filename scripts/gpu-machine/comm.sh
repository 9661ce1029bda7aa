#!/usr/bin/env bash
# The comm/mesh checks on the GPU machine, in one call (logs under $OUT):
#   build (CUDA + NCCL + MPI) -> GPU communicator tests (MPI staged with 1 and 3 ranks
#   sharing the GPU, NCCL with one rank) -> the MPI/mesh/distributed-layer suite, host and
#   CUDA backends (2 and 4 ranks sharing the GPU) ->
#   bench_dist_layer (hidden all-to-all fraction, host backend, 4 ranks, worker thread off
#   and on) -> $OUT/results/dist-layer.md from its JSON lines.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source scripts/gpu-machine/env.sh
device_configure -DMOE_BUILD_EXAMPLES=OFF >"$OUT/build.log" 2>&1 &&
  cmake --build "$B" -j16 --target test_comm_device test_comm_ops test_dist_layer_np2 test_dist_layer_np4 \
    bench_dist_layer >>"$OUT/build.log" 2>&1 ||
  { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
grep -E "libmoe .*CUDA=" "$OUT/build.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(cd "$B" && ctest -R "comm_device|comm_ops|dist_layer" -E np8 --output-on-failure -j4 \
  --timeout 300) >"$OUT/ctest.log" 2>&1
grep -E "Test +#|tests passed|Skipped" "$OUT/ctest.log"
grep -hE "device buffers|NCCL part|VERDICT|^world" "$OUT/ctest.log" | sort | uniq | head -20
dist_args="512 1024 32 8 2 5" # N H F E K iters
for thr in 0 1; do
  # shellcheck disable=SC2086
  MOE_A2A_THREAD=$thr mpirun -np 4 --bind-to none -x MOE_A2A_THREAD \
    "$B/bench/bench_dist_layer" $dist_args 2>&1 | tee -a "$OUT/bench.jsonl"
done
write_results --only dist-layer --gpu "none: the host backend on $(nproc) CPU cores" \
  --software "$(mpirun --version 2>/dev/null | head -1)" \
  --command "dist-layer=\`mpirun -np 4 --bind-to none bench_dist_layer $dist_args\`, with \`MOE_A2A_THREAD=0\`, then \`MOE_A2A_THREAD=1\`" \
  "$OUT/bench.jsonl"
