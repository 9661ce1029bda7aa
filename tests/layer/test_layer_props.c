/*
 * Property tests of the host layer over many random seeds and shapes, against the fp64
 * oracle (ref_moe.c) and against invariants read from the layer's saved routing state:
 *  - every kept (token, k) slot reaches exactly its expert, once, carrying its token's row;
 *  - per-expert counts equal an independent top-k histogram; capacity keeps each expert's
 *    first `capacity` slots in token order, and stats.capacity is the capacity applied,
 *    min(ceil(cf * N * K / E), N * K);
 *  - the output equals the naive sum_k w * FFN_e(x) of the oracle;
 *  - the same inputs give bitwise-equal outputs;
 *  - pad_plan (the padded layout a backend may ask for) keeps all of the above per expert;
 *  - the plan against a global order (the distributed layer's: other ranks' selections ahead
 *    of these, experts' rows in a given order) keeps and lays out rows as that order says;
 *  - parameter initialisation gives the same values whatever number of threads draws them.
 */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "layer_fixture.h"
#include "layer/layer_internal.h"

static uint64_t base_seed;

typedef struct shape {
    int64_t n, h, f;
    int32_t e, k;
} shape_t;

static moe_layer_config_t config_for(const shape_t *s, moe_score_fn_t fn, int renorm, float cf)
{
    moe_layer_config_t c = moe_layer_config_default();
    c.hidden = s->h;
    c.ffn_hidden = s->f;
    c.num_experts = s->e;
    c.top_k = s->k;
    c.score_fn = fn;
    c.renormalize = renorm;
    c.capacity_factor = cf;
    return c;
}

/* Routing invariants that hold whatever the selection was. Returns kept rows. */
static int64_t check_conservation(const fixture_t *fx)
{
    const moe_slot_t *s = &fx->layer->slots[0];
    int64_t n = s->n, k = fx->ref.k, h = fx->ref.h, e = fx->ref.e;
    int64_t rows = s->rows;
    assert_int_equal(rows, s->host_offsets[e]);
    int32_t *hits = calloc((size_t)rows + 1, sizeof(int32_t));
    for (int64_t slot = 0; slot < n * k; slot++) {
        int32_t row = s->row_of_slot[slot], ex = s->topk_idx[slot];
        assert_true(ex >= 0 && ex < e);
        if (row < 0) continue;
        assert_true(row < rows);
        /* the row lies in its expert's block, points back at the slot, and holds its token */
        assert_true(row >= s->host_offsets[ex] && row < s->host_offsets[ex + 1]);
        assert_int_equal(s->slot_of_row[row], slot);
        assert_memory_equal((const float *)s->xp + row * h, fx->xf + (slot / k) * h,
                            sizeof(float) * (size_t)h);
        hits[row]++;
    }
    for (int64_t r = 0; r < rows; r++) assert_int_equal(hits[r], 1);
    /* a token never picks the same expert twice */
    for (int64_t t = 0; t < n; t++)
        for (int64_t a = 0; a < k; a++)
            for (int64_t b = a + 1; b < k; b++)
                assert_int_not_equal(s->topk_idx[t * k + a], s->topk_idx[t * k + b]);
    free(hits);
    return rows;
}

