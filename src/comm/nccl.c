/*
 * The NCCL communicator: device buffers on the current CUDA device, enqueued on the
 * communicator's own stream.
 *
 * Creation: rank 0 makes the unique id, broadcast through an MPI bootstrap communicator;
 * the communicator is created non-blocking (config.blocking = 0) and polled with
 * ncclCommGetAsyncError until it is ready or the timeout passes, then ncclCommAbort and
 * MOE_STATUS_TIMEOUT naming the axis and ranks. split() is ncclCommSplit, polled alike.
 *
 * Operations: the NCCL stream first waits for the stream that produced the buffers (the
 * backend's current stream; without a backend, the legacy default stream) through an event
 * -- the GPU orders the two, the host does not wait -- then the operation is enqueued on the
 * NCCL stream and records a completion event.
 * wait() polls the event, the communicator's async error and the mesh's watch against the
 * deadline: a dead or hung peer ends in ncclCommAbort + TIMEOUT (the watch names it), never a
 * hang; a failure another rank reported aborts the communicator at once. alltoallv is grouped
 * ncclSend/ncclRecv (self included). NCCL has no tags: send/recv between two ranks match
 * in call order; count mismatches in alltoallv are not detected (NCCL receives what it is
 * told).
 */
#include "comm.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/clock.h"
#include "core/error.h"

typedef struct nccl_impl {
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t produced; /* recorded on the producing stream before each operation */
    int world_rank;       /* this rank in the root (bootstrap) communicator */
    int *dev_scratch;     /* device int [size]: barrier and member discovery */
    moe_comm_req_t *inflight;
} nccl_impl_t;

struct moe_comm_req {
    const char *what;
    cudaEvent_t done;
    moe_comm_req_t *next;
};

static ncclDataType_t nccl_type(moe_comm_dtype_t dt)
{
    switch (dt) {
    case MOE_COMM_F32: return ncclFloat32;
    case MOE_COMM_BF16: return ncclBfloat16;
    case MOE_COMM_I32: return ncclInt32;
    case MOE_COMM_I64: return ncclInt64;
    case MOE_COMM_F64: return ncclFloat64;
    case MOE_COMM_U8: return ncclUint8;
    }
    return ncclNumTypes;
}

static void mark_dead(moe_comm_t *c, const char *why)
{
    nccl_impl_t *m = c->impl;
    moe_comm_mark_dead(c, "%s", why);
    if (m->comm) ncclCommAbort(m->comm); /* stops NCCL's kernels and proxy; peers time out */
    m->comm = NULL;
}

/* Refuse work once c or its mesh failed; the NCCL communicator is aborted then, so that no
 * kernel keeps waiting for a peer that will never come. */
static moe_status_t check_live(moe_comm_t *c, const char *what)
{
    moe_status_t st = moe_comm_check_live(c, what);
    if (st != MOE_STATUS_SUCCESS && ((nccl_impl_t *)c->impl)->comm)
        mark_dead(c, "a failure elsewhere");
    return st;
}

/* Poll a non-blocking NCCL call (init, split, group end) until it settles. */
static moe_status_t settle(moe_comm_t *c, ncclComm_t comm, const char *what)
{
    double deadline = moe_now_ms() + c->timeout_ms;
    for (unsigned spin = 0;; spin++) {
        ncclResult_t state = ncclSuccess;
        ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
        if (rc != ncclSuccess) state = rc;
        if (state == ncclSuccess) return MOE_STATUS_SUCCESS;
        if (state != ncclInProgress) {
            char why[96];
            snprintf(why, sizeof why, "an NCCL error in %s", what);
            moe_status_t st = MOE_FAIL(
                MOE_STATUS_COMM_ERROR, "%s on the %s communicator (rank %d of %d; %s): %s", what,
                c->name, c->rank, c->size, c->members, ncclGetErrorString(state));
            if (c->impl)
                mark_dead(c, why);
            else
                ncclCommAbort(comm);
            return st;
        }
        if (moe_now_ms() > deadline) {
            char why[96];
            snprintf(why, sizeof why, "a timeout in %s", what);
            if (c->impl)
                mark_dead(c, why);
            else
                ncclCommAbort(comm);
            return MOE_FAIL(MOE_STATUS_TIMEOUT,
                            "%s on the %s communicator (rank %d of %d; %s) did not complete "
                            "within %d ms: a peer is dead or stalled (ncclCommAbort called)",
                            what, c->name, c->rank, c->size, c->members, c->timeout_ms);
        }
        moe_comm_backoff(spin);
    }
}

