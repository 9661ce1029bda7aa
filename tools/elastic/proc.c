/*
 * Process helpers (proc.h). A session is found through /proc/<pid>/stat, whose fields after
 * the command name (which may hold spaces and parentheses, so the scan starts after the last
 * ')') are: state, ppid, pgrp, session.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proc.h"

double proc_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double proc_wall(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

pid_t proc_spawn_session(char *const argv[], const char *log_path)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid != 0) return pid;
    setsid();
    /* ends with the launcher (mpirun ends its ranks on SIGTERM), so nothing outlives it */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);
    if (log_path) {
        int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            dup2(fd, STDERR_FILENO);
        }
    }
    int null = open("/dev/null", O_RDONLY);
    if (null >= 0) dup2(null, STDIN_FILENO);
    execvp(argv[0], argv);
    fprintf(stderr, "moe_elastic: exec %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

bool proc_wait(pid_t pid, double timeout_s, int *status)
{
    double end = proc_now() + timeout_s;
    int st;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid || (r < 0 && errno == ECHILD)) {
            if (status) *status = r == pid ? st : 0;
            return true;
        }
        if (proc_now() >= end) return false;
        usleep(10 * 1000);
    }
}

/* The start of /proc/<pid>/<name> (one read: at most size - 1 bytes) into buf, NUL-terminated;
 * its length, or 0 when the process or the file is gone or empty. */
static ssize_t read_proc(pid_t pid, const char *name, char *buf, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    return n;
}

/* state, ppid and session of pid; false when it is gone. */
static bool stat_of(pid_t pid, char *state, pid_t *ppid, pid_t *sid)
{
    char buf[1024];
    if (!read_proc(pid, "stat", buf, sizeof buf)) return false;
    char *p = strrchr(buf, ')');
    int pp, pg, se;
    if (!p || sscanf(p + 1, " %c %d %d %d", state, &pp, &pg, &se) != 4) return false;
    *ppid = pp;
    *sid = se;
    return true;
}

char proc_state(pid_t pid)
{
    char st;
    pid_t pp, se;
    return stat_of(pid, &st, &pp, &se) ? st : 0;
}

/* True when SIGKILL (bit 8 of the masks) is pending on the process or its main thread. */
static bool sigkill_pending(pid_t pid)
{
    char buf[4096];
    if (!read_proc(pid, "status", buf, sizeof buf)) return false;
    static const char *const fields[] = {"\nSigPnd:", "\nShdPnd:"};
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) {
        const char *p = strstr(buf, fields[i]);
        if (p && (strtoull(p + strlen(fields[i]), NULL, 16) >> (SIGKILL - 1)) & 1) return true;
    }
    return false;
}

bool proc_gone(pid_t pid)
{
    char st = proc_state(pid);
    return st == 0 || st == 'Z' || sigkill_pending(pid);
}

/* Calls fn for every process of session sid; returns how many there were. */
static size_t each_in_session(pid_t sid, void (*fn)(pid_t, char, pid_t, void *), void *user)
{
    DIR *d = opendir("/proc");
    if (!d) return 0;
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        char st;
        pid_t pp, se;
        if (*end || pid <= 0 || !stat_of((pid_t)pid, &st, &pp, &se) || se != sid) continue;
        n++;
        if (fn) fn((pid_t)pid, st, pp, user);
    }
    closedir(d);
    return n;
}

typedef struct collect {
    pid_t *pids;
    size_t n, max;
} collect_t;

static void collect_live(pid_t pid, char st, pid_t pp, void *user)
{
    (void)pp;
    collect_t *c = user;
    if (st != 'Z' && c->n < c->max) c->pids[c->n++] = pid;
}

size_t proc_session(pid_t sid, pid_t *pids, size_t max)
{
    collect_t c = {pids, 0, max};
    each_in_session(sid, collect_live, &c);
    return c.n;
}

static void send_sig(pid_t pid, char st, pid_t pp, void *user)
{
    (void)st, (void)pp;
    kill(pid, *(int *)user);
}

size_t proc_kill_session(pid_t sid, int sig) { return each_in_session(sid, send_sig, &sig); }

static void reap_child(pid_t pid, char st, pid_t pp, void *user)
{
    (void)user;
    if (st == 'Z' && pp == getpid()) waitpid(pid, NULL, WNOHANG);
}

void proc_reap_session(pid_t sid) { each_in_session(sid, reap_child, NULL); }

