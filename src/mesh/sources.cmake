list(APPEND MOE_SOURCES src/mesh/mesh.c)
