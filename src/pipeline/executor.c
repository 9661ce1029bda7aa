/*
 * The 1F1B executor: runs one stage's action list (schedule.c) with the user's callbacks and
 * moves stage-boundary tensors over the mesh's pp communicator.
 *
 * Legend: p stages, m microbatches, s this stage; a "buffer" is one stage-boundary tensor of
 * the configured shape, allocated on the runtime's device.
 *
 * Transfers, PREPOST mode (MPI): every receive of the list is posted `prepost` receive-actions
 * ahead of the action that needs it (so data arrives while the stage computes); sends are
 * started right after the compute that fills them. ORDERED mode (in-order transports such as
 * NCCL, where a receive queued ahead of a send blocks it): transfers start in the schedule's
 * global issue order (issue_order.c), a receive at its turn, a send at its turn once computed.
 * Either way sends are completed lazily (polled between actions, waited at the end of the
 * batch). Tags are 2*u (activation) and 2*u+1 (gradient) for the receiving unit
 * u = chunk*m + mb (chunk 0 without interleaving); MPI's non-overtaking order keeps
 * consecutive batches apart.
 *
 * Buffers come from a pool that grows on demand and is kept across batches, so its size is
 * the schedule's peak: about (p - s) inputs held for backward, plus posted receives and sends
 * in flight.
 *
 * Failures: a failing callback switches this rank to "drain" mode: it skips every later
 * callback but still performs every transfer of its list (sending zeros), so its peers
 * complete theirs.
 * A status exchange over the world then tells every rank, and nobody steps the optimizer.
 * A failing transfer leaves the communicator unusable: the rank aborts it and returns at once;
 * the abort poisons the mesh and tells the peers, whose transfers then fail at once too.
 */
#include "pipeline_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/runtime.h"

typedef struct pipe_buf {
    moe_tensor_t t;
    bool busy;
} pipe_buf_t;

typedef struct pipe_send {
    moe_comm_req_t *req;
    int32_t buf;
    const moe_pipeline_action_t *action; /* for messages */
} pipe_send_t;

struct moe_pipeline {
    uint64_t magic;
    moe_runtime_t *rt;
    moe_pipeline_config_t cfg;
    moe_pipeline_callbacks_t cb;
    moe_pipeline_schedule_t *sched;
    int32_t stage, stages, m, v; /* v: model chunks (virtual stages) on this rank */
    moe_comm_t *pp;              /* NULL when p == 1 */
    moe_comm_t *world;           /* NULL in a world of one */
    moe_comm_dtype_t comm_dtype;
    size_t act_bytes, act_numel;

    /* each buffer allocated on its own: stages are handed &bufs[i]->t and may keep it until
     * the unit's backward, while the table grows */
    pipe_buf_t **bufs;
    int32_t nbufs, cap_bufs;

    /* per unit u = chunk * m + mb: buffer index of its stage input (x), output (y), output
     * gradient (dy), input gradient (dx); -1 when none */
    int32_t *x_buf, *y_buf, *dy_buf, *dx_buf;
    /* per unit: forward called (1), backward completed (2) */
    uint8_t *progress;
    /* per action: posted receive and its buffer; for a send action in ordered mode, the buffer
     * waiting to be sent (ready[i] = 1) */
    moe_comm_req_t **recv_req;
    int32_t *recv_buf;
    uint8_t *ready;
    /* stream-ordered communicator (NCCL): transfers go out in sched->issue order */
    bool ordered;
    pipe_send_t *sends; /* started, not yet completed */
    int32_t nsends;

    void *ctrl;            /* device scratch for the status exchange (world_size*2 i32 + f64) */
    bool broken;           /* a transfer failed: the pp communicator is unusable */
    bool sync_before_send; /* device buffers on a communicator that does not stage them */
    moe_pipeline_stats_t stats;
};

/* ---- small helpers --------------------------------------------------------------------------- */

/* The unit index of an action: one per (chunk, microbatch). */
static int32_t unit_of(const moe_pipeline_t *pp, const moe_pipeline_action_t *a)
{
    return a->chunk * pp->m + a->microbatch;
}

/* A transfer's tag names the receiving side's unit and the kind, so both ends compute the
 * same one. */
static int32_t tag_of(const moe_pipeline_t *pp, const moe_pipeline_action_t *a)
{
    return 2 * moe_pipe_dest_unit(pp->sched, a) + moe_pipe_kind(a->op);
}

/* Tags are below 2 * m * v; send/recv tags must stay below MOE_COMM_MAX_TAG. */
#define PIPE_MAX_UNITS (MOE_COMM_MAX_TAG / 2)

