/*
 * The S3 mirror: a thread that copies committed steps to S3 (s3.c is the client), data files
 * first and manifest.json last, so a step on S3 is complete once its manifest is there.
 *
 * Guarantees: the mirror is optional and never costs the local tier anything. Only the newest
 * committed step must reach S3: a step committed while another uploads supersedes every
 * older step still waiting (there is one upload in flight and at most one waiting), so the
 * backlog is bounded and local retention spares only the step in flight (local disk stays
 * within keep_last + 1 steps). A failed upload is recorded (status fields, a WARN log line,
 * the next poll/wait with uploads) and the newest step is tried again after s3_retry_max_ms,
 * for as long as it takes; save_async never sees mirror errors. When an upload finishes,
 * local retention runs again. At create, rank 0 reconciles: the newest local step, when S3
 * has neither it nor a newer one (a crash or an outage before it was mirrored), is uploaded
 * first and kept locally until it is.
 *
 * World of one: the thread picks the work itself. Several ranks: every rank uploads its own
 * shard of the step and rank 0 the manifest once all have; the rounds start and end on the
 * training thread in ckpt_progress() (MPI is only called there): when no rank has an upload
 * in flight and some rank wants one, every rank starts the round for the same step (commits
 * run in the same order everywhere, so mir_want agrees); once every rank's shard is done the
 * ranks agree on the outcome and rank 0's thread puts the manifest.
 */
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/clock.h"
#include "core/error.h"
#include "ckpt_internal.h"

/* ---- bookkeeping (the caller holds ck->mu) ------------------------------------------------- */

bool ckpt_mirror_idle_locked(const moe_ckpt_t *ck)
{
    return ck->mir_round < 0 && (ck->mir_reconcile < 0 || ck->mir_draining);
}

bool ckpt_mirror_wants_locked(const moe_ckpt_t *ck)
{
    if (!ck->s3 || !ckpt_mirror_idle_locked(ck) || ck->mir_want <= ck->st.last_uploaded_step)
        return false;
    if (ck->mir_draining) return ck->mir_want > ck->mir_drain_tried;
    return ck->mir_want != ck->mir_failed || moe_now_s() >= ck->mir_retry_at;
}

bool ckpt_mirror_busy_locked(const moe_ckpt_t *ck)
{
    if (!ck->s3) return false;
    if (ck->mir_round >= 0) return true;
    if (ck->mir_reconcile >= 0 && (!ck->mir_draining || ck->mir_reconcile > ck->mir_drain_tried))
        return true;
    if (ck->mir_want <= ck->st.last_uploaded_step) return false;
    return !ck->mir_draining || ck->mir_want > ck->mir_drain_tried;
}

int64_t ckpt_mirror_pending_locked(const moe_ckpt_t *ck)
{
    int64_t n = ck->mir_round >= 0;
    if (ck->mir_want > ck->st.last_uploaded_step && ck->mir_want != ck->mir_round) n++;
    if (ck->mir_reconcile >= 0 && ck->mir_reconcile != ck->mir_round) n++;
    return n;
}

void ckpt_mirror_queue_step_locked(moe_ckpt_t *ck, int64_t step)
{
    if (ck->mir_want > ck->st.last_uploaded_step && ck->mir_want != ck->mir_round)
        ck->st.uploads_superseded++; /* never uploaded: the newer step replaces it */
    ck->mir_want = step;
}

/* The round for `step` is over on this rank (ok: the step is complete on S3, as far as this
 * rank knows); retention may now remove it. */
static void finish_round_locked(moe_ckpt_t *ck, int64_t step, bool ok)
{
    ck->mir_round = -1;
    ck->mir_task = CKPT_MIR_NONE;
    if (ck->mir_draining && step > ck->mir_drain_tried) ck->mir_drain_tried = step;
    if (ok) {
        if (step > ck->st.last_uploaded_step) ck->st.last_uploaded_step = step;
        ck->mir_failed = -1;
        ck->st.last_upload_error = MOE_STATUS_SUCCESS;
    } else {
        ck->mir_failed = step;
        ck->mir_retry_at = moe_now_s() + ck->cfg.s3_retry_max_ms / 1000.0;
    }
    if (ck->mir_reconcile >= 0 && ck->mir_reconcile <= ck->st.last_uploaded_step)
        ck->mir_reconcile = -1;
    ck->retention_due = ck->rank == 0;
    pthread_cond_broadcast(&ck->cv);
}

