/*
 * The tuned thresholds of the CUDA backend, in one table: the shape rules that pick a path
 * (fused router or cuBLAS GEMM + selection, the fused kernel's cluster splits, padded,
 * strided-batched, looped or side-streamed expert GEMMs) and the block, pass and tile sizes
 * chosen by measurement, each entry with what it decides and the measurement behind it.
 * Figures are from the H200 (132 SMs). Every rule takes the shape (N, H, E, rows an expert)
 * alone, never the device, so a grid, and with it a reduction order and the result, is the
 * same on every GPU.
 *
 * What belongs here: a value chosen by measuring it against others that are also correct (a
 * path's threshold by shape; a block, pass, stage, tile or cluster size), which a port to
 * another GPU would measure again. What stays beside its kernel, with its reason there: a
 * value the code or the hardware fixes (an instruction's shape, a swizzle or an alignment, the
 * 4 KiB of kernel parameters, a shared-memory budget, the router accumulators' bit layout, a
 * value derived from others); a size in a launcher's interface that its callers must know
 * (kernels.h: MOE_MT_CHUNK, MOE_ROUTER_MAX_E); and a plain default nobody has measured against
 * another (an element-wise kernel's 256-thread blocks, the plan's chunk of 1024 slots), which
 * moves here with its figure once it is measured.
 *
 * Plain C macros: the C backend (src/backend/cuda), the router kernels and the sm_90a object
 * library (which sees only kernels/) include it alike.
 *
 * Shape legend: N tokens, H hidden, E experts, El local experts.
 */
#ifndef MOE_KERNELS_TUNING_H
#define MOE_KERNELS_TUNING_H

/* ---- the GPU the fixed grid rules are sized for --------------------------------------------- */

/* SMs of one wave (the H100's and H200's 132): a constant, not the device's count, so that
 * grids depend on the shape alone. */
#define MOE_TUNE_WAVE_SMS 132

/* ---- router: selection after the logits GEMM (router_select.cu), d logits ------------------- */

/* Warps a block of the per-token kernels (router_select, router_dlogits). */
#define MOE_TUNE_ROUTER_WARPS 8

/* router_select's blocks an SM with 8 experts a lane, two tokens a warp pass: 115-128
 * registers, no spills. Three blocks (80 registers) spill 100-870 bytes and run slower
 * (E = 256: 0.0687 vs 0.0680 ms; E = 64: 0.0214 vs 0.0187 ms); with one token a pass, three
 * blocks at 80 registers are that form's best (0.071 ms at E = 256). */
#define MOE_TUNE_SELECT_BLOCKS_PER_SM 2

/* Most tokens a warp handles, one lane group's token a pass: router_select sizes its grid to
 * about one wave of MOE_TUNE_WAVE_SMS x MOE_TUNE_SELECT_BLOCKS_PER_SM blocks, with at most
 * this many passes. Fewer, longer-lived blocks beat 64 warps an SM with at most 8 passes: the
 * selection takes 0.026 against 0.031 ms (E=64) and 0.110 against 0.114 ms (E=256) at
 * N=65536. */
#define MOE_TUNE_SELECT_MAX_PASSES 64

/* router_dlogits' grid: at most this many blocks an SM of MOE_TUNE_WAVE_SMS, a grid-stride
 * loop over the rest. */
#define MOE_TUNE_DLOGITS_BLOCKS_PER_SM 16

/* ---- router: the fused logits GEMM + selection (router_fused.cu), E <= 64 ------------------- */

/* Threads a block of the fused kernel: 8 warps, 4 x 2 over a 128-token tile's tokens and
 * experts. 4 warps (with the copies' addresses computed in the loop) took 0.190 against
 * 0.165 ms at N=65536 H=4096 E=64 (docs/cuda-backend.md, "Alternatives measured and not
 * kept"). */
#define MOE_TUNE_FUSED_THREADS 256
/* Tokens a block's tile for many tokens. 256-token blocks of 16 warps (one an SM, so no
 * epilogue overlap; wg traffic halved) run slower: 0.170 vs 0.165 ms at N=65536 H=4096 E=64. */
#define MOE_TUNE_FUSED_TILE_TOKENS 128
/* Blocks an SM on those tiles (96 KiB ring each), so one block's epilogue overlaps the other's
 * loads. */
#define MOE_TUNE_FUSED_BLOCKS_PER_SM 2
/* cp.async ring stages of those tiles (24 KiB each). */
#define MOE_TUNE_FUSED_STAGES 4

/* Few tokens: clusters of blocks split H, at one block an SM (the shared memory of both
 * configurations allows no more). Up to MOE_TUNE_FUSED_SMALL_MAX_TOKENS, clusters of
 * MOE_TUNE_FUSED_SMALL_CLUSTER blocks on MOE_TUNE_FUSED_TILE_TOKENS-token tiles: at N <= 2048
 * 0.4-0.6 us ahead of the clusters below. */
