/*
 * The distributed MoE layer equals one rank on the concatenated batch.
 *
 * Under mpirun with W ranks, for every mesh (tp, ep, dp, 1) of W ranks (W = 2: (1,2,1,1),
 * (2,1,1,1); W = 4: (1,4,1,1), (2,2,1,1), (1,2,2,1), (4,1,1,1), (1,1,4,1), (2,1,2,1); W = 8:
 * (2,2,2,1), ...) and every scenario below:
 *   - the global batch is D = ep*dp pieces; dense rank j = ep + EP*dp holds piece j (n_j
 *     tokens), tp ranks hold the same piece. Every rank also runs the reference: a world of
 *     one on the concatenated batch (pieces in order j = 0..D-1), same seed, same config.
 *   - forward: y_j equals the reference rows of piece j; aux and z equal the reference's;
 *     the task loss sum_j <y_j, dy_j> equals the reference's.
 *   - backward: dx_j equals the reference rows; the router gradient summed over the dense
 *     group and the expert gradients summed over edp equal the reference gradients (this
 *     rank's expert/TP shard).
 *   - two AdamW steps (grad_scale 1 distributed, which averages over D replicas; 1/D in
 *     the reference): every parameter shard equals the reference's slice.
 * Relative errors (norm of the difference / norm of the reference) must be <= 1e-5 on the
 * host backend (fp32). MOE_TEST_BACKEND=cuda runs both sides on the GPU (bf16 activations
 * and weights; bound 1e-2, the bf16 bound, except 5e-2 for the router gradient when
 * tp > 1: the tp ranks' W2 partial sums are rounded to bf16 before their all-reduce, and the
 * router gradient goes through <dy, expert output> over H = 8, which cancels; exit 77
 * without a GPU) and
 * MOE_TEST_COMM=mpi|nccl picks the communicators (default: the mesh's choice; ranks that
 * share a GPU need mpi).
 *
 * Scenarios: dropless K=2; capacity drops (cf 1.0); K=1 with capacity; K=E; skewed routing
 * (every token's first choice is expert 0) with capacity, expert bias and sigmoid scores;
 * one dense rank with zero tokens; round-robin placement with 3 chunks; two microbatches in
 * flight (forward 0, forward 1, backward 1, backward 0; the second batch is -x/2, 0.7 dy).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <mpi.h>

#include <moe/moe.h>

#include "runtime/runtime.h"
#include "test_support.h"

static int W, R, failures;
static double worst, tol = 1e-5, tol_router_tp = 1e-5;
static moe_backend_kind_t backend = MOE_BACKEND_HOST;
static moe_comm_backend_t comm = MOE_COMM_AUTO;

typedef struct scenario {
    const char *name;
    int32_t e, k;
    float cf;
    int skew, bias, sigmoid, zero_rank, round_robin, chunks, interleave;
} scenario_t;

static const scenario_t scenarios[] = {
    {"dropless K=2", 4, 2, 0, 0, 0, 0, -1, 0, 2, 0},
    {"capacity cf=1", 4, 2, 1.0f, 0, 0, 0, -1, 0, 2, 0},
    {"K=1 capacity cf=1.25", 4, 1, 1.25f, 0, 0, 0, -1, 0, 2, 0},
    {"K=E", 4, 4, 0, 0, 0, 0, -1, 0, 2, 0},
    {"skewed + capacity + bias + sigmoid", 4, 2, 1.5f, 1, 1, 1, -1, 0, 2, 0},
    {"zero-token rank + capacity", 4, 2, 1.0f, 0, 0, 0, 1, 0, 2, 0},
    {"round-robin, 3 chunks", 8, 2, 0, 0, 0, 0, -1, 1, 3, 0},
    {"two microbatches in flight + capacity", 4, 2, 1.0f, 0, 0, 0, -1, 0, 2, 1},
};

enum { H = 8, F = 8 };

static void compare_within(const char *what, const float *got, const float *ref, int64_t n,
                           const char *ctx, double bound)
{
    double e = test_rel_err(got, ref, n);
    if (getenv("MOE_TEST_VERBOSE") && e > 1e-6)
        fprintf(stderr, "rank %d: %s: %s rel err %.3g\n", R, ctx, what, e);
    if (e > worst) worst = e;
    RANK_CHECK(e <= bound, "%s: %s rel err %.3g over %lld values (bound %g)", ctx, what, e,
               (long long)n, bound);
}

static void compare(const char *what, const float *got, const float *ref, int64_t n,
                    const char *ctx)
{
    compare_within(what, got, ref, n, ctx, tol);
}

/* A tensor's values as host f32 (any device and dtype: moe_tensor_copy converts). */
static void read_f32(moe_runtime_t *rt, const moe_tensor_t *t, float *dst)
{
    moe_tensor_t v;
    TEST_OK(moe_tensor_view(dst, MOE_DTYPE_F32, MOE_DEVICE_HOST, t->ndim, t->shape, &v));
    TEST_OK(moe_tensor_copy(rt, &v, t));
}

