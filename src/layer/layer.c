/*
 * The MoE layer's public API: configuration and its validation, the parameters (shapes,
 * shards and their seeded initialisation), the per-microbatch saved state (slots), the
 * gradient marks, the queries, and the choice of path for forward and backward: the
 * single-rank path (single_rank.c) in a world of one, the distributed one
 * (expert_parallel.c) when the mesh gives the layer a partner. Both use routing.c.
 *
 * Shapes: H hidden, E experts, El = E / ep local experts, F expert FFN width, Fl = F / tp.
 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/env.h"
#include "core/error.h"
#include "core/tensor.h"
#include "device_buffer.h"
#include "expert_parallel.h"
#include "layer_internal.h"
#include "routing.h"
#include "single_rank.h"

moe_layer_config_t moe_layer_config_default(void)
{
    moe_layer_config_t c = {
        .struct_size = sizeof c,
        .hidden = 0,
        .ffn_hidden = 0,
        .num_experts = 0,
        .top_k = 0,
        .score_fn = MOE_SCORE_SOFTMAX,
        .renormalize = 1,
        .capacity_factor = 0.0f,
        .aux_loss_coef = 0.01f,
        .z_loss_coef = 0.001f,
        .expert_bias = 0,
        .expert_bias_rate = 1e-3f,
        .max_microbatches = 1,
        .placement = MOE_PLACEMENT_CONTIGUOUS,
        .a2a_chunks = 2,
        .init_std = 0.02f,
        .aux_global_batch = 0,
    };
    return c;
}

static moe_status_t validate_config(const moe_layer_config_t *c, int32_t ep, int32_t tp)
{
    MOE_CHECK_ARG(c->hidden >= 1, "hidden is %lld; must be >= 1", (long long)c->hidden);
    MOE_CHECK_ARG(c->ffn_hidden >= 1, "ffn_hidden is %lld; must be >= 1", (long long)c->ffn_hidden);
    MOE_CHECK_ARG(c->num_experts >= 1, "num_experts is %d; must be >= 1", c->num_experts);
    MOE_CHECK_ARG(c->top_k >= 1 && c->top_k <= c->num_experts,
                  "top_k is %d; must be in 1..num_experts (%d)", c->top_k, c->num_experts);
    MOE_CHECK_ARG(c->score_fn == MOE_SCORE_SOFTMAX || c->score_fn == MOE_SCORE_SIGMOID,
                  "unknown score_fn %d", (int)c->score_fn);
    MOE_CHECK_ARG(c->placement == MOE_PLACEMENT_CONTIGUOUS ||
                      c->placement == MOE_PLACEMENT_ROUND_ROBIN,
                  "unknown placement %d", (int)c->placement);
    MOE_CHECK_ARG(c->max_microbatches >= 1 && c->max_microbatches <= 1024,
                  "max_microbatches is %d; must be in 1..1024", c->max_microbatches);
    MOE_CHECK_ARG(c->a2a_chunks >= 1, "a2a_chunks is %d; must be >= 1", c->a2a_chunks);
    MOE_CHECK_ARG(c->aux_global_batch == 0 || c->aux_global_batch == 1,
                  "aux_global_batch is %d; must be 0 or 1", c->aux_global_batch);
    MOE_CHECK_ARG(isfinite(c->capacity_factor) && isfinite(c->aux_loss_coef) &&
                      isfinite(c->z_loss_coef) && isfinite(c->expert_bias_rate) &&
                      isfinite(c->init_std) && c->init_std >= 0,
                  "capacity_factor, loss coefficients, expert_bias_rate and init_std must be "
                  "finite (init_std >= 0)");
    int64_t w1 = 0; /* num_experts x hidden x 2 ffn_hidden: the largest parameter */
    MOE_CHECK_ARG(!__builtin_mul_overflow((int64_t)c->num_experts * 2, c->hidden, &w1) &&
                      !__builtin_mul_overflow(w1, c->ffn_hidden, &w1) &&
                      w1 <= MOE_TENSOR_MAX_ELEMENTS,
                  "num_experts (%d) x hidden (%lld) x 2 ffn_hidden (%lld) is too many parameters",
                  c->num_experts, (long long)c->hidden, (long long)c->ffn_hidden);
    MOE_CHECK_ARG(c->num_experts % ep == 0, "num_experts (%d) is not divisible by ep (%d)",
                  c->num_experts, ep);
    MOE_CHECK_ARG(c->ffn_hidden % tp == 0, "ffn_hidden (%lld) is not divisible by tp (%d)",
                  (long long)c->ffn_hidden, tp);
    return MOE_STATUS_SUCCESS;
}

