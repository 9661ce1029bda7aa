/*
 * The distributed MoE layer (moe_dist_*): experts sharded over ep with the all-to-all
 * dispatch and combine, expert FFNs sharded over tp, the batch spread over the dense group
 * (ep x dp). layer.c takes this path whenever the runtime's mesh gives the layer a partner:
 * ep > 1, tp > 1, or dp > 1 (with ep = 1 the all-to-all is a copy to this rank); a world of
 * one takes the single-rank path (single_rank.h). The routing steps are routing.h's.
 *
 * Semantics: the distributed layer computes exactly what one rank computes on the
 * concatenated batch of the dense group (the ep x dp ranks of one tp/pp coordinate, in the
 * order ep + EP * dp); tp ranks hold the same tokens. So capacity, the aux and z losses,
 * their gradients and the expert-bias rule all use global counts and the global token count.
 * See docs/mesh.md.
 */
#ifndef MOE_EXPERT_PARALLEL_H
#define MOE_EXPERT_PARALLEL_H

#include "layer_internal.h"

/* Set up the layer's distributed state (l->dist) when the mesh needs it; no-op otherwise. */
moe_status_t moe_dist_create(moe_layer_t *l);
void moe_dist_destroy(moe_layer_t *l);
/* Forward / backward of one microbatch slot (collective over ep, tp and the dense group). */
moe_status_t moe_dist_forward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *x,
                              moe_tensor_t *y);
moe_status_t moe_dist_backward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *dy, void *dx);
/* Free the slot's distributed state (called by layer.c's slot_free). */
void moe_dist_slot_free(moe_layer_t *l, moe_slot_t *s);

/* Communication timing of the last forward + backward on this layer (for measuring how much
 * of the all-to-all time the chunked schedule hides). */
typedef struct moe_dist_timing {
    double a2a_blocked_ms; /* time spent blocked in all-to-all waits */
    double a2a_started_ms; /* sum over all-to-alls of (completion seen - start) */
    double compute_ms;     /* time in the expert computations of the pipeline */
    int64_t a2a_count;
    int64_t a2a_bytes;     /* bytes this rank sent in the data all-to-alls (self included) */
    int64_t worker_chunks; /* chunks whose experts ran on the host worker thread */
} moe_dist_timing_t;
void moe_dist_timing(const moe_layer_t *l, moe_dist_timing_t *out);
void moe_dist_timing_reset(moe_layer_t *l);

#endif /* MOE_EXPERT_PARALLEL_H */
