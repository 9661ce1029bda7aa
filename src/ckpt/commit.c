/*
 * The commit protocol: a step exists once every rank's shard is durable and rank 0 has
 * written manifest.json. The writer thread writes each queued save (snapshot.c) and, in a
 * world of one, commits it and runs retention; with several ranks the commit runs on the
 * training thread in ckpt_progress(), because the MPI communicator is MPI_THREAD_SERIALIZED:
 * the ranks agree (allreduce MIN), rank 0 gathers the piece lists and writes the manifest
 * (tmp, fsync, rename, fsync), then hands the step to the S3 mirror. Retention keeps the
 * newest keep_last complete steps and removes crashed leftovers, sparing steps still in use;
 * it runs after each commit and again whenever an upload finishes.
 */
#include <dirent.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/error.h"
#include "ckpt_internal.h"

/* ---- gathering the piece lists ------------------------------------------------------------- */

/* Rank 0 receives every rank's piece list (JSON text) and file size. */
static moe_status_t gather_pieces(moe_ckpt_t *ck, moe_comm_t *c, const char *mine,
                                  uint64_t my_bytes, char **all, uint64_t *bytes)
{
    if (!c) {
        all[0] = strdup(mine);
        bytes[0] = my_bytes;
        return all[0] ? MOE_STATUS_SUCCESS : MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "pieces");
    }
    for (int r = 0; r < ck->world; r++) {
        int64_t hdr[2] = {r == ck->rank ? (int64_t)strlen(mine) + 1 : 0,
                          r == ck->rank ? (int64_t)my_bytes : 0};
        MOE_TRY(moe_comm_broadcast_copy(c, hdr, 2, MOE_COMM_I64, r));
        char *buf = malloc((size_t)hdr[0]);
        if (!buf) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "pieces of rank %d", r);
        if (r == ck->rank) memcpy(buf, mine, (size_t)hdr[0]);
        moe_status_t st = moe_comm_broadcast(c, buf, (size_t)hdr[0], MOE_COMM_U8, r);
        if (st != MOE_STATUS_SUCCESS) return st; /* buf stays MPI's */
        if (ck->rank == 0) {
            all[r] = buf;
            bytes[r] = (uint64_t)hdr[1];
        } else {
            free(buf);
        }
    }
    return MOE_STATUS_SUCCESS;
}

/* ---- local retention ----------------------------------------------------------------------- */

/* A step still in use: queued or being written, not yet committed, being uploaded (the one
 * upload in flight, or a reconciled step not yet on S3) or loaded. Steps merely waiting
 * for the mirror are not: the newest is never removed and supersedes the others. The
 * caller holds ck->mu. */
static bool step_pinned_locked(const moe_ckpt_t *ck, int64_t step)
{
    if (step == ck->mir_round || step == ck->mir_reconcile || step == ck->loading_step) return true;
    for (const ckpt_job_t *j = ck->jobs; j; j = j->next)
        if (j->step == step) return true;
    for (const ckpt_job_t *j = ck->done; j; j = j->next)
        if (j->step == step) return true;
    return false;
}

/* Remove the oldest of the complete steps[n] (ascending) until `keep` remain, sparing the
 * steps in use (which still count): manifest first, so a half-deleted directory is never
 * complete. */
static void remove_beyond(moe_ckpt_t *ck, const int64_t *steps, int32_t n, int32_t keep)
{
    char path[PATH_MAX], mpath[PATH_MAX + 32];
    for (int32_t i = 0; i + keep < n; i++) {
        pthread_mutex_lock(&ck->mu);
        bool pinned = step_pinned_locked(ck, steps[i]);
        pthread_mutex_unlock(&ck->mu);
        if (pinned) continue;
        ckpt_local_step_dir(ck, steps[i], path, sizeof path);
        snprintf(mpath, sizeof mpath, "%s/%s", path, CK_MANIFEST);
        if (unlink(mpath) != 0) continue; /* gone already (the other thread's retention) */
        ck_fsync_dir(path);
        if (ck_rmtree(path) != MOE_STATUS_SUCCESS)
            moe_log(ck->log, MOE_LOG_WARN, "checkpoint: retention: %s", moe_last_error());
        else
            moe_log(ck->log, MOE_LOG_INFO, "checkpoint: retention removed step %" PRId64, steps[i]);
    }
}

