/* The dense model on the host backend (model_backend.h): fp32 C loops, the reference the
 * CUDA model is tested against. */
#include "model_backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

#define NORM_EPS 1e-5f

#define TRY(call)                                                                                  \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) return s_;                                                   \
    } while (0)

typedef struct host_act {
    const float *in; /* block input [N,H] (the previous block's out, or the stage input) */
    float *r1, *a, *qkv, *probs, *o, *h1, *r2, *b, *moe_out, *out;
} host_act_t;

typedef struct host_state {
    float *scratch[7];  /* backward temporaries, N x max(3H, 256) */
    float *head_buf[3]; /* loss: normed input, rms, logits */
    uint8_t *tokens;    /* [microbatches][N]: the embedding's inputs */
    float *embedded;    /* [microbatches][N,H]: chunk 0's input on stage 0 */
} host_state_t;

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

/* ---- saved activations -------------------------------------------------------------------- */

static int act_alloc(host_act_t *a, int64_t S, int64_t T, int64_t H, int64_t nh)
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

static void act_free(host_act_t *a)
{
    float *bufs[] = {a->r1, a->a, a->qkv, a->probs, a->o, a->h1, a->r2, a->b, a->moe_out, a->out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
}

/* ---- blocks -------------------------------------------------------------------------------- */

static moe_status_t host_tensor(float *data, int64_t rows, int64_t cols, moe_tensor_t *t)
{
    int64_t shape[2] = {rows, cols};
    return moe_tensor_view(data, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, t);
}

static float *pv(const dense_param_t *p) { return p->value; }

static moe_status_t block_forward(model_t *m, block_t *b, int32_t mb, const float *x)
{
    int64_t N = m->N, H = m->H;
    host_act_t *a = &((host_act_t *)b->act)[mb];
    a->in = x;
    rmsnorm_forward(x, pv(&b->norm1), a->a, a->r1, N, H);
    matmul(a->a, pv(&b->wqkv), a->qkv, N, H, 3 * H);
    attention_forward(m->S, m->T, H, m->heads, a->qkv, a->probs, a->o);
    matmul(a->o, pv(&b->wo), a->h1, N, H, H);
    for (int64_t i = 0; i < N * H; i++) a->h1[i] += x[i];
    rmsnorm_forward(a->h1, pv(&b->norm2), a->b, a->r2, N, H);
    moe_tensor_t tb, tm;
    TRY(host_tensor(a->b, N, H, &tb));
    TRY(host_tensor(a->moe_out, N, H, &tm));
    TRY(model_moe_forward(m, b, mb, &tb, &tm));
    for (int64_t i = 0; i < N * H; i++) a->out[i] = a->h1[i] + a->moe_out[i];
    return MOE_STATUS_SUCCESS;
}

/* dout [N,H] -> dx [N,H]; dout and dx may not alias. */
static moe_status_t block_backward(model_t *m, block_t *b, int32_t mb, const float *dout, float *dx)
{
    int64_t N = m->N, H = m->H;
    host_state_t *hs = m->impl;
    host_act_t *a = &((host_act_t *)b->act)[mb];
    float *dh1 = hs->scratch[0], *db = hs->scratch[1], *d_o = hs->scratch[2];
    float *dqkv = hs->scratch[3], *da = hs->scratch[4];
    moe_tensor_t tdy, tdb;
    TRY(host_tensor((float *)dout, N, H, &tdy));
    TRY(host_tensor(db, N, H, &tdb));
    TRY(model_moe_backward(m, b, mb, &tdy, &tdb));
    memcpy(dh1, dout, sizeof(float) * (size_t)(N * H));
    rmsnorm_backward(a->h1, pv(&b->norm2), a->r2, db, dh1, b->norm2.grad, N, H, 1);
    matmul_grad_b(a->o, dh1, b->wo.grad, N, H, H);
    matmul_grad_a(dh1, pv(&b->wo), d_o, N, H, H);
    attention_backward(m->S, m->T, H, m->heads, a->qkv, a->probs, d_o, dqkv);
    matmul_grad_b(a->a, dqkv, b->wqkv.grad, N, H, 3 * H);
    matmul_grad_a(dqkv, pv(&b->wqkv), da, N, H, 3 * H);
    memcpy(dx, dh1, sizeof(float) * (size_t)(N * H));
    rmsnorm_backward(a->in, pv(&b->norm1), a->r1, da, dx, b->norm1.grad, N, H, 1);
    return MOE_STATUS_SUCCESS;
}

/* ---- the stage ------------------------------------------------------------------------------ */

static void host_destroy(model_t *m)
{
    host_state_t *hs = m->impl;
    for (int64_t i = 0; m->blocks && i < m->chunks * m->blocks_per_chunk; i++) {
        host_act_t *acts = m->blocks[i].act;
        for (int32_t j = 0; acts && j < m->microbatches; j++) act_free(&acts[j]);
        free(acts);
        m->blocks[i].act = NULL;
    }
    if (!hs) return;
    for (int i = 0; i < 7; i++) free(hs->scratch[i]);
    for (int i = 0; i < 3; i++) free(hs->head_buf[i]);
    free(hs->tokens);
    free(hs->embedded);
    free(hs);
    m->impl = NULL;
}

static int host_create(model_t *m)
{
    int64_t N = m->N, H = m->H;
    host_state_t *hs = calloc(1, sizeof *hs);
    if (!(m->impl = hs)) return -1;
    for (int64_t i = 0; i < m->chunks * m->blocks_per_chunk; i++) {
        host_act_t *acts = calloc((size_t)m->microbatches, sizeof *acts);
        if (!(m->blocks[i].act = acts)) return -1;
        for (int32_t j = 0; j < m->microbatches; j++)
            if (act_alloc(&acts[j], m->S, m->T, H, m->heads)) return -1;
    }
    if (m->first) {
        hs->tokens = malloc((size_t)(m->microbatches * N));
        hs->embedded = malloc(sizeof(float) * (size_t)(m->microbatches * N * H));
        if (!hs->tokens || !hs->embedded) return -1;
    }
    if (m->last) {
        hs->head_buf[0] = malloc(sizeof(float) * (size_t)(N * H));
        hs->head_buf[1] = malloc(sizeof(float) * (size_t)N);
        hs->head_buf[2] = malloc(sizeof(float) * (size_t)(N * MODEL_VOCAB));
        if (!hs->head_buf[0] || !hs->head_buf[1] || !hs->head_buf[2]) return -1;
    }
    int64_t widest = 3 * H > MODEL_VOCAB ? 3 * H : MODEL_VOCAB;
    for (int i = 0; i < 7; i++)
        if (!(hs->scratch[i] = malloc(sizeof(float) * (size_t)(N * widest)))) return -1;
    return 0;
}

static moe_status_t host_forward(model_t *m, int32_t chunk, int32_t mb, const uint8_t *tokens,
                                 const void *xin, void *y)
{
    int64_t N = m->N, H = m->H;
    host_state_t *hs = m->impl;
    const float *x = xin;
    if (!x) { /* virtual stage 0: the embedding */
        uint8_t *tok = hs->tokens + (int64_t)mb * N;
        float *e = hs->embedded + (int64_t)mb * N * H;
        memcpy(tok, tokens, (size_t)N);
        for (int64_t t = 0; t < N; t++) {
            const float *te = pv(&m->embed) + (int64_t)tok[t] * H;
            const float *pe = pv(&m->pos_embed) + (t % m->T) * H;
            for (int64_t i = 0; i < H; i++) e[t * H + i] = te[i] + pe[i];
        }
        x = e;
    }
    block_t *b = &m->blocks[(int64_t)chunk * m->blocks_per_chunk];
    for (int64_t j = 0; j < m->blocks_per_chunk; j++) {
        TRY(block_forward(m, &b[j], mb, x));
        x = ((host_act_t *)b[j].act)[mb].out;
    }
    memcpy(y, x, sizeof(float) * (size_t)(N * H));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t host_backward(model_t *m, int32_t chunk, int32_t mb, const void *dy, void *dx)
{
    int64_t N = m->N, H = m->H;
    host_state_t *hs = m->impl;
    block_t *b = &m->blocks[(int64_t)chunk * m->blocks_per_chunk];
    float *cur = hs->scratch[5];
    memcpy(cur, dy, sizeof(float) * (size_t)(N * H));
    /* each block's dx lands in dx (or a scratch row block on stage 0), then becomes the
     * next block's dout */
    float *next = dx ? dx : hs->scratch[6];
    for (int64_t j = m->blocks_per_chunk - 1; j >= 0; j--) {
        TRY(block_backward(m, &b[j], mb, cur, next));
        memcpy(cur, next, sizeof(float) * (size_t)(N * H));
    }
    if (!dx) { /* the embeddings' gradients: rows of the tokens and positions seen */
        const uint8_t *tok = hs->tokens + (int64_t)mb * N;
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

static moe_status_t host_loss(model_t *m, const void *yin, const uint8_t *targets, float weight,
                              void *dy, double *loss)
{
    int64_t N = m->N, H = m->H, V = MODEL_VOCAB;
    host_state_t *hs = m->impl;
    const float *y = yin;
    float *f = hs->head_buf[0], *r = hs->head_buf[1], *logits = hs->head_buf[2];
    rmsnorm_forward(y, pv(&m->norm_f), f, r, N, H);
    matmul(f, pv(&m->head), logits, N, H, V);
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
    float *df = hs->scratch[0];
    matmul_grad_b(f, logits, m->head.grad, N, H, V);
    matmul_grad_a(logits, pv(&m->head), df, N, H, V);
    rmsnorm_backward(y, pv(&m->norm_f), r, df, dy, m->norm_f.grad, N, H, 0);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t host_clear(model_t *m, void *act)
{
    memset(act, 0, sizeof(float) * (size_t)(m->N * m->H));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t host_zero_dense_grads(model_t *m)
{
    for (int32_t i = 0; i < m->nparams; i++)
        memset(m->params[i]->grad, 0,
               sizeof(float) * (size_t)(m->params[i]->shape[0] * m->params[i]->shape[1]));
    return MOE_STATUS_SUCCESS;
}

const model_ops_t model_host_ops = {
    .create = host_create,
    .destroy = host_destroy,
    .forward = host_forward,
    .backward = host_backward,
    .loss = host_loss,
    .clear = host_clear,
    .zero_dense_grads = host_zero_dense_grads,
};
