/* The S3 test server: s3rver (tests/ckpt/s3/, installed by scripts/setup-deps.sh --tests)
 * behind tests/ckpt/s3/sigv4_front.py, a front that verifies every request's AWS Signature V4 with
 * botocore (AWS's own signer) and forwards only correctly signed ones. Both listen on
 * 127.0.0.1 at free ports, with a temporary directory; stopped (and restarted on the same
 * ports) on demand. Clients use `endpoint` (the front) with S3_FIXTURE_ACCESS_KEY and
 * S3_FIXTURE_SECRET_KEY: a request signed with anything else is refused with 403, as real S3
 * refuses it. */
#ifndef MOE_TEST_S3_FIXTURE_H
#define MOE_TEST_S3_FIXTURE_H

#include <stdbool.h>
#include <sys/types.h>

#include <moe/ckpt.h>

/* s3rver's one account; the secret is the front's (s3rver checks no signatures) */
#define S3_FIXTURE_ACCESS_KEY "S3RVER"
#define S3_FIXTURE_SECRET_KEY "moe/test+Secret=verified-by-the-front"

typedef struct s3_fixture {
    pid_t pid, front_pid;
    int port; /* the front's: the endpoint */
    int s3rver_port;
    char dir[256];
    char endpoint[64];
} s3_fixture_t;

/* false (with a message on stderr) when node, s3rver or Python with botocore is missing, or
 * a server does not start. */
bool s3_fixture_start(s3_fixture_t *f, const char *bucket);
/* Stop both servers (SIGKILL: like a crash; connections are then refused), keep the data. */
void s3_fixture_stop(s3_fixture_t *f);
/* Start them again on the same ports and directory. */
bool s3_fixture_restart(s3_fixture_t *f, const char *bucket);
/* Stop and remove the directory. */
void s3_fixture_destroy(s3_fixture_t *f);
/* Point checkpointer config c at the fixture: endpoint (a fixture's, or a copy of one),
 * bucket, prefix, us-east-1 and the fixture's keys. c keeps the pointers. */
void s3_fixture_config(moe_ckpt_config_t *c, const char *endpoint, const char *bucket,
                       const char *prefix);

#endif
