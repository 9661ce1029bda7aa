/*
 * Gradient reduction across data-parallel replicas. Dense (router, user) gradients are
 * summed over ep x dp, expert gradients over dp (the expert-data-parallel group: ranks that
 * hold the same experts). The optimizer then scales both by 1 / moe_grad_replicas(), so the
 * update equals the one a single rank would make on the concatenated batch with a per-rank
 * mean loss.
 */
#ifndef MOE_GRAD_SYNC_H
#define MOE_GRAD_SYNC_H

#include <moe/layer.h>

#include "../runtime/runtime.h"

/* ep x dp: the number of data-parallel replicas of a dense parameter. */
int32_t moe_grad_replicas(const moe_runtime_t *rt);

/* Sum over the parameter's reduction group, in place. Collective over the parameter's reduction group; a no-op in a world of one. */
moe_status_t moe_grad_sync(moe_runtime_t *rt, moe_param_kind_t kind, float *grad, int64_t n);

#endif /* MOE_GRAD_SYNC_H */
