/*
 * Device helpers shared by the router's three kernel families: the selection after cuBLAS's
 * logits GEMM (router_select.cu), the fused logits GEMM + selection (router_fused.cu) and the
 * d logits (router_backward.cu). They hold one token's E logits in registers: a group of
 * LANES lanes keeps the token's row (lane l of the group holds the EPL consecutive experts
 * l*EPL ... l*EPL+EPL-1), so the softmax/sigmoid, top-k and renormalisation never touch memory
 * again. The group is sized to E (8 experts a lane: E=64 puts 4 tokens in a warp), because the
 * kernels are bound by instruction issue and latency and the group-wide reductions dominate
 * them. Here: the order-preserving key bits and group reductions, the SFU transcendentals,
 * token_rows (a token's logits, scores, log-sum-exp, entropy), the selection core both forward
 * paths run (selector: top-k, weights, counts and the statistics' running sums), the
 * deterministic reduction of those statistics over the blocks (select_reduce), and the host's
 * rules for the register layout and the selection kernel's grid.
 *
 * Shape legend: N tokens, E experts (E <= 32*EPL <= 512), K top-k (K <= 8).
 *
 * Determinism: per-expert sums (P_e, counts) and the z/entropy sums are reduced in a fixed
 * order inside a block (registers per warp -> fixed warp order), and over blocks by exact
 * integer atomics or a fixed tree in the last block to arrive (see select_reduce). No float
 * atomics. Top-k ties (equal keys) go to the lower expert index, as on the host.
 *
 * Every definition is static or a template, so each router .cu file compiles its own copy.
 */
#ifndef MOE_KERNELS_ROUTER_COMMON_CUH
#define MOE_KERNELS_ROUTER_COMMON_CUH

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "kernels.h"
#include "tuning.h"

/* Order-preserving float -> u32 (a larger float gives a larger integer). Every float, -inf
 * included, maps above 0, the value a taken slot gets in the top-k. */
