/*
 * Every CUDA op against its host twin on fresh random inputs (seed printed; MOE_TEST_SEED
 * replays). Inputs are rounded to bf16 first so both backends see the same numbers; outputs
 * start poisoned (NaN / 0x7f7f7f7f) so an unwritten element fails.
 * Bounds: bf16 outputs (or bf16-operand GEMMs) ||gpu-ref||/||ref|| <= 1e-2; fp32 paths
 * (logits, weights, statistics, dlogits, AdamW state, weight gradients of the combine) <= 1e-5;
 * indices and counts exactly, except routing where two keys tie within 1e-6 (tie rule: the
 * lower expert index wins; a GPU choice that differs must be such a tie).
 * Shape legend: N tokens, H hidden, E experts, K top-k, F expert width, El local experts.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "kernels.h"
#include "backend/cuda/cuda_ctx.h"
#include "core/bf16.h"
#include "gpu_check.h"

static uint64_t seed;
static gpu_pair_t P;

#define HOST(op, ...) TEST_OK(P.host.ops->op(P.host.ctx, __VA_ARGS__))
#define CUDA(op, ...) TEST_OK(P.cuda.ops->op(P.cuda.ctx, __VA_ARGS__))

/* ---- router ---------------------------------------------------------------------------- */

typedef struct router_case {
    int64_t n, h;
    int32_t e, k;
    moe_score_fn_t fn;
    bool renorm, bias;
} router_case_t;

/* The host's selection key of expert j for token t (score + bias), in fp64. */
static double host_key(const router_case_t *rc, const float *logits, const float *bias, int64_t t,
                       int32_t j)
{
    const float *l = logits + t * rc->e;
    double s;
    if (rc->fn == MOE_SCORE_SOFTMAX) {
        double mx = -INFINITY, sum = 0;
        for (int32_t i = 0; i < rc->e; i++) mx = l[i] > mx ? l[i] : mx;
        for (int32_t i = 0; i < rc->e; i++) sum += exp(l[i] - mx);
        s = exp(l[j] - mx) / sum;
    } else {
        s = 1.0 / (1.0 + exp(-(double)l[j]));
    }
    return s + (bias ? bias[j] : 0.0);
}

/* big: x of every third run of 37 tokens is scaled by it (a power of 2, so bf16 stays exact;
 * 1: none) */
