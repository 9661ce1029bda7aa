/* S3 tier against s3rver on 127.0.0.1 behind the fixture's signature-verifying front
 * (botocore recomputes every request's SigV4 and payload hash; s3rver itself checks neither):
 *   - signatures: a wrong secret or access key is refused with S3's own error code in the
 *     message (SignatureDoesNotMatch, InvalidAccessKeyId), and so is a missing object on
 *     download (NoSuchKey, NOT_FOUND);
 *   - mirror + multipart (a 12 MiB tensor in 5 MiB parts) + retention on S3, then restore
 *     bitwise into an empty local directory;
 *   - a corrupt local copy is replaced by the S3 copy of the same step;
 *   - the server killed mid-upload and restarted: retries, the mirror completes, the local
 *     tier is unaffected (loads during the outage);
 *   - wrong bucket: a clear error at create; secrets never appear in errors or logs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt/ckpt_internal.h"
#include "ckpt_common.h"
#include "s3_fixture.h"

#define BUCKET "moe-test"
#define BIG_N (3 * (1 << 20)) /* 12 MiB of f32 */

static s3_fixture_t g_s3;
static bool g_have_s3;
static moe_runtime_t *g_rt;
static char g_dir[256];
static float *g_big;

typedef struct st5 {
    ct_state_t s;
    moe_ckpt_tensor_t t[4];
} st5_t;

static void st5_init(st5_t *x)
{
    ct_init(&x->s);
    memcpy(x->t, x->s.t, sizeof x->s.t);
    int64_t shp[2] = {3, 1 << 20};
    moe_tensor_t tb;
    TEST_OK(moe_tensor_view(g_big, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &tb));
    x->t[3] = moe_ckpt_tensor_whole("big", &tb);
}

static void st5_fill(st5_t *x, int64_t step)
{
    ct_fill(&x->s, step);
    for (int64_t i = 0; i < BIG_N; i++) g_big[i] = ct_f32(ct_hash((uint64_t)step, 3, (uint64_t)i));
}

static bool st5_check(st5_t *x, int64_t step)
{
    if (!ct_check(&x->s, step)) return false;
    for (int64_t i = 0; i < BIG_N; i++)
        if (g_big[i] != ct_f32(ct_hash((uint64_t)step, 3, (uint64_t)i))) return false;
    return true;
}

static moe_ckpt_config_t s3_config(const char *dir, const char *prefix)
{
    moe_ckpt_config_t c = ct_config(dir);
    c.pinned_budget_bytes = 4 << 20;
    s3_fixture_config(&c, g_s3.endpoint, BUCKET, prefix);
    c.s3_part_bytes = 5 << 20;
    c.s3_parallel_parts = 2;
    c.s3_max_retries = 8;
    c.s3_retry_base_ms = 100;
    c.s3_timeout_ms = 10000;
    return c;
}

static int setup(void **st)
{
    (void)st;
    if (!g_have_s3) {
        print_message("S3 test server unavailable (node + tests/ckpt/s3 via scripts/setup-deps.sh "
                      "--tests)\n");
        skip();
    }
    ct_up(g_dir, sizeof g_dir, "s3", &g_rt);
    return 0;
}

static int teardown(void **st)
{
    (void)st;
    ct_down(g_dir, g_rt);
    return 0;
}

static void test_mirror_multipart_retention_restore(void **st)
{
    (void)st;
    moe_ckpt_config_t c = s3_config(g_dir, "run/a");
    c.keep_last = 2;
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck));
    st5_t x;
    st5_init(&x);
    for (int64_t step = 1; step <= 3; step++) {
        st5_fill(&x, step);
        TEST_OK(moe_ckpt_save_async(ck, step, x.t, 4));
        TEST_OK(moe_ckpt_wait(ck, 1, 120000));
    }
    moe_ckpt_status_t s = {.struct_size = sizeof s};
    TEST_OK(moe_ckpt_status(ck, &s));
    assert_int_equal(s.last_uploaded_step, 3);
    assert_true(s.bytes_uploaded >= 3ull * BIG_N * 4);
    int64_t steps[8];
    int32_t n;
    TEST_OK(moe_ckpt_list(ck, MOE_CKPT_TIER_S3, steps, 8, &n));
    assert_int_equal(n, 2);
    assert_int_equal(steps[0], 2);
    assert_int_equal(steps[1], 3);
    TEST_OK(moe_ckpt_destroy(ck));
    /* a fresh machine: empty local directory, the same prefix */
    char fresh[256];
    ct_tempdir(fresh, sizeof fresh, "s3-fresh");
    c = s3_config(fresh, "run/a");
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck));
    TEST_OK(moe_ckpt_list(ck, MOE_CKPT_TIER_LOCAL, steps, 8, &n));
    assert_int_equal(n, 0);
    memset(g_big, 0, BIG_N * 4);
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, x.t, 4, &step));
    assert_int_equal(step, 3);
    assert_true(st5_check(&x, 3));
    assert_true(ct_log_has("restored from S3"));
    TEST_OK(moe_ckpt_list(ck, MOE_CKPT_TIER_LOCAL, steps, 8, &n)); /* now cached locally */
    assert_int_equal(n, 1);
    TEST_OK(moe_ckpt_destroy(ck));
    ct_rmrf(fresh);
    ct_free(&x.s);
}

