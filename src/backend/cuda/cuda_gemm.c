/*
 * The backend's GEMMs: bf16 x bf16 -> bf16 or f32 with fp32 accumulation on the tensor cores,
 * one call or strided batched, on the main stream or a side stream ("lane").
 *
 * cuBLAS's default choice is not always the fastest algorithm it has. For layer shape 0's
 * weight gradients (64 experts of 584 rows: k = 584, f32 output) cublasLt offers a 128x160
 * tile that runs 1.42 ms where the default takes 1.57 (dw1) and 0.72 vs 0.79-0.87 ms (dw2);
 * bench/gemm_algos.c, docs/cuda-backend.md. So a GEMM marked `tune` with beta = 0 is tuned
 * once per shape class: the default call and every candidate of cublasLt's heuristic that
 * computes each output in one pass (no split-K, no reduction) are timed on the call's own
 * operands (beta 0 overwrites C, so trial runs write nothing the real call does not write
 * again; median of 5 rounds), and the fastest is kept in the context's cache, the default
 * unless a candidate beats it by 5%. Only those whose
 * output has the same bits as the heuristic's first candidate compete (a checksum of C after
 * each), so the pick, which timing decides, never changes a result: the layer stays
 * deterministic. (On every shape gemm_algos covers all candidates and the default agreed bit
 * for bit; tests/cuda/test_cuda_ops.c checks the candidates on the GPU it runs on.) GEMMs with
 * beta != 0 (gradient accumulation) and everything with MOE_CUDA_GEMM_TUNE=0 use
 * cublasGemmEx's choice.
 * A shape class: the transposes, output type, batched or not, leading dimensions, the
 * operands' alignment, and m, n, k each rounded up to a power of two (rows per expert change
 * every step). An algorithm the exact shape turns out not to support falls back to the
 * default call.
 */
#include <stdlib.h>
#include <string.h>

#include "../../../kernels/kernels.h"
#include "cuda_ctx.h"

#define TUNE_ROUNDS 5
/* a candidate replaces the default only when this much faster: smaller margins measured in
 * tuning did not hold in the layer */
#define TUNE_MARGIN 0.95f

static cudaStream_t lane_stream(const cuda_ctx_t *c, int lane)
{
    return lane < 0 ? c->stream : c->side[lane];
}

static moe_status_t run_default(const cuda_ctx_t *c, int lane, const cuda_gemm_t *g)
{
    cublasHandle_t h = lane < 0 ? c->cublas : c->side_cublas[lane];
    const float alpha = 1.0f;
    if (g->batch > 1)
        MOE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
            h, g->ta, g->tb, (int)g->m, (int)g->n, (int)g->k, &alpha, g->a, CUDA_R_16BF,
            (int)g->lda, g->sa, g->b, CUDA_R_16BF, (int)g->ldb, g->sb, &g->beta, g->c, g->ctype,
            (int)g->ldc, g->sc, g->batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else
        MOE_CUBLAS_CHECK(cublasGemmEx(h, g->ta, g->tb, (int)g->m, (int)g->n, (int)g->k, &alpha,
                                      g->a, CUDA_R_16BF, (int)g->lda, g->b, CUDA_R_16BF,
                                      (int)g->ldb, &g->beta, g->c, g->ctype, (int)g->ldc,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return MOE_STATUS_SUCCESS;
}

/* cublasLt's description of g, in caller-owned storage (no allocation per call). */
typedef struct lt_problem {
    cublasLtMatmulDescOpaque_t desc;
    cublasLtMatrixLayoutOpaque_t a, b, c;
} lt_problem_t;

static moe_status_t lt_describe(const cuda_gemm_t *g, lt_problem_t *p)
{
    MOE_CUBLAS_CHECK(cublasLtMatmulDescInit(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &g->ta,
                                                    sizeof g->ta));
    MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &g->tb,
                                                    sizeof g->tb));
    bool an = g->ta == CUBLAS_OP_N, bn = g->tb == CUBLAS_OP_N;
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&p->a, CUDA_R_16BF, (uint64_t)(an ? g->m : g->k),
                                              (uint64_t)(an ? g->k : g->m), g->lda));
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&p->b, CUDA_R_16BF, (uint64_t)(bn ? g->k : g->n),
                                              (uint64_t)(bn ? g->n : g->k), g->ldb));
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&p->c, g->ctype, (uint64_t)g->m, (uint64_t)g->n,
                                              g->ldc));
    if (g->batch > 1) {
        cublasLtMatrixLayoutOpaque_t *ls[3] = {&p->a, &p->b, &p->c};
        int64_t strides[3] = {g->sa, g->sb, g->sc};
        for (int i = 0; i < 3; i++) {
            MOE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
                ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &g->batch, sizeof g->batch));
            MOE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
                ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                sizeof strides[i]));
        }
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_gemm_run_algo(const cuda_ctx_t *c, int lane, const cuda_gemm_t *g,
                                    const cublasLtMatmulAlgo_t *algo)
{
    lt_problem_t p;
    MOE_TRY(lt_describe(g, &p));
    const float alpha = 1.0f;
    void *ws = lane < 0 ? c->cublas_ws : c->side_ws[lane];
    MOE_CUBLAS_CHECK(cublasLtMatmul(c->cublaslt, &p.desc, &alpha, g->a, &p.a, g->b, &p.b,
                                    &g->beta, g->c, &p.c, g->c, &p.c, algo, ws,
                                    MOE_CUDA_CUBLAS_WORKSPACE, lane_stream(c, lane)));
    return MOE_STATUS_SUCCESS;
}

