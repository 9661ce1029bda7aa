/*
 * Ranks that disagree are told so: every rank of the world fails at once with
 * INVALID_ARGUMENT naming the field, the world ranks and both values, or naming the rank whose
 * own config is invalid — never a timeout, an INTERNAL error or silent divergence.
 *
 * 4 ranks, host backend, a 20 s mesh timeout (every failure must come well before it):
 *   mesh shape     ranks 0,1 tp=2 ep=2; ranks 2,3 tp=1 ep=4 (the same world size)
 *   rank order     rank 3 "pp-dp-ep-tp", the others the default
 *   invalid mesh   rank 3 tp=0; then rank 2 tp=3 (3 ranks of a world of 4)
 *   runtime        rank 1 seed 99; then rank 2 deterministic = 0
 *   layer          (ep = 4) rank 3 num_experts 4 of 8; rank 1 top_k 1 of 2; rank 2 capacity
 *                  1.25, sigmoid scores and ffn_hidden 64; rank 0 round-robin placement;
 *                  rank 1 top_k 0 (its own config invalid)
 *   tp inputs      (tp = 2, ep = 2) rank 1 forwards 16 tokens where its tp peer forwards 32;
 *                  then 32 tokens that differ from its peer's, found by the rows they route
 *                  (naming the likely cause and MOE_CHECK_TP_INPUTS), and with
 *                  MOE_CHECK_TP_INPUTS=1 by their hash
 *   comm           rank 2 comm=MPI where the others say AUTO (host backend: both resolve to
 *                  MPI, accepted); rank 1 comm=NCCL (refused, naming the resolved values)
 *   optimizer      (ep = 4) rank 2 lr 0.002; rank 3 weight_decay 0.1 and eps 1e-6; rank 1
 *                  beta1 0.5; rank 0
 *                  beta2 2 (its own config invalid); at the first step, rank 1 alone clipping
 *                  (max_grad_norm 1), then rank 2 alone a cosine schedule
 *   pipeline       (ep = 4) rank 1 lr 0.01; rank 3 grad_scale 0.5
 * and at the end a valid runtime, so the world is still usable after all of them.
 */
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include <moe/moe.h>

#include "fault_support.h"

#define TIMEOUT_MS 20000
#define FAST_S 5.0

typedef struct setup {
    moe_mesh_config_t mesh;
    moe_runtime_config_t rt;
} setup_t;

static setup_t base(void)
{
    setup_t s = {moe_mesh_config_default(), moe_runtime_config_default()};
    s.mesh.ep = 4;
    s.mesh.timeout_ms = TIMEOUT_MS;
    s.rt.backend = MOE_BACKEND_HOST;
    return s;
}

/* Create with this rank's setup; every rank must fail fast with INVALID_ARGUMENT and a
 * message holding every needle (NULL-terminated list; this rank's own list). */
static void expect_refused(setup_t *s, const char *what, const char *const *needles)
{
    s->rt.mesh = &s->mesh;
    moe_runtime_t *rt = (moe_runtime_t *)0x1;
    double t0 = fault_now_s();
    moe_status_t st = moe_runtime_create(&s->rt, &rt);
    double dt = fault_now_s() - t0;
    const char *msg = moe_last_error();
    FCHECK(st == MOE_STATUS_INVALID_ARGUMENT, "%s: %s (%s)", what, moe_status_string(st), msg);
    FCHECK(rt == NULL, "%s: a runtime came back", what);
    FCHECK(dt < FAST_S, "%s: took %.2f s", what, dt);
    for (int i = 0; needles[i]; i++)
        FCHECK(strstr(msg, needles[i]) != NULL, "%s: message lacks '%s': %s", what, needles[i],
               msg);
    fprintf(stderr, "rank %d: %s refused after %.2f s: %s\n", fault_rank, what, dt, msg);
    if (st == MOE_STATUS_SUCCESS) moe_runtime_destroy(rt);
}

static void t_mesh_shape(void)
{
    setup_t s = base();
    s.mesh.tp = fault_rank < 2 ? 2 : 1;
    s.mesh.ep = fault_rank < 2 ? 2 : 4;
    const char *n[] = {"the mesh config differs", "tp is 1 on world rank 2 and 2 on world rank 0",
                       "ep is 2 on world rank 0 and 4 on world rank 2", NULL};
    expect_refused(&s, "mesh shape", n);
}

