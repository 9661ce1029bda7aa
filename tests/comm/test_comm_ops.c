/*
 * Every communicator operation, blocking and non-blocking, with exact expected values.
 * Run under mpirun with P ranks (3 and 4 in CTest). Each test runs twice: on host buffers,
 * and on "device" buffers, i.e. a communicator whose backend claims device memory so every
 * buffer is staged through the (host backend's) pinned blocks and copied back; that pins the
 * staging path without a GPU.
 *
 * Topologies (P ranks, rank r):
 *   allreduce   element i of rank r is (r+1)*(i+1) (+ i for bf16's exact range):
 *               sum = (i+1)*P(P+1)/2, max = (i+1)*P, min = i+1
 *   broadcast   root b sends 100*b + i; every root in turn
 *   alltoallv   rank r sends (r + 2p) % 3 elements to rank p, element j = 1000r + 10p + j,
 *               into a receive buffer with one-element gaps holding a sentinel
 *   send/recv   ring: r sends 7r + i to r+1 on tag 5 and 9r + i on tag 6 (received in the
 *               other order)
 *   split       color r % 2, key -r: the new rank is the position in descending r
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>
#include <mpi.h>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/bf16.h"
#include "test_support.h"

static int P, R;
static moe_backend_t host_be, staged_be;
static moe_backend_ops_t staged_ops;
static moe_comm_t *comms[2]; /* [0] host buffers, [1] staged "device" buffers */

#define OK(call) assert_int_equal((call), MOE_STATUS_SUCCESS)

static int setup(void **state)
{
    (void)state;
    moe_backend_params_t p = {0};
    if (moe_backend_host_create(&p, &host_be) != MOE_STATUS_SUCCESS) return -1;
    staged_ops = *host_be.ops;
    staged_ops.device = MOE_DEVICE_CUDA; /* pretend: forces staging through pinned blocks */
    staged_be = (moe_backend_t){&staged_ops, host_be.ctx};
    if (moe_comm_mpi_create(NULL, "test", 20000, NULL, NULL, &comms[0])) return -1;
    if (moe_comm_mpi_create(NULL, "staged", 20000, &staged_be, NULL, &comms[1])) return -1;
    if (!comms[1]->device_buffers || comms[0]->device_buffers) return -1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    moe_comm_destroy(comms[0]);
    moe_comm_destroy(comms[1]);
    host_be.ops->destroy(host_be.ctx);
    return 0;
}

static void t_basics(void **state)
{
    (void)state;
    for (int v = 0; v < 2; v++) {
        assert_int_equal(comms[v]->rank, R);
        assert_int_equal(comms[v]->size, P);
        char want[96];
        int n = snprintf(want, sizeof want, "world ranks 0");
        for (int i = 1; i < P; i++) n += snprintf(want + n, sizeof want - (size_t)n, ",%d", i);
        assert_string_equal(comms[v]->members, want);
    }
}

/* ---- allreduce ------------------------------------------------------------------------------ */

static void allreduce_case(moe_comm_t *c, moe_comm_dtype_t dt, moe_reduce_op_t op, bool in_place,
                           bool nonblocking)
{
    enum { N = 37 };
    double in[N], out[N], want[N];
    for (int i = 0; i < N; i++) {
        in[i] = (double)(R + 1) * (i + 1);
        double s = (double)(i + 1);
        want[i] = op == MOE_REDUCE_SUM ? s * P * (P + 1) / 2 : op == MOE_REDUCE_MAX ? s * P : s;
    }
    char sbuf[N * 8], rbuf[N * 8];
    for (int i = 0; i < N; i++) {
        switch (dt) {
        case MOE_COMM_F32: ((float *)sbuf)[i] = (float)in[i]; break;
        case MOE_COMM_F64: ((double *)sbuf)[i] = in[i]; break;
        case MOE_COMM_I32: ((int32_t *)sbuf)[i] = (int32_t)in[i]; break;
        case MOE_COMM_I64: ((int64_t *)sbuf)[i] = (int64_t)in[i] << 33; break;
        case MOE_COMM_BF16: ((uint16_t *)sbuf)[i] = moe_f32_to_bf16((float)in[i]); break;
        default: fail();
        }
    }
    memset(rbuf, 0xab, sizeof rbuf);
    void *recv = in_place ? sbuf : rbuf;
    if (nonblocking) {
        moe_comm_req_t *req = NULL;
        OK(c->ops->allreduce(c, sbuf, recv, N, dt, op, &req));
        bool done = false;
        while (!done) OK(moe_comm_test(c, req, &done));
    } else {
        OK(moe_comm_allreduce(c, sbuf, recv, N, dt, op));
    }
    for (int i = 0; i < N; i++) {
        switch (dt) {
        case MOE_COMM_F32: out[i] = ((float *)recv)[i]; break;
        case MOE_COMM_F64: out[i] = ((double *)recv)[i]; break;
        case MOE_COMM_I32: out[i] = ((int32_t *)recv)[i]; break;
        case MOE_COMM_I64: out[i] = (double)(((int64_t *)recv)[i] >> 33); break;
        case MOE_COMM_BF16: out[i] = moe_bf16_to_f32(((uint16_t *)recv)[i]); break;
        default: fail();
        }
        double w = want[i];
        if (dt == MOE_COMM_BF16) { /* bf16 sum: each partial sum is rounded; compare loosely */
            if (op != MOE_REDUCE_SUM) w = moe_bf16_to_f32(moe_f32_to_bf16((float)w));
            if (out[i] < w * (1 - 1.0 / 64) || out[i] > w * (1 + 1.0 / 64)) {
                print_error("bf16 op %d elem %d: got %g want %g\n", (int)op, i, out[i], w);
                fail();
            }
        } else if (out[i] != w) {
            print_error("dtype %d op %d elem %d: got %.17g want %.17g\n", (int)dt, (int)op, i,
                        out[i], w);
            fail();
        }
    }
}

