/*
 * The 1F1B executor with p stages as p threads of one process, connected by the in-process
 * communicator of thread_comm.h (MPI matching rules, no MPI needed: runs on every CI).
 *
 *  equivalence  L = 8 layers (dense and MoE alternating; N=6 tokens, H=8, E=4 experts,
 *               top-2, F=12) split over p = 1, 2 and 4 stages, m in {1, 3, 8}, and
 *               interleaved (p, v, m) in {(2,2,2), (2,2,6), (2,4,4), (4,2,4), (4,2,8)}, two
 *               AdamW steps: the loss, every gradient and every updated parameter equal the
 *               pp = 1 reference run in one thread (rel. err <= 1e-5; the host path is in fact
 *               bitwise equal).
 *  failures     a failing backward / loss callback on one stage stops the batch on every
 *               stage with a status (the failing stage its own, the others ABORTED naming
 *               it), quickly (no timeout involved), without an optimizer step; the next batch
 *               then succeeds. A stage that never shows up makes its neighbours fail with
 *               TIMEOUT within the transfer timeout, and the pipeline refuses further use.
 *  bubble       p = 4 stages whose forward and backward sleep for the same time: the idle
 *               fraction 1 - sum(compute) / (p * makespan) is within 0.05 of (p-1)/(m+p-1)
 *               for m in {4, 8, 16}; and interleaved with v = 2 chunks of that cost each,
 *               within 0.05 of (p-1)/(m v + p-1) for m in {4, 8}.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "pipe_model.h"
#include "test_support.h"
#include "thread_comm.h"

#define MAXP 8
#define STEPS 2

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static moe_runtime_t *host_runtime(void)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.seed = 77;
    moe_runtime_t *rt = NULL;
    TEST_OK(moe_runtime_create(&rc, &rt));
    return rt;
}

/* ---- a pipeline of threads ------------------------------------------------------------- */

typedef struct stage_ctx {
    int s, p, v; /* v: model chunks per stage (interleaved when > 1) */
    tc_world_t *pp_world, *world;
    pm_shape_t sh;
    int steps;
    int pipe_timeout_ms, comm_timeout_ms;
    const char *fail_what; /* fault injection on this stage, in step fail_step only */
    int fail_mb, fail_step;
    bool absent;  /* never calls train_step */
    bool ordered; /* NCCL-like pp communicator (in order, untagged) */
    moe_pipeline_issue_t issue;
    pthread_barrier_t *start;
    /* results */
    moe_runtime_t *rt;
    pm_chunks_t chunks;
    pm_model_t *pm; /* chunk 0 */
    moe_pipeline_t *pipe;
    moe_status_t st[4];
    char msg[4][1024];
    double loss[4], seconds[4];
} stage_ctx_t;

static void *stage_main(void *arg)
{
    stage_ctx_t *c = arg;
    c->rt = host_runtime();
    tc_attach_pipeline(c->rt, c->s, c->p,
                       tc_comm_create(c->pp_world, c->s, "pp", c->comm_timeout_ms),
                       tc_comm_create(c->world, c->s, "world", c->comm_timeout_ms));
    int v = c->v > 0 ? c->v : 1;
    c->chunks.v = v;
    for (int k = 0; k < v; k++) {
        int first, last;
        pm_split(c->sh.layers, c->p * v, k * c->p + c->s, &first, &last);
        TEST_OK(pm_model_create(c->rt, &c->sh, first, last, &c->chunks.chunk[k]));
    }
    c->pm = c->chunks.chunk[0];
    moe_pipeline_config_t pc = moe_pipeline_config_default();
    pc.virtual_stages = v;
    pc.microbatches = c->sh.m;
    pc.act_ndim = 2;
    pc.act_shape[0] = c->sh.n;
    pc.act_shape[1] = c->sh.h;
    pc.timeout_ms = c->pipe_timeout_ms;
    pc.issue = c->issue;
    moe_pipeline_callbacks_t cb = pm_chunks_callbacks(&c->chunks);
    TEST_OK(moe_pipeline_create(c->rt, &pc, &cb, &c->pipe));
    for (int k = 0; k < c->steps; k++) {
        for (int j = 0; j < v; j++) {
            c->chunks.chunk[j]->fail_what = k == c->fail_step ? c->fail_what : NULL;
            c->chunks.chunk[j]->fail_mb = c->fail_mb;
        }
        pthread_barrier_wait(c->start);
        if (c->absent) continue;
        double t0 = now();
        c->st[k] = moe_pipeline_train_step(c->pipe, &c->loss[k]);
        c->seconds[k] = now() - t0;
        snprintf(c->msg[k], sizeof c->msg[k], "%s", moe_last_error());
    }
    return NULL;
}

