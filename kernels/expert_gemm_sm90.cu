/*
 * Grouped expert GEMMs for Hopper (sm_90a: TMA bulk tensor copies and wgmma), one launch over
 * every local expert with its real row count. Per local expert e with rows [o_e, o_e + n_e):
 *   SwiGLU forward   hpre = xp . w1[e]  and  act = silu(gate) * up       (one kernel)
 *   SwiGLU backward  d_act = d_out . w2[e]^T,  d_hpre = swiglu'(hpre, d_act)   (d_act never
 *                    stored)
 *   plain            C = A . B[e] with a bf16 epilogue: out = act . w2[e] (B N-major) and
 *                    d_xp = d_hpre . w1[e]^T (B K-major), the other two GEMMs whose M is n_e
 * The SwiGLU kinds save the stand-alone SwiGLU kernels' passes over hpre (forward: read 2F,
 * write F per row; backward: read 3F, write 2F); their products run slower than cuBLAS's on
 * equal loads, which eats that saving. Under uneven loads, where cuBLAS runs one launch per
 * expert, the grouped launch is what pays (kernels/tuning.h says where the backend takes it;
 * the figures: docs/cuda-backend.md, "Experts").
 *
 * One grouped launch covers every expert: the tiles of all experts are numbered in one list
 * (expert-major, then N tile, then M tile, so CTAs running together share B panels in L2) and a
 * persistent grid of one CTA per SM walks it. A CTA is three warpgroups: one producer thread
 * issuing TMA loads into a 3-stage ring of 128 x 64 A and 256 x 64 B tiles (128-byte
 * swizzled), and two consumer warpgroups, each computing 64 rows x 256 columns with
 * wgmma m64n256k16 (bf16 in, f32 accumulators in registers). At the end of a tile each
 * consumer rounds its accumulators to bf16 (the values the unfused path would store) into its
 * staging buffer in shared memory and goes on to the next tile; the staged tile goes out one
 * 16-byte unit per thread between the next tile's k steps (through swiglu.cuh's math for the
 * SwiGLU kinds). Rows past the expert's end are never written (a tile may read into the next
 * expert's rows, or past R, which TMA fills with zeros, as it fills K past its end). The
 * staging buffers (64 KiB) leave room for three stages, not four.
 *
 * B's layout: w1 is [H, 2F] and w2 [F, H] row-major. SwiGLU forward tiles hold 128 gate
 * columns and the same 128 up columns of w1 (N-major: four 64 x 64 TMA boxes per stage,
 * wgmma's transposed-B form); the plain N-major kind (w2 for out) loads 256 contiguous columns
 * the same way. SwiGLU backward (w2 for d_act) and the plain K-major kind (w1 for d_xp) load
 * one 256 x 64 box of K-contiguous rows.
 * Shape legend: R rows, H hidden, F expert width, El local experts; K and N of the plain
 * kinds: the product's inner and output widths.
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_experts_hopper; Hopper only)
 * Time: MOE_CUDA_EXPERT_GEMM=hopper build/bench/bench_moe experts
 */
#include "kernels.h"
#include "sm90.cuh"
#include "swiglu.cuh"

