/*
 * The router forward's per-token selection and its deterministic statistics, shared by
 * router.cu (router_select, router_fused) and router_sm90.cu. A group of LANES lanes keeps one
 * token's E logits in registers (lane l of the group holds the EPL consecutive experts
 * l*EPL ... l*EPL+EPL-1), so the softmax/sigmoid, top-k and renormalisation never touch memory
 * again.
 *
 * Determinism: per-expert sums (P_e, counts) and the z/entropy sums are reduced in a fixed
 * order: registers per warp -> rows of a fixed set of tokens (a warp's, or a chunk's) in
 * fixed order -> one partial row per block or tile -> fixed row order (the last-arriving
 * ones reduce the partials, see select_reduce). No float atomics. Integer counts use
 * shared-memory atomics (exact). Top-k ties (equal keys) go to the lower expert index, as on
 * the host.
 */
#ifndef MOE_ROUTER_SELECT_CUH
#define MOE_ROUTER_SELECT_CUH

#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* Order-preserving float -> u32 (a larger float gives a larger integer). Every float, -inf
 * included, maps above 0, the value a taken or padding slot gets in the top-k. */
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
 * of the ~750 instructions a token cost at E = 256 (ncu, sixth session, call 4). */
static __device__ __forceinline__ float sigmoidf_(float v)
{
    return __fdividef(1.0f, 1.0f + __expf(-v));
}

/* A token's row held by a group of LANES lanes: lane `sub` of the group holds experts
 * sub*EPL ... sub*EPL+EPL-1. Logits, log-sum-exp, scores s, normalised scores q.
 * A group past the last token (valid = false) computes on zeros and writes nothing.
 * vec: E % 4 == 0 and the logits 16-byte aligned, so a lane loads its experts as float4. */
template <int EPL, int LANES>
struct token_row {
    float l[EPL], s[EPL], q[EPL];
    float lse, qnorm;
    float ent; /* -sum q log q, where load was asked for it */

    static __device__ __forceinline__ int expert(int sub, int i) { return sub * EPL + i; }

    __device__ void load(const float *row, int e, int sub, int score_fn, bool valid, bool vec,
                         bool want_ent)
    {
        fetch(l, row, e, sub, valid, vec);
        scores(e, sub, score_fn, want_ent);
    }

    /* This lane's experts of the token at `row`: -inf past E, zeros for a token past N. */
    static __device__ void fetch(float (&l)[EPL], const float *row, int e, int sub, bool valid,
                                 bool vec)
    {
        if (vec) {
#pragma unroll
            for (int i = 0; i < EPL; i += 4) {
                int j = expert(sub, i);
                float4 v = valid && j < e ? *reinterpret_cast<const float4 *>(row + j)
                                          : make_float4(0, 0, 0, 0);
                bool real = j < e; /* E % 4 == 0: all four or none */
                l[i] = real ? v.x : -INFINITY;
                l[i + 1] = real ? v.y : -INFINITY;
                l[i + 2] = real ? v.z : -INFINITY;
                l[i + 3] = real ? v.w : -INFINITY;
            }
        } else {
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                int j = expert(sub, i);
                l[i] = j >= e ? -INFINITY : valid ? row[j] : 0.0f;
            }
        }
    }

    /* The group's sums (exp sum; sigmoid: score sum; the entropy's sum) share one butterfly,
     * so a token waits for one chain of shuffles instead of three (the kernels that run few
     * warps a scheduler are bound by that latency). Entropy from those sums:
     *   softmax  -sum q log q = log(sum) - sum ex (l - mx) / sum    (ex = exp(l - mx))
     *   sigmoid  -sum q log q = log(tot) - sum s log s / tot        (q = s / tot)
     * each term a product of a probability and a log of moderate size, so nothing cancels
     * badly. */
    __device__ void scores(int e, int sub, int score_fn, bool want_ent)
    {
        bool softmax = score_fn == 0, pair = !softmax || want_ent;
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < EPL; i++) mx = fmaxf(mx, l[i]);
        mx = group_max<LANES>(mx);
        float ex[EPL], sum = 0, a = 0, b = 0; /* a: sum ex (l - mx) or tot; b: sum s log s */
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            bool real = expert(sub, i) < e;
            ex[i] = __expf(l[i] - mx); /* exp(-inf) = 0 for padding */
            sum += ex[i];
            if (softmax) {
                a += real && ex[i] > 0 ? ex[i] * (l[i] - mx) : 0.0f;
            } else {
                s[i] = real ? sigmoidf_(l[i]) : 0.0f;
                a += s[i];
                b += s[i] > 0 ? s[i] * __logf(s[i]) : 0.0f;
            }
        }
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (pair) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (!softmax && want_ent) b += __shfl_xor_sync(0xffffffffu, b, o);
        }
        float log_sum = __logf(sum), inv_sum = __fdividef(1.0f, sum);
        lse = mx + log_sum;
        qnorm = softmax ? 1.0f : a;
        float inv = __fdividef(1.0f, qnorm);
        ent = softmax ? log_sum - a * inv_sum : __logf(a) - b * inv;
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            if (softmax) s[i] = expert(sub, i) < e ? ex[i] * inv_sum : 0.0f;
            q[i] = softmax ? s[i] : s[i] * inv;
        }
    }
};

