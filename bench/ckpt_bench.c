/*
 * Checkpoint benchmark: the caller's stall (time inside moe_ckpt_save_async), what the save
 * costs the training step that follows it, and the time until the checkpoint is durable on
 * disk (commit marker fsynced), for a state of --gib GiB of bf16 tensors on the runtime's
 * device (the GPU with the CUDA backend), against `dd oflag=direct conv=fsync` writing the
 * same number of bytes to the same directory, measured in the same run (before and after).
 *
 *   ckpt_bench [--gib 8] [--dir /path/on/nvme] [--runs 5] [--tensors 32]
 *              [--chunk-mib 256] [--qd 8] [--block-mib 8] [--backend auto|host|cuda]
 *              [--load-ms 250]
 *
 * The training load after each save: forwards and backwards of one MoE layer (H 2048, F 8192,
 * E 8, K 2, 8192 tokens; on the host backend H 256, F 512, 1024 tokens), repeated to about
 * --load-ms ms (0: none), then an AdamW step of
 * the layer, which waits for the snapshot's copy (the runtime's write fence) as a trainer's
 * optimizer does.
 *
 * Prints one JSON line per measured save and a summary line with medians:
 *   stall_s        time in save_async (the copy is only started; the pinned budget holds the
 *                  whole state, so no double-buffering wait)
 *   step_s         the training load right after the save, to its end on the device;
 *                  base_step_s the same load without a save (median of 3), step_delay_s the
 *                  difference: what the copy cost the step (the fence's wait, shared bandwidth)
 *   durable_s      save_async start -> manifest durable (moe_ckpt_status.last_durable_s)
 *   write_GBps     bytes / durable_s;  dd_GBps: dd's bytes / its wall time (incl. fsync)
 *   vs_dd          write_GBps / dd_GBps (target >= 0.9); stall target <= 0.01 s
 *   d2h_ref_GBps   a plain blocking device -> pinned copy of the state (the copy's floor)
 * One warm-up save first (pinned allocation, buffer registration, page-cache effects of
 * the directory). The checkpoint directory is removed at the end.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <moe/moe.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) {                                                            \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,                    \
                    moe_status_string(s_), moe_last_error());                                      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- the training load ---------------------------------------------------------------- */

typedef struct load {
    moe_layer_t *layer;
    moe_adamw_t *opt;
    moe_tensor_t x, y, dy;
    int reps; /* forward + backward passes per step */
} load_t;

/* x and dy: a fixed pattern of bf16 values in [-1, 1) (f32 on the host backend). */
static void fill_input(moe_runtime_t *rt, moe_tensor_t *t, uint64_t seed)
{
    int64_t n = moe_tensor_numel(t);
    float *h = malloc(sizeof *h * (size_t)n);
    for (int64_t i = 0; i < n; i++)
        h[i] = (float)((((uint64_t)i * 2654435761u) ^ seed) % 2001) / 1000.0f - 1.0f;
    moe_tensor_t ht;
    CHECK(moe_tensor_view(h, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, t->shape, &ht));
    CHECK(moe_tensor_copy(rt, t, &ht));
    free(h);
}

static double load_step(moe_runtime_t *rt, load_t *l)
{
    double t0 = now_s();
    CHECK(moe_layer_discard_grad(l->layer));
    for (int r = 0; r < l->reps; r++) {
        CHECK(moe_layer_forward(l->layer, 0, &l->x, &l->y));
        CHECK(moe_layer_backward(l->layer, 0, &l->dy, NULL));
    }
    CHECK(moe_adamw_step(l->opt, MOE_ADAMW_LR_CONFIGURED, 1.0f));
    CHECK(moe_runtime_synchronize(rt));
    return now_s() - t0;
}

/* A layer and its optimizer whose step takes about ms milliseconds. */
static void load_init(moe_runtime_t *rt, moe_device_kind_t dev, moe_dtype_t act, double ms,
                      load_t *l)
{
    moe_layer_config_t lc = moe_layer_config_default();
    bool host = dev == MOE_DEVICE_HOST; /* the fp32 reference: a small layer */
    lc.hidden = host ? 256 : 2048;
    lc.ffn_hidden = host ? 512 : 8192;
    lc.num_experts = 8;
    lc.top_k = 2;
    CHECK(moe_layer_create(rt, &lc, &l->layer));
    moe_adamw_config_t ac = moe_adamw_config_default();
    CHECK(moe_adamw_create(rt, &ac, &l->opt));
    CHECK(moe_adamw_add_layer(l->opt, l->layer, NULL));
    int64_t shape[2] = {host ? 1024 : 8192, lc.hidden};
    CHECK(moe_tensor_alloc(rt, act, dev, 2, shape, &l->x));
    CHECK(moe_tensor_alloc(rt, act, dev, 2, shape, &l->y));
    CHECK(moe_tensor_alloc(rt, act, dev, 2, shape, &l->dy));
    fill_input(rt, &l->x, 1);
    fill_input(rt, &l->dy, 2);
    /* per pass from the difference of 4 passes and 1 (the optimizer step and the fixed
     * costs cancel), after two warm-up steps: the first steps carry start-up costs */
    l->reps = 1;
    load_step(rt, l);
    load_step(rt, l);
    double one = load_step(rt, l);
    l->reps = 4;
    double four = load_step(rt, l);
    double per = (four - one) / 3 > 1e-4 ? (four - one) / 3 : 1e-4;
    l->reps = (int)((ms / 1e3 - one) / per + 1.5);
    if (l->reps < 1) l->reps = 1;
}

