/*
 * The router forward in one kernel for Hopper (sm_90a) at 64 < E <= 256, where the logits GEMM
 * is bound by the tensor cores rather than by reading x: logits f32 [N,E] = x bf16 [N,H] .
 * wg bf16 [H,E] with TMA and wgmma, then router_select.cuh's selection, without a second
 * kernel. Beside cuBLAS's GEMM + router_select this saves the selection's own pass: at
 * N=65536 H=7168 E=256 K=8 that pass (0.087 ms, bound by instruction issue) is what puts the
 * forward over its target.
 *
 * A persistent CTA of one CTA per SM walks 128-token tiles (all E experts, zero-padded to 256,
 * in one tile) with 12 warps:
 *  - a producer thread (warp 0) issuing TMA loads into a 4-stage ring of 128 x 64 x tiles and four
 *    64 x 64 wg boxes (wg is N-major: wgmma's transposed-B form, as swiglu_gemm_sm90.cu's
 *    forward), 128-byte swizzled; rows past N, hidden past H and experts past E read zeros;
 *  - two MMA warpgroups of 64 tokens x 256 experts each (wgmma m64n256k16, f32 accumulators
 *    in registers), which store their logits straight from the registers and go on to the
 *    next tile;
 *  - three selection warps (1-3), which read the finished tile's rows back (from L2) and run
 *    the selector on them while the next tile's products run: the selection hides behind the
 *    tensor cores instead of adding to them. On a CTA's last tile the MMA warps help with it.
 * 384 threads leave each 168 registers, enough for the MMA warps' 128 accumulators; a fourth
 * warpgroup of selection warps would cap every thread at 128, too few for them.
 * Hand-off: ready[slot] (the MMA warps' logits are out) and done[slot] (the selection is
 * through them and its shared rows are free), two slots, so the MMA warps run at most two
 * tiles ahead.
 *
 * Statistics: a tile's 128 tokens are 16 chunks of 8; a chunk's sums go to its own row of
 * shared memory whichever warp ran it, the tile's partial row is the chunks' sum in order, and
 * the tiles' rows are reduced as router_select's blocks are (select_reduce). So the result
 * depends on N, E and the inputs alone, not on the SM count or on which CTA ran a tile.
 *
 * Shape legend: N tokens, H hidden, E experts, K top-k.
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels.h"
#include "router_select.cuh"
#include "sm90.cuh"

namespace {

using namespace sm90;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4;
constexpr int A_TILE_BYTES = BM * BK * 2; /* 16 KiB */
constexpr int B_BOX_BYTES = 64 * BK * 2;  /* 8 KiB: 64 experts x 64 hidden */
constexpr int STAGE_BYTES = A_TILE_BYTES + 4 * B_BOX_BYTES;
constexpr int CHUNK = 8, CHUNKS = BM / CHUNK;
constexpr int THREADS = 384;
constexpr int SEL_WARP0 = 1, SEL_WARPS = 3, MMA_WARP0 = 4; /* 1-3 select, 4-11 multiply */
constexpr int TAIL_WARPS = 8 + SEL_WARPS; /* the last tile's selection */
constexpr int SEL_BARRIER = 1, TAIL_BARRIER = 2;
/* ring, chunk rows of P_e sums [CHUNKS][256] and stats [CHUNKS][2], counts [256], barriers */
constexpr int SMEM_BYTES = 1024 /* alignment slack */ + STAGES * STAGE_BYTES +
                           4 * (CHUNKS * BN + CHUNKS * 2 + BN) + 8 * (2 * STAGES + 4);

struct shared_t {
    uint8_t *ring;
    float *s_mean, *s_stats;
    int32_t *s_count;
    uint64_t *full, *empty, *ready, *done;
};

