/* The S3 test server: s3rver (tests/s3/, installed by scripts/setup-deps.sh --tests) started
 * on 127.0.0.1 at a free port with a temporary directory, stopped (and restarted) on demand.
 * s3rver is only an S3-compatible store for the tests: passing tests say nothing about
 * authentication against real S3. */
#ifndef MOE_TEST_S3_FIXTURE_H
#define MOE_TEST_S3_FIXTURE_H

#include <stdbool.h>
#include <sys/types.h>

typedef struct s3_fixture {
    pid_t pid;
    int port;
    char dir[256];
    char endpoint[64];
} s3_fixture_t;

/* false (with a message on stderr) when node or s3rver is missing or it does not start. */
bool s3_fixture_start(s3_fixture_t *f, const char *bucket);
/* Stop the server (SIGKILL: like a crash), keep its directory. */
void s3_fixture_stop(s3_fixture_t *f);
/* Start it again on the same port and directory. */
bool s3_fixture_restart(s3_fixture_t *f, const char *bucket);
/* Stop and remove the directory. */
void s3_fixture_destroy(s3_fixture_t *f);

#endif
