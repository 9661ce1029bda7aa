/* The byte-level MoE language model (model.h): layout over the pipeline, parameters, the MoE
 * layers, and the calls into the backend's compute (model_backend.h). */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model_backend.h"

/* ---- parameters ------------------------------------------------------------------------------ */

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t hash_name(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static int64_t param_numel(const dense_param_t *p) { return p->shape[0] * p->shape[1]; }

static int report(const char *what, const char *name)
{
    fprintf(stderr, "moe_train: %s %s: %s\n", what, name, moe_last_error());
    return -1;
}

/* Allocate a parameter on the model's device, in its dtype, with an f32 gradient; std > 0
 * draws N(0, std^2) from (seed, name, index), else fills 1. The values are drawn in fp32 on
 * the host and converted (to bf16 on CUDA) by the copy. */
static int param_init(model_t *m, dense_param_t *p, const char *name, int32_t ndim, int64_t d0,
                      int64_t d1, uint64_t seed, double std)
{
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = ndim > 1 ? d1 : 1;
    int64_t n = param_numel(p);
    float *init = malloc(sizeof(float) * (size_t)n);
    if (!init) return -1;
    uint64_t key = mix64(seed ^ hash_name(name));
    for (int64_t i = 0; i < n; i++) {
        if (std <= 0) {
            init[i] = 1.0f;
            continue;
        }
        uint64_t base = mix64(key + (uint64_t)i * 0x9e3779b97f4a7c15ull);
        double u1 = ((double)(mix64(base) >> 11) + 0.5) * 0x1.0p-53;
        double u2 = (double)(mix64(base + 1) >> 11) * 0x1.0p-53;
        init[i] = (float)(std * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    moe_tensor_t v, g, src;
    int rc = 0;
    if (moe_tensor_alloc(m->rt, m->dtype, m->device, p->ndim, p->shape, &v) != MOE_STATUS_SUCCESS ||
        moe_tensor_alloc(m->rt, MOE_DTYPE_F32, m->device, p->ndim, p->shape, &g) !=
            MOE_STATUS_SUCCESS) {
        rc = report("allocating", name);
    } else {
        p->value = v.data;
        p->grad = g.data;
        if (moe_tensor_view(init, MOE_DTYPE_F32, MOE_DEVICE_HOST, p->ndim, p->shape, &src) !=
                MOE_STATUS_SUCCESS ||
            moe_tensor_copy(m->rt, &v, &src) != MOE_STATUS_SUCCESS)
            rc = report("initialising", name);
    }
    free(init);
    return rc;
}

static void param_free(model_t *m, dense_param_t *p)
{
    moe_tensor_t t;
    if (p->value &&
        moe_tensor_view(p->value, m->dtype, m->device, p->ndim, p->shape, &t) == MOE_STATUS_SUCCESS)
        moe_tensor_free(m->rt, &t);
    if (p->grad && moe_tensor_view(p->grad, MOE_DTYPE_F32, m->device, p->ndim, p->shape, &t) ==
                       MOE_STATUS_SUCCESS)
        moe_tensor_free(m->rt, &t);
    p->value = p->grad = NULL;
}

static int add_param(model_t *m, dense_param_t *p)
{
    dense_param_t **grown = realloc(m->params, sizeof *grown * (size_t)(m->nparams + 1));
    if (!grown) return -1;
    m->params = grown;
    m->params[m->nparams++] = p;
    return 0;
}

/* ---- blocks -------------------------------------------------------------------------------- */

/* The router's initial logits have this standard deviation (its input is RMS-normalised, so
 * the weights get ROUTER_LOGIT_STD / sqrt(H)): the scores start close to uniform and every
 * expert close to its share, whatever the width. */
#define ROUTER_LOGIT_STD 0.1
/* Embedding rows N(0, 1) whatever the width: each token's own vector must dominate the
 * residual stream at the first router, whose attention branch adds about 0.4 / sqrt(2 L) per
 * coordinate shared by the tokens of a position (docs/trainer.md). */
#define EMBED_STD 1.0

/* Multiply a MoE layer's parameter (index as moe_layer_param) by factor, through the host. */
static int scale_layer_param(model_t *m, moe_layer_t *layer, int32_t index, double factor)
{
    moe_param_info_t info = {.struct_size = sizeof info};
    if (moe_layer_param(layer, index, &info) != MOE_STATUS_SUCCESS)
        return report("reading", "a MoE parameter");
    int64_t n = moe_tensor_numel(&info.value);
    float *buf = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!buf) return -1;
    moe_tensor_t host;
    int rc = 0;
    if (moe_tensor_view(buf, MOE_DTYPE_F32, MOE_DEVICE_HOST, info.value.ndim, info.value.shape,
                        &host) != MOE_STATUS_SUCCESS ||
        moe_tensor_copy(m->rt, &host, &info.value) != MOE_STATUS_SUCCESS)
        rc = report("reading", info.name);
    for (int64_t i = 0; !rc && i < n; i++) buf[i] = (float)(buf[i] * factor);
    if (!rc && moe_tensor_copy(m->rt, &info.value, &host) != MOE_STATUS_SUCCESS)
        rc = report("scaling", info.name);
    free(buf);
    return rc;
}

/* Initialisation (docs/trainer.md, "Initialisation and defaults"): every projection N(0,
 * sigma^2) with sigma = trainer_init_std (sqrt(2 / (5 H)) by default); the two projections
 * that write into the residual stream (attention's Wo, the experts' W2) sigma / sqrt(2 L), so
 * the stream's variance at the head does not grow with depth; the router ROUTER_LOGIT_STD /
 * sqrt(H); RMSNorm gains 1. */
static int block_create(model_t *m, block_t *b, int64_t index, const trainer_config_t *c)
{
    int64_t H = m->H;
    uint64_t seed = (uint64_t)c->seed;
    double sigma = trainer_init_std(c), depth = 1.0 / sqrt(2.0 * (double)c->layers);
    char name[96];
    b->index = index;
    snprintf(name, sizeof name, "blocks.%lld.norm1", (long long)index);
    if (param_init(m, &b->norm1, name, 1, H, 1, seed, 0)) return -1;
    snprintf(name, sizeof name, "blocks.%lld.attn.wqkv", (long long)index);
    if (param_init(m, &b->wqkv, name, 2, H, 3 * H, seed, sigma)) return -1;
    snprintf(name, sizeof name, "blocks.%lld.attn.wo", (long long)index);
    if (param_init(m, &b->wo, name, 2, H, H, seed, sigma * depth)) return -1;
    snprintf(name, sizeof name, "blocks.%lld.norm2", (long long)index);
    if (param_init(m, &b->norm2, name, 1, H, 1, seed, 0)) return -1;

    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = H;
    lc.ffn_hidden = c->ffn_hidden;
    lc.num_experts = (int32_t)c->experts;
    lc.top_k = (int32_t)c->top_k;
    lc.score_fn = !strcmp(c->score_fn, "sigmoid") ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
    lc.capacity_factor = (float)c->capacity_factor;
    lc.aux_loss_coef = (float)c->aux_loss_coef;
    lc.aux_global_batch = (int32_t)c->aux_global_batch;
    lc.z_loss_coef = (float)c->z_loss_coef;
    lc.expert_bias = (int32_t)c->expert_bias;
    lc.expert_bias_rate = (float)c->expert_bias_rate;
    lc.init_std = (float)sigma;
    lc.max_microbatches = m->microbatches;
    /* each block its own stream of initial values: its own experts and router */
    moe_status_t st = moe_layer_create_seeded(m->rt, &lc, (uint64_t)index + 1, &b->moe);
    if (st != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "moe_train: block %lld: moe_layer_create: %s\n", (long long)index,
                moe_last_error());
        return -1;
    }
    /* the layer draws all three from init_std: rescale the router and the down projection */
    if (scale_layer_param(m, b->moe, 0, ROUTER_LOGIT_STD / sqrt((double)H) / sigma) ||
        scale_layer_param(m, b->moe, 2, depth))
        return -1;
    return 0;
}

static void block_destroy(model_t *m, block_t *b)
{
    param_free(m, &b->norm1);
    param_free(m, &b->wqkv);
    param_free(m, &b->wo);
    param_free(m, &b->norm2);
    moe_layer_destroy(b->moe);
}

/* ---- the stage ------------------------------------------------------------------------------ */

static const model_ops_t *backend_ops(moe_runtime_t *rt)
{
    moe_backend_kind_t kind = MOE_BACKEND_HOST;
    if (moe_runtime_backend(rt, &kind) != MOE_STATUS_SUCCESS) return NULL;
    if (kind == MOE_BACKEND_HOST) return &model_host_ops;
#ifdef TRAINER_CUDA
    if (kind == MOE_BACKEND_CUDA) return &model_cuda_ops;
#endif
    fprintf(stderr, "moe_train: the trainer was built without the CUDA model "
                    "(configure with -DMOE_CUDA=ON)\n");
    return NULL;
}

int model_create(moe_runtime_t *rt, const trainer_config_t *c, int32_t stage, int32_t stages,
                 int64_t S, model_t **out)
{
    model_t *m = calloc(1, sizeof *m);
    if (!m) return -1;
    *out = m;
    m->rt = rt;
    if (!(m->ops = backend_ops(rt))) return -1;
    if (moe_runtime_compute_dtype(rt, &m->dtype) != MOE_STATUS_SUCCESS ||
        moe_runtime_device(rt, &m->device, &m->device_index) != MOE_STATUS_SUCCESS)
        return report("runtime", "query");
    m->S = S;
    m->T = c->context;
    m->H = c->hidden;
    m->heads = c->heads;
    m->N = S * c->context;
    m->microbatches = (int32_t)c->microbatches;
    m->chunks = (int32_t)c->virtual_stages;
    m->blocks_per_chunk = c->layers / (stages * m->chunks);
    m->first = stage == 0;
    m->last = stage == stages - 1;
    int64_t H = m->H;
    uint64_t seed = (uint64_t)c->seed;
    double sigma = trainer_init_std(c);
    if (m->first) {
        if (param_init(m, &m->embed, "embed", 2, MODEL_VOCAB, H, seed, EMBED_STD)) return -1;
        if (param_init(m, &m->pos_embed, "pos_embed", 2, m->T, H, seed, EMBED_STD)) return -1;
        if (add_param(m, &m->embed) || add_param(m, &m->pos_embed)) return -1;
    }
    int64_t nb = m->chunks * m->blocks_per_chunk;
    m->blocks = calloc((size_t)nb, sizeof *m->blocks);
    if (!m->blocks) return -1;
    for (int32_t ch = 0; ch < m->chunks; ch++)
        for (int64_t j = 0; j < m->blocks_per_chunk; j++) {
            int64_t vs = (int64_t)ch * stages + stage;
            block_t *b = &m->blocks[ch * m->blocks_per_chunk + j];
            if (block_create(m, b, vs * m->blocks_per_chunk + j, c)) return -1;
            if (add_param(m, &b->norm1) || add_param(m, &b->wqkv) || add_param(m, &b->wo) ||
                add_param(m, &b->norm2))
                return -1;
        }
    if (m->last) {
        if (param_init(m, &m->norm_f, "norm_f", 1, H, 1, seed, 0)) return -1;
        if (param_init(m, &m->head, "head", 2, H, MODEL_VOCAB, seed, sigma)) return -1;
        if (add_param(m, &m->norm_f) || add_param(m, &m->head)) return -1;
    }
    if (m->ops->create(m)) return -1;
    return model_zero_grad(m) == MOE_STATUS_SUCCESS ? 0 : report("zeroing", "gradients");
}

void model_destroy(model_t *m)
{
    if (!m) return;
    if (m->ops) m->ops->destroy(m);
    if (m->blocks)
        for (int64_t i = 0; i < m->chunks * m->blocks_per_chunk; i++)
            block_destroy(m, &m->blocks[i]);
    free(m->blocks);
    param_free(m, &m->embed);
    param_free(m, &m->pos_embed);
    param_free(m, &m->norm_f);
    param_free(m, &m->head);
    free(m->params);
    free(m);
}

moe_status_t model_forward(model_t *m, int32_t chunk, int32_t mb, const uint8_t *tokens,
                           const void *x, void *y)
{
    return m->ops->forward(m, chunk, mb, tokens, x, y);
}

moe_status_t model_backward(model_t *m, int32_t chunk, int32_t mb, const void *dy, void *dx)
{
    return m->ops->backward(m, chunk, mb, dy, dx);
}

void model_release(model_t *m, int32_t chunk, int32_t mb)
{
    block_t *b = &m->blocks[(int64_t)chunk * m->blocks_per_chunk];
    for (int64_t j = 0; j < m->blocks_per_chunk; j++) (void)moe_layer_release_slot(b[j].moe, mb);
}

moe_status_t model_loss(model_t *m, const void *y, const uint8_t *targets, float weight, void *dy,
                        double *loss)
{
    return m->ops->loss(m, y, targets, weight, dy, loss);
}

moe_status_t model_clear(model_t *m, void *act) { return m->ops->clear(m, act); }

static double seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef moe_status_t (*layer_call_fn)(moe_layer_t *, int32_t, const moe_tensor_t *, moe_tensor_t *);

/* Run one MoE layer call between two waits for the device (none on the host), timed. */
static moe_status_t timed(model_t *m, int which, layer_call_fn call, block_t *b, int32_t mb,
                          const moe_tensor_t *in, moe_tensor_t *out)
{
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (m->device != MOE_DEVICE_HOST) st = moe_runtime_synchronize(m->rt);
    double t0 = seconds();
    if (st == MOE_STATUS_SUCCESS) st = call(b->moe, mb, in, out);
    if (st == MOE_STATUS_SUCCESS && m->device != MOE_DEVICE_HOST)
        st = moe_runtime_synchronize(m->rt);
    m->moe_seconds[which] += seconds() - t0;
    return st;
}

moe_status_t model_moe_forward(model_t *m, block_t *b, int32_t mb, const moe_tensor_t *x,
                               moe_tensor_t *y)
{
    return timed(m, 0, moe_layer_forward, b, mb, x, y);
}

moe_status_t model_moe_backward(model_t *m, block_t *b, int32_t mb, const moe_tensor_t *dy,
                                moe_tensor_t *dx)
{
    return timed(m, 1, moe_layer_backward, b, mb, dy, dx);
}

moe_status_t model_zero_grad(model_t *m)
{
    moe_status_t st = m->ops->zero_dense_grads(m);
    if (st != MOE_STATUS_SUCCESS) return st;
    for (int64_t i = 0; i < m->chunks * m->blocks_per_chunk; i++)
        if ((st = moe_layer_zero_grad(m->blocks[i].moe)) != MOE_STATUS_SUCCESS) return st;
    return MOE_STATUS_SUCCESS;
}

/* Copy every layer's bias (parameter 3) between the layers and host [blocks][E]: to_host 1
 * reads them, 0 writes them back. */
static moe_status_t copy_biases(model_t *m, float *host, int to_host)
{
    int64_t nb = m->chunks * m->blocks_per_chunk;
    for (int64_t i = 0; i < nb; i++) {
        moe_param_info_t info = {.struct_size = sizeof info};
        moe_tensor_t h;
        moe_status_t st = moe_layer_param(m->blocks[i].moe, 3, &info);
        if (st == MOE_STATUS_SUCCESS) {
            int64_t E = info.value.shape[0];
            st = moe_tensor_view(host + i * E, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &E, &h);
        }
        if (st == MOE_STATUS_SUCCESS)
            st = to_host ? moe_tensor_copy(m->rt, &h, &info.value)
                         : moe_tensor_copy(m->rt, &info.value, &h);
        if (st != MOE_STATUS_SUCCESS) return st;
    }
    return MOE_STATUS_SUCCESS;
}

float *model_keep_biases(model_t *m, moe_status_t *st)
{
    *st = MOE_STATUS_SUCCESS;
    int64_t nb = m->chunks * m->blocks_per_chunk;
    int32_t np = 0;
    if (nb == 0 || moe_layer_num_params(m->blocks[0].moe, &np) != MOE_STATUS_SUCCESS || np < 4)
        return NULL;
    moe_param_info_t info = {.struct_size = sizeof info};
    if ((*st = moe_layer_param(m->blocks[0].moe, 3, &info)) != MOE_STATUS_SUCCESS) return NULL;
    float *kept = malloc(sizeof(float) * (size_t)(nb * info.value.shape[0]));
    if (!kept) {
        *st = MOE_STATUS_OUT_OF_MEMORY;
        return NULL;
    }
    if ((*st = copy_biases(m, kept, 1)) != MOE_STATUS_SUCCESS) {
        free(kept);
        return NULL;
    }
    return kept;
}

moe_status_t model_put_back_biases(model_t *m, float *kept)
{
    if (!kept) return MOE_STATUS_SUCCESS;
    moe_status_t st = copy_biases(m, kept, 0);
    free(kept);
    return st;
}

double model_flops_per_token(const trainer_config_t *c)
{
    double H = (double)c->hidden, T = (double)c->context;
    double per_block = 4 * H * H + H * (double)c->experts +
                       (double)c->top_k * 3 * H * (double)c->ffn_hidden;
    double matmul_params = (double)c->layers * per_block + H * MODEL_VOCAB;
    double attention = (double)c->layers * 2 * T * H; /* scores and values, causal half */
    return 6 * matmul_params + 6 * attention;
}
