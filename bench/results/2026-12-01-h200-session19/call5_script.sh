# Session 19, call 5, the final code: racecheck on test_cuda_ops, memcheck on test_cuda_layer,
# test_dist_layer_cuda on 2 and 4 ranks sharing the GPU.
export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -3
MOE_SANITIZE_TOOLS=racecheck MOE_SANITIZE_TESTS=test_cuda_ops bash bench/run_device.sh sanitize 2>&1 | tail -3
source scripts/device_env.sh
mv "$OUT/sanitize.log" /tmp/racecheck.log
MOE_SANITIZE_TOOLS=memcheck MOE_SANITIZE_TESTS=test_cuda_layer bash bench/run_device.sh sanitize 2>&1 | tail -3
cat /tmp/racecheck.log "$OUT/sanitize.log" >"$OUT/sanitize_all.log"; rm -f "$OUT/sanitize.log"
bash bench/run_device.sh dist 2>&1 | tail -4
rm -f "$OUT/build.log"
