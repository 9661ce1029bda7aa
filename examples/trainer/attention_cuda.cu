/*
 * Fused causal attention (attention_cuda.h), FlashAttention-2's scheme on bf16 tensor cores
 * (mma.sync m16n8k16, fp32 accumulation; sm_80 and later, so the sm_90 image too). No T x T
 * matrix is ever stored: each block holds a tile of queries (or keys) in shared memory and
 * walks the tiles of the other side, recomputing the scores it needs.
 *
 *   forward   per 64 queries, key tiles of 64 up to the diagonal: S = q k^T, the online softmax
 *             (running max m and sum l per row), o += P v; o = o / l and lse = m + log2 l kept
 *   backward  delta[t] = do[t] . o[t]; then two kernels, so that every gradient is a sum in a
 *             fixed order (no atomics: bitwise reproducible):
 *             per 64 keys, query tiles from the diagonal on: P^T, dv += P^T do,
 *               dP^T = v do^T, dS^T = P^T (dP^T - delta), dk += dS^T q
 *             per 64 queries, key tiles up to the diagonal: P, dP = do v^T, dS, dq += dS k
 *             (FlashAttention-2's one backward kernel adds dq with atomics instead; the split
 *             costs two more tile products and keeps the order fixed)
 *
 * Scores are kept in the log2 domain (x = s * scale * log2 e, exp2), so lse is in log2 units.
 * Shapes: S sequences of T tokens (N = S*T rows), H hidden, nh heads of d = H/nh, d padded to
 * D (16, 32, 64 or 128; the padding loaded as zeros). Warps own 16 rows of a tile each; the
 * shared tiles' rows are padded by 16 bytes, so ldmatrix's eight rows fall in distinct banks.
 */
#include <stdint.h>

#include <cuda_bf16.h>

#include "attention_cuda.h"

typedef __nv_bfloat16 bf16;

#define WARPS 4
#define THREADS (WARPS * 32)
#define TILE 64 /* queries per forward and dq block, keys per dk/dv block, keys per tile */
#define PAD 8   /* bf16 elements after each shared row */
#define LOG2E 1.4426950408889634f

/* ---- the PTX pieces ------------------------------------------------------------------------ */

static __device__ __forceinline__ uint32_t shared_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared; zeros when !valid (src is then not read) */
static __device__ __forceinline__ void copy16(void *dst, const void *src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_addr(dst)),
                 "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
static __device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int pending> static __device__ __forceinline__ void copy_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}

static __device__ __forceinline__ void ldsm4(uint32_t r[4], const bf16 *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_addr(p))
                 : "memory");
}
static __device__ __forceinline__ void ldsm4_trans(uint32_t r[4], const bf16 *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_addr(p))
                 : "memory");
}

/* c[16x8] += a[16x16] b[16x8] */
static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                           uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t pack(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* ---- fragments ------------------------------------------------------------------------------
 * Lane l = 4g + c holds, of a 16x8 accumulator, rows g and g+8 at columns 2c and 2c+1
 * (elements 0,1 and 2,3). ST is the shared row stride in elements. */

/* the A operand a[16x16] at (r0, c0) of a row-major tile */
template <int ST>
static __device__ __forceinline__ void frag_a(uint32_t a[4], const bf16 *s, int r0, int c0)
{
    int l = threadIdx.x & 31;
    ldsm4(a, s + (r0 + (l & 7) + ((l >> 3) & 1) * 8) * ST + c0 + (l >> 4) * 8);
}
/* B operands of the n-tiles n0 and n0+8 (b[0..1], b[2..3]) at k-step k0 from a tile stored
 * [n][k] (B = tile^T: the keys of q k^T) */
template <int ST>
static __device__ __forceinline__ void frag_b_nk(uint32_t b[4], const bf16 *s, int n0, int k0)
{
    int l = threadIdx.x & 31;
    ldsm4(b, s + (n0 + (l & 7) + (l >> 4) * 8) * ST + k0 + ((l >> 3) & 1) * 8);
}
/* the same from a tile stored [k][n] (B = tile: the values of P v) */
template <int ST>
static __device__ __forceinline__ void frag_b_kn(uint32_t b[4], const bf16 *s, int k0, int n0)
{
    int l = threadIdx.x & 31;
    ldsm4_trans(b, s + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ST + n0 + (l >> 4) * 8);
}
/* an accumulator's n-tiles 2kk and 2kk+1 as the A operand of k-step kk */
static __device__ __forceinline__ void acc_to_a(uint32_t a[4], const float c0[4], const float c1[4])
{
    a[0] = pack(c0[0], c0[1]);
    a[1] = pack(c0[2], c0[3]);
    a[2] = pack(c1[0], c1[1]);
    a[3] = pack(c1[2], c1[3]);
}

/* c[16 x 8*NT] = A[16 x K] B, A at rows r0 of a row-major tile, B from a [n][k] tile */
template <int ST, int K, int NT>
static __device__ __forceinline__ void product_nk(float c[NT][4], const bf16 *a_tile, int r0,
                                                  const bf16 *b_tile)
{
#pragma unroll
    for (int i = 0; i < NT; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0;
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[4];
        frag_a<ST>(a, a_tile, r0, kk * 16);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            frag_b_nk<ST>(b, b_tile, np * 16, kk * 16);
            mma(c[2 * np], a, b[0], b[1]);
            mma(c[2 * np + 1], a, b[2], b[3]);
        }
    }
}

