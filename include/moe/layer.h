/*
 * libmoe MoE layer: a router plus E SwiGLU experts.
 *
 * Shapes: N tokens (this rank, this microbatch), H hidden, E experts (global), K top-k,
 * F expert FFN width (global, before tensor-parallel sharding).
 *
 *   forward(slot, x[N,H]) -> y[N,H]
 *     logits = x·Wg [N,E] (fp32) -> scores s (softmax | sigmoid) -> top-k on s + bias
 *     -> weights w[t,k] (renormalised over k when enabled) -> capacity drop
 *     -> y[t] = sum_k w[t,k] * W2_e^T (silu(W1g_e^T x[t]) * (W1u_e^T x[t])),  e = idx[t,k]
 *   backward(slot, dy[N,H]) -> dx[N,H], and accumulates parameter gradients (+=).
 *
 * The layer's total loss contribution is task_loss + aux_coef * aux + z_coef * z, where
 *   aux = E * sum_e f_e * P_e
 *         f_e: fraction of the N*K selected slots routed to e before capacity drop (no
 *              gradient flows through it);
 *         P_e = mean over the N tokens of q[t,e], the normalised score: softmax: q = s (the
 *              router probability); sigmoid: q[t,e] = s[t,e] / sum_j s[t,j] (the token's E
 *              sigmoid scores scaled to sum to 1). The expert bias never enters q.
 *   z   = mean_t logsumexp(logits[t])^2
 * backward adds the gradients of the aux and z terms itself; their values are in the stats.
 * With a mesh, f_e, P_e, z, the capacity and the expert-bias loads are taken over the dense
 * group's concatenated batch (Nt tokens, see moe_layer_forward) instead of this rank's N.
 * Global-batch balancing (aux_global_batch = 1, Qwen's): f_e counts the selections of every
 * forward since the last moe_layer_zero_grad / moe_layer_discard_grad (the step's
 * microbatches) up to and including this one, over the dense group, instead of this
 * forward's alone; P_e stays the forward's. A forward's f is fixed when it runs, because a
 * 1F1B schedule runs a microbatch's backward before later microbatches are routed: the m-th
 * microbatch of a step sees the selections of microbatches 1..m, on every schedule and mesh
 * alike. Evaluation forwards inside that window count too (evaluate between steps).
 * docs/moe-layer.md gives the exact semantics.
 *
 * Microbatch slots: forward saves what backward needs under `slot` (0 .. max_microbatches-1),
 * so a pipeline can run several forwards before the matching backwards. backward frees the
 * slot; moe_layer_release_slot frees it without a backward (evaluation).
 *
 * Parameters (local shards; gradients always f32), by moe_layer_param index:
 *   0 "router.weight"      [H, E]           compute dtype; replicated over tp and ep,
 *                                            gradient reduced over ep x dp
 *   1 "experts.w1"         [E_l, H, 2, F_l] compute dtype; gate (index 0) and up (index 1)
 *                                            projections
 *   2 "experts.w2"         [E_l, F_l, H]    compute dtype; down projection
 *   3 "router.expert_bias" [E]              only when expert_bias = 1: an fp32 buffer
 *                                            (MOE_PARAM_BUFFER, no gradient) updated after
 *                                            each forward by the sign rule
 *                                            bias_e += rate * sign(mean_load - load_e),
 *                                            load_e the slots that selected e before capacity,
 *                                            mean_load = N*K/E.
 * Without expert_bias the layer has 3 parameters: moe_layer_num_params gives 3 and
 * moe_layer_param(3) fails with MOE_STATUS_INVALID_ARGUMENT.
 * E_l = E / ep local experts, F_l = F / tp.
 */
#ifndef MOE_LAYER_H
#define MOE_LAYER_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_layer moe_layer_t;

/* How global experts map to ep ranks. */
typedef enum moe_expert_placement {
    MOE_PLACEMENT_CONTIGUOUS = 0, /* rank r owns experts [r*E_l, (r+1)*E_l)     */
    MOE_PLACEMENT_ROUND_ROBIN = 1 /* rank r owns experts r, r+ep, r+2ep, ...     */
} moe_expert_placement_t;

