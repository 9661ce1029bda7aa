/*
 * The checks of a caller's tensor list, shared by save (before the layout) and load (before
 * any checkpoint is read): names, dtypes, shapes, the box in the global tensor, expert ids,
 * no name twice. A failure here is the request's (INVALID_ARGUMENT), never the checkpoint's.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "ckpt_internal.h"

void ck_tensor_box(const moe_ckpt_tensor_t *e, int64_t *global, int64_t *offset)
{
    const moe_tensor_t *x = &e->tensor;
    bool given = false;
    for (int d = 0; d < x->ndim; d++) given |= e->global_shape[d] != 0;
    for (int d = 0; d < x->ndim; d++) {
        global[d] = given ? e->global_shape[d] : x->shape[d];
        offset[d] = given ? e->offset[d] : 0;
    }
}

static int cmp_str_ptr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

moe_status_t ck_check_request(const moe_ckpt_tensor_t *t, int32_t count)
{
    MOE_CHECK_ARG(count >= 0, "tensor count is %d", count);
    MOE_CHECK_ARG(count == 0 || t != NULL, "tensors is NULL with count %d", count);
    for (int32_t i = 0; i < count; i++) {
        const moe_ckpt_tensor_t *e = &t[i];
        MOE_CHECK_ARG(ck_valid_name(e->name),
                      "tensors[%d].name is %s%s%s: names are 1..255 characters of "
                      "[A-Za-z0-9._/-] in /-separated parts other than . and ..",
                      i, e->name ? "\"" : "", e->name ? e->name : "NULL", e->name ? "\"" : "");
        const moe_tensor_t *x = &e->tensor;
        MOE_CHECK_ARG(moe_dtype_size(x->dtype) != 0, "tensor %s: unknown dtype %d", e->name,
                      (int)x->dtype);
        MOE_CHECK_ARG(x->ndim >= 1 && x->ndim <= MOE_MAX_DIMS, "tensor %s: ndim %d (1..%d)",
                      e->name, x->ndim, MOE_MAX_DIMS);
        MOE_CHECK_ARG(x->device == MOE_DEVICE_HOST || x->device == MOE_DEVICE_CUDA,
                      "tensor %s: unknown device %d", e->name, (int)x->device);
        int64_t gs[MOE_MAX_DIMS], go[MOE_MAX_DIMS];
        ck_tensor_box(e, gs, go);
        int64_t numel = 1;
        for (int d = 0; d < x->ndim; d++) {
            MOE_CHECK_ARG(x->shape[d] >= 0, "tensor %s: shape[%d] = %" PRId64, e->name, d,
                          x->shape[d]);
            numel *= x->shape[d];
            int64_t g = gs[d], o = go[d];
            MOE_CHECK_ARG(o >= 0 && g >= 0,
                          "tensor %s: offset[%d] = %" PRId64 ", global_shape[%d] = %" PRId64,
                          e->name, d, o, d, g);
            if (!(e->expert_ids && d == e->expert_dim))
                MOE_CHECK_ARG(o + x->shape[d] <= g,
                              "tensor %s: dimension %d: offset %" PRId64 " + local %" PRId64
                              " exceeds global %" PRId64,
                              e->name, d, o, x->shape[d], g);
        }
        MOE_CHECK_ARG(numel == 0 || x->data != NULL, "tensor %s: data is NULL", e->name);
        MOE_CHECK_ARG(e->expert_dim >= -1 && e->expert_dim < x->ndim,
                      "tensor %s: expert_dim %d (ndim %d)", e->name, e->expert_dim, x->ndim);
        if (e->expert_ids) {
            int ed = e->expert_dim;
            MOE_CHECK_ARG(ed >= 0, "tensor %s: expert_ids given but expert_dim is -1", e->name);
            for (int d = 0; d < ed; d++)
                MOE_CHECK_ARG(x->shape[d] == 1,
                              "tensor %s: expert_ids need every dimension before expert_dim %d"
                              " to have extent 1 (dimension %d has %" PRId64 ")",
                              e->name, ed, d, x->shape[d]);
            int64_t g = gs[ed];
            for (int64_t k = 0; k < x->shape[ed]; k++) {
                MOE_CHECK_ARG(e->expert_ids[k] >= 0 && e->expert_ids[k] < g,
                              "tensor %s: expert_ids[%" PRId64 "] = %d outside [0, %" PRId64 ")",
                              e->name, k, e->expert_ids[k], g);
                for (int64_t j = 0; j < k; j++)
                    MOE_CHECK_ARG(e->expert_ids[j] != e->expert_ids[k],
                                  "tensor %s: expert id %d appears twice", e->name,
                                  e->expert_ids[k]);
            }
        }
    }
    if (count > 1) {
        const char **names = malloc(sizeof *names * (size_t)count);
        if (!names) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "name table");
        for (int32_t i = 0; i < count; i++) names[i] = t[i].name;
        qsort(names, (size_t)count, sizeof *names, cmp_str_ptr);
        for (int32_t i = 1; i < count; i++)
            if (!strcmp(names[i - 1], names[i])) {
                moe_status_t st = MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                                           "tensor name \"%s\" appears more than once", names[i]);
                free(names);
                return st;
            }
        free(names);
    }
    return MOE_STATUS_SUCCESS;
}
