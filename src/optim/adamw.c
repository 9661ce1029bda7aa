/*
 * AdamW over layer and user parameters: fp32 masters and moments on the runtime's device,
 * gradients reduced over their data-parallel groups before each update (grad_sync.c).
 *
 * A reduction that fails (a peer timed out, or another rank reported a failure) ends the
 * step at once with its own status and message; the reductions still pending stay with
 * their communicators, which the failure made unusable (waiting for them would only repeat
 * the failure, or wait a timeout more).
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <moe/optim.h>

#include "core/error.h"
#include "core/tensor.h"
#include "runtime/runtime.h"
#include "clip.h"
#include "grad_sync.h"

typedef struct adamw_param {
    char *name;
    char *state_names[3];     /* "<name>.master", ".exp_avg", ".exp_avg_sq" */
    moe_param_info_t info;    /* value, grad and sharding, as registered */
    float *state[3];          /* master, m, v: f32 on the device */
    const moe_layer_t *layer; /* the layer it came from, or NULL for a user parameter */
    moe_grad_sync_t sync;     /* its gradient reduction, once started */
    bool sync_started;
} adamw_param_t;

struct moe_adamw {
    uint64_t magic;
    moe_runtime_t *rt;
    moe_adamw_config_t cfg;
    adamw_param_t *params;
    int32_t count, capacity;
    int64_t steps;
    float max_grad_norm;        /* 0: no clipping (moe_adamw_set_grad_clip) */
    moe_lr_schedule_t schedule; /* moe_adamw_set_lr_schedule; constant by default */
    float last_lr;              /* the rate of the last step */
    double last_grad_norm;      /* its global gradient norm before clipping; -1: not measured */
    bool warned_lr_zero;        /* the lr = 0 compatibility note is logged once */
    bool step_settings_agreed;  /* the first step compared the schedule and clipping */
};

moe_adamw_config_t moe_adamw_config_default(void)
{
    moe_adamw_config_t c = {.struct_size = sizeof c,
                            .lr = 1e-3f,
                            .beta1 = 0.9f,
                            .beta2 = 0.999f,
                            .eps = 1e-8f,
                            .weight_decay = 0.01f};
    return c;
}

static moe_status_t validate(const moe_adamw_config_t *c)
{
    MOE_CHECK_ARG(c->lr > 0, "lr is %g; must be > 0", c->lr);
    MOE_CHECK_ARG(c->beta1 >= 0 && c->beta1 < 1, "beta1 is %g; must be in [0, 1)", c->beta1);
    MOE_CHECK_ARG(c->beta2 >= 0 && c->beta2 < 1, "beta2 is %g; must be in [0, 1)", c->beta2);
    MOE_CHECK_ARG(c->eps > 0, "eps is %g; must be > 0", c->eps);
    MOE_CHECK_ARG(c->weight_decay >= 0, "weight_decay is %g; must be >= 0", c->weight_decay);
    return MOE_STATUS_SUCCESS;
}

/* The ranks of a pp stage hold replicas and shards of the same parameters: a different rate,
 * decay or moment setting on one of them makes the replicas drift apart silently. A rank
 * whose own config is invalid (`local`) still joins, so the others learn. */
static moe_status_t agree_config(moe_runtime_t *rt, const moe_adamw_config_t *c, moe_status_t local)
{
    moe_agree_field_t f[] = {
        moe_agree_f32("lr", c->lr),
        moe_agree_f32("beta1", c->beta1),
        moe_agree_f32("beta2", c->beta2),
        moe_agree_f32("eps", c->eps),
        moe_agree_f32("weight_decay", c->weight_decay),
    };
    return moe_mesh_agree(rt->mesh, MOE_MESH_STAGE, "the optimizer config", f,
                          (int)(sizeof f / sizeof f[0]), local);
}

/* The settings made after create, compared at the first step over the world: clipping takes
 * a world-wide norm (one rank alone clipping waits for ever on the others), the schedule
 * sets every rank's rate. */
