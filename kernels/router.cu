/*
 * Router kernels after the logits GEMM (cuBLAS, bf16 in, fp32 out). A group of LANES lanes
 * keeps one token's E logits in registers (lane l of the group holds the EPL consecutive
 * experts l*EPL ... l*EPL+EPL-1), so the softmax/sigmoid, top-k and renormalisation never touch
 * memory again. The forward sizes the group to E (8 experts a lane: E=64 puts 4 tokens in a
 * warp), because the kernels are bound by instruction issue and latency and the group-wide
 * reductions dominate them; router_select works on two passes' tokens at once, so that their
 * chains of dependent reductions overlap.
 *
 * Shape legend: N tokens, E experts (E <= 32*EPL <= 512), K top-k (K <= 8).
 *
 * Determinism: per-expert sums (P_e, counts) and the z/entropy sums are reduced in a fixed
 * order inside a block (registers per warp -> fixed warp order), and over blocks by exact
 * integer atomics or a fixed tree in the last block to arrive (see select_reduce). No float
 * atomics. Top-k ties (equal keys) go to the lower expert index, as on the host.
 */
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "kernels.h"
#include "sm90.cuh"

#define WARPS 8               /* warps per block in the per-token kernels */
/* router_select's occupancy with 8 experts a lane, two tokens a warp pass (selector::tokens<2>):
 * 115-128 registers, no spills. Three blocks (80 registers) spill 100-870 bytes and measured
 * slower (E = 256: 0.0687 vs 0.0680 ms; E = 64: 0.0214 vs 0.0187 ms, eleventh session, call 7);
 * with one token a pass, three blocks at 80 registers were best (0.071 ms at E = 256). */
