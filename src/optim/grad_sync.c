/* Gradient reduction over the mesh's data-parallel groups (see grad_sync.h). */
#include "grad_sync.h"

#include "core/error.h"

int32_t moe_grad_replicas(const moe_runtime_t *rt)
{
    return moe_mesh_group_size(rt->mesh, MOE_MESH_DENSE);
}

moe_status_t moe_grad_sync_start(moe_runtime_t *rt, moe_param_kind_t kind, float *grad, int64_t n,
                                 moe_grad_sync_t *out)
{
    moe_mesh_t *m = rt->mesh;
    out->comm = kind == MOE_PARAM_DENSE ? m->comm[MOE_MESH_DENSE] : m->comm[MOE_AXIS_EDP];
    out->req = NULL;
    if (!out->comm || n == 0) {
        out->comm = NULL;
        return MOE_STATUS_SUCCESS;
    }
    moe_status_t st = out->comm->ops->allreduce(out->comm, grad, grad, (size_t)n, MOE_COMM_F32,
                                                MOE_REDUCE_SUM, &out->req);
    if (st != MOE_STATUS_SUCCESS) out->comm = NULL;
    return st;
}

moe_status_t moe_grad_sync_wait(moe_grad_sync_t *sync)
{
    if (!sync->comm) return MOE_STATUS_SUCCESS;
    moe_status_t st = moe_comm_wait(sync->comm, sync->req);
    sync->comm = NULL;
    sync->req = NULL;
    return st;
}