static void check_router(const router_case_t *rc, float big, test_rng_t *rng, gpu_pair_t *G)
{
    int64_t n = rc->n, h = rc->h, e = rc->e, k = rc->k;
    float *x = rand_f32(rng, n * h, 1.0), *wg = rand_f32(rng, h * e, 1.0 / sqrt((double)h));
    for (int64_t t = 0; big != 1 && t < n; t += 3 * 37)
        for (int64_t i = t * h; i < (t + 37 < n ? t + 37 : n) * h; i++) x[i] *= big;
    float *bias = rc->bias ? rand_f32(rng, e, 0.05) : NULL;
    void *dx_ = gpu_up_bf16(G, x, n * h), *dwg_ = gpu_up_bf16(G, wg, h * e);
    float *dbias = bias ? gpu_up_f32(G, bias, e) : NULL;
    moe_router_fwd_t probe = {.n = n,
                              .h = h,
                              .e = rc->e,
                              .x = dx_,
                              .wg = dwg_,
                              .logits = gpu_poison(G, 4 * n * e, false)};
    bool fused = moe_cuda_router_uses_fused(G->cuda.ctx, &probe);
    fprintf(stderr, "router N=%lld H=%lld E=%d K=%d %s renorm=%d bias=%d big=%g: %s\n",
            (long long)n, (long long)h, rc->e, rc->k,
            rc->fn == MOE_SCORE_SOFTMAX ? "softmax" : "sigmoid", rc->renorm, rc->bias, big,
            fused ? "fused kernel" : "GEMM + selection");

    /* host forward */
    float *logits = malloc(4 * n * e), *tw = malloc(4 * n * k), *pm = malloc(4 * e), st[2];
    int32_t *idx = malloc(4 * n * k), *counts = malloc(4 * e);
    moe_router_fwd_t hf = {.n = n,
                           .h = h,
                           .e = rc->e,
                           .k = rc->k,
                           .score_fn = rc->fn,
                           .renormalize = rc->renorm,
                           .x = x,
                           .wg = wg,
                           .bias = bias,
                           .logits = logits,
                           .topk_idx = idx,
                           .topk_w = tw,
                           .counts = counts,
                           .score_mean = pm,
                           .stats = st};
    TEST_OK(G->host.ops->router_forward(G->host.ctx, &hf));

    /* GPU forward into poisoned buffers */
    moe_router_fwd_t gf = hf;
    gf.x = dx_;
    gf.wg = dwg_;
    gf.bias = dbias;
    gf.logits = probe.logits;
    gf.topk_idx = gpu_poison(G, 4 * n * k, true);
    gf.topk_w = gpu_poison(G, 4 * n * k, false);
    gf.counts = gpu_poison(G, 4 * e, true);
    gf.score_mean = gpu_poison(G, 4 * e, false);
    gf.stats = gpu_poison(G, 8, false);
    TEST_OK(G->cuda.ops->router_forward(G->cuda.ctx, &gf));
    float *g_logits = malloc(4 * n * e), *g_tw = malloc(4 * n * k), *g_pm = malloc(4 * e), g_st[2];
    int32_t *g_idx = malloc(4 * n * k), *g_counts = malloc(4 * e);
    gpu_down_f32(G, g_logits, gf.logits, n * e);
    gpu_down_f32(G, g_tw, gf.topk_w, n * k);
    gpu_down_f32(G, g_pm, gf.score_mean, e);
    gpu_down_f32(G, g_st, gf.stats, 2);
    gpu_down_i32(G, g_idx, gf.topk_idx, n * k);
    gpu_down_i32(G, g_counts, gf.counts, e);

    /* deterministic: a second run gives the same bits */
    {
        float *again = malloc(4 * n * e), st2[2], *pm2 = malloc(4 * e);
        TEST_OK(G->cuda.ops->router_forward(G->cuda.ctx, &gf));
        gpu_down_f32(G, again, gf.logits, n * e);
        assert_memory_equal(again, g_logits, 4 * n * e);
        gpu_down_f32(G, again, gf.topk_w, n * k);
        assert_memory_equal(again, g_tw, 4 * n * k);
        gpu_down_f32(G, pm2, gf.score_mean, e);
        assert_memory_equal(pm2, g_pm, 4 * e);
        gpu_down_f32(G, st2, gf.stats, 2);
        assert_memory_equal(st2, g_st, sizeof st2);
        free(again);
        free(pm2);
    }
    check_close("logits", g_logits, logits, n * e, 1e-5);
    int64_t ties = 0;
    for (int64_t t = 0; t < n; t++) {
        bool same = true;
        for (int32_t j = 0; j < k; j++) {
            int32_t a = g_idx[t * k + j], b = idx[t * k + j];
            assert_true(a >= 0 && a < e);
            if (a == b) continue;
            same = false;
            double ka = host_key(rc, logits, bias, t, a), kb = host_key(rc, logits, bias, t, b);
            if (fabs(ka - kb) > 1e-6 * (1 + fabs(kb)))
                fail_msg("token %lld choice %d: GPU expert %d (key %.9g) vs host %d (key %.9g)",
                         (long long)t, j, a, ka, b, kb);
        }
        if (!same) {
            ties++;
            /* a near-tie swapped: compare this token's weights as the host would give them */
            memcpy(g_tw + t * k, tw + t * k, 4 * k);
        }
    }
    fprintf(stderr, "  routing: %lld of %lld tokens differ, all within the tie tolerance\n",
            (long long)ties, (long long)n);
    check_close("topk_w", g_tw, tw, n * k, 1e-5);
    if (ties == 0)
        for (int32_t j = 0; j < e; j++) assert_int_equal(g_counts[j], counts[j]);
    check_close("score_mean", g_pm, pm, e, 1e-5);
    fprintf(stderr, "  host z %.6g, entropy %.6g\n", st[0], st[1]);
    check_close("stats (z, entropy)", g_st, st, 2, 1e-5);

    /* backward, both from the host's forward results so they see identical inputs */
    float *d_tw = rand_f32(rng, n * k, 1.0);
    float *dx_h = rand_f32(rng, n * h, 0.01), *dwg_h = rand_f32(rng, h * e, 0.01);
    void *dx_g = gpu_up_bf16(G, dx_h, n * h);
    float *dwg_g = gpu_up_f32(G, dwg_h, h * e);
    float *dl_h = malloc(4 * n * e);
    moe_router_bwd_t hb = {.n = n,
                           .h = h,
                           .e = rc->e,
                           .k = rc->k,
                           .score_fn = rc->fn,
                           .renormalize = rc->renorm,
                           .x = x,
                           .wg = wg,
                           .logits = logits,
                           .topk_idx = idx,
                           .topk_w = tw,
                           .d_topk_w = d_tw,
                           .counts = counts,
                           .aux_coef = 0.3f,
                           .z_coef = 0.2f,
                           .dlogits = dl_h,
                           .dx = dx_h,
                           .dwg = dwg_h};
    TEST_OK(G->host.ops->router_backward(G->host.ctx, &hb));
    moe_router_bwd_t gb = hb;
    gb.x = dx_;
    gb.wg = dwg_;
    gb.logits = gpu_up_f32(G, logits, n * e);
    gb.topk_idx = gpu_up_i32(G, idx, n * k);
    gb.topk_w = gpu_up_f32(G, tw, n * k);
    gb.d_topk_w = gpu_up_f32(G, d_tw, n * k);
    gb.counts = gpu_up_i32(G, counts, e);
    gb.dlogits = gpu_poison(G, 4 * n * e, false);
    gb.dx = dx_g;
    gb.dwg = dwg_g;
    TEST_OK(G->cuda.ops->router_backward(G->cuda.ctx, &gb));
    float *g_dl = malloc(4 * n * e), *g_dx = malloc(4 * n * h), *g_dwg = malloc(4 * h * e);
    gpu_down_f32(G, g_dl, gb.dlogits, n * e);
    gpu_down_bf16(G, g_dx, gb.dx, n * h);
    gpu_down_f32(G, g_dwg, gb.dwg, h * e);
    check_close("dlogits", g_dl, dl_h, n * e, 1e-5);
    check_close("dx (+=, bf16)", g_dx, dx_h, n * h, 1e-2);
    check_close("dwg (+=, bf16 operands)", g_dwg, dwg_h, h * e, 1e-2);
    /* overwrite_dx: dx written over poison (NaN on the host, 0x7f7f on the GPU) */
    for (int64_t i = 0; i < n * h; i++) dx_h[i] = NAN;
    hb.overwrite_dx = gb.overwrite_dx = true;
    gb.dx = gpu_poison(G, 2 * n * h, false);
    TEST_OK(G->host.ops->router_backward(G->host.ctx, &hb));
    TEST_OK(G->cuda.ops->router_backward(G->cuda.ctx, &gb));
    gpu_down_bf16(G, g_dx, gb.dx, n * h);
    check_close("dx (overwritten, bf16)", g_dx, dx_h, n * h, 1e-2);
    gpu_free(G, gb.dx);

    void *dev[] = {dx_,
                   dwg_,
                   dbias,
                   gf.logits,
                   gf.topk_idx,
                   gf.topk_w,
                   gf.counts,
                   gf.score_mean,
                   gf.stats,
                   dx_g,
                   dwg_g,
                   (void *)gb.logits,
                   (void *)gb.topk_idx,
                   (void *)gb.topk_w,
                   (void *)gb.d_topk_w,
                   (void *)gb.counts,
                   gb.dlogits};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gpu_free(G, dev[i]);
    void *hostp[] = {x,    wg,    bias,     logits, tw,   pm,    idx,  counts, g_logits, g_tw,
                     g_pm, g_idx, g_counts, d_tw,   dx_h, dwg_h, dl_h, g_dl,   g_dx,     g_dwg};
    for (size_t i = 0; i < sizeof hostp / sizeof hostp[0]; i++) free(hostp[i]);
}

static void run_router_case(const router_case_t *rc, test_rng_t *rng, gpu_pair_t *G)
{
    check_router(rc, 1, rng, G);
}

/* logits in the hundreds: z sums past the fixed-point range of the GPU's per-expert words,
 * which take the spill */
static void run_router_big_case(const router_case_t *rc, test_rng_t *rng, gpu_pair_t *G)
{
    check_router(rc, 64, rng, G);
}

typedef void (*router_run_t)(const router_case_t *rc, test_rng_t *rng, gpu_pair_t *G);

/* Every case through both forward paths: the fused kernel wherever it applies, and the cuBLAS
 * GEMM + selection kernel (auto picks one of the two by size). */
