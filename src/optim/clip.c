/* The global gradient norm for clipping (see clip.h). */
#include <math.h>

#include "clip.h"

#include "core/error.h"

static bool counts_here(const moe_mesh_t *m, const moe_param_info_t *info)
{
    bool tp_first = m->coord[MOE_AXIS_TP] == 0 || info->tp_dim >= 0;
    if (info->kind == MOE_PARAM_EXPERT) return tp_first && m->coord[MOE_AXIS_DP] == 0;
    return tp_first && m->coord[MOE_AXIS_EP] == 0 && m->coord[MOE_AXIS_DP] == 0;
}

bool moe_grad_counted_here(const moe_runtime_t *rt, const moe_param_info_t *info)
{
    return moe_tensor_numel(&info->grad) > 0 && info->kind != MOE_PARAM_BUFFER &&
           counts_here(rt->mesh, info);
}

moe_status_t moe_grad_norm_reduce(moe_runtime_t *rt, double share, double *norm)
{
    moe_comm_t *world = rt->mesh->host[MOE_AXIS_WORLD];
    double total = share;
    if (world) MOE_TRY(moe_comm_allreduce(world, &share, &total, 1, MOE_COMM_F64, MOE_REDUCE_SUM));
    *norm = sqrt(total);
    return MOE_STATUS_SUCCESS;
}