/* acc[16 x 8*NT] += P[16 x K] B, P an accumulator (K/8 n-tiles), B from a [k][n] tile */
template <int ST, int K, int NT>
static __device__ __forceinline__ void accumulate_kn(float acc[NT][4], const float p[K / 8][4],
                                                     const bf16 *b_tile)
{
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[4];
        acc_to_a(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            frag_b_kn<ST>(b, b_tile, kk * 16, np * 16);
            mma(acc[2 * np], a, b[0], b[1]);
            mma(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

/* Enqueue the copy of rows [R][D] (row r at src + r*stride; rows r >= rows and columns >= d
 * as zeros; safe: an address to name for the zeros) into a shared tile. */
template <int D, int R>
static __device__ __forceinline__ void load_tile(bf16 *dst, const bf16 *src, int64_t stride,
                                                 int rows, int d, const bf16 *safe)
{
    constexpr int CH = D / 8;
    for (int c = threadIdx.x; c < R * CH; c += THREADS) {
        int r = c / CH, ch = c % CH;
        bool ok = r < rows && ch * 8 < d;
        copy16(dst + r * (D + PAD) + ch * 8, ok ? src + r * stride + ch * 8 : safe, ok);
    }
}

/* the sum over the 4 lanes that share an accumulator row */
static __device__ __forceinline__ float quad_sum(float v)
{
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
static __device__ __forceinline__ float quad_max(float v)
{
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

/* Store 16 rows x D of an accumulator (times mul) as bf16: rows row0 + (g, g+8) < T,
 * columns < d, row r at out + r*stride. */
template <int D>
static __device__ __forceinline__ void store_rows(const float acc[D / 8][4], bf16 *out,
                                                  int64_t stride, int row0, int T, int d,
                                                  float mul0, float mul1)
{
    int l = threadIdx.x & 31, g = l >> 2, c = l & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int row = row0 + g + 8 * half;
        float mul = half ? mul1 : mul0;
        if (row >= T) continue;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            int col = dt * 8 + 2 * c;
            if (col < d)
                *reinterpret_cast<uint32_t *>(out + row * stride + col) = pack(
                    acc[dt][2 * half] * mul, acc[dt][2 * half + 1] * mul);
        }
    }
}

/* The walk up to the diagonal over key tiles 0..qb, double-buffered: while tile j is read
 * from its buffer (j & 1), the keys and values of tile j + 1 load into the other one (rows of
 * stride W from k and v, T rows in all, d columns; q names the zeros' address); at the last
 * tile only its own copy is waited for. */
template <int D, int ST>
static __device__ __forceinline__ void next_key_tile(bf16 *sk, bf16 *sv, const bf16 *k,
                                                     const bf16 *v, int64_t W, int T, int d,
                                                     const bf16 *q, int j, int qb)
{
    if (j < qb) {
        int nb = (j + 1) & 1, k0 = (j + 1) * TILE;
        load_tile<D, TILE>(sk + nb * TILE * ST, k + k0 * W, W, T - k0, d, q);
        load_tile<D, TILE>(sv + nb * TILE * ST, v + k0 * W, W, T - k0, d, q);
        copy_commit();
        copy_wait<1>();
    } else {
        copy_wait<0>();
    }
}

/* ---- forward ------------------------------------------------------------------------------- */

template <int D>
__global__ void __launch_bounds__(THREADS)
    attention_forward_kernel(const bf16 *qkv, bf16 *o, float *lse, int T, int H, int nh, int d,
                             float scale2)
{
    constexpr int ST = D + PAD, NT = TILE / 8, DT = D / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 *sq = reinterpret_cast<bf16 *>(smem), *sk = sq + TILE * ST, *sv = sk + 2 * TILE * ST;
    int bh = blockIdx.x, s = bh / nh, h = bh % nh;
    int qb = gridDim.y - 1 - blockIdx.y; /* the longest blocks first */
    int q0 = qb * TILE, warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    int64_t W = 3 * (int64_t)H;
    const bf16 *q = qkv + (int64_t)s * T * W + (int64_t)h * d, *k = q + H, *v = q + 2 * H;

    load_tile<D, TILE>(sq, q + q0 * W, W, T - q0, d, q);
    load_tile<D, TILE>(sk, k, W, T, d, q);
    load_tile<D, TILE>(sv, v, W, T, d, q);
    copy_commit();

    float acc[DT][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};
    uint32_t qf[D / 16][4];
    int row0 = q0 + warp * 16 + g;
    for (int j = 0; j <= qb; j++) { /* key tiles up to the diagonal */
        next_key_tile<D, ST>(sk, sv, k, v, W, T, d, q, j, qb);
        __syncthreads();
        if (j == 0)
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) frag_a<ST>(qf[kk], sq, warp * 16, kk * 16);
        const bf16 *kt = sk + (j & 1) * TILE * ST, *vt = sv + (j & 1) * TILE * ST;

        float x[NT][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                frag_b_nk<ST>(b, kt, np * 16, kk * 16);
                mma(x[2 * np], qf[kk], b[0], b[1]);
                mma(x[2 * np + 1], qf[kk], b[2], b[3]);
            }
            /* the diagonal tile holds the causal mask (and any keys past T: later than every row) */
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int col = j * TILE + nt * 8 + 2 * c + (e & 1), row = row0 + 8 * (e >> 1);
                x[nt][e] = (j == qb && col > row) ? -INFINITY : x[nt][e] * scale2;
            }
#pragma unroll
        for (int half = 0; half < 2; half++) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                mx = fmaxf(mx, fmaxf(x[nt][2 * half], x[nt][2 * half + 1]));
            float m_new = fmaxf(m[half], quad_max(mx));
            float base = m_new == -INFINITY ? 0.f : m_new;
            float alpha = exp2f(m[half] - base), sum = 0;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; e++) {
                    x[nt][e] = exp2f(x[nt][e] - base);
                    sum += x[nt][e];
                }
            l[half] = l[half] * alpha + sum;
            m[half] = m_new;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                acc[dt][2 * half] *= alpha;
                acc[dt][2 * half + 1] *= alpha;
            }
        }
        accumulate_kn<ST, TILE, DT>(acc, x, vt);
        __syncthreads(); /* the next iteration's copy overwrites this tile's buffer */
    }

    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        l[half] = quad_sum(l[half]);
        inv[half] = 1.f / l[half];
        int row = row0 + 8 * half;
        if (c == 0 && row < T) lse[(int64_t)bh * T + row] = m[half] + log2f(l[half]);
    }
    store_rows<D>(acc, o + (int64_t)s * T * H + (int64_t)h * d, H, row0 - g, T, d, inv[0], inv[1]);
}