static void each_router_path(const router_case_t *cases, size_t count, test_rng_t *rng,
                             router_run_t run)
{
    const char *modes[] = {"fused", "gemm"};
    for (int m = 0; m < 2; m++) {
        setenv("MOE_CUDA_ROUTER", modes[m], 1);
        gpu_pair_t G;
        gpu_pair_init(&G);
        for (size_t i = 0; i < count; i++) run(&cases[i], rng, &G);
        gpu_pair_free(&G);
    }
    unsetenv("MOE_CUDA_ROUTER");
}

static void test_router(void **state)
{
    (void)state;
    test_rng_t rng = {seed};
    const router_case_t cases[] = {
        {300, 72, 16, 2, MOE_SCORE_SOFTMAX, true, false},
        {257, 128, 64, 4, MOE_SCORE_SIGMOID, true, true},
        {130, 40, 256, 8, MOE_SCORE_SOFTMAX, false, true},
        {65, 64, 300, 3, MOE_SCORE_SIGMOID, false, false},
        {1000, 256, 8, 1, MOE_SCORE_SOFTMAX, true, false},
        /* E % 4 != 0: scalar loads and stores instead of float4 */
        {333, 96, 10, 3, MOE_SCORE_SIGMOID, true, true},
        {200, 64, 37, 2, MOE_SCORE_SOFTMAX, true, false},
        /* larger: several groups of blocks in the in-kernel reduction; 16 and 32 lanes per token */
        {4096, 512, 128, 4, MOE_SCORE_SOFTMAX, true, true},
        {2100, 520, 160, 6, MOE_SCORE_SIGMOID, true, true},
        /* 7 passes per warp (the grid is sized to one wave), a partly filled last block */
        {20000, 64, 256, 8, MOE_SCORE_SOFTMAX, true, true},
        /* for the fused kernel: partial last tiles, hidden sizes that end inside a 64-wide
         * tile, E = 8 ... 64 (1 to 8 lanes a token); it runs one block a 128-token tile above
         * 4224 tokens and splits H over clusters of 2 blocks on 64-token tiles above 2048,
         * of 4 blocks on 128-token tiles below. The next case leaves blocks 1-3 of each
         * cluster without hidden tiles and, in the last tile of 20 rows, without rows; the two
         * after it split into 2: H=200 in 2 + 2 hidden tiles (the last one partial), a last
         * tile of 56 rows (32 + 24); H=64, the second block without hidden tiles, a last tile
         * of 4 rows */
        {276, 56, 32, 2, MOE_SCORE_SOFTMAX, true, true},
        {3000, 200, 64, 4, MOE_SCORE_SIGMOID, true, true},
        {2500, 64, 48, 3, MOE_SCORE_SOFTMAX, true, false},
        {20000, 200, 48, 6, MOE_SCORE_SIGMOID, true, true},
        {40000, 136, 64, 2, MOE_SCORE_SOFTMAX, true, true},
        {777, 1032, 24, 3, MOE_SCORE_SOFTMAX, false, false},
        {17000, 40, 16, 2, MOE_SCORE_SIGMOID, false, true},
        /* few tokens and a long H (16 and 33 hidden tiles, the last one partial) */
        {1000, 1024, 64, 4, MOE_SCORE_SOFTMAX, true, true},
        {1500, 2056, 32, 4, MOE_SCORE_SIGMOID, true, false},
    };
    each_router_path(cases, sizeof cases / sizeof cases[0], &rng, run_router_case);
}

/* A NaN logit makes its token's scores NaN, so P_e of every expert and both statistics must
 * come out NaN on both backends (the GPU's fixed-point P_e sums flag it), and the next forward,
 * on finite data, must not inherit it from the accumulators the launches share. */
static void run_router_nan_case(const router_case_t *rc, test_rng_t *rng, gpu_pair_t *G)
{
    int64_t n = rc->n, h = rc->h, e = rc->e, k = rc->k;
    fprintf(stderr, "router with a NaN, N=%lld H=%lld E=%d K=%d %s\n", (long long)n, (long long)h,
            rc->e, rc->k, rc->fn == MOE_SCORE_SOFTMAX ? "softmax" : "sigmoid");
    float *wg = rand_f32(rng, h * e, 1.0 / sqrt((double)h));
    void *dwg = gpu_up_bf16(G, wg, h * e);
    float *logits = malloc(4 * n * e), *tw = malloc(4 * n * k), st[2], g_st[2];
    float pm[MOE_ROUTER_MAX_E], g_pm[MOE_ROUTER_MAX_E];
    int32_t *idx = malloc(4 * n * k), *counts = malloc(4 * e);
    moe_router_fwd_t hf = {.n = n,
                           .h = h,
                           .e = rc->e,
                           .k = rc->k,
                           .score_fn = rc->fn,
                           .renormalize = rc->renorm,
                           .wg = wg,
                           .logits = logits,
                           .topk_idx = idx,
                           .topk_w = tw,
                           .counts = counts,
                           .score_mean = pm,
                           .stats = st};
    moe_router_fwd_t gf = hf;
    gf.wg = dwg;
    gf.logits = gpu_poison(G, 4 * n * e, false);
    gf.topk_idx = gpu_poison(G, 4 * n * k, true);
    gf.topk_w = gpu_poison(G, 4 * n * k, false);
    gf.counts = gpu_poison(G, 4 * e, true);
    for (int pass = 0; pass < 2; pass++) { /* with a NaN, then finite */
        float *x = rand_f32(rng, n * h, 1.0);
        if (pass == 0) x[(n / 3) * h + h / 2] = NAN;
        void *dx = gpu_up_bf16(G, x, n * h);
        hf.x = x;
        TEST_OK(G->host.ops->router_forward(G->host.ctx, &hf));
        gf.x = dx;
        gf.score_mean = gpu_poison(G, 4 * e, false);
        gf.stats = gpu_poison(G, 8, false);
        TEST_OK(G->cuda.ops->router_forward(G->cuda.ctx, &gf));
        gpu_down_f32(G, g_pm, gf.score_mean, e);
        gpu_down_f32(G, g_st, gf.stats, 2);
        if (pass == 0) {
            for (int32_t j = 0; j < e; j++) {
                assert_true(isnan(pm[j]));
                assert_true(isnan(g_pm[j]));
            }
            for (int i = 0; i < 2; i++) {
                assert_true(isnan(st[i]));
                assert_true(isnan(g_st[i]));
            }
        } else {
            check_close("score_mean after the NaN", g_pm, pm, e, 1e-5);
            check_close("stats after the NaN", g_st, st, 2, 1e-5);
        }
        gpu_free(G, dx);
        gpu_free(G, gf.score_mean);
        gpu_free(G, gf.stats);
        free(x);
    }
    void *dev[] = {dwg, gf.logits, gf.topk_idx, gf.topk_w, gf.counts};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gpu_free(G, dev[i]);
    free(wg);
    free(logits);
    free(tw);
    free(idx);
    free(counts);
}

