/*
 * The router's forward in one kernel for E <= 64 (moe_cuda_router_fused): logits f32 [N,E] =
 * x bf16 [N,H] . wg bf16 [H,E] on the tensor cores, then router_select's selection
 * (router_common.cuh) on the logits tile in shared memory, without a second pass over them.
 *
 * Below E = 64 the logits GEMM moves bytes, not math (N*H*2 bytes of x for 2*N*H*E flops), so
 * one pass over x that keeps the logits on chip is the whole cost. A block owns BM tokens and
 * all (up to 64, zero-padded) experts:
 *  - mainloop: x and wg tiles of BK = 64 hidden each stream through a STAGES-deep cp.async
 *    ring in shared memory (16-byte chunks XOR-swizzled by row so ldmatrix is conflict-free;
 *    rows past N and hidden past H zero-filled; the L2 fetches 256 bytes a row at once);
 *    bf16 mma.sync m16n8k16 with f32 accumulate; 8 warps of 32 tokens x 32 experts. Every
 *    address is computed once before the loop (a thread always copies chunk tid % 8 of rows
 *    tid / 8 + 32 j), so the loop is copies, ldmatrix and mma and the address arithmetic
 *    does not fill the issue slots (docs/cuda-backend.md, "Alternatives measured and not
 *    kept"); the sm_90a image runs wgmma on the same stages instead (see walk);
 *  - epilogue: the f32 logits tile goes to shared memory (reusing the ring), is written out
 *    once (the interface saves logits), and the selector runs on it from there;
 *  - the block's partials end like router_select's (select_reduce, same determinism).
 * Two 128-token blocks per SM (96 KiB ring each), so one block's epilogue overlaps the other's
 * loads; the split kernel for few tokens (below) runs one block an SM. Conditions: E <= 64
 * and E % 8 == 0 (16-byte wg chunks), H % 8 == 0, x / wg / logits 16-byte aligned
 * (moe_cuda_router_fused_supported).
 *
 * Shape legend: N tokens, H hidden, E experts (E <= 64), K top-k (K <= 8).
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_router, test_router_nan, test_router_large_logits)
 * Time: build/bench/bench_moe router (router_fwd, variant "fused")
 */
#include <atomic>

#include "ptx.cuh"
#include "router_common.cuh"
#include "sm90.cuh"

