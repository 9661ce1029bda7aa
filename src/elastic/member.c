/*
 * A rank's elastic membership (moe/elastic.h): an etcd lease, the member key attached to it,
 * and the keep-alive thread that renews the lease and writes the progress the training loop
 * reports. The loop only stores its phase and step under a mutex and signals the thread, so a
 * slow or absent etcd never delays a training step; the thread's first failure is kept and
 * returned by the member's next call.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <moe/elastic.h>

#include "core/env.h"
#include "core/error.h"
#include "etcd.h"

#define MAX_RENEW_MS 1000 /* renew at least this often, whatever the TTL */

struct moe_elastic_member {
    uint64_t magic;
    el_etcd_t *etcd;
    char *prefix, *key;
    int32_t slot, rank;
    int64_t lease, renew_ms;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    bool stop, dirty;
    moe_elastic_phase_t phase;
    int64_t step, resumed_step; /* resumed_step: -1 until RESUMED is reported */
    moe_status_t failed;        /* the thread's first failure */
    char failure[512];
    char *launcher_key; /* NULL: not watched (under lock) */
    int64_t orphan_ms;
    struct timespec contact; /* the last request etcd answered */
    moe_elastic_orphan_fn on_orphan;
    void *orphan_user;
    bool orphaned;
    /* the last MOE_ELASTIC_BUSY_WINDOW busy times reported, a ring (under lock) */
    int64_t busy_step[MOE_ELASTIC_BUSY_WINDOW];
    double busy_s[MOE_ELASTIC_BUSY_WINDOW];
    int nbusy, busy_next;
};

static const char *phase_name(moe_elastic_phase_t p)
{
    return p == MOE_ELASTIC_PHASE_RESUMED    ? "resumed"
           : p == MOE_ELASTIC_PHASE_TRAINING ? "training"
                                             : "started";
}

moe_elastic_member_config_t moe_elastic_member_config_default(void)
{
    return (moe_elastic_member_config_t){.struct_size = sizeof(moe_elastic_member_config_t),
                                         .slot = -1,
                                         .rank = -1,
                                         .ttl_ms = 5000,
                                         .request_timeout_ms = 2000};
}

/* The member key's value; NULL when out of memory. Called with the lock held, or before the
 * thread starts. */
static char *member_value(const moe_elastic_member_t *m, moe_elastic_phase_t phase, int64_t step)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddNumberToObject(o, "slot", m->slot);
    cJSON_AddNumberToObject(o, "rank", m->rank);
    cJSON_AddNumberToObject(o, "pid", (double)getpid());
    cJSON_AddStringToObject(o, "phase", phase_name(phase));
    cJSON_AddNumberToObject(o, "step", (double)step);
    cJSON_AddNumberToObject(o, "resumed_step", (double)m->resumed_step);
    if (m->nbusy) { /* [[step, seconds], ...], oldest first */
        cJSON *busy = cJSON_AddArrayToObject(o, "busy");
        for (int i = 0; busy && i < m->nbusy; i++) {
            int k = (m->busy_next - m->nbusy + i + MOE_ELASTIC_BUSY_WINDOW) %
                    MOE_ELASTIC_BUSY_WINDOW;
            cJSON *pair = cJSON_CreateArray();
            cJSON_AddItemToArray(pair, cJSON_CreateNumber((double)m->busy_step[k]));
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(m->busy_s[k]));
            cJSON_AddItemToArray(busy, pair);
        }
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* Writes a member value (NULL: out of memory) and frees it. */
static moe_status_t put_member(moe_elastic_member_t *m, char *v)
{
    if (!v) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "elastic member value");
    moe_status_t st = el_etcd_put(m->etcd, m->key, v, m->lease);
    free(v);
    return st;
}

static void deadline_in(struct timespec *ts, int64_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000;
    if (ts->tv_nsec >= 1000000000) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000;
    }
}

static int64_t ms_since(const struct timespec *t)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)(now.tv_sec - t->tv_sec) * 1000 + (now.tv_nsec - t->tv_nsec) / 1000000;
}

/* Why the member is orphaned after a renewal that returned st, or NULL (keep-alive thread). */
static const char *orphan_cause(moe_elastic_member_t *m, moe_status_t st)
{
    char key[512] = "";
    pthread_mutex_lock(&m->lock);
    if (m->launcher_key) snprintf(key, sizeof key, "%s", m->launcher_key);
    int64_t orphan_ms = m->orphan_ms;
    pthread_mutex_unlock(&m->lock);
    if (st == MOE_STATUS_NOT_FOUND) return "its own lease expired: the launcher has given it up";
    if (st != MOE_STATUS_SUCCESS)
        return key[0] && ms_since(&m->contact) > orphan_ms
                   ? "etcd unreachable for longer than the orphan time"
                   : NULL;
    clock_gettime(CLOCK_MONOTONIC, &m->contact);
    if (!key[0]) return NULL;
    el_kv_t *kvs;
    size_t n;
    if (el_etcd_range_prefix(m->etcd, key, &kvs, &n) != MOE_STATUS_SUCCESS)
        return NULL; /* judged at the next renewal */
    el_kvs_free(kvs, n);
    return n ? NULL : "the launcher's lease expired: the launcher is gone";
}

