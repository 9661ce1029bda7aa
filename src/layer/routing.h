/*
 * The routing steps of the MoE layer, shared by the single-rank path (single_rank.c) and the
 * distributed one (expert_parallel.c): the router forward into a slot, the routing summary
 * and its copy to the host, the capacity, the layer's statistics, the expert-bias rule and
 * the router backward. They work on one rank's tokens; the distributed path passes global
 * counts and token totals where the semantics need them (docs/mesh.md).
 *
 * Shapes: N tokens of the slot, H hidden, E experts, K top-k.
 */
#ifndef MOE_ROUTING_H
#define MOE_ROUTING_H

#include "layer_internal.h"

/* Slots an expert keeps when `n` tokens are routed together: min(ceil(cf * n * K / E), n * K)
 * with cf the capacity factor (no expert can take more than every slot, so a larger factor
 * keeps all), or -1 when dropless (cf <= 0). */
int64_t moe_routing_capacity(const moe_layer_t *l, int64_t n);

/* The parts of a routing summary block (moe_slot_t's layout), on the device or the host. */
typedef struct moe_routing_parts {
    int32_t *counts;   /* [E] selections per expert (before capacity) */
    float *score_mean; /* [E] P_e over this rank's tokens */
    float *stats;      /* [2] mean lse^2, mean entropy, over this rank's tokens */
    int32_t *kept;     /* [E] kept per expert (after the plan) */
} moe_routing_parts_t;

/* Bytes of the whole summary block: the router's results, then the plan's kept counts. */
size_t moe_routing_summary_bytes(const moe_layer_t *l);
/* The parts of a summary block at `block`. */
moe_routing_parts_t moe_routing_summary_parts(const moe_layer_t *l, void *block);

/* Allocate the slot's routing state for x's N tokens, save x and enqueue the router
 * (zeros when N = 0). */
moe_status_t moe_routing_forward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *x);
/* Copy the router's small results to the host (blocking, one copy); out->kept points at
 * where a plan's kept counts go (the copy does not fill it). */
moe_status_t moe_routing_fetch(moe_layer_t *l, const moe_slot_t *s, moe_routing_parts_t *out);

/* Fill the layer's stats from s->host_kept and the given capacity and loss terms. */
void moe_routing_set_stats(moe_layer_t *l, const moe_slot_t *s, int64_t capacity, double aux,
                           double z, double entropy);
/* The expert-bias sign rule on the device, from the slot's counts (the selections the
 * balance is judged on) out of `slots` in total; no-op without expert_bias. */
moe_status_t moe_routing_update_bias(moe_layer_t *l, const moe_slot_t *s, int64_t slots);

/* Global-batch balancing (aux_global_batch): open a new window of selections (the start of a
 * batch: zero_grad, discard_grad); enqueued, no-op without the option. */
moe_status_t moe_routing_window_open(moe_layer_t *l);
/* The aux loss's expert frequencies f [E] (host) of the forward in s, whose selections over
 * the dense group are `counts` (host, E) and s->counts (device), `slots` in all: those
 * counts over slots; with aux_global_batch the window's after adding them (the device copy
 * too, saved in the slot for the backward). Sets s->aux_f_scale. */
moe_status_t moe_routing_aux_freq(moe_layer_t *l, moe_slot_t *s, const int32_t *counts,
                                  int64_t slots, double *f);

/* Router backward: writes dx (the first of its two parts; the experts' combine adds the other)
 * and adds the router gradient, with the given loss coefficients. */
moe_status_t moe_routing_backward(moe_layer_t *l, const moe_slot_t *s, const float *d_w, void *dx,
                                  float aux_coef, float z_coef);

#endif /* MOE_ROUTING_H */
