/* Blocking helpers over the communicator table, and dtype sizes. */
#include "comm.h"

#include "../core/error.h"

size_t moe_comm_dtype_size(moe_comm_dtype_t dt)
{
    switch (dt) {
    case MOE_COMM_F32: return 4;
    case MOE_COMM_BF16: return 2;
    case MOE_COMM_I32: return 4;
    case MOE_COMM_I64: return 8;
    case MOE_COMM_F64: return 8;
    case MOE_COMM_U8: return 1;
    }
    return 0;
}

moe_status_t moe_comm_allreduce(moe_comm_t *c, const void *send, void *recv, size_t count,
                                moe_comm_dtype_t dt, moe_reduce_op_t op)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->allreduce(c, send, recv, count, dt, op, &req));
    return c->ops->wait(c, req);
}

moe_status_t moe_comm_broadcast(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                int root)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->broadcast(c, buf, count, dt, root, &req));
    return c->ops->wait(c, req);
}

moe_status_t moe_comm_alltoallv(moe_comm_t *c, const void *send, const size_t *send_counts,
                                const size_t *send_displs, void *recv, const size_t *recv_counts,
                                const size_t *recv_displs, moe_comm_dtype_t dt)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->alltoallv(c, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                              dt, &req));
    return c->ops->wait(c, req);
}

moe_status_t moe_comm_barrier(moe_comm_t *c) { return c->ops->barrier(c); }

void moe_comm_destroy(moe_comm_t *c)
{
    if (c) c->ops->destroy(c);
}
