# Session 19, call 1: GPU tests of the select_outputs change; where layer shape 1's step goes
# under sustained load (a CUPTI trace of one step after 2 and after 400 warm-up steps), the
# power and clocks sampled every 25 ms during that run, during bench_moe layer 1 and during
# PyTorch's layer bench; the card's power limits.
export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -8
source scripts/device_env.sh
nvidia-smi --query-gpu=name,power.limit,enforced.power.limit,power.default_limit,power.max_limit,clocks.max.sm,clocks.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
sleep 8
MOE_PROFILE_SHAPES=1 MOE_PROFILE_WARMUP=2 bash bench/run_device.sh trace 2>&1 | head -40
mv "$OUT/trace.txt" "$OUT/trace_warm2.txt"; rm -f "$OUT"/trace_*.csv
sleep 8
power_sampling_start "trace, 400 warm-up steps"
MOE_PROFILE_SHAPES=1 MOE_PROFILE_WARMUP=400 bash bench/run_device.sh trace 2>&1 | head -40
power_sampling_stop
mv "$OUT/trace.txt" "$OUT/trace_warm400.txt"; rm -f "$OUT"/trace_*.csv
sleep 8
power_sampling_start "bench_moe layer 1"
"$B/bench/bench_moe" layer 1 | tee "$OUT/bench_layer1.jsonl" | python3 bench/brief.py /dev/stdin
power_sampling_stop
sleep 8
power_sampling_start "torch_moe.py layer"
PYTHONUNBUFFERED=1 python3 bench/torch_moe.py layer | tee "$OUT/torch_layer.jsonl" | python3 bench/brief.py /dev/stdin
power_sampling_stop
cat "$OUT/gpu.txt"
python3 bench/power_summary.py "$OUT/power.csv"
rm -f "$OUT/build.log"
