/*
 * SwiGLU experts on cuBLAS: per local expert e with rows [o_e, o_e + n_e),
 *   forward   hpre = xp · w1[e]          (GEMM1, [n_e,H]·[H,2F])
 *             act  = silu(gate) * up     (one kernel over all R rows)
 *             out  = act · w2[e]         (GEMM2, [n_e,F]·[F,H])
 *   backward  d_act = d_out · w2[e]^T    dw2[e] += act^T · d_out
 *             d_hpre = swiglu'(...)      (one kernel over all R rows)
 *             d_xp = d_hpre · w1[e]^T    dw1[e] += xp^T · d_hpre
 * Shape legend: El local experts, H hidden, F expert width, R rows, n_e rows of expert e.
 *
 * How the per-expert GEMMs are issued (see /work/shared/notes and docs/cuda-backend.md for the
 * numbers behind the choice):
 *   BATCHED  every expert has the same n_e: one cublasGemmStridedBatchedEx per GEMM kind;
 *            holds ~700 TFLOP/s for small experts where a loop is launch-bound.
 *   STREAMS  uneven n_e and many experts: the loop round-robin over side streams, each with
 *            its own cuBLAS handle and workspace, joined back with events.
 *   WINDOWS  uneven but similar n_e: each expert's rows as two windows of common sizes, one
 *            cublasGemmBatchedEx per window (see "Windows" below); the weight gradients run
 *            per expert on the side streams, overlapping the main stream's GEMMs. Only when
 *            MOE_CUDA_EXPERT_GEMM=windows asks for it (see choose_mode).
 *   LOOP     few large experts: one cublasGemmEx after the other on the current stream.
 * Every GEMM's result is fixed by the row counts (no atomics, each output written by one GEMM
 * or by windows in a fixed order), so every mode is bitwise reproducible.
 */
#include <stdlib.h>

#include "cuda_ctx.h"
#include "../../../kernels/kernels.h"

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
        g = (gemm_desc_t){CUBLAS_OP_N, CUBLAS_OP_N, f2, rows, h, w1, (const uint16_t *)x->xp + r0 * h,
                          (uint16_t *)x->hpre + r0 * f2, f2, h, f2, h * f2, rows * h, rows * f2,
                          CUDA_R_16BF, 0.0f};
        break;
    case FWD2: /* out^T [H,n] = w2^T [H,F] · act^T [F,n] */
        g = (gemm_desc_t){CUBLAS_OP_N, CUBLAS_OP_N, h, rows, f, w2, (const uint16_t *)x->act + r0 * f,
                          (uint16_t *)x->out + r0 * h, h, f, h, f * h, rows * f, rows * h,
                          CUDA_R_16BF, 0.0f};
        break;
    case BWD_DACT: /* d_act^T [F,n] = w2 [F,H] · d_out^T [H,n] */
        g = (gemm_desc_t){CUBLAS_OP_T, CUBLAS_OP_N, f, rows, h, w2, (const uint16_t *)x->d_out + r0 * h,
                          d_act + r0 * f, h, h, f, f * h, rows * h, rows * f, CUDA_R_16BF, 0.0f};
        break;
    case BWD_DW2: /* dw2^T [H,F] += d_out^T [H,n] · act [n,F] */
        g = (gemm_desc_t){CUBLAS_OP_N, CUBLAS_OP_T, h, f, rows, (const uint16_t *)x->d_out + r0 * h,
                          (const uint16_t *)x->act + r0 * f, x->dw2 + e * f * h, h, f, h, rows * h,
                          rows * f, f * h, CUDA_R_32F, 1.0f};
        break;
    case BWD_DXP: /* d_xp^T [H,n] = w1 [H,2F] · d_hpre^T [2F,n] */
        g = (gemm_desc_t){CUBLAS_OP_T, CUBLAS_OP_N, h, rows, f2, w1, d_hpre + r0 * f2,
                          (uint16_t *)x->d_xp + r0 * h, f2, f2, h, h * f2, rows * f2, rows * h,
                          CUDA_R_16BF, 0.0f};
        break;
    case BWD_DW1: /* dw1^T [2F,H] += d_hpre^T [2F,n] · xp [n,H] */
        g = (gemm_desc_t){CUBLAS_OP_N, CUBLAS_OP_T, f2, h, rows, d_hpre + r0 * f2,
                          (const uint16_t *)x->xp + r0 * h, x->dw1 + e * h * f2, f2, h, f2,
                          rows * f2, rows * h, h * f2, CUDA_R_32F, 1.0f};
        break;
    }
    return g;
}