typedef struct moe_layer_config {
    size_t struct_size;
    int64_t hidden;           /* H >= 1 */
    int64_t ffn_hidden;       /* F >= 1, divisible by tp */
    int32_t num_experts;      /* E >= 1, divisible by ep */
    int32_t top_k;            /* 1 <= K <= E */
    moe_score_fn_t score_fn;  /* default softmax */
    int32_t renormalize;      /* 1 (default): top-k weights divided by their sum */
    float capacity_factor;    /* cf <= 0 (default 0): dropless; else each expert keeps at
                                    most min(ceil(cf*N*K/E), N*K) slots (stats.capacity) */
    float aux_loss_coef;      /* default 0.01 */
    float z_loss_coef;        /* default 0.001 */
    int32_t expert_bias;      /* 1: aux-loss-free balancing bias used for selection only */
    float expert_bias_rate;   /* default 1e-3 */
    int32_t max_microbatches; /* slots in flight, default 1 */
    moe_expert_placement_t placement;
    int32_t a2a_chunks; /* dispatch/combine chunks for comm/compute overlap, default 2 */
    float init_std;     /* parameters ~ N(0, init_std^2); default 0.02 */
    /* Appended in 0.2 (a struct_size that ends before it keeps the default 0): */
    int32_t aux_global_batch; /* 1: the aux loss's f_e over the global batch (below);
                                    0 (default): over the microbatch */
} moe_layer_config_t;

MOE_API moe_layer_config_t moe_layer_config_default(void);

/* Collective over the runtime's mesh: the ranks of this pp stage compare their configs first
 * (every field but max_microbatches) and all fail with INVALID_ARGUMENT naming the field, the
 * world ranks and both values when they differ, or naming a rank whose own config is invalid.
 * Parameters are initialised from the runtime seed so that every mesh shape produces the same
 * global parameters. Tensors above 1 M elements are drawn on several host threads: the online
 * CPUs, or MOE_INIT_THREADS (at most 32); the values are the same for any count. */
MOE_API moe_status_t moe_layer_create(moe_runtime_t *rt, const moe_layer_config_t *config,
                                      moe_layer_t **out);
/* moe_layer_create with the initial values drawn from stream `init_stream` of the runtime
 * seed: the layers of one model give each its own stream (e.g. its index in the model + 1) so
 * that they start different; moe_layer_create is stream 0. Collective like it. */
MOE_API moe_status_t moe_layer_create_seeded(moe_runtime_t *rt, const moe_layer_config_t *config,
                                             uint64_t init_stream, moe_layer_t **out);
MOE_API moe_status_t moe_layer_destroy(moe_layer_t *layer);

/* [in] x [N,H] on the runtime's device in its compute dtype, N >= 0 (N may differ by rank,
 * but tp ranks must be fed the same tokens: their N is compared on every forward, and their
 * contents too with MOE_CHECK_TP_INPUTS=1 in the environment; a difference fails the forward
 * on every rank of the stage with INVALID_ARGUMENT naming the ranks).
 * [out] y [N,H], caller-allocated. Collective over tp, ep and dp (capacity, the aux and z
 * terms and the expert-bias update use counts over the ep x dp group, so every rank of it
 * calls, also with N = 0). Enqueued on the runtime's stream (CUDA); the host sees y after
 * synchronising. slot must not be in use. */
MOE_API moe_status_t moe_layer_forward(moe_layer_t *layer, int32_t slot, const moe_tensor_t *x,
                                       moe_tensor_t *y);
/* [in] dy [N,H] for the forward saved in slot. [out] dx [N,H] (may be NULL if not needed;
 * must not overlap dy, which is read after dx is first written). Accumulates into the
 * parameter gradients (the first backward after moe_layer_discard_grad writes them) and frees
 * the slot. Collective like forward. */
MOE_API moe_status_t moe_layer_backward(moe_layer_t *layer, int32_t slot, const moe_tensor_t *dy,
                                        moe_tensor_t *dx);
/* Drop the state saved by forward in slot without a backward. */
MOE_API moe_status_t moe_layer_release_slot(moe_layer_t *layer, int32_t slot);