#define MOE_TUNE_FUSED_SMALL_MAX_TOKENS 2048 /* most tokens for the small clusters */
#define MOE_TUNE_FUSED_SMALL_CLUSTER 4       /* blocks a small cluster */
/* Up to MOE_TUNE_FUSED_MEDIUM_MAX_TOKENS (as many tiles as clusters fit one wave, one block
 * an SM), clusters of MOE_TUNE_FUSED_MEDIUM_CLUSTER blocks on
 * MOE_TUNE_FUSED_MEDIUM_TILE_TOKENS-token tiles. Clusters of 4 there run two blocks on some SMs
 * (only 30 clusters of 4 fit at one block an SM), whose walks end ~3 us after the median's;
 * clusters of 2 fit 66. N=4096 H=2048: clusters of 2 17.1-17.3 us against 19.7-20.1 for
 * clusters of 4. */
#define MOE_TUNE_FUSED_MEDIUM_CLUSTER 2      /* blocks a medium cluster */
#define MOE_TUNE_FUSED_MEDIUM_TILE_TOKENS 64 /* tokens a medium cluster's tile */
#define MOE_TUNE_FUSED_MEDIUM_MAX_TOKENS                                                           \
    ((MOE_TUNE_WAVE_SMS / MOE_TUNE_FUSED_MEDIUM_CLUSTER) * MOE_TUNE_FUSED_MEDIUM_TILE_TOKENS)
/* The medium tiles' ring stages (16 KiB each) and k-groups (warp groups that split each hidden
 * tile's k16 steps, each with its own partial tile). N=4096: 2 k-groups 0.1-0.4 us ahead of
 * 4; 4 stages 0.3-0.5 us and 6 up to 0.3 us behind 8. */
#define MOE_TUNE_FUSED_MEDIUM_STAGES 8  /* ring stages */
#define MOE_TUNE_FUSED_MEDIUM_KGROUPS 2 /* k-groups */

/* ---- router: which forward runs (src/backend/cuda/cuda_ops.c) ------------------------------- */

/* Where the fused kernel applies (moe_cuda_router_fused_supported), it runs instead of the
 * cuBLAS GEMM + router_select from MOE_TUNE_ROUTER_FUSED_MIN_TOKENS tokens, for H up to
 * MOE_TUNE_ROUTER_FUSED_MAX_SHORT_H, and for H up to MOE_TUNE_ROUTER_FUSED_MAX_SPLIT_H where
 * clusters split H (moe_cuda_router_fused_splits). It saves the selection's second pass and a
 * launch, but each block walks all of H. Microseconds, fused vs GEMM + selection in the same
 * runs:
 *  - one block a tile: N=512 H=256 11.2-12.2 vs 10.4-18.7 (medians 11.6 vs 13.2); N=1024
 *    H=512 13.6-15.2 vs 11.7-13.4; N=2048 H=1024 20-22 vs 13-18; N=4096 H=2048 30-32 vs
 *    17-19; N=16384 H=4096 50 vs 48; N=65536 H=4096 159 vs 176;
 *  - H split over clusters: N=1024 H=512 11.5-12.2 vs 10.9-11.8; N=2048 H=1024 12.7-13.4 vs
 *    11.8-13.4, the one launch taken for its steadiness (GEMM + selection spans 12.3-17.5 over
 *    30 runs: two launches, one of them cuBLAS's, at the host's pace); N=4096 H=2048 15.5 vs
 *    16.9 with the sm_90a image's wgmma walk (16.1-16.6 vs 16.4-16.7 with the mma.sync walk).
 * From 264 blocks of 128 tokens (two for each of 132 SMs) the fused kernel wins at any H;
 * below, while a block's walk of H costs less than a launch. */
#define MOE_TUNE_ROUTER_FUSED_MIN_TOKENS (128 * 264) /* fused at any H */
#define MOE_TUNE_ROUTER_FUSED_MAX_SHORT_H 512        /* fused at any N */
#define MOE_TUNE_ROUTER_FUSED_MAX_SPLIT_H 2048       /* fused while clusters split H */

/* ---- experts: how the per-expert GEMMs run (src/backend/cuda/cuda_experts.c) ---------------- */

/* Side streams (each with its own cuBLAS handle and workspace) the expert GEMMs fan out over. */
#define MOE_TUNE_SIDE_STREAMS 4

/* Padding every expert to the most rows (rounded up to MOE_TUNE_PAD_ROW_ALIGN) lets its GEMMs
 * run as one strided-batched call a kind: taken for at least MOE_TUNE_PAD_MIN_EXPERTS experts
 * under MOE_TUNE_PAD_MAX_MEAN_ROWS rows each on average (there the per-expert loop is launch-
 * and wave-bound), while the filler stays at most 1/MOE_TUNE_PAD_FILLER_DIVISOR of the rows
 * (measured: docs/cuda-backend.md). */
