/*
 * libmoe asynchronous tiered checkpointer.
 *
 * A short tour:
 *   moe_ckpt_create()       on a runtime: a local directory (NVMe), optionally an S3 mirror.
 *   moe_ckpt_save_async()   starts the snapshot of named, sharded tensors into pinned host
 *                           memory and returns; the copy runs beside the training that
 *                           follows (the next write of the tensors waits for it: libmoe's
 *                           optimizer step and layers by themselves, the caller through
 *                           moe_ckpt_fence); a background thread writes them (io_uring, O_DIRECT),
 *                           the ranks agree, rank 0 writes the commit marker, and a second
 *                           background thread mirrors the newest committed step to S3.
 *   moe_ckpt_wait/poll/status  progress and errors of the background work.
 *   moe_ckpt_load_latest()  the newest complete, verified checkpoint (local first, then S3)
 *                           into the current mesh's tensors, resharding when the mesh changed.
 *   moe_ckpt_list()         the complete checkpoints on each tier.
 *   moe_ckpt_set_aside_newer()  steps a load passed over (they failed verification) moved
 *                           out of the way under a hidden name.
 *
 * On disk (docs/checkpoint-format.md is the normative spec): <dir>/step-<N>/ holds one data
 * file per rank (`rank-<R>.bin`) and, written last by rank 0 once every rank's data file is
 * durable, `manifest.json` — the commit marker and the index of every rank's pieces. A
 * directory without manifest.json is not a checkpoint and is never loaded.
 *
 * Sharding: every saved tensor names its global shape and where this rank's piece sits in
 * it (offset per dimension). Tensors sharded over experts name the global expert id of each
 * local expert, so a checkpoint written at one ep loads at any other: the loader fetches, for
 * every element a rank asks for, the piece of whichever file holds it.
 *
 * The S3 mirror is optional and never costs a local checkpoint: its failures are reported
 * through the status (upload_failures, last_upload_error), the log and the calls that ask
 * about uploads (poll/wait with include_uploads, destroy), never by save_async. Only the
 * newest committed step must reach S3: a newer commit supersedes an older step still waiting,
 * a failed upload is tried again after s3_retry_max_ms, and local retention spares only the
 * step being uploaded (at most keep_last + 1 steps on local disk). At create, the newest local
 * step is uploaded first when S3 has neither it nor a newer one.
 *
 * Threads: a checkpointer is used from one thread (the training thread). Its background
 * threads do file and S3 I/O only and call the runtime's log callback; they never use MPI,
 * so MPI_THREAD_SERIALIZED (what libmoe initialises MPI with) suffices. With several ranks,
 * the agreement that commits a step (and completes its S3 mirror) runs on the calling thread
 * inside the collective calls below (save_async, wait, load_*, destroy), once every rank's
 * shard is durable: call wait (or keep saving) to finish a save. The checkpoint directory
 * must then be shared by the ranks (or use S3 as the shared tier). Two checkpointers must not
 * share a directory.
 */
#ifndef MOE_CKPT_H
#define MOE_CKPT_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_ckpt moe_ckpt_t;

