/*
 * One data file written from pinned staging segments with io_uring: O_DIRECT, buffers
 * registered with the ring (write_fixed), up to queue_depth requests of io_block bytes in
 * flight, short writes resubmitted. Every error is translated here, once, with the call,
 * the file and the kernel's text.
 *
 * Fallbacks, each logged once per checkpointer:
 *   - io_uring unavailable (old kernel, seccomp in containers): synchronous pwrite;
 *   - O_DIRECT refused at open or by the first write (EINVAL): buffered writes;
 *   - buffer registration refused (RLIMIT_MEMLOCK): unregistered writes.
 * Also the small file-system helpers of the checkpointer (fsync of a directory, mkdir -p,
 * atomic small-file write, rm -r).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <liburing.h>

#include "core/env.h"
#include "core/error.h"
#include "ckpt_internal.h"

#define CK_MAX_REG_SLOTS 1024

typedef struct track { /* one ck_writer_write call */
    void *cookie;
    void (*done)(void *, void *);
    void *done_ctx;
    int remaining; /* requests not yet completed */
    bool all_submitted;
} track_t;

typedef struct wreq {
    const uint8_t *buf;
    size_t len;
    uint64_t off;
    int slot;
    bool in_flight, direct; /* submitted and not reaped; submitted while O_DIRECT was on */
    track_t *tr;
    struct wreq *next_free;
} wreq_t;

struct ck_writer {
    const moe_logger_t *log;
    bool uring, direct_wanted, direct, reg_ok;
    bool reg_slot[CK_MAX_REG_SLOTS];
    int qd, inflight;
    size_t io_block;
    struct io_uring ring;
    wreq_t *reqs, *free_reqs;
    int fd;
    char path[PATH_MAX];
    moe_status_t err; /* first failure on the current file */
};

bool ck_writer_direct(const ck_writer_t *w) { return w->direct; }

moe_status_t ck_writer_create(int queue_depth, size_t io_block, bool direct,
                              const moe_logger_t *log, ck_writer_t **out)
{
    ck_writer_t *w = calloc(1, sizeof *w);
    if (!w) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "writer");
    w->log = log;
    w->qd = queue_depth;
    w->io_block = io_block;
    w->direct_wanted = w->direct = direct;
    w->fd = -1;
    w->reqs = calloc((size_t)queue_depth, sizeof *w->reqs);
    if (!w->reqs) {
        free(w);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "writer requests");
    }
    for (int i = 0; i < queue_depth; i++) {
        w->reqs[i].next_free = w->free_reqs;
        w->free_reqs = &w->reqs[i];
    }
    bool force = moe_env_flag(MOE_ENV_CKPT_NO_URING, false, log);
    int rc = force ? -ENOSYS : io_uring_queue_init((unsigned)queue_depth, &w->ring, 0);
    if (rc < 0) {
        moe_log(log, MOE_LOG_WARN,
                "checkpoint: io_uring_queue_init failed (%s); writing with pwrite instead",
                strerror(-rc));
    } else {
        w->uring = true;
        int r2 = io_uring_register_buffers_sparse(&w->ring, CK_MAX_REG_SLOTS);
        w->reg_ok = r2 == 0;
        if (!w->reg_ok)
            moe_log(log, MOE_LOG_INFO,
                    "checkpoint: io_uring buffer registration unavailable (%s); using "
                    "unregistered buffers",
                    strerror(-r2));
    }
    *out = w;
    return MOE_STATUS_SUCCESS;
}

void ck_writer_register(ck_writer_t *w, int slot, void *buf, size_t len)
{
    if (!w->uring || !w->reg_ok || slot < 0 || slot >= CK_MAX_REG_SLOTS || w->reg_slot[slot])
        return;
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    int rc = io_uring_register_buffers_update_tag(&w->ring, (unsigned)slot, &iov, NULL, 1);
    if (rc < 0 || rc == 0) {
        w->reg_ok = false;
        moe_log(w->log, MOE_LOG_INFO,
                "checkpoint: registering a %zu-byte staging buffer failed (%s); using "
                "unregistered buffers",
                len, rc < 0 ? strerror(-rc) : "0 updated");
        return;
    }
    w->reg_slot[slot] = true;
}

static void fail_once(ck_writer_t *w, moe_status_t st)
{
    if (w->err == MOE_STATUS_SUCCESS) w->err = st;
}

moe_status_t ck_writer_open(ck_writer_t *w, const char *path)
{
    w->err = MOE_STATUS_SUCCESS;
    snprintf(w->path, sizeof w->path, "%s", path);
    int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
    if (w->direct) {
        w->fd = open(path, flags | O_DIRECT, 0644);
        if (w->fd < 0 && errno == EINVAL) {
            w->direct = false;
            moe_log(w->log, MOE_LOG_WARN,
                    "checkpoint: the file system of %s refuses O_DIRECT; using buffered writes",
                    path);
        } else if (w->fd < 0) {
            return MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "open(%s, O_DIRECT)", path);
        }
    }
    if (w->fd < 0)
        MOE_CHECK_ERRNO_MSG(w->fd = open(path, flags, 0644), MOE_STATUS_IO_ERROR, "open(%s)", path);
    return MOE_STATUS_SUCCESS;
}

