/*
 * Global-batch balancing (aux_global_batch = 1): the aux loss's expert frequencies f_e are
 * taken over the dense group and over every microbatch since zero_grad, as each forward
 * left them, against an fp64 reference written in this file from docs/moe-layer.md.
 *
 * Shapes: H = 8 hidden, E = 4 experts, K = 2, F = 8. Under mpirun with W ranks (1 or 2),
 * for every mesh (1, ep, dp, 1) of W ranks and both score functions:
 *   - step 1, three microbatches in a 1F1B order: F0 F1 B0 F2 B1 B2. Dense rank d holds
 *     n = 3 + 2d + j tokens of microbatch j (so the slots differ per microbatch), drawn from
 *     a generator keyed by (step, j, d): every rank can build the whole global batch.
 *   - dy = 0 and z_coef = 0, so the router gradient is the aux term's alone:
 *     dWg = sum_j sum_t x_t^T g_l(t), g_q[t,e] = aux_coef * E * f^(j)_e / Nt_j, through the
 *     score function to the logits (moe-layer.md "Backward").
 *   - f^(j) = (selections of microbatches 0..j) / (their slots): microbatch 0's backward runs
 *     after microbatch 1 is routed and must still use f^(0).
 *   - stats.aux after forward j equals E * sum_e f^(j)_e P^(j)_e.
 *   - step 2 (zero_grad opens a new window): one microbatch, f is its own.
 * The router gradient summed over the dense group must equal the reference within 1e-5
 * relative (fp32), aux within 1e-5. The same run with aux_global_batch = 0 must match the
 * per-microbatch reference, and the two references must differ by more than 1e-2 (the
 * scenario tells the options apart).
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include <moe/moe.h>

#include "test_support.h"

static int W, R, failures;
static double worst;

enum { H = 8, E = 4, K = 2, F = 8, MB = 3, MAXN = 16 };
static const double AUX = 0.1;

/* Microbatch j of step `step` on dense rank d: n tokens of x. */
static int64_t tokens(int step, int j, int d) { return step == 1 ? 3 + 2 * d + j : 5 + d; }

static void batch_x(int step, int j, int d, float *x)
{
    test_rng_t rng = {.state = 0x5eedULL + 1000003ULL * (uint64_t)step + 7919ULL * (uint64_t)j +
                               104729ULL * (uint64_t)d};
    test_fill_normal(&rng, x, tokens(step, j, d) * H, 1.0);
}

/* ---- the reference --------------------------------------------------------------------- */

typedef struct ref_mb {
    int64_t nt;
    double counts[E], p[E];
} ref_mb_t;

/* Scores s and normalised q of one token from its logits. */
static void ref_scores(const float *x, const double *wg, int sigmoid, double *s, double *q)
{
    double l[E], mx = -1e300, sum = 0;
    for (int e = 0; e < E; e++) {
        l[e] = 0;
        for (int h = 0; h < H; h++) l[e] += (double)x[h] * wg[h * E + e];
        if (l[e] > mx) mx = l[e];
    }
    for (int e = 0; e < E; e++) {
        s[e] = sigmoid ? 1.0 / (1.0 + exp(-l[e])) : exp(l[e] - mx);
        sum += s[e];
    }
    for (int e = 0; e < E; e++) {
        if (!sigmoid) s[e] /= sum;
        q[e] = s[e] / (sigmoid ? sum : 1.0);
    }
}

/* Microbatch j's global selections and P over the dense group of D ranks. */
static void ref_route(int step, int j, int D, const double *wg, int sigmoid, ref_mb_t *m)
{
    memset(m, 0, sizeof *m);
    float x[MAXN * H];
    for (int d = 0; d < D; d++) {
        batch_x(step, j, d, x);
        for (int64_t t = 0; t < tokens(step, j, d); t++) {
            double s[E], q[E];
            ref_scores(x + t * H, wg, sigmoid, s, q);
            int taken[E] = {0};
            for (int k = 0; k < K; k++) { /* top-k, ties to the lower index */
                int best = -1;
                for (int e = 0; e < E; e++)
                    if (!taken[e] && (best < 0 || s[e] > s[best])) best = e;
                taken[best] = 1;
                m->counts[best] += 1;
            }
            for (int e = 0; e < E; e++) m->p[e] += q[e];
            m->nt++;
        }
    }
    for (int e = 0; e < E; e++) m->p[e] /= (double)m->nt;
}

