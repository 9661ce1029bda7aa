# ncu of router_fused at N=4096 H=2048 E=64 K=4: this tree (thin tiles) and wt-base (clusters of 2)
export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build >/dev/null || exit 1
source scripts/device_env.sh
(cd wt-base && export MOE_BUILD_DIR=/tmp/build-base && source scripts/device_env.sh && device_configure >/dev/null && cmake --build /tmp/build-base -j16 --target bench_moe >/dev/null) || exit 1
for side in this base; do
  bin=$B/bench/bench_moe; [ $side = base ] && bin=/tmp/build-base/bench/bench_moe
  timeout 200 ncu --clock-control none -k regex:router_fused --launch-skip 20 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    $bin router 5 > $OUT/ncu_$side.txt 2>&1
  echo "== $side"; grep -E "Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\)|Shared Memory|Stall|Registers|Grid Size|Cluster" $OUT/ncu_$side.txt | head -30
done
