/* The parallel plan and the training step through the 1F1B executor (plan.h). */
#include "plan.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Seconds since t0 of a phase's work: on the CUDA backend the work enqueued so far is waited
 * for first, so each phase is charged its own GPU time rather than whichever phase syncs. */
static double phase_end(trainer_t *t, double t0)
{
    if (t->model->device != MOE_DEVICE_HOST) (void)moe_runtime_synchronize(t->rt);
    return now() - t0;
}

/* Global sequence index of sequence i of microbatch mb on this data rank (see plan.h). */
static int64_t global_sequence(const trainer_t *t, int32_t mb, int64_t i)
{
    const plan_t *p = &t->plan;
    return (int64_t)mb * (t->cfg->batch / t->cfg->microbatches) + p->data_rank * p->seqs + i;
}

/* Fill t->tokens / t->targets with microbatch mb of the current batch. */
static void load_microbatch(trainer_t *t, int32_t mb)
{
    int64_t T = t->cfg->context;
    for (int64_t i = 0; i < t->plan.seqs; i++) {
        int64_t g = global_sequence(t, mb, i);
        uint8_t *tok = t->tokens + i * T, *tgt = t->targets + i * T;
        if (t->eval) {
            int64_t count = t->cfg->eval_batches * t->cfg->batch;
            corpus_val_sequence(t->corpus, t->eval_batch * t->cfg->batch + g, count, T, tok, tgt);
        } else {
            corpus_train_sequence(t->corpus, (uint64_t)t->cfg->seed, t->step, g, T, tok, tgt);
        }
    }
}

/* Add the last forward's routing statistics of every block of a chunk. */
static void record_stats(trainer_t *t, int32_t chunk)
{
    const model_t *m = t->model;
    int64_t E = t->cfg->experts;
    int64_t *counts = malloc(sizeof *counts * (size_t)E);
    for (int64_t j = 0; j < m->blocks_per_chunk; j++) {
        const block_t *b = &m->blocks[chunk * m->blocks_per_chunk + j];
        moe_layer_stats_t s = {.struct_size = sizeof s};
        if (!counts || moe_layer_stats(b->moe, &s, counts) != MOE_STATUS_SUCCESS) continue;
        /* token counts are this rank's (tp replicas hold the same ones): tp = 0 adds them;
         * aux, z, entropy are global over ep x dp: the first data rank adds them */
        if (t->plan.tp_rank != 0) continue;
        int64_t l = b->index;
        for (int64_t e = 0; e < E; e++) t->stats.counts[l * E + e] += (double)counts[e];
        t->stats.dropped[l] += (double)s.dropped_slots;
        t->stats.slots[l] += (double)s.slots;
        if (t->plan.data_rank == 0) {
            t->stats.aux[l] += s.aux_loss / (double)t->cfg->microbatches;
            t->stats.z[l] += s.z_loss / (double)t->cfg->microbatches;
            t->stats.entropy[l] += s.entropy / (double)t->cfg->microbatches;
        }
    }
    free(counts);
}

/* ---- pipeline callbacks ------------------------------------------------------------------- */

static moe_status_t cb_forward(void *user, int32_t chunk, int32_t mb, const moe_tensor_t *x,
                               moe_tensor_t *y)
{
    trainer_t *t = user;
    double t0 = now();
    if (!x) load_microbatch(t, mb);
    moe_status_t st = model_forward(t->model, chunk, mb, t->tokens, x ? x->data : NULL, y->data);
    if (st == MOE_STATUS_SUCCESS && !t->eval) record_stats(t, chunk);
    t->times.forward += phase_end(t, t0);
    return st;
}

static moe_status_t cb_loss(void *user, int32_t mb, const moe_tensor_t *y, moe_tensor_t *dy,
                            double *loss)
{
    trainer_t *t = user;
    double t0 = now();
    load_microbatch(t, mb);
    /* the gradient of the global batch's mean (see plan.h) */
    float weight = 1.0f / (float)t->plan.data_ranks;
    moe_status_t st = model_loss(t->model, y->data, t->targets, weight, t->eval ? NULL : dy->data,
                                 loss);
    if (t->eval && st == MOE_STATUS_SUCCESS) st = model_clear(t->model, dy->data);
    t->times.loss += phase_end(t, t0);
    return st;
}