static void test_corrupt_local_uses_s3_copy(void **st)
{
    (void)st;
    moe_ckpt_config_t c = s3_config(g_dir, "run/b");
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck));
    st5_t x;
    st5_init(&x);
    for (int64_t step = 1; step <= 2; step++) {
        TEST_OK(moe_ckpt_fence(ck)); /* step 1 may still copy x */
        st5_fill(&x, step);
        TEST_OK(moe_ckpt_save_async(ck, step, x.t, 4));
    }
    TEST_OK(moe_ckpt_wait(ck, 1, 120000));
    char path[512];
    snprintf(path, sizeof path, "%s/step-000000000002/rank-00000.bin", g_dir);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char b = 0x5a;
    assert_int_equal(pwrite(fd, &b, 1, 500000), 1); /* inside "big" */
    close(fd);
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, x.t, 4, &step));
    assert_int_equal(step, 2); /* the same step, from S3, not the older local one */
    assert_true(st5_check(&x, 2));
    assert_true(ct_log_has("checksum mismatch"));
    assert_true(ct_log_has("step 2 restored from S3"));
    TEST_OK(moe_ckpt_destroy(ck));
    ct_free(&x.s);
}

static void test_server_killed_mid_upload(void **st)
{
    (void)st;
    moe_ckpt_config_t c = s3_config(g_dir, "run/c");
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck));
    st5_t x;
    st5_init(&x);
    st5_fill(&x, 7);
    TEST_OK(moe_ckpt_save_async(ck, 7, x.t, 4));
    TEST_OK(moe_ckpt_wait(ck, 0, 60000)); /* durable locally: the upload starts now */
    moe_ckpt_status_t s = {.struct_size = sizeof s};
    TEST_OK(moe_ckpt_status(ck, &s));
    print_message("killing the server with %llu bytes uploaded, state %d\n",
                  (unsigned long long)s.bytes_uploaded, (int)s.state);
    s3_fixture_stop(&g_s3);
    /* the local tier works during the outage (S3 listing fails fast and is skipped) */
    memset(g_big, 0, BIG_N * 4);
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, x.t, 4, &step));
    assert_int_equal(step, 7);
    assert_true(st5_check(&x, 7));
    assert_true(ct_log_has("cannot list S3"));
    struct timespec ts = {1, 500 * 1000 * 1000};
    nanosleep(&ts, NULL);
    assert_int_equal(moe_ckpt_poll(ck, 1), MOE_STATUS_IN_PROGRESS); /* still retrying */
    assert_true(s3_fixture_restart(&g_s3, BUCKET));
    TEST_OK(moe_ckpt_wait(ck, 1, 120000));
    assert_true(ct_log_has("retry"));
    TEST_OK(moe_ckpt_status(ck, &s));
    assert_int_equal(s.last_uploaded_step, 7);
    TEST_OK(moe_ckpt_destroy(ck));
    /* the mirror is complete: restore from S3 alone */
    char fresh[256];
    ct_tempdir(fresh, sizeof fresh, "s3-after");
    c = s3_config(fresh, "run/c");
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck));
    memset(g_big, 0, BIG_N * 4);
    TEST_OK(moe_ckpt_load_latest(ck, x.t, 4, &step));
    assert_int_equal(step, 7);
    assert_true(st5_check(&x, 7));
    TEST_OK(moe_ckpt_destroy(ck));
    ct_rmrf(fresh);
    ct_free(&x.s);
}

/* Requests the front refuses, and an error body of a download: S3's code reaches the message. */
static void test_signatures_verified(void **st)
{
    (void)st;
    moe_ckpt_config_t c = s3_config(g_dir, "run/e");
    c.s3_secret_key = "not-the-secret";
    moe_ckpt_t *ck = NULL;
    assert_int_equal(moe_ckpt_create(g_rt, &c, &ck), MOE_STATUS_REMOTE_ERROR);
    print_message("wrong secret: %s\n", moe_last_error());
    assert_non_null(strstr(moe_last_error(), "HTTP 403 SignatureDoesNotMatch"));
    assert_null(strstr(moe_last_error(), "not-the-secret"));
    c = s3_config(g_dir, "run/e");
    c.s3_access_key = "AKIDEXAMPLE";
    assert_int_equal(moe_ckpt_create(g_rt, &c, &ck), MOE_STATUS_REMOTE_ERROR);
    assert_non_null(strstr(moe_last_error(), "HTTP 403 InvalidAccessKeyId"));
    /* a step on S3 whose manifest names an object that is not there */
    c = s3_config(g_dir, "run/e");
    ck_s3_t *s3 = NULL;
    TEST_OK(ck_s3_create(&c, NULL, &s3));
    char local[400];
    snprintf(local, sizeof local, "%s/missing.bin", g_dir);
    moe_status_t r = ck_s3_get_file(s3, "step-000000000009", "rank-00000.bin", local);
    print_message("missing object: %s\n", moe_last_error());
    assert_int_equal(r, MOE_STATUS_NOT_FOUND);
    assert_non_null(strstr(moe_last_error(), "HTTP 404 NoSuchKey"));
    ck_s3_destroy(s3);
}

