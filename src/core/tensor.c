/* Tensor descriptors: construction, element counts and validation. */
#include "tensor.h"

#include <stdbool.h>

#include "error.h"

size_t moe_dtype_size(moe_dtype_t dtype)
{
    switch (dtype) {
    case MOE_DTYPE_F32: return 4;
    case MOE_DTYPE_BF16: return 2;
    }
    return 0;
}

const char *moe_dtype_name(moe_dtype_t dtype)
{
    switch (dtype) {
    case MOE_DTYPE_F32: return "f32";
    case MOE_DTYPE_BF16: return "bf16";
    }
    return "unknown";
}

static const char *device_name(moe_device_kind_t d)
{
    return d == MOE_DEVICE_HOST ? "host" : d == MOE_DEVICE_CUDA ? "cuda" : "unknown";
}

moe_status_t moe_tensor_view(void *data, moe_dtype_t dtype, moe_device_kind_t device, int32_t ndim,
                             const int64_t *shape, moe_tensor_t *out)
{
    moe_error_clear();
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    MOE_CHECK_ARG(shape != NULL, "shape is NULL");
    MOE_CHECK_ARG(ndim >= 1 && ndim <= MOE_MAX_DIMS, "ndim is %d; expected 1..%d", ndim,
                  MOE_MAX_DIMS);
    MOE_CHECK_ARG(moe_dtype_size(dtype) != 0, "unknown dtype %d", (int)dtype);
    MOE_CHECK_ARG(device == MOE_DEVICE_HOST || device == MOE_DEVICE_CUDA, "unknown device %d",
                  (int)device);
    moe_tensor_t t = {.data = data, .dtype = dtype, .ndim = ndim, .device = device};
    for (int i = 0; i < ndim; i++) {
        MOE_CHECK_ARG(shape[i] >= 0, "shape[%d] is %lld; must be >= 0", i, (long long)shape[i]);
        t.shape[i] = shape[i];
    }
    MOE_CHECK_ARG(moe_tensor_numel(&t) >= 0, "shape has more than %lld elements",
                  (long long)MOE_TENSOR_MAX_ELEMENTS);
    *out = t;
    return MOE_STATUS_SUCCESS;
}

int64_t moe_tensor_numel(const moe_tensor_t *t)
{
    if (!t || t->ndim < 1 || t->ndim > MOE_MAX_DIMS) return -1;
    int64_t n = 1;
    bool empty = false, too_many = false; /* a zero extent makes any other extent harmless */
    for (int i = 0; i < t->ndim; i++) {
        int64_t s = t->shape[i];
        if (s < 0) return -1;
        if (s == 0)
            empty = true;
        else if (n > MOE_TENSOR_MAX_ELEMENTS / s)
            too_many = true;
        else
            n *= s;
    }
    return empty ? 0 : too_many ? -1 : n;
}

size_t moe_tensor_bytes(const moe_tensor_t *t)
{
    int64_t n = moe_tensor_numel(t);
    return n < 0 ? 0 : (size_t)n * moe_dtype_size(t->dtype);
}

moe_status_t moe_tensor_check(const moe_tensor_t *t, const char *what, moe_dtype_t dtype,
                              moe_device_kind_t device, int32_t ndim, const int64_t *shape)
{
    MOE_CHECK_ARG(t != NULL, "%s is NULL", what);
    MOE_CHECK_ARG(moe_dtype_size(t->dtype) != 0, "%s has unknown dtype %d", what, (int)t->dtype);
    MOE_CHECK_ARG(t->dtype == dtype, "%s has dtype %s; expected %s", what, moe_dtype_name(t->dtype),
                  moe_dtype_name(dtype));
    MOE_CHECK_ARG(t->device == device, "%s is on %s memory; expected %s", what,
                  device_name(t->device), device_name(device));
    MOE_CHECK_ARG(t->ndim >= 1 && t->ndim <= MOE_MAX_DIMS, "%s has %d dimensions; expected 1..%d",
                  what, t->ndim, MOE_MAX_DIMS);
    MOE_CHECK_ARG(t->ndim == ndim, "%s has %d dimensions; expected %d", what, t->ndim, ndim);
    for (int i = 0; i < ndim; i++) {
        MOE_CHECK_ARG(t->shape[i] >= 0, "%s shape[%d] is %lld", what, i, (long long)t->shape[i]);
        MOE_CHECK_ARG(shape[i] < 0 || t->shape[i] == shape[i],
                      "%s shape[%d] is %lld; expected %lld", what, i, (long long)t->shape[i],
                      (long long)shape[i]);
    }
    int64_t numel = moe_tensor_numel(t);
    MOE_CHECK_ARG(numel >= 0, "%s has more than %lld elements", what,
                  (long long)MOE_TENSOR_MAX_ELEMENTS);
    MOE_CHECK_ARG(t->data != NULL || numel == 0, "%s data is NULL", what);
    return MOE_STATUS_SUCCESS;
}
