/*
 * Vector access to bf16 rows for the memory-bound kernels: VEC values per access, 8 (one
 * 16-byte load or store) when the row length is a multiple of 8, else 1; math in fp32.
 */
#ifndef MOE_KERNELS_BF16_VEC_CUH
#define MOE_KERNELS_BF16_VEC_CUH

#include <cuda_bf16.h>

template <int VEC> static __device__ __forceinline__ void load_vec(const __nv_bfloat16 *p, float *v)
{
    if constexpr (VEC == 8) {
        uint4 u = *(const uint4 *)p;
        const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __bfloat1622float2(h2[i]);
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
        }
    } else {
        v[0] = __bfloat162float(*p);
    }
}

template <int VEC>
static __device__ __forceinline__ void store_vec(__nv_bfloat16 *p, const float *v)
{
    if constexpr (VEC == 8) {
        uint4 u;
        __nv_bfloat162 *h2 = (__nv_bfloat162 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) h2[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        *(uint4 *)p = u;
    } else {
        *p = __float2bfloat16_rn(v[0]);
    }
}

#endif /* MOE_KERNELS_BF16_VEC_CUH */
