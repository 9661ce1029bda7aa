/* The in-process communicator of thread_comm.h. */
#include "thread_comm.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/error.h"

struct moe_comm_req {
    struct moe_comm_req *next;  /* in the world's pending list */
    struct moe_comm_req *qnext; /* ordered mode: in its rank's queue */
    bool is_send, done, matched_list;
    int src, dst, tag;
    void *buf;
    size_t bytes;
};

#define TC_MAX 16

struct tc_world {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int size;
    moe_comm_req_t *pending; /* unmatched sends and receives, in posting order */
    bool ordered;            /* NCCL-like: no tags, each rank's operations in call order */
    moe_comm_req_t *qhead[TC_MAX], *qtail[TC_MAX];
    /* collectives */
    unsigned long generation;
    int arrived;
    int leaving; /* ranks still to read the previous collective's result */
    double acc_f64[256];
    int64_t acc_i64[256];
    unsigned char bcast[256];
};

typedef struct tc_impl {
    tc_world_t *w;
    bool aborted;
} tc_impl_t;

tc_world_t *tc_world_create_ordered(int size)
{
    tc_world_t *w = tc_world_create(size);
    w->ordered = true;
    return w;
}

tc_world_t *tc_world_create(int size)
{
    tc_world_t *w = calloc(1, sizeof *w);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->size = size;
    return w;
}

