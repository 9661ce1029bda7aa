/*
 * moe_train: the bundled trainer. A byte-level MoE language model (model.h) trained with
 * mpirun across the 4D mesh (plan.h) on files read as bytes (data.h; default: the licenses
 * every Debian/Ubuntu system carries), with validation in bits per byte beside the unigram
 * baseline, checkpoints and resume (checkpoint.h) and metrics (metrics.h).
 *
 *   mpirun -np 4 moe_train --mesh pp=2,ep=2 --steps 300
 *
 * Every rank parses the same arguments and checks them before any work starts; the ranks
 * agree on the outcome, so a bad flag stops them all with the same message from rank 0.
 * Under the elastic launcher (membership.h) each rank reports its progress and, before it
 * exits, its exit code: MOE_EXIT_PEER_LOST when its runtime lost a peer.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checkpoint.h"
#include "config.h"
#include "data.h"
#include "membership.h"
#include "memplan.h"
#include "metrics.h"
#include "plan.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 1 when every rank passes ok = 1. */
static int all_agree(int ok)
{
    int all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return all;
}

static moe_runtime_t *runtime; /* for die(): whether a peer was lost */

/* A rank whose runtime lost a peer exits MOE_EXIT_PEER_LOST without MPI_Finalize (it would
 * wait for the lost peer); any other failure aborts the job. */
