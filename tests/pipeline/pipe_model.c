/* The pipeline test model of pipe_model.h. */
#include "pipe_model.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_support.h"

static int is_moe(const pm_shape_t *sh, int layer)
{
    return sh->moe_every > 0 && layer % sh->moe_every == sh->moe_every - 1;
}

static size_t nh(const pm_model_t *pm) { return (size_t)pm->sh.n * (size_t)pm->sh.h; }

static void fill(uint64_t seed, uint64_t a, uint64_t b, float *x, size_t n, double std)
{
    test_rng_t r = {seed ^ (a * 0x9e3779b97f4a7c15ull) ^ (b * 0xc2b2ae3d27d4eb4full)};
    test_fill_normal(&r, x, (int64_t)n, std);
}

/* the input and target of microbatch mb */
static void data_of(const pm_model_t *pm, int mb, float *x, float *t)
{
    if (x) fill(pm->sh.seed, 1000 + pm->sh.data_rank, (uint64_t)mb, x, nh(pm), 1.0);
    if (t) fill(pm->sh.seed, 2000 + pm->sh.data_rank, (uint64_t)mb, t, nh(pm), 0.5);
}

void pm_split(int layers, int p, int s, int *first, int *last)
{
    *first = layers * s / p;
    *last = layers * (s + 1) / p;
}

static moe_status_t view(float *p, const pm_model_t *pm, moe_tensor_t *t)
{
    int64_t shape[2] = {pm->sh.n, pm->sh.h};
    return moe_tensor_view(p, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, t);
}

moe_status_t pm_model_create(moe_runtime_t *rt, const pm_shape_t *sh, int first, int last,
                             pm_model_t **out)
{
    pm_model_t *pm = calloc(1, sizeof *pm);
    pm->rt = rt;
    pm->sh = *sh;
    pm->first = first;
    pm->last = last;
    pm->fail_mb = -1;
    int nl = last - first;
    size_t hh = (size_t)sh->h * (size_t)sh->h;
    pm->w = calloc((size_t)nl, sizeof *pm->w);
    pm->gw = calloc((size_t)nl, sizeof *pm->gw);
    pm->moe = calloc((size_t)nl, sizeof *pm->moe);
    moe_adamw_config_t oc = moe_adamw_config_default();
    oc.lr = 1e-2f;
    oc.weight_decay = 0.0f;
    moe_status_t st = moe_adamw_create(rt, &oc, &pm->opt);
    if (st) return st;
    for (int i = 0; i < nl; i++) {
        int layer = first + i;
        if (is_moe(sh, layer)) {
            moe_layer_config_t lc = moe_layer_config_default();
            lc.hidden = sh->h;
            lc.ffn_hidden = sh->ffn;
            lc.num_experts = sh->experts;
            lc.top_k = sh->top_k;
            lc.max_microbatches = sh->m;
            lc.init_std = 0.3f;
            if ((st = moe_layer_create(rt, &lc, &pm->moe[i]))) return st;
            char prefix[32];
            snprintf(prefix, sizeof prefix, "moe%d.", layer);
            if ((st = moe_adamw_add_layer(pm->opt, pm->moe[i], prefix))) return st;
        } else {
            pm->w[i] = malloc(hh * sizeof(float));
            pm->gw[i] = calloc(hh, sizeof(float));
            fill(sh->seed, 3000, (uint64_t)layer, pm->w[i], hh, 1.0 / sqrt((double)sh->h));
            int64_t shape[2] = {sh->h, sh->h};
            moe_tensor_t tv, tg;
            moe_tensor_view(pm->w[i], MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &tv);
            moe_tensor_view(pm->gw[i], MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &tg);
            char name[32];
            snprintf(name, sizeof name, "dense%d", layer);
            if ((st = moe_adamw_add_param(pm->opt, name, MOE_PARAM_DENSE, &tv, &tg))) return st;
        }
    }
    pm->act = calloc((size_t)sh->m, sizeof *pm->act);
    pm->kept_x = calloc((size_t)sh->m, sizeof *pm->kept_x);
    for (int mb = 0; mb < sh->m; mb++) {
        pm->act[mb] = calloc((size_t)nl + 1, sizeof **pm->act);
        for (int i = 0; i <= nl; i++) pm->act[mb][i] = calloc(nh(pm), sizeof(float));
    }
    pm->g0 = calloc(nh(pm), sizeof(float));
    pm->g1 = calloc(nh(pm), sizeof(float));
    *out = pm;
    return MOE_STATUS_SUCCESS;
}