static __device__ __forceinline__ unsigned key_bits(float v)
{
    unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static __device__ __forceinline__ float key_float(unsigned u)
{
    return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

/* Reductions over a group of LANES consecutive lanes (xor offsets below LANES stay inside
 * the aligned group); the fixed butterfly order keeps them deterministic. A whole warp uses
 * one redux.sync (sm_80+; it writes a warp-uniform register, so only for LANES = 32). */
template <int LANES> static __device__ __forceinline__ unsigned group_max_u32(unsigned v)
{
    if constexpr (LANES == 32) {
        return __reduce_max_sync(0xffffffffu, v);
    } else {
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
        return v;
    }
}

template <int LANES> static __device__ __forceinline__ float group_sum(float v)
{
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int LANES> static __device__ __forceinline__ float group_max(float v)
{
    if constexpr (LANES == 32) {
        return key_float(group_max_u32<32>(key_bits(v)));
    } else {
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        return v;
    }
}

/* The router's transcendentals use the SFU's approximations (ex2, lg2, rcp): within 2e-7 of
 * the correctly rounded results for scores (probabilities, |x| small where they are large),
 * against a 1e-6 routing tie tolerance and 1e-5 bounds; the precise library calls would be ~100
 * of the ~750 instructions a token costs at E = 256 (ncu).
 * exp_ftz flushes subnormal results to 0 (a score below 1.2e-38 is 0 to every use here),
 * which spares the non-flushing form's range fix-up around each ex2 (__expf's 5 instructions
 * become 2); log_ftz and rcp_ftz are for arguments that are never subnormal (sums >= 1). */
static __device__ __forceinline__ float exp_ftz(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950409f));
    return y;
}

static __device__ __forceinline__ float log_ftz(float x)
{
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y * 0.6931471806f;
}

static __device__ __forceinline__ float rcp_ftz(float x)
{
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ float sigmoidf_(float v)
{
    return __fdividef(1.0f, 1.0f + exp_ftz(-v));
}

/* A padding slot's logit (experts E ... LANES*EPL-1 of the last lanes): finite, so that a
 * padding slot's score is exactly 0 in both score functions (exp and sigmoid underflow) and
 * its products with a zero score are 0, not NaN; then no step after the load needs to ask
 * whether a slot is real. (Top-k keeps padding out by the keys: see selector::top_k.) */
#define PAD_LOGIT (-1e30f)

/* T tokens' rows held by a group of LANES lanes each (T = 2: two independent chains that the
 * compiler interleaves, each step for both rows before the next step): lane `sub` of the group
 * holds experts sub*EPL ... sub*EPL+EPL-1. Logits, log-sum-exp, scores s, the normalised scores
 * q = s / qnorm (q(x, i); softmax scores are their own, qnorm = 1), and with ENTROPY the
 * entropy -sum q log q.
 * A group past the last token (valid = false) computes on zeros and writes nothing.
 * vec: E % 4 == 0 and the logits 16-byte aligned, so a lane loads its experts as float4. */
template <int EPL, int LANES, int T = 1> struct token_rows {
    float l[T][EPL], s[T][EPL];
    float lse[T], qnorm[T], qinv[T], ent[T];

    __device__ __forceinline__ float q(int x, int i) const { return s[x][i] * qinv[x]; }

    static __device__ __forceinline__ int expert(int sub, int i) { return sub * EPL + i; }

    /* rows[x]: token x's row */
    template <bool ENTROPY = false>
    __device__ void load(const float *const (&rows)[T], int e, int sub, int score_fn,
                         const bool (&valid)[T], bool vec)
    {
        if (vec) {
#pragma unroll
            for (int x = 0; x < T; x++)
#pragma unroll
                for (int i = 0; i < EPL; i += 4) {
                    int j = expert(sub, i);
                    float4 v = valid[x] && j < e ? *reinterpret_cast<const float4 *>(rows[x] + j)
                                                 : make_float4(0, 0, 0, 0);
                    bool real = j < e; /* E % 4 == 0: all four or none */
                    l[x][i] = real ? v.x : PAD_LOGIT;
                    l[x][i + 1] = real ? v.y : PAD_LOGIT;
                    l[x][i + 2] = real ? v.z : PAD_LOGIT;
                    l[x][i + 3] = real ? v.w : PAD_LOGIT;
                }
        } else {
#pragma unroll
            for (int x = 0; x < T; x++)
#pragma unroll
                for (int i = 0; i < EPL; i++) {
                    int j = expert(sub, i);
                    l[x][i] = j >= e ? PAD_LOGIT : valid[x] ? rows[x][j] : 0.0f;
                }
        }
        scores<ENTROPY>(score_fn);
    }

    /* Softmax entropy without a log per expert: with d = l - max and S = sum exp(d),
     * -sum q log q = log S - sum exp(d) d / S; sum exp(d) d rides in the same butterfly as S. */
    template <bool ENTROPY> __device__ void scores(int score_fn)
    {
        float mx[T], ex[T][EPL], sum[T], dot[T];
#pragma unroll
        for (int x = 0; x < T; x++) {
            mx[x] = l[x][0];
#pragma unroll
            for (int i = 1; i < EPL; i++) mx[x] = fmaxf(mx[x], l[x][i]);
        }
#pragma unroll
        for (int x = 0; x < T; x++) mx[x] = group_max<LANES>(mx[x]);
#pragma unroll
        for (int x = 0; x < T; x++) {
            sum[x] = dot[x] = 0;
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                float d = l[x][i] - mx[x];
                ex[x][i] = exp_ftz(d); /* 0 for padding */
                sum[x] += ex[x][i];
                if (ENTROPY) dot[x] = fmaf(ex[x][i], d, dot[x]);
            }
        }
        if (ENTROPY && score_fn == 0) {
#pragma unroll
            for (int o = LANES / 2; o > 0; o >>= 1)
#pragma unroll
                for (int x = 0; x < T; x++) {
                    float a = __shfl_xor_sync(0xffffffffu, sum[x], o);
                    float b = __shfl_xor_sync(0xffffffffu, dot[x], o);
                    sum[x] += a;
                    dot[x] += b;
                }
        } else {
#pragma unroll
            for (int x = 0; x < T; x++) sum[x] = group_sum<LANES>(sum[x]);
        }
        float log_sum[T], inv_sum[T];
#pragma unroll
        for (int x = 0; x < T; x++) {
            log_sum[x] = log_ftz(sum[x]); /* sum >= 1: the max's term is 1 */
            lse[x] = mx[x] + log_sum[x];
            inv_sum[x] = rcp_ftz(sum[x]);
        }
        if (score_fn == 0) {
#pragma unroll
            for (int x = 0; x < T; x++) {
#pragma unroll
                for (int i = 0; i < EPL; i++) s[x][i] = ex[x][i] * inv_sum[x];
                qnorm[x] = qinv[x] = 1.0f;
                if (ENTROPY) ent[x] = log_sum[x] - dot[x] * inv_sum[x];
            }
            return;
        }
#pragma unroll
        for (int x = 0; x < T; x++) {
            float tot = 0;
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                s[x][i] = sigmoidf_(l[x][i]);
                tot += s[x][i];
            }
            qnorm[x] = group_sum<LANES>(tot);
            qinv[x] = __fdividef(1.0f, qnorm[x]);
            if (!ENTROPY) continue;
            float acc = 0;
#pragma unroll
            for (int i = 0; i < EPL; i++) acc -= q(x, i) != 0 ? q(x, i) * __logf(q(x, i)) : 0.0f;
            ent[x] = group_sum<LANES>(acc);
        }
    }
};

