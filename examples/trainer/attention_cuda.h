/*
 * Causal multi-head self-attention on CUDA (attention_cuda.c): the host's math (attention.h)
 * with the score and value products as cuBLAS strided-batched GEMMs over the S*nh heads (bf16
 * in, fp32 accumulation; scores and their gradient in f32) and the softmax in
 * dense_kernels.cu. The heads are first laid out contiguously, [3][S*nh][T][d], so that each
 * head's q, k, v is one [T,d] matrix at a fixed stride.
 *
 * Shapes as in attention.h: S sequences of T tokens (N = S*T), H hidden, nh heads of d = H/nh.
 */
#ifndef TRAINER_ATTENTION_CUDA_H
#define TRAINER_ATTENTION_CUDA_H

#include <stdint.h>

#include <cublas_v2.h>
#include <moe/core.h>

typedef struct attention_shape {
    int64_t S, T, H, nh;
} attention_shape_t;

/* Scratch one call uses and the next may overwrite (shared by every block). */
typedef struct attention_scratch {
    float *scores;  /* [S*nh, T, T] f32: scores, then their gradient dP */
    void *ds;       /* [S*nh, T, T] bf16: dS */
    void *heads;    /* [S*nh, T, d] bf16: o, then d_o, by head */
    void *dheads;   /* [3][S*nh, T, d] bf16: dq | dk | dv by head */
} attention_scratch_t;

/* [in] qkv [N,3H] [out] qkvh [3][S*nh,T,d] and probs [S*nh,T,T] (both bf16, kept for backward)
 * [out] o [N,H] bf16. Enqueued on the handle's stream. */
moe_status_t attention_cuda_forward(cublasHandle_t h, const attention_shape_t *a,
                                    const attention_scratch_t *w, const void *qkv, void *qkvh,
                                    void *probs, void *o);
/* [in] qkvh, probs from forward, d_o [N,H] [out] dqkv [N,3H] (written, not accumulated). */
moe_status_t attention_cuda_backward(cublasHandle_t h, const attention_shape_t *a,
                                     const attention_scratch_t *w, const void *qkvh,
                                     const void *probs, const void *d_o, void *dqkv);

#endif /* TRAINER_ATTENTION_CUDA_H */
