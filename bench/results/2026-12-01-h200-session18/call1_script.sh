export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -12
grep -E "big=|host z|stats \(z|score_mean" /tmp/test_cuda_ops.log | grep -B1 -A2 "big=64" | head -40 > $OUT/big_cases.txt
MOE_AB_TREE=wt-base MOE_AB_ROUNDS=3 bash bench/run_device.sh ab 2>&1 | grep -E "router_fwd " | grep -v stream | tee $OUT/ab.txt | grep -E "4096|N=512 |1024|2048" | head -60
