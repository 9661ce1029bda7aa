/*
 * SwiGLU experts on cuBLAS: per local expert e with rows [o_e, o_e + n_e),
 *   forward   hpre = xp · w1[e]          (GEMM1, [n_e,H]·[H,2F])
 *             act  = silu(gate) * up     (one kernel over all R rows)
 *             out  = act · w2[e]         (GEMM2, [n_e,F]·[F,H])
 *   backward  d_act = d_out · w2[e]^T    dw2[e] += act^T · d_out
 *             d_hpre = swiglu'(...)      (one kernel over all R rows)
 *             d_xp = d_hpre · w1[e]^T    dw1[e] += xp^T · d_hpre
 * The f32 weight gradients dominate the backward's memory traffic for small experts; with
 * overwrite_grads their GEMMs run with beta = 0 and skip reading them.
 * Shape legend: El local experts, H hidden, F expert width, R rows, n_e rows of expert e.
 *
 * How the per-expert GEMMs are issued (docs/cuda-backend.md has the numbers behind the
 * choice):
 *   BATCHED  every expert has the same n_e: one cublasGemmStridedBatchedEx per GEMM kind;
 *            small experts at the rate of large ones, where a loop is launch-bound.
 *   STREAMS  uneven n_e and many experts: the loop round-robin over side streams, each with
 *            its own cuBLAS handle and workspace, joined back with events.
 *   LOOP     few large experts: one cublasGemmEx after the other on the current stream.
 *   GROUPED  one cublasGemmGroupedBatchedEx per GEMM kind over the experts with rows, each a
 *            group of one problem with its real n_e (no padding, one launch).
 *   HOPPER   uneven n_e on Hopper: the four GEMMs whose M is n_e (hpre + SwiGLU, out, d_act +
 *            SwiGLU', d_xp) as grouped sm_90a kernels (kernels/expert_gemm_sm90.cu), one
 *            launch each over the real row counts; the two dW GEMMs, whose K is n_e, on cuBLAS
 *            (dw_mode).
 * Every GEMM writes a disjoint output, so each mode's results are the same from run to run;
 * the first three give bitwise-identical results (the same cuBLAS kernel per expert).
 *
 * With MOE_CUDA_SWIGLU_GEMM=1 on Hopper, GEMM1 + SwiGLU forward and d_act + SwiGLU backward
 * run as those grouped kernels whatever the mode; the other GEMMs are issued as above.
 */
#include <stdlib.h>

#include "cuda_ctx.h"
#include "kernels.h"
#include "tuning.h"

typedef enum gemm_kind { FWD1, FWD2, BWD_DACT, BWD_DW2, BWD_DXP, BWD_DW1 } gemm_kind_t;

/* One GEMM kind for experts sharing `rows` (column-major view of the row-major arrays):
 * pointers of expert 0's operands (or of expert e's when called per expert) and the strides
 * between consecutive experts for the batched call. */
typedef struct gemm_desc {
    cublasOperation_t ta, tb;
    int64_t m, n, k;
    const void *a, *b;
    void *c;
    int64_t lda, ldb, ldc;
    long long sa, sb, sc;
    cudaDataType_t ctype;
    float beta;
} gemm_desc_t;

