/*
 * The distributed MoE layer: expert-parallel dispatch and combine, tensor-parallel experts,
 * and the global routing statistics (see expert_parallel.h for when it runs, docs/mesh.md
 * for the schedule and the collective ordering rule).
 *
 * Shapes: N tokens on this rank, Nt tokens in the dense group (the global batch), H hidden,
 * E experts, El = E/ep local experts, K top-k, Fl = F/tp, P = ep.
 *
 * Forward, per microbatch:
 *   0. inputs     with tp > 1, the tp ranks check they were fed the same tokens (their
 *                 count; with MOE_CHECK_TP_INPUTS=1 also a hash of them), since the
 *                 all-reduces over tp sum slices of the same rows
 *   1. router (local tokens) -> counts, score means, z/entropy to the host
 *   2. exchange   one all-reduce over the dense group of a table [D, 3+2E] (f64): every
 *                 rank's N, counts, N*P_e, N*z, N*entropy -> global counts, capacity
 *                 C = min(ceil(cf*Nt*K/E), Nt*K), this rank's prefix per expert (ranks
 *                 before it in the concatenated order), global P / z / entropy; aux from
 *                 P and f (the global counts, or the window's: moe_routing_aux_freq)
 *   3. plan       the backend's: keep slot (t,k) of expert e iff prefix_e + (earlier
 *                 selections of e here) < C; rows sorted by (owner rank, local expert, slot)
 *                 -> row_of_slot, slot_of_row; kept counts to the host -> rows per ep peer
 *   4. counts     all-to-all over ep of El row counts per peer -> rows from each peer per
 *                 local expert; with tp > 1 the tp ranks compare them (they differ when the
 *                 tp ranks were fed different tokens)
 *   5. pipeline   rows are split per peer block into `a2a_chunks` chunks; chunk c+1's
 *                 all-to-all is in flight while the experts compute chunk c (non-blocking
 *                 communicator calls; on the host backend MPI is polled between slices so
 *                 it progresses), each computed slice is all-reduced over tp (W2 is row
 *                 parallel), and its rows start back (combine all-to-all of chunk c)
 *   6. unpermute  y[t] = sum_k w[t,k] * back[row(t,k)]   (backend combine, deterministic)
 * Backward mirrors it: d_w and the weighted d_rows from dy, the same pipeline with the
 * experts' backward (d_xp all-reduced over tp: W1 is column parallel), dx by un-gather,
 * router backward with the global aux/z gradient scale.
 */
#include "expert_parallel.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"
#include "device_buffer.h"
#include "routing.h"

typedef struct moe_dist {
    moe_comm_t *ep, *tp;            /* data (device buffers); NULL when the axis is 1 */
    moe_comm_t *hep, *htp, *hdense; /* host control */
    bool hash_tp_inputs;            /* MOE_CHECK_TP_INPUTS=1: compare the tokens' hash too */
    int32_t P, D, dense_rank;
    moe_comm_dtype_t act_dt;
    size_t act;                  /* bytes per activation element */
    int32_t *group;              /* [E] expert -> owner * El + local (row order) */
    int32_t *row_order;          /* device i32 [E]: the inverse, the plan's row_order */
    int32_t *first, *host_first; /* device and host i32 [E]: the plan's first */
    bool worker_thread;          /* host backend: experts on a thread while MPI progresses */
    moe_dist_timing_t timing;
} moe_dist_t;

typedef struct moe_dist_slot {
    int64_t rows_send, rows_recv; /* token-side rows, expert-side rows */
    int64_t *sc, *sd, *rc, *rd;   /* [P] rows to / from each ep peer and their offsets */
    int64_t *cnt;                 /* [P, El] rows from peer q for local expert le */
    float aux_scale, z_scale;     /* router backward coefficient factors (N/Nt)^2, N/Nt */
    void *back;                   /* act [Rs,H] expert outputs back on the token side */
    void *xr, *hpre, *act;        /* act [Rr,H], [Rr,2,Fl], [Rr,Fl] expert side, saved */
} moe_dist_slot_t;

/* ---- create / destroy ---------------------------------------------------------------------- */

