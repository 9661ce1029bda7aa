/*
 * What every file of the checkpointer handle shares, beneath all of them: the two error
 * channels of background work (the local tier's and the mirror's), step directory paths, the
 * list of complete local steps and the agreement of ranks on one value. Nothing here calls
 * back into the handle's other files (ckpt_internal.h draws their order).
 */
#include <dirent.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "ckpt_internal.h"

/* ---- the async error ----------------------------------------------------------------------- */

void ckpt_set_async_error(moe_ckpt_t *ck, moe_status_t st, const char *what)
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

moe_status_t ckpt_take_async_error(moe_ckpt_t *ck, bool uploads)
{
    pthread_mutex_lock(&ck->mu);
    moe_status_t st = ck->async_err;
    char msg[1024];
    if (st != MOE_STATUS_SUCCESS) {
        snprintf(msg, sizeof msg, "%s", ck->async_msg);
        ck->async_err = MOE_STATUS_SUCCESS;
        ck->async_msg[0] = 0;
        if (ck->st.state == MOE_CKPT_FAILED) ck->st.state = MOE_CKPT_IDLE;
    } else if (uploads && ck->mirror_err != MOE_STATUS_SUCCESS) {
        st = ck->mirror_err;
        snprintf(msg, sizeof msg, "%s", ck->mirror_msg);
        ck->mirror_err = MOE_STATUS_SUCCESS;
        ck->mirror_msg[0] = 0;
    }
    pthread_mutex_unlock(&ck->mu);
    if (st != MOE_STATUS_SUCCESS) return MOE_FAIL(st, "background checkpoint work failed: %s", msg);
    return MOE_STATUS_SUCCESS;
}

bool ckpt_error_pending_locked(const moe_ckpt_t *ck, bool uploads)
{
    return ck->async_err != MOE_STATUS_SUCCESS || (uploads && ck->mirror_err != MOE_STATUS_SUCCESS);
}

/* ---- steps on local disk ------------------------------------------------------------------- */

void ckpt_step_path(const moe_ckpt_t *ck, int64_t step, char *buf, size_t len)
{
    char name[64];
    ck_step_dirname(step, name, sizeof name);
    snprintf(buf, len, "%s/%s", ck->dir, name);
}

moe_status_t ckpt_local_steps(const moe_ckpt_t *ck, int64_t **out, int32_t *n)
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
        if (!ck_file_exists(path)) continue;
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
    int32_t u = 0; /* "step-4" and "step-000000000004" are one step */
    for (int32_t i = 0; i < cnt; i++)
        if (u == 0 || v[u - 1] != v[i]) v[u++] = v[i];
    *out = v;
    *n = u;
    return MOE_STATUS_SUCCESS;
}

bool ckpt_local_step_dir(const moe_ckpt_t *ck, int64_t step, char *buf, size_t len)
{
    char mpath[PATH_MAX + 32];
    ckpt_step_path(ck, step, buf, len);
    snprintf(mpath, sizeof mpath, "%s/%s", buf, CK_MANIFEST);
    if (ck_file_exists(mpath)) return true;
    /* another spelling of the number (the spec lets writers omit the padding) */
    DIR *d = opendir(ck->dir);
    if (!d) return false;
    struct dirent *e;
    bool found = false;
    while (!found && (e = readdir(d)) != NULL) {
        int64_t s;
        if (!ck_parse_step_dirname(e->d_name, &s) || s != step) continue;
        snprintf(mpath, sizeof mpath, "%s/%s/%s", ck->dir, e->d_name, CK_MANIFEST);
        if (!ck_file_exists(mpath)) continue;
        snprintf(buf, len, "%s/%s", ck->dir, e->d_name);
        found = true;
    }
    closedir(d);
    if (!found) ckpt_step_path(ck, step, buf, len);
    return found;
}

/* ---- agreement between ranks --------------------------------------------------------------- */

moe_status_t ckpt_agree(moe_comm_t *c, int32_t v, moe_reduce_op_t op, int32_t *out)
{
    *out = v;
    if (!c) return MOE_STATUS_SUCCESS;
    return moe_comm_allreduce_copy(c, &v, out, 1, MOE_COMM_I32, op);
}
