/*
 * The optimizer's controls on the host backend, world of one: learning-rate schedules
 * against their formula (include/moe/optim.h), MOE_ADAMW_LR_CONFIGURED and the values lr may
 * take, global gradient-norm clipping (the update with clipping equals the update of the
 * scaled-down gradient), and moe_layer_create_seeded (stream 0 is moe_layer_create's
 * values, other streams give other values).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "test_support.h"

static void test_schedule_formula(void **state)
{
    (void)state;
    moe_lr_schedule_t s = {
        .decay = MOE_LR_COSINE, .warmup_steps = 10, .decay_steps = 110, .min_lr_ratio = 0.1f};
    assert_true(fabsf(moe_lr_schedule_rate(&s, 1.0f, 5) - 0.5f) < 1e-7f);
    assert_true(fabsf(moe_lr_schedule_rate(&s, 1.0f, 10) - 1.0f) < 1e-7f);
    assert_true(fabsf(moe_lr_schedule_rate(&s, 1.0f, 60) - 0.55f) < 1e-6f); /* p = 1/2 */
    assert_true(fabsf(moe_lr_schedule_rate(&s, 1.0f, 110) - 0.1f) < 1e-6f);
    assert_true(fabsf(moe_lr_schedule_rate(&s, 1.0f, 500) - 0.1f) < 1e-6f);
    s.decay = MOE_LR_LINEAR;
    assert_true(fabsf(moe_lr_schedule_rate(&s, 2.0f, 35) - 2.0f * (1 - 0.9f * 0.25f)) < 1e-6f);
    s.decay = MOE_LR_CONSTANT;
    assert_true(moe_lr_schedule_rate(&s, 2.0f, 1000) == 2.0f);
    s.decay = MOE_LR_COSINE;
    s.decay_steps = 10; /* not past the warm-up */
    assert_true(moe_lr_schedule_rate(&s, 1.0f, 20) < 0);
    moe_runtime_t *rt;
    TEST_OK(moe_runtime_create(NULL, &rt));
    moe_adamw_t *opt = NULL;
    TEST_OK(moe_adamw_create(rt, NULL, &opt));
    assert_int_equal(moe_adamw_set_lr_schedule(opt, &s), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "schedule"));
    assert_int_equal(moe_adamw_set_grad_clip(opt, -1.0f), MOE_STATUS_INVALID_ARGUMENT);
    TEST_OK(moe_adamw_destroy(opt));
    TEST_OK(moe_runtime_destroy(rt));
}

/* One f32 parameter p with gradient g, on a host runtime. */
typedef struct one_param {
    moe_runtime_t *rt;
    moe_adamw_t *opt;
    float p[4], g[4];
} one_param_t;

static void one_param_init(one_param_t *o, const moe_adamw_config_t *c, float clip,
                           const moe_lr_schedule_t *schedule)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.log_level = MOE_LOG_ERROR; /* the lr 0 note is a warning */
    TEST_OK(moe_runtime_create(&rc, &o->rt));
    TEST_OK(moe_adamw_create(o->rt, c, &o->opt));
    TEST_OK(moe_adamw_set_grad_clip(o->opt, clip));
    if (schedule) TEST_OK(moe_adamw_set_lr_schedule(o->opt, schedule));
    const float p0[4] = {1, -2, 3, 0.5f}, g0[4] = {3, 0, -4, 0}; /* |g| = 5 */
    memcpy(o->p, p0, sizeof p0);
    memcpy(o->g, g0, sizeof g0);
    int64_t shape[1] = {4};
    moe_tensor_t tp, tg;
    TEST_OK(moe_tensor_view(o->p, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, shape, &tp));
    TEST_OK(moe_tensor_view(o->g, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, shape, &tg));
    TEST_OK(moe_adamw_add_param(o->opt, "p", MOE_PARAM_DENSE, &tp, &tg));
}

static void one_param_free(one_param_t *o)
{
    TEST_OK(moe_adamw_destroy(o->opt));
    TEST_OK(moe_runtime_destroy(o->rt));
}

static void test_lr_values(void **state)
{
    (void)state;
    moe_adamw_config_t c = moe_adamw_config_default();
    c.lr = 0.25f;
    moe_lr_schedule_t warmup = {.decay = MOE_LR_CONSTANT, .warmup_steps = 4};
    one_param_t o;
    one_param_init(&o, &c, 0, &warmup);
    float lr;
    double norm;
    TEST_OK(moe_adamw_step(o.opt, MOE_ADAMW_LR_CONFIGURED, 1.0f));
    TEST_OK(moe_adamw_last_step(o.opt, &lr, &norm));
    assert_true(lr == 0.25f / 4);               /* warm-up step 1 of 4 */
    assert_true(norm == -1);                    /* no clipping configured: not measured */
    TEST_OK(moe_adamw_step(o.opt, 0.0f, 1.0f)); /* 0: the configured rate, step 2 */
    TEST_OK(moe_adamw_last_step(o.opt, &lr, NULL));
    assert_true(lr == 0.25f / 2);
    TEST_OK(moe_adamw_step(o.opt, 0.5f, 1.0f)); /* explicit: no schedule */
    TEST_OK(moe_adamw_last_step(o.opt, &lr, NULL));
    assert_true(lr == 0.5f);
    assert_int_equal(moe_adamw_step(o.opt, -2.0f, 1.0f), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "MOE_ADAMW_LR_CONFIGURED"));
    one_param_free(&o);
}

static void test_clipping(void **state)
{
    (void)state;
    moe_adamw_config_t c = moe_adamw_config_default();
    one_param_t clipped, ref;
    one_param_init(&clipped, &c, 1.0f, NULL);
    one_param_init(&ref, &c, 0, NULL);
    for (int i = 0; i < 4; i++) ref.g[i] /= 5; /* the gradient clipping makes of g */
    TEST_OK(moe_adamw_step(clipped.opt, MOE_ADAMW_LR_CONFIGURED, 1.0f));
    TEST_OK(moe_adamw_step(ref.opt, MOE_ADAMW_LR_CONFIGURED, 1.0f));
    double norm;
    TEST_OK(moe_adamw_last_step(clipped.opt, NULL, &norm));
    assert_true(fabs(norm - 5.0) < 1e-12);
    for (int i = 0; i < 4; i++) assert_true(fabsf(clipped.p[i] - ref.p[i]) <= 1e-7f);
    one_param_free(&clipped);
    one_param_free(&ref);
}

static void layer_router(uint64_t stream, float *out)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    moe_runtime_t *rt;
    TEST_OK(moe_runtime_create(&rc, &rt));
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = 4;
    lc.ffn_hidden = 4;
    lc.num_experts = 2;
    lc.top_k = 1;
    moe_layer_t *l;
    if (stream == 0)
        TEST_OK(moe_layer_create(rt, &lc, &l));
    else
        TEST_OK(moe_layer_create_seeded(rt, &lc, stream, &l));
    moe_param_info_t info = {.struct_size = sizeof info};
    TEST_OK(moe_layer_param(l, 0, &info));
    memcpy(out, info.value.data, sizeof(float) * 8);
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));
}

static void test_init_stream(void **state)
{
    (void)state;
    float a[8], b[8], c[8];
    layer_router(0, a); /* moe_layer_create */
    layer_router(0, b);
    layer_router(3, c); /* moe_layer_create_seeded, stream 3 */
    assert_memory_equal(a, b, sizeof a);
    assert_memory_not_equal(a, c, sizeof a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_schedule_formula),
        cmocka_unit_test(test_lr_values),
        cmocka_unit_test(test_clipping),
        cmocka_unit_test(test_init_stream),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
