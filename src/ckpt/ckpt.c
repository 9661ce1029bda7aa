/*
 * The checkpointer: the public API, the snapshot into pinned staging segments, the writer
 * thread (one data file per rank), the commit (agreement + rank 0's manifest), the S3 mirror
 * thread, retention, listing and load with fallback.
 *
 * Data flow of one save (rank r, step N):
 *   save_async (training thread)          writer thread                    S3 thread
 *   layout pieces in rank-r.bin  ------>  open step-N/rank-r.bin.tmp
 *   for each chunk_bytes range:           (state fits the budget: wait
 *     take a free pinned segment            for the whole snapshot)
 *     D2H / memcpy the bytes in   ------>  for each filled segment:
 *   return (tensors reusable)               XXH3 of each piece chunk, io_uring writes
 *                                           (O_DIRECT), segment back to the free list
 *                                         fsync, rename rank-r.bin, fsync dir
 *   commit_job: agree (allreduce MIN), gather piece lists, rank 0 writes manifest.json
 *   (tmp, fsync, rename, fsync); retention (rank 0, writer thread)   -->  upload rank-r.bin;
 *                                                                        manifest.json last
 * World of one: the writer thread runs commit_job and the S3 thread puts the manifest after
 * the shard. Several ranks: MPI is only called on the training thread (the communicator is
 * MPI_THREAD_SERIALIZED), so commit_job and the upload agreement run in progress(), inside
 * the collective calls (save_async, wait, load, destroy); rank 0's S3 thread then puts the
 * manifest.
 * Locking: one mutex + condition variable guard the queues, the free segments, the status and
 * the async error; the I/O itself runs unlocked.
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "../core/clock.h"
#include "../core/env.h"
#include "../core/error.h"
#include "../runtime/runtime.h"
#include "ckpt_internal.h"

#define MOE_MAGIC_CKPT 0x4d4f45434b505431ull /* "MOECKPT1" */

typedef struct seg {
    uint8_t *buf;
    int slot;
    bool registered;
    uint64_t off;          /* file offset of buf[0] */
    size_t len;
    struct seg *next;
} seg_t;

typedef struct job {
    int64_t step;
    ck_piece_t *pieces;
    int32_t npieces;
    uint64_t file_bytes;
    seg_t *q_head, *q_tail;   /* filled, waiting for the writer */
    bool all_queued, snap_failed;
    double t_start;
    struct job *next;
    /* checksum walk */
    int32_t hp;
    XXH3_state_t *hs;
    /* result of the local write, for the commit */
    bool local_ok;
    char *mine;               /* this rank's piece list (JSON) */
} job_t;

typedef struct upload {
    int64_t step;
    bool manifest_only;       /* rank 0, world > 1: the shards are up, put the manifest */
    bool ok;                  /* world > 1: this rank's shard upload succeeded */
    struct upload *next;
} upload_t;

struct moe_ckpt {
    uint64_t magic;
    moe_runtime_t *rt;
    const moe_logger_t *log;
    moe_ckpt_config_t cfg;
    char *dir;
    int rank, world;
    moe_comm_t *comm_w;             /* NULL in a world of one; used on the training thread */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    seg_t *segs;
    int max_segs, nsegs;
    seg_t *free_segs;
    job_t *jobs, *jobs_tail;        /* queued for the writer */
    job_t *done, *done_tail;        /* world > 1: durable here, not yet committed */
    upload_t *ups, *ups_tail;       /* queued for the S3 thread */
    upload_t *updone, *updone_tail; /* world > 1: shard uploaded (or failed), not yet agreed */
    bool retention_due;
    int64_t uploading_step, loading_step;
    bool stop, aborting;
    bool defer_writer;              /* see write_job; MOE_CKPT_DEFER_WRITER=0 turns it off */
    pthread_t writer_th, s3_th;
    bool writer_started, s3_started;

    ck_writer_t *w;
    ck_s3_t *s3;

    int64_t last_saved_step;
    moe_ckpt_status_t st;
    moe_status_t async_err;
    char async_msg[1024];
};

/* ---- small helpers ----------------------------------------------------------------------- */

/* Record a background failure (first one wins until reported). Caller holds no lock. */
static void set_async_error(moe_ckpt_t *ck, moe_status_t st, const char *what)
{
    pthread_mutex_lock(&ck->mu);
    if (ck->async_err == MOE_STATUS_SUCCESS) {
        ck->async_err = st;
        snprintf(ck->async_msg, sizeof ck->async_msg, "%s: %s", what, moe_last_error());
    }
    ck->st.state = MOE_CKPT_FAILED;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    moe_log(ck->log, MOE_LOG_ERROR, "checkpoint: %s: %s", what, moe_last_error());
}

/* Return and clear the pending async error as this thread's error. */
static moe_status_t take_async_error(moe_ckpt_t *ck)
{
    pthread_mutex_lock(&ck->mu);
    moe_status_t st = ck->async_err;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", ck->async_msg);
    ck->async_err = MOE_STATUS_SUCCESS;
    ck->async_msg[0] = 0;
    if (st != MOE_STATUS_SUCCESS && ck->st.state == MOE_CKPT_FAILED) ck->st.state = MOE_CKPT_IDLE;
    pthread_mutex_unlock(&ck->mu);
    if (st != MOE_STATUS_SUCCESS) return MOE_FAIL(st, "background checkpoint work failed: %s", msg);
    return MOE_STATUS_SUCCESS;
}

static void step_path(const moe_ckpt_t *ck, int64_t step, char *buf, size_t len)
{
    char name[64];
    ck_step_dirname(step, name, sizeof name);
    snprintf(buf, len, "%s/%s", ck->dir, name);
}

static bool file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* Complete local checkpoints (a step directory with manifest.json), ascending. */
static moe_status_t local_steps(const moe_ckpt_t *ck, int64_t **out, int32_t *n)
{
    *out = NULL;
    *n = 0;
    DIR *d = opendir(ck->dir);
    if (!d) return MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "opendir(%s)", ck->dir);
    int32_t cap = 16, cnt = 0;
    int64_t *v = malloc(sizeof *v * (size_t)cap);
    struct dirent *e;
    char path[PATH_MAX];
    while (v && (e = readdir(d)) != NULL) {
        int64_t step;
        if (!ck_parse_step_dirname(e->d_name, &step)) continue;
        snprintf(path, sizeof path, "%s/%s/%s", ck->dir, e->d_name, CK_MANIFEST);
        if (!file_exists(path)) continue;
        if (cnt == cap) {
            int64_t *nv = realloc(v, sizeof *v * (size_t)(cap *= 2));
            if (!nv) {
                free(v);
                v = NULL;
                break;
            }
            v = nv;
        }
        v[cnt++] = step;
    }
    closedir(d);
    if (!v) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "step list");
    qsort(v, (size_t)cnt, sizeof *v, ck_cmp_i64);
    *out = v;
    *n = cnt;
    return MOE_STATUS_SUCCESS;
}

