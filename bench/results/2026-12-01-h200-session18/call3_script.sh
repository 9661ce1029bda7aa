export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests dist 2>&1 | tail -14
MOE_SANITIZE_TOOLS=memcheck MOE_SANITIZE_TESTS=test_cuda_layer bash bench/run_device.sh sanitize 2>&1 | tail -3
MOE_BENCH_PART=router bash bench/run_device.sh bench torch 2>&1 | grep -E "router_fwd |router_bwd|bench|torch" | grep -v stream
source scripts/device_env.sh
for i in 1 2 3 4 5 6 7 8; do "$B/bench/bench_moe" router 5 | python3 bench/brief.py /dev/stdin | grep "router_fwd " ; done | tee $OUT/n4096_runs.txt
