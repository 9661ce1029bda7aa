/*
 * The MPI communicator: host buffers, or device buffers staged through pinned host memory
 * (the runtime backend's alloc_pinned + copy), so several ranks can share one GPU.
 *
 * Every operation is started non-blocking (MPI_I*) and completed by wait(), which polls
 * MPI_Testall (and the mesh's watch) against a deadline of timeout_ms: a dead or stalled peer
 * ends in MOE_STATUS_TIMEOUT naming the operation, the axis, its members and the world ranks
 * that did not deliver, never in a hang. After a timeout, an MPI error or an abort the
 * communicator is dead: every later call fails with ABORTED. MPI cannot cancel a collective,
 * so buffers of an operation that never completed may still be written by MPI until the
 * process ends; staging buffers of such operations (and the communicator) are leaked on
 * purpose (freeing them would let MPI write into freed memory).
 *
 * alltoallv is point-to-point (one Irecv and one Isend per peer, on a reserved tag): it lets
 * a timeout name the peers whose rows never arrived and lets a count mismatch be reported
 * instead of silently truncating. Several alltoallv calls may be in flight on one
 * communicator; MPI's non-overtaking order matches them as long as every member starts them
 * in the same order (the collective ordering rule, docs/mesh.md).
 */
#include "comm.h"

#include <limits.h>
#include <mpi.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/bf16.h"
#include "core/clock.h"
#include "core/error.h"
#include "mpi_support.h"

#define A2A_TAG (MOE_COMM_MAX_TAG + 1)

/* ---- state ----------------------------------------------------------------------------------- */

typedef struct pool_block {
    void *p;
    size_t bytes;
    bool busy;
} pool_block_t;

typedef struct mpi_impl {
    MPI_Comm comm;
    MPI_Op bf16_op[3];  /* sum, max, min on bf16 (MPI has no bf16 type) */
    pool_block_t *pool; /* pinned staging blocks (device buffers only), grown */
    int npool;
    moe_comm_req_t *inflight; /* started, not completed */
} mpi_impl_t;

typedef struct stage_back {
    void *dst;             /* device */
    size_t src_off, bytes; /* in the request's recv staging block */
} stage_back_t;

struct moe_comm_req {
    const char *what;
    int n; /* MPI requests */
    MPI_Request *reqs;
    int *peer;      /* transfers: the peer of each request; NULL for collectives */
    int nrecv;      /* alltoallv: requests [0, nrecv) are the receives */
    size_t *expect; /* alltoallv: bytes each receive must deliver */
    int stage[2];   /* pool slots in use (-1: none) */
    int nback;      /* device copies to do on completion */
    stage_back_t *back;
    moe_comm_req_t *next;
    MPI_Request inline_reqs[2];
    int inline_peer;
};

static bool staged(const moe_comm_t *c) { return c->device_buffers && c->backend; }

static MPI_Datatype mpi_type(moe_comm_dtype_t dt)
{
    switch (dt) {
    case MOE_COMM_F32: return MPI_FLOAT;
    case MOE_COMM_BF16: return MPI_UINT16_T;
    case MOE_COMM_I32: return MPI_INT32_T;
    case MOE_COMM_I64: return MPI_INT64_T;
    case MOE_COMM_F64: return MPI_DOUBLE;
    case MOE_COMM_U8: return MPI_UINT8_T;
    }
    return MPI_DATATYPE_NULL;
}

/* ---- bf16 reductions ------------------------------------------------------------------------- */

static void bf16_reduce(void *in, void *inout, int *len, int op)
{
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++) {
        float x = moe_bf16_to_f32(a[i]), y = moe_bf16_to_f32(b[i]);
        float r = op == 0 ? x + y : op == 1 ? (x > y ? x : y) : (x < y ? x : y);
        b[i] = moe_f32_to_bf16(r);
    }
}
static void bf16_sum(void *in, void *io, int *len, MPI_Datatype *t)
{
    (void)t;
    bf16_reduce(in, io, len, 0);
}
static void bf16_max(void *in, void *io, int *len, MPI_Datatype *t)
{
    (void)t;
    bf16_reduce(in, io, len, 1);
}
static void bf16_min(void *in, void *io, int *len, MPI_Datatype *t)
{
    (void)t;
    bf16_reduce(in, io, len, 2);
}

static MPI_Op mpi_op(const mpi_impl_t *m, moe_comm_dtype_t dt, moe_reduce_op_t op)
{
    if (dt == MOE_COMM_BF16) return m->bf16_op[op];
    return op == MOE_REDUCE_SUM ? MPI_SUM : op == MOE_REDUCE_MAX ? MPI_MAX : MPI_MIN;
}

/* ---- staging pool ---------------------------------------------------------------------------- */