/* ---- config -------------------------------------------------------------------------------- */

moe_ckpt_config_t moe_ckpt_config_default(void)
{
    moe_ckpt_config_t c = {
        .struct_size = sizeof c, .dir = NULL, .keep_last = 3, .chunk_bytes = 256u << 20,
        .pinned_budget_bytes = (size_t)2 << 30, .queue_depth = 8, .io_block_bytes = 8u << 20,
        .use_direct_io = 1, .s3_part_bytes = 64u << 20, .s3_parallel_parts = 4,
        .s3_max_retries = 6, .s3_retry_base_ms = 200, .s3_timeout_ms = 60000,
    };
    return c;
}

moe_ckpt_tensor_t moe_ckpt_tensor_whole(const char *name, const moe_tensor_t *t)
{
    moe_ckpt_tensor_t e;
    memset(&e, 0, sizeof e);
    e.name = name;
    if (t) e.tensor = *t;
    e.expert_dim = -1;
    return e;
}

/* ---- segments ------------------------------------------------------------------------------ */

/* Take a free staging segment, allocating one while under budget, else waiting for the
 * writer to release one. */
static moe_status_t seg_acquire(moe_ckpt_t *ck, seg_t **out)
{
    pthread_mutex_lock(&ck->mu);
    for (;;) {
        if (ck->free_segs) {
            seg_t *s = ck->free_segs;
            ck->free_segs = s->next;
            pthread_mutex_unlock(&ck->mu);
            *out = s;
            return MOE_STATUS_SUCCESS;
        }
        if (ck->nsegs < ck->max_segs) {
            seg_t *s = &ck->segs[ck->nsegs];
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

static void seg_release(void *vck, void *vseg)
{
    moe_ckpt_t *ck = vck;
    seg_t *s = vseg;
    pthread_mutex_lock(&ck->mu);
    s->next = ck->free_segs;
    ck->free_segs = s;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
}

/* ---- the writer thread ------------------------------------------------------------------- */

/* Feed a segment's bytes to the per-chunk checksums of the pieces it overlaps. Segments of a
 * job arrive in file order, so one streaming state per job suffices. */
static void hash_segment(moe_ckpt_t *ck, job_t *j, const seg_t *s)
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
static seg_t *next_segment(moe_ckpt_t *ck, job_t *j)
{
    for (;;) {
        pthread_mutex_lock(&ck->mu);
        if (j->q_head || j->all_queued) {
            seg_t *s = j->q_head;
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

/* Saves (and, with uploads, S3 uploads) still pending; the caller holds ck->mu. */
static bool busy_locked(const moe_ckpt_t *ck, bool uploads)
{
    return ck->st.pending_saves > 0 || (uploads && ck->st.pending_uploads > 0);
}

/* Every rank contributes v; *out gets their min or max (v itself without a communicator). */
static moe_status_t agree(moe_comm_t *c, int32_t v, moe_reduce_op_t op, int32_t *out)
{
    *out = v;
    if (!c) return MOE_STATUS_SUCCESS;
    return moe_comm_allreduce(c, &v, out, 1, MOE_COMM_I32, op);
}

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
        MOE_TRY(moe_comm_broadcast(c, hdr, 2, MOE_COMM_I64, r));
        char *buf = malloc((size_t)hdr[0]);
        if (!buf) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "pieces of rank %d", r);
        if (r == ck->rank) memcpy(buf, mine, (size_t)hdr[0]);
        moe_status_t st = moe_comm_broadcast(c, buf, (size_t)hdr[0], MOE_COMM_U8, r);
        if (st != MOE_STATUS_SUCCESS) {
            free(buf);
            return st;
        }
        if (ck->rank == 0) {
            all[r] = buf;
            bytes[r] = (uint64_t)hdr[1];
        } else {
            free(buf);
        }
    }
    return MOE_STATUS_SUCCESS;
}

static bool step_pinned_locked(const moe_ckpt_t *ck, int64_t step)
{
    if (step == ck->uploading_step || step == ck->loading_step) return true;
    for (const upload_t *u = ck->ups; u; u = u->next)
        if (u->step == step) return true;
    for (const job_t *j = ck->jobs; j; j = j->next)
        if (j->step == step) return true;
    for (const job_t *j = ck->done; j; j = j->next)
        if (j->step == step) return true;
    for (const upload_t *u = ck->updone; u; u = u->next)
        if (u->step == step) return true;
    return false;
}

/* Keep the newest keep_last complete checkpoints; remove older ones (manifest first, so a
 * half-deleted directory is never complete) and incomplete directories older than the newest
 * complete one. Steps being written, uploaded or loaded are skipped. Rank 0 only (the
 * directory is shared by the ranks). */
static void local_retention(moe_ckpt_t *ck)
{
    if (ck->rank != 0 || ck->cfg.keep_last <= 0) return;
    int64_t *steps;
    int32_t n;
    if (local_steps(ck, &steps, &n) != MOE_STATUS_SUCCESS) return;
    char path[PATH_MAX], mpath[PATH_MAX + 32];
    int64_t newest = n ? steps[n - 1] : -1;
    for (int32_t i = 0; i + ck->cfg.keep_last < n; i++) {
        pthread_mutex_lock(&ck->mu);
        bool pinned = step_pinned_locked(ck, steps[i]);
        pthread_mutex_unlock(&ck->mu);
        if (pinned) continue;
        step_path(ck, steps[i], path, sizeof path);
        snprintf(mpath, sizeof mpath, "%s/%s", path, CK_MANIFEST);
        if (unlink(mpath) != 0) continue;
        ck_fsync_dir(path);
        if (ck_rmtree(path) != MOE_STATUS_SUCCESS)
            moe_log(ck->log, MOE_LOG_WARN, "checkpoint: retention: %s", moe_last_error());
        else
            moe_log(ck->log, MOE_LOG_INFO, "checkpoint: retention removed step %" PRId64, steps[i]);
    }
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
        if (pinned || file_exists(mpath)) continue;
        ck_rmtree(path);
    }
    closedir(d);
    ck_fsync_dir(ck->dir);
}

static moe_status_t write_job(moe_ckpt_t *ck, job_t *j, char *stepdir, char **pieces_json)
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
    seg_t *s;
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
        *pieces_json = ck_pieces_to_json(j->pieces, j->npieces);
        if (!*pieces_json) st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "piece list");
    }
    return st;
}

