/*
 * The compute-backend interface: a small table of function pointers plus a context, with two
 * implementations of identical meaning: host/ (plain C, fp32, the reference) and cuda/
 * (kernels/ + cuBLAS, bf16 activations and weights, fp32 router math).
 *
 * Shape legend: N tokens, H hidden, E experts (router: global), El local experts,
 * K top-k, F expert FFN width on this rank (F/tp), R permuted rows (kept slots).
 *
 * Memory: "act" pointers are in the backend's compute dtype (f32 host, bf16 CUDA) on the
 * backend's device; f32/i32 pointers are on the device too unless named `host_*`.
 * Parameter gradients are f32 on every backend (accumulated over microbatches without bf16
 * rounding); parameters themselves are in the compute dtype, with f32 masters in AdamW.
 * Ordering: ops are enqueued in call order (CUDA: on the backend's current stream); `copy`,
 * `plan` and `synchronize` block the host. Every op validates nothing the layer already
 * validated: the layer checks user input, ops trust the layer.
 *
 * Determinism: every op must give bitwise-identical results for identical inputs when the
 * runtime is deterministic (fixed reduction orders, no float atomics).
 */
#ifndef MOE_BACKEND_H
#define MOE_BACKEND_H

#include <stdbool.h>
#include <moe/core.h>

#include "core/log.h"

/* ---- op arguments ------------------------------------------------------------------------- */

/* Router forward: logits = x·wg, scores, top-k selection on (score + bias), weights. */
typedef struct moe_router_fwd {
    int64_t n, h;
    int32_t e, k;
    moe_score_fn_t score_fn;
    bool renormalize;
    const void *x;     /* act [N,H] */
    const void *wg;    /* act [H,E] */
    const float *bias; /* f32 [E] selection bias, or NULL */
    /* outputs */
    float *logits;     /* f32 [N,E], saved for backward */
    int32_t *topk_idx; /* i32 [N,K] experts, in descending (score + bias) order; ties
                                broken towards the lower expert index */
    float *topk_w;     /* f32 [N,K] combine weights (renormalised if asked) */
    int32_t *counts;   /* i32 [E] selected slots per expert (before capacity) */
    float *score_mean; /* f32 [E] P_e: mean over tokens of the normalised score */
    float *stats;      /* f32 [2]: mean_t lse_t^2 (z loss), mean_t entropy of normalised
                                scores */
} moe_router_fwd_t;

/* Router backward: from d(topk_w) and the loss coefficients to dlogits, then dx and dwg. */
typedef struct moe_router_bwd {
    int64_t n, h;
    int32_t e, k;
    moe_score_fn_t score_fn;
    bool renormalize;
    const void *x;           /* act [N,H] */
    const void *wg;          /* act [H,E] */
    const float *logits;     /* f32 [N,E] from forward */
    const int32_t *topk_idx; /* i32 [N,K] */
    const float *topk_w;     /* f32 [N,K] */
    const float *d_topk_w;   /* f32 [N,K] (0 for dropped slots) */
    const int32_t *counts;   /* i32 [E] from forward (aux f_e = counts / (N*K)) */
    float aux_coef;          /* multiplies d aux / d scores; 0 disables */
    float z_coef;            /* multiplies d z / d logits; 0 disables */
    float *dlogits;          /* f32 [N,E] scratch */
    void *dx;                /* act [N,H]: dx += dlogits · wg^T (= when overwrite_dx) */
    float *dwg;              /* f32 [H,E]: dwg += x^T · dlogits */
    bool overwrite_dx;       /* the first writer of dx: write instead of add (no read) */
} moe_router_bwd_t;

/* Dispatch plan: capacity drop and the stable counting sort of (token, k) slots by expert.
 * Slot s = t*K + k. Expert e keeps its first capacity - first[e] slots in slot order (the
 * distributed layer's global order puts other ranks' first[e] selections ahead of these);
 * rows are laid out expert by expert in row_order, each expert's in slot order. */
typedef struct moe_plan {
    int64_t n;
    int32_t e, k;
    int64_t capacity;         /* < 0: dropless */
    const int32_t *topk_idx;  /* i32 [N,K] */
    const int32_t *first;     /* i32 [E] (0 <= first[e] <= capacity), or NULL: zeros */
    const int32_t *row_order; /* i32 [E] a permutation of the experts, or NULL: 0..E-1 */
    /* outputs */
    int32_t *row_of_slot; /* i32 [N,K] row in the permuted buffer, -1 if dropped */
    int32_t *slot_of_row; /* i32 [N*K] slot that fills each row (first R entries valid) */
    int32_t *kept;        /* i32 [E] kept slots per expert */
    /* The plan ends in the layer's one device->host synchronisation, which brings the
     * routing results with it: summary_bytes at `summary` (device, `kept` among them) are
     * copied to host_summary. */
    const void *summary;
    size_t summary_bytes;
    void *host_summary;
} moe_plan_t;