static gemm_desc_t describe(gemm_kind_t kind, const moe_experts_t *x, int32_t e, int64_t r0,
                            int64_t rows)
{
    int64_t h = x->h, f = x->f, f2 = 2 * x->f, total = x->host_offsets[x->el];
    const uint16_t *w1 = (const uint16_t *)x->w1 + e * h * f2;
    const uint16_t *w2 = (const uint16_t *)x->w2 + e * f * h;
    uint16_t *d_act = (uint16_t *)x->scratch, *d_hpre = d_act + total * f;
    gemm_desc_t g = {.ctype = CUDA_R_16BF, .beta = 0.0f};
    switch (kind) {
    case FWD1: /* hpre^T [2F,n] = w1^T [2F,H] · xp^T [H,n] */
        g = (gemm_desc_t){CUBLAS_OP_N,
                          CUBLAS_OP_N,
                          f2,
                          rows,
                          h,
                          w1,
                          (const uint16_t *)x->xp + r0 * h,
                          (uint16_t *)x->hpre + r0 * f2,
                          f2,
                          h,
                          f2,
                          h * f2,
                          rows * h,
                          rows * f2,
                          CUDA_R_16BF,
                          0.0f};
        break;
    case FWD2: /* out^T [H,n] = w2^T [H,F] · act^T [F,n] */
        g = (gemm_desc_t){CUBLAS_OP_N,
                          CUBLAS_OP_N,
                          h,
                          rows,
                          f,
                          w2,
                          (const uint16_t *)x->act + r0 * f,
                          (uint16_t *)x->out + r0 * h,
                          h,
                          f,
                          h,
                          f * h,
                          rows * f,
                          rows * h,
                          CUDA_R_16BF,
                          0.0f};
        break;
    case BWD_DACT: /* d_act^T [F,n] = w2 [F,H] · d_out^T [H,n] */
        g = (gemm_desc_t){CUBLAS_OP_T,
                          CUBLAS_OP_N,
                          f,
                          rows,
                          h,
                          w2,
                          (const uint16_t *)x->d_out + r0 * h,
                          d_act + r0 * f,
                          h,
                          h,
                          f,
                          f * h,
                          rows * h,
                          rows * f,
                          CUDA_R_16BF,
                          0.0f};
        break;
    case BWD_DW2: /* dw2^T [H,F] += d_out^T [H,n] · act [n,F] */
        g = (gemm_desc_t){CUBLAS_OP_N,
                          CUBLAS_OP_T,
                          h,
                          f,
                          rows,
                          (const uint16_t *)x->d_out + r0 * h,
                          (const uint16_t *)x->act + r0 * f,
                          x->dw2 + e * f * h,
                          h,
                          f,
                          h,
                          rows * h,
                          rows * f,
                          f * h,
                          CUDA_R_32F,
                          x->overwrite_grads ? 0.0f : 1.0f};
        break;
    case BWD_DXP: /* d_xp^T [H,n] = w1 [H,2F] · d_hpre^T [2F,n] */
        g = (gemm_desc_t){CUBLAS_OP_T,
                          CUBLAS_OP_N,
                          h,
                          rows,
                          f2,
                          w1,
                          d_hpre + r0 * f2,
                          (uint16_t *)x->d_xp + r0 * h,
                          f2,
                          f2,
                          h,
                          h * f2,
                          rows * f2,
                          rows * h,
                          CUDA_R_16BF,
                          0.0f};
        break;
    case BWD_DW1: /* dw1^T [2F,H] += d_hpre^T [2F,n] · xp [n,H] */
        g = (gemm_desc_t){CUBLAS_OP_N,
                          CUBLAS_OP_T,
                          f2,
                          h,
                          rows,
                          d_hpre + r0 * f2,
                          (const uint16_t *)x->xp + r0 * h,
                          x->dw1 + e * h * f2,
                          f2,
                          h,
                          f2,
                          rows * f2,
                          rows * h,
                          h * f2,
                          CUDA_R_32F,
                          x->overwrite_grads ? 0.0f : 1.0f};
        break;
    }
    return g;
}

static moe_status_t run_one(cublasHandle_t h, const gemm_desc_t *g)
{
    return moe_cuda_gemm(h, g->ta, g->tb, g->m, g->n, g->k, g->a, g->lda, g->b, g->ldb, g->beta,
                         g->c, g->ctype, g->ldc);
}

static moe_status_t run_batched(cublasHandle_t h, const gemm_desc_t *g, int32_t batch)
{
    const float alpha = 1.0f;
    MOE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        h, g->ta, g->tb, (int)g->m, (int)g->n, (int)g->k, &alpha, g->a, CUDA_R_16BF, (int)g->lda,
        g->sa, g->b, CUDA_R_16BF, (int)g->ldb, g->sb, &g->beta, g->c, g->ctype, (int)g->ldc, g->sc,
        batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return MOE_STATUS_SUCCESS;
}

