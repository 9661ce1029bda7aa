/*
 * The CUDA backend's router, dispatch and element-wise ops: argument plumbing around the
 * kernels/ launchers and the router's cuBLAS GEMMs.
 *
 * Shape legend: N tokens, H hidden, E experts, K top-k, R kept rows.
 * Row-major [rows, cols] arrays are handed to column-major cuBLAS as their transposes, so
 * C = A·B (row-major) is computed as C^T = B^T·A^T.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "tuning.h"
#include "cuda_ctx.h"

moe_status_t moe_cuda_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                           int64_t n, int64_t k, const void *a, int64_t lda, const void *b,
                           int64_t ldb, float beta, void *c, cudaDataType_t ctype, int64_t ldc)
{
    const float alpha = 1.0f;
    MOE_CUBLAS_CHECK(cublasGemmEx(h, ta, tb, (int)m, (int)n, (int)k, &alpha, a, CUDA_R_16BF,
                                  (int)lda, b, CUDA_R_16BF, (int)ldb, &beta, c, ctype, (int)ldc,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return MOE_STATUS_SUCCESS;
}

/* ---- router --------------------------------------------------------------------------------- */

static moe_status_t check_router_shape(int32_t e, int32_t k)
{
    if (e > MOE_ROUTER_MAX_E || k > MOE_ROUTER_MAX_K)
        return MOE_FAIL(MOE_STATUS_UNSUPPORTED,
                        "CUDA router supports E <= %d and K <= %d (E=%d K=%d)", MOE_ROUTER_MAX_E,
                        MOE_ROUTER_MAX_K, e, k);
    return MOE_STATUS_SUCCESS;
}

/* The fused kernel's shape rule (its thresholds and the measurements behind them:
 * kernels/tuning.h); a forced mode overrides it. */
bool moe_cuda_router_uses_fused(const cuda_ctx_t *c, const moe_router_fwd_t *a)
{
    if (c->router_mode == CUDA_ROUTER_GEMM ||
        !moe_cuda_router_fused_supported(a->h, a->e, a->x, a->wg, a->logits))
        return false;
    return c->router_mode == CUDA_ROUTER_FUSED || a->n >= MOE_TUNE_ROUTER_FUSED_MIN_TOKENS ||
           a->h <= MOE_TUNE_ROUTER_FUSED_MAX_SHORT_H ||
           (a->h <= MOE_TUNE_ROUTER_FUSED_MAX_SPLIT_H && moe_cuda_router_fused_splits(a->n));
}