namespace
{

using namespace sm90;

/* Fixed by the code, not tuned (kernels/tuning.h says which belong there): two consumer
 * warpgroups of wgmma m64n256k16 make the 128 x 256 tile, BK is one 128-byte swizzled TMA box
 * row of bf16, and three stages are what shared memory holds beside the staging buffers. */
constexpr int BM = 128, BN = 256, BK = 64, STAGES = 3;
constexpr int A_TILE_BYTES = BM * BK * 2; /* 16 KiB */
constexpr int B_TILE_BYTES = BN * BK * 2; /* 32 KiB */
constexpr int STAGE_BYTES = A_TILE_BYTES + B_TILE_BYTES;
constexpr int STAGING_BYTES = 64 * BN * 2; /* per consumer warpgroup */
constexpr int SMEM_BYTES = 1024 /* alignment slack */ + STAGES * STAGE_BYTES + 2 * STAGING_BYTES +
                           2 * STAGES * 8;
constexpr int THREADS = 384;

struct groups_t {
    int32_t count;   /* experts */
    int32_t n_tiles; /* N tiles per expert */
    int32_t tile_start[MOE_SWIGLU_GEMM_MAX_EXPERTS + 1];
    int32_t row_start[MOE_SWIGLU_GEMM_MAX_EXPERTS + 1];
};

/* What a launch computes (see the opening comment). */
enum kind_t { SWIGLU_FWD, SWIGLU_BWD, PLAIN_N_MAJOR_B, PLAIN_K_MAJOR_B };

__host__ __device__ constexpr bool n_major_b(int kind)
{
    return kind == SWIGLU_FWD || kind == PLAIN_N_MAJOR_B;
}

struct tile_t {
    int32_t expert, row0, row_end, n_tile;
};

__device__ __forceinline__ tile_t decode(const groups_t &g, int32_t t)
{
    int lo = 0, hi = g.count - 1; /* the last expert whose first tile is <= t */
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (g.tile_start[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    int32_t local = t - g.tile_start[lo];
    int32_t m_tiles = (g.tile_start[lo + 1] - g.tile_start[lo]) / g.n_tiles;
    return {lo, g.row_start[lo] + (local % m_tiles) * BM, g.row_start[lo + 1], local / m_tiles};
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16;
}

/* The two bf16 of a packed word, as floats (a bf16 is the top half of an f32). */
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

/* act's word for one word (two columns) of hpre's gate and up. */
__device__ __forceinline__ uint32_t swiglu_word(uint32_t g, uint32_t u)
{
    return pack_bf16(swiglu_value(bf16_lo(g), bf16_lo(u)), swiglu_value(bf16_hi(g), bf16_hi(u)));
}

/* d_hpre's gate and up words for one word (two columns) of hpre's gate, up and d_act. */
__device__ __forceinline__ void swiglu_grad_word(uint32_t g, uint32_t u, uint32_t da, uint32_t *dg,
                                                 uint32_t *du)
{
    float g0, g1, u0, u1;
    swiglu_grad(bf16_lo(g), bf16_lo(u), bf16_lo(da), &g0, &u0);
    swiglu_grad(bf16_hi(g), bf16_hi(u), bf16_hi(da), &g1, &u1);
    *dg = pack_bf16(g0, g1);
    *du = pack_bf16(u0, u1);
}

/* A consumer warpgroup's staging buffer: its 64 rows x 256 columns of the finished tile in bf16
 * (512 bytes a row). The 16-byte chunk c of row r lives at chunk c ^ (r % 8), so the fragment
 * writes (8 rows x 4 words a warp) and the chunk reads are free of bank conflicts. */
__device__ __forceinline__ uint32_t staging_offset(int row, int chunk)
{
    return (uint32_t)(row * 512 + ((chunk ^ (row & 7)) << 4));
}

/* This thread's accumulators, rounded to bf16, into the staging buffer. Fragment of wgmma
 * m64nN: register 4b + j holds row w*16 + lane/4 (+8 for j >= 2), column 8b + 2 (lane % 4) +
 * (j & 1). */
__device__ __forceinline__ void stage_tile(uint8_t *staging, const float (&acc)[128], int warp,
                                           int lane)
{
    int r0 = warp * 16 + (lane >> 2), word = (lane & 3) * 4;
#pragma unroll
    for (int b = 0; b < 32; b++) {
        *(uint32_t *)(staging + staging_offset(r0, b) + word) = pack_bf16(acc[4 * b],
                                                                          acc[4 * b + 1]);
        *(uint32_t *)(staging + staging_offset(r0 + 8, b) + word) = pack_bf16(acc[4 * b + 2],
                                                                              acc[4 * b + 3]);
    }
}

/* The staged tile of one consumer warpgroup goes out one unit per thread at a time while the
 * next tile's products run, so that the epilogue's memory traffic, which every CTA reaches at
 * about the same moment, is spread over the main loop instead of stalling it (measured:
 * docs/cuda-backend.md). SwiGLU forward unit: 8 gate and the same 8 up columns of a row ->
 * hpre, act; SwiGLU backward unit: 8 d_act columns of a row with hpre's gate and up there ->
 * d_hpre; plain unit: 8 columns of a row -> C. `width`: F for the SwiGLU kinds, N for the
 * plain ones. */
template <int KIND> struct drain_t {
    static constexpr bool FORWARD = KIND == SWIGLU_FWD;
    static constexpr int UNITS = FORWARD ? 8 : 16; /* 64 rows x 16 or 32 chunks, / 128 threads */
    const uint8_t *staging;
    int64_t row_base, col0;
    int32_t row_end;
    int tid, next; /* next unit to write; UNITS: none pending */
    uint4 g, u;    /* SwiGLU backward: hpre's gate and up of unit `next`, loaded one unit ahead */

    __device__ __forceinline__ void locate(int i, int *row, int *chunk, int64_t *r,
                                           int64_t *c) const
    {
        int q = tid + 128 * i;
        *row = FORWARD ? q >> 4 : q >> 5;
        *chunk = FORWARD ? q & 15 : q & 31;
        *r = row_base + *row;
        *c = col0 + *chunk * 8;
    }

    __device__ __forceinline__ bool valid(int64_t r, int64_t c, int64_t width) const
    {
        return r < row_end && c < width;
    }

    __device__ __forceinline__ void load(const __nv_bfloat16 *hpre, int64_t f)
    {
        int row, chunk;
        int64_t r, c;
        locate(next, &row, &chunk, &r, &c);
        if (valid(r, c, f)) {
            g = *(const uint4 *)(hpre + r * 2 * f + c);
            u = *(const uint4 *)(hpre + r * 2 * f + f + c);
        }
    }

    /* A finished tile is staged: its units are next; SwiGLU backward has L2 fetch their hpre
     * now. */
    __device__ __forceinline__ void start(int64_t base, int32_t end, int64_t column0,
                                          const __nv_bfloat16 *hpre, int64_t width)
    {
        row_base = base;
        row_end = end;
        col0 = column0;
        next = 0;
        if constexpr (KIND == SWIGLU_BWD) {
            for (int i = 0; i < UNITS; i++) {
                int row, chunk;
                int64_t r, c;
                locate(i, &row, &chunk, &r, &c);
                if (valid(r, c, width)) {
                    const __nv_bfloat16 *gate = hpre + r * 2 * width + c;
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(gate));
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(gate + width));
                }
            }
            load(hpre, width);
        }
    }

    __device__ __forceinline__ void step(__nv_bfloat16 *hpre, __nv_bfloat16 *out, int64_t width)
    {
        int row, chunk;
        int64_t r, c;
        locate(next, &row, &chunk, &r, &c);
        if constexpr (FORWARD) {
            int64_t f = width;
            if (valid(r, c, f)) {
                uint4 gate = *(const uint4 *)(staging + staging_offset(row, chunk));
                uint4 up = *(const uint4 *)(staging + staging_offset(row, 16 + chunk));
                uint4 act;
                act.x = swiglu_word(gate.x, up.x);
                act.y = swiglu_word(gate.y, up.y);
                act.z = swiglu_word(gate.z, up.z);
                act.w = swiglu_word(gate.w, up.w);
                *(uint4 *)(hpre + r * 2 * f + c) = gate;
                *(uint4 *)(hpre + r * 2 * f + f + c) = up;
                *(uint4 *)(out + r * f + c) = act;
            }
            next++;
        } else if constexpr (KIND == SWIGLU_BWD) {
            int64_t f = width;
            uint4 gate = g, up = u, dg, du;
            bool ok = valid(r, c, f);
            if (++next < UNITS) load(hpre, f); /* in flight while this unit computes */
            if (ok) {
                uint4 da = *(const uint4 *)(staging + staging_offset(row, chunk));
                swiglu_grad_word(gate.x, up.x, da.x, &dg.x, &du.x);
                swiglu_grad_word(gate.y, up.y, da.y, &dg.y, &du.y);
                swiglu_grad_word(gate.z, up.z, da.z, &dg.z, &du.z);
                swiglu_grad_word(gate.w, up.w, da.w, &dg.w, &du.w);
                *(uint4 *)(out + r * 2 * f + c) = dg;
                *(uint4 *)(out + r * 2 * f + f + c) = du;
            }
        } else {
            if (valid(r, c, width))
                *(uint4 *)(out + r * width + c) = *(const uint4 *)(staging +
                                                                   staging_offset(row, chunk));
            next++;
        }
    }

    __device__ __forceinline__ void finish(__nv_bfloat16 *hpre, __nv_bfloat16 *out, int64_t width)
    {
        while (next < UNITS) step(hpre, out, width);
    }
};

template <int KIND>
__global__ void __launch_bounds__(THREADS, 1)
    expert_gemm(const __grid_constant__ CUtensorMap map_a,
                const __grid_constant__ CUtensorMap map_b, const __grid_constant__ groups_t groups,
                int32_t k_tiles, int64_t width, __nv_bfloat16 *__restrict__ hpre,
                __nv_bfloat16 *__restrict__ out)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) /* the only image built (CMakeLists.txt) */
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *ring = smem;
    uint8_t *staging = smem + STAGES * STAGE_BYTES;
    uint64_t *full = (uint64_t *)(staging + 2 * STAGING_BYTES), *empty = full + STAGES;
    int warpgroup = threadIdx.x / 128;
    int32_t total = groups.tile_start[groups.count];

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8); /* lane 0 of each consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) { /* producer: one thread issues every TMA load */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        int s = 0;
        uint32_t phase = 0;
        for (int32_t t = blockIdx.x; t < total && threadIdx.x == 0; t += gridDim.x) {
            tile_t tile = decode(groups, t);
            for (int32_t kt = 0; kt < k_tiles; kt++) {
                mbar_wait(&empty[s], phase ^ 1);
                mbar_expect_tx(&full[s], STAGE_BYTES);
                uint8_t *a = ring + s * STAGE_BYTES, *b = a + A_TILE_BYTES;
                tma_load_2d(a, &map_a, kt * BK, tile.row0, &full[s]);
                if (KIND == SWIGLU_FWD) { /* gate columns 128n.., then the same up F + 128n.. */
                    int32_t gate = tile.n_tile * 128;
                    for (int q = 0; q < 4; q++)
                        tma_load_3d(b + q * 8192, &map_b,
                                    (q < 2 ? gate : (int32_t)width + gate) + (q & 1) * 64, kt * BK,
                                    tile.expert, &full[s]);
                } else if (KIND == PLAIN_N_MAJOR_B) { /* columns 256n.. in four 64-wide boxes */
                    for (int q = 0; q < 4; q++)
                        tma_load_3d(b + q * 8192, &map_b, tile.n_tile * BN + q * 64, kt * BK,
                                    tile.expert, &full[s]);
                } else {
                    tma_load_3d(b, &map_b, kt * BK, tile.n_tile * BN, tile.expert, &full[s]);
                }
                if (++s == STAGES) {
                    s = 0;
                    phase ^= 1;
                }
            }
        }
    } else { /* consumers: 64 rows each */
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int cw = warpgroup - 1, tid = threadIdx.x - 128 * warpgroup, bar = 1 + cw;
        uint8_t *stage_buf = staging + cw * STAGING_BYTES;
        drain_t<KIND> drain;
        drain.staging = stage_buf;
        drain.tid = tid;
        drain.next = drain_t<KIND>::UNITS;
        float acc[128];
        int s = 0;
        uint32_t phase = 0;
        for (int32_t t = blockIdx.x; t < total; t += gridDim.x) {
            tile_t tile = decode(groups, t);
            int prev = 0;
            for (int32_t kt = 0; kt < k_tiles; kt++) {
                mbar_wait(&full[s], phase);
                uint32_t a = smem_u32(ring + s * STAGE_BYTES) + cw * (64 * 128);
                uint32_t b = smem_u32(ring + s * STAGE_BYTES + A_TILE_BYTES);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; kk++) {
                    uint64_t da = smem_desc(a + kk * 32, 16, 1024);
                    uint64_t db = n_major_b(KIND) ? smem_desc(b + kk * 2048, 8192, 1024)
                                                  : smem_desc(b + kk * 32, 16, 1024);
                    wgmma_m64n256k16<n_major_b(KIND) ? 1 : 0>(acc, da, db, kt > 0 || kk > 0);
                }
                wgmma_commit();
                if (kt > 0) { /* the previous stage's products are done: hand it back */
                    wgmma_wait<1>();
                    if (tid % 32 == 0) mbar_arrive(&empty[prev]);
                }
                /* then a unit of the staged tile, while this stage's products run (after the
                 * hand-back, so a store or load that waits does not hold the producer back) */
                if (drain.next < drain_t<KIND>::UNITS) drain.step(hpre, out, width);
                prev = s;
                if (++s == STAGES) {
                    s = 0;
                    phase ^= 1;
                }
            }
            wgmma_wait<0>();
            fence_acc(acc);
            if (tid % 32 == 0) mbar_arrive(&empty[prev]);
            drain.finish(hpre, out, width); /* main loops shorter than the drain */
            warpgroup_bar(bar);             /* the staging buffer is free */
            stage_tile(stage_buf, acc, tid / 32, tid % 32);
            warpgroup_bar(bar); /* and holds this tile */
            drain.start((int64_t)tile.row0 + 64 * cw, tile.row_end,
                        (int64_t)tile.n_tile * (KIND == SWIGLU_FWD ? 128 : BN), hpre, width);
        }
        drain.finish(hpre, out, width);
    }