/* Add microbatch j's aux gradient with frequencies f to dwg [H,E]. */
static void ref_grad(int step, int j, int D, const double *wg, int sigmoid, const double *f,
                     double nt, double *dwg)
{
    float x[MAXN * H];
    for (int d = 0; d < D; d++) {
        batch_x(step, j, d, x);
        for (int64_t t = 0; t < tokens(step, j, d); t++) {
            double s[E], q[E], gq[E], gl[E], ssum = 0, dot = 0;
            ref_scores(x + t * H, wg, sigmoid, s, q);
            for (int e = 0; e < E; e++) gq[e] = AUX * E * f[e] / nt;
            if (sigmoid) {
                for (int e = 0; e < E; e++) ssum += s[e], dot += gq[e] * q[e];
                for (int e = 0; e < E; e++) gl[e] = (gq[e] - dot) / ssum * s[e] * (1 - s[e]);
            } else {
                for (int e = 0; e < E; e++) dot += gq[e] * s[e];
                for (int e = 0; e < E; e++) gl[e] = s[e] * (gq[e] - dot);
            }
            for (int h = 0; h < H; h++)
                for (int e = 0; e < E; e++) dwg[h * E + e] += (double)x[t * H + h] * gl[e];
        }
    }
}

/* The reference of one step of `mbs` microbatches: the router gradient and aux per forward,
 * with f over the window (global) or the microbatch alone. */
static void ref_step(int step, int mbs, int D, const double *wg, int sigmoid, int global,
                     double *dwg, double *aux)
{
    double cum[E] = {0}, cum_slots = 0;
    memset(dwg, 0, sizeof(double) * H * E);
    for (int j = 0; j < mbs; j++) {
        ref_mb_t m;
        ref_route(step, j, D, wg, sigmoid, &m);
        double f[E], slots = (double)(m.nt * K);
        if (!global) memset(cum, 0, sizeof cum), cum_slots = 0;
        cum_slots += slots;
        aux[j] = 0;
        for (int e = 0; e < E; e++) {
            cum[e] += m.counts[e];
            f[e] = cum[e] / cum_slots;
            aux[j] += E * f[e] * m.p[e];
        }
        ref_grad(step, j, D, wg, sigmoid, f, (double)m.nt, dwg);
    }
}

/* ---- the library ------------------------------------------------------------------------- */

static void check_close(const char *what, double got, double want, const char *ctx)
{
    double e = fabs(got - want) / fmax(fabs(want), 1e-30);
    if (e > worst) worst = e;
    RANK_CHECK(e <= 1e-5, "%s: %s %.9g vs reference %.9g (rel err %.3g)", ctx, what, got, want, e);
}

static void forward(moe_layer_t *l, int step, int j, int d, int slot, float *x, float *y)
{
    int64_t sh[2] = {tokens(step, j, d), H};
    moe_tensor_t tx, ty;
    batch_x(step, j, d, x);
    TEST_OK(moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &tx));
    TEST_OK(moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &ty));
    TEST_OK(moe_layer_forward(l, slot, &tx, &ty));
}

static void backward(moe_layer_t *l, int step, int j, int d, int slot, float *dy)
{
    int64_t sh[2] = {tokens(step, j, d), H};
    moe_tensor_t tdy;
    memset(dy, 0, sizeof(float) * MAXN * H);
    TEST_OK(moe_tensor_view(dy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &tdy));
    TEST_OK(moe_layer_backward(l, slot, &tdy, NULL));
}

/* The library's aux after a forward, checked against the reference's for microbatch j. */
static void check_aux(moe_layer_t *l, double want, const char *ctx, int j)
{
    moe_layer_stats_t s = {.struct_size = sizeof s};
    TEST_OK(moe_layer_stats(l, &s, NULL));
    char what[32];
    snprintf(what, sizeof what, "aux of microbatch %d", j);
    check_close(what, s.aux_loss, want, ctx);
}