typedef struct moe_ckpt_config {
    size_t struct_size;
    const char *dir;            /* local directory (created if missing); required */
    int32_t keep_last;          /* complete checkpoints kept on each tier; <= 0 keeps all.
                                     default 3 */
    size_t chunk_bytes;         /* checksum granularity and staging segment size; multiple of
                                     4096. default 256 MiB (MOE_CKPT_CHUNK_BYTES overrides) */
    size_t pinned_budget_bytes; /* pinned host staging memory; at least 2 chunks. When the
                                     state is larger, save_async double-buffers (it waits for
                                     the writer to free segments). default 2 GiB
                                     (MOE_CKPT_PINNED_BYTES overrides) */
    int32_t queue_depth;        /* io_uring requests in flight, 1..256; default 8 */
    size_t io_block_bytes;      /* bytes per write request, multiple of 4096; default 8 MiB */
    int32_t use_direct_io;      /* 1 (default): O_DIRECT, falling back to buffered writes
                                     (logged once) where the file system refuses it; 0: buffered */
    /* S3 mirror: NULL bucket disables it. */
    const char *s3_endpoint; /* "https://s3.us-east-1.amazonaws.com" or "http://127.0.0.1:
                                     4568"; NULL: https://s3.<region>.amazonaws.com */
    const char *s3_bucket;
    const char *s3_prefix;        /* key prefix, e.g. "runs/42"; NULL: "" */
    const char *s3_region;        /* NULL: AWS_REGION / AWS_DEFAULT_REGION, else "us-east-1" */
    const char *s3_access_key;    /* NULL: AWS_ACCESS_KEY_ID */
    const char *s3_secret_key;    /* NULL: AWS_SECRET_ACCESS_KEY (never logged) */
    const char *s3_session_token; /* NULL: AWS_SESSION_TOKEN (optional) */
    size_t s3_part_bytes;         /* multipart part size, >= 5 MiB; default 64 MiB */
    int32_t s3_parallel_parts;    /* parts uploaded concurrently, 1..64; default 4 */
    int32_t s3_max_retries;       /* per request, on 5xx / reset / timeout; default 6
                                     (MOE_CKPT_S3_MAX_RETRIES overrides) */
    int32_t s3_retry_base_ms;     /* first backoff (doubles, with jitter); default 200
                                     (MOE_CKPT_S3_RETRY_BASE_MS overrides) */
    int32_t s3_timeout_ms;        /* per request; default 60000 */
    /* Fields below were added later: a smaller struct_size leaves them at their defaults. */
    int32_t s3_retry_max_ms; /* longest backoff between two tries of a request, and the
                                     pause before the mirror tries a failed step again;
                                     >= s3_retry_base_ms; default 20000
                                     (MOE_CKPT_S3_RETRY_MAX_MS overrides) */
} moe_ckpt_config_t;

MOE_API moe_ckpt_config_t moe_ckpt_config_default(void);

/* One named tensor (or this rank's shard of it) to save or to load into.
 *   tensor        the local data, on the runtime's device or on the host.
 *   global_shape  the unsharded shape; all zero means "the local shape" (not sharded).
 *   offset        where the local tensor starts in the global one, per dimension.
 *   expert_dim    -1, or the dimension indexed by expert; then expert_ids (when not NULL)
 *                 gives the global expert id of each local index along it (round-robin
 *                 placement); NULL means contiguous from offset[expert_dim].
 * Tensors replicated over ranks (dense parameters over ep/dp) should be passed by one replica
 * only (e.g. dp = ep = 0) to save space; a loader accepts overlapping pieces either way (and
 * refuses the checkpoint as CORRUPT where they differ). */
typedef struct moe_ckpt_tensor {
    const char *name; /* unique within a save; [A-Za-z0-9._/-], at most 255 bytes */
    moe_tensor_t tensor;
    int64_t global_shape[MOE_MAX_DIMS];
    int64_t offset[MOE_MAX_DIMS];
    int32_t expert_dim;
    const int32_t *expert_ids;
} moe_ckpt_tensor_t;

/* A tensor entry for an unsharded tensor (global = local, offset 0, no expert dim). */
MOE_API moe_ckpt_tensor_t moe_ckpt_tensor_whole(const char *name, const moe_tensor_t *t);

/* [in] rt, config (dir required) [out] out. Collective over the runtime's world: it creates
 * the checkpointer's own communicator, used only on the calling thread (see the top).
 * Starts the writer thread (and the S3 thread, after rank 0's reconcile with S3). Fails with
 * IO_ERROR when the directory cannot be created or written, REMOTE_ERROR when S3 refuses
 * the bucket probe (an unreachable S3 is only logged: the mirror retries later). */
MOE_API moe_status_t moe_ckpt_create(moe_runtime_t *rt, const moe_ckpt_config_t *config,
                                     moe_ckpt_t **out);
/* Waits for every queued save to finish (no limit: the local tier), then for the newest
 * step's upload to finish or fail (one more try when it failed before) for at most
 * upload_timeout_ms (>= 0; 0: not at all), cancelling it after that; then runs local
 * retention and frees the checkpointer. Returns the local tier's first unreported error,
 * else the mirror's state as it is at the end: SUCCESS when the newest committed step is on
 * S3 (an earlier failure that a later upload repaired is not reported), TIMEOUT when the
 * limit cut the upload short, else the mirror's failure. The checkpointer is freed whatever
 * the result. Collective (every rank passes the same limit). destroy(NULL) is a no-op. */
MOE_API moe_status_t moe_ckpt_destroy_within(moe_ckpt_t *ck, int64_t upload_timeout_ms);
/* moe_ckpt_destroy_within with the default limit: 30000 ms, or MOE_CKPT_DESTROY_TIMEOUT_MS
 * (read at create). */
