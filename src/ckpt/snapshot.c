/*
 * moe_ckpt_save_async, the training thread's side of a save: the checks, the job queued for
 * the writer thread (commit.c), and the start of the snapshot: each chunk_bytes range of this
 * rank's data file gets a staging segment (shard.c) whose copy is enqueued on the CUDA
 * backend's copy stream or handed to the host's copy thread (copy.c). save_async returns
 * without waiting for the copy; the next write of the tensors waits for it (the fences of
 * copy.c).
 */
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/error.h"
#include "ckpt_internal.h"

/* ---- the training thread: save_async ------------------------------------------------------- */

/* Everything save_async checks before the snapshot; fills j's layout. */
static moe_status_t save_checks(moe_ckpt_t *ck, int64_t step, const moe_ckpt_tensor_t *tensors,
                                int32_t count, ckpt_job_t *j)
{
    MOE_TRY(ckpt_take_async_error(ck, false)); /* local failures only: never the mirror's */
    MOE_CHECK_ARG(step >= 0, "step is %" PRId64 "; it must be >= 0", step);
    MOE_CHECK_ARG(step > ck->last_saved_step,
                  "step %" PRId64 " is not greater than the last saved step %" PRId64, step,
                  ck->last_saved_step);
    char stepdir[PATH_MAX], mpath[PATH_MAX + 32];
    ckpt_step_path(ck, step, stepdir, sizeof stepdir);
    snprintf(mpath, sizeof mpath, "%s/%s", stepdir, CK_MANIFEST);
    MOE_CHECK_ARG(!ck_file_exists(mpath),
                  "a complete checkpoint of step %" PRId64 " already exists in %s", step, ck->dir);
    MOE_TRY(ck_layout(tensors, count, ck->cfg.chunk_bytes, ck->rank, &j->pieces, &j->npieces,
                      &j->file_bytes));
    for (int32_t i = 0; i < j->npieces; i++)
        if (j->pieces[i].src_device == MOE_DEVICE_CUDA &&
            MOE_OPS(ck->rt)->device != MOE_DEVICE_CUDA)
            return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                            "tensor %s is on a CUDA device but the "
                            "runtime's backend is %s",
                            j->pieces[i].name, MOE_OPS(ck->rt)->name);
    return MOE_STATUS_SUCCESS;
}

/* Appends j (of `step`, started at t0) to the jobs the writer thread takes in order. */
static void enqueue_job(moe_ckpt_t *ck, ckpt_job_t *j, int64_t step, double t0, bool failed)
{
    j->step = step;
    j->t_start = t0;
    j->all_queued = j->snap_failed = failed;
    pthread_mutex_lock(&ck->mu);
    if (ck->jobs_tail)
        ck->jobs_tail->next = j;
    else
        ck->jobs = j;
    ck->jobs_tail = j;
    ck->st.pending_saves++;
    if (!failed) ck->st.state = MOE_CKPT_WRITING;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
}

/* ---- the snapshot: file range [k*chunk, (k+1)*chunk) goes through segment k ---------------- */

/* Take the staging segment for file range [off, off + chunk) of job j. */
static moe_status_t take_segment(moe_ckpt_t *ck, const ckpt_job_t *j, uint64_t off,
                                 ckpt_seg_t **out)
{
    MOE_TRY(ckpt_seg_acquire(ck, out));
    ckpt_seg_t *s = *out;
    uint64_t chunk = ck->cfg.chunk_bytes;
    s->off = off;
    s->len = j->file_bytes - off < chunk ? (size_t)(j->file_bytes - off) : (size_t)chunk;
    s->job = (ckpt_job_t *)j;
    return MOE_STATUS_SUCCESS;
}

/* Host backend: each segment goes to the copy thread (copy.c), which fills it and hands it
 * to the writer; the save's fence entry lets a write of its tensors wait for that. */
static moe_status_t snapshot_host(moe_ckpt_t *ck, ckpt_job_t *j)
{
    if (j->file_bytes == 0) return MOE_STATUS_SUCCESS;
    MOE_TRY(ckpt_fence_add(ck, j, NULL, NULL));
    for (uint64_t off = 0; off < j->file_bytes; off += ck->cfg.chunk_bytes) {
        ckpt_seg_t *s = NULL;
        MOE_TRY(take_segment(ck, j, off, &s));
        pthread_mutex_lock(&ck->mu);
        s->next = NULL;
        if (ck->copy_tail)
            ck->copy_tail->next = s;
        else
            ck->copy_head = s;
        ck->copy_tail = s;
        j->segs_issued++;
        pthread_cond_broadcast(&ck->cv);
        pthread_mutex_unlock(&ck->mu);
    }
    return MOE_STATUS_SUCCESS;
}

/* CUDA backend: the copies are enqueued on the backend's copy stream after the work enqueued
 * before the save. When the state fits the staging budget, every segment is taken first and
 * the small pieces are copied ahead of the large ones (their own event: a write of a small
 * buffer waits microseconds); otherwise segment by segment, as staging frees up. Each segment
 * then goes to the writer with the event it waits for; a segment whose copies may have been
 * enqueued always does, failed or not (the writer waits for it before reusing it). */
