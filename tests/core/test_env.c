/* The environment table's getters (src/core/env.c) and the keep-the-first-error forms of
 * core/error.h: each type's parser, a bad value falling back, and the first failure kept. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/env.h"
#include "core/error.h"

static void test_positive(void **state)
{
    (void)state;
    unsetenv("MOE_INIT_THREADS");
    assert_int_equal(moe_env_positive(MOE_ENV_INIT_THREADS, 7, NULL), 7);
    setenv("MOE_INIT_THREADS", "12", 1);
    assert_int_equal(moe_env_positive(MOE_ENV_INIT_THREADS, 7, NULL), 12);
    const char *bad[] = {"0", "-3", "12x", "99999999999999999999999", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("MOE_INIT_THREADS", bad[i], 1);
        assert_int_equal(moe_env_positive(MOE_ENV_INIT_THREADS, 7, NULL), 7);
    }
    unsetenv("MOE_INIT_THREADS");
}

static void test_positive_checked(void **state)
{
    (void)state;
    size_t ttl = 5000;
    unsetenv("MOE_ELASTIC_TTL_MS");
    assert_int_equal(moe_env_positive_checked(MOE_ENV_ELASTIC_TTL_MS, 100000, &ttl, NULL),
                     MOE_STATUS_SUCCESS);
    assert_int_equal(ttl, 5000);
    setenv("MOE_ELASTIC_TTL_MS", "2000", 1);
    assert_int_equal(moe_env_positive_checked(MOE_ENV_ELASTIC_TTL_MS, 100000, &ttl, NULL),
                     MOE_STATUS_SUCCESS);
    assert_int_equal(ttl, 2000);
    const char *bad[] = {"soon", "0", "100001"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("MOE_ELASTIC_TTL_MS", bad[i], 1);
        assert_int_equal(moe_env_positive_checked(MOE_ENV_ELASTIC_TTL_MS, 100000, &ttl, NULL),
                         MOE_STATUS_INVALID_ARGUMENT);
        assert_non_null(strstr(moe_last_error(), "MOE_ELASTIC_TTL_MS"));
        assert_int_equal(ttl, 2000);
    }
    unsetenv("MOE_ELASTIC_TTL_MS");
}

static void test_flag_int_string(void **state)
{
    (void)state;
    setenv("MOE_CKPT_NO_URING", "1", 1);
    assert_true(moe_env_flag(MOE_ENV_CKPT_NO_URING, false, NULL));
    setenv("MOE_CKPT_NO_URING", "0", 1);
    assert_false(moe_env_flag(MOE_ENV_CKPT_NO_URING, true, NULL));
    setenv("MOE_CKPT_NO_URING", "yes", 1);
    assert_true(moe_env_flag(MOE_ENV_CKPT_NO_URING, true, NULL));
    unsetenv("MOE_CKPT_NO_URING");
    setenv("SLURM_LOCALID", "-2", 1);
    assert_int_equal(moe_env_int(MOE_ENV_SLURM_LOCALID, 5, NULL), -2);
    setenv("SLURM_LOCALID", "two", 1);
    assert_int_equal(moe_env_int(MOE_ENV_SLURM_LOCALID, 5, NULL), 5);
    unsetenv("SLURM_LOCALID");
    setenv("MOE_ELASTIC_PREFIX", "", 1);
    assert_null(moe_env_string(MOE_ENV_ELASTIC_PREFIX, NULL));
    setenv("MOE_ELASTIC_PREFIX", "/job", 1);
    assert_string_equal(moe_env_string(MOE_ENV_ELASTIC_PREFIX, NULL), "/job");
    unsetenv("MOE_ELASTIC_PREFIX");
    /* a getter of the wrong type reads nothing */
    setenv("MOE_INIT_THREADS", "3", 1);
    assert_false(moe_env_flag(MOE_ENV_INIT_THREADS, false, NULL));
    unsetenv("MOE_INIT_THREADS");
}

static void test_choice(void **state)
{
    (void)state;
    const char *words[] = {"auto", "loop", "streams", "batched", "grouped", "hopper"};
    for (int i = 0; i < 6; i++) {
        setenv("MOE_CUDA_EXPERT_GEMM", words[i], 1);
        assert_int_equal(moe_env_choice(MOE_ENV_CUDA_EXPERT_GEMM, -1, NULL), i);
    }
    const char *bad[] = {"hop", "hopperx", "auto|loop", "HOPPER"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("MOE_CUDA_EXPERT_GEMM", bad[i], 1);
        assert_int_equal(moe_env_choice(MOE_ENV_CUDA_EXPERT_GEMM, -1, NULL), -1);
    }
    unsetenv("MOE_CUDA_EXPERT_GEMM");
}

static int fails_with(int rc) { return rc; }
static const char *describe(int rc) { return rc == 1 ? "one" : "two"; }

static moe_status_t teardown_two_failures(void)
{
    moe_status_t st = MOE_STATUS_SUCCESS;
    MOE_CHECK_GEN_KEEP(st, int, fails_with(0), rc_ == 0, MOE_STATUS_INTERNAL, describe);
    MOE_CHECK_GEN_KEEP(st, int, fails_with(1), rc_ == 0, MOE_STATUS_BACKEND_ERROR, describe);
    MOE_CHECK_GEN_KEEP(st, int, fails_with(2), rc_ == 0, MOE_STATUS_INTERNAL, describe);
    MOE_TRY_KEEP(st, MOE_STATUS_COMM_ERROR);
    return st;
}

static void test_keep_first_error(void **state)
{
    (void)state;
    moe_error_clear();
    assert_int_equal(teardown_two_failures(), MOE_STATUS_BACKEND_ERROR);
    assert_non_null(strstr(moe_last_error(), "fails_with(1) failed: one"));
    assert_null(strstr(moe_last_error(), "two"));
    moe_status_t st = MOE_STATUS_SUCCESS;
    MOE_TRY_KEEP(st, MOE_STATUS_SUCCESS);
    MOE_TRY_KEEP(st, MOE_STATUS_TIMEOUT);
    MOE_TRY_KEEP(st, MOE_STATUS_INTERNAL);
    assert_int_equal(st, MOE_STATUS_TIMEOUT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_positive),         cmocka_unit_test(test_positive_checked),
        cmocka_unit_test(test_flag_int_string),  cmocka_unit_test(test_choice),
        cmocka_unit_test(test_keep_first_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
