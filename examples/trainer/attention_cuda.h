/*
 * Causal multi-head self-attention on CUDA, fused (attention_cuda.cu): the host's math
 * (attention.h) without the T x T scores in memory. The forward keeps each row's
 * log-sum-exp of the scaled scores for the backward, which recomputes the probabilities tile
 * by tile. bf16 in and out ("bf16" pointers are __nv_bfloat16 on the device, passed as void *
 * so C can call these), fp32 accumulation on the tensor cores. Every launcher enqueues on
 * `stream` and returns the launches' cudaGetLastError(); cudaErrorInvalidValue for a shape
 * the kernels do not take. Sums run in a fixed order (no atomics): bitwise reproducible.
 *
 * Shapes as in attention.h: S sequences of T tokens (N = S*T rows), H hidden, nh heads of
 * d = H/nh; qkv [N,3H] holds q | k | v, head h in columns [h*d, (h+1)*d) of each third.
 */
#ifndef TRAINER_ATTENTION_CUDA_H
#define TRAINER_ATTENTION_CUDA_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct attention_cuda_shape {
    int64_t S, T, H, nh;
} attention_cuda_shape_t;

/* The head dims the kernels take: multiples of 8 up to this (padded to 16, 32, 64 or 128). */
#define ATTENTION_CUDA_MAX_HEAD_DIM 128
int attention_cuda_head_dim_ok(int64_t d);

/* [in] qkv [N,3H] [out] o [N,H], lse [S*nh*T] f32 (row s*T+t of head h at (s*nh+h)*T + t,
 * in log2 units), both kept for backward. */
cudaError_t attention_cuda_forward(const attention_cuda_shape_t *a, const void *qkv, void *o,
                                   float *lse, cudaStream_t stream);
/* [in] qkv, o, lse from forward, d_o [N,H]; delta: f32 scratch [S*nh*T] (do . o per row)
 * [out] dqkv [N,3H] (written, not accumulated). */
cudaError_t attention_cuda_backward(const attention_cuda_shape_t *a, const void *qkv, const void *o,
                                    const float *lse, const void *d_o, float *delta, void *dqkv,
                                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* TRAINER_ATTENTION_CUDA_H */
