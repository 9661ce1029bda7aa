/*
 * The MoE layer's forward and backward on one rank, when the mesh gives the layer no partner
 * (ep = tp = dp = 1): all experts local, no communication. See single_rank.c.
 */
#ifndef MOE_SINGLE_RANK_H
#define MOE_SINGLE_RANK_H

#include "layer_internal.h"

/* Forward of x [N,H] into y [N,H], saving what backward needs in slot s (its parts on
 * failure are freed by the caller's slot_free). Sets the layer's stats. */
moe_status_t moe_single_rank_forward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *x,
                                     moe_tensor_t *y);
/* Backward of slot s: writes dx [N,H], adds the parameter gradients (the expert GEMMs write
 * them instead when overwrite_grads). */
moe_status_t moe_single_rank_backward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *dy,
                                      void *dx, bool overwrite_grads);

#endif /* MOE_SINGLE_RANK_H */
