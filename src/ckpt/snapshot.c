/*
 * moe_ckpt_save_async, the training thread's side of a save: the checks, the job queued for
 * the writer thread (commit.c), and the snapshot: each chunk_bytes range of this rank's data
 * file copied (D2H or memcpy) into a staging segment (shard.c) and queued on the job.
 * save_async returns once every byte is staged, so the tensors are reusable while the write
 * goes on.
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
    MOE_CHECK_ARG(!ck_file_exists(mpath), "a complete checkpoint of step %" PRId64
                  " already exists in %s", step, ck->dir);
    MOE_TRY(ck_layout(tensors, count, ck->cfg.chunk_bytes, ck->rank, &j->pieces, &j->npieces,
                      &j->file_bytes));
    for (int32_t i = 0; i < j->npieces; i++)
        if (j->pieces[i].src_device == MOE_DEVICE_CUDA &&
            MOE_OPS(ck->rt)->device != MOE_DEVICE_CUDA)
            return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "tensor %s is on a CUDA device but the "
                            "runtime's backend is %s", j->pieces[i].name, MOE_OPS(ck->rt)->name);
    return MOE_STATUS_SUCCESS;
}

/* Appends j (of `step`, started at t0) to the jobs the writer thread takes in order. */
static void enqueue_job(moe_ckpt_t *ck, ckpt_job_t *j, int64_t step, double t0, bool failed)
{
    j->step = step;
    j->t_start = t0;
    j->all_queued = j->snap_failed = failed;
    pthread_mutex_lock(&ck->mu);
    if (ck->jobs_tail) ck->jobs_tail->next = j;
    else ck->jobs = j;
    ck->jobs_tail = j;
    ck->st.pending_saves++;
    if (!failed) ck->st.state = MOE_CKPT_WRITING;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
}

moe_status_t moe_ckpt_save_async(moe_ckpt_t *ck, int64_t step, const moe_ckpt_tensor_t *tensors,
                                 int32_t count)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
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
    enqueue_job(ck, j, step, t0, false);

    /* the snapshot: file range [k*chunk, (k+1)*chunk) goes through one segment */
    uint64_t chunk = ck->cfg.chunk_bytes;
    int32_t pi = 0;
    for (uint64_t off = 0; off < j->file_bytes && st == MOE_STATUS_SUCCESS; off += chunk) {
        ckpt_seg_t *s = NULL;
        st = ckpt_seg_acquire(ck, &s);
        if (st != MOE_STATUS_SUCCESS) break;
        s->off = off;
        s->len = j->file_bytes - off < chunk ? (size_t)(j->file_bytes - off) : (size_t)chunk;
        uint64_t pos = off, end = off + s->len;
        while (pi < j->npieces && j->pieces[pi].offset + j->pieces[pi].length <= off) pi++;
        for (int32_t k = pi; k < j->npieces && st == MOE_STATUS_SUCCESS; k++) {
            const ck_piece_t *p = &j->pieces[k];
            if (p->offset >= end) break;
            uint64_t a = p->offset > pos ? p->offset : pos;
            uint64_t b = p->offset + p->length < end ? p->offset + p->length : end;
            if (a > pos) memset(s->buf + (pos - off), 0, (size_t)(a - pos));
            if (b > a)
                st = MOE_OPS(ck->rt)->copy(MOE_CTX(ck->rt), s->buf + (a - off),
                                           p->src + (a - p->offset), (size_t)(b - a));
            if (b > pos) pos = b;
        }
        if (pos < end) memset(s->buf + (pos - off), 0, (size_t)(end - pos));
        if (st != MOE_STATUS_SUCCESS) {
            ckpt_seg_release(ck, s);
            break;
        }
        pthread_mutex_lock(&ck->mu);
        s->next = NULL;
        if (j->q_tail) j->q_tail->next = s;
        else j->q_head = s;
        j->q_tail = s;
        pthread_cond_broadcast(&ck->cv);
        pthread_mutex_unlock(&ck->mu);
    }
    pthread_mutex_lock(&ck->mu);
    j->all_queued = true;
    j->snap_failed = st != MOE_STATUS_SUCCESS;
    ck->st.last_stall_s = moe_now_s() - t0;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    if (st != MOE_STATUS_SUCCESS)
        return moe_error_wrap(st, "snapshot of step %" PRId64, step);
    return MOE_STATUS_SUCCESS;
}