/* ---- forward: selection and statistics ------------------------------------------------------ */

/* The per-block partials are reduced by the blocks themselves: blocks form groups of `gsz`
 * consecutive blocks; the last block of a group to finish sums the group's partials (block
 * order, fp64), and the last group to finish sums the groups' (group order). Which block
 * happens to be last changes nothing in the order, so the result is bitwise reproducible.
 * Tickets: [0] counts finished groups, [1 + g] finished blocks of group g; the last arrival
 * resets its ticket to 0 for the next launch. */
#define MAX_GROUPS (MOE_ROUTER_TICKETS - 1)

/* Blocks per group, a function of nb alone: one group up to 64 blocks; beyond, about sqrt(nb)
 * so both levels sum few rows, and never more than MAX_GROUPS groups. */
static int select_group(int64_t nb)
{
    if (nb <= 64) return (int)nb;
    int64_t g = (int64_t)ceil(sqrt((double)nb)), lo = (nb + MAX_GROUPS - 1) / MAX_GROUPS;
    return (int)(g > lo ? g : lo);
}

/* Partials in the scratch: fp64 group sums first (alignment), then fp32 block sums, then the
 * integer counts. */
struct select_scratch {
    double *g_mean, *g_stats; /* [ng][E], [ng][2] */
    float *b_mean, *b_stats;  /* [nb][E], [nb][2] */
    int32_t *b_count, *g_count;
    __device__ select_scratch(float *base, int nb, int ng, int e)
    {
        g_mean = (double *)base;
        g_stats = g_mean + (size_t)ng * e;
        b_mean = (float *)(g_stats + (size_t)ng * 2);
        b_stats = b_mean + (size_t)nb * e;
        b_count = (int32_t *)(b_stats + (size_t)nb * 2);
        g_count = b_count + (size_t)nb * e;
    }
    static int64_t floats(int64_t nb, int64_t ng, int e)
    {
        return 2 * (ng * e + 2 * ng) + nb * (e + 2) + (nb + ng) * e;
    }
};

/* Where a reduction's column sums go: column c < E is expert c (mean and count), E and E+1
 * are the z and entropy sums. */
struct group_sink { /* one group's row of fp64 partials */
    double *mean, *stats;
    int32_t *count;
    int e;
    __device__ void put(int c, double a, long long n) const
    {
        if (c < e) {
            mean[c] = a;
            count[c] = (int32_t)n;
        } else {
            stats[c - e] = a;
        }
    }
};
struct total_sink { /* the op's outputs */
    float *mean, *stats;
    int32_t *count;
    int e;
    double inv_n;
    __device__ void put(int c, double a, long long n) const
    {
        if (c < e) {
            mean[c] = (float)(a * inv_n);
            count[c] = (int32_t)n;
        } else {
            stats[c - e] = (float)(a * inv_n);
        }
    }
};

/* The threads that write a partial row and reduce the partials together: a whole block, or one
 * warpgroup of a warp-specialised kernel (a named barrier). At most SELECT_TEAM_MAX threads. */
#define SELECT_TEAM_MAX 256
struct team_t {
    int size, rank, barrier; /* barrier 0: __syncthreads */

