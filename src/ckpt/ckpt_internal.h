/*
 * Checkpointer internals shared by the files of src/ckpt/.
 *
 * The components (prefix ck_), each unaware of the handle:
 *   manifest.c  the on-disk format: layout of a rank's data file, manifest.json in and out,
 *               name/path validation (docs/checkpoint-format.md is the spec)
 *   request.c   the checks of a caller's tensor list (save and load)
 *   writer.c    one data file written from pinned segments: io_uring + O_DIRECT, registered
 *               buffers, several requests in flight; pwrite fallback; the file-system helpers
 *   load.c      verify + read + reshard (box intersection) into the caller's tensors
 *   sigv4.c     AWS Signature V4 and the payload hashes (SHA-256), on libcrypto
 *   s3.c        the S3 client over libcurl: signed requests, multipart, retries
 * The checkpointer handle (struct moe_ckpt below; prefix ckpt_ for what its files share), its
 * files top-down; each calls only the files below it:
 *   ckpt.c      create / destroy / abort, config defaults, status, poll, wait     } the public
 *   snapshot.c  save_async: checks, the job, the snapshot into staging segments   } entry points
 *   restore.c   list and load: candidates newest first, fallback to older steps   } (one each)
 *               and S3 copies
 *   commit.c    the writer thread, the commit (agreement between ranks, rank 0's manifest),
 *               local retention, what is pending, the collective progress on the training
 *               thread
 *   copy.c      the snapshot's copies (CUDA copy stream, or the host's copy thread)
 *               and the fences that order later writes of the tensors after them
 *   shard.c     the staging segments and one save's data file on the writer thread
 *               (checksums, io_uring writes, fsync, rename)
 *   mirror.c    the S3 thread: the newest committed step to S3 (one upload in flight, the
 *               newest waiting, failed steps tried again), the upload rounds of several
 *               ranks, the reconcile at create, S3 retention
 *   handle.c    what all of them share: the async error, step paths, the list of complete
 *               local steps, the agreement of ranks on one value
 *
 * Data flow of one save (rank r, step N):
 *   save_async (training thread)          writer thread                    S3 thread
 *   layout pieces in rank-r.bin  ------>  open step-N/rank-r.bin.tmp
 *   for each chunk_bytes range:           (state fits the budget: wait
 *     take a free pinned segment            for the whole snapshot)
 *     start its copy (copy.c)     ------>  for each segment, once copied:
 *   return (the next write of the           XXH3 of each piece chunk, io_uring writes
 *   tensors waits for the copy)
 *                                           (O_DIRECT), segment back to the free list
 *                                         fsync, rename rank-r.bin, fsync dir
 *   commit: agree (allreduce MIN), gather piece lists, rank 0 writes manifest.json
 *   (tmp, fsync, rename, fsync); retention (rank 0, writer thread)   -->  upload rank-r.bin;
 *                                                                        manifest.json last
 * World of one: the writer thread commits and the S3 thread puts the manifest after the
 * shard. Several ranks: MPI is only called on the training thread (the communicator is
 * MPI_THREAD_SERIALIZED), so the commit and the upload agreement run in ckpt_progress(),
 * inside the collective calls (save_async, wait, load, destroy); rank 0's S3 thread then puts
 * the manifest.
 *
 * Vocabulary: a *piece* is one contiguous region of a data file holding a box of a global
 * tensor (slice_start, slice_shape); a *segment* is one pinned staging buffer of chunk_bytes
 * that carries a range of a data file from save_async to the writer; a *chunk* is the
 * checksum unit: successive chunk_bytes of a piece's bytes, each with an XXH3-64.
 */
#ifndef MOE_CKPT_INTERNAL_H
#define MOE_CKPT_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <moe/ckpt.h>
#include <xxhash.h>

#include "core/log.h"
#include "runtime/runtime.h"

#define CK_FORMAT_NAME "libmoe-checkpoint"
#define CK_FORMAT_VERSION 3
#define CK_ALIGN 4096u
#define CK_MANIFEST "manifest.json"
/* a step set aside (moe_ckpt_set_aside_newer): <prefix><N>-<unix seconds>; hidden, never a step */
#define CK_SET_ASIDE_PREFIX ".rejected-step-"
#define CK_MAX_NAME 255
#define CK_MAX_MANIFEST_BYTES (256u << 20)

