/*
 * The checkpointer handle and the public calls that are not a save or a load: config
 * defaults, create (checks the config, probes the directory on every rank, reconciles with
 * S3, starts the writer and S3 threads), destroy (drains, tries the newest step's upload once
 * more), abort (cancels S3), status, poll, wait and the two error channels of background
 * work: the local tier's (returned by every call, save_async included) and the mirror's
 * (returned only by calls that ask about uploads). How the files of src/ckpt/ share the
 * work: ckpt_internal.h.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/env.h"
#include "core/error.h"
#include "ckpt_internal.h"

/* ---- config -------------------------------------------------------------------------------- */

moe_ckpt_config_t moe_ckpt_config_default(void)
{
    moe_ckpt_config_t c = {
        .struct_size = sizeof c,
        .dir = NULL,
        .keep_last = 3,
        .chunk_bytes = 256u << 20,
        .pinned_budget_bytes = (size_t)2 << 30,
        .queue_depth = 8,
        .io_block_bytes = 8u << 20,
        .use_direct_io = 1,
        .s3_part_bytes = 64u << 20,
        .s3_parallel_parts = 4,
        .s3_max_retries = 6,
        .s3_retry_base_ms = 200,
        .s3_timeout_ms = 60000,
        .s3_retry_max_ms = 20000,
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

/* ---- create / destroy ---------------------------------------------------------------------- */

/* Stop and join the threads, then free everything: the end of destroy and abort, and the
 * failure path of create (any part may be missing). */
static void free_handle(moe_ckpt_t *ck)
{
    if (ck->writer_started || ck->s3_started || ck->copier_started) {
        pthread_mutex_lock(&ck->mu);
        ck->stop = true;
        pthread_cond_broadcast(&ck->cv);
        pthread_mutex_unlock(&ck->mu);
        /* the writer may wait for the copy thread, which copies what is queued, then ends */
        if (ck->writer_started) pthread_join(ck->writer_th, NULL);
        if (ck->copier_started) pthread_join(ck->copier_th, NULL);
        if (ck->s3_started) pthread_join(ck->s3_th, NULL);
    }
    moe_runtime_remove_fence(ck->rt, ck);
    ckpt_fences_free(ck);
    ck_writer_destroy(ck->w);
    ck_s3_destroy(ck->s3);
    for (int i = 0; i < ck->nsegs; i++) {
        if (ck->segs[i].event) MOE_OPS(ck->rt)->event_destroy(MOE_CTX(ck->rt), ck->segs[i].event);
        if (ck->segs[i].buf) MOE_OPS(ck->rt)->free_pinned(MOE_CTX(ck->rt), ck->segs[i].buf);
    }
    free(ck->segs);
    while (ck->done) { /* durable but never agreed on (abort): never committed */
        ckpt_job_t *j = ck->done;
        ck->done = j->next;
        ckpt_job_free(j);
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
        MOE_CHECK_ARG(c->s3_retry_max_ms >= c->s3_retry_base_ms,
                      "s3_retry_max_ms %d is below s3_retry_base_ms %d", c->s3_retry_max_ms,
                      c->s3_retry_base_ms);
    }
    return MOE_STATUS_SUCCESS;
}

/* An int32 config field from the environment (positive values; others warned and ignored). */
static int32_t env_int(moe_env_id_t id, int32_t v, const moe_logger_t *log)
{
    size_t x = moe_env_positive(id, (size_t)(v > 0 ? v : 0), log);
    return x == 0 || x > INT32_MAX ? v : (int32_t)x;
}

moe_status_t moe_ckpt_create(moe_runtime_t *rt, const moe_ckpt_config_t *config, moe_ckpt_t **out)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(config != NULL, "config is NULL (config.dir is required)");
    moe_ckpt_config_t c = moe_ckpt_config_default();
    MOE_TAKE_CONFIG_PREFIX(c, config, moe_ckpt_config_t,
                           offsetof(moe_ckpt_config_t, s3_retry_max_ms));
    const moe_logger_t *lg = &rt->logger;
    c.chunk_bytes = moe_env_positive(MOE_ENV_CKPT_CHUNK_BYTES, c.chunk_bytes, lg);
    c.pinned_budget_bytes = moe_env_positive(MOE_ENV_CKPT_PINNED_BYTES, c.pinned_budget_bytes, lg);
    c.s3_max_retries = env_int(MOE_ENV_CKPT_S3_MAX_RETRIES, c.s3_max_retries, lg);
    c.s3_retry_base_ms = env_int(MOE_ENV_CKPT_S3_RETRY_BASE_MS, c.s3_retry_base_ms, lg);
    c.s3_retry_max_ms = env_int(MOE_ENV_CKPT_S3_RETRY_MAX_MS, c.s3_retry_max_ms, lg);
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
    ck->loading_step = -1;
    ck->mir_want = ck->mir_round = ck->mir_failed = ck->mir_reconcile = ck->mir_drain_tried = -1;
    ck->last_saved_step = -1;
    ck->destroy_timeout_ms = env_int(MOE_ENV_CKPT_DESTROY_TIMEOUT_MS, CKPT_DESTROY_TIMEOUT_MS, lg);
    ck->st.struct_size = sizeof ck->st;
    ck->st.last_committed_step = ck->st.last_uploaded_step = -1;
    ck->st.direct_io = c.use_direct_io != 0;
    ck->max_segs = (int)(c.pinned_budget_bytes / c.chunk_bytes);
    ck->defer_writer = moe_env_flag(MOE_ENV_CKPT_DEFER_WRITER, true, lg);
    ck->device_copies = MOE_OPS(rt)->snapshot_copy != NULL;
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
        moe_status_t cst = ckpt_agree(world, st == MOE_STATUS_SUCCESS, MOE_REDUCE_MIN, &all_ok);
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
            moe_log(ck->log, MOE_LOG_WARN,
                    "checkpoint: S3 is unreachable now (%s); the mirror "
                    "will retry",
                    moe_last_error());
        else if (bst != MOE_STATUS_SUCCESS) {
            st = bst;
            goto fail;
        }
        ckpt_mirror_reconcile(ck);
    }
    MOE_CHECK_PTHREAD_GOTO(st, pthread_create(&ck->writer_th, NULL, ckpt_writer_main, ck),
                           MOE_STATUS_INTERNAL);
    ck->writer_started = true;
    if (!ck->device_copies) {
        MOE_CHECK_PTHREAD_GOTO(st, pthread_create(&ck->copier_th, NULL, ckpt_copier_main, ck),
                               MOE_STATUS_INTERNAL);
        ck->copier_started = true;
    }
    MOE_TRY_GOTO(st, moe_runtime_add_fence(rt, ckpt_fence_writes, ck));
    if (ck->s3) {
        MOE_CHECK_PTHREAD_GOTO(st, pthread_create(&ck->s3_th, NULL, ckpt_mirror_main, ck),
                               MOE_STATUS_INTERNAL);
        ck->s3_started = true;
    }
    ck->magic = MOE_MAGIC_CKPT;
    moe_runtime_adopt(rt, MOE_CHILD_CHECKPOINTER);
    *out = ck;
    return MOE_STATUS_SUCCESS;
fail:
    free_handle(ck);
    return st;
}