/* ---- parameter initialisation ------------------------------------------------------------
 * Each global element draws from a counter-based generator keyed by (seed, tensor, index),
 * so every mesh shape gives the same global parameters. */

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float init_value(uint64_t seed, uint64_t tensor, uint64_t index, float std)
{
    uint64_t base = mix64(seed ^ mix64(tensor * 0x9e3779b97f4a7c15ull + index));
    double u1 = ((double)(mix64(base) >> 11) + 0.5) * 0x1.0p-53;
    double u2 = (double)(mix64(base + 1) >> 11) * 0x1.0p-53;
    return (float)(std * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static int32_t expert_id(const moe_layer_t *l, int32_t local)
{
    return l->cfg.placement == MOE_PLACEMENT_CONTIGUOUS ? l->ep_rank * l->el + local
                                                        : local * l->ep_size + l->ep_rank;
}

/* Global flat index of local element i of a tensor whose local shard has shape `local`. */
static uint64_t global_index(const moe_layer_t *l, const moe_param_info_t *p, int64_t i)
{
    int64_t idx[MOE_MAX_DIMS];
    int nd = p->value.ndim;
    for (int d = nd - 1; d >= 0; d--) {
        idx[d] = i % p->value.shape[d];
        i /= p->value.shape[d];
    }
    uint64_t g = 0;
    for (int d = 0; d < nd; d++) {
        int64_t gi = idx[d] + p->shard_offset[d];
        if (d == p->expert_dim) gi = expert_id(l, (int32_t)idx[d]);
        g = g * (uint64_t)p->global_shape[d] + (uint64_t)gi;
    }
    return g;
}

/* The runtime seed for stream 0 (so a layer's values do not change when streams are not
 * used), a mix of the seed and the stream otherwise. */
static uint64_t init_seed(const moe_layer_t *l)
{
    uint64_t stream = l->init_stream;
    return stream == 0 ? l->rt->seed : mix64(l->rt->seed ^ mix64(stream * 0x9e3779b97f4a7c15ull));
}

/* Elements [lo, hi) of one tensor's initial values, for one thread. */
typedef struct init_range {
    const moe_layer_t *l;
    const moe_param_info_t *p;
    int tensor_id;
    float *out;
    int64_t lo, hi;
} init_range_t;

static void *init_range_fill(void *arg)
{
    const init_range_t *r = arg;
    for (int64_t i = r->lo; i < r->hi; i++)
        r->out[i] = init_value(init_seed(r->l), (uint64_t)r->tensor_id, global_index(r->l, r->p, i),
                               r->l->cfg.init_std);
    return NULL;
}

/* Above this many elements a tensor's values are drawn on several threads: about 90 ns an
 * element on one core, so the experts of a 1.1 G-parameter layer took over a minute serially.
 * Each element depends on its index alone: the values are the same for any thread count.
 * Threads: MOE_INIT_THREADS if set (a positive integer), else the online CPUs; at most
 * INIT_MAX_THREADS. */
#define INIT_PARALLEL_MIN (1 << 20)
#define INIT_MAX_THREADS 32

static int init_threads(const moe_layer_t *l, int64_t n)
{
    if (n < INIT_PARALLEL_MIN) return 1;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t t = moe_env_positive(MOE_ENV_INIT_THREADS, cpus < 1 ? 1 : (size_t)cpus, &l->rt->logger);
    return t > INIT_MAX_THREADS ? INIT_MAX_THREADS : (int)t;
}

static void init_values(const moe_layer_t *l, int tensor_id, const moe_param_info_t *p, float *out,
                        int64_t n)
{
    int threads = init_threads(l, n);
    init_range_t r[INIT_MAX_THREADS];
    pthread_t th[INIT_MAX_THREADS];
    bool started[INIT_MAX_THREADS] = {false};
    for (int t = 0; t < threads; t++)
        r[t] = (init_range_t){l, p, tensor_id, out, n * t / threads, n * (t + 1) / threads};
    /* a range whose thread could not start is filled here */
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&th[t], NULL, init_range_fill, &r[t]) == 0;
    init_range_fill(&r[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(th[t], NULL);
        else
            init_range_fill(&r[t]);
    }
}

static moe_status_t init_param(moe_layer_t *l, int tensor_id, const moe_param_info_t *p)
{
    int64_t n = moe_tensor_numel(&p->value);
    float *host = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!host) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "init buffer for %s", p->name);
    init_values(l, tensor_id, p, host, n);
    moe_runtime_t *rt = l->rt;
    moe_status_t st = MOE_STATUS_SUCCESS;
    void *dev = NULL;
    if (n > 0) {
        MOE_TRY_GOTO(st, MOE_OPS(rt)->alloc(MOE_CTX(rt), sizeof(float) * (size_t)n, &dev));
        MOE_TRY_GOTO(st, MOE_OPS(rt)->copy(MOE_CTX(rt), dev, host, sizeof(float) * (size_t)n));
        MOE_TRY_GOTO(st, MOE_OPS(rt)->f32_to_act(MOE_CTX(rt), p->value.data, dev, n));
        MOE_TRY_GOTO(st, MOE_OPS(rt)->synchronize(MOE_CTX(rt)));
    }
fail:
    if (dev) MOE_OPS(rt)->free(MOE_CTX(rt), dev);
    free(host);
    return st;
}

