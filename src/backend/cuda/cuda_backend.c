/*
 * The CUDA backend: device memory, the stream, cuBLAS handles and workspaces (one set per
 * backend, no globals), and the op table that launches kernels/ (cuda_ops.c) and the expert
 * GEMMs (cuda_experts.c).
 */
#include <stdlib.h>
#include <string.h>

#include "cuda_ctx.h"
#include "kernels.h"
#include "core/env.h"

int moe_backend_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no driver" error */
        return 0;
    }
    return n;
}

static void cuda_destroy(void *vctx)
{
    cuda_ctx_t *c = vctx;
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->ws) cudaFreeAsync(c->ws, c->stream);
    if (c->stream) cudaStreamSynchronize(c->stream);
    if (c->pinned_summary) cudaFreeHost(c->pinned_summary);
    if (c->router_state) cudaFree(c->router_state);
    for (int i = 0; i < MOE_TUNE_SIDE_STREAMS; i++) {
        if (c->side_cublas[i]) cublasDestroy(c->side_cublas[i]);
        if (c->side_ws[i]) cudaFree(c->side_ws[i]);
        if (c->side[i]) cudaStreamDestroy(c->side[i]);
        if (c->join[i]) cudaEventDestroy(c->join[i]);
    }
    if (c->fork) cudaEventDestroy(c->fork);
    if (c->copy_stream) cudaStreamSynchronize(c->copy_stream);
    if (c->copy_stream) cudaStreamDestroy(c->copy_stream);
    if (c->snapshot_fork) cudaEventDestroy(c->snapshot_fork);
    if (c->cublas) cublasDestroy(c->cublas);
    if (c->cublas_ws) cudaFree(c->cublas_ws);
    if (c->own_stream) cudaStreamDestroy(c->own_stream);
    if (c->pool) cudaMemPoolDestroy(c->pool); /* released once outstanding blocks are freed */
    free(c);
}

/* Free the workspace in the order of the stream that uses it. */
static moe_status_t drop_workspace(cuda_ctx_t *c)
{
    if (c->ws) MOE_CUDA_CHECK(cudaFreeAsync(c->ws, c->stream));
    c->ws = NULL;
    c->ws_bytes = 0;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_fork(cuda_ctx_t *c, int n)
{
    MOE_CUDA_CHECK(cudaEventRecord(c->fork, c->stream));
    for (int s = 0; s < n; s++) MOE_CUDA_CHECK(cudaStreamWaitEvent(c->side[s], c->fork, 0));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_join(cuda_ctx_t *c, int n, moe_status_t st)
{
    for (int s = 0; s < n; s++) {
        cudaError_t rc = cudaEventRecord(c->join[s], c->side[s]);
        if (rc == cudaSuccess) rc = cudaStreamWaitEvent(c->stream, c->join[s], 0);
        if (rc != cudaSuccess && st == MOE_STATUS_SUCCESS)
            st = MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "CUDA join of side stream %d: %s", s,
                          cudaGetErrorString(rc));
    }
    return st;
}

moe_status_t moe_cuda_workspace(cuda_ctx_t *c, size_t bytes, void **out)
{
    if (bytes > c->ws_bytes) {
        MOE_TRY(drop_workspace(c));
        size_t want = bytes + bytes / 4; /* headroom: shapes drift between microbatches */
        cudaError_t rc = cudaMallocFromPoolAsync(&c->ws, want, c->pool, c->stream);
        if (rc != cudaSuccess)
            return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "CUDA workspace of %zu bytes: %s", want,
                            cudaGetErrorString(rc));
        c->ws_bytes = want;
    }
    *out = c->ws;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_alloc(void *vctx, size_t bytes, void **out)
{
    cuda_ctx_t *c = vctx;
    *out = NULL;
    if (bytes == 0) return MOE_STATUS_SUCCESS;
    MOE_CUDA_CHECK(cudaSetDevice(c->device));
    cudaError_t rc = cudaMallocFromPoolAsync(out, bytes, c->pool, c->stream);
    if (rc != cudaSuccess)
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "cudaMallocFromPoolAsync of %zu bytes: %s", bytes,
                        cudaGetErrorString(rc));
    return MOE_STATUS_SUCCESS;
}

static void cuda_free(void *vctx, void *p)
{
    cuda_ctx_t *c = vctx;
    if (p) cudaFreeAsync(p, c->stream);
}

static moe_status_t cuda_alloc_pinned(void *vctx, size_t bytes, void **out)
{
    (void)vctx;
    *out = NULL;
    if (bytes == 0) return MOE_STATUS_SUCCESS;
    cudaError_t rc = cudaHostAlloc(out, bytes, cudaHostAllocDefault);
    if (rc != cudaSuccess)
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "cudaHostAlloc of %zu bytes: %s", bytes,
                        cudaGetErrorString(rc));
    return MOE_STATUS_SUCCESS;
}

static void cuda_free_pinned(void *vctx, void *p)
{
    (void)vctx;
    if (p) cudaFreeHost(p);
}