static moe_status_t agree_step_settings(moe_adamw_t *opt)
{
    const moe_lr_schedule_t *s = &opt->schedule;
    moe_agree_field_t f[] = {
        moe_agree_f32("max_grad_norm (moe_adamw_set_grad_clip)", opt->max_grad_norm),
        moe_agree_int("schedule decay (0 constant, 1 linear, 2 cosine)", s->decay),
        moe_agree_int("schedule warmup_steps", s->warmup_steps),
        moe_agree_int("schedule decay_steps", s->decay_steps),
        moe_agree_f32("schedule min_lr_ratio", s->min_lr_ratio),
    };
    return moe_mesh_agree(opt->rt->mesh, MOE_AXIS_WORLD, "the optimizer's clipping and schedule", f,
                          (int)(sizeof f / sizeof f[0]), MOE_STATUS_SUCCESS);
}

moe_status_t moe_adamw_create(moe_runtime_t *rt, const moe_adamw_config_t *config,
                              moe_adamw_t **out)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    moe_adamw_config_t c = moe_adamw_config_default();
    MOE_TAKE_CONFIG(c, config, moe_adamw_config_t);
    MOE_TRY(agree_config(rt, &c, validate(&c)));
    moe_adamw_t *opt = calloc(1, sizeof *opt);
    if (!opt) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "optimizer allocation");
    opt->magic = MOE_MAGIC_ADAMW;
    opt->rt = rt;
    opt->cfg = c;
    opt->last_grad_norm = -1;
    moe_runtime_adopt(rt, MOE_CHILD_OPTIMIZER);
    *out = opt;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_set_grad_clip(moe_adamw_t *opt, float max_grad_norm)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(max_grad_norm >= 0, "max_grad_norm is %g; must be >= 0 (0: no clipping)",
                  max_grad_norm);
    opt->max_grad_norm = max_grad_norm;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_set_lr_schedule(moe_adamw_t *opt, const moe_lr_schedule_t *s)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(s != NULL, "schedule is NULL");
    MOE_CHECK_ARG(moe_lr_schedule_rate(s, opt->cfg.lr, 1) >= 0,
                  "schedule (decay %d, warmup_steps %lld, decay_steps %lld, min_lr_ratio %g) "
                  "is invalid: decay CONSTANT, LINEAR or COSINE, warmup_steps >= 0, "
                  "decay_steps > warmup_steps when decaying, min_lr_ratio in [0, 1]",
                  (int)s->decay, (long long)s->warmup_steps, (long long)s->decay_steps,
                  s->min_lr_ratio);
    opt->schedule = *s;
    return MOE_STATUS_SUCCESS;
}

static void param_free(moe_runtime_t *rt, adamw_param_t *p)
{
    moe_grad_sync_wait(&p->sync); /* never free under a reduction in flight */
    for (int i = 0; i < 3; i++) {
        if (p->state[i]) MOE_OPS(rt)->free(MOE_CTX(rt), p->state[i]);
        free(p->state_names[i]);
    }
    free(p->name);
}

moe_status_t moe_adamw_destroy(moe_adamw_t *opt)
{
    moe_error_clear();
    if (!opt) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_OPS(opt->rt)->synchronize(MOE_CTX(opt->rt));
    for (int32_t i = 0; i < opt->count; i++) param_free(opt->rt, &opt->params[i]);
    free(opt->params);
    moe_runtime_disown(opt->rt, MOE_CHILD_OPTIMIZER);
    opt->magic = MOE_MAGIC_DEAD;
    free(opt);
    return MOE_STATUS_SUCCESS;
}

static char *concat(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    char *s = malloc(la + lb + 1);
    if (s) {
        memcpy(s, a, la);
        memcpy(s + la, b, lb + 1);
    }
    return s;
}

static bool name_taken(const moe_adamw_t *opt, const char *name)
{
    for (int32_t i = 0; i < opt->count; i++)
        if (strcmp(opt->params[i].name, name) == 0) return true;
    return false;
}

static moe_status_t check_name_free(const moe_adamw_t *opt, const char *name)
{
    MOE_CHECK_ARG(!name_taken(opt, name), "a parameter named \"%s\" is already registered", name);
    return MOE_STATUS_SUCCESS;
}

/* Register one parameter: copy its description, allocate f32 master and moments, and seed
 * the master from the current value. */