/* Wait until the saves (and, with uploads, the S3 uploads) are done or timeout_ms passes
 * (< 0: no limit), or (stop_on_error) an unreported error is there to return. Collective when
 * world > 1. Takes no error. */
static moe_status_t wait_idle(moe_ckpt_t *ck, bool uploads, int64_t timeout_ms, bool stop_on_error)
{
    if (ck->world > 1) return ckpt_progress(ck, true, uploads, timeout_ms, stop_on_error);
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
    while (!(stop_on_error && ckpt_error_pending_locked(ck, uploads)) &&
           ckpt_busy_locked(ck, uploads)) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&ck->cv, &ck->mu);
        } else if (pthread_cond_timedwait(&ck->cv, &ck->mu, &dl) == ETIMEDOUT) {
            bool busy = ckpt_busy_locked(ck, uploads) &&
                        !(stop_on_error && ckpt_error_pending_locked(ck, uploads));
            pthread_mutex_unlock(&ck->mu);
            if (busy)
                return MOE_FAIL(MOE_STATUS_TIMEOUT,
                                "checkpoint work still in progress after "
                                "%" PRId64 " ms",
                                timeout_ms);
            pthread_mutex_lock(&ck->mu);
        }
    }
    pthread_mutex_unlock(&ck->mu);
    return MOE_STATUS_SUCCESS;
}

/* The mirror's state at the end of destroy, after the local tier's error: SUCCESS when the
 * newest committed step (and a reconciled one) is on S3, whatever failed before; else the
 * mirror's unreported failure, or TIMEOUT when destroy's limit cut the upload short. */
static moe_status_t mirror_outcome(moe_ckpt_t *ck, bool timed_out, int64_t limit_ms)
{
    if (!ck->s3) return MOE_STATUS_SUCCESS;
    pthread_mutex_lock(&ck->mu);
    int64_t want = ck->mir_reconcile > ck->mir_want ? ck->mir_reconcile : ck->mir_want;
    bool up = ck->mir_want <= ck->st.last_uploaded_step && ck->mir_reconcile < 0;
    moe_status_t err = ck->mirror_err;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", ck->mirror_msg);
    ck->mirror_err = MOE_STATUS_SUCCESS;
    ck->mirror_msg[0] = 0;
    pthread_mutex_unlock(&ck->mu);
    if (up) return MOE_STATUS_SUCCESS;
    if (timed_out)
        return MOE_FAIL(MOE_STATUS_TIMEOUT,
                        "step %" PRId64 " is not on S3: its upload did not "
                        "finish within destroy's limit (%" PRId64 " ms) and was cancelled%s%s",
                        want, limit_ms, err ? "; before that: " : "", err ? msg : "");
    if (err != MOE_STATUS_SUCCESS)
        return MOE_FAIL(err, "background checkpoint work failed: %s", msg);
    return MOE_FAIL(MOE_STATUS_REMOTE_ERROR, "step %" PRId64 " is not on S3", want);
}

