# Communicator tests: every operation on 3 and 4 ranks, and the timeout paths.
moe_add_test(test_comm_ops SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_comm_ops.c NP 4 TIMEOUT 60
             LABELS comm mpi)
if(MOE_HAVE_MPI)
  # the same program on 3 ranks (odd rings, uneven splits)
  moe_add_mpi_run(test_comm_ops_np3 TARGET test_comm_ops NP 3)
  # A stalled peer and a killed peer. For the kill, --enable-recovery (Open MPI) keeps the
  # launcher from killing the survivors as soon as the victim dies, so they can report their
  # timeouts; its exit code is then 0 whatever the ranks return, hence the verdict regex.
  add_executable(test_comm_timeout ${CMAKE_CURRENT_LIST_DIR}/test_comm_timeout.c)
  target_link_libraries(test_comm_timeout PRIVATE moe_static moe_test_support MPI::MPI_C)
  moe_add_mpi_run(test_comm_timeout_stall TARGET test_comm_timeout NP 3 ARGS stall)
  moe_add_mpi_run(test_comm_timeout_kill TARGET test_comm_timeout NP 3
                  LAUNCHER_ARGS --enable-recovery ARGS kill)
  set_tests_properties(test_comm_timeout_kill PROPERTIES
    PASS_REGULAR_EXPRESSION "VERDICT: PASS" FAIL_REGULAR_EXPRESSION "VERDICT: FAIL;Segmentation")
  set_tests_properties(test_comm_ops_np3 test_comm_timeout_stall test_comm_timeout_kill
    PROPERTIES TIMEOUT 60 LABELS "comm;mpi")
endif()
if(TARGET test_comm_ops)
  target_link_libraries(test_comm_ops PRIVATE MPI::MPI_C)
endif()
# GPU buffers: MPI staged through pinned memory (3 ranks share the GPU) and NCCL (1 rank per
# GPU). Exits 77 without a GPU.
if(MOE_HAVE_MPI)
  add_executable(test_comm_device ${CMAKE_CURRENT_LIST_DIR}/test_comm_device.c)
  target_link_libraries(test_comm_device PRIVATE moe_static moe_test_support MPI::MPI_C)
  foreach(_np 1 3)
    moe_add_mpi_run(test_comm_device_np${_np} TARGET test_comm_device NP ${_np})
    set_tests_properties(test_comm_device_np${_np} PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77
      LABELS "comm;mpi;cuda")
  endforeach()
endif()
# The failure path over several ranks (fault.cmake).
include(${CMAKE_CURRENT_LIST_DIR}/fault.cmake)
