#include "gpu_check.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime.h>

#include "core/bf16.h"

void gpu_pair_init(gpu_pair_t *p)
{
    if (moe_backend_cuda_device_count() <= 0) {
        fprintf(stderr, "no CUDA device: skipping\n");
        exit(77);
    }
    moe_backend_params_t bp = {.device_index = 0, .deterministic = true, .logger = NULL};
    TEST_OK(moe_backend_host_create(&bp, &p->host));
    TEST_OK(moe_backend_cuda_create(&bp, &p->cuda));
}

void gpu_pair_free(gpu_pair_t *p)
{
    p->cuda.ops->destroy(p->cuda.ctx);
    p->host.ops->destroy(p->host.ctx);
}

static void *dev_alloc(gpu_pair_t *p, size_t bytes)
{
    void *d = NULL;
    TEST_OK(p->cuda.ops->alloc(p->cuda.ctx, bytes ? bytes : 4, &d));
    return d;
}

void *gpu_up_bf16(gpu_pair_t *p, float *host, int64_t n)
{
    uint16_t *tmp = malloc(sizeof(uint16_t) * (size_t)(n + 1));
    for (int64_t i = 0; i < n; i++) {
        tmp[i] = moe_f32_to_bf16(host[i]);
        host[i] = moe_bf16_to_f32(tmp[i]);
    }
    void *d = dev_alloc(p, 2 * (size_t)n);
    TEST_OK(p->cuda.ops->copy(p->cuda.ctx, d, tmp, 2 * (size_t)n));
    free(tmp);
    return d;
}

float *gpu_up_f32(gpu_pair_t *p, const float *host, int64_t n)
{
    float *d = dev_alloc(p, 4 * (size_t)n);
    TEST_OK(p->cuda.ops->copy(p->cuda.ctx, d, host, 4 * (size_t)n));
    return d;
}

int32_t *gpu_up_i32(gpu_pair_t *p, const int32_t *host, int64_t n)
{
    int32_t *d = dev_alloc(p, 4 * (size_t)n);
    TEST_OK(p->cuda.ops->copy(p->cuda.ctx, d, host, 4 * (size_t)n));
    return d;
}

void *gpu_poison(gpu_pair_t *p, size_t bytes, bool integers)
{
    void *d = dev_alloc(p, bytes);
    TEST_OK(p->cuda.ops->synchronize(p->cuda.ctx)); /* the allocation is stream-ordered */
    assert_int_equal(cudaMemset(d, integers ? 0x7f : 0xff, bytes), cudaSuccess);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    return d;
}

void gpu_down_bf16(gpu_pair_t *p, float *host, const void *dev, int64_t n)
{
    uint16_t *tmp = malloc(sizeof(uint16_t) * (size_t)(n + 1));
    TEST_OK(p->cuda.ops->copy(p->cuda.ctx, tmp, dev, 2 * (size_t)n));
    for (int64_t i = 0; i < n; i++) host[i] = moe_bf16_to_f32(tmp[i]);
    free(tmp);
}

void gpu_down_f32(gpu_pair_t *p, float *host, const float *dev, int64_t n)
{
    TEST_OK(p->cuda.ops->copy(p->cuda.ctx, host, dev, 4 * (size_t)n));
}

void gpu_down_i32(gpu_pair_t *p, int32_t *host, const int32_t *dev, int64_t n)
{
    TEST_OK(p->cuda.ops->copy(p->cuda.ctx, host, dev, 4 * (size_t)n));
}

void gpu_free(gpu_pair_t *p, void *dev) { p->cuda.ops->free(p->cuda.ctx, dev); }

float *rand_f32(test_rng_t *rng, int64_t n, double std)
{
    float *v = malloc(sizeof(float) * (size_t)(n + 1));
    test_fill_normal(rng, v, n, std);
    return v;
}

void check_close(const char *what, const float *gpu, const float *ref, int64_t n, double tol)
{
    double err = test_rel_err(gpu, ref, n);
    fprintf(stderr, "  %-28s rel err %.3e (bound %.0e)\n", what, err, tol);
    if (!(err <= tol)) fail_msg("%s: relative error %.3e exceeds %.0e", what, err, tol);
}