/* The pointer arrays and per-group arguments of one grouped call, on the host. */
typedef struct grouped_args {
    cublasOperation_t *ta, *tb;
    int *m, *n, *k, *lda, *ldb, *ldc, *size;
    float *alpha, *beta;
    const void **ptr; /* A of each group, then B, then C */
} grouped_args_t;

/* GROUPED for one kind: a group for each expert with rows. Its pointer arrays reach the device
 * through moe_cuda_upload_pointers on the stream the GEMM runs on, into the backend's
 * workspace. *unsupported: cuBLAS's grouped GEMM lacks this kind's types (NOT_SUPPORTED), or a
 * size is over int's range; no product was computed and the caller issues it per expert. */
static moe_status_t run_grouped(cuda_ctx_t *c, const moe_experts_t *x, gemm_kind_t kind,
                                bool *unsupported)
{
    int32_t el = x->el;
    *unsupported = false;
    size_t bytes = (2 * sizeof(cublasOperation_t) + 7 * sizeof(int) + 2 * sizeof(float) +
                    3 * sizeof(void *)) *
                   (size_t)el;
    char *mem = malloc(bytes);
    if (!mem)
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "grouped GEMM arguments of %zu bytes", bytes);
    grouped_args_t g;
    g.ptr = (const void **)mem;
    g.ta = (cublasOperation_t *)(g.ptr + 3 * el);
    g.tb = g.ta + el;
    g.m = (int *)(g.tb + el);
    g.n = g.m + el, g.k = g.n + el, g.lda = g.k + el, g.ldb = g.lda + el, g.ldc = g.ldb + el;
    g.size = g.ldc + el;
    g.alpha = (float *)(g.size + el);
    g.beta = g.alpha + el;
    int32_t groups = 0;
    for (int32_t e = 0; e < el; e++) {
        int64_t r0 = x->host_offsets[e], rows = x->host_offsets[e + 1] - r0;
        if (rows == 0) continue;
        gemm_desc_t d = describe(kind, x, e, r0, rows);
        if (d.m > INT32_MAX || d.n > INT32_MAX || d.k > INT32_MAX || d.lda > INT32_MAX ||
            d.ldb > INT32_MAX || d.ldc > INT32_MAX)
            *unsupported = true;
        g.ta[groups] = d.ta, g.tb[groups] = d.tb;
        g.m[groups] = (int)d.m, g.n[groups] = (int)d.n, g.k[groups] = (int)d.k;
        g.lda[groups] = (int)d.lda, g.ldb[groups] = (int)d.ldb, g.ldc[groups] = (int)d.ldc;
        g.size[groups] = 1;
        g.alpha[groups] = 1.0f, g.beta[groups] = d.beta;
        g.ptr[groups] = d.a;
        g.ptr[el + groups] = d.b;
        g.ptr[2 * el + groups] = d.c;
        groups++;
    }
    moe_status_t st = MOE_STATUS_SUCCESS;
    void *dev = NULL;
    if (!*unsupported && groups > 0)
        st = moe_cuda_workspace(c, 3 * sizeof(void *) * (size_t)el, &dev);
    if (!*unsupported && groups > 0 && st == MOE_STATUS_SUCCESS) {
        const void **d_ptr = dev;
        cudaError_t rc = moe_cuda_upload_pointers(d_ptr, g.ptr, 3 * (int64_t)el, c->stream);
        if (rc != cudaSuccess) {
            st = MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "grouped GEMM pointers: %s",
                          cudaGetErrorString(rc));
        } else {
            cudaDataType_t ctype = describe(kind, x, 0, 0, 1).ctype;
            cublasStatus_t cs = cublasGemmGroupedBatchedEx(
                c->cublas, g.ta, g.tb, g.m, g.n, g.k, g.alpha, d_ptr, CUDA_R_16BF, g.lda,
                d_ptr + el, CUDA_R_16BF, g.ldb, g.beta, (void *const *)(d_ptr + 2 * el), ctype,
                g.ldc, groups, g.size, CUBLAS_COMPUTE_32F);
            if (cs == CUBLAS_STATUS_NOT_SUPPORTED)
                *unsupported = true;
            else if (cs != CUBLAS_STATUS_SUCCESS)
                st = MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "cublasGemmGroupedBatchedEx: %s",
                              cublasGetStatusString(cs));
        }
    }
    free(mem);
    return st;
}