static void test_router_nan(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 1};
    /* the fused kernel split over clusters of 4 and of 2 (E <= 64), and E = 256 (GEMM +
     * selection only), all with the per-expert words; the ticket's NaN bits (many tokens) */
    const router_case_t cases[] = {
        {300, 64, 32, 2, MOE_SCORE_SOFTMAX, true, false},
        {2500, 64, 48, 3, MOE_SCORE_SIGMOID, true, false},
        {1000, 64, 256, 8, MOE_SCORE_SOFTMAX, true, false},
        {9000, 64, 32, 2, MOE_SCORE_SOFTMAX, true, false},
    };
    each_router_path(cases, sizeof cases / sizeof cases[0], &rng, run_router_nan_case);
}

static void test_router_large_logits(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 2};
    /* the statistics through the per-expert words (split into clusters of 2, and E = 256), and
     * through the ticket (many tokens) */
    const router_case_t cases[] = {
        {3000, 200, 64, 4, MOE_SCORE_SOFTMAX, true, true},
        {1000, 64, 256, 8, MOE_SCORE_SOFTMAX, true, false},
        {20000, 64, 48, 3, MOE_SCORE_SOFTMAX, true, false},
    };
    each_router_path(cases, sizeof cases / sizeof cases[0], &rng, run_router_big_case);
}

/* ---- plan ------------------------------------------------------------------------------ */

/* global: the distributed layer's plan, with other ranks' selections ahead (first, random in
 * 0..capacity) and the experts' rows in a shuffled order */
static void run_plan_case(int64_t n, int32_t e, int32_t k, int64_t capacity, bool global,
                          test_rng_t *rng)
{
    fprintf(stderr, "plan N=%lld E=%d K=%d capacity=%lld%s\n", (long long)n, e, k,
            (long long)capacity, global ? " (first, row order)" : "");
    int64_t s = n * k;
    int32_t *idx = malloc(4 * s);
    test_fill_routing(rng, idx, n, e, k);
    int32_t *ros = malloc(4 * s), *sor = malloc(4 * s), *kept = malloc(4 * e);
    /* the summary the plan brings to the host is the kept counts themselves here */
    int32_t *hk = malloc(4 * e), *g_hk = malloc(4 * e);
    int32_t *first = malloc(4 * (size_t)e), *order = malloc(4 * (size_t)e);
    for (int32_t j = 0; j < e; j++)
        first[j] = (int32_t)(test_rng_uniform(rng) * (double)(capacity + 1));
    test_fill_permutation(rng, order, e);
    moe_plan_t hp = {.n = n,
                     .e = e,
                     .k = k,
                     .capacity = capacity,
                     .topk_idx = idx,
                     .first = global ? first : NULL,
                     .row_order = global ? order : NULL,
                     .row_of_slot = ros,
                     .slot_of_row = sor,
                     .kept = kept,
                     .summary = kept,
                     .summary_bytes = 4 * (size_t)e,
                     .host_summary = hk};
    TEST_OK(P.host.ops->plan(P.host.ctx, &hp));
    moe_plan_t gp = hp;
    gp.topk_idx = gpu_up_i32(&P, idx, s);
    gp.first = global ? gpu_up_i32(&P, first, e) : NULL;
    gp.row_order = global ? gpu_up_i32(&P, order, e) : NULL;
    gp.row_of_slot = gpu_poison(&P, 4 * s, true);
    gp.slot_of_row = gpu_poison(&P, 4 * s, true);
    gp.kept = gpu_poison(&P, 4 * e, true);
    gp.summary = gp.kept;
    gp.host_summary = g_hk;
    TEST_OK(P.cuda.ops->plan(P.cuda.ctx, &gp));
    int32_t *g_ros = malloc(4 * s), *g_sor = malloc(4 * s), *g_kept = malloc(4 * e);
    gpu_down_i32(&P, g_ros, gp.row_of_slot, s);
    gpu_down_i32(&P, g_sor, gp.slot_of_row, s);
    gpu_down_i32(&P, g_kept, gp.kept, e);
    int64_t rows = 0;
    for (int32_t j = 0; j < e; j++) {
        assert_int_equal(g_kept[j], kept[j]);
        assert_int_equal(g_hk[j], hk[j]);
        rows += kept[j];
    }
    assert_memory_equal(g_ros, ros, 4 * s);
    assert_memory_equal(g_sor, sor, 4 * rows);
    fprintf(stderr, "  %lld rows kept of %lld slots: identical\n", (long long)rows, (long long)s);
    if (global) {
        gpu_free(&P, (void *)gp.first);
        gpu_free(&P, (void *)gp.row_order);
    } else { /* padding is the single-rank layout's (expert order, nothing ahead) */
        /* the same plan re-laid with a fixed stride per expert (3 filler rows past the largest) */
        int64_t stride = 3;
        for (int32_t j = 0; j < e; j++) stride = kept[j] + 3 > stride ? kept[j] + 3 : stride;
        size_t padded = (size_t)(e * stride);
        int32_t *pad = malloc(4 * padded), *g_pad = malloc(4 * padded);
        moe_pad_plan_t ha = {.n = n,
                             .e = e,
                             .k = k,
                             .stride = stride,
                             .topk_idx = idx,
                             .kept = kept,
                             .slot_of_row = sor,
                             .row_of_slot = ros,
                             .padded_slot_of_row = pad};
        TEST_OK(P.host.ops->pad_plan(P.host.ctx, &ha));
        moe_pad_plan_t ga = {.n = n,
                             .e = e,
                             .k = k,
                             .stride = stride,
                             .topk_idx = gp.topk_idx,
                             .kept = gp.kept,
                             .slot_of_row = gp.slot_of_row,
                             .row_of_slot = gp.row_of_slot,
                             .padded_slot_of_row = gpu_poison(&P, 4 * padded, true)};
        TEST_OK(P.cuda.ops->pad_plan(P.cuda.ctx, &ga));
        gpu_down_i32(&P, g_ros, ga.row_of_slot, s);
        gpu_down_i32(&P, g_pad, ga.padded_slot_of_row, (int64_t)padded);
        assert_memory_equal(g_ros, ros, 4 * s);
        assert_memory_equal(g_pad, pad, 4 * padded);
        fprintf(stderr, "  padded to %lld rows per expert: identical\n", (long long)stride);
        gpu_free(&P, ga.padded_slot_of_row);
        free(pad);
        free(g_pad);
    }
    gpu_free(&P, (void *)gp.topk_idx);
    gpu_free(&P, gp.row_of_slot);
    gpu_free(&P, gp.slot_of_row);
    gpu_free(&P, gp.kept);
    void *hostp[] = {idx, ros, sor, kept, hk, g_hk, g_ros, g_sor, g_kept, first, order};
    for (size_t i = 0; i < sizeof hostp / sizeof hostp[0]; i++) free(hostp[i]);
}

