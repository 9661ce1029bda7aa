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