/* The rows every expert has, or -1 when they differ (or some expert has none). */
static int64_t uniform_rows(const moe_experts_t *x)
{
    int64_t rows = x->host_offsets[1] - x->host_offsets[0];
    for (int32_t e = 1; e < x->el; e++)
        if (x->host_offsets[e + 1] - x->host_offsets[e] != rows) return -1;
    return rows > 0 ? rows : -1;
}

/* Padding every expert to the largest count lets their GEMMs run as one strided-batched call
 * per kind; worth it for many small experts while the filler stays small (the thresholds:
 * kernels/tuning.h). Forcing a per-expert mode keeps the compact layout. */
int64_t moe_cuda_expert_row_stride(void *ctx, int32_t el, const int64_t *kept)
{
    const cuda_ctx_t *c = ctx;
    if (c->gemm_mode != CUDA_GEMM_AUTO && c->gemm_mode != CUDA_GEMM_BATCHED) return 0;
    int64_t total = 0, most = 0;
    for (int32_t e = 0; e < el; e++) {
        total += kept[e];
        most = kept[e] > most ? kept[e] : most;
    }
    if (total == 0 || most * el == total || el < MOE_TUNE_PAD_MIN_EXPERTS ||
        total / el >= MOE_TUNE_PAD_MAX_MEAN_ROWS)
        return 0;
    int64_t stride = (most + MOE_TUNE_PAD_ROW_ALIGN - 1) / MOE_TUNE_PAD_ROW_ALIGN *
                     MOE_TUNE_PAD_ROW_ALIGN;
    return stride * el <= total + total / MOE_TUNE_PAD_FILLER_DIVISOR && stride * el <= INT32_MAX
               ? stride
               : 0;
}

/* The per-expert mode for uneven loads: side streams for many small experts, else the loop. */
static cuda_gemm_mode_t per_expert_mode(const moe_experts_t *x)
{
    int64_t mean_rows = x->host_offsets[x->el] / (x->el > 0 ? x->el : 1);
    return x->el >= MOE_TUNE_STREAMS_MIN_EXPERTS && mean_rows < MOE_TUNE_STREAMS_MAX_MEAN_ROWS
               ? CUDA_GEMM_STREAMS
               : CUDA_GEMM_LOOP;
}

/* HOPPER's mode for the dW GEMMs: cuBLAS's grouped GEMM for many experts of few rows (where
 * the per-expert launches dominate), else the per-expert mode. */
static cuda_gemm_mode_t dw_mode(const moe_experts_t *x)
{
    int64_t mean_rows = x->host_offsets[x->el] / (x->el > 0 ? x->el : 1);
    return x->el >= MOE_TUNE_GROUPED_DW_MIN_EXPERTS && mean_rows < MOE_TUNE_GROUPED_DW_MAX_MEAN_ROWS
               ? CUDA_GEMM_GROUPED
               : per_expert_mode(x);
}

static bool hopper_fits(const cuda_ctx_t *c, const moe_experts_t *x)
{
    return c->sm90_kernels && moe_cuda_swiglu_gemm_fits(x->el, x->h, x->f);
}