static void write_f32(moe_runtime_t *rt, moe_tensor_t *t, float *src)
{
    moe_tensor_t v;
    TEST_OK(moe_tensor_view(src, MOE_DTYPE_F32, MOE_DEVICE_HOST, t->ndim, t->shape, &v));
    TEST_OK(moe_tensor_copy(rt, t, &v));
}

/* An activation [rows,H]: host f32 values and the tensor the layer takes (the same memory
 * on the host backend; a bf16 device copy on CUDA, moved by put/get). */
typedef struct act {
    float *host;
    moe_tensor_t t;
} act_t;

static act_t act_make(moe_runtime_t *rt, float *host, int64_t rows)
{
    act_t a = {host, {0}};
    int64_t sh[2] = {rows, H};
    if (backend == MOE_BACKEND_HOST)
        TEST_OK(moe_tensor_view(host, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &a.t));
    else
        TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, MOE_DEVICE_CUDA, 2, sh, &a.t));
    return a;
}
static void act_put(moe_runtime_t *rt, act_t *a)
{
    if (backend != MOE_BACKEND_HOST) write_f32(rt, &a->t, a->host);
}
static void act_get(moe_runtime_t *rt, act_t *a)
{
    if (backend != MOE_BACKEND_HOST) read_f32(rt, &a->t, a->host);
}
static void act_free(moe_runtime_t *rt, act_t *a)
{
    if (backend != MOE_BACKEND_HOST) TEST_OK(moe_tensor_free(rt, &a->t));
}

/* Map local element i of a parameter shard to its global flat index. */
static int64_t global_flat(moe_layer_t *l, const moe_param_info_t *p, int64_t i)
{
    int64_t idx[4];
    for (int dd = p->value.ndim - 1; dd >= 0; dd--) {
        idx[dd] = i % p->value.shape[dd];
        i /= p->value.shape[dd];
    }
    int64_t g = 0;
    for (int dd = 0; dd < p->value.ndim; dd++) {
        int64_t gi = idx[dd] + p->shard_offset[dd];
        if (dd == p->expert_dim) {
            int32_t ge;
            TEST_OK(moe_layer_expert_id(l, (int32_t)idx[dd], &ge));
            gi = ge;
        }
        g = g * p->global_shape[dd] + gi;
    }
    return g;
}

/* Compare every parameter (value, and gradient if grads) of the distributed layer with the
 * reference; gradients are first summed over their data-parallel group. */