/* ---- forward: selection and statistics ------------------------------------------------------ */

/* The statistics are summed over the blocks in a way that does not depend on which block
 * finishes first, without float atomics. Each block's sums (fixed order inside the block) reach
 * the outputs in one of two ways.
 *
 * Few tokens and blocks (fits_words: N < 2^13, at most 255 blocks), where the tail after the
 * selection is most of the time: every block adds its share of an expert, or of a statistic,
 * to one 64-bit word together with its arrival, in one integer atomic (exact, so
 * order-free). The block whose addition completes a word (it saw every other block's
 * arrival) writes that output from the word and zeroes it. No ticket, no fence, no last block.
 *  - expert words (mean_fx[j]): bits 0-34 the P_e numerator in units of 2^-22 (N < 2^13
 *    scores <= 1 stay below 2^35), 35-47 the count, 48-55 arrivals, 56-63 blocks whose
 *    numerator is NaN (the output is NaN then);
 *  - statistic words (z, entropy): bits 0-47 the sum in fixed point, 48-55 arrivals, 56-63
 *    blocks whose sum is outside [0, 2^40 units) or NaN. Those blocks (z past 2^16: a
 *    32-token block's |lse| near 45 on average) put their fp32 sum in `spill` before a fenced
 *    addition instead; the block that completes the word adds them in block order, in fp64.
 *
 * Otherwise, through a ticket:
 *  - counts: integer atomics;
 *  - the P_e numerators: in fixed point (units of 2^-32, exact for every sum >= 2^-9) added
 *    with 64-bit integer atomics; a NaN sum, which fixed point cannot carry, sets a bit;
 *  - the z and entropy sums: each block writes its two fp32 sums to the scratch, and the block
 *    that arrives last sums them in a fixed tree, in fp64.
 *   The last block takes the accumulators with atomicExch(.., 0) (the NaN bits with
 *   atomicAnd) and resets the ticket. So it waits for one ticket (an acquire-release atomic)
 *   and one round of loads.
 *
 * The accumulators outlive a launch (router_state, zeroed once by the owner); both ways leave
 * them zero for the next launch. */
#define WORDS_MAX_TOKENS 8191
#define WORDS_MAX_BLOCKS 255
struct router_state {
    unsigned long long mean_fx[MOE_ROUTER_MAX_E]; /* the P_e numerators, or the expert words */
    int32_t count[MOE_ROUTER_MAX_E];
    /* bit j: some block's P_e numerator of expert j is NaN, which fixed point cannot carry
     * (a NaN logit makes its token's scores NaN); the last block writes NaN for it */
    unsigned nan_bits[MOE_ROUTER_MAX_E / 32];
    unsigned ticket;
    unsigned long long stat_words[2];
    float spill[WORDS_MAX_BLOCKS][2];
};
static_assert(sizeof(router_state) <= MOE_ROUTER_STATE_BYTES, "MOE_ROUTER_STATE_BYTES");

#define MEAN_FX 4294967296.0f /* fixed-point units a P_e numerator: 2^32 */

struct select_outputs {
    float *mean, *stats;
    int32_t *count;
    int e;
    int64_t n;

