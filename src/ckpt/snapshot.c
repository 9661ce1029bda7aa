/*
 * The snapshot of one save through the pinned staging segments, both ends of their queue:
 * save_async on the training thread copies (D2H or memcpy) each chunk_bytes range of this
 * rank's data file into a free segment and queues it; the writer thread checksums each
 * segment's piece chunks, writes it (io_uring, O_DIRECT) and returns it to the free list,
 * then fsyncs and renames the data file. save_async returns once every byte is staged, so
 * the tensors are reusable while the write goes on.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "../core/clock.h"
#include "../core/error.h"
#include "ckpt_internal.h"

/* ---- staging segments ---------------------------------------------------------------------- */

/* Take a free staging segment, allocating one while under budget, else waiting for the
 * writer to release one. */
static moe_status_t seg_acquire(moe_ckpt_t *ck, ckpt_seg_t **out)
{
    pthread_mutex_lock(&ck->mu);
    for (;;) {
        if (ck->free_segs) {
            ckpt_seg_t *s = ck->free_segs;
            ck->free_segs = s->next;
            pthread_mutex_unlock(&ck->mu);
            *out = s;
            return MOE_STATUS_SUCCESS;
        }
        if (ck->nsegs < ck->max_segs) {
            ckpt_seg_t *s = &ck->segs[ck->nsegs];
            pthread_mutex_unlock(&ck->mu);
            MOE_TRY(MOE_OPS(ck->rt)->alloc_pinned(MOE_CTX(ck->rt), ck->cfg.chunk_bytes,
                                                   (void **)&s->buf));
            if (((uintptr_t)s->buf & (CK_ALIGN - 1)) != 0) {
                MOE_OPS(ck->rt)->free_pinned(MOE_CTX(ck->rt), s->buf);
                s->buf = NULL;
                return MOE_FAIL(MOE_STATUS_INTERNAL, "pinned staging buffer is not 4096-aligned");
            }
            pthread_mutex_lock(&ck->mu);
            s->slot = ck->nsegs++;
            pthread_mutex_unlock(&ck->mu);
            *out = s;
            return MOE_STATUS_SUCCESS;
        }
        pthread_cond_wait(&ck->cv, &ck->mu);
    }
}

/* Return a segment to the free list: the writer's completion callback (ck, segment). */
static void seg_release(void *vck, void *vseg)
{
    moe_ckpt_t *ck = vck;
    ckpt_seg_t *s = vseg;
    pthread_mutex_lock(&ck->mu);
    s->next = ck->free_segs;
    ck->free_segs = s;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
}

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
        st = seg_acquire(ck, &s);
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
        pthread_mutex_lock(&ck->mu);
        s->next = NULL;
        if (st != MOE_STATUS_SUCCESS) {
            s->next = ck->free_segs;
            ck->free_segs = s;
        } else {
            if (j->q_tail) j->q_tail->next = s;
            else j->q_head = s;
            j->q_tail = s;
        }
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

/* ---- the writer thread: the data file ------------------------------------------------------ */

/* Feed a segment's bytes to the per-chunk checksums of the pieces it overlaps. Segments of a
 * job arrive in file order, so one streaming state per job suffices. */
static void hash_segment(moe_ckpt_t *ck, ckpt_job_t *j, const ckpt_seg_t *s)
{
    uint64_t chunk = ck->cfg.chunk_bytes;
    uint64_t lo = s->off, hi = s->off + s->len;
    while (j->hp < j->npieces) {
        ck_piece_t *p = &j->pieces[j->hp];
        uint64_t pe = p->offset + p->length;
        if (p->length == 0 || pe <= lo) {
            j->hp++;
            continue;
        }
        if (p->offset >= hi) break;
        uint64_t a = p->offset > lo ? p->offset : lo;
        uint64_t b = pe < hi ? pe : hi;
        while (a < b) {
            uint64_t rel = a - p->offset;
            uint64_t c = rel / chunk, cend = p->offset + (c + 1) * chunk;
            if (cend > pe) cend = pe;
            uint64_t e = cend < b ? cend : b;
            if (rel % chunk == 0) XXH3_64bits_reset(j->hs);
            XXH3_64bits_update(j->hs, s->buf + (a - s->off), (size_t)(e - a));
            if (e == cend) p->xxh[c] = XXH3_64bits_digest(j->hs);
            a = e;
        }
        if (pe <= hi) {
            j->hp++;
            continue;
        }
        break;
    }
}

/* Wait for the next filled segment of job j; NULL once the job has no more. While none is
 * ready, completions of writes in flight are reaped: they free the segments save_async may
 * be waiting for. */
