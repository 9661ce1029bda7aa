list(APPEND MOE_SOURCES src/moe/layer.c src/moe/dispatch.c)
