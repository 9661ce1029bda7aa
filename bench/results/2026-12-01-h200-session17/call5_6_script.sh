export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build tests 2>&1 | tail -12
MOE_AB_TREE=wt-base MOE_AB_ENV="MOE_XTHIN=1" MOE_AB_ROUNDS=3 bash bench/run_device.sh ab 2>&1 | grep -E "env|router_fwd " | grep -v stream | tee $OUT/ab5.txt | grep fused
