/*
 * Internals of the pipeline module shared by schedule.c and executor.c.
 * Shape legend: p stages, m microbatches, s this stage, w warm-up forwards on s.
 */
#ifndef MOE_PIPELINE_INTERNAL_H
#define MOE_PIPELINE_INTERNAL_H

#include <moe/pipeline.h>

/* Handle magics (the module's own, beside the ones in core/error.h). */
#define MOE_MAGIC_PIPE_SCHED 0x4d4f455343484431ull /* "MOESCHD1" */
#define MOE_MAGIC_PIPELINE 0x4d4f455049504531ull   /* "MOEPIPE1" */

struct moe_pipeline_schedule {
    uint64_t magic;
    int32_t stages, microbatches, stage, warmup, virtual_stages;
    int32_t count;
    moe_pipeline_action_t *actions;
};

/* The schedule without the public-entry bookkeeping (error clearing); used by the executor. */
moe_status_t moe_pipeline_schedule_build(int32_t stages, int32_t microbatches, int32_t stage,
                                         int32_t virtual_stages, moe_pipeline_schedule_t **out);
void moe_pipeline_schedule_free(moe_pipeline_schedule_t *sched);

#endif /* MOE_PIPELINE_INTERNAL_H */
