/*
 * The CUDA backend's context: one per runtime (no globals). Holds the stream ops are enqueued
 * on, the side streams and cuBLAS handles the expert GEMMs fan out over, a stream-ordered
 * scratch workspace the ops share, and the pinned buffer of the plan's device->host copy.
 */
#ifndef MOE_CUDA_CTX_H
#define MOE_CUDA_CTX_H

#include <stdbool.h>

#include <cublasLt.h>

#include "../backend.h"
#include "../../core/log.h"
#include "cuda_check.h"

/* Side streams for the expert GEMMs (each with its own cuBLAS handle and workspace, so that
 * concurrent GEMMs never share a workspace). */
#define MOE_CUDA_SIDE_STREAMS 4
#define MOE_CUDA_CUBLAS_WORKSPACE (32u << 20)

/* How experts_forward/backward issue their GEMMs (MOE_CUDA_EXPERT_GEMM overrides AUTO). */
typedef enum cuda_gemm_mode {
    CUDA_GEMM_AUTO = 0,
    CUDA_GEMM_LOOP,      /* one cublasGemmEx per expert on the current stream */
    CUDA_GEMM_STREAMS,   /* the loop spread round-robin over the side streams */
    CUDA_GEMM_BATCHED    /* cublasGemmStridedBatchedEx when every expert has the same rows */
} cuda_gemm_mode_t;

/* How router_forward runs (MOE_CUDA_ROUTER=gemm|fused overrides AUTO). */
typedef enum cuda_router_mode {
    CUDA_ROUTER_AUTO = 0, /* the fused kernel where it applies and is faster, else GEMM */
    CUDA_ROUTER_GEMM,     /* the cuBLAS logits GEMM, then the selection kernel */
    CUDA_ROUTER_FUSED     /* the fused kernel wherever it applies (E <= 64, ...) */
} cuda_router_mode_t;

/* One GEMM (column-major, as cublasGemmEx): C[m,n] = op(A)[m,k] op(B)[k,n] (+ beta C), bf16
 * A and B, bf16 or f32 C (ctype), fp32 accumulation; batch > 1: strided batched with strides
 * sa, sb, sc between consecutive problems. tune: pick the algorithm by timing when beta is 0
 * (cuda_gemm.c), for the GEMMs where cuBLAS's default was measured to leave time behind. */
typedef struct cuda_gemm {
    cublasOperation_t ta, tb;
    int64_t m, n, k;
    const void *a, *b;
    void *c;
    int64_t lda, ldb, ldc;
    long long sa, sb, sc;
    cudaDataType_t ctype;
    float beta;
    int32_t batch;
    bool tune;
} cuda_gemm_t;

/* The tuned GEMMs (cuda_gemm.c): a shape class and the algorithm chosen for it. */
#define MOE_CUDA_GEMM_CLASSES 64
#define MOE_CUDA_GEMM_CANDIDATES 8
typedef struct cuda_gemm_class {
    int64_t m, n, k, ld[3];
    int32_t ta, tb, ctype, batched;
    uint32_t align[3];
} cuda_gemm_class_t;

typedef struct cuda_gemm_choice {
    cuda_gemm_class_t cls;
    bool tuned; /* false: cublasGemmEx's own choice */
    cublasLtMatmulAlgo_t algo;
} cuda_gemm_choice_t;

typedef struct cuda_ctx {
    int device;
    cudaStream_t own_stream;
    cudaStream_t stream;                 /* current: own_stream or the caller's */
    cublasHandle_t cublas;               /* bound to `stream` */
    void *cublas_ws;
    cudaStream_t side[MOE_CUDA_SIDE_STREAMS];
    cublasHandle_t side_cublas[MOE_CUDA_SIDE_STREAMS];
    void *side_ws[MOE_CUDA_SIDE_STREAMS];
    cudaEvent_t fork, join[MOE_CUDA_SIDE_STREAMS];
    cuda_gemm_mode_t gemm_mode;
    cuda_router_mode_t router_mode;
    const moe_logger_t *logger; /* the runtime's (may be NULL) */
    /* tuned GEMMs (cuda_gemm.c): on unless MOE_CUDA_GEMM_TUNE=0 */
    cublasLtHandle_t cublaslt;
    bool gemm_tune;
    cudaEvent_t tune_ev[MOE_CUDA_GEMM_CANDIDATES + 2];
    unsigned long long *tune_sums; /* device: the tuning entries' output checksums */
    int gemm_choices;
    cuda_gemm_choice_t gemm_choice[MOE_CUDA_GEMM_CLASSES];
    /* this backend's stream-ordered pool; it keeps freed memory (no release at each sync),
     * so the layer's per-call buffers cost no page mapping after the first step */
    cudaMemPool_t pool;
    /* scratch shared by the ops; stream-ordered on `stream` (grown with cudaMallocAsync) */
    void *ws;
    size_t ws_bytes;
    /* router_select's completion tickets (MOE_ROUTER_TICKETS, zero between launches) */
    unsigned *router_tickets;
    /* pinned landing buffer of the plan's routing summary */
    void *pinned_summary;
    size_t pinned_summary_bytes;
} cuda_ctx_t;

