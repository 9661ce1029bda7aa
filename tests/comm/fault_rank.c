/*
 * One rank of a chaos trial (chaos.py): a small training loop on a mesh of 4 ranks (host
 * backend) that runs until a step fails or the time limit passes, then destroys everything
 * and exits on its own.
 *
 * Usage: fault_rank ep|dp|pp TIMEOUT_MS OUTDIR
 *   ep  ep = 4: layer forward (dispatch/combine all-to-all), backward, AdamW (dense reduce)
 *   dp  dp = 4: the same with the routing all-reduce and the dense and edp reductions
 *   pp  pp = 4: moe_pipeline_train_step over 4 microbatches, one layer per stage, AdamW
 * Layer: H = 16, F = 32, E = 8, K = 2, 32 tokens per rank (per microbatch on pp).
 *
 * Writes OUTDIR/ready.<rank> ("<pid>") once set up, then after a failure appends to
 * OUTDIR/rank.<rank>.log the failing call, its status and message and every destroy's status
 * and time, and exits MOE_EXIT_PEER_LOST. A loop that never fails (the time limit passed)
 * exits 0; a destroy that does not return leaves the trial to chaos.py's wall-clock limit.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <moe/moe.h>

#ifndef MOE_EXIT_PEER_LOST
#define MOE_EXIT_PEER_LOST 75
#endif

#define H 16
#define F 32
#define E 8
#define K 2
#define T 32
#define MICROBATCHES 4
#define RUN_LIMIT_S 20.0

static FILE *logf_;
static int rank_;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void note(const char *fmt, const char *what, moe_status_t st)
{
    fprintf(logf_, fmt, what, moe_status_string(st), moe_last_error());
    fflush(logf_);
}

/* ---- the model: one layer, inputs drawn from the step and microbatch -------------------- */

typedef struct model {
    moe_runtime_t *rt;
    moe_layer_t *layer;
    moe_adamw_t *opt;
    moe_pipeline_t *pipe;
    float x[MICROBATCHES][T * H], y[T * H], dy[T * H], dx[T * H];
    int64_t step;
} model_t;

static void fill_input(model_t *m, int mb, float *x)
{
    for (int i = 0; i < T * H; i++)
        x[i] = (float)(((i * 7 + mb * 13 + rank_ * 5 + (int)m->step) % 17) - 8) * 0.05f;
}

static moe_tensor_t view(float *p)
{
    int64_t shape[2] = {T, H};
    moe_tensor_t t;
    moe_tensor_view(p, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &t);
    return t;
}

/* One step of the ep / dp loop. */
static moe_status_t flat_step(model_t *m, const char **what)
{
    fill_input(m, 0, m->x[0]);
    moe_tensor_t x = view(m->x[0]), y = view(m->y), dy = view(m->dy), dx = view(m->dx);
    moe_status_t st;
    *what = "moe_layer_zero_grad";
    if ((st = moe_layer_zero_grad(m->layer)) != MOE_STATUS_SUCCESS) return st;
    *what = "moe_layer_forward";
    if ((st = moe_layer_forward(m->layer, 0, &x, &y)) != MOE_STATUS_SUCCESS) return st;
    memcpy(m->dy, m->y, sizeof m->dy); /* loss = |y|^2 / 2 */
    *what = "moe_layer_backward";
    if ((st = moe_layer_backward(m->layer, 0, &dy, &dx)) != MOE_STATUS_SUCCESS) return st;
    *what = "moe_adamw_step";
    return moe_adamw_step(m->opt, 1e-3f, 1.0f);
}

static moe_status_t cb_forward(void *user, int32_t chunk, int32_t mb, const moe_tensor_t *x,
                               moe_tensor_t *y)
{
    (void)chunk;
    model_t *m = user;
    moe_tensor_t in = x ? *x : view(m->x[mb]);
    if (!x) fill_input(m, mb, m->x[mb]);
    return moe_layer_forward(m->layer, mb, &in, y);
}