static moe_status_t snapshot_device(moe_ckpt_t *ck, ckpt_job_t *j)
{
    const moe_backend_ops_t *ops = MOE_OPS(ck->rt);
    void *ctx = MOE_CTX(ck->rt);
    uint64_t chunk = ck->cfg.chunk_bytes;
    int32_t nseg = (int32_t)((j->file_bytes + chunk - 1) / chunk);
    if (nseg == 0) return MOE_STATUS_SUCCESS;
    bool together = nseg <= ck->max_segs;
    ckpt_seg_t **segs = calloc((size_t)(together ? nseg : 1), sizeof *segs);
    if (!segs) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "segment list of %d", nseg);
    void *small_ev = NULL, *full_ev = NULL;
    moe_status_t st = ops->snapshot_begin(ctx);
    if (together) {
        for (int32_t k = 0; k < nseg && st == MOE_STATUS_SUCCESS; k++)
            st = take_segment(ck, j, (uint64_t)k * chunk, &segs[k]);
        for (int32_t k = 0; k < nseg && segs[k] && st == MOE_STATUS_SUCCESS; k++)
            st = ckpt_fill_segment(ck, j, segs[k], CKPT_FILL_SMALL);
        if (st == MOE_STATUS_SUCCESS) st = ops->snapshot_mark(ctx, &small_ev);
        for (int32_t k = 0; k < nseg && segs[k]; k++) {
            if (st == MOE_STATUS_SUCCESS) st = ckpt_fill_segment(ck, j, segs[k], CKPT_FILL_LARGE);
            moe_status_t mst = ops->snapshot_mark(ctx, &segs[k]->event);
            if (st == MOE_STATUS_SUCCESS) st = mst;
            pthread_mutex_lock(&ck->mu);
            j->segs_issued++;
            ckpt_job_segment_ready_locked(ck, j, segs[k]);
            pthread_mutex_unlock(&ck->mu);
        }
    } else {
        for (int32_t k = 0; k < nseg && st == MOE_STATUS_SUCCESS; k++) {
            st = take_segment(ck, j, (uint64_t)k * chunk, &segs[0]);
            if (st != MOE_STATUS_SUCCESS) break;
            st = ckpt_fill_segment(ck, j, segs[0], CKPT_FILL_ALL);
            moe_status_t mst = ops->snapshot_mark(ctx, &segs[0]->event);
            if (st == MOE_STATUS_SUCCESS) st = mst;
            pthread_mutex_lock(&ck->mu);
            j->segs_issued++;
            ckpt_job_segment_ready_locked(ck, j, segs[0]);
            pthread_mutex_unlock(&ck->mu);
        }
    }
    free(segs);
    if (st == MOE_STATUS_SUCCESS) st = ops->snapshot_mark(ctx, &full_ev);
    if (st == MOE_STATUS_SUCCESS && !small_ev) st = ops->snapshot_mark(ctx, &small_ev);
    if (st == MOE_STATUS_SUCCESS) return ckpt_fence_add(ck, j, small_ev, full_ev);
    if (small_ev) ops->event_destroy(ctx, small_ev);
    if (full_ev) ops->event_destroy(ctx, full_ev);
    return st;
}

moe_status_t moe_ckpt_save_async(moe_ckpt_t *ck, int64_t step, const moe_ckpt_tensor_t *tensors,
                                 int32_t count)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    double t0 = moe_now_s();
    /* commit what every rank has made durable */
    MOE_TRY(ckpt_progress(ck, false, false, -1, false));
    ckpt_job_t *j = calloc(1, sizeof *j);
    if (!j) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "save job");
    moe_status_t st = save_checks(ck, step, tensors, count, j);
    if (st != MOE_STATUS_SUCCESS) {
        ck_pieces_free(j->pieces, j->npieces);
        j->pieces = NULL;
        j->npieces = 0;
        j->file_bytes = 0;
        if (ck->world == 1) {
            free(j);
            return st;
        }
        /* Several ranks: the others are saving this step, so take part anyway with a failed
         * job; the agreement then fails the step on every rank (nobody waits for ever). */
        enqueue_job(ck, j, step, t0, true);
        return st; /* moe_last_error() still holds the reason */
    }
    ck->last_saved_step = step;
    j->seq = ++ck->snap_seq;
    enqueue_job(ck, j, step, t0, false);
    st = ck->device_copies ? snapshot_device(ck, j) : snapshot_host(ck, j);
    pthread_mutex_lock(&ck->mu);
    j->issue_done = true;
    j->snap_failed = st != MOE_STATUS_SUCCESS;
    if (j->segs_ready == j->segs_issued) {
        j->all_queued = true;
        if (!ck->device_copies && j->seq > ck->copied_seq) ck->copied_seq = j->seq;
    }
    ck->st.last_stall_s = moe_now_s() - t0;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    if (st != MOE_STATUS_SUCCESS) return moe_error_wrap(st, "snapshot of step %" PRId64, step);
    return MOE_STATUS_SUCCESS;
}
