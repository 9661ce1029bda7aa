/*
 * The MoE layer on one rank (a world of one; layer.c takes this path when the mesh gives the
 * layer no partner): every expert is local and the batch is this rank's, so the forward and
 * backward are backend ops alone, with no communication. The distributed path is
 * expert_parallel.c; both use the routing steps of routing.c.
 *
 * Shapes: N tokens, H hidden, E experts (El = E here), K top-k, Fl = F (tp = 1),
 * R rows processed by the experts (kept slots, plus filler rows when the layout is padded).
 *
 * Forward:  router -> plan (capacity + counting sort; the one device->host sync, which also
 *           brings the routing statistics) -> gather rows -> experts -> weighted combine.
 * Backward: d(weights) and d(rows) from dy -> experts backward -> un-gather -> router
 *           backward (adds the aux and z loss gradients) -> dx.
 */
#include "single_rank.h"

#include <stdlib.h>

#include "core/error.h"
#include "device_buffer.h"
#include "routing.h"

/* ---- forward ------------------------------------------------------------------------------ */

/* The slot's expert rows: gathered input, pre-activations, activations, outputs. */
static moe_status_t slot_alloc_rows(moe_layer_t *l, moe_slot_t *s, int64_t rows)
{
    moe_runtime_t *rt = l->rt;
    size_t act = moe_dtype_size(MOE_OPS(rt)->compute_dtype);
    size_t r = (size_t)rows, h = (size_t)l->h, f = (size_t)l->f_local;
    s->rows = rows;
    MOE_TRY(moe_layer_alloc_dev(rt, r * h * act, &s->xp));
    MOE_TRY(moe_layer_alloc_dev(rt, r * 2 * f * act, &s->hpre));
    MOE_TRY(moe_layer_alloc_dev(rt, r * f * act, &s->act));
    MOE_TRY(moe_layer_alloc_dev(rt, r * h * act, &s->out));
    return MOE_STATUS_SUCCESS;
}

/* The stats of this rank's batch: aux from its f (its counts, or the window's) and P, then
 * the expert-bias rule. */
static moe_status_t finish_routing_stats(moe_layer_t *l, moe_slot_t *s, int64_t capacity,
                                         const moe_routing_parts_t *r)
{
    int64_t e = l->e, slots = s->n * l->k;
    double aux = 0, *f = l->host_aux_f;
    MOE_TRY(moe_routing_aux_freq(l, s, r->counts, slots, f));
    for (int64_t j = 0; j < e; j++) aux += f[j] * r->score_mean[j];
    moe_routing_set_stats(l, s, capacity, (double)e * aux, r->stats[0], r->stats[1]);
    return moe_routing_update_bias(l, s, slots);
}

/* Re-lay the slot's plan with `stride` rows per expert, the layout the backend's expert
 * GEMMs asked for: the padded slot_of_row replaces the plan's and the row offsets become
 * e * stride. */