static moe_status_t cb_backward(void *user, int32_t chunk, int32_t mb, const moe_tensor_t *dy,
                                moe_tensor_t *dx)
{
    trainer_t *t = user;
    if (t->eval) { /* every rank skips the layers' backward alike: no collective is missed */
        model_release(t->model, chunk, mb);
        return dx ? model_clear(t->model, dx->data) : MOE_STATUS_SUCCESS;
    }
    double t0 = now();
    moe_status_t st = model_backward(t->model, chunk, mb, dy->data, dx ? dx->data : NULL);
    t->times.backward += phase_end(t, t0);
    return st;
}

static moe_status_t cb_zero_grad(void *user)
{
    trainer_t *t = user;
    return t->eval ? MOE_STATUS_SUCCESS : model_zero_grad(t->model);
}

static moe_status_t cb_step(void *user, float grad_scale)
{
    trainer_t *t = user;
    if (t->eval) return MOE_STATUS_SUCCESS;
    double t0 = now();
    float scale = grad_scale * (float)t->plan.data_ranks; /* undoes the group's average */
    moe_status_t st = moe_adamw_step(t->opt, MOE_ADAMW_LR_CONFIGURED, scale);
    t->times.optimizer += phase_end(t, t0);
    return st;
}

static moe_status_t cb_abandon(void *user, int32_t chunk, int32_t mb)
{
    model_release(((trainer_t *)user)->model, chunk, mb);
    return MOE_STATUS_SUCCESS;
}

/* ---- setup ---------------------------------------------------------------------------------- */

static int report(const char *what)
{
    fprintf(stderr, "moe_train: %s: %s\n", what, moe_last_error());
    return -1;
}

static int make_runtime(trainer_t *t)
{
    const trainer_config_t *c = t->cfg;
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.tp = (int32_t)c->tp;
    mc.ep = (int32_t)c->ep;
    mc.dp = (int32_t)c->dp;
    mc.pp = (int32_t)c->pp;
    mc.comm = MOE_COMM_MPI;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = !strcmp(c->backend, "cuda") ? MOE_BACKEND_CUDA : MOE_BACKEND_HOST;
    rc.seed = (uint64_t)c->seed;
    rc.mesh = &mc;
    /* a failure every rank shares (no GPU for --backend cuda) is printed once, by rank 0 */
    int ok = moe_runtime_create(&rc, &t->rt) == MOE_STATUS_SUCCESS, any_ok = 0, world_rank = 0;
    MPI_Allreduce(&ok, &any_ok, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    if (!ok) return any_ok || world_rank == 0 ? report("moe_runtime_create") : -1;
    plan_t *p = &t->plan;
    int32_t size;
    moe_runtime_axis(t->rt, MOE_AXIS_WORLD, &p->world_rank, &p->world);
    moe_runtime_axis(t->rt, MOE_AXIS_TP, &p->tp_rank, &size);
    moe_runtime_axis(t->rt, MOE_AXIS_EP, &p->ep_rank, &size);
    moe_runtime_axis(t->rt, MOE_AXIS_DP, &p->dp_rank, &size);
    moe_runtime_axis(t->rt, MOE_AXIS_PP, &p->pp_rank, &size);
    p->data_rank = p->ep_rank + (int32_t)c->ep * p->dp_rank;
    p->data_ranks = (int32_t)(c->ep * c->dp);
    p->seqs = c->batch / (c->microbatches * p->data_ranks);
    return 0;
}

static int make_optimizer(trainer_t *t)
{
    const trainer_config_t *c = t->cfg;
    moe_adamw_config_t ac = moe_adamw_config_default();
    ac.lr = (float)trainer_lr(c);
    ac.beta1 = (float)c->beta1;
    ac.beta2 = (float)c->beta2;
    ac.eps = (float)c->eps;
    ac.weight_decay = (float)c->weight_decay;
    if (moe_adamw_create(t->rt, &ac, &t->opt) != MOE_STATUS_SUCCESS)
        return report("moe_adamw_create");
    moe_lr_schedule_t ls = {.warmup_steps = c->warmup_steps,
                            .decay_steps = c->steps,
                            .min_lr_ratio = (float)c->min_lr_ratio};
    ls.decay = !strcmp(c->decay, "cosine")   ? MOE_LR_COSINE
               : !strcmp(c->decay, "linear") ? MOE_LR_LINEAR
                                             : MOE_LR_CONSTANT;
    float clip = c->grad_clip > 0 ? (float)c->grad_clip : INFINITY; /* always measured */
    if (moe_adamw_set_lr_schedule(t->opt, &ls) != MOE_STATUS_SUCCESS ||
        moe_adamw_set_grad_clip(t->opt, clip) != MOE_STATUS_SUCCESS)
        return report("optimizer schedule and clipping");
    model_t *m = t->model;
    for (int32_t i = 0; i < m->nparams; i++) {
        dense_param_t *p = m->params[i];
        moe_tensor_t v, g;
        moe_tensor_view(p->value, m->dtype, m->device, p->ndim, p->shape, &v);
        moe_tensor_view(p->grad, MOE_DTYPE_F32, m->device, p->ndim, p->shape, &g);
        v.device_index = g.device_index = m->device_index;
        if (moe_adamw_add_param(t->opt, p->name, MOE_PARAM_DENSE, &v, &g) != MOE_STATUS_SUCCESS)
            return report(p->name);
    }
    for (int64_t i = 0; i < m->chunks * m->blocks_per_chunk; i++) {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "blocks.%lld.moe.", (long long)m->blocks[i].index);
        if (moe_adamw_add_layer(t->opt, m->blocks[i].moe, prefix) != MOE_STATUS_SUCCESS)
            return report(prefix);
    }
    return 0;
}

