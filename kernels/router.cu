/*
 * Router kernels after the logits GEMM (cuBLAS, bf16 in, fp32 out). A group of LANES lanes
 * keeps one token's E logits in registers (lane l of the group holds experts l, l+LANES, ...,
 * EPL of them), so the softmax/sigmoid, top-k and renormalisation never touch memory again.
 * The forward sizes the group to E (8 experts a lane: E=64 puts 4 tokens in a warp), because
 * the kernels are bound by instruction issue and the group-wide reductions dominate them.
 *
 * Shape legend: N tokens, E experts (E <= 32*EPL <= 512), K top-k (K <= 8).
 *
 * Determinism: per-expert sums (P_e, counts) and the z/entropy sums are reduced in a fixed
 * order: registers per warp -> fixed warp order per block -> fixed block order in
 * router_finalize. No float atomics. Integer counts use shared-memory atomics (exact).
 * Top-k ties (equal keys) go to the lower expert index, as on the host.
 */
#include <cuda_bf16.h>
#include <math.h>

#include "kernels.h"

#define WARPS 8               /* warps per block in the per-token kernels */

/* Reductions over a group of LANES consecutive lanes (xor offsets below LANES stay inside
 * the aligned group); the fixed butterfly order keeps them deterministic. */
template <int LANES>
static __device__ __forceinline__ float group_sum(float v)
{
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int LANES>
static __device__ __forceinline__ float group_max(float v)
{
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

static __device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }

/* A token's row held by a group of LANES lanes: lane `sub` of the group holds experts
 * sub, sub + LANES, ... (EPL of them). Logits, log-sum-exp, scores s, normalised scores q.
 * A group past the last token (valid = false) computes on zeros and writes nothing. */
template <int EPL, int LANES>
struct token_row {
    float l[EPL], s[EPL], q[EPL];
    float lse, qnorm;

    __device__ void load(const float *row, int e, int sub, int score_fn, bool valid)
    {
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            int j = sub + LANES * i;
            l[i] = j >= e ? -INFINITY : valid ? row[j] : 0.0f;
        }
        scores(e, sub, score_fn);
    }

    __device__ void scores(int e, int sub, int score_fn)
    {
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < EPL; i++) mx = fmaxf(mx, l[i]);
        mx = group_max<LANES>(mx);
        float ex[EPL], sum = 0;
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            ex[i] = expf(l[i] - mx); /* exp(-inf) = 0 for padding */
            sum += ex[i];
        }
        sum = group_sum<LANES>(sum);
        lse = mx + logf(sum);
        float inv_sum = 1.0f / sum, tot = 0;
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            bool real = sub + LANES * i < e;
            s[i] = !real ? 0.0f : score_fn == 0 ? ex[i] * inv_sum : sigmoidf_(l[i]);
            tot += s[i];
        }
        qnorm = score_fn == 0 ? 1.0f : group_sum<LANES>(tot);
        float inv = 1.0f / qnorm;
#pragma unroll
        for (int i = 0; i < EPL; i++) q[i] = score_fn == 0 ? s[i] : s[i] * inv;
    }
};

/* (key, expert) packed so that one unsigned 64-bit max picks the larger key and, on equal
 * keys, the lower expert index: order-preserving float bits above, 0xffff - index below.
 * Every real expert packs above 0, the value a taken or padding slot gets. */
static __device__ __forceinline__ unsigned long long pack_key(float key, int idx)
{
    unsigned b = __float_as_uint(key);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)b << 32) | (unsigned)(0xffff - idx);
}

/* ---- forward: selection and statistics ------------------------------------------------------ */

