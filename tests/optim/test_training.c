/*
 * Training mechanics on the host backend: the AdamW update against the formula in
 * include/moe/optim.h computed here in fp64; gradient accumulation over interleaved
 * microbatch slots; zero_grad and discard_grad; the expert-bias buffer (present only when
 * enabled) and its sign rule.
 */
#include <math.h>
#include <stdbool.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "layer_fixture.h"

static uint64_t base_seed;

static void test_adamw_matches_formula(void **state)
{
    (void)state;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    moe_runtime_t *rt;
    TEST_OK(moe_runtime_create(&rc, &rt));
    moe_adamw_config_t c = moe_adamw_config_default();
    c.lr = 0.05f;
    c.weight_decay = 0.1f;
    moe_adamw_t *opt;
    TEST_OK(moe_adamw_create(rt, &c, &opt));
    enum { n = 64 };
    float p[n], g[n];
    double ref_p[n], m[n] = {0}, v[n] = {0};
    test_rng_t rng = {base_seed};
    test_fill_normal(&rng, p, n, 1.0);
    for (int i = 0; i < n; i++) ref_p[i] = p[i];
    int64_t shape[1] = {n};
    moe_tensor_t pt, gt;
    TEST_OK(moe_tensor_view(p, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, shape, &pt));
    TEST_OK(moe_tensor_view(g, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, shape, &gt));
    TEST_OK(moe_adamw_add_param(opt, "p", MOE_PARAM_DENSE, &pt, &gt));
    const float scale = 0.5f;
    for (int step = 1; step <= 3; step++) {
        test_fill_normal(&rng, g, n, 1.0);
        TEST_OK(moe_adamw_step(opt, 0, scale));
        for (int i = 0; i < n; i++) {
            double gs = (double)g[i] * scale;
            m[i] = 0.9 * m[i] + 0.1 * gs;
            v[i] = 0.999 * v[i] + 0.001 * gs * gs;
            double mh = m[i] / (1 - pow(0.9, step)), vh = v[i] / (1 - pow(0.999, step));
            ref_p[i] -= 0.05 * (mh / (sqrt(vh) + 1e-8) + 0.1 * ref_p[i]);
        }
        for (int i = 0; i < n; i++)
            assert_true(fabs(p[i] - ref_p[i]) <= 1e-5 * (1 + fabs(ref_p[i])));
    }
    int64_t steps;
    TEST_OK(moe_adamw_step_count(opt, &steps));
    assert_int_equal(steps, 3);
    int32_t nstate;
    TEST_OK(moe_adamw_num_states(opt, &nstate));
    assert_int_equal(nstate, 3);
    moe_param_info_t info = {.struct_size = sizeof info};
    TEST_OK(moe_adamw_state(opt, 0, &info));
    assert_string_equal(info.name, "p.master");
    assert_memory_equal(info.value.data, p, sizeof p); /* host: the param is the master */
    TEST_OK(moe_adamw_destroy(opt));
    TEST_OK(moe_runtime_destroy(rt));
}

/* Run forward+backward for two microbatches, either interleaved through slots 0 and 1 or
 * one after the other through slot 0, and return the accumulated gradients. */
static void accumulate(bool interleaved, float **grads, int64_t *sizes)
{
    moe_layer_config_t cfg = moe_layer_config_default();
    cfg.hidden = 6;
    cfg.ffn_hidden = 4;
    cfg.num_experts = 5;
    cfg.top_k = 2;
    cfg.capacity_factor = 1.0f;
    cfg.max_microbatches = 2;
    test_rng_t rng = {base_seed};
    fixture_t fx;
    fixture_init(&fx, &cfg, 9, &rng, 1.0);
    float x[2][9 * 6], dy[2][9 * 6], y[2][9 * 6];
    for (int b = 0; b < 2; b++) {
        test_fill_normal(&rng, x[b], 9 * 6, 1.0);
        test_fill_normal(&rng, dy[b], 9 * 6, 1.0);
    }
    moe_tensor_t xt[2], yt[2], dyt[2];
    int64_t shape[2] = {9, 6};
    for (int b = 0; b < 2; b++) {
        TEST_OK(moe_tensor_view(x[b], MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &xt[b]));
        TEST_OK(moe_tensor_view(y[b], MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &yt[b]));
        TEST_OK(moe_tensor_view(dy[b], MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &dyt[b]));
    }
    if (interleaved) {
        TEST_OK(moe_layer_forward(fx.layer, 0, &xt[0], &yt[0]));
        TEST_OK(moe_layer_forward(fx.layer, 1, &xt[1], &yt[1]));
        TEST_OK(moe_layer_backward(fx.layer, 1, &dyt[1], NULL));
        TEST_OK(moe_layer_backward(fx.layer, 0, &dyt[0], NULL));
    } else {
        for (int b = 0; b < 2; b++) {
            TEST_OK(moe_layer_forward(fx.layer, 0, &xt[b], &yt[b]));
            TEST_OK(moe_layer_backward(fx.layer, 0, &dyt[b], NULL));
        }
    }
    for (int i = 0; i < 3; i++) {
        sizes[i] = moe_tensor_numel(&fx.p[i].grad);
        grads[i] = malloc(sizeof(float) * (size_t)sizes[i]);
        memcpy(grads[i], fx.p[i].grad.data, sizeof(float) * (size_t)sizes[i]);
    }
    TEST_OK(moe_layer_zero_grad(fx.layer));
    for (int i = 0; i < 3; i++)
        for (int64_t j = 0; j < sizes[i]; j++) assert_true(((float *)fx.p[i].grad.data)[j] == 0.0f);
    fixture_free(&fx);
}