static void t_rank_order(void)
{
    setup_t s = base();
    if (fault_rank == 3) s.mesh.rank_order = "pp-dp-ep-tp";
    const char *n[] = {"rank_order", "is 1234 on world rank 0 and 4321 on world rank 3", NULL};
    expect_refused(&s, "rank order", n);
}

static void t_invalid_mesh(void)
{
    setup_t s = base();
    if (fault_rank == 3) s.mesh.tp = 0;
    const char *own[] = {"mesh sizes must be >= 1 (tp=0", NULL};
    const char *told[] = {"world rank 3 refused it", "mesh sizes must be >= 1 (tp=0", NULL};
    expect_refused(&s, "invalid mesh", fault_rank == 3 ? own : told);

    s = base();
    if (fault_rank == 2) s.mesh.ep = 1, s.mesh.tp = 3;
    const char *own2[] = {"= 3 ranks, but the world communicator has 4 ranks", NULL};
    const char *told2[] = {"world rank 2 refused it",
                           "= 3 ranks, but the world communicator has 4 ranks", NULL};
    expect_refused(&s, "mesh of the wrong size", fault_rank == 2 ? own2 : told2);
}

static void t_runtime(void)
{
    setup_t s = base();
    if (fault_rank == 1) s.rt.seed = 99;
    const char *n[] = {"the runtime config differs",
                       "seed is 99 on world rank 1 and 1234 on "
                       "world rank 0",
                       NULL};
    expect_refused(&s, "seed", n);

    s = base();
    if (fault_rank == 2) s.rt.deterministic = 0;
    const char *n2[] = {"deterministic is 0 on world rank 2 and 1 on world rank 0", NULL};
    expect_refused(&s, "deterministic", n2);
}

static moe_runtime_t *runtime(int tp, int ep)
{
    setup_t s = base();
    s.mesh.tp = tp;
    s.mesh.ep = ep;
    s.rt.mesh = &s.mesh;
    moe_runtime_t *rt = NULL;
    moe_status_t st = moe_runtime_create(&s.rt, &rt);
    FCHECK(st == MOE_STATUS_SUCCESS, "runtime: %s", moe_last_error());
    return st == MOE_STATUS_SUCCESS ? rt : NULL;
}

static moe_layer_config_t layer_config(void)
{
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = 16, lc.ffn_hidden = 32, lc.num_experts = 8, lc.top_k = 2;
    return lc;
}

static void expect_layer_refused(moe_runtime_t *rt, const moe_layer_config_t *lc, const char *what,
                                 const char *const *needles)
{
    moe_layer_t *layer = (moe_layer_t *)0x1;
    double t0 = fault_now_s();
    moe_status_t st = moe_layer_create(rt, lc, &layer);
    double dt = fault_now_s() - t0;
    const char *msg = moe_last_error();
    FCHECK(st == MOE_STATUS_INVALID_ARGUMENT, "%s: %s (%s)", what, moe_status_string(st), msg);
    FCHECK(layer == NULL, "%s: a layer came back", what);
    FCHECK(dt < FAST_S, "%s: took %.2f s", what, dt);
    for (int i = 0; needles[i]; i++)
        FCHECK(strstr(msg, needles[i]) != NULL, "%s: message lacks '%s': %s", what, needles[i],
               msg);
    fprintf(stderr, "rank %d: %s refused after %.2f s: %s\n", fault_rank, what, dt, msg);
    if (st == MOE_STATUS_SUCCESS) moe_layer_destroy(layer);
}

