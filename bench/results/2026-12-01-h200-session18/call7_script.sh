export PATH=/usr/local/cuda/bin:$PATH
bash bench/run_device.sh build dist 2>&1 | tail -4
MOE_SANITIZE_TOOLS=memcheck MOE_SANITIZE_TESTS=test_cuda_layer bash bench/run_device.sh sanitize 2>&1 | tail -2