/* Commit job j once every rank's shard is durable: the ranks agree (allreduce MIN of their
 * local results), rank 0 gathers the piece lists and writes manifest.json (temporary name,
 * fsync, rename, fsync), everyone learns the outcome. Collective over comm_w: in a world of
 * one the writer thread calls it; otherwise the training thread does, from progress(), so
 * that MPI is only ever called from the thread that also drives training (the MPI
 * communicator runs at MPI_THREAD_SERIALIZED). */
static void commit_job(moe_ckpt_t *ck, job_t *j)
{
    char stepdir[PATH_MAX];
    step_path(ck, j->step, stepdir, sizeof stepdir);
    /* every rank takes part in the agreement, failed or not, so nobody waits for ever */
    int32_t all_ok = 0;
    moe_status_t cst = agree(ck->comm_w, j->local_ok, MOE_REDUCE_MIN, &all_ok);
    if (cst != MOE_STATUS_SUCCESS) {
        set_async_error(ck, cst, "checkpoint agreement");
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
            gst = text ? ck_write_file_atomic(stepdir, CK_MANIFEST, text, strlen(text))
                       : MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "manifest text");
            if (gst == MOE_STATUS_SUCCESS) gst = ck_fsync_dir(ck->dir);
            free(text);
            committed = gst == MOE_STATUS_SUCCESS;
        }
        if (gst != MOE_STATUS_SUCCESS) set_async_error(ck, gst, "committing the checkpoint");
        for (int r = 0; all && r < ck->world; r++) free(all[r]);
        free(all);
        free(bytes);
        if (ck->comm_w) { /* everyone learns whether rank 0 committed */
            moe_status_t bst = moe_comm_broadcast(ck->comm_w, &committed, 1, MOE_COMM_I32, 0);
            if (bst != MOE_STATUS_SUCCESS) {
                set_async_error(ck, bst, "checkpoint commit broadcast");
                committed = 0;
            } else if (!committed && ck->rank != 0) { /* rank 0 has the cause */
                MOE_FAIL(MOE_STATUS_ABORTED, "rank 0 could not commit step %" PRId64, j->step);
                set_async_error(ck, MOE_STATUS_ABORTED, "committing the checkpoint");
            }
        }
    } else if (j->local_ok) {
        MOE_FAIL(MOE_STATUS_ABORTED, "another rank failed to write its shard of step %" PRId64,
                 j->step);
        set_async_error(ck, MOE_STATUS_ABORTED, "checkpoint agreement");
    }
    double t = moe_now_s();
    pthread_mutex_lock(&ck->mu);
    if (committed) {
        ck->st.last_committed_step = j->step;
        ck->st.last_durable_s = t - j->t_start;
        if (ck->s3) {
            upload_t *u = calloc(1, sizeof *u);
            if (u) {
                u->step = j->step;
                if (ck->ups_tail) ck->ups_tail->next = u;
                else ck->ups = u;
                ck->ups_tail = u;
                ck->st.pending_uploads++;
            }
        }
    }
    ck->retention_due = ck->rank == 0;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    if (committed)
        moe_log(ck->log, MOE_LOG_INFO, "checkpoint: step %" PRId64 " durable after %.3f s",
                j->step, t - j->t_start);
}

static void free_job(job_t *j)
{
    ck_pieces_free(j->pieces, j->npieces);
    if (j->hs) XXH3_freeState(j->hs);
    free(j->mine);
    free(j);
}

static void *writer_main(void *arg)
{
    moe_ckpt_t *ck = arg;
    for (;;) {
        pthread_mutex_lock(&ck->mu);
        while (!ck->jobs && !ck->stop && !ck->retention_due) pthread_cond_wait(&ck->cv, &ck->mu);
        job_t *j = ck->jobs;
        bool retention = ck->retention_due;
        ck->retention_due = false;
        pthread_mutex_unlock(&ck->mu);
        if (retention) local_retention(ck);
        if (!j) {
            if (retention) continue;
            break;
        }
        char stepdir[PATH_MAX];
        step_path(ck, j->step, stepdir, sizeof stepdir);
        moe_status_t st = write_job(ck, j, stepdir, &j->mine);
        /* a failed snapshot was already returned by save_async */
        if (st != MOE_STATUS_SUCCESS && !j->snap_failed)
            set_async_error(ck, st, "writing the local checkpoint");
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
        } else { /* durable here; committed by progress() on the training thread */
            if (ck->done_tail) ck->done_tail->next = j;
            else ck->done = j;
            ck->done_tail = j;
        }
        pthread_cond_broadcast(&ck->cv);
        pthread_mutex_unlock(&ck->mu);
        if (ck->world == 1) free_job(j);
    }
    return NULL;
}

/* ---- the S3 thread --------------------------------------------------------------------------- */

