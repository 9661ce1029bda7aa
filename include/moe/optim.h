/*
 * libmoe AdamW optimizer.
 *
 * Keeps fp32 master weights and fp32 moments for every registered parameter; after each step
 * it writes the master weights back into the parameter tensors (rounded to bf16 on the CUDA
 * backend). Gradients are read as accumulated by backward over the microbatches of a global
 * batch; `grad_scale` (e.g. 1/microbatches) is applied before the update.
 *
 * Update per element, step t (1-based):
 *   g = grad * grad_scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
 *   p = p - lr * ( (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + weight_decay * p )
 */
#ifndef MOE_OPTIM_H
#define MOE_OPTIM_H

#include "core.h"
#include "layer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_adamw moe_adamw_t;

typedef struct moe_adamw_config {
    size_t struct_size;
    float lr;            /* default 1e-3 */
    float beta1;         /* default 0.9 */
    float beta2;         /* default 0.999 */
    float eps;           /* default 1e-8 */
    float weight_decay;  /* default 0.01 (decoupled) */
} moe_adamw_config_t;

MOE_API moe_adamw_config_t moe_adamw_config_default(void);
MOE_API moe_status_t moe_adamw_create(moe_runtime_t *rt, const moe_adamw_config_t *config,
                                      moe_adamw_t **out);
MOE_API moe_status_t moe_adamw_destroy(moe_adamw_t *opt);

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

/* One update of every registered parameter. With a mesh, gradients are first all-reduced
 * (averaged) over their data-parallel groups, so the call is collective. lr <= 0 uses the
 * configured rate. */
MOE_API moe_status_t moe_adamw_step(moe_adamw_t *opt, float lr, float grad_scale);
/* Optimizer state for checkpoints: for each registered parameter, in registration order,
 * "<name>.master", "<name>.exp_avg", "<name>.exp_avg_sq" (fp32, host or device as the
 * backend keeps them), with the parameter's sharding information. */
MOE_API moe_status_t moe_adamw_num_states(const moe_adamw_t *opt, int32_t *count);
MOE_API moe_status_t moe_adamw_state(const moe_adamw_t *opt, int32_t index, moe_param_info_t *info);
/* Number of completed steps. */
MOE_API moe_status_t moe_adamw_step_count(const moe_adamw_t *opt, int64_t *steps);
/* Restore the step count after loading state from a checkpoint. */
MOE_API moe_status_t moe_adamw_set_step_count(moe_adamw_t *opt, int64_t steps);

#ifdef __cplusplus
}
#endif
#endif /* MOE_OPTIM_H */