MOE_API moe_status_t moe_ckpt_destroy(moe_ckpt_t *ck);
/* Stops background work as soon as possible (in-flight writes are abandoned and never
 * committed; uploads are cancelled), then frees the checkpointer. Not collective. */
MOE_API void moe_ckpt_abort(moe_ckpt_t *ck);

/* [in] step >= 0, strictly greater than every step saved before by this checkpointer;
 * [in] tensors[count]: see moe_ckpt_tensor_t. Collective over the world (every rank calls it
 * with the same step; tensor lists may differ by rank).
 * The bytes saved are the tensors' state at the call: for device tensors the state after
 * the work enqueued on the runtime's stream before it. The call starts the copy into pinned
 * host memory and returns without waiting for it: device tensors are copied on the CUDA
 * backend's copy stream (the work enqueued after the call runs beside the copy); host
 * tensors are copied in the call on the CUDA backend, by the checkpointer's copy thread on
 * the host backend. Until the copy is done the tensors must be neither written nor freed:
 * libmoe's own writes of them wait for it by themselves (moe_adamw_step, the layer's
 * expert-bias update); any other write or free must come after moe_ckpt_fence (or wait,
 * load_*, destroy). When the state exceeds the pinned budget, the call waits for the writer
 * to release staging segments (bounded memory, longer stall).
 * A background failure of an earlier local save is returned here (and cleared); the new save
 * is then not made. Mirror failures are never returned here. With several ranks, a save
 * refused on one rank (bad argument, earlier failure) fails on every rank: the others get
 * ABORTED from a later call. */
MOE_API moe_status_t moe_ckpt_save_async(moe_ckpt_t *ck, int64_t step,
                                         const moe_ckpt_tensor_t *tensors, int32_t count);

/* Orders the caller's next writes of the tensors of every save so far after their snapshot
 * copies. Device tensors: work enqueued on the runtime's stream from now on waits for the
 * copies on the device; the host does not wait (a write from another stream must first wait
 * for this stream). Host tensors: returns once they are copied (at once on the CUDA backend,
 * which copies them in save_async). Not collective; never waits for disk or S3. */
MOE_API moe_status_t moe_ckpt_fence(moe_ckpt_t *ck);

typedef enum moe_ckpt_state {
    MOE_CKPT_IDLE = 0,      /* nothing queued */
    MOE_CKPT_WRITING = 1,   /* a local write or commit is in progress */
    MOE_CKPT_UPLOADING = 2, /* committed locally; the newest step is not on S3 yet (an
                                 upload in flight, or waiting to be tried again) */
    MOE_CKPT_FAILED = 3     /* a local save failed; see the async error */
} moe_ckpt_state_t;

typedef struct moe_ckpt_status {
    size_t struct_size;
    moe_ckpt_state_t state;
    int64_t last_committed_step; /* newest step committed locally by this checkpointer, -1 */
    int64_t last_uploaded_step;  /* newest step complete on S3, -1 */
    int64_t pending_saves;       /* queued or in progress locally */
    int64_t pending_uploads;     /* steps to upload: the one in flight and the newest
                                     waiting (0..2; 3 with a reconciled step) */
    uint64_t bytes_written;      /* data bytes written locally since create */
    uint64_t bytes_uploaded;
    double last_stall_s;   /* time spent in the last save_async (the caller's stall;
                                     the copy itself runs after it returns) */
    double last_durable_s; /* save_async start -> commit marker durable, last save */
    int32_t direct_io;     /* 1 while O_DIRECT is in use, 0 after the fallback */
    /* Fields below were added later (copied only when struct_size covers them). */
    int64_t uploads_superseded;     /* committed steps never uploaded: a newer step came first */
    int64_t upload_failures;        /* failed upload attempts (each also logged at WARN) */
    moe_status_t last_upload_error; /* of the newest failed attempt; SUCCESS once a later
                                       upload succeeded (or none failed) */
} moe_ckpt_status_t;

/* [out] status (set struct_size first). Never blocks on I/O. Not collective. On ranks other
 * than 0 of a multi-rank run, last_uploaded_step is the newest step whose shards all ranks
 * uploaded (rank 0 then puts the manifest). */
