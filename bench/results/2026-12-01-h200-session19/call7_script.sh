# Session 19, call 7: the side streams' join after a failed GEMM (cuda_experts.c, the router
# backward): GPU tests and test_dist_layer_cuda np2 / np4 on the final code.
export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests dist 2>&1 | tail -12
rm -f /tmp/moe-out/build.log "$OUT/build.log" 2>/dev/null
