# The failure path (docs/mesh.md, "When a peer fails"): a lost, stalled or failing peer and
# ranks that disagree on a config. The tests run on several ranks under mpirun (host backend)
# and carry the labels fault and mpi.
if(NOT MOE_HAVE_MPI)
  return()
endif()
find_package(Python3 COMPONENTS Interpreter)

add_library(moe_fault_support STATIC ${CMAKE_CURRENT_LIST_DIR}/fault_support.c)
target_link_libraries(moe_fault_support PUBLIC moe_static MPI::MPI_C)
target_include_directories(moe_fault_support PUBLIC ${CMAKE_CURRENT_LIST_DIR})

# moe_add_fault_test(NAME NP ranks [RECOVERY]): tests/comm/NAME.c under mpirun, judged by the
# verdict line rank 0 prints (fault_support.h); RECOVERY runs it under --enable-recovery, for
# tests whose ranks stall or leave without MPI_Finalize.
function(moe_add_fault_test name)
  cmake_parse_arguments(F "RECOVERY" "NP" "" ${ARGN})
  add_executable(${name} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/${name}.c)
  target_link_libraries(${name} PRIVATE moe_fault_support)
  if(F_RECOVERY)
    moe_add_mpi_run(${name} TARGET ${name} NP ${F_NP} LAUNCHER_ARGS --enable-recovery)
  else()
    moe_add_mpi_run(${name} TARGET ${name} NP ${F_NP})
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT 120 LABELS "fault;mpi"
    PASS_REGULAR_EXPRESSION "VERDICT: PASS" FAIL_REGULAR_EXPRESSION "VERDICT: FAIL;Segmentation")
endfunction()


# Chaos: kill -9 / SIGSTOP one rank of a training loop (ep, dp, pp meshes of 4) at random
# moments, 20 trials each; every survivor must exit by itself with MOE_EXIT_PEER_LOST within
# the 2 s timeout plus a few seconds, naming the lost rank (chaos.py).
add_executable(fault_rank ${CMAKE_CURRENT_LIST_DIR}/fault_rank.c)
target_link_libraries(fault_rank PRIVATE moe_static)
if(Python3_Interpreter_FOUND)
  foreach(_sig kill stop)
    add_test(NAME test_fault_chaos_${_sig}
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/chaos.py
                     --mpirun ${MPIEXEC_EXECUTABLE} --rank $<TARGET_FILE:fault_rank>
                     --signal ${_sig} --trials 20 --seed 1 --timeout-ms 2000)
    set_tests_properties(test_fault_chaos_${_sig} PROPERTIES TIMEOUT 400 LABELS "fault;mpi"
      ENVIRONMENT "OMPI_MCA_orte_tmpdir_base=${CMAKE_BINARY_DIR}/mpi-session/test_fault_chaos_${_sig}")
  endforeach()
endif()
# Ranks that disagree on the mesh, the runtime or a layer are all told, naming the field.
moe_add_fault_test(test_fault_config NP 4)
# An MPI error in a non-blocking collective is a status on every rank, not a job abort.
moe_add_fault_test(test_fault_errors NP 4 RECOVERY)
# A stalled rank costs one timeout, whose own message names the rank, the axis and the call.
moe_add_fault_test(test_fault_stall NP 4 RECOVERY)
# A pipeline rank that waits for a peer which finished normally names it as having left, never
# as dead or stalled (the test model of tests/pipeline/).
moe_add_fault_test(test_fault_left_peer NP 2 RECOVERY)
target_link_libraries(test_fault_left_peer PRIVATE moe_test_pipe)
set_tests_properties(test_fault_left_peer PROPERTIES LABELS "fault;mpi;pipeline")