moe_status_t moe_dist_create(moe_layer_t *l)
{
    moe_mesh_t *m = l->rt->mesh;
    int32_t D = moe_mesh_group_size(m, MOE_MESH_DENSE);
    if (l->ep_size == 1 && l->tp_size == 1 && D == 1) return MOE_STATUS_SUCCESS;
    moe_dist_t *d = calloc(1, sizeof *d);
    if (!d) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "distributed layer state");
    d->ep = m->comm[MOE_AXIS_EP];
    d->tp = m->comm[MOE_AXIS_TP];
    d->hep = m->host[MOE_AXIS_EP];
    d->htp = m->host[MOE_AXIS_TP];
    d->hdense = m->host[MOE_MESH_DENSE];
    d->hash_tp_inputs = moe_env_flag(MOE_ENV_CHECK_TP_INPUTS, false, &l->rt->logger);
    d->P = l->ep_size;
    d->D = D;
    d->dense_rank = m->coord[MOE_AXIS_EP] + m->size[MOE_AXIS_EP] * m->coord[MOE_AXIS_DP];
    moe_dtype_t cd = MOE_OPS(l->rt)->compute_dtype;
    d->act_dt = cd == MOE_DTYPE_BF16 ? MOE_COMM_BF16 : MOE_COMM_F32;
    d->act = moe_dtype_size(cd);
    d->group = malloc(sizeof(int32_t) * (size_t)l->e);
    if (!d->group) {
        free(d);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "expert map");
    }
    l->dist = d; /* from here on moe_dist_destroy frees what was made */
    d->host_first = malloc(sizeof(int32_t) * (size_t)l->e);
    if (!d->host_first) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "expert map");
    for (int32_t e = 0; e < l->e; e++) {
        int32_t owner = l->cfg.placement == MOE_PLACEMENT_CONTIGUOUS ? e / l->el : e % d->P;
        int32_t local = l->cfg.placement == MOE_PLACEMENT_CONTIGUOUS ? e % l->el : e / d->P;
        d->group[e] = owner * l->el + local;
        d->host_first[d->group[e]] = e; /* the inverse map, on its way to the device */
    }
    size_t bytes = sizeof(int32_t) * (size_t)l->e;
    MOE_TRY(moe_layer_alloc_dev(l->rt, bytes, &d->row_order));
    MOE_TRY(moe_layer_alloc_dev(l->rt, bytes, &d->first));
    MOE_TRY(MOE_OPS(l->rt)->copy(MOE_CTX(l->rt), d->row_order, d->host_first, bytes));
    /* The host worker thread: on when MPI allows other threads (MPI_THREAD_FUNNELED or
     * more; libmoe's own MPI_Init asks for SERIALIZED); MOE_A2A_THREAD=1 / 0 forces it. */
    bool want = moe_env_flag(MOE_ENV_A2A_THREAD, moe_comm_mpi_threads_ok(), &l->rt->logger);
    d->worker_thread = want && MOE_OPS(l->rt)->device == MOE_DEVICE_HOST && d->ep &&
                       l->cfg.a2a_chunks > 1;
    return MOE_STATUS_SUCCESS;
}

void moe_dist_destroy(moe_layer_t *l)
{
    if (!l->dist) return;
    moe_dist_t *d = l->dist;
    moe_layer_free_dev(l->rt, &d->row_order);
    moe_layer_free_dev(l->rt, &d->first);
    free(d->host_first);
    free(d->group);
    free(d);
    l->dist = NULL;
}

void moe_dist_slot_free(moe_layer_t *l, moe_slot_t *s)
{
    moe_dist_slot_t *ds = s->dist;
    if (!ds) return;
    free(ds->sc);
    moe_layer_free_comm_host(l->rt, ds->cnt); /* the counts all-to-all's receive buffer */
    moe_layer_free_dev(l->rt, &ds->back);
    moe_layer_free_dev(l->rt, &ds->xr);
    moe_layer_free_dev(l->rt, &ds->hpre);
    moe_layer_free_dev(l->rt, &ds->act);
    free(ds);
    s->dist = NULL;
}

void moe_dist_timing(const moe_layer_t *l, moe_dist_timing_t *out)
{
    memset(out, 0, sizeof *out);
    if (l->dist) *out = l->dist->timing;
}

void moe_dist_timing_reset(moe_layer_t *l)
{
    if (l->dist) memset(&l->dist->timing, 0, sizeof l->dist->timing);
}

/* ---- the chunked all-to-all pipeline ------------------------------------------------------- */

/* Chunk c of a block of n rows: [n*c/C, n*(c+1)/C), computed the same way on both sides. */
static int64_t chunk_lo(int64_t n, int c, int C) { return n * c / C; }

typedef struct a2a_op {
    moe_comm_req_t *req; /* NULL: already complete */
    double t_start;
    bool done;
} a2a_op_t;

/* Start the all-to-all of chunk c. Forward direction: token side (send layout sc/sd) to
 * expert side (rc/rd); reverse: back. Units on the wire: elements of rows * H. */
