/*
 * Communicators on GPU buffers (exit 77 without a GPU).
 *   MPI staged through pinned memory with the real CUDA backend, any number of ranks sharing
 *   the GPU: allreduce (f32, bf16), broadcast, alltoallv with gaps, send/recv, split.
 *   NCCL (only when every rank has its own GPU, e.g. 1 rank on a 1-GPU machine): the same
 *   operations, split, barrier.
 * Values as in test_comm_ops.c: rank r contributes (r+1)*(i+1); alltoallv rank r sends
 * (r + 2p) % 3 elements 1000r + 10p + j to rank p.
 */
#include <stdio.h>
#include <string.h>

#include <mpi.h>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/bf16.h"
#include "test_support.h"

static int P, R, failures;
static moe_backend_t be;

static void *dev(size_t bytes)
{
    void *p = NULL;
    TEST_OK(be.ops->alloc(be.ctx, bytes ? bytes : 4, &p));
    return p;
}
static void up(void *d, const void *h, size_t b) { TEST_OK(be.ops->copy(be.ctx, d, h, b)); }
static void down(void *h, const void *d, size_t b) { TEST_OK(be.ops->copy(be.ctx, h, d, b)); }

static void run_ops(moe_comm_t *c)
{
    const char *kind = c->ops->name;
    int n = c->size, me = c->rank;
    enum { N = 33 };
    /* allreduce f32, out of place and in place, non-blocking */
    float h[N], o[N];
    for (int i = 0; i < N; i++) h[i] = (float)((me + 1) * (i + 1));
    float *d = dev(sizeof h), *d2 = dev(sizeof h);
    up(d, h, sizeof h);
    moe_comm_req_t *q;
    TEST_OK(c->ops->allreduce(c, d, d2, N, MOE_COMM_F32, MOE_REDUCE_SUM, &q));
    TEST_OK(moe_comm_wait(c, q));
    TEST_OK(moe_comm_allreduce(c, d, d, N, MOE_COMM_F32, MOE_REDUCE_MAX));
    down(o, d2, sizeof o);
    for (int i = 0; i < N; i++)
        RANK_CHECK(o[i] == (float)((i + 1) * n * (n + 1) / 2), "%s allreduce sum [%d] %g", kind, i,
                   o[i]);
    down(o, d, sizeof o);
    for (int i = 0; i < N; i++)
        RANK_CHECK(o[i] == (float)((i + 1) * n), "%s allreduce max [%d]", kind, i);
    /* bf16 (exact small integers) */
    uint16_t hb[N], ob[N];
    for (int i = 0; i < N; i++) hb[i] = moe_f32_to_bf16((float)(me + 1));
    uint16_t *db = dev(sizeof hb);
    up(db, hb, sizeof hb);
    TEST_OK(moe_comm_allreduce(c, db, db, N, MOE_COMM_BF16, MOE_REDUCE_SUM));
    down(ob, db, sizeof ob);
    for (int i = 0; i < N; i++)
        RANK_CHECK(moe_bf16_to_f32(ob[i]) == (float)(n * (n + 1) / 2), "%s bf16 sum [%d]", kind, i);
    /* broadcast from the last rank */
    int32_t hi[N], oi[N];
    for (int i = 0; i < N; i++) hi[i] = me == n - 1 ? 100 * me + i : -1;
    int32_t *di = dev(sizeof hi);
    up(di, hi, sizeof hi);
    TEST_OK(moe_comm_broadcast(c, di, N, MOE_COMM_I32, n - 1));
    down(oi, di, sizeof oi);
    for (int i = 0; i < N; i++)
        RANK_CHECK(oi[i] == 100 * (n - 1) + i, "%s broadcast [%d]", kind, i);
    /* alltoallv with gaps in the receive buffer */
    size_t sc[16], sd[16], rc[16], rd[16], off = 0;
    float s[64], r[64];
    for (int p = 0; p < n; p++) {
        sc[p] = (size_t)((me + 2 * p) % 3);
        sd[p] = off;
        for (size_t j = 0; j < sc[p]; j++) s[off + j] = (float)(1000 * me + 10 * p + (int)j);
        off += sc[p];
    }
    off = 1;
    for (int p = n - 1; p >= 0; p--) {
        rc[p] = (size_t)((p + 2 * me) % 3);
        rd[p] = off;
        off += rc[p] + 1;
    }
    for (int i = 0; i < 64; i++) r[i] = -7;
    float *ds = dev(sizeof s), *dr = dev(sizeof r);
    up(ds, s, sizeof s);
    up(dr, r, sizeof r);
    TEST_OK(moe_comm_alltoallv(c, ds, sc, sd, dr, rc, rd, MOE_COMM_F32));
    down(r, dr, sizeof r);
    bool used[64] = {false};
    for (int p = 0; p < n; p++)
        for (size_t j = 0; j < rc[p]; j++) {
            RANK_CHECK(r[rd[p] + j] == (float)(1000 * p + 10 * me + (int)j), "%s alltoallv from %d",
                       kind, p);
            used[rd[p] + j] = true;
        }
    for (int i = 0; i < 64; i++)
        if (!used[i]) RANK_CHECK(r[i] == -7, "%s alltoallv gap %d overwritten", kind, i);
    /* send/recv ring */
    if (n > 1) {
        int64_t v[4] = {me, me + 1, me + 2, me + 3}, w[4];
        int64_t *dv = dev(sizeof v), *dw = dev(sizeof w);
        up(dv, v, sizeof v);
        moe_comm_req_t *qs, *qr;
        /* NCCL runs one communicator's operations in start order on its stream: if every rank
         * started its recv first, each recv would wait for a send queued behind the peer's
         * recv (seen on 2 H200s: TIMEOUT). Even ranks send first, odd ranks receive first. */
        if (me % 2 == 0) TEST_OK(c->ops->send(c, dv, 4, MOE_COMM_I64, (me + 1) % n, 2, &qs));
        TEST_OK(c->ops->recv(c, dw, 4, MOE_COMM_I64, (me + n - 1) % n, 2, &qr));
        if (me % 2 == 1) TEST_OK(c->ops->send(c, dv, 4, MOE_COMM_I64, (me + 1) % n, 2, &qs));
        TEST_OK(moe_comm_wait(c, qs));
        TEST_OK(moe_comm_wait(c, qr));
        down(w, dw, sizeof w);
        for (int i = 0; i < 4; i++)
            RANK_CHECK(w[i] == (me + n - 1) % n + i, "%s recv [%d]", kind, i);
        be.ops->free(be.ctx, dv);
        be.ops->free(be.ctx, dw);
    }
    /* split into halves; barrier */
    moe_comm_t *half = NULL;
    TEST_OK(moe_comm_split(c, me % 2, me, "half", &half));
    float one = 1, cnt = 0;
    float *d1 = dev(sizeof one);
    up(d1, &one, sizeof one);
    TEST_OK(moe_comm_allreduce(half, d1, d1, 1, MOE_COMM_F32, MOE_REDUCE_SUM));
    down(&cnt, d1, sizeof cnt);
    RANK_CHECK(cnt == (float)half->size && half->size == (n + (me % 2 ? 0 : 1)) / 2,
               "%s split size", kind);
    TEST_OK(moe_comm_barrier(half));
    TEST_OK(moe_comm_barrier(c));
    moe_comm_destroy(half);
    void *ptrs[] = {d, d2, db, di, ds, dr, d1};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) be.ops->free(be.ctx, ptrs[i]);
    fprintf(stderr, "rank %d: %s on device buffers (%d ranks): %d failures so far\n", R, kind, n,
            failures);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    int ngpu = moe_backend_cuda_device_count();
    if (ngpu <= 0) {
        if (R == 0) fprintf(stderr, "no GPU: skipped\n");
        MPI_Finalize();
        return 77;
    }
    moe_backend_params_t bp = {.device_index = R % ngpu, .deterministic = true};
    TEST_OK(moe_backend_cuda_create(&bp, &be));
    moe_comm_t *mpi = NULL, *host = NULL;
    TEST_OK(moe_comm_mpi_create(NULL, "staged", 30000, &be, NULL, &mpi));
    RANK_CHECK(mpi->device_buffers, "the MPI communicator should stage device buffers");
    run_ops(mpi);
    moe_comm_destroy(mpi);
    if (moe_comm_have_nccl() && P <= ngpu) {
        TEST_OK(moe_comm_mpi_create(NULL, "bootstrap", 30000, NULL, NULL, &host));
        moe_comm_t *nc = NULL;
        TEST_OK(moe_comm_nccl_create(host, "nccl-world", &nc));
        RANK_CHECK(strcmp(nc->members, P == 1 ? "world ranks 0" : nc->members) == 0, "members %s",
                   nc->members);
        run_ops(nc);
        moe_comm_abort(nc);
        float x = 0;
        RANK_CHECK(moe_comm_allreduce(nc, &x, &x, 1, MOE_COMM_F32, MOE_REDUCE_SUM) ==
                       MOE_STATUS_ABORTED,
                   "aborted NCCL communicator accepted work");
        moe_comm_destroy(nc);
        moe_comm_destroy(host);
    } else if (R == 0) {
        fprintf(stderr, "NCCL part skipped (%d ranks, %d GPUs, nccl built: %d)\n", P, ngpu,
                (int)moe_comm_have_nccl());
    }
    be.ops->destroy(be.ctx);
    MPI_Finalize();
    return failures ? 1 : 0;
}
