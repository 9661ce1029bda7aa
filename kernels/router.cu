/*
 * Router kernels after the logits GEMM (cuBLAS, bf16 in, fp32 out): one warp per token keeps
 * the token's E logits in registers (lane l holds experts l, l+32, ..., EPL of them), so the
 * softmax/sigmoid, top-k and renormalisation never touch memory again.
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
#define MAX_K 8

static __device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

static __device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }

/* A token's row: logits in registers, log-sum-exp, scores s and normalised scores q. */
template <int EPL>
struct token_row {
    float l[EPL], s[EPL], q[EPL];
    float lse, qnorm;

    __device__ void load(const float *row, int e, int lane, int score_fn)
    {
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            int j = lane + 32 * i;
            l[i] = j < e ? row[j] : -INFINITY;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < EPL; i++) mx = fmaxf(mx, l[i]);
        mx = warp_max(mx);
        float sum = 0;
#pragma unroll
        for (int i = 0; i < EPL; i++) sum += expf(l[i] - mx); /* exp(-inf) = 0 for padding */
        lse = mx + logf(warp_sum(sum));
        float tot = 0;
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            bool valid = lane + 32 * i < e;
            s[i] = !valid ? 0.0f : score_fn == 0 ? expf(l[i] - lse) : sigmoidf_(l[i]);
            tot += s[i];
        }
        qnorm = score_fn == 0 ? 1.0f : warp_sum(tot);
        float inv = 1.0f / qnorm;
#pragma unroll
        for (int i = 0; i < EPL; i++) q[i] = score_fn == 0 ? s[i] : s[i] * inv;
    }
};

/* ---- forward: selection and statistics ------------------------------------------------------ */

template <int EPL>
__global__ void __launch_bounds__(WARPS * 32)
router_select(const float *__restrict__ logits, const float *__restrict__ bias, int64_t n, int e,
              int k, int score_fn, bool renorm, int32_t *__restrict__ topk_idx,
              float *__restrict__ topk_w, float *__restrict__ part_mean,
              float *__restrict__ part_stats, int32_t *__restrict__ part_counts, int tpw)
{
    extern __shared__ float smem[]; /* [WARPS][E] means, then [E] int counts, [WARPS][2] */
    float *s_mean = smem;
    int32_t *s_count = (int32_t *)(s_mean + WARPS * e);
    float *s_stats = (float *)(s_count + e);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int j = threadIdx.x; j < e; j += blockDim.x) s_count[j] = 0;
    __syncthreads();

    float kb[EPL], pm[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        int j = lane + 32 * i;
        kb[i] = bias && j < e ? bias[j] : 0.0f;
        pm[i] = 0.0f;
    }
    float z_acc = 0, ent_acc = 0;
    int64_t t0 = ((int64_t)blockIdx.x * WARPS + warp) * tpw;
    for (int tt = 0; tt < tpw; tt++) {
        int64_t t = t0 + tt;
        if (t >= n) break;
        token_row<EPL> r;
        r.load(logits + t * e, e, lane, score_fn);
        z_acc += r.lse * r.lse;
        float ent = 0;
        float key[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            pm[i] += r.q[i];
            ent -= r.q[i] > 0 ? r.q[i] * logf(r.q[i]) : 0.0f;
            key[i] = lane + 32 * i < e ? r.s[i] + kb[i] : -INFINITY;
        }
        ent_acc += warp_sum(ent);
        /* top-k: each round the warp's best (key, lower index) wins and leaves the race */
        unsigned taken = 0;
        float ws[MAX_K];
        int wi[MAX_K];
        float wsum = 0;
#pragma unroll
        for (int j = 0; j < MAX_K; j++) {
            if (j >= k) break;
            float bk = -INFINITY, bs = 0;
            int bi = INT_MAX, bslot = -1;
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                int idx = lane + 32 * i;
                if (!(taken >> i & 1u) && idx < e && (bslot < 0 || key[i] > bk)) {
                    bk = key[i];
                    bs = r.s[i];
                    bi = idx;
                    bslot = i;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                float ok = __shfl_xor_sync(0xffffffffu, bk, o);
                float os = __shfl_xor_sync(0xffffffffu, bs, o);
                int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ok > bk || (ok == bk && oi < bi)) {
                    bk = ok;
                    bs = os;
                    bi = oi;
                }
            }
            if (bi % 32 == lane) taken |= 1u << (bi / 32);
            ws[j] = bs;
            wi[j] = bi;
            wsum += bs;
        }
        float inv = renorm ? 1.0f / wsum : 1.0f;
