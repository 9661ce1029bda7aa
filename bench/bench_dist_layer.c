/*
 * How much of the EP all-to-all time the chunked schedule hides, and how the layer's
 * all-to-all bandwidth compares with a plain all-to-all of the same size.
 *
 * mpirun -np P bench_dist_layer [N H F E K iters]: a (1,P,1,1) mesh, N tokens per rank,
 * forward + backward of one layer, for a2a_chunks = 1, 2, 4. Shape legend: N tokens per rank,
 * H hidden, F expert FFN width, E experts, K top-k.
 * MOE_BENCH_BACKEND=cuda: the CUDA backend (bf16 device activations, the mesh's communicators:
 * NCCL when every rank has its own GPU); exit 77 on every rank without a GPU. Default: host.
 *
 * JSON line "dist_layer" per chunk count (rank 0; median over iters of the max over ranks):
 *   step_ms      wall time of forward + backward (device synchronised at the end)
 *   blocked_ms   time blocked in all-to-all waits (exposed communication)
 *   inflight_ms  sum over all-to-alls of (completion seen - start)
 *   hidden_vs_1chunk = 1 - blocked(C) / blocked(1)
 *   a2a_bytes    bytes this rank sent in the 4*C data all-to-alls (self included)
 *   layer_a2a_busbw_GBps (1 chunk only, where the all-to-alls never overlap each other):
 *                a2a_bytes / inflight_ms * (P-1)/P. On the CUDA backend each transfer is
 *                queued behind the kernels that produce its buffer (permute, experts), and
 *                inflight counts that wait too: a lower bound on the transfer bandwidth.
 *                Likewise blocked(1) then contains GPU compute, so hidden_vs_1chunk is only
 *                indicative there; step_speedup_vs_1chunk = step(1) / step(C) is the number
 *                that counts.
 * With one chunk every all-to-all is waited for right after it starts, so blocked(1) is the
 * communication time (host backend); blocked time also contains waiting for slower peers.
 *
 * JSON line "plain_alltoall" (P > 1): an all-to-all of the layer's mean bytes per all-to-all
 * per rank (at 1 chunk, max over ranks), split evenly over the P peers (self included), as
 * nccl-tests' alltoall: algbw = bytes / time, busbw = algbw * (P-1)/P, GB = 1e9 bytes.
 *   moe_comm_*  through the mesh's ep communicator (libmoe's alltoallv: NCCL's grouped
 *               ncclSend/ncclRecv, or MPI), reps started back to back (at most 4 in
 *               flight), host clock to the last completion
 *   nccl_*      (CUDA build with NCCL, CUDA backend) a plain NCCL communicator made from
 *               MPI_COMM_WORLD, grouped ncclSend/ncclRecv on its own stream, reps timed with
 *               CUDA events on that stream
 * MOE_A2A_THREAD=1 / 0 turns on / off the host worker thread that computes a chunk's experts
 * while the main thread drives MPI (without it the host cannot overlap: MPI copies with the
 * CPU). Unset: on when MPI provides MPI_THREAD_FUNNELED (this program's MPI_Init: single).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <mpi.h>

#include <moe/moe.h>

#include "layer/expert_parallel.h"
#include "layer/layer_internal.h"
#include "runtime/runtime.h"
#include "test_support.h"

#ifdef BENCH_RAW_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

static int W, R;

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Random activations. The CUDA shapes hold ~10^8 values per tensor: a uniform of unit
 * variance there (normal sampling would take seconds); normal on the host as before. */
static void fill(test_rng_t *r, float *x, int64_t n, bool fast)
{
    if (!fast) {
        test_fill_normal(r, x, n, 1.0);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)((test_rng_uniform(r) - 0.5) * 3.4641016151377544);
}

/* nccl-tests' bus bandwidth of `bytes` per rank moved in `ms`: algbw (1e9 bytes/s) * (P-1)/P */
static double busbw_gbps(double bytes, double ms)
{
    return ms > 0 ? bytes / (ms * 1e6) * (W - 1) / W : 0.0;
}