/* ---- backward ------------------------------------------------------------------------------ */

/* delta[bh*T + t] = do[t] . o[t] over head h's d columns: a warp per (row, head) */
__global__ void attention_delta_kernel(const bf16 *o, const bf16 *d_o, float *delta, int64_t N,
                                       int T, int H, int nh, int d)
{
    int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= N * nh) return;
    int64_t n = w / nh;
    int h = (int)(w % nh);
    const bf16 *a = o + n * H + (int64_t)h * d, *b = d_o + n * H + (int64_t)h * d;
    float sum = 0;
    for (int i = 2 * lane; i < d; i += 64) {
        float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(a + i));
        float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(b + i));
        sum += x.x * y.x + x.y * y.y;
    }
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    int64_t s = n / T, t = n % T;
    if (lane == 0) delta[(s * nh + h) * T + t] = sum;
}

/* dk, dv of TILE keys over query tiles of MQ, from the diagonal on */
template <int D, int MQ>
__global__ void __launch_bounds__(THREADS)
    attention_dkdv_kernel(const bf16 *qkv, const bf16 *d_o, const float *lse, const float *delta,
                          bf16 *dqkv, int T, int H, int nh, int d, float scale, float scale2)
{
    constexpr int ST = D + PAD, NQ = MQ / 8, DT = D / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 *sk = reinterpret_cast<bf16 *>(smem), *sv = sk + TILE * ST, *sq = sv + TILE * ST,
         *sg = sq + 2 * MQ * ST;
    float *sl = reinterpret_cast<float *>(sg + 2 * MQ * ST), *sd = sl + 2 * MQ;
    int bh = blockIdx.x, s = bh / nh, h = bh % nh;
    int k0 = blockIdx.y * TILE; /* the first key blocks see the most queries: launched first */
    int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    int64_t W = 3 * (int64_t)H;
    const bf16 *q = qkv + (int64_t)s * T * W + (int64_t)h * d, *k = q + H, *v = q + 2 * H;
    const bf16 *go = d_o + (int64_t)s * T * H + (int64_t)h * d;
    const float *lse_h = lse + (int64_t)bh * T, *delta_h = delta + (int64_t)bh * T;

    load_tile<D, TILE>(sk, k + k0 * W, W, T - k0, d, q);
    load_tile<D, TILE>(sv, v + k0 * W, W, T - k0, d, q);
    int it0 = k0 / MQ, nit = (T + MQ - 1) / MQ;
    /* query tile `it` into buffer b: q and do by copy, lse and delta by plain stores (read
     * after the barrier that also publishes the copies) */
    auto load_queries = [&](int it, int b) {
        int r0 = it * MQ;
        load_tile<D, MQ>(sq + b * MQ * ST, q + r0 * W, W, T - r0, d, q);
        load_tile<D, MQ>(sg + b * MQ * ST, go + (int64_t)r0 * H, H, T - r0, d, q);
        for (int i = threadIdx.x; i < MQ; i += THREADS) {
            bool ok = r0 + i < T;
            sl[b * MQ + i] = ok ? lse_h[r0 + i] : 0.f;
            sd[b * MQ + i] = ok ? delta_h[r0 + i] : 0.f;
        }
    };
    load_queries(it0, 0);
    copy_commit();

    float dk[DT][4] = {}, dv[DT][4] = {};
    int key0 = k0 + warp * 16 + g;
    for (int it = it0; it < nit; it++) {
        int b = (it - it0) & 1;
        if (it + 1 < nit) {
            load_queries(it + 1, b ^ 1);
            copy_commit();
            copy_wait<1>();
        } else {
            copy_wait<0>();
        }
        __syncthreads();
        const bf16 *qt = sq + b * MQ * ST, *gt = sg + b * MQ * ST;
        const float *lt = sl + b * MQ, *dt_ = sd + b * MQ;
        int r0 = it * MQ;
        bool edge = r0 < k0 + TILE || r0 + MQ > T; /* the causal diagonal, or rows past T */

        float p[NQ][4];
        product_nk<ST, D, NQ>(p, sk, warp * 16, qt); /* S^T = k q^T */
#pragma unroll
        for (int nt = 0; nt < NQ; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int col = nt * 8 + 2 * c + (e & 1), key = key0 + 8 * (e >> 1);
                float x = exp2f(p[nt][e] * scale2 - lt[col]);
                p[nt][e] = (edge && (r0 + col < key || r0 + col >= T)) ? 0.f : x;
            }
        accumulate_kn<ST, MQ, DT>(dv, p, gt); /* dv += P^T do */
        float ds[NQ][4];
        product_nk<ST, D, NQ>(ds, sv, warp * 16, gt); /* dP^T = v do^T */
#pragma unroll
        for (int nt = 0; nt < NQ; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                ds[nt][e] = p[nt][e] * (ds[nt][e] - dt_[nt * 8 + 2 * c + (e & 1)]);
        accumulate_kn<ST, MQ, DT>(dk, ds, qt); /* dk += dS^T q */
        __syncthreads();
    }
    bf16 *out = dqkv + (int64_t)s * T * W + (int64_t)h * d;
    store_rows<D>(dk, out + H, W, k0 + warp * 16, T, d, scale, scale);
    store_rows<D>(dv, out + 2 * H, W, k0 + warp * 16, T, d, 1.f, 1.f);
}

/* dq of TILE queries over key tiles up to the diagonal */
template <int D>
__global__ void __launch_bounds__(THREADS)
    attention_dq_kernel(const bf16 *qkv, const bf16 *d_o, const float *lse, const float *delta,
                        bf16 *dqkv, int T, int H, int nh, int d, float scale, float scale2)
{
    constexpr int ST = D + PAD, NT = TILE / 8, DT = D / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 *sq = reinterpret_cast<bf16 *>(smem), *sg = sq + TILE * ST, *sk = sg + TILE * ST,
         *sv = sk + 2 * TILE * ST;
    int bh = blockIdx.x, s = bh / nh, h = bh % nh;
    int qb = gridDim.y - 1 - blockIdx.y;
    int q0 = qb * TILE, warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    int64_t W = 3 * (int64_t)H;
    const bf16 *q = qkv + (int64_t)s * T * W + (int64_t)h * d, *k = q + H, *v = q + 2 * H;
    const bf16 *go = d_o + (int64_t)s * T * H + (int64_t)h * d;

    load_tile<D, TILE>(sq, q + q0 * W, W, T - q0, d, q);
    load_tile<D, TILE>(sg, go + (int64_t)q0 * H, H, T - q0, d, q);
    load_tile<D, TILE>(sk, k, W, T, d, q);
    load_tile<D, TILE>(sv, v, W, T, d, q);
    copy_commit();

    int row0 = q0 + warp * 16 + g;
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int row = row0 + 8 * half;
        row_lse[half] = row < T ? lse[(int64_t)bh * T + row] : 0.f;
        row_delta[half] = row < T ? delta[(int64_t)bh * T + row] : 0.f;
    }
    float dq[DT][4] = {};
    for (int j = 0; j <= qb; j++) {
        next_key_tile<D, ST>(sk, sv, k, v, W, T, d, q, j, qb);
        __syncthreads();
        const bf16 *kt = sk + (j & 1) * TILE * ST, *vt = sv + (j & 1) * TILE * ST;
        float p[NT][4], ds[NT][4];
        product_nk<ST, D, NT>(p, sq, warp * 16, kt); /* S = q k^T */
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int col = j * TILE + nt * 8 + 2 * c + (e & 1), half = e >> 1;
                float x = exp2f(p[nt][e] * scale2 - row_lse[half]);
                p[nt][e] = (j == qb && col > row0 + 8 * half) ? 0.f : x;
            }
        product_nk<ST, D, NT>(ds, sg, warp * 16, vt); /* dP = do v^T */
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) ds[nt][e] = p[nt][e] * (ds[nt][e] - row_delta[e >> 1]);
        accumulate_kn<ST, TILE, DT>(dq, ds, kt); /* dq += dS k */
        __syncthreads();
    }
    store_rows<D>(dq, dqkv + (int64_t)s * T * W + (int64_t)h * d, W, q0 + warp * 16, T, d, scale,
                  scale);
}