static void run_pipeline(stage_ctx_t *ctx, int p)
{
    tc_world_t *ppw = ctx[0].ordered ? tc_world_create_ordered(p) : tc_world_create(p);
    tc_world_t *ww = tc_world_create(p);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)p);
    pthread_t th[MAXP];
    for (int s = 0; s < p; s++) {
        ctx[s].s = s;
        ctx[s].p = p;
        ctx[s].pp_world = ppw;
        ctx[s].world = ww;
        ctx[s].start = &start;
        pthread_create(&th[s], NULL, stage_main, &ctx[s]);
    }
    for (int s = 0; s < p; s++) pthread_join(th[s], NULL);
    pthread_barrier_destroy(&start);
    /* keep the worlds alive until the stages are destroyed (free_stages) */
    ctx[0].pp_world = ppw;
    ctx[0].world = ww;
}

static void free_stages(stage_ctx_t *ctx, int p)
{
    for (int s = 0; s < p; s++) {
        TEST_OK(moe_pipeline_destroy(ctx[s].pipe));
        for (int k = 0; k < ctx[s].chunks.v; k++) pm_model_destroy(ctx[s].chunks.chunk[k]);
        tc_detach_pipeline(ctx[s].rt);
        TEST_OK(moe_runtime_destroy(ctx[s].rt));
    }
    tc_world_destroy(ctx[0].pp_world);
    tc_world_destroy(ctx[0].world);
}

static pm_shape_t small_shape(int m)
{
    pm_shape_t sh = {.n = 6,
                     .h = 8,
                     .layers = 8,
                     .moe_every = 2,
                     .experts = 4,
                     .top_k = 2,
                     .ffn = 12,
                     .m = m,
                     .seed = 4242,
                     .data_rank = 0};
    return sh;
}

/* ---- equivalence --------------------------------------------------------------------- */

static double max_err;

static void compare_layer(pm_model_t *ref, pm_model_t *pm, int layer, int kind, const char *what)
{
    float *a = NULL, *b = NULL;
    int64_t na = 0, nb = 0;
    TEST_OK(pm_layer_tensor(pm, layer, kind, &a, &na));
    TEST_OK(pm_layer_tensor(ref, layer, kind, &b, &nb));
    assert_int_equal(na, nb);
    double e = test_rel_err(a, b, na);
    double norm = 0;
    for (int64_t i = 0; i < nb; i++) norm += (double)b[i] * b[i];
    assert_true(norm > 0); /* a zero reference would make the comparison vacuous */
    if (e > max_err) max_err = e;
    if (!(e <= 1e-5)) fail_msg("layer %d %s: rel err %.3g", layer, what, e);
    free(a);
    free(b);
}

/* PREPOST over the MPI-like communicator, or (ordered) AUTO over the NCCL-like one, which
 * must pick ORDERED */