void tc_world_destroy(tc_world_t *w)
{
    if (!w) return;
    while (w->pending) {
        moe_comm_req_t *r = w->pending;
        w->pending = r->next;
        free(r);
    }
    for (int i = 0; i < TC_MAX; i++)
        while (w->qhead[i]) { /* ordered mode: operations never completed */
            moe_comm_req_t *r = w->qhead[i];
            w->qhead[i] = r->qnext;
            if (!r->done) free(r);
        }
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

static struct timespec deadline_after(int ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* Match `r` against the earliest opposite request of the same (src, dst, tag); lock held. */
static void try_match(tc_world_t *w, moe_comm_req_t *r)
{
    moe_comm_req_t **pp = &w->pending;
    for (; *pp; pp = &(*pp)->next) {
        moe_comm_req_t *o = *pp;
        if (o->is_send != r->is_send && o->src == r->src && o->dst == r->dst && o->tag == r->tag) {
            moe_comm_req_t *s = r->is_send ? r : o, *d = r->is_send ? o : r;
            memcpy(d->buf, s->buf, s->bytes < d->bytes ? s->bytes : d->bytes);
            s->done = d->done = true;
            *pp = o->next;
            o->matched_list = false;
            pthread_cond_broadcast(&w->cv);
            return;
        }
    }
    r->next = NULL;
    *pp = r; /* append: posting order */
    r->matched_list = true;
}

/* Ordered mode: complete heads of rank queues that are each other's partners; lock held.
 * A completed request leaves its queue (the waiter frees it). */
static void ordered_progress(tc_world_t *w)
{
    bool changed = true;
    while (changed) {
        changed = false;
        for (int r = 0; r < w->size; r++) {
            moe_comm_req_t *h = w->qhead[r];
            if (!h) continue;
            int q = h->is_send ? h->dst : h->src;
            moe_comm_req_t *o = w->qhead[q];
            if (!o || o->is_send == h->is_send || o->src != h->src || o->dst != h->dst) continue;
            moe_comm_req_t *snd = h->is_send ? h : o, *rcv = h->is_send ? o : h;
            memcpy(rcv->buf, snd->buf, snd->bytes < rcv->bytes ? snd->bytes : rcv->bytes);
            w->qhead[r] = h->qnext;
            if (!w->qhead[r]) w->qtail[r] = NULL;
            w->qhead[q] = o->qnext;
            if (!w->qhead[q]) w->qtail[q] = NULL;
            h->done = o->done = true;
            changed = true;
        }
    }
    pthread_cond_broadcast(&w->cv);
}

static moe_status_t p2p(moe_comm_t *c, bool is_send, void *buf, size_t count, moe_comm_dtype_t dt,
                        int peer, int tag, moe_comm_req_t **req)
{
    tc_impl_t *im = c->impl;
    if (im->aborted) return MOE_FAIL(MOE_STATUS_COMM_ERROR, "%s: communicator aborted", c->name);
    if (peer < 0 || peer >= c->size || peer == c->rank)
        return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "%s: bad peer %d", c->name, peer);
    moe_comm_req_t *r = calloc(1, sizeof *r);
    r->is_send = is_send;
    r->src = is_send ? c->rank : peer;
    r->dst = is_send ? peer : c->rank;
    r->tag = tag;
    r->buf = buf;
    r->bytes = count * moe_comm_dtype_size(dt);
    pthread_mutex_lock(&im->w->mu);
    if (im->w->ordered) { /* append to this rank's queue: it runs in call order, tag ignored */
        tc_world_t *w = im->w;
        if (w->qtail[c->rank])
            w->qtail[c->rank]->qnext = r;
        else
            w->qhead[c->rank] = r;
        w->qtail[c->rank] = r;
        ordered_progress(w);
    } else {
        try_match(im->w, r);
    }
    pthread_mutex_unlock(&im->w->mu);
    *req = r;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t tc_send(moe_comm_t *c, const void *buf, size_t count, moe_comm_dtype_t dt,
                            int peer, int tag, moe_comm_req_t **req)
{
    return p2p(c, true, (void *)buf, count, dt, peer, tag, req);
}

static moe_status_t tc_recv(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt, int peer,
                            int tag, moe_comm_req_t **req)
{
    return p2p(c, false, buf, count, dt, peer, tag, req);
}

static void unlink_req(tc_world_t *w, moe_comm_req_t *r)
{
    for (moe_comm_req_t **pp = &w->pending; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            return;
        }
}

static moe_status_t tc_wait(moe_comm_t *c, moe_comm_req_t *r, int timeout_ms)
{
    tc_impl_t *im = c->impl;
    tc_world_t *w = im->w;
    struct timespec dl = deadline_after(timeout_ms);
    pthread_mutex_lock(&w->mu);
    int rc = 0;
    while (!r->done && !im->aborted && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&w->cv, &w->mu, &dl);
    bool done = r->done;
    if (!done && !w->ordered) unlink_req(w, r);
    pthread_mutex_unlock(&w->mu);
    if (done || !w->ordered) free(r); /* a stuck ordered operation stays in its queue */
    if (done) return MOE_STATUS_SUCCESS;
    if (im->aborted) return MOE_FAIL(MOE_STATUS_COMM_ERROR, "%s: communicator aborted", c->name);
    return MOE_FAIL(MOE_STATUS_TIMEOUT, "%s rank %d: no peer within %d ms", c->name, c->rank,
                    timeout_ms);
}

static moe_status_t tc_test(moe_comm_t *c, moe_comm_req_t *r, bool *done)
{
    tc_impl_t *im = c->impl;
    pthread_mutex_lock(&im->w->mu);
    *done = r->done;
    pthread_mutex_unlock(&im->w->mu);
    if (*done) free(r);
    return im->aborted && !*done ? MOE_FAIL(MOE_STATUS_COMM_ERROR, "%s: aborted", c->name)
                                 : MOE_STATUS_SUCCESS;
}

/* Blocking rendezvous of every rank: `deposit` runs on arrival, `collect` after the last one
 * arrived; both under the lock. */
static moe_status_t rendezvous(moe_comm_t *c, void (*deposit)(tc_world_t *, void *),
                               void (*collect)(tc_world_t *, void *), void *arg)
{
    tc_impl_t *im = c->impl;
    tc_world_t *w = im->w;
    if (im->aborted) return MOE_FAIL(MOE_STATUS_COMM_ERROR, "%s: communicator aborted", c->name);
    struct timespec dl = deadline_after(c->timeout_ms);
    pthread_mutex_lock(&w->mu);
    while (w->leaving > 0) pthread_cond_wait(&w->cv, &w->mu);
    if (w->arrived == 0) {
        memset(w->acc_f64, 0, sizeof w->acc_f64);
        memset(w->acc_i64, 0, sizeof w->acc_i64);
    }
    if (deposit) deposit(w, arg);
    unsigned long gen = w->generation;
    int rc = 0;
    if (++w->arrived == w->size) {
        w->arrived = 0;
        w->leaving = w->size;
        w->generation++;
        pthread_cond_broadcast(&w->cv);
    } else {
        while (w->generation == gen && rc != ETIMEDOUT)
            rc = pthread_cond_timedwait(&w->cv, &w->mu, &dl);
    }
    /* everyone reads the result before anyone can deposit into the next collective */
    bool ok = w->generation != gen;
    if (ok) {
        if (collect) collect(w, arg);
        if (--w->leaving == 0) pthread_cond_broadcast(&w->cv);
    } else {
        w->arrived--; /* withdraw: this rank gives up on the collective */
    }
    pthread_mutex_unlock(&w->mu);
    if (!ok)
        return MOE_FAIL(MOE_STATUS_TIMEOUT, "%s rank %d: collective timed out after %d ms", c->name,
                        c->rank, c->timeout_ms);
    return MOE_STATUS_SUCCESS;
}

typedef struct ar_arg {
    const void *send;
    void *recv;
    size_t count;
    moe_comm_dtype_t dt;
    moe_reduce_op_t op;
    int rank, root;
    bool first;
} ar_arg_t;

static double load_f(const ar_arg_t *a, size_t i)
{
    switch (a->dt) {
    case MOE_COMM_F32: return ((const float *)a->send)[i];
    case MOE_COMM_F64: return ((const double *)a->send)[i];
    default: return 0;
    }
}

static void ar_deposit(tc_world_t *w, void *p)
{
    ar_arg_t *a = p;
    bool first = w->arrived == 0;
    for (size_t i = 0; i < a->count; i++) {
        if (a->dt == MOE_COMM_I32 || a->dt == MOE_COMM_I64) {
            int64_t v = a->dt == MOE_COMM_I32 ? ((const int32_t *)a->send)[i]
                                              : ((const int64_t *)a->send)[i];
            int64_t *acc = &w->acc_i64[i];
            if (first)
                *acc = v;
            else if (a->op == MOE_REDUCE_SUM)
                *acc += v;
            else if (a->op == MOE_REDUCE_MAX)
                *acc = v > *acc ? v : *acc;
            else
                *acc = v < *acc ? v : *acc;
        } else {
            double v = load_f(a, i), *acc = &w->acc_f64[i];
            if (first)
                *acc = v;
            else if (a->op == MOE_REDUCE_SUM)
                *acc += v;
            else if (a->op == MOE_REDUCE_MAX)
                *acc = v > *acc ? v : *acc;
            else
                *acc = v < *acc ? v : *acc;
        }
    }
}

static void ar_collect(tc_world_t *w, void *p)
{
    ar_arg_t *a = p;
    for (size_t i = 0; i < a->count; i++) {
        switch (a->dt) {
        case MOE_COMM_I32: ((int32_t *)a->recv)[i] = (int32_t)w->acc_i64[i]; break;
        case MOE_COMM_I64: ((int64_t *)a->recv)[i] = w->acc_i64[i]; break;
        case MOE_COMM_F32: ((float *)a->recv)[i] = (float)w->acc_f64[i]; break;
        case MOE_COMM_F64: ((double *)a->recv)[i] = w->acc_f64[i]; break;
        default: break;
        }
    }
}

static moe_status_t done_req(moe_comm_req_t **req)
{
    *req = calloc(1, sizeof **req);
    (*req)->done = true;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t tc_allreduce(moe_comm_t *c, const void *send, void *recv, size_t count,
                                 moe_comm_dtype_t dt, moe_reduce_op_t op, moe_comm_req_t **req)
{
    if (count > 256 || dt == MOE_COMM_BF16 || dt == MOE_COMM_U8)
        return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "test allreduce: %zu elements of dtype %d", count,
                        (int)dt);
    /* copy the input first: send may alias recv */
    unsigned char tmp[256 * 8];
    memcpy(tmp, send, count * moe_comm_dtype_size(dt));
    ar_arg_t a = {.send = tmp, .recv = recv, .count = count, .dt = dt, .op = op};
    MOE_TRY(rendezvous(c, ar_deposit, ar_collect, &a));
    return done_req(req);
}

static void bc_deposit(tc_world_t *w, void *p)
{
    ar_arg_t *a = p;
    if (a->rank == a->root) memcpy(w->bcast, a->send, a->count);
}

static void bc_collect(tc_world_t *w, void *p)
{
    ar_arg_t *a = p;
    if (a->rank != a->root) memcpy(a->recv, w->bcast, a->count);
}

static moe_status_t tc_broadcast(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                 int root, moe_comm_req_t **req)
{
    size_t bytes = count * moe_comm_dtype_size(dt);
    if (bytes > sizeof((tc_world_t *)0)->bcast)
        return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "test broadcast of %zu bytes", bytes);
    ar_arg_t a = {.send = buf, .recv = buf, .count = bytes, .rank = c->rank, .root = root};
    MOE_TRY(rendezvous(c, bc_deposit, bc_collect, &a));
    return done_req(req);
}

static moe_status_t tc_barrier(moe_comm_t *c) { return rendezvous(c, NULL, NULL, NULL); }

static moe_status_t tc_alltoallv(moe_comm_t *c, const void *s, const size_t *sc, const size_t *sd,
                                 void *r, const size_t *rc, const size_t *rd, moe_comm_dtype_t dt,
                                 moe_comm_req_t **req)
{
    (void)s, (void)sc, (void)sd, (void)r, (void)rc, (void)rd, (void)dt, (void)req;
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "%s: test communicator has no alltoallv", c->name);
}

