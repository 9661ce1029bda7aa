# Session 19, call 1: GPU tests of the select_outputs change; where layer shape 1's step goes
# under sustained load (a CUPTI trace of one step after 2 and after 400 warm-up steps), the
# power and clocks sampled every 25 ms during that run, during bench_moe layer 1 and during
# PyTorch's layer bench; the card's power limits.
export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -8
source scripts/device_env.sh
nvidia-smi --query-gpu=name,power.limit,enforced.power.limit,power.default_limit,power.max_limit,clocks.max.sm,clocks.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
F=timestamp,clocks.sm,power.draw.instant,power.draw.average,temperature.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$F --format=csv,noheader >/dev/null 2>&1 || F=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active
echo "fields: $F" >>"$OUT/gpu.txt"
smi_start() { echo "== $1" >>"$OUT/smi.csv"; nvidia-smi --query-gpu=$F --format=csv,noheader -lms 25 >>"$OUT/smi.csv" & SMI=$!; sleep 0.3; }
smi_stop() { sleep 0.3; kill $SMI; wait $SMI 2>/dev/null; }
sleep 8
MOE_PROFILE_SHAPES=1 MOE_PROFILE_WARMUP=2 bash bench/run_device.sh trace 2>&1 | head -40
mv "$OUT/trace.txt" "$OUT/trace_warm2.txt"; rm -f "$OUT"/trace_*.csv
sleep 8
smi_start "trace, 400 warm-up steps"
MOE_PROFILE_SHAPES=1 MOE_PROFILE_WARMUP=400 bash bench/run_device.sh trace 2>&1 | head -40
smi_stop
mv "$OUT/trace.txt" "$OUT/trace_warm400.txt"; rm -f "$OUT"/trace_*.csv
sleep 8
smi_start "bench_moe layer 1"
"$B/bench/bench_moe" layer 1 | tee "$OUT/bench_layer1.jsonl" | python3 bench/brief.py /dev/stdin
smi_stop
sleep 8
smi_start "torch_moe.py layer"
PYTHONUNBUFFERED=1 python3 bench/torch_moe.py layer | tee "$OUT/torch_layer.jsonl" | python3 bench/brief.py /dev/stdin
smi_stop
cat "$OUT/gpu.txt"
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
