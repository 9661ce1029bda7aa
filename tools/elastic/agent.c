/* An agent per host (agent.h): its lease and key, its ranks, the end of incarnations, the
 * leader election. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "agent.h"
#include "incarnation_watch.h"
#include "proc.h"

struct agent {
    job_spec_t *s;
    el_etcd_t *etcd;
    events_t ev;
    int64_t lease; /* renewed by the keep-alive thread on its own client */
    el_etcd_t *renew_etcd;
    pthread_t renewer;
    atomic_bool stop_renewing, lease_lost;
    bool renewing;
    char key[320]; /* /moe/<job>/agents/<host> */
    pid_t sid;     /* 0, or this session only (--host-session: a simulated host) */
    /* the incarnation whose ranks this host runs */
    int inc;
    pid_t pids[WATCH_MAX_RANKS]; /* rank -> its process here, once seen (0: not here) */
    bool reported[WATCH_MAX_RANKS];
    double ending_since; /* > 0: ending inc's ranks */
    bool acked;
};

el_etcd_t *agent_etcd(agent_t *a) { return a->etcd; }
events_t *agent_events(agent_t *a) { return &a->ev; }
int64_t agent_lease(agent_t *a) { return a->lease; }

/* The agent's key on a fresh lease. */
static int register_host(agent_t *a)
{
    int64_t ttl = (a->s->ttl_ms + 999) / 1000;
    if (el_etcd_lease_grant(a->etcd, ttl, &a->lease, NULL) != MOE_STATUS_SUCCESS) return -1;
    char v[512];
    snprintf(v, sizeof v, "{\"host\":\"%s\",\"slots\":%d,\"pid\":%d}", a->s->host, a->s->slots,
             (int)getpid());
    if (el_etcd_put(a->etcd, a->key, v, a->lease) != MOE_STATUS_SUCCESS) return -1;
    return 0;
}

/* Renews the lease every third of the TTL, whatever the agent's thread is doing (a leader
 * waits for mpirun's --print-config, a teardown, a slow etcd): the host is alive while its
 * agent process is. A lease found expired (etcd away longer than the TTL) is lost for good:
 * the host's key and a leader key on it are gone, which agent_deposed reports. */
static void *renew_loop(void *arg)
{
    agent_t *a = arg;
    useconds_t every = (useconds_t)(a->s->ttl_ms / 3) * 1000;
    while (!atomic_load(&a->stop_renewing)) {
        for (useconds_t t = 0; t < every && !atomic_load(&a->stop_renewing); t += 20000)
            usleep(20000);
        if (atomic_load(&a->stop_renewing)) break;
        if (el_etcd_lease_keepalive(a->renew_etcd, a->lease) == MOE_STATUS_NOT_FOUND) {
            atomic_store(&a->lease_lost, true);
            break;
        }
    }
    return NULL;
}

bool agent_deposed(agent_t *a) { return atomic_load(&a->lease_lost); }

/* Reads an int key; dflt when absent or etcd did not answer (*ok false then). */
static long read_int(agent_t *a, const char *key, long dflt, bool *ok)
{
    el_kv_t *kvs;
    size_t n;
    *ok = el_etcd_range_prefix(a->etcd, key, &kvs, &n) == MOE_STATUS_SUCCESS;
    long v = dflt;
    for (size_t i = 0; *ok && i < n; i++)
        if (!strcmp(kvs[i].key, key)) v = strtol(kvs[i].value, NULL, 10);
    if (*ok) el_kvs_free(kvs, n);
    return v;
}