/* ---- create / destroy --------------------------------------------------------------------- */

/* Describe one parameter and allocate its value and gradient. */
static moe_status_t add_param(moe_layer_t *l, const char *name, moe_param_kind_t kind,
                              moe_dtype_t dtype, int ndim, const int64_t *local,
                              const int64_t *global, const int64_t *offset, int expert_dim,
                              int tp_dim, void **value, float **grad)
{
    moe_runtime_t *rt = l->rt;
    moe_param_info_t *p = &l->params[l->num_params];
    memset(p, 0, sizeof *p);
    p->struct_size = sizeof *p;
    p->name = name;
    p->kind = kind;
    p->expert_dim = expert_dim;
    p->tp_dim = tp_dim;
    MOE_TRY(moe_tensor_view(NULL, dtype, MOE_OPS(rt)->device, ndim, local, &p->value));
    p->value.device_index = rt->device_index;
    for (int d = 0; d < ndim; d++) {
        p->global_shape[d] = global[d];
        p->shard_offset[d] = offset[d];
    }
    MOE_TRY(moe_layer_alloc_dev(rt, moe_tensor_bytes(&p->value), value));
    p->value.data = *value;
    if (grad) {
        p->grad = p->value;
        p->grad.dtype = MOE_DTYPE_F32;
        MOE_TRY(moe_layer_alloc_dev(rt, moe_tensor_bytes(&p->grad), grad));
        p->grad.data = *grad;
        MOE_TRY(MOE_OPS(rt)->memset_zero(MOE_CTX(rt), *grad, moe_tensor_bytes(&p->grad)));
    }
    l->num_params++;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t create_params(moe_layer_t *l)
{
    moe_dtype_t act = MOE_OPS(l->rt)->compute_dtype;
    int64_t h = l->h, e = l->e, el = l->el, fl = l->f_local, f = l->cfg.ffn_hidden;
    int64_t first_expert = expert_id(l, 0);
    int64_t zero[4] = {0, 0, 0, 0};

    int64_t wg_shape[2] = {h, e};
    MOE_TRY(add_param(l, "router.weight", MOE_PARAM_DENSE, act, 2, wg_shape, wg_shape, zero, -1, -1,
                      &l->wg, &l->dwg));
    int64_t w1_local[4] = {el, h, 2, fl}, w1_global[4] = {e, h, 2, f};
    int64_t w1_off[4] = {first_expert, 0, 0, l->tp_rank * fl};
    MOE_TRY(add_param(l, "experts.w1", MOE_PARAM_EXPERT, act, 4, w1_local, w1_global, w1_off, 0, 3,
                      &l->w1, &l->dw1));
    int64_t w2_local[3] = {el, fl, h}, w2_global[3] = {e, f, h};
    int64_t w2_off[3] = {first_expert, l->tp_rank * fl, 0};
    MOE_TRY(add_param(l, "experts.w2", MOE_PARAM_EXPERT, act, 3, w2_local, w2_global, w2_off, 0, 1,
                      &l->w2, &l->dw2));
    for (int i = 0; i < l->num_params; i++) MOE_TRY(init_param(l, i, &l->params[i]));

    if (l->cfg.expert_bias) {
        int64_t b_shape[1] = {e};
        MOE_TRY(add_param(l, "router.expert_bias", MOE_PARAM_BUFFER, MOE_DTYPE_F32, 1, b_shape,
                          b_shape, zero, -1, -1, (void **)&l->bias, NULL));
        MOE_TRY(MOE_OPS(l->rt)->memset_zero(MOE_CTX(l->rt), l->bias, sizeof(float) * (size_t)e));
    }
    return MOE_STATUS_SUCCESS;
}

static void slot_free(moe_layer_t *l, moe_slot_t *s);

static void layer_free(moe_layer_t *l)
{
    moe_runtime_t *rt = l->rt;
    if (l->slots)
        for (int i = 0; i < l->cfg.max_microbatches; i++) slot_free(l, &l->slots[i]);
    free(l->slots);
    moe_layer_free_dev(rt, &l->wg);
    moe_layer_free_dev(rt, &l->w1);
    moe_layer_free_dev(rt, &l->w2);
    moe_layer_free_dev(rt, &l->dwg);
    moe_layer_free_dev(rt, &l->dw1);
    moe_layer_free_dev(rt, &l->dw2);
    moe_layer_free_dev(rt, &l->bias);
    moe_layer_free_dev(rt, &l->window_counts);
    free(l->host_window_counts);
    free(l->host_aux_f);
    free(l->host_tokens_per_expert);
    moe_dist_destroy(l);
    l->magic = MOE_MAGIC_DEAD;
    free(l);
}

/* The fields every rank of a pp stage must hold alike: they size the exchanges (H, F, E, K,
 * chunks, placement), set the global capacity and loss terms, or initialise the replicated
 * parameters. A rank whose own config is invalid (`local`) still joins, so the others learn. */
static moe_status_t agree_config(moe_runtime_t *rt, const moe_layer_config_t *c, moe_status_t local)
{
    moe_agree_field_t f[] = {
        moe_agree_int("hidden", c->hidden),
        moe_agree_int("ffn_hidden", c->ffn_hidden),
        moe_agree_int("num_experts", c->num_experts),
        moe_agree_int("top_k", c->top_k),
        moe_agree_int("score_fn", c->score_fn),
        moe_agree_int("renormalize", c->renormalize),
        moe_agree_f32("capacity_factor", c->capacity_factor),
        moe_agree_f32("aux_loss_coef", c->aux_loss_coef),
        moe_agree_f32("z_loss_coef", c->z_loss_coef),
        moe_agree_int("expert_bias", c->expert_bias),
        moe_agree_f32("expert_bias_rate", c->expert_bias_rate),
        moe_agree_int("placement", c->placement),
        moe_agree_int("a2a_chunks", c->a2a_chunks),
        moe_agree_f32("init_std", c->init_std),
        moe_agree_int("aux_global_batch", c->aux_global_batch),
    };
    return moe_mesh_agree(rt->mesh, MOE_MESH_STAGE, "the layer config", f,
                          (int)(sizeof f / sizeof f[0]), local);
}

moe_status_t moe_layer_create(moe_runtime_t *rt, const moe_layer_config_t *config,
                              moe_layer_t **out)
{
    return moe_layer_create_seeded(rt, config, 0, out);
}

moe_status_t moe_layer_create_seeded(moe_runtime_t *rt, const moe_layer_config_t *config,
                                     uint64_t init_stream, moe_layer_t **out)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(config != NULL, "config is NULL (hidden, ffn_hidden, num_experts and top_k "
                                  "have no defaults; start from moe_layer_config_default())");
    moe_layer_config_t cfg = moe_layer_config_default();
    MOE_TAKE_CONFIG_PREFIX(cfg, config, moe_layer_config_t,
                           offsetof(moe_layer_config_t, aux_global_batch));
    config = &cfg;
    int32_t ep = rt->mesh->size[MOE_AXIS_EP], tp = rt->mesh->size[MOE_AXIS_TP];
    moe_status_t local = validate_config(config, ep, tp);
    const moe_backend_ops_t *ops = MOE_OPS(rt);
    if (local == MOE_STATUS_SUCCESS &&
        ((ops->max_experts && config->num_experts > ops->max_experts) ||
         (ops->max_top_k && config->top_k > ops->max_top_k)))
        local = MOE_FAIL(MOE_STATUS_UNSUPPORTED,
                         "the %s backend's router serves E <= %d and K <= %d (E=%d K=%d)",
                         ops->name, ops->max_experts, ops->max_top_k, config->num_experts,
                         config->top_k);
    MOE_TRY(agree_config(rt, config, local));

    moe_layer_t *l = calloc(1, sizeof *l);
    if (!l) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "layer allocation");
    l->rt = rt;
    l->cfg = *config;
    l->cfg.struct_size = sizeof l->cfg;
    l->init_stream = init_stream;
    l->h = config->hidden;
    l->e = config->num_experts;
    l->k = config->top_k;
    l->ep_size = ep;
    l->ep_rank = rt->mesh->coord[MOE_AXIS_EP];
    l->tp_size = tp;
    l->tp_rank = rt->mesh->coord[MOE_AXIS_TP];
    l->el = l->e / ep;
    l->f_local = config->ffn_hidden / tp;
    moe_status_t st = MOE_STATUS_SUCCESS;
    l->slots = calloc((size_t)config->max_microbatches, sizeof *l->slots);
    l->host_tokens_per_expert = calloc((size_t)l->e, sizeof(int64_t));
    l->host_window_counts = calloc((size_t)l->e, sizeof(int64_t));
    l->host_aux_f = calloc((size_t)l->e, sizeof(double));
    if (!l->slots || !l->host_tokens_per_expert || !l->host_window_counts || !l->host_aux_f) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "layer slots");
        goto fail;
    }
    MOE_TRY_GOTO(st, create_params(l));
    if (l->cfg.aux_global_batch) {
        MOE_TRY_GOTO(st, moe_layer_alloc_dev(rt, sizeof(int32_t) * (size_t)l->e,
                                             (void **)&l->window_counts));
        MOE_TRY_GOTO(st, MOE_OPS(rt)->memset_zero(MOE_CTX(rt), l->window_counts,
                                                  sizeof(int32_t) * (size_t)l->e));
    }
    MOE_TRY_GOTO(st, moe_dist_create(l)); /* ep, tp or dp > 1: the distributed path */
    l->magic = MOE_MAGIC_LAYER;
    moe_runtime_adopt(rt, MOE_CHILD_LAYER);
    *out = l;
    return MOE_STATUS_SUCCESS;
