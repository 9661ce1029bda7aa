/*
 * Internals of the pipeline module shared by schedule.c and executor.c.
 * Shape legend: p stages, m microbatches, s this stage, w warm-up forwards on s.
 */
#ifndef MOE_PIPELINE_INTERNAL_H
#define MOE_PIPELINE_INTERNAL_H

#include <moe/pipeline.h>
#include <stdbool.h>

struct moe_pipeline_schedule {
    uint64_t magic;
    int32_t stages, microbatches, stage, warmup, virtual_stages;
    int32_t count;
    moe_pipeline_action_t *actions;
    /* Issue order of the transfers (indices into actions), for communicators that run their
     * operations in call order on one stream (NCCL): NULL until moe_pipeline_issue_order. */
    int32_t *issue;
    int32_t nissue;
};

/* The schedule without the public-entry bookkeeping (error clearing); used by the executor. */
moe_status_t moe_pipeline_schedule_build(int32_t stages, int32_t microbatches, int32_t stage,
                                         int32_t virtual_stages, moe_pipeline_schedule_t **out);
void moe_pipeline_schedule_free(moe_pipeline_schedule_t *sched);

/* Fill sched->issue: this stage's transfers ordered by a key every stage computes alike for
 * the same message: (tick at which it is sent in a unit-cost run of all stages, sender, kind,
 * receiving unit). Issuing every stage's transfers in key order (a receive at once, a send
 * once its compute is done) makes the operations on each pair of stages line up in the same
 * order on both sides, so even transfers that block their stream until the peer reaches the
 * partner operation (NCCL on one stream, messages beyond its buffers) cannot deadlock: the
 * pending operation with the smallest key always has both ends at the head of their streams.
 * The host never waits for a receive that is not issued: a receive is consumed after its
 * send tick, and every send keyed before it was computed earlier on this stage. */
moe_status_t moe_pipeline_issue_order(moe_pipeline_schedule_t *sched);

/* ---- transfer actions: shared by the issue order and the executor's tags, which must agree */

static inline bool moe_pipe_is_send(moe_pipeline_op_t op)
{
    return op == MOE_PIPELINE_SEND_ACT || op == MOE_PIPELINE_SEND_GRAD;
}

static inline bool moe_pipe_is_recv(moe_pipeline_op_t op)
{
    return op == MOE_PIPELINE_RECV_ACT || op == MOE_PIPELINE_RECV_GRAD;
}

/* 0 for activations, 1 for gradients. */
static inline int32_t moe_pipe_kind(moe_pipeline_op_t op)
{
    return op == MOE_PIPELINE_SEND_GRAD || op == MOE_PIPELINE_RECV_GRAD;
}

/* The receiving unit (chunk * m + microbatch) of a transfer action on stage sc->stage: an
 * activation sent by (chunk c, stage p-1) arrives at (chunk c+1, stage 0). */
static inline int32_t moe_pipe_dest_unit(const moe_pipeline_schedule_t *sc,
                                         const moe_pipeline_action_t *a)
{
    int32_t chunk = a->chunk;
    if (a->op == MOE_PIPELINE_SEND_ACT && sc->stage == sc->stages - 1) chunk++;
    if (a->op == MOE_PIPELINE_SEND_GRAD && sc->stage == 0) chunk--;
    return chunk * sc->microbatches + a->microbatch;
}

#endif /* MOE_PIPELINE_INTERNAL_H */