static void t_layer(void)
{
    moe_runtime_t *rt = runtime(1, 4);
    if (!rt) return;
    moe_layer_config_t lc = layer_config();
    if (fault_rank == 3) lc.num_experts = 4;
    const char *n1[] = {"the layer config differs",
                        "num_experts is 4 on world rank 3 and 8 on world rank 0", NULL};
    expect_layer_refused(rt, &lc, "num_experts", n1);

    lc = layer_config();
    if (fault_rank == 1) lc.top_k = 1;
    const char *n2[] = {"top_k is 1 on world rank 1 and 2 on world rank 0", NULL};
    expect_layer_refused(rt, &lc, "top_k", n2);

    lc = layer_config();
    if (fault_rank == 2)
        lc.capacity_factor = 1.25f, lc.score_fn = MOE_SCORE_SIGMOID, lc.ffn_hidden = 64;
    char score[96];
    snprintf(score, sizeof score, "score_fn is %d on world rank 0 and %d on world rank 2",
             (int)MOE_SCORE_SOFTMAX, (int)MOE_SCORE_SIGMOID);
    const char *n3[] = {"ffn_hidden is 32 on world rank 0 and 64 on world rank 2", score,
                        "capacity_factor is 0 on world rank 0 and 1.25 on world rank 2", NULL};
    expect_layer_refused(rt, &lc, "capacity, scores and ffn_hidden", n3);

    lc = layer_config();
    if (fault_rank == 0) lc.placement = MOE_PLACEMENT_ROUND_ROBIN;
    char place[96];
    snprintf(place, sizeof place, "placement is %d on world rank 1 and %d on world rank 0",
             (int)MOE_PLACEMENT_CONTIGUOUS, (int)MOE_PLACEMENT_ROUND_ROBIN);
    const char *n4[] = {place, NULL};
    expect_layer_refused(rt, &lc, "placement", n4);

    lc = layer_config();
    if (fault_rank == 1) lc.top_k = 0;
    const char *own[] = {"top_k is 0", NULL};
    const char *told[] = {"world rank 1 refused it", "top_k is 0", NULL};
    expect_layer_refused(rt, &lc, "invalid layer", fault_rank == 1 ? own : told);
    FCHECK(moe_runtime_destroy(rt) == MOE_STATUS_SUCCESS, "destroy: %s", moe_last_error());
}

/* One forward of 32 tokens (rank 1: `n1` tokens, its values shifted by `shift`). */
static void expect_forward_refused(moe_layer_t *layer, int n1, float shift, const char *what,
                                   const char *needle)
{
    static float x[32 * 16], y[32 * 16];
    int n = fault_rank == 1 ? n1 : 32;
    for (int i = 0; i < n * 16; i++)
        x[i] = (float)(i % 7) * 0.1f + (fault_rank == 1 ? shift : 0.0f);
    int64_t shape[2] = {n, 16};
    moe_tensor_t tx, ty;
    moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &tx);
    moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &ty);
    double t0 = fault_now_s();
    moe_status_t st = moe_layer_forward(layer, 0, &tx, &ty);
    double dt = fault_now_s() - t0;
    const char *msg = moe_last_error();
    FCHECK(st == MOE_STATUS_INVALID_ARGUMENT, "%s: %s (%s)", what, moe_status_string(st), msg);
    FCHECK(dt < FAST_S, "%s: took %.2f s", what, dt);
    FCHECK(strstr(msg, "tp ranks must be fed the same tokens") != NULL, "%s: %s", what, msg);
    FCHECK(strstr(msg, needle) != NULL, "%s: message lacks '%s': %s", what, needle, msg);
    fprintf(stderr, "rank %d: %s refused after %.2f s: %s\n", fault_rank, what, dt, msg);
    if (st == MOE_STATUS_SUCCESS) moe_layer_release_slot(layer, 0);
}

static void t_tp_inputs(void)
{
    moe_runtime_t *rt = runtime(2, 2);
    if (!rt) return;
    moe_layer_config_t lc = layer_config();
    moe_layer_t *layer = NULL;
    FCHECK(moe_layer_create(rt, &lc, &layer) == MOE_STATUS_SUCCESS, "layer: %s", moe_last_error());
    if (layer) {
        expect_forward_refused(layer, 16, 0.0f, "tp token count",
                               "tokens is 16 on world rank 1 and 32 on world rank 0");
        /* different tokens of the same count: found where they route differently */
        expect_forward_refused(layer, 32, 0.5f, "tp token contents unchecked",
                               "different tokens are the likely cause, MOE_CHECK_TP_INPUTS=1");
        moe_layer_destroy(layer);
    }
    setenv("MOE_CHECK_TP_INPUTS", "1", 1);
    layer = NULL;
    FCHECK(moe_layer_create(rt, &lc, &layer) == MOE_STATUS_SUCCESS, "layer: %s", moe_last_error());
    unsetenv("MOE_CHECK_TP_INPUTS");
    if (layer) {
        expect_forward_refused(layer, 32, 0.5f, "tp token contents",
                               "their hash (MOE_CHECK_TP_INPUTS) is");
        moe_layer_destroy(layer);
    }
    FCHECK(moe_runtime_destroy(rt) == MOE_STATUS_SUCCESS, "destroy: %s", moe_last_error());
}

