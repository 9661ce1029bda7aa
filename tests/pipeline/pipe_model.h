/*
 * A small model for pipeline tests: L layers over [N, H] activations, alternating
 *   dense: y = tanh(x · W)          W [H, H] owned by the test (f32 value, f32 grad)
 *   moe:   y = x + MoE(x)           a libmoe layer (E experts, top-k), slot = microbatch
 * (layer i is MoE when moe_every > 0 and i % moe_every == moe_every - 1), with the per-
 * microbatch loss 0.5 * sum((y - t)^2) / N on the output of the last layer.
 *
 * A pm_model_t holds the contiguous layers [first, last) of that model on one runtime: the
 * whole model for the pp = 1 reference, or one pipeline stage. Inputs x_mb and targets t_mb
 * and the dense weights are drawn from `seed` by global index, so every split holds identical
 * values; MoE parameters come from the runtime seed (identical on every mesh by contract).
 * Host backend only (activations are read and written as f32 on the host).
 */
#ifndef MOE_TEST_PIPE_MODEL_H
#define MOE_TEST_PIPE_MODEL_H

#include <moe/moe.h>

typedef struct pm_shape {
    int n, h;      /* tokens per microbatch (this rank), hidden */
    int layers;    /* L, global */
    int moe_every; /* 0: dense only */
    int experts, top_k, ffn;
    int m;              /* microbatches */
    uint64_t seed;      /* data and dense weights */
    uint64_t data_rank; /* mixed into the data seed (e.g. the dp coordinate) */
} pm_shape_t;

typedef struct pm_model {
    moe_runtime_t *rt;
    pm_shape_t sh;
    int first, last;
    float **w, **gw;   /* per local layer (NULL for MoE layers) */
    moe_layer_t **moe; /* per local layer (NULL for dense layers) */
    float ***act;      /* act[mb][i]: input of local layer i; act[mb][nl]: output */
    /* the stage input forward was handed, kept for backward as moe_pipeline_callbacks_t
     * allows (backward reads the first layer's input from it) */
    const moe_tensor_t **kept_x;
    float *g0, *g1; /* backward scratch [N*H] */
    moe_adamw_t *opt;
    int steps, forwards, backwards, abandoned;
    int zero_inputs; /* forwards / backwards that received an all-zero tensor */
    /* fault injection: fail this callback ("forward"/"backward"/"loss") at this microbatch */
    const char *fail_what;
    int fail_mb;
} pm_model_t;

/* [first, last) of the model on rt, with an AdamW (lr 1e-2, weight decay 0) over its layers. */
moe_status_t pm_model_create(moe_runtime_t *rt, const pm_shape_t *sh, int first, int last,
                             pm_model_t **out);
void pm_model_destroy(pm_model_t *pm);

/* The stage callbacks for moe_pipeline_create (user = the model). */
moe_pipeline_callbacks_t pm_callbacks(pm_model_t *pm);

/* The pp = 1 reference: zero_grad, forward + loss + backward per microbatch in order, AdamW
 * step with grad_scale 1/m. [out] loss: mean over microbatches. */
moe_status_t pm_reference_step(pm_model_t *pm, double *loss);

/* Flattened copy of everything comparable of global layer `layer` (must be local):
 * kind 0 values, 1 gradients. [out] n floats in *out (malloc'd). */
moe_status_t pm_layer_tensor(pm_model_t *pm, int layer, int kind, float **out, int64_t *n);

/* The half-open layer range of stage s when L layers are split evenly over p stages. */
void pm_split(int layers, int p, int s, int *first, int *last);

#endif

/* ---- interleaved stages: one pm_model_t per model chunk ------------------------------------ */

#define PM_MAX_CHUNKS 8

typedef struct pm_chunks {
    int v;
    pm_model_t *chunk[PM_MAX_CHUNKS];
} pm_chunks_t;

/* Callbacks that dispatch on the chunk to chunk[c]'s model (user = the pm_chunks_t); zero_grad
 * and step run over every chunk. */
moe_pipeline_callbacks_t pm_chunks_callbacks(pm_chunks_t *pc);