static void test_plan(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 1};
    run_plan_case(3001, 8, 2, -1, false, &rng);
    run_plan_case(3001, 8, 2, 500, false, &rng);
    run_plan_case(20000, 64, 4, -1, false, &rng);
    run_plan_case(20000, 64, 4, 1000, false, &rng);
    run_plan_case(777, 300, 8, 12, false, &rng);
    run_plan_case(5, 16, 2, -1, false, &rng);
    run_plan_case(20000, 64, 4, 1000, true, &rng);
    run_plan_case(3001, 8, 2, -1, true, &rng); /* dropless: only the order matters */
    run_plan_case(777, 300, 8, 12, true, &rng);
}

/* ---- gather / combine ------------------------------------------------------------------- */

static void run_rows_case(int64_t n, int32_t k, int64_t h, test_rng_t *rng)
{
    fprintf(stderr, "rows N=%lld K=%d H=%lld\n", (long long)n, k, (long long)h);
    int64_t s = n * k;
    /* a permutation of the slots with ~1/8 dropped */
    int32_t *ros = malloc(4 * s), *sor = malloc(4 * s);
    int64_t rows = 0;
    for (int64_t i = 0; i < s; i++) {
        if (test_rng_uniform(rng) < 0.125) {
            ros[i] = -1;
            continue;
        }
        sor[rows++] = (int32_t)i;
    }
    for (int64_t i = rows - 1; i > 0; i--) { /* shuffle the row order */
        int64_t j = test_rng_int(rng, 0, i);
        int32_t t = sor[i];
        sor[i] = sor[j];
        sor[j] = t;
    }
    for (int64_t r = 0; r < rows; r++) ros[sor[r]] = (int32_t)r;
    float *x = rand_f32(rng, n * h, 1.0), *w = rand_f32(rng, s, 1.0),
          *src = rand_f32(rng, rows * h, 1.0);
    float *dy = rand_f32(rng, n * h, 1.0);
    void *gx = gpu_up_bf16(&P, x, n * h), *gsrc = gpu_up_bf16(&P, src, rows * h);
    void *gdy = gpu_up_bf16(&P, dy, n * h);
    float *gw = gpu_up_f32(&P, w, s);
    int32_t *gros = gpu_up_i32(&P, ros, s), *gsor = gpu_up_i32(&P, sor, rows);
    float *ref = malloc(4 * (n + rows) * h), *got = malloc(4 * (n + rows) * h);

    for (int scaled = 0; scaled < 2; scaled++) {
        void *out = gpu_poison(&P, 2 * rows * h, false);
        HOST(gather_rows, ref, x, sor, k, scaled ? w : NULL, rows, h);
        CUDA(gather_rows, out, gx, gsor, k, scaled ? gw : NULL, rows, h);
        gpu_down_bf16(&P, got, out, rows * h);
        check_close(scaled ? "gather_rows (scaled)" : "gather_rows", got, ref, rows * h, 1e-2);
        gpu_free(&P, out);

        /* filler rows (slot -1, a padded layout's) come out as zeros over the poison */
        int32_t *fsor = malloc(4 * (size_t)(rows + 1));
        for (int64_t r = 0; r < rows; r++) fsor[r] = r % 7 == 3 ? -1 : sor[r];
        int32_t *gfsor = gpu_up_i32(&P, fsor, rows);
        out = gpu_poison(&P, 2 * rows * h, false);
        HOST(gather_rows, ref, x, fsor, k, scaled ? w : NULL, rows, h);
        CUDA(gather_rows, out, gx, gfsor, k, scaled ? gw : NULL, rows, h);
        gpu_down_bf16(&P, got, out, rows * h);
        for (int64_t i = 0; i < h; i++)
            assert_true(ref[3 * h + i] == 0.0f && got[3 * h + i] == 0.0f);
        check_close("gather_rows (filler rows)", got, ref, rows * h, 1e-2);
        gpu_free(&P, out);
        gpu_free(&P, gfsor);
        free(fsor);

        out = gpu_poison(&P, 2 * n * h, false);
        HOST(combine, ref, src, ros, scaled ? w : NULL, n, k, h, false);
        CUDA(combine, out, gsrc, gros, scaled ? gw : NULL, n, k, h, false);
        gpu_down_bf16(&P, got, out, n * h);
        check_close(scaled ? "combine (weighted)" : "combine", got, ref, n * h, 1e-2);
        /* accumulate adds onto what dst holds (here the sum just written: twice the sum) */
        HOST(combine, ref, src, ros, scaled ? w : NULL, n, k, h, true);
        CUDA(combine, out, gsrc, gros, scaled ? gw : NULL, n, k, h, true);
        gpu_down_bf16(&P, got, out, n * h);
        check_close("combine (accumulate)", got, ref, n * h, 1e-2);
        gpu_free(&P, out);
    }
    float *dw = gpu_poison(&P, 4 * s, false);
    HOST(combine_weight_grad, ref, dy, src, ros, n, k, h);
    CUDA(combine_weight_grad, dw, gdy, gsrc, gros, n, k, h);
    gpu_down_f32(&P, got, dw, s);
    check_close("combine_weight_grad", got, ref, s, 1e-5);
    gpu_free(&P, dw);
    void *dev[] = {gx, gsrc, gdy, gw, gros, gsor};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gpu_free(&P, dev[i]);
    void *hostp[] = {ros, sor, x, w, src, dy, ref, got};
    for (size_t i = 0; i < sizeof hostp / sizeof hostp[0]; i++) free(hostp[i]);
}

