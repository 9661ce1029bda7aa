/* Blocking helpers over the communicator table, dtype sizes, and the failure paths both
 * implementations share (marking a communicator dead, naming the ranks, the watch). */
#include "comm.h"

#include "core/error.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
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

void moe_comm_describe_members(moe_comm_t *c)
{
    moe_comm_format_ranks(c->members, sizeof c->members, c->world_ranks, c->size);
}

int moe_comm_my_world_rank(const moe_comm_t *c)
{
    return c->world_ranks ? c->world_ranks[c->rank] : c->rank;
}

int moe_comm_late_members(const moe_comm_t *c, moe_comm_req_t *r, int *late, int max)
{
    (void)r;
    int n = 0;
    for (int i = 0; c->world_ranks && i < c->size && n < max; i++)
        if (i != c->rank) late[n++] = c->world_ranks[i];
    return n;
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

bool moe_comm_is_dead(const moe_comm_t *c)
{
    return c->dead || (c->watch && moe_comm_watch_failure(c->watch, NULL) != MOE_STATUS_SUCCESS);
}

moe_status_t moe_comm_check_live(const moe_comm_t *c, const char *what)
{
    const char *cause = NULL;
    if (c->watch && moe_comm_watch_failure(c->watch, &cause) != MOE_STATUS_SUCCESS)
        return MOE_FAIL(MOE_STATUS_ABORTED,
                        "%s on the %s communicator (%s): the mesh is unusable since %s", what,
                        c->name, c->members, cause);
    if (c->dead)
        return MOE_FAIL(MOE_STATUS_ABORTED,
                        "%s on the %s communicator (%s): the communicator is unusable after %s",
                        what, c->name, c->members, c->dead_reason);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_poll_watch(moe_comm_t *c, const char *what)
{
    if (!c->watch) return MOE_STATUS_SUCCESS;
    moe_comm_watch_poll(c->watch);
    const char *cause = NULL;
    if (moe_comm_watch_failure(c->watch, &cause) == MOE_STATUS_SUCCESS) return MOE_STATUS_SUCCESS;
    moe_comm_mark_dead(c, "a failure elsewhere");
    return MOE_FAIL(MOE_STATUS_ABORTED,
                    "%s on the %s communicator (%s; this is world rank %d) "
                    "stopped: %s",
                    what, c->name, c->members, moe_comm_my_world_rank(c), cause);
}

moe_status_t moe_comm_timed_out(moe_comm_t *c, const char *what, int timeout_ms, const int *late,
                                int nlate, const char *detail)
{
    char found[512] = "";
    moe_comm_mark_dead(c, "a timeout in %s", what);
    if (c->watch) {
        moe_comm_watch_timed_out(c->watch, c->name, what, timeout_ms, late, nlate, found,
                                 sizeof found);
    } else if (nlate > 0 && !(detail && *detail)) {
        char ranks[128];
        moe_comm_format_ranks(ranks, sizeof ranks, late, nlate);
        snprintf(found, sizeof found, "waiting for %s: a peer is dead or stalled", ranks);
    } else {
        snprintf(found, sizeof found, "a peer is dead or stalled");
    }
    return MOE_FAIL(MOE_STATUS_TIMEOUT,
                    "%s on the %s communicator (%s; this is world rank %d) did not complete "
                    "within %d ms%s%s: %s",
                    what, c->name, c->members, moe_comm_my_world_rank(c), timeout_ms,
                    detail && *detail ? "; " : "", detail ? detail : "", found);
}

moe_status_t moe_comm_failed(moe_comm_t *c, moe_status_t status, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_comm_mark_dead(c, "%s", msg);
    if (c->watch) {
        char cause[640];
        snprintf(cause, sizeof cause, "world rank %d failed: %s", moe_comm_my_world_rank(c), msg);
        moe_comm_watch_fail(c->watch, status, cause);
    }
    return MOE_FAIL(status, "%s", msg);
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
    MOE_CHECK_ARG(root >= 0 && root < c->size,
                  "broadcast root %d on the %s communicator of %d ranks", root, c->name, c->size);
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
    return moe_comm_wait(c, req);
}

moe_status_t moe_comm_broadcast(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                int root)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->broadcast(c, buf, count, dt, root, &req));
    return moe_comm_wait(c, req);
}

moe_status_t moe_comm_alltoallv(moe_comm_t *c, const void *send, const size_t *send_counts,
                                const size_t *send_displs, void *recv, const size_t *recv_counts,
                                const size_t *recv_displs, moe_comm_dtype_t dt)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->alltoallv(c, send, send_counts, send_displs, recv, recv_counts, recv_displs, dt,
                              &req));
    return moe_comm_wait(c, req);
}

