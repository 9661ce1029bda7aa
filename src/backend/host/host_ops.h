/* The host backend's MoE ops (plain C, fp32 data, fp64 accumulation where sums are long). */
#ifndef MOE_HOST_OPS_H
#define MOE_HOST_OPS_H

#include "backend/backend.h"

moe_status_t moe_host_router_forward(void *ctx, const moe_router_fwd_t *a);
moe_status_t moe_host_router_backward(void *ctx, const moe_router_bwd_t *a);
moe_status_t moe_host_expert_bias_step(void *ctx, float *bias, const int32_t *counts, int32_t e,
                                       int64_t slots, float rate);
moe_status_t moe_host_accumulate_counts(void *ctx, int32_t *acc, const int32_t *counts,
                                        int32_t *out, int32_t e);
moe_status_t moe_host_plan(void *ctx, const moe_plan_t *a);
moe_status_t moe_host_pad_plan(void *ctx, const moe_pad_plan_t *a);
moe_status_t moe_host_gather_rows(void *ctx, void *dst, const void *src, const int32_t *slot_of_row,
                                  int32_t k, const float *scale, int64_t rows, int64_t h);
moe_status_t moe_host_combine(void *ctx, void *dst, const void *src, const int32_t *row_of_slot,
                              const float *w, int64_t n, int32_t k, int64_t h, bool accumulate);
moe_status_t moe_host_combine_weight_grad(void *ctx, float *dw, const void *dy, const void *rows,
                                          const int32_t *row_of_slot, int64_t n, int32_t k,
                                          int64_t h);
moe_status_t moe_host_experts_forward(void *ctx, const moe_experts_t *a);
moe_status_t moe_host_experts_backward(void *ctx, const moe_experts_t *a);
moe_status_t moe_host_adamw_update(void *ctx, const moe_adamw_update_t *a);

#endif /* MOE_HOST_OPS_H */