static moe_status_t pool_get(moe_comm_t *c, size_t bytes, int *slot)
{
    mpi_impl_t *m = c->impl;
    int best = -1, spare = -1;
    for (int i = 0; i < m->npool; i++) {
        if (m->pool[i].busy) continue;
        if (m->pool[i].bytes >= bytes && (best < 0 || m->pool[i].bytes < m->pool[best].bytes))
            best = i;
        if (spare < 0 || m->pool[i].bytes < m->pool[spare].bytes) spare = i;
    }
    if (best < 0) {
        if (spare < 0) { /* every block is busy: add one */
            pool_block_t *grown = realloc(m->pool, sizeof *grown * (size_t)(m->npool + 1));
            if (!grown) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "staging pool");
            m->pool = grown;
            spare = m->npool++;
            m->pool[spare] = (pool_block_t){NULL, 0, false};
        }
        pool_block_t *b = &m->pool[spare]; /* replace the smallest free block */
        if (b->p) c->backend->ops->free_pinned(c->backend->ctx, b->p);
        b->p = NULL;
        b->bytes = 0;
        size_t want = bytes < 4096 ? 4096 : bytes;
        MOE_TRY(c->backend->ops->alloc_pinned(c->backend->ctx, want, &b->p));
        b->bytes = want;
        best = spare;
    }
    m->pool[best].busy = true;
    *slot = best;
    return MOE_STATUS_SUCCESS;
}

static void *pool_ptr(moe_comm_t *c, int slot) { return ((mpi_impl_t *)c->impl)->pool[slot].p; }

/* ---- requests -------------------------------------------------------------------------------- */

/* A request of n MPI requests; a2a adds the per-receive peer and byte tables, p2p the one
 * peer. */
static moe_status_t req_new(moe_comm_t *c, const char *what, int n, bool a2a, bool p2p,
                            moe_comm_req_t **out)
{
    moe_comm_req_t *r = calloc(1, sizeof *r);
    if (!r) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "request for %s", what);
    r->what = what;
    r->n = n;
    r->stage[0] = r->stage[1] = -1;
    r->reqs = n <= 2 ? r->inline_reqs : malloc((size_t)n * sizeof *r->reqs);
    if (a2a) {
        r->peer = malloc((size_t)n * sizeof *r->peer);
        r->expect = malloc((size_t)n * sizeof *r->expect);
    } else if (p2p) {
        r->peer = &r->inline_peer;
    }
    if (!r->reqs || (a2a && (!r->peer || !r->expect))) {
        if (r->reqs != r->inline_reqs) free(r->reqs);
        if (r->peer != &r->inline_peer) free(r->peer);
        free(r->expect);
        free(r);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "request for %s", what);
    }
    for (int i = 0; i < n; i++) r->reqs[i] = MPI_REQUEST_NULL;
    (void)c;
    *out = r;
    return MOE_STATUS_SUCCESS;
}

/* Free a request that never reached MPI or whose MPI requests completed. */
static void req_free(moe_comm_t *c, moe_comm_req_t *r)
{
    mpi_impl_t *m = c->impl;
    for (int i = 0; i < 2; i++)
        if (r->stage[i] >= 0) m->pool[r->stage[i]].busy = false;
    if (r->reqs != r->inline_reqs) free(r->reqs);
    if (r->peer != &r->inline_peer) free(r->peer);
    free(r->expect);
    free(r->back);
    free(r);
}

static void inflight_add(moe_comm_t *c, moe_comm_req_t *r)
{
    mpi_impl_t *m = c->impl;
    r->next = m->inflight;
    m->inflight = r;
}

static void inflight_remove(moe_comm_t *c, moe_comm_req_t *r)
{
    mpi_impl_t *m = c->impl;
    for (moe_comm_req_t **p = &m->inflight; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            return;
        }
}

static bool is_inflight(moe_comm_t *c, moe_comm_req_t *r)
{
    for (moe_comm_req_t *p = ((mpi_impl_t *)c->impl)->inflight; p; p = p->next)
        if (p == r) return true;
    return false;
}

/* A start that failed after some MPI requests were posted cannot take them back: the
 * communicator is dead from then on (the peers are told) and the request stays in flight
 * (leaked with it). */
static moe_status_t start_failed(moe_comm_t *c, moe_comm_req_t *r, moe_status_t st)
{
    bool posted = false;
    for (int i = 0; i < r->n; i++) posted |= r->reqs[i] != MPI_REQUEST_NULL;
    if (!posted) {
        req_free(c, r);
        return st;
    }
    inflight_add(c, r);
    char msg[640];
    snprintf(msg, sizeof msg, "%s", moe_last_error());
    return moe_comm_failed(c, st, "%s on the %s communicator (%s) failed half-started: %s", r->what,
                           c->name, c->members, msg);
}