/* ---- optimizer and pipeline configs ------------------------------------------------------- */

static void expect_msg(moe_status_t st, double dt, const char *what, const char *const *needles)
{
    const char *msg = moe_last_error();
    FCHECK(st == MOE_STATUS_INVALID_ARGUMENT, "%s: %s (%s)", what, moe_status_string(st), msg);
    FCHECK(dt < FAST_S, "%s: took %.2f s", what, dt);
    for (int i = 0; needles[i]; i++)
        FCHECK(strstr(msg, needles[i]) != NULL, "%s: message lacks '%s': %s", what, needles[i],
               msg);
    fprintf(stderr, "rank %d: %s refused after %.2f s: %s\n", fault_rank, what, dt, msg);
}

static void expect_adamw_refused(moe_runtime_t *rt, const moe_adamw_config_t *c, const char *what,
                                 const char *const *needles)
{
    moe_adamw_t *opt = (moe_adamw_t *)0x1;
    double t0 = fault_now_s();
    moe_status_t st = moe_adamw_create(rt, c, &opt);
    expect_msg(st, fault_now_s() - t0, what, needles);
    FCHECK(opt == NULL, "%s: an optimizer came back", what);
    if (st == MOE_STATUS_SUCCESS) moe_adamw_destroy(opt);
}

/* A valid optimizer on every rank; `set` changes this rank's clipping or schedule; the first
 * step must be refused on every rank. */
static void expect_first_step_refused(moe_runtime_t *rt, int which, const char *what,
                                      const char *const *needles)
{
    moe_adamw_t *opt = NULL;
    moe_status_t st = moe_adamw_create(rt, NULL, &opt);
    FCHECK(st == MOE_STATUS_SUCCESS, "%s: create: %s", what, moe_last_error());
    if (st != MOE_STATUS_SUCCESS) return;
    if (which == 0 && fault_rank == 1) moe_adamw_set_grad_clip(opt, 1.0f);
    if (which == 1 && fault_rank == 2) {
        moe_lr_schedule_t sc = {MOE_LR_COSINE, 10, 100, 0.1f};
        FCHECK(moe_adamw_set_lr_schedule(opt, &sc) == MOE_STATUS_SUCCESS, "schedule: %s",
               moe_last_error());
    }
    double t0 = fault_now_s();
    st = moe_adamw_step(opt, MOE_ADAMW_LR_CONFIGURED, 1.0f);
    expect_msg(st, fault_now_s() - t0, what, needles);
    moe_adamw_destroy(opt);
}

