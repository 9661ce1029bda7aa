/*
 * The byte-level MoE language model, as the blocks one pipeline rank holds.
 *
 *   tokens [N] -> embedding [256,H] + position embedding [T,H] -> L x block -> RMSNorm
 *   -> LM head [H,256] -> cross-entropy
 *   block(x) = h1 + moe(rmsnorm(h1)),  h1 = x + attention(rmsnorm(x)) Wo,
 *              attention on qkv = rmsnorm(x) Wqkv (causal, heads; attention.h)
 *
 * Shapes: S sequences of T bytes per microbatch, N = S*T rows, H hidden, E experts, K top-k,
 * F expert FFN width. Dense parts are replicated over tp, ep and dp; the MoE layers are
 * libmoe's (experts over ep, F over tp). On pipeline stage s of p with v chunks,
 * chunk c holds the L/(p v) blocks of virtual stage c p + s; the embedding lives on virtual
 * stage 0, the final norm and head (and the loss) on the last. The learned position
 * embedding gives attention the order of the bytes (without it the model stays at the
 * bigram level: about 4.0 bits per byte on the default corpus's held-out tail).
 *
 * Backends: the runtime's. Host (model_host.c): fp32, the reference. CUDA (model_cuda.c):
 * bf16 parameters and activations, fp32 accumulation, fp32 gradients; the optimizer keeps the
 * fp32 masters. Activations passed in and out ([N,H]: x, y, dy, dx) are in the model's dtype
 * on its device; tokens and targets are host bytes.
 *
 * Every parameter is initialised from (seed, its global name, element index), so every mesh
 * (and both backends) starts from the same model. Saved activations are kept per microbatch
 * slot (0..m-1), the slot the 1F1B executor passes, like the MoE layer's own.
 */
#ifndef TRAINER_MODEL_H
#define TRAINER_MODEL_H

#include <stdint.h>

#include <moe/moe.h>

#include "config.h"

#define MODEL_VOCAB 256

typedef struct dense_param {
    char name[96]; /* global, e.g. "blocks.3.attn.wqkv" */
    int32_t ndim;
    int64_t shape[2];
    void *value; /* the model's dtype on its device */
    float *grad; /* f32 on the model's device */
} dense_param_t;

typedef struct block {
    int64_t index; /* global block index 0..L-1 */
    dense_param_t norm1, wqkv, wo, norm2;
    moe_layer_t *moe;
    void *act; /* the backend's saved activations, [microbatches] */
} block_t;

typedef struct model_ops model_ops_t; /* a backend's compute (model_backend.h) */

typedef struct model {
    moe_runtime_t *rt;
    const model_ops_t *ops;
    void *impl;        /* the backend's state: scratch, workspaces */
    moe_dtype_t dtype; /* parameters and activations: F32 host, BF16 CUDA */
    moe_device_kind_t device;
    int32_t device_index; /* CUDA ordinal (0 on the host) */
    int64_t S, T, H, heads, N;
    int32_t microbatches, chunks; /* chunks: virtual stages on this rank */
    int64_t blocks_per_chunk;
    block_t *blocks; /* chunks * blocks_per_chunk, chunk-major */
    int first, last; /* holds the embedding / the head */
    dense_param_t embed, pos_embed, norm_f, head;
    dense_param_t **params; /* every dense parameter, registration order */
    int32_t nparams;
    double moe_seconds[2]; /* in the MoE layers' forward, backward since zeroed */
} model_t;

/* Build the blocks of pipeline stage `stage` of `stages` (interleaved over c->virtual_stages
 * chunks) for microbatches of S sequences, on the runtime's backend. Collective over the
 * runtime's mesh (the MoE layers). Returns 0, or nonzero with a message on stderr. */
int model_create(moe_runtime_t *rt, const trainer_config_t *c, int32_t stage, int32_t stages,
                 int64_t S, model_t **out);
void model_destroy(model_t *m);

/* The chunk's forward of microbatch mb. tokens [N] on the first virtual stage (x NULL), else
 * x [N,H] (kept until backward). [out] y [N,H]. */
moe_status_t model_forward(model_t *m, int32_t chunk, int32_t mb, const uint8_t *tokens,
                           const void *x, void *y);
/* Backward of the chunk's forward of mb: [in] dy [N,H] [out] dx [N,H] (NULL on the first
 * virtual stage, where the embedding gradient is accumulated instead). Gradients accumulate. */
moe_status_t model_backward(model_t *m, int32_t chunk, int32_t mb, const void *dy, void *dx);
/* Drop what the chunk's forward of mb saved, without a backward (evaluation, failures). */
void model_release(model_t *m, int32_t chunk, int32_t mb);
/* Last virtual stage: final norm, head and mean cross-entropy (nats per byte) of y [N,H]
 * against targets [N]. [out] dy [N,H]: the gradient of weight x loss (dy NULL: evaluation,
 * no gradients); the head's gradients accumulate. */
moe_status_t model_loss(model_t *m, const void *y, const uint8_t *targets, float weight, void *dy,
                        double *loss);
/* Zero an activation [N,H] (the gradients an evaluation sends instead of real ones). */
moe_status_t model_clear(model_t *m, void *act);
/* Zero every gradient (dense and MoE) at the start of a batch. */
moe_status_t model_zero_grad(model_t *m);

/* The MoE layers' expert biases (with model.expert_bias; the layer updates them after every
 * forward, evaluation's too): keep copies, and put them back, so that an evaluation leaves the
 * training state as it found it. keep returns a malloc'd copy (NULL without biases or on
 * failure: *st says which); put_back frees it. */
float *model_keep_biases(model_t *m, moe_status_t *st);
moe_status_t model_put_back_biases(model_t *m, float *kept);

/* Model FLOPs per token of a training step (forward + backward: 3x forward's matmuls). */
double model_flops_per_token(const trainer_config_t *c);

#endif /* TRAINER_MODEL_H */