static moe_status_t register_param(moe_adamw_t *opt, const char *name, const moe_param_info_t *info)
{
    moe_runtime_t *rt = opt->rt;
    MOE_TRY(check_name_free(opt, name));
    if (opt->count == opt->capacity) {
        int32_t cap = opt->capacity ? opt->capacity * 2 : 8;
        adamw_param_t *grown = realloc(opt->params, sizeof *grown * (size_t)cap);
        if (!grown) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "optimizer parameter list");
        opt->params = grown;
        opt->capacity = cap;
    }
    adamw_param_t *p = &opt->params[opt->count];
    memset(p, 0, sizeof *p);
    p->info = *info;
    int64_t n = moe_tensor_numel(&info->value);
    size_t bytes = sizeof(float) * (size_t)n;
    static const char *suffix[3] = {".master", ".exp_avg", ".exp_avg_sq"};
    moe_status_t st = MOE_STATUS_SUCCESS;
    p->name = strdup(name);
    if (!p->name) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "parameter name");
        goto fail;
    }
    p->info.name = p->name;
    for (int i = 0; i < 3; i++) {
        p->state_names[i] = concat(name, suffix[i]);
        if (!p->state_names[i]) {
            st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "state name");
            goto fail;
        }
        MOE_TRY_GOTO(st, MOE_OPS(rt)->alloc(MOE_CTX(rt), bytes, (void **)&p->state[i]));
    }
    if (n > 0) {
        MOE_TRY_GOTO(st, MOE_OPS(rt)->act_to_f32(MOE_CTX(rt), p->state[0], info->value.data, n));
        MOE_TRY_GOTO(st, MOE_OPS(rt)->memset_zero(MOE_CTX(rt), p->state[1], bytes));
        MOE_TRY_GOTO(st, MOE_OPS(rt)->memset_zero(MOE_CTX(rt), p->state[2], bytes));
    }
    opt->count++;
    return MOE_STATUS_SUCCESS;
fail:
    param_free(rt, p);
    return st;
}

moe_status_t moe_adamw_add_layer(moe_adamw_t *opt, moe_layer_t *layer, const char *prefix)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    int32_t count = 0;
    MOE_TRY(moe_layer_num_params(layer, &count));
    /* two passes so that a name collision registers nothing */
    for (int pass = 0; pass < 2; pass++)
        for (int32_t i = 0; i < count; i++) {
            moe_param_info_t info = {.struct_size = sizeof info};
            MOE_TRY(moe_layer_param(layer, i, &info));
            if (info.kind == MOE_PARAM_BUFFER) continue;
            char *name = concat(prefix ? prefix : "", info.name);
            if (!name) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "parameter name");
            moe_status_t st = MOE_STATUS_SUCCESS;
            if (pass == 0)
                st = check_name_free(opt, name);
            else if (pass == 1 && (st = register_param(opt, name, &info)) == MOE_STATUS_SUCCESS)
                opt->params[opt->count - 1].layer = layer;
            free(name);
            MOE_TRY(st);
        }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_add_param(moe_adamw_t *opt, const char *name, moe_param_kind_t kind,
                                 const moe_tensor_t *value, const moe_tensor_t *grad)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(name != NULL && name[0] != '\0', "name is NULL or empty");
    MOE_CHECK_ARG(kind == MOE_PARAM_DENSE || kind == MOE_PARAM_EXPERT,
                  "kind %d is not a trainable kind (DENSE or EXPERT)", (int)kind);
    const moe_backend_ops_t *ops = MOE_OPS(opt->rt);
    MOE_CHECK_ARG(value != NULL && grad != NULL, "value or grad is NULL");
    MOE_TRY(moe_tensor_check(value, "value", ops->compute_dtype, ops->device, value->ndim,
                             value->shape));
    MOE_TRY(moe_tensor_check(grad, "grad", MOE_DTYPE_F32, ops->device, value->ndim, value->shape));
    moe_param_info_t info = {.struct_size = sizeof info,
                             .name = name,
                             .kind = kind,
                             .value = *value,
                             .grad = *grad,
                             .expert_dim = -1,
                             .tp_dim = -1};
    for (int d = 0; d < value->ndim; d++) info.global_shape[d] = value->shape[d];
    return register_param(opt, name, &info);
}

/* Start the reductions of the parameters of `layer` (NULL: of every parameter) that have not
 * started yet, in registration order. */
