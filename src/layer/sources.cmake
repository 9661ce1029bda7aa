list(APPEND MOE_SOURCES src/layer/layer.c src/layer/single_rank.c src/layer/expert_parallel.c
     src/layer/routing.c src/layer/device_buffer.c)
