/*
 * The CUDA backend's context: one per runtime (no globals). Holds the stream ops are enqueued
 * on, the side streams and cuBLAS handles the expert GEMMs fan out over, a stream-ordered
 * scratch workspace the ops share, and the pinned buffer of the plan's device->host copy.
 */
#ifndef MOE_CUDA_CTX_H
#define MOE_CUDA_CTX_H

#include <stdbool.h>

#include "tuning.h"
#include "backend/backend.h"
#include "cuda_check.h"

/* Each side stream (MOE_TUNE_SIDE_STREAMS of them, for the expert GEMMs) and the main stream
 * have their own cuBLAS handle and a workspace of this size, so that concurrent GEMMs never
 * share a workspace. */
#define MOE_CUDA_CUBLAS_WORKSPACE (32u << 20)

/* How experts_forward/backward issue their GEMMs (MOE_CUDA_EXPERT_GEMM overrides AUTO). */
typedef enum cuda_gemm_mode {
    CUDA_GEMM_AUTO = 0,
    CUDA_GEMM_LOOP,    /* one cublasGemmEx per expert on the current stream */
    CUDA_GEMM_STREAMS, /* the loop spread round-robin over the side streams */
    CUDA_GEMM_BATCHED, /* cublasGemmStridedBatchedEx when every expert has the same rows */
    CUDA_GEMM_GROUPED, /* one cublasGemmGroupedBatchedEx a GEMM kind, real row counts */
    CUDA_GEMM_HOPPER   /* the grouped sm_90a kernels for the GEMMs whose M is n_e */
} cuda_gemm_mode_t;

/* How router_forward runs (MOE_CUDA_ROUTER=gemm|fused overrides AUTO). */
typedef enum cuda_router_mode {
    CUDA_ROUTER_AUTO = 0, /* the fused kernel where it applies and is faster, else GEMM */
    CUDA_ROUTER_GEMM,     /* the cuBLAS logits GEMM, then the selection kernel */
    CUDA_ROUTER_FUSED     /* the fused kernel wherever it applies (E <= 64, ...) */
} cuda_router_mode_t;

typedef struct cuda_ctx {
    int device;
    int sms; /* the device's SM count, asked once: the element-wise and grouped grids' size */
    cudaStream_t own_stream;
    cudaStream_t stream;   /* current: own_stream or the caller's */
    cublasHandle_t cublas; /* bound to `stream` */
    void *cublas_ws;
    cudaStream_t side[MOE_TUNE_SIDE_STREAMS];
    cublasHandle_t side_cublas[MOE_TUNE_SIDE_STREAMS];
    void *side_ws[MOE_TUNE_SIDE_STREAMS];
    cudaEvent_t fork, join[MOE_TUNE_SIDE_STREAMS];
    /* the checkpointer's snapshot copies (device -> pinned) run here, beside the work that
     * follows them on `stream`; snapshot_fork orders them after the work before them */
    cudaStream_t copy_stream;
    cudaEvent_t snapshot_fork;
    cuda_gemm_mode_t gemm_mode;
    cuda_router_mode_t router_mode;
    /* the expert GEMMs next to SwiGLU carry it in their epilogue (Hopper, MOE_CUDA_SWIGLU_GEMM=1;
     * off by default: no faster, docs/cuda-backend.md) */
    bool swiglu_gemm;
    /* the device runs the grouped sm_90a expert kernels (kernels/expert_gemm_sm90.cu) */
    bool sm90_kernels;
    /* this backend's stream-ordered pool; it keeps freed memory (no release at each sync),
     * so the layer's per-call buffers cost no page mapping after the first step */
    cudaMemPool_t pool;
    /* scratch shared by the ops; stream-ordered on `stream` (grown with cudaMallocAsync) */
    void *ws;
    size_t ws_bytes;
    /* the router forward's accumulators (MOE_ROUTER_STATE_BYTES, zero between launches) */
    void *router_state;
    /* pinned landing buffer of the plan's routing summary */
    void *pinned_summary;
    size_t pinned_summary_bytes;
} cuda_ctx_t;