int proc_run_capture(char *const argv[], double timeout_s, char *out, size_t len)
{
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        setsid();
        dup2(fds[1], STDOUT_FILENO);
        execvp(argv[0], argv);
        fprintf(stderr, "moe_elastic: exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    size_t n = 0;
    double end = proc_now() + timeout_s;
    int status = -1;
    bool reaped = false;
    for (;;) {
        char tmp[4096];
        ssize_t r = read(fds[0], tmp, sizeof tmp);
        if (r > 0) {
            size_t take = (size_t)r < len - 1 - n ? (size_t)r : len - 1 - n;
            memcpy(out + n, tmp, take);
            n += take;
            continue;
        }
        if (r == 0) break; /* every writer closed: the program ended */
        if (errno != EAGAIN && errno != EINTR) break;
        if (proc_now() >= end) break;
        usleep(10 * 1000);
    }
    out[n] = 0;
    close(fds[0]);
    reaped = proc_wait(pid, proc_now() < end ? end - proc_now() : 0, &status);
    if (!reaped) {
        proc_kill_session(pid, SIGKILL);
        proc_wait(pid, 5.0, NULL);
        return -1;
    }
    proc_kill_session(pid, SIGKILL); /* anything it left behind */
    return status;
}

/* The value of the variable var ("NAME=") in pid's environment: 1 and out, or 0 when absent. */
static int env_of(pid_t pid, const char *var, char *out, size_t len)
{
    char buf[1 << 15];
    ssize_t n = read_proc(pid, "environ", buf, sizeof buf);
    if (!n) return 0;
    size_t vl = strlen(var);
    for (char *p = buf; p < buf + n; p += strlen(p) + 1)
        if (!strncmp(p, var, vl)) {
            snprintf(out, len, "%s", p + vl);
            return 1;
        }
    return 0;
}

/* The value of OMPI_COMM_WORLD_RANK in pid's environment, or -1. */
static int world_rank_of(pid_t pid)
{
    char v[32];
    return env_of(pid, "OMPI_COMM_WORLD_RANK=", v, sizeof v) ? atoi(v) : -1;
}

typedef struct ranks {
    pid_t *pids;
    int world;
    pid_t sid;
} ranks_t;

static void collect_rank(pid_t pid, char st, pid_t pp, void *user)
{
    ranks_t *r = user;
    if (st == 'Z') return;
    int k = world_rank_of(pid);
    if (k < 0 || k >= r->world) return;
    char pst;
    pid_t ppp, psid;
    /* a rank's own children inherit its variables: the rank is the one whose parent is not */
    if (stat_of(pp, &pst, &ppp, &psid) && psid == r->sid && world_rank_of(pp) == k) return;
    r->pids[k] = pid;
}

void proc_session_ranks(pid_t sid, pid_t *pids, int world)
{
    for (int k = 0; k < world; k++) pids[k] = 0;
    ranks_t r = {pids, world, sid};
    each_in_session(sid, collect_rank, &r);
}

void proc_reap_children(const pid_t *keep, int n_keep)
{
    DIR *d = opendir("/proc");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end, st;
        long pid = strtol(e->d_name, &end, 10);
        pid_t pp, se;
        if (*end || pid <= 0 || !stat_of((pid_t)pid, &st, &pp, &se)) continue;
        if (st != 'Z' || pp != getpid()) continue;
        bool kept = false;
        for (int i = 0; i < n_keep; i++) kept |= keep[i] == (pid_t)pid;
        if (!kept) waitpid((pid_t)pid, NULL, WNOHANG);
    }
    closedir(d);
}

void proc_job_ranks(const char *prefix, pid_t sid, pid_t *pids, int world)
{
    for (int k = 0; k < world; k++) pids[k] = 0;
    DIR *d = opendir("/proc");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end, st, v[512];
        long pid = strtol(e->d_name, &end, 10);
        pid_t pp, se;
        if (*end || pid <= 0 || !stat_of((pid_t)pid, &st, &pp, &se) || st == 'Z') continue;
        if ((sid && se != sid) || !env_of((pid_t)pid, "MOE_ELASTIC_PREFIX=", v, sizeof v) ||
            strcmp(v, prefix))
            continue;
        int k = world_rank_of((pid_t)pid);
        if (k < 0 || k >= world) continue;
        /* a rank's own children inherit its variables: the rank is the one whose parent is not */
        if (world_rank_of(pp) == k && env_of(pp, "MOE_ELASTIC_PREFIX=", v, sizeof v) &&
            !strcmp(v, prefix))
            continue;
        pids[k] = (pid_t)pid;
    }
    closedir(d);
}
