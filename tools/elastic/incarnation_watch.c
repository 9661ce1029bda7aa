/*
 * The watch of one incarnation (incarnation_watch.h). Every poll reads the incarnation's keys
 * with one range request and mpirun's state with waitpid; it never blocks longer than etcd's
 * request timeout, and the start timeout bounds the wait for ranks that never register, so the
 * watch always ends.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <moe/core.h>

#include "incarnation_watch.h"
#include "proc.h"

typedef struct rank_view {
    bool seen, present, exited;
    int exit_code;
    int64_t exit_step;
    char cause[400];
    pid_t pid;      /* from the member key */
    pid_t proc_pid; /* the rank's process, from mpirun's session or the member key */
    double gone_at; /* when its process was first seen gone (0: not yet) */
    char phase[16];
    int64_t step, resumed_step;
} rank_view_t;

static int rank_of_slot(const watch_config_t *c, int slot)
{
    for (int r = 0; r < c->world; r++)
        if (c->slots[r] == slot) return r;
    return -1;
}

static int64_t num(const cJSON *o, const char *k, int64_t dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? (int64_t)v->valuedouble : dflt;
}

/* Reads the incarnation's keys into views; false when etcd did not answer (the poll retries). */
static bool read_views(const watch_config_t *c, rank_view_t *v)
{
    char pfx[512];
    snprintf(pfx, sizeof pfx, "%s/", c->prefix);
    el_kv_t *kvs;
    size_t n;
    if (el_etcd_range_prefix(c->etcd, pfx, &kvs, &n) != MOE_STATUS_SUCCESS) return false;
    for (int r = 0; r < c->world; r++) v[r].present = false;
    size_t pl = strlen(pfx);
    for (size_t i = 0; i < n; i++) {
        const char *rest = kvs[i].key + pl;
        bool member = !strncmp(rest, "member/", 7), exit_rec = !strncmp(rest, "exit/", 5);
        if (!member && !exit_rec) continue;
        int r = rank_of_slot(c, atoi(rest + (member ? 7 : 5)));
        cJSON *o = cJSON_Parse(kvs[i].value);
        if (r < 0 || !o) {
            cJSON_Delete(o);
            continue;
        }
        if (member) {
            v[r].present = v[r].seen = true;
            v[r].pid = (pid_t)num(o, "pid", 0);
            v[r].step = num(o, "step", 0);
            v[r].resumed_step = num(o, "resumed_step", -1);
            const cJSON *ph = cJSON_GetObjectItemCaseSensitive(o, "phase");
            snprintf(v[r].phase, sizeof v[r].phase, "%s",
                     cJSON_IsString(ph) ? ph->valuestring : "");
            if (c->straggler) straggler_watch_take(c->straggler, r, o);
        } else {
            v[r].exited = true;
            v[r].exit_code = (int)num(o, "code", -1);
            v[r].exit_step = num(o, "step", -1);
            const cJSON *cs = cJSON_GetObjectItemCaseSensitive(o, "cause");
            snprintf(v[r].cause, sizeof v[r].cause, "%s",
                     cJSON_IsString(cs) ? cs->valuestring : "");
        }
        cJSON_Delete(o);
    }
    el_kvs_free(kvs, n);
    return true;
}

static void add_blame(watch_result_t *r, cJSON *list, int slot, int rank, const char *how,
                      const char *detail)
{
    for (int i = 0; i < r->n_blamed; i++)
        if (r->blamed[i] == slot) return;
    if (r->n_blamed < WATCH_MAX_RANKS) r->blamed[r->n_blamed++] = slot;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "slot", slot);
    cJSON_AddNumberToObject(o, "rank", rank);
    cJSON_AddStringToObject(o, "how", how);
    if (detail && *detail) cJSON_AddStringToObject(o, "detail", detail);
    cJSON_AddItemToArray(list, o);
}

/* Ranks whose process is gone (without an exit record) or stopped: lost with the first one. */
static void blame_dead_processes(const watch_config_t *c, const rank_view_t *v, watch_result_t *r,
                                 cJSON *list)
{
    for (int k = 0; k < c->world; k++) {
        if (!v[k].seen || v[k].pid <= 0 || v[k].exited) continue;
        char st = proc_state(v[k].pid);
        if (st == 'T' || st == 't')
            add_blame(r, list, c->slots[k], k, "stopped", "process stopped");
        else if (proc_gone(v[k].pid))
            add_blame(r, list, c->slots[k], k, "process gone", NULL);
    }
}

