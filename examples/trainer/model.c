/* The byte-level MoE language model on the host (model.h): dense ops, blocks, loss. */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

#define NORM_EPS 1e-5f

#define TRY(call)                                                                          \
    do {                                                                                   \
        moe_status_t s_ = (call);                                                          \
        if (s_ != MOE_STATUS_SUCCESS) return s_;                                           \
    } while (0)

struct block_act {
    const float *in;  /* block input [N,H] (the previous block's out, or the stage input) */
    float *r1, *a, *qkv, *probs, *o, *h1, *r2, *b, *moe_out, *out;
};

/* ---- dense ops (row-major; loops ordered so the inner one streams rows) ------------------- */

/* C[M,N] = A[M,K] B[K,N] */
static void matmul(const float *A, const float *B, float *C, int64_t M, int64_t K, int64_t N)
{
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * N;
        memset(c, 0, sizeof(float) * (size_t)N);
        for (int64_t k = 0; k < K; k++) {
            float a = A[i * K + k];
            const float *b = B + k * N;
            for (int64_t j = 0; j < N; j++) c[j] += a * b[j];
        }
    }
}

/* dB[K,N] += A[M,K]^T dC[M,N] */
static void matmul_grad_b(const float *A, const float *dC, float *dB, int64_t M, int64_t K,
                          int64_t N)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) {
            float a = A[i * K + k];
            float *db = dB + k * N;
            const float *dc = dC + i * N;
            for (int64_t j = 0; j < N; j++) db[j] += a * dc[j];
        }
}

/* dA[M,K] = dC[M,N] B[K,N]^T */
static void matmul_grad_a(const float *dC, const float *B, float *dA, int64_t M, int64_t K,
                          int64_t N)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) {
            const float *dc = dC + i * N, *b = B + k * N;
            float acc = 0;
            for (int64_t j = 0; j < N; j++) acc += dc[j] * b[j];
            dA[i * K + k] = acc;
        }
}

/* y = x * r * g, r = 1 / sqrt(mean(x^2) + eps) per row; r saved */
static void rmsnorm_forward(const float *x, const float *g, float *y, float *r, int64_t N,
                            int64_t H)
{
    for (int64_t t = 0; t < N; t++) {
        const float *xt = x + t * H;
        double ss = 0;
        for (int64_t i = 0; i < H; i++) ss += (double)xt[i] * xt[i];
        float rt = (float)(1.0 / sqrt(ss / (double)H + NORM_EPS));
        r[t] = rt;
        for (int64_t i = 0; i < H; i++) y[t * H + i] = xt[i] * rt * g[i];
    }
}

/* dx (+= when accumulate) and dg += from dy: u = g dy; dx = r u - x r^3 mean(u x) */
static void rmsnorm_backward(const float *x, const float *g, const float *r, const float *dy,
                             float *dx, float *dg, int64_t N, int64_t H, int accumulate)
{
    for (int64_t t = 0; t < N; t++) {
        const float *xt = x + t * H, *dyt = dy + t * H;
        float rt = r[t];
        double ux = 0;
        for (int64_t i = 0; i < H; i++) {
            ux += (double)g[i] * dyt[i] * xt[i];
            dg[i] += dyt[i] * xt[i] * rt;
        }
        float c = (float)(ux / (double)H) * rt * rt * rt;
        for (int64_t i = 0; i < H; i++) {
            float d = rt * g[i] * dyt[i] - xt[i] * c;
            dx[t * H + i] = accumulate ? dx[t * H + i] + d : d;
        }
    }
}

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