static moe_status_t a2a_start(moe_layer_t *l, moe_dist_slot_t *ds, int c, bool reverse,
                              const void *src, void *dst, a2a_op_t *op)
{
    moe_dist_t *d = l->dist;
    int P = d->P, C = l->cfg.a2a_chunks;
    size_t H = (size_t)l->h;
    size_t sc[P], sd[P], rc[P], rd[P];
    const int64_t *scnt = reverse ? ds->rc : ds->sc, *sdis = reverse ? ds->rd : ds->sd;
    const int64_t *rcnt = reverse ? ds->sc : ds->rc, *rdis = reverse ? ds->sd : ds->rd;
    for (int p = 0; p < P; p++) {
        int64_t lo = chunk_lo(scnt[p], c, C), hi = chunk_lo(scnt[p], c + 1, C);
        sc[p] = (size_t)(hi - lo) * H;
        sd[p] = (size_t)(sdis[p] + lo) * H;
        lo = chunk_lo(rcnt[p], c, C), hi = chunk_lo(rcnt[p], c + 1, C);
        rc[p] = (size_t)(hi - lo) * H;
        rd[p] = (size_t)(rdis[p] + lo) * H;
    }
    for (int p = 0; p < P; p++) d->timing.a2a_bytes += (int64_t)(sc[p] * d->act);
    op->t_start = moe_now_ms();
    op->done = false;
    op->req = NULL;
    if (!d->ep) { /* ep = 1: the only peer is this rank */
        if (sc[0])
            MOE_TRY(MOE_OPS(l->rt)->copy(MOE_CTX(l->rt), (char *)dst + rd[0] * d->act,
                                         (const char *)src + sd[0] * d->act, sc[0] * d->act));
        op->done = true;
        return MOE_STATUS_SUCCESS;
    }
    return d->ep->ops->alltoallv(d->ep, src, sc, sd, dst, rc, rd, d->act_dt, &op->req);
}