static void compare_params(moe_runtime_t *rt, moe_layer_t *l, moe_runtime_t *rrt, moe_layer_t *ref,
                           bool grads, const char *ctx)
{
    int32_t np, nr;
    TEST_OK(moe_layer_num_params(l, &np));
    TEST_OK(moe_layer_num_params(ref, &nr));
    RANK_CHECK(np == nr, "%s: %d params vs %d", ctx, np, nr);
    for (int32_t i = 0; i < np && i < nr; i++) {
        moe_param_info_t p = {.struct_size = sizeof p}, q = {.struct_size = sizeof q};
        TEST_OK(moe_layer_param(l, i, &p));
        TEST_OK(moe_layer_param(ref, i, &q));
        if (grads && !p.grad.data) continue;
        int64_t n = moe_tensor_numel(&p.value), rn = moe_tensor_numel(&q.value);
        float *got = malloc(sizeof(float) * (size_t)(n + 1)),
              *want = malloc(sizeof(float) * (size_t)(n + 1));
        float *rsrc = malloc(sizeof(float) * (size_t)(rn + 1));
        read_f32(rt, grads ? &p.grad : &p.value, got);
        read_f32(rrt, grads ? &q.grad : &q.value, rsrc);
        if (grads) {
            moe_comm_t *c = p.kind == MOE_PARAM_DENSE ? rt->mesh->host[MOE_MESH_DENSE]
                                                      : rt->mesh->host[MOE_AXIS_EDP];
            if (c)
                TEST_OK(moe_comm_allreduce(c, got, got, (size_t)n, MOE_COMM_F32, MOE_REDUCE_SUM));
        }
        for (int64_t j = 0; j < n; j++) want[j] = rsrc[global_flat(l, &p, j)];
        char what[96];
        snprintf(what, sizeof what, "%s %s", p.name, grads ? "gradient" : "value");
        bool router_tp = grads && p.kind == MOE_PARAM_DENSE && rt->mesh->size[MOE_AXIS_TP] > 1;
        compare_within(what, got, want, n, ctx, router_tp ? tol_router_tp : tol);
        free(got);
        free(want);
        free(rsrc);
    }
}

static moe_layer_t *make_layer(moe_runtime_t *rt, const scenario_t *sc)
{
    moe_layer_config_t c = moe_layer_config_default();
    c.hidden = H;
    c.ffn_hidden = F;
    c.num_experts = sc->e;
    c.top_k = sc->k;
    c.capacity_factor = sc->cf;
    c.expert_bias = sc->bias;
    c.expert_bias_rate = 0.01f;
    c.score_fn = sc->sigmoid ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
    c.placement = sc->round_robin ? MOE_PLACEMENT_ROUND_ROBIN : MOE_PLACEMENT_CONTIGUOUS;
    c.a2a_chunks = sc->chunks;
    c.max_microbatches = 2;
    c.init_std = 0.5f;
    c.aux_loss_coef = 0.1f; /* large enough that a wrong aux gradient shows */
    c.z_loss_coef = 0.05f;
    moe_layer_t *l = NULL;
    TEST_OK(moe_layer_create(rt, &c, &l));
    if (sc->skew) { /* every token's first choice: expert 0 (x has a positive mean) */
        moe_param_info_t p = {.struct_size = sizeof p};
        TEST_OK(moe_layer_param(l, 0, &p));
        float wg[H * 64];
        read_f32(rt, &p.value, wg);
        for (int h = 0; h < H; h++) wg[h * sc->e + 0] += 2.0f;
        write_f32(rt, &p.value, wg);
    }
    return l;
}

