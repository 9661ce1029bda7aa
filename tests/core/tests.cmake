moe_add_test(test_api_errors SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_api_errors.c LABELS core)