static moe_status_t put_step_file(moe_ckpt_t *ck, int64_t step, const char *file)
{
    char stepdir[PATH_MAX], name[64], local[PATH_MAX + 64];
    step_path(ck, step, stepdir, sizeof stepdir);
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
static void *s3_main(void *arg)
{
    moe_ckpt_t *ck = arg;
    for (;;) {
        pthread_mutex_lock(&ck->mu);
        while (!ck->ups && !ck->stop) pthread_cond_wait(&ck->cv, &ck->mu);
        upload_t *u = ck->ups;
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
        if (st != MOE_STATUS_SUCCESS) set_async_error(ck, st, "mirroring the checkpoint to S3");
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
        } else { /* the shard is up (or failed): the ranks agree in progress() */
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

/* ---- collective progress (world > 1), on the training thread ------------------------------ */

static int32_t list_len_jobs(const job_t *j)
{
    int32_t n = 0;
    for (; j; j = j->next) n++;
    return n;
}

static int32_t list_len_ups(const upload_t *u)
{
    int32_t n = 0;
    for (; u; u = u->next) n++;
    return n;
}

/* Commit the saves every rank has made durable and complete the uploads every rank has
 * finished (rank 0 then puts the manifest). With drain, repeat until nothing is pending on
 * any rank (saves, and uploads when asked) or timeout_ms passes on some rank. Collective. */
static moe_status_t progress(moe_ckpt_t *ck, bool drain, bool uploads, int64_t timeout_ms)
{
    if (ck->world == 1 || !ck->comm_w) return MOE_STATUS_SUCCESS;
    double t0 = moe_now_s();
    for (;;) {
        pthread_mutex_lock(&ck->mu);
        int32_t mine[2] = {list_len_jobs(ck->done), list_len_ups(ck->updone)}, mins[2];
        pthread_mutex_unlock(&ck->mu);
        MOE_TRY(moe_comm_allreduce(ck->comm_w, mine, mins, 2, MOE_COMM_I32, MOE_REDUCE_MIN));
        for (int32_t i = 0; i < mins[0]; i++) {
            pthread_mutex_lock(&ck->mu);
            job_t *j = ck->done;
            ck->done = j->next;
            if (!ck->done) ck->done_tail = NULL;
            pthread_mutex_unlock(&ck->mu);
            commit_job(ck, j);
            pthread_mutex_lock(&ck->mu);
            ck->st.pending_saves--;
            pthread_cond_broadcast(&ck->cv);
            pthread_mutex_unlock(&ck->mu);
            free_job(j);
        }
        for (int32_t i = 0; i < mins[1]; i++) {
            /* The upload stays at the head of updone through the agreement: retention, which
             * the writer thread may run meanwhile, spares the steps of the uploads it finds
             * queued, and this step's manifest is not uploaded yet. */
            pthread_mutex_lock(&ck->mu);
            upload_t *u = ck->updone;
            int32_t ok = u->ok;
            pthread_mutex_unlock(&ck->mu);
            int32_t all_ok = 0;
            moe_status_t st = agree(ck->comm_w, ok, MOE_REDUCE_MIN, &all_ok);
            if (st != MOE_STATUS_SUCCESS) return st; /* still queued, freed by destroy */
            if (!all_ok && ok) {
                MOE_FAIL(MOE_STATUS_REMOTE_ERROR, "another rank failed to upload its shard of "
                         "step %" PRId64, u->step);
                set_async_error(ck, MOE_STATUS_REMOTE_ERROR, "mirroring the checkpoint to S3");
            }
            pthread_mutex_lock(&ck->mu);
            ck->updone = u->next;
            if (!ck->updone) ck->updone_tail = NULL;
            u->next = NULL;
            if (all_ok && ck->rank == 0) { /* the remote commit */
                u->manifest_only = true;
                if (ck->ups_tail) ck->ups_tail->next = u;
                else ck->ups = u;
                ck->ups_tail = u;
                u = NULL;
            } else {
                if (all_ok) ck->st.last_uploaded_step = u->step;
                ck->st.pending_uploads--;
            }
            pthread_cond_broadcast(&ck->cv);
            pthread_mutex_unlock(&ck->mu);
            free(u);
        }
        if (!drain) return MOE_STATUS_SUCCESS;
        pthread_mutex_lock(&ck->mu);
        int32_t busy[2] = {busy_locked(ck, uploads),
                           timeout_ms >= 0 && (moe_now_s() - t0) * 1000.0 > (double)timeout_ms};
        pthread_mutex_unlock(&ck->mu);
        int32_t any[2];
        MOE_TRY(moe_comm_allreduce(ck->comm_w, busy, any, 2, MOE_COMM_I32, MOE_REDUCE_MAX));
        if (!any[0]) return MOE_STATUS_SUCCESS;
        if (any[1])
            return MOE_FAIL(MOE_STATUS_TIMEOUT, "checkpoint work still in progress after %" PRId64
                            " ms (on some rank)", timeout_ms);
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* ---- create / destroy ---------------------------------------------------------------------- */

static void free_handle(moe_ckpt_t *ck)
{
    if (ck->writer_started || ck->s3_started) {
        pthread_mutex_lock(&ck->mu);
        ck->stop = true;
        pthread_cond_broadcast(&ck->cv);
        pthread_mutex_unlock(&ck->mu);
        if (ck->writer_started) pthread_join(ck->writer_th, NULL);
        if (ck->s3_started) pthread_join(ck->s3_th, NULL);
    }
    ck_writer_destroy(ck->w);
    ck_s3_destroy(ck->s3);
    for (int i = 0; i < ck->nsegs; i++)
        if (ck->segs[i].buf) MOE_OPS(ck->rt)->free_pinned(MOE_CTX(ck->rt), ck->segs[i].buf);
    free(ck->segs);
    while (ck->ups) {
        upload_t *u = ck->ups;
        ck->ups = u->next;
        free(u);
    }
    while (ck->updone) {
        upload_t *u = ck->updone;
        ck->updone = u->next;
        free(u);
    }
    while (ck->done) { /* durable but never agreed on (abort): never committed */
        job_t *j = ck->done;
        ck->done = j->next;
        free_job(j);
    }
    moe_comm_destroy(ck->comm_w);
    pthread_mutex_destroy(&ck->mu);
    pthread_cond_destroy(&ck->cv);
    free(ck->dir);
    ck->magic = MOE_MAGIC_DEAD;
    free(ck);
}

static moe_status_t check_config(const moe_ckpt_config_t *c)
{
    MOE_CHECK_ARG(c->dir && *c->dir, "config.dir is required");
    MOE_CHECK_ARG(strlen(c->dir) < PATH_MAX - 128, "config.dir is too long");
    MOE_CHECK_ARG(c->chunk_bytes >= 65536 && c->chunk_bytes % CK_ALIGN == 0 &&
                      c->chunk_bytes <= ((size_t)1 << 30),
                  "chunk_bytes is %zu; it must be a multiple of 4096 in [64 KiB, 1 GiB]",
                  c->chunk_bytes);
    MOE_CHECK_ARG(c->pinned_budget_bytes >= 2 * c->chunk_bytes,
                  "pinned_budget_bytes %zu is less than two chunks (2 x %zu)",
                  c->pinned_budget_bytes, c->chunk_bytes);
    MOE_CHECK_ARG(c->queue_depth >= 1 && c->queue_depth <= 256, "queue_depth %d (1..256)",
                  c->queue_depth);
    MOE_CHECK_ARG(c->io_block_bytes >= CK_ALIGN && c->io_block_bytes % CK_ALIGN == 0 &&
                      c->io_block_bytes <= ((size_t)1 << 30),
                  "io_block_bytes %zu: a multiple of 4096 up to 1 GiB", c->io_block_bytes);
    if (c->s3_bucket) {
        MOE_CHECK_ARG(*c->s3_bucket && strlen(c->s3_bucket) <= 63 &&
                          strspn(c->s3_bucket, "abcdefghijklmnopqrstuvwxyz0123456789.-") ==
                              strlen(c->s3_bucket),
                      "s3_bucket \"%.80s\" is not a valid bucket name", c->s3_bucket);
        MOE_CHECK_ARG(ck_valid_prefix(c->s3_prefix),
                      "s3_prefix may hold only [A-Za-z0-9._/-] without . or .. components");
        MOE_CHECK_ARG(c->s3_part_bytes >= (5u << 20), "s3_part_bytes %zu < 5 MiB",
                      c->s3_part_bytes);
        MOE_CHECK_ARG(c->s3_parallel_parts >= 1 && c->s3_parallel_parts <= 64,
                      "s3_parallel_parts %d (1..64)", c->s3_parallel_parts);
        MOE_CHECK_ARG(c->s3_max_retries >= 0 && c->s3_max_retries <= 30,
                      "s3_max_retries %d (0..30)", c->s3_max_retries);
        MOE_CHECK_ARG(c->s3_retry_base_ms >= 1 && c->s3_timeout_ms >= 100,
                      "s3_retry_base_ms %d / s3_timeout_ms %d too small", c->s3_retry_base_ms,
                      c->s3_timeout_ms);
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_ckpt_create(moe_runtime_t *rt, const moe_ckpt_config_t *config, moe_ckpt_t **out)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(config != NULL, "config is NULL (config.dir is required)");
    MOE_CHECK_STRUCT_SIZE(config, moe_ckpt_config_t, sizeof(moe_ckpt_config_t));
    moe_ckpt_config_t c = *config;
    c.chunk_bytes = moe_env_positive("MOE_CKPT_CHUNK_BYTES", c.chunk_bytes, &rt->logger);
    c.pinned_budget_bytes =
        moe_env_positive("MOE_CKPT_PINNED_BYTES", c.pinned_budget_bytes, &rt->logger);
    MOE_TRY(check_config(&c));

    moe_ckpt_t *ck = calloc(1, sizeof *ck);
    if (!ck) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "checkpointer");
    ck->rt = rt;
    ck->log = &rt->logger;
    ck->cfg = c;
    ck->cfg.dir = NULL;
    /* the caller's strings are not kept: the S3 client copied what it needs */
    ck->cfg.s3_endpoint = ck->cfg.s3_bucket = ck->cfg.s3_prefix = ck->cfg.s3_region = NULL;
    ck->cfg.s3_access_key = ck->cfg.s3_secret_key = ck->cfg.s3_session_token = NULL;
    ck->dir = strdup(c.dir);
    pthread_mutex_init(&ck->mu, NULL);
    pthread_cond_init(&ck->cv, NULL);
    ck->rank = rt->mesh->world_rank;
    ck->world = rt->mesh->world_size;
    ck->uploading_step = ck->loading_step = -1;
    ck->last_saved_step = -1;
    ck->st.struct_size = sizeof ck->st;
    ck->st.last_committed_step = ck->st.last_uploaded_step = -1;
    ck->st.direct_io = c.use_direct_io != 0;
    ck->max_segs = (int)(c.pinned_budget_bytes / c.chunk_bytes);
    ck->defer_writer = !(getenv("MOE_CKPT_DEFER_WRITER") && getenv("MOE_CKPT_DEFER_WRITER")[0] == '0');
    ck->segs = calloc((size_t)ck->max_segs, sizeof *ck->segs);
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!ck->dir || !ck->segs) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "checkpointer tables");
        goto fail;
    }
    /* the directory: created here and probed for writing, so a bad path fails now */
    st = ck_mkdir_p(ck->dir);
    if (st == MOE_STATUS_SUCCESS) {
        char probe[PATH_MAX];
        snprintf(probe, sizeof probe, "%s/.probe-%d-%d", ck->dir, ck->rank, (int)getpid());
        FILE *f = fopen(probe, "w");
        if (!f)
            st = MOE_FAIL(MOE_STATUS_IO_ERROR, "checkpoint directory %s is not writable: %s",
                          ck->dir, strerror(errno));
        else {
            fclose(f);
            unlink(probe);
        }
    }
    int32_t all_ok;
    /* host[]: MPI over host buffers (comm[] may be NCCL on device buffers) */
    moe_comm_t *world = rt->mesh->host[MOE_AXIS_WORLD];
    if (world) {
        moe_status_t cst = agree(world, st == MOE_STATUS_SUCCESS, MOE_REDUCE_MIN, &all_ok);
        if (cst != MOE_STATUS_SUCCESS) st = cst;
        if (st == MOE_STATUS_SUCCESS && !all_ok)
            st = MOE_FAIL(MOE_STATUS_IO_ERROR, "another rank could not use its checkpoint "
                          "directory");
        if (st == MOE_STATUS_SUCCESS)
            st = world->ops->split(world, 0, ck->rank, "ckpt", &ck->comm_w);
    }
    if (st != MOE_STATUS_SUCCESS) goto fail;
    MOE_TRY_GOTO(st, ck_writer_create(c.queue_depth, c.io_block_bytes, c.use_direct_io != 0,
                                      ck->log, &ck->w));
    if (c.s3_bucket) {
        MOE_TRY_GOTO(st, ck_s3_create(&c, ck->log, &ck->s3));
        moe_status_t bst = ck_s3_check_bucket(ck->s3);
        if (bst == MOE_STATUS_TIMEOUT)
            moe_log(ck->log, MOE_LOG_WARN, "checkpoint: S3 is unreachable now (%s); the mirror "
                    "will retry", moe_last_error());
        else if (bst != MOE_STATUS_SUCCESS) {
            st = bst;
            goto fail;
        }
    }
    MOE_CHECK_PTHREAD_GOTO(st, pthread_create(&ck->writer_th, NULL, writer_main, ck),
                           MOE_STATUS_INTERNAL);
    ck->writer_started = true;
    if (ck->s3) {
        MOE_CHECK_PTHREAD_GOTO(st, pthread_create(&ck->s3_th, NULL, s3_main, ck),
                               MOE_STATUS_INTERNAL);
        ck->s3_started = true;
    }
    ck->magic = MOE_MAGIC_CKPT;
    *out = ck;
    return MOE_STATUS_SUCCESS;
fail:
    free_handle(ck);
    return st;
}

static moe_status_t wait_idle(moe_ckpt_t *ck, bool uploads, int64_t timeout_ms)
{
    if (ck->world > 1) {
        MOE_TRY(progress(ck, true, uploads, timeout_ms));
        return take_async_error(ck);
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    if (timeout_ms >= 0) {
        dl.tv_sec += timeout_ms / 1000;
        dl.tv_nsec += (timeout_ms % 1000) * 1000000;
        if (dl.tv_nsec >= 1000000000) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000;
        }
    }
    pthread_mutex_lock(&ck->mu);
    while (ck->async_err == MOE_STATUS_SUCCESS &&
           busy_locked(ck, uploads)) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&ck->cv, &ck->mu);
        } else if (pthread_cond_timedwait(&ck->cv, &ck->mu, &dl) == ETIMEDOUT) {
            bool busy = busy_locked(ck, uploads);
            pthread_mutex_unlock(&ck->mu);
            if (busy)
                return MOE_FAIL(MOE_STATUS_TIMEOUT, "checkpoint work still in progress after "
                                "%" PRId64 " ms", timeout_ms);
            pthread_mutex_lock(&ck->mu);
        }
    }
    pthread_mutex_unlock(&ck->mu);
    return take_async_error(ck);
}

