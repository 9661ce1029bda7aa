/* Gradient reduction over the mesh's data-parallel groups (see grad_sync.h). */
#include "grad_sync.h"

#include "../core/error.h"

int32_t moe_grad_replicas(const moe_runtime_t *rt)
{
    return rt->mesh->size[MOE_AXIS_EP] * rt->mesh->size[MOE_AXIS_DP];
}

moe_status_t moe_grad_sync(moe_runtime_t *rt, moe_param_kind_t kind, float *grad, int64_t n)
{
    moe_mesh_t *m = rt->mesh;
    if (moe_grad_replicas(rt) == 1 || n == 0) return MOE_STATUS_SUCCESS;
    moe_comm_t *groups[2] = {kind == MOE_PARAM_DENSE ? m->comm[MOE_AXIS_EP] : NULL,
                             m->comm[MOE_AXIS_EDP]};
    for (int g = 0; g < 2; g++)
        if (groups[g])
            MOE_TRY(moe_comm_allreduce(groups[g], grad, grad, (size_t)n, MOE_COMM_F32,
                                       MOE_REDUCE_SUM));
    return MOE_STATUS_SUCCESS;
}
