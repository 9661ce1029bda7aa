/*
 * The MoE layer's state: the layer handle and what one forward saves for its backward. Shared
 * by layer.c (which creates and frees both), the two forward/backward paths (single_rank.c,
 * expert_parallel.c) and routing.c; declares no functions.
 *
 * Shapes: N tokens, H hidden, E experts, El local experts, K top-k, Fl = F / tp, R rows
 * processed by the local experts.
 */
#ifndef MOE_LAYER_INTERNAL_H
#define MOE_LAYER_INTERNAL_H

#include <moe/layer.h>

#include "runtime/runtime.h"

/* What one forward saves for its backward. Device pointers unless named host_*. */
typedef struct moe_slot {
    bool in_use;
    int64_t n;         /* tokens */
    int64_t rows;      /* R (filler rows included when the layout is padded) */
    void *x;           /* act [N,H] copy of the input */
    float *logits;     /* f32 [N,E] */
    int32_t *topk_idx; /* i32 [N,K] */
    float *topk_w;     /* f32 [N,K] */
    /* The routing summary, one device block so that one copy brings it to the host:
     * i32 counts[E] | f32 score_mean[E] | f32 router_stats[2] | i32 kept[E]; the four
     * pointers below point into it. */
    void *summary;
    void *host_summary; /* host copy of it */
    int32_t *counts;    /* selected per expert, before capacity */
    float *score_mean;
    float *router_stats;
    int32_t *kept;
    int32_t *row_of_slot; /* i32 [N,K] */
    int32_t *slot_of_row; /* i32 [N*K], or [El*stride] once padded (-1: filler) */
    int64_t *host_kept;   /* host [E] */
    /* Global-batch balancing (aux_global_batch): the window's selections per expert as this
     * forward left them, which the backward's aux gradient takes f_e from, and this
     * forward's share of the window's slots (1 without the option). */
    int32_t *window_counts; /* i32 [E], or NULL */
    float aux_f_scale;
    int64_t *host_offsets;       /* host [El+1] row offsets of the local experts (single-rank) */
    void *xp, *hpre, *act, *out; /* act [R,H], [R,2,Fl], [R,Fl], [R,H] */
    struct moe_dist_slot *dist;  /* the distributed path's saved state, or NULL */
} moe_slot_t;

struct moe_layer {
    uint64_t magic;
    moe_runtime_t *rt;
    moe_layer_config_t cfg;
    uint64_t init_stream; /* the stream of the runtime seed its initial values come from */
    int64_t h, f_local;
    int32_t e, el, k;
    int32_t ep_rank, ep_size, tp_rank, tp_size;

    void *wg, *w1, *w2;     /* act [H,E], [El,H,2,Fl], [El,Fl,H] */
    float *dwg, *dw1, *dw2; /* f32, same shapes */
    bool grads_discarded;   /* moe_layer_discard_grad: the next backward writes them */
    float *bias;            /* f32 [E] device, or NULL when expert_bias is off */
    /* Global-batch balancing's window (aux_global_batch; docs/moe-layer.md): the selections
     * per expert of every forward since zero_grad / discard_grad, on the device (for the
     * backward, with no copy to the host) and on the host (for the aux value). */
    int32_t *window_counts;      /* i32 [E] device, or NULL */
    int64_t *host_window_counts; /* [E] */
    int64_t window_slots;
    double *host_aux_f; /* [E] scratch: the forward's f_e */

    moe_param_info_t params[4];
    int32_t num_params;

    moe_slot_t *slots; /* [max_microbatches] */

    moe_layer_stats_t stats;         /* last forward */
    int64_t *host_tokens_per_expert; /* [E] accepted slots, last forward */
    struct moe_dist *dist;           /* distributed state (expert_parallel.c); NULL: single rank */
};

#endif /* MOE_LAYER_INTERNAL_H */