typedef struct ck_piece {
    char *name;
    moe_dtype_t dtype;
    int32_t ndim;
    int64_t global_shape[MOE_MAX_DIMS];
    int64_t start[MOE_MAX_DIMS];
    int64_t extent[MOE_MAX_DIMS];
    int32_t file;            /* index into the manifest's files */
    uint64_t offset, length; /* bytes in that file; offset is CK_ALIGN-aligned */
    uint32_t nchunks;
    uint64_t *xxh; /* [nchunks] */
    /* save side only: where the bytes come from (contiguous) */
    const uint8_t *src;
    moe_device_kind_t src_device;
} ck_piece_t;

typedef struct ck_file {
    char *path;     /* plain file name inside the step directory */
    uint64_t bytes; /* file size (a multiple of CK_ALIGN) */
} ck_file_t;

typedef struct ck_manifest {
    int64_t step;
    uint64_t chunk_bytes;
    int32_t world, mesh[4]; /* tp, ep, dp, pp */
    int32_t nfiles;
    ck_file_t *files;
    int32_t npieces;
    ck_piece_t *pieces;
} ck_manifest_t;

/* ---- names.c ---- */
bool ck_valid_name(const char *s);      /* tensor names */
bool ck_valid_file_name(const char *s); /* a plain file name: no '/', not . or .. */
bool ck_valid_prefix(const char *s);    /* S3 prefix: [A-Za-z0-9._/-], no .. component */
void ck_step_dirname(int64_t step, char *buf, size_t len);  /* "step-000000000012" */
void ck_rank_filename(int32_t rank, char *buf, size_t len); /* "rank-00003.bin" */
/* qsort comparator of int64_t, ascending. */
int ck_cmp_i64(const void *a, const void *b);
bool ck_parse_step_dirname(const char *s, int64_t *step);

/* ---- manifest.c ---- */
void ck_manifest_free(ck_manifest_t *m);
void ck_pieces_free(ck_piece_t *p, int32_t n);
/* Pieces of a save: validate the user's tensors and cut expert-split pieces; offsets in the
 * rank file assigned (aligned), returns the file size. */
moe_status_t ck_layout(const moe_ckpt_tensor_t *t, int32_t count, uint64_t chunk_bytes,
                       int32_t file_index, ck_piece_t **pieces, int32_t *npieces,
                       uint64_t *file_bytes);
/* JSON array of this rank's pieces of step `step` (checksums filled; each piece's binding
 * computed), as text (malloc'd). */
char *ck_pieces_to_json(int64_t step, uint64_t chunk_bytes, const ck_piece_t *p, int32_t n);
/* Full manifest text from per-rank piece arrays (JSON texts) and file sizes. */
char *ck_manifest_build(int64_t step, uint64_t chunk_bytes, int32_t world, const int32_t mesh[4],
                        char *const *rank_pieces_json, const uint64_t *rank_file_bytes);
/* Parse + validate a manifest text (every structural rule of the spec). */
moe_status_t ck_manifest_parse(const char *text, size_t len, ck_manifest_t *out);
/* Read <dir>/manifest.json and parse it. */
moe_status_t ck_manifest_read(const char *stepdir, ck_manifest_t *out);
/* Open a file of a checkpoint for reading: NOT_FOUND when missing, CORRUPT when it is not a
 * regular file (a FIFO would block the open for ever). */
moe_status_t ck_open_regular(const char *path, int *fd);

/* ---- request.c ---- */
/* The tensor's box in its global tensor: global_shape and offset as given, or, where no global
 * shape was given (all zero), the local shape at offset 0. */
void ck_tensor_box(const moe_ckpt_tensor_t *e, int64_t *global, int64_t *offset);
/* Validate a save or load request (names, shapes, boxes, expert ids) without a checkpoint. */
moe_status_t ck_check_request(const moe_ckpt_tensor_t *t, int32_t count);

/* ---- writer.c ---- */
typedef struct ck_writer ck_writer_t;
moe_status_t ck_writer_create(int queue_depth, size_t io_block, bool direct,
                              const moe_logger_t *log, ck_writer_t **out);