/* A measured time and its bus bandwidth as JSON numbers, or null when the time is missing. */
static void json_ms_busbw(double ms, double bytes, char ms_s[32], char bw_s[32])
{
    strcpy(ms_s, "null");
    strcpy(bw_s, "null");
    if (ms <= 0) return;
    snprintf(ms_s, 32, "%.4f", ms);
    snprintf(bw_s, 32, "%.2f", busbw_gbps(bytes, ms));
}

/* ---- plain all-to-all through the mesh's ep communicator ------------------------------------ */

/* `bytes` per rank split evenly over the P peers; mean ms per all-to-all over reps started
 * back to back (2 warm-up first). Returns < 0 on failure (agreed over the world). */
static double moe_comm_a2a_ms(moe_runtime_t *rt, size_t bytes, int reps)
{
    moe_comm_t *c = rt->mesh->comm[MOE_AXIS_EP];
    if (!c) return -1;
    moe_dtype_t dt;
    TEST_OK(moe_runtime_compute_dtype(rt, &dt));
    moe_comm_dtype_t cdt = dt == MOE_DTYPE_BF16 ? MOE_COMM_BF16 : MOE_COMM_F32;
    size_t es = dt == MOE_DTYPE_BF16 ? 2 : 4, P = (size_t)c->size;
    size_t per = bytes / es / P; /* elements per peer */
    if (per == 0) per = 1;
    moe_device_kind_t dev;
    TEST_OK(moe_runtime_device(rt, &dev, NULL));
    int64_t n = (int64_t)(per * P);
    moe_tensor_t s, r;
    TEST_OK(moe_tensor_alloc(rt, dt, dev, 1, &n, &s));
    TEST_OK(moe_tensor_alloc(rt, dt, dev, 1, &n, &r));
    size_t cnt[64], dis[64];
    for (size_t p = 0; p < P && p < 64; p++) cnt[p] = per, dis[p] = p * per;
    moe_comm_req_t *q[64];
    int ok = P <= 64 && reps <= 64;
    double t0 = 0;
    enum { WINDOW = 4 }; /* in flight at once: the staged MPI communicator pins each one */
    for (int round = 0; round < 2 && ok; round++) { /* round 0: 2 warm-up, round 1: timed */
        int m = round ? reps : 2, started = 0, waited = 0;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = now_ms();
        for (int i = 0; i < m && ok; i++) {
            if (started - waited >= WINDOW && moe_comm_wait(c, q[waited++]) != MOE_STATUS_SUCCESS) {
                fprintf(stderr, "rank %d: moe_comm wait: %s\n", R, moe_last_error());
                ok = 0;
                break;
            }
            if (c->ops->alltoallv(c, s.data, cnt, dis, r.data, cnt, dis, cdt, &q[i]) !=
                MOE_STATUS_SUCCESS) {
                fprintf(stderr, "rank %d: moe_comm alltoallv: %s\n", R, moe_last_error());
                ok = 0;
                break;
            }
            started++;
        }
        while (waited < started)
            if (moe_comm_wait(c, q[waited++]) != MOE_STATUS_SUCCESS) {
                fprintf(stderr, "rank %d: moe_comm wait: %s\n", R, moe_last_error());
                ok = 0;
            }
    }
    double ms = (now_ms() - t0) / reps, mx = 0;
    int all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&ms, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    TEST_OK(moe_tensor_free(rt, &s));
    TEST_OK(moe_tensor_free(rt, &r));
    return all ? mx : -1;
}

/* ---- plain NCCL all-to-all (no libmoe in the path) ------------------------------------------ */

