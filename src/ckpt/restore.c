/*
 * Finding and restoring checkpoints: moe_ckpt_list, and the loads, which try the candidate
 * steps newest first (rank 0 lists the local directory and S3 and shares the list). Every
 * rank loads the step (load.c) and the ranks agree on the outcome; a step bad locally is
 * fetched again from its S3 copy by rank 0, and a step bad everywhere falls back to the next
 * older one. A bad request (names, shapes) fails at once without a fallback. Steps newer than
 * the one loaded (those a load passed over) can be set aside under a hidden name.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "core/error.h"
#include "ckpt_internal.h"

/* ---- list ---------------------------------------------------------------------------------- */

moe_status_t moe_ckpt_list(moe_ckpt_t *ck, moe_ckpt_tier_t tier, int64_t *steps, int32_t capacity,
                           int32_t *count)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_ARG(count != NULL, "count is NULL");
    MOE_CHECK_ARG(capacity >= 0 && (capacity == 0 || steps != NULL), "steps/capacity invalid");
    MOE_CHECK_ARG(tier == MOE_CKPT_TIER_LOCAL || tier == MOE_CKPT_TIER_S3, "unknown tier %d",
                  (int)tier);
    int64_t *v = NULL;
    int32_t n = 0;
    if (tier == MOE_CKPT_TIER_LOCAL) {
        MOE_TRY(ckpt_local_steps(ck, &v, &n));
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

/* ---- set aside ----------------------------------------------------------------------------- */

/* Rank 0: rename step directory `from` (complete step `step`) to <dir>/.rejected-step-<N>-<unix
 * seconds>, a suffix added if that name is taken (the same step set aside twice in a second). */
static moe_status_t set_aside_one(moe_ckpt_t *ck, int64_t step, const char *from)
{
    pthread_mutex_lock(&ck->mu);
    bool uploading = ck->mir_round == step;
    if (!uploading && ck->mir_reconcile == step) ck->mir_reconcile = -1; /* nothing to upload */
    pthread_mutex_unlock(&ck->mu);
    if (uploading)
        return MOE_FAIL(MOE_STATUS_IN_PROGRESS,
                        "step %" PRId64 " is being uploaded to S3; "
                        "set it aside after moe_ckpt_wait with uploads",
                        step);
    char to[PATH_MAX];
    long long now = (long long)time(NULL);
    int rc = -1;
    for (int k = 0; k < 100 && rc != 0; k++) {
        if (k == 0)
            snprintf(to, sizeof to, "%s/%s%" PRId64 "-%lld", ck->dir, CK_SET_ASIDE_PREFIX, step,
                     now);
        else
            snprintf(to, sizeof to, "%s/%s%" PRId64 "-%lld-%d", ck->dir, CK_SET_ASIDE_PREFIX, step,
                     now, k);
        rc = rename(from, to);
        if (rc != 0 && errno != EEXIST && errno != ENOTEMPTY)
            return MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "rename(%s, %s)", from, to);
    }
    if (rc != 0) return MOE_FAIL(MOE_STATUS_IO_ERROR, "no free name to set %s aside", from);
    moe_log(ck->log, MOE_LOG_WARN, "checkpoint: step %" PRId64 " set aside as %s", step, to);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_ckpt_set_aside_newer(moe_ckpt_t *ck, int64_t step, int32_t *count)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_ARG(step >= -1, "step is %" PRId64 "; it must be >= -1", step);
    if (count) *count = 0;
    MOE_TRY(ckpt_drain_saves(ck)); /* collective: every queued save committed or failed */
    moe_status_t st = MOE_STATUS_SUCCESS;
    int32_t moved = 0;
    if (ck->rank == 0) {
        int64_t *v = NULL;
        int32_t n = 0;
        st = ckpt_local_steps(ck, &v, &n);
        char from[PATH_MAX];
        for (int32_t i = 0; st == MOE_STATUS_SUCCESS && i < n; i++) {
            if (v[i] <= step || !ckpt_local_step_dir(ck, v[i], from, sizeof from)) continue;
            st = set_aside_one(ck, v[i], from);
            if (st == MOE_STATUS_SUCCESS) moved++;
        }
        free(v);
        if (moved > 0) { /* the renames made so far stay, durably, whatever failed after */
            moe_status_t synced = ck_fsync_dir(ck->dir);
            if (st == MOE_STATUS_SUCCESS) st = synced;
        }
    }
    /* the others learn rank 0's outcome: the same status and count everywhere */
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moe_last_error());
    int32_t agreed_st = (int32_t)st, agreed_n = moved;
    MOE_TRY(ckpt_agree(ck->comm_w, ck->rank == 0 ? (int32_t)st : 0, MOE_REDUCE_MAX, &agreed_st));
    MOE_TRY(ckpt_agree(ck->comm_w, ck->rank == 0 ? moved : 0, MOE_REDUCE_MAX, &agreed_n));
    if (count) *count = agreed_n;
    if (agreed_st == MOE_STATUS_SUCCESS) return MOE_STATUS_SUCCESS;
    if (ck->rank == 0) return MOE_FAIL((moe_status_t)agreed_st, "%s", msg);
    return MOE_FAIL((moe_status_t)agreed_st,
                    "rank 0 could not set the steps newer than %" PRId64
                    " aside (%d moved; its log says why)",
                    step, agreed_n);
}