static moe_status_t pad_rows(moe_layer_t *l, moe_slot_t *s, int64_t stride)
{
    int32_t *padded = NULL;
    MOE_TRY(moe_layer_alloc_dev(l->rt, sizeof(int32_t) * (size_t)(l->el * stride), &padded));
    moe_pad_plan_t a = {
        .n = s->n,
        .e = l->e,
        .k = l->k,
        .stride = stride,
        .topk_idx = s->topk_idx,
        .kept = s->kept,
        .slot_of_row = s->slot_of_row,
        .row_of_slot = s->row_of_slot,
        .padded_slot_of_row = padded,
    };
    moe_status_t st = MOE_OPS(l->rt)->pad_plan(MOE_CTX(l->rt), &a);
    if (st != MOE_STATUS_SUCCESS) {
        moe_layer_free_dev(l->rt, &padded);
        return st;
    }
    moe_layer_free_dev(l->rt, &s->slot_of_row);
    s->slot_of_row = padded;
    for (int32_t j = 0; j <= l->el; j++) s->host_offsets[j] = j * stride;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_single_rank_forward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *x,
                                     moe_tensor_t *y)
{
    moe_runtime_t *rt = l->rt;
    const moe_backend_ops_t *ops = MOE_OPS(rt);
    void *ctx = MOE_CTX(rt);
    int64_t n = x->shape[0], h = l->h, capacity = moe_routing_capacity(l, n);
    int32_t e = l->e, k = l->k;

    MOE_TRY(moe_routing_forward(l, s, x));
    s->host_offsets = calloc((size_t)l->el + 1, sizeof(int64_t));
    if (!s->host_offsets) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "slot host arrays");
    moe_plan_t p = {
        .n = n,
        .e = e,
        .k = k,
        .capacity = capacity,
        .topk_idx = s->topk_idx,
        .row_of_slot = s->row_of_slot,
        .slot_of_row = s->slot_of_row,
        .kept = s->kept,
        .summary = s->summary,
        .summary_bytes = moe_routing_summary_bytes(l),
        .host_summary = s->host_summary,
    };
    MOE_TRY(ops->plan(ctx, &p)); /* the forward's one wait for the device */
    moe_routing_parts_t routing = moe_routing_summary_parts(l, s->host_summary);
    for (int32_t j = 0; j < e; j++) s->host_kept[j] = routing.kept[j];
    s->host_offsets[0] = 0;
    for (int32_t j = 0; j < l->el; j++)
        s->host_offsets[j + 1] = s->host_offsets[j] + s->host_kept[j];
    int64_t stride = ops->expert_row_stride ? ops->expert_row_stride(ctx, l->el, s->host_kept) : 0;
    if (stride > 0) MOE_TRY(pad_rows(l, s, stride));
    int64_t rows = s->host_offsets[l->el];
    MOE_TRY(slot_alloc_rows(l, s, rows));
    if (rows > 0) {
        MOE_TRY(ops->gather_rows(ctx, s->xp, s->x, s->slot_of_row, k, NULL, rows, h));
        moe_experts_t ex = {
            .h = h,
            .f = l->f_local,
            .el = l->el,
            .host_offsets = s->host_offsets,
            .w1 = l->w1,
            .w2 = l->w2,
            .xp = s->xp,
            .hpre = s->hpre,
            .act = s->act,
            .out = s->out,
        };
        MOE_TRY(ops->experts_forward(ctx, &ex));
    }
    if (n > 0)
        MOE_TRY(ops->combine(ctx, y->data, s->out, s->row_of_slot, s->topk_w, n, k, h, false));
    return finish_routing_stats(l, s, capacity, &routing);
}

/* ---- backward ----------------------------------------------------------------------------- */

moe_status_t moe_single_rank_backward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *dy,
                                      void *dx, bool overwrite_grads)
{
    moe_runtime_t *rt = l->rt;
    const moe_backend_ops_t *ops = MOE_OPS(rt);
    void *ctx = MOE_CTX(rt);
    int64_t n = s->n, h = l->h, rows = s->rows, fl = l->f_local;
    int32_t k = l->k;
    size_t act = moe_dtype_size(ops->compute_dtype);
    float *d_w = NULL;
    void *d_out = NULL, *d_xp = NULL, *scratch = NULL;
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (n == 0) return MOE_STATUS_SUCCESS;

    MOE_TRY_GOTO(st, moe_layer_alloc_dev(rt, (size_t)n * (size_t)k * sizeof(float), &d_w));
    MOE_TRY_GOTO(st, ops->combine_weight_grad(ctx, d_w, dy->data, s->out, s->row_of_slot, n, k, h));
    MOE_TRY_GOTO(st, moe_routing_backward(l, s, d_w, dx, l->cfg.aux_loss_coef, l->cfg.z_loss_coef));
    if (rows > 0) {
        MOE_TRY_GOTO(st, moe_layer_alloc_dev(rt, (size_t)rows * (size_t)h * act, &d_out));
        MOE_TRY_GOTO(st, moe_layer_alloc_dev(rt, (size_t)rows * (size_t)h * act, &d_xp));
        MOE_TRY_GOTO(st, moe_layer_alloc_dev(rt, (size_t)rows * 3 * (size_t)fl * act, &scratch));
        MOE_TRY_GOTO(st,
                     ops->gather_rows(ctx, d_out, dy->data, s->slot_of_row, k, s->topk_w, rows, h));
        moe_experts_t ex = {
            .h = h,
            .f = fl,
            .el = l->el,
            .host_offsets = s->host_offsets,
            .w1 = l->w1,
            .w2 = l->w2,
            .xp = s->xp,
            .hpre = s->hpre,
            .act = s->act,
            .out = s->out,
            .d_out = d_out,
            .d_xp = d_xp,
            .dw1 = l->dw1,
            .dw2 = l->dw2,
            .scratch = scratch,
            .overwrite_grads = overwrite_grads,
        };
        MOE_TRY_GOTO(st, ops->experts_backward(ctx, &ex));
    }
    /* dx += sum over the token's kept slots of d_xp (rows == 0: every slot dropped, + 0) */
    MOE_TRY_GOTO(st, ops->combine(ctx, dx, d_xp, s->row_of_slot, NULL, n, k, h, true));
fail:
    moe_layer_free_dev(rt, &d_w);
    moe_layer_free_dev(rt, &d_out);
    moe_layer_free_dev(rt, &d_xp);
    moe_layer_free_dev(rt, &scratch);
    return st;
}
