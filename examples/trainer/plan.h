/*
 * The parallel plan: how the model and the batch map onto the 4D mesh, and one training step
 * through the library's 1F1B executor.
 *
 *   pp  the L blocks split over stages (model.h), m microbatches through 1F1B (interleaved
 *       with train.virtual_stages > 1); activations [N,H] cross stage boundaries.
 *   ep  the MoE layers' experts sharded over ep (libmoe's all-to-all); the ep ranks of a stage
 *       hold different sequences, like dp ranks: the batch is split over the ep x dp data
 *       ranks, data rank = ep + EP * dp, and dense gradients are averaged over that group
 *       (moe_adamw_add_param with MOE_PARAM_DENSE), expert gradients over dp.
 *   tp  the experts' FFN width split over tp inside the layer; attention and the other dense
 *       parts are replicated over tp (each tp rank computes them on the same sequences).
 *
 * Gradient scale: the optimizer averages dense gradients over the D = EP x DP data ranks,
 * while the MoE layer's aux and z gradients on each rank are already its share of the whole
 * group's batch terms. So each rank scales its cross-entropy gradient by 1/D (the gradient of
 * the global batch's mean) and the step's grad_scale by D: the update is then the one a single
 * rank makes on the global batch, on every mesh.
 *
 * Sequence i of microbatch j on data rank r is sequence j*(B/m) + r*S + i of the global batch
 * (S = B / (m * data ranks)), so microbatch j holds the same sequences on every mesh and the
 * MoE layer's batch-wide terms (aux loss, z loss) see the same tokens.
 */
#ifndef TRAINER_PLAN_H
#define TRAINER_PLAN_H

#include <stdint.h>

#include <moe/moe.h>

#include "config.h"
#include "data.h"
#include "model.h"

typedef struct plan {
    int32_t world_rank, world;
    int32_t tp_rank, ep_rank, dp_rank, pp_rank;
    int32_t data_rank, data_ranks; /* ep + EP * dp, EP * DP */
    int64_t seqs;                  /* S: sequences per microbatch on this rank */
} plan_t;

/* Per-step routing statistics of every MoE layer of the model (all stages), summed over
 * microbatches on each rank and over ranks by trainer_gather_stats. */
typedef struct layer_stats {
    double *counts;                              /* [L][E] accepted slots per expert */
    double *aux, *z, *entropy, *dropped, *slots; /* [L] */
} layer_stats_t;

typedef struct phase_times {
    double forward, backward, loss, optimizer, pipeline_wait, schedule;
    double moe_forward, moe_backward; /* the MoE layers' share of forward and backward */
    /* the step's time on this rank minus its time blocked waiting for peers
     * (moe_runtime_wait_stats): its own share, which tells a slow rank (docs/elastic.md) */
    double busy;
} phase_times_t;

typedef struct trainer {
    const trainer_config_t *cfg;
    const corpus_t *corpus;
    moe_runtime_t *rt;
    plan_t plan;
    model_t *model;
    moe_adamw_t *opt;
    moe_pipeline_t *pipe;
    int64_t step; /* the batch being run: 1-based training step */
    int eval;     /* 1: evaluation batch (no gradients, no update) */
    int64_t eval_batch;
    uint8_t *tokens, *targets;
    layer_stats_t stats;
    phase_times_t times;
    double slow_s; /* test.slow_ms on the rank of test.slow_slot: slept in every step */
} trainer_t;

/* Runtime (with the mesh), model, optimizer and pipeline. Collective. Returns 0 on success. */
int trainer_setup(trainer_t *t, const trainer_config_t *c, const corpus_t *corpus);
void trainer_teardown(trainer_t *t);

/* Training step t->step + 1: one global batch and one optimizer update; t->step advances.
 * [out] loss: mean cross-entropy (nats per byte) over the global batch, on every rank.
 * Collective. */
moe_status_t trainer_train_step(trainer_t *t, double *loss);
/* Mean validation cross-entropy over data.eval_batches batches, on every rank. Collective. */
moe_status_t trainer_evaluate(trainer_t *t, double *loss);
/* Sum this step's layer statistics over the ranks (every rank gets the totals). Collective. */
void trainer_gather_stats(trainer_t *t);

#endif /* TRAINER_PLAN_H */