/* A failed upload of `step`: counted, kept for the next poll/wait with uploads (first one
 * wins until reported), logged. The caller holds no lock; moe_last_error() is the cause. */
static void mirror_failed(moe_ckpt_t *ck, moe_status_t st, int64_t step)
{
    pthread_mutex_lock(&ck->mu);
    if (ck->aborting) { /* cancelled by moe_ckpt_abort: nobody is told */
        pthread_mutex_unlock(&ck->mu);
        return;
    }
    ck->st.upload_failures++;
    ck->st.last_upload_error = st;
    if (ck->mirror_err == MOE_STATUS_SUCCESS) {
        ck->mirror_err = st;
        snprintf(ck->mirror_msg, sizeof ck->mirror_msg, "mirroring step %" PRId64 " to S3: %s",
                 step, moe_last_error());
    }
    pthread_mutex_unlock(&ck->mu);
    moe_log(ck->log, MOE_LOG_WARN,
            "checkpoint: mirroring step %" PRId64 " to S3 failed: %s; "
            "local checkpoints go on, the newest step is tried again in %.1f s",
            step, moe_last_error(), ck->cfg.s3_retry_max_ms / 1000.0);
}

/* ---- uploads ------------------------------------------------------------------------------- */

/* Upload the local <stepdir>/<file>, counting the bytes sent in the status. */
static moe_status_t put_step_file(moe_ckpt_t *ck, int64_t step, const char *stepdir,
                                  const char *file)
{
    char name[64], local[PATH_MAX + 64];
    ck_step_dirname(step, name, sizeof name);
    snprintf(local, sizeof local, "%s/%s", stepdir, file);
    uint64_t sent = 0;
    moe_status_t st = MOE_STATUS_ABORTED;
    /* whole-file retries on top of the per-request ones (e.g. an upload id lost when the
     * server restarted) */
    for (int attempt = 0; attempt < 3; attempt++) {
        st = ck_s3_put_file(ck->s3, name, file, local, &sent);
        if (st == MOE_STATUS_SUCCESS || st == MOE_STATUS_ABORTED || st == MOE_STATUS_IO_ERROR)
            break;
        moe_log(ck->log, MOE_LOG_WARN,
                "checkpoint: uploading %s/%s failed (%s); retrying the "
                "file",
                name, file, moe_last_error());
    }
    pthread_mutex_lock(&ck->mu);
    ck->st.bytes_uploaded += sent;
    pthread_mutex_unlock(&ck->mu);
    return st;
}

/* Every data file the step's manifest names, then the manifest (world of one, and rank 0's
 * reconcile of a step written by any world). */
static moe_status_t put_whole_step(moe_ckpt_t *ck, int64_t step)
{
    char stepdir[PATH_MAX];
    if (!ckpt_local_step_dir(ck, step, stepdir, sizeof stepdir))
        return MOE_FAIL(MOE_STATUS_NOT_FOUND, "step %" PRId64 " is no longer on local disk", step);
    ck_manifest_t m;
    MOE_TRY(ck_manifest_read(stepdir, &m));
    moe_status_t st = MOE_STATUS_SUCCESS;
    for (int32_t i = 0; i < m.nfiles && st == MOE_STATUS_SUCCESS; i++)
        st = put_step_file(ck, step, stepdir, m.files[i].path);
    ck_manifest_free(&m);
    if (st == MOE_STATUS_SUCCESS) st = put_step_file(ck, step, stepdir, CK_MANIFEST);
    return st;
}