/* One random case; false when the oracle's decision is too close to a tie to compare. */
static bool check_random_case(uint64_t seed)
{
    test_rng_t rng = {seed};
    shape_t sh;
    sh.e = (int32_t)test_rng_int(&rng, 1, 12);
    sh.k = (int32_t)test_rng_int(&rng, 1, sh.e < 4 ? sh.e : 4);
    sh.n = test_rng_int(&rng, 1, 48);
    sh.h = test_rng_int(&rng, 1, 12);
    sh.f = test_rng_int(&rng, 1, 6);
    moe_score_fn_t fn = test_rng_int(&rng, 0, 1) ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
    int renorm = (int)test_rng_int(&rng, 0, 1);
    float cfs[] = {0.0f, 0.25f, 0.5f, 1.0f, 1.25f, 2.0f};
    float cf = cfs[test_rng_int(&rng, 0, 5)];
    moe_layer_config_t cfg = config_for(&sh, fn, renorm, cf);
    fixture_t fx;
    fixture_init(&fx, &cfg, sh.n, &rng, 1.0);

    int64_t nk = sh.n * sh.k, nh = sh.n * sh.h;
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)nk);
    int8_t *kept = malloc((size_t)nk);
    int64_t *counts = calloc((size_t)sh.e, sizeof(int64_t)),
            *accepted = calloc((size_t)sh.e, sizeof(int64_t));
    double *yref = malloc(sizeof(double) * (size_t)nh);
    ref_result_t rr = {.idx = idx, .kept = kept, .counts = counts, .accepted = accepted};
    ref_forward(&fx.ref, fx.x, fx.wg, fx.w1, fx.w2, yref, &rr);
    bool comparable = rr.min_gap > 1e-5;

    float *y = malloc(sizeof(float) * (size_t)nh), *y2 = malloc(sizeof(float) * (size_t)nh);
    fixture_forward(&fx, y);
    check_conservation(&fx);
    const moe_slot_t *s = &fx.layer->slots[0];
    int64_t tpe[12];
    moe_layer_stats_t st = {.struct_size = sizeof st};
    TEST_OK(moe_layer_stats(fx.layer, &st, tpe));
    if (comparable) {
        /* the same experts, in the same order, and the same capacity decisions */
        for (int64_t i = 0; i < nk; i++) {
            assert_int_equal(s->topk_idx[i], idx[i]);
            assert_int_equal(s->row_of_slot[i] >= 0, kept[i]);
        }
        int64_t dropped = 0;
        for (int32_t j = 0; j < sh.e; j++) {
            assert_int_equal(tpe[j], accepted[j]);
            dropped += counts[j] - accepted[j];
        }
        assert_int_equal(st.dropped_slots, dropped);
        float *yref_f = malloc(sizeof(float) * (size_t)nh);
        for (int64_t i = 0; i < nh; i++) yref_f[i] = (float)yref[i];
        assert_true(test_rel_err(y, yref_f, nh) < 1e-5);
        assert_true(fabs(st.aux_loss - rr.aux) <= 1e-5 * fabs(rr.aux) + 1e-7);
        assert_true(fabs(st.z_loss - rr.z) <= 1e-5 * fabs(rr.z) + 1e-7);
        assert_true(fabs(st.entropy - rr.entropy) <= 1e-5 * fabs(rr.entropy) + 1e-7);
        assert_int_equal(st.tokens, sh.n);
        assert_int_equal(st.slots, nk);
        free(yref_f);
    }
    /* determinism: the same inputs again give the same bits */
    TEST_OK(moe_layer_release_slot(fx.layer, 0));
    fixture_forward(&fx, y2);
    assert_memory_equal(y, y2, sizeof(float) * (size_t)nh);

    free(idx);
    free(kept);
    free(counts);
    free(accepted);
    free(yref);
    free(y);
    free(y2);
    fixture_free(&fx);
    return comparable;
}

static void test_random_shapes(void **state)
{
    (void)state;
    int compared = 0, tried = 0;
    for (uint64_t s = base_seed; compared < 120; s++, tried++) compared += check_random_case(s);
    printf("compared %d random cases against the oracle (%d skipped near a tie)\n", compared,
           tried - compared);
    assert_true(tried - compared < 20);
}

/* Capacity factor E/K gives capacity >= N, which no expert can exceed: nothing is dropped. */
static void test_capacity_that_drops_nothing(void **state)
{
    (void)state;
    for (uint64_t seed = base_seed; seed < base_seed + 20; seed++) {
        test_rng_t rng = {seed};
        shape_t sh = {test_rng_int(&rng, 1, 40), 6, 3, (int32_t)test_rng_int(&rng, 2, 8), 0};
        sh.k = (int32_t)test_rng_int(&rng, 1, sh.e);
        moe_layer_config_t cfg = config_for(&sh, MOE_SCORE_SOFTMAX, 1, (float)sh.e / (float)sh.k);
        fixture_t fx;
        fixture_init(&fx, &cfg, sh.n, &rng, 1.0);
        float *y = malloc(sizeof(float) * (size_t)(sh.n * sh.h));
        fixture_forward(&fx, y);
        moe_layer_stats_t st = {.struct_size = sizeof st};
        TEST_OK(moe_layer_stats(fx.layer, &st, NULL));
        assert_true(st.capacity >= sh.n); /* cf is a float: E/K may round up by one */
        assert_int_equal(st.dropped_slots, 0);
        assert_int_equal(check_conservation(&fx), sh.n * sh.k);
        free(y);
        fixture_free(&fx);
    }
}