/* Completion: check delivered byte counts, copy staged receives back to the device. */
static moe_status_t finish(moe_comm_t *c, moe_comm_req_t *r, MPI_Status *statuses)
{
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (r->expect) {
        for (int i = 0; i < r->nrecv; i++) {
            if (r->peer[i] < 0) continue;
            int got = 0;
            MPI_Get_count(&statuses[i], MPI_BYTE, &got);
            if ((size_t)got != r->expect[i]) {
                st = MOE_FAIL(MOE_STATUS_COMM_ERROR,
                              "alltoallv on the %s communicator (%s): world rank %d expected %zu "
                              "bytes from world rank %d and got %d; send and receive counts "
                              "disagree",
                              c->name, c->members, moe_comm_my_world_rank(c), r->expect[i],
                              c->world_ranks[r->peer[i]], got);
                break;
            }
        }
    }
    for (int i = 0; i < r->nback && st == MOE_STATUS_SUCCESS; i++)
        st = c->backend->ops->copy(c->backend->ctx, r->back[i].dst,
                                   (char *)pool_ptr(c, r->stage[1]) + r->back[i].src_off,
                                   r->back[i].bytes);
    inflight_remove(c, r);
    req_free(c, r);
    return st;
}

static moe_status_t mpi_test(moe_comm_t *c, moe_comm_req_t *r, bool *done)
{
    *done = false;
    MOE_CHECK_ARG(r != NULL && is_inflight(c, r),
                  "not an operation in flight on the %s communicator", c->name);
    MOE_TRY(moe_comm_check_live(c, r->what));
    const char *what = r->what;
    MPI_Status st_inline[2];
    MPI_Status *sts = r->n <= 2 ? st_inline : malloc((size_t)r->n * sizeof *sts);
    if (!sts) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "statuses");
    int flag = 0;
    int rc = moe_mpi_testall(r->n, r->reqs, &flag, sts);
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (rc != MPI_SUCCESS) {
        /* MPI_ERR_IN_STATUS: the request's own error says what happened */
        for (int i = 0; rc == MPI_ERR_IN_STATUS && i < r->n; i++)
            if (sts[i].MPI_ERROR != MPI_SUCCESS && sts[i].MPI_ERROR != MPI_ERR_PENDING)
                rc = sts[i].MPI_ERROR;
        st = moe_comm_failed(c, MOE_STATUS_COMM_ERROR, "%s on the %s communicator (%s): %s",
                             r->what, c->name, c->members, moe_mpi_describe(rc));
    } else if (flag) {
        *done = true;
        st = finish(c, r, sts);
    }
    if (sts != st_inline) free(sts);
    /* answer pings either way; a failure reported by another rank stops an operation that is
     * not done (one that is shows it on its next call) */
    if (st == MOE_STATUS_SUCCESS && !*done) return moe_comm_poll_watch(c, what);
    moe_comm_watch_poll(c->watch);
    return st;
}

/* The world ranks of the unfinished requests [lo, hi) of a transfer. */
static int unfinished(const moe_comm_t *c, moe_comm_req_t *r, int lo, int hi, int *late)
{
    int n = 0;
    for (int i = lo; i < hi; i++) {
        int flag = 0;
        if (r->peer[i] < 0 || r->reqs[i] == MPI_REQUEST_NULL) continue;
        MPI_Request_get_status(r->reqs[i], &flag, MPI_STATUS_IGNORE);
        if (!flag) late[n++] = c->world_ranks[r->peer[i]];
    }
    return n;
}

/* The world ranks a request still waits for: every other member for a collective; for an
 * alltoallv the peers whose rows have not arrived, or when they all have, those that have not
 * taken theirs (*sends set); the peer of a send or receive. */
static int late_ranks(const moe_comm_t *c, moe_comm_req_t *r, int *late, bool *sends)
{
    *sends = false;
    if (!r->peer) {
        int n = 0;
        for (int i = 0; i < c->size; i++)
            if (i != c->rank) late[n++] = c->world_ranks[i];
        return n;
    }
    if (!r->expect) return unfinished(c, r, 0, r->n, late);
    int n = unfinished(c, r, 0, r->nrecv, late);
    if (n == 0) {
        n = unfinished(c, r, r->nrecv, r->n, late);
        *sends = true;
    }
    return n;
}

/* late_ranks for the watch's answers, at most max of them. */
static int mpi_late(const moe_comm_t *c, moe_comm_req_t *r, int *late, int max)
{
    int *all = malloc(sizeof *all * (size_t)(c->size > r->n ? c->size : r->n));
    bool sends = false;
    int n = all ? late_ranks(c, r, all, &sends) : 0;
    if (n > max) n = max;
    if (n > 0) memcpy(late, all, sizeof *late * (size_t)n);
    free(all);
    return n;
}