/* A plan re-laid with `stride` rows per expert (stride >= every kept count) so that all
 * experts have equal row counts and their GEMMs can run batched: expert e's rows move from
 * [offset_e, offset_e + kept_e) to [e*stride, e*stride + kept_e); the rest of its block is
 * filler (slot -1: gathered as zeros, never combined, so it adds nothing to any gradient). */
typedef struct moe_pad_plan {
    int64_t n;
    int32_t e, k;
    int64_t stride;
    const int32_t *topk_idx;     /* i32 [N,K] */
    const int32_t *kept;         /* i32 [E] the plan's */
    const int32_t *slot_of_row;  /* i32 [R] the plan's */
    int32_t *row_of_slot;        /* i32 [N,K] the plan's, rewritten in place */
    int32_t *padded_slot_of_row; /* i32 [E*stride] */
} moe_pad_plan_t;

/* Expert FFN (SwiGLU) over El experts with variable row counts.
 *   hpre[r] = xp[r] · w1[e]      ([R,2,F]: gate at [:,0,:], up at [:,1,:])
 *   act[r]  = silu(gate) * up    ([R,F])
 *   out[r]  = act[r] · w2[e]     ([R,H])
 * Rows of expert e are [offsets[e], offsets[e+1]) of the host offsets. */
typedef struct moe_experts {
    int64_t h, f;
    int32_t el;
    const int64_t *host_offsets; /* host i64 [El+1] */
    const void *w1;              /* act [El,H,2,F] */
    const void *w2;              /* act [El,F,H] */
    const void *xp;              /* act [R,H] */
    void *hpre;                  /* act [R,2,F] forward output, saved */
    void *act;                   /* act [R,F]   forward output, saved */
    void *out;                   /* act [R,H]   forward output */
    /* backward only */
    const void *d_out; /* act [R,H] */
    void *d_xp;        /* act [R,H]   written (not accumulated) */
    float *dw1;        /* f32 [El,H,2,F] += (= with overwrite_grads) */
    float *dw2;        /* f32 [El,F,H]   += (= with overwrite_grads) */
    void *scratch;     /* act [R,3,F]: backward's d_act and d_hpre */
    /* dw1/dw2 are written, not added to, and experts without rows get zeros: the layer's
     * first backward after moe_layer_discard_grad skips reading (and zeroing) them */
    bool overwrite_grads;
} moe_experts_t;

/* One parameter tensor of an AdamW step: n elements. */
typedef struct moe_adamw_tensor {
    int64_t n;
    float *master, *m, *v; /* f32 [n] */
    void *param;           /* act [n] receives the updated master (rounded) */
    const float *grad;     /* f32 [n] */
} moe_adamw_tensor_t;

/* One AdamW step over a list of tensors (see moe/optim.h for the formula): one pass over
 * their memory, each element's arithmetic the host twin's, the same for every tensor. */
typedef struct moe_adamw_update {
    float lr, beta1, beta2, eps, weight_decay, grad_scale;
    int64_t step;                      /* 1-based, for bias correction */
    const moe_adamw_tensor_t *tensors; /* host array [count] */
    int32_t count;
} moe_adamw_update_t;

/* ---- the table ------------------------------------------------------------------------------ */