/* the largest power of two (at most 256) dividing the address: what cublasLt may assume */
static uint32_t alignment(const void *ptr)
{
    uint32_t a = 256;
    while (a > 1 && (uintptr_t)ptr % a) a /= 2;
    return a;
}

static int32_t config(const cublasLtMatmulAlgo_t *algo, cublasLtMatmulAlgoConfigAttributes_t attr)
{
    uint32_t v = 0; /* split-K is int32, the reduction scheme uint32 */
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &v, sizeof v, &written) !=
        CUBLAS_STATUS_SUCCESS)
        return -1;
    return (int32_t)v;
}

moe_status_t moe_cuda_gemm_candidates(const cuda_ctx_t *c, const cuda_gemm_t *g,
                                      cublasLtMatmulAlgo_t *out, int max, int *count)
{
    lt_problem_t p;
    MOE_TRY(lt_describe(g, &p));
    cublasLtMatmulPreferenceOpaque_t pref;
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceInit(&pref));
    uint64_t ws = MOE_CUDA_CUBLAS_WORKSPACE;
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        &pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    const cublasLtMatmulPreferenceAttributes_t align_attr[3] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES};
    const void *ptrs[3] = {g->a, g->b, g->c};
    for (int i = 0; i < 3; i++) {
        uint32_t a = alignment(ptrs[i]);
        MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, align_attr[i], &a, sizeof a));
    }
    uint32_t a = alignment(g->c);
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        &pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &a, sizeof a));
    cublasLtMatmulHeuristicResult_t res[MOE_CUDA_GEMM_CANDIDATES];
    int found = 0;
    if (max > MOE_CUDA_GEMM_CANDIDATES) max = MOE_CUDA_GEMM_CANDIDATES;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(c->cublaslt, &p.desc, &p.a, &p.b, &p.c,
                                                       &p.c, &pref, max, res, &found);
    *count = 0;
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) return MOE_STATUS_SUCCESS; /* none: the default */
    MOE_CUBLAS_CHECK(st);
    for (int i = 0; i < found; i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS &&
            config(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1 &&
            config(&res[i].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) ==
                CUBLASLT_REDUCTION_SCHEME_NONE)
            out[(*count)++] = res[i].algo;
    return MOE_STATUS_SUCCESS;
}

static int64_t round_pow2(int64_t x)
{
    int64_t p = 1;
    while (p < x) p *= 2;
    return p;
}