void ck_writer_destroy(ck_writer_t *w);
/* Register a segment buffer under slot index `slot` (best effort). */
void ck_writer_register(ck_writer_t *w, int slot, void *buf, size_t len);
moe_status_t ck_writer_open(ck_writer_t *w, const char *path);
/* Queue `len` bytes of buf (registered as `slot`, or -1) at `offset`; completions of earlier
 * segments are reaped meanwhile, calling done(cookie) for each finished segment. */
moe_status_t ck_writer_write(ck_writer_t *w, int slot, const void *buf, size_t len, uint64_t offset,
                             void *cookie, void (*done)(void *, void *), void *done_ctx);
/* Requests in flight? Then wait for at least one completion (segments come back through
 * their done callbacks). */
bool ck_writer_pending(const ck_writer_t *w);
void ck_writer_reap_one(ck_writer_t *w);
/* Wait for all in flight, fsync and close. */
moe_status_t ck_writer_finish(ck_writer_t *w);
/* Abandon the current file (close without fsync), reaping what is in flight. */
void ck_writer_cancel(ck_writer_t *w);
bool ck_writer_direct(const ck_writer_t *w);

/* ---- fs helpers (writer.c) ---- */
bool ck_file_exists(const char *path);
moe_status_t ck_fsync_dir(const char *dir);
moe_status_t ck_mkdir_p(const char *dir);
moe_status_t ck_write_file_atomic(const char *dir, const char *name, const void *data, size_t len);
moe_status_t ck_rmtree(const char *dir);

/* ---- s3.c ---- */
typedef struct ck_s3 ck_s3_t;
moe_status_t ck_s3_create(const moe_ckpt_config_t *c, const moe_logger_t *log, ck_s3_t **out);
void ck_s3_destroy(ck_s3_t *s);
void ck_s3_cancel(ck_s3_t *s); /* make in-flight and later requests fail quickly */
/* HEAD-like check that the bucket exists; UNREACHABLE is reported as TIMEOUT. */
moe_status_t ck_s3_check_bucket(ck_s3_t *s);
/* Upload a local file as <prefix>/<stepdir>/<name> (multipart above the part size). */
moe_status_t ck_s3_put_file(ck_s3_t *s, const char *stepdir, const char *name,
                            const char *local_path, uint64_t *bytes_sent);
moe_status_t ck_s3_get_file(ck_s3_t *s, const char *stepdir, const char *name,
                            const char *local_path);
/* Steps with a manifest.json object, ascending (malloc'd). retries < 0: the configured count. */
moe_status_t ck_s3_list_steps(ck_s3_t *s, int64_t **steps, int32_t *count, int retries);
/* Delete manifest first, then every other object of the step. */
moe_status_t ck_s3_delete_step(ck_s3_t *s, const char *stepdir);

/* ---- sigv4.c ---- */
/* Hex SHA-256 of memory, or of the bytes [off, off + len) of a file. */
moe_status_t ck_sha256_hex(const void *data, size_t len, char out[65]);
moe_status_t ck_sha256_fd_hex(int fd, uint64_t off, uint64_t len, char out[65]);
/* AWS's URI encoding (unreserved characters kept, every other byte %XX; '/' kept where
 * keep_slash), malloc'd; NULL when out of memory. */
char *ck_uri_encode(const char *s, bool keep_slash);
typedef struct ck_sigv4_header {
    const char *name, *value; /* as sent */
} ck_sigv4_header_t;
typedef struct ck_sigv4_request {
    const char *method;               /* "GET", "PUT", ... */
    const char *path;                 /* "/bucket/key", not URI-encoded (encoded here) */
    const char *query;                /* as sent (URI-encoded), NULL or "" for none */
    const ck_sigv4_header_t *headers; /* every header to sign (host, x-amz-*) */
    int nheaders;
    const char *payload_sha256; /* hex, as in x-amz-content-sha256 */
    const char *amz_date;       /* "YYYYMMDDTHHMMSSZ", as in x-amz-date */
    const char *region, *service, *access_key, *secret_key;
} ck_sigv4_request_t;
/* The Authorization header's value for r into authz[authz_len]; creq / sts (may be NULL)
 * receive the canonical request and the string to sign (malloc'd) for tests. */