static int make_pipeline(trainer_t *t)
{
    moe_pipeline_config_t pc = moe_pipeline_config_default();
    pc.microbatches = (int32_t)t->cfg->microbatches;
    pc.virtual_stages = (int32_t)t->cfg->virtual_stages;
    pc.act_ndim = 2;
    pc.act_shape[0] = t->model->N;
    pc.act_shape[1] = t->model->H;
    pc.act_dtype = t->model->dtype; /* the stage boundaries carry the compute dtype */
    moe_pipeline_callbacks_t cb = {.forward = cb_forward,
                                   .loss = cb_loss,
                                   .backward = cb_backward,
                                   .zero_grad = cb_zero_grad,
                                   .step = cb_step,
                                   .abandon = cb_abandon,
                                   .user = t};
    if (moe_pipeline_create(t->rt, &pc, &cb, &t->pipe) != MOE_STATUS_SUCCESS)
        return report("moe_pipeline_create");
    return 0;
}

int trainer_setup(trainer_t *t, const trainer_config_t *c, const corpus_t *corpus)
{
    memset(t, 0, sizeof *t);
    t->cfg = c;
    t->corpus = corpus;
    if (make_runtime(t)) return -1;
    if (model_create(t->rt, c, t->plan.pp_rank, (int32_t)c->pp, t->plan.seqs, &t->model)) return -1;
    if (make_optimizer(t) || make_pipeline(t)) return -1;
    int64_t N = t->model->N, L = c->layers, E = c->experts;
    t->tokens = malloc((size_t)N);
    t->targets = malloc((size_t)N);
    t->stats.counts = calloc((size_t)(L * E), sizeof(double));
    double **per_layer[] = {&t->stats.aux, &t->stats.z, &t->stats.entropy, &t->stats.dropped,
                            &t->stats.slots};
    for (size_t i = 0; i < 5; i++) *per_layer[i] = calloc((size_t)L, sizeof(double));
    return t->tokens && t->targets && t->stats.counts && t->stats.slots ? 0 : -1;
}

void trainer_teardown(trainer_t *t)
{
    moe_pipeline_destroy(t->pipe);
    moe_adamw_destroy(t->opt);
    model_destroy(t->model);
    moe_runtime_destroy(t->rt);
    free(t->tokens);
    free(t->targets);
    free(t->stats.counts);
    double *per_layer[] = {t->stats.aux, t->stats.z, t->stats.entropy, t->stats.dropped,
                           t->stats.slots};
    for (size_t i = 0; i < 5; i++) free(per_layer[i]);
    memset(t, 0, sizeof *t);
}

