/*
 * The global gradient norm over a mesh, for clipping: every parameter is counted once however
 * many ranks hold it. After the data-parallel reduction the replicas of a parameter hold equal
 * gradients, so only one of them adds its square:
 *   dense (replicated over tp, ep and dp)      the rank with tp = ep = dp = 0 of its pp stage
 *   expert (sharded over ep, replicated over dp) the ranks with dp = 0, and tp = 0 unless the
 *                                              tensor is split over tp (tp_dim >= 0)
 * and one sum over the world adds the pp stages and the shards.
 */
#ifndef MOE_OPTIM_CLIP_H
#define MOE_OPTIM_CLIP_H

#include <moe/layer.h>

#include "runtime/runtime.h"

/* Whether this rank adds the square of this parameter's gradient to its share of the norm
 * (false where another replica counts it, or it has no elements). The share itself is one
 * sum of squares over the counted gradients on their device (the backend's sum_squares). */
bool moe_grad_counted_here(const moe_runtime_t *rt, const moe_param_info_t *info);
/* sqrt of the sum of every rank's share. Collective over the world. */
moe_status_t moe_grad_norm_reduce(moe_runtime_t *rt, double share, double *norm);

#endif /* MOE_OPTIM_CLIP_H */
