/*
 * One training step of the MoE layer from C through the public API alone, timed the way
 * bench/python/torch_bench.py times the Python wrapper, so the two differ only by the wrapper:
 * a step is discard_grad, forward, backward (with dx) on the CUDA backend, x and dy drawn from
 * N(0, 1) by fill() below, which torch_bench.py reproduces draw for draw: with the runtime's
 * default seed on both sides the two layers route the same tokens alike (max_load shows it).
 *   ms       median over 10 back-to-back steps of CUDA events around each step on the
 *            runtime's stream,
 *            after warm-up steps (at least 2, and at least WARM_S seconds of them: an idle GPU
 *            starts at a low clock), as bench_moe times its layer
 *   wall_ms  host time of 20 back-to-back steps divided by 20, the stream synchronised at both
 *            ends: the per-call host cost shows here when the GPU work is short
 * Prints one JSON line per shape. Shapes: N tokens, H hidden, F expert width, E experts, K
 * top-k. Usage: step_bench N H F E K [N H F E K ...]
 * Built by tests/python/device_check.sh against the build's libmoe.so and cudart, also as a
 * shared object whose step_bench_steps() torch_bench.py calls: the same step loop in C, on the
 * wrapper's own layer and tensors, timed in the same process beside the wrapper.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <cuda_runtime.h>

#include <moe/moe.h>

#define CK(call)                                                                                   \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) {                                                            \
            fprintf(stderr, "%s: %s\n", #call, moe_last_error());                                  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));                            \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef struct step {
    moe_layer_t *layer;
    moe_tensor_t x, y, dy, dx;
} step_t;

static void run_step(step_t *s)
{
    CK(moe_layer_discard_grad(s->layer));
    CK(moe_layer_forward(s->layer, 0, &s->x, &s->y));
    CK(moe_layer_backward(s->layer, 0, &s->dy, &s->dx));
}

/* count steps back to back on caller-made tensors (torch_bench.py's in-process C loop); the
 * first failing call's status, its message in moe_last_error() */
moe_status_t step_bench_steps(moe_layer_t *layer, const moe_tensor_t *x, moe_tensor_t *y,
                              const moe_tensor_t *dy, moe_tensor_t *dx, int count)
{
    for (int i = 0; i < count; i++) {
        moe_status_t st = moe_layer_discard_grad(layer);
        if (st == MOE_STATUS_SUCCESS) st = moe_layer_forward(layer, 0, x, y);
        if (st == MOE_STATUS_SUCCESS) st = moe_layer_backward(layer, 0, dy, dx);
        if (st != MOE_STATUS_SUCCESS) return st;
    }
    return MOE_STATUS_SUCCESS;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A uniform draw in (0, 1) from a splitmix64 sequence. */
static double uniform(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return ((double)((z ^ (z >> 31)) >> 11) + 0.5) * 0x1.0p-53;
}

/* x or dy: N(0, 1) drawn on the host (Box-Muller), converted to bf16 by moe_tensor_copy */
static void fill(moe_runtime_t *rt, moe_tensor_t *dst, uint64_t seed)
{
    int64_t n = moe_tensor_numel(dst);
    float *host = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        double u1 = uniform(&seed), u2 = uniform(&seed);
        host[i] = (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    moe_tensor_t src;
    CK(moe_tensor_view(host, MOE_DTYPE_F32, MOE_DEVICE_HOST, dst->ndim, dst->shape, &src));
    CK(moe_tensor_copy(rt, dst, &src));
    free(host);
}

static void bench_shape(cudaStream_t stream, int64_t n, int64_t h, int64_t f, int32_t e, int32_t k)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_CUDA;
    moe_runtime_t *rt;
    CK(moe_runtime_create(&rc, &rt));
    CK(moe_runtime_set_stream(rt, stream));
    moe_layer_config_t cfg = moe_layer_config_default();
    cfg.hidden = h;
    cfg.ffn_hidden = f;
    cfg.num_experts = e;
    cfg.top_k = k;
    step_t s;
    CK(moe_layer_create(rt, &cfg, &s.layer));
    int64_t shape[2] = {n, h};
    moe_tensor_t *ts[] = {&s.x, &s.y, &s.dy, &s.dx};
    for (int i = 0; i < 4; i++)
        CK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, MOE_DEVICE_CUDA, 2, shape, ts[i]));
    fill(rt, &s.x, 1);
    fill(rt, &s.dy, 2);

    enum { WARM = 2, ITERS = 10, WALL = 20 };
    const double WARM_S = 0.5;
    double w0 = now_s();
    for (int i = 0; i < WARM || now_s() - w0 < WARM_S; i++) {
        run_step(&s);
        CU(cudaStreamSynchronize(stream));
    }
    cudaEvent_t ev[2 * ITERS];
    for (int i = 0; i < 2 * ITERS; i++) CU(cudaEventCreate(&ev[i]));
    CU(cudaStreamSynchronize(stream));
    for (int i = 0; i < ITERS; i++) {
        CU(cudaEventRecord(ev[2 * i], stream));
        run_step(&s);
        CU(cudaEventRecord(ev[2 * i + 1], stream));
    }
    CU(cudaStreamSynchronize(stream));
    float ms[ITERS];
    for (int i = 0; i < ITERS; i++) CU(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    qsort(ms, ITERS, sizeof(float), cmp_float);
    double t0 = now_s();
    for (int i = 0; i < WALL; i++) run_step(&s);
    CU(cudaStreamSynchronize(stream));
    double wall_ms = (now_s() - t0) * 1e3 / WALL;
    moe_layer_stats_t st = {.struct_size = sizeof st};
    CK(moe_layer_stats(s.layer, &st, NULL));
    double median = 0.5 * (ms[ITERS / 2 - 1] + ms[ITERS / 2]);
    printf("{\"impl\":\"libmoe C\",\"bench\":\"ffi_layer_step\",\"shape\":\"N=%lld H=%lld F=%lld "
           "E=%d K=%d\",\"variant\":\"C API\",\"ms\":%.4f,\"wall_ms\":%.4f,"
           "\"max_load\":%.0f,\"mean_load\":%.1f}\n",
           (long long)n, (long long)h, (long long)f, e, k, median, wall_ms, st.max_load,
           st.mean_load);
    fflush(stdout);
    for (int i = 0; i < 2 * ITERS; i++) cudaEventDestroy(ev[i]);
    for (int i = 0; i < 4; i++) CK(moe_tensor_free(rt, ts[i]));
    CK(moe_layer_destroy(s.layer));
    CK(moe_runtime_set_stream(rt, NULL));
    CK(moe_runtime_destroy(rt));
}

int main(int argc, char **argv)
{
    if (argc < 6 || (argc - 1) % 5 != 0) {
        fprintf(stderr, "usage: %s N H F E K [N H F E K ...]\n", argv[0]);
        return 2;
    }
    cudaStream_t stream;
    CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int a = 1; a + 4 < argc; a += 5)
        bench_shape(stream, atoll(argv[a]), atoll(argv[a + 1]), atoll(argv[a + 2]),
                    atoi(argv[a + 3]), atoi(argv[a + 4]));
    cudaStreamDestroy(stream);
    return 0;
}