/* ---- launchers ----------------------------------------------------------------------------- */

extern "C" int attention_cuda_head_dim_ok(int64_t d)
{
    return d >= 8 && d <= ATTENTION_CUDA_MAX_HEAD_DIM && d % 8 == 0;
}

/* the padded head dim D of d */
static int padded(int64_t d) { return d <= 16 ? 16 : d <= 32 ? 32 : d <= 64 ? 64 : 128; }

/* query tile of the dk/dv kernel: 32 rows at D = 128 keep its two accumulators in registers */
template <int D> struct dkdv_rows {
    static constexpr int value = D == 128 ? 32 : 64;
};

static size_t tile_bytes(int D, int rows) { return sizeof(bf16) * (size_t)rows * (D + PAD); }

/* launch kernel with `bytes` of dynamic shared memory (over 48 KiB needs the opt-in) */
template <typename K, typename... A>
static cudaError_t launch(K kernel, dim3 grid, size_t bytes, cudaStream_t st, A... args)
{
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)bytes);
    if (e != cudaSuccess) return e;
    kernel<<<grid, THREADS, bytes, st>>>(args...);
    return cudaGetLastError();
}

static bool shape_ok(const attention_cuda_shape_t *a)
{
    return a->S > 0 && a->T > 0 && a->nh > 0 && a->H % a->nh == 0 &&
           attention_cuda_head_dim_ok(a->H / a->nh) && a->S * a->nh <= INT32_MAX &&
           a->T <= INT32_MAX / 2 && 3 * a->H <= INT32_MAX;
}

