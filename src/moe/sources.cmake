list(APPEND MOE_SOURCES src/moe/layer.c src/moe/single_rank.c src/moe/expert_parallel.c
     src/moe/routing.c src/moe/device_buffer.c)
