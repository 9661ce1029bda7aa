/* The host backend: ordinary aligned memory, no streams, and the reference MoE ops. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "host_ops.h"

/* Cache-line alignment; 4 KiB for large blocks so O_DIRECT I/O can use them directly. */
static size_t alignment_for(size_t bytes) { return bytes >= 65536 ? 4096 : 64; }

static void host_destroy(void *ctx) { (void)ctx; }

static moe_status_t host_alloc(void *ctx, size_t bytes, void **out)
{
    (void)ctx;
    *out = NULL;
    if (bytes == 0) return MOE_STATUS_SUCCESS;
    size_t align = alignment_for(bytes);
    if (bytes > SIZE_MAX - align) /* its rounding would wrap to a small size */
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "host allocation of %zu bytes", bytes);
    size_t rounded = (bytes + align - 1) / align * align;
    *out = aligned_alloc(align, rounded);
    if (!*out) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "host allocation of %zu bytes", bytes);
    return MOE_STATUS_SUCCESS;
}

static void host_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static moe_status_t host_memset_zero(void *ctx, void *p, size_t bytes)
{
    (void)ctx;
    if (bytes) memset(p, 0, bytes);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t host_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    (void)ctx;
    if (bytes) memmove(dst, src, bytes);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t host_sum_squares(void *ctx, const float *const *x, const int64_t *n,
                                     int32_t count, double *out)
{
    (void)ctx;
    double s = 0;
    for (int32_t t = 0; t < count; t++)
        for (int64_t i = 0; i < n[t]; i++) s += (double)x[t][i] * (double)x[t][i];
    *out = s;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t host_nothing(void *ctx)
{
    (void)ctx;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t host_set_stream(void *ctx, void *stream)
{
    (void)ctx;
    (void)stream;
    return MOE_STATUS_SUCCESS;
}

static void *host_stream(void *ctx)
{
    (void)ctx;
    return NULL;
}

static moe_status_t host_act_f32(void *ctx, float *dst, const void *src, int64_t n)
{
    return host_copy(ctx, dst, src, (size_t)n * sizeof(float));
}

static moe_status_t host_f32_act(void *ctx, void *dst, const float *src, int64_t n)
{
    return host_copy(ctx, dst, src, (size_t)n * sizeof(float));
}

static const moe_backend_ops_t host_ops = {
    .name = "host",
    .kind = MOE_BACKEND_HOST,
    .compute_dtype = MOE_DTYPE_F32,
    .device = MOE_DEVICE_HOST,
    .destroy = host_destroy,
    .alloc = host_alloc,
    .free = host_free,
    .alloc_pinned = host_alloc,
    .free_pinned = host_free,
    .memset_zero = host_memset_zero,
    .copy = host_copy,
    .copy_device = host_copy,
    .synchronize = host_nothing,
    .set_stream = host_set_stream,
    .stream = host_stream,
    .act_to_f32 = host_act_f32,
    .f32_to_act = host_f32_act,
    .router_forward = moe_host_router_forward,
    .router_backward = moe_host_router_backward,
    .expert_bias_step = moe_host_expert_bias_step,
    .accumulate_counts = moe_host_accumulate_counts,
    .plan = moe_host_plan,
    .pad_plan = moe_host_pad_plan,
    .gather_rows = moe_host_gather_rows,
    .combine = moe_host_combine,
    .combine_weight_grad = moe_host_combine_weight_grad,
    .experts_forward = moe_host_experts_forward,
    .experts_backward = moe_host_experts_backward,
    .adamw_update = moe_host_adamw_update,
    .sum_squares = host_sum_squares,
};

moe_status_t moe_backend_host_create(const moe_backend_params_t *p, moe_backend_t *out)
{
    (void)p;
    out->ops = &host_ops;
    out->ctx = NULL;
    return MOE_STATUS_SUCCESS;
}
