# Session 19, call 3: the layer bench with its new sustained figure (layer_fwd_bwd_sustained,
# timed after 3 s of steps), libmoe and PyTorch, power and clocks sampled every 25 ms.
export PATH=/usr/local/cuda/bin:$PATH
source scripts/device_env.sh
F=timestamp,clocks.sm,power.draw.instant,power.draw.average,temperature.gpu,clocks_event_reasons.active
smi_start() { echo "== $1" >>"$OUT/smi.csv"; nvidia-smi --query-gpu=$F --format=csv,noheader -lms 25 >>"$OUT/smi.csv" & SMI=$!; sleep 0.3; }
smi_stop() { sleep 0.3; kill $SMI; wait $SMI 2>/dev/null; }
bash bench/run_device.sh build 2>&1 | tail -2
for round in 1 2; do
  sleep 8
  smi_start "bench_moe layer, round $round"
  "$B/bench/bench_moe" layer >"$OUT/bench_libmoe_layer_$round.jsonl"; smi_stop
  python3 bench/brief.py "$OUT/bench_libmoe_layer_$round.jsonl" | grep -E "auto |sustained"
  sleep 8
  smi_start "torch_moe.py layer, round $round"
  PYTHONUNBUFFERED=1 python3 bench/torch_moe.py layer >"$OUT/bench_torch_layer_$round.jsonl"; smi_stop
  python3 bench/brief.py "$OUT/bench_torch_layer_$round.jsonl"
done
python3 - "$OUT/smi.csv" <<'PY'
import statistics as st, sys
sec, rows = None, {}
for line in open(sys.argv[1]):
    if line.startswith("=="):
        sec = line[3:].strip(); rows[sec] = []; continue
    c = [x.strip() for x in line.split(",")]
    try: rows[sec].append((float(c[1].split()[0]), float(c[2].split()[0]), int(c[-1], 16)))
    except (ValueError, IndexError): pass
for s, r in rows.items():
    busy = [x for x in r if x[1] > 250]  # watts: the GPU at work
    if not busy: print(s, len(r), "samples, none busy"); continue
    clk = [x[0] for x in busy]; pw = [x[1] for x in busy]
    cap = sum(1 for x in busy if x[2] & 4)
    print(f"{s}: {len(r)} samples, {len(busy)} busy; SM MHz median {st.median(clk):.0f} "
          f"min {min(clk):.0f} max {max(clk):.0f}; W median {st.median(pw):.0f} max {max(pw):.0f}; "
          f"sw power cap in {cap}")
PY
rm -f "$OUT/build.log"
