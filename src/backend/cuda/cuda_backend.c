/*
 * The CUDA backend: device memory, the stream, cuBLAS handles and workspaces (one set per
 * backend, no globals), and the op table that launches kernels/.
 */
#include <stdlib.h>

#include "../backend.h"
#include "cuda_check.h"

typedef struct cuda_ctx {
    int device;
    cudaStream_t own_stream;
    cudaStream_t stream;
    cublasHandle_t cublas;
    const moe_logger_t *logger;
} cuda_ctx_t;

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
    if (c->cublas) cublasDestroy(c->cublas);
    if (c->own_stream) cudaStreamDestroy(c->own_stream);
    free(c);
}

static moe_status_t cuda_alloc(void *vctx, size_t bytes, void **out)
{
    cuda_ctx_t *c = vctx;
    *out = NULL;
    if (bytes == 0) return MOE_STATUS_SUCCESS;
    MOE_CUDA_CHECK(cudaSetDevice(c->device));
    cudaError_t rc = cudaMallocAsync(out, bytes, c->stream);
    if (rc != cudaSuccess)
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "cudaMallocAsync of %zu bytes: %s", bytes,
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

static moe_status_t cuda_synchronize(void *vctx)
{
    cuda_ctx_t *c = vctx;
    MOE_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_set_stream(void *vctx, void *stream)
{
    cuda_ctx_t *c = vctx;
    c->stream = stream ? (cudaStream_t)stream : c->own_stream;
    MOE_CUBLAS_CHECK(cublasSetStream(c->cublas, c->stream));
    return MOE_STATUS_SUCCESS;
}

static const moe_backend_ops_t cuda_ops = {
    .name = "cuda",
    .kind = MOE_BACKEND_CUDA,
    .compute_dtype = MOE_DTYPE_BF16,
    .device = MOE_DEVICE_CUDA,
    .destroy = cuda_destroy,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .alloc_pinned = cuda_alloc_pinned,
    .free_pinned = cuda_free_pinned,
    .memset_zero = cuda_memset_zero,
    .copy = cuda_copy,
    .synchronize = cuda_synchronize,
    .set_stream = cuda_set_stream,
};

moe_status_t moe_backend_cuda_create(const moe_backend_params_t *p, moe_backend_t *out)
{
    cuda_ctx_t *c = calloc(1, sizeof *c);
    if (!c) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "CUDA backend context");
    c->device = p->device_index;
    c->logger = p->logger;
    moe_status_t st;
    MOE_CUDA_CHECK_GOTO(st, cudaSetDevice(c->device));
    MOE_CUDA_CHECK_GOTO(st, cudaStreamCreateWithFlags(&c->own_stream, cudaStreamNonBlocking));
    c->stream = c->own_stream;
    MOE_CHECK_GEN_GOTO(st, cublasStatus_t, cublasCreate(&c->cublas), rc_ == CUBLAS_STATUS_SUCCESS,
                       MOE_STATUS_BACKEND_ERROR, cublasGetStatusString);
    MOE_CHECK_GEN_GOTO(st, cublasStatus_t, cublasSetStream(c->cublas, c->stream),
                       rc_ == CUBLAS_STATUS_SUCCESS, MOE_STATUS_BACKEND_ERROR,
                       cublasGetStatusString);
    out->ops = &cuda_ops;
    out->ctx = c;
    return MOE_STATUS_SUCCESS;
fail:
    cuda_destroy(c);
    return st;
}