static void die(const char *what)
{
    char msg[1024], cause[1200];
    snprintf(msg, sizeof msg, "%s", moe_last_error());
    fprintf(stderr, "moe_train: %s failed: %s\n", what, msg);
    snprintf(cause, sizeof cause, "%s failed: %s", what, msg);
    int lost = runtime && moe_runtime_get_async_error(runtime, NULL, 0) != MOE_STATUS_SUCCESS;
    membership_leave(lost ? MOE_EXIT_PEER_LOST : 1, cause);
    if (lost) exit(MOE_EXIT_PEER_LOST);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Parse, validate and load the corpus on every rank. Returns -1 to go on, else the exit
 * status every rank returns with. */
static int prepare(trainer_config_t *c, corpus_t *corpus, int argc, char **argv, int rank,
                   int world)
{
    char err[512] = "";
    int bad = trainer_config_parse_args(c, argc, argv, err, sizeof err) ||
              (!c->help &&
               trainer_config_validate(c, c->print_config ? 0 : world, err, sizeof err));
    if (!all_agree(!bad)) {
        if (rank == 0) fprintf(stderr, "moe_train: %s\n", err[0] ? err : "bad arguments");
        return 2;
    }
    if (c->help || c->print_config) {
        if (rank == 0 && c->help) trainer_config_usage(stdout);
        if (rank == 0 && !c->help) {
            char *json = trainer_config_to_json(c);
            printf("%s\n", json);
            free(json);
        }
        return 0;
    }
    bad = corpus_load(corpus, c->paths, c->npaths, c->val_fraction, rank == 0, err, sizeof err);
    if (!bad && corpus->size - corpus->train_size <= (size_t)c->context + 1) {
        snprintf(err, sizeof err, "model.context (%lld) is longer than the %zu validation bytes",
                 (long long)c->context, corpus->size - corpus->train_size);
        bad = 1;
    }
    if (!all_agree(!bad)) {
        if (rank == 0) fprintf(stderr, "moe_train: %s\n", err[0] ? err : "data failed");
        return 2;
    }
    return -1;
}

int main(int argc, char **argv)
{
    int provided, rank, world;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (!all_agree(membership_join(rank) == 0)) {
        membership_leave(2, "elastic membership failed");
        MPI_Finalize();
        return 2;
    }
    trainer_config_t c;
    trainer_config_default(&c);
    corpus_t corpus = {0};
    int rc = prepare(&c, &corpus, argc, argv, rank, world);
    if (rc >= 0) {
        trainer_config_free(&c);
        membership_leave(rc, rc ? "bad arguments or data" : NULL);
        MPI_Finalize();
        return rc;
    }
    if (rank == 0)
        printf("data: %d files, %zu bytes: %zu train, %zu validation; unigram entropy of the "
               "training bytes %.4f bits/byte\n",
               corpus.files, corpus.size, corpus.train_size, corpus.size - corpus.train_size,
               corpus.unigram_bits);

    if ((rc = memplan_gate(&c, rank, world)) != 0) { /* 1: --plan printed; 2: does not fit */
        rc = rc == 2 ? 2 : 0;
        corpus_free(&corpus);
        trainer_config_free(&c);
        membership_leave(rc, rc ? "the memory plan does not fit" : NULL);
        MPI_Finalize();
        return rc;
    }
    trainer_t t;
    int setup_ok = trainer_setup(&t, &c, &corpus) == 0, any_ok = 0;
    MPI_Allreduce(&setup_ok, &any_ok, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!any_ok) { /* the same failure everywhere, already printed once: a plain exit */
        corpus_free(&corpus);
        trainer_config_free(&c);
        membership_leave(1, "set-up failed");
        MPI_Finalize();
        return 1;
    }
    if (!all_agree(setup_ok)) die("set-up");
    runtime = t.rt;
    trainer_ckpt_t ck = {0};
    if (c.ckpt_dir[0] && trainer_ckpt_open(&ck, &t, c.ckpt_dir)) die("checkpoint open");
    /* a fresh run would fail at its first save over the old steps: say so before training */
    int64_t old_step = ck.ck && !c.resume ? trainer_ckpt_newest(&ck) : -1;
    if (!all_agree(old_step < 0)) {
        if (rank == 0)
            fprintf(stderr,
                    "moe_train: %s already holds checkpoints (newest: step %lld): pass "
                    "--resume to continue from it, or another --ckpt-dir\n",
                    c.ckpt_dir, (long long)old_step);
        trainer_ckpt_close(&ck);
        trainer_teardown(&t);
        corpus_free(&corpus);
        trainer_config_free(&c);
        membership_leave(2, "ckpt.dir holds checkpoints and --resume was not given");
        MPI_Finalize();
        return 2;
    }
    if (c.resume) {
        int r = trainer_ckpt_resume(&ck, &t);
        if (r < 0) die("resume");
        if (rank == 0 && r == 0)
            printf("resume: step %lld from %s\n", (long long)t.step, c.ckpt_dir);
        if (rank == 0 && r == 0 && t.step >= c.steps)
            printf("resume: the run is complete (train.steps %lld); nothing to train\n",
                   (long long)c.steps);
        if (rank == 0 && r == 1)
            printf("resume: no checkpoint in %s; starting at step 0\n", c.ckpt_dir);
    }
    membership_resumed(t.step);
    metrics_t mx;
    if (!all_agree(metrics_open(&mx, &t, corpus.unigram_bits) == 0)) die("metrics");
    if (rank == 0)
        printf("mesh tp=%lld ep=%lld dp=%lld pp=%lld (%d ranks), L=%lld H=%lld heads=%lld T=%lld "
               "E=%lld K=%lld F=%lld, batch %lld x %lld bytes in %lld microbatches\n",
               (long long)c.tp, (long long)c.ep, (long long)c.dp, (long long)c.pp, world,
               (long long)c.layers, (long long)c.hidden, (long long)c.heads, (long long)c.context,
               (long long)c.experts, (long long)c.top_k, (long long)c.ffn_hidden,
               (long long)c.batch, (long long)c.context, (long long)c.microbatches);

    if (c.slow_slot >= 0 && membership_slot() == c.slow_slot) t.slow_s = c.slow_ms / 1e3;
    int64_t first_step = t.step;
    double t_start = now(), val = -1, tokens = 0;
    while (t.step < c.steps) {
        double t0 = now(), loss;
        if (trainer_train_step(&t, &loss) != MOE_STATUS_SUCCESS) die("training step");
        step_report_t r = {.step = t.step, .loss = loss, .val_loss = -1};
        r.step_s = now() - t0;
        r.times = t.times;
        tokens += (double)(c.batch * c.context);
        moe_adamw_last_step(t.opt, &r.lr, &r.grad_norm);
        trainer_gather_stats(&t);
        if ((c.eval_every > 0 && t.step % c.eval_every == 0) || t.step == c.steps) {
            if (trainer_evaluate(&t, &r.val_loss) != MOE_STATUS_SUCCESS) die("evaluation");
            val = r.val_loss;
        }
        double c0 = now();
        if (trainer_ckpt_progress(&ck)) die("checkpoint commit");
        r.ckpt_stall_s = now() - c0;
        if (ck.ck && ((c.ckpt_every > 0 && t.step % c.ckpt_every == 0) || t.step == c.steps)) {
            if (trainer_ckpt_save(&ck, &t, t.step)) die("checkpoint save");
            r.ckpt_stall_s += ck.last_stall_s;
        }
        metrics_busy(&mx, r.times.busy);
        metrics_step(&mx, &t, &r);
        membership_step(t.step, r.times.busy);
    }
    double elapsed = now() - t_start;
    if (ck.ck && trainer_ckpt_close(&ck)) die("checkpoint close");
    char span[96]; /* after a resume the time and rate are this run's steps only */
    if (first_step > 0)
        snprintf(span, sizeof span, "step %lld; steps %lld-%lld (this run)", (long long)t.step,
                 (long long)first_step + 1, (long long)t.step);
    else
        snprintf(span, sizeof span, "%lld steps", (long long)t.step);
    if (rank == 0 && val >= 0)
        printf("done: %s in %.1f s (%.0f tok/s); validation %.4f bits/byte = %.1f%% of the "
               "unigram baseline %.4f\n",
               span, elapsed, elapsed > 0 ? tokens / elapsed : 0, val / log(2.0),
               100 * val / log(2.0) / corpus.unigram_bits, corpus.unigram_bits);
    metrics_close(&mx);
    trainer_teardown(&t);
    corpus_free(&corpus);
    trainer_config_free(&c);
    membership_leave(0, NULL);
    MPI_Finalize();
    return 0;
}