namespace fused
{
/* EP: the experts a tile holds (E <= 64, zero-padded); BK: hidden a stage, one 128-byte
 * swizzled row of bf16 */
constexpr int EP = 64, BK = 64, THREADS = MOE_TUNE_FUSED_THREADS, NWARPS = THREADS / 32;
constexpr int ROW_BYTES = BK * 2;      /* one tile row: 8 chunks of 16 bytes */
constexpr int PASS_ROWS = THREADS / 8; /* rows one pass of the block's copies covers */
constexpr int LDS = EP + 8; /* logits tile row stride (floats): conflict-free float2 stores */
constexpr uint32_t SMEM_ALIGN = 1024; /* router_fused's dynamic shared memory: alignment, slack */

/* sum_block_stats (router_common.cuh) keeps a partial for each of the block's warps */
static_assert(NWARPS <= MOE_TUNE_ROUTER_WARPS, "router_fused's warps fit sum_block_stats");
static_assert(MOE_TUNE_FUSED_MEDIUM_TILE_TOKENS != MOE_TUNE_FUSED_TILE_TOKENS &&
                  MOE_TUNE_FUSED_MEDIUM_CLUSTER != MOE_TUNE_FUSED_SMALL_CLUSTER &&
                  MOE_TUNE_FUSED_MEDIUM_CLUSTER > 1 && MOE_TUNE_FUSED_SMALL_CLUSTER > 1,
              "the tile and cluster sizes tell the configurations apart");

/* The tile configuration of BM-token tiles (kernels/tuning.h has the sizes and why). 128-token
 * tiles (the unsplit kernel and the small clusters): 4 stages of 24 KiB; the warps split the
 * tile's tokens and experts (4 x 2). 64-token tiles (the medium clusters): 8 stages of 16 KiB,
 * and the warps also split each hidden tile's four k16 steps in KG = 2 groups of 2 x 2 warps,
 * each group with its own partial tile, so that each A fragment is read from shared memory
 * twice instead of four times. */
template <int BM, int SPLIT = 1> struct cfg {
    static constexpr bool MEDIUM = BM == MOE_TUNE_FUSED_MEDIUM_TILE_TOKENS;
    static constexpr int ROWS = BM;
    static constexpr int STAGES = MEDIUM ? MOE_TUNE_FUSED_MEDIUM_STAGES : MOE_TUNE_FUSED_STAGES;
    static constexpr int KG = MEDIUM ? MOE_TUNE_FUSED_MEDIUM_KGROUPS : 1;
    static constexpr int WM = BM / 32, WN = NWARPS / KG / WM,
                         NT = EP / 8 / WN;  /* n8 tiles a warp */
    static constexpr int KK = BK / 16 / KG; /* k16 steps a warp per hidden tile */
    static constexpr int A_BYTES = BM * ROW_BYTES, STAGE_BYTES = A_BYTES + BK * ROW_BYTES;
    static constexpr int A_PASSES = BM / PASS_ROWS, B_PASSES = BK / PASS_ROWS;
    /* over the ring: KG partial logits tiles; past the ring and them (split: the other
     * blocks write it while this one may still be loading) the SPLIT blocks' sums of the rows
     * this block selects */
    static constexpr int RING = STAGES * STAGE_BYTES, TILE = BM * LDS * 4;
    static constexpr int RECV_AT = RING > KG *TILE ? RING : KG *TILE;
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
template <class C> static __device__ __forceinline__ uint32_t next_stage(uint32_t st, uint32_t ring)
{
    return st + C::STAGE_BYTES == ring + C::RING ? ring : st + C::STAGE_BYTES;
}

static __device__ __forceinline__ int swz(int row, int chunk)
{
    return row * ROW_BYTES + ((chunk ^ (row & 7)) << 4);
}

/* One thread's share of the tile copies: chunk `lc` of rows lr + PASS_ROWS * j, for x and wg.
 * Sources advance by one 64-wide hidden tile per step; smem offsets are fixed. */
template <class C> struct copier {
    const __nv_bfloat16 *xs, *ws;   /* this thread's first x and wg chunk of the current tile */
    const __nv_bfloat16 *x0, *w0;   /* in-bounds addresses for the zero-filling copies */
    int64_t x_pass, w_pass, w_step; /* elements: to the next pass's row; wg to the next tile */
    int64_t h, kc, k_left;          /* kc: this thread's hidden offset lc * 8 */
    unsigned x_rows;                /* bit j: x row of pass j is a token (< N) */
    uint32_t a_off, b_off;
    bool w_chunk; /* lc < E / 8: this thread copies wg */

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
            ptx::cp_async16(stage + a_off + j * PASS_ROWS * ROW_BYTES, ok ? xs + j * x_pass : x0,
                            ok);
        }
        if (w_chunk) {
#pragma unroll
            for (int j = 0; j < C::B_PASSES; j++) {
                bool ok = (threadIdx.x >> 3) + PASS_ROWS * j < k_left;
                ptx::cp_async16(stage + b_off + j * PASS_ROWS * ROW_BYTES,
                                ok ? ws + j * w_pass : w0, ok);
            }
        }
        xs += BK;
        ws += w_step;
        k_left -= BK;
    }
};

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
 * ahead than the mma.sync form, which it beats at the shapes measured: there the products
 * bound the walk (docs/cuda-backend.md, "Alternatives measured and not kept"). */
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
        ptx::cp_commit();
    }
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; i++) d[i] = 0.0f;
    sm90::fence_acc(d);
    uint32_t use = ring, load = ring + (C::STAGES - 2) * C::STAGE_BYTES;
    for (int kt = 0; kt < ktiles; kt++) {
        ptx::cp_wait<C::STAGES - 3>(); /* tile kt has landed (this thread's part) */
        sm90::fence_proxy_async_smem();
        __syncthreads(); /* ... everyone's; and the products of step kt-2 have read their stage */
        if (kt + C::STAGES - 2 < ktiles) cp.issue(load);
        ptx::cp_commit();
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
    ptx::cp_wait<0>();
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
        ptx::cp_commit();
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
        ptx::cp_wait<C::STAGES - 2>(); /* tile kt has landed (this thread's part) */
        __syncthreads();               /* ... everyone's; and the stage read in step kt-1 is free */
        if (kt + C::STAGES - 1 < ktiles) cp.issue(load);
        ptx::cp_commit();
        load = next_stage<C>(load, ring);
#pragma unroll
        for (int q = 0; q < C::KK; q++) {
            uint32_t af[2][4], bf[C::NT][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                ptx::ldsm<false>(af[mt], use + a_x[q] + mt * 16 * ROW_BYTES);
#pragma unroll
            for (int np = 0; np < C::NT / 2; np++) /* bf[2np][0..1], bf[2np+1][0..1] */
                ptx::ldsm<true>(&bf[2 * np][0], use + b_x[np] + b_k[q]);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < C::NT; nt++)
                    ptx::mma_bf16(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
        }
        use = next_stage<C>(use, ring);
    }
    ptx::cp_wait<0>();
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
 * on timing) and selects those rows. Pushing the partials, rather than each block pulling
 * the others' tiles, spares a second cluster barrier that would keep a block from leaving
 * while others still read its tile. */
