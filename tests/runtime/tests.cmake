# A runtime is not destroyed under the objects made on it (a world of one, no MPI).
moe_add_test(test_runtime_destroy_order
             SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_runtime_destroy_order.c
             TIMEOUT 30 LABELS fault core)
# The wait clock: on 2 ranks, the rank that arrives late at a collective waits for nobody.
moe_add_test(test_runtime_wait_stats SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_runtime_wait_stats.c
             NP 2 TIMEOUT 60 LABELS core)