static moe_status_t a2a_poll(moe_layer_t *l, a2a_op_t *op)
{
    moe_dist_t *d = l->dist;
    if (op->done) return MOE_STATUS_SUCCESS;
    MOE_TRY(moe_comm_test(d->ep, op->req, &op->done));
    if (op->done) {
        d->timing.a2a_started_ms += moe_now_ms() - op->t_start;
        d->timing.a2a_count++;
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t a2a_wait(moe_layer_t *l, a2a_op_t *op)
{
    moe_dist_t *d = l->dist;
    if (op->done) return MOE_STATUS_SUCCESS;
    double t0 = moe_now_ms();
    MOE_TRY(moe_comm_wait(d->ep, op->req));
    double t1 = moe_now_ms();
    op->done = true;
    d->timing.a2a_blocked_ms += t1 - t0;
    d->timing.a2a_started_ms += t1 - op->t_start;
    d->timing.a2a_count++;
    return MOE_STATUS_SUCCESS;
}

/* The expert computation, forward or backward, on the rows of the expert side from row0 on,
 * whose local-expert boundaries are off[0..El] (relative to row0). Forward reads the saved
 * xr and writes exp_out; backward reads the upstream gradient from exp_in, writes the input
 * gradient to exp_out and accumulates the weight gradients. */
static moe_status_t run_slice(moe_layer_t *l, moe_slot_t *s, bool backward, int64_t row0,
                              const int64_t *off, void *exp_in, void *exp_out, void *scratch)
{
    moe_dist_slot_t *ds = s->dist;
    size_t a = l->dist->act, H = (size_t)l->h, F = (size_t)l->f_local, r0 = (size_t)row0;
    moe_experts_t ex = {
        .h = l->h,
        .f = l->f_local,
        .el = l->el,
        .host_offsets = off,
        .w1 = l->w1,
        .w2 = l->w2,
        .xp = (char *)ds->xr + r0 * H * a,
        .hpre = (char *)ds->hpre + r0 * 2 * F * a,
        .act = (char *)ds->act + r0 * F * a,
    };
    if (!backward) {
        ex.out = (char *)exp_out + r0 * H * a;
        return MOE_OPS(l->rt)->experts_forward(MOE_CTX(l->rt), &ex);
    }
    ex.d_out = (char *)exp_in + r0 * H * a;
    ex.d_xp = (char *)exp_out + r0 * H * a;
    ex.dw1 = l->dw1;
    ex.dw2 = l->dw2;
    ex.scratch = scratch;
    return MOE_OPS(l->rt)->experts_backward(MOE_CTX(l->rt), &ex);
}

/* The expert work of chunk c: every peer block's slice of it. With `polls`, MPI is polled
 * between slices (the transfers in flight progress only inside MPI calls). */
typedef struct chunk_job {
    moe_layer_t *l;
    moe_slot_t *s;
    int c;
    bool backward;
    void *exp_in, *exp_out, *scratch;
    moe_status_t st;
    char err[600];
    atomic_bool done;
} chunk_job_t;

typedef struct poll_set {
    a2a_op_t *ops[2];
    int lo[2], hi[2]; /* ops[i][lo..hi) are polled */
} poll_set_t;

static moe_status_t poll_all(moe_layer_t *l, poll_set_t *ps, bool *idle)
{
    *idle = true;
    for (int i = 0; i < 2; i++)
        for (int j = ps->lo[i]; j < ps->hi[i]; j++) {
            if (ps->ops[i][j].done) continue;
            MOE_TRY(a2a_poll(l, &ps->ops[i][j]));
            if (!ps->ops[i][j].done) *idle = false;
        }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t compute_chunk(chunk_job_t *j, poll_set_t *polls)
{
    moe_layer_t *l = j->l;
    moe_dist_slot_t *ds = j->s->dist;
    int P = l->dist->P, C = l->cfg.a2a_chunks, El = l->el, c = j->c;
    int64_t off[El + 1];
    for (int q = 0; q < P; q++) {
        int64_t n = ds->rc[q], lo = chunk_lo(n, c, C), hi = chunk_lo(n, c + 1, C);
        if (hi == lo) continue;
        /* local-expert boundaries of this peer's block, clipped to the chunk */
        int64_t acc = 0;
        for (int e = 0; e <= El; e++) {
            int64_t b = acc < lo ? lo : acc > hi ? hi : acc;
            off[e] = b - lo;
            if (e < El) acc += ds->cnt[q * El + e];
        }
        MOE_TRY(run_slice(l, j->s, j->backward, ds->rd[q] + lo, off, j->exp_in, j->exp_out,
                          j->scratch));
        bool idle;
        if (polls) MOE_TRY(poll_all(l, polls, &idle));
    }
    return MOE_STATUS_SUCCESS;
}

static void *chunk_worker(void *arg)
{
    chunk_job_t *j = arg;
    j->st = compute_chunk(j, NULL);
    if (j->st != MOE_STATUS_SUCCESS) snprintf(j->err, sizeof j->err, "%s", moe_last_error());
    atomic_store(&j->done, true);
    return NULL;
}

/* Host backend: the experts of chunk c run on a worker thread while this thread keeps MPI
 * progressing the other chunks' transfers (only this thread calls MPI), so the copies that
 * shared-memory MPI does with the CPU run on a second core. Other backends compute on their
 * stream (asynchronous already) and poll between slices. */
static moe_status_t run_chunk(moe_layer_t *l, chunk_job_t *j, poll_set_t *ps)
{
    moe_dist_t *d = l->dist;
    bool threaded = d->worker_thread;
    if (threaded) {
        bool idle;
        MOE_TRY(poll_all(l, ps, &idle));
        threaded = !idle; /* nothing in flight: no reason for a thread */
    }
    if (!threaded) return compute_chunk(j, ps);
    atomic_store(&j->done, false);
    pthread_t t;
    if (pthread_create(&t, NULL, chunk_worker, j) != 0) return compute_chunk(j, ps);
    d->timing.worker_chunks++;
    moe_status_t st = MOE_STATUS_SUCCESS;
    bool idle = false;
    while (!atomic_load(&j->done)) {
        if (st == MOE_STATUS_SUCCESS && !idle) st = poll_all(l, ps, &idle);
        if (idle || st != MOE_STATUS_SUCCESS) break; /* nothing left to drive: just join */
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    pthread_join(t, NULL);
    MOE_TRY(st);
    if (j->st != MOE_STATUS_SUCCESS) return MOE_FAIL(j->st, "%s", j->err);
    return MOE_STATUS_SUCCESS;
}

/* tok_in (token side) -> exp_in (expert side) -> run_slice -> exp_out -> tok_out (token
 * side). */
static moe_status_t pipeline(moe_layer_t *l, moe_slot_t *s, const void *tok_in, void *exp_in,
                             void *exp_out, void *tok_out, bool backward, void *scratch)
{
    moe_dist_t *d = l->dist;
    moe_dist_slot_t *ds = s->dist;
    int P = d->P, C = l->cfg.a2a_chunks;
    size_t H = (size_t)l->h, a = d->act;
    a2a_op_t disp[C], comb[C];
    moe_status_t st = MOE_STATUS_SUCCESS;
    int started_d = 0, started_c = 0;
    chunk_job_t job = {.l = l,
                       .s = s,
                       .backward = backward,
                       .exp_in = exp_in,
                       .exp_out = exp_out,
                       .scratch = scratch};

    MOE_TRY_GOTO(st, a2a_start(l, ds, 0, false, tok_in, exp_in, &disp[0]));
    started_d = 1;
    for (int c = 0; c < C; c++) {
        if (c + 1 < C) {
            MOE_TRY_GOTO(st, a2a_start(l, ds, c + 1, false, tok_in, exp_in, &disp[c + 1]));
            started_d++;
        }
        MOE_TRY_GOTO(st, a2a_wait(l, &disp[c]));
        double t0 = moe_now_ms();
        job.c = c;
        poll_set_t ps = {{disp, comb}, {c + 1, 0}, {started_d, started_c}};
        MOE_TRY_GOTO(st, run_chunk(l, &job, &ps));
        d->timing.compute_ms += moe_now_ms() - t0;
        if (d->tp) /* row-parallel W2 (forward) / column-parallel W1 (backward): sum over tp */
            for (int q = 0; q < P; q++) {
                int64_t n = ds->rc[q], lo = chunk_lo(n, c, C), hi = chunk_lo(n, c + 1, C);
                if (hi == lo) continue;
                void *p = (char *)exp_out + (size_t)(ds->rd[q] + lo) * H * a;
                MOE_TRY_GOTO(st, moe_comm_allreduce(d->tp, p, p, (size_t)(hi - lo) * H, d->act_dt,
                                                    MOE_REDUCE_SUM));
            }
        MOE_TRY_GOTO(st, a2a_start(l, ds, c, true, exp_out, tok_out, &comb[c]));
        started_c++;
    }
    for (int c = 0; c < C; c++) MOE_TRY_GOTO(st, a2a_wait(l, &comb[c]));
    return MOE_STATUS_SUCCESS;
fail:
    /* an operation failed: the others cannot be taken back; abort the communicator so that
     * the peers fail too (their waits time out) instead of matching stale messages */
    if (d->ep && (started_d || started_c)) moe_comm_abort(d->ep);
    return st;
}

/* ---- forward ------------------------------------------------------------------------------- */

/* The distributed part of a slot; the routing state itself comes from moe_routing_forward. */
static moe_status_t alloc_dist_slot(moe_layer_t *l, moe_slot_t *s)
{
    moe_dist_slot_t *ds = calloc(1, sizeof *ds);
    s->dist = ds;
    if (!ds) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "slot host arrays");
    int P = l->dist->P;
    ds->sc = calloc((size_t)P * 4, sizeof(int64_t));
    ds->cnt = calloc((size_t)P * (size_t)l->el, sizeof(int64_t));
    if (!ds->sc || !ds->cnt) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "slot host arrays");
    ds->sd = ds->sc + P;
    ds->rc = ds->sc + 2 * P;
    ds->rd = ds->sc + 3 * P;
    return MOE_STATUS_SUCCESS;
}

/* The global routing table: one all-reduce over the dense group. Row j (dense rank j):
 * [N, N*z, N*entropy, counts[E], N*P[E]] in f64 (counts are exact below 2^53). */
typedef struct global_routing {
    int64_t n_total, capacity;
    double *counts; /* [E] global selections per expert (before capacity) */
    double *prefix; /* [E] selections on dense ranks before this one */
    double *p;      /* [E] P_e over the dense group's tokens */
    double z, entropy;
} global_routing_t;

static moe_status_t exchange_routing(moe_layer_t *l, moe_slot_t *s, const int32_t *counts,
                                     const float *pmean, const float *rstats, double *table,
                                     global_routing_t *g)
{
    moe_dist_t *d = l->dist;
    int32_t E = l->e, W = 3 + 2 * E;
    double n = (double)s->n;
    double *row = table + (size_t)d->dense_rank * (size_t)W;
    row[0] = n;
    row[1] = n * rstats[0];
    row[2] = n * rstats[1];
    for (int32_t e = 0; e < E; e++) {
        row[3 + e] = counts[e];
        row[3 + E + e] = n * pmean[e];
    }
    if (d->hdense)
        MOE_TRY(moe_comm_allreduce(d->hdense, table, table, (size_t)d->D * (size_t)W, MOE_COMM_F64,
                                   MOE_REDUCE_SUM));
    double nt = 0, zs = 0, hs = 0;
    for (int32_t j = 0; j < d->D; j++) {
        const double *r = table + (size_t)j * (size_t)W;
        nt += r[0];
        zs += r[1];
        hs += r[2];
    }
    g->n_total = (int64_t)nt;
    for (int32_t e = 0; e < E; e++) {
        double c = 0, pre = 0, pm = 0;
        for (int32_t j = 0; j < d->D; j++) {
            const double *r = table + (size_t)j * (size_t)W;
            c += r[3 + e];
            pm += r[3 + E + e];
            if (j < d->dense_rank) pre += r[3 + e];
        }
        g->counts[e] = c;
        g->prefix[e] = pre;
        g->p[e] = nt > 0 ? pm / nt : 0.0;
    }
    g->z = nt > 0 ? zs / nt : 0;
    g->entropy = nt > 0 ? hs / nt : 0;
    g->capacity = moe_routing_capacity(l, g->n_total);
    return MOE_STATUS_SUCCESS;
}

/* The backend's plan against the global order: an expert's capacity counts the selections
 * on the dense ranks before this one first; rows sorted by (owner rank, local expert, slot).
 * Its wait for the device brings the kept counts to r->kept. */
static moe_status_t plan_rows(moe_layer_t *l, moe_slot_t *s, const global_routing_t *g,
                              const moe_routing_parts_t *r, int64_t *kept_group)
{
    moe_dist_t *d = l->dist;
    moe_dist_slot_t *ds = s->dist;
    const moe_backend_ops_t *ops = MOE_OPS(l->rt);
    void *ctx = MOE_CTX(l->rt);
    int32_t E = l->e, El = l->el;
    if (g->capacity >= 0) {
        for (int32_t e = 0; e < E; e++)
            d->host_first[e] = (int32_t)(g->prefix[e] < (double)g->capacity ? g->prefix[e]
                                                                            : (double)g->capacity);
        MOE_TRY(ops->copy(ctx, d->first, d->host_first, sizeof(int32_t) * (size_t)E));
    }
    moe_plan_t plan = {
        .n = s->n,
        .e = E,
        .k = l->k,
        .capacity = g->capacity,
        .topk_idx = s->topk_idx,
        .first = g->capacity >= 0 ? d->first : NULL,
        .row_order = d->row_order,
        .row_of_slot = s->row_of_slot,
        .slot_of_row = s->slot_of_row,
        .kept = s->kept,
        .summary = s->kept,
        .summary_bytes = sizeof(int32_t) * (size_t)E,
        .host_summary = r->kept,
    };
    MOE_TRY(ops->plan(ctx, &plan));
    for (int32_t e = 0; e < E; e++) {
        s->host_kept[e] = r->kept[e];
        kept_group[d->group[e]] = r->kept[e];
    }
    ds->rows_send = 0;
    for (int p = 0; p < d->P; p++) {
        ds->sc[p] = 0;
        for (int32_t j = 0; j < El; j++) ds->sc[p] += kept_group[p * El + j];
        ds->sd[p] = ds->rows_send;
        ds->rows_send += ds->sc[p];
    }
    return MOE_STATUS_SUCCESS;
}

/* Rows from each ep peer per local expert: the counts all-to-all (El per peer). */
static moe_status_t exchange_counts(moe_layer_t *l, moe_slot_t *s, const int64_t *kept_group)
{
    moe_dist_t *d = l->dist;
    moe_dist_slot_t *ds = s->dist;
    int P = d->P, El = l->el;
    if (d->hep) {
        size_t cnt[P], dis[P];
        for (int p = 0; p < P; p++) {
            cnt[p] = (size_t)El;
            dis[p] = (size_t)p * (size_t)El;
        }
        MOE_TRY(moe_comm_alltoallv(d->hep, kept_group, cnt, dis, ds->cnt, cnt, dis, MOE_COMM_I64));
    } else {
        memcpy(ds->cnt, kept_group, sizeof(int64_t) * (size_t)El);
    }
    ds->rows_recv = 0;
    for (int q = 0; q < P; q++) {
        ds->rc[q] = 0;
        for (int j = 0; j < El; j++) ds->rc[q] += ds->cnt[q * El + j];
        ds->rd[q] = ds->rows_recv;
        ds->rows_recv += ds->rc[q];
    }
    return MOE_STATUS_SUCCESS;
}

/* FNV-1a over the bytes of x (brought to the host). */
static moe_status_t hash_tokens(moe_layer_t *l, const moe_tensor_t *x, uint64_t *out)
{
    size_t bytes = (size_t)x->shape[0] * (size_t)l->h * l->dist->act;
    unsigned char *host = malloc(bytes ? bytes : 1);
    if (!host) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "tp input check of %zu bytes", bytes);
    moe_status_t st = bytes ? MOE_OPS(l->rt)->copy(MOE_CTX(l->rt), host, x->data, bytes)
                            : MOE_STATUS_SUCCESS;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < bytes; i++) h = (h ^ host[i]) * 1099511628211ull;
    free(host);
    *out = h;
    return st;
}