#endif
}

/* The tile list: ceil(n_e / 128) M tiles of n_tiles each per expert. */
bool make_groups(groups_t *g, const int64_t *offsets, int32_t el, int32_t n_tiles)
{
    g->count = el;
    g->n_tiles = n_tiles;
    g->tile_start[0] = 0;
    for (int32_t e = 0; e < el; e++) {
        int64_t rows = offsets[e + 1] - offsets[e];
        int64_t next = g->tile_start[e] + (rows + BM - 1) / BM * n_tiles;
        if (next > INT32_MAX || offsets[e + 1] > INT32_MAX) return false;
        g->tile_start[e + 1] = (int32_t)next;
        g->row_start[e] = (int32_t)offsets[e];
    }
    g->row_start[el] = (int32_t)offsets[el];
    return true;
}

/* The A map of R rows of K (row-major [R, K]), A_BOX-sized boxes. */
cudaError_t map_rows(CUtensorMap *m, const void *a, int64_t rows, int64_t k)
{
    const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)(rows > 0 ? rows : 1)};
    const cuuint64_t strides[1] = {(cuuint64_t)k * 2};
    const cuuint32_t box[2] = {BK, BM};
    return encode_map(m, a, 2, dims, strides, box);
}

/* The B map of El row-major [inner, outer] matrices: boxes of 64 x BK (N-major B: inner is
 * N) or BK x BN (K-major B: inner is K). */
