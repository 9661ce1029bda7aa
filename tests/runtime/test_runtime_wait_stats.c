/*
 * moe_runtime_wait_stats: the time a rank spends blocked waiting in libmoe's communication.
 * 2 ranks (dp=2, host backend): after a barrier, rank 1 sleeps 300 ms before an all-reduce
 * that rank 0 enters at once, so rank 0's wait grows by about 300 ms and rank 1's by almost
 * nothing, and each counts one wait: the split that tells the slow rank in lock-step training
 * (docs/elastic.md, "Stragglers"). The bounds leave room for a loaded machine: rank 0 at least
 * 200 ms, rank 1 under 150 ms (with MOE_TEST_NO_TIMING, CI's sanitizer pass: rank 0 at least
 * 20 ms, so a clock that never counted still fails).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include <cmocka.h>

#include <moe/moe.h>

#include "runtime/runtime.h"

#define OK(call) assert_int_equal((call), MOE_STATUS_SUCCESS)

static moe_runtime_wait_stats_t stats_of(moe_runtime_t *rt)
{
    moe_runtime_wait_stats_t s = {.struct_size = sizeof s};
    OK(moe_runtime_wait_stats(rt, &s));
    return s;
}

static void test_the_late_rank_does_not_wait(void **state)
{
    (void)state;
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.dp = 2;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    OK(moe_runtime_create(&rc, &rt));
    int32_t rank, size;
    OK(moe_runtime_axis(rt, MOE_AXIS_WORLD, &rank, &size));
    assert_int_equal(size, 2);
    moe_comm_t *world = rt->mesh->host[MOE_AXIS_WORLD];
    OK(moe_comm_barrier(world));
    moe_runtime_wait_stats_t before = stats_of(rt);
    if (rank == 1) {
        struct timespec ts = {0, 300 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    int32_t v = rank, sum = 0;
    OK(moe_comm_allreduce_copy(world, &v, &sum, 1, MOE_COMM_I32, MOE_REDUCE_SUM));
    assert_int_equal(sum, 1);
    moe_runtime_wait_stats_t after = stats_of(rt);
    double waited = after.wait_seconds - before.wait_seconds;
    assert_int_equal(after.waits - before.waits, 1);
    /* under the sanitizers' parallel pass (MOE_TEST_NO_TIMING) only the order is checked */
    bool timing = getenv("MOE_TEST_NO_TIMING") == NULL;
    double least = timing ? 0.200 : 0.020, most = timing ? 0.150 : 10.0;
    if (rank == 0 && waited < least) fail_msg("rank 0 waited %.3f s for the late rank", waited);
    if (rank == 1 && waited > most) fail_msg("the late rank 1 waited %.3f s", waited);
    /* the arguments (one runtime per process: libmoe finalises MPI with the last one) */
    moe_runtime_wait_stats_t s = {.struct_size = sizeof s};
    assert_int_equal(moe_runtime_wait_stats(NULL, &s), MOE_STATUS_INVALID_HANDLE);
    assert_int_equal(moe_runtime_wait_stats(rt, NULL), MOE_STATUS_INVALID_ARGUMENT);
    s.struct_size = sizeof(size_t);
    assert_int_equal(moe_runtime_wait_stats(rt, &s), MOE_STATUS_INVALID_ARGUMENT);
    OK(moe_runtime_destroy(rt));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_the_late_rank_does_not_wait),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