/* Each warp runs 32/LANES tokens at once (one per lane group), `iters` times. */
template <int EPL, int LANES>
__global__ void __launch_bounds__(WARPS * 32)
router_select(const float *__restrict__ logits, const float *__restrict__ bias, int64_t n, int e,
              int k, int score_fn, bool renorm, int32_t *__restrict__ topk_idx,
              float *__restrict__ topk_w, float *__restrict__ part_mean,
              float *__restrict__ part_stats, int32_t *__restrict__ part_counts, int iters)
{
    constexpr int GROUPS = 32 / LANES;
    extern __shared__ float smem[]; /* [WARPS][E] means, then [E] int counts, [WARPS][2] */
    float *s_mean = smem;
    int32_t *s_count = (int32_t *)(s_mean + WARPS * e);
    float *s_stats = (float *)(s_count + e);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane % LANES, grp = lane / LANES;
    for (int j = threadIdx.x; j < e; j += blockDim.x) s_count[j] = 0;
    __syncthreads();

    float kb[EPL], pm[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        int j = sub + LANES * i;
        kb[i] = bias && j < e ? bias[j] : 0.0f;
        pm[i] = 0.0f;
    }
    float z_acc = 0, ent_acc = 0;
    int64_t first = ((int64_t)blockIdx.x * WARPS + warp) * iters * GROUPS;
    for (int it = 0; it < iters; it++) {
        int64_t t0 = first + (int64_t)it * GROUPS, t = t0 + grp;
        if (t0 >= n) break; /* warp-uniform */
        bool valid = t < n;
        token_row<EPL, LANES> r;
        r.load(logits + (valid ? t : 0) * e, e, sub, score_fn, valid);
        /* entropy -sum q log q; softmax: log q = logit - lse exactly, no log needed */
        float ent = 0;
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            float lq = score_fn == 0 ? r.l[i] - r.lse : logf(r.q[i]);
            ent -= r.q[i] > 0 ? r.q[i] * lq : 0.0f;
        }
        ent = group_sum<LANES>(ent);
        if (valid) {
            z_acc += r.lse * r.lse;
            ent_acc += ent;
#pragma unroll
            for (int i = 0; i < EPL; i++) pm[i] += r.q[i];
        }
        /* top-k: each round the group's largest packed key wins and leaves the race */
        unsigned long long pk[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            int j = sub + LANES * i;
            pk[i] = j < e ? pack_key(r.s[i] + kb[i], j) : 0ull;
        }
        float ws[MOE_ROUTER_MAX_K], wsum = 0;
        int wi[MOE_ROUTER_MAX_K];
#pragma unroll
        for (int j = 0; j < MOE_ROUTER_MAX_K; j++) {
            if (j >= k) break;
            unsigned long long best = 0;
#pragma unroll
            for (int i = 0; i < EPL; i++) best = pk[i] > best ? pk[i] : best;
#pragma unroll
            for (int o = LANES / 2; o > 0; o >>= 1) {
                unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
                best = other > best ? other : best;
            }
            int idx = 0xffff - (int)(best & 0xffffu);
            float mine = 0;
#pragma unroll
            for (int i = 0; i < EPL; i++)
                if (pk[i] == best) {
                    mine = r.s[i];
                    pk[i] = 0;
                }
            float bs = __shfl_sync(0xffffffffu, mine, grp * LANES + idx % LANES);
            ws[j] = bs;
            wi[j] = idx;
            wsum += bs;
        }
        if (valid && sub == 0) {
            float inv = renorm ? 1.0f / wsum : 1.0f;
#pragma unroll
            for (int j = 0; j < MOE_ROUTER_MAX_K; j++) {
                if (j >= k) break;
                topk_idx[t * k + j] = wi[j];
                topk_w[t * k + j] = ws[j] * inv;
                atomicAdd(&s_count[wi[j]], 1);
            }
        }
    }
    /* fold the lane groups together (fixed butterfly), then the warps (fixed order) */
#pragma unroll
    for (int o = LANES; o < 32; o <<= 1) {
#pragma unroll
        for (int i = 0; i < EPL; i++) pm[i] += __shfl_xor_sync(0xffffffffu, pm[i], o);
        z_acc += __shfl_xor_sync(0xffffffffu, z_acc, o);
        ent_acc += __shfl_xor_sync(0xffffffffu, ent_acc, o);
    }
    if (grp == 0)
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            int j = sub + LANES * i;
            if (j < e) s_mean[warp * e + j] = pm[i];
        }
    if (lane == 0) {
        s_stats[warp * 2] = z_acc;
        s_stats[warp * 2 + 1] = ent_acc;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < e; j += blockDim.x) {
        float acc = 0;
        for (int w = 0; w < WARPS; w++) acc += s_mean[w * e + j];
        part_mean[(int64_t)blockIdx.x * e + j] = acc;
        part_counts[(int64_t)blockIdx.x * e + j] = s_count[j];
    }
    if (threadIdx.x < 2) {
        float acc = 0;
        for (int w = 0; w < WARPS; w++) acc += s_stats[w * 2 + threadIdx.x];
        part_stats[blockIdx.x * 2 + threadIdx.x] = acc;
    }
}

/* Block j < E reduces expert j's partials over the blocks of router_select; block E reduces
 * the z/entropy partials. Fixed strided order + fixed tree: deterministic. fp64 accumulation
 * because the sums run over all N tokens. */
