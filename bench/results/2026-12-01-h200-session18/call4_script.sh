export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -12
MOE_SANITIZE_TESTS=test_cuda_ops bash bench/run_device.sh sanitize 2>&1 | tail -4
MOE_AB_TREE=wt-prev MOE_AB_ROUNDS=3 bash bench/run_device.sh ab 2>&1 | grep -E "router_fwd " | grep -v stream | tee $OUT/ab.txt | grep -E "N=4096|N=16384|N=65536 H=4096|N=512 " | sort -k1,1 -s