void pm_model_destroy(pm_model_t *pm)
{
    if (!pm) return;
    moe_adamw_destroy(pm->opt);
    int nl = pm->last - pm->first;
    for (int i = 0; i < nl; i++) {
        free(pm->w[i]);
        free(pm->gw[i]);
        moe_layer_destroy(pm->moe[i]);
    }
    for (int mb = 0; mb < pm->sh.m; mb++) {
        for (int i = 0; i <= nl; i++) free(pm->act[mb][i]);
        free(pm->act[mb]);
    }
    free(pm->act);
    free(pm->kept_x);
    free(pm->w);
    free(pm->gw);
    free(pm->moe);
    free(pm->g0);
    free(pm->g1);
    free(pm);
}

static bool all_zero(const moe_tensor_t *t, size_t n)
{
    const float *f = t->data;
    for (size_t i = 0; i < n; i++)
        if (f[i] != 0.0f) return false;
    return true;
}

static bool inject(const pm_model_t *pm, const char *what, int mb)
{
    return pm->fail_what && strcmp(pm->fail_what, what) == 0 && pm->fail_mb == mb;
}

/* ---- callbacks ------------------------------------------------------------------------------- */

static moe_status_t cb_forward(void *user, int32_t chunk, int32_t mb, const moe_tensor_t *x,
                               moe_tensor_t *y)
{
    pm_model_t *pm = user;
    (void)chunk;
    const pm_shape_t *sh = &pm->sh;
    int nl = pm->last - pm->first;
    if (inject(pm, "forward", mb)) return MOE_STATUS_BACKEND_ERROR;
    if (x && all_zero(x, nh(pm))) pm->zero_inputs++;
    if (x)
        memcpy(pm->act[mb][0], x->data, nh(pm) * sizeof(float));
    else
        data_of(pm, mb, pm->act[mb][0], NULL);
    pm->kept_x[mb] = x;
    for (int i = 0; i < nl; i++) {
        const float *in = pm->act[mb][i];
        float *out = pm->act[mb][i + 1];
        if (pm->moe[i]) {
            moe_tensor_t tx, ty;
            view((float *)in, pm, &tx);
            view(out, pm, &ty);
            moe_status_t st = moe_layer_forward(pm->moe[i], mb, &tx, &ty);
            if (st) return st;
            for (size_t k = 0; k < nh(pm); k++) out[k] += in[k];
        } else {
            const float *w = pm->w[i];
            for (int t = 0; t < sh->n; t++)
                for (int j = 0; j < sh->h; j++) {
                    double acc = 0;
                    for (int k = 0; k < sh->h; k++)
                        acc += (double)in[t * sh->h + k] * w[k * sh->h + j];
                    out[t * sh->h + j] = (float)tanh(acc);
                }
        }
    }
    if (y) memcpy(y->data, pm->act[mb][nl], nh(pm) * sizeof(float));
    pm->forwards++;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cb_loss(void *user, int32_t mb, const moe_tensor_t *y, moe_tensor_t *dy,
                            double *loss)
{
    pm_model_t *pm = user;
    if (inject(pm, "loss", mb)) return MOE_STATUS_INVALID_ARGUMENT;
    float *t = malloc(nh(pm) * sizeof(float));
    data_of(pm, mb, NULL, t);
    const float *yy = y->data;
    float *d = dy->data;
    double l = 0;
    for (size_t k = 0; k < nh(pm); k++) {
        double e = (double)yy[k] - t[k];
        l += 0.5 * e * e / pm->sh.n;
        d[k] = (float)(e / pm->sh.n);
    }
    free(t);
    *loss = l;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cb_backward(void *user, int32_t chunk, int32_t mb, const moe_tensor_t *dy,
                                moe_tensor_t *dx)
{
    pm_model_t *pm = user;
    (void)chunk;
    const pm_shape_t *sh = &pm->sh;
    int nl = pm->last - pm->first;
    if (inject(pm, "backward", mb)) return MOE_STATUS_BACKEND_ERROR;
    if (all_zero(dy, nh(pm))) pm->zero_inputs++;
    float *g = pm->g0, *gn = pm->g1;
    memcpy(g, dy->data, nh(pm) * sizeof(float));
    for (int i = nl - 1; i >= 0; i--) {
        const float *in = i == 0 && pm->kept_x[mb] ? pm->kept_x[mb]->data : pm->act[mb][i];
        const float *out = pm->act[mb][i + 1];
        if (pm->moe[i]) {
            moe_tensor_t tdy, tdx;
            view(g, pm, &tdy);
            view(gn, pm, &tdx);
            moe_status_t st = moe_layer_backward(pm->moe[i], mb, &tdy, &tdx);
            if (st) return st;
            for (size_t k = 0; k < nh(pm); k++) gn[k] += g[k];
        } else {
            const float *w = pm->w[i];
            float *gw = pm->gw[i];
            /* dpre = g * (1 - y^2) stored in g */
            for (size_t k = 0; k < nh(pm); k++) g[k] *= 1.0f - out[k] * out[k];
            for (int k = 0; k < sh->h; k++)
                for (int j = 0; j < sh->h; j++) {
                    double acc = 0;
                    for (int t = 0; t < sh->n; t++)
                        acc += (double)in[t * sh->h + k] * g[t * sh->h + j];
                    gw[k * sh->h + j] += (float)acc;
                }
            for (int t = 0; t < sh->n; t++)
                for (int k = 0; k < sh->h; k++) {
                    double acc = 0;
                    for (int j = 0; j < sh->h; j++)
                        acc += (double)g[t * sh->h + j] * w[k * sh->h + j];
                    gn[t * sh->h + k] = (float)acc;
                }
        }
        float *tmp = g;
        g = gn;
        gn = tmp;
    }
    if (dx) memcpy(dx->data, g, nh(pm) * sizeof(float));
    pm->backwards++;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cb_zero_grad(void *user)
{
    pm_model_t *pm = user;
    int nl = pm->last - pm->first;
    for (int i = 0; i < nl; i++) {
        if (pm->moe[i]) {
            moe_status_t st = moe_layer_zero_grad(pm->moe[i]);
            if (st) return st;
        } else {
            memset(pm->gw[i], 0, (size_t)pm->sh.h * (size_t)pm->sh.h * sizeof(float));
        }
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cb_step(void *user, float grad_scale)
{
    pm_model_t *pm = user;
    pm->steps++;
    return moe_adamw_step(pm->opt, 0.0f, grad_scale);
}

static moe_status_t cb_abandon(void *user, int32_t chunk, int32_t mb)
{
    pm_model_t *pm = user;
    (void)chunk;
    pm->abandoned++;
    for (int i = 0; i < pm->last - pm->first; i++)
        if (pm->moe[i]) (void)moe_layer_release_slot(pm->moe[i], mb);
    return MOE_STATUS_SUCCESS;
}

moe_pipeline_callbacks_t pm_callbacks(pm_model_t *pm)
{
    moe_pipeline_callbacks_t cb = {.forward = cb_forward,
                                   .loss = cb_loss,
                                   .backward = cb_backward,
                                   .zero_grad = cb_zero_grad,
                                   .step = cb_step,
                                   .abandon = cb_abandon,
                                   .user = pm};
    return cb;
}

/* ---- chunk dispatch ---------------------------------------------------------------------- */

static moe_status_t ch_forward(void *user, int32_t chunk, int32_t mb, const moe_tensor_t *x,
                               moe_tensor_t *y)
{
    return cb_forward(((pm_chunks_t *)user)->chunk[chunk], 0, mb, x, y);
}

static moe_status_t ch_loss(void *user, int32_t mb, const moe_tensor_t *y, moe_tensor_t *dy,
                            double *loss)
{
    pm_chunks_t *pc = user;
    return cb_loss(pc->chunk[pc->v - 1], mb, y, dy, loss);
}

static moe_status_t ch_backward(void *user, int32_t chunk, int32_t mb, const moe_tensor_t *dy,
                                moe_tensor_t *dx)
{
    return cb_backward(((pm_chunks_t *)user)->chunk[chunk], 0, mb, dy, dx);
}

static moe_status_t ch_zero_grad(void *user)
{
    pm_chunks_t *pc = user;
    for (int c = 0; c < pc->v; c++) {
        moe_status_t st = cb_zero_grad(pc->chunk[c]);
        if (st) return st;
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t ch_step(void *user, float grad_scale)
{
    pm_chunks_t *pc = user;
    for (int c = 0; c < pc->v; c++) {
        moe_status_t st = cb_step(pc->chunk[c], grad_scale);
        if (st) return st;
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t ch_abandon(void *user, int32_t chunk, int32_t mb)
{
    return cb_abandon(((pm_chunks_t *)user)->chunk[chunk], 0, mb);
}

moe_pipeline_callbacks_t pm_chunks_callbacks(pm_chunks_t *pc)
{
    moe_pipeline_callbacks_t cb = {.forward = ch_forward,
                                   .loss = ch_loss,
                                   .backward = ch_backward,
                                   .zero_grad = ch_zero_grad,
                                   .step = ch_step,
                                   .abandon = ch_abandon,
                                   .user = pc};
    return cb;
}

moe_status_t pm_reference_step(pm_model_t *pm, double *loss)
{
    moe_status_t st = cb_zero_grad(pm);
    if (st) return st;
    size_t bytes = nh(pm) * sizeof(float);
    float *y = malloc(bytes), *dy = malloc(bytes);
    moe_tensor_t ty, tdy;
    view(y, pm, &ty);
    view(dy, pm, &tdy);
    double sum = 0;
    for (int mb = 0; mb < pm->sh.m && !st; mb++) {
        double l = 0;
        if (!st) st = cb_forward(pm, 0, mb, NULL, &ty);
        if (!st) st = cb_loss(pm, mb, &ty, &tdy, &l);
        if (!st) st = cb_backward(pm, 0, mb, &tdy, NULL);
        sum += l;
    }
    free(y);
    free(dy);
    if (st) return st;
    *loss = sum / pm->sh.m;
    return cb_step(pm, 1.0f / (float)pm->sh.m);
}

moe_status_t pm_layer_tensor(pm_model_t *pm, int layer, int kind, float **out, int64_t *n)
{
    int i = layer - pm->first;
    if (i < 0 || layer >= pm->last) return MOE_STATUS_INVALID_ARGUMENT;
    if (!pm->moe[i]) {
        *n = (int64_t)pm->sh.h * pm->sh.h;
        *out = malloc((size_t)*n * sizeof(float));
        memcpy(*out, kind ? pm->gw[i] : pm->w[i], (size_t)*n * sizeof(float));
        return MOE_STATUS_SUCCESS;
    }
    int32_t np = 0;
    moe_status_t st = moe_layer_num_params(pm->moe[i], &np);
    if (st) return st;
    int64_t total = 0;
    float *buf = NULL;
    for (int32_t p = 0; p < np; p++) {
        moe_param_info_t info = {.struct_size = sizeof info};
        if ((st = moe_layer_param(pm->moe[i], p, &info))) return st;
        if (info.kind == MOE_PARAM_BUFFER) continue;
        const moe_tensor_t *t = kind ? &info.grad : &info.value;
        int64_t k = moe_tensor_numel(t);
        buf = realloc(buf, (size_t)(total + k) * sizeof(float));
        memcpy(buf + total, t->data, (size_t)k * sizeof(float));
        total += k;
    }
    *out = buf;
    *n = total;
    return MOE_STATUS_SUCCESS;
}