__global__ void router_finalize(const float *__restrict__ part_mean,
                                const float *__restrict__ part_stats,
                                const int32_t *__restrict__ part_counts, int nblocks, int e,
                                double inv_n, int32_t *__restrict__ counts,
                                float *__restrict__ score_mean, float *__restrict__ stats)
{
    __shared__ double s_a[256], s_b[256];
    __shared__ long long s_c[256];
    int j = blockIdx.x;
    double a = 0, b = 0;
    long long c = 0;
    for (int i = threadIdx.x; i < nblocks; i += blockDim.x) {
        if (j < e) {
            a += part_mean[(int64_t)i * e + j];
            c += part_counts[(int64_t)i * e + j];
        } else {
            a += part_stats[i * 2];
            b += part_stats[i * 2 + 1];
        }
    }
    s_a[threadIdx.x] = a;
    s_b[threadIdx.x] = b;
    s_c[threadIdx.x] = c;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            s_a[threadIdx.x] += s_a[threadIdx.x + o];
            s_b[threadIdx.x] += s_b[threadIdx.x + o];
            s_c[threadIdx.x] += s_c[threadIdx.x + o];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (j < e) {
            score_mean[j] = (float)(s_a[0] * inv_n);
            counts[j] = (int32_t)s_c[0];
        } else {
            stats[0] = (float)(s_a[0] * inv_n);
            stats[1] = (float)(s_b[0] * inv_n);
        }
    }
}

/* Lanes per token (forward and backward): enough that each lane holds at most 8 experts (16
 * above E = 256), so the per-token reductions span few lanes and small E packs several
 * tokens into a warp. */
static int select_lanes(int32_t e)
{
    int lanes = 1;
    while (lanes < 32 && lanes * 8 < e) lanes *= 2;
    return lanes;
}

/* Tokens per warp pass: a function of N and E alone (so the reduction order, and the result,
 * never depend on the device). One pass while the GPU is still short of warps; up to 8 for
 * large N, which keeps the per-block partial sums few. */
static int select_iters(int64_t n, int32_t e)
{
    int64_t per_pass = 32 / select_lanes(e);
    int64_t t = n / (132 * 64 * per_pass);
    return (int)(t < 1 ? 1 : t > 8 ? 8 : t);
}

static int64_t select_blocks(int64_t n, int32_t e)
{
    int64_t per_block = (int64_t)WARPS * select_iters(n, e) * (32 / select_lanes(e));
    return (n + per_block - 1) / per_block;
}

extern "C" int64_t moe_cuda_router_select_scratch(int64_t n, int32_t e)
{
    return select_blocks(n, e) * (2 * (int64_t)e + 2);
}

template <int EPL, int LANES>
static void launch_select(const float *logits, const float *bias, int64_t n, int32_t e, int32_t k,
                          int score_fn, bool renorm, int32_t *topk_idx, float *topk_w,
                          float *pm, float *ps, int32_t *pc, cudaStream_t stream)
{
    size_t smem = sizeof(float) * (WARPS * (size_t)e + 2 * WARPS) + sizeof(int32_t) * (size_t)e;
    router_select<EPL, LANES><<<(unsigned)select_blocks(n, e), WARPS * 32, smem, stream>>>(
        logits, bias, n, e, k, score_fn, renorm, topk_idx, topk_w, pm, ps, pc, select_iters(n, e));
}

extern "C" cudaError_t moe_cuda_router_select(const float *logits, const float *bias, int64_t n,
                                              int32_t e, int32_t k, int score_fn,
                                              bool renormalize, int32_t *topk_idx, float *topk_w,
                                              int32_t *counts, float *score_mean, float *stats,
                                              float *scratch, cudaStream_t stream)
{
    if (e > MOE_ROUTER_MAX_E || k > MOE_ROUTER_MAX_K || n <= 0) return cudaErrorInvalidValue;
    int64_t nb = select_blocks(n, e);
    float *pm = scratch, *ps = pm + nb * e;
    int32_t *pc = (int32_t *)(ps + nb * 2);
#define MOE_SEL(EPL, LANES)                                                                  \
    launch_select<EPL, LANES>(logits, bias, n, e, k, score_fn, renormalize, topk_idx, topk_w, \
                              pm, ps, pc, stream)
    switch (e > 256 ? 64 : select_lanes(e)) {
    case 1: MOE_SEL(8, 1); break;
    case 2: MOE_SEL(8, 2); break;
    case 4: MOE_SEL(8, 4); break;
    case 8: MOE_SEL(8, 8); break;
    case 16: MOE_SEL(8, 16); break;
    case 32: MOE_SEL(8, 32); break;
    default: MOE_SEL(16, 32); break;
    }
#undef MOE_SEL
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
    router_finalize<<<e + 1, 256, 0, stream>>>(pm, ps, pc, (int)nb, e, 1.0 / (double)n, counts,
                                                score_mean, stats);
    return cudaGetLastError();
}

/* ---- backward: d logits ------------------------------------------------------------------- */

