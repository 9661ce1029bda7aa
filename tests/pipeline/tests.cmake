moe_add_test(test_pipeline_schedule SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_schedule.c
             LABELS pipeline TIMEOUT 60)

# In-process stages (threads) over a test communicator: no MPI needed.
add_library(moe_test_pipe STATIC ${CMAKE_CURRENT_LIST_DIR}/thread_comm.c
            ${CMAKE_CURRENT_LIST_DIR}/pipe_model.c)
target_link_libraries(moe_test_pipe PUBLIC moe_test_support Threads::Threads m)
target_include_directories(moe_test_pipe PUBLIC ${CMAKE_CURRENT_LIST_DIR})
moe_add_test(test_pipeline_threads SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_executor_threads.c
             LABELS pipeline TIMEOUT 120)
target_link_libraries(test_pipeline_threads PRIVATE moe_test_pipe)
