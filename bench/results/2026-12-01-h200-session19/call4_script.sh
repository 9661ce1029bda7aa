# Session 19, call 4: the sustained layer figure (after 3 s of steps) of each expert GEMM path
# at layer shapes 0 and 1: auto (padded strided batched at shape 0, the loop at shape 1), side
# streams (compact rows), and auto with the SwiGLU GEMMs; sides in turns, separate processes.
export PATH=/usr/local/cuda/bin:$PATH
source scripts/device_env.sh
bash bench/run_device.sh build 2>&1 | tail -1
for round in 1 2; do
  for shape in 0 1; do
    for env in "MOE_BENCH_SIDE=auto" "MOE_CUDA_EXPERT_GEMM=streams" "MOE_CUDA_SWIGLU_GEMM=1"; do
      sleep 5
      echo "== round $round shape $shape $env" | tee -a "$OUT/sustained.jsonl"
      env $env "$B/bench/bench_moe" layer $shape | tee -a "$OUT/sustained.jsonl" |
        python3 bench/brief.py /dev/stdin | grep -E "sustained|fwd_bwd "
    done
  done
done
rm -f "$OUT/build.log"