fail:
    layer_free(l);
    return st;
}

moe_status_t moe_layer_destroy(moe_layer_t *layer)
{
    moe_error_clear();
    if (!layer) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(layer, MOE_MAGIC_LAYER, "layer");
    MOE_OPS(layer->rt)->synchronize(MOE_CTX(layer->rt));
    moe_runtime_disown(layer->rt, MOE_CHILD_LAYER);
    layer_free(layer);
    return MOE_STATUS_SUCCESS;
}

/* ---- saved state per microbatch -------------------------------------------------------- */

static void slot_free(moe_layer_t *l, moe_slot_t *s)
{
    moe_runtime_t *rt = l->rt;
    void **dev[] = {&s->x,
                    (void **)&s->logits,
                    (void **)&s->topk_idx,
                    (void **)&s->topk_w,
                    &s->summary,
                    (void **)&s->row_of_slot,
                    (void **)&s->slot_of_row,
                    &s->xp,
                    &s->hpre,
                    &s->act,
                    &s->out,
                    (void **)&s->window_counts};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) moe_layer_free_dev(rt, dev[i]);
    moe_dist_slot_free(l, s);
    free(s->host_summary);
    free(s->host_kept);
    free(s->host_offsets);
    memset(s, 0, sizeof *s);
}

static moe_status_t check_slot(const moe_layer_t *l, int32_t slot)
{
    MOE_CHECK_ARG(slot >= 0 && slot < l->cfg.max_microbatches,
                  "slot %d is out of range 0..%d (max_microbatches)", slot,
                  l->cfg.max_microbatches - 1);
    return MOE_STATUS_SUCCESS;
}

