/*
 * The trainer's checkpoints through libmoe's checkpointer and its one-call training state
 * (moe/train_state.h): every MoE layer, the optimizer (masters, moments, step count), the dense
 * parameters, and "trainer.data" (the seed; the data position is the step count, since
 * batches are a pure function of seed and step). A checkpoint written at one mesh resumes at
 * any other (libmoe reshards the experts).
 */
#ifndef TRAINER_CHECKPOINT_H
#define TRAINER_CHECKPOINT_H

#include <moe/moe.h>

#include "plan.h"

typedef struct trainer_ckpt {
    moe_ckpt_t *ck;
    moe_train_state_t *state;
    float data[4];       /* the seed in 16-bit limbs */
    double last_stall_s; /* time the last save held training */
    int uncommitted;     /* a save is not yet known committed on every rank */
    int64_t pending;     /* the step of that save */
    int verbose;         /* rank 0: print each commit */
    int s3;              /* an S3 mirror is configured */
    char dir[512];
} trainer_ckpt_t;

/* Open the checkpointer on dir (with the config's S3 mirror) and list the trainer's state.
 * Rank 0 prints "checkpoint: step N saved in DIR" once each save is committed. Collective.
 * Returns 0 on success. */
int trainer_ckpt_open(trainer_ckpt_t *k, trainer_t *t, const char *dir);
/* Save the state as `step` (asynchronous). Collective. */
int trainer_ckpt_save(trainer_ckpt_t *k, trainer_t *t, int64_t step);
/* Commit the last save once its shards are durable on every rank. With several ranks libmoe
 * commits only inside its collective calls, so without this a save would wait for the next
 * one, and a failure would lose up to two checkpoint intervals instead of one (plus the
 * write). Call once a step. Collective; while a save is uncommitted it costs two small
 * all-reduces (moe_ckpt_wait with a zero timeout), otherwise nothing. Returns 0, or -1 on a
 * checkpoint error. */
int trainer_ckpt_progress(trainer_ckpt_t *k);
/* The newest complete checkpoint's step in the local directory, -1 when there is none. */
int64_t trainer_ckpt_newest(trainer_ckpt_t *k);
/* Load the newest complete checkpoint; t->step becomes its step. Returns 0 when loaded, 1 when
 * there is none, -1 on failure. Collective. */
int trainer_ckpt_resume(trainer_ckpt_t *k, trainer_t *t);
/* Wait for queued saves and close. Collective. Returns 0 when every save is committed
 * locally: the S3 mirror never fails a run (checkpointing.md: the local tier does not depend
 * on it); when the newest step could not be mirrored, rank 0 prints one warning naming the
 * newest mirrored step and the cause. */
int trainer_ckpt_close(trainer_ckpt_t *k);

#endif /* TRAINER_CHECKPOINT_H */
