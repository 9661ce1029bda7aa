/*
 * The snapshot's copies and the fences that order later writes after them. save_async only
 * starts the copy of a save into its staging segments and returns:
 *   CUDA backend  the device pieces are copied on the backend's copy stream after the work
 *                 enqueued before the save (small pieces first, then the large ones, one
 *                 event per segment for the writer); host pieces are copied in the call.
 *   host backend  the copy thread here memcpy's each segment's pieces, in order.
 * Until a save's copy is done its tensors must not be written. Every save whose copy may
 * still run keeps a fence entry (the source ranges it reads, two events on CUDA); a write of
 * state goes through ckpt_fence_writes first (the runtime's fence, called by the optimizer
 * and the layer's expert-bias update, and moe_ckpt_fence for the caller): on CUDA the
 * runtime's stream waits for the events of the copies that read the range (the small
 * pieces' event where only small pieces overlap it), the host does not; on the host backend
 * the call blocks until the copy thread has copied that save.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "ckpt_internal.h"

/* ---- one segment's bytes --------------------------------------------------------------------- */

/* Copy into segment s the parts of job j's pieces that fall in its file range, those the
 * filter selects; CKPT_FILL_SMALL and CKPT_FILL_ALL also zero the gaps between pieces. Device
 * pieces go through the backend's snapshot_copy (enqueued), host pieces through memcpy. */
moe_status_t ckpt_fill_segment(moe_ckpt_t *ck, const ckpt_job_t *j, ckpt_seg_t *s,
                               ckpt_fill_t filter)
{
    uint64_t off = s->off, pos = off, end = off + s->len;
    bool zero = filter != CKPT_FILL_LARGE;
    for (int32_t k = 0; k < j->npieces; k++) {
        const ck_piece_t *p = &j->pieces[k];
        if (p->offset + p->length <= off) continue;
        if (p->offset >= end) break;
        uint64_t a = p->offset > pos ? p->offset : pos;
        uint64_t b = p->offset + p->length < end ? p->offset + p->length : end;
        if (zero && a > pos) memset(s->buf + (pos - off), 0, (size_t)(a - pos));
        bool small = p->length <= CKPT_SMALL_PIECE_BYTES;
        bool take = filter == CKPT_FILL_ALL || (filter == CKPT_FILL_SMALL) == small;
        if (take && b > a) {
            uint8_t *dst = s->buf + (a - off);
            const uint8_t *src = p->src + (a - p->offset);
            if (p->src_device == MOE_DEVICE_CUDA)
                MOE_TRY(MOE_OPS(ck->rt)->snapshot_copy(MOE_CTX(ck->rt), dst, src, (size_t)(b - a)));
            else
                memcpy(dst, src, (size_t)(b - a));
        }
        if (b > pos) pos = b;
    }
    if (zero && pos < end) memset(s->buf + (pos - off), 0, (size_t)(end - pos));
    return MOE_STATUS_SUCCESS;
}

/* ---- the copy thread (host backend) ---------------------------------------------------------- */

void ckpt_job_segment_ready_locked(moe_ckpt_t *ck, ckpt_job_t *j, ckpt_seg_t *s)
{
    s->next = NULL;
    if (j->q_tail)
        j->q_tail->next = s;
    else
        j->q_head = s;
    j->q_tail = s;
    j->segs_ready++;
    if (j->issue_done && j->segs_ready == j->segs_issued) {
        j->all_queued = true;
        if (!ck->device_copies && j->seq > ck->copied_seq) ck->copied_seq = j->seq;
    }
    pthread_cond_broadcast(&ck->cv);
}

void *ckpt_copier_main(void *arg)
{
    moe_ckpt_t *ck = arg;
    pthread_mutex_lock(&ck->mu);
    for (;;) {
        while (!ck->copy_head && !ck->stop) pthread_cond_wait(&ck->cv, &ck->mu);
        ckpt_seg_t *s = ck->copy_head;
        if (!s) break; /* stopping, and every queued segment is copied */
        ck->copy_head = s->next;
        if (!ck->copy_head) ck->copy_tail = NULL;
        pthread_mutex_unlock(&ck->mu);
        /* host memory only: memcpy cannot fail */
        (void)ckpt_fill_segment(ck, s->job, s, CKPT_FILL_ALL);
        pthread_mutex_lock(&ck->mu);
        ckpt_job_segment_ready_locked(ck, s->job, s);
    }
    pthread_mutex_unlock(&ck->mu);
    return NULL;
}

/* ---- fences ---------------------------------------------------------------------------------- */