static void equivalence(int p, int v, int m, bool ordered)
{
    pm_shape_t sh = small_shape(m);
    /* reference: the whole model, one thread */
    moe_runtime_t *rrt = host_runtime();
    pm_model_t *ref = NULL;
    TEST_OK(pm_model_create(rrt, &sh, 0, sh.layers, &ref));

    stage_ctx_t ctx[MAXP];
    memset(ctx, 0, sizeof ctx);
    for (int s = 0; s < p; s++) {
        ctx[s].sh = sh;
        ctx[s].v = v;
        ctx[s].ordered = ordered;
        ctx[s].issue = ordered ? MOE_PIPELINE_ISSUE_AUTO : MOE_PIPELINE_ISSUE_PREPOST;
        ctx[s].steps = STEPS;
        ctx[s].comm_timeout_ms = 20000;
        ctx[s].fail_mb = -1;
    }
    run_pipeline(ctx, p);
    max_err = 0;
    for (int k = 0; k < STEPS; k++) {
        double rl = 0;
        TEST_OK(pm_reference_step(ref, &rl));
        for (int s = 0; s < p; s++) {
            if (ctx[s].st[k] != MOE_STATUS_SUCCESS)
                fail_msg("p=%d m=%d stage %d step %d: %s", p, m, s, k, ctx[s].msg[k]);
            double e = fabs(ctx[s].loss[k] - rl) / fabs(rl);
            if (e > max_err) max_err = e;
            if (!(e <= 1e-5))
                fail_msg("p=%d m=%d stage %d step %d: loss %.9g, reference %.9g", p, m, s, k,
                         ctx[s].loss[k], rl);
        }
    }
    int compared = 0;
    for (int s = 0; s < p; s++) {
        for (int k = 0; k < v; k++) {
            pm_model_t *pm = ctx[s].chunks.chunk[k];
            for (int layer = pm->first; layer < pm->last; layer++) {
                compare_layer(ref, pm, layer, 1, "gradient");
                compare_layer(ref, pm, layer, 0, "updated value");
                compared++;
            }
            assert_int_equal(pm->steps, STEPS);
            assert_int_equal(pm->forwards, STEPS * m);
            assert_int_equal(pm->backwards, STEPS * m);
        }
    }
    assert_int_equal(compared, sh.layers); /* every layer lives on exactly one stage */
    printf("equivalence %s p=%d v=%d m=%d: loss %.6f %.6f, max rel err vs pp=1: %.3g\n",
           ordered ? "ordered/in-order comm" : "prepost/tagged comm", p, v, m, ctx[0].loss[0],
           ctx[0].loss[1], max_err);
    free_stages(ctx, p);
    pm_model_destroy(ref);
    TEST_OK(moe_runtime_destroy(rrt));
}

static void test_equivalence(void **state)
{
    (void)state;
    for (int o = 0; o < 2; o++) {
        int ps[] = {1, 2, 4}, ms[] = {1, 3, 8};
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 3; j++) equivalence(ps[i], 1, ms[j], o);
        /* interleaved: 8 layers over p * v virtual stages, m a multiple of p */
        equivalence(2, 2, 2, o);
        equivalence(2, 2, 6, o);
        equivalence(2, 4, 4, o);
        equivalence(4, 2, 4, o);
        equivalence(4, 2, 8, o);
    }
}

/* ---- memory and posting window -------------------------------------------------------------
 * p = 4, m = 16 with dense stages: the pool of boundary buffers on stage s stays near the
 * activations 1F1B keeps alive (p - s) plus the posted receives and unfinished sends, far
 * below the m a forward-all-then-backward (GPipe) schedule would hold; and the posting window
 * (prepost 1, 2, 16) changes nothing in the results; the last run steps through
 * config.optimizer (moe_adamw_step called by the executor) instead of the step callback, with
 * the same updated weights. */

typedef struct window_ctx {
    int s, p, prepost, use_optimizer, steps;
    tc_world_t *ppw, *ww;
    pm_shape_t sh;
    moe_status_t st;
    double loss;
    int32_t buffers;
    float *w0; /* stage's first dense weight after the step */
    int64_t nw;
} window_ctx_t;

