/*
 * How much of the EP all-to-all time the chunked schedule hides (host backend, MPI).
 *
 * mpirun -np P bench_dist_layer [N H F E K iters]: a (1,P,1,1) mesh, N tokens per rank,
 * forward + backward of one layer, for a2a_chunks = 1, 2, 4. Per run (median over iters):
 *   step_ms     wall time of forward + backward
 *   blocked_ms  time blocked in all-to-all waits (exposed communication)
 *   inflight_ms sum over all-to-alls of (completion seen - start)
 * With one chunk every all-to-all is waited for right after it starts, so blocked(1) is the
 * communication time; hidden(C) = 1 - blocked(C) / blocked(1) is the fraction the overlap
 * hid. Blocked time also contains waiting for slower peers, so this is a lower bound on a
 * loaded machine. One JSON line per configuration on rank 0 (max over ranks).
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

#include "moe/dispatch.h"
#include "runtime/runtime.h"
#include "test_support.h"

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

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int W, R;
    MPI_Comm_size(MPI_COMM_WORLD, &W);
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    int64_t N = argc > 1 ? atoll(argv[1]) : 256, H = argc > 2 ? atoll(argv[2]) : 128;
    int64_t F = argc > 3 ? atoll(argv[3]) : 256;
    int E = argc > 4 ? atoi(argv[4]) : 2 * W, K = argc > 5 ? atoi(argv[5]) : 2;
    int iters = argc > 6 ? atoi(argv[6]) : 5;

    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.ep = W;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_runtime_t *rt;
    TEST_OK(moe_runtime_create(&rc, &rt));
    float *x = malloc(sizeof(float) * (size_t)(N * H)), *y = malloc(sizeof(float) * (size_t)(N * H));
    float *dy = malloc(sizeof(float) * (size_t)(N * H)), *dx = malloc(sizeof(float) * (size_t)(N * H));
    test_rng_t rng = {1000 + (uint64_t)R};
    test_fill_normal(&rng, x, N * H, 1.0);
    test_fill_normal(&rng, dy, N * H, 1.0);
    int64_t sh[2] = {N, H};
    moe_tensor_t tx, ty, tdy, tdx;
    moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &tx);
    moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &ty);
    moe_tensor_view(dy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &tdy);
    moe_tensor_view(dx, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, sh, &tdx);

    double base_blocked = 0;
    const int chunk_list[] = {1, 2, 4};
    for (size_t ci = 0; ci < 3; ci++) {
        moe_layer_config_t c = moe_layer_config_default();
        c.hidden = H, c.ffn_hidden = F, c.num_experts = E, c.top_k = K;
        c.a2a_chunks = chunk_list[ci];
        moe_layer_t *l;
        TEST_OK(moe_layer_create(rt, &c, &l));
        double step[64], blocked[64], inflight[64];
        for (int it = -1; it < iters && it < 64; it++) { /* it = -1: warm-up */
            MPI_Barrier(MPI_COMM_WORLD);
            moe_dist_timing_reset(l);
            double t0 = now_ms();
            TEST_OK(moe_layer_forward(l, 0, &tx, &ty));
            TEST_OK(moe_layer_backward(l, 0, &tdy, &tdx));
            double t1 = now_ms();
            moe_dist_timing_t tm;
            moe_dist_timing(l, &tm);
            double v[3] = {t1 - t0, tm.a2a_blocked_ms, tm.a2a_started_ms}, mx[3];
            if (it == 0 && R == 0)
                fprintf(stderr, "chunks %d: %lld chunks on the worker thread\n", chunk_list[ci],
                        (long long)tm.worker_chunks);
            MPI_Allreduce(v, mx, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (it >= 0) {
                step[it] = mx[0];
                blocked[it] = mx[1];
                inflight[it] = mx[2];
            }
        }
        qsort(step, (size_t)iters, sizeof(double), cmp);
        qsort(blocked, (size_t)iters, sizeof(double), cmp);
        qsort(inflight, (size_t)iters, sizeof(double), cmp);
        double b = blocked[iters / 2];
        if (ci == 0) base_blocked = b;
        if (R == 0)
            printf("{\"bench\":\"dist_layer\",\"worker_thread\":%d,\"ranks\":%d,\"N\":%lld,\"H\":%lld,\"F\":%lld,\"E\":%d,"
                   "\"K\":%d,\"chunks\":%d,\"step_ms\":%.3f,\"blocked_ms\":%.3f,"
                   "\"inflight_ms\":%.3f,\"hidden_vs_1chunk\":%.3f}\n",
                   getenv("MOE_A2A_THREAD") ? atoi(getenv("MOE_A2A_THREAD")) : -1, W,
                   (long long)N, (long long)H, (long long)F, E, K, chunk_list[ci],
                   step[iters / 2], b, inflight[iters / 2],
                   base_blocked > 0 ? 1.0 - b / base_blocked : 0.0);
        fflush(stdout);
        TEST_OK(moe_layer_destroy(l));
    }
    TEST_OK(moe_runtime_destroy(rt));
    free(x), free(y), free(dy), free(dx);
    MPI_Finalize();
    return 0;
}
