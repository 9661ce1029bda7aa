/*
 * Bad input for every public call of the core, layer and optimizer API: each returns the
 * documented status with a message naming the problem, and nothing crashes.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "test_support.h"

/* The call fails with `want` and leaves a message containing `needle`. */
#define EXPECT_FAIL(want, needle, call)                                                            \
    do {                                                                                           \
        moe_status_t got_ = (call);                                                                \
        if (got_ != (want) || strstr(moe_last_error(), (needle)) == NULL)                          \
            fprintf(stderr, "%s -> %s: \"%s\"\n", #call, moe_status_string(got_),                  \
                    moe_last_error());                                                             \
        assert_int_equal(got_, (want));                                                            \
        assert_non_null(strstr(moe_last_error(), (needle)));                                       \
    } while (0)

static moe_runtime_t *host_runtime(void)
{
    moe_runtime_config_t c = moe_runtime_config_default();
    c.backend = MOE_BACKEND_HOST;
    moe_runtime_t *rt = NULL;
    TEST_OK(moe_runtime_create(&c, &rt));
    return rt;
}

static moe_layer_config_t small_layer(void)
{
    moe_layer_config_t c = moe_layer_config_default();
    c.hidden = 4;
    c.ffn_hidden = 6;
    c.num_experts = 4;
    c.top_k = 2;
    return c;
}

static void test_status_and_version(void **state)
{
    (void)state;
    assert_string_equal(moe_status_string(MOE_STATUS_SUCCESS), "success");
    assert_string_equal(moe_status_string((moe_status_t)999), "unknown status");
    assert_int_equal(moe_version(), MOE_VERSION);
    assert_non_null(moe_version_string());
    assert_int_equal(moe_dtype_size((moe_dtype_t)7), 0);
    assert_string_equal(moe_dtype_name((moe_dtype_t)7), "unknown");
}

static void test_runtime_bad_input(void **state)
{
    (void)state;
    moe_runtime_config_t c = moe_runtime_config_default();
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "out is NULL", moe_runtime_create(&c, NULL));
    c.struct_size = 3;
    moe_runtime_t *rt = NULL;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "struct_size is 3", moe_runtime_create(&c, &rt));
    assert_null(rt);
    c = moe_runtime_config_default();
    c.backend = (moe_backend_kind_t)9;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown backend 9", moe_runtime_create(&c, &rt));
    c = moe_runtime_config_default();
    c.log_level = (moe_log_level_t)12;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown log level 12", moe_runtime_create(&c, &rt));
    moe_mesh_config_t mesh = moe_mesh_config_default();
    mesh.ep = 0;
    c = moe_runtime_config_default();
    c.backend = MOE_BACKEND_HOST;
    c.mesh = &mesh;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "ep=0", moe_runtime_create(&c, &rt));

    assert_int_equal(moe_runtime_destroy(NULL), MOE_STATUS_SUCCESS);
    /* a pointer that is not a live runtime */
    uint64_t fake[16] = {0};
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "not a live handle",
                moe_runtime_destroy((moe_runtime_t *)fake));
    moe_backend_kind_t kind;
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "runtime is NULL", moe_runtime_backend(NULL, &kind));
    rt = host_runtime();
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "out is NULL", moe_runtime_backend(rt, NULL));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "kind is NULL", moe_runtime_device(rt, NULL, NULL));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "out is NULL", moe_runtime_compute_dtype(rt, NULL));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown log level",
                moe_runtime_set_log(rt, (moe_log_level_t)-1, NULL, NULL));
    int32_t r, s;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown axis",
                moe_runtime_axis(rt, (moe_axis_t)17, &r, &s));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "NULL", moe_runtime_axis(rt, MOE_AXIS_EP, NULL, &s));
    TEST_OK(moe_runtime_axis(rt, MOE_AXIS_WORLD, &r, &s));
    assert_int_equal(r, 0);
    assert_int_equal(s, 1);
    TEST_OK(moe_runtime_synchronize(rt));
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "runtime is NULL", moe_runtime_synchronize(NULL));
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "runtime is NULL", moe_runtime_set_stream(NULL, NULL));
    void *stream = &stream; /* the host backend has no stream: the getter says NULL */
    TEST_OK(moe_runtime_get_stream(rt, &stream));
    assert_null(stream);
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "runtime is NULL",
                moe_runtime_get_stream(NULL, &stream));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "cuda_stream is NULL",
                moe_runtime_get_stream(rt, NULL));
    TEST_OK(moe_runtime_destroy(rt));
}