static void notify_orphan(moe_elastic_member_t *m, const char *why)
{
    pthread_mutex_lock(&m->lock);
    bool first = !m->orphaned;
    m->orphaned = true;
    moe_elastic_orphan_fn fn = m->on_orphan;
    void *user = m->orphan_user;
    pthread_mutex_unlock(&m->lock);
    if (first && fn) fn(user, why);
}

static void *keepalive_main(void *arg)
{
    moe_elastic_member_t *m = arg;
    struct timespec next;
    deadline_in(&next, m->renew_ms);
    pthread_mutex_lock(&m->lock);
    while (!m->stop) {
        if (!m->dirty) pthread_cond_timedwait(&m->wake, &m->lock, &next);
        if (m->stop) break;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        bool renew = now.tv_sec > next.tv_sec ||
                     (now.tv_sec == next.tv_sec && now.tv_nsec >= next.tv_nsec);
        bool write = m->dirty;
        char *value = write ? member_value(m, m->phase, m->step) : NULL;
        m->dirty = false;
        pthread_mutex_unlock(&m->lock);
        moe_status_t st = MOE_STATUS_SUCCESS;
        if (renew) {
            st = el_etcd_lease_keepalive(m->etcd, m->lease);
            deadline_in(&next, m->renew_ms);
        }
        if (st == MOE_STATUS_SUCCESS && write)
            st = put_member(m, value);
        else
            free(value);
        const char *orphan = renew ? orphan_cause(m, st) : NULL;
        if (orphan) notify_orphan(m, orphan);
        pthread_mutex_lock(&m->lock);
        if (st != MOE_STATUS_SUCCESS && m->failed == MOE_STATUS_SUCCESS) {
            m->failed = st;
            snprintf(m->failure, sizeof m->failure, "%s", moe_last_error());
        }
        if (st == MOE_STATUS_NOT_FOUND) break; /* the lease is gone: nothing left to renew */
    }
    pthread_mutex_unlock(&m->lock);
    return NULL;
}

static void member_free(moe_elastic_member_t *m)
{
    el_etcd_destroy(m->etcd);
    free(m->launcher_key);
    free(m->prefix);
    free(m->key);
    m->magic = MOE_MAGIC_DEAD;
    free(m);
}

moe_status_t moe_elastic_member_create(const moe_elastic_member_config_t *c,
                                       moe_elastic_member_t **out)
{
    moe_error_clear();
    MOE_CHECK_ARG(c && out, "config and out must not be NULL");
    *out = NULL;
    MOE_CHECK_STRUCT_SIZE(c, moe_elastic_member_config_t, sizeof(moe_elastic_member_config_t));
    MOE_CHECK_ARG(c->endpoint && c->prefix && c->prefix[0] == '/',
                  "elastic member: endpoint and prefix (starting with '/') are required");
    MOE_CHECK_ARG(c->slot >= 0 && c->rank >= 0, "elastic member: slot %d and rank %d must be >= 0",
                  (int)c->slot, (int)c->rank);
    MOE_CHECK_ARG(c->ttl_ms > 0 && c->request_timeout_ms > 0,
                  "elastic member: ttl_ms %d and request_timeout_ms %d must be > 0", (int)c->ttl_ms,
                  (int)c->request_timeout_ms);
    moe_elastic_member_t *m = calloc(1, sizeof *m);
    if (!m) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "elastic member");
    m->magic = MOE_MAGIC_MEMBER;
    m->slot = c->slot;
    m->rank = c->rank;
    m->resumed_step = -1;
    clock_gettime(CLOCK_MONOTONIC, &m->contact);
    int64_t ttl_s = (c->ttl_ms + 999) / 1000;
    moe_status_t st = el_etcd_create(c->endpoint, c->request_timeout_ms, &m->etcd);
    if (st != MOE_STATUS_SUCCESS) {
        member_free(m);
        return st;
    }
    size_t kl = strlen(c->prefix) + 32;
    m->prefix = strdup(c->prefix);
    m->key = malloc(kl);
    if (!m->prefix || !m->key) {
        member_free(m);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "elastic member key");
    }
    snprintf(m->key, kl, "%s/member/%d", c->prefix, (int)c->slot);
    int64_t granted = 0;
    st = el_etcd_lease_grant(m->etcd, ttl_s, &m->lease, &granted);
    if (st == MOE_STATUS_SUCCESS) st = put_member(m, member_value(m, MOE_ELASTIC_PHASE_STARTED, 0));
    if (st != MOE_STATUS_SUCCESS) {
        if (m->lease) el_etcd_lease_revoke(m->etcd, m->lease);
        member_free(m);
        return moe_error_wrap(st, "elastic member of slot %d: ", (int)c->slot);
    }
    /* a third of the granted TTL leaves two renewals' slack before the lease expires */
    m->renew_ms = (granted > 0 ? granted : ttl_s) * 1000 / 3;
    if (m->renew_ms > MAX_RENEW_MS) m->renew_ms = MAX_RENEW_MS;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&m->wake, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&m->lock, NULL);
    MOE_CHECK_PTHREAD_GOTO(st, pthread_create(&m->thread, NULL, keepalive_main, m),
                           MOE_STATUS_INTERNAL);
    *out = m;
    return MOE_STATUS_SUCCESS;