/* ---- steps ---------------------------------------------------------------------------------- */

/* The mean of each rank's pipeline loss over the world: every data rank appears tp x pp
 * times, so this is the mean over data ranks, i.e. over the global batch. */
static double world_mean(double v)
{
    double sum = 0;
    int n;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return sum / n;
}

static void clear_stats(trainer_t *t)
{
    int64_t L = t->cfg->layers, E = t->cfg->experts;
    memset(t->stats.counts, 0, sizeof(double) * (size_t)(L * E));
    double *per_layer[] = {t->stats.aux, t->stats.z, t->stats.entropy, t->stats.dropped,
                           t->stats.slots};
    for (size_t i = 0; i < 5; i++) memset(per_layer[i], 0, sizeof(double) * (size_t)L);
    memset(&t->times, 0, sizeof t->times);
    t->model->moe_seconds[0] = t->model->moe_seconds[1] = 0;
}

moe_status_t trainer_train_step(trainer_t *t, double *loss)
{
    clear_stats(t);
    t->eval = 0;
    t->step++;
    double local = 0;
    moe_runtime_wait_stats_t w0 = {.struct_size = sizeof w0}, w1 = w0;
    moe_status_t st = moe_runtime_wait_stats(t->rt, &w0);
    double t0 = now();
    if (t->slow_s > 0) { /* a slow device, for the straggler tests: before any collective */
        struct timespec ts = {(time_t)t->slow_s, (long)((t->slow_s - (time_t)t->slow_s) * 1e9)};
        nanosleep(&ts, NULL);
    }
    if (st == MOE_STATUS_SUCCESS) st = moe_pipeline_train_step(t->pipe, &local);
    if (st == MOE_STATUS_SUCCESS) st = moe_runtime_wait_stats(t->rt, &w1);
    if (st != MOE_STATUS_SUCCESS) {
        t->step--;
        return st;
    }
    t->times.busy = now() - t0 - (w1.wait_seconds - w0.wait_seconds);
    if (t->times.busy < 0) t->times.busy = 0;
    moe_pipeline_stats_t ps = {.struct_size = sizeof ps};
    if (moe_pipeline_stats(t->pipe, &ps) == MOE_STATUS_SUCCESS) {
        t->times.pipeline_wait = ps.wait_seconds;
        t->times.schedule = ps.schedule_seconds;
    }
    t->times.moe_forward = t->model->moe_seconds[0];
    t->times.moe_backward = t->model->moe_seconds[1];
    *loss = world_mean(local);
    return MOE_STATUS_SUCCESS;
}

moe_status_t trainer_evaluate(trainer_t *t, double *loss)
{
    double sum = 0;
    moe_status_t st;
    float *biases = model_keep_biases(t->model, &st); /* evaluation must not move them */
    if (st != MOE_STATUS_SUCCESS) return st;
    t->eval = 1;
    for (t->eval_batch = 0; t->eval_batch < t->cfg->eval_batches; t->eval_batch++) {
        double local = 0;
        st = moe_pipeline_train_step(t->pipe, &local);
        if (st != MOE_STATUS_SUCCESS) {
            t->eval = 0;
            free(biases);
            return st;
        }
        sum += local;
    }
    t->eval = 0;
    if ((st = model_put_back_biases(t->model, biases)) != MOE_STATUS_SUCCESS) return st;
    *loss = world_mean(sum / (double)t->cfg->eval_batches);
    return MOE_STATUS_SUCCESS;
}

void trainer_gather_stats(trainer_t *t)
{
    int64_t L = t->cfg->layers, E = t->cfg->experts;
    MPI_Allreduce(MPI_IN_PLACE, t->stats.counts, (int)(L * E), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    double *per_layer[] = {t->stats.aux, t->stats.z, t->stats.entropy, t->stats.dropped,
                           t->stats.slots};
    for (size_t i = 0; i < 5; i++)
        MPI_Allreduce(MPI_IN_PLACE, per_layer[i], (int)L, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
}
