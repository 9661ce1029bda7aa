/*
 * moe_elastic: elastic training with restarts (docs/elastic.md).
 *
 *   moe_elastic --slots 4 --spares 1 --mpirun-arg --oversubscribe -- \
 *       moe_train --config job.json --ckpt-dir ckpt --ckpt-every 10
 *
 * Runs the trainer as successive mpirun incarnations, each the leader of its own session. The
 * ranks hold leases in etcd (moe/elastic.h); a private etcd on loopback is started unless
 * --etcd names one. When an incarnation fails (its watch) the launcher ends its whole session,
 * marks the slots to blame as failed, takes spares in their place or, with none left, picks
 * the largest valid mesh on the slots that remain (keeping the global batch), and relaunches
 * with --resume: every rank loads the latest complete checkpoint, resharded to the new mesh.
 * A rank that runs slowly (a straggler, straggler.h) is reported, or, with a spare, replaced
 * after the next checkpoint the same way. It stops with a message and an exit code below
 * min_world ranks, without a valid mesh, or after max_restarts; every wait has a deadline.
 *
 * Every incarnation, the first included, runs with --resume, so the same command again on a
 * job folder continues from its newest complete checkpoint; the folder's lock (job_lock.h)
 * keeps a second launcher out. The launcher holds its own lease in etcd, whose key the ranks
 * watch: a dead launcher's ranks end (and its mpirun and private etcd get SIGTERM at once).
 *
 * With --agent the program is one host's agent (agent.h); the agent elected leader runs the
 * same job loop (lead) over the live agents' hosts: slots numbered per host, each incarnation
 * launched with a hostfile, its ranks checked by their hosts' agents and ended by them, a lost
 * host's slots failed (hosts.h).
 */
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/env.h"
#include "elastic/etcd.h"
#include "elastic/mesh_choice.h"
#include "agent.h"
#include "etcd_server.h"
#include "events.h"
#include "hosts.h"
#include "incarnation_watch.h"
#include "job_lock.h"
#include "proc.h"
#include "relay.h"
#include "spec.h"
#include <moe/elastic.h>

enum {
    EXIT_DONE = 0,
    EXIT_LAUNCHER = 1,
    EXIT_ARGS = 2,
    EXIT_TOO_FEW = 3,
    EXIT_RESTARTS = 4,
    EXIT_SIGNALLED = 130
};

static volatile int stop_requested;

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

static cJSON *int_array(const int *v, int n)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
    return a;
}

static cJSON *mesh_json(const el_mesh_t *m, const int *slots, int world)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "tp", (double)m->tp);
    cJSON_AddNumberToObject(o, "ep", (double)m->ep);
    cJSON_AddNumberToObject(o, "dp", (double)m->dp);
    cJSON_AddNumberToObject(o, "pp", (double)m->pp);
    cJSON_AddNumberToObject(o, "microbatches", (double)m->microbatches);
    cJSON_AddNumberToObject(o, "world", world);
    cJSON_AddItemToObject(o, "slots", int_array(slots, world));
    return o;
}

static void stop_event(events_t *ev, const char *why, int code)
{
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "reason", why);
    cJSON_AddNumberToObject(f, "exit_code", code);
    events_emit(ev, "stop", f);
}

