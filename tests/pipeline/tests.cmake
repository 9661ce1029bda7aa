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
set_tests_properties(test_pipeline_threads PROPERTIES ENVIRONMENT "PIPE_TESTS=functional")
# The bubble measurement sleeps in its stages; run it alone so other tests do not steal the
# cores its threads wake up on.
add_test(NAME test_pipeline_bubble COMMAND test_pipeline_threads)
set_tests_properties(test_pipeline_bubble PROPERTIES ENVIRONMENT "PIPE_TESTS=bubble"
                     RUN_SERIAL TRUE TIMEOUT 120 LABELS pipeline)

# Over MPI (host backend): equivalence with pp = 1, failure propagation, bubble (np 4).
if(MOE_HAVE_MPI)
  moe_add_test(test_pipeline_mpi_np2 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_pipeline_mpi.c
               NP 2 LABELS pipeline TIMEOUT 120)
  target_link_libraries(test_pipeline_mpi_np2 PRIVATE moe_test_pipe MPI::MPI_C)
  moe_add_test(test_pipeline_mpi_np4 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_pipeline_mpi.c
               NP 4 LABELS pipeline TIMEOUT 120)
  target_link_libraries(test_pipeline_mpi_np4 PRIVATE moe_test_pipe MPI::MPI_C)
  if(TEST test_pipeline_mpi_np4)
    set_tests_properties(test_pipeline_mpi_np4 PROPERTIES RUN_SERIAL TRUE) # bubble timing
  endif()
endif()