static moe_status_t start_grad_sync(moe_adamw_t *opt, const moe_layer_t *layer)
{
    for (int32_t i = 0; i < opt->count; i++) {
        adamw_param_t *p = &opt->params[i];
        if (p->sync_started || (layer && p->layer != layer)) continue;
        MOE_TRY(moe_grad_sync_start(opt->rt, p->info.kind, p->info.grad.data,
                                    moe_tensor_numel(&p->info.grad), &p->sync));
        p->sync_started = true;
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_start_grad_sync(moe_adamw_t *opt, moe_layer_t *layer)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    if (layer) {
        bool registered = false;
        for (int32_t i = 0; i < opt->count; i++) registered |= opt->params[i].layer == layer;
        MOE_CHECK_ARG(registered, "the layer has no parameters registered with this optimizer");
        for (int32_t i = 0; i < opt->count; i++)
            MOE_CHECK_ARG(opt->params[i].layer != layer || !opt->params[i].sync_started,
                          "the gradient reduction of \"%s\" has already started in this "
                          "global batch",
                          opt->params[i].name);
    }
    return start_grad_sync(opt, layer);
}

/* The rate of the coming step: an explicit one, or the configured rate through the schedule. */
static moe_status_t step_rate(moe_adamw_t *opt, float lr, float *rate)
{
    if (lr == 0.0f && !opt->warned_lr_zero) {
        moe_log(&opt->rt->logger, MOE_LOG_WARN,
                "moe_adamw_step: lr 0 is taken as MOE_ADAMW_LR_CONFIGURED (the configured "
                "rate); pass the constant to say so");
        opt->warned_lr_zero = true;
    }
    MOE_CHECK_ARG(lr > 0 || lr == 0.0f || lr == MOE_ADAMW_LR_CONFIGURED,
                  "lr is %g; must be > 0 or MOE_ADAMW_LR_CONFIGURED", lr);
    *rate = lr > 0 ? lr : moe_lr_schedule_rate(&opt->schedule, opt->cfg.lr, opt->steps + 1);
    return MOE_STATUS_SUCCESS;
}

/* The clipping factor for this step's averaged gradient (grad * scale), 1 without clipping:
 * the squares of every gradient this rank counts in one pass on their device, one wait. */
static moe_status_t clip_factor(moe_adamw_t *opt, float scale, float *factor)
{
    *factor = 1.0f;
    opt->last_grad_norm = -1;
    if (opt->max_grad_norm <= 0) return MOE_STATUS_SUCCESS;
    const float **grads = malloc(sizeof *grads * (size_t)(opt->count + 1));
    int64_t *sizes = malloc(sizeof *sizes * (size_t)(opt->count + 1));
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!grads || !sizes) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "gradient list of %d", opt->count);
        goto fail;
    }
    int32_t counted = 0;
    for (int32_t i = 0; i < opt->count; i++) {
        const moe_param_info_t *info = &opt->params[i].info;
        if (!moe_grad_counted_here(opt->rt, info)) continue;
        grads[counted] = info->grad.data;
        sizes[counted++] = moe_tensor_numel(&info->grad);
    }
    double share = 0, norm;
    if (counted > 0)
        MOE_TRY_GOTO(
            st, MOE_OPS(opt->rt)->sum_squares(MOE_CTX(opt->rt), grads, sizes, counted, &share));
    MOE_TRY_GOTO(st, moe_grad_norm_reduce(opt->rt, share, &norm));
    norm *= scale;
    opt->last_grad_norm = norm;
    if (norm > opt->max_grad_norm) *factor = (float)(opt->max_grad_norm / norm);
fail:
    free(grads);
    free(sizes);
    return st;
}