/* Starts an incarnation on the given slots and mesh; returns mpirun's pid or -1. */
static pid_t launch(const job_spec_t *s, const char *endpoint, const char *prefix, const int *slots,
                    int world, const el_mesh_t *m, const char *hostfile)
{
    char slot_list[4096] = "", ttl[16], np[16], mesh[128], mb[32];
    for (int i = 0; i < world; i++) {
        size_t l = strlen(slot_list);
        snprintf(slot_list + l, sizeof slot_list - l, "%s%d", i ? "," : "", slots[i]);
    }
    snprintf(ttl, sizeof ttl, "%d", s->ttl_ms);
    snprintf(np, sizeof np, "%d", world);
    snprintf(mesh, sizeof mesh, "tp=%lld,ep=%lld,dp=%lld,pp=%lld", (long long)m->tp,
             (long long)m->ep, (long long)m->dp, (long long)m->pp);
    snprintf(mb, sizeof mb, "%lld", (long long)m->microbatches);
    setenv("MOE_ELASTIC_ENDPOINT", endpoint, 1);
    setenv("MOE_ELASTIC_PREFIX", prefix, 1);
    setenv("MOE_ELASTIC_SLOTS", slot_list, 1);
    setenv("MOE_ELASTIC_TTL_MS", ttl, 1);
    char **argv = calloc((size_t)(s->n_mpirun_args + s->n_trainer + 24), sizeof *argv);
    if (!argv) return -1;
    int n = 0;
    const char *fixed[] = {s->mpirun, "-np",
                           np,        "--enable-recovery",
                           "-x",      "MOE_ELASTIC_ENDPOINT",
                           "-x",      "MOE_ELASTIC_PREFIX",
                           "-x",      "MOE_ELASTIC_SLOTS",
                           "-x",      "MOE_ELASTIC_TTL_MS",
                           "-x",      "MOE_ELASTIC_LAUNCHER_KEY",
                           "-x",      "MOE_ELASTIC_ORPHAN_MS"};
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++) argv[n++] = (char *)fixed[i];
    if (hostfile) { /* agent mode: the live hosts; rank k on slots[k]'s host (hosts.h) */
        argv[n++] = "--hostfile";
        argv[n++] = (char *)hostfile;
    }
    for (int i = 0; i < s->n_mpirun_args; i++) argv[n++] = (char *)s->mpirun_args[i];
    for (int i = 0; i < s->n_trainer; i++) argv[n++] = s->trainer[i];
    argv[n++] = "--mesh";
    argv[n++] = mesh;
    argv[n++] = "--train.microbatches";
    argv[n++] = mb;
    argv[n++] = "--resume"; /* from the newest complete checkpoint, the first incarnation too */
    pid_t pid = proc_spawn_session(argv, s->mpirun_log);
    free(argv);
    return pid;
}

/* What the launcher does at every poll, whatever it waits for. */
typedef struct ticker {
    events_t *ev;
    etcd_server_t *server; /* the private etcd, or one of no members */
    relay_t relay;
    pid_t mpirun; /* the running incarnation's (its status is the watch's) */
    const char *ckpt_dir;
    agent_t *agent;         /* agent mode: this host's agent, whose duties go on */
    char rejected[64][128]; /* checkpoints the trainer moved aside, already reported */
    int n_rejected;
    bool etcd_lost; /* the private etcd could not be restarted */
} ticker_t;

/* The trainer moves a checkpoint that failed verification aside as .rejected-step-<N>-...
 * (docs/elastic.md); each is reported once. */
static void report_rejected(ticker_t *t)
{
    DIR *d = opendir(t->ckpt_dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, ".rejected-", 10) || strlen(e->d_name) >= sizeof t->rejected[0])
            continue;
        bool known = false;
        for (int i = 0; i < t->n_rejected && !known; i++)
            known = !strcmp(t->rejected[i], e->d_name);
        if (known || t->n_rejected == (int)(sizeof t->rejected / sizeof *t->rejected)) continue;
        snprintf(t->rejected[t->n_rejected++], sizeof t->rejected[0], "%s", e->d_name);
        cJSON *f = cJSON_CreateObject();
        cJSON_AddNumberToObject(f, "step",
                                (double)strtoll(e->d_name + strlen(".rejected-step-"), NULL, 10));
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", t->ckpt_dir, e->d_name);
        cJSON_AddStringToObject(f, "moved_to", path);
        cJSON_AddStringToObject(f, "why", "failed verification at resume; training passes it");
        events_emit(t->ev, "checkpoint_rejected", f);
    }
    closedir(d);
}

/* A private etcd member that exited is reported and started again (etcd_server.h). */
static void supervise_etcd(ticker_t *t)
{
    int member, status = 0, sup;
    while ((sup = etcd_server_supervise(t->server, &member, &status)) != 0) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "endpoint", t->server->m[member].client);
        cJSON_AddNumberToObject(f, "member", member);
        cJSON_AddStringToObject(f, "how", WIFSIGNALED(status) ? "killed by a signal" : "exited");
        cJSON_AddNumberToObject(f, "code",
                                WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
        cJSON_AddBoolToObject(f, "restarted", sup > 0);
        events_emit(t->ev, "etcd_exited", f);
        t->etcd_lost |= sup < 0;
        if (sup < 0) break;
    }
}