#ifdef BENCH_RAW_NCCL
/* Report a failed CUDA or NCCL call on this rank and give up the measurement. */
#define RAW_CHECK(type, ok, errstr, call)                                                          \
    do {                                                                                           \
        type e_ = (call);                                                                          \
        if (e_ != (ok)) {                                                                          \
            fprintf(stderr, "rank %d: %s: %s\n", R, #call, errstr(e_));                            \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)
#define RAW_CUDA(call) RAW_CHECK(cudaError_t, cudaSuccess, cudaGetErrorString, call)
#define RAW_NCCL(call) RAW_CHECK(ncclResult_t, ncclSuccess, ncclGetErrorString, call)

/* Mean ms per all-to-all of `bytes` per rank over the world, on `device`; < 0 on failure.
 * *version: ncclGetVersion's code. */
static double nccl_a2a_ms(int device, size_t bytes, int reps, int *version)
{
    double result = -1;
    int ok = 0, all = 0, idok = 1;
    ncclComm_t comm = NULL;
    cudaStream_t st = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    char *sb = NULL, *rb = NULL;
    size_t per = bytes / (size_t)W;
    if (per == 0) per = 1;
    float ms = 0;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (ncclGetVersion(version) != ncclSuccess) *version = -1;
    if (R == 0 && ncclGetUniqueId(&id) != ncclSuccess) idok = 0;
    MPI_Bcast(&idok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (!idok) return -1;
    MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    RAW_CUDA(cudaSetDevice(device));
    RAW_NCCL(ncclCommInitRank(&comm, W, id, R));
    RAW_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    RAW_CUDA(cudaEventCreate(&e0));
    RAW_CUDA(cudaEventCreate(&e1));
    RAW_CUDA(cudaMalloc((void **)&sb, per * (size_t)W));
    RAW_CUDA(cudaMalloc((void **)&rb, per * (size_t)W));
    RAW_CUDA(cudaMemset(sb, 1, per * (size_t)W));
    RAW_CUDA(cudaDeviceSynchronize());
    MPI_Barrier(MPI_COMM_WORLD);
    for (int it = -2; it < reps; it++) { /* 2 warm-up */
        if (it == 0) RAW_CUDA(cudaEventRecord(e0, st));
        RAW_NCCL(ncclGroupStart());
        for (int p = 0; p < W; p++) {
            RAW_NCCL(ncclSend(sb + (size_t)p * per, per, ncclInt8, p, comm, st));
            RAW_NCCL(ncclRecv(rb + (size_t)p * per, per, ncclInt8, p, comm, st));
        }
        RAW_NCCL(ncclGroupEnd());
    }
    RAW_CUDA(cudaEventRecord(e1, st));
    RAW_CUDA(cudaEventSynchronize(e1));
    RAW_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    ok = 1;
done:
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    double mine = (double)ms / reps;
    MPI_Allreduce(&mine, &result, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (st) cudaStreamSynchronize(st);
    cudaFree(sb);
    cudaFree(rb);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (st) cudaStreamDestroy(st);
    if (comm) {
        if (all)
            ncclCommDestroy(comm);
        else
            ncclCommAbort(comm);
    }
    return all ? result : -1;
}
#endif

/* ---- main ------------------------------------------------------------------------------------ */

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &W);
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    int64_t N = argc > 1 ? atoll(argv[1]) : 256, H = argc > 2 ? atoll(argv[2]) : 128;
    int64_t F = argc > 3 ? atoll(argv[3]) : 256;
    int E = argc > 4 ? atoi(argv[4]) : 2 * W, K = argc > 5 ? atoi(argv[5]) : 2;
    int iters = argc > 6 ? atoi(argv[6]) : 5;
    if (iters < 1) iters = 1;
    if (iters > 64) iters = 64;
    const char *bk = getenv("MOE_BENCH_BACKEND");
    bool cuda = bk && strcmp(bk, "cuda") == 0;

    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = cuda ? MOE_BACKEND_CUDA : MOE_BACKEND_HOST;
    if (cuda) { /* every rank must have the backend before the (collective) mesh is made */
        moe_runtime_t *probe = NULL;
        int ok = moe_runtime_create(&rc, &probe) == MOE_STATUS_SUCCESS, all = 0;
        if (!ok) fprintf(stderr, "rank %d: no CUDA backend: %s\n", R, moe_last_error());
        moe_runtime_destroy(probe);
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        if (!all) {
            MPI_Finalize();
            return 77;
        }
    }
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.ep = W;
    rc.mesh = &mc;
    moe_runtime_t *rt;
    TEST_OK(moe_runtime_create(&rc, &rt));
    moe_dtype_t dt;
    moe_device_kind_t dev;
    int32_t dev_index = 0;
    TEST_OK(moe_runtime_compute_dtype(rt, &dt));
    TEST_OK(moe_runtime_device(rt, &dev, &dev_index));
    const char *comm_name = rt->mesh->comm[MOE_AXIS_EP] ? rt->mesh->comm[MOE_AXIS_EP]->ops->name
                                                        : "none";

    /* activations: random f32 on the host, copied (converted) to the runtime's device */
    int64_t sh[2] = {N, H};
    moe_tensor_t tx, ty, tdy, tdx;
    TEST_OK(moe_tensor_alloc(rt, dt, dev, 2, sh, &tx));
    TEST_OK(moe_tensor_alloc(rt, dt, dev, 2, sh, &ty));
    TEST_OK(moe_tensor_alloc(rt, dt, dev, 2, sh, &tdy));
    TEST_OK(moe_tensor_alloc(rt, dt, dev, 2, sh, &tdx));
    {
        float *h = malloc(sizeof(float) * (size_t)(N * H));
        if (!h) {
            fprintf(stderr, "rank %d: out of host memory\n", R);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        test_rng_t rng = {1000 + (uint64_t)R};
        moe_tensor_t hv;
        TEST_OK(moe_tensor_view(h, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &hv));
        fill(&rng, h, N * H, cuda);
        TEST_OK(moe_tensor_copy(rt, &tx, &hv));
        fill(&rng, h, N * H, cuda);
        TEST_OK(moe_tensor_copy(rt, &tdy, &hv));
        free(h);
    }

    double base_blocked = 0, base_step = 0, a2a_op_bytes = 0;
    const int chunk_list[] = {1, 2, 4};
    moe_layer_t *l = NULL;
    for (size_t ci = 0; ci < 3; ci++) {
        if (cuda && l) {
            /* The parameters are initialised on the host (~20 s for 10^8-10^9 values): the
             * CUDA runs keep one layer and change only the chunk count, which the layer reads
             * afresh in every forward and backward (host: a new layer per count, as its
             * worker-thread choice is made at creation). */
            l->cfg.a2a_chunks = chunk_list[ci];
        } else {
            TEST_OK(moe_layer_destroy(l));
            moe_layer_config_t c = moe_layer_config_default();
            c.hidden = H, c.ffn_hidden = F, c.num_experts = E, c.top_k = K;
            c.a2a_chunks = chunk_list[ci];
            TEST_OK(moe_layer_create(rt, &c, &l));
        }
        double step[64], blocked[64], inflight[64], bytes = 0, count = 0;
        for (int it = -1; it < iters; it++) { /* it = -1: warm-up */
            TEST_OK(moe_runtime_synchronize(rt));
            MPI_Barrier(MPI_COMM_WORLD);
            moe_dist_timing_reset(l);
            double t0 = now_ms();
            TEST_OK(moe_layer_forward(l, 0, &tx, &ty));
            TEST_OK(moe_layer_backward(l, 0, &tdy, &tdx));
            TEST_OK(moe_runtime_synchronize(rt));
            double t1 = now_ms();
            moe_dist_timing_t tm;
            moe_dist_timing(l, &tm);
            double v[5] = {t1 - t0, tm.a2a_blocked_ms, tm.a2a_started_ms, (double)tm.a2a_bytes,
                           (double)tm.a2a_count},
                   mx[5];
            if (it == 0 && R == 0)
                fprintf(stderr, "chunks %d: %lld chunks on the worker thread\n", chunk_list[ci],
                        (long long)tm.worker_chunks);
            MPI_Allreduce(v, mx, 5, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (it >= 0) {
                step[it] = mx[0];
                blocked[it] = mx[1];
                inflight[it] = mx[2];
                bytes = mx[3];
                count = mx[4];
            }
        }
        qsort(step, (size_t)iters, sizeof(double), cmp);
        qsort(blocked, (size_t)iters, sizeof(double), cmp);
        qsort(inflight, (size_t)iters, sizeof(double), cmp);
        double b = blocked[iters / 2], s = step[iters / 2], fl = inflight[iters / 2];
        if (ci == 0) {
            base_blocked = b, base_step = s;
            a2a_op_bytes = count > 0 ? bytes / count : 0;
        }
        char busbw[48] = "null";
        if (ci == 0 && W > 1) snprintf(busbw, sizeof busbw, "%.2f", busbw_gbps(bytes, fl));
        if (R == 0)
            printf(
                "{\"bench\":\"dist_layer\",\"backend\":\"%s\",\"comm\":\"%s\",\"worker_thread\":%d,"
                "\"ranks\":%d,\"N\":%lld,\"H\":%lld,\"F\":%lld,\"E\":%d,"
                "\"K\":%d,\"chunks\":%d,\"step_ms\":%.3f,\"blocked_ms\":%.3f,"
                "\"inflight_ms\":%.3f,\"hidden_vs_1chunk\":%.3f,\"step_speedup_vs_1chunk\":%.3f,"
                "\"a2a_count\":%.0f,\"a2a_bytes\":%.0f,\"layer_a2a_busbw_GBps\":%s}\n",
                cuda ? "cuda" : "host", comm_name,
                getenv("MOE_A2A_THREAD") ? atoi(getenv("MOE_A2A_THREAD")) : -1, W, (long long)N,
                (long long)H, (long long)F, E, K, chunk_list[ci], s, b, fl,
                base_blocked > 0 ? 1.0 - b / base_blocked : 0.0, s > 0 ? base_step / s : 0.0, count,
                bytes, busbw);
        fflush(stdout);
    }
    TEST_OK(moe_layer_destroy(l));

    /* the same bytes per rank through a plain all-to-all */
    if (W > 1 && a2a_op_bytes > 0) {
        const int reps = 20;
        size_t op = (size_t)a2a_op_bytes;
        double mc_ms = moe_comm_a2a_ms(rt, op, reps), nc_ms = -1;
        int nccl_version = -1;
#ifdef BENCH_RAW_NCCL
        if (cuda) nc_ms = nccl_a2a_ms(dev_index, op, reps, &nccl_version);
#endif
        char mcs[32], ncs[32], mcb[32], ncb[32];
        json_ms_busbw(mc_ms, (double)op, mcs, mcb);
        json_ms_busbw(nc_ms, (double)op, ncs, ncb);
        if (R == 0)
            printf("{\"bench\":\"plain_alltoall\",\"backend\":\"%s\",\"comm\":\"%s\",\"ranks\":%d,"
                   "\"N\":%lld,\"H\":%lld,\"K\":%d,\"bytes_per_rank\":%zu,\"reps\":%d,"
                   "\"moe_comm_ms\":%s,\"moe_comm_busbw_GBps\":%s,\"nccl_ms\":%s,"
                   "\"nccl_busbw_GBps\":%s,\"nccl_version\":%d,\"what\":\"bytes_per_rank = the "
                   "layer's mean all-to-all (1 chunk, max over ranks), split evenly over peers; "
                   "busbw = bytes/ms*(P-1)/P; moe_comm: mesh ep communicator, host clock; nccl: "
                   "own NCCL communicator, CUDA events\"}\n",
                   cuda ? "cuda" : "host", comm_name, W, (long long)N, (long long)H, K, op, reps,
                   mcs, mcb, ncs, ncb, nccl_version);
        fflush(stdout);
    }
    (void)dev_index;
    TEST_OK(moe_tensor_free(rt, &tx));
    TEST_OK(moe_tensor_free(rt, &ty));
    TEST_OK(moe_tensor_free(rt, &tdy));
    TEST_OK(moe_tensor_free(rt, &tdx));
    TEST_OK(moe_runtime_destroy(rt));
    MPI_Finalize();
    return 0;
}