moe_status_t moe_cuda_router_forward(void *ctx, const moe_router_fwd_t *a)
{
    cuda_ctx_t *c = ctx;
    MOE_TRY(check_router_shape(a->e, a->k));
    if (a->n == 0) {
        MOE_CUDA_CHECK(cudaMemsetAsync(a->counts, 0, sizeof(int32_t) * (size_t)a->e, c->stream));
        MOE_CUDA_CHECK(cudaMemsetAsync(a->score_mean, 0, sizeof(float) * (size_t)a->e, c->stream));
        MOE_CUDA_CHECK(cudaMemsetAsync(a->stats, 0, 2 * sizeof(float), c->stream));
        return MOE_STATUS_SUCCESS;
    }
    void *scratch;
    MOE_TRY(moe_cuda_workspace(
        c, sizeof(float) * (size_t)moe_cuda_router_forward_scratch(a->n, a->e), &scratch));
    if (moe_cuda_router_uses_fused(c, a)) {
        MOE_CUDA_CHECK(moe_cuda_router_fused(a->x, a->wg, a->bias, a->n, a->h, a->e, a->k,
                                             (int)a->score_fn, a->renormalize, a->logits,
                                             a->topk_idx, a->topk_w, a->counts, a->score_mean,
                                             a->stats, scratch, c->router_state, c->stream));
        return MOE_STATUS_SUCCESS;
    }
    /* logits [N,E] = x [N,H] · wg [H,E]  ==  logits^T = wg^T · x^T. Measured alternatives
     * (docs/cuda-backend.md): cuBLAS on a copy of wg transposed to K-major is 1.2x-2.1x
     * slower; logits computed inside the selection kernel (no GEMM launch) are 3.6x-21x
     * slower even at N*H*E <= 2^27. */
    MOE_TRY(moe_cuda_gemm(c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, a->e, a->n, a->h, a->wg, a->e, a->x,
                          a->h, 0.0f, a->logits, CUDA_R_32F, a->e));
    MOE_CUDA_CHECK(moe_cuda_router_select(
        a->logits, a->bias, a->n, a->e, a->k, (int)a->score_fn, a->renormalize, a->topk_idx,
        a->topk_w, a->counts, a->score_mean, a->stats, scratch, c->router_state, c->stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_router_backward(void *ctx, const moe_router_bwd_t *a)
{
    cuda_ctx_t *c = ctx;
    MOE_TRY(check_router_shape(a->e, a->k));
    if (a->n == 0) return MOE_STATUS_SUCCESS;
    /* dlogits in bf16 feeds the tensor-core GEMMs (the f32 copy is the op's output) */
    void *dl16;
    MOE_TRY(moe_cuda_workspace(c, 2 * (size_t)a->n * (size_t)a->e, &dl16));
    MOE_CUDA_CHECK(moe_cuda_router_dlogits(
        a->logits, a->topk_idx, a->topk_w, a->d_topk_w, a->counts, a->n, a->e, a->k,
        (int)a->score_fn, a->renormalize, a->aux_coef, a->z_coef, a->dlogits, dl16, c->stream));
    /* The two GEMMs only share their read-only input dl16: dwg runs on a side stream while
     * dx runs here, so one's memory-bound phases overlap the other's math. */
    MOE_TRY(moe_cuda_fork(c, 1));
    /* dwg [H,E] += x^T · dlogits  ==  dwg^T += dlogits^T · x */
    moe_status_t st = moe_cuda_gemm(c->side_cublas[0], CUBLAS_OP_N, CUBLAS_OP_T, a->e, a->h, a->n,
                                    dl16, a->e, a->x, a->h, 1.0f, a->dwg, CUDA_R_32F, a->e);
    /* dx [N,H] += dlogits [N,E] · wg^T  ==  dx^T += wg · dlogits^T. Written when it may be:
     * cuBLAS's beta = 1 epilogue costs more than the GEMM (bench/gemm_algos.c measures it;
     * docs/cuda-backend.md has the figures). */
    if (st == MOE_STATUS_SUCCESS)
        st = moe_cuda_gemm(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, a->h, a->n, a->e, a->wg, a->e, dl16,
                           a->e, a->overwrite_dx ? 0.0f : 1.0f, a->dx, CUDA_R_16BF, a->h);
    return moe_cuda_join(c, 1, st);
}

moe_status_t moe_cuda_expert_bias_step_op(void *ctx, float *bias, const int32_t *counts, int32_t e,
                                          int64_t slots, float rate)
{
    cuda_ctx_t *c = ctx;
    MOE_CUDA_CHECK(moe_cuda_expert_bias_step(bias, counts, e, slots, rate, c->stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_accumulate_counts_op(void *ctx, int32_t *acc, const int32_t *counts,
                                           int32_t *out, int32_t e)
{
    cuda_ctx_t *c = ctx;
    MOE_CUDA_CHECK(moe_cuda_accumulate_counts(acc, counts, out, e, c->stream));
    return MOE_STATUS_SUCCESS;
}

/* ---- dispatch ----------------------------------------------------------------------------- */

/* The plan ends with the layer's one device->host synchronisation: the kept counts size the
 * expert GEMMs, which the host launches, and the rest of the routing summary rides along in
 * the same copy. */
moe_status_t moe_cuda_plan_op(void *ctx, const moe_plan_t *a)
{
    cuda_ctx_t *c = ctx;
    void *scratch;
    MOE_TRY(moe_cuda_workspace(c, sizeof(int32_t) * (size_t)moe_cuda_plan_scratch(a->n, a->k, a->e),
                               &scratch));
    MOE_CUDA_CHECK(moe_cuda_plan(a->topk_idx, a->n, a->k, a->e, a->capacity, a->first, a->row_order,
                                 a->row_of_slot, a->slot_of_row, a->kept, scratch, c->stream));
    if (a->summary_bytes > c->pinned_summary_bytes) {
        if (c->pinned_summary) MOE_CUDA_CHECK(cudaFreeHost(c->pinned_summary));
        c->pinned_summary = NULL;
        c->pinned_summary_bytes = 0;
        MOE_CUDA_CHECK(cudaHostAlloc(&c->pinned_summary, a->summary_bytes, cudaHostAllocDefault));
        c->pinned_summary_bytes = a->summary_bytes;
    }
    MOE_CUDA_CHECK(cudaMemcpyAsync(c->pinned_summary, a->summary, a->summary_bytes,
                                   cudaMemcpyDeviceToHost, c->stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    memcpy(a->host_summary, c->pinned_summary, a->summary_bytes);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_pad_plan_op(void *ctx, const moe_pad_plan_t *a)
{
    cuda_ctx_t *c = ctx;
    MOE_CUDA_CHECK(moe_cuda_pad_plan(a->topk_idx, a->n, a->k, a->e, a->kept, a->stride,
                                     a->slot_of_row, a->row_of_slot, a->padded_slot_of_row,
                                     c->stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_gather_rows_op(void *ctx, void *dst, const void *src,
                                     const int32_t *slot_of_row, int32_t k, const float *scale,
                                     int64_t rows, int64_t h)
{
    cuda_ctx_t *c = ctx;
    MOE_CUDA_CHECK(moe_cuda_gather_rows(dst, src, slot_of_row, k, scale, rows, h, c->stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_combine_op(void *ctx, void *dst, const void *src, const int32_t *row_of_slot,
                                 const float *w, int64_t n, int32_t k, int64_t h, bool accumulate)
{
    cuda_ctx_t *c = ctx;
    MOE_CUDA_CHECK(moe_cuda_combine(dst, src, row_of_slot, w, n, k, h, accumulate, c->stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_combine_weight_grad_op(void *ctx, float *dw, const void *dy, const void *rows,
                                             const int32_t *row_of_slot, int64_t n, int32_t k,
                                             int64_t h)
{
    cuda_ctx_t *c = ctx;
    MOE_CUDA_CHECK(moe_cuda_combine_weight_grad(dw, dy, rows, row_of_slot, n, k, h, c->stream));
    return MOE_STATUS_SUCCESS;
}

/* ---- element-wise ------------------------------------------------------------------------- */

moe_status_t moe_cuda_adamw_op(void *ctx, const moe_adamw_update_t *a)
{
    cuda_ctx_t *c = ctx;
    if (a->count <= 0) return MOE_STATUS_SUCCESS;
    moe_cuda_adamw_tensor_t *t = malloc(sizeof *t * (size_t)a->count);
    if (!t) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "AdamW tensor list of %d", a->count);
    for (int32_t i = 0; i < a->count; i++) {
        const moe_adamw_tensor_t *p = &a->tensors[i];
        t[i] = (moe_cuda_adamw_tensor_t){p->master, p->m, p->v, p->param, p->grad, p->n};
    }
    /* bias corrections in fp64 on the host, as the host twin computes them */
    double bc1 = 1.0 - pow(a->beta1, (double)a->step), bc2 = 1.0 - pow(a->beta2, (double)a->step);
    cudaError_t rc = moe_cuda_adamw_multi(t, a->count, a->lr, a->beta1, a->beta2, a->eps,
                                          a->weight_decay, a->grad_scale, bc1, bc2, c->stream);
    free(t);
    MOE_CUDA_CHECK(rc);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_sum_squares_op(void *ctx, const float *const *x, const int64_t *n,
                                     int32_t count, double *out)
{
    cuda_ctx_t *c = ctx;
    void *ws;
    /* the partials and the sum in the workspace; 8 bytes come back, after the one wait */
    int64_t chunks = moe_cuda_mt_chunks(n, count);
    MOE_TRY(moe_cuda_workspace(c, sizeof(double) * (size_t)(chunks + 1), &ws));
    double *partial = ws, *sum = partial + chunks;
    MOE_CUDA_CHECK(moe_cuda_sum_squares_multi(x, n, count, partial, sum, c->stream));
    MOE_CUDA_CHECK(cudaMemcpyAsync(out, sum, sizeof *out, cudaMemcpyDeviceToHost, c->stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_act_to_f32(void *ctx, float *dst, const void *src, int64_t n)
{
    cuda_ctx_t *c = ctx;
    MOE_CUDA_CHECK(moe_cuda_bf16_to_f32(dst, src, n, c->sms, c->stream));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_f32_to_act(void *ctx, void *dst, const float *src, int64_t n)
{
    cuda_ctx_t *c = ctx;
    MOE_CUDA_CHECK(moe_cuda_f32_to_bf16(dst, src, n, c->sms, c->stream));
    return MOE_STATUS_SUCCESS;
}
