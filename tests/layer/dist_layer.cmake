# The distributed layer against one rank on the concatenated batch (every mesh of 2, 4, 8).
foreach(_np 2 4 8)
  moe_add_test(test_dist_layer_np${_np} SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_dist_layer.c
               NP ${_np} TIMEOUT 150 LABELS moe mesh mpi)
  if(TARGET test_dist_layer_np${_np})
    target_link_libraries(test_dist_layer_np${_np} PRIVATE MPI::MPI_C)
  endif()
endforeach()
# The same on 4 ranks with the host worker thread forced on (experts of chunk c on a thread
# while the main thread drives MPI; off by default under MPI_Init's MPI_THREAD_SINGLE).
if(TARGET test_dist_layer_np4)
  moe_add_mpi_run(test_dist_layer_np4_thread TARGET test_dist_layer_np4 NP 4
                  ENV MOE_A2A_THREAD=1)
  set_tests_properties(test_dist_layer_np4_thread PROPERTIES TIMEOUT 150 LABELS "moe;mesh;mpi")
endif()
# The same with the CUDA backend, 2 and 4 ranks sharing one GPU through MPI (exit 77 without
# a GPU).
foreach(_np 2 4)
  if(TARGET test_dist_layer_np${_np})
    moe_add_mpi_run(test_dist_layer_cuda_np${_np} TARGET test_dist_layer_np${_np} NP ${_np}
                    ENV MOE_TEST_BACKEND=cuda MOE_TEST_COMM=mpi)
    set_tests_properties(test_dist_layer_cuda_np${_np} PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
      LABELS "moe;mesh;mpi;cuda")
  endif()
endforeach()