static cuda_gemm_class_t class_of(const cuda_gemm_t *g)
{
    cuda_gemm_class_t k;
    memset(&k, 0, sizeof k); /* compared with memcmp */
    k.ta = g->ta;
    k.tb = g->tb;
    k.ctype = g->ctype;
    k.batched = g->batch > 1;
    k.m = round_pow2(g->m);
    k.n = round_pow2(g->n);
    k.k = round_pow2(g->k);
    k.ld[0] = g->lda;
    k.ld[1] = g->ldb;
    k.ld[2] = g->ldc;
    k.align[0] = alignment(g->a);
    k.align[1] = alignment(g->b);
    k.align[2] = alignment(g->c);
    return k;
}

static int cmp_float(const void *x, const void *y)
{
    float a = *(const float *)x, b = *(const float *)y;
    return (a > b) - (a < b);
}

/* Entry i < n of a tuning is candidate i, entry n cuBLAS's default call. */
static bool run_entry(cuda_ctx_t *c, int lane, const cuda_gemm_t *g,
                      const cublasLtMatmulAlgo_t *cand, int n, int i)
{
    moe_status_t st =
        i < n ? moe_cuda_gemm_run_algo(c, lane, g, &cand[i]) : run_default(c, lane, g);
    return st == MOE_STATUS_SUCCESS;
}

/* Each entry's median ms over TUNE_ROUNDS rounds, the entries taking turns within a round (so
 * that clock drift during tuning favours none), after one warm-up call each; < 0 for one that
 * does not run. */
static void time_entries(cuda_ctx_t *c, int lane, const cuda_gemm_t *g,
                         const cublasLtMatmulAlgo_t *cand, int n, float *median)
{
    cudaStream_t s = lane_stream(c, lane);
    float ms[MOE_CUDA_GEMM_CANDIDATES + 1][TUNE_ROUNDS];
    bool ok[MOE_CUDA_GEMM_CANDIDATES + 1];
    for (int i = 0; i <= n; i++) ok[i] = run_entry(c, lane, g, cand, n, i);
    for (int r = 0; r < TUNE_ROUNDS; r++) {
        if (cudaEventRecord(c->tune_ev[0], s) != cudaSuccess) goto fail;
        for (int i = 0; i <= n; i++) {
            if (ok[i]) ok[i] = run_entry(c, lane, g, cand, n, i);
            if (cudaEventRecord(c->tune_ev[i + 1], s) != cudaSuccess) goto fail;
        }
        if (cudaEventSynchronize(c->tune_ev[n + 1]) != cudaSuccess) goto fail;
        for (int i = 0; i <= n; i++)
            if (cudaEventElapsedTime(&ms[i][r], c->tune_ev[i], c->tune_ev[i + 1]) != cudaSuccess)
                goto fail;
    }
    for (int i = 0; i <= n; i++) {
        qsort(ms[i], TUNE_ROUNDS, sizeof(float), cmp_float);
        median[i] = ok[i] ? ms[i][TUNE_ROUNDS / 2] : -1.0f;
    }
    return;
fail:
    for (int i = 0; i <= n; i++) median[i] = -1.0f;
}

/* The bytes C spans (gaps between columns or batch entries included). */
static size_t c_span(const cuda_gemm_t *g)
{
    size_t csize = g->ctype == CUDA_R_32F ? 4 : 2;
    int64_t last = g->ldc * (g->n - 1) + g->m + (g->batch > 1 ? (g->batch - 1) * g->sc : 0);
    return csize * (size_t)last;
}

/* Each entry's output checksum into sums[0..n]; false when one could not be taken. */
static bool checksum_entries(cuda_ctx_t *c, int lane, const cuda_gemm_t *g,
                             const cublasLtMatmulAlgo_t *cand, int n, const float *ms,
                             unsigned long long *sums)
{
    cudaStream_t s = lane_stream(c, lane);
    for (int i = 0; i <= n; i++) {
        if (ms[i] < 0) continue;
        if (!run_entry(c, lane, g, cand, n, i) ||
            moe_cuda_checksum(g->c, c_span(g), &c->tune_sums[i], s) != cudaSuccess)
            return false;
    }
    return cudaMemcpyAsync(sums, c->tune_sums, sizeof *sums * (size_t)(n + 1),
                           cudaMemcpyDeviceToHost, s) == cudaSuccess &&
           cudaStreamSynchronize(s) == cudaSuccess;
}

