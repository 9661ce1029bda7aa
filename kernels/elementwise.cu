/*
 * Element-wise kernels: bf16 <-> f32 conversion, n elements, grid-stride loops (the
 * optimizer's passes are adamw.cu).
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_elementwise)
 * Time: none: the conversions run at set-up (a layer's parameters, the optimizer's
 *       masters), outside any step
 */
#include <cuda_bf16.h>

#include "grid.cuh"
#include "kernels.h"

__global__ void bf16_to_f32(float *dst, const __nv_bfloat16 *src, int64_t n)
{
    GRID_STRIDE(i, n) dst[i] = __bfloat162float(src[i]);
}

__global__ void f32_to_bf16(__nv_bfloat16 *dst, const float *src, int64_t n)
{
    GRID_STRIDE(i, n) dst[i] = __float2bfloat16_rn(src[i]);
}

extern "C" cudaError_t moe_cuda_bf16_to_f32(float *dst, const void *src, int64_t n, int sms,
                                            cudaStream_t stream)
{
    if (n <= 0) return cudaSuccess;
    bf16_to_f32<<<grid_for(n, sms), 256, 0, stream>>>(dst, (const __nv_bfloat16 *)src, n);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_f32_to_bf16(void *dst, const float *src, int64_t n, int sms,
                                            cudaStream_t stream)
{
    if (n <= 0) return cudaSuccess;
    f32_to_bf16<<<grid_for(n, sms), 256, 0, stream>>>((__nv_bfloat16 *)dst, src, n);
    return cudaGetLastError();
}