MOE_API moe_status_t moe_ckpt_status(moe_ckpt_t *ck, moe_ckpt_status_t *status);
/* SUCCESS when every queued save is committed locally (and, with include_uploads, the newest
 * committed step is on S3), IN_PROGRESS while work remains, or the first unreported
 * background error (then cleared; the mirror's only with include_uploads). Not collective,
 * so with several ranks it does not commit anything itself (see the top). */
MOE_API moe_status_t moe_ckpt_poll(moe_ckpt_t *ck, int include_uploads);
/* Blocks until poll would not return IN_PROGRESS, or timeout_ms passes (TIMEOUT); a negative
 * timeout waits for ever (with include_uploads during an S3 outage: until S3 is back or an
 * upload attempt fails, which is then returned). Collective over the world when it has
 * several ranks (all return together, once the work is done everywhere or some rank has an
 * error to return; TIMEOUT when the timeout passed on any rank). */
MOE_API moe_status_t moe_ckpt_wait(moe_ckpt_t *ck, int include_uploads, int64_t timeout_ms);
/* The first background error not yet reported, without clearing it (SUCCESS if none): the
 * local tier's, else the mirror's; [out] message (may be NULL) receives its text, truncated
 * to message_len. */
MOE_API moe_status_t moe_ckpt_get_async_error(moe_ckpt_t *ck, char *message, size_t message_len);

/* Load the newest complete checkpoint into tensors[count] (names, global shapes and this
 * rank's slices as for save; data written in place, converting between F32 and BF16 when the
 * saved dtype differs). Candidates are tried newest first: a checkpoint is skipped (CORRUPT,
 * with a logged reason) when a file is missing, not a regular file, truncated or fails its
 * checksum, when its manifest is malformed, breaks a rule of the spec, names a path outside
 * its directory or was altered (a piece's binding does not match), or when overlapping
 * pieces disagree; when the same step exists on S3 it is downloaded (replacing the bad local
 * copy) before falling back to an older one.
 * Collective over the world: all ranks load the same step. Waits for queued saves first
 * (a background error stays on the handle for poll/wait; it does not fail the load).
 * [out] step (may be NULL). NOT_FOUND when no checkpoint exists; CORRUPT when none is
 * usable; INVALID_ARGUMENT (no fallback) when an intact checkpoint does not hold what was
 * asked: a requested tensor is absent, its global shape differs, or the requested slice is
 * not covered. On failure the tensors' contents are unspecified. */
MOE_API moe_status_t moe_ckpt_load_latest(moe_ckpt_t *ck, const moe_ckpt_tensor_t *tensors,
                                          int32_t count, int64_t *step);
/* The same for one given step (no fallback to another step; S3 is used if local fails). */
MOE_API moe_status_t moe_ckpt_load_step(moe_ckpt_t *ck, int64_t step,
                                        const moe_ckpt_tensor_t *tensors, int32_t count);

/* Sets aside every complete local checkpoint newer than `step`: after a load that fell back
 * past newer steps (they failed verification), so that training passes those steps again
 * instead of meeting the bad copies, which are kept for a look. Rank 0 renames each step
 * directory to <dir>/.rejected-step-<N>-<unix seconds> (a hidden name: list and load never
 * see it again), logs it at WARN and syncs the directory. S3 copies are left alone.
 * [in] step >= -1 (-1: every complete step); [out] count (may be NULL): how many steps were
 * set aside, the same on every rank. Collective over the world; waits for queued saves first
 * (as load_*). Fails on every rank when rank 0's rename fails (IO_ERROR; the steps renamed
 * before it stay aside and are counted) or a step is being uploaded to S3 (IN_PROGRESS). */
MOE_API moe_status_t moe_ckpt_set_aside_newer(moe_ckpt_t *ck, int64_t step, int32_t *count);

typedef enum moe_ckpt_tier { MOE_CKPT_TIER_LOCAL = 0, MOE_CKPT_TIER_S3 = 1 } moe_ckpt_tier_t;

/* [out] steps[capacity], ascending; [out] count: how many complete checkpoints exist on the
 * tier (may exceed capacity; only the newest `capacity` are stored). Local: directories
 * step-<N> (the number with or without zero padding) holding a manifest.json. S3: prefixes
 * with a manifest.json object. Not collective. */
MOE_API moe_status_t moe_ckpt_list(moe_ckpt_t *ck, moe_ckpt_tier_t tier, int64_t *steps,
                                   int32_t capacity, int32_t *count);

#ifdef __cplusplus
}
#endif
#endif /* MOE_CKPT_H */