/* A small factor keeps exactly min(count, capacity) per expert and drops most slots. */
static void test_capacity_that_drops_most(void **state)
{
    (void)state;
    for (uint64_t seed = base_seed; seed < base_seed + 20; seed++) {
        test_rng_t rng = {seed};
        shape_t sh = {64, 8, 4, 8, 2};
        moe_layer_config_t cfg = config_for(&sh, MOE_SCORE_SOFTMAX, 1, 0.1f);
        fixture_t fx;
        fixture_init(&fx, &cfg, sh.n, &rng, 1.0);
        float *y = malloc(sizeof(float) * (size_t)(sh.n * sh.h));
        fixture_forward(&fx, y);
        moe_layer_stats_t st = {.struct_size = sizeof st};
        int64_t tpe[8];
        TEST_OK(moe_layer_stats(fx.layer, &st, tpe));
        int64_t cap = (int64_t)ceil(0.1 * 64 * 2 / 8.0); /* 2 */
        assert_int_equal(st.capacity, cap);
        const moe_slot_t *s = &fx.layer->slots[0];
        int64_t selected[8] = {0};
        for (int64_t i = 0; i < sh.n * sh.k; i++) selected[s->topk_idx[i]]++;
        for (int j = 0; j < 8; j++) assert_int_equal(tpe[j], selected[j] < cap ? selected[j] : cap);
        assert_true(st.dropped_ratio > 0.5);
        check_conservation(&fx);
        free(y);
        fixture_free(&fx);
    }
}

/* stats.capacity is the capacity the forward applied: min(ceil(cf * N * K / E), N * K), -1
 * dropless. N = 10, E = 4, K = 2 (N * K = 20): exact values, including factors whose ceiling
 * passes N * K (5, 1e30, FLT_MAX: 20), and every expert keeps min(selected, capacity). */
static void test_capacity_reported_is_applied(void **state)
{
    (void)state;
    static const struct {
        float cf;
        int64_t capacity;
    } cases[] = {
        {0.0f, -1}, {-1.0f, -1}, {0.1f, 1},  {1.0f, 5},   {1.3f, 7}, /* 1.3f * 5 = 6.4999998 */
        {3.9f, 20}, {4.0f, 20},  {5.0f, 20}, {1e30f, 20}, {FLT_MAX, 20},
    };
    shape_t sh = {10, 4, 3, 4, 2};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        test_rng_t rng = {base_seed + c};
        moe_layer_config_t cfg = config_for(&sh, MOE_SCORE_SOFTMAX, 1, cases[c].cf);
        fixture_t fx;
        fixture_init(&fx, &cfg, sh.n, &rng, 1.0);
        float y[10 * 4];
        fixture_forward(&fx, y);
        moe_layer_stats_t st = {.struct_size = sizeof st};
        int64_t tpe[4];
        TEST_OK(moe_layer_stats(fx.layer, &st, tpe));
        assert_int_equal(st.capacity, cases[c].capacity);
        const moe_slot_t *s = &fx.layer->slots[0];
        int64_t selected[4] = {0}, dropped = 0;
        for (int64_t i = 0; i < sh.n * sh.k; i++) selected[s->topk_idx[i]]++;
        for (int j = 0; j < 4; j++) {
            int64_t keep = cases[c].capacity < 0 || selected[j] < cases[c].capacity
                               ? selected[j]
                               : cases[c].capacity;
            assert_int_equal(tpe[j], keep);
            dropped += selected[j] - keep;
        }
        assert_int_equal(st.dropped_slots, dropped);
        if (cases[c].capacity >= sh.n || cases[c].capacity < 0) assert_int_equal(dropped, 0);
        fixture_free(&fx);
    }
    /* no tokens: ceil(0) = 0 */
    moe_layer_config_t cfg = config_for(&sh, MOE_SCORE_SOFTMAX, 1, 1.0f);
    test_rng_t rng = {base_seed};
    fixture_t fx;
    fixture_init(&fx, &cfg, 0, &rng, 1.0);
    float dummy = 0;
    moe_tensor_t xt, yt;
    int64_t shape[2] = {0, sh.h};
    TEST_OK(moe_tensor_view(&dummy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &xt));
    TEST_OK(moe_tensor_view(&dummy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &yt));
    TEST_OK(moe_layer_forward(fx.layer, 0, &xt, &yt));
    moe_layer_stats_t st = {.struct_size = sizeof st};
    TEST_OK(moe_layer_stats(fx.layer, &st, NULL));
    assert_int_equal(st.capacity, 0);
    assert_int_equal(st.dropped_slots, 0);
    fixture_free(&fx);
}