/* ---- requests ------------------------------------------------------------------------------ */

/* Before enqueuing: order after the stream that produced the buffers. */
static moe_status_t begin(moe_comm_t *c, const char *what)
{
    MOE_TRY(check_live(c, what));
    nccl_impl_t *m = c->impl;
    cudaStream_t producer = c->backend ? (cudaStream_t)c->backend->ops->stream(c->backend->ctx)
                                       : NULL;
    /* the wait takes the event's state at this call, so one event serves every operation */
    cudaError_t e = cudaEventRecord(m->produced, producer);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(m->stream, m->produced, 0);
    if (e != cudaSuccess)
        return MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "ordering %s after the compute stream: %s", what,
                        cudaGetErrorString(e));
    return MOE_STATUS_SUCCESS;
}

/* After enqueuing: settle the (non-blocking) call and record the completion event. */
static moe_status_t finish_start(moe_comm_t *c, const char *what, moe_comm_req_t **out)
{
    nccl_impl_t *m = c->impl;
    MOE_TRY(settle(c, m->comm, what));
    moe_comm_req_t *r = calloc(1, sizeof *r);
    if (!r) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "request for %s", what);
    r->what = what;
    cudaError_t e = cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(r->done, m->stream);
    if (e != cudaSuccess) {
        free(r);
        return MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "completion event of %s: %s", what,
                        cudaGetErrorString(e));
    }
    r->next = m->inflight;
    m->inflight = r;
    *out = r;
    return MOE_STATUS_SUCCESS;
}

static bool take(moe_comm_t *c, moe_comm_req_t *r)
{
    nccl_impl_t *m = c->impl;
    for (moe_comm_req_t **p = &m->inflight; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            return true;
        }
    return false;
}

static bool is_inflight(moe_comm_t *c, moe_comm_req_t *r)
{
    for (moe_comm_req_t *p = ((nccl_impl_t *)c->impl)->inflight; p; p = p->next)
        if (p == r) return true;
    return false;
}

static moe_status_t nccl_test(moe_comm_t *c, moe_comm_req_t *r, bool *done)
{
    *done = false;
    MOE_CHECK_ARG(r && is_inflight(c, r), "not an operation in flight on the %s communicator",
                  c->name);
    MOE_TRY(check_live(c, r->what));
    nccl_impl_t *m = c->impl;
    cudaError_t q = cudaEventQuery(r->done);
    if (q == cudaSuccess) {
        take(c, r);
        cudaEventDestroy(r->done);
        free(r);
        *done = true;
        moe_comm_watch_poll(c->watch); /* answer pings; a failure shows on the next call */
        return MOE_STATUS_SUCCESS;
    }
    moe_status_t watched = moe_comm_poll_watch(c, r->what);
    if (watched != MOE_STATUS_SUCCESS) {
        mark_dead(c, "a failure elsewhere");
        return watched;
    }
    if (q != cudaErrorNotReady)
        return MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "%s on the %s communicator: %s", r->what, c->name,
                        cudaGetErrorString(q));
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(m->comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
        const char *what = r->what;
        mark_dead(c, "an asynchronous NCCL error");
        return moe_comm_failed(c, MOE_STATUS_COMM_ERROR, "%s on the %s communicator (%s): %s", what,
                               c->name, c->members, ncclGetErrorString(state));
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t wait_until(moe_comm_t *c, moe_comm_req_t *r, int timeout_ms)
{
    double deadline = moe_now_ms() + timeout_ms;
    const char *what = r->what;
    for (unsigned spin = 0;; spin++) {
        bool done = false;
        MOE_TRY(nccl_test(c, r, &done));
        if (done) return MOE_STATUS_SUCCESS;
        if (moe_now_ms() > deadline) {
            char why[96];
            snprintf(why, sizeof why, "a timeout in %s", what);
            mark_dead(c, why);
            /* NCCL cannot say who is missing: every other member is a suspect */
            int *late = malloc(sizeof *late * (size_t)c->size);
            int nlate = 0;
            for (int i = 0; late && c->world_ranks && i < c->size; i++)
                if (i != c->rank) late[nlate++] = c->world_ranks[i];
            moe_status_t st = moe_comm_timed_out(c, what, timeout_ms, late, nlate,
                                                 "ncclCommAbort called");
            free(late);
            return st;
        }
        moe_comm_backoff(spin);
    }
}

static moe_status_t nccl_wait(moe_comm_t *c, moe_comm_req_t *r, int timeout_ms)
{
    MOE_CHECK_ARG(r && is_inflight(c, r), "not an operation in flight on the %s communicator",
                  c->name);
    moe_comm_watch_waiting(c->watch, c, r, moe_comm_late_members);
    moe_status_t st = wait_until(c, r, timeout_ms);
    moe_comm_watch_waiting(c->watch, NULL, NULL, NULL);
    return st;
}

/* ---- operations ---------------------------------------------------------------------------- */

static moe_status_t nccl_allreduce(moe_comm_t *c, const void *send, void *recv, size_t count,
                                   moe_comm_dtype_t dt, moe_reduce_op_t op, moe_comm_req_t **out)
{
    MOE_CHECK_ARG(nccl_type(dt) != ncclNumTypes, "unknown dtype %d", (int)dt);
    MOE_TRY(moe_comm_check_reduce_op(op));
    MOE_TRY(begin(c, "allreduce"));
    nccl_impl_t *m = c->impl;
    ncclRedOp_t o = op == MOE_REDUCE_SUM ? ncclSum : op == MOE_REDUCE_MAX ? ncclMax : ncclMin;
    MOE_NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(dt), o, m->comm, m->stream));
    return finish_start(c, "allreduce", out);
}