/* Rank 0: keep the newest keep_last steps on S3 (each older one deleted manifest first). */
static void s3_retention(moe_ckpt_t *ck)
{
    if (ck->rank != 0 || ck->cfg.keep_last <= 0) return;
    int64_t *steps = NULL;
    int32_t n = 0;
    if (ck_s3_list_steps(ck->s3, &steps, &n, -1) != MOE_STATUS_SUCCESS) {
        moe_log(ck->log, MOE_LOG_WARN, "checkpoint: S3 retention: %s", moe_last_error());
        return;
    }
    char name[64];
    for (int32_t i = 0; i + ck->cfg.keep_last < n; i++) {
        ck_step_dirname(steps[i], name, sizeof name);
        if (ck_s3_delete_step(ck->s3, name) != MOE_STATUS_SUCCESS)
            moe_log(ck->log, MOE_LOG_WARN, "checkpoint: S3 retention: %s", moe_last_error());
    }
    free(steps);
}

/* A step is complete on S3: logged (with the recovery after failures), S3 retention. */
static void mirrored(moe_ckpt_t *ck, int64_t step)
{
    pthread_mutex_lock(&ck->mu);
    bool recovered = ck->mir_failed >= 0;
    pthread_mutex_unlock(&ck->mu);
    moe_log(ck->log, MOE_LOG_INFO, "checkpoint: step %" PRId64 " mirrored to S3%s", step,
            recovered ? " (the mirror recovered)" : "");
    s3_retention(ck);
}

/* ---- the S3 thread ------------------------------------------------------------------------- */

/* The next job of this rank's thread; the caller holds ck->mu. Sets mir_round. */
static ckpt_mir_task_t next_task_locked(moe_ckpt_t *ck, int64_t *step)
{
    if (ck->aborting) return CKPT_MIR_NONE;
    if (ck->mir_task == CKPT_MIR_SHARD || ck->mir_task == CKPT_MIR_MANIFEST) {
        *step = ck->mir_round;
        return ck->mir_task;
    }
    if (ck->mir_round >= 0) return CKPT_MIR_NONE; /* world > 1: waiting for the agreement */
    int64_t r = ck->mir_reconcile;
    if (r >= 0 && r <= ck->st.last_uploaded_step) r = ck->mir_reconcile = -1;
    if (r >= 0) { /* the reconciled step goes first (but is not retried for ever at destroy) */
        bool due = ck->mir_draining ? r > ck->mir_drain_tried
                                    : r != ck->mir_failed || moe_now_s() >= ck->mir_retry_at;
        if (due) {
            *step = ck->mir_round = r;
            return CKPT_MIR_WHOLE;
        }
        if (!ck->mir_draining) return CKPT_MIR_NONE;
    }
    if (ck->world == 1 && ckpt_mirror_wants_locked(ck)) {
        *step = ck->mir_round = ck->mir_want;
        return CKPT_MIR_WHOLE;
    }
    return CKPT_MIR_NONE;
}

/* Sleep on the condition variable, at most until a failed step is due again. */
static void wait_for_work_locked(moe_ckpt_t *ck)
{
    double left = ck->mir_retry_at - moe_now_s();
    if (ck->mir_failed < 0 || left <= 0) { /* nothing becomes due by waiting */
        pthread_cond_wait(&ck->cv, &ck->mu);
        return;
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += (time_t)left;
    dl.tv_nsec += (long)((left - (double)(time_t)left) * 1e9);
    if (dl.tv_nsec >= 1000000000) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&ck->cv, &ck->mu, &dl);
}