/* The cache entry for g's class, tuned now if new; NULL when the cache is full. Only entries
 * whose output has the bits of the heuristic's first candidate compete, so the pick, which
 * timing decides, cannot change a result. */
static const cuda_gemm_choice_t *choice_for(cuda_ctx_t *c, int lane, const cuda_gemm_t *g)
{
    cuda_gemm_class_t k = class_of(g);
    for (int i = 0; i < c->gemm_choices; i++)
        if (!memcmp(&c->gemm_choice[i].cls, &k, sizeof k)) return &c->gemm_choice[i];
    if (c->gemm_choices == MOE_CUDA_GEMM_CLASSES) return NULL;
    cuda_gemm_choice_t *ch = &c->gemm_choice[c->gemm_choices++];
    ch->cls = k;
    ch->tuned = false; /* cublasGemmEx's choice unless a candidate wins */
    cublasLtMatmulAlgo_t cand[MOE_CUDA_GEMM_CANDIDATES];
    int n = 0;
    if (moe_cuda_gemm_candidates(c, g, cand, MOE_CUDA_GEMM_CANDIDATES, &n) != MOE_STATUS_SUCCESS)
        n = 0;
    float ms[MOE_CUDA_GEMM_CANDIDATES + 1];
    unsigned long long sums[MOE_CUDA_GEMM_CANDIDATES + 1];
    int pick = -1, ref = -1, differ = 0; /* entry n: the default */
    if (n > 0) {
        time_entries(c, lane, g, cand, n, ms);
        if (!checksum_entries(c, lane, g, cand, n, ms, sums)) n = 0;
    }
    for (int i = 0; i < n && ref < 0; i++)
        if (ms[i] >= 0) ref = i;
    for (int i = 0; ref >= 0 && i <= n; i++) {
        if (ms[i] < 0) continue;
        if (sums[i] != sums[ref])
            differ++;
        else if (pick < 0 || ms[i] < ms[pick])
            pick = i;
    }
    if (pick < 0 || (ms[n] >= 0 && sums[n] == sums[ref] && ms[pick] > TUNE_MARGIN * ms[n]))
        pick = n;
    cudaGetLastError(); /* a candidate that failed to launch leaves nothing behind */
    if (pick < n) {
        ch->algo = cand[pick];
        ch->tuned = true;
    }
    moe_log(c->logger, MOE_LOG_INFO,
            "GEMM %c%c m=%lld n=%lld k=%lld batch=%d: %d candidates (%d with other bits), "
            "default %.3f ms, picked %s %.3f ms (tile %d)",
            g->ta == CUBLAS_OP_N ? 'N' : 'T', g->tb == CUBLAS_OP_N ? 'N' : 'T', (long long)g->m,
            (long long)g->n, (long long)g->k, g->batch, n, differ, ref >= 0 ? (double)ms[n] : 0.0,
            pick < n ? "a candidate" : "the default", ref >= 0 ? (double)ms[pick] : 0.0,
            pick < n ? config(&cand[pick], CUBLASLT_ALGO_CONFIG_TILE_ID) : -1);
    return ch;
}

moe_status_t moe_cuda_gemm_run(cuda_ctx_t *c, int lane, const cuda_gemm_t *g)
{
    if (!g->tune || !c->gemm_tune || g->beta != 0.0f) return run_default(c, lane, g);
    const cuda_gemm_choice_t *ch = choice_for(c, lane, g);
    if (ch && ch->tuned && moe_cuda_gemm_run_algo(c, lane, g, &ch->algo) == MOE_STATUS_SUCCESS)
        return MOE_STATUS_SUCCESS;
    return run_default(c, lane, g);
}
