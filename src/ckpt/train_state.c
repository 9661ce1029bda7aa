/*
 * A run's training state as one set of checkpoint entries (moe/train_state.h): layers and
 * optimizers through their public parameter and state descriptions, user tensors as given.
 * Optimizer step counts travel as an F32 tensor [4] of 16-bit limbs (exact for any int64 >= 0;
 * the checkpoint format has no integer dtype).
 */
#include <stdlib.h>
#include <string.h>

#include <moe/train_state.h>
#include <moe/mesh.h>

#include "core/error.h"
#include "ckpt_internal.h"

#define STEP_LIMBS 4

typedef struct state_entry {
    moe_ckpt_tensor_t t;   /* t.name and t.expert_ids owned by the entry */
    moe_param_kind_t kind; /* who writes it (see the header) */
    moe_adamw_t *opt;      /* set for an optimizer's step-count entry */
    float *limbs;          /* that entry's data */
} state_entry_t;

struct moe_train_state {
    uint64_t magic;
    state_entry_t *e;
    int32_t count, capacity;
};

moe_status_t moe_train_state_create(moe_train_state_t **out)
{
    moe_error_clear();
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = calloc(1, sizeof **out);
    if (!*out) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "training state");
    (*out)->magic = MOE_MAGIC_TRAIN_STATE;
    return MOE_STATUS_SUCCESS;
}

static void entry_free(state_entry_t *e)
{
    free((char *)e->t.name);
    free((int32_t *)e->t.expert_ids);
    free(e->limbs);
}

moe_status_t moe_train_state_destroy(moe_train_state_t *s)
{
    moe_error_clear();
    if (!s) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(s, MOE_MAGIC_TRAIN_STATE, "training state");
    for (int32_t i = 0; i < s->count; i++) entry_free(&s->e[i]);
    free(s->e);
    s->magic = MOE_MAGIC_DEAD;
    free(s);
    return MOE_STATUS_SUCCESS;
}

/* Append a copy of t named prefix + name; the set takes ownership of expert_ids. */
static moe_status_t append(moe_train_state_t *s, const char *prefix, const char *name,
                           const moe_ckpt_tensor_t *t, int32_t *expert_ids, moe_param_kind_t kind)
{
    if (s->count == s->capacity) {
        int32_t cap = s->capacity ? s->capacity * 2 : 16;
        state_entry_t *grown = realloc(s->e, sizeof *grown * (size_t)cap);
        if (!grown) {
            free(expert_ids);
            return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "checkpoint state entries");
        }
        s->e = grown;
        s->capacity = cap;
    }
    size_t lp = prefix ? strlen(prefix) : 0, ln = strlen(name);
    char *full = malloc(lp + ln + 1);
    if (!full) {
        free(expert_ids);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "checkpoint entry name");
    }
    memcpy(full, prefix ? prefix : "", lp);
    memcpy(full + lp, name, ln + 1);
    state_entry_t *e = &s->e[s->count++];
    *e = (state_entry_t){.t = *t, .kind = kind};
    e->t.name = full;
    e->t.expert_ids = expert_ids;
    return MOE_STATUS_SUCCESS;
}

/* An entry for a layer parameter or an optimizer state described by info; the expert ids of
 * its expert dimension come from `layer`. */
static moe_status_t append_info(moe_train_state_t *s, const char *prefix,
                                const moe_param_info_t *info, const moe_layer_t *layer,
                                moe_param_kind_t kind)
{
    moe_ckpt_tensor_t t = moe_ckpt_tensor_whole(info->name, &info->value);
    memcpy(t.global_shape, info->global_shape, sizeof t.global_shape);
    memcpy(t.offset, info->shard_offset, sizeof t.offset);
    t.expert_dim = info->expert_dim;
    int32_t *ids = NULL;
    if (info->expert_dim >= 0 && layer) {
        int64_t n = info->value.shape[info->expert_dim];
        ids = malloc(sizeof *ids * (size_t)(n > 0 ? n : 1));
        if (!ids) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "expert ids of %s", info->name);
        for (int64_t j = 0; j < n; j++) {
            moe_status_t st = moe_layer_expert_id(layer, (int32_t)j, &ids[j]);
            if (st != MOE_STATUS_SUCCESS) {
                free(ids);
                return st;
            }
        }
    }
    return append(s, prefix, info->name, &t, ids, kind);
}