static void tick(void *user)
{
    ticker_t *t = user;
    supervise_etcd(t);
    relay_pump(&t->relay, false);
    pid_t keep[1 + ETCD_SERVER_MAX_MEMBERS] = {t->mpirun};
    for (int i = 0; i < t->server->n; i++) keep[1 + i] = t->server->m[i].pid;
    proc_reap_children(keep, 1 + t->server->n);
    report_rejected(t);
    if (t->agent) {
        agent_tick(t->agent);
        if (agent_deposed(t->agent)) stop_requested = 1; /* another agent leads now */
    }
}

/* The launcher's own lease, whose key the ranks watch (MOE_ELASTIC_LAUNCHER_KEY): refused when
 * a live launcher of the job holds it. Returns 0, -1 (etcd failed) or -2 (held), with a
 * message. */
static int launcher_lease(const job_spec_t *s, el_etcd_t *etcd, const char *endpoint,
                          moe_elastic_member_t **out, char *err, size_t len)
{
    char dead[300];
    snprintf(dead, sizeof dead, "/moe/%s/launcher/member/0", s->job);
    el_kv_t *held;
    size_t nh;
    /* an elected leader is the only one: a key still there is a lost leader's, whose ranks
     * end (orphaned) once its lease is revoked */
    if (s->agent && el_etcd_range_prefix(etcd, dead, &held, &nh) == MOE_STATUS_SUCCESS) {
        for (size_t i = 0; i < nh; i++) el_etcd_lease_revoke(etcd, held[i].lease);
        el_kvs_free(held, nh);
    }
    char prefix[300], key[340], ttl[16], orphan[16];
    snprintf(prefix, sizeof prefix, "/moe/%s/launcher", s->job);
    snprintf(key, sizeof key, "%s/member/0", prefix);
    el_kv_t *kvs;
    size_t n;
    if (el_etcd_range_prefix(etcd, key, &kvs, &n) != MOE_STATUS_SUCCESS) {
        snprintf(err, len, "etcd at %s unreachable: %s", endpoint, moe_last_error());
        return -1;
    }
    if (n) {
        snprintf(err, len,
                 "job \"%s\" already has a live launcher in etcd at %s (%s): one "
                 "launcher per job",
                 s->job, endpoint, kvs[0].value);
        el_kvs_free(kvs, n);
        return -2;
    }
    el_kvs_free(kvs, n);
    /* long enough to outlast a teardown's waits; the ranks end one TTL after the launcher */
    int lease_ms = s->ttl_ms * 3 > 10000 ? s->ttl_ms * 3 : 10000;
    moe_elastic_member_config_t c = moe_elastic_member_config_default();
    c.endpoint = endpoint;
    c.prefix = prefix;
    c.slot = 0;
    c.rank = 0;
    c.ttl_ms = lease_ms;
    if (moe_elastic_member_create(&c, out) != MOE_STATUS_SUCCESS) {
        snprintf(err, len, "the launcher's lease in etcd at %s: %s", endpoint, moe_last_error());
        return -1;
    }
    snprintf(ttl, sizeof ttl, "%d", lease_ms);
    snprintf(orphan, sizeof orphan, "%d", lease_ms);
    setenv("MOE_ELASTIC_LAUNCHER_KEY", key, 1);
    setenv("MOE_ELASTIC_ORPHAN_MS", orphan, 1);
    return 0;
}

/* Picks the next world in agent mode: the live hosts' healthy slots, in slot order (each
 * host's contiguous), and the largest valid mesh on them. Returns 0, or an exit code with a
 * message in err. */
static int pick_on_hosts(const job_spec_t *s, const trainer_info_t *info, hosts_t *h,
                         const bool *failed, int *active, int *world, el_mesh_t *mesh,
                         int *spares_left, char *err, size_t len)
{
    if (hosts_refresh(h)) {
        snprintf(err, len, "etcd at %s unreachable: %s", s->etcd, moe_last_error());
        return EXIT_LAUNCHER;
    }
    int healthy[WATCH_MAX_RANKS], n = 0;
    for (int slot = 0; slot < h->total && slot < WATCH_MAX_RANKS; slot++) {
        int host = hosts_of_slot(h, slot);
        if (host >= 0 && h->live[host] && !failed[slot]) healthy[n++] = slot;
    }
    int max_world = n < s->max_world ? n : s->max_world;
    el_mesh_t next;
    if (max_world < s->min_world ||
        el_choose_mesh(&info->shape, max_world, s->min_world, &next) != MOE_STATUS_SUCCESS) {
        snprintf(err, len, "%d healthy slots on the live hosts (min world %d): %s", n, s->min_world,
                 max_world < s->min_world ? "too few" : moe_last_error());
        return EXIT_TOO_FEW;
    }
    *world = (int)(next.tp * next.ep * next.dp * next.pp);
    for (int i = 0; i < *world; i++) active[i] = healthy[i];
    *mesh = next;
    *spares_left = n - *world;
    return 0;
}