/* Step 4b: the tp ranks compare the rows they received per ep peer and local expert, which
 * their sums over tp add up slice by slice. Fed the same tokens they always agree; without
 * MOE_CHECK_TP_INPUTS this is where different tokens show (they route differently), and the
 * failure says so on every rank of the stage, as step 0's. */
static moe_status_t check_tp_rows(moe_layer_t *l, const moe_dist_slot_t *ds)
{
    moe_dist_t *d = l->dist;
    if (!d->htp) return MOE_STATUS_SUCCESS;
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < (int64_t)d->P * l->el; i++)
        h = (h ^ (uint64_t)ds->cnt[i]) * 1099511628211ull;
    const char *what = "the rows the experts received over tp (tp ranks must be fed the same "
                       "tokens: different tokens are the likely cause, MOE_CHECK_TP_INPUTS=1 "
                       "compares them at the input)";
    moe_agree_field_t f[2] = {moe_agree_int("rows received", ds->rows_recv),
                              moe_agree_u64("their split over ep peers and experts (hash)", h)};
    moe_status_t st = moe_comm_agree(d->htp, what, f, 2, MOE_STATUS_SUCCESS);
    if (!d->hdense) return st;
    return moe_comm_agree(d->hdense, what, NULL, 0, st);
}

/* Step 0: the tp ranks compare what they were fed. A difference fails on every rank of the
 * stage: on the tp group that found it, then over the dense group, whose other ranks would
 * otherwise wait in the routing exchange for the ranks that stopped. */