static moe_status_t run_one(cublasHandle_t h, const gemm_desc_t *g)
{
    const float alpha = 1.0f;
    MOE_CUBLAS_CHECK(cublasGemmEx(h, g->ta, g->tb, (int)g->m, (int)g->n, (int)g->k, &alpha, g->a,
                                  CUDA_R_16BF, (int)g->lda, g->b, CUDA_R_16BF, (int)g->ldb,
                                  &g->beta, g->c, g->ctype, (int)g->ldc, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
    return MOE_STATUS_SUCCESS;
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

static int64_t rows_of(const moe_experts_t *x, int32_t e)
{
    return x->host_offsets[e + 1] - x->host_offsets[e];
}

static int64_t max_rows(const moe_experts_t *x)
{
    int64_t m = 0;
    for (int32_t e = 0; e < x->el; e++)
        if (rows_of(x, e) > m) m = rows_of(x, e);
    return m;
}

/* The rows every expert has, or -1 when they differ (or some expert has none). */
static int64_t uniform_rows(const moe_experts_t *x)
{
    int64_t rows = x->host_offsets[1] - x->host_offsets[0];
    for (int32_t e = 1; e < x->el; e++)
        if (x->host_offsets[e + 1] - x->host_offsets[e] != rows) return -1;
    return rows > 0 ? rows : -1;
}

static cuda_gemm_mode_t choose_mode(const cuda_ctx_t *c, const moe_experts_t *x)
{
    int64_t uni = uniform_rows(x);
    cuda_gemm_mode_t m = c->gemm_mode;
    if (m == CUDA_GEMM_BATCHED && uni < 0) m = CUDA_GEMM_AUTO; /* not applicable: fall back */
    /* pointer arrays hide their alignment from cuBLAS: windows need 16-byte aligned rows */
    if (m == CUDA_GEMM_WINDOWS && (x->h % 8 != 0 || x->f % 8 != 0)) m = CUDA_GEMM_AUTO;
    if (m != CUDA_GEMM_AUTO) return m;
    int64_t mean_rows = x->host_offsets[x->el] / (x->el > 0 ? x->el : 1);
    /* Measured on the H200 (docs/cuda-backend.md): the loop wins for a few large experts,
     * strided batched whenever sizes are equal and experts are small, side streams for
     * uneven small ones. Not WINDOWS: it lost on the 8-expert layers (run 4) and is not yet
     * measured on many small uneven experts, the case it is meant for. */
    if (uni > 0 && (x->el >= 16 || uni < 4096)) return CUDA_GEMM_BATCHED;
    if (x->el >= 4 && mean_rows < 2048) return CUDA_GEMM_STREAMS;
    return CUDA_GEMM_LOOP;
}

/* The side streams start after everything enqueued on the main stream so far. */
static moe_status_t fork_side(cuda_ctx_t *c)
{
    MOE_CUDA_CHECK(cudaEventRecord(c->fork, c->stream));
    for (int s = 0; s < MOE_CUDA_SIDE_STREAMS; s++)
        MOE_CUDA_CHECK(cudaStreamWaitEvent(c->side[s], c->fork, 0));
    return MOE_STATUS_SUCCESS;
}

/* The main stream waits for everything enqueued on the side streams. */
static moe_status_t join_side(cuda_ctx_t *c)
{
    for (int s = 0; s < MOE_CUDA_SIDE_STREAMS; s++) {
        MOE_CUDA_CHECK(cudaEventRecord(c->join[s], c->side[s]));
        MOE_CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->join[s], 0));
    }
    return MOE_STATUS_SUCCESS;
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
    bool fan = mode == CUDA_GEMM_STREAMS;
    if (fan) MOE_TRY(fork_side(c));
    int next = 0;
    for (int32_t e = 0; e < x->el; e++) {
        int64_t r0 = x->host_offsets[e], rows = x->host_offsets[e + 1] - r0;
        if (rows == 0) continue;
        cublasHandle_t h = fan ? c->side_cublas[next] : c->cublas;
        next = (next + 1) % MOE_CUDA_SIDE_STREAMS;
        for (int i = 0; i < nk; i++) {
            gemm_desc_t g = describe(kinds[i], x, e, r0, rows);
            MOE_TRY(run_one(h, &g));
        }
    }
    return fan ? join_side(c) : MOE_STATUS_SUCCESS;
}

/* ---- Windows ----------------------------------------------------------------------------------
 * With tmax the most rows of any expert, the batched experts are those with at least tmax/2
 * rows; a = the fewest rows among them, b = tmax - a <= a. Expert e's rows [o, o + n) are
 * covered by its last a rows and its first b rows (a + b = tmax >= n), and both windows lie
 * inside its own rows (a, b <= n): one cublasGemmBatchedEx per window computes every batched
 * expert at once, reading and writing nothing outside each expert's rows. Rows in both windows
 * are computed twice with the same weights; the head window's result stays (fixed order).
 * Cost: El * tmax rows, as if every expert were padded to the largest, without copies or
 * padded buffers. Experts with fewer than tmax/2 rows take the loop. This only works for the
 * GEMMs whose rows are output columns; the weight gradients (rows are their reduction) run one
 * GEMM per expert on the side streams, overlapping the main stream's GEMMs and SwiGLU'. */

typedef struct windows {
    int64_t a, b;          /* rows of the tail window and of the head window (0: none) */
    int32_t n;             /* batched experts */
    int64_t *tail, *head;  /* [n] first row of each window */
    int32_t *ex;           /* [n] the batched experts */
    void **dptr;           /* device A, B, C pointer arrays, 3 * MOE_CUDA_GEMM_PTRS_MAX */
} windows_t;

static moe_status_t windows_plan(cuda_ctx_t *c, const moe_experts_t *x, windows_t *w)
{
    int64_t tmax = max_rows(x);
    *w = (windows_t){.a = tmax};
    MOE_TRY(moe_cuda_workspace(c, 3 * MOE_CUDA_GEMM_PTRS_MAX * sizeof(void *), (void **)&w->dptr));
    w->tail = malloc((size_t)x->el * (2 * sizeof(int64_t) + sizeof(int32_t)));
    if (!w->tail) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "expert windows for %d experts", x->el);
    w->head = w->tail + x->el;
    w->ex = (int32_t *)(w->head + x->el);
    for (int32_t e = 0; e < x->el; e++) {
        int64_t n = rows_of(x, e);
        if (n == 0 || 2 * n < tmax) continue;
        w->ex[w->n++] = e;
        if (n < w->a) w->a = n;
    }
    w->b = tmax - w->a;
    for (int32_t i = 0; i < w->n; i++) {
        w->tail[i] = x->host_offsets[w->ex[i] + 1] - w->a;
        w->head[i] = x->host_offsets[w->ex[i]];
    }
    return MOE_STATUS_SUCCESS;
}

