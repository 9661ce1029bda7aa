list(APPEND MOE_SOURCES src/optim/adamw.c src/optim/grad_sync.c src/optim/clip.c
     src/optim/schedule.c)
