list(APPEND MOE_SOURCES src/backend/host/host_backend.c src/backend/host/host_router.c
     src/backend/host/host_dispatch.c src/backend/host/host_experts.c)
if(MOE_HAVE_CUDA)
  list(APPEND MOE_SOURCES src/backend/cuda/cuda_backend.c src/backend/cuda/cuda_ops.c
       src/backend/cuda/cuda_experts.c)
  list(APPEND MOE_PRIVATE_LIBS CUDA::cudart CUDA::cublas CUDA::cublasLt)
else()
  list(APPEND MOE_SOURCES src/backend/cuda_absent.c)
endif()