/* Allocate a parameter; std > 0 draws N(0, std^2) from (seed, name, index), else fills 1. */
static int param_init(dense_param_t *p, const char *name, int32_t ndim, int64_t d0, int64_t d1,
                      uint64_t seed, double std)
{
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = ndim > 1 ? d1 : 1;
    int64_t n = p->shape[0] * p->shape[1];
    p->value = malloc(sizeof(float) * (size_t)n);
    p->grad = calloc((size_t)n, sizeof(float));
    if (!p->value || !p->grad) return -1;
    uint64_t key = mix64(seed ^ hash_name(name));
    for (int64_t i = 0; i < n; i++) {
        if (std <= 0) {
            p->value[i] = 1.0f;
            continue;
        }
        uint64_t base = mix64(key + (uint64_t)i * 0x9e3779b97f4a7c15ull);
        double u1 = ((double)(mix64(base) >> 11) + 0.5) * 0x1.0p-53;
        double u2 = (double)(mix64(base + 1) >> 11) * 0x1.0p-53;
        p->value[i] = (float)(std * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    return 0;
}

static int64_t param_numel(const dense_param_t *p) { return p->shape[0] * p->shape[1]; }

static void param_free(dense_param_t *p)
{
    free(p->value);
    free(p->grad);
}

/* ---- blocks -------------------------------------------------------------------------------- */

static int act_alloc(block_act_t *a, int64_t S, int64_t T, int64_t H, int64_t nh)
{
    int64_t N = S * T;
    float **bufs[] = {&a->a, &a->o, &a->h1, &a->b, &a->moe_out, &a->out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (!(*bufs[i] = malloc(sizeof(float) * (size_t)(N * H)))) return -1;
    a->r1 = malloc(sizeof(float) * (size_t)N);
    a->r2 = malloc(sizeof(float) * (size_t)N);
    a->qkv = malloc(sizeof(float) * (size_t)(N * 3 * H));
    a->probs = malloc(sizeof(float) * (size_t)(S * nh * T * T));
    return a->r1 && a->r2 && a->qkv && a->probs ? 0 : -1;
}

static void act_free(block_act_t *a)
{
    float *bufs[] = {a->r1, a->a, a->qkv, a->probs, a->o, a->h1, a->r2, a->b, a->moe_out, a->out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
}

static int block_create(model_t *m, block_t *b, int64_t index, const trainer_config_t *c)
{
    int64_t H = m->H;
    uint64_t seed = (uint64_t)c->seed;
    char name[96];
    b->index = index;
    snprintf(name, sizeof name, "blocks.%lld.norm1", (long long)index);
    if (param_init(&b->norm1, name, 1, H, 1, seed, 0)) return -1;
    snprintf(name, sizeof name, "blocks.%lld.attn.wqkv", (long long)index);
    if (param_init(&b->wqkv, name, 2, H, 3 * H, seed, c->init_std)) return -1;
    snprintf(name, sizeof name, "blocks.%lld.attn.wo", (long long)index);
    if (param_init(&b->wo, name, 2, H, H, seed, c->init_std / sqrt(2.0 * (double)c->layers)))
        return -1;
    snprintf(name, sizeof name, "blocks.%lld.norm2", (long long)index);
    if (param_init(&b->norm2, name, 1, H, 1, seed, 0)) return -1;
    b->act = calloc((size_t)m->microbatches, sizeof *b->act);
    if (!b->act) return -1;
    for (int32_t i = 0; i < m->microbatches; i++)
        if (act_alloc(&b->act[i], m->S, m->T, H, m->heads)) return -1;

    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = H;
    lc.ffn_hidden = c->ffn_hidden;
    lc.num_experts = (int32_t)c->experts;
    lc.top_k = (int32_t)c->top_k;
    lc.capacity_factor = (float)c->capacity_factor;
    lc.aux_loss_coef = (float)c->aux_loss_coef;
    lc.z_loss_coef = (float)c->z_loss_coef;
    lc.init_std = (float)c->init_std;
    lc.max_microbatches = m->microbatches;
    /* each block its own stream of initial values: its own experts and router */
    moe_status_t st = moe_layer_create_seeded(m->rt, &lc, (uint64_t)index + 1, &b->moe);
    if (st != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "moe_train: block %lld: moe_layer_create: %s\n", (long long)index,
                moe_last_error());
        return -1;
    }
    return 0;
}

static void block_destroy(model_t *m, block_t *b)
{
    param_free(&b->norm1);
    param_free(&b->wqkv);
    param_free(&b->wo);
    param_free(&b->norm2);
    if (b->act)
        for (int32_t i = 0; i < m->microbatches; i++) act_free(&b->act[i]);
    free(b->act);
    moe_layer_destroy(b->moe);
}

static moe_status_t host_tensor(float *data, int64_t rows, int64_t cols, moe_tensor_t *t)
{
    int64_t shape[2] = {rows, cols};
    return moe_tensor_view(data, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, t);
}

static moe_status_t block_forward(model_t *m, block_t *b, int32_t mb, const float *x)
{
    int64_t N = m->N, H = m->H;
    block_act_t *a = &b->act[mb];
    a->in = x;
    rmsnorm_forward(x, b->norm1.value, a->a, a->r1, N, H);
    matmul(a->a, b->wqkv.value, a->qkv, N, H, 3 * H);
    attention_forward(m->S, m->T, H, m->heads, a->qkv, a->probs, a->o);
    matmul(a->o, b->wo.value, a->h1, N, H, H);
    for (int64_t i = 0; i < N * H; i++) a->h1[i] += x[i];
    rmsnorm_forward(a->h1, b->norm2.value, a->b, a->r2, N, H);
    moe_tensor_t tb, tm;
    TRY(host_tensor(a->b, N, H, &tb));
    TRY(host_tensor(a->moe_out, N, H, &tm));
    TRY(moe_layer_forward(b->moe, mb, &tb, &tm));
    for (int64_t i = 0; i < N * H; i++) a->out[i] = a->h1[i] + a->moe_out[i];
    return MOE_STATUS_SUCCESS;
}

/* dout [N,H] -> dx [N,H]; dout and dx may not alias. */
static moe_status_t block_backward(model_t *m, block_t *b, int32_t mb, const float *dout,
                                   float *dx)
{
    int64_t N = m->N, H = m->H;
    block_act_t *a = &b->act[mb];
    float *dh1 = m->scratch[0], *db = m->scratch[1], *d_o = m->scratch[2];
    float *dqkv = m->scratch[3], *da = m->scratch[4];
    moe_tensor_t tdy, tdb;
    TRY(host_tensor((float *)dout, N, H, &tdy));
    TRY(host_tensor(db, N, H, &tdb));
    TRY(moe_layer_backward(b->moe, mb, &tdy, &tdb));
    memcpy(dh1, dout, sizeof(float) * (size_t)(N * H));
    rmsnorm_backward(a->h1, b->norm2.value, a->r2, db, dh1, b->norm2.grad, N, H, 1);
    matmul_grad_b(a->o, dh1, b->wo.grad, N, H, H);
    matmul_grad_a(dh1, b->wo.value, d_o, N, H, H);
    attention_backward(m->S, m->T, H, m->heads, a->qkv, a->probs, d_o, dqkv);
    matmul_grad_b(a->a, dqkv, b->wqkv.grad, N, H, 3 * H);
    matmul_grad_a(dqkv, b->wqkv.value, da, N, H, 3 * H);
    memcpy(dx, dh1, sizeof(float) * (size_t)(N * H));
    rmsnorm_backward(a->in, b->norm1.value, a->r1, da, dx, b->norm1.grad, N, H, 1);
    return MOE_STATUS_SUCCESS;
}

/* ---- the stage ------------------------------------------------------------------------------ */

static int add_param(model_t *m, dense_param_t *p)
{
    dense_param_t **grown = realloc(m->params, sizeof *grown * (size_t)(m->nparams + 1));
    if (!grown) return -1;
    m->params = grown;
    m->params[m->nparams++] = p;
    return 0;
}

int model_create(moe_runtime_t *rt, const trainer_config_t *c, int32_t stage, int32_t stages,
                 int64_t S, model_t **out)
{
    model_t *m = calloc(1, sizeof *m);
    if (!m) return -1;
    *out = m;
    m->rt = rt;
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
    int64_t N = m->N, H = m->H;
    uint64_t seed = (uint64_t)c->seed;
    if (m->first) {
        if (param_init(&m->embed, "embed", 2, MODEL_VOCAB, H, seed, 1.0)) return -1;
        if (param_init(&m->pos_embed, "pos_embed", 2, m->T, H, seed, 1.0)) return -1;
        if (add_param(m, &m->embed) || add_param(m, &m->pos_embed)) return -1;
        m->tokens = malloc((size_t)(m->microbatches * N));
        m->embedded = malloc(sizeof(float) * (size_t)(m->microbatches * N * H));
        if (!m->tokens || !m->embedded) return -1;
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
        if (param_init(&m->norm_f, "norm_f", 1, H, 1, seed, 0)) return -1;
        if (param_init(&m->head, "head", 2, H, MODEL_VOCAB, seed, c->init_std)) return -1;
        if (add_param(m, &m->norm_f) || add_param(m, &m->head)) return -1;
        m->head_buf[0] = malloc(sizeof(float) * (size_t)(N * H));
        m->head_buf[1] = malloc(sizeof(float) * (size_t)N);
        m->head_buf[2] = malloc(sizeof(float) * (size_t)(N * MODEL_VOCAB));
        if (!m->head_buf[0] || !m->head_buf[1] || !m->head_buf[2]) return -1;
    }
    int64_t widest = 3 * H > MODEL_VOCAB ? 3 * H : MODEL_VOCAB;
    for (int i = 0; i < 7; i++)
        if (!(m->scratch[i] = malloc(sizeof(float) * (size_t)(N * widest)))) return -1;
    return 0;
}

void model_destroy(model_t *m)
{
    if (!m) return;
    if (m->blocks)
        for (int64_t i = 0; i < m->chunks * m->blocks_per_chunk; i++)
            block_destroy(m, &m->blocks[i]);
    free(m->blocks);
    param_free(&m->embed);
    param_free(&m->pos_embed);
    param_free(&m->norm_f);
    param_free(&m->head);
    for (int i = 0; i < 7; i++) free(m->scratch[i]);
    for (int i = 0; i < 3; i++) free(m->head_buf[i]);
    free(m->tokens);
    free(m->embedded);
    free(m->params);
    free(m);
}

moe_status_t model_forward(model_t *m, int32_t chunk, int32_t mb, const uint8_t *tokens,
                           const float *x, float *y)
{
    int64_t N = m->N, H = m->H;
    if (!x) { /* virtual stage 0: the embedding */
        uint8_t *tok = m->tokens + (int64_t)mb * N;
        float *e = m->embedded + (int64_t)mb * N * H;
        memcpy(tok, tokens, (size_t)N);
        for (int64_t t = 0; t < N; t++) {
            const float *te = m->embed.value + (int64_t)tok[t] * H;
            const float *pe = m->pos_embed.value + (t % m->T) * H;
            for (int64_t i = 0; i < H; i++) e[t * H + i] = te[i] + pe[i];
        }
        x = e;
    }
    block_t *b = &m->blocks[(int64_t)chunk * m->blocks_per_chunk];
    for (int64_t j = 0; j < m->blocks_per_chunk; j++) {
        TRY(block_forward(m, &b[j], mb, x));
        x = b[j].act[mb].out;
    }
    memcpy(y, x, sizeof(float) * (size_t)(N * H));
    return MOE_STATUS_SUCCESS;
}

moe_status_t model_backward(model_t *m, int32_t chunk, int32_t mb, const float *dy, float *dx)
{
    int64_t N = m->N, H = m->H;
    block_t *b = &m->blocks[(int64_t)chunk * m->blocks_per_chunk];
    float *cur = m->scratch[5];
    memcpy(cur, dy, sizeof(float) * (size_t)(N * H));
    /* each block's dx lands in dx (or a scratch row block on stage 0), then becomes the
     * next block's dout */
    float *next = dx ? dx : m->scratch[6];
    for (int64_t j = m->blocks_per_chunk - 1; j >= 0; j--) {
        TRY(block_backward(m, &b[j], mb, cur, next));
        memcpy(cur, next, sizeof(float) * (size_t)(N * H));
    }
    if (!dx) { /* the embeddings' gradients: rows of the tokens and positions seen */
        const uint8_t *tok = m->tokens + (int64_t)mb * N;
        for (int64_t t = 0; t < N; t++) {
            float *g = m->embed.grad + (int64_t)tok[t] * H;
            float *gp = m->pos_embed.grad + (t % m->T) * H;
            for (int64_t i = 0; i < H; i++) {
                g[i] += cur[t * H + i];
                gp[i] += cur[t * H + i];
            }
        }
    }
    return MOE_STATUS_SUCCESS;
}

void model_release(model_t *m, int32_t chunk, int32_t mb)
{
    block_t *b = &m->blocks[(int64_t)chunk * m->blocks_per_chunk];
    for (int64_t j = 0; j < m->blocks_per_chunk; j++) (void)moe_layer_release_slot(b[j].moe, mb);
}

moe_status_t model_loss(model_t *m, const float *y, const uint8_t *targets, float weight,
                        float *dy, double *loss)
{
    int64_t N = m->N, H = m->H, V = MODEL_VOCAB;
    float *f = m->head_buf[0], *r = m->head_buf[1], *logits = m->head_buf[2];
    rmsnorm_forward(y, m->norm_f.value, f, r, N, H);
    matmul(f, m->head.value, logits, N, H, V);
    double total = 0;
    for (int64_t t = 0; t < N; t++) {
        float *l = logits + t * V, mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) mx = l[v] > mx ? l[v] : mx;
        double sum = 0;
        for (int64_t v = 0; v < V; v++) sum += exp((double)(l[v] - mx));
        total += log(sum) + mx - l[targets[t]];
        if (dy) { /* dlogits = weight (softmax - onehot) / N, in place */
            double w = (double)weight / (double)N;
            for (int64_t v = 0; v < V; v++) l[v] = (float)(exp((double)(l[v] - mx)) / sum * w);
            l[targets[t]] -= (float)w;
        }
    }
    *loss = total / (double)N;
    if (!dy) return MOE_STATUS_SUCCESS;
    float *df = m->scratch[0];
    matmul_grad_b(f, logits, m->head.grad, N, H, V);
    matmul_grad_a(logits, m->head.value, df, N, H, V);
    rmsnorm_backward(y, m->norm_f.value, r, df, dy, m->norm_f.grad, N, H, 0);
    return MOE_STATUS_SUCCESS;
}

moe_status_t model_zero_grad(model_t *m)
{
    for (int32_t i = 0; i < m->nparams; i++)
        memset(m->params[i]->grad, 0, sizeof(float) * (size_t)param_numel(m->params[i]));
    for (int64_t i = 0; i < m->chunks * m->blocks_per_chunk; i++)
        TRY(moe_layer_zero_grad(m->blocks[i].moe));
    return MOE_STATUS_SUCCESS;
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