static moe_status_t cuda_memset_zero(void *vctx, void *p, size_t bytes)
{
    cuda_ctx_t *c = vctx;
    if (bytes == 0) return MOE_STATUS_SUCCESS;
    MOE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, c->stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_copy(void *vctx, void *dst, const void *src, size_t bytes)
{
    cuda_ctx_t *c = vctx;
    if (bytes == 0) return MOE_STATUS_SUCCESS;
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_copy_device(void *vctx, void *dst, const void *src, size_t bytes)
{
    cuda_ctx_t *c = vctx;
    if (bytes == 0) return MOE_STATUS_SUCCESS;
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_synchronize(void *vctx)
{
    cuda_ctx_t *c = vctx;
    MOE_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_set_stream(void *vctx, void *stream)
{
    cuda_ctx_t *c = vctx;
    cudaStream_t next = stream ? (cudaStream_t)stream : c->own_stream;
    if (next == c->stream) return MOE_STATUS_SUCCESS;
    /* the workspace is ordered on the old stream: free it there, regrow on the new one */
    MOE_TRY(drop_workspace(c));
    c->stream = next;
    MOE_CUBLAS_CHECK(cublasSetStream(c->cublas, c->stream));
    return MOE_STATUS_SUCCESS;
}

static void *cuda_stream(void *vctx) { return ((cuda_ctx_t *)vctx)->stream; }

/* ---- snapshot copies (backend.h): the copy stream and its events ---- */

static moe_status_t cuda_snapshot_begin(void *vctx)
{
    cuda_ctx_t *c = vctx;
    MOE_CUDA_CHECK(cudaEventRecord(c->snapshot_fork, c->stream));
    MOE_CUDA_CHECK(cudaStreamWaitEvent(c->copy_stream, c->snapshot_fork, 0));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_snapshot_copy(void *vctx, void *dst, const void *src, size_t bytes)
{
    cuda_ctx_t *c = vctx;
    if (bytes == 0) return MOE_STATUS_SUCCESS;
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->copy_stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_snapshot_mark(void *vctx, void **event)
{
    cuda_ctx_t *c = vctx;
    if (!*event) {
        cudaEvent_t ev;
        MOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        *event = ev;
    }
    MOE_CUDA_CHECK(cudaEventRecord((cudaEvent_t)*event, c->copy_stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_event_wait(void *vctx, void *event)
{
    (void)vctx;
    MOE_CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)event));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_event_fence(void *vctx, void *event)
{
    cuda_ctx_t *c = vctx;
    MOE_CUDA_CHECK(cudaStreamWaitEvent(c->stream, (cudaEvent_t)event, 0));
    return MOE_STATUS_SUCCESS;
}

static void cuda_event_destroy(void *vctx, void *event)
{
    (void)vctx;
    if (event) cudaEventDestroy((cudaEvent_t)event);
}

static const moe_backend_ops_t cuda_ops = {
    .name = "cuda",
    .kind = MOE_BACKEND_CUDA,
    .compute_dtype = MOE_DTYPE_BF16,
    .max_experts = MOE_ROUTER_MAX_E,
    .max_top_k = MOE_ROUTER_MAX_K,
    .device = MOE_DEVICE_CUDA,
    .destroy = cuda_destroy,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .alloc_pinned = cuda_alloc_pinned,
    .free_pinned = cuda_free_pinned,
    .memset_zero = cuda_memset_zero,
    .copy = cuda_copy,
    .copy_device = cuda_copy_device,
    .synchronize = cuda_synchronize,
    .set_stream = cuda_set_stream,
    .stream = cuda_stream,
    .snapshot_begin = cuda_snapshot_begin,
    .snapshot_copy = cuda_snapshot_copy,
    .snapshot_mark = cuda_snapshot_mark,
    .event_wait = cuda_event_wait,
    .event_fence = cuda_event_fence,
    .event_destroy = cuda_event_destroy,
    .act_to_f32 = moe_cuda_act_to_f32,
    .f32_to_act = moe_cuda_f32_to_act,
    .router_forward = moe_cuda_router_forward,
    .router_backward = moe_cuda_router_backward,
    .expert_bias_step = moe_cuda_expert_bias_step_op,
    .accumulate_counts = moe_cuda_accumulate_counts_op,
    .plan = moe_cuda_plan_op,
    .expert_row_stride = moe_cuda_expert_row_stride,
    .pad_plan = moe_cuda_pad_plan_op,
    .gather_rows = moe_cuda_gather_rows_op,
    .combine = moe_cuda_combine_op,
    .combine_weight_grad = moe_cuda_combine_weight_grad_op,
    .experts_forward = moe_cuda_experts_forward,
    .experts_backward = moe_cuda_experts_backward,
    .adamw_update = moe_cuda_adamw_op,
    .sum_squares = moe_cuda_sum_squares_op,
};

/* A cuBLAS handle on `stream` with its own workspace (deterministic: no atomics mode). */
static moe_status_t make_cublas(cudaStream_t stream, cublasHandle_t *h, void **ws)
{
    MOE_CUBLAS_CHECK(cublasCreate(h));
    MOE_CUBLAS_CHECK(cublasSetStream(*h, stream));
    MOE_CUDA_CHECK(cudaMalloc(ws, MOE_CUDA_CUBLAS_WORKSPACE));
    MOE_CUBLAS_CHECK(cublasSetWorkspace(*h, *ws, MOE_CUDA_CUBLAS_WORKSPACE));
    MOE_CUBLAS_CHECK(cublasSetAtomicsMode(*h, CUBLAS_ATOMICS_NOT_ALLOWED));
    return MOE_STATUS_SUCCESS;
}

static cuda_gemm_mode_t gemm_mode_from_env(const moe_logger_t *logger)
{
    /* in the order of the table's choices auto|loop|streams|batched|grouped|hopper */
    static const cuda_gemm_mode_t modes[] = {CUDA_GEMM_AUTO,    CUDA_GEMM_LOOP,
                                             CUDA_GEMM_STREAMS, CUDA_GEMM_BATCHED,
                                             CUDA_GEMM_GROUPED, CUDA_GEMM_HOPPER};
    return modes[moe_env_choice(MOE_ENV_CUDA_EXPERT_GEMM, 0, logger)];
}

static cuda_router_mode_t router_mode_from_env(const moe_logger_t *logger)
{
    /* in the order of the table's choices auto|gemm|fused */
    static const cuda_router_mode_t modes[] = {CUDA_ROUTER_AUTO, CUDA_ROUTER_GEMM,
                                               CUDA_ROUTER_FUSED};
    return modes[moe_env_choice(MOE_ENV_CUDA_ROUTER, 0, logger)];
}

/* Opt-in: the SwiGLU GEMMs are correct but no faster than cuBLAS + the SwiGLU kernels in a
 * layer step (docs/cuda-backend.md). */
static bool swiglu_gemm_from_env(int device, const moe_logger_t *logger)
{
    if (!moe_env_flag(MOE_ENV_CUDA_SWIGLU_GEMM, false, logger)) return false;
    bool ok = moe_cuda_swiglu_gemm_supported(device);
    moe_log(logger, MOE_LOG_INFO, "MOE_CUDA_SWIGLU_GEMM=1: %s",
            ok ? "SwiGLU in the expert GEMMs"
               : "not on this device (needs compute capability 9.0 and the sm_90a image)");
    return ok;
}

moe_status_t moe_backend_cuda_create(const moe_backend_params_t *p, moe_backend_t *out)
{
    cuda_ctx_t *c = calloc(1, sizeof *c);
    if (!c) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "CUDA backend context");
    c->device = p->device_index;
    moe_status_t st;
    MOE_CUDA_CHECK_GOTO(st, cudaSetDevice(c->device));
    MOE_CUDA_CHECK_GOTO(st,
                        cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, c->device));
    MOE_CUDA_CHECK_GOTO(st, cudaStreamCreateWithFlags(&c->own_stream, cudaStreamNonBlocking));
    c->stream = c->own_stream;
    struct cudaMemPoolProps props = {
        .allocType = cudaMemAllocationTypePinned,
        .location = {.type = cudaMemLocationTypeDevice, .id = c->device}};
    MOE_CUDA_CHECK_GOTO(st, cudaMemPoolCreate(&c->pool, &props));
    uint64_t keep = UINT64_MAX;
    MOE_CUDA_CHECK_GOTO(st,
                        cudaMemPoolSetAttribute(c->pool, cudaMemPoolAttrReleaseThreshold, &keep));
    MOE_TRY_GOTO(st, make_cublas(c->stream, &c->cublas, &c->cublas_ws));
    MOE_CUDA_CHECK_GOTO(st, cudaMalloc(&c->router_state, MOE_ROUTER_STATE_BYTES));
    /* zero before any stream (the caller's too) can use them */
    MOE_CUDA_CHECK_GOTO(st, cudaMemsetAsync(c->router_state, 0, MOE_ROUTER_STATE_BYTES, c->stream));
    MOE_CUDA_CHECK_GOTO(st, cudaStreamSynchronize(c->stream));
    MOE_CUDA_CHECK_GOTO(st, cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming));
    MOE_CUDA_CHECK_GOTO(st, cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking));
    MOE_CUDA_CHECK_GOTO(st, cudaEventCreateWithFlags(&c->snapshot_fork, cudaEventDisableTiming));
    for (int i = 0; i < MOE_TUNE_SIDE_STREAMS; i++) {
        MOE_CUDA_CHECK_GOTO(st, cudaStreamCreateWithFlags(&c->side[i], cudaStreamNonBlocking));
        MOE_CUDA_CHECK_GOTO(st, cudaEventCreateWithFlags(&c->join[i], cudaEventDisableTiming));
        MOE_TRY_GOTO(st, make_cublas(c->side[i], &c->side_cublas[i], &c->side_ws[i]));
    }
    c->gemm_mode = gemm_mode_from_env(p->logger);
    c->router_mode = router_mode_from_env(p->logger);
    c->swiglu_gemm = swiglu_gemm_from_env(c->device, p->logger);
    c->sm90_kernels = moe_cuda_swiglu_gemm_supported(c->device);
    out->ops = &cuda_ops;
    out->ctx = c;
    return MOE_STATUS_SUCCESS;
fail:
    cuda_destroy(c);
    return st;
}
