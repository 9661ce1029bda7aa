add_library(moe_test_ref STATIC ${CMAKE_CURRENT_LIST_DIR}/ref_moe.c ${CMAKE_CURRENT_LIST_DIR}/layer_fixture.c)
target_link_libraries(moe_test_ref PUBLIC moe_test_support m)
target_include_directories(moe_test_ref PUBLIC ${CMAKE_CURRENT_LIST_DIR})
moe_add_test(test_layer_grad SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_layer_grad.c LABELS moe)
target_link_libraries(test_layer_grad PRIVATE moe_test_ref)
moe_add_test(test_layer_props SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_layer_props.c LABELS moe)
target_link_libraries(test_layer_props PRIVATE moe_test_ref)
# The distributed layer on 2, 4 and 8 ranks (dist_layer.cmake).
include(${CMAKE_CURRENT_LIST_DIR}/dist_layer.cmake)
# Global-batch balancing against its fp64 reference on 1 and 2 ranks (test_aux_global.c).
foreach(_np 1 2)
  moe_add_test(test_aux_global_np${_np} SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_aux_global.c
               NP ${_np} TIMEOUT 60 LABELS moe mpi)
  if(TARGET test_aux_global_np${_np})
    target_link_libraries(test_aux_global_np${_np} PRIVATE MPI::MPI_C)
  endif()
endforeach()