/* Set every parameter gradient to zero (start of a global batch). Enqueued (CUDA). */
MOE_API moe_status_t moe_layer_zero_grad(moe_layer_t *layer);
/* The cheaper start of a global batch (PyTorch's zero_grad(set_to_none=True)): the gradients
 * are marked zero without touching them, and the next backward writes them instead of adding,
 * which saves reading and zeroing the f32 expert gradients (twice their size in traffic a
 * batch). Until that backward completes their contents are undefined: use it when the layer
 * runs a backward before anything reads its gradients (a layer that sees no tokens still
 * does, N = 0). Further backwards accumulate as usual; zero_grad cancels the mark. */
MOE_API moe_status_t moe_layer_discard_grad(moe_layer_t *layer);

/* ---- parameters ---------------------------------------------------------------------------- */

typedef enum moe_param_kind {
    MOE_PARAM_DENSE = 0,  /* replicated over ep: gradients reduced over ep x dp          */
    MOE_PARAM_EXPERT = 1, /* sharded over ep: gradients reduced over expert-data-parallel */
    MOE_PARAM_BUFFER = 2  /* state without gradient (expert bias)                         */
} moe_param_kind_t;

typedef struct moe_param_info {
    size_t struct_size;
    const char *name; /* stable, owned by the layer */
    moe_param_kind_t kind;
    moe_tensor_t value;                 /* this rank's shard */
    moe_tensor_t grad;                  /* same shape, always f32; data NULL for buffers */
    int64_t global_shape[MOE_MAX_DIMS]; /* the unsharded shape */
    int64_t shard_offset[MOE_MAX_DIMS]; /* where this shard starts in the global tensor;
                                            along expert_dim use moe_layer_expert_id, since
                                            round-robin placement is not a contiguous slice */
    int32_t expert_dim;                 /* dimension indexed by expert, or -1 */
    int32_t tp_dim;                     /* dimension split over tp, or -1 */
} moe_param_info_t;

MOE_API moe_status_t moe_layer_num_params(const moe_layer_t *layer, int32_t *count);
/* [in] index 0..count-1 [out] info (set info->struct_size first). */
MOE_API moe_status_t moe_layer_param(const moe_layer_t *layer, int32_t index,
                                     moe_param_info_t *info);
/* The global expert id of local expert `local_expert` on this rank (placement applied). */
MOE_API moe_status_t moe_layer_expert_id(const moe_layer_t *layer, int32_t local_expert,
                                         int32_t *global_expert);

/* ---- statistics of the most recent forward -------------------------------------------------- */

typedef struct moe_layer_stats {
    size_t struct_size;
    int64_t tokens;        /* N: tokens this rank routed in that forward */
    int64_t slots;         /* N * K */
    int64_t dropped_slots; /* slots refused by capacity */
    double dropped_ratio;  /* dropped_slots / slots */
    double max_load;       /* max over experts of accepted slots */
    double mean_load;      /* accepted slots / E */
    double entropy;        /* mean over tokens of -sum_e q log q (nats; q: see top) */
    double aux_loss;       /* unscaled aux value (see top of file) */
    double z_loss;         /* unscaled z value */
    int64_t capacity;      /* slots each expert may keep, as the forward applied it:
                                  min(ceil(cf*N*K/E), N*K), cf = capacity_factor, N -> Nt
                                  with a mesh (any value >= N drops nothing); -1 when
                                  dropless (cf <= 0) */
} moe_layer_stats_t;

/* [out] stats (set struct_size first) [out] tokens_per_expert: E entries of accepted slots
 * per expert, or NULL. Reflects the last forward on this layer (any slot). With a mesh,
 * aux_loss, z_loss, entropy and capacity are global over the ep x dp group; the token, slot,
 * drop and load fields are this rank's. */
MOE_API moe_status_t moe_layer_stats(const moe_layer_t *layer, moe_layer_stats_t *stats,
                                     int64_t *tokens_per_expert);

#ifdef __cplusplus
}
#endif
#endif /* MOE_LAYER_H */
