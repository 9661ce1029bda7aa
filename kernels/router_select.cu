/*
 * The router's selection after cuBLAS's logits GEMM (moe_cuda_router_select): from logits f32
 * [N,E], each token's scores (softmax or sigmoid), top-k on score + bias, the weights
 * (renormalised or not), the per-expert counts and P_e, and the z and entropy sums, in one
 * kernel. A group of LANES lanes holds one token's row in registers (router_common.cuh); each
 * warp works on two passes' tokens at once, so that their chains of dependent reductions
 * overlap, and the blocks' statistics meet in select_reduce (deterministic, no float atomics).
 *
 * Shape legend: N tokens, E experts (E <= 512), K top-k (K <= 8).
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_router, test_router_nan, test_router_large_logits)
 * Time: build/bench/bench_moe router (router_fwd, variant "gemm+select"; router_select_only)
 */
#include "router_common.cuh"

/* Each warp runs 32/LANES tokens at once (one per lane group), `iters` times. */
template <int EPL, int LANES>
__global__ void __launch_bounds__(MOE_TUNE_ROUTER_WARPS * 32,
                                  EPL == 8 ? MOE_TUNE_SELECT_BLOCKS_PER_SM : 1)
    router_select(const float *__restrict__ logits, const float *__restrict__ bias, int64_t n,
                  int e, int k, int score_fn, bool renorm, bool vec, int32_t *__restrict__ topk_idx,
                  float *__restrict__ topk_w, float *scratch, router_state *state,
                  int32_t *__restrict__ counts, float *__restrict__ score_mean,
                  float *__restrict__ stats, int iters)
{
    constexpr int GROUPS = 32 / LANES;
    extern __shared__ float smem[];
    float *s_mean = smem;
    int32_t *s_count = (int32_t *)(s_mean + MOE_TUNE_ROUTER_WARPS * e);
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
    int64_t first = ((int64_t)blockIdx.x * MOE_TUNE_ROUTER_WARPS + warp) * iters * GROUPS;
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
            sel.template tokens<1>({row}, {t}, {valid}, e, k, score_fn, renorm, vec, lane, topk_idx,
                                   topk_w, s_count);
    }
    sel.finish(s_mean, s_stats, s_count, e, scratch, state, {score_mean, stats, counts, e, n});
}

template <int EPL, int LANES>
static cudaError_t launch_select(const float *logits, const float *bias, int64_t n, int32_t e,
                                 int32_t k, int score_fn, bool renorm, int32_t *topk_idx,
                                 float *topk_w, float *scratch, void *state, int32_t *counts,
                                 float *score_mean, float *stats, cudaStream_t stream)
{
    size_t smem = select_smem(MOE_TUNE_ROUTER_WARPS, e);
    bool vec = e % 4 == 0 && (uintptr_t)logits % 16 == 0;
    /* programmatic dependent launch (see cudaGridDependencySynchronize in the kernel): the
     * selection's setup overlaps the GEMM's end (measured: docs/cuda-backend.md) */
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)select_blocks(n, e));
    cfg.blockDim = dim3(MOE_TUNE_ROUTER_WARPS * 32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, router_select<EPL, LANES>, logits, bias, n, (int)e, (int)k,
                              score_fn, renorm, vec, topk_idx, topk_w, scratch,
                              (router_state *)state, counts, score_mean, stats, select_iters(n, e));
}

extern "C" cudaError_t moe_cuda_router_select(const float *logits, const float *bias, int64_t n,
                                              int32_t e, int32_t k, int score_fn, bool renormalize,
                                              int32_t *topk_idx, float *topk_w, int32_t *counts,
                                              float *score_mean, float *stats, float *scratch,
                                              void *state, cudaStream_t stream)
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
