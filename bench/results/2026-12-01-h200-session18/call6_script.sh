export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build 2>&1 | tail -2
source scripts/device_env.sh
for i in 1 2 3 4 5 6; do "$B/bench/bench_moe" layer 0 | python3 bench/brief.py /dev/stdin | grep "layer_fwd_bwd.*auto  "; done | tee $OUT/layer0_runs.txt