fail:
    el_etcd_lease_revoke(m->etcd, m->lease);
    pthread_cond_destroy(&m->wake);
    pthread_mutex_destroy(&m->lock);
    member_free(m);
    return st;
}

/* The r-th entry of a comma-separated list of slots; -1 when absent or malformed. */
static int slot_of_rank(const char *slots, int32_t rank)
{
    const char *p = slots;
    for (int32_t i = 0; *p; i++) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || (*end && *end != ',')) return -1;
        if (i == rank) return (int)v;
        p = *end ? end + 1 : end;
    }
    return -1;
}

moe_status_t moe_elastic_member_create_from_env(int32_t rank, moe_elastic_member_t **out)
{
    moe_error_clear();
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    const char *endpoint = moe_env_string(MOE_ENV_ELASTIC_ENDPOINT, NULL);
    if (!endpoint) return MOE_STATUS_SUCCESS;
    moe_elastic_member_config_t c = moe_elastic_member_config_default();
    c.endpoint = endpoint;
    c.prefix = moe_env_string(MOE_ENV_ELASTIC_PREFIX, NULL);
    c.rank = rank;
    MOE_CHECK_ARG(c.prefix && c.prefix[0] == '/',
                  "MOE_ELASTIC_PREFIX (\"%s\") must be set and start with '/' when "
                  "MOE_ELASTIC_ENDPOINT is",
                  c.prefix ? c.prefix : "");
    const char *slots = moe_env_string(MOE_ENV_ELASTIC_SLOTS, NULL);
    c.slot = slots ? slot_of_rank(slots, rank) : -1;
    MOE_CHECK_ARG(c.slot >= 0, "MOE_ELASTIC_SLOTS (\"%s\") gives no slot to world rank %d",
                  slots ? slots : "", (int)rank);
    size_t ttl = (size_t)c.ttl_ms;
    MOE_TRY(moe_env_positive_checked(MOE_ENV_ELASTIC_TTL_MS, INT32_MAX - 1, &ttl, NULL));
    c.ttl_ms = (int32_t)ttl;
    const char *launcher = moe_env_string(MOE_ENV_ELASTIC_LAUNCHER_KEY, NULL);
    size_t orphan_ms = 60000;
    MOE_TRY(moe_env_positive_checked(MOE_ENV_ELASTIC_ORPHAN_MS, INT32_MAX - 1, &orphan_ms, NULL));
    moe_status_t st = moe_elastic_member_create(&c, out);
    if (st != MOE_STATUS_SUCCESS || !launcher || !*launcher) return st;
    st = moe_elastic_member_watch_launcher(*out, launcher, (int32_t)orphan_ms);
    if (st != MOE_STATUS_SUCCESS) {
        moe_elastic_member_destroy(*out);
        *out = NULL;
    }
    return st;
}

/* The thread's first failure as this call's status, or SUCCESS. Called with the lock held. */
static moe_status_t thread_failure(const moe_elastic_member_t *m)
{
    if (m->failed == MOE_STATUS_SUCCESS) return MOE_STATUS_SUCCESS;
    return MOE_FAIL(m->failed, "elastic member of slot %d: %s", (int)m->slot, m->failure);
}

moe_status_t moe_elastic_member_report(moe_elastic_member_t *m, moe_elastic_phase_t phase,
                                       int64_t step)
{
    MOE_ENTRY(m, MOE_MAGIC_MEMBER, "elastic member");
    MOE_CHECK_ARG(phase >= MOE_ELASTIC_PHASE_STARTED && phase <= MOE_ELASTIC_PHASE_TRAINING,
                  "elastic member: unknown phase %d", (int)phase);
    pthread_mutex_lock(&m->lock);
    m->phase = phase;
    m->step = step;
    if (phase == MOE_ELASTIC_PHASE_RESUMED) m->resumed_step = step;
    m->dirty = true;
    pthread_cond_signal(&m->wake);
    moe_status_t st = thread_failure(m);
    pthread_mutex_unlock(&m->lock);
    return st;
}