/* Zero router weights tie every expert; ties go to the lower index, so with K=1 every token
 * goes to expert 0, and capacity c keeps exactly tokens 0..c-1. */
static void test_all_tokens_to_one_expert(void **state)
{
    (void)state;
    shape_t sh = {30, 4, 3, 5, 1};
    float cfs[] = {0.0f, 1.0f, 0.5f};
    for (int c = 0; c < 3; c++) {
        test_rng_t rng = {base_seed + (uint64_t)c};
        moe_layer_config_t cfg = config_for(&sh, MOE_SCORE_SOFTMAX, 1, cfs[c]);
        fixture_t fx;
        fixture_init(&fx, &cfg, sh.n, &rng, 1.0);
        memset(fx.wg, 0, sizeof(double) * (size_t)(sh.h * sh.e));
        fixture_push_params(&fx);
        float *y = malloc(sizeof(float) * (size_t)(sh.n * sh.h));
        fixture_forward(&fx, y);
        int64_t cap = cfs[c] > 0 ? (int64_t)ceil(cfs[c] * 30 / 5.0) : 30;
        const moe_slot_t *s = &fx.layer->slots[0];
        for (int64_t t = 0; t < sh.n; t++) {
            assert_int_equal(s->topk_idx[t], 0);
            assert_int_equal(s->row_of_slot[t], t < cap ? t : -1);
        }
        int64_t tpe[5];
        moe_layer_stats_t st = {.struct_size = sizeof st};
        TEST_OK(moe_layer_stats(fx.layer, &st, tpe));
        assert_int_equal(tpe[0], cap);
        assert_int_equal(st.max_load, (double)cap);
        /* dropped tokens get exactly zero output */
        for (int64_t t = cap; t < sh.n; t++)
            for (int64_t i = 0; i < sh.h; i++) assert_true(y[t * sh.h + i] == 0.0f);
        free(y);
        fixture_free(&fx);
    }
}

/* pad_plan on the saved plan of a forward with capacity drop: every kept slot moves to its
 * expert's block of `stride` rows, keeping its place in the expert's order; dropped slots stay
 * dropped; the padded slot_of_row inverts the new row_of_slot and the rest of it is filler. */
static void test_pad_plan(void **state)
{
    (void)state;
    test_rng_t rng = {base_seed};
    shape_t sh = {200, 8, 4, 6, 2};
    moe_layer_config_t cfg = config_for(&sh, MOE_SCORE_SOFTMAX, 1, 0.8f);
    fixture_t fx;
    fixture_init(&fx, &cfg, sh.n, &rng, 1.0);
    float *y = malloc(sizeof(float) * (size_t)(sh.n * sh.h));
    fixture_forward(&fx, y);
    const moe_slot_t *s = &fx.layer->slots[0];
    int64_t slots = sh.n * sh.k, stride = 0, kept = 0, off[6 + 1] = {0};
    for (int32_t j = 0; j < sh.e; j++) {
        stride = s->kept[j] + 5 > stride ? s->kept[j] + 5 : stride;
        off[j + 1] = off[j] + s->kept[j];
        kept += s->kept[j];
    }
    assert_true(kept < slots); /* the capacity dropped some */
    int32_t *ros = malloc(sizeof(int32_t) * (size_t)slots),
            *pad = malloc(sizeof(int32_t) * (size_t)(sh.e * stride));
    memcpy(ros, s->row_of_slot, sizeof(int32_t) * (size_t)slots);
    moe_pad_plan_t a = {.n = sh.n,
                        .e = sh.e,
                        .k = sh.k,
                        .stride = stride,
                        .topk_idx = s->topk_idx,
                        .kept = s->kept,
                        .slot_of_row = s->slot_of_row,
                        .row_of_slot = ros,
                        .padded_slot_of_row = pad};
    TEST_OK(MOE_OPS(fx.rt)->pad_plan(MOE_CTX(fx.rt), &a));
    for (int64_t i = 0; i < slots; i++) {
        int32_t was = s->row_of_slot[i], ex = s->topk_idx[i];
        if (was < 0) {
            assert_int_equal(ros[i], -1);
            continue;
        }
        assert_int_equal(ros[i], ex * stride + (was - off[ex]));
        assert_int_equal(pad[ros[i]], i);
    }
    int64_t filler = 0;
    for (int64_t r = 0; r < sh.e * stride; r++) {
        filler += pad[r] < 0;
        if (pad[r] >= 0) assert_true(r % stride < s->kept[r / stride]);
    }
    assert_int_equal(filler, sh.e * stride - kept);
    free(ros);
    free(pad);
    free(y);
    TEST_OK(moe_layer_release_slot(fx.layer, 0));
    fixture_free(&fx);
}