static void *window_main(void *arg)
{
    window_ctx_t *c = arg;
    moe_runtime_t *rt = host_runtime();
    tc_attach_pipeline(rt, c->s, c->p, tc_comm_create(c->ppw, c->s, "pp", 20000),
                       tc_comm_create(c->ww, c->s, "world", 20000));
    int first, last;
    pm_split(c->sh.layers, c->p, c->s, &first, &last);
    pm_model_t *pm = NULL;
    TEST_OK(pm_model_create(rt, &c->sh, first, last, &pm));
    moe_pipeline_config_t pc = moe_pipeline_config_default();
    pc.microbatches = c->sh.m;
    pc.prepost = c->prepost;
    pc.issue = MOE_PIPELINE_ISSUE_PREPOST; /* the MPI default, where the window matters */
    pc.act_ndim = 2;
    pc.act_shape[0] = c->sh.n;
    pc.act_shape[1] = c->sh.h;
    moe_pipeline_callbacks_t cb = pm_callbacks(pm);
    if (c->use_optimizer) { /* the executor calls moe_adamw_step itself */
        cb.step = NULL;
        pc.optimizer = pm->opt;
    }
    moe_pipeline_t *pipe = NULL;
    TEST_OK(moe_pipeline_create(rt, &pc, &cb, &pipe));
    c->st = moe_pipeline_train_step(pipe, &c->loss);
    c->steps = pm->steps;
    moe_pipeline_stats_t ps = {.struct_size = sizeof ps};
    TEST_OK(moe_pipeline_stats(pipe, &ps));
    c->buffers = ps.buffers;
    TEST_OK(pm_layer_tensor(pm, first, 0, &c->w0, &c->nw));
    moe_pipeline_destroy(pipe);
    pm_model_destroy(pm);
    tc_detach_pipeline(rt);
    moe_runtime_destroy(rt);
    return NULL;
}

static void test_buffers_and_window(void **state)
{
    (void)state;
    const int p = 4;
    int windows[] = {1, 2, 16};
    float *w_first[4] = {0};
    double loss_first = 0;
    for (int i = 0; i < 3; i++) {
        tc_world_t *ppw = tc_world_create(p), *ww = tc_world_create(p);
        window_ctx_t ctx[4];
        pthread_t th[4];
        for (int s = 0; s < p; s++) {
            ctx[s] = (window_ctx_t){.s = s,
                                    .p = p,
                                    .prepost = windows[i],
                                    .ppw = ppw,
                                    .ww = ww,
                                    .sh = small_shape(16),
                                    .use_optimizer = i == 2};
            ctx[s].sh.moe_every = 0; /* dense: 8 layers, 2 per stage */
            pthread_create(&th[s], NULL, window_main, &ctx[s]);
        }
        for (int s = 0; s < p; s++) pthread_join(th[s], NULL);
        for (int s = 0; s < p; s++) {
            assert_int_equal(ctx[s].st, MOE_STATUS_SUCCESS);
            /* the step callback, or (last window) config.optimizer: one AdamW step either way,
             * and the same updated weights */
            assert_int_equal(ctx[s].steps, i == 2 ? 0 : 1);
            printf("  prepost %2d: stage %d used %d boundary buffers (1F1B keeps %d "
                   "activations; m = 16)\n",
                   windows[i], s, ctx[s].buffers, p - s);
            /* held inputs (p - s, none on stage 0) + posted receives + unfinished sends + the
             * output and gradient being computed */
            int bound = (s > 0 ? p - s : 0) + windows[i] + (p - s) + 2;
            assert_true(ctx[s].buffers <= bound);
            if (windows[i] <= 2) assert_true(ctx[s].buffers < 16);
            if (i == 0) {
                w_first[s] = ctx[s].w0;
                loss_first = ctx[s].loss;
            } else {
                assert_true(ctx[s].loss == loss_first);
                assert_memory_equal(ctx[s].w0, w_first[s], (size_t)ctx[s].nw * sizeof(float));
                free(ctx[s].w0);
            }
        }
        tc_world_destroy(ppw);
        tc_world_destroy(ww);
    }
    for (int s = 0; s < p; s++) free(w_first[s]);
}

/* ---- failures ------------------------------------------------------------------------- */