/* Wait until every queued save is committed (or failed), without taking the async error. */
static moe_status_t drain_saves(moe_ckpt_t *ck)
{
    if (ck->world > 1) return progress(ck, true, false, -1);
    pthread_mutex_lock(&ck->mu);
    while (ck->st.pending_saves > 0) pthread_cond_wait(&ck->cv, &ck->mu);
    pthread_mutex_unlock(&ck->mu);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_ckpt_destroy(moe_ckpt_t *ck)
{
    moe_error_clear();
    if (!ck) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    /* drain everything; an error is reported but does not stop the drain */
    moe_status_t st = MOE_STATUS_SUCCESS;
    for (int i = 0; i < 1000; i++) {
        moe_status_t s = wait_idle(ck, true, -1);
        if (s == MOE_STATUS_SUCCESS) break;
        if (st == MOE_STATUS_SUCCESS) st = s;
        /* peers gone; or several ranks, whose collective drain has drained everything (another
         * would wait for ranks that had nothing to report and have left) */
        if (s == MOE_STATUS_COMM_ERROR || s == MOE_STATUS_TIMEOUT || ck->world > 1) break;
    }
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moe_last_error());
    free_handle(ck);
    if (st != MOE_STATUS_SUCCESS) return MOE_FAIL(st, "%s", msg);
    return MOE_STATUS_SUCCESS;
}

