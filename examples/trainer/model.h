/*
 * The byte-level MoE language model, as the blocks one pipeline rank holds.
 *
 *   tokens [N] -> embedding [256,H] + position embedding [T,H] -> L x block -> RMSNorm
 *   -> LM head [H,256] -> cross-entropy
 *   block(x) = h1 + moe(rmsnorm(h1)),  h1 = x + attention(rmsnorm(x)) Wo,
 *              attention on qkv = rmsnorm(x) Wqkv (causal, heads; attention.h)
 *
 * Shapes: S sequences of T bytes per microbatch, N = S*T rows, H hidden, E experts, K top-k,
 * F expert FFN width. Dense parts are fp32 on the host, replicated over tp, ep and dp; the
 * MoE layers are libmoe's (experts over ep, F over tp). On pipeline stage s of p with v chunks,
 * chunk c holds the L/(p v) blocks of virtual stage c p + s; the embedding lives on virtual
 * stage 0, the final norm and head (and the loss) on the last. The learned position
 * embedding gives attention the order of the bytes (without it the model stays at the
 * bigram level: about 4.0 bits per byte on the default corpus's held-out tail).
 *
 * Every parameter is initialised from (seed, its global name, element index), so every mesh
 * starts from the same model. Saved activations are kept per microbatch slot (0..m-1), the
 * slot the 1F1B executor passes, like the MoE layer's own.
 */
#ifndef TRAINER_MODEL_H
#define TRAINER_MODEL_H

#include <stdint.h>

#include <moe/moe.h>

#include "config.h"

#define MODEL_VOCAB 256

typedef struct dense_param {
    char name[96];     /* global, e.g. "blocks.3.attn.wqkv" */
    int32_t ndim;
    int64_t shape[2];
    float *value, *grad;
} dense_param_t;

typedef struct block_act block_act_t; /* one block's saved activations of one microbatch */

typedef struct block {
    int64_t index;                      /* global block index 0..L-1 */
    dense_param_t norm1, wqkv, wo, norm2;
    moe_layer_t *moe;
    block_act_t *act;                   /* [microbatches] */
} block_t;

typedef struct model {
    moe_runtime_t *rt;
    int64_t S, T, H, heads, N;
    int32_t microbatches, chunks;       /* chunks: virtual stages on this rank */
    int64_t blocks_per_chunk;
    block_t *blocks;                    /* chunks * blocks_per_chunk, chunk-major */
    int first, last;                    /* holds the embedding / the head */
    dense_param_t embed, pos_embed, norm_f, head;
    dense_param_t **params;             /* every dense parameter, registration order */
    int32_t nparams;
    float *scratch[7];                  /* backward temporaries, N x max(3H, 256) */
    float *head_buf[3];                 /* loss: normed input, rms, logits */
    uint8_t *tokens;                    /* [microbatches][N]: the embedding's inputs */
    float *embedded;                    /* [microbatches][N,H]: chunk 0's input on stage 0 */
} model_t;

/* Build the blocks of pipeline stage `stage` of `stages` (interleaved over c->virtual_stages
 * chunks) for microbatches of S sequences. Collective over the runtime's mesh (the MoE layers).
 * Returns 0, or nonzero with moe_last_error() / a message on stderr. */
int model_create(moe_runtime_t *rt, const trainer_config_t *c, int32_t stage, int32_t stages,
                 int64_t S, model_t **out);
void model_destroy(model_t *m);

/* The chunk's forward of microbatch mb. tokens [N] on the first virtual stage (x NULL), else
 * x [N,H] (kept until backward). [out] y [N,H]. */
moe_status_t model_forward(model_t *m, int32_t chunk, int32_t mb, const uint8_t *tokens,
                           const float *x, float *y);
/* Backward of the chunk's forward of mb: [in] dy [N,H] [out] dx [N,H] (NULL on the first
 * virtual stage, where the embedding gradient is accumulated instead). Gradients accumulate. */
moe_status_t model_backward(model_t *m, int32_t chunk, int32_t mb, const float *dy, float *dx);
/* Drop what the chunk's forward of mb saved, without a backward (evaluation, failures). */
void model_release(model_t *m, int32_t chunk, int32_t mb);
/* Last virtual stage: final norm, head and mean cross-entropy (nats per byte) of y [N,H]
 * against targets [N]. [out] dy [N,H]: the gradient of weight x loss (dy NULL: evaluation,
 * no gradients); the head's gradients accumulate. */
moe_status_t model_loss(model_t *m, const float *y, const uint8_t *targets, float weight,
                        float *dy, double *loss);
/* Zero every gradient (dense and MoE) at the start of a batch. */
moe_status_t model_zero_grad(model_t *m);

/* Model FLOPs per token of a training step (forward + backward: 3x forward's matmuls). */
double model_flops_per_token(const trainer_config_t *c);

#endif /* TRAINER_MODEL_H */