static moe_status_t nccl_broadcast(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                   int root, moe_comm_req_t **out)
{
    MOE_CHECK_ARG(nccl_type(dt) != ncclNumTypes, "unknown dtype %d", (int)dt);
    MOE_TRY(moe_comm_check_root(c, root));
    MOE_TRY(begin(c, "broadcast"));
    nccl_impl_t *m = c->impl;
    MOE_NCCL_CHECK(ncclBroadcast(buf, buf, count, nccl_type(dt), root, m->comm, m->stream));
    return finish_start(c, "broadcast", out);
}

static moe_status_t nccl_alltoallv(moe_comm_t *c, const void *send, const size_t *send_counts,
                                   const size_t *send_displs, void *recv, const size_t *recv_counts,
                                   const size_t *recv_displs, moe_comm_dtype_t dt,
                                   moe_comm_req_t **out)
{
    MOE_TRY(moe_comm_check_alltoallv(send_counts, send_displs, recv_counts, recv_displs));
    MOE_CHECK_ARG(nccl_type(dt) != ncclNumTypes, "unknown dtype %d", (int)dt);
    MOE_TRY(begin(c, "alltoallv"));
    nccl_impl_t *m = c->impl;
    size_t es = moe_comm_dtype_size(dt);
    ncclDataType_t t = nccl_type(dt);
    moe_status_t st = MOE_STATUS_SUCCESS;
    MOE_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < c->size; p++) {
        if (send_counts[p])
            MOE_NCCL_CHECK_GOTO(st, ncclSend((const char *)send + send_displs[p] * es,
                                             send_counts[p], t, p, m->comm, m->stream));
        if (recv_counts[p])
            MOE_NCCL_CHECK_GOTO(st, ncclRecv((char *)recv + recv_displs[p] * es, recv_counts[p], t,
                                             p, m->comm, m->stream));
    }
fail:
    /* The group is ended whatever happened: left open, it would take in every later NCCL
     * call of this thread. After a failed enqueue the peers' halves of the exchange are
     * unmatched, so the communicator is dead. */
    {
        ncclResult_t rc = ncclGroupEnd();
        if (st == MOE_STATUS_SUCCESS && rc != ncclSuccess && rc != ncclInProgress)
            st = MOE_FAIL(MOE_STATUS_COMM_ERROR, "ncclGroupEnd of alltoallv: %s",
                          ncclGetErrorString(rc));
    }
    if (st != MOE_STATUS_SUCCESS) {
        moe_comm_mark_dead(c, "a failed alltoallv");
        return st;
    }
    return finish_start(c, "alltoallv", out);
}

static moe_status_t nccl_p2p(moe_comm_t *c, bool is_send, void *buf, size_t count,
                             moe_comm_dtype_t dt, int peer, int tag, moe_comm_req_t **out)
{
    const char *what = is_send ? "send" : "recv";
    MOE_CHECK_ARG(nccl_type(dt) != ncclNumTypes, "unknown dtype %d", (int)dt);
    MOE_TRY(moe_comm_check_peer_tag(c, what, peer, tag));
    MOE_TRY(begin(c, what));
    nccl_impl_t *m = c->impl;
    if (is_send)
        MOE_NCCL_CHECK(ncclSend(buf, count, nccl_type(dt), peer, m->comm, m->stream));
    else
        MOE_NCCL_CHECK(ncclRecv(buf, count, nccl_type(dt), peer, m->comm, m->stream));
    return finish_start(c, what, out);
}