#define SELECT_BLOCKS_PER_SM 2

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
template <int LANES>
static __device__ __forceinline__ unsigned group_max_u32(unsigned v)
{
    if constexpr (LANES == 32) {
        return __reduce_max_sync(0xffffffffu, v);
    } else {
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
        return v;
    }
}

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
 * against a 1e-6 routing tie tolerance and 1e-5 bounds; the precise library calls were ~100
 * of the ~750 instructions a token cost at E = 256 (ncu, sixth session, call 4).
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
template <int EPL, int LANES, int T = 1>
struct token_rows {
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
    template <bool ENTROPY>
    __device__ void scores(int score_fn)
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
 *    numerator was NaN (the output is NaN then);
 *  - statistic words (z, entropy): bits 0-47 the sum in fixed point, 48-55 arrivals, 56-63
 *    blocks whose sum was outside [0, 2^40 units) or NaN. Those blocks (z past 2^16: a
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
    /* bit j: some block's P_e numerator of expert j was NaN, which fixed point cannot carry
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
 * follows. Against a full fence before the atomic and another in every thread of the last
 * block: 0.3-0.4 us off both forward paths' spans at N=4096 (fifteenth session, call 2). */
static __device__ bool last_to_arrive(unsigned *ticket, unsigned count)
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
 * butterfly in each warp and the warps in order. */
static __device__ void sum_block_stats(const float2 *b_stats, int nb, float2 first, double *out)
{
    __shared__ double s_part[WARPS][2];
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

static __device__ bool fits_words(int64_t n)
{
    return n <= WORDS_MAX_TOKENS && gridDim.x <= WORDS_MAX_BLOCKS;
}

namespace words {
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

static __device__ void reduce_by_words(const float *s_mean_sum, const int32_t *s_count,
                                       const float (&zs)[2], int e, router_state *st,
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

static __device__ void reduce_by_ticket(const float *s_mean_sum, const int32_t *s_count,
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
static __device__ void select_reduce(const float *s_mean_sum, const int32_t *s_count,
                                     const float (&zs)[2], int e, float *scratch,
                                     router_state *st, const select_outputs &out)
{
    if (fits_words(out.n))
        reduce_by_words(s_mean_sum, s_count, zs, e, st, out);
    else
        reduce_by_ticket(s_mean_sum, s_count, zs, e, scratch, st, out);
}

/* One lane's share of the selection: its experts' selection bias, and running sums over the
 * tokens its group has selected (P_e numerators, z and entropy). Shared by router_select
 * (logits from global memory) and router_fused (logits from its shared-memory tile). */
template <int EPL, int LANES>
struct selector {
    template <int T>
    using rows_t = token_rows<EPL, LANES, T>;
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
    __device__ __forceinline__ void top_k(const rows_t<T> &r, const int64_t (&t)[T],
                                          const bool (&valid)[T], int k, bool renorm, int lane,
                                          int32_t *__restrict__ topk_idx,
                                          float *__restrict__ topk_w, int32_t *s_count)
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

/* Shared memory of the selection: [warps][E] means, [E] int counts, [warps][2] stats. */
static size_t select_smem(int warps, int32_t e)
{
    return sizeof(float) * ((size_t)warps * e + 2 * (size_t)warps) + sizeof(int32_t) * (size_t)e;
}

/* Each warp runs 32/LANES tokens at once (one per lane group), `iters` times. */
template <int EPL, int LANES>
__global__ void __launch_bounds__(WARPS * 32, EPL == 8 ? SELECT_BLOCKS_PER_SM : 1)
router_select(const float *__restrict__ logits, const float *__restrict__ bias, int64_t n, int e,
              int k, int score_fn, bool renorm, bool vec, int32_t *__restrict__ topk_idx,
              float *__restrict__ topk_w, float *scratch, router_state *state,
              int32_t *__restrict__ counts, float *__restrict__ score_mean,
              float *__restrict__ stats, int iters)
{
    constexpr int GROUPS = 32 / LANES;
    extern __shared__ float smem[];
    float *s_mean = smem;
    int32_t *s_count = (int32_t *)(s_mean + WARPS * e);
    float *s_stats = (float *)(s_count + e);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / LANES;
    for (int j = threadIdx.x; j < e; j += blockDim.x) s_count[j] = 0;
    /* launched as a programmatic dependent of the logits GEMM: wait for it (and its memory)
     * only now, so this grid's launch overlaps the GEMM's end; and let the next kernel launch
     * (it waits likewise for this grid to complete) */
    cudaGridDependencySynchronize();
    cudaTriggerProgrammaticLaunchCompletion();
    __syncthreads();

    selector<EPL, LANES> sel(bias, e, lane % LANES);
    int64_t first = ((int64_t)blockIdx.x * WARPS + warp) * iters * GROUPS;
    /* two passes at a time (their tokens' chains overlap), then the odd one */
    for (int it = 0; it < iters; it += 2) {
        int64_t t0 = first + (int64_t)it * GROUPS, t = t0 + grp, u = t + GROUPS;
        if (t0 >= n) break; /* warp-uniform */
        bool valid = t < n, valid_u = u < n;
        const float *row = logits + (valid ? t : 0) * e, *row_u = logits + (valid_u ? u : 0) * e;
        if (it + 1 < iters && t0 + GROUPS < n)
            sel.template tokens<2>({row, row_u}, {t, u}, {valid, valid_u}, e, k, score_fn, renorm,
                                   vec, lane, topk_idx, topk_w, s_count);
        else
            sel.template tokens<1>({row}, {t}, {valid}, e, k, score_fn, renorm, vec, lane,
                                   topk_idx, topk_w, s_count);
    }
    sel.finish(s_mean, s_stats, s_count, e, scratch, state,
               {score_mean, stats, counts, e, n});
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

/* The register layout for E experts, as compile-time EPL (experts a lane) and LANES (lanes a
 * token): 8 experts a lane and select_lanes(E) lanes, 16 experts on 32 lanes above E = 256.
 * Forward and backward must hold a token's logits alike, so both dispatch through here. */
template <int V>
using int_c = std::integral_constant<int, V>;

template <class F>
static cudaError_t with_layout(int32_t e, F &&launch)
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
 * never depend on the device): as many as make the grid about one wave of 132 SMs x
 * SELECT_BLOCKS_PER_SM blocks, at most 64. Fewer, longer-lived blocks beat the earlier "64
 * warps per SM, at most 8 passes": selection 0.031 -> 0.026 ms (E=64), 0.114 -> 0.110 ms
 * (E=256), N=65536. */
static int select_iters(int64_t n, int32_t e)
{
    int64_t per_wave = (int64_t)132 * SELECT_BLOCKS_PER_SM * WARPS * (32 / select_lanes(e));
    int64_t w = (n + per_wave - 1) / per_wave;
    return (int)(w > 64 ? 64 : w);
}

static int64_t select_blocks(int64_t n, int32_t e)
{
    int64_t per_block = (int64_t)WARPS * select_iters(n, e) * (32 / select_lanes(e));
    return (n + per_block - 1) / per_block;
}

template <int EPL, int LANES>
static cudaError_t launch_select(const float *logits, const float *bias, int64_t n, int32_t e,
                                 int32_t k, int score_fn, bool renorm, int32_t *topk_idx,
                                 float *topk_w, float *scratch, void *state,
                                 int32_t *counts, float *score_mean, float *stats,
                                 cudaStream_t stream)
{
    size_t smem = select_smem(WARPS, e);
    bool vec = e % 4 == 0 && (uintptr_t)logits % 16 == 0;
    /* programmatic dependent launch (see cudaGridDependencySynchronize in the kernel):
     * forward 0.1809 -> 0.1790 ms (E=64) and 0.4395 -> 0.4382 ms (E=256), N=65536 */
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)select_blocks(n, e));
    cfg.blockDim = dim3(WARPS * 32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, router_select<EPL, LANES>, logits, bias, n, (int)e, (int)k,
                              score_fn, renorm, vec, topk_idx, topk_w, scratch,
                              (router_state *)state, counts, score_mean, stats,
                              select_iters(n, e));
}

extern "C" cudaError_t moe_cuda_router_select(const float *logits, const float *bias, int64_t n,
                                              int32_t e, int32_t k, int score_fn,
                                              bool renormalize, int32_t *topk_idx, float *topk_w,
                                              int32_t *counts, float *score_mean, float *stats,
                                              float *scratch, void *state,
                                              cudaStream_t stream)
{
    if (e > MOE_ROUTER_MAX_E || k > MOE_ROUTER_MAX_K || k > e || n <= 0 ||
        select_blocks(n, e) > INT32_MAX)
        return cudaErrorInvalidValue;
    cudaError_t rc = with_layout(e, [&](auto epl, auto lanes) {
        return launch_select<decltype(epl)::value, decltype(lanes)::value>(
            logits, bias, n, e, k, score_fn, renormalize, topk_idx, topk_w, scratch, state, counts,
            score_mean, stats, stream);
    });
    return rc != cudaSuccess ? rc : cudaGetLastError();
}

/* ---- fused forward: logits GEMM + selection in one kernel (E <= 64) ------------------------ */

/* Below E = 64 the logits GEMM moves bytes, not math (N*H*2 bytes of x for 2*N*H*E flops), so
 * one pass over x that keeps the logits on chip is the whole cost. A block owns BM tokens and
 * all (up to 64, zero-padded) experts:
 *  - mainloop: x and wg tiles of BK = 64 hidden each stream through a STAGES-deep cp.async
 *    ring in shared memory (16-byte chunks XOR-swizzled by row so ldmatrix is conflict-free;
 *    rows past N and hidden past H zero-filled; the L2 fetches 256 bytes a row at once);
 *    bf16 mma.sync m16n8k16 with f32 accumulate; 8 warps of 32 tokens x 32 experts. Every
 *    address is computed once before the loop (a thread always copies chunk tid % 8 of rows
 *    tid / 8 + 32 j), so the loop is copies, ldmatrix and mma (first version, with the
 *    addresses in the loop and 4 warps: 80 M instructions, 0.190 ms; now 44 M, 0.159-0.165);
 *  - epilogue: the f32 logits tile goes to shared memory (reusing the ring), is written out
 *    once (the interface saves logits), and the selector runs on it from there;
 *  - the block's partials end like router_select's (select_reduce, same determinism).
 * Two 128-token blocks per SM (96 KiB ring each), so one block's epilogue overlaps the other's
 * loads; the split kernel for few tokens (below) runs one block an SM. Conditions: E <= 64
 * and E % 8 == 0 (16-byte wg chunks), H % 8 == 0, x / wg / logits 16-byte aligned
 * (moe_cuda_router_fused_supported). */
namespace fused {
constexpr int EP = 64, BK = 64, THREADS = 256, NWARPS = THREADS / 32;
constexpr int ROW_BYTES = BK * 2;              /* one tile row: 8 chunks of 16 bytes */
constexpr int PASS_ROWS = THREADS / 8;         /* rows one pass of the block's copies covers */
constexpr int LDS = EP + 8; /* logits tile row stride (floats): conflict-free float2 stores */
constexpr uint32_t SMEM_ALIGN = 1024; /* router_fused's dynamic shared memory: alignment, slack */

template <int BM, int SPLIT = 1>
struct cfg {
    /* 128-token tiles: 4 stages of 24 KiB; the warps split the tile's tokens and experts
     * (4 x 2). 64-token tiles (the split kernel above 2048 tokens): 8 stages of 16 KiB, and
     * the warps also split each hidden tile's four k16 steps in KG = 2 groups of 2 x 2 warps,
     * each group with its own partial tile, so that each A fragment is read from shared
     * memory twice instead of four times (fourteenth session, call 6, N=4096: KG = 2 0.1-0.4
     * us ahead of KG = 4; 4 stages 0.3-0.5 us and 6 up to 0.3 behind 8) */
    static constexpr int ROWS = BM, STAGES = BM == 64 ? 8 : 4, KG = BM == 64 ? 2 : 1;
    static constexpr int WM = BM / 32, WN = NWARPS / KG / WM, NT = EP / 8 / WN; /* n8 tiles a warp */
    static constexpr int KK = BK / 16 / KG; /* k16 steps a warp per hidden tile */
    static constexpr int A_BYTES = BM * ROW_BYTES, STAGE_BYTES = A_BYTES + BK * ROW_BYTES;
    static constexpr int A_PASSES = BM / PASS_ROWS, B_PASSES = BK / PASS_ROWS;
    /* over the ring: KG partial logits tiles; past the ring and them (split: the other
     * blocks write it while this one may still be loading) the SPLIT blocks' sums of the rows
     * this block selects */
    static constexpr int RING = STAGES * STAGE_BYTES, TILE = BM * LDS * 4;
    static constexpr int RECV_AT = RING > KG * TILE ? RING : KG * TILE;
    static constexpr int MAIN = RECV_AT + (SPLIT == 1 ? 0 : BM * LDS * 4);
    static_assert(BM % PASS_ROWS == 0 && NWARPS % (KG * WM) == 0 && NT % 2 == 0 && KK >= 1,
                  "tile shape");
    static_assert(KG == 1 || SPLIT > 1, "partial tiles are summed by the split epilogue");
};

static __device__ __forceinline__ void add4(float4 &a, float4 b)
{
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
}

/* the stage after `st` in the ring of C::STAGES stages from `ring` */
template <class C>
static __device__ __forceinline__ uint32_t next_stage(uint32_t st, uint32_t ring)
{
    return st + C::STAGE_BYTES == ring + C::RING ? ring : st + C::STAGE_BYTES;
}

static __device__ __forceinline__ int swz(int row, int chunk)
{
    return row * ROW_BYTES + ((chunk ^ (row & 7)) << 4);
}

/* 16 bytes global -> shared, zero-filled when !full; L2 fetches the 256 aligned bytes around
 * them (the same token's next hidden tile too) */
static __device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool full)
{
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(full ? 16 : 0));
}
static __device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
static __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* One thread's share of the tile copies: chunk `lc` of rows lr + PASS_ROWS * j, for x and wg.
 * Sources advance by one 64-wide hidden tile per step; smem offsets are fixed. */
template <class C>
struct copier {
    const __nv_bfloat16 *xs, *ws; /* this thread's first x and wg chunk of the current tile */
    const __nv_bfloat16 *x0, *w0; /* in-bounds addresses for the zero-filling copies */
    int64_t x_pass, w_pass, w_step;   /* elements: to the next pass's row; wg to the next tile */
    int64_t h, kc, k_left;            /* kc: this thread's hidden offset lc * 8 */
    unsigned x_rows;                  /* bit j: x row of pass j is a token (< N) */
    uint32_t a_off, b_off;
    bool w_chunk;                     /* lc < E / 8: this thread copies wg */

    /* hidden [h0, h0 + hlen) of rows of length h_ */
    __device__ copier(const __nv_bfloat16 *x, const __nv_bfloat16 *wg, int64_t m0, int64_t n,
                      int64_t h_, int64_t h0, int64_t hlen, int e)
    {
        int lr = threadIdx.x >> 3, lc = threadIdx.x & 7;
        h = h_;
        x0 = x;
        w0 = wg;
        kc = lc * 8;
        k_left = hlen;
        xs = x + (m0 + lr) * h + h0 + kc;
        ws = wg + (h0 + lr) * e + kc;
        x_pass = PASS_ROWS * h;
        w_pass = (int64_t)PASS_ROWS * e;
        w_step = (int64_t)BK * e;
        x_rows = 0;
#pragma unroll
        for (int j = 0; j < C::A_PASSES; j++) x_rows |= (m0 + lr + PASS_ROWS * j < n) << j;
        a_off = swz(lr, lc);
        b_off = C::A_BYTES + swz(lr, lc);
        w_chunk = lc < (e >> 3);
    }

    /* copies the current hidden tile into the stage at `stage` and steps to the next */
    __device__ __forceinline__ void issue(uint32_t stage)
    {
        bool col = kc < k_left; /* hidden past H (last tile) is zero-filled */
#pragma unroll
        for (int j = 0; j < C::A_PASSES; j++) {
            bool ok = col && (x_rows >> j & 1);
            cp_async16(stage + a_off + j * PASS_ROWS * ROW_BYTES, ok ? xs + j * x_pass : x0, ok);
        }
        if (w_chunk) {
#pragma unroll
            for (int j = 0; j < C::B_PASSES; j++) {
                bool ok = (threadIdx.x >> 3) + PASS_ROWS * j < k_left;
                cp_async16(stage + b_off + j * PASS_ROWS * ROW_BYTES, ok ? ws + j * w_pass : w0, ok);
            }
        }
        xs += BK;
        ws += w_step;
        k_left -= BK;
    }
};

/* Thread-block clusters (sm_90, like the programmatic dependent launch router_select needs,
 * so every image this file builds into has them): this block's rank, the two halves of a
 * barrier of every thread of the cluster (shared-memory accesses before a releasing arrive
 * are ordered with those after the wait), and a float4 store into block `rank`'s shared memory
 * at the offset of `local` in this one. */
static __device__ __forceinline__ unsigned cluster_rank()
{
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

static __device__ __forceinline__ void cluster_arrive()
{
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

static __device__ __forceinline__ void cluster_arrive_relaxed()
{
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

static __device__ __forceinline__ void cluster_wait()
{
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

static __device__ __forceinline__ void st_cluster(float *local, unsigned rank, float4 v)
{
    uint32_t remote, a = (uint32_t)__cvta_generic_to_shared(local);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "f"(v.x),
                 "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
}

/* The walk over this block's hidden tiles [kt0, kt0 + ktiles) (copier `cp`): x and wg tiles
 * stream through the cp.async ring and their products accumulate on the tensor cores; it ends
 * with the block's partial logits tile in shared memory (KG of them, one a k-group, over the
 * ring, which is free by then), visible to all threads, and returns the first. `smem` is the
 * block's 1024-byte aligned dynamic shared memory, `ring` its shared address. Two forms, by
 * the image being compiled: */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* sm_90a: wgmma m64n64k16. Warpgroup g takes rows 64 g of every k16 step (128-token tiles)
 * or all 64 rows of the k16 steps of k-group g (64-token tiles), straight from the stages: the
 * copies' XOR swizzle by row is wgmma's 128-byte swizzle (x K-major, wg N-major), and the
 * stages are 1024-byte aligned. A stage's products run asynchronously, one group of them stays
 * in flight (wait_group 1), so a stage is refilled two steps after it was read: one stage less
 * ahead than the mma.sync form. Against that form in one binary (sixteenth session, call 4):
 * N=4096 H=2048 15.6-15.7 vs 16.9-17.1 us, N=2048 11.7-12.0 vs 12.8-12.9, N=65536 H=4096
 * 0.1504-0.1507 vs 0.1546-0.1549 ms; the mma.sync walk's products had cost ~2.8 us of the
 * 17.2 at N=4096 (call 3: 14.4 us with them skipped). */
template <class C>
static __device__ float *walk(copier<C> &cp, uint32_t ring, unsigned char *smem, int ktiles)
{
    static_assert(C::ROWS * C::KG == 2 * 64 && THREADS == 2 * 128 && C::STAGES >= 3,
                  "two warpgroups of 64 rows or of half the k16 steps");
    int g = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    int kg = C::KG == 1 ? 0 : g, row0 = C::KG == 1 ? 64 * g : 0;
#pragma unroll
    for (int st = 0; st < C::STAGES - 2; st++) {
        if (st < ktiles) cp.issue(ring + st * C::STAGE_BYTES);
        cp_commit();
    }
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; i++) d[i] = 0.0f;
    sm90::fence_acc(d);
    uint32_t use = ring, load = ring + (C::STAGES - 2) * C::STAGE_BYTES;
    for (int kt = 0; kt < ktiles; kt++) {
        cp_wait<C::STAGES - 3>(); /* tile kt has landed (this thread's part) */
        sm90::fence_proxy_async_smem();
        __syncthreads(); /* ... everyone's; and the products of step kt-2 have read their stage */
        if (kt + C::STAGES - 2 < ktiles) cp.issue(load);
        cp_commit();
        load = next_stage<C>(load, ring);
        sm90::wgmma_fence();
#pragma unroll
        for (int q = 0; q < C::KK; q++) {
            int kk = kg * C::KK + q;
            uint64_t da = sm90::smem_desc(use + row0 * ROW_BYTES + kk * 32, 16, 1024);
            uint64_t db = sm90::smem_desc(use + C::A_BYTES + kk * 16 * ROW_BYTES, 8192, 1024);
            sm90::wgmma_m64n64k16<1>(d, da, db);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();
        use = next_stage<C>(use, ring);
    }
    sm90::wgmma_wait<0>();
    sm90::fence_acc(d);
    cp_wait<0>();
    __syncthreads(); /* the ring is free: the logits tiles take its place */
    float *tile = (float *)(smem + kg * C::TILE);
#pragma unroll
    for (int i = 0; i < 8; i++) { /* wgmma's accumulator layout: n8 block i of 16 rows a warp */
        int row = row0 + 16 * warp + (lane >> 2), col = 8 * i + 2 * (lane & 3);
        *(float2 *)(tile + row * LDS + col) = make_float2(d[4 * i], d[4 * i + 1]);
        *(float2 *)(tile + (row + 8) * LDS + col) = make_float2(d[4 * i + 2], d[4 * i + 3]);
    }
    __syncthreads();
    return (float *)smem;
}
#else
/* four 8x8 b16 matrices; .trans delivers them column-wise (the mma's B operand) */
template <bool TRANS>
static __device__ __forceinline__ void ldsm(uint32_t *r, uint32_t addr)
{
    if constexpr (!TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

static __device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* other images: mma.sync m16n8k16 from ldmatrix fragments; warp (wm, wn) of k-group kg holds
 * 32 tokens x NT n8 tiles of experts */
template <class C>
static __device__ float *walk(copier<C> &cp, uint32_t ring, unsigned char *smem, int ktiles)
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int kg = warp / (C::WM * C::WN), wq = warp % (C::WM * C::WN);
    int wm = wq / C::WN, wn = wq % C::WN;
#pragma unroll
    for (int st = 0; st < C::STAGES - 1; st++) {
        if (st < ktiles) cp.issue(ring + st * C::STAGE_BYTES);
        cp_commit();
    }

    /* this lane's ldmatrix offsets inside a stage, for its k16 steps kk = kg*KK + q: A rows
     * wm*32 + mt*16 + lane % 16, 16-byte chunk 2 kk + lane / 16; B hidden rows kk*16 + lane % 8
     * (+8 for lanes 8-15, 24-31), expert chunk wn*NT + 2 np + lane / 16 (the XOR swizzle only
     * depends on row % 8 = lane % 8) */
    int lo = lane & 7, hi = lane >> 4;
    uint32_t a_row = (wm * 32 + (lane & 15)) * ROW_BYTES, a_x[C::KK], b_k[C::KK];
#pragma unroll
    for (int q = 0; q < C::KK; q++) {
        int kk = kg * C::KK + q;
        a_x[q] = a_row + (((2 * kk + hi) ^ lo) << 4);
        b_k[q] = kk * 16 * ROW_BYTES;
    }
    uint32_t b_x[C::NT / 2]; /* one x4 ldmatrix per two n8 tiles */
#pragma unroll
    for (int np = 0; np < C::NT / 2; np++)
        b_x[np] = C::A_BYTES + (lo + ((lane >> 3) & 1) * 8) * ROW_BYTES +
                  (((wn * C::NT + 2 * np + hi) ^ lo) << 4);

    float acc[2][C::NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < C::NT; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mt][nt][q] = 0.0f;

    uint32_t use = ring, load = ring + (C::STAGES - 1) * C::STAGE_BYTES;
    for (int kt = 0; kt < ktiles; kt++) {
        cp_wait<C::STAGES - 2>(); /* tile kt has landed (this thread's part) */
        __syncthreads();       /* ... everyone's; and the stage read in step kt-1 is free */
        if (kt + C::STAGES - 1 < ktiles) cp.issue(load);
        cp_commit();
        load = next_stage<C>(load, ring);
#pragma unroll
        for (int q = 0; q < C::KK; q++) {
            uint32_t af[2][4], bf[C::NT][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) ldsm<false>(af[mt], use + a_x[q] + mt * 16 * ROW_BYTES);
#pragma unroll
            for (int np = 0; np < C::NT / 2; np++) /* bf[2np][0..1], bf[2np+1][0..1] */
                ldsm<true>(&bf[2 * np][0], use + b_x[np] + b_k[q]);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < C::NT; nt++) mma_bf16(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
        }
        use = next_stage<C>(use, ring);
    }
    cp_wait<0>();
    __syncthreads(); /* the ring is free: the logits tile takes its place */

    float *tile = (float *)(smem + kg * C::TILE); /* this k-group's partial tile */
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < C::NT; nt++) {
            int row = wm * 32 + mt * 16 + (lane >> 2), col = (wn * C::NT + nt) * 8 + 2 * (lane & 3);
            *(float2 *)(tile + row * LDS + col) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
            *(float2 *)(tile + (row + 8) * LDS + col) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
        }
    __syncthreads();
    return (float *)smem;
}
#endif
} /* namespace fused */

/* SPLIT > 1: a cluster of SPLIT blocks shares one BM-token tile, block r of it walking the
 * r-th part of H; each block sends its partial sums of rows [r BM / SPLIT, (r + 1) BM / SPLIT)
 * into block r's shared memory, which sums them in block order (so the logits do not depend
 * on timing) and selects those rows. Pushing the partials (fourteenth session) instead of
 * each block pulling the others' tiles spares the second cluster barrier that kept a block
 * from leaving while others still read its tile. */
template <int BM, int LANES, int SPLIT>
__global__ void __launch_bounds__(fused::THREADS, SPLIT == 1 ? 2 : 1)
router_fused(const __nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ wg,
             const float *__restrict__ bias, int64_t n, int64_t h, int e, int k, int score_fn,
             bool renorm, float *__restrict__ logits, int32_t *__restrict__ topk_idx,
             float *__restrict__ topk_w, float *scratch, router_state *state,
             int32_t *__restrict__ counts, float *__restrict__ score_mean,
             float *__restrict__ stats)
{
    using namespace fused;
    using C = cfg<BM, SPLIT>;
    constexpr int GROUPS = 32 / LANES;
    extern __shared__ __align__(128) unsigned char fsmem_raw[];
    /* SMEM_ALIGN-byte aligned (the launch adds the slack): wgmma's 128-byte swizzle repeats
     * every 1024 bytes from an aligned address, and the copies' swizzle counts rows from the
     * stage */
    uint32_t ring = (uint32_t)__cvta_generic_to_shared(fsmem_raw);
    uint32_t pad = (SMEM_ALIGN - ring % SMEM_ALIGN) % SMEM_ALIGN;
    unsigned char *fsmem = fsmem_raw + pad;
    ring += pad;
    float *s_mean = (float *)(fsmem + C::MAIN);
    int32_t *s_count = (int32_t *)(s_mean + NWARPS * e);
    float *s_stats = (float *)(s_count + e);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned rank = SPLIT == 1 ? 0 : cluster_rank();
    int64_t m0 = (int64_t)(blockIdx.x / SPLIT) * BM;
    /* this block's hidden tiles [kt0, kt0 + ktiles) */
    int kt_all = (int)((h + BK - 1) / BK), kt_part = (kt_all + SPLIT - 1) / SPLIT;
    int kt0 = min(kt_all, (int)rank * kt_part), ktiles = min(kt_all, kt0 + kt_part) - kt0;
    int64_t h0 = (int64_t)kt0 * BK;
    int64_t hlen = max((int64_t)0, min(h, h0 + (int64_t)ktiles * BK) - h0);

    /* wg chunks past E are never copied: zero them once in every stage */
    for (int i = threadIdx.x; i < C::STAGES * BK * 8; i += THREADS) {
        int st = i / (BK * 8), r = (i / 8) % BK, c = i % 8;
        if (c >= (e >> 3))
            *(uint4 *)(fsmem + st * C::STAGE_BYTES + C::A_BYTES + swz(r, c)) = make_uint4(0, 0, 0, 0);
    }
    for (int j = threadIdx.x; j < e; j += THREADS) s_count[j] = 0;

    /* split: the others' shared memory may be written only once they run; this phase of the
     * cluster barrier is waited for just before the first such write */
    if constexpr (SPLIT > 1) cluster_arrive_relaxed();

    copier<C> cp(x, wg, m0, n, h, h0, hlen, e);
    /* launched as a programmatic dependent of the kernel before it: everything above overlaps
     * that kernel's end, global memory is touched only from here; and the next kernel may
     * launch (it waits likewise for this grid to complete) */
    cudaGridDependencySynchronize();
    cudaTriggerProgrammaticLaunchCompletion();
    float *tile = walk<C>(cp, ring, fsmem, ktiles);
    int rows = (int)min((int64_t)BM, n - m0), q4 = e / 4;
    if constexpr (SPLIT > 1) {
        /* each block sends its partial (its k-groups summed in order) of every block's rows
         * to that block's slot `rank`; after one cluster barrier each block sums its slots in
         * block order, so no block reads another's memory and none waits for the others to
         * finish reading its own */
        constexpr int OWN_ROWS = BM / SPLIT, SLOT = OWN_ROWS * LDS;
        float *recv = (float *)(fsmem + C::RECV_AT); /* [SPLIT][OWN_ROWS][LDS] */
        cluster_wait(); /* every block of the cluster runs */
        for (int i = threadIdx.x; i < BM * (EP / 4); i += THREADS) {
            int r = i / (EP / 4), c = (i % (EP / 4)) * 4;
            const float *src = (const float *)fsmem + r * LDS + c;
            float4 v = *(const float4 *)src;
#pragma unroll
            for (int g = 1; g < C::KG; g++) add4(v, *(const float4 *)(src + g * (C::TILE / 4)));
            st_cluster(recv + rank * SLOT + (r % OWN_ROWS) * LDS + c, r / OWN_ROWS, v);
        }
        cluster_arrive(); /* every block's sums have landed */
        cluster_wait();
        for (int i = threadIdx.x; i < OWN_ROWS * (EP / 4); i += THREADS) {
            int o = (i / (EP / 4)) * LDS + (i % (EP / 4)) * 4;
            float4 v = *(const float4 *)(recv + o);
#pragma unroll
            for (int b = 1; b < SPLIT; b++) add4(v, *(const float4 *)(recv + b * SLOT + o));
            *(float4 *)(recv + o) = v;
        }
        __syncthreads();
        m0 += rank * OWN_ROWS;
        rows = (int)max((int64_t)0, min((int64_t)OWN_ROWS, n - m0));
        tile = recv;
    }
    for (int i = threadIdx.x; i < rows * q4; i += THREADS) {
        int r = i / q4, c = (i - r * q4) * 4;
        *(float4 *)(logits + (m0 + r) * e + c) = *(const float4 *)(tile + r * LDS + c);
    }

    selector<8, LANES> sel(bias, e, lane % LANES);
    for (int p = warp * GROUPS; p < rows; p += NWARPS * GROUPS) { /* warp-uniform */
        int r = p + lane / LANES;
        bool valid = r < rows;
        sel.template tokens<1>({tile + (valid ? r : 0) * LDS}, {m0 + r}, {valid}, e, k, score_fn,
                               renorm, true, lane, topk_idx, topk_w, s_count);
    }
    sel.finish(s_mean, s_stats, s_count, e, scratch, state,
               {score_mean, stats, counts, e, n});
}

/* Tokens per block. 256-token blocks of 16 warps (one per SM, so no epilogue overlap; wg
 * traffic halved) measured slower: 0.170 vs 0.165 ms at N=65536 H=4096 E=64. */
#define FUSED_BM 128
/* Few tokens: clusters split H (router_fused), by rules of N alone (like select_iters, so the
 * result does not depend on the device), at one block an SM of 132 (the shared memory of
 * both configurations allows no more):
 *  - up to FUSED_SPLIT4_MAX_TOKENS, clusters of 4 blocks on 128-token tiles;
 *  - up to FUSED_SPLIT_MAX_TOKENS, clusters of 2 blocks on 64-token tiles. Clusters of 4
 *    there ran two blocks on some SMs (only 30 clusters of 4 fit at one block an SM), whose
 *    walks ended ~3 us after the median's (thirteenth session's probes); clusters of 2 fit 66.
 * Fourteenth session, calls 1-5: at N=4096 H=2048 the second 17.1-17.3 us against
 * 19.7-20.1 for clusters of 4; at N <= 2048 clusters of 4 0.4-0.6 us ahead. */
#define FUSED_SPLIT4_MAX_TOKENS 2048
#define FUSED_SPLIT2_BM 64
#define FUSED_SPLIT_MAX_TOKENS ((132 / 2) * FUSED_SPLIT2_BM)

static int64_t fused_tiles(int64_t n, int bm) { return (n + bm - 1) / bm; }

/* tokens a tile, by cluster size: the one rule the grid (fused_blocks) and the kernel's
 * template (launch_fused) share */
static constexpr int fused_tile_tokens(int split)
{
    return split == 2 ? FUSED_SPLIT2_BM : FUSED_BM;
}

/* the split kernel's cluster size for N (1: one block a 128-token tile) */
static int fused_split(int64_t n)
{
    return n <= FUSED_SPLIT4_MAX_TOKENS ? 4 : n <= FUSED_SPLIT_MAX_TOKENS ? 2 : 1;
}

static int64_t fused_blocks(int64_t n)
{
    int split = fused_split(n);
    return fused_tiles(n, fused_tile_tokens(split)) * split;
}

extern "C" int64_t moe_cuda_router_forward_scratch(int64_t n, int32_t e)
{
    int64_t a = select_blocks(n, e), b = fused_blocks(n);
    return 2 * (a > b ? a : b); /* the most blocks */
}

extern "C" bool moe_cuda_router_fused_supported(int64_t h, int32_t e, const void *x,
                                                const void *wg, const float *logits)
{
    return e <= fused::EP && e % 8 == 0 && h % 8 == 0 && (uintptr_t)x % 16 == 0 &&
           (uintptr_t)wg % 16 == 0 && (uintptr_t)logits % 16 == 0;
}

extern "C" bool moe_cuda_router_fused_splits(int64_t n) { return fused_split(n) > 1; }

template <int LANES, int SPLIT>
static cudaError_t launch_fused(int dev, const void *x, const void *wg, const float *bias,
                                int64_t n, int64_t h, int32_t e, int32_t k, int score_fn,
                                bool renorm, float *logits, int32_t *topk_idx, float *topk_w,
                                float *scratch, void *state, int32_t *counts, float *score_mean,
                                float *stats, cudaStream_t stream)
{
    constexpr int BM = fused_tile_tokens(SPLIT);
    auto kernel = router_fused<BM, LANES, SPLIT>;
    using C = fused::cfg<BM, SPLIT>;
    /* the shared-memory limit is per device: raise it once on each (idempotent) */
    static bool sized[64];
    if (dev >= 64 || !sized[dev]) {
        int most = (int)(fused::SMEM_ALIGN + C::MAIN + select_smem(fused::NWARPS, fused::EP));
        cudaError_t rc = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              most);
        if (rc != cudaSuccess) return rc;
        if (dev < 64) sized[dev] = true;
    }
    int64_t nb = fused_tiles(n, BM) * SPLIT;
    /* programmatic dependent launch (see cudaGridDependencySynchronize in the kernel) */
    cudaLaunchAttribute attr[2] = {};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = SPLIT;
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)nb);
    cfg.blockDim = dim3(fused::THREADS);
    cfg.dynamicSmemBytes = fused::SMEM_ALIGN + C::MAIN + select_smem(fused::NWARPS, e);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = SPLIT > 1 ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, kernel, (const __nv_bfloat16 *)x, (const __nv_bfloat16 *)wg,
                              bias, n, h, (int)e, (int)k, score_fn, renorm, logits, topk_idx,
                              topk_w, scratch, (router_state *)state, counts, score_mean, stats);
}

extern "C" cudaError_t moe_cuda_router_fused(const void *x, const void *wg, const float *bias,
                                             int64_t n, int64_t h, int32_t e, int32_t k,
                                             int score_fn, bool renormalize, float *logits,
                                             int32_t *topk_idx, float *topk_w, int32_t *counts,
                                             float *score_mean, float *stats, float *scratch,
                                             void *state, cudaStream_t stream)
{
    if (!moe_cuda_router_fused_supported(h, e, x, wg, logits) || k > MOE_ROUTER_MAX_K || k > e ||
        n <= 0 || fused_blocks(n) > INT32_MAX)
        return cudaErrorInvalidValue;
    int dev = 0;
    cudaError_t rc = cudaGetDevice(&dev);
    if (rc != cudaSuccess) return rc;
    int split = fused_split(n);
    auto launch = [&](auto lanes) {
        constexpr int L = decltype(lanes)::value;
        auto go = [&](auto kernel) {
            return kernel(dev, x, wg, bias, n, h, e, k, score_fn, renormalize, logits, topk_idx,
                          topk_w, scratch, state, counts, score_mean, stats, stream);
        };
        cudaError_t r = split == 4   ? go(launch_fused<L, 4>)
                        : split == 2 ? go(launch_fused<L, 2>)
                                     : go(launch_fused<L, 1>);
        return r != cudaSuccess ? r : cudaGetLastError();
    };
    switch (select_lanes(e)) { /* the selection's lanes a token: 1 to 8 for E <= 64 */
    case 1: return launch(int_c<1>{});
    case 2: return launch(int_c<2>{});
    case 4: return launch(int_c<4>{});
    default: return launch(int_c<8>{});
    }
}

/* ---- backward: d logits ------------------------------------------------------------------- */

template <int EPL, int LANES>
__global__ void __launch_bounds__(WARPS * 32)
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
    int64_t stride = (int64_t)gridDim.x * WARPS * GROUPS;
    /* the loop is warp-uniform (shuffles need every lane); a group past N redoes the warp's
     * first token and writes nothing */
    for (int64_t tw = ((int64_t)blockIdx.x * WARPS + threadIdx.x / 32) * GROUPS; tw < n;
         tw += stride) {
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
                *reinterpret_cast<float4 *>(dlogits + j) =
                    make_float4(g[i], g[i + 1], g[i + 2], g[i + 3]);
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
static void launch_dlogits(const float *logits, const int32_t *idx, const float *w,
                           const float *dw, const int32_t *counts, int64_t n, int32_t e,
                           int32_t k, int score_fn, bool renorm, float aux, float z, float *dl,
                           void *dl16, cudaStream_t stream)
{
    int64_t per_block = (int64_t)WARPS * (32 / LANES);
    int64_t blocks = (n + per_block - 1) / per_block;
    if (blocks > 132 * 16) blocks = 132 * 16;
    bool vec = e % 4 == 0 && (uintptr_t)logits % 16 == 0 && (uintptr_t)dl % 16 == 0 &&
               (uintptr_t)dl16 % 8 == 0;
    router_dlogits<EPL, LANES><<<(unsigned)blocks, WARPS * 32, 0, stream>>>(
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
    expert_bias_step<<<(unsigned)((e + 255) / 256), 256, 0, stream>>>(bias, counts, e, slots,
                                                                      rate);
    return cudaGetLastError();
}