/* The router gradient summed over the dense group, against the reference. */
static void check_grad(moe_layer_t *l, const double *want, const char *ctx)
{
    moe_param_info_t p = {.struct_size = sizeof p};
    TEST_OK(moe_layer_param(l, 0, &p));
    float got[H * E], ref[H * E];
    memcpy(got, p.grad.data, sizeof got);
    MPI_Allreduce(MPI_IN_PLACE, got, H * E, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    for (int i = 0; i < H * E; i++) ref[i] = (float)want[i];
    double e = test_rel_err(got, ref, H * E);
    if (e > worst) worst = e;
    RANK_CHECK(e <= 1e-5, "%s: router gradient rel err %.3g", ctx, e);
}

static void run_case(int ep, int dp, int sigmoid, int global)
{
    char ctx[96];
    snprintf(ctx, sizeof ctx, "ep=%d dp=%d %s, aux_global_batch %d", ep, dp,
             sigmoid ? "sigmoid" : "softmax", global);
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.ep = ep, mc.dp = dp, mc.timeout_ms = 30000;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.seed = 99;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    TEST_OK(moe_runtime_create(&rc, &rt));
    moe_layer_config_t c = moe_layer_config_default();
    c.hidden = H, c.ffn_hidden = F, c.num_experts = E, c.top_k = K;
    c.score_fn = sigmoid ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
    c.aux_loss_coef = (float)AUX, c.z_loss_coef = 0;
    c.max_microbatches = MB, c.init_std = 0.5f;
    c.aux_global_batch = global;
    moe_layer_t *l = NULL;
    TEST_OK(moe_layer_create(rt, &c, &l));
    int32_t er, es, dr, ds;
    TEST_OK(moe_runtime_axis(rt, MOE_AXIS_EP, &er, &es));
    TEST_OK(moe_runtime_axis(rt, MOE_AXIS_DP, &dr, &ds));
    int d = er + ep * dr, D = ep * dp;

    moe_param_info_t p = {.struct_size = sizeof p};
    TEST_OK(moe_layer_param(l, 0, &p));
    double wg[H * E], dwg[H * E], dwg_other[H * E], aux[MB], aux_other[MB];
    for (int i = 0; i < H * E; i++) wg[i] = ((const float *)p.value.data)[i];
    ref_step(1, MB, D, wg, sigmoid, global, dwg, aux);
    ref_step(1, MB, D, wg, sigmoid, !global, dwg_other, aux_other);
    float a[H * E], b[H * E];
    for (int i = 0; i < H * E; i++) a[i] = (float)dwg[i], b[i] = (float)dwg_other[i];
    RANK_CHECK(test_rel_err(b, a, H * E) > 1e-2,
               "%s: the scenario does not tell the options apart (references differ by %.3g)", ctx,
               test_rel_err(b, a, H * E));

    float x[MAXN * H], y[MAXN * H], dy[MAXN * H];
    /* step 1: F0 F1 B0 F2 B1 B2 */
    TEST_OK(moe_layer_zero_grad(l));
    forward(l, 1, 0, d, 0, x, y);
    check_aux(l, aux[0], ctx, 0);
    forward(l, 1, 1, d, 1, x, y);
    check_aux(l, aux[1], ctx, 1);
    backward(l, 1, 0, d, 0, dy);
    forward(l, 1, 2, d, 2, x, y);
    check_aux(l, aux[2], ctx, 2);
    backward(l, 1, 1, d, 1, dy);
    backward(l, 1, 2, d, 2, dy);
    check_grad(l, dwg, ctx);
    /* step 2: a new window of one microbatch (the parameters did not change) */
    ref_step(2, 1, D, wg, sigmoid, global, dwg, aux);
    TEST_OK(moe_layer_zero_grad(l));
    forward(l, 2, 0, d, 0, x, y);
    check_aux(l, aux[0], ctx, 0);
    backward(l, 2, 0, d, 0, dy);
    snprintf(ctx + strlen(ctx), sizeof ctx - strlen(ctx), ", step 2");
    check_grad(l, dwg, ctx);
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &W);
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    int cases = 0;
    for (int ep = 1; ep <= W; ep++) {
        if (W % ep) continue;
        for (int sigmoid = 0; sigmoid <= 1; sigmoid++)
            for (int global = 1; global >= 0; global--, cases++)
                run_case(ep, W / ep, sigmoid, global);
    }
    /* a struct_size that ends before aux_global_batch gets its default 0 */
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    moe_runtime_t *rt = NULL;
    TEST_OK(moe_runtime_create(&rc, &rt));
    moe_layer_config_t c = moe_layer_config_default();
    c.hidden = H, c.ffn_hidden = F, c.num_experts = E, c.top_k = K;
    c.aux_global_batch = 7; /* past the old struct's end: must not be read */
    c.struct_size = offsetof(moe_layer_config_t, aux_global_batch);
    moe_layer_t *l = NULL;
    RANK_CHECK(moe_layer_create(rt, &c, &l) == MOE_STATUS_SUCCESS, "short config: %s",
               moe_last_error());
    moe_layer_destroy(l);
    c.struct_size = sizeof c;
    RANK_CHECK(moe_layer_create(rt, &c, &l) == MOE_STATUS_INVALID_ARGUMENT &&
                   strstr(moe_last_error(), "aux_global_batch is 7"),
               "aux_global_batch 7 refused: %s", moe_last_error());
    TEST_OK(moe_runtime_destroy(rt));
    int total = 0;
    double w = 0;
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&worst, &w, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (R == 0)
        fprintf(stderr,
                "world %d: %d cases, worst relative error %.3g (bound 1e-5), %d failed "
                "checks\n",
                W, cases, w, total);
    MPI_Finalize();
    return total ? 1 : 0;
}
