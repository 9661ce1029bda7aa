list(APPEND MOE_SOURCES src/comm/comm.c)
