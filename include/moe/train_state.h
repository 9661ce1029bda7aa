/*
 * libmoe training state for checkpoints: one call saves or loads everything a run needs.
 *
 * A state set lists the pieces of a training state: layers (parameters and buffers, with
 * their expert and tp sharding), optimizers (fp32 masters and moments of every registered
 * parameter, and the step count) and user tensors (dense parameters of the user's model, data
 * positions, RNG states). moe_ckpt_save_train_state / moe_ckpt_load_train_state turn the set into
 * checkpoint entries (moe/ckpt.h) and back, so a state saved at one mesh loads at another:
 * expert shards are redistributed over the new ep, tp shards over the new tp.
 *
 * Replicated pieces (dense parameters, buffers and their optimizer states) are written by one
 * replica only, the rank with tp = ep = dp = 0 of each pp stage; every rank loads its own copy.
 *
 * Names: a layer's entries are prefix + parameter name ("blocks.3.moe." + "experts.w1"), an
 * optimizer's prefix + state name ("optim." + "blocks.3.moe.experts.w1.exp_avg") and
 * prefix + "step" for its step count. Every name is unique within the run's state (the pp
 * stages together), so give each layer of a model its own prefix.
 *
 * The set keeps pointers to the layers, optimizers and tensor memory it was given: they must
 * outlive it. Not collective, except save and load (collective as moe_ckpt_save_async and
 * moe_ckpt_load_latest are).
 */
#ifndef MOE_TRAIN_STATE_H
#define MOE_TRAIN_STATE_H

#include "ckpt.h"
#include "layer.h"
#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_train_state moe_train_state_t;

/* [out] out: an empty set. destroy(NULL) is a no-op. */
MOE_API moe_status_t moe_train_state_create(moe_train_state_t **out);
MOE_API moe_status_t moe_train_state_destroy(moe_train_state_t *state);

/* Every parameter and buffer of the layer, as prefix + name (prefix may be NULL). */
MOE_API moe_status_t moe_train_state_add_layer(moe_train_state_t *state, const moe_layer_t *layer,
                                               const char *prefix);
/* Every optimizer state (moe_adamw_state) as prefix + its name, and the step count as
 * prefix + "step"; loading restores the step count too. */
MOE_API moe_status_t moe_train_state_add_adamw(moe_train_state_t *state, moe_adamw_t *opt,
                                               const char *prefix);
/* A user tensor: entry as for moe_ckpt_save_async (name copied; the data must outlive the
 * set). kind says who holds it: MOE_PARAM_DENSE or MOE_PARAM_BUFFER for a tensor replicated
 * over tp, ep and dp (written by one replica), MOE_PARAM_EXPERT for one that differs over ep
 * (its slice given by entry's offset / expert ids; written by the dp = 0 ranks). */
MOE_API moe_status_t moe_train_state_add_tensor(moe_train_state_t *state,
                                                const moe_ckpt_tensor_t *entry,
                                                moe_param_kind_t kind);

/* Save the set as `step` (see moe_ckpt_save_async: asynchronous, collective). */
MOE_API moe_status_t moe_ckpt_save_train_state(moe_ckpt_t *ck, int64_t step,
                                               moe_train_state_t *state);
/* Load the set from `step`, or from the newest complete checkpoint when step < 0 (see
 * moe_ckpt_load_latest; collective). [out] loaded_step (may be NULL). */
MOE_API moe_status_t moe_ckpt_load_train_state(moe_ckpt_t *ck, int64_t step,
                                               moe_train_state_t *state, int64_t *loaded_step);

#ifdef __cplusplus
}
#endif
#endif /* MOE_TRAIN_STATE_H */