static void fence_free(moe_ckpt_t *ck, ckpt_fence_t *f)
{
    const moe_backend_ops_t *ops = MOE_OPS(ck->rt);
    if (f->small_ev) ops->event_destroy(MOE_CTX(ck->rt), f->small_ev);
    if (f->full_ev) ops->event_destroy(MOE_CTX(ck->rt), f->full_ev);
    free(f->ranges);
}

moe_status_t ckpt_fence_add(moe_ckpt_t *ck, const ckpt_job_t *j, void *small_ev, void *full_ev)
{
    ckpt_fence_t f = {.seq = j->seq, .small_ev = small_ev, .full_ev = full_ev};
    f.ranges = malloc(sizeof *f.ranges * (size_t)(j->npieces > 0 ? j->npieces : 1));
    ckpt_fence_t *grown = realloc(ck->fences, sizeof *grown * (size_t)(ck->nfences + 1));
    if (grown) ck->fences = grown;
    if (!f.ranges || !grown) {
        fence_free(ck, &f);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "fence of step %" PRId64, j->step);
    }
    for (int32_t k = 0; k < j->npieces; k++) {
        const ck_piece_t *p = &j->pieces[k];
        /* on CUDA the host pieces were copied in the call: nothing to wait for */
        if (ck->device_copies && p->src_device != MOE_DEVICE_CUDA) continue;
        f.ranges[f.nranges++] = (ckpt_range_t){
            .src = p->src, .len = p->length, .small = p->length <= CKPT_SMALL_PIECE_BYTES};
    }
    ck->fences[ck->nfences++] = f;
    return MOE_STATUS_SUCCESS;
}

/* Drop the entries of saves whose copy is done (ck->copied_seq: set by the writer thread on
 * CUDA, by the copy thread on the host). Training thread. */
static void fence_prune(moe_ckpt_t *ck)
{
    pthread_mutex_lock(&ck->mu);
    int64_t done = ck->copied_seq;
    pthread_mutex_unlock(&ck->mu);
    int32_t n = 0;
    for (int32_t i = 0; i < ck->nfences; i++) {
        if (ck->fences[i].seq <= done)
            fence_free(ck, &ck->fences[i]);
        else
            ck->fences[n++] = ck->fences[i];
    }
    ck->nfences = n;
}

/* 0: the entry reads nothing of [data, data + bytes); 1: only small pieces of it; 2: more.
 * data NULL: everything the entry reads. */
static int fence_need(const ckpt_fence_t *f, const uint8_t *data, size_t bytes)
{
    int need = 0;
    for (int32_t i = 0; i < f->nranges && need < 2; i++) {
        const ckpt_range_t *r = &f->ranges[i];
        bool hit = !data || (r->src < data + bytes && data < r->src + r->len);
        int level = r->small ? 1 : 2;
        if (hit && level > need) need = level;
    }
    return need;
}

moe_status_t ckpt_fence_writes(void *arg, const void *data, size_t bytes)
{
    moe_ckpt_t *ck = arg;
    fence_prune(ck);
    const moe_backend_ops_t *ops = MOE_OPS(ck->rt);
    int64_t wait_seq = -1;
    for (int32_t i = 0; i < ck->nfences; i++) {
        const ckpt_fence_t *f = &ck->fences[i];
        int need = fence_need(f, data, bytes);
        if (need == 0) continue;
        if (!ck->device_copies)
            wait_seq = f->seq;
        else
            MOE_TRY(ops->event_fence(MOE_CTX(ck->rt), need == 1 ? f->small_ev : f->full_ev));
    }
    if (wait_seq < 0) return MOE_STATUS_SUCCESS;
    pthread_mutex_lock(&ck->mu);
    while (ck->copied_seq < wait_seq) pthread_cond_wait(&ck->cv, &ck->mu);
    pthread_mutex_unlock(&ck->mu);
    return MOE_STATUS_SUCCESS;
}

void ckpt_fences_free(moe_ckpt_t *ck)
{
    /* the pinned segments are freed next: no copy may still write them */
    if (ck->nfences > 0 && ck->device_copies)
        (void)MOE_OPS(ck->rt)->event_wait(MOE_CTX(ck->rt), ck->fences[ck->nfences - 1].full_ev);
    for (int32_t i = 0; i < ck->nfences; i++) fence_free(ck, &ck->fences[i]);
    free(ck->fences);
    ck->fences = NULL;
    ck->nfences = 0;
}

moe_status_t moe_ckpt_fence(moe_ckpt_t *ck)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    return ckpt_fence_writes(ck, NULL, 0);
}