    static __device__ team_t block() { return {(int)blockDim.x, (int)threadIdx.x, 0}; }

    __device__ void sync() const
    {
        if (barrier == 0) __syncthreads();
        else asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(size) : "memory");
    }
};

/* Sums rows [r0, r1) of the partials, column by column, with the whole team: each column's
 * rows are split into P contiguous runs (P threads), each run summed in row order with 8
 * loads in flight, then the runs in order. Fixed split, fixed order: deterministic. */
template <typename T, typename Sink>
static __device__ void sum_rows(const team_t &team, const T *mean, const T *stats,
                                const int32_t *count, int r0, int r1, int e, const Sink &out,
                                double *s_a, long long *s_n)
{
    int cols = e + 2, P = max(1, team.size / cols), C = team.size / P;
    int len = (r1 - r0 + P - 1) / P, p = team.rank / C;
    for (int c0 = 0; c0 < cols; c0 += C) {
        int c = c0 + team.rank % C;
        double a = 0;
        long long n = 0;
        if (p < P && c < cols) {
            const T *src = c < e ? mean + c : stats + (c - e);
            const int32_t *cnt = c < e ? count + c : NULL;
            int stride = c < e ? e : 2, lo = r0 + p * len, hi = min(r1, lo + len);
            for (int r = lo; r < hi; r += 8) {
                T v[8];
                int32_t w[8];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    bool in = r + u < hi;
                    v[u] = in ? __ldcg(&src[(int64_t)(r + u) * stride]) : (T)0;
                    w[u] = in && cnt ? __ldcg(&cnt[(int64_t)(r + u) * stride]) : 0;
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    a += (double)v[u];
                    n += w[u];
                }
            }
        }
        s_a[team.rank] = a;
        s_n[team.rank] = n;
        team.sync();
        if (team.rank < C && c < cols) {
            for (int q = 1; q < P; q++) {
                a += s_a[q * C + team.rank];
                n += s_n[q * C + team.rank];
            }
            out.put(c, a, n);
        }
        team.sync();
    }
}

/* True in the team that arrives last at `ticket` out of `count`; it resets the ticket. */
static __device__ bool last_to_arrive(const team_t &team, unsigned *ticket, unsigned count)
{
    __shared__ bool s_last;
    __threadfence(); /* this team's partials, before its ticket */
    team.sync();
    if (team.rank == 0) {
        s_last = atomicAdd(ticket, 1u) == count - 1;
        if (s_last) *ticket = 0;
    }
    team.sync();
    return s_last;
}

/* Called by every team after it wrote partial row b of nb; returns at once in all but the
 * last. */
static __device__ void select_reduce(const team_t &team, const select_scratch &p, int nb, int b,
                                     int gsz, unsigned *tickets, int e, const total_sink &total)
{
    int ng = (nb + gsz - 1) / gsz, g = b / gsz;
    int r0 = g * gsz, r1 = min(nb, r0 + gsz);
    /* one per thread, shared by the three sum_rows instances */
    __shared__ double s_a[SELECT_TEAM_MAX];
    __shared__ long long s_n[SELECT_TEAM_MAX];
    if (!last_to_arrive(team, &tickets[1 + g], (unsigned)(r1 - r0))) return;
    if (ng == 1) { /* the only group: its sums are the totals */
        sum_rows(team, p.b_mean, p.b_stats, p.b_count, r0, r1, e, total, s_a, s_n);
        return;
    }
    group_sink row = {p.g_mean + (int64_t)g * e, p.g_stats + 2 * g, p.g_count + (int64_t)g * e, e};
    sum_rows(team, p.b_mean, p.b_stats, p.b_count, r0, r1, e, row, s_a, s_n);
    if (!last_to_arrive(team, &tickets[0], (unsigned)ng)) return;
    sum_rows(team, p.g_mean, p.g_stats, p.g_count, 0, ng, e, total, s_a, s_n);
}

/* Partial row b of nb: the `rows` rows of s_mean / s_stats summed in order, the counts, then
 * select_reduce. Every thread of the team calls; the rows are complete (the team has synced). */
