/*
 * The MoE layer's internal state, shared by layer.c (single-rank path, parameters, stats)
 * and the distributed dispatch code. Shapes: N tokens, H hidden, E experts, El local experts,
 * K top-k, Fl = F / tp, R rows processed by the local experts.
 */
#ifndef MOE_LAYER_INTERNAL_H
#define MOE_LAYER_INTERNAL_H

#include <moe/layer.h>

#include "../runtime/runtime.h"

/* What one forward saves for its backward. Device pointers unless named host_*. */
typedef struct moe_slot {
    bool in_use;
    int64_t n;                 /* tokens */
    int64_t rows;              /* R (filler rows included when the layout is padded) */
    void *x;                   /* act [N,H] copy of the input */
    float *logits;             /* f32 [N,E] */
    int32_t *topk_idx;         /* i32 [N,K] */
    float *topk_w;             /* f32 [N,K] */
    /* The routing summary, one device block so that one copy brings it to the host:
     * i32 counts[E] | f32 score_mean[E] | f32 router_stats[2] | i32 kept[E]; the four
     * pointers below point into it. */
    void *summary;
    void *host_summary;        /* host copy of it */
    int32_t *counts;           /* selected per expert, before capacity */
    float *score_mean;
    float *router_stats;
    int32_t *kept;
    int32_t *row_of_slot;      /* i32 [N,K] */
    int32_t *slot_of_row;      /* i32 [N*K], or [El*stride] once padded (-1: filler) */
    int64_t *host_kept;        /* host [E] */
    int64_t *host_offsets;     /* host [El+1] row offsets of the local experts (single-rank) */
    void *xp, *hpre, *act, *out; /* act [R,H], [R,2,Fl], [R,Fl], [R,H] */
    struct moe_dist_slot *dist; /* distributed layer's saved state (expert_parallel.c), or NULL */
} moe_slot_t;

struct moe_layer {
    uint64_t magic;
    moe_runtime_t *rt;
    moe_layer_config_t cfg;
    int64_t h, f_local;
    int32_t e, el, k;
    int32_t ep_rank, ep_size, tp_rank, tp_size;

    void *wg, *w1, *w2;        /* act [H,E], [El,H,2,Fl], [El,Fl,H] */
    float *dwg, *dw1, *dw2;    /* f32, same shapes */
    bool grads_discarded;      /* moe_layer_discard_grad: the next backward writes them */
    float *bias;               /* f32 [E] device, or NULL when expert_bias is off */

    moe_param_info_t params[4];
    int32_t num_params;

    moe_slot_t *slots;         /* [max_microbatches] */

    moe_layer_stats_t stats;   /* last forward */
    int64_t *host_tokens_per_expert; /* [E] accepted slots, last forward */
    struct moe_dist *dist;     /* distributed state (expert_parallel.c); NULL in a world of one */
};

/* ---- steps shared by the single-rank path (layer.c) and the distributed one ------------ */

/* Device memory of the runtime's backend; free sets *pp to NULL and ignores NULL. */
moe_status_t moe_layer_alloc_dev(moe_runtime_t *rt, size_t bytes, void *out);
void moe_layer_free_dev(moe_runtime_t *rt, void *pp);
/* Slots an expert keeps out of n tokens' (capacity_factor * n * K / E, rounded up), or -1
 * when dropless. */
int64_t moe_layer_capacity(const moe_layer_t *l, int64_t n);

/* The parts of a routing summary block (moe_slot_t's layout), on the device or the host. */
typedef struct moe_routing_parts {
    int32_t *counts;       /* [E] selections per expert (before capacity) */
    float *score_mean;     /* [E] P_e over this rank's tokens */
    float *stats;          /* [2] mean lse^2, mean entropy, over this rank's tokens */
    int32_t *kept;         /* [E] kept per expert (after the plan) */
} moe_routing_parts_t;

/* Allocate the slot's routing state for x's N tokens, save x and enqueue the router
 * (zeros when N = 0). */
moe_status_t moe_layer_route(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *x);
/* Copy the router's small results to the host (blocking, one copy); out->kept points at
 * where a plan's kept counts go (the copy does not fill it). */
moe_status_t moe_routing_fetch(moe_layer_t *l, const moe_slot_t *s, moe_routing_parts_t *out);
/* Fill the layer's stats from s->host_kept and the given loss terms. */
void moe_layer_set_stats(moe_layer_t *l, const moe_slot_t *s, int64_t capacity, double aux,
                         double z, double entropy);
/* The expert-bias sign rule on the device, from the slot's counts (the selections the
 * balance is judged on) out of `slots` in total. */
moe_status_t moe_layer_update_bias(moe_layer_t *l, const moe_slot_t *s, int64_t slots);
/* Router backward: writes dx (the first of its two parts; the experts' combine adds the other)
 * and adds the router gradient, with the given loss coefficients. */
moe_status_t moe_layer_router_backward(moe_layer_t *l, const moe_slot_t *s, const float *d_w,
                                       void *dx, float aux_coef, float z_coef);

#endif /* MOE_LAYER_INTERNAL_H */