static moe_status_t cb_loss(void *user, int32_t mb, const moe_tensor_t *y, moe_tensor_t *dy,
                            double *loss)
{
    (void)user, (void)mb;
    const float *v = y->data;
    double l = 0;
    for (int i = 0; i < T * H; i++) l += 0.5 * v[i] * v[i];
    memcpy(dy->data, y->data, sizeof(float) * T * H);
    *loss = l;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cb_backward(void *user, int32_t chunk, int32_t mb, const moe_tensor_t *dy,
                                moe_tensor_t *dx)
{
    (void)chunk;
    model_t *m = user;
    return moe_layer_backward(m->layer, mb, dy, dx);
}

static moe_status_t cb_zero_grad(void *user)
{
    return moe_layer_zero_grad(((model_t *)user)->layer);
}

static moe_status_t cb_abandon(void *user, int32_t chunk, int32_t mb)
{
    (void)chunk;
    return moe_layer_release_slot(((model_t *)user)->layer, mb);
}

/* ---- setup, loop, teardown -------------------------------------------------------------- */

static moe_status_t setup(model_t *m, const char *mesh, int timeout_ms)
{
    moe_mesh_config_t mc = moe_mesh_config_default();
    if (strcmp(mesh, "ep") == 0)
        mc.ep = 4;
    else if (strcmp(mesh, "dp") == 0)
        mc.dp = 4;
    else
        mc.pp = 4;
    mc.timeout_ms = timeout_ms;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_status_t st;
    if ((st = moe_runtime_create(&rc, &m->rt)) != MOE_STATUS_SUCCESS) return st;
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = H, lc.ffn_hidden = F, lc.num_experts = E, lc.top_k = K;
    lc.capacity_factor = 1.5f;
    lc.max_microbatches = MICROBATCHES;
    if ((st = moe_layer_create(m->rt, &lc, &m->layer)) != MOE_STATUS_SUCCESS) return st;
    if ((st = moe_adamw_create(m->rt, NULL, &m->opt)) != MOE_STATUS_SUCCESS) return st;
    if ((st = moe_adamw_add_layer(m->opt, m->layer, NULL)) != MOE_STATUS_SUCCESS) return st;
    if (strcmp(mesh, "pp") != 0) return MOE_STATUS_SUCCESS;
    moe_pipeline_config_t pc = moe_pipeline_config_default();
    pc.microbatches = MICROBATCHES;
    pc.act_ndim = 2;
    pc.act_shape[0] = T;
    pc.act_shape[1] = H;
    pc.optimizer = m->opt;
    pc.lr = 1e-3f;
    moe_pipeline_callbacks_t cb = {.forward = cb_forward,
                                   .loss = cb_loss,
                                   .backward = cb_backward,
                                   .zero_grad = cb_zero_grad,
                                   .abandon = cb_abandon,
                                   .user = m};
    return moe_pipeline_create(m->rt, &pc, &cb, &m->pipe);
}

/* Destroy in reverse order of creation, logging each status and how long it took. */
static void teardown(model_t *m)
{
    struct {
        const char *name;
        moe_status_t st;
    } d[4];
    double t[4];
    double t0 = now_s();
    d[0].name = "moe_pipeline_destroy", d[0].st = moe_pipeline_destroy(m->pipe), t[0] = now_s();
    d[1].name = "moe_adamw_destroy", d[1].st = moe_adamw_destroy(m->opt), t[1] = now_s();
    d[2].name = "moe_layer_destroy", d[2].st = moe_layer_destroy(m->layer), t[2] = now_s();
    d[3].name = "moe_runtime_destroy", d[3].st = moe_runtime_destroy(m->rt), t[3] = now_s();
    for (int i = 0; i < 4; i++) {
        fprintf(logf_, "%s: %s after %.3f s%s%s\n", d[i].name, moe_status_string(d[i].st),
                t[i] - t0, i == 3 && d[i].st ? ": " : "",
                i == 3 && d[i].st ? moe_last_error() : "");
    }
    fflush(logf_);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s ep|dp|pp TIMEOUT_MS OUTDIR\n", argv[0]);
        return 2;
    }
    const char *mesh = argv[1], *dir = argv[3];
    int timeout_ms = atoi(argv[2]);
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    rank_ = r ? atoi(r) : 0;
    char path[512];
    snprintf(path, sizeof path, "%s/rank.%d.log", dir, rank_);
    logf_ = fopen(path, "w");
    if (!logf_) return 2;
    static model_t m;
    moe_status_t st = setup(&m, mesh, timeout_ms);
    if (st != MOE_STATUS_SUCCESS) {
        note("setup (%s): %s: %s\n", mesh, st);
        return 3;
    }
    snprintf(path, sizeof path, "%s/ready.%d", dir, rank_);
    FILE *ready = fopen(path, "w");
    if (!ready) return 2;
    fprintf(ready, "%d\n", (int)getpid());
    fclose(ready);

    double t0 = now_s();
    const char *what = "";
    for (m.step = 0; now_s() - t0 < RUN_LIMIT_S; m.step++) {
        if (m.pipe) {
            what = "moe_pipeline_train_step";
            st = moe_pipeline_train_step(m.pipe, NULL);
        } else {
            st = flat_step(&m, &what);
        }
        if (st != MOE_STATUS_SUCCESS) break;
    }
    if (st == MOE_STATUS_SUCCESS) {
        fprintf(logf_, "no failure in %lld steps\n", (long long)m.step);
        teardown(&m);
        return 0;
    }
    fprintf(logf_, "step %lld: ", (long long)m.step);
    note("%s failed: %s: %s\n", what, st);
    teardown(&m);
    fclose(logf_);
    return MOE_EXIT_PEER_LOST;
}