static void test_tensor_bad_input(void **state)
{
    (void)state;
    float buf[8];
    moe_tensor_t t;
    int64_t shape[2] = {2, 4}, neg[2] = {2, -1};
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "ndim is 5",
                moe_tensor_view(buf, MOE_DTYPE_F32, MOE_DEVICE_HOST, 5, shape, &t));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown dtype 7",
                moe_tensor_view(buf, (moe_dtype_t)7, MOE_DEVICE_HOST, 2, shape, &t));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "shape[1] is -1",
                moe_tensor_view(buf, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, neg, &t));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown device",
                moe_tensor_view(buf, MOE_DTYPE_F32, (moe_device_kind_t)5, 2, shape, &t));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "out is NULL",
                moe_tensor_view(buf, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, NULL));
    assert_int_equal(moe_tensor_numel(NULL), -1);

    moe_runtime_t *rt = host_runtime();
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "not available",
                moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_CUDA, 2, shape, &t));
    /* 2^32 x 2^32 elements: the count would not fit, so the shape is refused, not wrapped */
    int64_t huge[2] = {(int64_t)1 << 32, (int64_t)1 << 32};
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "more than",
                moe_tensor_view(&t, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, huge, &t));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "more than",
                moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, huge, &t));
    int64_t none[2] = {(int64_t)1 << 62, 0}; /* a zero extent: no elements, whatever the other */
    TEST_OK(moe_tensor_view(NULL, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, none, &t));
    moe_tensor_t a, b;
    TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &a));
    int64_t other[1] = {7};
    TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 1, other, &b));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "8 elements and dst 7", moe_tensor_copy(rt, &b, &a));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "NULL", moe_tensor_copy(rt, NULL, &a));
    /* f32 -> bf16 -> f32 round trip keeps bf16-representable values exactly */
    for (int i = 0; i < 8; i++) ((float *)a.data)[i] = (float)(i - 3) * 0.5f;
    moe_tensor_t c16, back;
    TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 2, shape, &c16));
    TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &back));
    TEST_OK(moe_tensor_copy(rt, &c16, &a));
    TEST_OK(moe_tensor_copy(rt, &back, &c16));
    assert_memory_equal(a.data, back.data, sizeof(float) * 8);
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "tensor is NULL", moe_tensor_free(rt, NULL));
    TEST_OK(moe_tensor_free(rt, &a));
    TEST_OK(moe_tensor_free(rt, &a)); /* a cleared descriptor is a no-op */
    TEST_OK(moe_tensor_free(rt, &b));
    TEST_OK(moe_tensor_free(rt, &c16));
    TEST_OK(moe_tensor_free(rt, &back));
    TEST_OK(moe_runtime_destroy(rt));
}

static void test_layer_config_bad_input(void **state)
{
    (void)state;
    moe_runtime_t *rt = host_runtime();
    moe_layer_t *l = NULL;
    moe_layer_config_t c = small_layer();
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "runtime is NULL", moe_layer_create(NULL, &c, &l));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "config is NULL", moe_layer_create(rt, NULL, &l));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "out is NULL", moe_layer_create(rt, &c, NULL));
    c.top_k = 5;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "top_k is 5", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.top_k = 0;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "top_k is 0", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.num_experts = 0;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "num_experts is 0", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.hidden = 0;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "hidden is 0", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.ffn_hidden = -3;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "ffn_hidden is -3", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.score_fn = (moe_score_fn_t)4;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown score_fn 4", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.placement = (moe_expert_placement_t)4;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown placement 4", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.max_microbatches = 0;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "max_microbatches is 0", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.ffn_hidden = (int64_t)1 << 62; /* its weights' element count overflows */
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "too many parameters", moe_layer_create(rt, &c, &l));
    c = small_layer();
    c.struct_size = 8;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "struct_size is 8", moe_layer_create(rt, &c, &l));
    assert_null(l);
    assert_int_equal(moe_layer_destroy(NULL), MOE_STATUS_SUCCESS);
    TEST_OK(moe_runtime_destroy(rt));
}