moe_status_t moe_train_state_add_layer(moe_train_state_t *s, const moe_layer_t *layer,
                                       const char *prefix)
{
    MOE_ENTRY(s, MOE_MAGIC_TRAIN_STATE, "training state");
    int32_t n;
    MOE_TRY(moe_layer_num_params(layer, &n));
    for (int32_t i = 0; i < n; i++) {
        moe_param_info_t info = {.struct_size = sizeof info};
        MOE_TRY(moe_layer_param(layer, i, &info));
        MOE_TRY(append_info(s, prefix, &info, layer, info.kind));
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_train_state_add_adamw(moe_train_state_t *s, moe_adamw_t *opt, const char *prefix)
{
    MOE_ENTRY(s, MOE_MAGIC_TRAIN_STATE, "training state");
    int32_t n;
    MOE_TRY(moe_adamw_num_states(opt, &n));
    for (int32_t i = 0; i < n; i++) {
        moe_param_info_t info = {.struct_size = sizeof info};
        moe_param_kind_t kind;
        const moe_layer_t *layer;
        MOE_TRY(moe_adamw_state(opt, i, &info));
        MOE_TRY(moe_adamw_state_owner(opt, i, &kind, &layer));
        MOE_TRY(append_info(s, prefix, &info, layer, kind));
    }
    float *limbs = calloc(STEP_LIMBS, sizeof *limbs);
    if (!limbs) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "step count entry");
    int64_t shape[1] = {STEP_LIMBS};
    moe_tensor_t t;
    moe_status_t st = moe_tensor_view(limbs, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, shape, &t);
    moe_ckpt_tensor_t entry = moe_ckpt_tensor_whole("step", &t);
    if (st == MOE_STATUS_SUCCESS) st = append(s, prefix, "step", &entry, NULL, MOE_PARAM_BUFFER);
    if (st != MOE_STATUS_SUCCESS) {
        free(limbs);
        return st;
    }
    s->e[s->count - 1].opt = opt;
    s->e[s->count - 1].limbs = limbs;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_train_state_add_tensor(moe_train_state_t *s, const moe_ckpt_tensor_t *entry,
                                        moe_param_kind_t kind)
{
    MOE_ENTRY(s, MOE_MAGIC_TRAIN_STATE, "training state");
    MOE_CHECK_ARG(entry != NULL && entry->name != NULL, "entry or its name is NULL");
    MOE_CHECK_ARG(kind == MOE_PARAM_DENSE || kind == MOE_PARAM_EXPERT || kind == MOE_PARAM_BUFFER,
                  "kind %d is not a moe_param_kind_t", (int)kind);
    int32_t *ids = NULL;
    if (entry->expert_dim >= 0 && entry->expert_ids) {
        int64_t n = entry->tensor.shape[entry->expert_dim];
        ids = malloc(sizeof *ids * (size_t)(n > 0 ? n : 1));
        if (!ids) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "expert ids of %s", entry->name);
        memcpy(ids, entry->expert_ids, sizeof *ids * (size_t)n);
    }
    return append(s, NULL, entry->name, entry, ids, kind);
}

/* Whether this rank writes an entry: expert pieces from every dp = 0 rank, replicated ones
 * from the tp = ep = dp = 0 rank of each pp stage. */
static moe_status_t writes_entry(moe_runtime_t *rt, const state_entry_t *e, bool *writes)
{
    int32_t tp, ep, dp, size;
    MOE_TRY(moe_runtime_axis(rt, MOE_AXIS_TP, &tp, &size));
    MOE_TRY(moe_runtime_axis(rt, MOE_AXIS_EP, &ep, &size));
    MOE_TRY(moe_runtime_axis(rt, MOE_AXIS_DP, &dp, &size));
    bool sharded = e->kind == MOE_PARAM_EXPERT;
    *writes = dp == 0 && (sharded || (tp == 0 && ep == 0));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_ckpt_save_train_state(moe_ckpt_t *ck, int64_t step, moe_train_state_t *s)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_HANDLE(s, MOE_MAGIC_TRAIN_STATE, "training state");
    moe_ckpt_tensor_t *list = malloc(sizeof *list * (size_t)(s->count > 0 ? s->count : 1));
    if (!list) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "checkpoint entry list");
    int32_t n = 0;
    moe_status_t st = MOE_STATUS_SUCCESS;
    for (int32_t i = 0; i < s->count && st == MOE_STATUS_SUCCESS; i++) {
        state_entry_t *e = &s->e[i];
        if (e->opt) {
            int64_t steps = 0;
            st = moe_adamw_step_count(e->opt, &steps);
            /* the limbs are a host tensor an earlier save may still be copying */
            if (st == MOE_STATUS_SUCCESS)
                st = ckpt_fence_writes(ck, e->limbs, sizeof *e->limbs * STEP_LIMBS);
            for (int k = 0; k < STEP_LIMBS; k++)
                e->limbs[k] = (float)((uint64_t)steps >> (16 * k) & 0xffffu);
        }
        bool writes = false;
        if (st == MOE_STATUS_SUCCESS) st = writes_entry(ck->rt, e, &writes);
        if (writes) list[n++] = e->t;
    }
    /* every rank takes part in the collective save, also one whose list failed to build */
    if (st != MOE_STATUS_SUCCESS) n = 0;
    moe_status_t saved = moe_ckpt_save_async(ck, step, list, n);
    free(list);
    return st != MOE_STATUS_SUCCESS ? st : saved;
}

moe_status_t moe_ckpt_load_train_state(moe_ckpt_t *ck, int64_t step, moe_train_state_t *s,
                                       int64_t *loaded_step)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_HANDLE(s, MOE_MAGIC_TRAIN_STATE, "training state");
    moe_ckpt_tensor_t *list = malloc(sizeof *list * (size_t)(s->count > 0 ? s->count : 1));
    if (!list) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "checkpoint entry list");
    for (int32_t i = 0; i < s->count; i++) list[i] = s->e[i].t;
    int64_t got = step;
    moe_status_t st = step < 0 ? moe_ckpt_load_latest(ck, list, s->count, &got)
                               : moe_ckpt_load_step(ck, step, list, s->count);
    free(list);
    MOE_TRY(st);
    for (int32_t i = 0; i < s->count; i++) {
        const state_entry_t *e = &s->e[i];
        if (!e->opt) continue;
        uint64_t steps = 0;
        for (int k = 0; k < STEP_LIMBS; k++) steps |= (uint64_t)e->limbs[k] << (16 * k);
        MOE_TRY(moe_adamw_set_step_count(e->opt, (int64_t)steps));
    }
    if (loaded_step) *loaded_step = got;
    return MOE_STATUS_SUCCESS;
}