static moe_status_t wait_until(moe_comm_t *c, moe_comm_req_t *r, int timeout_ms)
{
    double deadline = moe_now_ms() + timeout_ms;
    for (unsigned spin = 0;; spin++) {
        bool done = false;
        const char *what = r->what;
        MOE_TRY(mpi_test(c, r, &done));
        if (done) return MOE_STATUS_SUCCESS;
        if (moe_now_ms() > deadline) {
            int *late = malloc(sizeof *late * (size_t)(c->size > r->n ? c->size : r->n));
            bool sends = false;
            int nlate = late ? late_ranks(c, r, late, &sends) : 0;
            char detail[160] = "";
            if (r->expect && nlate > 0) { /* alltoallv: whose rows are missing */
                char ranks[128];
                moe_comm_format_ranks(ranks, sizeof ranks, late, nlate);
                if (sends)
                    snprintf(detail, sizeof detail, "%s %s not taken this rank's rows", ranks,
                             nlate == 1 ? "has" : "have");
                else
                    snprintf(detail, sizeof detail, "no rows yet from %s", ranks);
            }
            moe_status_t st = moe_comm_timed_out(c, what, timeout_ms, late, nlate, detail);
            free(late);
            return st;
        }
        moe_comm_backoff(spin);
    }
}

static moe_status_t mpi_wait(moe_comm_t *c, moe_comm_req_t *r, int timeout_ms)
{
    MOE_CHECK_ARG(r != NULL && is_inflight(c, r),
                  "not an operation in flight on the %s communicator", c->name);
    moe_comm_watch_waiting(c->watch, c, r, mpi_late);
    moe_status_t st = wait_until(c, r, timeout_ms);
    moe_comm_watch_waiting(c->watch, NULL, NULL, NULL);
    return st;
}

/* ---- operations ------------------------------------------------------------------------------ */

static moe_status_t check_count(moe_comm_t *c, const char *what, size_t count)
{
    if (count > (size_t)INT_MAX)
        return MOE_FAIL(MOE_STATUS_UNSUPPORTED,
                        "%s of %zu elements on the %s communicator exceeds MPI's int count (%d)",
                        what, count, c->name, INT_MAX);
    return MOE_STATUS_SUCCESS;
}

/* Stage a single-buffer operation through one pooled block: copy `in` into it first when
 * given, and copy it back to `out` when the operation completes when given. *d is then the
 * buffer MPI works on. */
