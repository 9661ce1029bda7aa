/* The global gradient norm for clipping (see clip.h). */
#include <math.h>
#include <stdlib.h>

#include "clip.h"

#include "../core/error.h"

static bool counts_here(const moe_mesh_t *m, const moe_param_info_t *info)
{
    bool tp_first = m->coord[MOE_AXIS_TP] == 0 || info->tp_dim >= 0;
    if (info->kind == MOE_PARAM_EXPERT) return tp_first && m->coord[MOE_AXIS_DP] == 0;
    return tp_first && m->coord[MOE_AXIS_EP] == 0 && m->coord[MOE_AXIS_DP] == 0;
}

moe_status_t moe_grad_sq_share(moe_runtime_t *rt, const moe_param_info_t *info, double *sq)
{
    *sq = 0;
    int64_t n = moe_tensor_numel(&info->grad);
    if (n <= 0 || info->kind == MOE_PARAM_BUFFER || !counts_here(rt->mesh, info))
        return MOE_STATUS_SUCCESS;
    const float *g = info->grad.data;
    float *copy = NULL;
    if (info->grad.device != MOE_DEVICE_HOST) {
        copy = malloc(sizeof(float) * (size_t)n);
        if (!copy) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "gradient copy for %s", info->name);
        moe_status_t st = MOE_OPS(rt)->copy(MOE_CTX(rt), copy, g, sizeof(float) * (size_t)n);
        if (st != MOE_STATUS_SUCCESS) {
            free(copy);
            return st;
        }
        g = copy;
    }
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)g[i] * (double)g[i];
    free(copy);
    *sq = s;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_grad_norm_reduce(moe_runtime_t *rt, double share, double *norm)
{
    moe_comm_t *world = rt->mesh->host[MOE_AXIS_WORLD];
    double total = share;
    if (world) MOE_TRY(moe_comm_allreduce(world, &share, &total, 1, MOE_COMM_F64, MOE_REDUCE_SUM));
    *norm = sqrt(total);
    return MOE_STATUS_SUCCESS;
}
