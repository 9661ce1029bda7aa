/*
 * The S3 mirror: a thread that uploads each committed step (s3.c is the client): this
 * rank's shard, then manifest.json last, so a step on S3 is complete once its manifest is
 * there. In a world of one the thread puts both; with several ranks every rank puts its
 * shard, the ranks agree on the training thread (ckpt_progress) and rank 0's thread then
 * puts the manifest. After each mirrored step, S3 retention keeps the newest keep_last.
 */
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "ckpt_internal.h"

/* ---- the upload queue ---------------------------------------------------------------------- */

/* Append u to the uploads the S3 thread takes in order; the caller holds ck->mu. */
static void queue_upload_locked(moe_ckpt_t *ck, ckpt_upload_t *u)
{
    if (ck->ups_tail) ck->ups_tail->next = u;
    else ck->ups = u;
    ck->ups_tail = u;
}

void ckpt_mirror_queue_step_locked(moe_ckpt_t *ck, int64_t step)
{
    ckpt_upload_t *u = calloc(1, sizeof *u);
    if (u) {
        u->step = step;
        queue_upload_locked(ck, u);
        ck->st.pending_uploads++;
    }
}

/* ---- the S3 thread ------------------------------------------------------------------------- */

/* Upload the local <step dir>/<file>, counting the bytes sent in the status. */
static moe_status_t put_step_file(moe_ckpt_t *ck, int64_t step, const char *file)
{
    char stepdir[PATH_MAX], name[64], local[PATH_MAX + 64];
    ckpt_step_path(ck, step, stepdir, sizeof stepdir);
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
        moe_log(ck->log, MOE_LOG_WARN, "checkpoint: uploading %s/%s failed (%s); retrying the "
                "file", name, file, moe_last_error());
    }
    pthread_mutex_lock(&ck->mu);
    ck->st.bytes_uploaded += sent;
    pthread_mutex_unlock(&ck->mu);
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

/* Uploads: the shard of this rank, then (world of one, or a manifest task on rank 0 once
 * every rank's shard is up) manifest.json, the remote commit, last. */
void *ckpt_mirror_main(void *arg)
{
    moe_ckpt_t *ck = arg;
    for (;;) {
        pthread_mutex_lock(&ck->mu);
        while (!ck->ups && !ck->stop) pthread_cond_wait(&ck->cv, &ck->mu);
        ckpt_upload_t *u = ck->ups;
        if (!u) {
            pthread_mutex_unlock(&ck->mu);
            break;
        }
        ck->ups = u->next;
        if (!ck->ups) ck->ups_tail = NULL;
        u->next = NULL;
        ck->uploading_step = u->step;
        bool aborting = ck->aborting;
        pthread_mutex_unlock(&ck->mu);
        moe_status_t st = MOE_STATUS_ABORTED;
        char file[64];
        ck_rank_filename(ck->rank, file, sizeof file);
        if (!aborting) {
            st = put_step_file(ck, u->step, u->manifest_only ? CK_MANIFEST : file);
            if (st == MOE_STATUS_SUCCESS && ck->world == 1)
                st = put_step_file(ck, u->step, CK_MANIFEST);
        }
        bool finished = ck->world == 1 || u->manifest_only;
        if (st != MOE_STATUS_SUCCESS)
            ckpt_set_async_error(ck, st, "mirroring the checkpoint to S3");
        if (st == MOE_STATUS_SUCCESS && finished) {
            moe_log(ck->log, MOE_LOG_INFO, "checkpoint: step %" PRId64 " mirrored to S3", u->step);
            s3_retention(ck);
        }
        pthread_mutex_lock(&ck->mu);
        ck->uploading_step = -1;
        if (finished) {
            if (st == MOE_STATUS_SUCCESS) ck->st.last_uploaded_step = u->step;
            ck->st.pending_uploads--;
            free(u);
        } else { /* the shard is up (or failed): the ranks agree in ckpt_progress() */
            u->ok = st == MOE_STATUS_SUCCESS;
            if (ck->updone_tail) ck->updone_tail->next = u;
            else ck->updone = u;
            ck->updone_tail = u;
        }
        pthread_cond_broadcast(&ck->cv);
        pthread_mutex_unlock(&ck->mu);
    }
    return NULL;
}

/* ---- the upload agreement (world > 1), on the training thread ------------------------------ */

moe_status_t ckpt_mirror_agree_upload(moe_ckpt_t *ck)
{
    /* The upload stays at the head of updone through the agreement: retention, which
     * the writer thread may run meanwhile, spares the steps of the uploads it finds
     * queued, and this step's manifest is not uploaded yet. */
    pthread_mutex_lock(&ck->mu);
    ckpt_upload_t *u = ck->updone;
    int32_t ok = u->ok;
    pthread_mutex_unlock(&ck->mu);
    int32_t all_ok = 0;
    moe_status_t st = ckpt_agree(ck->comm_w, ok, MOE_REDUCE_MIN, &all_ok);
    if (st != MOE_STATUS_SUCCESS) return st; /* still queued, freed by destroy */
    if (!all_ok && ok) {
        MOE_FAIL(MOE_STATUS_REMOTE_ERROR, "another rank failed to upload its shard of "
                 "step %" PRId64, u->step);
        ckpt_set_async_error(ck, MOE_STATUS_REMOTE_ERROR, "mirroring the checkpoint to S3");
    }
    pthread_mutex_lock(&ck->mu);
    ck->updone = u->next;
    if (!ck->updone) ck->updone_tail = NULL;
    u->next = NULL;
    if (all_ok && ck->rank == 0) { /* the remote commit */
        u->manifest_only = true;
        queue_upload_locked(ck, u);
        u = NULL;
    } else {
        if (all_ok) ck->st.last_uploaded_step = u->step;
        ck->st.pending_uploads--;
    }
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    free(u);
    return MOE_STATUS_SUCCESS;
}