static void t_allreduce(void **state)
{
    (void)state;
    moe_comm_dtype_t dts[] = {MOE_COMM_F32, MOE_COMM_F64, MOE_COMM_I32, MOE_COMM_I64,
                              MOE_COMM_BF16};
    for (int v = 0; v < 2; v++)
        for (size_t d = 0; d < 5; d++)
            for (int op = 0; op < 3; op++)
                for (int ip = 0; ip < 2; ip++)
                    for (int nb = 0; nb < 2; nb++)
                        allreduce_case(comms[v], dts[d], (moe_reduce_op_t)op, ip, nb);
}

/* Several operations in flight at once, completed in reverse order of their start. */
static void t_allreduce_many_in_flight(void **state)
{
    (void)state;
    enum { K = 4, N = 1000 };
    for (int v = 0; v < 2; v++) {
        moe_comm_t *c = comms[v];
        static float buf[K][N];
        moe_comm_req_t *req[K];
        for (int k = 0; k < K; k++) {
            for (int i = 0; i < N; i++) buf[k][i] = (float)(R * (k + 1) + i);
            OK(c->ops->allreduce(c, buf[k], buf[k], N, MOE_COMM_F32, MOE_REDUCE_SUM, &req[k]));
        }
        for (int k = K - 1; k >= 0; k--) OK(moe_comm_wait(c, req[k]));
        for (int k = 0; k < K; k++)
            for (int i = 0; i < N; i++)
                assert_true(buf[k][i] == (float)((k + 1) * P * (P - 1) / 2 + P * i));
    }
}

/* ---- broadcast ------------------------------------------------------------------------------ */

static void t_broadcast(void **state)
{
    (void)state;
    enum { N = 19 };
    for (int v = 0; v < 2; v++)
        for (int root = 0; root < P; root++)
            for (int nb = 0; nb < 2; nb++) {
                int32_t buf[N];
                for (int i = 0; i < N; i++) buf[i] = R == root ? 100 * root + i : -1;
                if (nb) {
                    moe_comm_req_t *req;
                    OK(comms[v]->ops->broadcast(comms[v], buf, N, MOE_COMM_I32, root, &req));
                    OK(moe_comm_wait(comms[v], req));
                } else {
                    OK(moe_comm_broadcast(comms[v], buf, N, MOE_COMM_I32, root));
                }
                for (int i = 0; i < N; i++) assert_int_equal(buf[i], 100 * root + i);
            }
}

/* ---- alltoallv ------------------------------------------------------------------------------ */

#define SENTINEL -7.0f

static size_t a2a_count(int from, int to) { return (size_t)((from + 2 * to) % 3); }

typedef struct a2a_bufs {
    size_t sc[16], sd[16], rc[16], rd[16];
    float send[64], recv[64];
} a2a_bufs_t;

static void a2a_prepare(a2a_bufs_t *b, int salt)
{
    size_t off = 0;
    for (int p = 0; p < P; p++) {
        b->sc[p] = a2a_count(R, p);
        b->sd[p] = off;
        for (size_t j = 0; j < b->sc[p]; j++)
            b->send[off + j] = (float)(1000 * R + 10 * p + (int)j + salt);
        off += b->sc[p];
    }
    off = 1; /* receive blocks in reverse peer order, one-element gaps */
    for (int p = P - 1; p >= 0; p--) {
        b->rc[p] = a2a_count(p, R);
        b->rd[p] = off;
        off += b->rc[p] + 1;
    }
    for (int i = 0; i < 64; i++) b->recv[i] = SENTINEL;
}