static cJSON *pid_list(const watch_config_t *c, const rank_view_t *v)
{
    cJSON *a = cJSON_CreateArray();
    for (int k = 0; k < c->world; k++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "slot", c->slots[k]);
        cJSON_AddNumberToObject(o, "rank", k);
        cJSON_AddNumberToObject(o, "pid", v[k].pid);
        cJSON_AddItemToArray(a, o);
    }
    return a;
}

/* The recovery event, at the recovered incarnation's first step. */
static void recovery_event(const watch_config_t *c, const watch_result_t *r, double now)
{
    cJSON *f = cJSON_CreateObject();
    cJSON_AddNumberToObject(f, "incarnation", c->incarnation);
    cJSON_AddNumberToObject(f, "resume_step", (double)r->resume_step);
    cJSON_AddNumberToObject(f, "steps_lost", (double)(c->previous_step - r->resume_step));
    cJSON_AddNumberToObject(f, "teardown_s", c->teardown_s);
    cJSON_AddNumberToObject(f, "detection_to_launch_s", r->launched_at - c->failed_at);
    cJSON_AddNumberToObject(f, "detection_to_step_s", now - c->failed_at);
    events_emit(c->events, "recovery", f);
}

/* Reports etcd going away or coming back (once each way). */
static void etcd_state(const watch_config_t *c, bool answered, bool *down, double *down_since,
                       double now)
{
    if (!answered && !*down) {
        *down = true;
        *down_since = now;
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "endpoint", c->endpoint ? c->endpoint : "");
        cJSON_AddStringToObject(f, "error", moe_last_error());
        cJSON_AddStringToObject(f, "effect",
                                "ranks train on; failures are found by their "
                                "processes until etcd answers");
        events_emit(c->events, "etcd_unreachable", f);
    } else if (answered && *down) {
        *down = false;
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "endpoint", c->endpoint ? c->endpoint : "");
        cJSON_AddNumberToObject(f, "down_s", now - *down_since);
        events_emit(c->events, "etcd_reachable", f);
    }
}

/* Rank processes gone without an exit record, or stopped. A gone process is blamed only once
 * a read of etcd made after it was seen gone still shows no exit record (a rank writes its
 * record and then exits: one poll may see the exit before the record), or, with etcd down,
 * after a second. */
static void check_processes(const watch_config_t *c, rank_view_t *v, bool read, double now,
                            watch_result_t *r, cJSON *blame)
{
    pid_t found[WATCH_MAX_RANKS];
    proc_session_ranks(c->mpirun, found, c->world);
    for (int k = 0; k < c->world; k++) {
        if (!v[k].proc_pid) v[k].proc_pid = found[k] ? found[k] : v[k].pid;
        if (!v[k].proc_pid || v[k].exited) continue;
        char st = proc_state(v[k].proc_pid);
        if (st == 'T' || st == 't') {
            add_blame(r, blame, c->slots[k], k, "stopped", "process stopped");
        } else if (proc_gone(v[k].proc_pid)) {
            if (!v[k].gone_at)
                v[k].gone_at = now;
            else if (read || now - v[k].gone_at > 1.0)
                add_blame(r, blame, c->slots[k], k,
                          v[k].seen ? "process gone" : "process gone before it registered", NULL);
        }
    }
}