template <int EPL, int LANES>
__global__ void __launch_bounds__(WARPS * 32)
router_dlogits(const float *__restrict__ logits, const int32_t *__restrict__ topk_idx,
               const float *__restrict__ topk_w, const float *__restrict__ d_topk_w,
               const int32_t *__restrict__ counts, int64_t n, int e, int k, int score_fn,
               bool renorm, float aux_coef, float z_coef, float *__restrict__ dlogits,
               __nv_bfloat16 *__restrict__ dl16)
{
    constexpr int GROUPS = 32 / LANES;
    int lane = threadIdx.x % 32, sub = lane % LANES, grp = lane / LANES;
    float inv_n = 1.0f / (float)n;
    /* aux: d(aux_coef * aux)/d q[t,e] = aux_coef * E * f_e / N, the same for every token */
    float caux[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        int j = sub + LANES * i;
        caux[i] = aux_coef != 0 && j < e
                      ? (float)((double)aux_coef * e * counts[j] / ((double)n * k) / (double)n)
                      : 0.0f;
    }
    int64_t stride = (int64_t)gridDim.x * WARPS * GROUPS;
    /* the loop is warp-uniform (shuffles need every lane); a group past N redoes the warp's
     * first token and writes nothing */
    for (int64_t tw = ((int64_t)blockIdx.x * WARPS + threadIdx.x / 32) * GROUPS; tw < n;
         tw += stride) {
        bool valid = tw + grp < n;
        int64_t t = valid ? tw + grp : tw;
        const float *row = logits + t * e;
        token_row<EPL, LANES> r;
        r.load(row, e, sub, score_fn, true);
        float gs[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++) gs[i] = 0;
        /* renormalisation -> the chosen raw scores */
        float wsum = 0, gw_dot_w = 0;
        for (int j = 0; j < k; j++) {
            float lj = row[topk_idx[t * k + j]];
            wsum += score_fn == 0 ? expf(lj - r.lse) : sigmoidf_(lj);
            gw_dot_w += d_topk_w[t * k + j] * topk_w[t * k + j];
        }
        for (int j = 0; j < k; j++) {
            int idx = topk_idx[t * k + j];
            float g = renorm ? (d_topk_w[t * k + j] - gw_dot_w) / wsum : d_topk_w[t * k + j];
#pragma unroll
            for (int i = 0; i < EPL; i++)
                if (sub + LANES * i == idx) gs[i] += g;
        }
        if (aux_coef != 0) {
            float gq_dot_q = 0;
            if (score_fn != 0) {
#pragma unroll
                for (int i = 0; i < EPL; i++) gq_dot_q += caux[i] * r.q[i];
                gq_dot_q = group_sum<LANES>(gq_dot_q);
            }
#pragma unroll
            for (int i = 0; i < EPL; i++)
                gs[i] += score_fn == 0 ? caux[i] : (caux[i] - gq_dot_q) / r.qnorm;
        }
        float gs_dot_s = 0;
        if (score_fn == 0) {
#pragma unroll
            for (int i = 0; i < EPL; i++) gs_dot_s += gs[i] * r.s[i];
            gs_dot_s = group_sum<LANES>(gs_dot_s);
        }
        if (!valid) continue;
        float zc = z_coef * 2.0f * r.lse * inv_n;
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            int j = sub + LANES * i;
            if (j >= e) continue;
            float g = score_fn == 0 ? r.s[i] * (gs[i] - gs_dot_s) : gs[i] * r.s[i] * (1.0f - r.s[i]);
            if (z_coef != 0) g += zc * expf(r.l[i] - r.lse);
            dlogits[t * e + j] = g;
            dl16[t * e + j] = __float2bfloat16_rn(g);
        }
    }
}

template <int EPL, int LANES>
static void launch_dlogits(const float *logits, const int32_t *idx, const float *w,
                           const float *dw, const int32_t *counts, int64_t n, int32_t e,
                           int32_t k, int score_fn, bool renorm, float aux, float z, float *dl,
                           void *dl16, cudaStream_t stream)
{
    int64_t per_block = (int64_t)WARPS * (32 / LANES);
    int64_t blocks = (n + per_block - 1) / per_block;
    if (blocks > 132 * 16) blocks = 132 * 16;
    router_dlogits<EPL, LANES><<<(unsigned)blocks, WARPS * 32, 0, stream>>>(
        logits, idx, w, dw, counts, n, e, k, score_fn, renorm, aux, z, dl,
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
#define MOE_DL(EPL, LANES)                                                                   \
    launch_dlogits<EPL, LANES>(logits, topk_idx, topk_w, d_topk_w, counts, n, e, k, score_fn, \
                               renormalize, aux_coef, z_coef, dlogits, dlogits_bf16, stream)
    switch (e > 256 ? 64 : select_lanes(e)) {
    case 1: MOE_DL(8, 1); break;
    case 2: MOE_DL(8, 2); break;
    case 4: MOE_DL(8, 4); break;
    case 8: MOE_DL(8, 8); break;
    case 16: MOE_DL(8, 16); break;
    case 32: MOE_DL(8, 32); break;
    default: MOE_DL(16, 32); break;
    }
#undef MOE_DL
    return cudaGetLastError();
}