static void test_wrong_bucket_and_secrets(void **st)
{
    (void)st;
    const char *secret = S3_FIXTURE_SECRET_KEY;
    setenv("AWS_ACCESS_KEY_ID", S3_FIXTURE_ACCESS_KEY, 1);
    setenv("AWS_SECRET_ACCESS_KEY", secret, 1);
    moe_ckpt_config_t c = s3_config(g_dir, "run/d");
    c.s3_access_key = c.s3_secret_key = NULL; /* from the environment */
    c.s3_bucket = "no-such-bucket";
    moe_ckpt_t *ck = NULL;
    assert_int_equal(moe_ckpt_create(g_rt, &c, &ck), MOE_STATUS_REMOTE_ERROR);
    assert_null(ck);
    print_message("wrong bucket: %s\n", moe_last_error());
    assert_non_null(strstr(moe_last_error(), "S3 bucket \"no-such-bucket\" does not exist"));
    assert_non_null(strstr(moe_last_error(), "NoSuchBucket"));
    assert_null(strstr(moe_last_error(), secret));
    /* an upload that fails for good (nothing listens there) reports without the secret */
    c.s3_bucket = BUCKET;
    c.s3_endpoint = "http://127.0.0.1:9"; /* discard port: connection refused */
    c.s3_max_retries = 1;
    c.s3_retry_base_ms = 10;
    TEST_OK(moe_ckpt_create(g_rt, &c, &ck)); /* unreachable at create: warned, not fatal */
    st5_t x;
    st5_init(&x);
    st5_fill(&x, 1);
    TEST_OK(moe_ckpt_save_async(ck, 1, x.t, 3));
    moe_status_t r = moe_ckpt_wait(ck, 1, 60000);
    assert_int_equal(r, MOE_STATUS_TIMEOUT);
    print_message("unreachable: %s\n", moe_last_error());
    assert_null(strstr(moe_last_error(), secret));
    assert_false(ct_log_has(secret));
    int64_t steps[4];
    int32_t n;
    TEST_OK(moe_ckpt_list(ck, MOE_CKPT_TIER_LOCAL, steps, 4, &n)); /* local tier unaffected */
    assert_int_equal(n, 1);
    /* a second failed upload stays on the handle; loading is not blocked by it */
    st5_fill(&x, 2);
    TEST_OK(moe_ckpt_save_async(ck, 2, x.t, 3));
    int64_t step = -1;
    TEST_OK(moe_ckpt_fence(ck)); /* the save may still copy x */
    memset(x.s.a, 0, CT_A_N * 4);
    TEST_OK(moe_ckpt_load_latest(ck, x.t, 3, &step));
    assert_int_equal(step, 2);
    assert_true(ct_check(&x.s, 2));
    assert_int_equal(moe_ckpt_wait(ck, 1, 60000), MOE_STATUS_TIMEOUT); /* reported here */
    /* destroy tries the newest step once more, and says that it is not on S3 */
    assert_int_equal(moe_ckpt_destroy(ck), MOE_STATUS_TIMEOUT);
    assert_non_null(strstr(moe_last_error(), "mirroring step 2 to S3"));
    assert_null(strstr(moe_last_error(), secret));
    unsetenv("AWS_ACCESS_KEY_ID");
    unsetenv("AWS_SECRET_ACCESS_KEY");
    ct_free(&x.s);
}

int main(void)
{
    g_big = malloc(BIG_N * sizeof *g_big);
    g_have_s3 = s3_fixture_start(&g_s3, BUCKET);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_signatures_verified, setup, teardown),
        cmocka_unit_test_setup_teardown(test_mirror_multipart_retention_restore, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupt_local_uses_s3_copy, setup, teardown),
        cmocka_unit_test_setup_teardown(test_server_killed_mid_upload, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_bucket_and_secrets, setup, teardown),
    };
    int r = cmocka_run_group_tests(tests, NULL, NULL);
    if (g_have_s3) s3_fixture_destroy(&g_s3);
    free(g_big);
    if (r == 0 && !g_have_s3) {
        fprintf(stderr, "S3 test server unavailable: reported as skipped\n");
        return 77;
    }
    return r;
}
