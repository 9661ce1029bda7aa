/*
 * The CUDA model's GEMMs (gemm_cuda.c), in row-major terms, on cuBLAS: bf16 inputs, fp32
 * accumulation (CUBLAS_COMPUTE_32F), bf16 or f32 output; and the check macros of the trainer's
 * CUDA files (a failed CUDA or cuBLAS call prints the call and file:line and returns
 * MOE_STATUS_BACKEND_ERROR: the trainer is a program on the public API, whose moe_last_error
 * belongs to the library).
 *
 *   C[M,N] = alpha op(A) op(B) + beta C, A stored [M,K] ([K,M] when ta), B stored [K,N]
 *   ([N,K] when tb). Batched: `batch` such products at fixed element strides.
 */
#ifndef TRAINER_GEMM_CUDA_H
#define TRAINER_GEMM_CUDA_H

#include <stdint.h>
#include <stdio.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <moe/core.h>

#define TRAINER_CUDA_CHECK(call)                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "moe_train: %s failed at %s:%d: %s\n", #call, __FILE__, __LINE__,      \
                    cudaGetErrorString(e_));                                                       \
            return MOE_STATUS_BACKEND_ERROR;                                                       \
        }                                                                                          \
    } while (0)

#define TRAINER_CUBLAS_CHECK(call)                                                                 \
    do {                                                                                           \
        cublasStatus_t e_ = (call);                                                                \
        if (e_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            fprintf(stderr, "moe_train: %s failed at %s:%d: %s\n", #call, __FILE__, __LINE__,      \
                    cublasGetStatusString(e_));                                                    \
            return MOE_STATUS_BACKEND_ERROR;                                                       \
        }                                                                                          \
    } while (0)

typedef struct gemm_operand {
    const void *data;
    cudaDataType_t type; /* CUDA_R_16BF or CUDA_R_32F */
    int trans;           /* stored transposed (see above) */
    int64_t stride;      /* elements between batch entries */
} gemm_operand_t;

/* C = alpha op(A) op(B) + beta C, `batch` times (1: a plain GEMM). */
moe_status_t gemm_rm(cublasHandle_t h, int64_t M, int64_t N, int64_t K, gemm_operand_t A,
                     gemm_operand_t B, float alpha, float beta, void *C, cudaDataType_t ctype,
                     int64_t c_stride, int64_t batch);

#endif /* TRAINER_GEMM_CUDA_H */