moe_status_t moe_comm_allreduce_copy(moe_comm_t *c, const void *send, void *recv, size_t count,
                                     moe_comm_dtype_t dt, moe_reduce_op_t op)
{
    MOE_CHECK_ARG(!c->device_buffers, "allreduce_copy takes host buffers");
    size_t bytes = count * moe_comm_dtype_size(dt);
    void *tmp = malloc(bytes ? bytes : 1);
    if (!tmp) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "allreduce of %zu bytes", bytes);
    memcpy(tmp, send, bytes);
    MOE_TRY(moe_comm_allreduce(c, tmp, tmp, count, dt, op)); /* tmp stays MPI's */
    memcpy(recv, tmp, bytes);
    free(tmp);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_broadcast_copy(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                     int root)
{
    MOE_CHECK_ARG(!c->device_buffers, "broadcast_copy takes host buffers");
    size_t bytes = count * moe_comm_dtype_size(dt);
    void *tmp = malloc(bytes ? bytes : 1);
    if (!tmp) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "broadcast of %zu bytes", bytes);
    memcpy(tmp, buf, bytes);
    MOE_TRY(moe_comm_broadcast(c, tmp, count, dt, root)); /* tmp stays MPI's */
    memcpy(buf, tmp, bytes);
    free(tmp);
    return MOE_STATUS_SUCCESS;
}

/* The wait clock (comm.h): a monotonic reading in ns, and a wait's time added to c's. */
static int64_t waited_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static moe_status_t waited_add(moe_comm_t *c, int64_t t0_ns, moe_status_t st)
{
    if (c->waited) {
        atomic_fetch_add_explicit(&c->waited->ns, waited_now_ns() - t0_ns, memory_order_relaxed);
        atomic_fetch_add_explicit(&c->waited->count, 1, memory_order_relaxed);
    }
    return st;
}

moe_status_t moe_comm_barrier(moe_comm_t *c)
{
    int64_t t0 = waited_now_ns();
    return waited_add(c, t0, c->ops->barrier(c));
}

void moe_comm_destroy(moe_comm_t *c)
{
    if (c) c->ops->destroy(c);
}

moe_status_t moe_comm_send(moe_comm_t *c, const void *buf, size_t count, moe_comm_dtype_t dt,
                           int peer, int tag)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->send(c, buf, count, dt, peer, tag, &req));
    return moe_comm_wait(c, req);
}

moe_status_t moe_comm_recv(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt, int peer,
                           int tag)
{
    moe_comm_req_t *req = NULL;
    MOE_TRY(c->ops->recv(c, buf, count, dt, peer, tag, &req));
    return moe_comm_wait(c, req);
}

moe_status_t moe_comm_wait(moe_comm_t *c, moe_comm_req_t *req)
{
    return moe_comm_wait_within(c, req, c->timeout_ms);
}

moe_status_t moe_comm_wait_within(moe_comm_t *c, moe_comm_req_t *req, int timeout_ms)
{
    int64_t t0 = waited_now_ns();
    return waited_add(c, t0, c->ops->wait(c, req, timeout_ms));
}

moe_status_t moe_comm_test(moe_comm_t *c, moe_comm_req_t *req, bool *done)
{
    return c->ops->test(c, req, done);
}

moe_status_t moe_comm_split(moe_comm_t *c, int color, int key, const char *name, moe_comm_t **out)
{
    return c->ops->split(c, color, key, name, out);
}

void moe_comm_abort(moe_comm_t *c)
{
    if (!c) return;
    bool was_live = !moe_comm_is_dead(c);
    c->ops->abort(c);
    if (was_live && c->watch) {
        char cause[640];
        snprintf(cause, sizeof cause, "world rank %d aborted the %s communicator after: %s",
                 moe_comm_my_world_rank(c), c->name,
                 moe_last_error()[0] ? moe_last_error() : "a local failure");
        moe_comm_watch_fail(c->watch, MOE_STATUS_ABORTED, cause);
    }
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
void moe_comm_mpi_abandon(void) {}
bool moe_comm_mpi_release_finalizes(void) { return false; }
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

#ifndef MOE_HAVE_MPI
/* Without MPI there is no mesh of several ranks, hence no watch. */
moe_status_t moe_comm_mpi_watch(moe_comm_t *world, moe_comm_watch_t **out)
{
    (void)world;
    *out = NULL;
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "libmoe was built without MPI");
}
moe_status_t moe_comm_watch_create(const void *mpi_comm, int rank, int size, int timeout_ms,
                                   const moe_logger_t *logger, moe_comm_watch_t **out)
{
    (void)mpi_comm, (void)rank, (void)size, (void)timeout_ms, (void)logger;
    *out = NULL;
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "libmoe was built without MPI");
}
void moe_comm_watch_destroy(moe_comm_watch_t *w) { (void)w; }
void moe_comm_watch_poll(moe_comm_watch_t *w) { (void)w; }
void moe_comm_watch_waiting(moe_comm_watch_t *w, const moe_comm_t *c, moe_comm_req_t *r,
                            moe_comm_late_fn late)
{
    (void)w, (void)c, (void)r, (void)late;
}
moe_status_t moe_comm_watch_failure(const moe_comm_watch_t *w, const char **cause)
{
    (void)w;
    if (cause) *cause = "";
    return MOE_STATUS_SUCCESS;
}
void moe_comm_watch_timed_out(moe_comm_watch_t *w, const char *comm_name, const char *what,
                              int timeout_ms, const int *late, int nlate, char *text, size_t size)
{
    (void)w, (void)comm_name, (void)what, (void)timeout_ms, (void)late, (void)nlate;
    if (size) text[0] = '\0';
}
void moe_comm_watch_fail(moe_comm_watch_t *w, moe_status_t status, const char *cause)
{
    (void)w, (void)status, (void)cause;
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