static void drop_direct(ck_writer_t *w)
{
    int fl = fcntl(w->fd, F_GETFL);
    if (fl >= 0) fcntl(w->fd, F_SETFL, fl & ~O_DIRECT);
    w->direct = false;
    moe_log(w->log, MOE_LOG_WARN,
            "checkpoint: O_DIRECT writes to %s were refused (EINVAL); using buffered writes",
            w->path);
}

static void submit_req(ck_writer_t *w, wreq_t *r)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&w->ring);
    /* qd requests at most, so an SQE is always available */
    if (r->slot >= 0 && w->reg_ok && w->reg_slot[r->slot])
        io_uring_prep_write_fixed(sqe, w->fd, r->buf, (unsigned)r->len, r->off, r->slot);
    else
        io_uring_prep_write(sqe, w->fd, r->buf, (unsigned)r->len, r->off);
    io_uring_sqe_set_data(sqe, r);
    r->in_flight = true;
    r->direct = w->direct;
    w->inflight++;
}

static void complete_part(ck_writer_t *w, wreq_t *r)
{
    track_t *tr = r->tr;
    r->next_free = w->free_reqs;
    w->free_reqs = r;
    if (--tr->remaining == 0 && tr->all_submitted) {
        if (tr->done) tr->done(tr->done_ctx, tr->cookie);
        free(tr);
    }
}

/* Reap at least `min` completions (0: whatever is ready). */
static void reap(ck_writer_t *w, int min)
{
    int got = 0;
    while (w->inflight > 0) {
        struct io_uring_cqe *cqe;
        int rc;
        if (got < min) {
            io_uring_submit(&w->ring);
            rc = io_uring_wait_cqe(&w->ring, &cqe);
        } else {
            rc = io_uring_peek_cqe(&w->ring, &cqe);
        }
        if (rc == -EINTR) continue;
        if (rc < 0) {
            if (got >= min) return; /* -EAGAIN: nothing ready */
            fail_once(w, MOE_FAIL_ERRNUM(MOE_STATUS_IO_ERROR, -rc, "io_uring_wait_cqe"));
            /* the ring is unusable: what is in flight ends as failed, so that its segments
             * are released and no one waits for a free request that never comes */
            for (int i = 0; i < w->qd; i++)
                if (w->reqs[i].in_flight) {
                    w->reqs[i].in_flight = false;
                    complete_part(w, &w->reqs[i]);
                }
            w->inflight = 0;
            return;
        }
        wreq_t *r = io_uring_cqe_get_data(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&w->ring, cqe);
        r->in_flight = false;
        w->inflight--;
        got++;
        if (res == -EINVAL && r->direct) { /* every write sent under O_DIRECT, not the first */
            if (w->direct) drop_direct(w);
            submit_req(w, r);
            continue;
        }
        if (res == -EAGAIN || res == -EINTR) {
            submit_req(w, r);
            continue;
        }
        if (res < 0) {
            fail_once(w, MOE_FAIL_ERRNUM(MOE_STATUS_IO_ERROR, -res,
                                         "io_uring write of %zu bytes at offset %llu to %s", r->len,
                                         (unsigned long long)r->off, w->path));
            complete_part(w, r);
            continue;
        }
        if ((size_t)res < r->len) { /* short write: the rest again */
            r->buf += res;
            r->len -= (size_t)res;
            r->off += (uint64_t)res;
            if (res == 0) {
                fail_once(w,
                          MOE_FAIL(MOE_STATUS_IO_ERROR, "write to %s made no progress", w->path));
                complete_part(w, r);
                continue;
            }
            submit_req(w, r);
            continue;
        }
        complete_part(w, r);
    }
}