static void callback_failure(int v, bool ordered, int fail_stage, const char *what, int mb,
                             moe_status_t want)
{
    int p = 4, m = 4;
    stage_ctx_t ctx[MAXP];
    memset(ctx, 0, sizeof ctx);
    for (int s = 0; s < p; s++) {
        ctx[s].sh = small_shape(m);
        ctx[s].v = v;
        ctx[s].ordered = ordered;
        ctx[s].issue = ordered ? MOE_PIPELINE_ISSUE_AUTO : MOE_PIPELINE_ISSUE_PREPOST;
        ctx[s].steps = 3; /* clean, failing (buffers then hold real data), retry */
        ctx[s].fail_step = 1;
        ctx[s].comm_timeout_ms = 20000; /* a hang would show as ~20 s, not a pass */
        ctx[s].fail_mb = mb;
        ctx[s].fail_what = s == fail_stage ? what : NULL;
    }
    run_pipeline(ctx, p);
    char expect_other[128], expect_own[128];
    snprintf(expect_other, sizeof expect_other, "world rank %d (pp stage %d)", fail_stage,
             fail_stage);
    snprintf(expect_own, sizeof expect_own, "stage %d/4: %s of microbatch %d", fail_stage, what,
             mb);
    if (v > 1 && strcmp(what, "loss") != 0) strcat(expect_own, " (chunk 0)");
    for (int s = 0; s < p; s++) {
        printf("  %s v=%d %s failing on stage %d mb %d -> stage %d: %s in %.3f s: %s\n",
               ordered ? "ordered" : "prepost", v, what, fail_stage, mb, s,
               moe_status_string(ctx[s].st[1]), ctx[s].seconds[1], ctx[s].msg[1]);
        assert_true(ctx[s].seconds[1] < 5.0);
        if (s == fail_stage) {
            assert_int_equal(ctx[s].st[1], want);
            assert_non_null(strstr(ctx[s].msg[1], expect_own));
        } else {
            assert_int_equal(ctx[s].st[1], MOE_STATUS_ABORTED);
            assert_non_null(strstr(ctx[s].msg[1], expect_other));
        }
        /* optimizer steps for the clean and the retried batch, none for the failed one */
        assert_int_equal(ctx[s].st[0], MOE_STATUS_SUCCESS);
        assert_int_equal(ctx[s].st[2], MOE_STATUS_SUCCESS);
        assert_int_equal(ctx[s].pm->steps, 2);
    }
    /* the stages after (forward failure) or before (backward failure) the failing one were
     * sent zeros, not stale buffers, for the microbatches it did not compute */
    if (strcmp(what, "forward") == 0 && fail_stage < p - 1) {
        int zeros = 0;
        for (int k = 0; k < v; k++) zeros += ctx[fail_stage + 1].chunks.chunk[k]->zero_inputs;
        assert_true(zeros >= 1);
    }
    if (strcmp(what, "backward") == 0 && fail_stage > 0) {
        int zeros = 0;
        for (int k = 0; k < v; k++) zeros += ctx[fail_stage - 1].chunks.chunk[k]->zero_inputs;
        assert_true(zeros >= 1);
    }
    /* the failed batch left no trace: the retried batch gives the loss of a clean second batch */
    pm_shape_t sh = small_shape(m);
    moe_runtime_t *rrt = host_runtime();
    pm_model_t *ref = NULL;
    TEST_OK(pm_model_create(rrt, &sh, 0, sh.layers, &ref));
    double rl0 = 0, rl = 0;
    TEST_OK(pm_reference_step(ref, &rl0));
    TEST_OK(pm_reference_step(ref, &rl));
    for (int s = 0; s < p; s++) {
        assert_true(fabs(ctx[s].loss[0] - rl0) <= 1e-5 * fabs(rl0));
        assert_true(fabs(ctx[s].loss[2] - rl) <= 1e-5 * fabs(rl));
    }
    /* a stage that had forwards without backwards released their MoE slots (else the retry
     * above would have failed with a slot in use) */
    int abandoned = 0;
    for (int k = 0; k < v; k++) abandoned += ctx[fail_stage].chunks.chunk[k]->abandoned;
    assert_true(abandoned > 0 || strcmp(what, "loss") == 0 || fail_stage == p - 1);
    pm_model_destroy(ref);
    TEST_OK(moe_runtime_destroy(rrt));
    free_stages(ctx, p);
}

static void test_callback_failures(void **state)
{
    (void)state;
    callback_failure(1, false, 2, "backward", 1, MOE_STATUS_BACKEND_ERROR);
    callback_failure(1, false, 0, "forward", 2, MOE_STATUS_BACKEND_ERROR);
    callback_failure(1, false, 3, "loss", 0, MOE_STATUS_INVALID_ARGUMENT);
    callback_failure(1, false, 1, "forward", 0, MOE_STATUS_BACKEND_ERROR);
    callback_failure(2, false, 1, "forward", 3, MOE_STATUS_BACKEND_ERROR);
    callback_failure(2, false, 3, "loss", 2, MOE_STATUS_INVALID_ARGUMENT);
    callback_failure(1, true, 2, "backward", 1, MOE_STATUS_BACKEND_ERROR);
    callback_failure(2, true, 0, "forward", 2, MOE_STATUS_BACKEND_ERROR);
}