static ckpt_seg_t *next_segment(moe_ckpt_t *ck, ckpt_job_t *j)
{
    for (;;) {
        pthread_mutex_lock(&ck->mu);
        if (j->q_head || j->all_queued) {
            ckpt_seg_t *s = j->q_head;
            if (s) {
                j->q_head = s->next;
                if (!j->q_head) j->q_tail = NULL;
            }
            pthread_mutex_unlock(&ck->mu);
            return s;
        }
        if (!ck_writer_pending(ck->w)) {
            while (!j->q_head && !j->all_queued) pthread_cond_wait(&ck->cv, &ck->mu);
            pthread_mutex_unlock(&ck->mu);
            continue;
        }
        pthread_mutex_unlock(&ck->mu);
        ck_writer_reap_one(ck->w);
    }
}

moe_status_t ckpt_write_job(moe_ckpt_t *ck, ckpt_job_t *j, char *stepdir, char **pieces_json)
{
    moe_status_t st = MOE_STATUS_SUCCESS;
    char tmp[PATH_MAX + 64], fin[PATH_MAX + 64], name[32];
    ck_rank_filename(ck->rank, name, sizeof name);
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", stepdir, name);
    snprintf(fin, sizeof fin, "%s/%s", stepdir, name);
    bool opened = false;
    if (j->snap_failed && j->npieces == 0) /* a placeholder for a save refused at once */
        return MOE_FAIL(MOE_STATUS_ABORTED, "the save of step %" PRId64 " was refused", j->step);
    if (mkdir(stepdir, 0755) != 0 && errno != EEXIST) {
        st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "mkdir(%s)", stepdir);
    } else {
        st = ck_fsync_dir(ck->dir);
        if (st == MOE_STATUS_SUCCESS) st = ck_writer_open(ck->w, tmp);
        opened = st == MOE_STATUS_SUCCESS;
    }
    if (ck->defer_writer && j->file_bytes <= (uint64_t)ck->max_segs * ck->cfg.chunk_bytes) {
        /* The whole state fits in staging: start hashing and writing only once the snapshot is
         * complete. Measured on an H200 host (bench/results/): with the writer running
         * concurrently the 8 GiB snapshot stalled 0.40 s (median; D2H at 21 GB/s), deferred it
         * stalled 0.156 s (55 GB/s, the plain D2H rate) for +0.2 s until durable. */
        pthread_mutex_lock(&ck->mu);
        while (!j->all_queued) pthread_cond_wait(&ck->cv, &ck->mu);
        pthread_mutex_unlock(&ck->mu);
    }
    j->hs = XXH3_createState();
    if (!j->hs && st == MOE_STATUS_SUCCESS) st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "XXH3 state");
    ckpt_seg_t *s;
    while ((s = next_segment(ck, j)) != NULL) {
        bool abort_now;
        pthread_mutex_lock(&ck->mu);
        abort_now = ck->aborting;
        pthread_mutex_unlock(&ck->mu);
        if (abort_now && st == MOE_STATUS_SUCCESS)
            st = MOE_FAIL(MOE_STATUS_ABORTED, "checkpointer aborted");
        if (st != MOE_STATUS_SUCCESS || j->snap_failed) {
            seg_release(ck, s);
            continue;
        }
        if (!s->registered) {
            ck_writer_register(ck->w, s->slot, s->buf, ck->cfg.chunk_bytes);
            s->registered = true;
        }
        hash_segment(ck, j, s);
        size_t len = s->len;
        uint64_t off = s->off;
        st = ck_writer_write(ck->w, s->slot, s->buf, len, off, s, seg_release, ck);
        if (st == MOE_STATUS_SUCCESS) {
            pthread_mutex_lock(&ck->mu);
            ck->st.bytes_written += len;
            pthread_mutex_unlock(&ck->mu);
        }
    }
    if (j->snap_failed && st == MOE_STATUS_SUCCESS)
        st = MOE_FAIL(MOE_STATUS_ABORTED, "the snapshot of step %" PRId64 " failed", j->step);
    if (opened) {
        if (st == MOE_STATUS_SUCCESS) {
            st = ck_writer_finish(ck->w);
        } else {
            ck_writer_cancel(ck->w);
        }
        pthread_mutex_lock(&ck->mu);
        ck->st.direct_io = ck_writer_direct(ck->w);
        pthread_mutex_unlock(&ck->mu);
    }
    if (st == MOE_STATUS_SUCCESS && rename(tmp, fin) != 0)
        st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "rename(%s)", tmp);
    if (st == MOE_STATUS_SUCCESS) st = ck_fsync_dir(stepdir);
    if (st != MOE_STATUS_SUCCESS && opened) unlink(tmp);
    if (st == MOE_STATUS_SUCCESS) {
        *pieces_json = ck_pieces_to_json(j->step, ck->cfg.chunk_bytes, j->pieces, j->npieces);
        if (!*pieces_json) st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "piece list");
    }
    return st;
}

void ckpt_job_free(ckpt_job_t *j)
{
    ck_pieces_free(j->pieces, j->npieces);
    if (j->hs) XXH3_freeState(j->hs);
    free(j->mine);
    free(j);
}