static moe_status_t buf_acquire(moe_pipeline_t *pp, int32_t *out)
{
    for (int32_t i = 0; i < pp->nbufs; i++) {
        if (!pp->bufs[i]->busy) {
            pp->bufs[i]->busy = true;
            *out = i;
            return MOE_STATUS_SUCCESS;
        }
    }
    if (pp->nbufs == pp->cap_bufs) {
        int32_t cap = pp->cap_bufs ? 2 * pp->cap_bufs : 8;
        pipe_buf_t **nb = realloc(pp->bufs, sizeof *nb * (size_t)cap);
        if (!nb) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "pipeline buffer table of %d", cap);
        pp->bufs = nb;
        pp->cap_bufs = cap;
    }
    pipe_buf_t *b = calloc(1, sizeof *b);
    if (!b) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "pipeline buffer");
    moe_status_t st = moe_tensor_alloc(pp->rt, pp->cfg.act_dtype, pp->rt->backend.ops->device,
                                       pp->cfg.act_ndim, pp->cfg.act_shape, &b->t);
    if (st != MOE_STATUS_SUCCESS) {
        free(b);
        return st;
    }
    b->busy = true;
    pp->bufs[pp->nbufs] = b;
    *out = pp->nbufs++;
    return MOE_STATUS_SUCCESS;
}

static void buf_release(moe_pipeline_t *pp, int32_t *idx)
{
    if (*idx >= 0) pp->bufs[*idx]->busy = false;
    *idx = -1;
}

/* Wait for a transfer within the pipeline's timeout (0: the communicator's); a timeout names
 * the peer's world rank and whether it answers. */
static moe_status_t wait_req(moe_pipeline_t *pp, moe_comm_req_t *req, const char *what, int32_t mb)
{
    double t0 = moe_now_s();
    moe_status_t st = pp->cfg.timeout_ms > 0 ? moe_comm_wait_within(pp->pp, req, pp->cfg.timeout_ms)
                                             : moe_comm_wait(pp->pp, req);
    pp->stats.wait_seconds += moe_now_s() - t0;
    if (st != MOE_STATUS_SUCCESS)
        return moe_error_wrap(st, "pipeline stage %d/%d: %s of microbatch %d", pp->stage,
                              pp->stages, what, mb);
    return MOE_STATUS_SUCCESS;
}

/* A transfer failed: nothing more can go over pp. Stop in-flight work so buffers are free. */
static void mark_broken(moe_pipeline_t *pp)
{
    pp->broken = true;
    moe_comm_abort(pp->pp);
    pp->nsends = 0;
    int32_t n = pp->sched->count;
    for (int32_t i = 0; i < n; i++) pp->recv_req[i] = NULL;
}

/* ---- create / destroy ------------------------------------------------------------------------ */

moe_pipeline_config_t moe_pipeline_config_default(void)
{
    moe_pipeline_config_t c = {
        .struct_size = sizeof c,
        .microbatches = 1,
        .act_ndim = 0,
        .act_shape = {0},
        .act_dtype = (moe_dtype_t)-1,
        .prepost = 2,
        .optimizer = NULL,
        .lr = 0.0f,
        .grad_scale = 0.0f,
        .timeout_ms = 0,
        .virtual_stages = 1,
        .issue = MOE_PIPELINE_ISSUE_AUTO,
    };
    return c;
}

static void pipeline_free(moe_pipeline_t *pp)
{
    if (!pp) return;
    /* after the mesh lost a peer, transfers that never completed may still write the pool's
     * buffers and the status scratch: those are leaked */
    bool leak = moe_runtime_poisoned(pp->rt);
    for (int32_t i = 0; i < pp->nbufs; i++) {
        if (!leak) moe_tensor_free(pp->rt, &pp->bufs[i]->t);
        free(pp->bufs[i]);
    }
    if (pp->ctrl && !leak) MOE_OPS(pp->rt)->free(MOE_CTX(pp->rt), pp->ctrl);
    free(pp->bufs);
    free(pp->x_buf);
    free(pp->y_buf);
    free(pp->dy_buf);
    free(pp->dx_buf);
    free(pp->progress);
    free(pp->recv_req);
    free(pp->recv_buf);
    free(pp->ready);
    free(pp->sends);
    moe_pipeline_schedule_free(pp->sched);
    pp->magic = MOE_MAGIC_DEAD;
    free(pp);
}

