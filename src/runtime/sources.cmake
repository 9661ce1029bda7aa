list(APPEND MOE_SOURCES src/runtime/runtime.c)