/* Rank 0, right before a commit makes one more step complete. When local disk already holds
 * more than keep_last complete steps (an older one spared for its upload in flight, during an
 * S3 outage), the oldest of the others goes first, so that local disk never holds more than
 * keep_last + 1 complete steps, also between the new manifest and the retention after it. */
static void make_room(moe_ckpt_t *ck)
{
    if (ck->rank != 0 || ck->cfg.keep_last <= 0) return;
    int64_t *steps;
    int32_t n;
    if (ckpt_local_steps(ck, &steps, &n) != MOE_STATUS_SUCCESS) return;
    if (n > ck->cfg.keep_last) remove_beyond(ck, steps, n, ck->cfg.keep_last - 1);
    free(steps);
}

/* Keep the newest keep_last complete checkpoints; remove older ones and incomplete
 * directories older than the newest complete one. Steps being written, uploaded or loaded
 * are skipped. Rank 0 only (the directory is shared by the ranks). */
static void local_retention(moe_ckpt_t *ck)
{
    if (ck->rank != 0 || ck->cfg.keep_last <= 0) return;
    int64_t *steps;
    int32_t n;
    if (ckpt_local_steps(ck, &steps, &n) != MOE_STATUS_SUCCESS) return;
    char path[PATH_MAX], mpath[PATH_MAX + 32];
    int64_t newest = n ? steps[n - 1] : -1;
    remove_beyond(ck, steps, n, ck->cfg.keep_last);
    free(steps);
    /* incomplete leftovers (crashed saves) older than the newest complete checkpoint */
    DIR *d = opendir(ck->dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int64_t step;
        if (!ck_parse_step_dirname(e->d_name, &step) || step >= newest) continue;
        snprintf(path, sizeof path, "%s/%s", ck->dir, e->d_name);
        snprintf(mpath, sizeof mpath, "%s/%s", path, CK_MANIFEST);
        pthread_mutex_lock(&ck->mu);
        bool pinned = step_pinned_locked(ck, step);
        pthread_mutex_unlock(&ck->mu);
        if (pinned || ck_file_exists(mpath)) continue;
        ck_rmtree(path);
    }
    closedir(d);
    ck_fsync_dir(ck->dir);
}

/* ---- the commit; the writer thread --------------------------------------------------------- */

/* Commit job j once every rank's shard is durable: the ranks agree (allreduce MIN of their
 * local results), rank 0 gathers the piece lists and writes manifest.json (temporary name,
 * fsync, rename, fsync), everyone learns the outcome. Collective over comm_w: in a world of
 * one the writer thread calls it; otherwise the training thread does, from ckpt_progress(),
 * so that MPI is only ever called from the thread that also drives training (the MPI
 * communicator runs at MPI_THREAD_SERIALIZED). */