static moe_status_t nccl_send(moe_comm_t *c, const void *buf, size_t count, moe_comm_dtype_t dt,
                              int peer, int tag, moe_comm_req_t **out)
{
    return nccl_p2p(c, true, (void *)buf, count, dt, peer, tag, out);
}

static moe_status_t nccl_recv(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt, int peer,
                              int tag, moe_comm_req_t **out)
{
    return nccl_p2p(c, false, buf, count, dt, peer, tag, out);
}

static moe_status_t nccl_barrier(moe_comm_t *c)
{
    nccl_impl_t *m = c->impl;
    moe_comm_req_t *r = NULL;
    MOE_TRY(nccl_allreduce(c, m->dev_scratch, m->dev_scratch, 1, MOE_COMM_I32, MOE_REDUCE_SUM, &r));
    return nccl_wait(c, r, c->timeout_ms);
}

/* ---- lifecycle ------------------------------------------------------------------------------ */

static void nccl_abort(moe_comm_t *c) { mark_dead(c, "abort"); }

static void nccl_destroy(moe_comm_t *c)
{
    nccl_impl_t *m = c->impl;
    if (m) {
        for (moe_comm_req_t *r = m->inflight; r;) {
            moe_comm_req_t *next = r->next;
            cudaEventDestroy(r->done);
            free(r);
            r = next;
        }
        if (m->comm) {
            if (moe_comm_is_dead(c))
                ncclCommAbort(m->comm);
            else {
                cudaStreamSynchronize(m->stream);
                ncclCommDestroy(m->comm);
            }
        }
        if (m->dev_scratch) cudaFree(m->dev_scratch);
        if (m->produced) cudaEventDestroy(m->produced);
        if (m->stream) cudaStreamDestroy(m->stream);
        free(m);
    }
    free(c->world_ranks);
    free(c);
}

static moe_status_t nccl_split(moe_comm_t *c, int color, int key, const char *name,
                               moe_comm_t **out);

static const moe_comm_ops_t nccl_ops = {
    .name = "nccl",
    .allreduce = nccl_allreduce,
    .broadcast = nccl_broadcast,
    .alltoallv = nccl_alltoallv,
    .send = nccl_send,
    .recv = nccl_recv,
    .wait = nccl_wait,
    .test = nccl_test,
    .barrier = nccl_barrier,
    .split = nccl_split,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};

/* A communicator shell around a settled ncclComm_t; members named by an all-gather of the
 * world ranks. */
static moe_status_t wrap(ncclComm_t comm, const moe_comm_t *like, int world_rank, const char *name,
                         moe_comm_t **out)
{
    moe_comm_t *c = calloc(1, sizeof *c);
    nccl_impl_t *m = calloc(1, sizeof *m);
    if (!c || !m) {
        free(c);
        free(m);
        ncclCommDestroy(comm);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "communicator");
    }
    c->ops = &nccl_ops;
    c->impl = m;
    m->comm = comm;
    m->world_rank = world_rank;
    snprintf(c->name, sizeof c->name, "%s", name ? name : "?");
    c->timeout_ms = like->timeout_ms;
    c->device_buffers = true;
    c->logger = like->logger;
    c->backend = like->backend;
    c->watch = like->watch;
    ncclCommCount(comm, &c->size);
    ncclCommUserRank(comm, &c->rank);
    snprintf(c->members, sizeof c->members, "%d ranks", c->size);
    moe_status_t st = MOE_STATUS_SUCCESS;
    int *host = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&m->produced, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaMalloc((void **)&m->dev_scratch, sizeof(int) * (size_t)c->size);
    if (e != cudaSuccess) {
        st = MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "NCCL communicator stream: %s",
                      cudaGetErrorString(e));
        goto fail;
    }
    host = malloc(sizeof(int) * (size_t)c->size);
    if (!host) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "member table");
        goto fail;
    }
    /* members: all-gather of the world ranks */
    host[0] = world_rank;
    e = cudaMemcpy(m->dev_scratch + c->rank, host, sizeof(int), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        st = MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "member table: %s", cudaGetErrorString(e));
        goto fail;
    }
    {
        moe_comm_req_t *r = NULL;
        ncclResult_t rc = ncclAllGather(m->dev_scratch + c->rank, m->dev_scratch, 1, ncclInt32,
                                        m->comm, m->stream);
        if (rc != ncclSuccess && rc != ncclInProgress) {
            st = MOE_FAIL(MOE_STATUS_COMM_ERROR, "ncclAllGather of the members of %s: %s", c->name,
                          ncclGetErrorString(rc));
            goto fail;
        }
        MOE_TRY_GOTO(st, finish_start(c, "allgather", &r));
        MOE_TRY_GOTO(st, nccl_wait(c, r, c->timeout_ms));
    }
    e = cudaMemcpy(host, m->dev_scratch, sizeof(int) * (size_t)c->size, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        st = MOE_FAIL(MOE_STATUS_BACKEND_ERROR, "member table: %s", cudaGetErrorString(e));
        goto fail;
    }
    c->world_ranks = host;
    moe_comm_describe_members(c);
    *out = c;
    return MOE_STATUS_SUCCESS;