void *ckpt_mirror_main(void *arg)
{
    moe_ckpt_t *ck = arg;
    char shard[64];
    ck_rank_filename(ck->rank, shard, sizeof shard);
    for (;;) {
        pthread_mutex_lock(&ck->mu);
        int64_t step = -1;
        ckpt_mir_task_t task;
        while ((task = next_task_locked(ck, &step)) == CKPT_MIR_NONE && !ck->stop)
            wait_for_work_locked(ck);
        if (task == CKPT_MIR_NONE) { /* stopped */
            pthread_mutex_unlock(&ck->mu);
            break;
        }
        if (task != CKPT_MIR_WHOLE) ck->mir_task = CKPT_MIR_BUSY; /* taken */
        pthread_mutex_unlock(&ck->mu);

        moe_status_t st;
        if (task == CKPT_MIR_SHARD) {
            char stepdir[PATH_MAX];
            ckpt_step_path(ck, step, stepdir, sizeof stepdir);
            st = put_step_file(ck, step, stepdir, shard);
        } else if (task == CKPT_MIR_MANIFEST) {
            char stepdir[PATH_MAX];
            ckpt_step_path(ck, step, stepdir, sizeof stepdir);
            st = put_step_file(ck, step, stepdir, CK_MANIFEST);
        } else {
            st = put_whole_step(ck, step);
        }
        if (st != MOE_STATUS_SUCCESS)
            mirror_failed(ck, st, step);
        else if (task != CKPT_MIR_SHARD)
            mirrored(ck, step);

        pthread_mutex_lock(&ck->mu);
        if (task == CKPT_MIR_WHOLE && step == ck->mir_reconcile &&
            (st == MOE_STATUS_NOT_FOUND || st == MOE_STATUS_CORRUPT))
            ck->mir_reconcile = -1;   /* gone or damaged locally: trying again cannot help */
        if (task == CKPT_MIR_SHARD) { /* the ranks agree in ckpt_progress() */
            ck->mir_task = CKPT_MIR_NONE;
            ck->mir_shard_done = true;
            ck->mir_shard_ok = st == MOE_STATUS_SUCCESS;
            pthread_cond_broadcast(&ck->cv);
        } else {
            finish_round_locked(ck, step, st == MOE_STATUS_SUCCESS);
        }
        pthread_mutex_unlock(&ck->mu);
    }
    return NULL;
}

/* ---- reconcile at create ------------------------------------------------------------------- */

void ckpt_mirror_reconcile(moe_ckpt_t *ck)
{
    if (!ck->s3 || ck->rank != 0) return;
    int64_t *loc = NULL, *rem = NULL;
    int32_t nl = 0, nr = 0;
    if (ckpt_local_steps(ck, &loc, &nl) != MOE_STATUS_SUCCESS || nl == 0) {
        free(loc);
        return;
    }
    int64_t newest = loc[nl - 1];
    free(loc);
    if (ck_s3_list_steps(ck->s3, &rem, &nr, 1) != MOE_STATUS_SUCCESS) {
        moe_log(ck->log, MOE_LOG_WARN,
                "checkpoint: cannot list S3 (%s); local step %" PRId64
                " will be uploaded when it can be",
                moe_last_error(), newest);
    } else if (nr > 0 && rem[nr - 1] >= newest) {
        newest = -1; /* S3 has it, or a newer one */
    } else {
        moe_log(ck->log, MOE_LOG_INFO,
                "checkpoint: local step %" PRId64 " is not on S3: "
                "uploading it (kept locally until it is)",
                newest);
    }
    free(rem);
    ck->mir_reconcile = newest;
}

/* ---- rounds (world > 1), on the training thread -------------------------------------------- */

void ckpt_mirror_start_round(moe_ckpt_t *ck)
{
    pthread_mutex_lock(&ck->mu);
    ck->mir_round = ck->mir_want;
    ck->mir_task = CKPT_MIR_SHARD;
    ck->mir_shard_done = ck->mir_shard_ok = false;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
}

moe_status_t ckpt_mirror_agree_upload(moe_ckpt_t *ck)
{
    pthread_mutex_lock(&ck->mu);
    int64_t step = ck->mir_round;
    int32_t ok = ck->mir_shard_ok;
    pthread_mutex_unlock(&ck->mu);
    int32_t all_ok = 0;
    MOE_TRY(ckpt_agree(ck->comm_w, ok, MOE_REDUCE_MIN, &all_ok));
    if (!all_ok && ok) {
        MOE_FAIL(MOE_STATUS_REMOTE_ERROR, "another rank failed to upload its shard");
        mirror_failed(ck, MOE_STATUS_REMOTE_ERROR, step);
    }
    pthread_mutex_lock(&ck->mu);
    ck->mir_shard_done = false;
    if (all_ok && ck->rank == 0) { /* the remote commit */
        ck->mir_task = CKPT_MIR_MANIFEST;
        pthread_cond_broadcast(&ck->cv);
    } else {
        finish_round_locked(ck, step, all_ok);
    }
    pthread_mutex_unlock(&ck->mu);
    return MOE_STATUS_SUCCESS;
}