typedef struct moe_backend_ops {
    const char *name;
    moe_backend_kind_t kind;
    moe_dtype_t compute_dtype;
    moe_device_kind_t device;
    /* capabilities checked when a layer is created: the largest E and K the router
     * serves (0: no limit) */
    int32_t max_experts, max_top_k;

    void (*destroy)(void *ctx);

    /* memory on the backend's device; alloc of 0 bytes returns NULL and success */
    moe_status_t (*alloc)(void *ctx, size_t bytes, void **out);
    void (*free)(void *ctx, void *p);
    /* page-locked host memory (host backend: ordinary aligned memory) */
    moe_status_t (*alloc_pinned)(void *ctx, size_t bytes, void **out);
    void (*free_pinned)(void *ctx, void *p);
    moe_status_t (*memset_zero)(void *ctx, void *p, size_t bytes);
    /* blocking copy of bytes between any two memories (host, pinned or device) */
    moe_status_t (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
    /* device-to-device copy, enqueued like the other ops (does not block) */
    moe_status_t (*copy_device)(void *ctx, void *dst, const void *src, size_t bytes);
    moe_status_t (*synchronize)(void *ctx);
    /* the stream ops are enqueued on (CUDA), or ignored */
    moe_status_t (*set_stream)(void *ctx, void *stream);
    /* the stream ops are enqueued on now (a cudaStream_t), NULL on the host: NCCL orders
     * its operations after it with an event */
    void *(*stream)(void *ctx);

    /* Snapshot copies (the checkpointer), optional: NULL on the host backend, where the
     * checkpointer copies host memory on a thread of its own. The copies run on a copy stream
     * of their own, so that the work enqueued after them overlaps them.
     *   snapshot_begin  the copy stream waits for the work enqueued so far (the host does not)
     *   snapshot_copy   device -> pinned copy of bytes, enqueued on the copy stream
     *   snapshot_mark   *event (created when NULL) marks the copies enqueued so far
     *   event_wait      blocks the calling thread (any thread) until the event's copies are
     *                   done; their failure is returned
     *   event_fence     work enqueued from now on waits for the event's copies (no host wait)
     *   event_destroy   (an event still pending is released once it completes) */
    moe_status_t (*snapshot_begin)(void *ctx);
    moe_status_t (*snapshot_copy)(void *ctx, void *dst, const void *src, size_t bytes);
    moe_status_t (*snapshot_mark)(void *ctx, void **event);
    moe_status_t (*event_wait)(void *ctx, void *event);
    moe_status_t (*event_fence)(void *ctx, void *event);
    void (*event_destroy)(void *ctx, void *event);

    /* element-wise conversion of n values between the compute dtype and f32 */
    moe_status_t (*act_to_f32)(void *ctx, float *dst, const void *src, int64_t n);
    moe_status_t (*f32_to_act)(void *ctx, void *dst, const float *src, int64_t n);

    /* ---- MoE ops ---- */
    moe_status_t (*router_forward)(void *ctx, const moe_router_fwd_t *a);
    moe_status_t (*router_backward)(void *ctx, const moe_router_bwd_t *a);
    /* The expert-bias balancing rule, on the device copy (the state): with mean = slots / E,
     * bias[j] += rate where counts[j] < mean, -= rate where counts[j] > mean. */
    moe_status_t (*expert_bias_step)(void *ctx, float *bias, const int32_t *counts, int32_t e,
                                     int64_t slots, float rate);
    /* Global-batch balancing's running selections (i32 [E] each): acc[j] += counts[j], then
     * out[j] = acc[j], the window's counts as this forward saw them. */
    moe_status_t (*accumulate_counts)(void *ctx, int32_t *acc, const int32_t *counts, int32_t *out,
                                      int32_t e);
    moe_status_t (*plan)(void *ctx, const moe_plan_t *a);
    /* Rows per expert of a padded layout that suits this backend's expert GEMMs better than
     * the compact one, for these kept counts ([El]); 0 keeps the compact layout. NULL: never. */
    int64_t (*expert_row_stride)(void *ctx, int32_t el, const int64_t *kept);
    moe_status_t (*pad_plan)(void *ctx, const moe_pad_plan_t *a);
    /* dst[r,:] = src[slot_of_row[r] / K, :] * (scale ? scale[slot_of_row[r]] : 1), r < rows;
     * zeros where slot_of_row[r] < 0 */
    moe_status_t (*gather_rows)(void *ctx, void *dst, const void *src, const int32_t *slot_of_row,
                                int32_t k, const float *scale, int64_t rows, int64_t h);
    /* dst[t,:] = sum_k (w ? w[t,k] : 1) * src[row_of_slot[t,k], :] over kept slots (no
     * atomics); tokens with no kept slot get 0. With accumulate, dst[t,:] += the same (one
     * rounding, dst first). Serves unpermute and permute's backward. */
    moe_status_t (*combine)(void *ctx, void *dst, const void *src, const int32_t *row_of_slot,
                            const float *w, int64_t n, int32_t k, int64_t h, bool accumulate);
    /* dw[t,k] = <dy[t,:], rows[row_of_slot[t,k], :]> for kept slots, 0 for dropped ones */
    moe_status_t (*combine_weight_grad)(void *ctx, float *dw, const void *dy, const void *rows,
                                        const int32_t *row_of_slot, int64_t n, int32_t k,
                                        int64_t h);
    moe_status_t (*experts_forward)(void *ctx, const moe_experts_t *a);
    moe_status_t (*experts_backward)(void *ctx, const moe_experts_t *a);
    moe_status_t (*adamw_update)(void *ctx, const moe_adamw_update_t *a);
    /* *out = sum of x[t][i]^2 over the count tensors (a host array of pointers to n[t] f32
     * values on the backend's device), accumulated in fp64 in an order fixed by the sizes
     * alone (the same result run to run; the two backends' orders differ, so their results
     * may differ in the last bits). Blocking: *out is set on return, after one wait. The
     * gradient norm for clipping. */
    moe_status_t (*sum_squares)(void *ctx, const float *const *x, const int64_t *n, int32_t count,
                                double *out);
} moe_backend_ops_t;

typedef struct moe_backend {
    const moe_backend_ops_t *ops;
    void *ctx;
} moe_backend_t;

typedef struct moe_backend_params {
    int32_t device_index; /* CUDA: resolved ordinal */
    bool deterministic;
    const moe_logger_t *logger;
} moe_backend_params_t;

moe_status_t moe_backend_host_create(const moe_backend_params_t *p, moe_backend_t *out);
/* Returns UNSUPPORTED when libmoe was built without CUDA or no device is visible. */
moe_status_t moe_backend_cuda_create(const moe_backend_params_t *p, moe_backend_t *out);
/* Number of visible CUDA devices: 0 with no driver or no device, -1 in a build without CUDA
 * (the runtime names which of the two in its message). */
int moe_backend_cuda_device_count(void);

#endif /* MOE_BACKEND_H */
