moe_add_test(test_pipeline_schedule SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_schedule.c
             LABELS pipeline TIMEOUT 60)
