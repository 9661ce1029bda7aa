/* The CUDA model's GEMMs (gemm_cuda.h): row-major products as cuBLAS's column-major ones.
 * A row-major [R,C] matrix is a column-major [C,R] one with leading dimension C, so
 * C = op(A) op(B) is computed as C^T = op(B)^T op(A)^T with the operands swapped. */
#include "gemm_cuda.h"

moe_status_t gemm_rm(cublasHandle_t h, int64_t M, int64_t N, int64_t K, gemm_operand_t A,
                     gemm_operand_t B, float alpha, float beta, void *C, cudaDataType_t ctype,
                     int64_t c_stride, int64_t batch)
{
    cublasOperation_t opa = A.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t opb = B.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    int64_t lda = A.trans ? M : K, ldb = B.trans ? K : N;
    if (batch == 1)
        TRAINER_CUBLAS_CHECK(cublasGemmEx(h, opb, opa, (int)N, (int)M, (int)K, &alpha, B.data,
                                          B.type, (int)ldb, A.data, A.type, (int)lda, &beta, C,
                                          ctype, (int)N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else
        TRAINER_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
            h, opb, opa, (int)N, (int)M, (int)K, &alpha, B.data, B.type, (int)ldb, B.stride, A.data,
            A.type, (int)lda, A.stride, &beta, C, ctype, (int)N, c_stride, (int)batch,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return MOE_STATUS_SUCCESS;
}