static moe_status_t check_tp_inputs(moe_layer_t *l, const moe_tensor_t *x)
{
    moe_dist_t *d = l->dist;
    if (!d->htp) return MOE_STATUS_SUCCESS;
    const char *what = "the forward's input over tp (tp ranks must be fed the same tokens)";
    moe_agree_field_t f[2] = {moe_agree_int("tokens", x->shape[0])};
    int n = 1;
    moe_status_t local = MOE_STATUS_SUCCESS;
    if (d->hash_tp_inputs) {
        uint64_t h = 0;
        local = hash_tokens(l, x, &h);
        f[n++] = moe_agree_u64("their hash (MOE_CHECK_TP_INPUTS)", h);
    }
    moe_status_t st = moe_comm_agree(d->htp, what, f, n, local);
    if (!d->hdense) return st;
    return moe_comm_agree(d->hdense, what, NULL, 0, st);
}

moe_status_t moe_dist_forward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *x, moe_tensor_t *y)
{
    moe_runtime_t *rt = l->rt;
    const moe_backend_ops_t *ops = MOE_OPS(rt);
    void *ctx = MOE_CTX(rt);
    moe_dist_t *d = l->dist;
    int64_t n = x->shape[0], H = l->h, Fl = l->f_local;
    int32_t E = l->e, K = l->k;
    size_t a = d->act;
    moe_status_t st = MOE_STATUS_SUCCESS;
    double *table = NULL, *gbuf = NULL;
    int64_t *kept_group = NULL;
    void *xs = NULL, *outr = NULL;
    moe_routing_parts_t routing = {0};

    /* 0. the tp ranks' inputs, 1. router on the local tokens */
    MOE_TRY_GOTO(st, check_tp_inputs(l, x));
    MOE_TRY_GOTO(st, moe_routing_forward(l, s, x));
    MOE_TRY_GOTO(st, moe_routing_fetch(l, s, &routing));
    MOE_TRY_GOTO(st, alloc_dist_slot(l, s));
    moe_dist_slot_t *ds = s->dist;
    table = calloc((size_t)d->D * (size_t)(3 + 2 * E), sizeof *table);
    gbuf = calloc((size_t)E * 3, sizeof *gbuf);
    kept_group = calloc((size_t)E, sizeof *kept_group);
    if (!table || !gbuf || !kept_group) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "routing host buffers");
        goto fail;
    }
    /* 2. global routing statistics, capacity and this rank's place in the global order */
    global_routing_t g = {.counts = gbuf, .prefix = gbuf + E, .p = gbuf + 2 * E};
    MOE_TRY_GOTO(
        st, exchange_routing(l, s, routing.counts, routing.score_mean, routing.stats, table, &g));
    ds->aux_scale = g.n_total ? (float)(((double)n / g.n_total) * ((double)n / g.n_total)) : 0;
    ds->z_scale = g.n_total ? (float)((double)n / g.n_total) : 0;
    /* backward's aux gradient needs the global selections */
    for (int32_t e = 0; e < E; e++) routing.counts[e] = (int32_t)g.counts[e];
    MOE_TRY_GOTO(st, ops->copy(ctx, s->counts, routing.counts, sizeof(int32_t) * (size_t)E));
    double aux = 0, *f = l->host_aux_f;
    MOE_TRY_GOTO(st, moe_routing_aux_freq(l, s, routing.counts, g.n_total * K, f));
    for (int32_t e = 0; e < E; e++) aux += f[e] * g.p[e];
    /* 3. plan, 4. row counts to the expert owners */
    MOE_TRY_GOTO(st, plan_rows(l, s, &g, &routing, kept_group));
    MOE_TRY_GOTO(st, exchange_counts(l, s, kept_group));
    MOE_TRY_GOTO(st, check_tp_rows(l, ds));
    s->rows = ds->rows_recv;
    /* 5. gather, dispatch / experts / combine pipeline */
    size_t Rs = (size_t)ds->rows_send, Rr = (size_t)ds->rows_recv;
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rs * (size_t)H * a, &xs));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rs * (size_t)H * a, &ds->back));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rr * (size_t)H * a, &ds->xr));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rr * 2 * (size_t)Fl * a, &ds->hpre));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rr * (size_t)Fl * a, &ds->act));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rr * (size_t)H * a, &outr));
    if (Rs)
        MOE_TRY_GOTO(st, ops->gather_rows(ctx, xs, s->x, s->slot_of_row, K, NULL, (int64_t)Rs, H));
    MOE_TRY_GOTO(st, pipeline(l, s, xs, ds->xr, outr, ds->back, false, NULL));
    /* 6. unpermute */
    if (n > 0)
        MOE_TRY_GOTO(
            st, ops->combine(ctx, y->data, ds->back, s->row_of_slot, s->topk_w, n, K, H, false));
    moe_routing_set_stats(l, s, g.capacity, (double)E * aux, g.z, g.entropy);
    MOE_TRY_GOTO(st, moe_routing_update_bias(l, s, g.n_total * K)); /* s->counts: global */
