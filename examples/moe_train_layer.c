/*
 * moe_train_layer: train one MoE layer on an embedded synthetic task, no download needed.
 *
 * The data: C clusters in R^H. A token of cluster c is x = center_c + noise, and its target
 * is a cluster-specific vector t_c plus a cluster-specific linear response to the noise.
 * One expert (or a pair) per cluster can fit this; a single shared FFN of the same width
 * cannot, so the router has to learn to send each cluster to experts that specialise.
 *
 * Loss per step: mean over tokens of 0.5 * ||y - target||^2 (the layer adds its aux and z
 * terms to the gradients itself). Prints one line per step:
 *   step, loss, tokens/s, max/mean expert load, dropped-slot ratio.
 *
 * Usage: moe_train_layer [--steps S] [--tokens N] [--seed X] [--backend auto|host|cuda] [--check]
 *   --check exits with status 1 unless the final loss is below 20% of the first.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <moe/moe.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) {                                                            \
            fprintf(stderr, "moe_train_layer: %s failed: %s\n", #call, moe_last_error());          \
            return 2;                                                                              \
        }                                                                                          \
    } while (0)

enum { HIDDEN = 32, FFN = 64, EXPERTS = 8, TOP_K = 2, CLUSTERS = 8 };

typedef struct options {
    int steps;
    int64_t tokens;
    uint64_t seed;
    moe_backend_kind_t backend;
    int check;
} options_t;

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_normal(uint64_t *s)
{
    double u1 = ((double)(rng_next(s) >> 11) + 0.5) * 0x1.0p-53;
    double u2 = (double)(rng_next(s) >> 11) * 0x1.0p-53;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* A whole-string unsigned number; "3x", "" and "foo" are refused. */
static int parse_number(const char *flag, const char *v, unsigned long long *out)
{
    char *end;
    errno = 0;
    *out = strtoull(v, &end, 0);
    if (errno || end == v || *end || v[0] == '-') {
        fprintf(stderr, "moe_train_layer: %s: \"%s\" is not a non-negative integer\n", flag, v);
        return -1;
    }
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: moe_train_layer [--steps S] [--tokens N] [--seed X] "
               "[--backend auto|host|cuda] [--check] [--help]\n");
}

/* Returns 0 to run, 1 after --help, -1 on a bad argument (named in the message). */
static int parse(int argc, char **argv, options_t *o)
{
    *o = (options_t){.steps = 300, .tokens = 512, .seed = 7, .backend = MOE_BACKEND_AUTO};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        unsigned long long n = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 1;
        } else if (!strcmp(a, "--check")) {
            o->check = 1;
        } else if (!strcmp(a, "--steps") || !strcmp(a, "--tokens") || !strcmp(a, "--seed") ||
                   !strcmp(a, "--backend")) {
            if (!v) {
                fprintf(stderr, "moe_train_layer: %s needs a value\n", a);
                return -1;
            }
            i++;
            if (!strcmp(a, "--backend")) {
                if (!strcmp(v, "host"))
                    o->backend = MOE_BACKEND_HOST;
                else if (!strcmp(v, "cuda"))
                    o->backend = MOE_BACKEND_CUDA;
                else if (!strcmp(v, "auto"))
                    o->backend = MOE_BACKEND_AUTO;
                else {
                    fprintf(stderr,
                            "moe_train_layer: --backend: \"%s\" is not auto, host or "
                            "cuda\n",
                            v);
                    return -1;
                }
                continue;
            }
            if (parse_number(a, v, &n)) return -1;
            if (!strcmp(a, "--seed"))
                o->seed = n;
            else if (n < 1 || n > (1ull << 30)) {
                fprintf(stderr, "moe_train_layer: %s: %s is not in 1..2^30\n", a, v);
                return -1;
            } else if (!strcmp(a, "--steps"))
                o->steps = (int)n;
            else
                o->tokens = (int64_t)n;
        } else {
            fprintf(stderr, "moe_train_layer: %s: unknown argument\n", a);
            usage(stderr);
            return -1;
        }
    }
    return 0;
}

/* The task: cluster centres, target vectors and response matrices. */
typedef struct task {
    float center[CLUSTERS][HIDDEN], target[CLUSTERS][HIDDEN], response[CLUSTERS][HIDDEN][HIDDEN];
} task_t;

static void make_task(task_t *t, uint64_t seed)
{
    for (int c = 0; c < CLUSTERS; c++)
        for (int i = 0; i < HIDDEN; i++) {
            t->center[c][i] = 2.0f * rng_normal(&seed);
            t->target[c][i] = rng_normal(&seed);
            for (int j = 0; j < HIDDEN; j++)
                t->response[c][i][j] = 0.3f * rng_normal(&seed) / sqrtf((float)HIDDEN);
        }
}

