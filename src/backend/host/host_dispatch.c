/*
 * Host reference dispatch: the capacity-aware stable counting sort of (token, k) slots by
 * expert, the row gather into expert-contiguous order, and the gather-based combine.
 * Slot s = t*K + k; rows of expert e are contiguous and in slot order.
 */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "host_ops.h"

moe_status_t moe_host_plan(void *ctx, const moe_plan_t *a)
{
    (void)ctx;
    int64_t slots = a->n * a->k;
    /* kept per expert: its first capacity - first[e] slots in slot order */
    memset(a->kept, 0, sizeof(int32_t) * (size_t)a->e);
    for (int64_t s = 0; s < slots; s++) {
        int32_t ex = a->topk_idx[s];
        int64_t ahead = a->first ? a->first[ex] : 0;
        if (a->capacity < 0 || ahead + a->kept[ex] < a->capacity) a->kept[ex]++;
    }
    /* fill[e] runs from the expert's first row to end[e], experts in row order; a full
     * expert drops the slot */
    int64_t *fill = malloc(sizeof(int64_t) * 2 * (size_t)a->e);
    if (!fill) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "plan scratch for E=%d", a->e);
    int64_t *end = fill + a->e;
    int64_t row = 0;
    for (int32_t g = 0; g < a->e; g++) {
        int32_t ex = a->row_order ? a->row_order[g] : g;
        fill[ex] = row;
        row += a->kept[ex];
        end[ex] = row;
    }
    for (int64_t s = 0; s < slots; s++) {
        int32_t ex = a->topk_idx[s];
        if (fill[ex] < end[ex]) {
            a->row_of_slot[s] = (int32_t)fill[ex];
            a->slot_of_row[fill[ex]++] = (int32_t)s;
        } else {
            a->row_of_slot[s] = -1;
        }
    }
    free(fill);
    memcpy(a->host_summary, a->summary, a->summary_bytes);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_host_pad_plan(void *ctx, const moe_pad_plan_t *a)
{
    (void)ctx;
    int64_t *off = malloc(sizeof(int64_t) * ((size_t)a->e + 1));
    if (!off) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "pad_plan scratch for E=%d", a->e);
    off[0] = 0;
    for (int32_t ex = 0; ex < a->e; ex++) off[ex + 1] = off[ex] + a->kept[ex];
    for (int64_t s = 0; s < a->n * a->k; s++) {
        int32_t r = a->row_of_slot[s], ex = a->topk_idx[s];
        if (r >= 0) a->row_of_slot[s] = (int32_t)(ex * a->stride + (r - off[ex]));
    }
    for (int32_t ex = 0; ex < a->e; ex++)
        for (int64_t j = 0; j < a->stride; j++)
            a->padded_slot_of_row[ex * a->stride + j] = j < a->kept[ex]
                                                            ? a->slot_of_row[off[ex] + j]
                                                            : -1;
    free(off);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_host_gather_rows(void *ctx, void *dst, const void *src, const int32_t *slot_of_row,
                                  int32_t k, const float *scale, int64_t rows, int64_t h)
{
    (void)ctx;
    float *d = dst;
    const float *s = src;
    for (int64_t r = 0; r < rows; r++) {
        int32_t slot = slot_of_row[r];
        if (slot < 0) { /* a padded layout's filler row */
            memset(d + r * h, 0, sizeof(float) * (size_t)h);
            continue;
        }
        const float *row = s + (int64_t)(slot / k) * h;
        float c = scale ? scale[slot] : 1.0f;
        for (int64_t i = 0; i < h; i++) d[r * h + i] = c * row[i];
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_host_combine(void *ctx, void *dst, const void *src, const int32_t *row_of_slot,
                              const float *w, int64_t n, int32_t k, int64_t h, bool accumulate)
{
    (void)ctx;
    float *d = dst;
    const float *s = src;
    for (int64_t t = 0; t < n; t++) {
        float *out = d + t * h;
        if (!accumulate) memset(out, 0, sizeof(float) * (size_t)h);
        for (int32_t j = 0; j < k; j++) {
            int32_t row = row_of_slot[t * k + j];
            if (row < 0) continue;
            float c = w ? w[t * k + j] : 1.0f;
            for (int64_t i = 0; i < h; i++) out[i] += c * s[(int64_t)row * h + i];
        }
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_host_combine_weight_grad(void *ctx, float *dw, const void *dy, const void *rows,
                                          const int32_t *row_of_slot, int64_t n, int32_t k,
                                          int64_t h)
{
    (void)ctx;
    const float *g = dy, *r = rows;
    for (int64_t t = 0; t < n; t++)
        for (int32_t j = 0; j < k; j++) {
            int32_t row = row_of_slot[t * k + j];
            double acc = 0;
            if (row >= 0)
                for (int64_t i = 0; i < h; i++)
                    acc += (double)g[t * h + i] * r[(int64_t)row * h + i];
            dw[t * k + j] = (float)acc;
        }
    return MOE_STATUS_SUCCESS;
}