static void test_absent_stage_times_out(void **state)
{
    (void)state;
    int p = 3, m = 4;
    stage_ctx_t ctx[MAXP];
    memset(ctx, 0, sizeof ctx);
    for (int s = 0; s < p; s++) {
        ctx[s].sh = small_shape(m);
        ctx[s].steps = 2;
        ctx[s].fail_mb = -1;
        ctx[s].absent = s == 1;
    }
    ctx[0].pipe_timeout_ms = 300; /* the executor's own deadline (polling) */
    ctx[0].comm_timeout_ms = 60000;
    ctx[2].pipe_timeout_ms = 0; /* the communicator's wait and timeout */
    ctx[2].comm_timeout_ms = 300;
    ctx[1].comm_timeout_ms = 60000;
    run_pipeline(ctx, p);
    for (int s = 0; s < p; s += 2) {
        printf("  stage 1 absent -> stage %d: %s in %.3f s: %s\n", s,
               moe_status_string(ctx[s].st[0]), ctx[s].seconds[0], ctx[s].msg[0]);
        assert_int_equal(ctx[s].st[0], MOE_STATUS_TIMEOUT);
        assert_true(ctx[s].seconds[0] >= 0.25 && ctx[s].seconds[0] < 3.0);
        assert_non_null(strstr(ctx[s].msg[0], "microbatch"));
        assert_int_equal(ctx[s].st[1], MOE_STATUS_ABORTED);
        assert_int_equal(ctx[s].pm->steps, 0);
    }
    free_stages(ctx, p);
}

/* PREPOST over an in-order, untagged communicator: a receive posted ahead of a send blocks
 * the stream the send is queued on; the stages time out instead of hanging. (This is why AUTO
 * picks ORDERED on anything but MPI.) */
static void test_prepost_on_in_order_comm_times_out(void **state)
{
    (void)state;
    int p = 2, m = 2;
    stage_ctx_t ctx[MAXP];
    memset(ctx, 0, sizeof ctx);
    for (int s = 0; s < p; s++) {
        ctx[s].sh = small_shape(m);
        ctx[s].sh.moe_every = 0;
        ctx[s].steps = 1;
        ctx[s].fail_mb = -1;
        ctx[s].ordered = true;
        ctx[s].issue = MOE_PIPELINE_ISSUE_PREPOST;
        ctx[s].comm_timeout_ms = 300;
    }
    run_pipeline(ctx, p);
    for (int s = 0; s < p; s++) {
        printf("  prepost on an in-order comm -> stage %d: %s in %.3f s\n", s,
               moe_status_string(ctx[s].st[0]), ctx[s].seconds[0]);
        assert_int_equal(ctx[s].st[0], MOE_STATUS_TIMEOUT);
        assert_true(ctx[s].seconds[0] < 3.0);
    }
    free_stages(ctx, p);
}

/* ---- bubble ----------------------------------------------------------------------------- */

typedef struct sleepy {
    double cost_s;
} sleepy_t;