static moe_status_t tc_split(moe_comm_t *c, int color, int key, const char *name, moe_comm_t **out)
{
    (void)color, (void)key, (void)name, (void)out;
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "%s: test communicator has no split", c->name);
}

static void tc_abort(moe_comm_t *c)
{
    tc_impl_t *im = c->impl;
    pthread_mutex_lock(&im->w->mu);
    im->aborted = true;
    pthread_cond_broadcast(&im->w->cv);
    pthread_mutex_unlock(&im->w->mu);
}

static void tc_destroy(moe_comm_t *c)
{
    free(c->impl);
    free(c);
}

static const moe_comm_ops_t tc_ops = {
    .name = "thread",
    .allreduce = tc_allreduce,
    .broadcast = tc_broadcast,
    .alltoallv = tc_alltoallv,
    .send = tc_send,
    .recv = tc_recv,
    .wait = tc_wait,
    .test = tc_test,
    .barrier = tc_barrier,
    .split = tc_split,
    .abort = tc_abort,
    .destroy = tc_destroy,
};

moe_comm_t *tc_comm_create(tc_world_t *w, int rank, const char *name, int timeout_ms)
{
    moe_comm_t *c = calloc(1, sizeof *c);
    tc_impl_t *im = calloc(1, sizeof *im);
    im->w = w;
    c->ops = &tc_ops;
    c->impl = im;
    c->rank = rank;
    c->size = w->size;
    strncpy(c->name, name, sizeof c->name - 1);
    c->timeout_ms = timeout_ms;
    return c;
}

void tc_attach_pipeline(moe_runtime_t *rt, int stage, int stages, moe_comm_t *pp, moe_comm_t *world)
{
    moe_mesh_t *m = rt->mesh;
    m->size[MOE_AXIS_PP] = stages;
    m->coord[MOE_AXIS_PP] = stage;
    m->world_size = stages;
    m->world_rank = stage;
    if (stages == 1) { /* a world of one has no communicators */
        moe_comm_destroy(pp);
        moe_comm_destroy(world);
        pp = world = NULL;
    }
    m->comm[MOE_AXIS_PP] = pp;
    m->comm[MOE_AXIS_WORLD] = world;
}

void tc_detach_pipeline(moe_runtime_t *rt)
{
    moe_mesh_t *m = rt->mesh;
    moe_comm_destroy(m->comm[MOE_AXIS_PP]);
    moe_comm_destroy(m->comm[MOE_AXIS_WORLD]);
    m->comm[MOE_AXIS_PP] = m->comm[MOE_AXIS_WORLD] = NULL;
    m->size[MOE_AXIS_PP] = 1;
    m->coord[MOE_AXIS_PP] = 0;
    m->world_size = 1;
    m->world_rank = 0;
}