#pragma unroll
        for (int j = 0; j < MAX_K; j++) {
            if (j >= k) break;
            if (lane == j) {
                topk_idx[t * k + j] = wi[j];
                topk_w[t * k + j] = ws[j] * inv;
                atomicAdd(&s_count[wi[j]], 1);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        int j = lane + 32 * i;
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

/* Tokens per warp in router_select: a function of N alone (so the reduction order, and the
 * result, never depend on the device). One token per warp while that still leaves the GPU
 * short of work: a warp's tokens run one after the other, each a chain of warp reductions,
 * so small N wants more warps, not more tokens per warp. Up to 8 for large N, which keeps the
 * per-block partial sums few. */
static int select_tpw(int64_t n)
{
    int64_t t = n / (132 * 64);
    return (int)(t < 1 ? 1 : t > 8 ? 8 : t);
}

static int64_t select_blocks(int64_t n)
{
    int64_t per_block = (int64_t)WARPS * select_tpw(n);
    return (n + per_block - 1) / per_block;
}

extern "C" int64_t moe_cuda_router_select_scratch(int64_t n, int32_t e)
{
    return select_blocks(n) * (2 * (int64_t)e + 2);
}

template <int EPL>
static void launch_select(const float *logits, const float *bias, int64_t n, int32_t e, int32_t k,
                          int score_fn, bool renorm, int32_t *topk_idx, float *topk_w,
                          float *pm, float *ps, int32_t *pc, cudaStream_t stream)
{
    size_t smem = sizeof(float) * (WARPS * (size_t)e + 2 * WARPS) + sizeof(int32_t) * (size_t)e;
    router_select<EPL><<<(unsigned)select_blocks(n), WARPS * 32, smem, stream>>>(
        logits, bias, n, e, k, score_fn, renorm, topk_idx, topk_w, pm, ps, pc, select_tpw(n));
}

extern "C" cudaError_t moe_cuda_router_select(const float *logits, const float *bias, int64_t n,
                                              int32_t e, int32_t k, int score_fn,
                                              bool renormalize, int32_t *topk_idx, float *topk_w,
                                              int32_t *counts, float *score_mean, float *stats,
                                              float *scratch, cudaStream_t stream)
{
    if (e > MOE_ROUTER_MAX_E || k > MAX_K || n <= 0) return cudaErrorInvalidValue;
    int64_t nb = select_blocks(n);
    float *pm = scratch, *ps = pm + nb * e;
    int32_t *pc = (int32_t *)(ps + nb * 2);
    if (e <= 32)
        launch_select<1>(logits, bias, n, e, k, score_fn, renormalize, topk_idx, topk_w, pm, ps, pc, stream);
    else if (e <= 64)
        launch_select<2>(logits, bias, n, e, k, score_fn, renormalize, topk_idx, topk_w, pm, ps, pc, stream);
    else if (e <= 128)
        launch_select<4>(logits, bias, n, e, k, score_fn, renormalize, topk_idx, topk_w, pm, ps, pc, stream);
    else if (e <= 256)
        launch_select<8>(logits, bias, n, e, k, score_fn, renormalize, topk_idx, topk_w, pm, ps, pc, stream);
    else
        launch_select<16>(logits, bias, n, e, k, score_fn, renormalize, topk_idx, topk_w, pm, ps, pc, stream);
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
    router_finalize<<<e + 1, 256, 0, stream>>>(pm, ps, pc, (int)nb, e, 1.0 / (double)n, counts,
                                                score_mean, stats);
    return cudaGetLastError();
}

/* ---- wg transpose ------------------------------------------------------------------------ */

/* dst [cols, rows] = src [rows, cols]^T through a 32x33 shared tile (no bank conflicts). */
__global__ void transpose_bf16(__nv_bfloat16 *__restrict__ dst, const __nv_bfloat16 *__restrict__ src,
                               int64_t rows, int64_t cols)
{
    __shared__ __nv_bfloat16 tile[32][33];
    int64_t r0 = (int64_t)blockIdx.y * 32, c0 = (int64_t)blockIdx.x * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        int64_t r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = src[r * cols + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        int64_t c = c0 + i, r = r0 + threadIdx.x;
        if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][i];
    }
}

extern "C" cudaError_t moe_cuda_transpose_bf16(void *dst, const void *src, int64_t rows,
                                               int64_t cols, cudaStream_t stream)
{
    dim3 grid((unsigned)((cols + 31) / 32), (unsigned)((rows + 31) / 32)), block(32, 8);
    transpose_bf16<<<grid, block, 0, stream>>>((__nv_bfloat16 *)dst, (const __nv_bfloat16 *)src,
                                               rows, cols);
    return cudaGetLastError();
}

/* ---- backward: d logits ------------------------------------------------------------------- */

template <int EPL>
__global__ void __launch_bounds__(WARPS * 32)
router_dlogits(const float *__restrict__ logits, const int32_t *__restrict__ topk_idx,
               const float *__restrict__ topk_w, const float *__restrict__ d_topk_w,
               const int32_t *__restrict__ counts, int64_t n, int e, int k, int score_fn,
               bool renorm, float aux_coef, float z_coef, float *__restrict__ dlogits,
               __nv_bfloat16 *__restrict__ dl16)
{
    int lane = threadIdx.x % 32;
    float inv_n = 1.0f / (float)n;
    /* aux: d(aux_coef * aux)/d q[t,e] = aux_coef * E * f_e / N, the same for every token */
    float caux[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) {
        int j = lane + 32 * i;
        caux[i] = aux_coef != 0 && j < e
                      ? (float)((double)aux_coef * e * counts[j] / ((double)n * k) / (double)n)
                      : 0.0f;
    }
    int64_t warps = (int64_t)gridDim.x * WARPS;
    for (int64_t t = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32; t < n; t += warps) {
        const float *row = logits + t * e;
        token_row<EPL> r;
        r.load(row, e, lane, score_fn);
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
                if (lane + 32 * i == idx) gs[i] += g;
        }
        if (aux_coef != 0) {
            float gq_dot_q = 0;
            if (score_fn != 0) {
#pragma unroll
                for (int i = 0; i < EPL; i++) gq_dot_q += caux[i] * r.q[i];
                gq_dot_q = warp_sum(gq_dot_q);
            }
#pragma unroll
            for (int i = 0; i < EPL; i++)
                gs[i] += score_fn == 0 ? caux[i] : (caux[i] - gq_dot_q) / r.qnorm;
        }
        float gs_dot_s = 0;
        if (score_fn == 0) {
#pragma unroll
            for (int i = 0; i < EPL; i++) gs_dot_s += gs[i] * r.s[i];
            gs_dot_s = warp_sum(gs_dot_s);
        }
        float zc = z_coef * 2.0f * r.lse * inv_n;
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            int j = lane + 32 * i;
            if (j >= e) continue;
            float g = score_fn == 0 ? r.s[i] * (gs[i] - gs_dot_s) : gs[i] * r.s[i] * (1.0f - r.s[i]);
            if (z_coef != 0) g += zc * expf(r.l[i] - r.lse);
            dlogits[t * e + j] = g;
            dl16[t * e + j] = __float2bfloat16_rn(g);
        }
    }
}

template <int EPL>
static void launch_dlogits(const float *logits, const int32_t *idx, const float *w,
                           const float *dw, const int32_t *counts, int64_t n, int32_t e,
                           int32_t k, int score_fn, bool renorm, float aux, float z, float *dl,
                           void *dl16, cudaStream_t stream)
{
    int64_t blocks = (n + WARPS - 1) / WARPS;
    if (blocks > 132 * 16) blocks = 132 * 16;
    router_dlogits<EPL><<<(unsigned)blocks, WARPS * 32, 0, stream>>>(
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
    if (e > MOE_ROUTER_MAX_E || k > MAX_K || n <= 0) return cudaErrorInvalidValue;
#define MOE_DL(EPL)                                                                          \
    launch_dlogits<EPL>(logits, topk_idx, topk_w, d_topk_w, counts, n, e, k, score_fn,       \
                        renormalize, aux_coef, z_coef, dlogits, dlogits_bf16, stream)
    if (e <= 32) MOE_DL(1);
    else if (e <= 64) MOE_DL(2);
    else if (e <= 128) MOE_DL(4);
    else if (e <= 256) MOE_DL(8);
    else MOE_DL(16);
#undef MOE_DL
    return cudaGetLastError();
}
