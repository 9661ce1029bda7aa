/*
 * The dense model's compute, one table per backend (model.h): model.c lays out the blocks,
 * initialises the parameters and creates the MoE layers; a backend allocates its saved
 * activations and scratch and runs the dense ops around the layers.
 *   model_host_ops  model_host.c: fp32 C loops (the reference)
 *   model_cuda_ops  model_cuda.c: bf16 on cuBLAS and dense_kernels.cu (built with CUDA only)
 */
#ifndef TRAINER_MODEL_BACKEND_H
#define TRAINER_MODEL_BACKEND_H

#include "model.h"

struct model_ops {
    /* After the layout and parameters: m->impl and every block's act. 0 or -1 (stderr). */
    int (*create)(model_t *m);
    void (*destroy)(model_t *m); /* what create made, also after a failed create */
    moe_status_t (*forward)(model_t *m, int32_t chunk, int32_t mb, const uint8_t *tokens,
                            const void *x, void *y);
    moe_status_t (*backward)(model_t *m, int32_t chunk, int32_t mb, const void *dy, void *dx);
    moe_status_t (*loss)(model_t *m, const void *y, const uint8_t *targets, float weight, void *dy,
                         double *loss);
    moe_status_t (*clear)(model_t *m, void *act);
    moe_status_t (*zero_dense_grads)(model_t *m);
};

/* A block's MoE layer forward / backward for the backends, timed into m->moe_seconds: on a
 * device the work enqueued before is waited for first and the layer's own after, so the time
 * is the layer's alone (the trainer's phase split; the public API has no per-layer timer). */
moe_status_t model_moe_forward(model_t *m, block_t *b, int32_t mb, const moe_tensor_t *x,
                               moe_tensor_t *y);
moe_status_t model_moe_backward(model_t *m, block_t *b, int32_t mb, const moe_tensor_t *dy,
                                moe_tensor_t *dx);

extern const model_ops_t model_host_ops;
#ifdef TRAINER_CUDA
extern const model_ops_t model_cuda_ops;
#endif

#endif /* TRAINER_MODEL_BACKEND_H */