static void test_layer_call_bad_input(void **state)
{
    (void)state;
    moe_runtime_t *rt = host_runtime();
    moe_layer_config_t c = small_layer();
    c.max_microbatches = 2;
    moe_layer_t *l = NULL;
    TEST_OK(moe_layer_create(rt, &c, &l));
    float xb[3 * 4] = {0}, yb[3 * 4], bad[3 * 5];
    int64_t s34[2] = {3, 4}, s35[2] = {3, 5}, s24[2] = {2, 4};
    moe_tensor_t x, y, xw, yw, x16;
    TEST_OK(moe_tensor_view(xb, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, s34, &x));
    TEST_OK(moe_tensor_view(yb, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, s34, &y));
    TEST_OK(moe_tensor_view(bad, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, s35, &xw));
    TEST_OK(moe_tensor_view(yb, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, s24, &yw));
    TEST_OK(moe_tensor_view(xb, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 2, s34, &x16));

    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "layer is NULL", moe_layer_forward(NULL, 0, &x, &y));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "slot 2 is out of range",
                moe_layer_forward(l, 2, &x, &y));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "x is NULL", moe_layer_forward(l, 0, NULL, &y));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "y is NULL", moe_layer_forward(l, 0, &x, NULL));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "x shape[1] is 5; expected 4",
                moe_layer_forward(l, 0, &xw, &y));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "y shape[0] is 2; expected 3",
                moe_layer_forward(l, 0, &x, &yw));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "x has dtype bf16; expected f32",
                moe_layer_forward(l, 0, &x16, &y));
    moe_tensor_t xu = x;
    xu.dtype = (moe_dtype_t)9;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "unknown dtype 9", moe_layer_forward(l, 0, &xu, &y));
    moe_tensor_t xd = x;
    xd.device = MOE_DEVICE_CUDA;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "x is on cuda memory; expected host",
                moe_layer_forward(l, 0, &xd, &y));
    moe_tensor_t xn = x;
    xn.data = NULL;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "x data is NULL", moe_layer_forward(l, 0, &xn, &y));
    moe_tensor_t x3 = x;
    x3.ndim = 3;
    x3.shape[2] = 1;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "x has 3 dimensions; expected 2",
                moe_layer_forward(l, 0, &x3, &y));

    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "slot 0 holds no forward",
                moe_layer_backward(l, 0, &y, &x));
    TEST_OK(moe_layer_forward(l, 0, &x, &y));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "slot 0 already holds a forward",
                moe_layer_forward(l, 0, &x, &y));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "dy shape[0] is 2; expected 3",
                moe_layer_backward(l, 0, &yw, &x));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "dx shape[1] is 5; expected 4",
                moe_layer_backward(l, 0, &y, &xw));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "dx overlaps dy", moe_layer_backward(l, 0, &y, &y));
    TEST_OK(moe_layer_backward(l, 0, &y, NULL)); /* dx is optional */
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "slot -1", moe_layer_release_slot(l, -1));
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "layer is NULL", moe_layer_zero_grad(NULL));

    int32_t count = 0;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "count is NULL", moe_layer_num_params(l, NULL));
    TEST_OK(moe_layer_num_params(l, &count));
    assert_int_equal(count, 3);
    moe_param_info_t info = {.struct_size = sizeof info};
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "index 3 is out of range",
                moe_layer_param(l, 3, &info));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "info is NULL", moe_layer_param(l, 0, NULL));
    info.struct_size = 0;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "struct_size is 0", moe_layer_param(l, 0, &info));
    int32_t ge;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "local_expert 4 is out of range",
                moe_layer_expert_id(l, 4, &ge));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "global_expert is NULL",
                moe_layer_expert_id(l, 0, NULL));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "stats is NULL", moe_layer_stats(l, NULL, NULL));
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));
}

/* A capacity factor too large for an int64 capacity is dropless: every slot is kept and the
 * reported capacity is all of them, N * K. */
static void test_layer_huge_capacity_factor(void **state)
{
    (void)state;
    moe_runtime_t *rt = host_runtime();
    moe_layer_config_t c = small_layer();
    c.capacity_factor = 1e30f;
    moe_layer_t *l = NULL;
    TEST_OK(moe_layer_create(rt, &c, &l));
    float xb[3 * 4] = {1, -2, 3, 0.5f, 2, 1, -1, 0, 0.25f, 4, -3, 2}, yb[3 * 4];
    int64_t s34[2] = {3, 4};
    moe_tensor_t x, y;
    TEST_OK(moe_tensor_view(xb, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, s34, &x));
    TEST_OK(moe_tensor_view(yb, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, s34, &y));
    TEST_OK(moe_layer_forward(l, 0, &x, &y));
    moe_layer_stats_t st = {.struct_size = sizeof st};
    TEST_OK(moe_layer_stats(l, &st, NULL));
    assert_int_equal(st.capacity, 3 * 2);
    assert_int_equal(st.dropped_slots, 0);
    TEST_OK(moe_layer_release_slot(l, 0));
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));
}

