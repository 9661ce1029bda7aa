/* Causal multi-head self-attention on CUDA (attention_cuda.h). Per head, [T,d] matrices:
 *   forward   scores = q k^T;  P = softmax_causal(scores / sqrt(d));  o = P v
 *   backward  dv = P^T do;  dP = do v^T;  dS = P (dP - rowsum(P dP)) / sqrt(d);
 *             dq = dS k;  dk = dS^T q */
#include "attention_cuda.h"

#include <math.h>

#include "dense_kernels.h"
#include "gemm_cuda.h"

#define BF CUDA_R_16BF
#define F32 CUDA_R_32F

static gemm_operand_t op(const void *data, cudaDataType_t type, int trans, int64_t stride)
{
    return (gemm_operand_t){data, type, trans, stride};
}

static cudaStream_t stream_of(cublasHandle_t h)
{
    cudaStream_t s = NULL;
    (void)cublasGetStream(h, &s);
    return s;
}

moe_status_t attention_cuda_forward(cublasHandle_t h, const attention_shape_t *a,
                                    const attention_scratch_t *w, const void *qkv, void *qkvh,
                                    void *probs, void *o)
{
    int64_t S = a->S, T = a->T, H = a->H, nh = a->nh, d = H / nh, BH = S * nh;
    int64_t part = BH * T * d; /* elements of q (k, v) in qkvh */
    cudaStream_t st = stream_of(h);
    float scale = 1.0f / sqrtf((float)d);
    const char *q = qkvh, *k = (const char *)qkvh + 2 * part, *v = (const char *)qkvh + 4 * part;
    TRAINER_CUDA_CHECK(dk_rows_to_heads(qkv, qkvh, S, T, H, nh, 3, st));
    moe_status_t s;
    if ((s = gemm_rm(h, T, T, d, op(q, BF, 0, T * d), op(k, BF, 1, T * d), 1, 0, w->scores, F32,
                     T * T, BH)))
        return s;
    TRAINER_CUDA_CHECK(dk_softmax_causal_forward(w->scores, probs, BH * T, T, scale, st));
    if ((s = gemm_rm(h, T, d, T, op(probs, BF, 0, T * T), op(v, BF, 0, T * d), 1, 0, w->heads,
                     BF, T * d, BH)))
        return s;
    TRAINER_CUDA_CHECK(dk_heads_to_rows(w->heads, o, S, T, H, nh, 1, st));
    return MOE_STATUS_SUCCESS;
}

moe_status_t attention_cuda_backward(cublasHandle_t h, const attention_shape_t *a,
                                     const attention_scratch_t *w, const void *qkvh,
                                     const void *probs, const void *d_o, void *dqkv)
{
    int64_t S = a->S, T = a->T, H = a->H, nh = a->nh, d = H / nh, BH = S * nh;
    int64_t part = BH * T * d;
    cudaStream_t st = stream_of(h);
    float scale = 1.0f / sqrtf((float)d);
    const char *q = qkvh, *k = (const char *)qkvh + 2 * part, *v = (const char *)qkvh + 4 * part;
    char *dq = w->dheads, *dk = (char *)w->dheads + 2 * part, *dv = (char *)w->dheads + 4 * part;
    TRAINER_CUDA_CHECK(dk_rows_to_heads(d_o, w->heads, S, T, H, nh, 1, st));
    moe_status_t s;
    if ((s = gemm_rm(h, T, d, T, op(probs, BF, 1, T * T), op(w->heads, BF, 0, T * d), 1, 0, dv,
                     BF, T * d, BH)))
        return s;
    if ((s = gemm_rm(h, T, T, d, op(w->heads, BF, 0, T * d), op(v, BF, 1, T * d), 1, 0,
                     w->scores, F32, T * T, BH)))
        return s;
    TRAINER_CUDA_CHECK(dk_softmax_causal_backward(probs, w->scores, w->ds, BH * T, T, scale, st));
    if ((s = gemm_rm(h, T, d, T, op(w->ds, BF, 0, T * T), op(k, BF, 0, T * d), 1, 0, dq, BF,
                     T * d, BH)))
        return s;
    if ((s = gemm_rm(h, T, d, T, op(w->ds, BF, 1, T * T), op(q, BF, 0, T * d), 1, 0, dk, BF,
                     T * d, BH)))
        return s;
    TRAINER_CUDA_CHECK(dk_heads_to_rows(w->dheads, dqkv, S, T, H, nh, 3, st));
    return MOE_STATUS_SUCCESS;
}