static __device__ void write_partial(const team_t &team, int rows, const float *s_mean,
                                     const float *s_stats, const int32_t *s_count, int e,
                                     float *scratch, int nb, int b, int gsz, unsigned *tickets,
                                     const total_sink &total)
{
    select_scratch p(scratch, nb, (nb + gsz - 1) / gsz, e);
    for (int j = team.rank; j < e; j += team.size) {
        float acc = 0;
        for (int w = 0; w < rows; w++) acc += s_mean[w * e + j];
        p.b_mean[(int64_t)b * e + j] = acc;
        p.b_count[(int64_t)b * e + j] = s_count[j];
    }
    if (team.rank < 2) {
        float acc = 0;
        for (int w = 0; w < rows; w++) acc += s_stats[w * 2 + team.rank];
        p.b_stats[b * 2 + team.rank] = acc;
    }
    select_reduce(team, p, nb, b, gsz, tickets, e, total);
}

/* One lane's share of the selection: its experts' selection bias, and running sums over the
 * tokens its group has selected (P_e numerators, z and entropy). Shared by router_select
 * (logits from global memory) and router_fused (logits from its shared-memory tile). */
template <int EPL, int LANES>
struct selector {
    using row_t = token_row<EPL, LANES>;
    float kb[EPL], pm[EPL];
    float z_acc, ent_acc;

