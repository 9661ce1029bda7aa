/*
 * libmoe AdamW optimizer.
 *
 * Keeps fp32 master weights and fp32 moments for every registered parameter; after each step
 * it writes the master weights back into the parameter tensors (rounded to bf16 on the CUDA
 * backend). Gradients are read as accumulated by backward over the microbatches of a global
 * batch; `grad_scale` (e.g. 1/microbatches) is applied before the update.
 *
 * Update per element, step t (1-based):
 *   g = grad * grad_scale * clip;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
 *   p = p - lr_t * ( (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + weight_decay * p )
 * clip = min(1, max_grad_norm / ||g||) with ||g|| the global norm of the averaged gradient
 * over the whole model (1 without clipping); lr_t the configured rate through the schedule.
 */
#ifndef MOE_OPTIM_H
#define MOE_OPTIM_H

#include "core.h"
#include "layer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_adamw moe_adamw_t;

/* ---- learning-rate schedule ------------------------------------------------------------------
 * The rate of step t (1-based) for a base rate lr, W warm-up steps, D decay steps, floor
 * lr_min = min_lr_ratio * lr:
 *   t <= W             lr * t / W                                (linear warm-up)
 *   CONSTANT           lr
 *   LINEAR             lr - (lr - lr_min) * p                    p = (t - W) / (D - W),
 *   COSINE             lr_min + (lr - lr_min) * (1 + cos(pi p)) / 2   clamped to [0, 1]
 * so the decay reaches lr_min at step D and stays there. */

typedef enum moe_lr_decay {
    MOE_LR_CONSTANT = 0,
    MOE_LR_LINEAR = 1,
    MOE_LR_COSINE = 2
} moe_lr_decay_t;

typedef struct moe_lr_schedule {
    moe_lr_decay_t decay; /* default CONSTANT */
    int64_t warmup_steps; /* W >= 0, default 0 */
    int64_t decay_steps;  /* D > W for LINEAR and COSINE (usually the run's total steps) */
    float min_lr_ratio;   /* in [0, 1], default 0 */
} moe_lr_schedule_t;

/* The rate at step t >= 1 (see above); -1 when the schedule or lr is invalid. Pure. */
MOE_API float moe_lr_schedule_rate(const moe_lr_schedule_t *schedule, float lr, int64_t step);

/* ---- optimizer ------------------------------------------------------------------------------ */

typedef struct moe_adamw_config {
    size_t struct_size;
    float lr;           /* default 1e-3 */
    float beta1;        /* default 0.9 */
    float beta2;        /* default 0.999 */
    float eps;          /* default 1e-8 */
    float weight_decay; /* default 0.01 (decoupled) */
} moe_adamw_config_t;

MOE_API moe_adamw_config_t moe_adamw_config_default(void);
/* Collective over the runtime's pp stage (tp x ep x dp): the ranks compare lr, beta1, beta2,
 * eps and weight_decay, and a difference is INVALID_ARGUMENT on every rank, naming the field
 * and both values. */
MOE_API moe_status_t moe_adamw_create(moe_runtime_t *rt, const moe_adamw_config_t *config,
                                      moe_adamw_t **out);
MOE_API moe_status_t moe_adamw_destroy(moe_adamw_t *opt);

/* Global gradient-norm clipping: max_grad_norm > 0 scales each step's gradient so that its
 * norm over the whole model is at most this (INFINITY measures the norm without clipping); 0
 * (the default) neither measures nor clips. The norm counts each replicated parameter once and
 * each expert or tp shard once, over every pp stage: moe_adamw_step is then collective over
 * the world. Not collective itself; every rank sets the same value. */
MOE_API moe_status_t moe_adamw_set_grad_clip(moe_adamw_t *opt, float max_grad_norm);
/* The schedule moe_adamw_step applies to the configured rate when given
 * MOE_ADAMW_LR_CONFIGURED (default: constant, no warm-up). [in] schedule, copied. */
MOE_API moe_status_t moe_adamw_set_lr_schedule(moe_adamw_t *opt, const moe_lr_schedule_t *schedule);

