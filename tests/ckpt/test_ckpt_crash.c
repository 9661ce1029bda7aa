/* Crash safety: a child process saves checkpoints in a loop (keep_last 3, so retention runs
 * too; some trials with several saves in flight, some with the S3 mirror on) and is killed
 * with SIGKILL after a random delay — during a snapshot, a write, a rename, a commit, a
 * retention sweep or an upload. Then, in the parent:
 *   - load_latest returns a step >= the last step the child saw committed (wait returned)
 *     and its contents are bitwise the pattern of that step (never a partial checkpoint);
 *   - every complete checkpoint listed locally loads bitwise;
 *   - with S3: every step listed on S3 loads bitwise from S3 alone (empty local directory).
 * 24 trials; MOE_TEST_SEED replays one run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt_common.h"
#include "s3_fixture.h"

#define TRIALS 24
#define BUCKET "crash-bucket"

static s3_fixture_t g_s3;
static bool g_have_s3;

static moe_ckpt_config_t cfg_for(const char *dir, bool s3)
{
    moe_ckpt_config_t c = ct_config(dir);
    c.keep_last = 3;
    if (s3) {
        s3_fixture_config(&c, g_s3.endpoint, BUCKET, "crash");
        c.s3_part_bytes = 5 << 20;
        c.s3_max_retries = 2;
        c.s3_retry_base_ms = 20;
    }
    return c;
}

static void child(const char *dir, int64_t first, bool s3, bool overlap, int fd)
{
    moe_runtime_t *rt = ct_runtime();
    moe_ckpt_config_t c = cfg_for(dir, s3);
    moe_ckpt_t *ck = NULL;
    if (moe_ckpt_create(rt, &c, &ck) != MOE_STATUS_SUCCESS) _exit(3);
    ct_state_t s;
    ct_init(&s);
    for (int64_t step = first;; step++) {
        if (moe_ckpt_fence(ck) != MOE_STATUS_SUCCESS) _exit(7); /* a save may still copy s */
        ct_fill(&s, step);
        if (moe_ckpt_save_async(ck, step, s.t, 3) != MOE_STATUS_SUCCESS) _exit(4);
        if (overlap && step % 3 != 0) continue; /* several saves in flight */
        if (moe_ckpt_wait(ck, 0, -1) != MOE_STATUS_SUCCESS) _exit(5);
        moe_ckpt_status_t st = {.struct_size = sizeof st};
        moe_ckpt_status(ck, &st);
        int64_t done = st.last_committed_step;
        if (write(fd, &done, sizeof done) != sizeof done) _exit(6);
    }
}

/* Every listed step loads bitwise. On S3 a step may instead be refused as CORRUPT: s3rver
 * writes an object in place while its body streams in, so a client killed mid-PUT of a
 * manifest leaves a truncated object under the final key (real S3 never stores an incomplete
 * PUT). The property that must hold everywhere: wrong data is never returned. Returns the
 * number of steps that loaded. */
static int check_all_listed(moe_ckpt_t *ck, ct_state_t *s, moe_ckpt_tier_t tier)
{
    int64_t steps[64];
    int32_t n = 0;
    int ok = 0;
    TEST_OK(moe_ckpt_list(ck, tier, steps, 64, &n));
    for (int32_t i = 0; i < n && i < 64; i++) {
        memset(s->a, 0, CT_A_N * 4);
        moe_status_t r = moe_ckpt_load_step(ck, steps[i], s->t, 3);
        if (r == MOE_STATUS_CORRUPT && tier == MOE_CKPT_TIER_S3) {
            print_message("  S3 step %lld refused: %s\n", (long long)steps[i], moe_last_error());
            continue;
        }
        TEST_OK(r);
        if (!ct_check(s, steps[i]))
            fail_msg("listed step %lld is not bitwise complete", (long long)steps[i]);
        ok++;
    }
    return ok;
}

static void test_kill9(void **st)
{
    (void)st;
    uint64_t seed = test_seed();
    test_rng_t rng = {seed};
    char dir[256];
    ct_tempdir(dir, sizeof dir, "crash");
    moe_runtime_t *rt = ct_runtime();
    ct_state_t s;
    ct_init(&s);
    int64_t prev_loaded = -1;
    int s3_loaded = 0;
    for (int trial = 0; trial < TRIALS; trial++) {
        bool s3 = g_have_s3 && trial % 2 == 1;
        bool overlap = trial % 3 == 2;
        int64_t first = (int64_t)trial * 1000;
        int p[2];
        assert_int_equal(pipe(p), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(p[0]);
            child(dir, first, s3, overlap, p[1]);
        }
        close(p[1]);
        /* random moment: 5..400 ms (child start-up, then a save every few ms) */
        long delay_us = 5000 + (long)test_rng_int(&rng, 0, 395000);
        struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        assert_true(WIFSIGNALED(status)); /* killed, not failed */
        int64_t committed = -1, v;
        while (read(p[0], &v, sizeof v) == sizeof v) committed = v;
        close(p[0]);

        moe_ckpt_config_t c = cfg_for(dir, s3);
        moe_ckpt_t *ck = NULL;
        TEST_OK(moe_ckpt_create(rt, &c, &ck));
        int64_t step = -1;
        moe_status_t r = moe_ckpt_load_latest(ck, s.t, 3, &step);
        print_message("trial %2d: killed after %5.1f ms, child saw %lld committed, loaded %lld%s\n",
                      trial, delay_us / 1000.0, (long long)committed, (long long)step,
                      s3 ? " (S3 on)" : "");
        if (committed >= 0) {
            TEST_OK(r);
            assert_true(step >= committed);
        }
        if (r == MOE_STATUS_SUCCESS) {
            assert_true(ct_check(&s, step));
            assert_true(step >= prev_loaded); /* never goes back past a complete one */
            prev_loaded = step;
        } else {
            assert_int_equal(r, MOE_STATUS_NOT_FOUND);
            assert_int_equal(prev_loaded, -1);
        }
        check_all_listed(ck, &s, MOE_CKPT_TIER_LOCAL);
        TEST_OK(moe_ckpt_destroy(ck));
        if (s3) { /* the remote tier alone: every listed step is complete */
            char empty[256];
            ct_tempdir(empty, sizeof empty, "crash-s3only");
            moe_ckpt_config_t c2 = cfg_for(empty, true);
            c2.keep_last = 0;
            TEST_OK(moe_ckpt_create(rt, &c2, &ck));
            int ok = check_all_listed(ck, &s, MOE_CKPT_TIER_S3);
            s3_loaded += ok;
            if (ok > 0) { /* the S3 tier alone restores a bitwise-complete step */
                int64_t rstep = -1;
                TEST_OK(moe_ckpt_load_latest(ck, s.t, 3, &rstep));
                assert_true(ct_check(&s, rstep));
            }
            TEST_OK(moe_ckpt_destroy(ck));
            ct_rmrf(empty);
        }
    }
    print_message("%d S3 steps restored bitwise from the remote tier alone\n", s3_loaded);
    if (g_have_s3) assert_true(s3_loaded > 0);
    ct_free(&s);
    moe_runtime_destroy(rt);
    ct_rmrf(dir);
}

int main(void)
{
    g_have_s3 = s3_fixture_start(&g_s3, BUCKET);
    if (!g_have_s3)
        fprintf(stderr, "S3 test server unavailable: crash trials run without the mirror\n");
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_kill9)};
    int r = cmocka_run_group_tests(tests, NULL, NULL);
    if (g_have_s3) s3_fixture_destroy(&g_s3);
    return r;
}