static moe_status_t stage_one(moe_comm_t *c, moe_comm_req_t *r, size_t bytes, const void *in,
                              void *out, void **d)
{
    MOE_TRY(pool_get(c, bytes, &r->stage[1]));
    *d = pool_ptr(c, r->stage[1]);
    if (in) MOE_TRY(c->backend->ops->copy(c->backend->ctx, *d, in, bytes));
    if (out) {
        r->back = malloc(sizeof *r->back);
        if (!r->back) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "staging record");
        r->back[0] = (stage_back_t){out, 0, bytes};
        r->nback = 1;
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t mpi_allreduce(moe_comm_t *c, const void *send, void *recv, size_t count,
                                  moe_comm_dtype_t dt, moe_reduce_op_t op, moe_comm_req_t **out)
{
    MOE_TRY(moe_comm_check_live(c, "allreduce"));
    MOE_TRY(check_count(c, "allreduce", count));
    MOE_TRY(moe_comm_check_reduce_op(op));
    MOE_CHECK_ARG(mpi_type(dt) != MPI_DATATYPE_NULL, "unknown dtype %d", (int)dt);
    mpi_impl_t *m = c->impl;
    size_t bytes = count * moe_comm_dtype_size(dt);
    moe_comm_req_t *r;
    MOE_TRY(req_new(c, "allreduce", 1, false, false, &r));
    moe_status_t st = MOE_STATUS_SUCCESS;
    const void *s = send;
    void *d = recv;
    if (staged(c) && bytes) {
        MOE_TRY_GOTO(st, stage_one(c, r, bytes, send, recv, &d));
        s = d; /* reduce in place in the staging block */
    }
    MOE_MPI_CHECK_GOTO(st, MPI_Iallreduce(s == d ? MPI_IN_PLACE : s, d, (int)count, mpi_type(dt),
                                          mpi_op(m, dt, op), m->comm, &r->reqs[0]));
    inflight_add(c, r);
    *out = r;
    return MOE_STATUS_SUCCESS;
fail:
    return start_failed(c, r, st);
}

static moe_status_t mpi_broadcast(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                  int root, moe_comm_req_t **out)
{
    MOE_TRY(moe_comm_check_live(c, "broadcast"));
    MOE_TRY(check_count(c, "broadcast", count));
    MOE_TRY(moe_comm_check_root(c, root));
    MOE_CHECK_ARG(mpi_type(dt) != MPI_DATATYPE_NULL, "unknown dtype %d", (int)dt);
    mpi_impl_t *m = c->impl;
    size_t bytes = count * moe_comm_dtype_size(dt);
    moe_comm_req_t *r;
    MOE_TRY(req_new(c, "broadcast", 1, false, false, &r));
    moe_status_t st = MOE_STATUS_SUCCESS;
    void *d = buf;
    if (staged(c) && bytes) {
        bool root_rank = c->rank == root;
        MOE_TRY_GOTO(st,
                     stage_one(c, r, bytes, root_rank ? buf : NULL, root_rank ? NULL : buf, &d));
    }
    MOE_MPI_CHECK_GOTO(st, MPI_Ibcast(d, (int)count, mpi_type(dt), root, m->comm, &r->reqs[0]));
    inflight_add(c, r);
    *out = r;
    return MOE_STATUS_SUCCESS;
fail:
    return start_failed(c, r, st);
}

static moe_status_t mpi_alltoallv(moe_comm_t *c, const void *send, const size_t *send_counts,
                                  const size_t *send_displs, void *recv, const size_t *recv_counts,
                                  const size_t *recv_displs, moe_comm_dtype_t dt,
                                  moe_comm_req_t **out)
{
    MOE_TRY(moe_comm_check_live(c, "alltoallv"));
    MOE_TRY(moe_comm_check_alltoallv(send_counts, send_displs, recv_counts, recv_displs));
    MOE_CHECK_ARG(mpi_type(dt) != MPI_DATATYPE_NULL, "unknown dtype %d", (int)dt);
    mpi_impl_t *m = c->impl;
    size_t es = moe_comm_dtype_size(dt);
    int P = c->size, me = c->rank;
    size_t send_end = 0, recv_end = 0;
    for (int p = 0; p < P; p++) {
        MOE_TRY(check_count(c, "alltoallv", send_counts[p] * es));
        MOE_TRY(check_count(c, "alltoallv", recv_counts[p] * es));
        if (send_counts[p] && send_displs[p] + send_counts[p] > send_end)
            send_end = send_displs[p] + send_counts[p];
        if (recv_counts[p] && recv_displs[p] + recv_counts[p] > recv_end)
            recv_end = recv_displs[p] + recv_counts[p];
    }
    MOE_CHECK_ARG(send_counts[me] == recv_counts[me],
                  "alltoallv on the %s communicator: rank %d sends itself %zu elements but "
                  "expects %zu",
                  c->name, me, send_counts[me], recv_counts[me]);
    MOE_CHECK_ARG((send || !send_end) && (recv || !recv_end), "alltoallv: buffer is NULL");
    moe_comm_req_t *r = NULL;
    MOE_TRY(req_new(c, "alltoallv", 2 * (P - 1) > 0 ? 2 * (P - 1) : 1, true, false, &r));
    moe_status_t st = MOE_STATUS_SUCCESS;
    const char *s = send;
    char *d = recv;
    if (staged(c)) {
        if (send_end) {
            MOE_TRY_GOTO(st, pool_get(c, send_end * es, &r->stage[0]));
            s = pool_ptr(c, r->stage[0]);
            MOE_TRY_GOTO(st,
                         c->backend->ops->copy(c->backend->ctx, (void *)s, send, send_end * es));
        }
        if (recv_end) {
            MOE_TRY_GOTO(st, pool_get(c, recv_end * es, &r->stage[1]));
            d = pool_ptr(c, r->stage[1]);
            r->back = malloc((size_t)P * sizeof *r->back);
            if (!r->back) {
                st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "staging records");
                goto fail;
            }
            for (int p = 0; p < P; p++)
                if (recv_counts[p])
                    r->back[r->nback++] = (stage_back_t){(char *)recv + recv_displs[p] * es,
                                                         recv_displs[p] * es, recv_counts[p] * es};
        }
    }
    for (int i = 0; i < r->n; i++) r->peer[i] = -1;
    /* receives first (from ranks after me, wrapping), then sends; the own block is a copy */
    int k = 0;
    r->nrecv = P - 1;
    for (int j = 1; j < P; j++) {
        int p = (me + P - j) % P;
        r->peer[k] = p;
        r->expect[k] = recv_counts[p] * es;
        MOE_MPI_CHECK_GOTO(st, MPI_Irecv(d + recv_displs[p] * es, (int)(recv_counts[p] * es),
                                         MPI_BYTE, p, A2A_TAG, m->comm, &r->reqs[k]));
        k++;
    }
    for (int j = 1; j < P; j++) {
        int p = (me + j) % P;
        r->peer[k] = p;
        MOE_MPI_CHECK_GOTO(st, MPI_Isend(s + send_displs[p] * es, (int)(send_counts[p] * es),
                                         MPI_BYTE, p, A2A_TAG, m->comm, &r->reqs[k]));
        k++;
    }
    if (send_counts[me])
        memmove(d + recv_displs[me] * es, s + send_displs[me] * es, send_counts[me] * es);
    inflight_add(c, r);
    *out = r;
    return MOE_STATUS_SUCCESS;
fail:
    return start_failed(c, r, st);
}

