/*
 * SwiGLU's element math, shared by the stand-alone kernels (swiglu.cu) and the GEMM epilogues
 * that fuse it (expert_gemm_sm90.cu), so both round and approximate alike:
 *   act = silu(g) * u,  silu(g) = g sigma(g)
 *   d_g = d_act * u * sigma(g) (1 + g (1 - sigma(g))),  d_u = d_act * silu(g)
 * fp32 math on bf16 values, on the SFU: __expf (relative error ~2^-21) and the approximate
 * reciprocal / division (~1 ulp), instead of the IEEE division's longer sequence: in a GEMM
 * epilogue every instruction here is time the tensor cores wait.
 */
#ifndef MOE_KERNELS_SWIGLU_CUH
#define MOE_KERNELS_SWIGLU_CUH

static __device__ __forceinline__ float swiglu_value(float g, float u)
{
    return __fdividef(g, 1.0f + __expf(-g)) * u;
}

static __device__ __forceinline__ void swiglu_grad(float g, float u, float d_act, float *d_g,
                                                   float *d_u)
{
    float s = __fdividef(1.0f, 1.0f + __expf(-g));
    *d_g = d_act * u * s * (1.0f + g * (1.0f - s));
    *d_u = d_act * g * s;
}

#endif /* MOE_KERNELS_SWIGLU_CUH */