/* The plan op with `first` and `row_order`, on random routings: expert e keeps its first
 * min(count_e, capacity - first[e]) slots; expert row_order[g]'s rows follow those of
 * row_order[0..g-1], in slot order; row_of_slot and slot_of_row invert each other. */
static void check_global_plan(test_rng_t *rng, int64_t n, int32_t e, int32_t k, int64_t capacity)
{
    moe_backend_t be;
    moe_backend_params_t bp = {0};
    TEST_OK(moe_backend_host_create(&bp, &be));
    const moe_backend_ops_t *ops = be.ops;
    size_t slots = (size_t)(n * k), ne = (size_t)e, i4 = sizeof(int32_t);
    int32_t *idx = malloc(i4 * slots + 1), *ros = malloc(i4 * slots + 1),
            *sor = malloc(i4 * slots + 1);
    int32_t *first = malloc(i4 * ne), *order = malloc(i4 * ne), *kept = malloc(i4 * ne);
    int32_t *host_kept = malloc(i4 * ne), *count = calloc(ne, i4);
    test_fill_routing(rng, idx, n, e, k);
    for (size_t sl = 0; sl < slots; sl++) count[idx[sl]]++;
    for (int32_t j = 0; j < e; j++)
        first[j] = capacity < 0 ? 0 : (int32_t)(test_rng_uniform(rng) * (double)(capacity + 1));
    test_fill_permutation(rng, order, e);
    moe_plan_t p = {.n = n,
                    .e = e,
                    .k = k,
                    .capacity = capacity,
                    .topk_idx = idx,
                    .first = capacity < 0 ? NULL : first,
                    .row_order = order,
                    .row_of_slot = ros,
                    .slot_of_row = sor,
                    .kept = kept,
                    .summary = kept,
                    .summary_bytes = i4 * ne,
                    .host_summary = host_kept};
    TEST_OK(ops->plan(be.ctx, &p));
    int64_t *base = malloc(sizeof(int64_t) * ne), *seen = calloc(ne, sizeof(int64_t));
    int64_t rows = 0;
    for (int32_t g = 0; g < e; g++) {
        int32_t ex = order[g];
        int64_t room = capacity < 0 ? count[ex] : capacity - first[ex];
        assert_int_equal(kept[ex], count[ex] < room ? count[ex] : room);
        assert_int_equal(host_kept[ex], kept[ex]);
        base[ex] = rows;
        rows += kept[ex];
    }
    for (int64_t sl = 0; sl < (int64_t)slots; sl++) {
        int32_t ex = idx[sl];
        int64_t rank = seen[ex]++;
        if (rank < kept[ex]) {
            assert_int_equal(ros[sl], base[ex] + rank);
            assert_int_equal(sor[ros[sl]], sl);
        } else {
            assert_int_equal(ros[sl], -1);
        }
    }
    void *bufs[] = {idx, ros, sor, first, order, kept, host_kept, count, base, seen};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    ops->destroy(be.ctx);
}

