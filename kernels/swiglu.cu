/*
 * SwiGLU activation between the two expert GEMMs, forward and backward (the math is in
 * swiglu.cuh). Shape legend: R rows, F expert FFN width; hpre [R,2,F] holds gate (index 0)
 * and up (1). bf16 in and out, fp32 math; 16-byte accesses when F % 8 == 0. Memory-bound:
 * forward moves 6 bytes per output element, backward 10. With MOE_CUDA_SWIGLU_GEMM=1 on
 * Hopper the expert GEMMs carry this math in their epilogue instead (expert_gemm_sm90.cu).
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_experts)
 * Time: build/bench/bench_moe experts
 */
#include <cuda_bf16.h>

#include "bf16_vec.cuh"
#include "grid.cuh"
#include "kernels.h"
#include "swiglu.cuh"

template <int VEC>
__global__ void swiglu_fwd(__nv_bfloat16 *__restrict__ act, const __nv_bfloat16 *__restrict__ hpre,
                           int64_t rows, int64_t f)
{
    int64_t per_row = f / VEC, total = rows * per_row;
    GRID_STRIDE(v, total)
    {
        int64_t r = v / per_row, c = (v % per_row) * VEC;
        float g[VEC], u[VEC], a[VEC];
        load_vec<VEC>(hpre + r * 2 * f + c, g);
        load_vec<VEC>(hpre + r * 2 * f + f + c, u);
#pragma unroll
        for (int i = 0; i < VEC; i++) a[i] = swiglu_value(g[i], u[i]);
        store_vec<VEC>(act + r * f + c, a);
    }
}

template <int VEC>
__global__ void swiglu_bwd(__nv_bfloat16 *__restrict__ d_hpre,
                           const __nv_bfloat16 *__restrict__ d_act,
                           const __nv_bfloat16 *__restrict__ hpre, int64_t rows, int64_t f)
{
    int64_t per_row = f / VEC, total = rows * per_row;
    GRID_STRIDE(v, total)
    {
        int64_t r = v / per_row, c = (v % per_row) * VEC;
        float g[VEC], u[VEC], da[VEC], dg[VEC], du[VEC];
        load_vec<VEC>(hpre + r * 2 * f + c, g);
        load_vec<VEC>(hpre + r * 2 * f + f + c, u);
        load_vec<VEC>(d_act + r * f + c, da);
#pragma unroll
        for (int i = 0; i < VEC; i++) swiglu_grad(g[i], u[i], da[i], &dg[i], &du[i]);
        store_vec<VEC>(d_hpre + r * 2 * f + c, dg);
        store_vec<VEC>(d_hpre + r * 2 * f + f + c, du);
    }
}

extern "C" cudaError_t moe_cuda_swiglu_forward(void *act, const void *hpre, int64_t rows, int64_t f,
                                               int sms, cudaStream_t stream)
{
    if (rows <= 0) return cudaSuccess;
    if (f % 8 == 0)
        swiglu_fwd<8><<<grid_for(rows * f / 8, sms), 256, 0, stream>>>(
            (__nv_bfloat16 *)act, (const __nv_bfloat16 *)hpre, rows, f);
    else
        swiglu_fwd<1><<<grid_for(rows * f, sms), 256, 0, stream>>>(
            (__nv_bfloat16 *)act, (const __nv_bfloat16 *)hpre, rows, f);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_swiglu_backward(void *d_hpre, const void *d_act, const void *hpre,
                                                int64_t rows, int64_t f, int sms,
                                                cudaStream_t stream)
{
    if (rows <= 0) return cudaSuccess;
    if (f % 8 == 0)
        swiglu_bwd<8><<<grid_for(rows * f / 8, sms), 256, 0, stream>>>(
            (__nv_bfloat16 *)d_hpre, (const __nv_bfloat16 *)d_act, (const __nv_bfloat16 *)hpre,
            rows, f);
    else
        swiglu_bwd<1><<<grid_for(rows * f, sms), 256, 0, stream>>>(
            (__nv_bfloat16 *)d_hpre, (const __nv_bfloat16 *)d_act, (const __nv_bfloat16 *)hpre,
            rows, f);
    return cudaGetLastError();
}