static void commit_job(moe_ckpt_t *ck, ckpt_job_t *j)
{
    char stepdir[PATH_MAX];
    ckpt_step_path(ck, j->step, stepdir, sizeof stepdir);
    /* every rank takes part in the agreement, failed or not, so nobody waits for ever */
    int32_t all_ok = 0;
    moe_status_t cst = ckpt_agree(ck->comm_w, j->local_ok, MOE_REDUCE_MIN, &all_ok);
    if (cst != MOE_STATUS_SUCCESS) {
        ckpt_set_async_error(ck, cst, "checkpoint agreement");
        all_ok = 0;
    }
    int32_t committed = 0;
    if (all_ok) {
        char **all = calloc((size_t)ck->world, sizeof *all);
        uint64_t *bytes = calloc((size_t)ck->world, sizeof *bytes);
        moe_status_t gst = all && bytes
                               ? gather_pieces(ck, ck->comm_w, j->mine, j->file_bytes, all, bytes)
                               : MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "gather tables");
        if (gst == MOE_STATUS_SUCCESS && ck->rank == 0) {
            moe_mesh_t *m = ck->rt->mesh;
            int32_t mesh[4] = {m->size[MOE_AXIS_TP], m->size[MOE_AXIS_EP], m->size[MOE_AXIS_DP],
                               m->size[MOE_AXIS_PP]};
            char *text = ck_manifest_build(j->step, ck->cfg.chunk_bytes, ck->world, mesh, all,
                                           bytes);
            make_room(ck);
            gst = text ? ck_write_file_atomic(stepdir, CK_MANIFEST, text, strlen(text))
                       : MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "manifest text");
            if (gst == MOE_STATUS_SUCCESS) gst = ck_fsync_dir(ck->dir);
            free(text);
            committed = gst == MOE_STATUS_SUCCESS;
        }
        if (gst != MOE_STATUS_SUCCESS) ckpt_set_async_error(ck, gst, "committing the checkpoint");
        for (int r = 0; all && r < ck->world; r++) free(all[r]);
        free(all);
        free(bytes);
        if (ck->comm_w) { /* everyone learns whether rank 0 committed */
            moe_status_t bst = moe_comm_broadcast_copy(ck->comm_w, &committed, 1, MOE_COMM_I32, 0);
            if (bst != MOE_STATUS_SUCCESS) {
                ckpt_set_async_error(ck, bst, "checkpoint commit broadcast");
                committed = 0;
            } else if (!committed && ck->rank != 0) { /* rank 0 has the cause */
                MOE_FAIL(MOE_STATUS_ABORTED, "rank 0 could not commit step %" PRId64, j->step);
                ckpt_set_async_error(ck, MOE_STATUS_ABORTED, "committing the checkpoint");
            }
        }
    } else if (j->local_ok) {
        MOE_FAIL(MOE_STATUS_ABORTED, "another rank failed to write its shard of step %" PRId64,
                 j->step);
        ckpt_set_async_error(ck, MOE_STATUS_ABORTED, "checkpoint agreement");
    }
    double t = moe_now_s();
    pthread_mutex_lock(&ck->mu);
    if (committed) {
        ck->st.last_committed_step = j->step;
        ck->st.last_durable_s = t - j->t_start;
        if (ck->s3) ckpt_mirror_queue_step_locked(ck, j->step);
    }
    ck->retention_due = ck->rank == 0;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    if (committed)
        moe_log(ck->log, MOE_LOG_INFO, "checkpoint: step %" PRId64 " durable after %.3f s", j->step,
                t - j->t_start);
}

/* The writer thread: each queued save's data file in order (ckpt_write_job); in a world of
 * one also its commit and retention; otherwise the job waits in ck->done for ckpt_progress. */
void *ckpt_writer_main(void *arg)
{
    moe_ckpt_t *ck = arg;
    for (;;) {
        pthread_mutex_lock(&ck->mu);
        while (!ck->jobs && !ck->stop && !ck->retention_due) pthread_cond_wait(&ck->cv, &ck->mu);
        ckpt_job_t *j = ck->jobs;
        bool retention = ck->retention_due;
        ck->retention_due = false;
        pthread_mutex_unlock(&ck->mu);
        if (retention) local_retention(ck);
        if (!j) {
            if (retention) continue;
            break;
        }
        char stepdir[PATH_MAX];
        ckpt_step_path(ck, j->step, stepdir, sizeof stepdir);
        moe_status_t st = ckpt_write_job(ck, j, stepdir, &j->mine);
        /* a failed snapshot was already returned by save_async */
        if (st != MOE_STATUS_SUCCESS && !j->snap_failed)
            ckpt_set_async_error(ck, st, "writing the local checkpoint");
        j->local_ok = st == MOE_STATUS_SUCCESS;
        if (ck->world == 1) {
            commit_job(ck, j);
            pthread_mutex_lock(&ck->mu);
            ck->retention_due = false;
            pthread_mutex_unlock(&ck->mu);
            local_retention(ck); /* before the save counts as done: wait() sees its effect */
        }
        pthread_mutex_lock(&ck->mu);
        ck->jobs = j->next;
        if (!ck->jobs) ck->jobs_tail = NULL;
        j->next = NULL;
        if (ck->world == 1) {
            ck->st.pending_saves--;
        } else { /* durable here; committed by ckpt_progress() on the training thread */
            if (ck->done_tail)
                ck->done_tail->next = j;
            else
                ck->done = j;
            ck->done_tail = j;
        }
        pthread_cond_broadcast(&ck->cv);
        pthread_mutex_unlock(&ck->mu);
        if (ck->world == 1) ckpt_job_free(j);
    }
    return NULL;
}