fail:
    free(host);
    nccl_destroy(c);
    return st;
}

static ncclConfig_t nonblocking_config(void)
{
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    return cfg;
}

moe_status_t moe_comm_nccl_create(moe_comm_t *bootstrap, const char *name, moe_comm_t **out)
{
    MOE_CHECK_ARG(bootstrap && out, "bootstrap or out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(strcmp(bootstrap->ops->name, "mpi") == 0 && !bootstrap->device_buffers,
                  "the NCCL bootstrap must be an MPI communicator on host buffers");
    /* on the heap: after a timed-out broadcast MPI may still write it (it is leaked then) */
    ncclUniqueId *shared = calloc(1, sizeof *shared);
    if (!shared) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "NCCL unique id");
    if (bootstrap->rank == 0) {
        ncclResult_t got = ncclGetUniqueId(shared);
        if (got != ncclSuccess) {
            free(shared);
            return MOE_FAIL(MOE_STATUS_COMM_ERROR, "ncclGetUniqueId: %s", ncclGetErrorString(got));
        }
    }
    MOE_TRY(moe_comm_broadcast(bootstrap, shared, sizeof *shared, MOE_COMM_U8, 0));
    ncclUniqueId id = *shared;
    free(shared);
    int world_rank = bootstrap->rank;
    ncclConfig_t cfg = nonblocking_config();
    ncclComm_t comm = NULL;
    ncclResult_t rc = ncclCommInitRankConfig(&comm, bootstrap->size, id, bootstrap->rank, &cfg);
    if (rc != ncclSuccess && rc != ncclInProgress)
        return MOE_FAIL(MOE_STATUS_COMM_ERROR,
                        "ncclCommInitRankConfig for the %s communicator (rank %d of %d): %s",
                        name ? name : "?", bootstrap->rank, bootstrap->size,
                        ncclGetErrorString(rc));
    moe_comm_t probe = *bootstrap; /* names and timeout for messages while settling */
    probe.impl = NULL;
    snprintf(probe.name, sizeof probe.name, "%s", name ? name : "?");
    MOE_TRY(settle(&probe, comm, "ncclCommInitRankConfig"));
    return wrap(comm, bootstrap, world_rank, name, out);
}

static moe_status_t nccl_split(moe_comm_t *c, int color, int key, const char *name,
                               moe_comm_t **out)
{
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(color >= 0, "split color %d must be >= 0", color);
    MOE_TRY(moe_comm_check_live(c, "split"));
    nccl_impl_t *m = c->impl;
    ncclConfig_t cfg = nonblocking_config();
    ncclComm_t nc = NULL;
    ncclResult_t rc = ncclCommSplit(m->comm, color, key, &nc, &cfg);
    if (rc != ncclSuccess && rc != ncclInProgress)
        return MOE_FAIL(MOE_STATUS_COMM_ERROR, "ncclCommSplit of the %s communicator: %s", c->name,
                        ncclGetErrorString(rc));
    MOE_TRY(settle(c, m->comm, "ncclCommSplit"));
    moe_comm_t probe = *c;
    probe.impl = NULL;
    snprintf(probe.name, sizeof probe.name, "%s", name ? name : "?");
    MOE_TRY(settle(&probe, nc, "ncclCommSplit"));
    return wrap(nc, c, m->world_rank, name, out);
}

bool moe_comm_have_nccl(void) { return true; }