/* Zero the parameter gradients, the experts' too or not. */
static moe_status_t zero_param_grads(moe_layer_t *l, bool experts)
{
    for (int i = 0; i < l->num_params; i++) {
        moe_param_info_t *p = &l->params[i];
        if (!p->grad.data || (p->kind == MOE_PARAM_EXPERT && !experts)) continue;
        MOE_TRY(
            MOE_OPS(l->rt)->memset_zero(MOE_CTX(l->rt), p->grad.data, moe_tensor_bytes(&p->grad)));
    }
    return MOE_STATUS_SUCCESS;
}

/* ---- forward ------------------------------------------------------------------------------ */

/* Validate x/y (or dy/dx) against the layer: [N,H] in the compute dtype on the device. */
static moe_status_t check_activation(const moe_layer_t *l, const moe_tensor_t *t, const char *what,
                                     int64_t n)
{
    int64_t shape[2] = {n, l->h};
    return moe_tensor_check(t, what, MOE_OPS(l->rt)->compute_dtype, MOE_OPS(l->rt)->device, 2,
                            shape);
}

moe_status_t moe_layer_forward(moe_layer_t *layer, int32_t slot, const moe_tensor_t *x,
                               moe_tensor_t *y)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    MOE_TRY(check_slot(layer, slot));
    MOE_TRY(check_activation(layer, x, "x", -1));
    MOE_TRY(check_activation(layer, y, "y", x->shape[0]));
    MOE_CHECK_ARG(x->shape[0] <= INT32_MAX / layer->k,
                  "x has %lld tokens; at most %d with top_k=%d", (long long)x->shape[0],
                  INT32_MAX / layer->k, layer->k);
    moe_slot_t *s = &layer->slots[slot];
    MOE_CHECK_ARG(!s->in_use, "slot %d already holds a forward awaiting backward (or release)",
                  slot);
    moe_status_t st = layer->dist ? moe_dist_forward(layer, s, x, y)
                                  : moe_single_rank_forward(layer, s, x, y);
    if (st != MOE_STATUS_SUCCESS) {
        slot_free(layer, s);
        return st;
    }
    s->in_use = true;
    return MOE_STATUS_SUCCESS;
}