    /* a sum over the tokens as their mean, rounded as the host twin does (times 1/n) */
    __device__ double per_token(double sum) const { return sum * (1.0 / (double)n); }
};

/* True in the block that arrives last at `ticket` out of `count`; it resets the ticket. The
 * barrier orders every thread's partials before thread 0's ticket, whose acquire-release
 * atomic publishes them (the barrier makes the release cover the other threads' writes, as in
 * CUTLASS's semaphore) and, in the last block, orders the reads after the barrier that
 * follows. Faster than a full fence before the atomic and another in every thread of the
 * last block (docs/cuda-backend.md, "Alternatives measured and not kept"). */
static __device__ __forceinline__ bool last_to_arrive(unsigned *ticket, unsigned count)
{
    __shared__ bool s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(before)
                     : "l"(ticket)
                     : "memory");
        s_last = before == count - 1;
        if (s_last) *ticket = 0;
    }
    __syncthreads();
    return s_last;
}

/* The blocks' (z, entropy) sums, rows [0, nb) of b_stats, summed in fp64: each thread its
 * rows in order (the first, row threadIdx.x, loaded by the caller: `first`), then a fixed
 * butterfly in each warp and the warps in order (at most MOE_TUNE_ROUTER_WARPS of them). */
static __device__ __forceinline__ void sum_block_stats(const float2 *b_stats, int nb, float2 first,
                                                       double *out)
{
    __shared__ double s_part[MOE_TUNE_ROUTER_WARPS][2];
    double a = first.x, b = first.y;
#pragma unroll 4
    for (int r = threadIdx.x + blockDim.x; r < nb; r += blockDim.x) {
        float2 v = __ldcg(&b_stats[r]);
        a += v.x;
        b += v.y;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (threadIdx.x % 32 == 0) {
        s_part[threadIdx.x / 32][0] = a;
        s_part[threadIdx.x / 32][1] = b;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        a = b = 0;
        for (int w = 0; w < (int)blockDim.x / 32; w++) {
            a += s_part[w][0];
            b += s_part[w][1];
        }
        out[0] = a;
        out[1] = b;
    }
}

static __device__ __forceinline__ bool fits_words(int64_t n)
{
    return n <= WORDS_MAX_TOKENS && gridDim.x <= WORDS_MAX_BLOCKS;
}

namespace words
{
constexpr int COUNT_AT = 35, ARRIVAL_AT = 48, FLAG_AT = 56;
constexpr unsigned long long ARRIVAL = 1ull << ARRIVAL_AT, FLAG = 1ull << FLAG_AT;
constexpr float MEAN_UNITS = 4194304.0f;           /* 2^22 */
constexpr float STAT_SHARE_MAX = 1099511627776.0f; /* 2^40 units a block */
static_assert(WORDS_MAX_TOKENS < 1 << (ARRIVAL_AT - COUNT_AT), "counts fit their field");
static_assert((WORDS_MAX_TOKENS + 1) * (double)MEAN_UNITS <= (double)(1ull << COUNT_AT),
              "P_e numerators fit their field");
static_assert(WORDS_MAX_BLOCKS < 1 << (FLAG_AT - ARRIVAL_AT), "arrivals and flags fit");
static_assert(WORDS_MAX_BLOCKS * (double)STAT_SHARE_MAX <= (double)(1ull << ARRIVAL_AT),
              "statistic sums fit their field");

/* fixed-point units of z (per token lse^2) and of entropy (per token <= ln 512) */
static __device__ __forceinline__ float stat_units(int i)
{
    return i == 0 ? 16777216.0f : 4294967296.0f; /* 2^24, 2^32 */
}
static __device__ __forceinline__ unsigned long long field(unsigned long long w, int at, int bits)
{
    return (w >> at) & ((1ull << bits) - 1);
}
static __device__ __forceinline__ bool completes(unsigned long long before)
{
    return field(before, ARRIVAL_AT, FLAG_AT - ARRIVAL_AT) == gridDim.x - 1;
}
} /* namespace words */

/* The thread that holds the block's z and entropy sums: the last, which adds no expert's word
 * while E is below the block's 256 threads, so its round trip runs beside theirs */
static __device__ __forceinline__ bool stats_thread() { return threadIdx.x == blockDim.x - 1; }

static __device__ __forceinline__ void reduce_by_words(const float *s_mean_sum,
                                                       const int32_t *s_count, const float (&zs)[2],
                                                       int e, router_state *st,
                                                       const select_outputs &out)
{
    using namespace words;
    for (int j = threadIdx.x; j < e; j += blockDim.x) {
        float s = s_mean_sum[j];
        unsigned long long share = ARRIVAL | (unsigned long long)s_count[j] << COUNT_AT |
                                   (isnan(s) ? FLAG : __float2ull_rn(s * MEAN_UNITS));
        unsigned long long before = atomicAdd(&st->mean_fx[j], share);
        if (!completes(before)) continue;
        unsigned long long w = before + share;
        st->mean_fx[j] = 0;
        out.count[j] = (int32_t)field(w, COUNT_AT, ARRIVAL_AT - COUNT_AT);
        double mean = out.per_token((double)field(w, 0, COUNT_AT) / MEAN_UNITS);
        out.mean[j] = w >> FLAG_AT ? NAN : (float)mean;
    }
    if (!stats_thread()) return;
    unsigned long long share[2], before[2];
    bool spilled = false;
    for (int i = 0; i < 2; i++) {
        float u = zs[i] * stat_units(i);
        bool fits = u >= 0 && u < STAT_SHARE_MAX; /* false for NaN */
        share[i] = ARRIVAL | (fits ? __float2ull_rn(u) : FLAG);
        if (!fits) {
            st->spill[blockIdx.x][i] = zs[i];
            spilled = true;
        }
    }
    if (spilled) __threadfence(); /* the spill before the arrival that announces it */
    for (int i = 0; i < 2; i++) before[i] = atomicAdd(&st->stat_words[i], share[i]);
    for (int i = 0; i < 2; i++) {
        if (!completes(before[i])) continue;
        unsigned long long w = before[i] + share[i];
        st->stat_words[i] = 0;
        double sum = (double)field(w, 0, ARRIVAL_AT) / stat_units(i);
        if (w >> FLAG_AT) {
            __threadfence(); /* after the arrivals, so that the spills they announce are seen */
            for (unsigned b = 0; b < gridDim.x; b++) {
                float v = __ldcg(&st->spill[b][i]);
                if (__float_as_uint(v) == 0) continue; /* a block whose share fit */
                sum += v;
                st->spill[b][i] = 0;
            }
        }
        out.stats[i] = (float)out.per_token(sum);
    }
}

static __device__ __forceinline__ void reduce_by_ticket(const float *s_mean_sum,
                                                        const int32_t *s_count,
                                                        const float (&zs)[2], int e, float *scratch,
                                                        router_state *st, const select_outputs &out)
{
    float2 *b_stats = (float2 *)scratch;
    for (int j = threadIdx.x; j < e; j += blockDim.x) {
        atomicAdd(&st->mean_fx[j], (unsigned long long)__float2ull_rn(s_mean_sum[j] * MEAN_FX));
        if (s_count[j]) atomicAdd(&st->count[j], s_count[j]);
        if (isnan(s_mean_sum[j])) atomicOr(&st->nan_bits[j / 32], 1u << (j % 32));
    }
    if (stats_thread()) b_stats[blockIdx.x] = make_float2(zs[0], zs[1]);
    if (!last_to_arrive(&st->ticket, gridDim.x)) return;
    /* loaded before the exchanges, so that the two round trips overlap */
    float2 first = threadIdx.x < gridDim.x ? __ldcg(&b_stats[threadIdx.x]) : make_float2(0, 0);
    for (int j = threadIdx.x; j < e; j += blockDim.x) {
        unsigned long long fx = atomicExch(&st->mean_fx[j], 0ull);
        unsigned bit = 1u << (j % 32), nan = atomicAnd(&st->nan_bits[j / 32], ~bit) & bit;
        out.count[j] = atomicExch(&st->count[j], 0);
        out.mean[j] = nan ? NAN : (float)out.per_token((double)fx / (double)MEAN_FX);
    }
    __shared__ double s_tot[2];
    sum_block_stats(b_stats, gridDim.x, first, s_tot);
    if (threadIdx.x == 0) {
        out.stats[0] = (float)out.per_token(s_tot[0]);
        out.stats[1] = (float)out.per_token(s_tot[1]);
    }
}

/* Called by every block with its column sums (P_e numerators in s_mean_sum, counts in s_count,
 * z and entropy in zs, the stats thread's) once they are final. */
static __device__ __forceinline__ void select_reduce(const float *s_mean_sum,
                                                     const int32_t *s_count, const float (&zs)[2],
                                                     int e, float *scratch, router_state *st,
                                                     const select_outputs &out)
{
    if (fits_words(out.n))
        reduce_by_words(s_mean_sum, s_count, zs, e, st, out);
    else
        reduce_by_ticket(s_mean_sum, s_count, zs, e, scratch, st, out);
}

/* One lane's share of the selection: its experts' selection bias, and running sums over the
 * tokens its group has selected (P_e numerators, z and entropy). Shared by router_select
 * (logits from global memory) and router_fused (logits from its shared-memory tile). */
template <int EPL, int LANES> struct selector {
    template <int T> using rows_t = token_rows<EPL, LANES, T>;
    float kb[EPL], pm[EPL];
    float z_acc, ent_acc;
    bool biased;

    /* A padding slot's bias is -inf, so its key (selector::top_k) sits below every real one. */
    __device__ selector(const float *bias, int e, int sub) : biased(bias != NULL)
    {
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            int j = rows_t<1>::expert(sub, i);
            kb[i] = j >= e ? -INFINITY : bias ? bias[j] : 0.0f;
            pm[i] = 0.0f;
        }
        z_acc = ent_acc = 0;
    }

    /* T tokens t[x], their E logits at rows[x] (16-byte aligned when vec): scores,
     * statistics (in token order), top-k on score + bias, weights; counts go to the block's
     * s_count. A group with valid[x] = false computes on rows[x]'s values and writes nothing.
     * Every lane of the warp must call. */
    template <int T>
    __device__ void tokens(const float *const (&rows)[T], const int64_t (&t)[T],
                           const bool (&valid)[T], int e, int k, int score_fn, bool renorm,
                           bool vec, int lane, int32_t *__restrict__ topk_idx,
                           float *__restrict__ topk_w, int32_t *s_count)
    {
        rows_t<T> r;
        r.template load<true>(rows, e, lane % LANES, score_fn, valid, vec);
#pragma unroll
        for (int x = 0; x < T; x++)
            if (valid[x]) {
                z_acc += r.lse[x] * r.lse[x];
                ent_acc += r.ent[x];
#pragma unroll
                for (int i = 0; i < EPL; i++) pm[i] = fmaf(r.s[x][i], r.qinv[x], pm[i]);
            }
        if (biased)
            top_k<true>(r, t, valid, k, renorm, lane, topk_idx, topk_w, s_count);
        else
            top_k<false>(r, t, valid, k, renorm, lane, topk_idx, topk_w, s_count);
    }

    /* Top-k on 32-bit keys. Each lane finds its two largest keys in one pass (the lower slot
     * first on equal keys). A round takes the group's largest first key; among equal ones the
     * lowest lane, which holds the lower expert index (experts are lane-contiguous). The
     * winner moves its second key up; a lane winning again rescans its untaken slots (unless
     * it was the last round). Every lane gets the winners by shuffle (for the weights' sum);
     * lane j % LANES of the group keeps and writes choice j, so up to LANES choices go out in
     * one coalesced store. Each round's group reductions run for all T tokens before any
     * winner moves on, so the tokens' chains overlap.
     * BIASED: keys of score + bias, and the winner's score travels with its key. Otherwise
     * the key is the score's own bits (scores are >= +0, so setting the sign bit orders them
     * and a round's weight is the group maximum itself); a padding slot (score 0) then ties
     * with real zeros and loses them by index, so it is never chosen while k <= E. */
    template <bool BIASED, int T>
    __device__ __forceinline__ void
    top_k(const rows_t<T> &r, const int64_t (&t)[T], const bool (&valid)[T], int k, bool renorm,
          int lane, int32_t *__restrict__ topk_idx, float *__restrict__ topk_w, int32_t *s_count)
    {
        int sub = lane % LANES, grp = lane / LANES;
        unsigned gmask = LANES == 32 ? 0xffffffffu : ((1u << LANES) - 1) << (grp * LANES);
        unsigned u[T][EPL], taken[T], h1[T], h2[T];
        int i1[T], i2[T];
        float s1[T], s2[T]; /* BIASED only */
        bool second[T];     /* h2 is this lane's next key */
#pragma unroll
        for (int x = 0; x < T; x++)
#pragma unroll
            for (int i = 0; i < EPL; i++)
                u[x][i] = BIASED ? key_bits(r.s[x][i] + kb[i])
                                 : __float_as_uint(r.s[x][i]) | 0x80000000u;
        auto top_two = [&](int x) {
            h1[x] = h2[x] = 0u;
            i1[x] = i2[x] = 0;
            s1[x] = s2[x] = 0.0f;
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                unsigned v = (taken[x] >> i) & 1u ? 0u : u[x][i];
                bool gt1 = v > h1[x], gt2 = v > h2[x];
                h2[x] = gt1 ? h1[x] : gt2 ? v : h2[x];
                i2[x] = gt1 ? i1[x] : gt2 ? i : i2[x];
                h1[x] = gt1 ? v : h1[x];
                i1[x] = gt1 ? i : i1[x];
                if (BIASED) {
                    s2[x] = gt1 ? s1[x] : gt2 ? r.s[x][i] : s2[x];
                    s1[x] = gt1 ? r.s[x][i] : s1[x];
                }
            }
        };
#pragma unroll
        for (int x = 0; x < T; x++) {
            taken[x] = 0;
            top_two(x);
            second[x] = true;
        }
        constexpr int KEEP = (MOE_ROUTER_MAX_K + LANES - 1) / LANES;
        float ws[T][KEEP], wsum[T];
        int wi[T][KEEP];
#pragma unroll
        for (int x = 0; x < T; x++) wsum[x] = 0;
#pragma unroll
        for (int j = 0; j < MOE_ROUTER_MAX_K; j++) {
            if (j >= k) break;
            unsigned best[T];
            int win[T];
#pragma unroll
            for (int x = 0; x < T; x++) best[x] = group_max_u32<LANES>(h1[x]);
#pragma unroll
            for (int x = 0; x < T; x++)
                win[x] = __ffs(__ballot_sync(0xffffffffu, h1[x] == best[x]) & gmask) - 1;
#pragma unroll
            for (int x = 0; x < T; x++) {
                float w = BIASED ? __shfl_sync(0xffffffffu, s1[x], win[x])
                                 : __uint_as_float(best[x] & 0x7fffffffu);
                int chosen = __shfl_sync(0xffffffffu, rows_t<T>::expert(sub, i1[x]), win[x]);
                wsum[x] += w;
                if (sub == j % LANES) {
                    ws[x][j / LANES] = w;
                    wi[x][j / LANES] = chosen;
                }
            }
#pragma unroll
            for (int x = 0; x < T; x++)
                if (lane == win[x]) {
                    taken[x] |= 1u << i1[x];
                    if (second[x]) {
                        h1[x] = h2[x];
                        i1[x] = i2[x];
                        s1[x] = s2[x];
                        second[x] = false;
                    } else if (j + 1 < k) {
                        top_two(x);
                        second[x] = true;
                    }
                }
        }
#pragma unroll
        for (int x = 0; x < T; x++) {
            if (!valid[x]) continue;
            float inv = renorm ? __fdividef(1.0f, wsum[x]) : 1.0f;
#pragma unroll
            for (int c = 0; c < KEEP; c++) {
                int j = c * LANES + sub;
                if (j >= k) break;
                topk_idx[t[x] * k + j] = wi[x][c];
                topk_w[t[x] * k + j] = ws[x][c] * inv;
                atomicAdd(&s_count[wi[x][c]], 1);
            }
        }
    }

    /* The block's sums: lane groups folded (fixed butterfly), then the warps (fixed order),
     * then select_reduce. s_mean [warps][E] and s_stats [warps][2] are the block's shared
     * arrays, s_count its counts. */
    __device__ void finish(float *s_mean, float *s_stats, const int32_t *s_count, int e,
                           float *scratch, router_state *st, const select_outputs &out)
    {
        int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane % LANES;
        int warps = blockDim.x / 32;
#pragma unroll
        for (int o = LANES; o < 32; o <<= 1) {
#pragma unroll
            for (int i = 0; i < EPL; i++) pm[i] += __shfl_xor_sync(0xffffffffu, pm[i], o);
            z_acc += __shfl_xor_sync(0xffffffffu, z_acc, o);
            ent_acc += __shfl_xor_sync(0xffffffffu, ent_acc, o);
        }
        if (lane < LANES)
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                int j = rows_t<1>::expert(sub, i);
                if (j < e) s_mean[warp * e + j] = pm[i];
            }
        if (lane == 0) {
            s_stats[warp * 2] = z_acc;
            s_stats[warp * 2 + 1] = ent_acc;
        }
        __syncthreads();
        /* the warps in order, into row 0 of s_mean (a column stays with its thread through
         * select_reduce) */
        for (int j = threadIdx.x; j < e; j += blockDim.x) {
            float acc = 0;
            for (int w = 0; w < warps; w++) acc += s_mean[w * e + j];
            s_mean[j] = acc;
        }
        float zs[2] = {0, 0};
        if (stats_thread())
            for (int w = 0; w < warps; w++) {
                zs[0] += s_stats[w * 2];
                zs[1] += s_stats[w * 2 + 1];
            }
        select_reduce(s_mean, s_count, zs, e, scratch, st, out);
    }
};