    __device__ selector(const float *bias, int e, int sub)
    {
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            int j = row_t::expert(sub, i);
            kb[i] = bias && j < e ? bias[j] : 0.0f;
            pm[i] = 0.0f;
        }
        z_acc = ent_acc = 0;
    }

    /* Token t, its E logits at `row` (16-byte aligned when vec): scores, statistics, top-k
     * on score + bias, weights; counts go to the block's s_count. A group with valid = false
     * computes on row's values and writes nothing. Every lane of the warp must call. */
    __device__ void token(const float *row, int64_t t, bool valid, int e, int k, int score_fn,
                          bool renorm, bool vec, int lane, int32_t *__restrict__ topk_idx,
                          float *__restrict__ topk_w, int32_t *s_count)
    {
        float l[EPL];
        row_t::fetch(l, row, e, lane % LANES, valid, vec);
        token(l, t, valid, e, k, score_fn, renorm, lane, topk_idx, topk_w, s_count);
    }

    /* The same with this lane's logits already fetched (row_t::fetch). */
    __device__ void token(const float (&l)[EPL], int64_t t, bool valid, int e, int k,
                          int score_fn, bool renorm, int lane, int32_t *__restrict__ topk_idx,
                          float *__restrict__ topk_w, int32_t *s_count)
    {
        row_t r;
#pragma unroll
        for (int i = 0; i < EPL; i++) r.l[i] = l[i];
        r.scores(e, lane % LANES, score_fn, true);
        if (valid) {
            z_acc += r.lse * r.lse;
            ent_acc += r.ent;
#pragma unroll
            for (int i = 0; i < EPL; i++) pm[i] += r.q[i];
        }
        pick(r, t, valid, e, k, renorm, lane, topk_idx, topk_w, s_count);
    }

    /* Token t's top-k on score + bias from its scores r.s, and its weights; counts go to the
     * block's s_count. Every lane of the warp must call. */
    __device__ void pick(const row_t &r, int64_t t, bool valid, int e, int k, bool renorm,
                         int lane, int32_t *__restrict__ topk_idx, float *__restrict__ topk_w,
                         int32_t *s_count)
    {
        int sub = lane % LANES, grp = lane / LANES;
        unsigned gmask = LANES == 32 ? 0xffffffffu : ((1u << LANES) - 1) << (grp * LANES);
        /* top-k on 32-bit keys. Each lane finds its two largest keys in one pass (the lower
         * slot first on equal keys), with their scores. A round takes the group's largest
         * first key; among equal ones the lowest lane, which holds the lower expert index
         * (experts are lane-contiguous). The winner moves its second key up; a lane winning
         * again rescans its untaken slots (unless it was the last round). Every lane gets
         * the winners by shuffle (for the weights' sum); lane j % LANES of the group keeps
         * and writes choice j, so up to LANES choices go out in one coalesced store. */
        unsigned u[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++)
            u[i] = row_t::expert(sub, i) < e ? key_bits(r.s[i] + kb[i]) : 0u;
        unsigned taken = 0, h1, h2;
        int i1, i2;
        float s1, s2;
        auto top_two = [&]() {
            h1 = h2 = 0u;
            i1 = i2 = 0;
            s1 = s2 = 0.0f;
#pragma unroll
            for (int i = 0; i < EPL; i++) {
                unsigned v = (taken >> i) & 1u ? 0u : u[i];
                bool gt1 = v > h1, gt2 = v > h2;
                h2 = gt1 ? h1 : gt2 ? v : h2;
                i2 = gt1 ? i1 : gt2 ? i : i2;
                s2 = gt1 ? s1 : gt2 ? r.s[i] : s2;
                h1 = gt1 ? v : h1;
                i1 = gt1 ? i : i1;
                s1 = gt1 ? r.s[i] : s1;
            }
        };
        top_two();
        bool second = true; /* h2 is this lane's next key */
        constexpr int KEEP = (MOE_ROUTER_MAX_K + LANES - 1) / LANES;
        float ws[KEEP], wsum = 0;
        int wi[KEEP];
#pragma unroll
        for (int j = 0; j < MOE_ROUTER_MAX_K; j++) {
            if (j >= k) break;
            unsigned best = group_max_u32<LANES>(h1);
            int win = __ffs(__ballot_sync(0xffffffffu, h1 == best) & gmask) - 1;
            float w = __shfl_sync(0xffffffffu, s1, win);
            int chosen = __shfl_sync(0xffffffffu, row_t::expert(sub, i1), win);
            wsum += w;
            if (sub == j % LANES) {
                ws[j / LANES] = w;
                wi[j / LANES] = chosen;
            }
            if (lane == win) {
                taken |= 1u << i1;
                if (second) {
                    h1 = h2;
                    i1 = i2;
                    s1 = s2;
                    second = false;
                } else if (j + 1 < k) {
                    top_two();
                    second = true;
                }
            }
        }
        if (valid) {
            float inv = renorm ? __fdividef(1.0f, wsum) : 1.0f;
#pragma unroll
            for (int c = 0; c < KEEP; c++) {
                int j = c * LANES + sub;
                if (j >= k) break;
                topk_idx[t * k + j] = wi[c];
                topk_w[t * k + j] = ws[c] * inv;
                atomicAdd(&s_count[wi[c]], 1);
            }
        }
    }

    /* Starts a new set of tokens (the running sums only; the bias stays). */
    __device__ void clear()
    {
#pragma unroll
        for (int i = 0; i < EPL; i++) pm[i] = 0.0f;
        z_acc = ent_acc = 0;
    }

    /* This warp's sums, lane groups folded (fixed butterfly), into row `row` of s_mean [][E]
     * and s_stats [][2]. */
    __device__ void fold(float *s_mean, float *s_stats, int row, int e)
    {
        int lane = threadIdx.x % 32, sub = lane % LANES;
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
                int j = row_t::expert(sub, i);
                if (j < e) s_mean[row * e + j] = pm[i];
            }
        if (lane == 0) {
            s_stats[row * 2] = z_acc;
            s_stats[row * 2 + 1] = ent_acc;
        }
    }

    /* The block's partials: each warp's sums folded into its row, the block's row of the
     * scratch written, then select_reduce. s_mean [warps][E] and s_stats [warps][2] are the
     * block's shared arrays, s_count its counts. */
    __device__ void finish(float *s_mean, float *s_stats, const int32_t *s_count, int e,
                           float *scratch, int gsz, unsigned *tickets, const total_sink &total)
    {
        fold(s_mean, s_stats, threadIdx.x / 32, e);
        team_t team = team_t::block();
        team.sync();
        write_partial(team, blockDim.x / 32, s_mean, s_stats, s_count, e, scratch, gridDim.x,
                      blockIdx.x, gsz, tickets, total);
    }
};

/* Shared memory of the selection: [warps][E] means, [E] int counts, [warps][2] stats. */
static size_t select_smem(int warps, int32_t e)
{
    return sizeof(float) * ((size_t)warps * e + 2 * (size_t)warps) + sizeof(int32_t) * (size_t)e;
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

#endif
