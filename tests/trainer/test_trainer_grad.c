/*
 * The trainer's model against finite differences (host backend, world of one).
 *
 * A tiny model (L 2, H 8, 2 heads, T 6, E 4, K 2, F 8, S 2 sequences of random bytes) runs
 * forward, loss and backward; for every parameter tensor (dense ones and each MoE layer's)
 * the analytic gradient g is checked along its own direction u = g / |g|:
 *   (J(p + eps u) - J(p - eps u)) / (2 eps)  ~  |g|
 * where J is the objective the gradients belong to: cross-entropy plus each layer's
 * aux_coef * aux + z_coef * z (libmoe adds their gradients itself). A gradient with a wrong
 * component along or across g changes |g| or the slope, so both kinds of error show. fp32
 * throughout, bound 1% relative. The difference quotient holds only where routing does not
 * change: a token whose top-k choice flips inside the step makes the slope jump (with some
 * draws even at eps 1e-3). So each side's routing (every layer's tokens per expert) is
 * compared with the unperturbed one, and eps is quartered (1e-3, 2.5e-4, 6.25e-5) until
 * neither side flips; a tensor whose routing flips at every eps is a failure.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "model.h"
#include "test_support.h"

enum { S = 2, T = 6 };

typedef struct tensor_ref {
    const char *name;
    float *value, *grad;
    int64_t n;
} tensor_ref_t;

static trainer_config_t tiny_config(void)
{
    trainer_config_t c;
    trainer_config_default(&c);
    c.layers = 2;
    c.hidden = 8;
    c.heads = 2;
    c.context = T;
    c.experts = 4;
    c.top_k = 2;
    c.ffn_hidden = 8;
    c.microbatches = 1;
    c.init_std = 0.5;
    c.expert_bias = 0; /* its update after every forward would move the objective */
    c.aux_loss_coef = 0.1;
    c.z_loss_coef = 0.01;
    return c;
}

/* The objective at the current parameters (forward only); [out] routing: every layer's
 * tokens per expert, [blocks][E]. */
static double objective(model_t *m, const trainer_config_t *c, const uint8_t *tok,
                        const uint8_t *tgt, float *y, int64_t *routing)
{
    TEST_OK(model_forward(m, 0, 0, tok, NULL, y));
    double ce;
    TEST_OK(model_loss(m, y, tgt, 1.0f, NULL, &ce));
    double j = ce;
    for (int64_t b = 0; b < m->blocks_per_chunk; b++) {
        moe_layer_stats_t s = {.struct_size = sizeof s};
        TEST_OK(moe_layer_stats(m->blocks[b].moe, &s, routing + b * c->experts));
        j += c->aux_loss_coef * s.aux_loss + c->z_loss_coef * s.z_loss;
    }
    model_release(m, 0, 0);
    return j;
}

static void test_model_gradients(void **state)
{
    (void)state;
    trainer_config_t c = tiny_config();
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.seed = 11;
    moe_runtime_t *rt;
    TEST_OK(moe_runtime_create(&rc, &rt));
    model_t *m;
    assert_int_equal(model_create(rt, &c, 0, 1, S, &m), 0);
    int64_t N = S * T, H = c.hidden;
    uint8_t tok[S * T], tgt[S * T];
    test_rng_t r = {test_seed()};
    for (int64_t i = 0; i < N; i++) {
        tok[i] = (uint8_t)test_rng_int(&r, 0, 255);
        tgt[i] = (uint8_t)test_rng_int(&r, 0, 255);
    }
    float *y = malloc(sizeof(float) * (size_t)(N * H)),
          *dy = malloc(sizeof(float) * (size_t)(N * H));

    TEST_OK(model_zero_grad(m));
    TEST_OK(model_forward(m, 0, 0, tok, NULL, y));
    double ce;
    TEST_OK(model_loss(m, y, tgt, 1.0f, dy, &ce));
    TEST_OK(model_backward(m, 0, 0, dy, NULL));

    tensor_ref_t refs[64];
    int nrefs = 0;
    for (int32_t i = 0; i < m->nparams; i++)
        refs[nrefs++] = (tensor_ref_t){m->params[i]->name, m->params[i]->value, m->params[i]->grad,
                                       m->params[i]->shape[0] * m->params[i]->shape[1]};
    for (int64_t b = 0; b < m->blocks_per_chunk; b++) {
        int32_t np;
        TEST_OK(moe_layer_num_params(m->blocks[b].moe, &np));
        for (int32_t i = 0; i < np; i++) {
            moe_param_info_t info = {.struct_size = sizeof info};
            TEST_OK(moe_layer_param(m->blocks[b].moe, i, &info));
            if (info.kind == MOE_PARAM_BUFFER) continue;
            refs[nrefs++] = (tensor_ref_t){info.name, info.value.data, info.grad.data,
                                           moe_tensor_numel(&info.value)};
        }
    }
    /* routing of the unperturbed parameters and of each side of a difference */
    int64_t base[2 * 4] = {0}, plus[2 * 4], minus[2 * 4];
    assert_true(m->blocks_per_chunk * c.experts == (int64_t)(sizeof base / sizeof base[0]));
    (void)objective(m, &c, tok, tgt, y, base);
    int failures = 0;
    for (int k = 0; k < nrefs; k++) {
        tensor_ref_t *t = &refs[k];
        float *g = malloc(sizeof(float) * (size_t)t->n), *p0 = malloc(sizeof(float) * (size_t)t->n);
        memcpy(g, t->grad, sizeof(float) * (size_t)t->n);
        memcpy(p0, t->value, sizeof(float) * (size_t)t->n);
        double norm = 0;
        for (int64_t i = 0; i < t->n; i++) norm += (double)g[i] * g[i];
        norm = sqrt(norm);
        double eps = 1e-3, jp = 0, jm = 0;
        bool smooth = false;
        for (int tries = 0; tries < 3 && !smooth; tries++, eps /= 4) {
            for (int64_t i = 0; i < t->n; i++) t->value[i] = p0[i] + (float)(eps * g[i] / norm);
            jp = objective(m, &c, tok, tgt, y, plus);
            for (int64_t i = 0; i < t->n; i++) t->value[i] = p0[i] - (float)(eps * g[i] / norm);
            jm = objective(m, &c, tok, tgt, y, minus);
            smooth = !memcmp(plus, base, sizeof plus) && !memcmp(minus, base, sizeof minus);
        }
        eps *= 4; /* the last one tried */
        memcpy(t->value, p0, sizeof(float) * (size_t)t->n);
        double fd = (jp - jm) / (2 * eps), rel = fabs(fd - norm) / norm;
        printf("%-28s |g| %.6e  slope %.6e  rel %.2e  eps %.2e%s\n", t->name, norm, fd, rel, eps,
               smooth ? "" : "  routing flips at every eps");
        if (!smooth || !(rel <= 1e-2)) failures++;
        free(g);
        free(p0);
    }
    assert_int_equal(failures, 0);
    free(y);
    free(dy);
    model_destroy(m);
    TEST_OK(moe_runtime_destroy(rt));
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_model_gradients)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