/* One GEMM kind for every batched expert on rows [row0[i], row0[i] + rows): one pointer-table
 * launch and one cublasGemmBatchedEx per MOE_CUDA_GEMM_PTRS_MAX experts. The pointer arrays
 * are reused by the next launch, which the stream orders after this GEMM. */
static moe_status_t run_window(cuda_ctx_t *c, const moe_experts_t *x, const windows_t *w,
                               gemm_kind_t kind, const int64_t *row0, int64_t rows)
{
    const float alpha = 1.0f;
    moe_cuda_gemm_ptrs_t t;
    for (int32_t i0 = 0; i0 < w->n; i0 += MOE_CUDA_GEMM_PTRS_MAX) {
        t.count = w->n - i0 < MOE_CUDA_GEMM_PTRS_MAX ? w->n - i0 : MOE_CUDA_GEMM_PTRS_MAX;
        gemm_desc_t g = describe(kind, x, w->ex[i0], row0[i0], rows);
        for (int32_t i = 0; i < t.count; i++) {
            if (i > 0) g = describe(kind, x, w->ex[i0 + i], row0[i0 + i], rows);
            t.p[0][i] = g.a;
            t.p[1][i] = g.b;
            t.p[2][i] = g.c;
        }
        void **d = w->dptr;
        MOE_CUDA_CHECK(moe_cuda_gemm_ptrs(d, &t, c->stream));
        MOE_CUBLAS_CHECK(cublasGemmBatchedEx(
            c->cublas, g.ta, g.tb, (int)g.m, (int)g.n, (int)g.k, &alpha, (const void *const *)d,
            CUDA_R_16BF, (int)g.lda, (const void *const *)(d + t.count), CUDA_R_16BF, (int)g.ldb,
            &g.beta, d + 2 * t.count, g.ctype, (int)g.ldc, t.count, CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT));
    }
    return MOE_STATUS_SUCCESS;
}

/* A row-column GEMM kind (FWD1, FWD2, BWD_DACT, BWD_DXP) for every expert, on the main stream. */
static moe_status_t run_windows(cuda_ctx_t *c, const moe_experts_t *x, const windows_t *w,
                                gemm_kind_t kind)
{
    MOE_TRY(run_window(c, x, w, kind, w->tail, w->a));
    if (w->b > 0) MOE_TRY(run_window(c, x, w, kind, w->head, w->b));
    for (int32_t e = 0; e < x->el; e++) {
        int64_t rows = rows_of(x, e);
        if (rows == 0 || 2 * rows >= w->a + w->b) continue;
        gemm_desc_t g = describe(kind, x, e, x->host_offsets[e], rows);
        MOE_TRY(run_one(c->cublas, &g));
    }
    return MOE_STATUS_SUCCESS;
}