void watch_incarnation(const watch_config_t *c, watch_result_t *r)
{
    memset(r, 0, sizeof *r);
    r->resume_step = -1;
    r->last_step = -1;
    r->launched_at = proc_now();
    rank_view_t *v = calloc((size_t)c->world, sizeof *v);
    cJSON *blame = cJSON_CreateArray();
    if (!v || !blame) { /* no memory: end the incarnation rather than watch it blind */
        free(v);
        cJSON_Delete(blame);
        r->detected_at = proc_now();
        return;
    }
    double peer_lost_at = 0, etcd_down_since = 0;
    bool up = false, resumed = false, stepped = false, mpirun_done = false, etcd_down = false;
    int status = 0;
    double t_up = 0, t_resumed = 0;
    const char *reason = NULL;
    char detail[256] = "";
    while (!reason) {
        usleep((useconds_t)(c->poll_s * 1e6));
        if (*c->stop) {
            r->stopped = true;
            reason = "launcher stopped";
            break;
        }
        if (c->tick) c->tick(c->tick_user);
        if (!mpirun_done && waitpid(c->mpirun, &status, WNOHANG) == c->mpirun) mpirun_done = true;
        bool read = read_views(c, v);
        double now = proc_now();
        etcd_state(c, read, &etcd_down, &etcd_down_since, now);
        int n_seen = 0, n_resumed = 0;
        for (int k = 0; k < c->world; k++) {
            n_seen += v[k].seen;
            n_resumed += v[k].present && strcmp(v[k].phase, "started") != 0;
            if (v[k].present && v[k].step > r->last_step) r->last_step = v[k].step;
            if (v[k].exited && v[k].exit_step > r->last_step) r->last_step = v[k].exit_step;
        }
        r->n_registered = n_seen;
        if (!up && n_seen == c->world) {
            up = true;
            t_up = now;
            cJSON *f = cJSON_CreateObject();
            cJSON_AddNumberToObject(f, "incarnation", c->incarnation);
            cJSON_AddNumberToObject(f, "relaunch_s", t_up - r->launched_at);
            cJSON_AddItemToObject(f, "ranks", pid_list(c, v));
            events_emit(c->events, "ranks_up", f);
        }
        if (up && !resumed && n_resumed == c->world) {
            resumed = true;
            t_resumed = now;
            r->resume_step = v[0].resumed_step; /* every rank loads the same checkpoint */
            cJSON *f = cJSON_CreateObject();
            cJSON_AddNumberToObject(f, "incarnation", c->incarnation);
            cJSON_AddNumberToObject(f, "step", (double)r->resume_step);
            cJSON_AddNumberToObject(f, "ckpt_load_s", t_resumed - t_up);
            events_emit(c->events, "resumed", f);
        }
        if (resumed && !stepped) {
            for (int k = 0; k < c->world && !stepped; k++) {
                if (!v[k].present || strcmp(v[k].phase, "training")) continue;
                stepped = true;
                cJSON *f = cJSON_CreateObject();
                cJSON_AddNumberToObject(f, "incarnation", c->incarnation);
                cJSON_AddNumberToObject(f, "step", (double)v[k].step);
                cJSON_AddNumberToObject(f, "first_step_s", now - t_resumed);
                cJSON_AddNumberToObject(f, "since_launch_s", now - r->launched_at);
                events_emit(c->events, "first_step", f);
                if (c->recovering) recovery_event(c, r, now);
            }
        }
        /* failures, in order of what they say about the culprit */
        for (int k = 0; read && k < c->world; k++) {
            if (v[k].exited && v[k].exit_code != 0 && v[k].exit_code != MOE_EXIT_PEER_LOST) {
                char how[32];
                snprintf(how, sizeof how, "exit code %d", v[k].exit_code);
                add_blame(r, blame, c->slots[k], k, how, v[k].cause);
            }
            if (v[k].seen && !v[k].present && !v[k].exited)
                add_blame(r, blame, c->slots[k], k, "lease expired", NULL);
        }
        /* a host lost (its agent gone): its ranks, even those whose leases still live */
        if (read && c->lost_ranks) {
            int lost[WATCH_MAX_RANKS];
            const char *host[WATCH_MAX_RANKS];
            int n_lost = c->lost_ranks(c->lost_ranks_user, lost, host);
            for (int i = 0; i < n_lost; i++) {
                char why[200];
                snprintf(why, sizeof why, "the agent of host %s is gone (its key expired)",
                         host[i]);
                add_blame(r, blame, c->slots[lost[i]], lost[i], "host lost", why);
            }
        }
        /* after mpirun's own end its ranks' ends are its doing, not theirs */
        if (!mpirun_done && !c->remote_ranks) check_processes(c, v, read, now, r, blame);
        for (int k = 0; read && !peer_lost_at && k < c->world; k++)
            if (v[k].exited && v[k].exit_code == MOE_EXIT_PEER_LOST) peer_lost_at = now;
        if (peer_lost_at && !r->n_blamed && now - peer_lost_at > c->peer_lost_grace_s)
            for (int k = 0; k < c->world; k++)
                if (v[k].present && !v[k].exited)
                    add_blame(r, blame, c->slots[k], k, "hung", "its peers lost it; it still runs");
        if (r->n_blamed) {
            reason = "rank lost";
            if (!mpirun_done && !c->remote_ranks) blame_dead_processes(c, v, r, blame);
            break;
        }
        int slow;
        if (c->straggler && read && !mpirun_done &&
            straggler_watch_poll(c->straggler, c->events, c->incarnation, c->slots, &slow, detail,
                                 sizeof detail)) {
            add_blame(r, blame, c->slots[slow], slow, "straggler", detail);
            reason = "straggler";
            break;
        }
        if (mpirun_done) {
            if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
                /* under --enable-recovery mpirun exits 0 even when a rank exited non-zero, so
                 * the exit records decide; with etcd gone mpirun's word is all there is */
                if (!read_views(c, v)) {
                    r->done = true;
                    break;
                }
                for (int k = 0; k < c->world; k++) {
                    if (v[k].exit_step > r->last_step) r->last_step = v[k].exit_step;
                    if (!v[k].exited)
                        add_blame(r, blame, c->slots[k], k,
                                  v[k].seen ? "no exit record" : "exited before it registered",
                                  NULL);
                }
                if (!r->n_blamed) {
                    r->done = true;
                    break;
                }
                reason = "rank lost";
                snprintf(detail, sizeof detail, "mpirun exited 0, but not every rank finished");
                break;
            }
            r->mpirun_exited = true;
            snprintf(detail, sizeof detail, "mpirun %s %d; no rank failed, so none is blamed",
                     WIFSIGNALED(status) ? "killed by signal" : "exited with",
                     WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
            reason = "mpirun exited";
            break;
        }
        if (!up && now - r->launched_at > c->start_timeout_s) {
            for (int k = 0; k < c->world; k++)
                if (!v[k].seen) add_blame(r, blame, c->slots[k], k, "never registered", NULL);
            snprintf(detail, sizeof detail, "not every rank registered within %.0f s",
                     c->start_timeout_s);
            reason = "start timeout";
        }
    }
    r->detected_at = proc_now();
    if (!r->done) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddNumberToObject(f, "incarnation", c->incarnation);
        cJSON_AddStringToObject(f, "reason", reason);
        if (detail[0]) cJSON_AddStringToObject(f, "detail", detail);
        cJSON_AddNumberToObject(f, "last_step", (double)r->last_step);
        cJSON_AddItemToObject(f, "blamed", blame);
        blame = NULL;
        events_emit(c->events, "failure", f);
    }
    cJSON_Delete(blame);
    free(v);
}