moe_status_t ck_sigv4_sign(const ck_sigv4_request_t *r, char **creq, char **sts, char *authz,
                           size_t authz_len);

/* ---- load.c ---- */
/* Load from one complete local step directory. Returns CORRUPT / IO_ERROR / NOT_FOUND for
 * problems of the checkpoint (fall back) and INVALID_ARGUMENT for problems of the request. */
moe_status_t ck_load_dir(moe_runtime_t *rt, const char *stepdir, int64_t step,
                         const moe_ckpt_tensor_t *t, int32_t count);

/* ==== the checkpointer handle ================================================================ */

/* moe_ckpt_destroy's limit on the last upload (moe_ckpt_destroy_within takes another). */
#define CKPT_DESTROY_TIMEOUT_MS 30000

/* One pinned staging buffer of chunk_bytes: it carries the file range [off, off + len) of a
 * save from save_async to the writer thread and goes back to the free list once written. */
typedef struct ckpt_seg {
    uint8_t *buf;
    int slot; /* the writer's registration slot */
    bool registered;
    uint64_t off; /* file offset of buf[0] */
    size_t len;
    void *event;          /* CUDA: marks this segment's copies (the writer waits) */
    struct ckpt_job *job; /* host: the save the copy thread fills it for */
    struct ckpt_seg *next;
} ckpt_seg_t;

/* One save of this rank, from save_async through the writer thread to the commit. */
typedef struct ckpt_job {
    int64_t step;
    ck_piece_t *pieces;
    int32_t npieces;
    uint64_t file_bytes;
    int64_t seq;                     /* this checkpointer's count of saves, from 1 */
    ckpt_seg_t *q_head, *q_tail;     /* copied (host) or copying (CUDA), waiting for the writer */
    int32_t segs_issued, segs_ready; /* segments save_async started / the writer may take */
    bool issue_done;                 /* save_async has started every segment it will */
    bool all_queued, snap_failed;
    double t_start;
    struct ckpt_job *next;
    /* checksum walk */
    int32_t hp;
    XXH3_state_t *hs;
    /* result of the local write, for the commit */
    bool local_ok;
    char *mine; /* this rank's piece list (JSON) */
} ckpt_job_t;

/* Pieces of at most this many bytes are copied first (CUDA), under an event of their own: a
 * small buffer the layer writes during the next forward (the expert bias) then waits for
 * microseconds, not for the whole state's copy. */
#define CKPT_SMALL_PIECE_BYTES ((uint64_t)1 << 20)

/* Which parts of a segment ckpt_fill_segment copies. */
typedef enum ckpt_fill {
    CKPT_FILL_ALL = 0, /* every piece, and the gaps zeroed */
    CKPT_FILL_SMALL,   /* pieces up to CKPT_SMALL_PIECE_BYTES, and the gaps zeroed */
    CKPT_FILL_LARGE    /* the other pieces */
} ckpt_fill_t;

/* One source range a save's copy reads. */
typedef struct ckpt_range {
    const uint8_t *src;
    uint64_t len;
    bool small;
} ckpt_range_t;

/* A save whose copy may still run: what it reads and (CUDA) the events after its small
 * pieces' copies and after all of them. */
typedef struct ckpt_fence {
    int64_t seq;
    ckpt_range_t *ranges;
    int32_t nranges;
    void *small_ev, *full_ev;
} ckpt_fence_t;

/* What the S3 thread does next (mirror.c). */
typedef enum ckpt_mir_task {
    CKPT_MIR_NONE = 0,
    CKPT_MIR_WHOLE,    /* every file of the step, manifest last (world of one, reconcile) */
    CKPT_MIR_SHARD,    /* world > 1: this rank's data file of the round's step */
    CKPT_MIR_MANIFEST, /* world > 1, rank 0: every shard is up, put the manifest */
    CKPT_MIR_BUSY      /* a SHARD or MANIFEST task the thread has taken */
} ckpt_mir_task_t;

/* Locking: mu and cv guard the queues, the free segments, the status and the async error; the
 * I/O itself runs unlocked. */
