list(APPEND MOE_SOURCES src/moe/layer.c)