template <int D>
static cudaError_t forward_d(const attention_cuda_shape_t *a, const bf16 *qkv, bf16 *o, float *lse,
                             cudaStream_t st)
{
    int T = (int)a->T, d = (int)(a->H / a->nh);
    dim3 grid((unsigned)(a->S * a->nh), (unsigned)((T + TILE - 1) / TILE));
    return launch(attention_forward_kernel<D>, grid, 5 * tile_bytes(D, TILE), st, qkv, o, lse, T,
                  (int)a->H, (int)a->nh, d, LOG2E / sqrtf((float)d));
}

template <int D>
static cudaError_t backward_d(const attention_cuda_shape_t *a, const bf16 *qkv, const bf16 *o,
                              const float *lse, const bf16 *d_o, float *delta, bf16 *dqkv,
                              cudaStream_t st)
{
    constexpr int MQ = dkdv_rows<D>::value;
    int T = (int)a->T, H = (int)a->H, nh = (int)a->nh, d = H / nh;
    int64_t N = a->S * a->T, warps = N * nh;
    float scale = 1.f / sqrtf((float)d), scale2 = scale * LOG2E;
    attention_delta_kernel<<<(unsigned)((warps * 32 + 255) / 256), 256, 0, st>>>(o, d_o, delta, N,
                                                                                 T, H, nh, d);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    unsigned BH = (unsigned)(a->S * nh), tiles = (unsigned)((T + TILE - 1) / TILE);
    size_t dkdv_bytes = 2 * tile_bytes(D, TILE) + 4 * tile_bytes(D, MQ) + sizeof(float) * 4 * MQ;
    e = launch(attention_dkdv_kernel<D, MQ>, dim3(BH, tiles), dkdv_bytes, st, qkv, d_o, lse, delta,
               dqkv, T, H, nh, d, scale, scale2);
    if (e != cudaSuccess) return e;
    return launch(attention_dq_kernel<D>, dim3(BH, tiles), 6 * tile_bytes(D, TILE), st, qkv, d_o,
                  lse, delta, dqkv, T, H, nh, d, scale, scale2);
}