void moe_ckpt_abort(moe_ckpt_t *ck)
{
    if (!ck || ck->magic != MOE_MAGIC_CKPT) return;
    pthread_mutex_lock(&ck->mu);
    ck->aborting = true;
    while (ck->ups) { /* queued uploads are dropped */
        upload_t *u = ck->ups;
        ck->ups = u->next;
        ck->st.pending_uploads--;
        free(u);
    }
    ck->ups_tail = NULL;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    if (ck->s3) ck_s3_cancel(ck->s3);
    free_handle(ck);
}

/* ---- save ------------------------------------------------------------------------------------ */

/* Everything save_async checks before the snapshot; fills j's layout. */
static moe_status_t save_checks(moe_ckpt_t *ck, int64_t step, const moe_ckpt_tensor_t *tensors,
                                int32_t count, job_t *j)
{
    MOE_TRY(take_async_error(ck));
    MOE_CHECK_ARG(step >= 0, "step is %" PRId64 "; it must be >= 0", step);
    MOE_CHECK_ARG(step > ck->last_saved_step,
                  "step %" PRId64 " is not greater than the last saved step %" PRId64, step,
                  ck->last_saved_step);
    char stepdir[PATH_MAX], mpath[PATH_MAX + 32];
    step_path(ck, step, stepdir, sizeof stepdir);
    snprintf(mpath, sizeof mpath, "%s/%s", stepdir, CK_MANIFEST);
    MOE_CHECK_ARG(!file_exists(mpath), "a complete checkpoint of step %" PRId64
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
static void enqueue_job(moe_ckpt_t *ck, job_t *j, int64_t step, double t0, bool failed)
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
    MOE_TRY(progress(ck, false, false, -1)); /* commit what every rank has made durable */
    job_t *j = calloc(1, sizeof *j);
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
        seg_t *s = NULL;
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

/* ---- progress -------------------------------------------------------------------------------- */

moe_status_t moe_ckpt_status(moe_ckpt_t *ck, moe_ckpt_status_t *status)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_ARG(status != NULL, "status is NULL");
    MOE_CHECK_STRUCT_SIZE(status, moe_ckpt_status_t, sizeof(moe_ckpt_status_t));
    pthread_mutex_lock(&ck->mu);
    moe_ckpt_status_t s = ck->st;
    if (ck->async_err != MOE_STATUS_SUCCESS) s.state = MOE_CKPT_FAILED;
    else if (s.pending_saves > 0) s.state = MOE_CKPT_WRITING;
    else if (s.pending_uploads > 0) s.state = MOE_CKPT_UPLOADING;
    else s.state = MOE_CKPT_IDLE;
    pthread_mutex_unlock(&ck->mu);
    s.struct_size = status->struct_size;
    memcpy(status, &s, status->struct_size < sizeof s ? status->struct_size : sizeof s);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_ckpt_poll(moe_ckpt_t *ck, int include_uploads)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_TRY(take_async_error(ck));
    pthread_mutex_lock(&ck->mu);
    bool busy = busy_locked(ck, include_uploads);
    pthread_mutex_unlock(&ck->mu);
    return busy ? MOE_STATUS_IN_PROGRESS : MOE_STATUS_SUCCESS;
}

moe_status_t moe_ckpt_wait(moe_ckpt_t *ck, int include_uploads, int64_t timeout_ms)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    return wait_idle(ck, include_uploads != 0, timeout_ms);
}

moe_status_t moe_ckpt_get_async_error(moe_ckpt_t *ck, char *message, size_t message_len)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    pthread_mutex_lock(&ck->mu);
    moe_status_t st = ck->async_err;
    if (message && message_len) snprintf(message, message_len, "%s", ck->async_msg);
    pthread_mutex_unlock(&ck->mu);
    return st;
}