static moe_status_t p2p(moe_comm_t *c, bool is_send, void *buf, size_t count, moe_comm_dtype_t dt,
                        int peer, int tag, moe_comm_req_t **out)
{
    const char *what = is_send ? "send" : "recv";
    MOE_TRY(moe_comm_check_live(c, what));
    MOE_TRY(check_count(c, what, count));
    MOE_TRY(moe_comm_check_peer_tag(c, what, peer, tag));
    MOE_CHECK_ARG(mpi_type(dt) != MPI_DATATYPE_NULL, "unknown dtype %d", (int)dt);
    mpi_impl_t *m = c->impl;
    size_t bytes = count * moe_comm_dtype_size(dt);
    moe_comm_req_t *r;
    MOE_TRY(req_new(c, what, 1, false, true, &r));
    r->peer[0] = peer;
    moe_status_t st = MOE_STATUS_SUCCESS;
    void *d = buf;
    if (staged(c) && bytes)
        MOE_TRY_GOTO(st, stage_one(c, r, bytes, is_send ? buf : NULL, is_send ? NULL : buf, &d));
    if (is_send)
        MOE_MPI_CHECK_GOTO(st,
                           MPI_Isend(d, (int)count, mpi_type(dt), peer, tag, m->comm, &r->reqs[0]));
    else
        MOE_MPI_CHECK_GOTO(st,
                           MPI_Irecv(d, (int)count, mpi_type(dt), peer, tag, m->comm, &r->reqs[0]));
    inflight_add(c, r);
    *out = r;
    return MOE_STATUS_SUCCESS;
fail:
    return start_failed(c, r, st);
}

static moe_status_t mpi_send(moe_comm_t *c, const void *buf, size_t count, moe_comm_dtype_t dt,
                             int peer, int tag, moe_comm_req_t **out)
{
    return p2p(c, true, (void *)buf, count, dt, peer, tag, out);
}

static moe_status_t mpi_recv(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt, int peer,
                             int tag, moe_comm_req_t **out)
{
    return p2p(c, false, buf, count, dt, peer, tag, out);
}