static void sleep_for(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static moe_status_t sl_forward(void *u, int32_t chunk, int32_t mb, const moe_tensor_t *x,
                               moe_tensor_t *y)
{
    (void)chunk, (void)mb, (void)x, (void)y;
    sleep_for(((sleepy_t *)u)->cost_s);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t sl_backward(void *u, int32_t chunk, int32_t mb, const moe_tensor_t *dy,
                                moe_tensor_t *dx)
{
    (void)chunk, (void)mb, (void)dy, (void)dx;
    sleep_for(((sleepy_t *)u)->cost_s);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t sl_loss(void *u, int32_t mb, const moe_tensor_t *y, moe_tensor_t *dy, double *l)
{
    (void)u, (void)mb, (void)y, (void)dy;
    *l = 1.0;
    return MOE_STATUS_SUCCESS;
}

typedef struct bubble_ctx {
    int s, p, v, m, steps;
    moe_pipeline_issue_t issue;
    tc_world_t *ppw, *ww;
    pthread_barrier_t *start;
    double cost;
    double busy[8], span[8];
    moe_status_t st;
} bubble_ctx_t;

static void *bubble_main(void *arg)
{
    bubble_ctx_t *c = arg;
    moe_runtime_t *rt = host_runtime();
    tc_attach_pipeline(rt, c->s, c->p, tc_comm_create(c->ppw, c->s, "pp", 20000),
                       tc_comm_create(c->ww, c->s, "world", 20000));
    sleepy_t sl = {c->cost};
    moe_pipeline_callbacks_t cb = {
        .forward = sl_forward, .backward = sl_backward, .loss = sl_loss, .user = &sl};
    moe_pipeline_config_t pc = moe_pipeline_config_default();
    pc.microbatches = c->m;
    pc.virtual_stages = c->v;
    pc.issue = c->issue;
    pc.act_ndim = 2;
    pc.act_shape[0] = 16;
    pc.act_shape[1] = 64;
    moe_pipeline_t *pipe = NULL;
    TEST_OK(moe_pipeline_create(rt, &pc, &cb, &pipe));
    for (int k = 0; k < c->steps; k++) {
        pthread_barrier_wait(c->start);
        c->st = moe_pipeline_train_step(pipe, NULL);
        if (c->st) break;
        moe_pipeline_stats_t ps = {.struct_size = sizeof ps};
        TEST_OK(moe_pipeline_stats(pipe, &ps));
        c->busy[k] = ps.compute_seconds;
        c->span[k] = ps.schedule_seconds;
    }
    moe_pipeline_destroy(pipe);
    tc_detach_pipeline(rt);
    moe_runtime_destroy(rt);
    return NULL;
}

static void test_bubble(void **state)
{
    (void)state;
    const int p = 4, steps = 5;
    const double cost = 0.020; /* per chunk (per stage without interleaving), F and B each */
    /* plain 1F1B for m in {4, 8, 16}, then interleaved with v = 2 chunks of the same cost
     * (PREPOST over the MPI-like communicator), then ORDERED over the in-order one (NCCL-like,
     * a send completes only when its receive is at the head of the peer's queue) */
    int ms[] = {4, 8, 16, 4, 8, 8, 8}, vs[] = {1, 1, 1, 2, 2, 1, 2};
    for (int i = 0; i < 7; i++) {
        int m = ms[i], v = vs[i];
        bool ordered = i >= 5;
        tc_world_t *ppw = ordered ? tc_world_create_ordered(p) : tc_world_create(p);
        tc_world_t *ww = tc_world_create(p);
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, (unsigned)p);
        bubble_ctx_t ctx[4];
        pthread_t th[4];
        for (int s = 0; s < p; s++) {
            ctx[s] = (bubble_ctx_t){.s = s,
                                    .p = p,
                                    .v = v,
                                    .m = m,
                                    .steps = steps,
                                    .issue = ordered ? MOE_PIPELINE_ISSUE_ORDERED
                                                     : MOE_PIPELINE_ISSUE_PREPOST,
                                    .ppw = ppw,
                                    .ww = ww,
                                    .start = &start,
                                    .cost = cost};
            pthread_create(&th[s], NULL, bubble_main, &ctx[s]);
        }
        for (int s = 0; s < p; s++) pthread_join(th[s], NULL);
        double theory = (double)(p - 1) / (m * v + p - 1), idle[8];
        for (int k = 0; k < steps; k++) {
            double busy = 0, span = 0;
            for (int s = 0; s < p; s++) {
                assert_int_equal(ctx[s].st, MOE_STATUS_SUCCESS);
                busy += ctx[s].busy[k];
                if (ctx[s].span[k] > span) span = ctx[s].span[k];
            }
            idle[k] = 1.0 - busy / (p * span);
        }
        double mean = test_median(idle, steps); /* robust to one step disturbed by the machine */
        printf("bubble %s p=%d v=%d m=%2d: measured idle (median of %d) %.4f, theoretical "
               "(p-1)/(m*v+p-1) = "
               "%.4f, diff %+.4f\n",
               ordered ? "ordered" : "prepost", p, v, m, steps, mean, theory, mean - theory);
        assert_true(fabs(mean - theory) <= 0.05);
        pthread_barrier_destroy(&start);
        tc_world_destroy(ppw);
        tc_world_destroy(ww);
    }
}

/* ---- argument checks ----------------------------------------------------------------------- */

static void test_bad_arguments(void **state)
{
    (void)state;
    moe_runtime_t *rt = host_runtime();
    sleepy_t sl = {0};
    moe_pipeline_callbacks_t cb = {
        .forward = sl_forward, .backward = sl_backward, .loss = sl_loss, .user = &sl};
    moe_pipeline_config_t pc = moe_pipeline_config_default();
    moe_pipeline_t *pipe = NULL;
    /* no activation shape */
    assert_int_equal(moe_pipeline_create(rt, &pc, &cb, &pipe), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "act_ndim"));
    pc.act_ndim = 1;
    pc.act_shape[0] = 4;
    pc.microbatches = 0;
    assert_int_equal(moe_pipeline_create(rt, &pc, &cb, &pipe), MOE_STATUS_INVALID_ARGUMENT);
    pc.microbatches = 15001;
    assert_int_equal(moe_pipeline_create(rt, &pc, &cb, &pipe), MOE_STATUS_INVALID_ARGUMENT);
    pc.microbatches = 2;
    moe_pipeline_callbacks_t nol = cb;
    nol.loss = NULL; /* a single stage is the last stage */
    assert_int_equal(moe_pipeline_create(rt, &pc, &nol, &pipe), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "loss"));
    assert_int_equal(moe_pipeline_create(rt, &pc, NULL, &pipe), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_pipeline_create(NULL, &pc, &cb, &pipe), MOE_STATUS_INVALID_HANDLE);
    moe_pipeline_config_t bad = pc;
    bad.struct_size = 8;
    assert_int_equal(moe_pipeline_create(rt, &bad, &cb, &pipe), MOE_STATUS_INVALID_ARGUMENT);
    assert_null(pipe);
    /* a good one: single stage, default dtype resolves to the host's F32 */
    TEST_OK(moe_pipeline_create(rt, &pc, &cb, &pipe));
    const moe_pipeline_schedule_t *sc = NULL;
    TEST_OK(moe_pipeline_get_schedule(pipe, &sc));
    char buf[128];
    TEST_OK(moe_pipeline_schedule_to_string(sc, buf, sizeof buf, NULL));
    assert_string_equal(buf, "stage 0/1 m=2: F0 B0 F1 B1");
    double loss = 0;
    TEST_OK(moe_pipeline_train_step(pipe, &loss));
    assert_true(loss == 1.0);
    moe_pipeline_stats_t ps = {.struct_size = 4};
    assert_int_equal(moe_pipeline_stats(pipe, &ps), MOE_STATUS_INVALID_ARGUMENT);
    TEST_OK(moe_pipeline_destroy(pipe));
    assert_int_equal(moe_pipeline_destroy(NULL), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_pipeline_train_step(NULL, &loss), MOE_STATUS_INVALID_HANDLE);
    TEST_OK(moe_runtime_destroy(rt));
}

/* PIPE_TESTS=functional runs all but the timing test, PIPE_TESTS=bubble only it (CTest runs
 * the latter alone, RUN_SERIAL, so that other tests do not disturb the timing); unset: all. */
int main(void)
{
    const struct CMUnitTest functional[] = {
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_equivalence),
        cmocka_unit_test(test_callback_failures),
        cmocka_unit_test(test_absent_stage_times_out),
        cmocka_unit_test(test_buffers_and_window),
        cmocka_unit_test(test_prepost_on_in_order_comm_times_out),
    };
    const struct CMUnitTest timing[] = {
        cmocka_unit_test(test_bubble),
    };
    const char *which = getenv("PIPE_TESTS");
    int rc = 0;
    if (!which || strcmp(which, "bubble") != 0)
        rc |= cmocka_run_group_tests_name("pipeline threads", functional, NULL, NULL);
    if (!which || strcmp(which, "functional") != 0)
        rc |= cmocka_run_group_tests_name("pipeline bubble", timing, NULL, NULL);
    return rc;
}