__device__ __forceinline__ shared_t carve(uint8_t *raw)
{
    shared_t s;
    s.ring = (uint8_t *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
    s.s_mean = (float *)(s.ring + STAGES * STAGE_BYTES);
    s.s_stats = s.s_mean + CHUNKS * BN;
    s.s_count = (int32_t *)(s.s_stats + CHUNKS * 2);
    s.full = (uint64_t *)(s.s_count + BN);
    s.empty = s.full + STAGES;
    s.ready = s.empty + STAGES;
    s.done = s.ready + 2;
    return s;
}

struct args_t {
    const float *bias;
    int64_t n;
    int e, k, score_fn, gsz, tiles, k_tiles;
    bool renorm;
    float *logits;
    int32_t *topk_idx;
    float *topk_w;
    float *scratch;
    unsigned *tickets;
    int32_t *counts;
    float *score_mean, *stats;
};

/* Chunks [first, CHUNKS) step `step` of tile t through `sel`, each folded into its row. */
template <int LANES>
__device__ void select_chunks(selector<8, LANES> &sel, const args_t &a, const shared_t &sh,
                              int64_t t, int first, int step)
{
    constexpr int GROUPS = 32 / LANES;
    int lane = threadIdx.x % 32;
    int64_t row0 = t * BM;
    int rows = (int)min((int64_t)BM, a.n - row0);
    for (int c = first; c < CHUNKS; c += step) {
        sel.clear();
        for (int p = c * CHUNK; p < (c + 1) * CHUNK && p < rows; p += GROUPS) {
            int r = p + lane / LANES;
            bool valid = r < rows;
            /* the next pass's row into L1 while this one computes */
            if (r + GROUPS < rows)
                asm volatile("prefetch.global.L1 [%0];" ::"l"(a.logits + (row0 + r + GROUPS) * a.e +
                                                              (lane % LANES) * 8));
            sel.token(a.logits + (row0 + (valid ? r : 0)) * a.e, row0 + r, valid, a.e, a.k,
                      a.score_fn, a.renorm, true, lane, a.topk_idx, a.topk_w, sh.s_count);
        }
        sel.fold(sh.s_mean, sh.s_stats, c, a.e);
    }
}

template <int LANES>
__global__ void __launch_bounds__(THREADS, 1)
    router_fused_sm90(const __grid_constant__ CUtensorMap map_x,
                      const __grid_constant__ CUtensorMap map_w, const __grid_constant__ args_t a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) /* the only image built (CMakeLists.txt) */
    extern __shared__ uint8_t smem_raw[];
    shared_t sh = carve(smem_raw);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&sh.full[s], 1);
            mbar_init(&sh.empty[s], 8); /* lane 0 of each MMA warp */
        }
        for (int s = 0; s < 2; s++) {
            mbar_init(&sh.ready[s], 8);
            mbar_init(&sh.done[s], 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    for (int j = threadIdx.x; j < BN; j += THREADS) sh.s_count[j] = 0;
    __syncthreads();

    if (warp == 0) { /* producer: one thread issues every TMA load */
        int s = 0;
        uint32_t phase = 0;
        for (int32_t t = blockIdx.x; t < a.tiles && threadIdx.x == 0; t += gridDim.x) {
            for (int32_t kt = 0; kt < a.k_tiles; kt++) {
                mbar_wait(&sh.empty[s], phase ^ 1);
                mbar_expect_tx(&sh.full[s], STAGE_BYTES);
                uint8_t *st = sh.ring + s * STAGE_BYTES;
                tma_load_2d(st, &map_x, kt * BK, t * BM, &sh.full[s]);
                for (int q = 0; q < 4; q++)
                    tma_load_2d(st + A_TILE_BYTES + q * B_BOX_BYTES, &map_w, q * 64, kt * BK,
                                &sh.full[s]);
                if (++s == STAGES) { s = 0; phase ^= 1; }
            }
        }
    } else if (warp >= MMA_WARP0) { /* MMA: 64 tokens each */
        int cw = (warp - MMA_WARP0) / 4, w = (warp - MMA_WARP0) % 4;
        float acc[128];
        int s = 0, i = 0;
        uint32_t phase = 0;
        int32_t t = blockIdx.x;
        for (; t < a.tiles; t += gridDim.x, i++) {
            int prev = 0;
            for (int32_t kt = 0; kt < a.k_tiles; kt++) {
                mbar_wait(&sh.full[s], phase);
                uint32_t x = smem_u32(sh.ring + s * STAGE_BYTES) + cw * (64 * 128);
                uint32_t b = smem_u32(sh.ring + s * STAGE_BYTES + A_TILE_BYTES);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; kk++)
                    wgmma_m64n256k16<1>(acc, smem_desc(x + kk * 32, 16, 1024),
                                        smem_desc(b + kk * 2048, B_BOX_BYTES, 1024),
                                        kt > 0 || kk > 0);
                wgmma_commit();
                if (kt > 0) { /* the previous stage's products are done: hand it back */
                    wgmma_wait<1>();
                    if (lane == 0) mbar_arrive(&sh.empty[prev]);
                }
                prev = s;
                if (++s == STAGES) { s = 0; phase ^= 1; }
            }
            wgmma_wait<0>();
            fence_acc(acc);
            if (lane == 0) mbar_arrive(&sh.empty[prev]);
            /* fragment of m64n256: register 4b + j is token w*16 + lane/4 (+8 for j >= 2),
             * expert 8b + 2 (lane % 4) + (j & 1) */
            int64_t r = (int64_t)t * BM + 64 * cw + 16 * w + lane / 4;
            float *lo = a.logits + r * a.e, *hi = lo + 8 * a.e;
#pragma unroll
            for (int bb = 0; bb < 32; bb++) {
                int col = 8 * bb + 2 * (lane % 4);
                if (col < a.e) {
                    if (r < a.n) *(float2 *)(lo + col) = make_float2(acc[4 * bb], acc[4 * bb + 1]);
                    if (r + 8 < a.n)
                        *(float2 *)(hi + col) = make_float2(acc[4 * bb + 2], acc[4 * bb + 3]);
                }
            }
            int slot = i & 1;
            if (i >= 2) mbar_wait(&sh.done[slot], ((i >> 1) - 1) & 1);
            __threadfence_block(); /* the logits, before the warp's arrival */
            __syncwarp();
            if (lane == 0) mbar_arrive(&sh.ready[slot]);
        }
        /* the CTA's last tile: chunks v and v + TAIL_WARPS, v = this warp's index 0-7, once
         * the selection warps are through the tile before (its chunk rows and counts) */
        if (i > 0) {
            t -= gridDim.x;
            i--;
            selector<8, LANES> sel(a.bias, a.e, lane % LANES);
            mbar_wait(&sh.ready[i & 1], (i >> 1) & 1);
            if (i > 0) mbar_wait(&sh.done[(i - 1) & 1], ((i - 1) >> 1) & 1);
            select_chunks<LANES>(sel, a, sh, t, warp - MMA_WARP0, TAIL_WARPS);
            asm volatile("bar.arrive %0, %1;" ::"r"(TAIL_BARRIER), "r"(32 * TAIL_WARPS)
                         : "memory");
        }
    } else { /* selection */
        team_t team = {32 * SEL_WARPS, (int)threadIdx.x - 32 * SEL_WARP0, SEL_BARRIER};
        selector<8, LANES> sel(a.bias, a.e, lane % LANES);
        int i = 0;
        for (int32_t t = blockIdx.x; t < a.tiles; t += gridDim.x, i++) {
            int slot = i & 1;
            bool last = t + (int32_t)gridDim.x >= a.tiles;
            mbar_wait(&sh.ready[slot], (i >> 1) & 1);
            if (!last) {
                select_chunks<LANES>(sel, a, sh, t, warp - SEL_WARP0, SEL_WARPS);
                team.sync();
            } else { /* with the MMA warps, as tail warps 8, 9, 10 */
                select_chunks<LANES>(sel, a, sh, t, 8 + warp - SEL_WARP0, TAIL_WARPS);
                asm volatile("bar.sync %0, %1;" ::"r"(TAIL_BARRIER), "r"(32 * TAIL_WARPS)
                             : "memory");
            }
            write_partial(team, CHUNKS, sh.s_mean, sh.s_stats, sh.s_count, a.e, a.scratch,
                          a.tiles, t, a.gsz, a.tickets,
                          {a.score_mean, a.stats, a.counts, a.e, 1.0 / (double)a.n});
            for (int j = team.rank; j < BN; j += team.size) sh.s_count[j] = 0;
            team.sync();
            if (team.rank == 0) mbar_arrive(&sh.done[slot]); /* rows, counts and logits free */
        }
    }
#endif
}