#define MOE_TUNE_PAD_MIN_EXPERTS 16     /* fewest experts to pad */
#define MOE_TUNE_PAD_MAX_MEAN_ROWS 2048 /* mean rows an expert below which to pad */
#define MOE_TUNE_PAD_ROW_ALIGN 8        /* padded stride: a multiple of these rows */
#define MOE_TUNE_PAD_FILLER_DIVISOR 4   /* filler at most 1/4 of the rows */

/* AUTO's mode (docs/cuda-backend.md): strided batched when every expert has the same rows and
 * there are at least MOE_TUNE_BATCHED_MIN_EXPERTS experts or fewer than
 * MOE_TUNE_BATCHED_MAX_ROWS rows each; else side streams for at least
 * MOE_TUNE_STREAMS_MIN_EXPERTS experts under MOE_TUNE_STREAMS_MAX_MEAN_ROWS rows each on
 * average; else the loop on the current stream (a few large experts). */
#define MOE_TUNE_BATCHED_MIN_EXPERTS 16     /* equal rows: batched from these experts */
#define MOE_TUNE_BATCHED_MAX_ROWS 4096      /* ... or below these rows each */
#define MOE_TUNE_STREAMS_MIN_EXPERTS 4      /* side streams from these experts */
#define MOE_TUNE_STREAMS_MAX_MEAN_ROWS 2048 /* ... below these mean rows each */

/* Uneven rows on Hopper, where the grouped sm_90a kernels fit: those kernels (one launch a
 * GEMM kind over the real row counts, tiles over the concatenated rows) for the GEMMs whose M
 * is n_e, from MOE_TUNE_HOPPER_MIN_EXPERTS experts, under MOE_TUNE_HOPPER_MAX_MEAN_ROWS rows
 * each on average or with an average expert's forward (6 n H F FLOPs) under
 * MOE_TUNE_HOPPER_MAX_EXPERT_GFLOP. The second bound is cuBLAS's host cost: a cublasGemmEx on
 * sizes it has not met costs the host tens of microseconds (40-90 us measured: its
 * heuristics), and in training the counts change every step. Skewed loads with the counts
 * changed before every run, forward / backward ms: 64 x 1536 x 2048 x 1408 (a 26.6 GFLOP
 * expert, ~38 us of GPU for its two calls) side streams 8.20 / 24.52, loop 17.89 / 24.74,
 * kernels 2.65 / 6.38 (side streams on repeated counts: 2.99 / 6.36); 32 x 1024 x 7168 x 2048
 * (90 GFLOP) side streams 4.63 / 14.77, loop 13.19 / 22.23, kernels 4.69 / 10.19. The calls
 * hide that cost from about 2 x 85 us of GPU work an expert, ~120 GFLOP. On counts met before, the
 * kernels win at 256-512 rows an expert and tie or lose by up to 10% from 1024 (forward ms,
 * kernels vs side streams: 64 x 512 x 2048 x 1408 skewed 0.97 vs 1.55; 128 x 256 x 2048 x 768
 * routed 0.63 vs 3.27; 64 x 1536 x 2048 x 1408 skewed 3.03 vs 2.99, hot 3.17 vs 2.90;
 * 32 x 1024 x 7168 x 2048 routed 4.93 vs 4.60). The spread of the load does not move the
 * choice: a cost model that charged every near-empty expert a cuBLAS call's floor lost by up
 * to 10%, the near-empty experts' calls running on the side streams beside the large ones.
 * Their dW GEMMs on cuBLAS's grouped GEMM from MOE_TUNE_GROUPED_DW_MIN_EXPERTS experts under
 * MOE_TUNE_GROUPED_DW_MAX_MEAN_ROWS rows each, else per expert as above. Backward ms with
 * every GEMM on cuBLAS's grouped GEMM (mode grouped) against side streams: 128 x 256 x 2048 x
 * 768 routed 3.11 vs 6.03, 64 x 512 x 2048 x 1408 routed 3.98 vs 3.14. bench/results/experts.md
 * has every load. */
#define MOE_TUNE_HOPPER_MIN_EXPERTS 16        /* grouped kernels from these experts */
#define MOE_TUNE_HOPPER_MAX_MEAN_ROWS 1024    /* ... below these mean rows each */
#define MOE_TUNE_HOPPER_MAX_EXPERT_GFLOP 120  /* ... or below an expert's forward GFLOP */
#define MOE_TUNE_GROUPED_DW_MIN_EXPERTS 128   /* cuBLAS grouped dW from these experts */
#define MOE_TUNE_GROUPED_DW_MAX_MEAN_ROWS 512 /* ... below these mean rows each */

#endif /* MOE_KERNELS_TUNING_H */