static cuda_gemm_mode_t choose_mode(const cuda_ctx_t *c, const moe_experts_t *x)
{
    int64_t uni = uniform_rows(x);
    cuda_gemm_mode_t m = c->gemm_mode;
    /* not applicable: fall back */
    if ((m == CUDA_GEMM_BATCHED && uni < 0) || (m == CUDA_GEMM_HOPPER && !hopper_fits(c, x)))
        m = CUDA_GEMM_AUTO;
    if (m != CUDA_GEMM_AUTO) return m;
    /* Measured on the H200 (docs/cuda-backend.md; the thresholds: kernels/tuning.h): the loop
     * wins for a few large experts, strided batched whenever sizes are equal and experts are
     * small, the grouped Hopper kernels for uneven ones too small to hide cuBLAS's host cost
     * on new sizes, else side streams. */
    if (uni > 0 && (x->el >= MOE_TUNE_BATCHED_MIN_EXPERTS || uni < MOE_TUNE_BATCHED_MAX_ROWS))
        return CUDA_GEMM_BATCHED;
    int64_t mean_rows = x->host_offsets[x->el] / (x->el > 0 ? x->el : 1);
    double expert_gflop = 6e-9 * (double)mean_rows * (double)x->h * (double)x->f;
    if (hopper_fits(c, x) && x->el >= MOE_TUNE_HOPPER_MIN_EXPERTS &&
        (mean_rows < MOE_TUNE_HOPPER_MAX_MEAN_ROWS ||
         expert_gflop < MOE_TUNE_HOPPER_MAX_EXPERT_GFLOP))
        return CUDA_GEMM_HOPPER;
    return per_expert_mode(x);
}

cuda_gemm_mode_t moe_cuda_experts_mode(const void *ctx, const moe_experts_t *a)
{
    return choose_mode(ctx, a);
}

/* Issue the GEMM kinds kinds[0..nk) for every expert with rows, in the given mode. Within one
 * expert the kinds run in order on one stream (they may depend on each other). */
static moe_status_t run_experts(cuda_ctx_t *c, const moe_experts_t *x, cuda_gemm_mode_t mode,
                                const gemm_kind_t *kinds, int nk)
{
    if (mode == CUDA_GEMM_BATCHED) {
        int64_t rows = uniform_rows(x);
        for (int i = 0; i < nk; i++) {
            gemm_desc_t g = describe(kinds[i], x, 0, 0, rows);
            MOE_TRY(run_batched(c->cublas, &g, x->el));
        }
        return MOE_STATUS_SUCCESS;
    }
    if (mode == CUDA_GEMM_GROUPED) {
        for (int i = 0; i < nk; i++) {
            bool unsupported;
            MOE_TRY(run_grouped(c, x, kinds[i], &unsupported));
            if (unsupported) MOE_TRY(run_experts(c, x, per_expert_mode(x), &kinds[i], 1));
        }
        return MOE_STATUS_SUCCESS;
    }
    bool fan = mode == CUDA_GEMM_STREAMS;
    if (fan) MOE_TRY(moe_cuda_fork(c, MOE_TUNE_SIDE_STREAMS));
    moe_status_t st = MOE_STATUS_SUCCESS;
    int next = 0;
    for (int32_t e = 0; e < x->el && st == MOE_STATUS_SUCCESS; e++) {
        int64_t r0 = x->host_offsets[e], rows = x->host_offsets[e + 1] - r0;
        if (rows == 0) continue;
        cublasHandle_t h = fan ? c->side_cublas[next] : c->cublas;
        next = (next + 1) % MOE_TUNE_SIDE_STREAMS;
        for (int i = 0; i < nk && st == MOE_STATUS_SUCCESS; i++) {
            gemm_desc_t g = describe(kinds[i], x, e, r0, rows);
            st = run_one(h, &g);
        }
    }
    return fan ? moe_cuda_join(c, MOE_TUNE_SIDE_STREAMS, st) : st;
}

static bool fused_swiglu(const cuda_ctx_t *c, const moe_experts_t *x)
{
    return c->swiglu_gemm && moe_cuda_swiglu_gemm_fits(x->el, x->h, x->f);
}