/* ---- list ------------------------------------------------------------------------------------ */

moe_status_t moe_ckpt_list(moe_ckpt_t *ck, moe_ckpt_tier_t tier, int64_t *steps, int32_t capacity,
                           int32_t *count)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_ARG(count != NULL, "count is NULL");
    MOE_CHECK_ARG(capacity >= 0 && (capacity == 0 || steps != NULL), "steps/capacity invalid");
    MOE_CHECK_ARG(tier == MOE_CKPT_TIER_LOCAL || tier == MOE_CKPT_TIER_S3, "unknown tier %d",
                  (int)tier);
    int64_t *v = NULL;
    int32_t n = 0;
    if (tier == MOE_CKPT_TIER_LOCAL) {
        MOE_TRY(local_steps(ck, &v, &n));
    } else {
        if (!ck->s3) return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "no S3 tier is configured");
        MOE_TRY(ck_s3_list_steps(ck->s3, &v, &n, 1));
    }
    int32_t first = n > capacity ? n - capacity : 0;
    for (int32_t i = first; i < n; i++) steps[i - first] = v[i];
    *count = n;
    free(v);
    return MOE_STATUS_SUCCESS;
}

/* ---- load ------------------------------------------------------------------------------------ */

/* Severity of a load failure: 0 ok, 1 the checkpoint is bad (fall back), 2 the request is bad. */
static int32_t severity(moe_status_t st)
{
    if (st == MOE_STATUS_SUCCESS) return 0;
    if (st == MOE_STATUS_INVALID_ARGUMENT || st == MOE_STATUS_OUT_OF_MEMORY ||
        st == MOE_STATUS_BACKEND_ERROR || st == MOE_STATUS_UNSUPPORTED)
        return 2;
    return 1;
}

/* Rank 0: fetch step from S3 into a hidden directory, then swap it in for the local copy. */
static moe_status_t restore_from_s3(moe_ckpt_t *ck, int64_t step)
{
    char name[64], tmpdir[PATH_MAX], bad[PATH_MAX], fin[PATH_MAX], lp[PATH_MAX + 300];
    ck_step_dirname(step, name, sizeof name);
    snprintf(tmpdir, sizeof tmpdir, "%s/.restore-%s", ck->dir, name);
    snprintf(bad, sizeof bad, "%s/.bad-%s", ck->dir, name);
    step_path(ck, step, fin, sizeof fin);
    ck_rmtree(tmpdir);
    MOE_CHECK_ERRNO_MSG(mkdir(tmpdir, 0755), MOE_STATUS_IO_ERROR, "mkdir(%s)", tmpdir);
    snprintf(lp, sizeof lp, "%s/%s", tmpdir, CK_MANIFEST);
    moe_status_t st = ck_s3_get_file(ck->s3, name, CK_MANIFEST, lp);
    ck_manifest_t m = {0};
    if (st == MOE_STATUS_SUCCESS) st = ck_manifest_read(tmpdir, &m);
    for (int32_t i = 0; st == MOE_STATUS_SUCCESS && i < m.nfiles; i++) {
        snprintf(lp, sizeof lp, "%s/%s", tmpdir, m.files[i].path);
        st = ck_s3_get_file(ck->s3, name, m.files[i].path, lp);
    }
    ck_manifest_free(&m);
    if (st == MOE_STATUS_SUCCESS) st = ck_fsync_dir(tmpdir);
    if (st != MOE_STATUS_SUCCESS) goto fail;
    ck_rmtree(bad);
    if (rename(fin, bad) != 0 && errno != ENOENT) {
        st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "rename(%s)", fin);
        goto fail;
    }
    MOE_CHECK_ERRNO_MSG_GOTO(st, rename(tmpdir, fin), MOE_STATUS_IO_ERROR, "rename(%s)", tmpdir);
    ck_fsync_dir(ck->dir);
    ck_rmtree(bad);
    moe_log(ck->log, MOE_LOG_WARN, "checkpoint: step %" PRId64 " restored from S3", step);
    return MOE_STATUS_SUCCESS;
fail:
    ck_rmtree(tmpdir);
    return st;
}

/* Every rank loads `step` from stepdir and all agree on the worst severity (collective).
 * Success only if every rank loaded; else this rank's error, or a stand-in where only another
 * rank failed. *sev: the agreed severity (2 when the agreement itself failed). */
static moe_status_t load_agreed(moe_ckpt_t *ck, const char *stepdir, int64_t step,
                                const moe_ckpt_tensor_t *t, int32_t count, int32_t *sev)
{
    moe_status_t st = ck_load_dir(ck->rt, stepdir, step, t, count);
    moe_status_t cs = agree(ck->comm_w, severity(st), MOE_REDUCE_MAX, sev);
    if (cs != MOE_STATUS_SUCCESS) {
        *sev = 2;
        return cs;
    }
    if (*sev == 0) return MOE_STATUS_SUCCESS;
    if (st == MOE_STATUS_SUCCESS)
        st = MOE_FAIL(*sev == 2 ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_CORRUPT,
                      "another rank could not load step %" PRId64, step);
    return st;
}

/* Try one step: local, then (if it fails for a reason of the checkpoint) the S3 copy.
 * Collective. Returns the agreed result. */
static moe_status_t try_step(moe_ckpt_t *ck, int64_t step, bool on_s3,
                             const moe_ckpt_tensor_t *t, int32_t count)
{
    char stepdir[PATH_MAX];
    step_path(ck, step, stepdir, sizeof stepdir);
    int32_t sev;
    moe_status_t st = load_agreed(ck, stepdir, step, t, count, &sev);
    if (st == MOE_STATUS_SUCCESS || sev == 2) return st;
    moe_log(ck->log, st == MOE_STATUS_NOT_FOUND ? MOE_LOG_INFO : MOE_LOG_WARN,
            "checkpoint: local step %" PRId64 " unusable: %s%s", step, moe_last_error(),
            on_s3 ? "; trying its S3 copy" : "; falling back");
    if (!on_s3) return st;
    int32_t ok = 1;
    if (ck->rank == 0) {
        moe_status_t rs = restore_from_s3(ck, step);
        if (rs != MOE_STATUS_SUCCESS) {
            moe_log(ck->log, MOE_LOG_WARN, "checkpoint: S3 copy of step %" PRId64
                    " unusable: %s; falling back", step, moe_last_error());
            ok = 0;
        }
    }
    if (ck->comm_w) MOE_TRY(moe_comm_broadcast(ck->comm_w, &ok, 1, MOE_COMM_I32, 0));
    if (!ok) return MOE_FAIL(MOE_STATUS_CORRUPT, "step %" PRId64 " unusable locally and on S3", step);
    st = load_agreed(ck, stepdir, step, t, count, &sev);
    if (st != MOE_STATUS_SUCCESS && sev == 1)
        moe_log(ck->log, MOE_LOG_WARN, "checkpoint: S3 copy of step %" PRId64 " unusable: %s",
                step, moe_last_error());
    return st;
}