static moe_status_t mpi_barrier(moe_comm_t *c)
{
    MOE_TRY(moe_comm_check_live(c, "barrier"));
    mpi_impl_t *m = c->impl;
    moe_comm_req_t *r;
    MOE_TRY(req_new(c, "barrier", 1, false, false, &r));
    moe_status_t st = MOE_STATUS_SUCCESS;
    MOE_MPI_CHECK_GOTO(st, MPI_Ibarrier(m->comm, &r->reqs[0]));
    inflight_add(c, r);
    return mpi_wait(c, r, c->timeout_ms);
fail:
    return start_failed(c, r, st);
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

static void mpi_abort(moe_comm_t *c)
{
    if (moe_comm_mark_dead(c, "abort"))
        moe_log(c->logger, MOE_LOG_WARN, "comm: the %s communicator (%s) was aborted", c->name,
                c->members);
}

static void mpi_destroy(moe_comm_t *c)
{
    mpi_impl_t *m = c->impl;
    bool dead = moe_comm_is_dead(c);
    bool leak = m->inflight != NULL; /* MPI may still write into their staging blocks */
    if (leak)
        moe_log(c->logger, MOE_LOG_WARN,
                "comm: the %s communicator is destroyed with operations in flight; their "
                "buffers are leaked",
                c->name);
    for (moe_comm_req_t *r = m->inflight; r;) {
        moe_comm_req_t *next = r->next;
        if (!dead) {
            /* completed or not, nobody will wait for them: detach what is safe */
            for (int i = 0; i < r->n; i++)
                if (r->reqs[i] != MPI_REQUEST_NULL && r->peer) MPI_Request_free(&r->reqs[i]);
        }
        for (int i = 0; i < 2; i++)
            if (r->stage[i] >= 0) m->pool[r->stage[i]].p = NULL; /* leaked, see above */
        r->stage[0] = r->stage[1] = -1;
        req_free(c, r);
        r = next;
    }
    for (int i = 0; i < m->npool; i++)
        if (m->pool[i].p) c->backend->ops->free_pinned(c->backend->ctx, m->pool[i].p);
    free(m->pool);
    int finalized = 0;
    MPI_Finalized(&finalized);
    /* a dead communicator's world cannot finish anything: no more MPI calls on it */
    if (!finalized && !dead) {
        for (int i = 0; i < 3; i++)
            if (m->bf16_op[i] != MPI_OP_NULL) MPI_Op_free(&m->bf16_op[i]);
        /* a collective that never completed would be progressed on a freed communicator
         * (Open MPI's libnbc crashes in MPI_Finalize): leak the communicator with it */
        if (m->comm != MPI_COMM_NULL && !leak) MPI_Comm_free(&m->comm);
    }
    free(c->world_ranks);
    free(m);
    free(c);
}

static moe_status_t mpi_split(moe_comm_t *c, int color, int key, const char *name,
                              moe_comm_t **out);

static const moe_comm_ops_t mpi_ops = {
    .name = "mpi",
    .allreduce = mpi_allreduce,
    .broadcast = mpi_broadcast,
    .alltoallv = mpi_alltoallv,
    .send = mpi_send,
    .recv = mpi_recv,
    .wait = mpi_wait,
    .test = mpi_test,
    .barrier = mpi_barrier,
    .split = mpi_split,
    .abort = mpi_abort,
    .destroy = mpi_destroy,
};

/* Wrap an MPI communicator we own (errors set to return); `watch` is the parent's. */
static moe_status_t wrap(MPI_Comm comm, int *world_ranks, const char *name, int timeout_ms,
                         const moe_backend_t *backend, bool device_buffers,
                         const moe_logger_t *logger, moe_comm_watch_t *watch, moe_comm_t **out)
{
    moe_comm_t *c = calloc(1, sizeof *c);
    mpi_impl_t *m = calloc(1, sizeof *m);
    if (!c || !m) {
        free(c);
        free(m);
        free(world_ranks);
        MPI_Comm_free(&comm);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "communicator");
    }
    c->ops = &mpi_ops;
    c->impl = m;
    m->comm = comm;
    c->world_ranks = world_ranks;
    c->watch = watch;
    for (int i = 0; i < 3; i++) m->bf16_op[i] = MPI_OP_NULL;
    MPI_Comm_rank(comm, &c->rank);
    MPI_Comm_size(comm, &c->size);
    snprintf(c->name, sizeof c->name, "%s", name ? name : "?");
    c->timeout_ms = timeout_ms;
    c->backend = backend;
    c->device_buffers = device_buffers;
    c->logger = logger;
    moe_comm_describe_members(c);
    moe_status_t st = MOE_STATUS_SUCCESS;
    MOE_MPI_CHECK_GOTO(st, MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    MOE_MPI_CHECK_GOTO(st, MPI_Op_create(bf16_sum, 1, &m->bf16_op[0]));
    MOE_MPI_CHECK_GOTO(st, MPI_Op_create(bf16_max, 1, &m->bf16_op[1]));
    MOE_MPI_CHECK_GOTO(st, MPI_Op_create(bf16_min, 1, &m->bf16_op[2]));
    *out = c;
    return MOE_STATUS_SUCCESS;
fail:
    mpi_destroy(c);
    return st;
}

/* The communicator a caller names (NULL: MPI_COMM_WORLD); MPI_COMM_NULL, what a rank left out
 * of a split holds, is refused before MPI's fatal error handler sees it. */
static moe_status_t parent_of(const void *mpi_comm, MPI_Comm *out)
{
    *out = mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD;
    if (*out == MPI_COMM_NULL)
        return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                        "mpi_comm is MPI_COMM_NULL: this rank is not in the communicator");
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_mpi_watch(moe_comm_t *world, moe_comm_watch_t **out)
{
    *out = NULL;
    MOE_CHECK_ARG(world && world->ops == &mpi_ops && !world->device_buffers,
                  "the watch needs an MPI communicator on host buffers");
    const mpi_impl_t *m = world->impl;
    MOE_TRY(moe_comm_watch_create(&m->comm, world->rank, world->size, world->timeout_ms,
                                  world->logger, out));
    world->watch = *out;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_mpi_create(const void *mpi_comm, const char *name, int timeout_ms,
                                 const moe_backend_t *backend, const moe_logger_t *logger,
                                 moe_comm_t **out)
{
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(timeout_ms > 0, "timeout_ms is %d; it must be > 0", timeout_ms);
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (!inited || finalized)
        return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "MPI is %s",
                        finalized ? "already finalised" : "not initialised");
    MPI_Comm parent, comm;
    MOE_TRY(parent_of(mpi_comm, &parent));
    MOE_TRY(moe_mpi_dup_within(parent, timeout_ms, &comm));
    int size = 0;
    MPI_Comm_size(comm, &size);
    int *ranks = malloc((size_t)size * sizeof *ranks);
    if (!ranks) {
        MPI_Comm_free(&comm);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "rank table");
    }
    for (int i = 0; i < size; i++) ranks[i] = i;
    bool dev = backend && backend->ops->device != MOE_DEVICE_HOST;
    return wrap(comm, ranks, name, timeout_ms, backend, dev, logger, NULL, out);
}

/* Split: an Iallgather of (color, key) under the deadline proves every member is present
 * before the blocking MPI_Comm_split, so a dead peer times out here instead of hanging. */
