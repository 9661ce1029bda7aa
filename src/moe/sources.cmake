list(APPEND MOE_SOURCES src/moe/layer.c src/moe/expert_parallel.c)
