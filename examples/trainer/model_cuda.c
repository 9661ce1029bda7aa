/*
 * The dense model on the CUDA backend (model_backend.h): the host model's math (model_host.c)
 * in bf16 with fp32 accumulation. Projections and the head are cuBLAS GEMMs (gemm_cuda.h),
 * attention is fused (attention_cuda.h), the rest the trainer's kernels (dense_kernels.h).
 * Parameter values are bf16 and gradients f32, both on the device (the optimizer keeps the
 * fp32 masters); RMSNorm's 1/rms, attention's log-sum-exp, the logits and per-token losses
 * are f32. Everything is enqueued on
 * the runtime's stream (moe_runtime_get_stream), so the MoE layers' work and the trainer's are
 * ordered on one stream; the loss waits for it once, to read the per-token losses.
 *
 * The cuBLAS handle is the trainer's own (the library's is not part of its API).
 */
#include <stdlib.h>
#include <string.h>

#include "attention_cuda.h"
#include "dense_kernels.h"
#include "gemm_cuda.h"
#include "model_backend.h"

#define NORM_EPS 1e-5f
#define BF CUDA_R_16BF
#define F32 CUDA_R_32F

#define TRY(call)                                                                                  \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) return s_;                                                   \
    } while (0)

typedef struct cuda_act {
    const void *in;                             /* block input [N,H] */
    void *a, *qkv, *o, *h1, *b, *moe_out, *out; /* bf16; qkv [N,3H] */
    float *r1, *r2;                             /* 1/rms of the two norms' inputs [N] */
    float *lse;                                 /* attention's log-sum-exp [S*nh*T] */
} cuda_act_t;

typedef struct cuda_state {
    cublasHandle_t blas;
    cudaStream_t stream;
    void **owned; /* every device allocation, freed by destroy */
    int32_t nowned;
    float *delta;                 /* [S*nh*T] attention backward's do . o */
    void *dqkv;                   /* [N,3H] */
    void *dh1, *db, *d_o, *da;    /* [N,H] backward temporaries */
    void *cur, *next;             /* [N,H] the backward chain's gradient in and out */
    float *gain_partial;          /* [DK_GAIN_CHUNKS, H] */
    uint8_t *tokens;              /* first stage: [mb][N] on the device */
    int32_t *order;               /* [mb][N + V + 1]: rows by token, then the offsets */
    int32_t *order_host;          /* [N + V + 1] */
    void *embedded;               /* [mb][N,H] */
    uint8_t *targets;             /* last stage: [N] */
    void *f, *dlogits;            /* [N,H] normed head input, [N,V] bf16 */
    float *r, *logits, *row_loss; /* [N], [N,V], [N] */
    float *row_loss_host;         /* [N] */
} cuda_state_t;

/* ---- memory and streams ----------------------------------------------------------------- */

static void *dalloc(cuda_state_t *cs, size_t bytes)
{
    void **grown = realloc(cs->owned, sizeof *grown * (size_t)(cs->nowned + 1));
    if (!grown) return NULL;
    cs->owned = grown;
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        fprintf(stderr, "moe_train: cudaMalloc of %zu bytes failed\n", bytes);
        return NULL;
    }
    cs->owned[cs->nowned++] = p;
    return p;
}