/* The checks of one rank's config (act_dtype resolved by the caller). */
static moe_status_t check_config(const moe_runtime_t *rt, const moe_pipeline_config_t *c,
                                 const moe_pipeline_callbacks_t *callbacks)
{
    const moe_mesh_t *mesh = rt->mesh;
    int32_t p = mesh->size[MOE_AXIS_PP], s = mesh->coord[MOE_AXIS_PP];
    MOE_CHECK_ARG(c->microbatches >= 1, "microbatches is %d; expected >= 1", c->microbatches);
    MOE_CHECK_ARG(c->virtual_stages >= 1, "virtual_stages is %d; expected >= 1", c->virtual_stages);
    /* tags 2*unit+1 must stay below the communicators' user tag limit */
    MOE_CHECK_ARG((int64_t)c->microbatches * c->virtual_stages <= PIPE_MAX_UNITS,
                  "microbatches x virtual_stages is %lld; at most %d",
                  (long long)c->microbatches * c->virtual_stages, PIPE_MAX_UNITS);
    MOE_CHECK_ARG(c->act_ndim >= 1 && c->act_ndim <= MOE_MAX_DIMS,
                  "act_ndim is %d; expected 1..%d (the stage boundary tensor's shape)", c->act_ndim,
                  MOE_MAX_DIMS);
    for (int d = 0; d < c->act_ndim; d++)
        MOE_CHECK_ARG(c->act_shape[d] >= 1, "act_shape[%d] is %lld; expected >= 1", d,
                      (long long)c->act_shape[d]);
    MOE_CHECK_ARG(c->act_dtype == MOE_DTYPE_F32 || c->act_dtype == MOE_DTYPE_BF16,
                  "act_dtype is %d; expected F32 (0) or BF16 (1)", (int)c->act_dtype);
    MOE_CHECK_ARG(c->prepost >= 1, "prepost is %d; expected >= 1", c->prepost);
    MOE_CHECK_ARG(c->issue >= MOE_PIPELINE_ISSUE_AUTO && c->issue <= MOE_PIPELINE_ISSUE_ORDERED,
                  "issue is %d; expected AUTO (0), PREPOST (1) or ORDERED (2)", (int)c->issue);
    MOE_CHECK_ARG(callbacks->forward != NULL, "callbacks->forward is NULL");
    MOE_CHECK_ARG(callbacks->backward != NULL, "callbacks->backward is NULL");
    MOE_CHECK_ARG(p > 1 || c->virtual_stages == 1,
                  "virtual_stages is %d but the mesh has a single pp stage", c->virtual_stages);
    MOE_CHECK_ARG(c->virtual_stages == 1 || c->microbatches % p == 0,
                  "interleaving needs microbatches (%d) divisible by the pp size (%d)",
                  c->microbatches, p);
    MOE_CHECK_ARG(s != p - 1 || callbacks->loss != NULL,
                  "callbacks->loss is NULL on the last stage (%d of %d)", s, p);
    MOE_CHECK_ARG(p == 1 || mesh->comm[MOE_AXIS_PP] != NULL,
                  "the mesh has pp=%d but no pp communicator", p);
    return MOE_STATUS_SUCCESS;
}

/* The step's lr and grad_scale: the ranks of a pp stage hold replicas and shards of the same
 * parameters, and a difference on one of them makes the replicas drift apart silently. A
 * rank whose own config is invalid (`local`) still joins, so the others learn. */
static moe_status_t agree_config(moe_runtime_t *rt, const moe_pipeline_config_t *c,
                                 moe_status_t local)
{
    moe_agree_field_t f[] = {
        moe_agree_f32("lr (<= 0: the optimizer's configured rate, shown as 0)",
                      c->lr > 0 ? c->lr : 0),
        moe_agree_f32("grad_scale (<= 0: 1/microbatches, shown as 0)",
                      c->grad_scale > 0 ? c->grad_scale : 0),
    };
    return moe_mesh_agree(rt->mesh, MOE_MESH_STAGE, "the pipeline config", f,
                          (int)(sizeof f / sizeof f[0]), local);
}