moe_status_t moe_cuda_experts_forward(void *ctx, const moe_experts_t *a)
{
    cuda_ctx_t *c = ctx;
    int64_t total = a->host_offsets[a->el];
    if (total == 0) return MOE_STATUS_SUCCESS;
    cuda_gemm_mode_t mode = choose_mode(c, a);
    static const gemm_kind_t k1[] = {FWD1}, k2[] = {FWD2};
    if (mode == CUDA_GEMM_HOPPER) {
        MOE_CUDA_CHECK(moe_cuda_swiglu_gemm_forward(a->hpre, a->act, a->xp, a->w1, a->host_offsets,
                                                    a->el, a->h, a->f, c->sms, c->stream));
        MOE_CUDA_CHECK(moe_cuda_grouped_gemm(a->out, a->act, a->w2, false, a->host_offsets, a->el,
                                             a->f, a->h, c->sms, c->stream));
        return MOE_STATUS_SUCCESS;
    }
    if (fused_swiglu(c, a)) {
        MOE_CUDA_CHECK(moe_cuda_swiglu_gemm_forward(a->hpre, a->act, a->xp, a->w1, a->host_offsets,
                                                    a->el, a->h, a->f, c->sms, c->stream));
    } else {
        MOE_TRY(run_experts(c, a, mode, k1, 1));
        MOE_CUDA_CHECK(moe_cuda_swiglu_forward(a->act, a->hpre, total, a->f, c->sms, c->stream));
    }
    MOE_TRY(run_experts(c, a, mode, k2, 1));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_experts_backward(void *ctx, const moe_experts_t *a)
{
    cuda_ctx_t *c = ctx;
    if (a->overwrite_grads) /* experts without rows write no gradient: theirs is zero */
        for (int32_t e = 0; e < a->el; e++) {
            if (a->host_offsets[e + 1] > a->host_offsets[e]) continue;
            size_t n1 = (size_t)(a->h * 2 * a->f), n2 = (size_t)(a->f * a->h);
            MOE_CUDA_CHECK(cudaMemsetAsync(a->dw1 + e * n1, 0, sizeof(float) * n1, c->stream));
            MOE_CUDA_CHECK(cudaMemsetAsync(a->dw2 + e * n2, 0, sizeof(float) * n2, c->stream));
        }
    int64_t total = a->host_offsets[a->el];
    if (total == 0) return MOE_STATUS_SUCCESS;
    cuda_gemm_mode_t mode = choose_mode(c, a);
    static const gemm_kind_t k1[] = {BWD_DACT, BWD_DW2}, k2[] = {BWD_DXP, BWD_DW1},
                             k_dw2[] = {BWD_DW2};
    uint16_t *d_act = a->scratch, *d_hpre = d_act + total * a->f;
    if (mode == CUDA_GEMM_HOPPER) {
        static const gemm_kind_t k_dw1[] = {BWD_DW1};
        cuda_gemm_mode_t dw = dw_mode(a);
        MOE_CUDA_CHECK(moe_cuda_swiglu_gemm_backward(d_hpre, a->d_out, a->w2, a->hpre,
                                                     a->host_offsets, a->el, a->h, a->f, c->sms,
                                                     c->stream));
        MOE_TRY(run_experts(c, a, dw, k_dw2, 1));
        MOE_CUDA_CHECK(moe_cuda_grouped_gemm(a->d_xp, d_hpre, a->w1, true, a->host_offsets, a->el,
                                             2 * a->f, a->h, c->sms, c->stream));
        return run_experts(c, a, dw, k_dw1, 1);
    }
    if (fused_swiglu(c, a)) {
        MOE_CUDA_CHECK(moe_cuda_swiglu_gemm_backward(d_hpre, a->d_out, a->w2, a->hpre,
                                                     a->host_offsets, a->el, a->h, a->f, c->sms,
                                                     c->stream));
        MOE_TRY(run_experts(c, a, mode, k_dw2, 1));
    } else {
        MOE_TRY(run_experts(c, a, mode, k1, 2));
        MOE_CUDA_CHECK(
            moe_cuda_swiglu_backward(d_hpre, d_act, a->hpre, total, a->f, c->sms, c->stream));
    }
    MOE_TRY(run_experts(c, a, mode, k2, 2));
    return MOE_STATUS_SUCCESS;
}
