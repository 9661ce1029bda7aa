/*
 * The staging segments and the data file of one save, the writer thread's side: a segment is
 * taken from the free list (or allocated while under the pinned budget) by the snapshot
 * (snapshot.c), filled and queued on its job; the writer thread checksums each segment's
 * piece chunks, writes it (io_uring, O_DIRECT) and returns it to the free list, then fsyncs
 * and renames the data file.
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

#include "core/error.h"
#include "ckpt_internal.h"

/* ---- staging segments ---------------------------------------------------------------------- */

/* Take a free staging segment, allocating one while under budget, else waiting for the
 * writer to release one. */
moe_status_t ckpt_seg_acquire(moe_ckpt_t *ck, ckpt_seg_t **out)
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
void ckpt_seg_release(void *vck, void *vseg)
{
    moe_ckpt_t *ck = vck;
    ckpt_seg_t *s = vseg;
    pthread_mutex_lock(&ck->mu);
    s->next = ck->free_segs;
    ck->free_segs = s;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
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
         * concurrently the 8 GiB snapshot copied at 21 GB/s, deferred at 55 GB/s (the plain
         * D2H rate) for +0.2 s until durable. */
        pthread_mutex_lock(&ck->mu);
        while (!j->all_queued) pthread_cond_wait(&ck->cv, &ck->mu);
        ckpt_seg_t *last = j->q_tail;
        pthread_mutex_unlock(&ck->mu);
        if (last && last->event) /* the copy stream runs in order: the last is the whole copy */
            (void)MOE_OPS(ck->rt)->event_wait(MOE_CTX(ck->rt), last->event);
    }
    j->hs = XXH3_createState();
    if (!j->hs && st == MOE_STATUS_SUCCESS) st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "XXH3 state");
    ckpt_seg_t *s;
    while ((s = next_segment(ck, j)) != NULL) {
        /* CUDA: the segment's copies are done first (also before a failed job releases it) */
        if (s->event) {
            moe_status_t cst = MOE_OPS(ck->rt)->event_wait(MOE_CTX(ck->rt), s->event);
            if (cst != MOE_STATUS_SUCCESS && st == MOE_STATUS_SUCCESS)
                st = moe_error_wrap(cst, "the snapshot copy of step %" PRId64, j->step);
        }
        bool abort_now;
        pthread_mutex_lock(&ck->mu);
        abort_now = ck->aborting;
        pthread_mutex_unlock(&ck->mu);
        if (abort_now && st == MOE_STATUS_SUCCESS)
            st = MOE_FAIL(MOE_STATUS_ABORTED, "checkpointer aborted");
        if (st != MOE_STATUS_SUCCESS || j->snap_failed) {
            ckpt_seg_release(ck, s);
            continue;
        }
        if (!s->registered) {
            ck_writer_register(ck->w, s->slot, s->buf, ck->cfg.chunk_bytes);
            s->registered = true;
        }
        hash_segment(ck, j, s);
        size_t len = s->len;
        uint64_t off = s->off;
        st = ck_writer_write(ck->w, s->slot, s->buf, len, off, s, ckpt_seg_release, ck);
        if (st == MOE_STATUS_SUCCESS) {
            pthread_mutex_lock(&ck->mu);
            ck->st.bytes_written += len;
            pthread_mutex_unlock(&ck->mu);
        }
    }
    if (ck->device_copies) { /* every copy of the save is done: its fence entry may go */
        pthread_mutex_lock(&ck->mu);
        if (j->seq > ck->copied_seq) ck->copied_seq = j->seq;
        pthread_cond_broadcast(&ck->cv);
        pthread_mutex_unlock(&ck->mu);
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