/* Register every trainable parameter of a layer (buffers are skipped) under the name
 * prefix + parameter name (e.g. prefix "layers.3." gives "layers.3.router.weight"); prefix may
 * be NULL for a model with one layer. Names must be unique within the optimizer. The layer
 * must outlive the optimizer. */
MOE_API moe_status_t moe_adamw_add_layer(moe_adamw_t *opt, moe_layer_t *layer, const char *prefix);
/* Register a caller-owned parameter (e.g. a dense layer of the user's model). value (compute
 * dtype) and grad (f32) have equal shapes on the runtime's device; `kind` says how its
 * gradient is reduced. name is copied. */
MOE_API moe_status_t moe_adamw_add_param(moe_adamw_t *opt, const char *name, moe_param_kind_t kind,
                                         const moe_tensor_t *value, const moe_tensor_t *grad);

/* Start the data-parallel all-reduce of a layer's gradients (one non-blocking all-reduce per
 * parameter tensor) so that it overlaps with the backward of earlier layers. Call it right
 * after the layer's last backward of the global batch; moe_adamw_step waits for it. layer
 * NULL starts every registered parameter's reduction that has not started (user parameters
 * too). A no-op in a world of one. Collective over the dense (ep x dp) and expert-data-
 * parallel groups: every rank starts its layers' reductions in the same order. */
MOE_API moe_status_t moe_adamw_start_grad_sync(moe_adamw_t *opt, moe_layer_t *layer);

/* moe_adamw_step's lr for "the configured rate through the configured schedule". */
#define MOE_ADAMW_LR_CONFIGURED (-1.0f)

/* One update of every registered parameter. With a mesh, gradients are first all-reduced
 * (averaged) over their data-parallel groups: reductions not started by
 * moe_adamw_start_grad_sync start here, then all are waited for. So the call is collective
 * (over the world when max_grad_norm is set, and at the first step, which compares
 * max_grad_norm and the schedule across the world: a difference is INVALID_ARGUMENT on every
 * rank, naming the field and both values).
 * [in] lr > 0: this rate for this step (no schedule); MOE_ADAMW_LR_CONFIGURED: the configured
 * rate through the schedule. 0 is accepted as MOE_ADAMW_LR_CONFIGURED for programs written
 * before the constant (logged once per optimizer); any other value is INVALID_ARGUMENT. */
MOE_API moe_status_t moe_adamw_step(moe_adamw_t *opt, float lr, float grad_scale);
/* [out] lr: the rate the last step used (0 before the first). [out] grad_norm: the global
 * gradient norm before clipping of the last step, -1 when not measured (max_grad_norm 0);
 * either may be NULL. Not collective. */
MOE_API moe_status_t moe_adamw_last_step(const moe_adamw_t *opt, float *lr, double *grad_norm);
/* Optimizer state for checkpoints: for each registered parameter, in registration order,
 * "<name>.master", "<name>.exp_avg", "<name>.exp_avg_sq" (fp32, host or device as the
 * backend keeps them), with the parameter's sharding information. */
MOE_API moe_status_t moe_adamw_num_states(const moe_adamw_t *opt, int32_t *count);
MOE_API moe_status_t moe_adamw_state(const moe_adamw_t *opt, int32_t index, moe_param_info_t *info);
/* The parameter optimizer state `index` belongs to: [out] kind (DENSE or EXPERT: who holds
 * replicas of the state) [out] layer: its layer (whose expert ids place the state's expert
 * shards), NULL for a parameter added by moe_adamw_add_param. Either may be NULL. */
MOE_API moe_status_t moe_adamw_state_owner(const moe_adamw_t *opt, int32_t index,
                                           moe_param_kind_t *kind, const moe_layer_t **layer);
/* Number of completed steps. */
MOE_API moe_status_t moe_adamw_step_count(const moe_adamw_t *opt, int64_t *steps);
/* Restore the step count after loading state from a checkpoint. */
MOE_API moe_status_t moe_adamw_set_step_count(moe_adamw_t *opt, int64_t steps);

#ifdef __cplusplus
}
#endif
#endif /* MOE_OPTIM_H */