/* ---- backward ----------------------------------------------------------------------------- */

static moe_status_t backward_impl(moe_layer_t *l, moe_slot_t *s, const moe_tensor_t *dy, void *dx)
{
    /* The first backward since discard_grad: the expert GEMMs write their gradients (the
     * single-rank path issues them once over all rows; the distributed one per slice, so it
     * adds onto zeros like the small router gradient). */
    bool overwrite = l->grads_discarded && !l->dist && s->rows > 0;
    if (l->grads_discarded) MOE_TRY(zero_param_grads(l, !overwrite));
    l->grads_discarded = false;
    if (l->dist) return moe_dist_backward(l, s, dy, dx); /* collective even with n == 0 */
    return moe_single_rank_backward(l, s, dy, dx, overwrite);
}

moe_status_t moe_layer_backward(moe_layer_t *layer, int32_t slot, const moe_tensor_t *dy,
                                moe_tensor_t *dx)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    MOE_TRY(check_slot(layer, slot));
    moe_slot_t *s = &layer->slots[slot];
    MOE_CHECK_ARG(s->in_use, "slot %d holds no forward to differentiate", slot);
    MOE_TRY(check_activation(layer, dy, "dy", s->n));
    if (dx) {
        MOE_TRY(check_activation(layer, dx, "dx", s->n));
        /* the router's part of dx is written before the experts' rows are gathered from dy */
        uintptr_t a = (uintptr_t)dx->data, b = (uintptr_t)dy->data;
        size_t bytes = moe_tensor_bytes(dy);
        MOE_CHECK_ARG(bytes == 0 || (a >= b ? a - b : b - a) >= bytes,
                      "dx overlaps dy; backward needs dy intact while it writes dx");
    }

    moe_runtime_t *rt = layer->rt;
    void *dx_data = dx ? dx->data : NULL, *dx_scratch = NULL;
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!dx_data && s->n > 0) {
        size_t bytes = (size_t)s->n * (size_t)layer->h * moe_dtype_size(MOE_OPS(rt)->compute_dtype);
        MOE_TRY(moe_layer_alloc_dev(rt, bytes, &dx_scratch));
        dx_data = dx_scratch;
    }
    st = backward_impl(layer, s, dy, dx_data);
    moe_layer_free_dev(rt, &dx_scratch);
    if (st == MOE_STATUS_SUCCESS) slot_free(layer, s);
    return st;
}

