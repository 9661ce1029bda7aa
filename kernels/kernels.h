/*
 * extern "C" launchers of libmoe's CUDA kernels (one .cu per op family). Each enqueues on
 * `stream` and returns the launch status (cudaGetLastError), so the C backend translates it
 * into a moe_status_t at one place. Nothing here allocates: scratch comes from the caller.
 *
 * Shape legend: N tokens, H hidden, E experts, K top-k, F expert FFN width, R permuted rows.
 * "bf16" pointers are __nv_bfloat16 on the device, passed as void * so C can call these.
 */
#ifndef MOE_KERNELS_H
#define MOE_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Launchers that size their grid by the device take `sms`, its SM count, which the caller
 * asks the device for once and keeps (the CUDA backend's context), not at every launch. */

/* ---- router (router_select.cu, router_fused.cu, router_backward.cu) ---- */

/* The router kernels keep a token's E scores in registers, at most 16 on each of 32 lanes. */
#define MOE_ROUTER_MAX_E 512
#define MOE_ROUTER_MAX_K 8

/* Floats of scratch the forward kernels (router_select or router_fused) need for their
 * per-block sums. */
int64_t moe_cuda_router_forward_scratch(int64_t n, int32_t e);

/* Bytes of the forward's accumulators that outlive a launch (the statistics' sums over blocks,
 * their NaN flags, a completion ticket and the slots of sums too large for fixed point): zeroed
 * once by the owner; every launch leaves them zero again. Launches sharing them must be
 * stream-ordered. */
#define MOE_ROUTER_STATE_BYTES 8448

/* From logits f32 [N,E]: scores, top-k on score + bias, weights, and the statistics, in one
 * kernel. counts/score_mean/stats are written (not accumulated); scratch as sized above;
 * state: MOE_ROUTER_STATE_BYTES zeroed bytes. */
cudaError_t moe_cuda_router_select(const float *logits, const float *bias, int64_t n, int32_t e,
                                   int32_t k, int score_fn, bool renormalize, int32_t *topk_idx,
                                   float *topk_w, int32_t *counts, float *score_mean, float *stats,
                                   float *scratch, void *state, cudaStream_t stream);

/* The whole forward in one kernel for E <= 64: logits f32 [N,E] = x bf16 [N,H] . wg bf16 [H,E]
 * on the tensor cores, then the selection as above, without a second pass over the logits.
 * Only where moe_cuda_router_fused_supported (E % 8 == 0, H % 8 == 0, 16-byte aligned
 * pointers); scratch and state as for moe_cuda_router_select. */
bool moe_cuda_router_fused_supported(int64_t h, int32_t e, const void *x, const void *wg,
                                     const float *logits);
/* Whether moe_cuda_router_fused splits H over thread-block clusters for N tokens (few
 * tokens). */
bool moe_cuda_router_fused_splits(int64_t n);
cudaError_t moe_cuda_router_fused(const void *x, const void *wg, const float *bias, int64_t n,
                                  int64_t h, int32_t e, int32_t k, int score_fn, bool renormalize,
                                  float *logits, int32_t *topk_idx, float *topk_w, int32_t *counts,
                                  float *score_mean, float *stats, float *scratch, void *state,
                                  cudaStream_t stream);

/* dlogits f32 [N,E] (and its bf16 copy for the tensor-core GEMMs) from d(topk_w) and the
 * aux/z coefficients; see host_router.c for the formulas. */
cudaError_t moe_cuda_router_dlogits(const float *logits, const int32_t *topk_idx,
                                    const float *topk_w, const float *d_topk_w,
                                    const int32_t *counts, int64_t n, int32_t e, int32_t k,
                                    int score_fn, bool renormalize, float aux_coef, float z_coef,
                                    float *dlogits, void *dlogits_bf16, cudaStream_t stream);

/* The expert-bias sign rule (see moe_backend_ops_t.expert_bias_step). */
cudaError_t moe_cuda_expert_bias_step(float *bias, const int32_t *counts, int32_t e, int64_t slots,
                                      float rate, cudaStream_t stream);
/* Global-batch balancing's running counts (see moe_backend_ops_t.accumulate_counts). */
cudaError_t moe_cuda_accumulate_counts(int32_t *acc, const int32_t *counts, int32_t *out, int32_t e,
                                       cudaStream_t stream);

/* ---- dispatch (dispatch.cu) ---- */

/* Int32 scratch the plan needs: per-chunk expert histograms plus row bases. */
int64_t moe_cuda_plan_scratch(int64_t n, int32_t k, int32_t e);

/* Stable counting sort of the N*K slots by expert with capacity drop (see moe_plan_t). */
cudaError_t moe_cuda_plan(const int32_t *topk_idx, int64_t n, int32_t k, int32_t e,
                          int64_t capacity, const int32_t *first, const int32_t *row_order,
                          int32_t *row_of_slot, int32_t *slot_of_row, int32_t *kept,
                          int32_t *scratch, cudaStream_t stream);

/* The plan re-laid with `stride` rows per expert (see moe_pad_plan_t). */
cudaError_t moe_cuda_pad_plan(const int32_t *topk_idx, int64_t n, int32_t k, int32_t e,
                              const int32_t *kept, int64_t stride, const int32_t *slot_of_row,
                              int32_t *row_of_slot, int32_t *padded_slot_of_row,
                              cudaStream_t stream);

/* Rows with slot_of_row < 0 (a padded layout's filler) are written as zeros. */
cudaError_t moe_cuda_gather_rows(void *dst, const void *src, const int32_t *slot_of_row, int32_t k,
                                 const float *scale, int64_t rows, int64_t h, cudaStream_t stream);
/* accumulate: dst += the sum (dst read first, one rounding) */
cudaError_t moe_cuda_combine(void *dst, const void *src, const int32_t *row_of_slot, const float *w,
                             int64_t n, int32_t k, int64_t h, bool accumulate, cudaStream_t stream);
cudaError_t moe_cuda_combine_weight_grad(float *dw, const void *dy, const void *rows,
                                         const int32_t *row_of_slot, int64_t n, int32_t k,
                                         int64_t h, cudaStream_t stream);

/* ---- SwiGLU (swiglu.cu) ---- */

/* act[r,:] = silu(hpre[r,0,:]) * hpre[r,1,:], R rows of F */
cudaError_t moe_cuda_swiglu_forward(void *act, const void *hpre, int64_t rows, int64_t f, int sms,
                                    cudaStream_t stream);
/* d_hpre[r,0,:] = d_act * up * silu'(gate), d_hpre[r,1,:] = d_act * silu(gate) */
cudaError_t moe_cuda_swiglu_backward(void *d_hpre, const void *d_act, const void *hpre,
                                     int64_t rows, int64_t f, int sms, cudaStream_t stream);

/* ---- the grouped expert GEMMs, SwiGLU in the epilogue or not, Hopper only (expert_gemm_sm90.cu) */

#define MOE_SWIGLU_GEMM_MAX_EXPERTS 256

/* Whether `device` can run them (compute capability 9.0 and the sm_90a image present), and
 * whether a shape fits them (El <= 256, H % 8 == 0, F % 128 == 0). */
bool moe_cuda_swiglu_gemm_supported(int device);
bool moe_cuda_swiglu_gemm_fits(int32_t el, int64_t h, int64_t f);
/* Per local expert e, rows [offsets[e], offsets[e+1]) (host array, El + 1 entries):
 * hpre = xp . w1[e] and act = silu(gate) * up, in one grouped launch. */
cudaError_t moe_cuda_swiglu_gemm_forward(void *hpre, void *act, const void *xp, const void *w1,
                                         const int64_t *offsets, int32_t el, int64_t h, int64_t f,
                                         int sms, cudaStream_t stream);
/* d_hpre = swiglu'(hpre, d_out . w2[e]^T), the same rows. */
cudaError_t moe_cuda_swiglu_gemm_backward(void *d_hpre, const void *d_out, const void *w2,
                                          const void *hpre, const int64_t *offsets, int32_t el,
                                          int64_t h, int64_t f, int sms, cudaStream_t stream);
/* c [R,N] = a [R,K] . b[e] for the same rows, bf16 out: b holds El row-major [K,N] matrices
 * (b_k_major false) or El row-major [N,K] ones (true: their transposes); where the SwiGLU
 * kernels fit, with K and N each one of H, F, 2F. */
cudaError_t moe_cuda_grouped_gemm(void *c, const void *a, const void *b, bool b_k_major,
                                  const int64_t *offsets, int32_t el, int64_t k, int64_t n, int sms,
                                  cudaStream_t stream);

/* ---- element-wise (elementwise.cu) ---- */

cudaError_t moe_cuda_bf16_to_f32(float *dst, const void *src, int64_t n, int sms,
                                 cudaStream_t stream);
cudaError_t moe_cuda_f32_to_bf16(void *dst, const float *src, int64_t n, int sms,
                                 cudaStream_t stream);
/* ---- the optimizer's multi-tensor passes (adamw.cu) ---- */

/* A launch takes up to MOE_MT_TENSORS tensors (their pointers are kernel parameters); each
 * block MOE_MT_CHUNK elements of one tensor. */
#define MOE_MT_TENSORS 64
#define MOE_MT_CHUNK 8192
typedef struct moe_cuda_adamw_tensor {
    float *master, *m, *v; /* f32 [n] */
    void *param;           /* bf16 [n]: the updated master, rounded */
    const float *grad;     /* f32 [n] */
    int64_t n;
} moe_cuda_adamw_tensor_t;
/* AdamW (moe/optim.h) over count tensors (a host array); bc1/bc2 are the bias corrections
 * 1 - beta^step. The host twin's arithmetic exactly (adamw.cu). */
cudaError_t moe_cuda_adamw_multi(const moe_cuda_adamw_tensor_t *t, int32_t count, float lr,
                                 float beta1, float beta2, float eps, float weight_decay,
                                 float grad_scale, double bc1, double bc2, cudaStream_t stream);
/* The partial sums moe_cuda_sum_squares_multi writes for these sizes: one per chunk. */
int64_t moe_cuda_mt_chunks(const int64_t *n, int32_t count);
/* out[0] = sum over the count tensors x[i] (host array of device pointers, n[i] floats) of
 * their squares in fp64: a fixed partial per chunk (each thread a fixed stride of it, each
 * block a fixed tree), then one block's tree over the partials, so the order depends on the
 * sizes alone. partial: device scratch of moe_cuda_mt_chunks(n, count) doubles; out: one
 * device double. */
cudaError_t moe_cuda_sum_squares_multi(const float *const *x, const int64_t *n, int32_t count,
                                       double *partial, double *out, cudaStream_t stream);

/* ---- pointer arrays (pointer_upload.cu) ---- */

/* dst[0..n) = src[0..n) (host-computed device pointers), written by kernels enqueued on
 * `stream`: src may be reused as soon as this returns. */
cudaError_t moe_cuda_upload_pointers(const void **dst, const void *const *src, int64_t n,
                                     cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MOE_KERNELS_H */