moe_status_t moe_elastic_member_report_busy(moe_elastic_member_t *m, int64_t step, double busy_s)
{
    MOE_ENTRY(m, MOE_MAGIC_MEMBER, "elastic member");
    MOE_CHECK_ARG(step >= 0 && busy_s >= 0,
                  "elastic member: step %lld and busy_s %g must be "
                  ">= 0",
                  (long long)step, busy_s);
    pthread_mutex_lock(&m->lock);
    m->busy_step[m->busy_next] = step;
    m->busy_s[m->busy_next] = busy_s;
    m->busy_next = (m->busy_next + 1) % MOE_ELASTIC_BUSY_WINDOW;
    if (m->nbusy < MOE_ELASTIC_BUSY_WINDOW) m->nbusy++;
    m->dirty = true;
    pthread_cond_signal(&m->wake);
    moe_status_t st = thread_failure(m);
    pthread_mutex_unlock(&m->lock);
    return st;
}

moe_status_t moe_elastic_member_slot(const moe_elastic_member_t *m, int32_t *slot)
{
    MOE_ENTRY(m, MOE_MAGIC_MEMBER, "elastic member");
    MOE_CHECK_ARG(slot != NULL, "slot is NULL");
    *slot = m->slot;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_elastic_member_report_exit(moe_elastic_member_t *m, int32_t code,
                                            const char *cause)
{
    MOE_ENTRY(m, MOE_MAGIC_MEMBER, "elastic member");
    cJSON *o = cJSON_CreateObject();
    if (o) {
        cJSON_AddNumberToObject(o, "slot", m->slot);
        cJSON_AddNumberToObject(o, "rank", m->rank);
        cJSON_AddNumberToObject(o, "code", code);
        pthread_mutex_lock(&m->lock);
        cJSON_AddNumberToObject(o, "step", (double)m->step);
        pthread_mutex_unlock(&m->lock);
        cJSON_AddStringToObject(o, "cause", cause ? cause : "");
    }
    char *v = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (!v) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "elastic exit record");
    size_t kl = strlen(m->prefix) + 32;
    char *key = malloc(kl);
    moe_status_t st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "elastic exit key");
    if (key) {
        snprintf(key, kl, "%s/exit/%d", m->prefix, (int)m->slot);
        moe_error_clear();
        st = el_etcd_put(m->etcd, key, v, 0);
    }
    free(key);
    free(v);
    return st;
}

moe_status_t moe_elastic_member_watch_launcher(moe_elastic_member_t *m, const char *launcher_key,
                                               int32_t orphan_ms)
{
    MOE_ENTRY(m, MOE_MAGIC_MEMBER, "elastic member");
    MOE_CHECK_ARG(launcher_key && *launcher_key && orphan_ms > 0,
                  "elastic member: a launcher key and orphan_ms %d > 0 are required",
                  (int)orphan_ms);
    char *key = strdup(launcher_key);
    if (!key) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "elastic member launcher key");
    pthread_mutex_lock(&m->lock);
    char *old = m->launcher_key;
    m->launcher_key = key;
    m->orphan_ms = orphan_ms;
    pthread_mutex_unlock(&m->lock);
    free(old); /* the thread reads the key only under the lock, into its own copy */
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_elastic_member_set_orphan_handler(moe_elastic_member_t *m,
                                                   moe_elastic_orphan_fn fn, void *user)
{
    MOE_ENTRY(m, MOE_MAGIC_MEMBER, "elastic member");
    pthread_mutex_lock(&m->lock);
    m->on_orphan = fn;
    m->orphan_user = user;
    pthread_mutex_unlock(&m->lock);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_elastic_member_destroy(moe_elastic_member_t *m)
{
    moe_error_clear();
    if (!m) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(m, MOE_MAGIC_MEMBER, "elastic member");
    pthread_mutex_lock(&m->lock);
    m->stop = true;
    pthread_cond_signal(&m->wake);
    pthread_mutex_unlock(&m->lock);
    pthread_join(m->thread, NULL);
    moe_status_t st = thread_failure(m);
    moe_status_t rv = el_etcd_lease_revoke(m->etcd, m->lease);
    if (st == MOE_STATUS_SUCCESS) st = rv;
    pthread_cond_destroy(&m->wake);
    pthread_mutex_destroy(&m->lock);
    member_free(m);
    return st;
}