static void test_accumulation_over_slots(void **state)
{
    (void)state;
    float *a[3], *b[3];
    int64_t n[3];
    accumulate(true, a, n);
    accumulate(false, b, n);
    for (int i = 0; i < 3; i++) {
        double norm = 0;
        for (int64_t j = 0; j < n[i]; j++) norm += fabs(a[i][j]);
        assert_true(norm > 0); /* the microbatches did produce gradients */
        /* equal up to the rounding of the summation order (backward of mb1 ran first) */
        assert_true(test_rel_err(a[i], b[i], n[i]) < 1e-6);
        free(a[i]);
        free(b[i]);
    }
}

/* One forward+backward of the n tokens x (fp32 [n,6]) with upstream gradient dy. */
static void step(fixture_t *fx, const float *x, const float *dy, int64_t n)
{
    int64_t shape[2] = {n, 6};
    float *y = malloc(sizeof(float) * (size_t)(n * 6));
    moe_tensor_t xt, yt, dyt;
    TEST_OK(moe_tensor_view((void *)x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &xt));
    TEST_OK(moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &yt));
    TEST_OK(moe_tensor_view((void *)dy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &dyt));
    TEST_OK(moe_layer_forward(fx->layer, 0, &xt, &yt));
    TEST_OK(moe_layer_backward(fx->layer, 0, &dyt, NULL));
    free(y);
}

/* discard_grad, then two microbatches, gives the gradients of zero_grad then the same two,
 * whatever the gradients held before: the first backward writes the experts' (empty experts
 * included: 3 tokens with top-1 leave at least 5 of 8 experts without rows), the second adds.
 * A batch that sees no tokens at all writes zeros. */
static void test_discard_grad(void **state)
{
    (void)state;
    moe_layer_config_t cfg = moe_layer_config_default();
    cfg.hidden = 6;
    cfg.ffn_hidden = 4;
    cfg.num_experts = 8;
    cfg.top_k = 1;
    test_rng_t rng = {base_seed};
    fixture_t fx;
    fixture_init(&fx, &cfg, 64, &rng, 1.0);
    float big_x[64 * 6], big_dy[64 * 6], x[2][3 * 6], dy[2][3 * 6];
    test_fill_normal(&rng, big_x, 64 * 6, 1.0);
    test_fill_normal(&rng, big_dy, 64 * 6, 1.0);
    for (int b = 0; b < 2; b++) {
        test_fill_normal(&rng, x[b], 3 * 6, 1.0);
        test_fill_normal(&rng, dy[b], 3 * 6, 1.0);
    }
    float *ref[3];
    int64_t sizes[3];
    TEST_OK(moe_layer_zero_grad(fx.layer));
    for (int b = 0; b < 2; b++) step(&fx, x[b], dy[b], 3);
    for (int i = 0; i < 3; i++) {
        sizes[i] = moe_tensor_numel(&fx.p[i].grad);
        ref[i] = malloc(sizeof(float) * (size_t)sizes[i]);
        memcpy(ref[i], fx.p[i].grad.data, sizeof(float) * (size_t)sizes[i]);
    }
    for (int round = 0; round < 2; round++) {
        step(&fx, big_x, big_dy, 64); /* every expert's gradient non-zero now */
        for (int i = 1; i < 3; i++) {
            int64_t nonzero = 0;
            for (int64_t j = 0; j < sizes[i]; j++)
                nonzero += ((float *)fx.p[i].grad.data)[j] != ref[i][j];
            assert_true(nonzero > sizes[i] / 2);
        }
        TEST_OK(moe_layer_discard_grad(fx.layer));
        if (round == 1) TEST_OK(moe_layer_discard_grad(fx.layer)); /* twice is once */
        for (int b = 0; b < 2; b++) step(&fx, x[b], dy[b], 3);
        for (int i = 0; i < 3; i++)
            for (int64_t j = 0; j < sizes[i]; j++)
                assert_true(((float *)fx.p[i].grad.data)[j] == ref[i][j]);
    }
    step(&fx, big_x, big_dy, 64);
    TEST_OK(moe_layer_discard_grad(fx.layer));
    step(&fx, big_x, big_dy, 0);
    for (int i = 0; i < 3; i++) {
        for (int64_t j = 0; j < sizes[i]; j++) assert_true(((float *)fx.p[i].grad.data)[j] == 0.0f);
        free(ref[i]);
    }
    assert_int_equal(moe_layer_discard_grad(NULL), MOE_STATUS_INVALID_HANDLE);
    fixture_free(&fx);
}

