list(APPEND MOE_SOURCES src/core/env.c src/core/error.c src/core/log.c src/core/tensor.c)
list(APPEND MOE_PRIVATE_LIBS Threads::Threads m)