/* ---- load ---------------------------------------------------------------------------------- */

/* Severity of a load failure: 0 ok, 1 the checkpoint is bad (fall back), 2 the request is bad. */
static int32_t severity(moe_status_t st)
{
    if (st == MOE_STATUS_SUCCESS) return 0;
    if (st == MOE_STATUS_INVALID_ARGUMENT || st == MOE_STATUS_OUT_OF_MEMORY ||
        st == MOE_STATUS_BACKEND_ERROR || st == MOE_STATUS_UNSUPPORTED)
        return 2;
    return 1;
}

/* Rank 0: fetch step from S3 into a hidden directory, then swap it in for the local copy
 * `local` (whatever its name); the restored copy gets the padded name. */
static moe_status_t restore_from_s3(moe_ckpt_t *ck, int64_t step, const char *local)
{
    char name[64], tmpdir[PATH_MAX], bad[PATH_MAX], fin[PATH_MAX], lp[PATH_MAX + 300];
    ck_step_dirname(step, name, sizeof name);
    snprintf(tmpdir, sizeof tmpdir, "%s/.restore-%s", ck->dir, name);
    snprintf(bad, sizeof bad, "%s/.bad-%s", ck->dir, name);
    ckpt_step_path(ck, step, fin, sizeof fin);
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
    if (rename(local, bad) != 0 && errno != ENOENT) {
        st = MOE_FAIL_ERRNO(MOE_STATUS_IO_ERROR, "rename(%s)", local);
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
    moe_status_t cs = ckpt_agree(ck->comm_w, severity(st), MOE_REDUCE_MAX, sev);
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
static moe_status_t try_step(moe_ckpt_t *ck, int64_t step, bool on_s3, const moe_ckpt_tensor_t *t,
                             int32_t count)
{
    char stepdir[PATH_MAX];
    ckpt_local_step_dir(ck, step, stepdir, sizeof stepdir);
    int32_t sev;
    moe_status_t st = load_agreed(ck, stepdir, step, t, count, &sev);
    if (st == MOE_STATUS_SUCCESS || sev == 2) return st;
    moe_log(ck->log, st == MOE_STATUS_NOT_FOUND ? MOE_LOG_INFO : MOE_LOG_WARN,
            "checkpoint: local step %" PRId64 " unusable: %s%s", step, moe_last_error(),
            on_s3 ? "; trying its S3 copy" : "; falling back");
    if (!on_s3) return st;
    int32_t ok = 1;
    if (ck->rank == 0) {
        moe_status_t rs = restore_from_s3(ck, step, stepdir);
        if (rs != MOE_STATUS_SUCCESS) {
            moe_log(ck->log, MOE_LOG_WARN,
                    "checkpoint: S3 copy of step %" PRId64 " unusable: %s; falling back", step,
                    moe_last_error());
            ok = 0;
        }
    }
    if (ck->comm_w) MOE_TRY(moe_comm_broadcast_copy(ck->comm_w, &ok, 1, MOE_COMM_I32, 0));
    if (!ok)
        return MOE_FAIL(MOE_STATUS_CORRUPT, "step %" PRId64 " unusable locally and on S3", step);
    ckpt_step_path(ck, step, stepdir, sizeof stepdir); /* where the restored copy is */
    st = load_agreed(ck, stepdir, step, t, count, &sev);
    if (st != MOE_STATUS_SUCCESS && sev == 1)
        moe_log(ck->log, MOE_LOG_WARN, "checkpoint: S3 copy of step %" PRId64 " unusable: %s", step,
                moe_last_error());
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
        st = ckpt_local_steps(ck, &loc, &nl);
        if (st == MOE_STATUS_SUCCESS && ck->s3 &&
            ck_s3_list_steps(ck->s3, &rem, &nr, 1) != MOE_STATUS_SUCCESS) {
            moe_log(ck->log, MOE_LOG_WARN, "checkpoint: cannot list S3 (%s); local tier only",
                    moe_last_error());
            rem = NULL;
            nr = 0;
        }
    }
    int64_t n[2] = {st == MOE_STATUS_SUCCESS ? nl + nr : -1, nr};
    if (ck->comm_w) MOE_TRY(moe_comm_broadcast_copy(ck->comm_w, n, 2, MOE_COMM_I64, 0));
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
    if (ck->comm_w && n[0] + n[1] > 0) /* a failure leaves `all` to MPI */
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

/* Load the newest usable candidate (with `one`, step `want` only), newer ones failing for a
 * reason of the checkpoint falling back to older ones. Collective. */
static moe_status_t load_common(moe_ckpt_t *ck, bool one, int64_t want, const moe_ckpt_tensor_t *t,
                                int32_t count, int64_t *step)
{
    MOE_TRY(ck_check_request(t, count));
    MOE_TRY(ckpt_drain_saves(ck)); /* background errors stay on the handle for poll/wait */
    int64_t *cand = NULL, *rem = NULL;
    int32_t nc = 0, nr = 0;
    MOE_TRY(candidates(ck, &cand, &nc, &rem, &nr));
    moe_status_t st = one ? MOE_FAIL(MOE_STATUS_NOT_FOUND,
                                     "no checkpoint of step %" PRId64 " in %s%s", want, ck->dir,
                                     ck->s3 ? " or on S3" : "")
                          : MOE_FAIL(MOE_STATUS_NOT_FOUND, "no complete checkpoint in %s%s",
                                     ck->dir, ck->s3 ? " or on S3" : "");
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
        st = moe_error_wrap(MOE_STATUS_CORRUPT,
                            "no usable checkpoint (%d candidate%s tried, "
                            "newest first); last reason",
                            tried, tried == 1 ? "" : "s");
    free(cand);
    free(rem);
    return st;
}

moe_status_t moe_ckpt_load_latest(moe_ckpt_t *ck, const moe_ckpt_tensor_t *tensors, int32_t count,
                                  int64_t *step)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    return load_common(ck, false, -1, tensors, count, step);
}

moe_status_t moe_ckpt_load_step(moe_ckpt_t *ck, int64_t step, const moe_ckpt_tensor_t *tensors,
                                int32_t count)
{
    MOE_ENTRY(ck, MOE_MAGIC_CKPT, "checkpointer");
    MOE_CHECK_ARG(step >= 0, "step %" PRId64, step);
    return load_common(ck, true, step, tensors, count, NULL);
}
