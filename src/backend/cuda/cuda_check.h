/* CUDA and cuBLAS status checks for the CUDA backend (see core/error.h for the generator). */
#ifndef MOE_CUDA_CHECK_H
#define MOE_CUDA_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "../../core/error.h"

#define MOE_CUDA_CHECK(call)                                                               \
    MOE_CHECK_GEN(cudaError_t, call, rc_ == cudaSuccess, MOE_STATUS_BACKEND_ERROR,         \
                  cudaGetErrorString)
#define MOE_CUDA_CHECK_GOTO(st, call)                                                      \
    MOE_CHECK_GEN_GOTO(st, cudaError_t, call, rc_ == cudaSuccess, MOE_STATUS_BACKEND_ERROR, \
                       cudaGetErrorString)
#define MOE_CUBLAS_CHECK(call)                                                             \
    MOE_CHECK_GEN(cublasStatus_t, call, rc_ == CUBLAS_STATUS_SUCCESS,                      \
                  MOE_STATUS_BACKEND_ERROR, cublasGetStatusString)

#endif /* MOE_CUDA_CHECK_H */