/* A record for a rank lost here, unless the rank wrote its own. */
static void report(agent_t *a, const char *prefix, const int *slots, int n_slots, int k, int sig,
                   const char *what)
{
    if (k >= n_slots) return;
    char key[512], v[512];
    snprintf(key, sizeof key, "%s/exit/%d", prefix, slots[k]);
    snprintf(v, sizeof v,
             "{\"slot\":%d,\"rank\":%d,\"code\":%d,\"step\":-1,\"cause\":\"%s, "
             "seen by the agent of host %s\"}",
             slots[k], k, 128 + sig, what, a->s->host);
    bool created;
    if (el_etcd_create_key(a->etcd, key, v, 0, &created, NULL) == MOE_STATUS_SUCCESS)
        a->reported[k] = true;
}

/* The ranks of incarnation a->inc on this host: checked, or ended when the leader says so. */
static void watch_ranks(agent_t *a)
{
    char prefix[300], key[400];
    snprintf(prefix, sizeof prefix, "/moe/%s/inc/%d", a->s->job, a->inc);
    snprintf(key, sizeof key, "%s/", prefix);
    el_kv_t *kvs;
    size_t n;
    if (el_etcd_range_prefix(a->etcd, key, &kvs, &n) != MOE_STATUS_SUCCESS) return;
    bool end = false, acked = false;
    int slots[WATCH_MAX_RANKS], n_slots = 0;
    bool recorded[WATCH_MAX_RANKS] = {false};
    char ended[400];
    snprintf(ended, sizeof ended, "%s/ended/%s", prefix, a->s->host);
    for (size_t i = 0; i < n; i++) {
        const char *rest = kvs[i].key + strlen(key);
        if (!strcmp(rest, "end"))
            end = true;
        else if (!strcmp(kvs[i].key, ended))
            acked = true;
        else if (!strcmp(rest, "slots"))
            for (char *p = kvs[i].value; *p && n_slots < WATCH_MAX_RANKS;) {
                slots[n_slots++] = (int)strtol(p, &p, 10);
                if (*p == ',')
                    p++;
                else
                    break;
            }
    }
    for (size_t i = 0; i < n; i++) {
        const char *rest = kvs[i].key + strlen(key);
        if (strncmp(rest, "exit/", 5)) continue;
        int slot = atoi(rest + 5);
        for (int k = 0; k < n_slots; k++) recorded[k] |= slots[k] == slot;
    }
    el_kvs_free(kvs, n);
    pid_t now_pids[WATCH_MAX_RANKS];
    proc_job_ranks(prefix, a->sid, now_pids, WATCH_MAX_RANKS);
    if (end || a->ending_since > 0) {
        if (a->ending_since == 0) a->ending_since = proc_now();
        bool late = proc_now() - a->ending_since > a->s->grace_ms / 1000.0;
        int left = 0;
        for (int k = 0; k < WATCH_MAX_RANKS; k++) {
            if (!now_pids[k]) continue;
            left++;
            char st = proc_state(now_pids[k]);
            kill(now_pids[k], late || st == 'T' || st == 't' ? SIGKILL : SIGTERM);
        }
        if (!left && !acked && !a->acked &&
            el_etcd_put(a->etcd, ended, "1", 0) == MOE_STATUS_SUCCESS)
            a->acked = true;
        return;
    }
    for (int k = 0; k < WATCH_MAX_RANKS; k++) {
        if (now_pids[k]) {
            a->pids[k] = now_pids[k];
            char st = proc_state(now_pids[k]);
            if ((st == 'T' || st == 't') && !a->reported[k] && !recorded[k])
                report(a, prefix, slots, n_slots, k, SIGSTOP, "process stopped");
        } else if (a->pids[k] && !a->reported[k] && !recorded[k]) {
            report(a, prefix, slots, n_slots, k, SIGKILL, "process gone without an exit record");
        }
    }
}