static void a2a_check(const a2a_bufs_t *b, int salt)
{
    bool used[64] = {false};
    for (int p = 0; p < P; p++)
        for (size_t j = 0; j < b->rc[p]; j++) {
            assert_true(b->recv[b->rd[p] + j] == (float)(1000 * p + 10 * R + (int)j + salt));
            used[b->rd[p] + j] = true;
        }
    for (int i = 0; i < 64; i++)
        if (!used[i]) assert_true(b->recv[i] == SENTINEL); /* gaps untouched */
}

static void t_alltoallv(void **state)
{
    (void)state;
    for (int v = 0; v < 2; v++) {
        a2a_bufs_t b;
        a2a_prepare(&b, 0);
        OK(moe_comm_alltoallv(comms[v], b.send, b.sc, b.sd, b.recv, b.rc, b.rd, MOE_COMM_F32));
        a2a_check(&b, 0);
    }
}

/* The dispatch pattern: several chunks' all-to-alls in flight, completed out of order. */
static void t_alltoallv_chunks_in_flight(void **state)
{
    (void)state;
    enum { CH = 3 };
    for (int v = 0; v < 2; v++) {
        static a2a_bufs_t b[CH];
        moe_comm_req_t *req[CH];
        for (int k = 0; k < CH; k++) {
            a2a_prepare(&b[k], 100000 * k);
            OK(comms[v]->ops->alltoallv(comms[v], b[k].send, b[k].sc, b[k].sd, b[k].recv, b[k].rc,
                                        b[k].rd, MOE_COMM_F32, &req[k]));
        }
        bool done[CH] = {false};
        int left = CH;
        while (left) /* poll in reverse */
            for (int k = CH - 1; k >= 0; k--)
                if (!done[k]) {
                    OK(moe_comm_test(comms[v], req[k], &done[k]));
                    if (done[k]) left--;
                }
        for (int k = 0; k < CH; k++) a2a_check(&b[k], 100000 * k);
    }
}

/* Counts that disagree are reported, not truncated silently. Rank 0 sends 1 element to rank 1,
 * which expects 2; everything else is empty. */
static void t_alltoallv_count_mismatch(void **state)
{
    (void)state;
    moe_comm_t *c;
    OK(moe_comm_split(comms[0], 0, R, "mismatch", &c));
    size_t sc[16] = {0}, sd[16] = {0}, rc[16] = {0}, rd[16] = {0};
    float s[2] = {1, 2}, r[2] = {0, 0};
    if (R == 0) sc[1] = 1;
    if (R == 1) rc[0] = 2;
    moe_status_t st = moe_comm_alltoallv(c, s, sc, sd, r, rc, rd, MOE_COMM_F32);
    if (R == 1) {
        assert_int_equal(st, MOE_STATUS_COMM_ERROR);
        assert_non_null(strstr(moe_last_error(), "expected 8 bytes from world rank 0 and got 4"));
    } else {
        OK(st);
    }
    OK(moe_comm_barrier(c));
    moe_comm_destroy(c);
}

/* ---- send / recv ---------------------------------------------------------------------------- */

static void t_send_recv(void **state)
{
    (void)state;
    enum { N = 11 };
    for (int v = 0; v < 2; v++) {
        moe_comm_t *c = comms[v];
        int next = (R + 1) % P, prev = (R + P - 1) % P;
        int64_t a[N], b[N], ra[N], rb[N];
        for (int i = 0; i < N; i++) {
            a[i] = 7 * R + i;
            b[i] = 9 * R + i;
        }
        moe_comm_req_t *q[4];
        OK(c->ops->recv(c, rb, N, MOE_COMM_I64, prev, 6, &q[0])); /* tag 6 posted first */
        OK(c->ops->recv(c, ra, N, MOE_COMM_I64, prev, 5, &q[1]));
        OK(c->ops->send(c, a, N, MOE_COMM_I64, next, 5, &q[2]));
        OK(c->ops->send(c, b, N, MOE_COMM_I64, next, 6, &q[3]));
        for (int k = 3; k >= 0; k--) OK(moe_comm_wait(c, q[k]));
        for (int i = 0; i < N; i++) {
            assert_int_equal(ra[i], 7 * prev + i);
            assert_int_equal(rb[i], 9 * prev + i);
        }
        /* blocking: even ranks send first, odd ranks receive first (P even or odd: rank P-1
         * and 0 are both handled by the ring order below) */
        float x = (float)R + 0.5f, y = -1;
        if (R % 2 == 0) {
            OK(moe_comm_send(c, &x, 1, MOE_COMM_F32, next, 1));
            OK(moe_comm_recv(c, &y, 1, MOE_COMM_F32, prev, 1));
        } else {
            OK(moe_comm_recv(c, &y, 1, MOE_COMM_F32, prev, 1));
            OK(moe_comm_send(c, &x, 1, MOE_COMM_F32, next, 1));
        }
        assert_true(y == (float)prev + 0.5f);
    }
}

