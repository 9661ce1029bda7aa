# GPU tests: the CUDA backend against the host twin. They exit 77 (CTest skip) on machines
# without a GPU, so CI builds them (when nvcc is present) and skips them.
if(MOE_HAVE_CUDA)
  add_library(moe_test_gpu STATIC ${CMAKE_CURRENT_LIST_DIR}/gpu_check.c)
  target_link_libraries(moe_test_gpu PUBLIC moe_test_support PkgConfig::MOE_CMOCKA CUDA::cudart m)
  target_include_directories(moe_test_gpu PUBLIC ${CMAKE_CURRENT_LIST_DIR})
  foreach(_t test_cuda_ops test_cuda_layer)
    moe_add_test(${_t} SOURCES ${CMAKE_CURRENT_LIST_DIR}/${_t}.c LABELS cuda gpu TIMEOUT 600)
    target_link_libraries(${_t} PRIVATE moe_test_gpu)
  endforeach()
endif()