moe_status_t moe_layer_release_slot(moe_layer_t *layer, int32_t slot)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    MOE_TRY(check_slot(layer, slot));
    slot_free(layer, &layer->slots[slot]);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_zero_grad(moe_layer_t *layer)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    MOE_TRY(zero_param_grads(layer, true));
    layer->grads_discarded = false;
    return moe_routing_window_open(layer);
}

moe_status_t moe_layer_discard_grad(moe_layer_t *layer)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    layer->grads_discarded = true;
    return moe_routing_window_open(layer);
}

/* ---- queries -------------------------------------------------------------------------------- */

moe_status_t moe_layer_num_params(const moe_layer_t *layer, int32_t *count)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    MOE_CHECK_ARG(count != NULL, "count is NULL");
    *count = layer->num_params;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_param(const moe_layer_t *layer, int32_t index, moe_param_info_t *info)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    MOE_CHECK_ARG(info != NULL, "info is NULL");
    MOE_CHECK_STRUCT_SIZE(info, moe_param_info_t, sizeof(moe_param_info_t));
    MOE_CHECK_ARG(index >= 0 && index < layer->num_params, "index %d is out of range 0..%d%s",
                  index, layer->num_params - 1,
                  index == layer->num_params && !layer->cfg.expert_bias
                      ? " (router.expert_bias exists only with expert_bias = 1)"
                      : "");
    *info = layer->params[index];
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_expert_id(const moe_layer_t *layer, int32_t local_expert,
                                 int32_t *global_expert)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    MOE_CHECK_ARG(global_expert != NULL, "global_expert is NULL");
    MOE_CHECK_ARG(local_expert >= 0 && local_expert < layer->el,
                  "local_expert %d is out of range 0..%d", local_expert, layer->el - 1);
    *global_expert = expert_id(layer, local_expert);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_stats(const moe_layer_t *layer, moe_layer_stats_t *stats,
                             int64_t *tokens_per_expert)
{
    MOE_ENTRY(layer, MOE_MAGIC_LAYER, "layer");
    MOE_CHECK_ARG(stats != NULL, "stats is NULL");
    MOE_CHECK_STRUCT_SIZE(stats, moe_layer_stats_t, sizeof(moe_layer_stats_t));
    *stats = layer->stats;
    stats->struct_size = sizeof *stats;
    if (tokens_per_expert)
        memcpy(tokens_per_expert, layer->host_tokens_per_expert,
               sizeof(int64_t) * (size_t)layer->e);
    return MOE_STATUS_SUCCESS;
}
