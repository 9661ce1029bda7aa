/*
 * Host-computed device pointers into device memory, in stream order: the pointer arrays of
 * cuBLAS's grouped GEMM (src/backend/cuda/cuda_experts.c) travel as kernel parameters, so no
 * host buffer has to outlive the call (a cudaMemcpyAsync from pageable memory would be
 * staged synchronously; from a pinned buffer the buffer would be in use until the copy ran).
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_experts_grouped)
 * Time: MOE_CUDA_EXPERT_GEMM=grouped build/bench/bench_moe experts
 */
#include "kernels.h"

namespace
{

/* Pointers one launch carries: 4 KiB of parameters, the limit on every architecture. */
constexpr int CHUNK = 500;

struct chunk_t {
    const void *p[CHUNK];
};

__global__ void write_pointers(const void **dst, const chunk_t src, int32_t n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src.p[i];
}

} /* namespace */

extern "C" cudaError_t moe_cuda_upload_pointers(const void **dst, const void *const *src, int64_t n,
                                                cudaStream_t stream)
{
    for (int64_t at = 0; at < n; at += CHUNK) {
        int32_t m = (int32_t)(n - at < CHUNK ? n - at : CHUNK);
        chunk_t c;
        for (int32_t i = 0; i < m; i++) c.p[i] = src[at + i];
        write_pointers<<<(m + 127) / 128, 128, 0, stream>>>(dst + at, c, m);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}