/* Follow the runtime's stream (a caller may have set another since the last call). */
static moe_status_t on_runtime_stream(model_t *m)
{
    cuda_state_t *cs = m->impl;
    void *s = NULL;
    TRY(moe_runtime_get_stream(m->rt, &s));
    if ((cudaStream_t)s != cs->stream) {
        cs->stream = s;
        TRAINER_CUBLAS_CHECK(cublasSetStream(cs->blas, cs->stream));
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t device_tensor(const model_t *m, const void *data, moe_tensor_t *t)
{
    int64_t shape[2] = {m->N, m->H};
    TRY(moe_tensor_view((void *)data, MOE_DTYPE_BF16, MOE_DEVICE_CUDA, 2, shape, t));
    t->device_index = m->device_index;
    return MOE_STATUS_SUCCESS;
}

static gemm_operand_t op(const void *data, cudaDataType_t type, int trans)
{
    return (gemm_operand_t){data, type, trans, 0};
}

/* C[M,N] (+)= op(A) op(B), one product */
static moe_status_t gemm(model_t *m, int64_t M, int64_t N, int64_t K, gemm_operand_t A,
                         gemm_operand_t B, float beta, void *C, cudaDataType_t ctype)
{
    return gemm_rm(((cuda_state_t *)m->impl)->blas, M, N, K, A, B, 1, beta, C, ctype, 0, 1);
}

/* ---- blocks -------------------------------------------------------------------------------- */

static moe_status_t block_forward(model_t *m, block_t *b, int32_t mb, const void *x)
{
    cuda_state_t *cs = m->impl;
    int64_t N = m->N, H = m->H;
    cuda_act_t *a = &((cuda_act_t *)b->act)[mb];
    attention_cuda_shape_t as = {m->S, m->T, H, m->heads};
    a->in = x;
    TRAINER_CUDA_CHECK(
        dk_rmsnorm_forward(x, b->norm1.value, a->a, a->r1, N, H, NORM_EPS, cs->stream));
    TRY(gemm(m, N, 3 * H, H, op(a->a, BF, 0), op(b->wqkv.value, BF, 0), 0, a->qkv, BF));
    TRAINER_CUDA_CHECK(attention_cuda_forward(&as, a->qkv, a->o, a->lse, cs->stream));
    TRY(gemm(m, N, H, H, op(a->o, BF, 0), op(b->wo.value, BF, 0), 0, a->h1, BF));
    TRAINER_CUDA_CHECK(dk_add(a->h1, x, a->h1, N * H, cs->stream));
    TRAINER_CUDA_CHECK(
        dk_rmsnorm_forward(a->h1, b->norm2.value, a->b, a->r2, N, H, NORM_EPS, cs->stream));
    moe_tensor_t tb, tm;
    TRY(device_tensor(m, a->b, &tb));
    TRY(device_tensor(m, a->moe_out, &tm));
    TRY(model_moe_forward(m, b, mb, &tb, &tm));
    TRAINER_CUDA_CHECK(dk_add(a->h1, a->moe_out, a->out, N * H, cs->stream));
    return MOE_STATUS_SUCCESS;
}

/* dout [N,H] -> dx [N,H]; dout and dx may not alias. */
static moe_status_t block_backward(model_t *m, block_t *b, int32_t mb, const void *dout, void *dx)
{
    cuda_state_t *cs = m->impl;
    int64_t N = m->N, H = m->H;
    cuda_act_t *a = &((cuda_act_t *)b->act)[mb];
    attention_cuda_shape_t as = {m->S, m->T, H, m->heads};
    moe_tensor_t tdy, tdb;
    TRY(device_tensor(m, dout, &tdy));
    TRY(device_tensor(m, cs->db, &tdb));
    TRY(model_moe_backward(m, b, mb, &tdy, &tdb));
    /* dh1 = dout + the second norm's backward of db */
    TRAINER_CUDA_CHECK(
        dk_rmsnorm_backward(a->h1, b->norm2.value, a->r2, cs->db, dout, cs->dh1, N, H, cs->stream));
    TRAINER_CUDA_CHECK(dk_rmsnorm_gain_grad(a->h1, a->r2, cs->db, cs->gain_partial, b->norm2.grad,
                                            N, H, cs->stream));
    TRY(gemm(m, H, H, N, op(a->o, BF, 1), op(cs->dh1, BF, 0), 1, b->wo.grad, F32));
    TRY(gemm(m, N, H, H, op(cs->dh1, BF, 0), op(b->wo.value, BF, 1), 0, cs->d_o, BF));
    TRAINER_CUDA_CHECK(attention_cuda_backward(&as, a->qkv, a->o, a->lse, cs->d_o, cs->delta,
                                               cs->dqkv, cs->stream));
    TRY(gemm(m, H, 3 * H, N, op(a->a, BF, 1), op(cs->dqkv, BF, 0), 1, b->wqkv.grad, F32));
    TRY(gemm(m, N, H, 3 * H, op(cs->dqkv, BF, 0), op(b->wqkv.value, BF, 1), 0, cs->da, BF));
    /* dx = dh1 + the first norm's backward of da */
    TRAINER_CUDA_CHECK(
        dk_rmsnorm_backward(a->in, b->norm1.value, a->r1, cs->da, cs->dh1, dx, N, H, cs->stream));
    TRAINER_CUDA_CHECK(dk_rmsnorm_gain_grad(a->in, a->r1, cs->da, cs->gain_partial, b->norm1.grad,
                                            N, H, cs->stream));
    return MOE_STATUS_SUCCESS;
}

/* ---- the stage ------------------------------------------------------------------------------ */

static void cuda_destroy(model_t *m)
{
    cuda_state_t *cs = m->impl;
    for (int64_t i = 0; m->blocks && i < m->chunks * m->blocks_per_chunk; i++) {
        free(m->blocks[i].act);
        m->blocks[i].act = NULL;
    }
    if (!cs) return;
    /* the stream of the last call may be one the caller has destroyed since: move the handle
     * to the runtime's current stream first, and wait there before freeing */
    if (cs->blas) (void)on_runtime_stream(m);
    (void)moe_runtime_synchronize(m->rt);
    for (int32_t i = 0; i < cs->nowned; i++) cudaFree(cs->owned[i]);
    free(cs->owned);
    free(cs->order_host);
    free(cs->row_loss_host);
    if (cs->blas) cublasDestroy(cs->blas);
    free(cs);
    m->impl = NULL;
}

static int cuda_create(model_t *m)
{
    int64_t N = m->N, H = m->H, V = MODEL_VOCAB, BH = m->S * m->heads;
    size_t nh_bytes = sizeof(uint16_t) * (size_t)(N * H); /* one bf16 [N,H] */
    size_t lse_bytes = sizeof(float) * (size_t)(BH * m->T);
    if (!attention_cuda_head_dim_ok(H / m->heads)) {
        fprintf(stderr,
                "moe_train: the CUDA model's attention takes head dims (model.hidden / "
                "model.heads) that are multiples of 8 up to %d; this model's is %lld\n",
                ATTENTION_CUDA_MAX_HEAD_DIM, (long long)(H / m->heads));
        return -1;
    }
    cuda_state_t *cs = calloc(1, sizeof *cs);
    if (!(m->impl = cs)) return -1;
    if (cudaSetDevice(m->device_index) != cudaSuccess ||
        cublasCreate(&cs->blas) != CUBLAS_STATUS_SUCCESS ||
        on_runtime_stream(m) != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "moe_train: the CUDA model's cuBLAS handle on device %d failed\n",
                m->device_index);
        return -1;
    }
    for (int64_t i = 0; i < m->chunks * m->blocks_per_chunk; i++) {
        cuda_act_t *acts = calloc((size_t)m->microbatches, sizeof *acts);
        if (!(m->blocks[i].act = acts)) return -1;
        for (int32_t j = 0; j < m->microbatches; j++) {
            cuda_act_t *a = &acts[j];
            void **bufs[] = {&a->a, &a->o, &a->h1, &a->b, &a->moe_out, &a->out};
            for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++)
                if (!(*bufs[k] = dalloc(cs, nh_bytes))) return -1;
            if (!(a->qkv = dalloc(cs, 3 * nh_bytes)) || !(a->lse = dalloc(cs, lse_bytes)) ||
                !(a->r1 = dalloc(cs, sizeof(float) * (size_t)N)) ||
                !(a->r2 = dalloc(cs, sizeof(float) * (size_t)N)))
                return -1;
        }
    }
    cs->delta = dalloc(cs, lse_bytes);
    cs->dqkv = dalloc(cs, 3 * nh_bytes);
    void **tmp[] = {&cs->dh1, &cs->db, &cs->d_o, &cs->da, &cs->cur, &cs->next};
    for (size_t k = 0; k < sizeof tmp / sizeof tmp[0]; k++)
        if (!(*tmp[k] = dalloc(cs, nh_bytes))) return -1;
    cs->gain_partial = dalloc(cs, sizeof(float) * (size_t)(DK_GAIN_CHUNKS * H));
    if (!cs->delta || !cs->dqkv || !cs->gain_partial) return -1;
    if (m->first) {
        cs->tokens = dalloc(cs, (size_t)(m->microbatches * N));
        cs->order = dalloc(cs, sizeof(int32_t) * (size_t)(m->microbatches * (N + V + 1)));
        cs->order_host = malloc(sizeof(int32_t) * (size_t)(N + V + 1));
        cs->embedded = dalloc(cs, nh_bytes * (size_t)m->microbatches);
        if (!cs->tokens || !cs->order || !cs->order_host || !cs->embedded) return -1;
    }
    if (m->last) {
        cs->targets = dalloc(cs, (size_t)N);
        cs->f = dalloc(cs, nh_bytes);
        cs->dlogits = dalloc(cs, sizeof(uint16_t) * (size_t)(N * V));
        cs->r = dalloc(cs, sizeof(float) * (size_t)N);
        cs->logits = dalloc(cs, sizeof(float) * (size_t)(N * V));
        cs->row_loss = dalloc(cs, sizeof(float) * (size_t)N);
        cs->row_loss_host = malloc(sizeof(float) * (size_t)N);
        if (!cs->targets || !cs->f || !cs->dlogits || !cs->r || !cs->logits || !cs->row_loss ||
            !cs->row_loss_host)
            return -1;
    }
    return 0;
}

