/* Test fixture: a host layer with test-controlled parameters. */
#include "layer_fixture.h"

#include <string.h>

static double *fill(test_rng_t *rng, int64_t n, double scale)
{
    double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = (float)(scale * test_rng_normal(rng));
    return v;
}

void fixture_init(fixture_t *fx, const moe_layer_config_t *cfg, int64_t n, test_rng_t *rng,
                  double scale)
{
    memset(fx, 0, sizeof *fx);
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    TEST_OK(moe_runtime_create(&rc, &fx->rt));
    TEST_OK(moe_layer_create(fx->rt, cfg, &fx->layer));
    int64_t h = cfg->hidden, f = cfg->ffn_hidden, e = cfg->num_experts;
    fx->n = n;
    fx->ref = (ref_cfg_t){.n = n,
                          .h = h,
                          .f = f,
                          .e = cfg->num_experts,
                          .k = cfg->top_k,
                          .score_fn = cfg->score_fn,
                          .renormalize = cfg->renormalize,
                          .capacity_factor = cfg->capacity_factor,
                          .aux_coef = cfg->aux_loss_coef,
                          .z_coef = cfg->z_loss_coef};
    fx->x = fill(rng, n * h, 1.0);
    fx->wg = fill(rng, h * e, scale);
    fx->w1 = fill(rng, e * h * 2 * f, scale);
    fx->w2 = fill(rng, e * f * h, scale);
    fx->xf = malloc(sizeof(float) * (size_t)(n * h + 1));
    for (int64_t i = 0; i < n * h; i++) fx->xf[i] = (float)fx->x[i];
    for (int i = 0; i < 3; i++) {
        fx->p[i].struct_size = sizeof fx->p[i];
        TEST_OK(moe_layer_param(fx->layer, i, &fx->p[i]));
    }
    fixture_push_params(fx);
}

void fixture_push_params(fixture_t *fx)
{
    const double *src[3] = {fx->wg, fx->w1, fx->w2};
    for (int i = 0; i < 3; i++) {
        float *dst = fx->p[i].value.data;
        int64_t n = moe_tensor_numel(&fx->p[i].value);
        for (int64_t j = 0; j < n; j++) dst[j] = (float)src[i][j];
    }
}

void fixture_forward(fixture_t *fx, float *y)
{
    moe_tensor_t xt, yt;
    int64_t shape[2] = {fx->n, fx->ref.h};
    TEST_OK(moe_tensor_view(fx->xf, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &xt));
    TEST_OK(moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &yt));
    TEST_OK(moe_layer_forward(fx->layer, 0, &xt, &yt));
}

void fixture_free(fixture_t *fx)
{
    TEST_OK(moe_layer_destroy(fx->layer));
    TEST_OK(moe_runtime_destroy(fx->rt));
    free(fx->x);
    free(fx->wg);
    free(fx->w1);
    free(fx->w2);
    free(fx->xf);
}
