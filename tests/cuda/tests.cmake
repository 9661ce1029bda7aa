# GPU tests: the CUDA backend against the host twin. They exit 77 (CTest skip) on machines
# without a GPU, so CI builds them (when nvcc is present) and skips them.
if(MOE_HAVE_CUDA)
  add_library(moe_test_gpu STATIC ${CMAKE_CURRENT_LIST_DIR}/gpu_check.c)
  target_link_libraries(moe_test_gpu PUBLIC moe_test_support PkgConfig::MOE_CMOCKA CUDA::cudart m)
  target_include_directories(moe_test_gpu PUBLIC ${CMAKE_CURRENT_LIST_DIR})
  moe_add_test(test_cuda_ops SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.c LABELS cuda gpu
               TIMEOUT 600)
  target_link_libraries(test_cuda_ops PRIVATE moe_test_gpu)
endif()
if(MOE_HAVE_CUDA)
  moe_add_test(test_cuda_layer SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_layer.c LABELS cuda gpu
               TIMEOUT 600)
  target_link_libraries(test_cuda_layer PRIVATE moe_test_gpu)
endif()