static void make_batch(const task_t *t, uint64_t *rng, int64_t n, float *x, float *target)
{
    for (int64_t k = 0; k < n; k++) {
        int c = (int)(rng_next(rng) % CLUSTERS);
        float noise[HIDDEN];
        for (int i = 0; i < HIDDEN; i++) {
            noise[i] = 0.3f * rng_normal(rng);
            x[k * HIDDEN + i] = t->center[c][i] + noise[i];
        }
        for (int i = 0; i < HIDDEN; i++) {
            float r = t->target[c][i];
            for (int j = 0; j < HIDDEN; j++) r += t->response[c][i][j] * noise[j];
            target[k * HIDDEN + i] = r;
        }
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    options_t o;
    int parsed = parse(argc, argv, &o);
    if (parsed) return parsed > 0 ? 0 : 2;

    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = o.backend;
    rc.seed = o.seed;
    moe_runtime_t *rt;
    CHECK(moe_runtime_create(&rc, &rt));
    moe_backend_kind_t backend;
    moe_dtype_t act;
    moe_device_kind_t device;
    CHECK(moe_runtime_backend(rt, &backend));
    CHECK(moe_runtime_compute_dtype(rt, &act));
    CHECK(moe_runtime_device(rt, &device, NULL));

    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = HIDDEN;
    lc.ffn_hidden = FFN;
    lc.num_experts = EXPERTS;
    lc.top_k = TOP_K;
    lc.capacity_factor = 1.5f;
    lc.init_std = 0.1f;
    moe_layer_t *layer;
    CHECK(moe_layer_create(rt, &lc, &layer));
    moe_adamw_config_t ac = moe_adamw_config_default();
    ac.lr = 3e-3f;
    ac.weight_decay = 0.0f;
    moe_adamw_t *opt;
    CHECK(moe_adamw_create(rt, &ac, &opt));
    CHECK(moe_adamw_add_layer(opt, layer, NULL));

    /* host staging in f32, device tensors in the backend's dtype */
    int64_t n = o.tokens, shape[2] = {n, HIDDEN};
    moe_tensor_t hx, hy, hdy, dx_, dy_, dg_;
    CHECK(moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &hx));
    CHECK(moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &hy));
    CHECK(moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &hdy));
    CHECK(moe_tensor_alloc(rt, act, device, 2, shape, &dx_));
    CHECK(moe_tensor_alloc(rt, act, device, 2, shape, &dy_));
    CHECK(moe_tensor_alloc(rt, act, device, 2, shape, &dg_));
    float *target = malloc(sizeof(float) * (size_t)(n * HIDDEN));
    if (!target) return 2;

    task_t task;
    make_task(&task, o.seed);
    uint64_t data_rng = o.seed ^ 0x5eed;
    printf("moe_train_layer: backend %s, %lld tokens/step, H=%d F=%d E=%d K=%d, %d steps\n",
           backend == MOE_BACKEND_CUDA ? "cuda" : "host", (long long)n, HIDDEN, FFN, EXPERTS, TOP_K,
           o.steps);
    double first = 0, last = 0;
    for (int step = 1; step <= o.steps; step++) {
        double t0 = now_s();
        make_batch(&task, &data_rng, n, hx.data, target);
        CHECK(moe_tensor_copy(rt, &dx_, &hx));
        /* one backward per step follows before the optimizer reads the gradients, so
         * they need not be zeroed: the backward writes them */
        CHECK(moe_layer_discard_grad(layer));
        CHECK(moe_layer_forward(layer, 0, &dx_, &dy_));
        CHECK(moe_tensor_copy(rt, &hy, &dy_));
        const float *y = hy.data;
        float *dy = hdy.data;
        double loss = 0;
        for (int64_t i = 0; i < n * HIDDEN; i++) {
            double d = (double)y[i] - target[i];
            loss += 0.5 * d * d;
            dy[i] = (float)(d / (double)n);
        }
        loss /= (double)n;
        CHECK(moe_tensor_copy(rt, &dg_, &hdy));
        CHECK(moe_layer_backward(layer, 0, &dg_, NULL));
        CHECK(moe_adamw_step(opt, MOE_ADAMW_LR_CONFIGURED, 1.0f));
        CHECK(moe_runtime_synchronize(rt));
        double dt = now_s() - t0;
        moe_layer_stats_t st = {.struct_size = sizeof st};
        CHECK(moe_layer_stats(layer, &st, NULL));
        if (step == 1) first = loss;
        last = loss;
        printf("step %4d  loss %.5f  tokens/s %9.0f  max/mean load %.2f  dropped %.3f  aux %.3f\n",
               step, loss, (double)n / dt, st.mean_load > 0 ? st.max_load / st.mean_load : 0.0,
               st.dropped_ratio, st.aux_loss);
    }
    printf("moe_train_layer: loss %.5f -> %.5f (%.1f%% of the first step)\n", first, last,
           100.0 * last / first);

    free(target);
    moe_tensor_t *ts[] = {&hx, &hy, &hdy, &dx_, &dy_, &dg_};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) CHECK(moe_tensor_free(rt, ts[i]));
    CHECK(moe_adamw_destroy(opt));
    CHECK(moe_layer_destroy(layer));
    CHECK(moe_runtime_destroy(rt));
    if (o.check && !(last < 0.2 * first)) {
        fprintf(stderr, "moe_train_layer: the loss did not fall below 20%% of its start\n");
        return 1;
    }
    return 0;
}