moe_status_t moe_adamw_step(moe_adamw_t *opt, float lr, float grad_scale)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(grad_scale > 0 && grad_scale == grad_scale, "grad_scale is %g; must be > 0",
                  grad_scale);
    float rate = 0;
    MOE_TRY(step_rate(opt, lr, &rate));
    moe_runtime_t *rt = opt->rt;
    /* reductions not started during the backward start now, in registration order */
    MOE_TRY(start_grad_sync(opt, NULL));
    for (int32_t i = 0; i < opt->count; i++) {
        moe_status_t st = moe_grad_sync_wait(&opt->params[i].sync);
        opt->params[i].sync_started = false;
        MOE_TRY(st); /* the first failure is the one to report */
    }
    if (!opt->step_settings_agreed) { /* before the clipping norm, which they decide */
        MOE_TRY(agree_step_settings(opt));
        opt->step_settings_agreed = true;
    }
    float scale = grad_scale / (float)moe_grad_replicas(rt), clip;
    MOE_TRY(clip_factor(opt, scale, &clip));
    scale *= clip;
    /* every parameter in one pass (the backend's multi-tensor update) */
    moe_adamw_tensor_t *tensors = malloc(sizeof *tensors * (size_t)(opt->count + 1));
    if (!tensors) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "parameter list of %d", opt->count);
    int32_t count = 0;
    for (int32_t i = 0; i < opt->count; i++) {
        adamw_param_t *p = &opt->params[i];
        int64_t n = moe_tensor_numel(&p->info.value);
        if (n > 0)
            tensors[count++] = (moe_adamw_tensor_t){.n = n,
                                                    .master = p->state[0],
                                                    .m = p->state[1],
                                                    .v = p->state[2],
                                                    .param = p->info.value.data,
                                                    .grad = p->info.grad.data};
    }
    /* a checkpoint's snapshot of this state may still be copying: the update waits for it
     * (CUDA: the stream waits for the copy's event; the host does not) */
    moe_status_t fenced = moe_runtime_fence_writes(rt, NULL, 0);
    if (fenced != MOE_STATUS_SUCCESS) {
        free(tensors);
        return fenced;
    }
    moe_adamw_update_t u = {
        .lr = rate,
        .beta1 = opt->cfg.beta1,
        .beta2 = opt->cfg.beta2,
        .eps = opt->cfg.eps,
        .weight_decay = opt->cfg.weight_decay,
        .grad_scale = scale,
        .step = opt->steps + 1,
        .tensors = tensors,
        .count = count,
    };
    moe_status_t st = MOE_OPS(rt)->adamw_update(MOE_CTX(rt), &u);
    free(tensors);
    MOE_TRY(st);
    opt->steps++;
    opt->last_lr = rate;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_num_states(const moe_adamw_t *opt, int32_t *count)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(count != NULL, "count is NULL");
    *count = opt->count * 3;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_state(const moe_adamw_t *opt, int32_t index, moe_param_info_t *info)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(info != NULL, "info is NULL");
    MOE_CHECK_STRUCT_SIZE(info, moe_param_info_t, sizeof(moe_param_info_t));
    MOE_CHECK_ARG(index >= 0 && index < opt->count * 3, "index %d is out of range 0..%d", index,
                  opt->count * 3 - 1);
    const adamw_param_t *p = &opt->params[index / 3];
    *info = p->info;
    info->struct_size = sizeof *info;
    info->name = p->state_names[index % 3];
    info->kind = MOE_PARAM_BUFFER;
    info->value.dtype = MOE_DTYPE_F32;
    info->value.data = p->state[index % 3];
    memset(&info->grad, 0, sizeof info->grad);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_state_owner(const moe_adamw_t *opt, int32_t index, moe_param_kind_t *kind,
                                   const moe_layer_t **layer)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(index >= 0 && index < opt->count * 3, "index %d is out of range 0..%d", index,
                  opt->count * 3 - 1);
    if (kind) *kind = opt->params[index / 3].info.kind;
    if (layer) *layer = opt->params[index / 3].layer;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_step_count(const moe_adamw_t *opt, int64_t *steps)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(steps != NULL, "steps is NULL");
    *steps = opt->steps;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_set_step_count(moe_adamw_t *opt, int64_t steps)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    MOE_CHECK_ARG(steps >= 0, "steps is %lld; must be >= 0", (long long)steps);
    opt->steps = steps;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_adamw_last_step(const moe_adamw_t *opt, float *lr, double *grad_norm)
{
    MOE_ENTRY(opt, MOE_MAGIC_ADAMW, "optimizer");
    if (lr) *lr = opt->last_lr;
    if (grad_norm) *grad_norm = opt->last_grad_norm;
    return MOE_STATUS_SUCCESS;
}