static moe_status_t pwrite_all(ck_writer_t *w, const uint8_t *buf, size_t len, uint64_t off)
{
    while (len > 0) {
        ssize_t n = pwrite(w->fd, buf, len, (off_t)off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EINVAL && w->direct) {
            drop_direct(w);
            continue;
        }
        if (n <= 0)
            return MOE_FAIL(MOE_STATUS_IO_ERROR,
                            "pwrite of %zu bytes at offset %llu to %s "
                            "failed: %s",
                            len, (unsigned long long)off, w->path,
                            n < 0 ? strerror(errno) : "no progress");
        buf += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t ck_writer_write(ck_writer_t *w, int slot, const void *buf, size_t len, uint64_t offset,
                             void *cookie, void (*done)(void *, void *), void *done_ctx)
{
    if (!w->uring || w->err != MOE_STATUS_SUCCESS) {
        if (w->err == MOE_STATUS_SUCCESS) fail_once(w, pwrite_all(w, buf, len, offset));
        if (done) done(done_ctx, cookie);
        return w->err;
    }
    track_t *tr = calloc(1, sizeof *tr);
    if (!tr) {
        fail_once(w, MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "write tracker"));
        if (done) done(done_ctx, cookie);
        return w->err;
    }
    tr->cookie = cookie;
    tr->done = done;
    tr->done_ctx = done_ctx;
    tr->remaining = 1; /* held until all parts are submitted */
    const uint8_t *p = buf;
    for (size_t pos = 0; pos < len; pos += w->io_block) {
        while (!w->free_reqs) reap(w, 1);
        wreq_t *r = w->free_reqs;
        w->free_reqs = r->next_free;
        r->buf = p + pos;
        r->len = len - pos < w->io_block ? len - pos : w->io_block;
        r->off = offset + pos;
        r->slot = slot;
        r->tr = tr;
        tr->remaining++;
        submit_req(w, r);
    }
    io_uring_submit(&w->ring);
    tr->all_submitted = true;
    if (--tr->remaining == 0) {
        if (done) done(done_ctx, cookie);
        free(tr);
    }
    reap(w, 0);
    return w->err;
}

bool ck_writer_pending(const ck_writer_t *w) { return w->uring && w->inflight > 0; }

void ck_writer_reap_one(ck_writer_t *w)
{
    if (w->uring && w->inflight > 0) reap(w, 1);
}

moe_status_t ck_writer_finish(ck_writer_t *w)
{
    while (w->uring && w->inflight > 0) reap(w, 1);
    if (w->fd >= 0) {
        if (w->err == MOE_STATUS_SUCCESS && fsync(w->fd) != 0)
            fail_once(w, MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "fsync(%s)", w->path));
        if (close(w->fd) != 0 && w->err == MOE_STATUS_SUCCESS)
            fail_once(w, MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "close(%s)", w->path));
        w->fd = -1;
    }
    moe_status_t st = w->err;
    w->err = MOE_STATUS_SUCCESS;
    return st;
}

void ck_writer_cancel(ck_writer_t *w)
{
    while (w->uring && w->inflight > 0) reap(w, 1);
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
    w->err = MOE_STATUS_SUCCESS;
}

void ck_writer_destroy(ck_writer_t *w)
{
    if (!w) return;
    ck_writer_cancel(w);
    if (w->uring) io_uring_queue_exit(&w->ring);
    free(w->reqs);
    free(w);
}

/* ---- file-system helpers ------------------------------------------------------------------- */

bool ck_file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

moe_status_t ck_fsync_dir(const char *dir)
{
    int fd;
    MOE_CHECK_ERRNO_MSG(fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC), MOE_STATUS_IO_ERROR,
                        "open(%s)", dir);
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0 && e != EINVAL) /* some file systems cannot fsync directories */
        return MOE_FAIL_ERRNUM(MOE_STATUS_IO_ERROR, e, "fsync(%s)", dir);
    return MOE_STATUS_SUCCESS;
}

moe_status_t ck_mkdir_p(const char *dir)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf)
        return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, "directory path too long");
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "mkdir(%s)", buf);
            *p = c;
            if (c == 0) break;
        }
    }
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return MOE_FAIL(MOE_STATUS_IO_ERROR, "%s is not a directory", dir);
    return MOE_STATUS_SUCCESS;
}

moe_status_t ck_write_file_atomic(const char *dir, const char *name, const void *data, size_t len)
{
    char tmp[PATH_MAX], dst[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, name);
    snprintf(dst, sizeof dst, "%s/%s", dir, name);
    int fd;
    MOE_CHECK_ERRNO_MSG(fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                        MOE_STATUS_IO_ERROR, "open(%s)", tmp);
    moe_status_t st = MOE_STATUS_SUCCESS;
    const char *p = data;
    size_t left = len;
    while (left > 0) {
        ssize_t n = write(fd, p, left);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            st = MOE_FAIL(MOE_STATUS_IO_ERROR, "write(%s) failed: %s", tmp,
                          n < 0 ? strerror(errno) : "no progress");
            goto fail;
        }
        p += n;
        left -= (size_t)n;
    }
    MOE_CHECK_ERRNO_MSG_GOTO(st, fsync(fd), MOE_STATUS_IO_ERROR, "fsync(%s)", tmp);
    close(fd);
    fd = -1;
    MOE_CHECK_ERRNO_MSG_GOTO(st, rename(tmp, dst), MOE_STATUS_IO_ERROR, "rename(%s, %s)", tmp, dst);
    return ck_fsync_dir(dir);
fail:
    if (fd >= 0) close(fd);
    unlink(tmp);
    return st;
}

moe_status_t ck_rmtree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) return MOE_STATUS_SUCCESS;
        return MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "opendir(%s)", dir);
    }
    struct dirent *e;
    char path[PATH_MAX];
    moe_status_t st = MOE_STATUS_SUCCESS;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (lstat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
            moe_status_t s2 = ck_rmtree(path);
            if (st == MOE_STATUS_SUCCESS) st = s2;
        } else if (unlink(path) != 0 && errno != ENOENT && st == MOE_STATUS_SUCCESS) {
            st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "unlink(%s)", path);
        }
    }
    closedir(d);
    if (rmdir(dir) != 0 && errno != ENOENT && st == MOE_STATUS_SUCCESS)
        st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "rmdir(%s)", dir);
    return st;
}