static void test_rows(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 2};
    run_rows_case(300, 2, 256, &rng);
    run_rows_case(97, 3, 75, &rng); /* H % 8 != 0: the scalar path */
    run_rows_case(64, 8, 2048, &rng);
}

/* ---- experts ---------------------------------------------------------------------------- */

/* fused: "1" for SwiGLU in the GEMM epilogues where the device can (Hopper: then it must),
 * "0" for the stand-alone kernels */
static void run_experts_case(int32_t el, int64_t h, int64_t f, const int64_t *rows_per,
                             const char *mode, const char *fused, test_rng_t *rng)
{
    setenv("MOE_CUDA_EXPERT_GEMM", mode, 1);
    setenv("MOE_CUDA_SWIGLU_GEMM", fused, 1);
    gpu_pair_t Q;
    gpu_pair_init(&Q);
    const cuda_ctx_t *cc = Q.cuda.ctx;
    struct cudaDeviceProp prop;
    assert_int_equal(cudaGetDeviceProperties(&prop, cc->device), cudaSuccess);
    bool hopper = prop.major == 9 && prop.minor == 0;
    assert_true(cc->swiglu_gemm == (hopper && strcmp(fused, "1") == 0));
    fprintf(stderr, "experts El=%d H=%lld F=%lld mode=%s swiglu_gemm=%d rows:", el, (long long)h,
            (long long)f, mode, cc->swiglu_gemm && moe_cuda_swiglu_gemm_fits(el, h, f));
    int64_t off[129] = {0};
    for (int32_t e = 0; e < el; e++) {
        off[e + 1] = off[e] + rows_per[e];
        fprintf(stderr, " %lld", (long long)rows_per[e]);
    }
    fprintf(stderr, "\n");
    int64_t r = off[el];
    float *w1 = rand_f32(rng, el * h * 2 * f, 1.0 / sqrt((double)h));
    float *w2 = rand_f32(rng, el * f * h, 1.0 / sqrt((double)f));
    float *xp = rand_f32(rng, r * h, 1.0), *d_out = rand_f32(rng, r * h, 1.0);
    float *dw1 = rand_f32(rng, el * h * 2 * f, 0.1), *dw2 = rand_f32(rng, el * f * h, 0.1);
    moe_experts_t ha = {.h = h,
                        .f = f,
                        .el = el,
                        .host_offsets = off,
                        .w1 = w1,
                        .w2 = w2,
                        .xp = xp,
                        .hpre = malloc(4 * r * 2 * f),
                        .act = malloc(4 * r * f),
                        .out = malloc(4 * r * h),
                        .d_out = d_out,
                        .d_xp = malloc(4 * r * h),
                        .dw1 = malloc(4 * el * h * 2 * f),
                        .dw2 = malloc(4 * el * f * h),
                        .scratch = malloc(4 * r * 3 * f + 4)};
    memcpy(ha.dw1, dw1, 4 * el * h * 2 * f);
    memcpy(ha.dw2, dw2, 4 * el * f * h);
    moe_experts_t ga = ha;
    ga.w1 = gpu_up_bf16(&Q, w1, el * h * 2 * f);
    ga.w2 = gpu_up_bf16(&Q, w2, el * f * h);
    ga.xp = gpu_up_bf16(&Q, xp, r * h);
    ga.d_out = gpu_up_bf16(&Q, d_out, r * h);
    ga.dw1 = gpu_up_f32(&Q, dw1, el * h * 2 * f);
    ga.dw2 = gpu_up_f32(&Q, dw2, el * f * h);
    ga.hpre = gpu_poison(&Q, 2 * r * 2 * f, false);
    ga.act = gpu_poison(&Q, 2 * r * f, false);
    ga.out = gpu_poison(&Q, 2 * r * h, false);
    ga.d_xp = gpu_poison(&Q, 2 * r * h, false);
    ga.scratch = gpu_poison(&Q, 2 * r * 3 * f, false);
    TEST_OK(Q.host.ops->experts_forward(Q.host.ctx, &ha));
    TEST_OK(Q.host.ops->experts_backward(Q.host.ctx, &ha));
    TEST_OK(Q.cuda.ops->experts_forward(Q.cuda.ctx, &ga));
    TEST_OK(Q.cuda.ops->experts_backward(Q.cuda.ctx, &ga));
    int64_t big = el * h * 2 * f > r * 2 * f ? el * h * 2 * f : r * 2 * f;
    float *got = malloc(4 * (big + r * h));
    gpu_down_bf16(&Q, got, ga.hpre, r * 2 * f);
    check_close("hpre", got, ha.hpre, r * 2 * f, 1e-2);
    gpu_down_bf16(&Q, got, ga.act, r * f);
    check_close("act", got, ha.act, r * f, 1e-2);
    gpu_down_bf16(&Q, got, ga.out, r * h);
    check_close("out", got, ha.out, r * h, 1e-2);
    gpu_down_bf16(&Q, got, ga.d_xp, r * h);
    check_close("d_xp", got, ha.d_xp, r * h, 1e-2);
    gpu_down_f32(&Q, got, ga.dw1, el * h * 2 * f);
    check_close("dw1 (+=)", got, ha.dw1, el * h * 2 * f, 1e-2);
    gpu_down_f32(&Q, got, ga.dw2, el * f * h);
    check_close("dw2 (+=)", got, ha.dw2, el * f * h, 1e-2);
    /* a second run from the same inputs (gradients re-uploaded) gives the same bits: every
     * mode's grid and reduction order depend on the shape and row counts alone */
    int64_t n_all = r * 2 * f + r * f + 2 * r * h + el * h * 2 * f + el * f * h;
    float *runs[2] = {malloc(4 * n_all), malloc(4 * n_all)};
    for (int run = 0; run < 2; run++) {
        if (run == 1) {
            gpu_free(&Q, ga.dw1);
            gpu_free(&Q, ga.dw2);
            ga.dw1 = gpu_up_f32(&Q, dw1, el * h * 2 * f);
            ga.dw2 = gpu_up_f32(&Q, dw2, el * f * h);
            TEST_OK(Q.cuda.ops->experts_forward(Q.cuda.ctx, &ga));
            TEST_OK(Q.cuda.ops->experts_backward(Q.cuda.ctx, &ga));
        }
        float *at = runs[run];
        gpu_down_bf16(&Q, at, ga.hpre, r * 2 * f);
        gpu_down_bf16(&Q, at += r * 2 * f, ga.act, r * f);
        gpu_down_bf16(&Q, at += r * f, ga.out, r * h);
        gpu_down_bf16(&Q, at += r * h, ga.d_xp, r * h);
        gpu_down_f32(&Q, at += r * h, ga.dw1, el * h * 2 * f);
        gpu_down_f32(&Q, at + el * h * 2 * f, ga.dw2, el * f * h);
    }
    assert_memory_equal(runs[0], runs[1], 4 * n_all);
    free(runs[0]);
    free(runs[1]);
    /* the backward that overwrites the gradients (the layer's after they were discarded), over
     * the poison: experts without rows must come out zero */
    ha.overwrite_grads = ga.overwrite_grads = true;
    gpu_free(&Q, ga.dw1);
    gpu_free(&Q, ga.dw2);
    ga.dw1 = gpu_poison(&Q, 4 * el * h * 2 * f, false);
    ga.dw2 = gpu_poison(&Q, 4 * el * f * h, false);
    TEST_OK(Q.host.ops->experts_backward(Q.host.ctx, &ha));
    TEST_OK(Q.cuda.ops->experts_backward(Q.cuda.ctx, &ga));
    gpu_down_f32(&Q, got, ga.dw1, el * h * 2 * f);
    check_close("dw1 (=)", got, ha.dw1, el * h * 2 * f, 1e-2);
    gpu_down_f32(&Q, got, ga.dw2, el * f * h);
    check_close("dw2 (=)", got, ha.dw2, el * f * h, 1e-2);
    void *dev[] = {(void *)ga.w1, (void *)ga.w2, (void *)ga.xp, (void *)ga.d_out, ga.dw1,    ga.dw2,
                   ga.hpre,       ga.act,        ga.out,        ga.d_xp,          ga.scratch};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gpu_free(&Q, dev[i]);
    void *hostp[] = {w1,     w2,     xp,      d_out,  dw1,    dw2,        ha.hpre,
                     ha.act, ha.out, ha.d_xp, ha.dw1, ha.dw2, ha.scratch, got};
    for (size_t i = 0; i < sizeof hostp / sizeof hostp[0]; i++) free(hostp[i]);
    gpu_pair_free(&Q);
    unsetenv("MOE_CUDA_EXPERT_GEMM");
    unsetenv("MOE_CUDA_SWIGLU_GEMM");
}