static moe_status_t nop_stage(void *u, int32_t c, int32_t mb, const moe_tensor_t *x,
                              moe_tensor_t *y)
{
    (void)u, (void)c, (void)mb, (void)x, (void)y;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t nop_loss(void *u, int32_t mb, const moe_tensor_t *y, moe_tensor_t *dy,
                             double *l)
{
    (void)u, (void)mb, (void)y, (void)dy;
    *l = 0;
    return MOE_STATUS_SUCCESS;
}

static void expect_pipeline_refused(moe_runtime_t *rt, float lr, float grad_scale, const char *what,
                                    const char *const *needles)
{
    moe_pipeline_config_t c = moe_pipeline_config_default();
    c.act_ndim = 2, c.act_shape[0] = 4, c.act_shape[1] = 16;
    c.lr = lr, c.grad_scale = grad_scale;
    moe_pipeline_callbacks_t cb = {.forward = nop_stage, .loss = nop_loss, .backward = nop_stage};
    moe_pipeline_t *pp = (moe_pipeline_t *)0x1;
    double t0 = fault_now_s();
    moe_status_t st = moe_pipeline_create(rt, &c, &cb, &pp);
    expect_msg(st, fault_now_s() - t0, what, needles);
    FCHECK(pp == NULL, "%s: a pipeline came back", what);
    if (st == MOE_STATUS_SUCCESS) moe_pipeline_destroy(pp);
}

/* comm is compared as resolved: AUTO and MPI agree on the host backend, NCCL does not. */
static void t_comm_resolved(void)
{
    moe_runtime_t *rt = NULL;
    setup_t s = base();
    if (fault_rank == 2) s.mesh.comm = MOE_COMM_MPI;
    s.rt.mesh = &s.mesh;
    moe_status_t st = moe_runtime_create(&s.rt, &rt);
    FCHECK(st == MOE_STATUS_SUCCESS, "AUTO and MPI on the host backend: %s", moe_last_error());
    if (st == MOE_STATUS_SUCCESS) moe_runtime_destroy(rt);
    s = base();
    if (fault_rank == 1) s.mesh.comm = MOE_COMM_NCCL;
    const char *n[] = {"comm (resolved: 1 MPI, 2 NCCL) is 1 on world rank 0 and 2 on world rank 1",
                       NULL};
    expect_refused(&s, "comm NCCL on one rank", n);
}

static void t_optimizer_and_pipeline(void)
{
    moe_runtime_t *rt = runtime(1, 4);
    if (!rt) return;
    moe_adamw_config_t c = moe_adamw_config_default();
    if (fault_rank == 2) c.lr = 0.002f;
    const char *n1[] = {"the optimizer config differs", "lr is", "on world rank 2", NULL};
    expect_adamw_refused(rt, &c, "optimizer lr", n1);
    c = moe_adamw_config_default();
    if (fault_rank == 3) c.weight_decay = 0.1f, c.eps = 1e-6f;
    const char *n2[] = {"weight_decay is", "eps is", "on world rank 3", NULL};
    expect_adamw_refused(rt, &c, "optimizer weight_decay and eps", n2);
    c = moe_adamw_config_default();
    if (fault_rank == 1) c.beta1 = 0.5f;
    const char *nb[] = {"beta1 is 0.5 on world rank 1", NULL};
    expect_adamw_refused(rt, &c, "optimizer beta1", nb);
    c = moe_adamw_config_default();
    if (fault_rank == 0) c.beta2 = 2.0f;
    const char *own[] = {"beta2", NULL};
    const char *told[] = {"world rank 0 refused it", "beta2", NULL};
    expect_adamw_refused(rt, &c, "invalid optimizer", fault_rank == 0 ? own : told);

    const char *n3[] = {"max_grad_norm", "0 on world rank 0 and 1 on world rank 1", NULL};
    expect_first_step_refused(rt, 0, "clipping on one rank", n3);
    const char *n4[] = {"schedule decay", "0 on world rank 0 and 2 on world rank 2", NULL};
    expect_first_step_refused(rt, 1, "a schedule on one rank", n4);

    const char *n5[] = {"the pipeline config differs", "lr (", "on world rank 1", NULL};
    expect_pipeline_refused(rt, fault_rank == 1 ? 0.01f : 0.0f, 0.0f, "pipeline lr", n5);
    const char *n6[] = {"grad_scale (", "0 on world rank 0 and 0.5 on world rank 3", NULL};
    expect_pipeline_refused(rt, 0.0f, fault_rank == 3 ? 0.5f : 0.0f, "pipeline grad_scale", n6);
    FCHECK(moe_runtime_destroy(rt) == MOE_STATUS_SUCCESS, "destroy: %s", moe_last_error());
}

int main(int argc, char **argv)
{
    fault_init(&argc, &argv, 4);
    t_mesh_shape();
    t_rank_order();
    t_invalid_mesh();
    t_runtime();
    t_layer();
    t_tp_inputs();
    t_comm_resolved();
    t_optimizer_and_pipeline();
    /* the world is still usable */
    setup_t s = base();
    s.rt.mesh = &s.mesh;
    moe_runtime_t *rt = NULL;
    moe_status_t st = moe_runtime_create(&s.rt, &rt);
    FCHECK(st == MOE_STATUS_SUCCESS, "valid runtime: %s", moe_last_error());
    if (st == MOE_STATUS_SUCCESS) {
        st = moe_runtime_destroy(rt);
        FCHECK(st == MOE_STATUS_SUCCESS, "destroy: %s", moe_last_error());
    }
    fault_verdict(NULL, 0, 1);
}
