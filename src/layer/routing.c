/*
 * The routing steps of the MoE layer (see routing.h): router forward and backward through the
 * backend's ops, the slot's routing summary, the capacity, the statistics and the expert-bias
 * rule. Both the single-rank and the distributed path use them.
 *
 * Shapes: N tokens of the slot, H hidden, E experts, K top-k.
 *
 * The slot's routing summary (its layout: moe_slot_t) is one device block, so that one copy
 * brings it to the host: the router writes counts, score means and stats, the plan kept.
 */
#include "routing.h"

#include <math.h>
#include <stdlib.h>

#include "core/error.h"
#include "device_buffer.h"

/* ---- capacity -------------------------------------------------------------------------------- */

int64_t moe_routing_capacity(const moe_layer_t *l, int64_t n)
{
    if (l->cfg.capacity_factor <= 0) return -1;
    double c = ceil((double)l->cfg.capacity_factor * (double)n * l->k / (double)l->e);
    /* no expert can take more than every slot: a larger factor is dropless */
    return c >= (double)n * l->k ? n * l->k : (int64_t)c;
}

/* ---- the routing summary --------------------------------------------------------------------- */

/* The router's results: the summary without the plan's kept counts. */
static size_t router_results_bytes(const moe_layer_t *l)
{
    return sizeof(int32_t) * (size_t)(2 * l->e + 2);
}

size_t moe_routing_summary_bytes(const moe_layer_t *l)
{
    return router_results_bytes(l) + sizeof(int32_t) * (size_t)l->e;
}

moe_routing_parts_t moe_routing_summary_parts(const moe_layer_t *l, void *block)
{
    moe_routing_parts_t r = {.counts = block};
    r.score_mean = (float *)r.counts + l->e;
    r.stats = r.score_mean + l->e;
    r.kept = (int32_t *)(r.stats + 2);
    return r;
}

/* ---- router forward ------------------------------------------------------------------------- */

/* The slot's routing state for n tokens: the saved x, the router's outputs, the summary and
 * the plan's maps. */
static moe_status_t slot_alloc_routing(moe_layer_t *l, moe_slot_t *s, int64_t n)
{
    moe_runtime_t *rt = l->rt;
    size_t act = moe_dtype_size(MOE_OPS(rt)->compute_dtype);
    size_t nk = (size_t)n * (size_t)l->k, ne = (size_t)n * (size_t)l->e, e = (size_t)l->e;
    s->n = n;
    MOE_TRY(moe_layer_alloc_dev(rt, (size_t)n * (size_t)l->h * act, &s->x));
    MOE_TRY(moe_layer_alloc_dev(rt, ne * sizeof(float), &s->logits));
    MOE_TRY(moe_layer_alloc_dev(rt, nk * sizeof(int32_t), &s->topk_idx));
    MOE_TRY(moe_layer_alloc_dev(rt, nk * sizeof(float), &s->topk_w));
    MOE_TRY(moe_layer_alloc_dev(rt, moe_routing_summary_bytes(l), &s->summary));
    moe_routing_parts_t dev = moe_routing_summary_parts(l, s->summary);
    s->counts = dev.counts;
    s->score_mean = dev.score_mean;
    s->router_stats = dev.stats;
    s->kept = dev.kept;
    MOE_TRY(moe_layer_alloc_dev(rt, nk * sizeof(int32_t), &s->row_of_slot));
    MOE_TRY(moe_layer_alloc_dev(rt, nk * sizeof(int32_t), &s->slot_of_row));
    s->host_summary = malloc(moe_routing_summary_bytes(l));
    s->host_kept = calloc(e, sizeof(int64_t));
    if (!s->host_summary || !s->host_kept)
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "slot host arrays");
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_routing_forward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *x)
{
    const moe_backend_ops_t *ops = MOE_OPS(l->rt);
    void *ctx = MOE_CTX(l->rt);
    int64_t n = x->shape[0];
    MOE_TRY(slot_alloc_routing(l, s, n));
    MOE_TRY(ops->copy_device(ctx, s->x, x->data,
                             (size_t)n * (size_t)l->h * moe_dtype_size(ops->compute_dtype)));
    /* no tokens: the summary holds zeros (backward and the plan read it) */
    if (n == 0) return ops->memset_zero(ctx, s->summary, moe_routing_summary_bytes(l));
    moe_router_fwd_t r = {
        .n = n,
        .h = l->h,
        .e = l->e,
        .k = l->k,
        .score_fn = l->cfg.score_fn,
        .renormalize = l->cfg.renormalize != 0,
        .x = s->x,
        .wg = l->wg,
        .bias = l->bias,
        .logits = s->logits,
        .topk_idx = s->topk_idx,
        .topk_w = s->topk_w,
        .counts = s->counts,
        .score_mean = s->score_mean,
        .stats = s->router_stats,
    };
    return ops->router_forward(ctx, &r);
}

