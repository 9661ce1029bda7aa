# Session 19, call 2, the final code: GPU tests, memcheck on test_cuda_ops, the router and
# layer benches with PyTorch in the same call, and one traced step of layer shapes 0 and 2
# after a few seconds of steps (power and clocks sampled every 25 ms during those traces).
export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -4
MOE_SANITIZE_TOOLS=memcheck MOE_SANITIZE_TESTS=test_cuda_ops bash bench/run_device.sh sanitize 2>&1 | tail -3
MOE_BENCH_PART="router layer" bash bench/run_device.sh bench torch 2>&1 | grep -E "router_fwd |router_bwd|layer" | grep -v stream
source scripts/device_env.sh
cat "$OUT/gpu.txt"; rm -f "$OUT/gpu.txt"
for shape_warm in "0 800" "2 60"; do
  set -- $shape_warm
  sleep 8
  power_sampling_start "trace of layer shape $1, $2 warm-up steps"
  MOE_PROFILE_SHAPES=$1 MOE_PROFILE_WARMUP=$2 bash bench/run_device.sh trace 2>&1 | head -30
  power_sampling_stop
  cat "$OUT/trace.txt" >>"$OUT/traces.txt"; rm -f "$OUT/trace.txt" "$OUT"/trace_*.csv
done
python3 bench/power_summary.py "$OUT/power.csv"
rm -f "$OUT/build.log"
ls "$OUT"
