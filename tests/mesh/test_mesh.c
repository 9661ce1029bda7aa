/*
 * The distributed mesh under mpirun: for every mesh (tp, ep, dp, pp) whose product is the
 * world size, and for the default and a reversed rank order, a runtime gets the coordinates
 * and axis groups written out below independently of the library:
 *
 *   default order "tp-ep-dp-pp":  rank = tp + TP*(ep + EP*(dp + DP*pp))
 *   reversed "pp-dp-ep-tp":       rank = pp + PP*(dp + DP*(ep + EP*tp))
 *   group of axis a:  ranks whose coordinates equal this rank's on every axis but a,
 *                     rank inside the group = coordinate on a
 *   edp:   same members and ranks as dp;  dense: same tp and pp, rank = ep + EP*dp
 *
 * Membership is checked by an all-reduce over each group of (1 << world rank): the sum is
 * the member set, which must equal the expected set exactly. The world sizes in CTest are
 * 2, 4 and 8, covering (1,2,1,1) (2,1,1,1) | (1,4,1,1) (2,2,1,1) (1,2,2,1) (4,1,1,1)
 * (1,1,2,2) | (2,2,2,1) (1,2,2,2) (2,1,2,2) and others of those sizes.
 * Also: invalid meshes are rejected on every rank with messages naming the numbers.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>
#include <mpi.h>

#include "runtime/runtime.h"
#include "test_support.h"

static int W, R;

#define OK(call)                                                                                   \
    do {                                                                                           \
        moe_status_t s__ = (call);                                                                 \
        if (s__ != MOE_STATUS_SUCCESS) print_error("%s: %s\n", #call, moe_last_error());           \
        assert_int_equal(s__, MOE_STATUS_SUCCESS);                                                 \
    } while (0)

static moe_runtime_t *make(int tp, int ep, int dp, int pp, const char *order, moe_status_t *st)
{
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.tp = tp, mc.ep = ep, mc.dp = dp, mc.pp = pp;
    mc.rank_order = order;
    mc.timeout_ms = 20000;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    *st = moe_runtime_create(&rc, &rt);
    return rt;
}

/* Coordinates of world rank r, written out per order. */
static void expected_coords(int r, const int s[4], bool reversed, int c[4])
{
    if (!reversed) {
        c[0] = r % s[0];
        c[1] = r / s[0] % s[1];
        c[2] = r / (s[0] * s[1]) % s[2];
        c[3] = r / (s[0] * s[1] * s[2]);
    } else {
        c[3] = r % s[3];
        c[2] = r / s[3] % s[2];
        c[1] = r / (s[3] * s[2]) % s[1];
        c[0] = r / (s[3] * s[2] * s[1]);
    }
}

