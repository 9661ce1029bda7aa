/*
 * Element-wise kernels: bf16 <-> f32 conversion, the fused AdamW update (fp32 master and
 * moments, bf16 model copy written from the updated master) and the sum of squares of the
 * gradient norm. n elements; grid-stride loops, memory-bound (AdamW moves 4+4+4+4 bytes in,
 * 4+4+4+2 out per element; the sum of squares reads 4).
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

__global__ void adamw(float *__restrict__ master, float *__restrict__ m, float *__restrict__ v,
                      __nv_bfloat16 *__restrict__ param, const float *__restrict__ grad, int64_t n,
                      float lr, float b1, float b2, float eps, float wd, float gscale,
                      float inv_bc1, float inv_sqrt_bc2)
{
    GRID_STRIDE(i, n)
    {
        float g = grad[i] * gscale;
        float mi = b1 * m[i] + (1.0f - b1) * g;
        float vi = b2 * v[i] + (1.0f - b2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float p = master[i];
        p -= lr * ((mi * inv_bc1) / (sqrtf(vi) * inv_sqrt_bc2 + eps) + wd * p);
        master[i] = p;
        param[i] = __float2bfloat16_rn(p);
    }
}

extern "C" cudaError_t moe_cuda_bf16_to_f32(float *dst, const void *src, int64_t n, cudaStream_t stream)
{
    if (n <= 0) return cudaSuccess;
    bf16_to_f32<<<grid_for(n), 256, 0, stream>>>(dst, (const __nv_bfloat16 *)src, n);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_f32_to_bf16(void *dst, const float *src, int64_t n, cudaStream_t stream)
{
    if (n <= 0) return cudaSuccess;
    f32_to_bf16<<<grid_for(n), 256, 0, stream>>>((__nv_bfloat16 *)dst, src, n);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_adamw(float *master, float *m, float *v, void *param,
                                      const float *grad, int64_t n, float lr, float beta1,
                                      float beta2, float eps, float weight_decay, float grad_scale,
                                      float inv_bc1, float inv_sqrt_bc2, cudaStream_t stream)
{
    if (n <= 0) return cudaSuccess;
    adamw<<<grid_for(n), 256, 0, stream>>>(master, m, v, (__nv_bfloat16 *)param, grad, n, lr,
                                           beta1, beta2, eps, weight_decay, grad_scale, inv_bc1,
                                           inv_sqrt_bc2);
    return cudaGetLastError();
}

/* The sum over a block of 256 threads' values, in a fixed tree; thread 0 gets it. */
static __device__ double block_tree_sum(double v)
{
    __shared__ double part[256];
    part[threadIdx.x] = v;
    __syncthreads();
    for (unsigned w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    return part[0];
}

__global__ void sum_squares_partial(const float *x, int64_t n, double *partial)
{
    double s = 0;
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < n; i += (int64_t)gridDim.x * 256)
        s += (double)x[i] * (double)x[i];
    s = block_tree_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_squares_final(const double *partial, double *out)
{
    double s = 0;
    for (int b = threadIdx.x; b < MOE_SUM_SQUARES_BLOCKS; b += 256) s += partial[b];
    s = block_tree_sum(s);
    if (threadIdx.x == 0) out[0] = s;
}

extern "C" cudaError_t moe_cuda_sum_squares(const float *x, int64_t n, double *partial,
                                            double *out, cudaStream_t stream)
{
    /* the grid is fixed (not grid_for(n)), so the order of the sum depends on n alone */
    sum_squares_partial<<<MOE_SUM_SQUARES_BLOCKS, 256, 0, stream>>>(x, n, partial);
    sum_squares_final<<<1, 256, 0, stream>>>(partial, out);
    return cudaGetLastError();
}
