/*
 * Causal multi-head self-attention on the host, fp32 (the trainer's reference).
 *
 * Shapes: S sequences of T tokens (N = S*T rows, row s*T + t), H hidden, nh heads of
 * d = H / nh. qkv [N, 3H] holds q | k | v, head h in columns [h*d, (h+1)*d) of each third.
 *   P[s,h,t,u] = softmax_u<=t( q[s,t,h] . k[s,u,h] / sqrt(d) )     saved for backward
 *   o[s,t,h]   = sum_u<=t P[s,h,t,u] v[s,u,h]                        o [N, H]
 * The projections around it (qkv = a Wqkv, out = o Wo) are the model's (model.c).
 */
#ifndef TRAINER_ATTENTION_H
#define TRAINER_ATTENTION_H

#include <stdint.h>

/* [in] qkv [N,3H] [out] probs [S, nh, T, T] (upper triangle unused) [out] o [N,H]. */
void attention_forward(int64_t S, int64_t T, int64_t H, int64_t nh, const float *qkv, float *probs,
                       float *o);
/* [in] qkv, probs from forward, d_o [N,H] [out] d_qkv [N,3H] (written, not accumulated). */
void attention_backward(int64_t S, int64_t T, int64_t H, int64_t nh, const float *qkv,
                        const float *probs, const float *d_o, float *d_qkv);

#endif /* TRAINER_ATTENTION_H */