struct moe_ckpt {
    uint64_t magic;
    moe_runtime_t *rt;
    const moe_logger_t *log;
    moe_ckpt_config_t cfg;
    char *dir;
    int rank, world;
    moe_comm_t *comm_w; /* NULL in a world of one; used on the training thread */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    ckpt_seg_t *segs;
    int max_segs, nsegs;
    ckpt_seg_t *free_segs;
    ckpt_job_t *jobs, *jobs_tail; /* queued for the writer */
    ckpt_job_t *done, *done_tail; /* world > 1: durable here, not yet committed */
    bool retention_due;
    int64_t loading_step;
    /* the S3 mirror (mirror.c); steps are -1 when none */
    int64_t mir_want;                  /* newest committed step, to be on S3 */
    int64_t mir_round;                 /* step whose upload is in flight on this rank */
    ckpt_mir_task_t mir_task;          /* world > 1: set by ckpt_progress for the S3 thread */
    bool mir_shard_done, mir_shard_ok; /* world > 1: this rank's shard of mir_round */
    int64_t mir_failed;                /* step of the newest failed round ... */
    double mir_retry_at;               /* ... tried again from then on (moe_now_s) */
    int64_t mir_reconcile;             /* rank 0: a step from before create, to upload */
    bool mir_draining;                 /* destroy: each wanted step is tried once more */
    int64_t mir_drain_tried;           /* the newest step tried since draining began */
    bool stop, aborting;
    bool defer_writer; /* see ckpt_write_job; MOE_CKPT_DEFER_WRITER=0: off */
    pthread_t writer_th, s3_th, copier_th;
    bool writer_started, s3_started, copier_started;
    /* the snapshot's copies (copy.c) */
    bool device_copies;                /* the backend copies (CUDA); else the copy thread */
    ckpt_seg_t *copy_head, *copy_tail; /* host: segments waiting for the copy thread */
    int64_t snap_seq;                  /* saves started (job seq) */
    int64_t copied_seq;                /* every save up to this one is copied */
    ckpt_fence_t *fences;              /* training thread: saves whose copy may still run */
    int32_t nfences;

    ck_writer_t *w;
    ck_s3_t *s3;

    int64_t last_saved_step;
    int32_t destroy_timeout_ms; /* moe_ckpt_destroy's limit (MOE_CKPT_DESTROY_...) */
    moe_ckpt_status_t st;
    moe_status_t async_err; /* the local tier's first unreported failure */
    char async_msg[1024];
    moe_status_t mirror_err; /* the mirror's (reported only with uploads) */
    char mirror_msg[1024];
};

/* ---- handle.c (beneath every other file of the handle) ---- */
/* Record a background failure (first one wins until reported). Caller holds no lock. */
void ckpt_set_async_error(moe_ckpt_t *ck, moe_status_t st, const char *what);
/* Return and clear the pending local error (with uploads: else the mirror's) as this
 * thread's error. */
moe_status_t ckpt_take_async_error(moe_ckpt_t *ck, bool uploads);
/* An unreported failure a wait should return now (the mirror's only with uploads); the
 * caller holds ck->mu. */
bool ckpt_error_pending_locked(const moe_ckpt_t *ck, bool uploads);
/* <dir>/step-<N> */
void ckpt_step_path(const moe_ckpt_t *ck, int64_t step, char *buf, size_t len);
/* Complete local checkpoints (a step directory with manifest.json), ascending, each step once
 * (malloc'd). */
moe_status_t ckpt_local_steps(const moe_ckpt_t *ck, int64_t **out, int32_t *n);
/* The directory of complete local step `step` into buf: <dir>/step-<12 digits>, else any
 * other spelling of the number ("step-4"); false (buf: the padded name) when there is none. */
bool ckpt_local_step_dir(const moe_ckpt_t *ck, int64_t step, char *buf, size_t len);
/* Every rank contributes v; *out gets their min or max (v itself without a communicator). */
moe_status_t ckpt_agree(moe_comm_t *c, int32_t v, moe_reduce_op_t op, int32_t *out);

/* ---- mirror.c (uses handle.c) ---- */
/* The S3 thread (arg: the handle). */
void *ckpt_mirror_main(void *arg);
/* Rank 0 at create: the newest local step, when S3 has neither it nor a newer one, becomes
 * mir_reconcile (uploaded first, spared by retention until it is). */