static void check_mesh(int tp, int ep, int dp, int pp, bool reversed)
{
    const int s[4] = {tp, ep, dp, pp};
    moe_status_t st;
    moe_runtime_t *rt = make(tp, ep, dp, pp, reversed ? "pp-dp-ep-tp" : NULL, &st);
    OK(st);
    int mine[4];
    expected_coords(R, s, reversed, mine);
    const moe_mesh_t *m = rt->mesh;
    for (int a = 0; a <= MOE_AXIS_WORLD; a++) {
        int32_t rank, size;
        OK(moe_runtime_axis(rt, (moe_axis_t)a, &rank, &size));
        int want_rank = a < 4 ? mine[a] : a == MOE_AXIS_EDP ? mine[2] : R;
        int want_size = a < 4 ? s[a] : a == MOE_AXIS_EDP ? dp : W;
        assert_int_equal(rank, want_rank);
        assert_int_equal(size, want_size);
    }
    /* groups: axes 0..3, edp (4), world (5), dense (6), stage (7; host only, which is also
     * comm[] on the host backend) */
    for (int g = 0; g < MOE_MESH_GROUPS; g++) {
        int64_t expect = 0;
        int want_rank = 0, count = 0;
        for (int r = 0; r < W; r++) {
            int c[4];
            expected_coords(r, s, reversed, c);
            bool same;
            if (g < 4) {
                same = true;
                for (int a = 0; a < 4; a++)
                    if (a != g && c[a] != mine[a]) same = false;
            } else if (g == MOE_AXIS_EDP) {
                same = c[0] == mine[0] && c[1] == mine[1] && c[3] == mine[3];
            } else if (g == MOE_AXIS_WORLD) {
                same = true;
            } else if (g == MOE_MESH_STAGE) {
                same = c[3] == mine[3];
            } else {
                same = c[0] == mine[0] && c[3] == mine[3];
            }
            if (same) {
                expect |= (int64_t)1 << r;
                count++;
            }
        }
        want_rank = g < 4                 ? mine[g]
                    : g == MOE_AXIS_EDP   ? mine[2]
                    : g == MOE_AXIS_WORLD ? R
                    : g == MOE_MESH_STAGE ? mine[0] + tp * (mine[1] + ep * mine[2])
                                          : mine[1] + ep * mine[2];
        for (int h = 0; h < 2; h++) {
            moe_comm_t *c = h ? m->host[g] : m->comm[g];
            if (count == 1) {
                assert_null(c);
                continue;
            }
            assert_non_null(c);
            assert_int_equal(c->size, count);
            assert_int_equal(c->rank, want_rank);
            int64_t bit = (int64_t)1 << R, got = 0;
            OK(moe_comm_allreduce(c, &bit, &got, 1, MOE_COMM_I64, MOE_REDUCE_SUM));
            if (got != expect)
                print_error("mesh (%d,%d,%d,%d)%s group %d: members %llx, expected %llx\n", tp, ep,
                            dp, pp, reversed ? " reversed" : "", g, (unsigned long long)got,
                            (unsigned long long)expect);
            assert_true(got == expect);
        }
    }
    OK(moe_runtime_destroy(rt));
}

static void t_all_meshes(void **state)
{
    (void)state;
    int tested = 0;
    for (int tp = 1; tp <= W; tp++)
        for (int ep = 1; ep <= W; ep++)
            for (int dp = 1; dp <= W; dp++)
                for (int pp = 1; pp <= W; pp++) {
                    if (tp * ep * dp * pp != W) continue;
                    check_mesh(tp, ep, dp, pp, false);
                    check_mesh(tp, ep, dp, pp, true);
                    tested++;
                }
    if (R == 0) fprintf(stderr, "world %d: %d meshes x 2 orders checked\n", W, tested);
    assert_true(tested >= 2);
}

static void expect_invalid(int tp, int ep, int dp, int pp, const char *order, int timeout_ms,
                           moe_status_t want, const char *needle)
{
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.tp = tp, mc.ep = ep, mc.dp = dp, mc.pp = pp;
    mc.rank_order = order;
    mc.timeout_ms = timeout_ms;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_runtime_t *rt = (moe_runtime_t *)0x1;
    moe_status_t st = moe_runtime_create(&rc, &rt);
    if (st != want || !strstr(moe_last_error(), needle))
        print_error("mesh (%d,%d,%d,%d) order %s: got %s \"%s\", expected %s with \"%s\"\n", tp, ep,
                    dp, pp, order ? order : "-", moe_status_string(st), moe_last_error(),
                    moe_status_string(want), needle);
    assert_int_equal(st, want);
    assert_non_null(strstr(moe_last_error(), needle));
    assert_null(rt);
}

