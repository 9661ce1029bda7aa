/*
 * Gradient reduction across data-parallel replicas. Dense (router, user) gradients are
 * summed over the dense group (ep x dp: every rank holding the same replicated parameters),
 * expert gradients over the expert-data-parallel group (dp: the ranks holding the same
 * experts). The optimizer then scales both by 1 / moe_grad_replicas(), so the update equals
 * the one a single rank would make on the concatenated batch with a per-rank mean loss.
 *
 * Each reduction is one non-blocking all-reduce per parameter tensor (a bucket), so it can
 * run while the backward of earlier layers computes (moe_adamw_start_grad_sync).
 */
#ifndef MOE_GRAD_SYNC_H
#define MOE_GRAD_SYNC_H

#include <moe/layer.h>

#include "runtime/runtime.h"

/* ep x dp: the number of data-parallel replicas of a dense parameter. */
int32_t moe_grad_replicas(const moe_runtime_t *rt);

/* A reduction in flight; comm == NULL when there is nothing to reduce. */
typedef struct moe_grad_sync {
    moe_comm_t *comm;
    moe_comm_req_t *req;
} moe_grad_sync_t;

/* Start the in-place sum of grad[0..n) over the parameter's group. Collective over it: every
 * member starts its reductions in the same order. */
moe_status_t moe_grad_sync_start(moe_runtime_t *rt, moe_param_kind_t kind, float *grad, int64_t n,
                                 moe_grad_sync_t *out);
/* Wait for a started reduction (no-op when none) and clear it. */
moe_status_t moe_grad_sync_wait(moe_grad_sync_t *sync);

#endif /* MOE_GRAD_SYNC_H */
