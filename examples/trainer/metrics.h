/*
 * The trainer's reporting on rank 0: one progress line per log.progress_every steps, one
 * JSON object per step in the log.metrics file (docs/trainer.md lists the fields), and the
 * final summary.
 *
 * MFU = model FLOPs of the step (model_flops_per_token x tokens) / step time / peak, with
 * peak = log.peak_tflops x ranks (default per backend: 774 TFLOP/s, the H200's measured bf16
 * GEMM rate, on CUDA; 0.05 TFLOP/s, a nominal CPU core, on the host).
 */
#ifndef TRAINER_METRICS_H
#define TRAINER_METRICS_H

#include <stdio.h>

#include "plan.h"

typedef struct step_report {
    int64_t step;
    double loss, val_loss; /* nats per byte; val_loss < 0: not evaluated this step */
    double step_s, ckpt_stall_s;
    float lr;
    double grad_norm;
    phase_times_t times; /* the training step's, on rank 0 (not the evaluation's) */
} step_report_t;

typedef struct metrics {
    FILE *jsonl;       /* NULL: no file */
    double peak_flops; /* of the whole job */
    double flops_per_token, tokens_per_step;
    double unigram_bits;
    double *busy; /* [world] each rank's busy time of the step (rank 0); NULL without a file */
    int world;
} metrics_t;

/* Rank 0 opens the file (appending on resume). Returns 0 on success. */
int metrics_open(metrics_t *mx, const trainer_t *t, double unigram_bits);
/* Gathers every rank's busy time of the step (phase_times_t.busy) to rank 0, for the step's
 * row. Collective; nothing to do when no metrics file is written (log.metrics is the same on
 * every rank). */
void metrics_busy(metrics_t *mx, double busy_s);
/* Progress line and JSON line of one step (rank 0; other ranks ignore the call). The layer
 * statistics must be gathered (trainer_gather_stats). */
void metrics_step(metrics_t *mx, const trainer_t *t, const step_report_t *r);
void metrics_close(metrics_t *mx);

#endif /* TRAINER_METRICS_H */