static void t_invalid(void **state)
{
    (void)state;
    char msg[128];
    snprintf(msg, sizeof msg, "= %d ranks, but the world communicator has %d ranks", W + 1, W);
    expect_invalid(W + 1, 1, 1, 1, NULL, 1000, MOE_STATUS_INVALID_ARGUMENT, msg);
    snprintf(msg, sizeof msg, "tp=1 x ep=%d x dp=2 x pp=1 = %d ranks", W, 2 * W);
    expect_invalid(1, W, 2, 1, NULL, 1000, MOE_STATUS_INVALID_ARGUMENT, msg);
    expect_invalid(0, W, 1, 1, NULL, 1000, MOE_STATUS_INVALID_ARGUMENT, "tp=0");
    expect_invalid(1, W, -2, 1, NULL, 1000, MOE_STATUS_INVALID_ARGUMENT, "dp=-2");
    /* a product that would overflow 64 bits (65536^4 = 2^64) is too large, not a world of 0 */
    expect_invalid(65536, 65536, 65536, 65536, NULL, 1000, MOE_STATUS_INVALID_ARGUMENT,
                   "is too large");
    const char *bad[] = {"tp-ep-ep-pp",    "tp-ep-dp", "tp-ep-dp-pp-", "xx-ep-dp-pp",
                         "tp-ep-dp-pp-tp", "",         "tpep-dp-pp"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(msg, sizeof msg, "rank_order \"%s\"", bad[i]);
        expect_invalid(1, W, 1, 1, bad[i], 1000, MOE_STATUS_INVALID_ARGUMENT, msg);
    }
    expect_invalid(1, W, 1, 1, "pp,dp,ep,tp", 0, MOE_STATUS_INVALID_ARGUMENT, "timeout_ms is 0");
    /* NCCL on the host backend */
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.ep = W;
    mc.comm = MOE_COMM_NCCL;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    assert_int_equal(moe_runtime_create(&rc, &rt), MOE_STATUS_UNSUPPORTED);
    assert_non_null(strstr(moe_last_error(), "comm=NCCL needs the CUDA backend"));
    mc.comm = (moe_comm_backend_t)7;
    assert_int_equal(moe_runtime_create(&rc, &rt), MOE_STATUS_INVALID_ARGUMENT);
    mc.comm = MOE_COMM_MPI;
    mc.struct_size = 3;
    assert_int_equal(moe_runtime_create(&rc, &rt), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "struct_size"));
    /* the world is still usable: a valid mesh after all those */
    moe_status_t st;
    rt = make(1, W, 1, 1, "pp,dp,ep,tp", &st);
    OK(st);
    OK(moe_runtime_destroy(rt));
}

/* A caller-supplied MPI communicator as the world: the mesh lives on half of the ranks. A
 * rank left out of a split holds MPI_COMM_NULL, which is refused, not fatal to the job. */
static void t_sub_world(void **state)
{
    (void)state;
    if (W < 4) skip();
    MPI_Comm outside;
    MPI_Comm_split(MPI_COMM_WORLD, R == 0 ? 0 : MPI_UNDEFINED, R, &outside);
    if (R != 0) {
        moe_mesh_config_t mc = moe_mesh_config_default();
        mc.mpi_comm = &outside;
        moe_runtime_config_t rc = moe_runtime_config_default();
        rc.backend = MOE_BACKEND_HOST;
        rc.mesh = &mc;
        moe_runtime_t *rt = (moe_runtime_t *)0x1;
        assert_int_equal(moe_runtime_create(&rc, &rt), MOE_STATUS_INVALID_ARGUMENT);
        assert_non_null(strstr(moe_last_error(), "MPI_COMM_NULL"));
        assert_null(rt);
    } else {
        MPI_Comm_free(&outside);
    }
    MPI_Comm half;
    MPI_Comm_split(MPI_COMM_WORLD, R % 2, R, &half);
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.ep = W / 2;
    mc.mpi_comm = &half;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    OK(moe_runtime_create(&rc, &rt));
    int32_t rank, size;
    OK(moe_runtime_axis(rt, MOE_AXIS_EP, &rank, &size));
    assert_int_equal(size, W / 2);
    assert_int_equal(rank, R / 2);
    int64_t bit = (int64_t)1 << R, got = 0, want = 0;
    OK(moe_comm_allreduce(rt->mesh->comm[MOE_AXIS_EP], &bit, &got, 1, MOE_COMM_I64,
                          MOE_REDUCE_SUM));
    for (int r = R % 2; r < W; r += 2) want |= (int64_t)1 << r;
    assert_true(got == want);
    char members[96];
    int n = snprintf(members, sizeof members, "world ranks 0"); /* ranks in the given world */
    for (int r = 1; r < W / 2; r++)
        n += snprintf(members + n, sizeof members - (size_t)n, ",%d", r);
    assert_string_equal(rt->mesh->comm[MOE_AXIS_EP]->members, members);
    OK(moe_runtime_destroy(rt));
    MPI_Comm_free(&half);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &W);
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_all_meshes),
        cmocka_unit_test(t_invalid),
        cmocka_unit_test(t_sub_world),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    MPI_Finalize();
    return failed ? 1 : 0;
}
