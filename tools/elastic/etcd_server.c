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

/* The last line of the server's log, for a failed start's message. */
static void log_tail(const etcd_server_t *s, char *out, size_t len)
{
    char path[300], line[512] = "";
    snprintf(path, sizeof path, "%s/etcd.log", s->dir);
    FILE *f = fopen(path, "r");
    out[0] = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f)) snprintf(out, len, "%s", line);
    fclose(f);
    size_t n = strlen(out);
    if (n && out[n - 1] == '\n') out[n - 1] = 0;
}

/* Starts the server process on s's folder and ports. */
static int spawn(etcd_server_t *s)
{
    char cluster[96], data[300], logp[300];
    snprintf(cluster, sizeof cluster, "moe-elastic=%s", s->peer);
    snprintf(data, sizeof data, "%s/data", s->dir);
    snprintf(logp, sizeof logp, "%s/etcd.log", s->dir);
    char *argv[] = {s->binary, "--name", "moe-elastic", "--data-dir", data,
                    "--listen-client-urls", s->endpoint, "--advertise-client-urls", s->endpoint,
                    "--listen-peer-urls", s->peer, "--initial-advertise-peer-urls", s->peer,
                    "--initial-cluster", cluster, NULL};
    s->pid = proc_spawn_session(argv, logp);
    if (s->pid < 0) {
        s->pid = 0;
        return -1;
    }
    return 0;
}

int etcd_server_start(etcd_server_t *s, const char *binary, int ready_ms, char *err, size_t len)
{
    memset(s, 0, sizeof *s);
    snprintf(s->binary, sizeof s->binary, "%s", binary ? binary : "etcd");
    const char *tmp = moe_env_string(MOE_ENV_TMPDIR, NULL);
    snprintf(s->dir, sizeof s->dir, "%s/moe-etcd-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(s->dir)) {
        snprintf(err, len, "mkdtemp(%s): %s", s->dir, strerror(errno));
        return -1;
    }
    int cport = free_port(), pport = free_port();
    if (cport < 0 || pport < 0 || cport == pport) {
        snprintf(err, len, "no free loopback port for etcd");
        etcd_server_stop(s);
        return -1;
    }
    snprintf(s->endpoint, sizeof s->endpoint, "http://127.0.0.1:%d", cport);
    snprintf(s->peer, sizeof s->peer, "http://127.0.0.1:%d", pport);
    if (spawn(s)) {
        snprintf(err, len, "starting %s: %s", s->binary, strerror(errno));
        etcd_server_stop(s);
        return -1;
    }
    el_etcd_t *e = NULL;
    if (el_etcd_create(s->endpoint, 500, &e) != MOE_STATUS_SUCCESS) {
        snprintf(err, len, "%s", moe_last_error());
        etcd_server_stop(s);
        return -1;
    }
    double end = proc_now() + ready_ms / 1000.0;
    int ready = 0, status;
    while (!ready && proc_now() < end) {
        if (waitpid(s->pid, &status, WNOHANG) == s->pid) {
            s->pid = 0;
            break;
        }
        ready = el_etcd_put(e, "/moe/ready", "1", 0) == MOE_STATUS_SUCCESS;
        if (!ready) usleep(50 * 1000);
    }
    el_etcd_destroy(e);
    if (!ready) {
        char tail[400];
        log_tail(s, tail, sizeof tail);
        snprintf(err, len, "etcd at %s %s within %d ms (%s/etcd.log: %s)", s->endpoint,
                 s->pid ? "did not answer" : "exited", ready_ms, s->dir, tail);
        etcd_server_stop(s);
        return -1;
    }
    return 0;
}

int etcd_server_supervise(etcd_server_t *s, int *wait_status)
{
    if (s->pid <= 0 || waitpid(s->pid, wait_status, WNOHANG) != s->pid) return 0;
    s->pid = 0;
    return spawn(s) ? -1 : 1;
}

void etcd_server_stop(etcd_server_t *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGTERM);
        if (!proc_wait(s->pid, 5.0, NULL)) {
            kill(s->pid, SIGKILL);
            proc_wait(s->pid, 5.0, NULL);
        }
        s->pid = 0;
    }
    if (s->dir[0]) nftw(s->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    s->dir[0] = 0;
}
