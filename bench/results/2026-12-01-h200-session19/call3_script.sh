# Session 19, call 3: the layer bench with its new sustained figure (layer_fwd_bwd_sustained,
# timed after 3 s of steps), libmoe and PyTorch, power and clocks sampled every 25 ms.
export PATH=/usr/local/cuda/bin:$PATH
source scripts/device_env.sh
bash bench/run_device.sh build 2>&1 | tail -2
for round in 1 2; do
  sleep 8
  power_sampling_start "bench_moe layer, round $round"
  "$B/bench/bench_moe" layer >"$OUT/bench_libmoe_layer_$round.jsonl"; power_sampling_stop
  python3 bench/brief.py "$OUT/bench_libmoe_layer_$round.jsonl" | grep -E "auto |sustained"
  sleep 8
  power_sampling_start "torch_moe.py layer, round $round"
  PYTHONUNBUFFERED=1 python3 bench/torch_moe.py layer >"$OUT/bench_torch_layer_$round.jsonl"; power_sampling_stop
  python3 bench/brief.py "$OUT/bench_torch_layer_$round.jsonl"
done
python3 bench/power_summary.py "$OUT/power.csv"
rm -f "$OUT/build.log"