static bool contains(const int64_t *v, int32_t n, int64_t x)
{
    for (int32_t i = 0; i < n; i++)
        if (v[i] == x) return true;
    return false;
}

/* Candidates (newest first) from rank 0, shared with every rank. */
static moe_status_t candidates(moe_ckpt_t *ck, int64_t **cand, int32_t *ncand, int64_t **remote,
                               int32_t *nremote)
{
    int64_t *loc = NULL, *rem = NULL;
    int32_t nl = 0, nr = 0;
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (ck->rank == 0) {
        st = local_steps(ck, &loc, &nl);
        if (st == MOE_STATUS_SUCCESS && ck->s3 && ck_s3_list_steps(ck->s3, &rem, &nr, 1) != MOE_STATUS_SUCCESS) {
            moe_log(ck->log, MOE_LOG_WARN, "checkpoint: cannot list S3 (%s); local tier only",
                    moe_last_error());
            rem = NULL;
            nr = 0;
        }
    }
    int64_t n[2] = {st == MOE_STATUS_SUCCESS ? nl + nr : -1, nr};
    if (ck->comm_w) MOE_TRY(moe_comm_broadcast(ck->comm_w, n, 2, MOE_COMM_I64, 0));
    if (n[0] < 0) {
        free(loc);
        free(rem);
        return st != MOE_STATUS_SUCCESS ? st : MOE_FAIL(MOE_STATUS_IO_ERROR, "rank 0 cannot list");
    }
    int64_t *all = malloc(sizeof *all * (size_t)(n[0] + n[1] + 1));
    if (!all) {
        free(loc);
        free(rem);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "candidates");
    }
    if (ck->rank == 0) {
        for (int32_t i = 0; i < nl; i++) all[i] = loc[i];
        for (int32_t i = 0; i < nr; i++) all[nl + i] = rem[i];
        for (int32_t i = 0; i < nr; i++) all[n[0] + i] = rem[i];
    }
    free(loc);
    free(rem);
    if (ck->comm_w && n[0] + n[1] > 0)
        MOE_TRY(moe_comm_broadcast(ck->comm_w, all, (size_t)(n[0] + n[1]), MOE_COMM_I64, 0));
    /* unique, descending */
    int32_t m = (int32_t)n[0];
    qsort(all, (size_t)m, sizeof *all, ck_cmp_i64);
    int32_t u = 0; /* unique in place (ascending), then reversed */
    for (int32_t i = 0; i < m; i++)
        if (u == 0 || all[u - 1] != all[i]) all[u++] = all[i];
    for (int32_t i = 0; i < u / 2; i++) {
        int64_t x = all[i];
        all[i] = all[u - 1 - i];
        all[u - 1 - i] = x;
    }
    int64_t *r = malloc(sizeof *r * (size_t)(n[1] + 1));
    if (!r) {
        free(all);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "candidates");
    }
    memcpy(r, all + n[0], sizeof *r * (size_t)n[1]);
    *cand = all;
    *ncand = u;
    *remote = r;
    *nremote = (int32_t)n[1];
    return MOE_STATUS_SUCCESS;
}

static moe_status_t load_common(moe_ckpt_t *ck, bool one, int64_t want,
                                const moe_ckpt_tensor_t *t, int32_t count, int64_t *step)
{
    MOE_TRY(ck_check_request(t, count));
    MOE_TRY(drain_saves(ck)); /* background errors stay on the handle for poll/wait */
    int64_t *cand = NULL, *rem = NULL;
    int32_t nc = 0, nr = 0;
    MOE_TRY(candidates(ck, &cand, &nc, &rem, &nr));
    moe_status_t st =
        one ? MOE_FAIL(MOE_STATUS_NOT_FOUND, "no checkpoint of step %" PRId64 " in %s%s", want,
                       ck->dir, ck->s3 ? " or on S3" : "")
            : MOE_FAIL(MOE_STATUS_NOT_FOUND, "no complete checkpoint in %s%s", ck->dir,
                       ck->s3 ? " or on S3" : "");
    int tried = 0;
    for (int32_t i = 0; i < nc; i++) {
        if (one && cand[i] != want) continue;
        pthread_mutex_lock(&ck->mu);
        ck->loading_step = cand[i];
        pthread_mutex_unlock(&ck->mu);
        tried++;
        st = try_step(ck, cand[i], contains(rem, nr, cand[i]), t, count);
        pthread_mutex_lock(&ck->mu);
        ck->loading_step = -1;
        pthread_mutex_unlock(&ck->mu);
        if (st == MOE_STATUS_SUCCESS) {
            if (step) *step = cand[i];
            moe_log(ck->log, MOE_LOG_INFO, "checkpoint: loaded step %" PRId64, cand[i]);
            break;
        }
        if (severity(st) == 2 || st == MOE_STATUS_COMM_ERROR || st == MOE_STATUS_TIMEOUT) break;
    }
    if (st != MOE_STATUS_SUCCESS && tried > 0 && severity(st) == 1)
        st = moe_error_wrap(MOE_STATUS_CORRUPT, "no usable checkpoint (%d candidate%s tried, "
                            "newest first); last reason", tried, tried == 1 ? "" : "s");
    free(cand);
    free(rem);
    return st;
}

moe_status_t moe_ckpt_load_latest(moe_ckpt_t *ck, const moe_ckpt_tensor_t *tensors, int32_t count,
                                  int64_t *step)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    return load_common(ck, false, -1, tensors, count, step);
}

moe_status_t moe_ckpt_load_step(moe_ckpt_t *ck, int64_t step, const moe_ckpt_tensor_t *tensors,
                                int32_t count)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_ARG(step >= 0, "step %" PRId64, step);
    return load_common(ck, true, step, tensors, count, NULL);
}