void agent_tick(agent_t *a)
{
    char key[320];
    snprintf(key, sizeof key, "/moe/%s/incarnation", a->s->job);
    bool ok;
    long inc = read_int(a, key, -1, &ok);
    if (ok && inc > a->inc) {
        /* a newer incarnation: the old one's ranks here are ended first */
        if (a->inc >= 0) {
            a->ending_since = a->ending_since > 0 ? a->ending_since : proc_now();
            watch_ranks(a);
            pid_t left[WATCH_MAX_RANKS];
            char prefix[300];
            snprintf(prefix, sizeof prefix, "/moe/%s/inc/%d", a->s->job, a->inc);
            proc_job_ranks(prefix, a->sid, left, WATCH_MAX_RANKS);
            for (int k = 0; k < WATCH_MAX_RANKS; k++)
                if (left[k]) return; /* again at the next poll */
        }
        a->inc = (int)inc;
        memset(a->pids, 0, sizeof a->pids);
        memset(a->reported, 0, sizeof a->reported);
        a->ending_since = 0;
        a->acked = false;
    }
    if (a->inc >= 0) watch_ranks(a);
}

int agent_main(job_spec_t *s, agent_leader_fn lead)
{
    agent_t *a = calloc(1, sizeof *a);
    if (!a) return 1;
    a->s = s;
    a->inc = -1;
    a->sid = s->host_session ? getsid(0) : 0;
    snprintf(a->key, sizeof a->key, "/moe/%s/agents/%s", s->job, s->host);
    int code = 1;
    if (events_open(&a->ev, s->events)) {
        fprintf(stderr, "moe_elastic: cannot open the events file %s\n", s->events);
        free(a);
        return 2;
    }
    /* agents may start before etcd answers (every host starts at once): 30 s to register */
    bool created = el_etcd_create(s->etcd, job_spec_request_ms(s), &a->etcd) == MOE_STATUS_SUCCESS;
    double deadline = proc_now() + 30.0;
    int reg = -1;
    while (created && (reg = register_host(a)) != 0 && proc_now() < deadline) usleep(200 * 1000);
    created = created && !reg &&
              el_etcd_create(s->etcd, job_spec_request_ms(s), &a->renew_etcd) == MOE_STATUS_SUCCESS;
    a->renewing = created && pthread_create(&a->renewer, NULL, renew_loop, a) == 0;
    if (!a->renewing) {
        fprintf(stderr, "moe_elastic: agent %s: etcd at %s unreachable: %s\n", s->host, s->etcd,
                moe_last_error());
        goto out;
    }
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "host", s->host);
    cJSON_AddNumberToObject(f, "slots", s->slots);
    cJSON_AddNumberToObject(f, "agent_pid", getpid());
    cJSON_AddStringToObject(f, "etcd", s->etcd);
    events_emit(&a->ev, "agent", f);
    char leader[320], done[320], me[512]; /* done: the job's exit code */
    snprintf(leader, sizeof leader, "/moe/%s/leader", s->job);
    snprintf(done, sizeof done, "/moe/%s/exit", s->job);
    snprintf(me, sizeof me, "{\"host\":\"%s\",\"pid\":%d}", s->host, (int)getpid());
    for (;;) {
        usleep((useconds_t)s->poll_ms * 1000);
        if (agent_deposed(a)) {
            fprintf(stderr,
                    "moe_elastic: agent %s: its lease expired (etcd away longer than the "
                    "TTL): the host leaves the job\n",
                    s->host);
            break;
        }
        agent_tick(a);
        bool ok;
        long end = read_int(a, done, -1, &ok);
        if (end >= 0) {
            code = (int)end;
            break;
        }
        bool won = false;
        if (!ok || el_etcd_create_key(a->etcd, leader, me, a->lease, &won, NULL) || !won) continue;
        f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "host", s->host);
        events_emit(&a->ev, "leader", f);
        code = lead(s, a);
        break;
    }
out:
    if (a->renewing) {
        atomic_store(&a->stop_renewing, true);
        pthread_join(a->renewer, NULL);
    }
    el_etcd_lease_revoke(a->etcd, a->lease); /* the host's key and a leader key go at once */
    el_etcd_destroy(a->renew_etcd);
    el_etcd_destroy(a->etcd);
    events_close(&a->ev);
    free(a);
    return code;
}