static void t_bad_arguments(void **state)
{
    (void)state;
    moe_comm_t *c = comms[0];
    moe_comm_req_t *q = NULL;
    float x = 0;
    assert_int_equal(c->ops->send(c, &x, 1, MOE_COMM_F32, P, 0, &q), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "peer"));
    assert_int_equal(c->ops->send(c, &x, 1, MOE_COMM_F32, R, 0, &q), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(c->ops->recv(c, &x, 1, MOE_COMM_F32, (R + 1) % P, MOE_COMM_MAX_TAG, &q),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "tag"));
    assert_int_equal(c->ops->broadcast(c, &x, 1, MOE_COMM_F32, -1, &q),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(c->ops->allreduce(c, &x, &x, 1, (moe_comm_dtype_t)99, MOE_REDUCE_SUM, &q),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_comm_wait(c, (moe_comm_req_t *)&x), MOE_STATUS_INVALID_ARGUMENT);
    /* the communicator is still fine */
    OK(moe_comm_barrier(c));
}

/* ---- split / barrier / abort ------------------------------------------------------------------ */

static void t_split(void **state)
{
    (void)state;
    for (int v = 0; v < 2; v++) {
        moe_comm_t *s = NULL;
        OK(moe_comm_split(comms[v], R % 2, -R, "half", &s));
        int members = 0, pos = 0;
        for (int r = P - 1; r >= 0; r--)
            if (r % 2 == R % 2) {
                if (r == R) pos = members;
                members++;
            }
        assert_int_equal(s->size, members);
        assert_int_equal(s->rank, pos);
        assert_string_equal(s->name, "half");
        assert_int_equal(s->device_buffers, comms[v]->device_buffers);
        char want[96];
        int n = snprintf(want, sizeof want, members == 1 ? "world rank " : "world ranks ");
        for (int r = P - 1, first = 1; r >= 0; r--)
            if (r % 2 == R % 2) {
                n += snprintf(want + n, sizeof want - (size_t)n, "%s%d", first ? "" : ",", r);
                first = 0;
            }
        assert_string_equal(s->members, want);
        int64_t bits = (int64_t)1 << R, all = 0;
        OK(moe_comm_allreduce(s, &bits, &all, 1, MOE_COMM_I64, MOE_REDUCE_SUM));
        int64_t expect = 0;
        for (int r = 0; r < P; r++)
            if (r % 2 == R % 2) expect |= (int64_t)1 << r;
        assert_int_equal(all, expect);
        /* split of a split: singletons */
        moe_comm_t *one = NULL;
        OK(moe_comm_split(s, s->rank, 0, "one", &one));
        assert_int_equal(one->size, 1);
        float z = 3, zz = 0;
        OK(moe_comm_allreduce(one, &z, &zz, 1, MOE_COMM_F32, MOE_REDUCE_SUM));
        assert_true(zz == 3);
        moe_comm_destroy(one);
        moe_comm_destroy(s);
    }
}

static void t_barrier_and_abort(void **state)
{
    (void)state;
    OK(moe_comm_barrier(comms[0]));
    OK(moe_comm_barrier(comms[1]));
    /* an aborted communicator refuses work (locally; each rank aborts its own) */
    moe_comm_t *c;
    OK(moe_comm_split(comms[0], 0, R, "victim", &c));
    moe_comm_abort(c);
    float x = 1;
    assert_int_equal(moe_comm_allreduce(c, &x, &x, 1, MOE_COMM_F32, MOE_REDUCE_SUM),
                     MOE_STATUS_ABORTED);
    assert_non_null(strstr(moe_last_error(), "victim"));
    assert_non_null(strstr(moe_last_error(), "abort"));
    moe_comm_destroy(c);
    moe_comm_abort(NULL);
    moe_comm_destroy(NULL);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    if (P < 2 || P > 16) {
        fprintf(stderr, "run with 2..16 ranks\n");
        MPI_Finalize();
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_basics),
        cmocka_unit_test(t_allreduce),
        cmocka_unit_test(t_allreduce_many_in_flight),
        cmocka_unit_test(t_broadcast),
        cmocka_unit_test(t_alltoallv),
        cmocka_unit_test(t_alltoallv_chunks_in_flight),
        cmocka_unit_test(t_alltoallv_count_mismatch),
        cmocka_unit_test(t_send_recv),
        cmocka_unit_test(t_bad_arguments),
        cmocka_unit_test(t_split),
        cmocka_unit_test(t_barrier_and_abort),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    MPI_Finalize();
    return failed ? 1 : 0;
}