/* A weight-gradient kind for every expert, round-robin over the side streams, after everything
 * enqueued on the main stream so far (the caller joins). */
static moe_status_t fork_weight_grads(cuda_ctx_t *c, const moe_experts_t *x, gemm_kind_t kind)
{
    MOE_TRY(fork_side(c));
    int next = 0;
    for (int32_t e = 0; e < x->el; e++) {
        int64_t rows = rows_of(x, e);
        if (rows == 0) continue;
        gemm_desc_t g = describe(kind, x, e, x->host_offsets[e], rows);
        MOE_TRY(run_one(c->side_cublas[next], &g));
        next = (next + 1) % MOE_CUDA_SIDE_STREAMS;
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t forward_windows(cuda_ctx_t *c, const moe_experts_t *a, const windows_t *w)
{
    int64_t total = a->host_offsets[a->el];
    MOE_TRY(run_windows(c, a, w, FWD1));
    MOE_CUDA_CHECK(moe_cuda_swiglu_forward(a->act, a->hpre, total, a->f, c->stream));
    return run_windows(c, a, w, FWD2);
}

/* dw2 needs only the op's inputs: it starts at once on the side streams; dw1 after SwiGLU'. */
static moe_status_t backward_windows(cuda_ctx_t *c, const moe_experts_t *a, const windows_t *w)
{
    int64_t total = a->host_offsets[a->el];
    uint16_t *d_act = a->scratch, *d_hpre = d_act + total * a->f;
    MOE_TRY(fork_weight_grads(c, a, BWD_DW2));
    MOE_TRY(run_windows(c, a, w, BWD_DACT));
    MOE_CUDA_CHECK(moe_cuda_swiglu_backward(d_hpre, d_act, a->hpre, total, a->f, c->stream));
    MOE_TRY(fork_weight_grads(c, a, BWD_DW1));
    MOE_TRY(run_windows(c, a, w, BWD_DXP));
    return join_side(c);
}

typedef moe_status_t (*windows_fn)(cuda_ctx_t *c, const moe_experts_t *a, const windows_t *w);

static moe_status_t with_windows(cuda_ctx_t *c, const moe_experts_t *a, windows_fn fn)
{
    windows_t w;
    moe_status_t st = windows_plan(c, a, &w);
    if (st == MOE_STATUS_SUCCESS) st = fn(c, a, &w);
    free(w.tail);
    return st;
}

/* ---- the ops ---------------------------------------------------------------------------------- */

moe_status_t moe_cuda_experts_forward(void *ctx, const moe_experts_t *a)
{
    cuda_ctx_t *c = ctx;
    int64_t total = a->host_offsets[a->el];
    if (total == 0) return MOE_STATUS_SUCCESS;
    cuda_gemm_mode_t mode = choose_mode(c, a);
    if (mode == CUDA_GEMM_WINDOWS) return with_windows(c, a, forward_windows);
    static const gemm_kind_t k1[] = {FWD1}, k2[] = {FWD2};
    MOE_TRY(run_experts(c, a, mode, k1, 1));
    MOE_CUDA_CHECK(moe_cuda_swiglu_forward(a->act, a->hpre, total, a->f, c->stream));
    MOE_TRY(run_experts(c, a, mode, k2, 1));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_experts_backward(void *ctx, const moe_experts_t *a)
{
    cuda_ctx_t *c = ctx;
    int64_t total = a->host_offsets[a->el];
    if (total == 0) return MOE_STATUS_SUCCESS;
    cuda_gemm_mode_t mode = choose_mode(c, a);
    if (mode == CUDA_GEMM_WINDOWS) return with_windows(c, a, backward_windows);
    static const gemm_kind_t k1[] = {BWD_DACT, BWD_DW2}, k2[] = {BWD_DXP, BWD_DW1};
    uint16_t *d_act = a->scratch, *d_hpre = d_act + total * a->f;
    MOE_TRY(run_experts(c, a, mode, k1, 2));
    MOE_CUDA_CHECK(moe_cuda_swiglu_backward(d_hpre, d_act, a->hpre, total, a->f, c->stream));
    MOE_TRY(run_experts(c, a, mode, k2, 2));
    return MOE_STATUS_SUCCESS;
}