/* Marks slot failed (once) with its event. */
static void fail_slot(events_t *ev, bool *failed, int total, int slot)
{
    if (slot < 0 || slot >= total || failed[slot]) return;
    failed[slot] = true;
    cJSON *f = cJSON_CreateObject();
    cJSON_AddNumberToObject(f, "slot", slot);
    events_emit(ev, "slot_failed", f);
}

/* The ranks of an incarnation whose host's agent is gone (agent mode; watch_config_t). */
typedef struct host_check {
    hosts_t *hosts;
    const int *slots;
    int world;
    agent_t *agent; /* this host's: its own key gone means this leader is deposed instead */
    const char *self;
} host_check_t;

static int lost_ranks(void *user, int *lost, const char **host)
{
    host_check_t *hc = user;
    if (agent_deposed(hc->agent) || hosts_refresh(hc->hosts) != 0)
        return 0; /* deposed: the watch stops; etcd did not answer: judged at the next poll */
    int n = 0;
    for (int k = 0; k < hc->world; k++) {
        int i = hosts_of_slot(hc->hosts, hc->slots[k]);
        if (i < 0 || hc->hosts->live[i] || !strcmp(hc->hosts->name[i], hc->self)) continue;
        host[n] = hc->hosts->name[i]; /* stays put until the next refresh */
        lost[n++] = k;
    }
    return n;
}

/* Ends incarnation inc on every host (agent mode) and fails the slots of the hosts lost. */
static void end_on_hosts(const job_spec_t *s, hosts_t *h, events_t *ev, bool *failed, int inc,
                         const int *slots, int world, ticker_t *tk)
{
    bool lost[HOSTS_MAX];
    double wait_s = 2.0 * s->ttl_ms / 1000.0 + s->grace_ms / 1000.0 + 3.0;
    double took = hosts_end_incarnation(h, inc, slots, world, wait_s, lost, tick, tk);
    for (int i = 0; i < h->n; i++) {
        if (!lost[i]) continue;
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "host", h->name[i]);
        cJSON_AddNumberToObject(f, "incarnation", inc);
        cJSON *sl = cJSON_CreateArray();
        for (int k = 0; k < h->slots[i]; k++)
            cJSON_AddItemToArray(sl, cJSON_CreateNumber(h->first[i] + k));
        cJSON_AddItemToObject(f, "slots", sl);
        cJSON_AddNumberToObject(f, "found_after_s", took);
        events_emit(ev, "host_lost", f);
        for (int k = 0; k < h->slots[i]; k++)
            fail_slot(ev, failed, WATCH_MAX_RANKS, h->first[i] + k);
    }
    hosts_failed_write(h, failed, WATCH_MAX_RANKS);
}

/* The incarnation a lost leader left (agent mode): its number (-1: none) and slots. */
static int previous_incarnation(el_etcd_t *etcd, const char *job, int *slots, int *world)
{
    char key[300];
    snprintf(key, sizeof key, "/moe/%s/incarnation", job);
    el_kv_t *kvs;
    size_t n;
    int inc = -1;
    *world = 0;
    if (el_etcd_range_prefix(etcd, key, &kvs, &n) != MOE_STATUS_SUCCESS) return -1;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(kvs[i].key, key)) inc = atoi(kvs[i].value);
    el_kvs_free(kvs, n);
    if (inc < 0) return -1;
    snprintf(key, sizeof key, "/moe/%s/inc/%d/slots", job, inc);
    if (el_etcd_range_prefix(etcd, key, &kvs, &n) == MOE_STATUS_SUCCESS) {
        for (size_t i = 0; i < n; i++) {
            if (strcmp(kvs[i].key, key)) continue;
            for (char *p = kvs[i].value; *p && *world < WATCH_MAX_RANKS;) {
                slots[(*world)++] = (int)strtol(p, &p, 10);
                if (*p != ',') break;
                p++;
            }
        }
        el_kvs_free(kvs, n);
    }
    return inc;
}