static void test_adamw_bad_input(void **state)
{
    (void)state;
    moe_runtime_t *rt = host_runtime();
    moe_adamw_t *opt = NULL;
    moe_adamw_config_t c = moe_adamw_config_default();
    c.lr = -1;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "lr is -1", moe_adamw_create(rt, &c, &opt));
    c = moe_adamw_config_default();
    c.beta2 = 1.0f;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "beta2 is 1", moe_adamw_create(rt, &c, &opt));
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "runtime is NULL", moe_adamw_create(NULL, NULL, &opt));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "out is NULL", moe_adamw_create(rt, NULL, NULL));
    TEST_OK(moe_adamw_create(rt, NULL, &opt));
    float v[4] = {1, 2, 3, 4}, g[4] = {0};
    int64_t s4[1] = {4}, s3[1] = {3};
    moe_tensor_t vt, gt, g3, g16;
    TEST_OK(moe_tensor_view(v, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, s4, &vt));
    TEST_OK(moe_tensor_view(g, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, s4, &gt));
    TEST_OK(moe_tensor_view(g, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, s3, &g3));
    TEST_OK(moe_tensor_view(g, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 1, s4, &g16));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "name is NULL",
                moe_adamw_add_param(opt, NULL, MOE_PARAM_DENSE, &vt, &gt));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "grad shape[0] is 3; expected 4",
                moe_adamw_add_param(opt, "w", MOE_PARAM_DENSE, &vt, &g3));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "grad has dtype bf16; expected f32",
                moe_adamw_add_param(opt, "w", MOE_PARAM_DENSE, &vt, &g16));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "not a trainable kind",
                moe_adamw_add_param(opt, "w", MOE_PARAM_BUFFER, &vt, &gt));
    moe_tensor_t v7 = vt; /* more dimensions than a descriptor holds */
    v7.ndim = 7;
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "value has 7 dimensions; expected 1..4",
                moe_adamw_add_param(opt, "w", MOE_PARAM_DENSE, &v7, &gt));
    TEST_OK(moe_adamw_add_param(opt, "w", MOE_PARAM_DENSE, &vt, &gt));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "already registered",
                moe_adamw_add_param(opt, "w", MOE_PARAM_DENSE, &vt, &gt));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "grad_scale is 0", moe_adamw_step(opt, 0, 0));
    EXPECT_FAIL(MOE_STATUS_INVALID_HANDLE, "layer is NULL", moe_adamw_add_layer(opt, NULL, NULL));
    /* two layers need distinct prefixes */
    moe_layer_config_t lc = small_layer();
    moe_layer_t *l1, *l2;
    TEST_OK(moe_layer_create(rt, &lc, &l1));
    TEST_OK(moe_layer_create(rt, &lc, &l2));
    TEST_OK(moe_adamw_add_layer(opt, l1, NULL));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "\"router.weight\" is already registered",
                moe_adamw_add_layer(opt, l2, NULL));
    TEST_OK(moe_adamw_add_layer(opt, l2, "layers.1."));
    int32_t nstates = 0;
    TEST_OK(moe_adamw_num_states(opt, &nstates));
    assert_int_equal(nstates, 3 * (1 + 3 + 3)); /* w, then 3 per layer; the failed add added none */
    moe_param_info_t info = {.struct_size = sizeof info};
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "index 21 is out of range",
                moe_adamw_state(opt, 21, &info));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "steps is -2", moe_adamw_set_step_count(opt, -2));
    EXPECT_FAIL(MOE_STATUS_INVALID_ARGUMENT, "steps is NULL", moe_adamw_step_count(opt, NULL));
    assert_int_equal(moe_adamw_destroy(NULL), MOE_STATUS_SUCCESS);
    TEST_OK(moe_adamw_destroy(opt));
    TEST_OK(moe_layer_destroy(l1));
    TEST_OK(moe_layer_destroy(l2));
    TEST_OK(moe_runtime_destroy(rt));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_and_version),
        cmocka_unit_test(test_runtime_bad_input),
        cmocka_unit_test(test_tensor_bad_input),
        cmocka_unit_test(test_layer_config_bad_input),
        cmocka_unit_test(test_layer_call_bad_input),
        cmocka_unit_test(test_layer_huge_capacity_factor),
        cmocka_unit_test(test_adamw_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