/* router.expert_bias is parameter 3 with expert_bias = 1 (an fp32 buffer [E] without
 * gradient) and absent without it: 3 parameters, and index 3 is a clear INVALID_ARGUMENT. */
static void test_expert_bias_param_only_when_enabled(void **state)
{
    (void)state;
    moe_layer_config_t cfg = moe_layer_config_default();
    cfg.hidden = 6;
    cfg.ffn_hidden = 4;
    cfg.num_experts = 5;
    cfg.top_k = 2;
    for (int enabled = 0; enabled <= 1; enabled++) {
        cfg.expert_bias = enabled;
        test_rng_t rng = {base_seed};
        fixture_t fx;
        fixture_init(&fx, &cfg, 4, &rng, 1.0);
        int32_t count = 0;
        TEST_OK(moe_layer_num_params(fx.layer, &count));
        assert_int_equal(count, enabled ? 4 : 3);
        moe_param_info_t b = {.struct_size = sizeof b};
        if (enabled) {
            TEST_OK(moe_layer_param(fx.layer, 3, &b));
            assert_string_equal(b.name, "router.expert_bias");
            assert_int_equal(b.kind, MOE_PARAM_BUFFER);
            assert_int_equal(b.value.dtype, MOE_DTYPE_F32);
            assert_int_equal(b.value.ndim, 1);
            assert_int_equal(b.value.shape[0], 5);
            assert_null(b.grad.data);
        } else {
            assert_int_equal(moe_layer_param(fx.layer, 3, &b), MOE_STATUS_INVALID_ARGUMENT);
            assert_non_null(strstr(moe_last_error(), "index 3 is out of range 0..2"));
            assert_non_null(strstr(moe_last_error(), "only with expert_bias = 1"));
        }
        fixture_free(&fx);
    }
}

/* The expert bias follows the sign rule after each forward: experts loaded above the mean
 * lose `rate`, experts below it gain `rate`, experts exactly at the mean keep their bias. */
static void test_expert_bias_sign_rule(void **state)
{
    (void)state;
    moe_layer_config_t cfg = moe_layer_config_default();
    cfg.hidden = 6;
    cfg.ffn_hidden = 4;
    cfg.num_experts = 6;
    cfg.top_k = 2;
    cfg.expert_bias = 1;
    cfg.expert_bias_rate = 0.25f;
    test_rng_t rng = {base_seed};
    fixture_t fx;
    fixture_init(&fx, &cfg, 21, &rng, 1.0);
    moe_param_info_t b = {.struct_size = sizeof b};
    TEST_OK(moe_layer_param(fx.layer, 3, &b));
    assert_string_equal(b.name, "router.expert_bias");
    assert_int_equal(b.kind, MOE_PARAM_BUFFER);
    float expected[6] = {0};
    float y[21 * 6];
    for (int round = 0; round < 3; round++) {
        fixture_forward(&fx, y);
        int64_t load[6];
        moe_layer_stats_t st = {.struct_size = sizeof st};
        TEST_OK(moe_layer_stats(fx.layer, &st, load)); /* dropless: accepted = selected */
        double mean = 21.0 * 2 / 6;
        for (int e = 0; e < 6; e++)
            expected[e] += 0.25f * (float)((mean > load[e]) - (mean < load[e]));
        assert_memory_equal(b.value.data, expected, sizeof expected);
        TEST_OK(moe_layer_release_slot(fx.layer, 0));
    }
    fixture_free(&fx);
}

int main(void)
{
    base_seed = test_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adamw_matches_formula),
        cmocka_unit_test(test_accumulation_over_slots),
        cmocka_unit_test(test_discard_grad),
        cmocka_unit_test(test_expert_bias_param_only_when_enabled),
        cmocka_unit_test(test_expert_bias_sign_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