static void test_plan_global_order(void **state)
{
    (void)state;
    test_rng_t rng = {base_seed + 3};
    check_global_plan(&rng, 300, 8, 2, 40);
    check_global_plan(&rng, 1000, 16, 4, 100);
    check_global_plan(&rng, 257, 5, 1, 10);
    check_global_plan(&rng, 300, 8, 2, -1); /* dropless: the order alone */
    check_global_plan(&rng, 0, 4, 2, 3);
}

/* A rank with no tokens: forward and backward succeed and touch nothing. */
static void test_zero_tokens(void **state)
{
    (void)state;
    shape_t sh = {0, 4, 3, 4, 2};
    moe_layer_config_t cfg = config_for(&sh, MOE_SCORE_SOFTMAX, 1, 1.0f);
    test_rng_t rng = {base_seed};
    fixture_t fx;
    fixture_init(&fx, &cfg, 0, &rng, 1.0);
    float dummy = 0;
    moe_tensor_t xt, yt;
    int64_t shape[2] = {0, 4};
    TEST_OK(moe_tensor_view(&dummy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &xt));
    TEST_OK(moe_tensor_view(&dummy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &yt));
    TEST_OK(moe_layer_forward(fx.layer, 0, &xt, &yt));
    TEST_OK(moe_layer_backward(fx.layer, 0, &yt, &xt));
    const float *dwg = fx.p[0].grad.data;
    for (int i = 0; i < 16; i++) assert_true(dwg[i] == 0.0f);
    fixture_free(&fx);
}

/* The initial parameters of a layer with a 2 M-element tensor (drawn on several threads) under
 * MOE_INIT_THREADS = 1, 3 and 8: bitwise equal, and N(0, init_std^2) as documented. */
static void test_init_any_thread_count(void **state)
{
    (void)state;
    moe_layer_config_t cfg = moe_layer_config_default();
    cfg.hidden = 256;
    cfg.ffn_hidden = 1024; /* w1 [4, 256, 2, 1024]: 2 M elements */
    cfg.num_experts = 4;
    cfg.top_k = 2;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.seed = base_seed;
    const char *threads[] = {"1", "3", "8"};
    float *first[3] = {NULL};
    int64_t numel[3] = {0};
    for (int t = 0; t < 3; t++) {
        setenv("MOE_INIT_THREADS", threads[t], 1);
        moe_runtime_t *rt;
        moe_layer_t *l;
        TEST_OK(moe_runtime_create(&rc, &rt));
        TEST_OK(moe_layer_create(rt, &cfg, &l));
        for (int i = 0; i < 3; i++) {
            moe_param_info_t p = {.struct_size = sizeof p};
            TEST_OK(moe_layer_param(l, i, &p));
            int64_t n = moe_tensor_numel(&p.value);
            if (t == 0) {
                numel[i] = n;
                first[i] = malloc(sizeof(float) * (size_t)n);
                memcpy(first[i], p.value.data, sizeof(float) * (size_t)n);
            } else {
                assert_int_equal(n, numel[i]);
                assert_memory_equal(p.value.data, first[i], sizeof(float) * (size_t)n);
            }
        }
        TEST_OK(moe_layer_destroy(l));
        TEST_OK(moe_runtime_destroy(rt));
    }
    unsetenv("MOE_INIT_THREADS");
    double sum = 0, sq = 0;
    for (int64_t j = 0; j < numel[1]; j++) {
        sum += first[1][j];
        sq += (double)first[1][j] * first[1][j];
    }
    /* w1: mean within 5 standard errors of 0, standard deviation within 1% of init_std */
    double n1 = (double)numel[1], mean = sum / n1, sd = sqrt(sq / n1 - mean * mean);
    assert_true(fabs(mean) < 5 * cfg.init_std / sqrt(n1));
    assert_true(fabs(sd / cfg.init_std - 1) < 0.01);
    for (int i = 0; i < 3; i++) free(first[i]);
}

int main(void)
{
    base_seed = test_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_shapes),
        cmocka_unit_test(test_capacity_that_drops_nothing),
        cmocka_unit_test(test_capacity_that_drops_most),
        cmocka_unit_test(test_capacity_reported_is_applied),
        cmocka_unit_test(test_all_tokens_to_one_expert),
        cmocka_unit_test(test_zero_tokens),
        cmocka_unit_test(test_pad_plan),
        cmocka_unit_test(test_plan_global_order),
        cmocka_unit_test(test_init_any_thread_count),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
