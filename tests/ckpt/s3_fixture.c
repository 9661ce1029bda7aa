/* s3rver on loopback for the checkpoint tests (see s3_fixture.h). */
#include "s3_fixture.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef MOE_S3RVER_JS
#define MOE_S3RVER_JS "tests/s3/node_modules/s3rver/bin/s3rver.js"
#endif

static int free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(s, (struct sockaddr *)&a, &l) != 0) {
        if (s >= 0) close(s);
        return -1;
    }
    close(s);
    return ntohs(a.sin_port);
}

static bool can_connect(int port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bool ok = s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0;
    if (s >= 0) close(s);
    return ok;
}

static bool launch(s3_fixture_t *f, const char *bucket)
{
    char port[16];
    snprintf(port, sizeof port, "%d", f->port);
    f->pid = fork();
    if (f->pid < 0) return false;
    if (f->pid == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
        if (!getenv("MOE_TEST_S3_VERBOSE")) {
            FILE *n = freopen("/dev/null", "w", stdout);
            (void)n;
        }
        const char *quiet = getenv("MOE_TEST_S3_VERBOSE") ? "--no-vhost-buckets" : "--silent";
        /* s3rver 3.7.1 makes ListObjectsV2 continuation tokens with DES, which OpenSSL 3
         * (Node >= 17) only offers through its legacy provider */
        execlp("node", "node", "--openssl-legacy-provider", MOE_S3RVER_JS, "-d", f->dir, "-a", "127.0.0.1", "-p", port,
               quiet, "--configure-bucket", bucket, (char *)NULL);
        fprintf(stderr, "s3 fixture: cannot run node: %s\n", strerror(errno));
        _exit(127);
    }
    for (int i = 0; i < 300; i++) { /* up to 15 s */
        if (can_connect(f->port)) return true;
        int status;
        if (waitpid(f->pid, &status, WNOHANG) == f->pid) {
            fprintf(stderr, "s3 fixture: s3rver exited (status %d)\n", status);
            f->pid = 0;
            return false;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "s3 fixture: s3rver did not listen on port %d\n", f->port);
    s3_fixture_stop(f);
    return false;
}

bool s3_fixture_start(s3_fixture_t *f, const char *bucket)
{
    memset(f, 0, sizeof *f);
    if (access(MOE_S3RVER_JS, R_OK) != 0) {
        fprintf(stderr, "s3 fixture: %s missing (run scripts/setup-deps.sh --tests)\n",
                MOE_S3RVER_JS);
        return false;
    }
    snprintf(f->dir, sizeof f->dir, "/tmp/moe-s3rver-XXXXXX");
    if (!mkdtemp(f->dir)) return false;
    for (int attempt = 0; attempt < 3; attempt++) {
        f->port = free_port();
        snprintf(f->endpoint, sizeof f->endpoint, "http://127.0.0.1:%d", f->port);
        if (f->port > 0 && launch(f, bucket)) return true;
    }
    return false;
}

void s3_fixture_stop(s3_fixture_t *f)
{
    if (f->pid > 0) {
        kill(-f->pid, SIGKILL);
        kill(f->pid, SIGKILL);
        waitpid(f->pid, NULL, 0);
    }
    f->pid = 0;
}

bool s3_fixture_restart(s3_fixture_t *f, const char *bucket) { return launch(f, bucket); }

void s3_fixture_destroy(s3_fixture_t *f)
{
    s3_fixture_stop(f);
    if (f->dir[0]) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", f->dir);
        if (system(cmd) != 0) fprintf(stderr, "s3 fixture: could not remove %s\n", f->dir);
    }
}
