/*
 * The mesh without mpirun: a world of one needs no MPI, the rank-order parser, and the
 * rank <-> coordinate maps (exhaustive round trip over small meshes and all 24 orders,
 * against the written-out formula for the default order).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "runtime/runtime.h"
#include "test_support.h"

static void t_world_of_one(void **state)
{
    (void)state;
    moe_mesh_config_t mc = moe_mesh_config_default();
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    for (int with_mesh = 0; with_mesh < 2; with_mesh++) {
        rc.mesh = with_mesh ? &mc : NULL;
        moe_runtime_t *rt = NULL;
        assert_int_equal(moe_runtime_create(&rc, &rt), MOE_STATUS_SUCCESS);
        for (int a = 0; a <= MOE_AXIS_WORLD; a++) {
            int32_t rank = -1, size = -1;
            assert_int_equal(moe_runtime_axis(rt, (moe_axis_t)a, &rank, &size), MOE_STATUS_SUCCESS);
            assert_int_equal(rank, 0);
            assert_int_equal(size, 1);
        }
        for (int g = 0; g < MOE_MESH_GROUPS; g++) {
            assert_null(rt->mesh->comm[g]);
            assert_null(rt->mesh->host[g]);
        }
        assert_false(moe_comm_mpi_ready()); /* no MPI_Init for a world of one */
        assert_int_equal(moe_runtime_destroy(rt), MOE_STATUS_SUCCESS);
    }
    int32_t r, s;
    assert_int_equal(moe_runtime_axis(NULL, MOE_AXIS_TP, &r, &s), MOE_STATUS_INVALID_HANDLE);
    /* a bigger mesh without a launcher: the world (1 process) does not match */
    mc.ep = 2;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    moe_status_t st = moe_runtime_create(&rc, &rt);
    if (moe_comm_have_mpi()) {
        assert_int_equal(st, MOE_STATUS_INVALID_ARGUMENT);
        assert_non_null(strstr(moe_last_error(), "= 2 ranks, but the world communicator has 1"));
    } else {
        assert_int_equal(st, MOE_STATUS_UNSUPPORTED);
    }
    assert_null(rt);
}

static void t_parse_order(void **state)
{
    (void)state;
    int32_t o[4];
    assert_int_equal(moe_mesh_parse_order(NULL, o), MOE_STATUS_SUCCESS);
    assert_int_equal(o[0], MOE_AXIS_TP);
    assert_int_equal(o[3], MOE_AXIS_PP);
    assert_int_equal(moe_mesh_parse_order("pp,ep-tp,dp", o), MOE_STATUS_SUCCESS);
    assert_int_equal(o[0], MOE_AXIS_PP);
    assert_int_equal(o[1], MOE_AXIS_EP);
    assert_int_equal(o[2], MOE_AXIS_TP);
    assert_int_equal(o[3], MOE_AXIS_DP);
    const char *bad[] = {"",
                         "tp",
                         "tp-ep-dp",
                         "tp-ep-dp-pp-",
                         "-tp-ep-dp-pp",
                         "tp-ep-ep-pp",
                         "TP-ep-dp-pp",
                         "tp-ep-dp-pp-tp",
                         "tp--ep-dp-pp",
                         "tp ep dp pp"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(moe_mesh_parse_order(bad[i], o), MOE_STATUS_INVALID_ARGUMENT);
        char want[64];
        snprintf(want, sizeof want, "rank_order \"%s\"", bad[i]);
        assert_non_null(strstr(moe_last_error(), want));
    }
}

static void t_rank_coords(void **state)
{
    (void)state;
    const int32_t sizes[][4] = {{2, 2, 2, 1}, {1, 4, 1, 1}, {2, 3, 1, 2}, {3, 1, 2, 2}};
    int perms = 0;
    for (size_t m = 0; m < sizeof sizes / sizeof sizes[0]; m++) {
        const int32_t *s = sizes[m];
        int W = s[0] * s[1] * s[2] * s[3];
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++)
                for (int c = 0; c < 4; c++)
                    for (int d = 0; d < 4; d++) {
                        if (a == b || a == c || a == d || b == c || b == d || c == d) continue;
                        int32_t order[4] = {a, b, c, d};
                        perms++;
                        bool seen[64] = {false};
                        for (int r = 0; r < W; r++) {
                            int32_t co[4];
                            moe_mesh_coords_of(s, order, r, co);
                            for (int x = 0; x < 4; x++) assert_true(co[x] >= 0 && co[x] < s[x]);
                            assert_int_equal(moe_mesh_rank_of(s, order, co), r);
                            int key = co[0] + s[0] * (co[1] + s[1] * (co[2] + s[2] * co[3]));
                            assert_false(seen[key]); /* a bijection */
                            seen[key] = true;
                            /* the fastest axis changes between consecutive ranks */
                            if (r + 1 < W && s[order[0]] > 1 && (r + 1) % s[order[0]]) {
                                int32_t co2[4];
                                moe_mesh_coords_of(s, order, r + 1, co2);
                                assert_int_equal(co2[order[0]], co[order[0]] + 1);
                            }
                            if (a == 0 && b == 1 && c == 2) /* default order, written out */
                                assert_int_equal(
                                    r, co[0] + s[0] * (co[1] + s[1] * (co[2] + s[2] * co[3])));
                        }
                    }
    }
    assert_int_equal(perms, 4 * 24);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_world_of_one),
        cmocka_unit_test(t_parse_order),
        cmocka_unit_test(t_rank_coords),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
