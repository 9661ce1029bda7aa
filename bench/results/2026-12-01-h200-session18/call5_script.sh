export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -12
MOE_BENCH_PART="router layer" bash bench/run_device.sh bench torch 2>&1 | grep -E "router_fwd |router_bwd|layer|bench|torch" | grep -v stream