moe_status_t moe_routing_fetch(moe_layer_t *l, const moe_slot_t *s, moe_routing_parts_t *out)
{
    MOE_TRY(
        MOE_OPS(l->rt)->copy(MOE_CTX(l->rt), s->host_summary, s->summary, router_results_bytes(l)));
    *out = moe_routing_summary_parts(l, s->host_summary);
    return MOE_STATUS_SUCCESS;
}

/* ---- statistics and balancing ------------------------------------------------------------ */

void moe_routing_set_stats(moe_layer_t *l, const moe_slot_t *s, int64_t capacity, double aux,
                           double z, double entropy)
{
    int64_t e = l->e, slots = s->n * l->k, accepted = 0, max_load = 0;
    for (int64_t j = 0; j < e; j++) {
        l->host_tokens_per_expert[j] = s->host_kept[j];
        accepted += s->host_kept[j];
        if (s->host_kept[j] > max_load) max_load = s->host_kept[j];
    }
    moe_layer_stats_t *st = &l->stats;
    st->struct_size = sizeof *st;
    st->tokens = s->n;
    st->slots = slots;
    st->dropped_slots = slots - accepted;
    st->dropped_ratio = slots ? (double)(slots - accepted) / (double)slots : 0.0;
    st->max_load = (double)max_load;
    st->mean_load = (double)accepted / (double)e;
    st->entropy = entropy;
    st->aux_loss = aux;
    st->z_loss = z;
    st->capacity = capacity;
}

moe_status_t moe_routing_update_bias(moe_layer_t *l, const moe_slot_t *s, int64_t slots)
{
    if (!l->cfg.expert_bias || slots <= 0) return MOE_STATUS_SUCCESS;
    /* the bias is state a checkpoint's snapshot may still be copying */
    MOE_TRY(moe_runtime_fence_writes(l->rt, l->bias, sizeof(float) * (size_t)l->e));
    return MOE_OPS(l->rt)->expert_bias_step(MOE_CTX(l->rt), l->bias, s->counts, l->e, slots,
                                            l->cfg.expert_bias_rate);
}

/* ---- global-batch balancing ---------------------------------------------------------------- */

moe_status_t moe_routing_window_open(moe_layer_t *l)
{
    if (!l->cfg.aux_global_batch) return MOE_STATUS_SUCCESS;
    for (int32_t j = 0; j < l->e; j++) l->host_window_counts[j] = 0;
    l->window_slots = 0;
    return MOE_OPS(l->rt)->memset_zero(MOE_CTX(l->rt), l->window_counts,
                                       sizeof(int32_t) * (size_t)l->e);
}

moe_status_t moe_routing_aux_freq(moe_layer_t *l, moe_slot_t *s, const int32_t *counts,
                                  int64_t slots, double *f)
{
    s->aux_f_scale = 1.0f;
    if (!l->cfg.aux_global_batch) {
        for (int32_t j = 0; j < l->e; j++) f[j] = slots ? (double)counts[j] / (double)slots : 0.0;
        return MOE_STATUS_SUCCESS;
    }
    l->window_slots += slots;
    for (int32_t j = 0; j < l->e; j++) {
        l->host_window_counts[j] += counts[j];
        f[j] = l->window_slots ? (double)l->host_window_counts[j] / (double)l->window_slots : 0.0;
    }
    /* the backward's op takes f_e as counts / (this forward's slots): scaled to the window's */
    s->aux_f_scale = l->window_slots ? (float)((double)slots / (double)l->window_slots) : 0.0f;
    MOE_TRY(moe_layer_alloc_dev(l->rt, sizeof(int32_t) * (size_t)l->e, (void **)&s->window_counts));
    return MOE_OPS(l->rt)->accumulate_counts(MOE_CTX(l->rt), l->window_counts, s->counts,
                                             s->window_counts, l->e);
}

/* ---- router backward ------------------------------------------------------------------------- */

moe_status_t moe_routing_backward(moe_layer_t *l, const moe_slot_t *s, const float *d_w, void *dx,
                                  float aux_coef, float z_coef)
{
    moe_runtime_t *rt = l->rt;
    float *dlogits = NULL;
    MOE_TRY(moe_layer_alloc_dev(rt, (size_t)s->n * (size_t)l->e * sizeof(float), &dlogits));
    moe_router_bwd_t r = {
        .n = s->n,
        .h = l->h,
        .e = l->e,
        .k = l->k,
        .score_fn = l->cfg.score_fn,
        .renormalize = l->cfg.renormalize != 0,
        .x = s->x,
        .wg = l->wg,
        .logits = s->logits,
        .topk_idx = s->topk_idx,
        .topk_w = s->topk_w,
        .d_topk_w = d_w,
        .counts = s->window_counts ? s->window_counts : s->counts,
        .aux_coef = aux_coef * s->aux_f_scale,
        .z_coef = z_coef,
        .dlogits = dlogits,
        .dx = dx,
        .dwg = l->dwg,
        .overwrite_dx = true,
    };
    moe_status_t st = MOE_OPS(rt)->router_backward(MOE_CTX(rt), &r);
    moe_layer_free_dev(rt, &dlogits);
    return st;
}