static moe_status_t mpi_split(moe_comm_t *c, int color, int key, const char *name, moe_comm_t **out)
{
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_TRY(moe_comm_check_live(c, "split"));
    MOE_CHECK_ARG(color >= 0, "split color %d must be >= 0", color);
    mpi_impl_t *m = c->impl;
    /* this rank's (color, key), then everyone's: on the heap, because after a timeout MPI may
     * still read the one and write the other (both are leaked then) */
    int *mine = malloc(((size_t)c->size + 1) * 2 * sizeof *mine), *all = mine ? mine + 2 : NULL;
    int *ranks = malloc((size_t)c->size * sizeof *ranks);
    moe_comm_req_t *r = NULL;
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!mine || !ranks) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "split tables");
        goto fail;
    }
    mine[0] = color;
    mine[1] = key;
    MOE_TRY_GOTO(st, req_new(c, "split", 1, false, false, &r));
    {
        int rc = MPI_Iallgather(mine, 2, MPI_INT, all, 2, MPI_INT, m->comm, &r->reqs[0]);
        if (rc != MPI_SUCCESS) {
            st = MOE_FAIL(MOE_STATUS_COMM_ERROR, "MPI_Iallgather in split of %s: %s", c->name,
                          moe_mpi_describe(rc));
            req_free(c, r);
            goto fail;
        }
    }
    inflight_add(c, r);
    st = mpi_wait(c, r, c->timeout_ms);
    if (st != MOE_STATUS_SUCCESS) {
        mine = NULL; /* still MPI's: leaked */
        goto fail;
    }
    /* members in MPI_Comm_split's order: by key, then by rank in the parent */
    int n = 0;
    for (int i = 0; i < c->size; i++) {
        if (all[2 * i] != color) continue;
        int j = n++;
        while (j > 0 && all[2 * (ranks[j - 1]) + 1] > all[2 * i + 1]) {
            ranks[j] = ranks[j - 1];
            j--;
        }
        ranks[j] = i;
    }
    for (int i = 0; i < n; i++) ranks[i] = c->world_ranks[ranks[i]];
    MPI_Comm nc;
    {
        int rc = MPI_Comm_split(m->comm, color, key, &nc);
        if (rc != MPI_SUCCESS) {
            st = MOE_FAIL(MOE_STATUS_COMM_ERROR, "MPI_Comm_split of %s: %s", c->name,
                          moe_mpi_describe(rc));
            goto fail;
        }
    }
    st = wrap(nc, ranks, name, c->timeout_ms, c->backend, c->device_buffers, c->logger, c->watch,
              out);
    ranks = NULL; /* owned by the new communicator (or freed by wrap) */
fail:
    free(mine);
    free(ranks);
    return st;
}

bool moe_comm_have_mpi(void) { return true; }

/* ---- process-wide MPI state ----------------------------------------------------------------- */

static atomic_int mpi_users; /* acquires not yet released */
static atomic_bool mpi_ours; /* libmoe called MPI_Init */
static atomic_bool mpi_lost; /* a mesh lost a peer: MPI_Finalize could never return */

moe_status_t moe_comm_mpi_acquire(void)
{
    int inited = 0, finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized)
        return MOE_FAIL(MOE_STATUS_UNSUPPORTED,
                        "MPI was already finalised (it cannot be initialised twice); initialise "
                        "MPI in the program to create meshes after libmoe finalised it");
    MPI_Initialized(&inited);
    if (!inited) {
        int provided = 0;
        MOE_MPI_CHECK(MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided));
        atomic_store(&mpi_ours, true);
    }
    atomic_fetch_add(&mpi_users, 1);
    return MOE_STATUS_SUCCESS;
}

void moe_comm_mpi_release(void)
{
    if (atomic_fetch_sub(&mpi_users, 1) == 1 && !atomic_load(&mpi_lost) &&
        atomic_exchange(&mpi_ours, false)) {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Finalize();
    }
}

void moe_comm_mpi_abandon(void)
{
    atomic_store(&mpi_lost, true);
    atomic_fetch_sub(&mpi_users, 1);
}

bool moe_comm_mpi_release_finalizes(void)
{
    return atomic_load(&mpi_users) == 1 && atomic_load(&mpi_ours) && !atomic_load(&mpi_lost);
}

bool moe_comm_mpi_ready(void)
{
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    return inited && !finalized;
}

bool moe_comm_mpi_threads_ok(void)
{
    int provided = MPI_THREAD_SINGLE;
    if (!moe_comm_mpi_ready() || MPI_Query_thread(&provided) != MPI_SUCCESS) return false;
    return provided >= MPI_THREAD_FUNNELED;
}

moe_status_t moe_comm_mpi_rank_size(const void *mpi_comm, int *rank, int *size)
{
    MPI_Comm c;
    MOE_TRY(parent_of(mpi_comm, &c));
    MOE_MPI_CHECK(MPI_Comm_rank(c, rank));
    MOE_MPI_CHECK(MPI_Comm_size(c, size));
    return MOE_STATUS_SUCCESS;
}