cudaError_t map_weights(CUtensorMap *m, const void *b, int32_t el, int64_t inner, int64_t outer,
                        bool n_major)
{
    const cuuint64_t dims[3] = {(cuuint64_t)inner, (cuuint64_t)outer, (cuuint64_t)el};
    const cuuint64_t strides[2] = {(cuuint64_t)inner * 2, (cuuint64_t)inner * outer * 2};
    const cuuint32_t box_n[3] = {64, BK, 1}, box_k[3] = {BK, BN, 1};
    return encode_map(m, b, 3, dims, strides, n_major ? box_n : box_k);
}

template <int KIND>
cudaError_t launch(const CUtensorMap &ma, const CUtensorMap &mb, const groups_t &g, int64_t k,
                   int64_t width, void *hpre, void *out, int sms, cudaStream_t stream)
{
    int32_t total = g.tile_start[g.count];
    if (total == 0) return cudaSuccess;
    cudaError_t err = cudaFuncSetAttribute(expert_gemm<KIND>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (err != cudaSuccess) return err;
    int grid = total < sms ? total : sms;
    /* clang-format 14 reads a template's launch (<KIND><<<) as comparisons */
    // clang-format off
    expert_gemm<KIND><<<grid, THREADS, SMEM_BYTES, stream>>>(
        ma, mb, g, (int32_t)((k + BK - 1) / BK), width, (__nv_bfloat16 *)hpre,
        (__nv_bfloat16 *)out);
    // clang-format on
    return cudaGetLastError();
}

} /* namespace */