double watch_teardown(pid_t mpirun, double grace_s, void (*tick)(void *), void *tick_user)
{
    double t0 = proc_now();
    pid_t pids[WATCH_MAX_RANKS * 4];
    size_t n = proc_session(mpirun, pids, sizeof pids / sizeof *pids);
    for (size_t i = 0; i < n; i++) /* a stopped process cannot act on SIGTERM */
        if (proc_state(pids[i]) == 'T') kill(pids[i], SIGKILL);
    proc_kill_session(mpirun, SIGTERM);
    for (int pass = 0; pass < 2; pass++) {
        double end = proc_now() + (pass == 0 ? grace_s : 10.0);
        while (proc_now() < end) {
            waitpid(mpirun, NULL, WNOHANG);
            proc_reap_session(mpirun);
            if (tick) tick(tick_user);
            if (proc_session(mpirun, pids, 1) == 0) return proc_now() - t0;
            usleep(10 * 1000);
        }
        proc_kill_session(mpirun, SIGKILL);
    }
    return -1;
}

int64_t watch_last_step(const watch_config_t *c)
{
    rank_view_t *v = calloc((size_t)c->world, sizeof *v);
    int64_t last = -1;
    if (v && read_views(c, v))
        for (int k = 0; k < c->world; k++) {
            if (v[k].seen && v[k].step > last) last = v[k].step;
            if (v[k].exited && v[k].exit_step > last) last = v[k].exit_step;
        }
    free(v);
    return last;
}
