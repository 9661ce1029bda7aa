/*
 * The CUDA model's own kernels (dense_kernels.cu): embedding, RMSNorm, cross-entropy and
 * residual adds, forward and backward (attention is attention_cuda.h); the GEMMs around
 * them are cuBLAS calls (gemm_cuda.h). "bf16" pointers are __nv_bfloat16 on the
 * device, passed as void * so C can call these; every launcher enqueues on `stream` and
 * returns the launch's cudaGetLastError().
 *
 * Shapes: N = S*T rows, H hidden, V = 256 vocabulary.
 * Every reduction has a fixed order (no atomics), so results are bitwise reproducible.
 */
#ifndef TRAINER_DENSE_KERNELS_H
#define TRAINER_DENSE_KERNELS_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out[t] = embed[tok[t]] + pos[t % T]   (tok [N] bytes on the device; embed [V,H], pos [T,H],
 * out [N,H], all bf16) */
cudaError_t dk_embed_forward(const uint8_t *tok, const void *embed, const void *pos, void *out,
                             int64_t N, int64_t T, int64_t H, cudaStream_t stream);
/* dembed[v] += sum_{t: tok[t]=v} dx[t], dpos[p] += sum_{t % T = p} dx[t]  (dx bf16, f32 grads).
 * order [N] lists the rows by token (ascending row within a token), offsets [V+1] where each
 * token's rows start: the host's counting sort of the tokens, so each sum runs in row order. */
cudaError_t dk_embed_backward(const int32_t *order, const int32_t *offsets, const void *dx,
                              float *dembed, float *dpos, int64_t N, int64_t T, int64_t H,
                              int64_t V, cudaStream_t stream);

/* y = x r g, r[t] = 1 / sqrt(mean(x[t]^2) + eps) (fp32) saved   (x, g, y bf16; r f32 [N]) */
cudaError_t dk_rmsnorm_forward(const void *x, const void *g, void *y, float *r, int64_t N,
                               int64_t H, float eps, cudaStream_t stream);
/* dx = res + r g dy - x r^3 mean(g dy x)   (res may be NULL: 0; all bf16 but r) */
cudaError_t dk_rmsnorm_backward(const void *x, const void *g, const float *r, const void *dy,
                                const void *res, void *dx, int64_t N, int64_t H,
                                cudaStream_t stream);
/* dg[i] += sum_t dy[t,i] x[t,i] r[t], over DK_GAIN_CHUNKS row chunks summed in order;
 * partial: f32 scratch [DK_GAIN_CHUNKS, H] */
#define DK_GAIN_CHUNKS 64
cudaError_t dk_rmsnorm_gain_grad(const void *x, const float *r, const void *dy, float *partial,
                                 float *dg, int64_t N, int64_t H, cudaStream_t stream);

/* out = a + b, n bf16 elements (out may alias a or b) */
cudaError_t dk_add(const void *a, const void *b, void *out, int64_t n, cudaStream_t stream);

/* Per row t of logits f32 [N,V]: loss[t] = logsumexp - logits[t, y[t]] (f32 [N]); with
 * dlogits (bf16 [N,V], may be NULL) = w (softmax - onehot(y[t])) */
cudaError_t dk_cross_entropy(const float *logits, const uint8_t *y, float *loss, void *dlogits,
                             float w, int64_t N, int64_t V, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* TRAINER_DENSE_KERNELS_H */