/* The rows of each token in row order, and where each token's rows start (a counting sort):
 * the embedding gradient's fixed summation order. */
static void sort_by_token(const uint8_t *tok, int64_t N, int32_t *order)
{
    int32_t *offsets = order + N;
    memset(offsets, 0, sizeof(int32_t) * (MODEL_VOCAB + 1));
    for (int64_t t = 0; t < N; t++) offsets[tok[t] + 1]++;
    for (int v = 0; v < MODEL_VOCAB; v++) offsets[v + 1] += offsets[v];
    int32_t next[MODEL_VOCAB];
    memcpy(next, offsets, sizeof next);
    for (int64_t t = 0; t < N; t++) order[next[tok[t]]++] = (int32_t)t;
}

static moe_status_t cuda_forward(model_t *m, int32_t chunk, int32_t mb, const uint8_t *tokens,
                                 const void *x, void *y)
{
    int64_t N = m->N, H = m->H, V = MODEL_VOCAB;
    TRY(on_runtime_stream(m));
    cuda_state_t *cs = m->impl;
    if (!x) { /* virtual stage 0: the embedding */
        uint8_t *tok = cs->tokens + (int64_t)mb * N;
        int32_t *order = cs->order + (int64_t)mb * (N + V + 1);
        void *e = (char *)cs->embedded + (size_t)mb * sizeof(uint16_t) * (size_t)(N * H);
        sort_by_token(tokens, N, cs->order_host);
        /* from pageable memory: the copies return once the host buffers are read */
        TRAINER_CUDA_CHECK(
            cudaMemcpyAsync(tok, tokens, (size_t)N, cudaMemcpyHostToDevice, cs->stream));
        TRAINER_CUDA_CHECK(cudaMemcpyAsync(order, cs->order_host,
                                           sizeof(int32_t) * (size_t)(N + V + 1),
                                           cudaMemcpyHostToDevice, cs->stream));
        TRAINER_CUDA_CHECK(
            dk_embed_forward(tok, m->embed.value, m->pos_embed.value, e, N, m->T, H, cs->stream));
        x = e;
    }
    block_t *b = &m->blocks[(int64_t)chunk * m->blocks_per_chunk];
    for (int64_t j = 0; j < m->blocks_per_chunk; j++) {
        TRY(block_forward(m, &b[j], mb, x));
        x = ((cuda_act_t *)b[j].act)[mb].out;
    }
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(y, x, sizeof(uint16_t) * (size_t)(N * H),
                                       cudaMemcpyDeviceToDevice, cs->stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_backward(model_t *m, int32_t chunk, int32_t mb, const void *dy, void *dx)
{
    int64_t N = m->N, H = m->H, V = MODEL_VOCAB;
    size_t bytes = sizeof(uint16_t) * (size_t)(N * H);
    TRY(on_runtime_stream(m));
    cuda_state_t *cs = m->impl;
    block_t *b = &m->blocks[(int64_t)chunk * m->blocks_per_chunk];
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(cs->cur, dy, bytes, cudaMemcpyDeviceToDevice, cs->stream));
    void *next = dx ? dx : cs->next;
    for (int64_t j = m->blocks_per_chunk - 1; j >= 0; j--) {
        TRY(block_backward(m, &b[j], mb, cs->cur, next));
        TRAINER_CUDA_CHECK(
            cudaMemcpyAsync(cs->cur, next, bytes, cudaMemcpyDeviceToDevice, cs->stream));
    }
    if (!dx) {
        const int32_t *order = cs->order + (int64_t)mb * (N + V + 1);
        TRAINER_CUDA_CHECK(dk_embed_backward(order, order + N, cs->cur, m->embed.grad,
                                             m->pos_embed.grad, N, m->T, H, V, cs->stream));
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_loss(model_t *m, const void *y, const uint8_t *targets, float weight,
                              void *dy, double *loss)
{
    int64_t N = m->N, H = m->H, V = MODEL_VOCAB;
    TRY(on_runtime_stream(m));
    cuda_state_t *cs = m->impl;
    TRAINER_CUDA_CHECK(
        cudaMemcpyAsync(cs->targets, targets, (size_t)N, cudaMemcpyHostToDevice, cs->stream));
    TRAINER_CUDA_CHECK(
        dk_rmsnorm_forward(y, m->norm_f.value, cs->f, cs->r, N, H, NORM_EPS, cs->stream));
    TRY(gemm(m, N, V, H, op(cs->f, BF, 0), op(m->head.value, BF, 0), 0, cs->logits, F32));
    TRAINER_CUDA_CHECK(dk_cross_entropy(cs->logits, cs->targets, cs->row_loss,
                                        dy ? cs->dlogits : NULL, weight / (float)N, N, V,
                                        cs->stream));
    if (dy) {
        TRY(gemm(m, H, V, N, op(cs->f, BF, 1), op(cs->dlogits, BF, 0), 1, m->head.grad, F32));
        TRY(gemm(m, N, H, V, op(cs->dlogits, BF, 0), op(m->head.value, BF, 1), 0, cs->da, BF));
        TRAINER_CUDA_CHECK(
            dk_rmsnorm_backward(y, m->norm_f.value, cs->r, cs->da, NULL, dy, N, H, cs->stream));
        TRAINER_CUDA_CHECK(dk_rmsnorm_gain_grad(y, cs->r, cs->da, cs->gain_partial, m->norm_f.grad,
                                                N, H, cs->stream));
    }
    TRAINER_CUDA_CHECK(cudaMemcpyAsync(cs->row_loss_host, cs->row_loss, sizeof(float) * (size_t)N,
                                       cudaMemcpyDeviceToHost, cs->stream));
    TRAINER_CUDA_CHECK(cudaStreamSynchronize(cs->stream));
    double total = 0;
    for (int64_t t = 0; t < N; t++) total += cs->row_loss_host[t];
    *loss = total / (double)N;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_clear(model_t *m, void *act)
{
    TRY(on_runtime_stream(m));
    cuda_state_t *cs = m->impl;
    TRAINER_CUDA_CHECK(
        cudaMemsetAsync(act, 0, sizeof(uint16_t) * (size_t)(m->N * m->H), cs->stream));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_zero_dense_grads(model_t *m)
{
    TRY(on_runtime_stream(m));
    cuda_state_t *cs = m->impl;
    for (int32_t i = 0; i < m->nparams; i++) {
        const dense_param_t *p = m->params[i];
        TRAINER_CUDA_CHECK(cudaMemsetAsync(
            p->grad, 0, sizeof(float) * (size_t)(p->shape[0] * p->shape[1]), cs->stream));
    }
    return MOE_STATUS_SUCCESS;
}

const model_ops_t model_cuda_ops = {
    .create = cuda_create,
    .destroy = cuda_destroy,
    .forward = cuda_forward,
    .backward = cuda_backward,
    .loss = cuda_loss,
    .clear = cuda_clear,
    .zero_dense_grads = cuda_zero_dense_grads,
};