static void run_case(int tp, int ep, int dp, const scenario_t *sc, uint64_t seed)
{
    char ctx[160];
    snprintf(ctx, sizeof ctx, "mesh (%d,%d,%d,1) [%s]", tp, ep, dp, sc->name);
    int D = ep * dp;
    /* the global batch, identical on every rank */
    test_rng_t rng = {seed};
    int64_t n[64], off[65];
    off[0] = 0;
    for (int j = 0; j < D; j++) {
        n[j] = j == sc->zero_rank ? 0 : test_rng_int(&rng, 3, 9);
        off[j + 1] = off[j] + n[j];
    }
    int64_t NT = off[D];
    float *x = malloc(sizeof(float) * (size_t)(NT * H + 1)),
          *dy = malloc(sizeof(float) * (size_t)(NT * H + 1));
    test_fill_normal(&rng, x, NT * H, 1.0);
    test_fill_normal(&rng, dy, NT * H, 1.0);
    if (sc->skew)
        for (int64_t i = 0; i < NT * H; i++) x[i] = 0.3f * x[i] + 1.0f;

    /* reference: a world of one */
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = backend;
    rc.seed = 77;
    moe_runtime_t *rrt = NULL;
    TEST_OK(moe_runtime_create(&rc, &rrt));
    moe_layer_t *ref = make_layer(rrt, sc);
    moe_adamw_t *ropt = NULL;
    TEST_OK(moe_adamw_create(rrt, NULL, &ropt));
    TEST_OK(moe_adamw_add_layer(ropt, ref, NULL));

    /* distributed */
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.tp = tp, mc.ep = ep, mc.dp = dp, mc.pp = 1;
    mc.timeout_ms = 30000;
    mc.comm = comm;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    TEST_OK(moe_runtime_create(&rc, &rt));
    moe_layer_t *l = make_layer(rt, sc);
    moe_adamw_t *opt = NULL;
    TEST_OK(moe_adamw_create(rt, NULL, &opt));
    TEST_OK(moe_adamw_add_layer(opt, l, NULL));
    compare_params(rt, l, rrt, ref, false, ctx); /* same global parameters from the seed */

    int32_t er, es, dr, ds_;
    TEST_OK(moe_runtime_axis(rt, MOE_AXIS_EP, &er, &es));
    TEST_OK(moe_runtime_axis(rt, MOE_AXIS_DP, &dr, &ds_));
    int j = er + ep * dr;
    int64_t nj = n[j];
    float *yr = malloc(sizeof(float) * (size_t)(NT * H + 1)),
          *dxr = malloc(sizeof(float) * (size_t)(NT * H + 1));
    float *y = malloc(sizeof(float) * (size_t)(nj * H + 1)),
          *dx = malloc(sizeof(float) * (size_t)(nj * H + 1));
    float *x2 = malloc(sizeof(float) * (size_t)(NT * H + 1)),
          *dy2 = malloc(sizeof(float) * (size_t)(NT * H + 1));
    /* r*: the reference's whole batch; the rest: this rank's piece j */
    act_t rax = act_make(rrt, x, NT), ray = act_make(rrt, yr, NT), rady = act_make(rrt, dy, NT),
          radx = act_make(rrt, dxr, NT), rax2 = act_make(rrt, x2, NT),
          rady2 = act_make(rrt, dy2, NT);
    act_t ax = act_make(rt, x + off[j] * H, nj), ay = act_make(rt, y, nj),
          ady = act_make(rt, dy + off[j] * H, nj), adx = act_make(rt, dx, nj),
          ax2 = act_make(rt, x2 + off[j] * H, nj), ady2 = act_make(rt, dy2 + off[j] * H, nj);
    act_put(rrt, &rax), act_put(rrt, &rady), act_put(rt, &ax), act_put(rt, &ady);

    for (int step = 1; step <= 2; step++) {
        char sctx[200];
        snprintf(sctx, sizeof sctx, "%s step %d", ctx, step);
        /* step 2 starts from step 1's gradients: discard_grad must make them irrelevant */
        moe_status_t (*start)(moe_layer_t *) = step == 1 ? moe_layer_zero_grad
                                                         : moe_layer_discard_grad;
        TEST_OK(start(ref));
        TEST_OK(start(l));
        TEST_OK(moe_layer_forward(ref, 0, &rax.t, &ray.t));
        TEST_OK(moe_layer_forward(l, 0, &ax.t, &ay.t));
        act_get(rrt, &ray), act_get(rt, &ay);
        compare("y", y, yr + off[j] * H, nj * H, sctx);
        moe_layer_stats_t s = {.struct_size = sizeof s}, rs = {.struct_size = sizeof rs};
        TEST_OK(moe_layer_stats(l, &s, NULL));
        TEST_OK(moe_layer_stats(ref, &rs, NULL));
        float terms[2] = {(float)s.aux_loss, (float)s.z_loss},
              rterms[2] = {(float)rs.aux_loss, (float)rs.z_loss};
        compare("aux and z losses", terms, rterms, 2, sctx);
        RANK_CHECK(s.capacity == rs.capacity, "%s: capacity %lld vs %lld", sctx,
                   (long long)s.capacity, (long long)rs.capacity);
        /* task loss: its error relative to sum |y dy| (the sum cancels, so relative to
         * |loss| it would measure the cancellation, not the layer) */
        double loss = 0, rloss = 0, rabs = 0;
        for (int64_t i = 0; i < nj * H; i++) loss += (double)y[i] * dy[off[j] * H + i];
        for (int64_t i = 0; i < NT * H; i++) {
            rloss += (double)yr[i] * dy[i];
            rabs += fabs((double)yr[i] * dy[i]);
        }
        if (rt->mesh->host[MOE_MESH_DENSE])
            TEST_OK(moe_comm_allreduce(rt->mesh->host[MOE_MESH_DENSE], &loss, &loss, 1,
                                       MOE_COMM_F64, MOE_REDUCE_SUM));
        double lerr = rabs > 0 ? fabs(loss - rloss) / rabs : fabs(loss - rloss);
        if (lerr > worst) worst = lerr;
        RANK_CHECK(lerr <= tol, "%s: task loss %.9g vs %.9g (error %.3g of sum |y dy|)", sctx, loss,
                   rloss, lerr);
        if (step == 1 && sc->cf > 0 && R == 0)
            fprintf(stderr, "  %s: reference dropped %lld of %lld slots\n", sctx,
                    (long long)rs.dropped_slots, (long long)rs.slots);

        if (sc->interleave) { /* a second microbatch in flight, its backward first */
            for (int64_t i = 0; i < NT * H; i++) {
                x2[i] = -0.5f * x[i];
                dy2[i] = 0.7f * dy[i];
            }
            act_put(rrt, &rax2), act_put(rrt, &rady2), act_put(rt, &ax2), act_put(rt, &ady2);
            TEST_OK(moe_layer_forward(ref, 1, &rax2.t, &ray.t));
            TEST_OK(moe_layer_forward(l, 1, &ax2.t, &ay.t));
            act_get(rrt, &ray), act_get(rt, &ay);
            compare("y (microbatch 2)", y, yr + off[j] * H, nj * H, sctx);
            TEST_OK(moe_layer_backward(ref, 1, &rady2.t, &radx.t));
            TEST_OK(moe_layer_backward(l, 1, &ady2.t, &adx.t));
            act_get(rrt, &radx), act_get(rt, &adx);
            compare("dx (microbatch 2)", dx, dxr + off[j] * H, nj * H, sctx);
        }
        TEST_OK(moe_layer_backward(ref, 0, &rady.t, &radx.t));
        TEST_OK(moe_layer_backward(l, 0, &ady.t, &adx.t));
        act_get(rrt, &radx), act_get(rt, &adx);
        compare("dx", dx, dxr + off[j] * H, nj * H, sctx);
        compare_params(rt, l, rrt, ref, true, sctx);
        TEST_OK(moe_adamw_step(ropt, 0, 1.0f / (float)D));
        TEST_OK(moe_adamw_step(opt, 0, 1.0f));
        compare_params(rt, l, rrt, ref, false, sctx);
    }
    act_t *acts[] = {&ax, &ay, &ady, &adx, &ax2, &ady2},
          *racts[] = {&rax, &ray, &rady, &radx, &rax2, &rady2};
    for (int i = 0; i < 6; i++) act_free(rt, acts[i]), act_free(rrt, racts[i]);
    TEST_OK(moe_adamw_destroy(opt));
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));
    TEST_OK(moe_adamw_destroy(ropt));
    TEST_OK(moe_layer_destroy(ref));
    TEST_OK(moe_runtime_destroy(rrt));
    free(x), free(dy), free(yr), free(dxr), free(y), free(dx), free(x2), free(dy2);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &W);
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    uint64_t seed = 12345;
    const char *v = getenv("MOE_TEST_SEED");
    if (v) seed = strtoull(v, NULL, 0);
    const char *b = getenv("MOE_TEST_BACKEND"), *cm = getenv("MOE_TEST_COMM");
    if (b && strcmp(b, "cuda") == 0) {
        backend = MOE_BACKEND_CUDA;
        tol = 1e-2;
        tol_router_tp = 5e-2;
        moe_runtime_config_t rc = moe_runtime_config_default();
        rc.backend = backend;
        moe_runtime_t *probe = NULL;
        if (moe_runtime_create(&rc, &probe) != MOE_STATUS_SUCCESS) {
            if (R == 0) fprintf(stderr, "no CUDA backend here: %s\n", moe_last_error());
            MPI_Finalize();
            return 77;
        }
        TEST_OK(moe_runtime_destroy(probe));
    }
    if (cm)
        comm = strcmp(cm, "nccl") == 0  ? MOE_COMM_NCCL
               : strcmp(cm, "mpi") == 0 ? MOE_COMM_MPI
                                        : MOE_COMM_AUTO;
    int cases = 0;
    for (int tp = 1; tp <= W; tp++)
        for (int ep = 1; ep <= W; ep++)
            for (int dp = 1; dp <= W; dp++) {
                if (tp * ep * dp != W) continue;
                for (size_t s = 0; s < sizeof scenarios / sizeof scenarios[0]; s++) {
                    if (scenarios[s].e % ep) continue;
                    if (scenarios[s].zero_rank >= ep * dp) continue;
                    run_case(tp, ep, dp, &scenarios[s],
                             seed + 1000 * s + 7 * (uint64_t)(tp + 3 * ep));
                    cases++;
                }
            }
    /* layer shapes the mesh cannot split are refused with the numbers named */
    for (int tp = 1; tp <= W; tp++) {
        if (W % tp) continue;
        int ep = W / tp;
        moe_mesh_config_t mc = moe_mesh_config_default();
        mc.tp = tp, mc.ep = ep;
        moe_runtime_config_t rc = moe_runtime_config_default();
        rc.backend = MOE_BACKEND_HOST;
        rc.mesh = &mc;
        moe_runtime_t *rt = NULL;
        TEST_OK(moe_runtime_create(&rc, &rt));
        moe_layer_config_t c = moe_layer_config_default();
        c.hidden = 4, c.ffn_hidden = 4 * tp, c.num_experts = 2 * ep, c.top_k = 1;
        char want[96];
        moe_layer_t *l = NULL;
        if (ep > 1) {
            c.num_experts = 2 * ep + 1;
            snprintf(want, sizeof want, "num_experts (%d) is not divisible by ep (%d)", 2 * ep + 1,
                     ep);
            moe_status_t st = moe_layer_create(rt, &c, &l);
            RANK_CHECK(st == MOE_STATUS_INVALID_ARGUMENT && strstr(moe_last_error(), want),
                       "E %% ep: %s: %s", moe_status_string(st), moe_last_error());
            c.num_experts = 2 * ep;
        }
        if (tp > 1) {
            c.ffn_hidden = 4 * tp + 1;
            snprintf(want, sizeof want, "ffn_hidden (%d) is not divisible by tp (%d)", 4 * tp + 1,
                     tp);
            moe_status_t st = moe_layer_create(rt, &c, &l);
            RANK_CHECK(st == MOE_STATUS_INVALID_ARGUMENT && strstr(moe_last_error(), want),
                       "F %% tp: %s: %s", moe_status_string(st), moe_last_error());
        }
        TEST_OK(moe_runtime_destroy(rt));
    }
    int total = 0;
    double w = 0;
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&worst, &w, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (R == 0)
        fprintf(stderr,
                "world %d, %s backend, comm %s: %d mesh x scenario cases, worst relative "
                "error %.3g (bound %g; router gradient with tp > 1: %g), %d failed checks\n",
                W, backend == MOE_BACKEND_HOST ? "host" : "cuda", cm ? cm : "auto", cases, w, tol,
                tol_router_tp, total);
    MPI_Finalize();
    return total ? 1 : 0;
}