/* Runs the job: the single-host launcher (ag NULL), or the elected leader of the agents. */
static int lead(job_spec_t *sp, agent_t *ag)
{
    job_spec_t s = *sp;
    char err[1024];
    int rc;
    if (ag) { /* the job's ranks, not this host's slots, are the trainer's world */
        s.slots = s.ranks;
        s.spares = 0;
    }
    trainer_info_t info;
    if (trainer_info_query(&s, &info, err, sizeof err)) {
        fprintf(stderr, "moe_elastic: %s\n", err);
        return EXIT_ARGS;
    }
    /* agents: the leader key in etcd keeps a second leader out; the folder's lock is one
     * host's and stays with the single-host launcher */
    int lock = ag ? -1 : job_lock_take(info.ckpt_dir, 30.0, err, sizeof err);
    if (!ag && lock < 0) {
        fprintf(stderr, "moe_elastic: %s\n", err);
        trainer_info_free(&info);
        return EXIT_ARGS;
    }
    events_t own_ev, *evp = ag ? agent_events(ag) : &own_ev;
    if (!ag && events_open(&own_ev, s.events)) {
        fprintf(stderr, "moe_elastic: cannot open the events file %s\n", s.events);
        return EXIT_ARGS;
    }
    /* orphans of an incarnation (ranks whose mpirun died first) become our children */
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    etcd_server_t server = {0};
    const char *endpoint = s.etcd;
    if (!endpoint) {
        if (etcd_server_start(&server, s.etcd_binary, s.etcd_members, 30000, err, sizeof err)) {
            fprintf(stderr, "moe_elastic: private etcd: %s\n", err);
            events_close(evp);
            return EXIT_LAUNCHER;
        }
        endpoint = server.endpoint;
    }
    el_etcd_t *etcd = ag ? agent_etcd(ag) : NULL;
    moe_elastic_member_t *lease = NULL;
    hosts_t hosts = {.etcd = etcd, .job = s.job};
    char hostfile[1100] = "";
    if (ag) {
        const char *tmp = moe_env_string(MOE_ENV_TMPDIR, NULL);
        snprintf(hostfile, sizeof hostfile, "%s/moe-elastic-hosts-XXXXXX",
                 tmp && *tmp ? tmp : "/tmp");
        int fd = mkstemp(hostfile);
        if (fd < 0)
            hostfile[0] = 0;
        else
            close(fd);
    }
    int code = EXIT_LAUNCHER;
    bool *failed = NULL;
    int *active = NULL;
    if (!ag && el_etcd_create(endpoint, job_spec_request_ms(&s), &etcd) != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "moe_elastic: %s\n", moe_last_error());
        goto out;
    }
    rc = launcher_lease(&s, etcd, endpoint, &lease, err, sizeof err);
    if (rc) {
        fprintf(stderr, "moe_elastic: %s\n", err);
        code = rc == -2 ? EXIT_ARGS : EXIT_LAUNCHER;
        goto out;
    }
    ticker_t *tk = calloc(1, sizeof *tk);
    int total = ag ? WATCH_MAX_RANKS : s.slots + s.spares;
    failed = calloc((size_t)total, sizeof *failed);
    active = calloc((size_t)total, sizeof *active);
    if (!failed || !active || !tk) {
        free(tk);
        goto out;
    }
    tk->ev = evp;
    tk->agent = ag;
    tk->server = &server;
    tk->ckpt_dir = info.ckpt_dir;
    relay_open(&tk->relay, s.mpirun_log);
    el_mesh_t mesh = info.shape.job;
    int world = s.slots;
    for (int i = 0; i < world; i++) active[i] = i;
    {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "etcd", endpoint);
        cJSON_AddNumberToObject(f, "etcd_pid", server.n ? server.m[0].pid : 0);
        cJSON *pids = cJSON_CreateArray();
        for (int i = 0; i < server.n; i++)
            cJSON_AddItemToArray(pids, cJSON_CreateNumber(server.m[i].pid));
        cJSON_AddItemToObject(f, "etcd_pids", pids);
        cJSON_AddNumberToObject(f, "launcher_pid", getpid());
        cJSON_AddNumberToObject(f, "slots", s.slots);
        cJSON_AddNumberToObject(f, "spares", s.spares);
        cJSON_AddNumberToObject(f, "ttl_ms", s.ttl_ms);
        cJSON_AddNumberToObject(f, "steps", (double)info.steps);
        cJSON_AddItemToObject(f, "mesh", mesh_json(&mesh, active, world));
        cJSON_AddStringToObject(f, "mpirun_log", s.mpirun_log);
        events_emit(evp, "start", f);
    }
    int64_t previous_step = -1;
    double last_detected = 0, last_teardown = 0;
    bool recovering = false;
    int first_inc = 0;
    if (ag) {
        /* a new leader: the failed slots so far, and what a lost leader left running ended */
        int prev_slots[WATCH_MAX_RANKS], prev_world;
        hosts_failed_read(&hosts, failed, total);
        int prev = previous_incarnation(etcd, s.job, prev_slots, &prev_world);
        if (prev >= 0 && hosts_refresh(&hosts) == 0) {
            end_on_hosts(&s, &hosts, evp, failed, prev, prev_slots, prev_world, tk);
            first_inc = prev + 1;
            recovering = true;
            last_detected = proc_now();
        }
    }
    if (ag) {
        /* the hosts start at once but register one by one: the first world waits for the
         * job's ranks in healthy slots (or the start timeout, then takes what is there) */
        double until = proc_now() + s.start_timeout_ms / 1000.0;
        for (;;) {
            int n = 0;
            if (hosts_refresh(&hosts) == 0)
                for (int slot = 0; slot < hosts.total && slot < WATCH_MAX_RANKS; slot++) {
                    int h = hosts_of_slot(&hosts, slot);
                    n += h >= 0 && hosts.live[h] && !failed[slot];
                }
            if (n >= s.ranks || proc_now() > until || stop_requested) break;
            tick(tk);
            usleep((useconds_t)s.poll_ms * 1000);
        }
    }
    for (int inc = first_inc, restarts = 0;; inc++) {
        char prefix[256], key[320], val[64];
        snprintf(prefix, sizeof prefix, "/moe/%s/inc/%d", s.job, inc);
        snprintf(key, sizeof key, "%s/", prefix);
        el_etcd_delete_prefix(etcd, key, NULL); /* an earlier launcher's keys of the same job */
        snprintf(key, sizeof key, "/moe/%s/incarnation", s.job);
        snprintf(val, sizeof val, "%d", inc);
        if (el_etcd_put(etcd, key, val, 0) != MOE_STATUS_SUCCESS) {
            snprintf(err, sizeof err, "etcd at %s unreachable: %s", endpoint, moe_last_error());
            stop_event(evp, err, EXIT_LAUNCHER);
            break;
        }
        int agent_spares = 0;
        if (ag) {
            int pick = pick_on_hosts(&s, &info, &hosts, failed, active, &world, &mesh,
                                     &agent_spares, err, sizeof err);
            if (!pick && hosts_write_hostfile(&hosts, active, world, hostfile)) {
                snprintf(err, sizeof err, "cannot write the hostfile %s", hostfile);
                pick = EXIT_LAUNCHER;
            }
            char slots_key[320], slot_list[4096] = "";
            for (int i = 0; i < world && !pick; i++) {
                size_t l = strlen(slot_list);
                snprintf(slot_list + l, sizeof slot_list - l, "%s%d", i ? "," : "", active[i]);
            }
            snprintf(slots_key, sizeof slots_key, "%s/slots", prefix);
            if (!pick && el_etcd_put(etcd, slots_key, slot_list, 0) != MOE_STATUS_SUCCESS) {
                snprintf(err, sizeof err, "etcd at %s unreachable: %s", endpoint, moe_last_error());
                pick = EXIT_LAUNCHER;
            }
            if (pick) {
                stop_event(evp, err, pick);
                code = pick;
                break;
            }
        }
        pid_t mpirun = launch(&s, endpoint, prefix, active, world, &mesh, ag ? hostfile : NULL);
        if (mpirun < 0) {
            fprintf(stderr, "moe_elastic: could not start %s\n", s.mpirun);
            break;
        }
        tk->mpirun = mpirun;
        cJSON *f = cJSON_CreateObject();
        cJSON_AddNumberToObject(f, "incarnation", inc);
        cJSON_AddNumberToObject(f, "mpirun_pid", mpirun);
        cJSON_AddBoolToObject(f, "resume", true);
        cJSON_AddItemToObject(f, "mesh", mesh_json(&mesh, active, world));
        if (ag) { /* the host of each rank */
            cJSON *hl = cJSON_CreateArray();
            for (int i = 0; i < world; i++) {
                int h = hosts_of_slot(&hosts, active[i]);
                cJSON_AddItemToArray(hl, cJSON_CreateString(h >= 0 ? hosts.name[h] : "?"));
            }
            cJSON_AddItemToObject(f, "hosts", hl);
        }
        events_emit(evp, "launch", f);
        watch_config_t wc = {.etcd = etcd,
                             .events = evp,
                             .prefix = prefix,
                             .incarnation = inc,
                             .world = world,
                             .slots = active,
                             .mpirun = mpirun,
                             .start_timeout_s = s.start_timeout_ms / 1000.0,
                             .poll_s = s.poll_ms / 1000.0,
                             .peer_lost_grace_s = 2 * s.ttl_ms / 1000.0,
                             .stop = &stop_requested,
                             .tick = tick,
                             .tick_user = tk,
                             .endpoint = endpoint,
                             .recovering = recovering,
                             .previous_step = previous_step,
                             .failed_at = last_detected,
                             .teardown_s = last_teardown,
                             .remote_ranks = ag != NULL};
        host_check_t hc = {&hosts, active, world, ag, s.host};
        if (ag) {
            wc.lost_ranks = lost_ranks;
            wc.lost_ranks_user = &hc;
        }
        int free_slots = -world; /* healthy slots outside the incarnation: spares */
        for (int i = 0; i < total && !ag; i++) free_slots += !failed[i];
        if (ag) free_slots = agent_spares; /* the live hosts' healthy slots not in use */
        straggler_watch_t sw;
        if (straggler_watch_init(&sw, &s.straggler, world, free_slots > 0, info.ckpt_dir) == 0)
            wc.straggler = &sw; /* (out of memory: watched without it) */
        watch_result_t r;
        watch_incarnation(&wc, &r);
        straggler_watch_free(&sw);
        if (r.done) {
            f = cJSON_CreateObject();
            cJSON_AddNumberToObject(f, "incarnations", inc + 1);
            cJSON_AddNumberToObject(f, "restarts", restarts);
            cJSON_AddNumberToObject(f, "step",
                                    (double)(r.last_step >= 0 ? r.last_step : info.steps));
            events_emit(evp, "done", f);
            code = EXIT_DONE;
            break;
        }
        if (ag) { /* first: the agents then take the ranks' ends for the teardown's */
            char end_key[320];
            snprintf(end_key, sizeof end_key, "%s/end", prefix);
            el_etcd_put(etcd, end_key, "1", 0);
        }
        double td = watch_teardown(mpirun, s.grace_ms / 1000.0, tick, tk);
        if (ag && td >= 0) { /* the ranks are the hosts' to end; a host that is gone is lost */
            for (int i = 0; i < r.n_blamed; i++) fail_slot(evp, failed, total, r.blamed[i]);
            end_on_hosts(&s, &hosts, evp, failed, inc, active, world, tk);
        }
        f = cJSON_CreateObject();
        cJSON_AddNumberToObject(f, "incarnation", inc);
        cJSON_AddNumberToObject(f, "teardown_s", td);
        events_emit(evp, "teardown", f);
        if (td < 0) {
            stop_event(evp, "processes of the incarnation survived SIGKILL", EXIT_LAUNCHER);
            break;
        }
        if (r.stopped) {
            stop_event(evp,
                       ag && agent_deposed(ag) ? "this agent's lease expired: another "
                                                 "agent leads"
                                               : "stopped by a signal",
                       EXIT_SIGNALLED);
            code = EXIT_SIGNALLED;
            break;
        }
        if (tk->etcd_lost) {
            snprintf(err, sizeof err,
                     "a member of the private etcd at %s exited and could not "
                     "be started again",
                     endpoint);
            stop_event(evp, err, EXIT_LAUNCHER);
            break;
        }
        if (r.mpirun_exited && !r.n_registered && !ag) {
            snprintf(err, sizeof err, "%s exited before any rank registered: see %s", s.mpirun,
                     s.mpirun_log);
            stop_event(evp, err, EXIT_LAUNCHER);
            break;
        }
        last_detected = r.detected_at;
        last_teardown = td;
        recovering = true;
        if (r.last_step > previous_step) previous_step = r.last_step;
        int64_t settled = watch_last_step(&wc);
        if (settled > previous_step) previous_step = settled;
        for (int i = 0; i < r.n_blamed; i++) fail_slot(evp, failed, total, r.blamed[i]);
        if (ag) hosts_failed_write(&hosts, failed, total);
        if (++restarts > s.max_restarts) {
            snprintf(err, sizeof err,
                     "incarnation %d failed after %d restarts: --max-restarts "
                     "%d reached",
                     inc, restarts - 1, s.max_restarts);
            stop_event(evp, err, EXIT_RESTARTS);
            code = EXIT_RESTARTS;
            break;
        }
        if (ag) continue; /* the next world is picked from the live hosts at the launch */
        int healthy[WATCH_MAX_RANKS], n_healthy = 0;
        char failed_list[1024] = "";
        for (int i = 0; i < total; i++) {
            if (!failed[i])
                healthy[n_healthy++] = i;
            else {
                size_t l = strlen(failed_list);
                snprintf(failed_list + l, sizeof failed_list - l, "%s%d", l ? "," : "", i);
            }
        }
        int max_world = n_healthy < s.max_world ? n_healthy : s.max_world;
        el_mesh_t next;
        if (max_world < s.min_world ||
            el_choose_mesh(&info.shape, max_world, s.min_world, &next) != MOE_STATUS_SUCCESS) {
            snprintf(err, sizeof err, "%d healthy slots of %d (failed: %s; min world %d): %s",
                     n_healthy, total, failed_list, s.min_world,
                     max_world < s.min_world ? "too few" : moe_last_error());
            stop_event(evp, err, EXIT_TOO_FEW);
            code = EXIT_TOO_FEW;
            break;
        }
        world = (int)(next.tp * next.ep * next.dp * next.pp);
        for (int i = 0; i < world; i++) active[i] = healthy[i];
        f = mesh_json(&next, active, world);
        cJSON_AddBoolToObject(f, "changed",
                              next.tp != mesh.tp || next.ep != mesh.ep || next.dp != mesh.dp ||
                                  next.pp != mesh.pp || next.microbatches != mesh.microbatches);
        cJSON_AddNumberToObject(f, "spares_left", n_healthy - world);
        events_emit(evp, "mesh", f);
        mesh = next;
    }
    tk->mpirun = 0;
    tick(tk); /* the last lines, the last zombies */
    relay_pump(&tk->relay, true);
    free(tk);
out:
    free(failed);
    free(active);
    if (code != EXIT_DONE) fprintf(stderr, "moe_elastic: stopped (exit %d)\n", code);
    if (ag && code != EXIT_SIGNALLED) { /* the job ended: every agent ends with its code */
        char key[300], val[16];
        snprintf(key, sizeof key, "/moe/%s/exit", s.job);
        snprintf(val, sizeof val, "%d", code);
        el_etcd_put(etcd, key, val, 0);
    }
    moe_elastic_member_destroy(lease);
    if (!ag) el_etcd_destroy(etcd);
    etcd_server_stop(&server);
    if (!ag) events_close(evp);
    if (lock >= 0) close(lock);
    if (hostfile[0]) unlink(hostfile);
    trainer_info_free(&info);
    return code;
}

int main(int argc, char **argv)
{
    job_spec_t s;
    char err[1024];
    int rc = job_spec_parse(&s, argc, argv, err, sizeof err);
    if (rc == 1) {
        job_spec_usage(stdout);
        return EXIT_DONE;
    }
    if (rc < 0) {
        fprintf(stderr, "moe_elastic: %s\n", err);
        return EXIT_ARGS;
    }
    return s.agent ? agent_main(&s, lead) : lead(&s, NULL);
}
