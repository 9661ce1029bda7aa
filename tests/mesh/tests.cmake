# Mesh tests: the world of one (no mpirun), and the distributed mesh on 2, 4 and 8 ranks.
moe_add_test(test_mesh_single SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_mesh_single.c TIMEOUT 30
             LABELS mesh)
foreach(_np 2 4 8)
  moe_add_test(test_mesh_np${_np} SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_mesh.c NP ${_np}
               TIMEOUT 120 LABELS mesh mpi)
  if(TARGET test_mesh_np${_np})
    target_link_libraries(test_mesh_np${_np} PRIVATE MPI::MPI_C)
  endif()
endforeach()
moe_add_test(test_mesh_owns_mpi SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_mesh_owns_mpi.c NP 2
             TIMEOUT 60 LABELS mesh mpi)
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
  add_test(NAME test_dist_layer_np4_thread COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 4
           --oversubscribe $<TARGET_FILE:test_dist_layer_np4>)
  set_tests_properties(test_dist_layer_np4_thread PROPERTIES TIMEOUT 150 LABELS "moe;mesh;mpi"
    ENVIRONMENT "MOE_A2A_THREAD=1;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
endif()
# The same with the CUDA backend, 2 and 4 ranks sharing one GPU through MPI (exit 77 without
# a GPU).
foreach(_np 2 4)
  if(TARGET test_dist_layer_np${_np})
    add_test(NAME test_dist_layer_cuda_np${_np} COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG}
             ${_np} --oversubscribe $<TARGET_FILE:test_dist_layer_np${_np}>)
    set_tests_properties(test_dist_layer_cuda_np${_np} PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
      LABELS "moe;mesh;mpi;cuda" ENVIRONMENT
      "MOE_TEST_BACKEND=cuda;MOE_TEST_COMM=mpi;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
  endif()
endforeach()
# Gradient reduction started during the backward equals the one the step makes.
moe_add_test(test_grad_sync SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_grad_sync.c NP 4 TIMEOUT 120
             LABELS moe mesh mpi)
if(TARGET test_grad_sync)
  target_link_libraries(test_grad_sync PRIVATE MPI::MPI_C)
endif()
