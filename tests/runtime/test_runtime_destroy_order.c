/*
 * A runtime is not destroyed under the objects made on it: moe_runtime_destroy refuses with
 * INVALID_ARGUMENT naming what is alive, the runtime and those objects stay usable, and the
 * runtime's destroy succeeds once they are gone. (Destroying the runtime first used to
 * succeed, and the object's later destroy then used freed memory.)
 *
 * World of one (no mesh), host backend: layers, an optimizer, a pipeline and a checkpointer
 * (whose abort also lets the runtime go).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <moe/moe.h>

#define OK(call) assert_int_equal((call), MOE_STATUS_SUCCESS)

static moe_status_t fwd(void *u, int32_t c, int32_t mb, const moe_tensor_t *x, moe_tensor_t *y)
{
    (void)u, (void)c, (void)mb, (void)x, (void)y;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t bwd(void *u, int32_t c, int32_t mb, const moe_tensor_t *dy, moe_tensor_t *dx)
{
    (void)u, (void)c, (void)mb, (void)dy, (void)dx;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t loss(void *u, int32_t mb, const moe_tensor_t *y, moe_tensor_t *dy, double *l)
{
    (void)u, (void)mb, (void)y, (void)dy;
    *l = 0;
    return MOE_STATUS_SUCCESS;
}

static void expect_refused(moe_runtime_t *rt, const char *alive)
{
    assert_int_equal(moe_runtime_destroy(rt), MOE_STATUS_INVALID_ARGUMENT);
    if (!strstr(moe_last_error(), alive)) fail_msg("'%s' not in: %s", alive, moe_last_error());
    moe_backend_kind_t kind;
    OK(moe_runtime_backend(rt, &kind)); /* still a runtime */
}

static void t_children_first(void **state)
{
    (void)state;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    moe_runtime_t *rt = NULL;
    OK(moe_runtime_create(&rc, &rt));
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = 8, lc.ffn_hidden = 8, lc.num_experts = 4, lc.top_k = 2;
    moe_layer_t *layer = NULL, *second = NULL;
    OK(moe_layer_create(rt, &lc, &layer));
    OK(moe_layer_create(rt, &lc, &second));
    moe_adamw_t *opt = NULL;
    OK(moe_adamw_create(rt, NULL, &opt));
    OK(moe_adamw_add_layer(opt, layer, NULL));
    moe_pipeline_config_t pc = moe_pipeline_config_default();
    pc.act_ndim = 2;
    pc.act_shape[0] = 4;
    pc.act_shape[1] = 8;
    moe_pipeline_callbacks_t cb = {.forward = fwd, .backward = bwd, .loss = loss};
    moe_pipeline_t *pipe = NULL;
    OK(moe_pipeline_create(rt, &pc, &cb, &pipe));
    char dir[] = "/tmp/moe-children-XXXXXX";
    assert_non_null(mkdtemp(dir));
    moe_ckpt_config_t kc = moe_ckpt_config_default();
    kc.dir = dir;
    moe_ckpt_t *ck = NULL;
    OK(moe_ckpt_create(rt, &kc, &ck));

    expect_refused(rt, "2 layers, 1 optimizer, 1 pipeline, 1 checkpointer");
    moe_ckpt_abort(ck);
    rmdir(dir);
    expect_refused(rt, "2 layers, 1 optimizer, 1 pipeline made on it");
    OK(moe_pipeline_destroy(pipe));
    expect_refused(rt, "2 layers, 1 optimizer");
    OK(moe_adamw_destroy(opt));
    OK(moe_layer_destroy(second));
    expect_refused(rt, "1 layer made on it");
    /* the layer still works after the refusal */
    float x[2 * 8] = {0.1f, 0.2f}, y[2 * 8];
    int64_t shape[2] = {2, 8};
    moe_tensor_t tx, ty;
    OK(moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &tx));
    OK(moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &ty));
    OK(moe_layer_forward(layer, 0, &tx, &ty));
    OK(moe_layer_release_slot(layer, 0));
    OK(moe_layer_destroy(layer));
    OK(moe_runtime_destroy(rt));
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(t_children_first)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
