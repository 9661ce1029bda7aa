/* Blocking helpers over the communicator table, and dtype sizes. */
#include "comm.h"

#include "../core/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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

void moe_comm_describe_members(moe_comm_t *c, const int *world_ranks)
{
    size_t len = (size_t)snprintf(c->members, sizeof c->members, "world ranks ");
    for (int i = 0; i < c->size && len < sizeof c->members; i++) {
        int room = (int)(sizeof c->members - len);
        int w = snprintf(c->members + len, (size_t)room, "%s%d", i ? "," : "", world_ranks[i]);
        if (w >= room) { /* truncated: end with an ellipsis */
            strcpy(c->members + sizeof c->members - 4, "...");
            break;
        }
        len += (size_t)w;
    }
}

void moe_comm_backoff(unsigned spin)
{
    if (spin > 64) {
        struct timespec ts = {0, spin > 4096 ? 200000 : 20000};
        nanosleep(&ts, NULL);
    }
}

bool moe_comm_mark_dead(moe_comm_t *c, const char *fmt, ...)
{
    if (c->dead) return false;
    c->dead = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->dead_reason, sizeof c->dead_reason, fmt, ap);
    va_end(ap);
    return true;
}

moe_status_t moe_comm_check_live(const moe_comm_t *c, const char *what)
{
    if (c->dead)
        return MOE_FAIL(MOE_STATUS_ABORTED,
                        "%s on the %s communicator (%s): the communicator is unusable after %s",
                        what, c->name, c->members, c->dead_reason);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_check_peer_tag(const moe_comm_t *c, const char *what, int peer, int tag)
{
    MOE_CHECK_ARG(peer >= 0 && peer < c->size && peer != c->rank,
                  "%s: peer %d on the %s communicator of %d ranks (this is rank %d)", what, peer,
                  c->name, c->size, c->rank);
    MOE_CHECK_ARG(tag >= 0 && tag < MOE_COMM_MAX_TAG, "%s: tag %d is outside [0, %d)", what, tag,
                  MOE_COMM_MAX_TAG);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_check_root(const moe_comm_t *c, int root)
{
    MOE_CHECK_ARG(root >= 0 && root < c->size, "broadcast root %d on the %s communicator of %d ranks",
                  root, c->name, c->size);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_check_reduce_op(moe_reduce_op_t op)
{
    MOE_CHECK_ARG(op >= MOE_REDUCE_SUM && op <= MOE_REDUCE_MIN, "unknown reduce op %d", (int)op);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_check_alltoallv(const size_t *send_counts, const size_t *send_displs,
                                      const size_t *recv_counts, const size_t *recv_displs)
{
    MOE_CHECK_ARG(send_counts && send_displs && recv_counts && recv_displs,
                  "alltoallv: counts or displacements are NULL");
    return MOE_STATUS_SUCCESS;
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

moe_status_t moe_comm_send(moe_comm_t *c, const void *buf, size_t count, moe_comm_dtype_t dt,
                           int peer, int tag)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->send(c, buf, count, dt, peer, tag, &req));
    return c->ops->wait(c, req);
}

moe_status_t moe_comm_recv(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                           int peer, int tag)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->recv(c, buf, count, dt, peer, tag, &req));
    return c->ops->wait(c, req);
}

moe_status_t moe_comm_wait(moe_comm_t *c, moe_comm_req_t *req) { return c->ops->wait(c, req); }

moe_status_t moe_comm_test(moe_comm_t *c, moe_comm_req_t *req, bool *done)
{
    return c->ops->test(c, req, done);
}

moe_status_t moe_comm_split(moe_comm_t *c, int color, int key, const char *name,
                            moe_comm_t **out)
{
    return c->ops->split(c, color, key, name, out);
}

void moe_comm_abort(moe_comm_t *c)
{
    if (c) c->ops->abort(c);
}

/* ---- builds without a backend ------------------------------------------------------------- */

#ifndef MOE_HAVE_MPI
moe_status_t moe_comm_mpi_create(const void *mpi_comm, const char *name, int timeout_ms,
                                 const moe_backend_t *backend, const moe_logger_t *logger,
                                 moe_comm_t **out)
{
    (void)mpi_comm, (void)name, (void)timeout_ms, (void)backend, (void)logger;
    if (out) *out = NULL;
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "libmoe was built without MPI");
}
bool moe_comm_have_mpi(void) { return false; }
moe_status_t moe_comm_mpi_acquire(void)
{
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "libmoe was built without MPI");
}
void moe_comm_mpi_release(void) {}
bool moe_comm_mpi_ready(void) { return false; }
bool moe_comm_mpi_threads_ok(void) { return false; }
moe_status_t moe_comm_mpi_rank_size(const void *mpi_comm, int *rank, int *size)
{
    (void)mpi_comm;
    *rank = 0;
    *size = 1;
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "libmoe was built without MPI");
}
#endif

#if !defined(MOE_HAVE_NCCL) || !defined(MOE_HAVE_MPI)
moe_status_t moe_comm_nccl_create(moe_comm_t *bootstrap, const char *name, moe_comm_t **out)
{
    (void)bootstrap, (void)name;
    if (out) *out = NULL;
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "libmoe was built without NCCL");
}
bool moe_comm_have_nccl(void) { return false; }
#endif