/* ---- host: the selection's shared memory, the register layout, the selection's grid --------- */

/* Shared memory of the selection: [warps][E] means, [E] int counts, [warps][2] stats. */
static inline size_t select_smem(int warps, int32_t e)
{
    return sizeof(float) * ((size_t)warps * e + 2 * (size_t)warps) + sizeof(int32_t) * (size_t)e;
}

/* Lanes per token (forward and backward): enough that each lane holds at most 8 experts (16
 * above E = 256), so the per-token reductions span few lanes and small E packs several
 * tokens into a warp. */
static inline int select_lanes(int32_t e)
{
    int lanes = 1;
    while (lanes < 32 && lanes * 8 < e) lanes *= 2;
    return lanes;
}

/* The register layout for E experts, as compile-time EPL (experts a lane) and LANES (lanes a
 * token): 8 experts a lane and select_lanes(E) lanes, 16 experts on 32 lanes above E = 256.
 * Forward and backward must hold a token's logits alike, so both dispatch through here. */
template <int V> using int_c = std::integral_constant<int, V>;

template <class F> static inline cudaError_t with_layout(int32_t e, F &&launch)
{
    switch (e > 256 ? 64 : select_lanes(e)) {
    case 1: return launch(int_c<8>{}, int_c<1>{});
    case 2: return launch(int_c<8>{}, int_c<2>{});
    case 4: return launch(int_c<8>{}, int_c<4>{});
    case 8: return launch(int_c<8>{}, int_c<8>{});
    case 16: return launch(int_c<8>{}, int_c<16>{});
    case 32: return launch(int_c<8>{}, int_c<32>{});
    default: return launch(int_c<16>{}, int_c<32>{});
    }
}

/* Tokens per warp pass: a function of N and E alone (so the reduction order, and the result,
 * never depend on the device): as many as make the grid about one wave of MOE_TUNE_WAVE_SMS x
 * MOE_TUNE_SELECT_BLOCKS_PER_SM blocks, at most MOE_TUNE_SELECT_MAX_PASSES. */
static inline int select_iters(int64_t n, int32_t e)
{
    int64_t per_wave = (int64_t)MOE_TUNE_WAVE_SMS * MOE_TUNE_SELECT_BLOCKS_PER_SM *
                       MOE_TUNE_ROUTER_WARPS * (32 / select_lanes(e));
    int64_t w = (n + per_wave - 1) / per_wave;
    return (int)(w > MOE_TUNE_SELECT_MAX_PASSES ? MOE_TUNE_SELECT_MAX_PASSES : w);
}

static inline int64_t select_blocks(int64_t n, int32_t e)
{
    int64_t per_block = (int64_t)MOE_TUNE_ROUTER_WARPS * select_iters(n, e) *
                        (32 / select_lanes(e));
    return (n + per_block - 1) / per_block;
}

#endif /* MOE_KERNELS_ROUTER_COMMON_CUH */