static void test_experts(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 3};
    const int64_t uneven[] = {37, 0, 130, 5, 64, 1};
    const int64_t even[] = {48, 48, 48, 48};
    const char *modes[] = {"loop", "streams", "auto"};
    for (int m = 0; m < 3; m++) run_experts_case(6, 64, 96, uneven, modes[m], "1", &rng);
    run_experts_case(4, 64, 96, even, "batched", "1", &rng);
    run_experts_case(4, 40, 45, even, "loop", "1", &rng); /* F % 8 != 0: scalar SwiGLU */
    /* shapes the SwiGLU GEMMs take (F % 128 == 0): M tiles cut by expert ends and by R, an
     * expert without rows, H not a multiple of the 64-wide K step, the backward's last
     * 256-column tile half outside F; each also through the stand-alone kernels */
    const int64_t ragged[] = {300, 0, 129, 1, 128}, three[] = {130, 70, 260};
    for (int fused = 1; fused >= 0; fused--) {
        run_experts_case(5, 200, 256, ragged, "auto", fused ? "1" : "0", &rng);
        run_experts_case(3, 64, 384, three, "loop", fused ? "1" : "0", &rng);
    }
}

/* The grouped mode (one cuBLAS grouped GEMM a kind, real row counts) on the loads it is for:
 * balanced, routed (a few rows either side of the mean), uneven, experts without rows, a
 * single hot expert; alone and beside the SwiGLU GEMMs. */
static void test_experts_grouped(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 5};
    const int64_t balanced[] = {48, 48, 48, 48}, routed[] = {60, 52, 45, 49, 55, 47, 50, 42};
    const int64_t uneven[] = {37, 0, 130, 5, 64, 1}, zeros[] = {0, 0, 70, 0};
    const int64_t hot[] = {1, 0, 250, 2, 1}, ragged[] = {300, 0, 129, 1, 128};
    run_experts_case(4, 64, 96, balanced, "grouped", "0", &rng);
    run_experts_case(8, 64, 96, routed, "grouped", "0", &rng);
    run_experts_case(6, 64, 96, uneven, "grouped", "0", &rng);
    run_experts_case(4, 64, 96, zeros, "grouped", "0", &rng);
    run_experts_case(5, 72, 40, hot, "grouped", "0", &rng);
    for (int fused = 1; fused >= 0; fused--)
        run_experts_case(5, 200, 256, ragged, "grouped", fused ? "1" : "0", &rng);
}

/* The grouped Hopper kernels for all four GEMMs whose M is n_e (elsewhere the mode falls back
 * to auto's choice, also checked): the same loads, M tiles cut by expert ends and by R, H not
 * a multiple of the 256-wide N tile nor of the 64-wide K step; and auto on many small uneven
 * experts, where it takes these kernels with cuBLAS's grouped dW GEMMs. */
static void test_experts_hopper(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 6};
    const int64_t balanced[] = {130, 130, 130, 130}, routed[] = {60, 52, 45, 49, 55, 47, 50, 42};
    const int64_t ragged[] = {300, 0, 129, 1, 128}, zeros[] = {0, 0, 70, 0};
    const int64_t hot[] = {1, 0, 400, 2, 1};
    run_experts_case(4, 200, 256, balanced, "hopper", "0", &rng);
    run_experts_case(8, 136, 128, routed, "hopper", "0", &rng);
    run_experts_case(5, 200, 256, ragged, "hopper", "0", &rng);
    run_experts_case(4, 64, 128, zeros, "hopper", "0", &rng);
    run_experts_case(5, 264, 384, hot, "hopper", "0", &rng);
    int64_t many[128];
    for (int e = 0; e < 128; e++) many[e] = (e * 7) % 13 * 3; /* 0..36 rows, some none */
    run_experts_case(128, 64, 128, many, "auto", "0", &rng);
    /* heavy-tailed, as bench_moe's skewed load: a Zipf-like head, a quarter of the experts
     * near-empty, one without rows; auto and the kernels */
    int64_t skewed[24];
    for (int e = 0; e < 24; e++) skewed[e] = e < 18 ? 600 / (e + 2) : e < 23 ? 2 : 0;
    run_experts_case(24, 136, 256, skewed, "auto", "0", &rng);
    run_experts_case(24, 136, 256, skewed, "hopper", "0", &rng);
}

