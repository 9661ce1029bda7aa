moe_add_test(test_api_errors SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_api_errors.c LABELS core)
moe_add_test(test_env SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_env.c LABELS core)