template <int LANES>
cudaError_t launch(const CUtensorMap &mx, const CUtensorMap &mw, const args_t &a,
                   cudaStream_t stream)
{
    auto kernel = router_fused_sm90<LANES>;
    int device, sms;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess)
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (err != cudaSuccess) return err;
    kernel<<<a.tiles < sms ? a.tiles : sms, THREADS, SMEM_BYTES, stream>>>(mx, mw, a);
    return cudaGetLastError();
}

} /* namespace */

extern "C" bool moe_cuda_router_sm90_supported(int device)
{
    return image_runs((const void *)router_fused_sm90<32>, device, SMEM_BYTES);
}

extern "C" bool moe_cuda_router_sm90_fits(int64_t h, int32_t e, const void *x, const void *wg,
                                          const float *logits)
{
    return e > 64 && e <= BN && e % 8 == 0 && h % 8 == 0 && (uintptr_t)x % 16 == 0 &&
           (uintptr_t)wg % 16 == 0 && (uintptr_t)logits % 16 == 0;
}

extern "C" cudaError_t moe_cuda_router_fused_sm90(const void *x, const void *wg, const float *bias,
                                                  int64_t n, int64_t h, int32_t e, int32_t k,
                                                  int score_fn, bool renormalize, float *logits,
                                                  int32_t *topk_idx, float *topk_w,
                                                  int32_t *counts, float *score_mean,
                                                  float *stats, float *scratch,
                                                  unsigned *tickets, cudaStream_t stream)
{
    int64_t tiles = (n + BM - 1) / BM;
    if (!moe_cuda_router_sm90_fits(h, e, x, wg, logits) || k < 1 || k > MOE_ROUTER_MAX_K ||
        n <= 0 || tiles > INT32_MAX || (h + BK - 1) / BK > INT32_MAX)
        return cudaErrorInvalidValue;
    CUtensorMap mx, mw;
    const cuuint64_t dx[2] = {(cuuint64_t)h, (cuuint64_t)n};
    const cuuint64_t sx[1] = {(cuuint64_t)h * 2};
    const cuuint32_t bx[2] = {BK, BM};
    const cuuint64_t dw[2] = {(cuuint64_t)e, (cuuint64_t)h};
    const cuuint64_t sw[1] = {(cuuint64_t)e * 2};
    const cuuint32_t bw[2] = {64, BK};
    cudaError_t err = encode_map(&mx, x, 2, dx, sx, bx);
    if (err == cudaSuccess) err = encode_map(&mw, wg, 2, dw, sw, bw);
    if (err != cudaSuccess) return err;
    args_t a = {bias, n, e, k, score_fn, select_group(tiles), (int)tiles, (int)((h + BK - 1) / BK),
                renormalize, logits, topk_idx, topk_w, scratch, tickets, counts, score_mean, stats};
    return select_lanes(e) == 32 ? launch<32>(mx, mw, a, stream) : launch<16>(mx, mw, a, stream);
}