/* ---- element-wise ------------------------------------------------------------------------ */

/* The optimizer's multi-tensor passes on 70 tensors carved out of one buffer each for the
 * masters, moments, values and gradients: more than one launch's MOE_MT_TENSORS, a tensor of
 * several chunks with a tail, empty and one-element tensors, and slices at offsets that are
 * not 16-byte aligned (the scalar path). Masters and moments must equal the host twin's
 * bitwise, the bf16 values the host master rounded; the sum of squares the host's to 1e-12. */
static void test_optimizer_passes(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 4};
    enum { COUNT = 70 };
    int64_t sizes[COUNT], at[COUNT], total = 0;
    for (int i = 0; i < COUNT; i++) {
        sizes[i] = i == 0 ? 3 * MOE_MT_CHUNK + 1001 : i == 1 ? 0 : i == 2 ? 1 : (i * 37) % 301;
        at[i] = total;
        total += sizes[i];
    }
    float *master = rand_f32(&rng, total, 1.0), *m = rand_f32(&rng, total, 0.01);
    float *grad = rand_f32(&rng, total, 1.0), *v = malloc(4 * total), *param = malloc(4 * total);
    float *got = malloc(4 * total);
    for (int64_t i = 0; i < total; i++) v[i] = (float)fabs(0.01 * test_rng_normal(&rng));
    float *gmaster = gpu_up_f32(&P, master, total), *gm = gpu_up_f32(&P, m, total);
    float *gv = gpu_up_f32(&P, v, total), *ggrad = gpu_up_f32(&P, grad, total);
    uint16_t *gparam = gpu_poison(&P, 2 * total, false);
    moe_adamw_tensor_t ht[COUNT], gt[COUNT];
    const float *hg[COUNT], *gg[COUNT];
    for (int i = 0; i < COUNT; i++) {
        ht[i] = (moe_adamw_tensor_t){sizes[i],  master + at[i], m + at[i],
                                     v + at[i], param + at[i],  grad + at[i]};
        gt[i] = (moe_adamw_tensor_t){sizes[i],   gmaster + at[i], gm + at[i],
                                     gv + at[i], gparam + at[i],  ggrad + at[i]};
        hg[i] = grad + at[i];
        gg[i] = ggrad + at[i];
    }
    moe_adamw_update_t ha = {.lr = 1e-2f,
                             .beta1 = 0.9f,
                             .beta2 = 0.999f,
                             .eps = 1e-8f,
                             .weight_decay = 0.01f,
                             .grad_scale = 0.5f,
                             .step = 3,
                             .tensors = ht,
                             .count = COUNT};
    moe_adamw_update_t ga = ha;
    ga.tensors = gt;
    for (int step = 0; step < 2; step++) { /* the second from the first's state */
        TEST_OK(P.host.ops->adamw_update(P.host.ctx, &ha));
        TEST_OK(P.cuda.ops->adamw_update(P.cuda.ctx, &ga));
        ha.step = ++ga.step;
    }
    gpu_down_f32(&P, got, gmaster, total);
    assert_memory_equal(got, master, 4 * total);
    gpu_down_f32(&P, got, gm, total);
    assert_memory_equal(got, m, 4 * total);
    gpu_down_f32(&P, got, gv, total);
    assert_memory_equal(got, v, 4 * total);
    gpu_down_bf16(&P, got, gparam, total);
    for (int64_t i = 0; i < total; i++)
        assert_true(got[i] == moe_bf16_to_f32(moe_f32_to_bf16(master[i])));
    printf("adamw: %d tensors, %lld elements: masters, moments and values exact\n", COUNT,
           (long long)total);

    /* the gradient norm's sum of squares: fp64 on both sides, in different orders */
    double sq_host, sq_gpu, sq_again;
    TEST_OK(P.host.ops->sum_squares(P.host.ctx, hg, sizes, COUNT, &sq_host));
    TEST_OK(P.cuda.ops->sum_squares(P.cuda.ctx, gg, sizes, COUNT, &sq_gpu));
    TEST_OK(P.cuda.ops->sum_squares(P.cuda.ctx, gg, sizes, COUNT, &sq_again));
    printf("sum_squares: host %.17g cuda %.17g\n", sq_host, sq_gpu);
    assert_true(sq_host > 0 && fabs(sq_gpu - sq_host) <= 1e-12 * sq_host);
    assert_memory_equal(&sq_again, &sq_gpu, sizeof sq_gpu); /* the same order run to run */
    double sq_empty = -1;
    TEST_OK(P.cuda.ops->sum_squares(P.cuda.ctx, gg, sizes + 1, 1, &sq_empty));
    assert_true(sq_empty == 0);
    void *dev[] = {gmaster, gm, gv, ggrad, gparam};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gpu_free(&P, dev[i]);
    void *hostp[] = {master, m, grad, v, param, got};
    for (size_t i = 0; i < sizeof hostp / sizeof hostp[0]; i++) free(hostp[i]);
}

/* ---- element-wise ------------------------------------------------------------------------ */

static void test_elementwise(void **state)
{
    (void)state;
    test_rng_t rng = {seed + 5};
    const int64_t n = 100003;
    float *got = malloc(4 * n);
    /* conversions */
    float *a = rand_f32(&rng, n, 1.0);
    void *ga16 = gpu_up_bf16(&P, a, n);
    float *f32 = gpu_poison(&P, 4 * n, false);
    CUDA(act_to_f32, f32, ga16, n);
    gpu_down_f32(&P, got, f32, n);
    assert_memory_equal(got, a, 4 * n); /* bf16 -> f32 is exact */
    void *back = gpu_poison(&P, 2 * n, false);
    CUDA(f32_to_act, back, f32, n);
    gpu_down_bf16(&P, got, back, n);
    assert_memory_equal(got, a, 4 * n);
    void *dev[] = {ga16, f32, back};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gpu_free(&P, dev[i]);
    free(got);
    free(a);
}

int main(void)
{
    gpu_pair_init(&P); /* exits 77 without a GPU */
    seed = test_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_router),
        cmocka_unit_test(test_router_nan),
        cmocka_unit_test(test_router_large_logits),
        cmocka_unit_test(test_plan),
        cmocka_unit_test(test_rows),
        cmocka_unit_test(test_experts),
        cmocka_unit_test(test_experts_grouped),
        cmocka_unit_test(test_experts_hopper),
        cmocka_unit_test(test_optimizer_passes),
        cmocka_unit_test(test_elementwise),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gpu_pair_free(&P);
    return rc;
}
