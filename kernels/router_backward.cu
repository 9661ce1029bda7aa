/*
 * The router's backward kernels: d logits (moe_cuda_router_dlogits) from d(topk_w) through the
 * renormalisation and the score function, plus the aux-loss and z-loss terms, written in f32
 * and in bf16 for the tensor-core GEMMs of d wg and d x (the formulas:
 * src/backend/host/host_router.c); the expert-bias step (moe_cuda_expert_bias_step) and the
 * global-batch balancing's running counts (moe_cuda_accumulate_counts). A
 * token's logits sit in registers as in the forward (router_common.cuh's layout), so its
 * scores are recomputed, not saved.
 *
 * Shape legend: N tokens, E experts (E <= 512), K top-k (K <= 8).
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_router, test_router_nan, test_router_large_logits)
 * Time: build/bench/bench_moe router (router_bwd)
 */
#include "router_common.cuh"

/* ---- d logits ------------------------------------------------------------------------------- */

template <int EPL, int LANES>
__global__ void __launch_bounds__(MOE_TUNE_ROUTER_WARPS * 32)
    router_dlogits(const float *__restrict__ logits, const int32_t *__restrict__ topk_idx,
                   const float *__restrict__ topk_w, const float *__restrict__ d_topk_w,
                   const int32_t *__restrict__ counts, int64_t n, int e, int k, int score_fn,
                   bool renorm, bool vec, float aux_coef, float z_coef, float *__restrict__ dlogits,
                   __nv_bfloat16 *__restrict__ dl16)
{
    constexpr int GROUPS = 32 / LANES;
    int lane = threadIdx.x % 32, sub = lane % LANES, grp = lane / LANES;
    float inv_n = 1.0f / (float)n;
    /* aux: d(aux_coef * aux)/d q[t,e] = aux_coef * E * f_e / N, the same for every token */
    using row_t = token_rows<EPL, LANES>;
    float caux[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        int j = row_t::expert(sub, i);
        caux[i] = aux_coef != 0 && j < e
                      ? (float)((double)aux_coef * e * counts[j] / ((double)n * k) / (double)n)
                      : 0.0f;
    }
    int64_t stride = (int64_t)gridDim.x * MOE_TUNE_ROUTER_WARPS * GROUPS;
    /* the loop is warp-uniform (shuffles need every lane); a group past N redoes the warp's
     * first token and writes nothing */
    for (int64_t tw = ((int64_t)blockIdx.x * MOE_TUNE_ROUTER_WARPS + threadIdx.x / 32) * GROUPS;
         tw < n; tw += stride) {
        bool valid = tw + grp < n;
        int64_t t = valid ? tw + grp : tw;
        const float *row = logits + t * e;
        row_t r;
        r.load({row}, e, sub, score_fn, {true}, vec);
        float gs[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++) gs[i] = 0;
        /* renormalisation -> the chosen raw scores */
        float wsum = 0, gw_dot_w = 0;
        for (int j = 0; j < k; j++) {
            float lj = row[topk_idx[t * k + j]];
            wsum += score_fn == 0 ? exp_ftz(lj - r.lse[0]) : sigmoidf_(lj);
            gw_dot_w += d_topk_w[t * k + j] * topk_w[t * k + j];
        }
        for (int j = 0; j < k; j++) {
            int idx = topk_idx[t * k + j];
            float g = renorm ? (d_topk_w[t * k + j] - gw_dot_w) / wsum : d_topk_w[t * k + j];
#pragma unroll
            for (int i = 0; i < EPL; i++)
                if (row_t::expert(sub, i) == idx) gs[i] += g;
        }
        if (aux_coef != 0) {
            float gq_dot_q = 0;
            if (score_fn != 0) {
#pragma unroll
                for (int i = 0; i < EPL; i++) gq_dot_q += caux[i] * r.q(0, i);
                gq_dot_q = group_sum<LANES>(gq_dot_q);
            }
#pragma unroll
            for (int i = 0; i < EPL; i++)
                gs[i] += score_fn == 0 ? caux[i] : (caux[i] - gq_dot_q) / r.qnorm[0];
        }
        float gs_dot_s = 0;
        if (score_fn == 0) {
#pragma unroll
            for (int i = 0; i < EPL; i++) gs_dot_s += gs[i] * r.s[0][i];
            gs_dot_s = group_sum<LANES>(gs_dot_s);
        }
        if (!valid) continue;
        float zc = z_coef * 2.0f * r.lse[0] * inv_n;
        float g[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            g[i] = score_fn == 0 ? r.s[0][i] * (gs[i] - gs_dot_s)
                                 : gs[i] * r.s[0][i] * (1.0f - r.s[0][i]);
            if (z_coef != 0) g[i] += zc * exp_ftz(r.l[0][i] - r.lse[0]);
        }
        /* a lane's experts are contiguous: vector stores where the row allows them */
#pragma unroll
        for (int i = 0; i < EPL; i += 4) {
            int64_t j = t * e + row_t::expert(sub, i);
            if (vec) {
                if (row_t::expert(sub, i) >= e) continue;
                *reinterpret_cast<float4 *>(dlogits + j) = make_float4(g[i], g[i + 1], g[i + 2],
                                                                       g[i + 3]);
                __nv_bfloat162 lo = __floats2bfloat162_rn(g[i], g[i + 1]);
                __nv_bfloat162 hi = __floats2bfloat162_rn(g[i + 2], g[i + 3]);
                uint2 v = {*reinterpret_cast<unsigned *>(&lo), *reinterpret_cast<unsigned *>(&hi)};
                *reinterpret_cast<uint2 *>(dl16 + j) = v;
            } else {
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if (row_t::expert(sub, i + q) >= e) break;
                    dlogits[j + q] = g[i + q];
                    dl16[j + q] = __float2bfloat16_rn(g[i + q]);
                }
            }
        }
    }
}

