/* s3rver behind the signature-verifying front, on loopback, for the checkpoint tests (see
 * s3_fixture.h). */
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
#define MOE_S3RVER_JS "tests/ckpt/s3/node_modules/s3rver/bin/s3rver.js"
#endif
#ifndef MOE_S3_FRONT_PY
#define MOE_S3_FRONT_PY "tests/ckpt/s3/sigv4_front.py"
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
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bool ok = s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0;
    if (s >= 0) close(s);
    return ok;
}

/* The first of $MOE_TEST_PYTHON, python3, /usr/bin/python3 that imports botocore. */
static const char *python_with_botocore(void)
{
    static char found[256];
    if (found[0]) return found;
    const char *cand[3] = {getenv("MOE_TEST_PYTHON"), "python3", "/usr/bin/python3"};
    for (int i = 0; i < 3; i++) {
        if (!cand[i] || !*cand[i] || strchr(cand[i], '\'')) continue;
        char cmd[400];
        snprintf(cmd, sizeof cmd, "'%s' -c 'import botocore' > /dev/null 2>&1", cand[i]);
        if (system(cmd) == 0) {
            snprintf(found, sizeof found, "%s", cand[i]);
            return found;
        }
    }
    return NULL;
}

static void kill_child(pid_t *pid)
{
    if (*pid > 0) {
        kill(-*pid, SIGKILL);
        kill(*pid, SIGKILL);
        waitpid(*pid, NULL, 0);
    }
    *pid = 0;
}

/* Fork argv[] in its own process group, dying with the test; wait until `port` accepts. */
static bool spawn(char *const argv[], int port, pid_t *pid, const char *what)
{
    *pid = fork();
    if (*pid < 0) return false;
    if (*pid == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
        if (!getenv("MOE_TEST_S3_VERBOSE")) {
            FILE *n = freopen("/dev/null", "w", stdout);
            (void)n;
        }
        execvp(argv[0], argv);
        fprintf(stderr, "s3 fixture: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    for (int i = 0; i < 300; i++) { /* up to 15 s */
        if (can_connect(port)) return true;
        int status;
        if (waitpid(*pid, &status, WNOHANG) == *pid) {
            fprintf(stderr, "s3 fixture: %s exited (status %d)\n", what, status);
            *pid = 0;
            return false;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "s3 fixture: %s did not listen on port %d\n", what, port);
    kill_child(pid);
    return false;
}

static bool launch(s3_fixture_t *f, const char *bucket)
{
    char port[16], up[16];
    snprintf(port, sizeof port, "%d", f->port);
    snprintf(up, sizeof up, "%d", f->s3rver_port);
    /* s3rver 3.7.1 makes ListObjectsV2 continuation tokens with DES, which OpenSSL 3
     * (Node >= 17) only offers through its legacy provider */
    char *s3rver[] = {"node",
                      "--openssl-legacy-provider",
                      MOE_S3RVER_JS,
                      "-d",
                      f->dir,
                      "-a",
                      "127.0.0.1",
                      "-p",
                      up,
                      getenv("MOE_TEST_S3_VERBOSE") ? "--no-vhost-buckets" : "--silent",
                      "--configure-bucket",
                      (char *)bucket,
                      NULL};
    char *front[] = {(char *)python_with_botocore(),
                     MOE_S3_FRONT_PY,
                     "--port",
                     port,
                     "--upstream-port",
                     up,
                     "--access-key",
                     S3_FIXTURE_ACCESS_KEY,
                     "--secret-key",
                     S3_FIXTURE_SECRET_KEY,
                     "--region",
                     "us-east-1",
                     NULL};
    if (!spawn(s3rver, f->s3rver_port, &f->pid, "s3rver")) return false;
    if (spawn(front, f->port, &f->front_pid, "the signature-verifying front")) return true;
    kill_child(&f->pid);
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
    if (!python_with_botocore()) {
        fprintf(stderr, "s3 fixture: no Python with botocore (python3-botocore; run "
                        "scripts/setup-deps.sh --tests)\n");
        return false;
    }
    snprintf(f->dir, sizeof f->dir, "/tmp/moe-s3rver-XXXXXX");
    if (!mkdtemp(f->dir)) return false;
    for (int attempt = 0; attempt < 3; attempt++) {
        f->port = free_port();
        f->s3rver_port = free_port();
        snprintf(f->endpoint, sizeof f->endpoint, "http://127.0.0.1:%d", f->port);
        if (f->port > 0 && f->s3rver_port > 0 && f->port != f->s3rver_port && launch(f, bucket))
            return true;
    }
    return false;
}

void s3_fixture_stop(s3_fixture_t *f)
{
    kill_child(&f->front_pid);
    kill_child(&f->pid);
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

void s3_fixture_config(moe_ckpt_config_t *c, const char *endpoint, const char *bucket,
                       const char *prefix)
{
    c->s3_endpoint = endpoint;
    c->s3_bucket = bucket;
    c->s3_prefix = prefix;
    c->s3_region = "us-east-1";
    c->s3_access_key = S3_FIXTURE_ACCESS_KEY;
    c->s3_secret_key = S3_FIXTURE_SECRET_KEY;
}
