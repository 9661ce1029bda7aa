/*
 * The memory plan: what one rank of a configuration will hold, counted from the config alone
 * before anything is allocated (docs/trainer.md, "The memory plan"). `moe_train --plan`
 * prints it; every run checks it at start-up against the memory the rank can have and
 * refuses a configuration that does not fit, naming the largest term and the knob that
 * shrinks it.
 *
 * Terms, per rank of pipeline stage s (bytes; a = 4 on the host, 2 on CUDA):
 *   parameters   the stage's dense parameters and its MoE layers' local shards, a each
 *   gradients    4 per parameter (always f32)
 *   optimizer    12 per parameter: AdamW's f32 master, first and second moments
 *   activations  the dense blocks' saved activations (the model keeps a set for each of the
 *                m microbatches) and the backend's workspaces
 *   moe_saved    the MoE layers' saved routing and expert rows for the microbatches 1F1B
 *                keeps in flight on stage s (min(m, pp - s); interleaved: min(m v, pp v)),
 *                at the dropless bound: N K rows a layer, ep N K received with ep > 1
 *   moe_backward one layer's backward temporaries at the same bound
 *   pipeline     the stage-boundary buffers, 2 m activations [N,H]
 *   ckpt_staging with ckpt.dir: the state's copy in (pinned) host memory, at most the
 *                checkpointer's pinned budget (2 GiB); host memory on either backend
 *   process      the host backend: this process's resident memory before the model
 *                (libraries, MPI, the corpus), measured; CUDA: the context and cuBLAS, fixed
 */
#ifndef TRAINER_MEMPLAN_H
#define TRAINER_MEMPLAN_H

#include <stdio.h>

#include "config.h"

#define MEMPLAN_TERMS 10

typedef struct memplan_term {
    const char *name;
    double bytes;
    const char *knob; /* what shrinks it */
} memplan_term_t;

typedef struct memplan {
    int32_t stage;
    int64_t params;    /* parameter count on this rank */
    int64_t in_flight; /* microbatches whose MoE state is held at once */
    memplan_term_t term[MEMPLAN_TERMS];
    int nterms;
    double device_total; /* the terms on the backend's device */
    double host_total;   /* ckpt staging (and, on the host backend, everything) */
    double available;    /* for this rank: the device's free memory (CUDA) or the
                                  node's available memory (host), shared by its ranks; 0: unknown */
} memplan_t;

/* The plan of a rank of pipeline stage `stage`; process_bytes: the process's resident memory
 * now (host backend: counted as a term). */
void memplan_compute(const trainer_config_t *c, int32_t stage, double process_bytes, memplan_t *p);
/* Print the plan (rank 0's view of its stage). */
void memplan_print(FILE *out, const memplan_t *p);
/* Before any allocation, on every rank (collective over MPI_COMM_WORLD): compute this rank's
 * plan, print rank 0's (with --plan, every stage's first rank's) and check it against the
 * memory this rank can have. Returns 0 to go on, 1 when --plan asked only for the plan, 2 when
 * the configuration does not fit (rank 0 names the largest term and its knob). */
int memplan_gate(const trainer_config_t *c, int rank, int world);
/* The rank's peak use so far: the host's peak resident memory, or on CUDA the device memory
 * in use now. */
double memplan_measured(const trainer_config_t *c);

#endif /* TRAINER_MEMPLAN_H */