extern "C" cudaError_t attention_cuda_forward(const attention_cuda_shape_t *a, const void *qkv,
                                              void *o, float *lse, cudaStream_t stream)
{
    if (!shape_ok(a)) return cudaErrorInvalidValue;
    const bf16 *x = static_cast<const bf16 *>(qkv);
    bf16 *y = static_cast<bf16 *>(o);
    switch (padded(a->H / a->nh)) {
    case 16: return forward_d<16>(a, x, y, lse, stream);
    case 32: return forward_d<32>(a, x, y, lse, stream);
    case 64: return forward_d<64>(a, x, y, lse, stream);
    default: return forward_d<128>(a, x, y, lse, stream);
    }
}

extern "C" cudaError_t attention_cuda_backward(const attention_cuda_shape_t *a, const void *qkv,
                                               const void *o, const float *lse, const void *d_o,
                                               float *delta, void *dqkv, cudaStream_t stream)
{
    if (!shape_ok(a)) return cudaErrorInvalidValue;
    const bf16 *x = static_cast<const bf16 *>(qkv), *y = static_cast<const bf16 *>(o),
               *g = static_cast<const bf16 *>(d_o);
    bf16 *dx = static_cast<bf16 *>(dqkv);
    switch (padded(a->H / a->nh)) {
    case 16: return backward_d<16>(a, x, y, lse, g, delta, dx, stream);
    case 32: return backward_d<32>(a, x, y, lse, g, delta, dx, stream);
    case 64: return backward_d<64>(a, x, y, lse, g, delta, dx, stream);
    default: return backward_d<128>(a, x, y, lse, g, delta, dx, stream);
    }
}