static void load_free(moe_runtime_t *rt, load_t *l)
{
    moe_tensor_free(rt, &l->x);
    moe_tensor_free(rt, &l->y);
    moe_tensor_free(rt, &l->dy);
    CHECK(moe_adamw_destroy(l->opt));
    CHECK(moe_layer_destroy(l->layer));
}

/* dd of `bytes` with O_DIRECT and a final fsync; returns GB/s (1e9 bytes/s) of wall time */
static double run_dd(const char *dir, uint64_t bytes)
{
    char cmd[1024];
    uint64_t bs = 64ull << 20;
    snprintf(cmd, sizeof cmd,
             "dd if=/dev/zero of=%s/dd-bench.bin bs=%" PRIu64 " count=%" PRIu64
             " oflag=direct conv=fsync status=none",
             dir, bs, (bytes + bs - 1) / bs);
    double t0 = now_s();
    int rc = system(cmd);
    double t = now_s() - t0;
    snprintf(cmd, sizeof cmd, "rm -f %s/dd-bench.bin", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove the dd file\n");
    if (rc != 0) {
        fprintf(stderr, "dd failed (rc %d)\n", rc);
        return 0;
    }
    return (double)((bytes + bs - 1) / bs * bs) / t / 1e9;
}

int main(int argc, char **argv)
{
    double gib = 8;
    const char *dir = getenv("MOE_CKPT_BENCH_DIR") ? getenv("MOE_CKPT_BENCH_DIR") : "/tmp";
    int runs = 5, ntensors = 32, qd = 8;
    double load_ms = 250;
    size_t chunk_mib = 256, block_mib = 8;
    moe_backend_kind_t backend = MOE_BACKEND_AUTO;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--gib"))
            gib = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir"))
            dir = argv[i + 1];
        else if (!strcmp(argv[i], "--runs"))
            runs = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tensors"))
            ntensors = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--chunk-mib"))
            chunk_mib = (size_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--qd"))
            qd = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--block-mib"))
            block_mib = (size_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--load-ms"))
            load_ms = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--backend"))
            backend = !strcmp(argv[i + 1], "host")   ? MOE_BACKEND_HOST
                      : !strcmp(argv[i + 1], "cuda") ? MOE_BACKEND_CUDA
                                                     : MOE_BACKEND_AUTO;
        else {
            fprintf(stderr, "unknown option %s (see the top of bench/ckpt_bench.c)\n", argv[i]);
            return 2;
        }
    }
    if (runs < 1 || runs > 100 || ntensors < 1 || load_ms < 0) return 2;
    uint64_t total = (uint64_t)(gib * (double)(1ull << 30));
    int64_t per = (int64_t)(total / (uint64_t)ntensors / 2); /* bf16 elements per tensor */
    total = (uint64_t)per * 2 * (uint64_t)ntensors;

    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = backend;
    moe_runtime_t *rt;
    CHECK(moe_runtime_create(&rc, &rt));
    moe_backend_kind_t kind;
    moe_device_kind_t dev;
    CHECK(moe_runtime_backend(rt, &kind));
    CHECK(moe_runtime_device(rt, &dev, NULL));

    /* the state: ntensors bf16 tensors on the device, filled from a host pattern */
    moe_tensor_t *t = calloc((size_t)ntensors, sizeof *t);
    moe_ckpt_tensor_t *ct = calloc((size_t)ntensors, sizeof *ct);
    char(*names)[32] = calloc((size_t)ntensors, 32);
    uint16_t *host = malloc((size_t)per * 2);
    for (int64_t i = 0; i < per; i++) host[i] = (uint16_t)(0x3f80 ^ (i * 2654435761u >> 20));
    moe_tensor_t ht;
    CHECK(moe_tensor_view(host, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 1, &per, &ht));
    for (int i = 0; i < ntensors; i++) {
        CHECK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, dev, 1, &per, &t[i]));
        CHECK(moe_tensor_copy(rt, &t[i], &ht));
        snprintf(names[i], 32, "layer%03d.weight", i);
        ct[i] = moe_ckpt_tensor_whole(names[i], &t[i]);
    }
    CHECK(moe_runtime_synchronize(rt));

    /* reference: plain device -> pinned copies of the same tensors (the stall's floor) */
    double ref[3];
    {
        moe_tensor_t pin;
        CHECK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 1, &per, &pin));
        for (int k = 0; k < 3; k++) {
            CHECK(moe_runtime_synchronize(rt));
            double t0 = now_s();
            for (int i = 0; i < ntensors; i++) CHECK(moe_tensor_copy(rt, &pin, &t[i]));
            ref[k] = total / (now_s() - t0) / 1e9;
        }
        moe_tensor_free(rt, &pin);
    }
    double d2h_ref = median(ref, 3);
    printf("{\"bench\":\"d2h_reference\",\"bytes\":%" PRIu64 ",\"GBps\":%.2f}\n", total, d2h_ref);

    load_t load = {0};
    double base_step = 0;
    if (load_ms > 0) {
        load_init(rt, dev, kind == MOE_BACKEND_CUDA ? MOE_DTYPE_BF16 : MOE_DTYPE_F32, load_ms,
                  &load);
        double b[3];
        for (int k = 0; k < 3; k++) b[k] = load_step(rt, &load);
        base_step = median(b, 3);
        printf("{\"bench\":\"ckpt_load\",\"reps\":%d,\"base_step_s\":%.4f}\n", load.reps,
               base_step);
    }

    char ckdir[1024];
    snprintf(ckdir, sizeof ckdir, "%s/moe-ckpt-bench-%d", dir, (int)getpid());
    double dd_before = run_dd(dir, total);

    moe_ckpt_config_t cc = moe_ckpt_config_default();
    cc.dir = ckdir;
    cc.keep_last = 1;
    cc.chunk_bytes = chunk_mib << 20;
    cc.pinned_budget_bytes = (size_t)total + 2 * cc.chunk_bytes + (size_t)ntensors * 4096;
    cc.queue_depth = qd;
    cc.io_block_bytes = block_mib << 20;
    moe_ckpt_t *ck;
    CHECK(moe_ckpt_create(rt, &cc, &ck));

    double stall[100], durable[100], step[100];
    int direct = 0;
    for (int r = -1; r < runs; r++) { /* r = -1: warm-up */
        CHECK(moe_runtime_synchronize(rt));
        double t0 = now_s();
        CHECK(moe_ckpt_save_async(ck, r + 1, ct, ntensors));
        double t1 = now_s();
        double st_s = load_ms > 0 ? load_step(rt, &load) : 0;
        CHECK(moe_ckpt_wait(ck, 0, -1));
        double t2 = now_s();
        moe_ckpt_status_t st = {.struct_size = sizeof st};
        CHECK(moe_ckpt_status(ck, &st));
        direct = st.direct_io;
        if (r < 0) continue;
        stall[r] = t1 - t0;
        step[r] = st_s;
        durable[r] = st.last_durable_s > 0 ? st.last_durable_s : t2 - t0;
        printf("{\"bench\":\"ckpt_save\",\"run\":%d,\"bytes\":%" PRIu64 ",\"stall_s\":%.5f,"
               "\"step_s\":%.4f,\"step_delay_s\":%.4f,\"durable_s\":%.3f,"
               "\"write_GBps\":%.3f,\"direct_io\":%d}\n",
               r, total, stall[r], step[r], load_ms > 0 ? step[r] - base_step : 0, durable[r],
               total / durable[r] / 1e9, direct);
        fflush(stdout);
    }
    CHECK(moe_ckpt_destroy(ck));
    double dd_after = run_dd(dir, total);
    double ms = median(stall, runs), md = median(durable, runs), mstep = median(step, runs);
    double dd = dd_before > dd_after ? dd_before : dd_after;
    printf("{\"bench\":\"ckpt_summary\",\"backend\":\"%s\",\"bytes\":%" PRIu64 ",\"tensors\":%d,"
           "\"runs\":%d,\"chunk_mib\":%zu,\"qd\":%d,\"block_mib\":%zu,\"direct_io\":%d,"
           "\"stall_median_s\":%.5f,\"load_reps\":%d,\"base_step_s\":%.4f,"
           "\"step_median_s\":%.4f,\"step_delay_s\":%.4f,\"durable_median_s\":%.3f,"
           "\"write_GBps\":%.3f,\"dd_before_GBps\":%.3f,\"dd_after_GBps\":%.3f,"
           "\"vs_dd\":%.3f,\"d2h_ref_GBps\":%.2f,\"defer_writer\":%d,\"stall_target_met\":%s,"
           "\"write_target_met\":%s,\"dir\":\"%s\"}\n",
           kind == MOE_BACKEND_CUDA ? "cuda" : "host", total, ntensors, runs, chunk_mib, qd,
           block_mib, direct, ms, load.reps, base_step, mstep, load_ms > 0 ? mstep - base_step : 0,
           md, total / md / 1e9, dd_before, dd_after, dd > 0 ? total / md / 1e9 / dd : 0, d2h_ref,
           getenv("MOE_CKPT_DEFER_WRITER") ? atoi(getenv("MOE_CKPT_DEFER_WRITER")) : 1,
           ms <= 0.01 ? "true" : "false", dd > 0 && total / md / 1e9 >= 0.9 * dd ? "true" : "false",
           dir);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", ckdir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", ckdir);
    if (load_ms > 0) load_free(rt, &load);
    for (int i = 0; i < ntensors; i++) moe_tensor_free(rt, &t[i]);
    moe_runtime_destroy(rt);
    free(t);
    free(ct);
    free(names);
    free(host);
    return 0;
}