moe_status_t moe_pipeline_create(moe_runtime_t *rt, const moe_pipeline_config_t *config,
                                 const moe_pipeline_callbacks_t *callbacks, moe_pipeline_t **out)
{
    moe_error_clear();
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_HANDLE(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(callbacks != NULL, "callbacks is NULL");
    moe_pipeline_config_t c = moe_pipeline_config_default();
    MOE_TAKE_CONFIG(c, config, moe_pipeline_config_t);
    if ((int)c.act_dtype == -1) c.act_dtype = rt->backend.ops->compute_dtype;
    MOE_TRY(agree_config(rt, &c, check_config(rt, &c, callbacks)));
    const moe_mesh_t *mesh = rt->mesh;
    int32_t p = mesh->size[MOE_AXIS_PP], s = mesh->coord[MOE_AXIS_PP];

    moe_pipeline_t *pp = calloc(1, sizeof *pp);
    if (!pp) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "pipeline allocation");
    pp->rt = rt;
    pp->cfg = c;
    pp->cb = *callbacks;
    pp->stage = s;
    pp->stages = p;
    pp->m = c.microbatches;
    pp->v = c.virtual_stages;
    pp->pp = p > 1 ? mesh->comm[MOE_AXIS_PP] : NULL;
    pp->world = mesh->world_size > 1 ? mesh->comm[MOE_AXIS_WORLD] : NULL;
    pp->comm_dtype = c.act_dtype == MOE_DTYPE_F32 ? MOE_COMM_F32 : MOE_COMM_BF16;
    bool stream_ordered = pp->pp && strcmp(pp->pp->ops->name, "mpi") != 0; /* NCCL */
    pp->sync_before_send = stream_ordered && rt->backend.ops->device != MOE_DEVICE_HOST;
    /* MPI matches by tag and progresses operations independently: receives are posted
     * `prepost` ahead. Any other communicator (NCCL) runs operations in call order on one
     * stream, where a receive posted ahead of a send deadlocks the pair: issue in the
     * schedule's global order instead (see moe_pipeline_issue_order). */
    pp->ordered = pp->pp && (c.issue == MOE_PIPELINE_ISSUE_ORDERED ||
                             (c.issue == MOE_PIPELINE_ISSUE_AUTO && stream_ordered));
    pp->act_numel = 1;
    for (int d = 0; d < c.act_ndim; d++) pp->act_numel *= (size_t)c.act_shape[d];
    pp->act_bytes = pp->act_numel * moe_dtype_size(c.act_dtype);

    moe_status_t st;
    MOE_TRY_GOTO(st, moe_pipeline_schedule_build(p, pp->m, s, pp->v, &pp->sched));
    if (pp->ordered) MOE_TRY_GOTO(st, moe_pipeline_issue_order(pp->sched));
    size_t m = (size_t)pp->m * (size_t)pp->v, n = (size_t)pp->sched->count;
    pp->x_buf = malloc(m * sizeof(int32_t));
    pp->y_buf = malloc(m * sizeof(int32_t));
    pp->dy_buf = malloc(m * sizeof(int32_t));
    pp->dx_buf = malloc(m * sizeof(int32_t));
    pp->progress = calloc(m, 1);
    pp->recv_req = calloc(n, sizeof *pp->recv_req);
    pp->recv_buf = malloc(n * sizeof(int32_t));
    pp->ready = calloc(n, 1);
    pp->sends = calloc(n, sizeof *pp->sends);
    if (!pp->x_buf || !pp->y_buf || !pp->dy_buf || !pp->dx_buf || !pp->progress || !pp->recv_req ||
        !pp->recv_buf || !pp->ready || !pp->sends) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "pipeline tables for %d microbatches", pp->m);
        goto fail;
    }
    if (pp->world) {
        size_t bytes = sizeof(int32_t) * 2 * (size_t)mesh->world_size + sizeof(double);
        MOE_TRY_GOTO(st, MOE_OPS(rt)->alloc(MOE_CTX(rt), bytes, &pp->ctrl));
    }
    pp->stats.struct_size = sizeof pp->stats;
    pp->stats.stage = s;
    pp->stats.stages = p;
    pp->stats.microbatches = pp->m;
    pp->magic = MOE_MAGIC_PIPELINE;
    moe_runtime_adopt(rt, MOE_CHILD_PIPELINE);
    *out = pp;
    moe_log(&rt->logger, MOE_LOG_DEBUG,
            "pipeline: stage %d of %d, %d microbatches, %zu bytes "
            "per boundary tensor",
            s, p, pp->m, pp->act_bytes);
    return MOE_STATUS_SUCCESS;
fail:
    pipeline_free(pp);
    return st;
}

