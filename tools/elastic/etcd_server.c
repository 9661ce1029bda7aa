/*
 * The private etcd (etcd_server.h). Ports come from the kernel (bind to port 0, read it back,
 * close): another program could take one in between, which etcd then reports and the start
 * fails with its log's last line instead of hanging.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/env.h"
#include "elastic/etcd.h"
#include "etcd_server.h"
#include "proc.h"

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &al) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

/* The last line of member i's log, for a failed start's message. */
static void log_tail(const etcd_server_t *s, int i, char *out, size_t len)
{
    char path[400], line[512] = "";
    snprintf(path, sizeof path, "%s/%s.log", s->dir, s->m[i].name);
    FILE *f = fopen(path, "r");
    out[0] = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f)) snprintf(out, len, "%s", line);
    fclose(f);
    size_t n = strlen(out);
    if (n && out[n - 1] == '\n') out[n - 1] = 0;
}

/* Starts member i's process on its folder and ports. A restarted member finds its data folder
 * and ignores the --initial-cluster flags: it rejoins as itself. */
static int spawn(etcd_server_t *s, int i)
{
    etcd_server_member_t *m = &s->m[i];
    char data[400], logp[400];
    snprintf(data, sizeof data, "%s/%s", s->dir, m->name);
    snprintf(logp, sizeof logp, "%s/%s.log", s->dir, m->name);
    char *argv[] = {s->binary,  "--name",
                    m->name,    "--data-dir",
                    data,       "--listen-client-urls",
                    m->client,  "--advertise-client-urls",
                    m->client,  "--listen-peer-urls",
                    m->peer,    "--initial-advertise-peer-urls",
                    m->peer,    "--initial-cluster",
                    s->cluster, "--initial-cluster-token",
                    s->dir,     NULL};
    m->pid = proc_spawn_session(argv, logp);
    if (m->pid < 0) {
        m->pid = 0;
        return -1;
    }
    return 0;
}

int etcd_server_start(etcd_server_t *s, const char *binary, int n, int ready_ms, char *err,
                      size_t len)
{
    memset(s, 0, sizeof *s);
    if (n < 1 || n > ETCD_SERVER_MAX_MEMBERS) {
        snprintf(err, len, "%d etcd members: 1 to %d", n, ETCD_SERVER_MAX_MEMBERS);
        return -1;
    }
    snprintf(s->binary, sizeof s->binary, "%s", binary ? binary : "etcd");
    const char *tmp = moe_env_string(MOE_ENV_TMPDIR, NULL);
    snprintf(s->dir, sizeof s->dir, "%s/moe-etcd-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(s->dir)) {
        snprintf(err, len, "mkdtemp(%s): %s", s->dir, strerror(errno));
        s->dir[0] = 0;
        return -1;
    }
    s->n = n;
    for (int i = 0; i < n; i++) {
        etcd_server_member_t *m = &s->m[i];
        int cport = free_port(), pport = free_port();
        if (cport < 0 || pport < 0 || cport == pport) {
            snprintf(err, len, "no free loopback port for etcd");
            etcd_server_stop(s);
            return -1;
        }
        snprintf(m->name, sizeof m->name, n == 1 ? "moe-elastic" : "moe-elastic-%d", i);
        snprintf(m->client, sizeof m->client, "http://127.0.0.1:%d", cport);
        snprintf(m->peer, sizeof m->peer, "http://127.0.0.1:%d", pport);
        size_t l = strlen(s->endpoint), c = strlen(s->cluster);
        snprintf(s->endpoint + l, sizeof s->endpoint - l, "%s%s", i ? "," : "", m->client);
        snprintf(s->cluster + c, sizeof s->cluster - c, "%s%s=%s", i ? "," : "", m->name, m->peer);
    }
    for (int i = 0; i < n; i++) {
        if (spawn(s, i)) {
            snprintf(err, len, "starting %s: %s", s->binary, strerror(errno));
            etcd_server_stop(s);
            return -1;
        }
    }
    el_etcd_t *e = NULL;
    if (el_etcd_create(s->endpoint, 500, &e) != MOE_STATUS_SUCCESS) {
        snprintf(err, len, "%s", moe_last_error());
        etcd_server_stop(s);
        return -1;
    }
    double end = proc_now() + ready_ms / 1000.0;
    int ready = 0, status, exited = -1;
    while (!ready && exited < 0 && proc_now() < end) {
        for (int i = 0; i < n && exited < 0; i++) {
            if (waitpid(s->m[i].pid, &status, WNOHANG) == s->m[i].pid) {
                s->m[i].pid = 0;
                exited = i;
            }
        }
        ready = exited < 0 && el_etcd_put(e, "/moe/ready", "1", 0) == MOE_STATUS_SUCCESS;
        if (!ready) usleep(50 * 1000);
    }
    el_etcd_destroy(e);
    if (!ready) {
        char tail[400];
        int i = exited >= 0 ? exited : 0;
        log_tail(s, i, tail, sizeof tail);
        snprintf(err, len, "etcd at %s %s within %d ms (%s/%s.log: %s)", s->endpoint,
                 exited >= 0 ? "exited" : "did not answer", ready_ms, s->dir, s->m[i].name, tail);
        etcd_server_stop(s);
        return -1;
    }
    return 0;
}

int etcd_server_supervise(etcd_server_t *s, int *member, int *wait_status)
{
    for (int i = 0; i < s->n; i++) {
        if (s->m[i].pid <= 0 || waitpid(s->m[i].pid, wait_status, WNOHANG) != s->m[i].pid) continue;
        s->m[i].pid = 0;
        *member = i;
        return spawn(s, i) ? -1 : 1;
    }
    return 0;
}

void etcd_server_stop(etcd_server_t *s)
{
    for (int i = 0; i < s->n; i++) /* all at once: a cluster's members wait for each other */
        if (s->m[i].pid > 0) kill(s->m[i].pid, SIGTERM);
    for (int i = 0; i < s->n; i++) {
        pid_t pid = s->m[i].pid;
        if (pid <= 0) continue;
        if (!proc_wait(pid, 5.0, NULL)) {
            kill(pid, SIGKILL);
            proc_wait(pid, 5.0, NULL);
        }
        s->m[i].pid = 0;
    }
    if (s->dir[0]) nftw(s->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    s->dir[0] = 0;
}
