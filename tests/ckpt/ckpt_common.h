/* Helpers shared by the checkpoint tests: a host runtime with a log capture, a small
 * checkpointer config, and a fixed tensor set whose contents are a function of the step, so
 * a loaded checkpoint can be checked bitwise against the step it claims to be.
 *
 * The tensor set (host backend):
 *   "dense.a"      f32  [37, 129]                 unsharded
 *   "dense.b"      bf16 [3, 70000]                unsharded, 420 000 bytes = 6.4 chunks of 64 KiB
 *   "experts.w"    f32  [4, 8, 16] of global [8, 8, 16]: local experts hold global ids 1,3,5,7
 *                  (round-robin placement, ep rank 1 of 2), so it is saved as 4 pieces
 * value(step, tensor t, element i) = hash(step, t, i) as raw bits (f32: a finite float). */
#ifndef MOE_TEST_CKPT_COMMON_H
#define MOE_TEST_CKPT_COMMON_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moe/moe.h>

#include "test_support.h"

#define CT_A_N (37 * 129)
#define CT_B_N (3 * 70000)
#define CT_E_N (4 * 8 * 16)

typedef struct ct_state {
    float *a;
    uint16_t *b;
    float *e;
    moe_ckpt_tensor_t t[3];
} ct_state_t;

static const int32_t ct_expert_ids[4] = {1, 3, 5, 7};

static inline uint64_t ct_hash(uint64_t step, uint64_t t, uint64_t i)
{
    test_rng_t r = {step * 0x100000001b3ull ^ (t << 40) ^ i};
    return test_rng_next(&r);
}

static inline float ct_f32(uint64_t h)
{
    /* a finite float in (-2, 2) from the hash */
    return (float)((double)(h >> 11) * 0x1.0p-53 * 4.0 - 2.0);
}

static inline void ct_fill(ct_state_t *s, int64_t step)
{
    for (int64_t i = 0; i < CT_A_N; i++) s->a[i] = ct_f32(ct_hash((uint64_t)step, 0, (uint64_t)i));
    for (int64_t i = 0; i < CT_B_N; i++)
        s->b[i] = (uint16_t)(ct_hash((uint64_t)step, 1, (uint64_t)i) & 0x7f7f);
    for (int64_t i = 0; i < CT_E_N; i++) s->e[i] = ct_f32(ct_hash((uint64_t)step, 2, (uint64_t)i));
}

/* 1 when every element equals the pattern of `step` */
static inline bool ct_check(const ct_state_t *s, int64_t step)
{
    for (int64_t i = 0; i < CT_A_N; i++)
        if (s->a[i] != ct_f32(ct_hash((uint64_t)step, 0, (uint64_t)i))) return false;
    for (int64_t i = 0; i < CT_B_N; i++)
        if (s->b[i] != (uint16_t)(ct_hash((uint64_t)step, 1, (uint64_t)i) & 0x7f7f)) return false;
    for (int64_t i = 0; i < CT_E_N; i++)
        if (s->e[i] != ct_f32(ct_hash((uint64_t)step, 2, (uint64_t)i))) return false;
    return true;
}

static inline void ct_init(ct_state_t *s)
{
    s->a = calloc(CT_A_N, sizeof *s->a);
    s->b = calloc(CT_B_N, sizeof *s->b);
    s->e = calloc(CT_E_N, sizeof *s->e);
    int64_t sa[2] = {37, 129}, sb[2] = {3, 70000}, se[3] = {4, 8, 16};
    moe_tensor_t ta, tb, te;
    TEST_OK(moe_tensor_view(s->a, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sa, &ta));
    TEST_OK(moe_tensor_view(s->b, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 2, sb, &tb));
    TEST_OK(moe_tensor_view(s->e, MOE_DTYPE_F32, MOE_DEVICE_HOST, 3, se, &te));
    s->t[0] = moe_ckpt_tensor_whole("dense.a", &ta);
    s->t[1] = moe_ckpt_tensor_whole("dense.b", &tb);
    s->t[2] = moe_ckpt_tensor_whole("experts.w", &te);
    s->t[2].global_shape[0] = 8;
    s->t[2].global_shape[1] = 8;
    s->t[2].global_shape[2] = 16;
    s->t[2].expert_dim = 0;
    s->t[2].expert_ids = ct_expert_ids;
}

static inline void ct_free(ct_state_t *s)
{
    free(s->a);
    free(s->b);
    free(s->e);
}

/* ---- log capture (the runtime's callback; background threads call it) ---- */

typedef struct ct_log {
    pthread_mutex_t mu;
    char text[1 << 16];
    size_t len;
} ct_log_t;

static ct_log_t ct_log_buf = {PTHREAD_MUTEX_INITIALIZER, {0}, 0};

static void ct_log_fn(moe_log_level_t level, const char *msg, void *ud)
{
    (void)ud;
    pthread_mutex_lock(&ct_log_buf.mu);
    int n = snprintf(ct_log_buf.text + ct_log_buf.len, sizeof ct_log_buf.text - ct_log_buf.len,
                     "[%d] %s\n", (int)level, msg);
    if (n > 0 && ct_log_buf.len + (size_t)n < sizeof ct_log_buf.text) ct_log_buf.len += (size_t)n;
    pthread_mutex_unlock(&ct_log_buf.mu);
    if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "log[%d] %s\n", (int)level, msg);
}

static inline void ct_log_clear(void)
{
    pthread_mutex_lock(&ct_log_buf.mu);
    ct_log_buf.len = 0;
    ct_log_buf.text[0] = 0;
    pthread_mutex_unlock(&ct_log_buf.mu);
}

static inline bool ct_log_has(const char *needle)
{
    pthread_mutex_lock(&ct_log_buf.mu);
    bool r = strstr(ct_log_buf.text, needle) != NULL;
    pthread_mutex_unlock(&ct_log_buf.mu);
    return r;
}

static inline moe_runtime_t *ct_runtime(void)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.log_level = MOE_LOG_INFO;
    rc.log_fn = ct_log_fn;
    moe_runtime_t *rt = NULL;
    TEST_OK(moe_runtime_create(&rc, &rt));
    return rt;
}

/* 64 KiB chunks, 256 KiB of staging (4 segments < the 460 KB state: double-buffering). */
static inline moe_ckpt_config_t ct_config(const char *dir)
{
    moe_ckpt_config_t c = moe_ckpt_config_default();
    c.dir = dir;
    c.chunk_bytes = 64 << 10;
    c.pinned_budget_bytes = 256 << 10;
    c.queue_depth = 4;
    c.io_block_bytes = 16 << 10;
    c.keep_last = 0;
    return c;
}

static inline void ct_tempdir(char *buf, size_t n, const char *tag)
{
    snprintf(buf, n, "/tmp/moe-ckpt-%s-XXXXXX", tag);
    if (!mkdtemp(buf)) {
        perror("mkdtemp");
        abort();
    }
}

static inline void ct_rmrf(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

/* A test's fixture of a directory and a runtime: a fresh directory named after tag, a host
 * runtime logging into the capture, the capture emptied; ct_down removes both. */
static inline void ct_up(char *dir, size_t n, const char *tag, moe_runtime_t **rt)
{
    ct_tempdir(dir, n, tag);
    *rt = ct_runtime();
    ct_log_clear();
}

static inline void ct_down(const char *dir, moe_runtime_t *rt)
{
    moe_runtime_destroy(rt);
    ct_rmrf(dir);
}

#endif