moe_status_t moe_pipeline_destroy(moe_pipeline_t *pp)
{
    moe_error_clear();
    if (!pp) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(pp, MOE_MAGIC_PIPELINE, "pipeline");
    moe_runtime_disown(pp->rt, MOE_CHILD_PIPELINE);
    pipeline_free(pp);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_pipeline_get_schedule(const moe_pipeline_t *pp,
                                       const moe_pipeline_schedule_t **out)
{
    MOE_ENTRY(pp, MOE_MAGIC_PIPELINE, "pipeline");
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = pp->sched;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_pipeline_stats(const moe_pipeline_t *pp, moe_pipeline_stats_t *stats)
{
    MOE_ENTRY(pp, MOE_MAGIC_PIPELINE, "pipeline");
    MOE_CHECK_ARG(stats != NULL, "stats is NULL");
    MOE_CHECK_STRUCT_SIZE(stats, moe_pipeline_stats_t, sizeof(moe_pipeline_stats_t));
    size_t sz = stats->struct_size < sizeof *stats ? stats->struct_size : sizeof *stats;
    moe_pipeline_stats_t s = pp->stats;
    s.struct_size = stats->struct_size;
    s.buffers = pp->nbufs;
    memcpy(stats, &s, sz);
    return MOE_STATUS_SUCCESS;
}

/* ---- one global batch ------------------------------------------------------------------------ */

/* Execution state of one batch: the first local failure and its message. */
typedef struct step_state {
    moe_status_t failed;
    char message[1024];
    double loss_sum;
    int32_t next_post;  /* next action index to consider for posting a receive */
    int32_t posted;     /* receives posted and not yet consumed */
    int32_t next_issue; /* ordered mode: next entry of sched->issue */
} step_state_t;

static void record_failure(moe_pipeline_t *pp, step_state_t *ss, moe_status_t st, const char *what,
                           int32_t mb, int32_t chunk)
{
    if (ss->failed != MOE_STATUS_SUCCESS) return;
    if (moe_last_error()[0] == '\0') /* the callback failed without a libmoe message */
        MOE_FAIL(st, "the %s callback returned '%s'", what, moe_status_string(st));
    if (mb >= 0 && pp->v > 1)
        moe_error_wrap(st, "pipeline stage %d/%d: %s of microbatch %d (chunk %d)", pp->stage,
                       pp->stages, what, mb, chunk);
    else if (mb >= 0)
        moe_error_wrap(st, "pipeline stage %d/%d: %s of microbatch %d", pp->stage, pp->stages, what,
                       mb);
    else
        moe_error_wrap(st, "pipeline stage %d/%d: %s", pp->stage, pp->stages, what);
    ss->failed = st;
    snprintf(ss->message, sizeof ss->message, "%s", moe_last_error());
    moe_log(&pp->rt->logger, MOE_LOG_ERROR, "%s (draining the schedule)", ss->message);
}

/* Post the receive of action i. */
static moe_status_t post_receive(moe_pipeline_t *pp, step_state_t *ss, int32_t i)
{
    const moe_pipeline_action_t *a = &pp->sched->actions[i];
    MOE_TRY(buf_acquire(pp, &pp->recv_buf[i]));
    moe_status_t st = pp->pp->ops->recv(pp->pp, pp->bufs[pp->recv_buf[i]]->t.data, pp->act_numel,
                                        pp->comm_dtype, a->peer, tag_of(pp, a), &pp->recv_req[i]);
    if (st != MOE_STATUS_SUCCESS)
        return moe_error_wrap(st, "pipeline stage %d/%d: posting %s of microbatch %d", pp->stage,
                              pp->stages, moe_pipeline_op_string(a->op), a->microbatch);
    ss->posted++;
    return MOE_STATUS_SUCCESS;
}

/* Keep `prepost` receives posted ahead of the current action `cur`. */
static moe_status_t post_receives(moe_pipeline_t *pp, step_state_t *ss, int32_t cur)
{
    const moe_pipeline_action_t *acts = pp->sched->actions;
    if (ss->next_post < cur) ss->next_post = cur;
    while (ss->next_post < pp->sched->count &&
           (ss->posted < pp->cfg.prepost || ss->next_post == cur)) {
        int32_t i = ss->next_post++;
        const moe_pipeline_action_t *a = &acts[i];
        if (!moe_pipe_is_recv(a->op)) continue;
        MOE_TRY(post_receive(pp, ss, i));
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t start_send(moe_pipeline_t *pp, const moe_pipeline_action_t *a, int32_t *buf,
                               bool draining)
{
    pipe_send_t *sd = &pp->sends[pp->nsends];
    /* draining: the buffer holds whatever the pool had (never-written memory may hold NaN
     * patterns); send zeros, a safe input for the peer's layers until the batch ends */
    if (draining)
        MOE_TRY(
            MOE_OPS(pp->rt)->memset_zero(MOE_CTX(pp->rt), pp->bufs[*buf]->t.data, pp->act_bytes));
    /* GPU buffers: the callback's kernels that fill the buffer are on the runtime's stream.
     * The MPI communicator stages through a copy on that stream (ordered, blocking); any other
     * communicator (NCCL) gets a finished buffer. */
    if (pp->sync_before_send) MOE_TRY(MOE_OPS(pp->rt)->synchronize(MOE_CTX(pp->rt)));
    moe_status_t st = pp->pp->ops->send(pp->pp, pp->bufs[*buf]->t.data, pp->act_numel,
                                        pp->comm_dtype, a->peer, tag_of(pp, a), &sd->req);
    if (st != MOE_STATUS_SUCCESS)
        return moe_error_wrap(st, "pipeline stage %d/%d: starting %s of microbatch %d", pp->stage,
                              pp->stages, moe_pipeline_op_string(a->op), a->microbatch);
    sd->buf = *buf;
    sd->action = a;
    *buf = -1; /* owned by the send until it completes */
    pp->nsends++;
    return MOE_STATUS_SUCCESS;
}

/* Ordered mode: start transfers in sched->issue order, a receive at once, a send once its
 * action was reached (its buffer is ready); stop at the first send that is not. */
static moe_status_t issue_transfers(moe_pipeline_t *pp, step_state_t *ss)
{
    const moe_pipeline_schedule_t *sc = pp->sched;
    while (ss->next_issue < sc->nissue) {
        int32_t i = sc->issue[ss->next_issue];
        const moe_pipeline_action_t *a = &sc->actions[i];
        if (moe_pipe_is_recv(a->op)) {
            MOE_TRY(post_receive(pp, ss, i));
        } else {
            if (!pp->ready[i]) break;
            MOE_TRY(start_send(pp, a, &pp->recv_buf[i], ss->failed != MOE_STATUS_SUCCESS));
        }
        ss->next_issue++;
    }
    return MOE_STATUS_SUCCESS;
}

/* A send action: start it (or, in ordered mode, hand its buffer to the issue order). */
static moe_status_t send_action(moe_pipeline_t *pp, step_state_t *ss, int32_t i, int32_t *buf)
{
    const moe_pipeline_action_t *a = &pp->sched->actions[i];
    if (!pp->ordered) return start_send(pp, a, buf, ss->failed != MOE_STATUS_SUCCESS);
    pp->recv_buf[i] = *buf;
    *buf = -1;
    pp->ready[i] = 1;
    return issue_transfers(pp, ss);
}

/* Complete sends that are done (all of them, waiting, when `all`). */
static moe_status_t progress_sends(moe_pipeline_t *pp, bool all)
{
    int32_t keep = 0;
    for (int32_t i = 0; i < pp->nsends; i++) {
        pipe_send_t sd = pp->sends[i];
        bool done = false;
        if (all) {
            MOE_TRY(
                wait_req(pp, sd.req, moe_pipeline_op_string(sd.action->op), sd.action->microbatch));
            done = true;
        } else {
            moe_status_t st = moe_comm_test(pp->pp, sd.req, &done);
            if (st != MOE_STATUS_SUCCESS)
                return moe_error_wrap(st, "pipeline stage %d/%d: %s of microbatch %d", pp->stage,
                                      pp->stages, moe_pipeline_op_string(sd.action->op),
                                      sd.action->microbatch);
        }
        if (done)
            buf_release(pp, &sd.buf);
        else
            pp->sends[keep++] = sd;
    }
    pp->nsends = keep;
    return MOE_STATUS_SUCCESS;
}

/* Run a user callback unless the batch already failed here; time it. */
#define RUN_CALLBACK(pp, ss, what, mb, chunk, call)                                                \
    do {                                                                                           \
        if ((ss)->failed == MOE_STATUS_SUCCESS) {                                                  \
            double t0_ = moe_now_s();                                                              \
            moe_error_clear();                                                                     \
            moe_status_t cst_ = (call);                                                            \
            (pp)->stats.compute_seconds += moe_now_s() - t0_;                                      \
            if (cst_ != MOE_STATUS_SUCCESS)                                                        \
                record_failure((pp), (ss), cst_, (what), (mb), (chunk));                           \
        }                                                                                          \
    } while (0)

/* Execute this stage's action list. Returns a non-success status only for transfer and
 * allocation failures (callback failures are recorded in ss and drained). */
static moe_status_t run_schedule(moe_pipeline_t *pp, step_state_t *ss)
{
    const moe_pipeline_action_t *acts = pp->sched->actions;
    for (int32_t i = 0; i < pp->sched->count; i++) {
        const moe_pipeline_action_t *a = &acts[i];
        int32_t mb = a->microbatch, c = a->chunk, u = unit_of(pp, a);
        /* the model's first and last virtual stage */
        bool first = pp->stage == 0 && c == 0;
        bool last = pp->stage == pp->stages - 1 && c == pp->v - 1;
        if (pp->pp) MOE_TRY(pp->ordered ? issue_transfers(pp, ss) : post_receives(pp, ss, i));
        switch (a->op) {
        case MOE_PIPELINE_RECV_ACT:
        case MOE_PIPELINE_RECV_GRAD: {
            if (!pp->recv_req[i])
                return MOE_FAIL(MOE_STATUS_INTERNAL,
                                "pipeline stage %d/%d: %s of microbatch "
                                "%d was not issued before it is needed",
                                pp->stage, pp->stages, moe_pipeline_op_string(a->op), mb);
            MOE_TRY(wait_req(pp, pp->recv_req[i], moe_pipeline_op_string(a->op), mb));
            pp->recv_req[i] = NULL;
            ss->posted--;
            if (a->op == MOE_PIPELINE_RECV_ACT)
                pp->x_buf[u] = pp->recv_buf[i];
            else
                pp->dy_buf[u] = pp->recv_buf[i];
            pp->recv_buf[i] = -1;
            break;
        }
        case MOE_PIPELINE_FORWARD: {
            MOE_TRY(buf_acquire(pp, &pp->y_buf[u]));
            if (last) MOE_TRY(buf_acquire(pp, &pp->dy_buf[u]));
            /* pointers into the pool only after the last acquire (it may grow the table) */
            moe_tensor_t *x = pp->x_buf[u] >= 0 ? &pp->bufs[pp->x_buf[u]]->t : NULL;
            moe_tensor_t *y = &pp->bufs[pp->y_buf[u]]->t;
            if (ss->failed == MOE_STATUS_SUCCESS) pp->progress[u] = 1;
            RUN_CALLBACK(pp, ss, "forward", mb, c, pp->cb.forward(pp->cb.user, c, mb, x, y));
            if (last) {
                double l = 0.0;
                RUN_CALLBACK(pp, ss, "loss", mb, c,
                             pp->cb.loss(pp->cb.user, mb, y, &pp->bufs[pp->dy_buf[u]]->t, &l));
                ss->loss_sum += l;
                buf_release(pp, &pp->y_buf[u]);
            }
            break;
        }
        case MOE_PIPELINE_BACKWARD: {
            if (!first) MOE_TRY(buf_acquire(pp, &pp->dx_buf[u]));
            moe_tensor_t *dy = &pp->bufs[pp->dy_buf[u]]->t;
            moe_tensor_t *dx = pp->dx_buf[u] >= 0 ? &pp->bufs[pp->dx_buf[u]]->t : NULL;
            RUN_CALLBACK(pp, ss, "backward", mb, c, pp->cb.backward(pp->cb.user, c, mb, dy, dx));
            if (ss->failed == MOE_STATUS_SUCCESS) pp->progress[u] = 2;
            buf_release(pp, &pp->dy_buf[u]);
            buf_release(pp, &pp->x_buf[u]); /* the input was kept for this backward */
            break;
        }
        case MOE_PIPELINE_SEND_ACT: MOE_TRY(send_action(pp, ss, i, &pp->y_buf[u])); break;
        case MOE_PIPELINE_SEND_GRAD: MOE_TRY(send_action(pp, ss, i, &pp->dx_buf[u])); break;
        }
        if (pp->nsends) MOE_TRY(progress_sends(pp, false));
    }
    if (pp->ordered && ss->next_issue != pp->sched->nissue)
        return MOE_FAIL(MOE_STATUS_INTERNAL, "pipeline stage %d/%d: %d of %d transfers issued",
                        pp->stage, pp->stages, ss->next_issue, pp->sched->nissue);
    if (pp->nsends) MOE_TRY(progress_sends(pp, true));
    return MOE_STATUS_SUCCESS;
}

/* Every rank learns every rank's status; returns the first failing world rank or -1. */
static moe_status_t exchange_status(moe_pipeline_t *pp, moe_status_t local, int32_t *bad_rank,
                                    moe_status_t *bad_status, int32_t *bad_stage)
{
    *bad_rank = -1;
    if (!pp->world) {
        if (local != MOE_STATUS_SUCCESS) {
            *bad_rank = 0;
            *bad_status = local;
            *bad_stage = pp->stage;
        }
        return MOE_STATUS_SUCCESS;
    }
    moe_runtime_t *rt = pp->rt;
    int32_t n = rt->mesh->world_size, me = rt->mesh->world_rank;
    int32_t *v = calloc((size_t)2 * (size_t)n, sizeof *v);
    if (!v) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "status exchange of %d ranks", n);
    v[2 * me] = (int32_t)local;
    v[2 * me + 1] = pp->stage;
    size_t bytes = sizeof(int32_t) * 2 * (size_t)n;
    moe_status_t st;
    MOE_TRY_GOTO(st, MOE_OPS(rt)->copy(MOE_CTX(rt), pp->ctrl, v, bytes));
    MOE_TRY_GOTO(st, moe_comm_allreduce(pp->world, pp->ctrl, pp->ctrl, (size_t)2 * (size_t)n,
                                        MOE_COMM_I32, MOE_REDUCE_SUM));
    MOE_TRY_GOTO(st, MOE_OPS(rt)->copy(MOE_CTX(rt), v, pp->ctrl, bytes));
    for (int32_t r = 0; r < n; r++) {
        if (v[2 * r] != MOE_STATUS_SUCCESS) {
            *bad_rank = r;
            *bad_status = (moe_status_t)v[2 * r];
            *bad_stage = v[2 * r + 1];
            break;
        }
    }
fail:
    free(v);
    if (st != MOE_STATUS_SUCCESS)
        moe_error_wrap(st, "pipeline stage %d/%d: status exchange over the world", pp->stage,
                       pp->stages);
    return st;
}

/* The last stage's mean loss to every stage of this pipeline. */
static moe_status_t share_loss(moe_pipeline_t *pp, double *loss)
{
    if (!pp->pp) return MOE_STATUS_SUCCESS;
    moe_runtime_t *rt = pp->rt;
    void *dev = (char *)pp->ctrl + sizeof(int32_t) * 2 * (size_t)rt->mesh->world_size;
    MOE_TRY(MOE_OPS(rt)->copy(MOE_CTX(rt), dev, loss, sizeof *loss));
    MOE_TRY(moe_comm_broadcast(pp->pp, dev, 1, MOE_COMM_F64, pp->stages - 1));
    return MOE_OPS(rt)->copy(MOE_CTX(rt), loss, dev, sizeof *loss);
}

/* After a failed batch: let the stage drop state saved by forwards without a backward. */
static void abandon_microbatches(moe_pipeline_t *pp)
{
    if (!pp->cb.abandon) return;
    for (int32_t u = 0; u < pp->m * pp->v; u++)
        if (pp->progress[u] == 1) (void)pp->cb.abandon(pp->cb.user, u / pp->m, u % pp->m);
}

moe_status_t moe_pipeline_train_step(moe_pipeline_t *pp, double *loss)
{
    MOE_ENTRY(pp, MOE_MAGIC_PIPELINE, "pipeline");
    if (pp->broken)
        return MOE_FAIL(MOE_STATUS_ABORTED,
                        "a transfer of an earlier batch failed on stage "
                        "%d; the pp communicator is unusable",
                        pp->stage);
    step_state_t ss = {.failed = MOE_STATUS_SUCCESS};
    for (int32_t i = 0; i < pp->m * pp->v; i++) {
        pp->x_buf[i] = pp->y_buf[i] = pp->dy_buf[i] = pp->dx_buf[i] = -1;
        pp->progress[i] = 0;
    }
    for (int32_t i = 0; i < pp->sched->count; i++) {
        pp->recv_req[i] = NULL;
        pp->recv_buf[i] = -1;
        pp->ready[i] = 0;
    }
    for (int32_t i = 0; i < pp->nbufs; i++) pp->bufs[i]->busy = false;
    pp->nsends = 0;
    pp->stats.compute_seconds = pp->stats.wait_seconds = 0.0;

    if (pp->cb.zero_grad) {
        moe_error_clear();
        moe_status_t zst = pp->cb.zero_grad(pp->cb.user);
        if (zst != MOE_STATUS_SUCCESS) record_failure(pp, &ss, zst, "zero_grad", -1, 0);
    }

    double t0 = moe_now_s();
    moe_status_t st = run_schedule(pp, &ss);
    pp->stats.schedule_seconds = moe_now_s() - t0;
    if (st != MOE_STATUS_SUCCESS) {
        /* a transfer or an allocation failed: the peers' matching transfers cannot complete */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", moe_last_error());
        moe_log(&pp->rt->logger, MOE_LOG_ERROR, "%s (aborting the pp communicator)", msg);
        mark_broken(pp);
        abandon_microbatches(pp);
        return MOE_FAIL(st, "%s", msg);
    }

    int32_t bad_rank = -1, bad_stage = -1;
    moe_status_t bad_status = MOE_STATUS_SUCCESS;
    st = exchange_status(pp, ss.failed, &bad_rank, &bad_status, &bad_stage);
    if (st != MOE_STATUS_SUCCESS) {
        abandon_microbatches(pp); /* no verdict: give the unfinished units up, as on a failure */
        return st;
    }
    if (bad_rank >= 0) abandon_microbatches(pp);
    if (ss.failed != MOE_STATUS_SUCCESS) return MOE_FAIL(ss.failed, "%s", ss.message);
    if (bad_rank >= 0)
        return MOE_FAIL(MOE_STATUS_ABORTED,
                        "pipeline batch stopped: world rank %d (pp stage %d) failed with '%s'; "
                        "no optimizer step was taken",
                        bad_rank, bad_stage, moe_status_string(bad_status));

    double mean = ss.loss_sum / pp->m;
    MOE_TRY(share_loss(pp, &mean));
    if (loss) *loss = mean;

    float scale = pp->cfg.grad_scale > 0.0f ? pp->cfg.grad_scale : 1.0f / (float)pp->m;
    moe_error_clear();
    if (pp->cb.step) {
        st = pp->cb.step(pp->cb.user, scale);
        if (st != MOE_STATUS_SUCCESS)
            return moe_error_wrap(st, "pipeline stage %d/%d: step callback", pp->stage, pp->stages);
    } else if (pp->cfg.optimizer) {
        float lr = pp->cfg.lr > 0 ? pp->cfg.lr : MOE_ADAMW_LR_CONFIGURED;
        st = moe_adamw_step(pp->cfg.optimizer, lr, scale);
        if (st != MOE_STATUS_SUCCESS)
            return moe_error_wrap(st, "pipeline stage %d/%d: optimizer step", pp->stage,
                                  pp->stages);
    }
    return MOE_STATUS_SUCCESS;
}