void ckpt_mirror_reconcile(moe_ckpt_t *ck);
/* The caller holds ck->mu for these: */
/* step committed (S3 configured): it supersedes the step waiting, if any. */
void ckpt_mirror_queue_step_locked(moe_ckpt_t *ck, int64_t step);
/* No upload in flight on this rank, and no reconciled step waiting to go first. */
bool ckpt_mirror_idle_locked(const moe_ckpt_t *ck);
/* This rank wants an upload round to start now (idle, a newer step, a failed one due). */
bool ckpt_mirror_wants_locked(const moe_ckpt_t *ck);
/* Mirror work remains (a round in flight, a step not yet on S3; while draining, a step not
 * yet tried since). */
bool ckpt_mirror_busy_locked(const moe_ckpt_t *ck);
/* Uploads in flight or waiting (status.pending_uploads). */
int64_t ckpt_mirror_pending_locked(const moe_ckpt_t *ck);
/* World > 1, training thread, every rank: start the round for mir_want / agree on a round
 * whose shards are done everywhere (rank 0 then puts the manifest). */
void ckpt_mirror_start_round(moe_ckpt_t *ck);
moe_status_t ckpt_mirror_agree_upload(moe_ckpt_t *ck);

/* ---- shard.c (uses handle.c) ---- */
/* Take a free staging segment, allocating one while under budget, else waiting for the
 * writer to release one. */
moe_status_t ckpt_seg_acquire(moe_ckpt_t *ck, ckpt_seg_t **out);
/* Return a segment to the free list (also the writer's completion callback: ck, segment). */
void ckpt_seg_release(void *ck, void *seg);
/* Writer thread: write job j's data file from its segments into stepdir (tmp, fsync, rename,
 * fsync dir); on success *pieces_json is this rank's piece list with the checksums. */
moe_status_t ckpt_write_job(moe_ckpt_t *ck, ckpt_job_t *j, char *stepdir, char **pieces_json);
void ckpt_job_free(ckpt_job_t *j);

/* ---- copy.c (beneath shard.c) ---- */
moe_status_t ckpt_fill_segment(moe_ckpt_t *ck, const ckpt_job_t *j, ckpt_seg_t *s,
                               ckpt_fill_t filter);
/* Segment s of job j is ready for the writer (copied on the host, or its copies enqueued on
 * CUDA); the caller holds ck->mu. */
void ckpt_job_segment_ready_locked(moe_ckpt_t *ck, ckpt_job_t *j, ckpt_seg_t *s);
/* The copy thread of the host backend (arg: the handle). */
void *ckpt_copier_main(void *arg);
/* Training thread: job j's copy has started; small_ev / full_ev (CUDA, else NULL) mark it.
 * The entry owns the events. */
moe_status_t ckpt_fence_add(moe_ckpt_t *ck, const ckpt_job_t *j, void *small_ev, void *full_ev);
/* The runtime's write fence (moe_write_fence_fn; arg: the handle), moe_ckpt_fence's too. */
moe_status_t ckpt_fence_writes(void *arg, const void *data, size_t bytes);
/* Waits for the copies still running, then frees the fence entries (destroy, abort). */
void ckpt_fences_free(moe_ckpt_t *ck);

/* ---- commit.c (uses shard.c, mirror.c, handle.c) ---- */
/* The writer thread (arg: the handle): writes, commits (world of one) and retention. */
void *ckpt_writer_main(void *arg);
/* Saves (and, with uploads, S3 uploads) still pending; the caller holds ck->mu. */
bool ckpt_busy_locked(const moe_ckpt_t *ck, bool uploads);
/* Commit the saves every rank has made durable, agree on a finished upload round (rank 0
 * then puts the manifest) and start the next one. With drain, repeat until nothing is
 * pending on any rank (saves, and uploads when asked), or timeout_ms passes on some rank, or
 * (stop_on_error) some rank has an unreported error. Collective; a no-op in a world of one. */
moe_status_t ckpt_progress(moe_ckpt_t *ck, bool drain, bool uploads, int64_t timeout_ms,
                           bool stop_on_error);
/* Wait until every queued save is committed (or failed), without taking the async error. */
moe_status_t ckpt_drain_saves(moe_ckpt_t *ck);

/* ckpt.c, snapshot.c and restore.c hold the public calls and declare nothing here. */

#endif /* MOE_CKPT_INTERNAL_H */