fail:
    moe_layer_free_dev(l->rt, &xs);
    moe_layer_free_dev(l->rt, &outr);
    moe_layer_free_comm_host(l->rt, table);      /* the routing all-reduce's buffer */
    moe_layer_free_comm_host(l->rt, kept_group); /* the counts all-to-all's send buffer */
    free(gbuf);
    return st;
}

/* ---- backward ------------------------------------------------------------------------------ */

moe_status_t moe_dist_backward(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *dy, void *dx)
{
    moe_runtime_t *rt = l->rt;
    const moe_backend_ops_t *ops = MOE_OPS(rt);
    void *ctx = MOE_CTX(rt);
    moe_dist_t *d = l->dist;
    moe_dist_slot_t *ds = s->dist;
    int64_t n = s->n, H = l->h, Fl = l->f_local;
    int32_t K = l->k;
    size_t a = d->act, Rs = (size_t)ds->rows_send, Rr = (size_t)ds->rows_recv;
    float *d_w = NULL;
    void *d_rows = NULL, *d_outr = NULL, *d_xr = NULL, *d_back = NULL, *scratch = NULL;
    moe_status_t st = MOE_STATUS_SUCCESS;

    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, (size_t)n * (size_t)K * sizeof(float), &d_w));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rs * (size_t)H * a, &d_rows));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rs * (size_t)H * a, &d_back));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rr * (size_t)H * a, &d_outr));
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, Rr * (size_t)H * a, &d_xr));
    /* scratch for the largest slice: a peer block's chunk */
    int64_t max_slice = 0;
    for (int q = 0; q < d->P; q++) {
        int64_t c = (ds->rc[q] + l->cfg.a2a_chunks - 1) / l->cfg.a2a_chunks + 1;
        if (c > max_slice) max_slice = c;
    }
    MOE_TRY_GOTO(st, moe_layer_alloc_dev(l->rt, (size_t)max_slice * 3 * (size_t)Fl * a, &scratch));
    if (n > 0) {
        MOE_TRY_GOTO(
            st, ops->combine_weight_grad(ctx, d_w, dy->data, ds->back, s->row_of_slot, n, K, H));
        /* the router writes dx; the combine below adds the experts' part. The op scales by
         * its local N; the global batch's terms need Nt (see top) */
        MOE_TRY_GOTO(st, moe_routing_backward(l, s, d_w, dx, l->cfg.aux_loss_coef * ds->aux_scale,
                                              l->cfg.z_loss_coef * ds->z_scale));
    }
    if (Rs)
        MOE_TRY_GOTO(st, ops->gather_rows(ctx, d_rows, dy->data, s->slot_of_row, K, s->topk_w,
                                          (int64_t)Rs, H));
    MOE_TRY_GOTO(st, pipeline(l, s, d_rows, d_outr, d_xr, d_back, true, scratch));
    if (n > 0) MOE_TRY_GOTO(st, ops->combine(ctx, dx, d_back, s->row_of_slot, NULL, n, K, H, true));
fail:
    moe_layer_free_dev(l->rt, &d_w);
    moe_layer_free_dev(l->rt, &d_rows);
    moe_layer_free_dev(l->rt, &d_outr);
    moe_layer_free_dev(l->rt, &d_xr);
    moe_layer_free_dev(l->rt, &d_back);
    moe_layer_free_dev(l->rt, &scratch);
    return st;
}