moe_status_t moe_ckpt_destroy(moe_ckpt_t *ck)
{
    moe_error_clear();
    if (!ck) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    return moe_ckpt_destroy_within(ck, ck->destroy_timeout_ms);
}

moe_status_t moe_ckpt_destroy_within(moe_ckpt_t *ck, int64_t upload_timeout_ms)
{
    moe_error_clear();
    if (!ck) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_ARG(upload_timeout_ms >= 0, "upload_timeout_ms is %" PRId64 "; it must be >= 0",
                  upload_timeout_ms);
    /* drain everything, whatever fails on the way: every save committed or failed, and the
     * newest step's upload tried once more (not for ever: S3 may be down), for at most
     * upload_timeout_ms */
    pthread_mutex_lock(&ck->mu);
    ck->mir_draining = true;
    ck->mir_drain_tried = -1;
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    moe_status_t st = wait_idle(ck, false, -1, false);
    bool timed_out = false;
    if (st == MOE_STATUS_SUCCESS && ck->s3) {
        st = wait_idle(ck, true, upload_timeout_ms, false);
        if (st == MOE_STATUS_TIMEOUT) { /* every rank times out together (ckpt_progress) */
            timed_out = true;
            st = MOE_STATUS_SUCCESS;
            pthread_mutex_lock(&ck->mu);
            ck->aborting = true; /* no further uploads start; the cancelled one is not news */
            pthread_cond_broadcast(&ck->cv);
            pthread_mutex_unlock(&ck->mu);
            ck_s3_cancel(ck->s3);
        }
    }
    if (st == MOE_STATUS_SUCCESS) st = ckpt_take_async_error(ck, false);
    if (st == MOE_STATUS_SUCCESS) st = mirror_outcome(ck, timed_out, upload_timeout_ms);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moe_last_error());
    pthread_mutex_lock(&ck->mu);
    ck->retention_due = ck->rank == 0; /* with the uploads done; the writer runs it first */
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    moe_runtime_disown(ck->rt, MOE_CHILD_CHECKPOINTER);
    free_handle(ck);
    if (st != MOE_STATUS_SUCCESS) return MOE_FAIL(st, "%s", msg);
    return MOE_STATUS_SUCCESS;
}

void moe_ckpt_abort(moe_ckpt_t *ck)
{
    if (!ck || ck->magic != MOE_MAGIC_CKPT) return;
    pthread_mutex_lock(&ck->mu);
    ck->aborting = true; /* no further uploads start */
    pthread_cond_broadcast(&ck->cv);
    pthread_mutex_unlock(&ck->mu);
    if (ck->s3) ck_s3_cancel(ck->s3);
    moe_runtime_disown(ck->rt, MOE_CHILD_CHECKPOINTER);
    free_handle(ck);
}

/* ---- status, poll, wait -------------------------------------------------------------------- */

moe_status_t moe_ckpt_status(moe_ckpt_t *ck, moe_ckpt_status_t *status)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_ARG(status != NULL, "status is NULL");
    MOE_CHECK_STRUCT_SIZE(status, moe_ckpt_status_t,
                          offsetof(moe_ckpt_status_t, uploads_superseded));
    pthread_mutex_lock(&ck->mu);
    moe_ckpt_status_t s = ck->st;
    s.pending_uploads = ckpt_mirror_pending_locked(ck);
    if (ck->async_err != MOE_STATUS_SUCCESS)
        s.state = MOE_CKPT_FAILED;
    else if (s.pending_saves > 0)
        s.state = MOE_CKPT_WRITING;
    else if (ckpt_mirror_busy_locked(ck))
        s.state = MOE_CKPT_UPLOADING;
    else
        s.state = MOE_CKPT_IDLE;
    pthread_mutex_unlock(&ck->mu);
    s.struct_size = status->struct_size;
    memcpy(status, &s, status->struct_size < sizeof s ? status->struct_size : sizeof s);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_ckpt_poll(moe_ckpt_t *ck, int include_uploads)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_TRY(ckpt_take_async_error(ck, include_uploads != 0));
    pthread_mutex_lock(&ck->mu);
    bool busy = ckpt_busy_locked(ck, include_uploads);
    pthread_mutex_unlock(&ck->mu);
    return busy ? MOE_STATUS_IN_PROGRESS : MOE_STATUS_SUCCESS;
}

moe_status_t moe_ckpt_wait(moe_ckpt_t *ck, int include_uploads, int64_t timeout_ms)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_TRY(wait_idle(ck, include_uploads != 0, timeout_ms, true));
    return ckpt_take_async_error(ck, include_uploads != 0);
}

moe_status_t moe_ckpt_get_async_error(moe_ckpt_t *ck, char *message, size_t message_len)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    pthread_mutex_lock(&ck->mu);
    bool local = ck->async_err != MOE_STATUS_SUCCESS;
    moe_status_t st = local ? ck->async_err : ck->mirror_err;
    if (message && message_len)
        snprintf(message, message_len, "%s", local ? ck->async_msg : ck->mirror_msg);
    pthread_mutex_unlock(&ck->mu);
    return st;
}