/* ---- what is pending ----------------------------------------------------------------------- */

bool ckpt_busy_locked(const moe_ckpt_t *ck, bool uploads)
{
    return ck->st.pending_saves > 0 || (uploads && ckpt_mirror_busy_locked(ck));
}

/* ---- collective progress (world > 1), on the training thread ------------------------------- */

static int32_t list_len_jobs(const ckpt_job_t *j)
{
    int32_t n = 0;
    for (; j; j = j->next) n++;
    return n;
}

moe_status_t ckpt_progress(moe_ckpt_t *ck, bool drain, bool uploads, int64_t timeout_ms,
                           bool stop_on_error)
{
    if (ck->world == 1 || !ck->comm_w) return MOE_STATUS_SUCCESS;
    double t0 = moe_now_s();
    for (;;) {
        /* MIN over the ranks: saves durable everywhere; the round's shard done everywhere;
         * every rank's mirror idle; -(some rank wants a round) */
        pthread_mutex_lock(&ck->mu);
        int32_t mine[4] = {list_len_jobs(ck->done),
                           ck->mir_round >= 0 && ck->mir_task == CKPT_MIR_NONE &&
                               ck->mir_shard_done,
                           ckpt_mirror_idle_locked(ck), -(int32_t)ckpt_mirror_wants_locked(ck)};
        pthread_mutex_unlock(&ck->mu);
        int32_t mins[4];
        MOE_TRY(moe_comm_allreduce_copy(ck->comm_w, mine, mins, 4, MOE_COMM_I32, MOE_REDUCE_MIN));
        for (int32_t i = 0; i < mins[0]; i++) {
            pthread_mutex_lock(&ck->mu);
            ckpt_job_t *j = ck->done;
            ck->done = j->next;
            if (!ck->done) ck->done_tail = NULL;
            pthread_mutex_unlock(&ck->mu);
            commit_job(ck, j);
            pthread_mutex_lock(&ck->mu);
            ck->st.pending_saves--;
            pthread_cond_broadcast(&ck->cv);
            pthread_mutex_unlock(&ck->mu);
            ckpt_job_free(j);
        }
        if (mins[1])
            MOE_TRY(ckpt_mirror_agree_upload(ck));
        else if (mins[2] && mins[3] < 0)
            ckpt_mirror_start_round(ck); /* mir_want agrees */
        if (!drain) return MOE_STATUS_SUCCESS;
        pthread_mutex_lock(&ck->mu);
        int32_t busy[3] = {ckpt_busy_locked(ck, uploads),
                           stop_on_error && ckpt_error_pending_locked(ck, uploads),
                           timeout_ms >= 0 && (moe_now_s() - t0) * 1000.0 > (double)timeout_ms};
        pthread_mutex_unlock(&ck->mu);
        int32_t any[3];
        MOE_TRY(moe_comm_allreduce_copy(ck->comm_w, busy, any, 3, MOE_COMM_I32, MOE_REDUCE_MAX));
        if (!any[0] || any[1]) return MOE_STATUS_SUCCESS; /* done, or an error to report */
        if (any[2])
            return MOE_FAIL(MOE_STATUS_TIMEOUT,
                            "checkpoint work still in progress after %" PRId64 " ms (on some rank)",
                            timeout_ms);
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

moe_status_t ckpt_drain_saves(moe_ckpt_t *ck)
{
    if (ck->world > 1) return ckpt_progress(ck, true, false, -1, false);
    pthread_mutex_lock(&ck->mu);
    while (ck->st.pending_saves > 0) pthread_cond_wait(&ck->cv, &ck->mu);
    pthread_mutex_unlock(&ck->mu);
    return MOE_STATUS_SUCCESS;
}