extern "C" bool moe_cuda_swiglu_gemm_supported(int device)
{
    return image_runs((const void *)expert_gemm<SWIGLU_FWD>, device, SMEM_BYTES);
}

extern "C" bool moe_cuda_swiglu_gemm_fits(int32_t el, int64_t h, int64_t f)
{
    return el >= 1 && el <= MOE_SWIGLU_GEMM_MAX_EXPERTS && h % 8 == 0 && f % 128 == 0 && h > 0;
}

extern "C" cudaError_t moe_cuda_swiglu_gemm_forward(void *hpre, void *act, const void *xp,
                                                    const void *w1, const int64_t *offsets,
                                                    int32_t el, int64_t h, int64_t f, int sms,
                                                    cudaStream_t stream)
{
    groups_t g;
    if (!make_groups(&g, offsets, el, (int32_t)(f / 128))) return cudaErrorInvalidValue;
    CUtensorMap ma, mb;
    cudaError_t err = map_rows(&ma, xp, offsets[el], h);
    if (err == cudaSuccess) err = map_weights(&mb, w1, el, 2 * f, h, true);
    if (err != cudaSuccess) return err;
    return launch<SWIGLU_FWD>(ma, mb, g, h, f, hpre, act, sms, stream);
}

extern "C" cudaError_t moe_cuda_swiglu_gemm_backward(void *d_hpre, const void *d_out,
                                                     const void *w2, const void *hpre,
                                                     const int64_t *offsets, int32_t el, int64_t h,
                                                     int64_t f, int sms, cudaStream_t stream)
{
    groups_t g;
    if (!make_groups(&g, offsets, el, (int32_t)((f + BN - 1) / BN))) return cudaErrorInvalidValue;
    CUtensorMap ma, mb;
    cudaError_t err = map_rows(&ma, d_out, offsets[el], h);
    if (err == cudaSuccess) err = map_weights(&mb, w2, el, h, f, false);
    if (err != cudaSuccess) return err;
    return launch<SWIGLU_BWD>(ma, mb, g, h, f, (void *)hpre, d_hpre, sms, stream);
}

extern "C" cudaError_t moe_cuda_grouped_gemm(void *c, const void *a, const void *b, bool b_k_major,
                                             const int64_t *offsets, int32_t el, int64_t k,
                                             int64_t n, int sms, cudaStream_t stream)
{
    groups_t g;
    if (!make_groups(&g, offsets, el, (int32_t)((n + BN - 1) / BN))) return cudaErrorInvalidValue;
    CUtensorMap ma, mb;
    cudaError_t err = map_rows(&ma, a, offsets[el], k);
    if (err == cudaSuccess)
        err = b_k_major ? map_weights(&mb, b, el, k, n, false)
                        : map_weights(&mb, b, el, n, k, true);
    if (err != cudaSuccess) return err;
    return b_k_major ? launch<PLAIN_K_MAJOR_B>(ma, mb, g, k, n, NULL, c, sms, stream)
                     : launch<PLAIN_N_MAJOR_B>(ma, mb, g, k, n, NULL, c, sms, stream);
}