template <int BM, int LANES, int SPLIT>
__global__ void __launch_bounds__(fused::THREADS, SPLIT == 1 ? MOE_TUNE_FUSED_BLOCKS_PER_SM : 1)
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
    unsigned rank = SPLIT == 1 ? 0 : ptx::cluster_rank();
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
            *(uint4 *)(fsmem + st * C::STAGE_BYTES + C::A_BYTES + swz(r, c)) = make_uint4(0, 0, 0,
                                                                                          0);
    }
    for (int j = threadIdx.x; j < e; j += THREADS) s_count[j] = 0;

    /* split: the others' shared memory may be written only once they run; this phase of the
     * cluster barrier is waited for just before the first such write */
    if constexpr (SPLIT > 1) ptx::cluster_arrive_relaxed();

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
        ptx::cluster_wait();                         /* every block of the cluster runs */
        for (int i = threadIdx.x; i < BM * (EP / 4); i += THREADS) {
            int r = i / (EP / 4), c = (i % (EP / 4)) * 4;
            const float *src = (const float *)fsmem + r * LDS + c;
            float4 v = *(const float4 *)src;
#pragma unroll
            for (int g = 1; g < C::KG; g++) add4(v, *(const float4 *)(src + g * (C::TILE / 4)));
            ptx::st_cluster(recv + rank * SLOT + (r % OWN_ROWS) * LDS + c, r / OWN_ROWS, v);
        }
        ptx::cluster_arrive(); /* every block's sums have landed */
        ptx::cluster_wait();
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
    sel.finish(s_mean, s_stats, s_count, e, scratch, state, {score_mean, stats, counts, e, n});
}

/* ---- host: grid rules and launch ------------------------------------------------------------ */

/* The grid: MOE_TUNE_FUSED_TILE_TOKENS-token tiles, one block each; with few tokens, clusters
 * that split H (router_fused), by rules of N alone (like select_iters, so the result does not
 * depend on the device): small and medium clusters (kernels/tuning.h). */
static int64_t fused_tiles(int64_t n, int bm) { return (n + bm - 1) / bm; }

/* tokens a tile, by cluster size: the one rule the grid (fused_blocks) and the kernel's
 * template (launch_fused) share */
static constexpr int fused_tile_tokens(int split)
{
    return split == MOE_TUNE_FUSED_MEDIUM_CLUSTER ? MOE_TUNE_FUSED_MEDIUM_TILE_TOKENS
                                                  : MOE_TUNE_FUSED_TILE_TOKENS;
}

/* the split kernel's cluster size for N (1: one block a tile, no split) */
static int fused_split(int64_t n)
{
    return n <= MOE_TUNE_FUSED_SMALL_MAX_TOKENS    ? MOE_TUNE_FUSED_SMALL_CLUSTER
           : n <= MOE_TUNE_FUSED_MEDIUM_MAX_TOKENS ? MOE_TUNE_FUSED_MEDIUM_CLUSTER
                                                   : 1;
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

extern "C" bool moe_cuda_router_fused_supported(int64_t h, int32_t e, const void *x, const void *wg,
                                                const float *logits)
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
    /* The shared-memory limit is a property of the kernel on each device: raise it once on
     * each. A process-wide cache, the one in the kernels, because the attribute itself is
     * process-wide; atomic, since runtimes on several threads may launch at once (setting it
     * twice is harmless). */
    static std::atomic<uint64_t> sized{0};
    uint64_t bit = dev < 64 ? 1ull << dev : 0;
    if (!bit || !(sized.load(std::memory_order_acquire) & bit)) {
        int most = (int)(fused::SMEM_ALIGN + C::MAIN + select_smem(fused::NWARPS, fused::EP));
        cudaError_t rc = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              most);
        if (rc != cudaSuccess) return rc;
        sized.fetch_or(bit, std::memory_order_release);
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
        cudaError_t r = split == MOE_TUNE_FUSED_SMALL_CLUSTER
                            ? go(launch_fused<L, MOE_TUNE_FUSED_SMALL_CLUSTER>)
                        : split == MOE_TUNE_FUSED_MEDIUM_CLUSTER
                            ? go(launch_fused<L, MOE_TUNE_FUSED_MEDIUM_CLUSTER>)
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
