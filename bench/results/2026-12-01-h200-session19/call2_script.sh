# Session 19, call 2, the final code: GPU tests, memcheck on test_cuda_ops, the router and
# layer benches with PyTorch in the same call, and one traced step of layer shapes 0 and 2
# after a few seconds of steps (power and clocks sampled every 25 ms during those traces).
export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -4
MOE_SANITIZE_TOOLS=memcheck MOE_SANITIZE_TESTS=test_cuda_ops bash bench/run_device.sh sanitize 2>&1 | tail -3
MOE_BENCH_PART="router layer" bash bench/run_device.sh bench torch 2>&1 | grep -E "router_fwd |router_bwd|layer" | grep -v stream
source scripts/device_env.sh
cat "$OUT/gpu.txt"; rm -f "$OUT/gpu.txt"
F=timestamp,clocks.sm,power.draw.instant,power.draw.average,temperature.gpu,clocks_event_reasons.active
smi_start() { echo "== $1" >>"$OUT/smi.csv"; nvidia-smi --query-gpu=$F --format=csv,noheader -lms 25 >>"$OUT/smi.csv" & SMI=$!; sleep 0.3; }
smi_stop() { sleep 0.3; kill $SMI; wait $SMI 2>/dev/null; }
for shape_warm in "0 800" "2 60"; do
  set -- $shape_warm
  sleep 8
  smi_start "trace of layer shape $1, $2 warm-up steps"
  MOE_PROFILE_SHAPES=$1 MOE_PROFILE_WARMUP=$2 bash bench/run_device.sh trace 2>&1 | head -30
  smi_stop
  cat "$OUT/trace.txt" >>"$OUT/traces.txt"; rm -f "$OUT/trace.txt" "$OUT"/trace_*.csv
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
ls "$OUT"