/* Side streams 0..n-1 wait for the work enqueued so far on c->stream (fork), and c->stream
 * waits for everything enqueued on them (join). The join takes the status of the work between
 * the two and joins whatever it is, so that nothing a failed op gave the side streams outlives
 * it; it returns that status, or the join's own failure after a success. */
moe_status_t moe_cuda_fork(cuda_ctx_t *c, int n);
moe_status_t moe_cuda_join(cuda_ctx_t *c, int n, moe_status_t st);

/* A scratch pointer of at least `bytes`, valid for work enqueued on c->stream until the next
 * call. */
moe_status_t moe_cuda_workspace(cuda_ctx_t *c, size_t bytes, void **out);

/* bf16 x bf16 -> f32 or bf16 (ctype) with fp32 accumulation on the tensor cores, alpha = 1:
 * the one cuBLAS GEMM call of the backend (column-major arguments as cublasGemmEx). */
moe_status_t moe_cuda_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                           int64_t n, int64_t k, const void *a, int64_t lda, const void *b,
                           int64_t ldb, float beta, void *c, cudaDataType_t ctype, int64_t ldc);

/* Whether router_forward runs the fused kernel for these arguments (mode, shape, alignment). */
bool moe_cuda_router_uses_fused(const cuda_ctx_t *c, const moe_router_fwd_t *a);

/* op implementations (cuda_ops.c, cuda_experts.c) */
moe_status_t moe_cuda_router_forward(void *ctx, const moe_router_fwd_t *a);
moe_status_t moe_cuda_router_backward(void *ctx, const moe_router_bwd_t *a);
moe_status_t moe_cuda_expert_bias_step_op(void *ctx, float *bias, const int32_t *counts, int32_t e,
                                          int64_t slots, float rate);
moe_status_t moe_cuda_accumulate_counts_op(void *ctx, int32_t *acc, const int32_t *counts,
                                           int32_t *out, int32_t e);
moe_status_t moe_cuda_plan_op(void *ctx, const moe_plan_t *a);
moe_status_t moe_cuda_pad_plan_op(void *ctx, const moe_pad_plan_t *a);
moe_status_t moe_cuda_gather_rows_op(void *ctx, void *dst, const void *src,
                                     const int32_t *slot_of_row, int32_t k, const float *scale,
                                     int64_t rows, int64_t h);
moe_status_t moe_cuda_combine_op(void *ctx, void *dst, const void *src, const int32_t *row_of_slot,
                                 const float *w, int64_t n, int32_t k, int64_t h, bool accumulate);
moe_status_t moe_cuda_combine_weight_grad_op(void *ctx, float *dw, const void *dy, const void *rows,
                                             const int32_t *row_of_slot, int64_t n, int32_t k,
                                             int64_t h);
int64_t moe_cuda_expert_row_stride(void *ctx, int32_t el, const int64_t *kept);
/* The issue mode experts_forward/backward take for these row counts (AUTO resolved). */
cuda_gemm_mode_t moe_cuda_experts_mode(const void *ctx, const moe_experts_t *a);
moe_status_t moe_cuda_experts_forward(void *ctx, const moe_experts_t *a);
moe_status_t moe_cuda_experts_backward(void *ctx, const moe_experts_t *a);
moe_status_t moe_cuda_adamw_op(void *ctx, const moe_adamw_update_t *a);
moe_status_t moe_cuda_act_to_f32(void *ctx, float *dst, const void *src, int64_t n);
moe_status_t moe_cuda_sum_squares_op(void *ctx, const float *const *x, const int64_t *n,
                                     int32_t count, double *out);
moe_status_t moe_cuda_f32_to_act(void *ctx, void *dst, const float *src, int64_t n);

#endif /* MOE_CUDA_CTX_H */