/* Side streams 0..n-1 wait for the work enqueued so far on c->stream (fork), and c->stream
 * waits for everything enqueued on them (join). */
moe_status_t moe_cuda_fork(cuda_ctx_t *c, int n);
moe_status_t moe_cuda_join(cuda_ctx_t *c, int n);

/* A scratch pointer of at least `bytes`, valid for work enqueued on c->stream until the next
 * call. */
moe_status_t moe_cuda_workspace(cuda_ctx_t *c, size_t bytes, void **out);

/* Every GEMM of the backend: g on the main stream (lane -1) or side stream `lane`, with the
 * algorithm tuned for its shape class when g->tune and beta is 0 (cuda_gemm.c), else
 * cuBLAS's default. */
moe_status_t moe_cuda_gemm_run(cuda_ctx_t *c, int lane, const cuda_gemm_t *g);
/* The tuning candidates for g (cublasLt heuristic, one pass per output: no split-K), and one
 * run of g with a given algorithm; tests check that every candidate writes the same bits. */
moe_status_t moe_cuda_gemm_candidates(const cuda_ctx_t *c, const cuda_gemm_t *g,
                                      cublasLtMatmulAlgo_t *out, int max, int *count);
moe_status_t moe_cuda_gemm_run_algo(const cuda_ctx_t *c, int lane, const cuda_gemm_t *g,
                                    const cublasLtMatmulAlgo_t *algo);

/* Whether router_forward runs the fused kernel for these arguments (mode, shape, alignment). */
bool moe_cuda_router_uses_fused(const cuda_ctx_t *c, const moe_router_fwd_t *a);

/* op implementations (cuda_ops.c, cuda_experts.c) */
moe_status_t moe_cuda_router_forward(void *ctx, const moe_router_fwd_t *a);
moe_status_t moe_cuda_router_backward(void *ctx, const moe_router_bwd_t *a);
moe_status_t moe_cuda_expert_bias_step_op(void *ctx, float *bias, const int32_t *counts,
                                          int32_t e, int64_t slots, float rate);
moe_status_t moe_cuda_plan_op(void *ctx, const moe_plan_t *a);
moe_status_t moe_cuda_pad_plan_op(void *ctx, const moe_pad_plan_t *a);
moe_status_t moe_cuda_gather_rows_op(void *ctx, void *dst, const void *src,
                                     const int32_t *slot_of_row, int32_t k, const float *scale,
                                     int64_t rows, int64_t h);
moe_status_t moe_cuda_combine_op(void *ctx, void *dst, const void *src, const int32_t *row_of_slot,
                                 const float *w, int64_t n, int32_t k, int64_t h, bool accumulate);
moe_status_t moe_cuda_combine_weight_grad_op(void *ctx, float *dw, const void *dy,
                                             const void *rows, const int32_t *row_of_slot,
                                             int64_t n, int32_t k, int64_t h);
int64_t moe_cuda_expert_row_stride(void *ctx, int32_t el, const int64_t *kept);
moe_status_t moe_cuda_experts_forward(void *ctx, const moe_experts_t *a);
moe_status_t moe_cuda_experts_backward(void *ctx, const moe_experts_t *a);
moe_status_t moe_cuda_adamw_op(void *ctx, const moe_adamw_update_t *a);
moe_status_t moe_cuda_act_to_f32(void *ctx, float *dst, const void *src, int64_t n);
moe_status_t moe_cuda_f32_to_act(void *ctx, void *dst, const float *src, int64_t n);

#endif /* MOE_CUDA_CTX_H */
