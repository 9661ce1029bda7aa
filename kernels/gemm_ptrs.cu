/*
 * Device pointer arrays for cublasGemmBatchedEx. The host fills a table of up to
 * MOE_CUDA_GEMM_PTRS_MAX (A, B, C) triples and passes it by value as the kernel's argument:
 * the launch copies it, so the host may reuse its table at once and nothing waits on the
 * device (a cudaMemcpyAsync from pageable memory may synchronise; a pinned staging buffer
 * would need its own reuse tracking).
 */
#include "kernels.h"

__global__ void gemm_ptrs(moe_cuda_gemm_ptrs_t t, void **dst)
{
    int i = threadIdx.x;
    if (i >= t.count) return;
    for (int j = 0; j < 3; j++) dst[j * t.count + i] = (void *)t.p[j][i];
}

extern "C" cudaError_t moe_cuda_gemm_ptrs(void **dst, const moe_cuda_gemm_ptrs_t *t,
                                          cudaStream_t stream)
{
    if (t->count <= 0) return cudaSuccess;
    gemm_ptrs<<<1, MOE_CUDA_GEMM_PTRS_MAX, 0, stream>>>(*t, dst);
    return cudaGetLastError();
}