template <int EPL, int LANES>
static void launch_dlogits(const float *logits, const int32_t *idx, const float *w, const float *dw,
                           const int32_t *counts, int64_t n, int32_t e, int32_t k, int score_fn,
                           bool renorm, float aux, float z, float *dl, void *dl16,
                           cudaStream_t stream)
{
    int64_t per_block = (int64_t)MOE_TUNE_ROUTER_WARPS * (32 / LANES);
    int64_t blocks = (n + per_block - 1) / per_block;
    if (blocks > MOE_TUNE_WAVE_SMS * MOE_TUNE_DLOGITS_BLOCKS_PER_SM)
        blocks = MOE_TUNE_WAVE_SMS * MOE_TUNE_DLOGITS_BLOCKS_PER_SM;
    bool vec = e % 4 == 0 && (uintptr_t)logits % 16 == 0 && (uintptr_t)dl % 16 == 0 &&
               (uintptr_t)dl16 % 8 == 0;
    router_dlogits<EPL, LANES><<<(unsigned)blocks, MOE_TUNE_ROUTER_WARPS * 32, 0, stream>>>(
        logits, idx, w, dw, counts, n, e, k, score_fn, renorm, vec, aux, z, dl,
        (__nv_bfloat16 *)dl16);
}

extern "C" cudaError_t moe_cuda_router_dlogits(const float *logits, const int32_t *topk_idx,
                                               const float *topk_w, const float *d_topk_w,
                                               const int32_t *counts, int64_t n, int32_t e,
                                               int32_t k, int score_fn, bool renormalize,
                                               float aux_coef, float z_coef, float *dlogits,
                                               void *dlogits_bf16, cudaStream_t stream)
{
    if (e > MOE_ROUTER_MAX_E || k > MOE_ROUTER_MAX_K || n <= 0) return cudaErrorInvalidValue;
    with_layout(e, [&](auto epl, auto lanes) {
        launch_dlogits<decltype(epl)::value, decltype(lanes)::value>(
            logits, topk_idx, topk_w, d_topk_w, counts, n, e, k, score_fn, renormalize, aux_coef,
            z_coef, dlogits, dlogits_bf16, stream);
        return cudaSuccess;
    });
    return cudaGetLastError();
}

/* ---- expert-bias step ----------------------------------------------------------------------- */

/* The expert-bias sign rule on the device copy, so that the forward never reads it back.
 * counts[j] against mean = slots / E compared exactly, as counts[j] * E against slots. */
__global__ void expert_bias_step(float *bias, const int32_t *counts, int32_t e, int64_t slots,
                                 float rate)
{
    int32_t j = (int32_t)(blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= e) return;
    int64_t scaled = (int64_t)counts[j] * e;
    bias[j] += rate * (float)((scaled < slots) - (scaled > slots));
}

extern "C" cudaError_t moe_cuda_expert_bias_step(float *bias, const int32_t *counts, int32_t e,
                                                 int64_t slots, float rate, cudaStream_t stream)
{
    if (e <= 0) return cudaSuccess;
    expert_bias_step<<<(unsigned)((e + 255) / 256), 256, 0, stream>>>(bias, counts, e, slots, rate);
    return cudaGetLastError();
}

/* Global-batch balancing: the window's counts stay on the device, so the backward's aux
 * gradient reads them without a copy to the host. */
__global__ void accumulate_counts(int32_t *acc, const int32_t *counts, int32_t *out, int32_t e)
{
    int32_t j = (int32_t)(blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= e) return;
    out[j] = acc[j] += counts[j];
}

extern "C" cudaError_t moe_cuda_accumulate_counts(int32_t *acc, const int32_t *counts, int32_t *out,
                                                  int32_t e, cudaStream_t stream)
{
    if (e <= 0) return cudaSuccess;
    accumulate_counts<<<(unsigned)((e + 255) / 256), 256, 0, stream>>>(acc, counts, out, e);
    return cudaGetLastError();
}
