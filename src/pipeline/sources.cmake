list(APPEND MOE_SOURCES src/pipeline/schedule.c src/pipeline/executor.c)
