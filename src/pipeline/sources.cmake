list(APPEND MOE_SOURCES src/pipeline/schedule.c src/pipeline/issue_order.c
     src/pipeline/executor.c)
