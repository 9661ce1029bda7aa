list(APPEND MOE_SOURCES src/optim/adamw.c src/optim/grad_sync.c)
