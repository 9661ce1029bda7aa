/*
 * libmoe CUDA benchmarks: router forward/backward, the SwiGLU expert FFN (each GEMM issue mode)
 * and the whole layer forward+backward, on the shapes of issue 3. Prints one JSON line per
 * measurement: median over `iters` timed runs (CUDA events on the work's stream, after
 * warm-up), random non-zero inputs (router inputs rotate over 3 buffers so repeated runs do
 * not hit a warm L2), and the floor the time is measured against:
 *   hbm: bytes that must move / 4.3 TB/s (device-to-device copy measured on this H200 kind)
 *   tc:  FLOPs / 790 TFLOP/s (8192^3 bf16 GEMM measured on this H200 kind)
 * bench/torch_moe.py measures the same shapes in PyTorch in the same run and re-measures both
 * ceilings.
 *
 * Shape legend: N tokens, H hidden, E experts, K top-k, T tokens per expert, F expert width.
 * Usage: bench_moe [router|experts|layer|all] [shape index within the part]
 *        bench_moe profile [layer shape index]
 * The router forward is also measured as router_fwd_stream: the mean of back-to-back runs; the
 * layer also as layer_fwd_bwd_sustained: timed after a few seconds of steps, at the clock the
 * GPU's power cap holds it to under sustained load.
 * The experts and layer parts measure every expert GEMM mode (variant = mode) unless
 * MOE_CUDA_EXPERT_GEMM names one. The experts part runs five loads a shape (expert_rows:
 * equal, routed, uneven, skewed, hot) and, with MOE_BENCH_COUNTS naming a trainer metrics
 * file, the per-expert counts of its last line's layers ("replay Ll"). `profile` runs MOE_PROFILE_WARMUP layer steps (default 2),
 * then one more between cudaProfilerStart/Stop, for `ncu --profile-from-start off`
 * (bench/kernel_times.py sums it) or bench/trace.c; many warm-up steps (a few seconds of them)
 * profile a step at the clock the GPU settles at under sustained load.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_profiler_api.h>
#include <cjson/cJSON.h>

#include <moe/moe.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_ctx.h"
#include "bench_fill.h"
#include "runtime/runtime.h"
#include "kernels.h"

#define HBM_BPS 4.3e12
#define TC_FLOPS 790e12

#define CK(call)                                                                                   \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) {                                                            \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, moe_last_error());       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (cudaError_t)(call);                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static char gpu_name[256], today[32];

typedef void (*bench_fn)(void *arg, int iter);

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median milliseconds of fn over iters runs, each bracketed by events on stream. */
static double time_median(cudaStream_t stream, bench_fn fn, void *arg, int warm, int iters)
{
    for (int i = 0; i < warm; i++) fn(arg, i);
    CU(cudaStreamSynchronize(stream));
    cudaEvent_t *ev = malloc(sizeof(cudaEvent_t) * 2 * (size_t)iters);
    float *ms = malloc(sizeof(float) * (size_t)iters);
    for (int i = 0; i < 2 * iters; i++) CU(cudaEventCreate(&ev[i]));
    for (int i = 0; i < iters; i++) {
        CU(cudaEventRecord(ev[2 * i], stream));
        fn(arg, warm + i);
        CU(cudaEventRecord(ev[2 * i + 1], stream));
    }
    CU(cudaStreamSynchronize(stream));
    for (int i = 0; i < iters; i++) CU(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    qsort(ms, (size_t)iters, sizeof(float), cmp_float);
    double med = iters % 2 ? ms[iters / 2] : 0.5 * (ms[iters / 2 - 1] + ms[iters / 2]);
    for (int i = 0; i < 2 * iters; i++) cudaEventDestroy(ev[i]);
    free(ev);
    free(ms);
    return med;
}

/* Mean milliseconds of fn over iters runs issued back to back between one pair of events: no
 * event between runs, so a kernel launched as a programmatic dependent may start before the
 * previous run ends (the router forward's); against time_median, what the events and the
 * launches cost each run. */
static double time_stream(cudaStream_t stream, bench_fn fn, void *arg, int warm, int iters)
{
    for (int i = 0; i < warm; i++) fn(arg, i);
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    CU(cudaStreamSynchronize(stream));
    CU(cudaEventRecord(e0, stream));
    for (int i = 0; i < iters; i++) fn(arg, warm + i);
    CU(cudaEventRecord(e1, stream));
    CU(cudaStreamSynchronize(stream));
    float ms;
    CU(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ms / iters;
}

static void *dalloc(size_t bytes)
{
    void *p = NULL;
    CU(cudaMalloc(&p, bytes ? bytes : 16));
    return p;
}

static void emit(const char *bench, const char *shape, const char *variant, double ms,
                 double floor_ms, const char *floor_kind, double tflops)
{
    printf("{\"impl\":\"libmoe\",\"bench\":\"%s\",\"shape\":\"%s\",\"variant\":\"%s\",\"ms\":%.4f,"
           "\"floor_ms\":%.4f,\"floor\":\"%s\",\"tflops\":%.1f,\"gpu\":\"%s\",\"date\":\"%s\"}\n",
           bench, shape, variant, ms, floor_ms, floor_kind, tflops, gpu_name, today);
    fflush(stdout);
}

/* ---- router ------------------------------------------------------------------------------- */

typedef struct router_arg {
    moe_backend_t be;
    cudaStream_t stream;
    float *scratch;
    void *state;
    moe_router_fwd_t f[3];
    moe_router_bwd_t b[3];
} router_arg_t;

static void run_router_fwd(void *p, int i)
{
    router_arg_t *a = p;
    CK(a->be.ops->router_forward(a->be.ctx, &a->f[i % 3]));
}

/* the selection kernels alone (logits already computed), to split the forward's time */
static void run_router_select(void *p, int i)
{
    router_arg_t *a = p;
    const moe_router_fwd_t *f = &a->f[i % 3];
    CU(moe_cuda_router_select(f->logits, f->bias, f->n, f->e, f->k, (int)f->score_fn,
                              f->renormalize, f->topk_idx, f->topk_w, f->counts, f->score_mean,
                              f->stats, a->scratch, a->state, a->stream));
}

static void run_router_bwd(void *p, int i)
{
    router_arg_t *a = p;
    CK(a->be.ops->router_backward(a->be.ctx, &a->b[i % 3]));
}

static void bench_router(moe_backend_t be, cudaStream_t stream, int only)
{
    /* the six, then the router of the first layer shape */
    const int64_t shapes[][4] = {{65536, 4096, 64, 2}, {65536, 7168, 256, 8}, {512, 256, 16, 2},
                                 {1024, 512, 32, 2},   {2048, 1024, 64, 2},   {4096, 2048, 64, 4},
                                 {16384, 4096, 64, 2}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        if (only >= 0 && (size_t)only != s) continue;
        int64_t n = shapes[s][0], h = shapes[s][1], e = shapes[s][2], k = shapes[s][3];
        router_arg_t a = {.be = be, .stream = stream};
        a.scratch = dalloc(4 * (size_t)moe_cuda_router_forward_scratch(n, (int32_t)e));
        a.state = dalloc(MOE_ROUTER_STATE_BYTES);
        CU(cudaMemsetAsync(a.state, 0, MOE_ROUTER_STATE_BYTES, stream));
        void *wg = dalloc(2 * h * e);
        float *dwg = dalloc(4 * h * e);
        CU(bench_fill_bf16(wg, h * e, 7, 1.0f / sqrtf((float)h), stream));
        CU(bench_fill_f32(dwg, h * e, 8, 0.0f, stream));
        for (int b = 0; b < 3; b++) {
            void *x = dalloc(2 * n * h);
            CU(bench_fill_bf16(x, n * h, 100 + b + 10 * s, 1.0f, stream));
            a.f[b] = (moe_router_fwd_t){.n = n,
                                        .h = h,
                                        .e = (int32_t)e,
                                        .k = (int32_t)k,
                                        .score_fn = MOE_SCORE_SOFTMAX,
                                        .renormalize = true,
                                        .x = x,
                                        .wg = wg,
                                        .bias = NULL,
                                        .logits = dalloc(4 * n * e),
                                        .topk_idx = dalloc(4 * n * k),
                                        .topk_w = dalloc(4 * n * k),
                                        .counts = dalloc(4 * e),
                                        .score_mean = dalloc(4 * e),
                                        .stats = dalloc(8)};
            CK(be.ops->router_forward(be.ctx, &a.f[b]));
            float *dtw = dalloc(4 * n * k);
            CU(bench_fill_f32(dtw, n * k, 200 + b, 1.0f, stream));
            void *dx = dalloc(2 * n * h);
            CU(bench_fill_bf16(dx, n * h, 300 + b, 0.01f, stream));
            a.b[b] = (moe_router_bwd_t){.n = n,
                                        .h = h,
                                        .e = (int32_t)e,
                                        .k = (int32_t)k,
                                        .score_fn = MOE_SCORE_SOFTMAX,
                                        .renormalize = true,
                                        .x = x,
                                        .wg = wg,
                                        .logits = a.f[b].logits,
                                        .topk_idx = a.f[b].topk_idx,
                                        .topk_w = a.f[b].topk_w,
                                        .d_topk_w = dtw,
                                        .counts = a.f[b].counts,
                                        .aux_coef = 0.01f,
                                        .z_coef = 0.001f,
                                        .dlogits = dalloc(4 * n * e),
                                        .dx = dx,
                                        .dwg = dwg};
        }
        char shape[96];
        snprintf(shape, sizeof shape, "N=%lld H=%lld E=%lld K=%lld", (long long)n, (long long)h,
                 (long long)e, (long long)k);
        int iters = n >= 65536 ? 30 : 200;
        double flops_f = 2.0 * n * h * e;
        double bytes_f = 2.0 * n * h + 2.0 * h * e + 4.0 * n * e + 8.0 * n * k;
        double fl_hbm = bytes_f / HBM_BPS * 1e3, fl_tc = flops_f / TC_FLOPS * 1e3, ms;
        /* both forward paths where the fused kernel applies (auto picks one by N and H) */
        cuda_ctx_t *c = be.ctx;
        c->router_mode = CUDA_ROUTER_FUSED;
        bool fused = moe_cuda_router_uses_fused(c, &a.f[0]);
        for (int m = fused ? 0 : 1; m < 2; m++) {
            c->router_mode = m == 0 ? CUDA_ROUTER_FUSED : CUDA_ROUTER_GEMM;
            ms = time_median(stream, run_router_fwd, &a, 5, iters);
            emit("router_fwd", shape, m == 0 ? "fused" : "gemm+select", ms, fmax(fl_hbm, fl_tc),
                 fl_hbm >= fl_tc ? "hbm" : "tc", flops_f / ms * 1e-9);
            ms = time_stream(stream, run_router_fwd, &a, 5, iters);
            emit("router_fwd_stream", shape, m == 0 ? "fused" : "gemm+select", ms,
                 fmax(fl_hbm, fl_tc), fl_hbm >= fl_tc ? "hbm" : "tc", flops_f / ms * 1e-9);
        }
        c->router_mode = CUDA_ROUTER_AUTO;
        ms = time_median(stream, run_router_select, &a, 5, iters);
        emit("router_select_only", shape, "select", ms, 4.0 * n * e / HBM_BPS * 1e3, "hbm", 0);
        /* backward: read x, logits, write dlogits, write dx (the layer's call: the router is
         * dx's first writer) or read+write it; two GEMMs */
        double flops_b = 4.0 * n * h * e;
        for (int add = 0; add < 2; add++) {
            for (int b = 0; b < 3; b++) a.b[b].overwrite_dx = !add;
            double bytes_b = 2.0 * n * h + 4.0 * n * e * 2 + (add ? 4.0 : 2.0) * n * h +
                             4.0 * h * e * 2;
            ms = time_median(stream, run_router_bwd, &a, 5, iters);
            fl_hbm = bytes_b / HBM_BPS * 1e3;
            fl_tc = flops_b / TC_FLOPS * 1e3;
            emit("router_bwd", shape, add ? "add to dx" : "write dx", ms, fmax(fl_hbm, fl_tc),
                 fl_hbm >= fl_tc ? "hbm" : "tc", flops_b / ms * 1e-9);
        }
        CU(cudaDeviceSynchronize());
        for (int b = 0; b < 3; b++) {
            void *p[] = {(void *)a.f[b].x, a.f[b].logits,           a.f[b].topk_idx,
                         a.f[b].topk_w,    a.f[b].counts,           a.f[b].score_mean,
                         a.f[b].stats,     (void *)a.b[b].d_topk_w, a.b[b].dx,
                         a.b[b].dlogits};
            for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
        }
        cudaFree(wg);
        cudaFree(dwg);
        cudaFree(a.scratch);
        cudaFree(a.state);
    }
}

/* ---- experts ------------------------------------------------------------------------------ */

typedef struct experts_arg {
    moe_backend_t be;
    moe_experts_t x;
    int64_t *offsets;     /* x.host_offsets */
    const int64_t *fresh; /* the load's rows, moved a little before each run; or NULL */
    int variant;          /* the variant measured, for refresh_counts */
} experts_arg_t;

/* The "fresh counts" load: before run i of variant v, expert 2j + 1 gives expert 2j
 * (1 + 7 i + 977 v + 13 j) mod (its rows + 1) rows, so that the counts, and with them the
 * per-expert GEMMs' shapes, change from run to run and from variant to variant (few sizes
 * come back, as in training, where the routing changes every step), while the total stays. */
static void refresh_counts(experts_arg_t *a, int i)
{
    if (!a->fresh) return;
    int32_t el = a->x.el;
    for (int32_t e = 0; e < el; e++) {
        int64_t n = a->fresh[e];
        if (e + 1 < el || e % 2) {
            int64_t odd = a->fresh[e | 1];
            int64_t move = (1 + 7 * (int64_t)i + 977 * (int64_t)a->variant + 13 * (e / 2)) %
                           (odd + 1);
            n += e % 2 ? -move : move;
        }
        a->offsets[e + 1] = a->offsets[e] + n;
    }
}

static void run_experts_fwd(void *p, int i)
{
    experts_arg_t *a = p;
    refresh_counts(a, i);
    CK(a->be.ops->experts_forward(a->be.ctx, &a->x));
}

static void run_experts_bwd(void *p, int i)
{
    experts_arg_t *a = p;
    refresh_counts(a, i);
    CK(a->be.ops->experts_backward(a->be.ctx, &a->x));
}

/* The loads of the experts part, each the same total rows R = El * T (bench/torch_moe.py has
 * the same arithmetic, integers only, so both measure the same counts). Expert e holds
 * popularity rank e * 37 % El (spreading the busy ranks over the experts):
 *   ""        every expert T rows
 *   routed    T + 2.5 sqrt(T) x [-1, 1) by rank, about the spread of random top-k routing
 *   uneven    [0.25, 1.75) x T by rank
 *   skewed    heavy-tailed, as early training gives: the first 3/4 of the ranks share the rows
 *             Zipf-like, as 1 / (r + El/16) (the busiest 4.3-6.3 x the mean), the last
 *             quarter near-empty (T/64 rows, the last rank none)
 *   hot       one expert a quarter of the rows, the others the same share of the rest
 *   skewed, fresh counts  skewed with rows moved between neighbouring experts before each run
 *             (refresh_counts); libmoe's modes alone (PyTorch's one grouped call takes its
 *             counts on the device)
 *   replay Ll the per-expert counts of layer l in the last line of MOE_BENCH_COUNTS (the
 *             trainer's metrics file, JSON lines with layers[].tokens_per_expert), scaled to R;
 *             on the shapes whose El is the file's expert count
 * Every remainder goes to the rank 0 expert. */
enum { LOAD_EVEN, LOAD_ROUTED, LOAD_UNEVEN, LOAD_SKEWED, LOAD_HOT, LOAD_FRESH, LOAD_REPLAY };

static void expert_rows(int load, int32_t el, int64_t t, const int64_t *replay, int64_t *rows)
{
    int64_t r = el * t, acc = 0, tail = el / 4, w_sum = 0, counted = 0;
    for (int32_t e = 0; e < el; e++) {
        int32_t rank = (int32_t)(e * 37 % el);
        double u = (rank + 0.5) / el;
        int64_t n = t;
        if (load == LOAD_ROUTED) n = (int64_t)(t + 2.5 * sqrt((double)t) * (2 * u - 1));
        if (load == LOAD_UNEVEN) n = (int64_t)(t * (0.25 + 1.5 * u));
        if (load == LOAD_HOT) n = rank == 0 ? r / 4 : (r - r / 4) / (el - 1);
        bool skewed = load == LOAD_SKEWED || load == LOAD_FRESH;
        if (skewed && rank >= el - tail) n = rank == el - 1 ? 0 : t / 64;
        if (skewed && rank < el - tail) {
            n = 0; /* after the tail is counted */
            w_sum += ((int64_t)1 << 40) / (16 * rank + el);
        }
        if (load == LOAD_REPLAY) counted += replay[e];
        rows[e] = n;
        acc += n;
    }
    if (load == LOAD_SKEWED || load == LOAD_FRESH) {
        int64_t head = r - acc;
        for (int32_t e = 0; e < el; e++) {
            int32_t rank = (int32_t)(e * 37 % el);
            if (rank >= el - tail) continue;
            rows[e] = head * (((int64_t)1 << 40) / (16 * rank + el)) / w_sum;
            acc += rows[e];
        }
    }
    if (load == LOAD_REPLAY) {
        acc = 0;
        for (int32_t e = 0; e < el; e++) {
            rows[e] = counted > 0 ? replay[e] * r / counted : t;
            acc += rows[e];
        }
    }
    for (int32_t e = 0; e < el; e++)
        if (e * 37 % el == 0) rows[e] += r - acc;
}

/* The per-expert counts of every layer in the last metrics line of `path` with El experts
 * (layers x El values, *layers of them), or NULL when the file has none. */
static int64_t *replay_counts(const char *path, int32_t el, int *layers)
{
    *layers = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "MOE_BENCH_COUNTS=%s: cannot open\n", path);
        exit(1);
    }
    char *line = NULL, *last = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0)
        if (strstr(line, "\"tokens_per_expert\"")) {
            free(last);
            last = strdup(line);
        }
    free(line);
    fclose(f);
    cJSON *doc = last ? cJSON_Parse(last) : NULL;
    free(last);
    cJSON *ls = cJSON_GetObjectItemCaseSensitive(doc, "layers");
    int n = cJSON_GetArraySize(ls);
    int64_t *out = n > 0 ? calloc((size_t)n * (size_t)el, sizeof(int64_t)) : NULL;
    for (int l = 0; out && l < n; l++) {
        cJSON *c = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(ls, l), "tokens_per_expert");
        if (cJSON_GetArraySize(c) != el) continue;
        for (int32_t e = 0; e < el; e++)
            out[(size_t)*layers * el + e] = (int64_t)cJSON_GetNumberValue(cJSON_GetArrayItem(c, e));
        (*layers)++;
    }
    cJSON_Delete(doc);
    if (*layers == 0) {
        free(out);
        out = NULL;
    }
    return out;
}

static const char *mode_name(cuda_gemm_mode_t m)
{
    static const char *names[] = {"auto", "loop", "streams", "batched", "grouped", "hopper"};
    return m >= CUDA_GEMM_AUTO && m <= CUDA_GEMM_HOPPER ? names[m] : "?";
}

static void bench_experts(moe_backend_t be, cudaStream_t stream, int only)
{
    /* issue 31's five (fine-grained E=64, DeepSeek-V3-like at ep = 8, Qwen3-MoE-like, a few
     * large experts), the experts of the second and third layer shapes, and those of the
     * bundled trainer's fine-grained model (16384 tokens, top-6 of 64); bench/torch_moe.py has
     * the same list */
    const int64_t shapes[][4] = {{64, 512, 2048, 1408},  {64, 512, 4096, 1408},
                                 {32, 1024, 7168, 2048}, {128, 256, 2048, 768},
                                 {8, 4096, 4096, 14336}, {16, 2048, 2048, 8192},
                                 {8, 4096, 2048, 8192},  {64, 1536, 2048, 1408}};
    cuda_ctx_t *c = be.ctx;
    const char *forced = getenv("MOE_CUDA_EXPERT_GEMM");
    const char *counts_file = getenv("MOE_BENCH_COUNTS");
    /* the modes, then (on Hopper, no mode forced) auto with the opt-in SwiGLU GEMMs; the
     * backward writes the weight gradients (a step's first backward after the gradients were
     * discarded, as the layer runs it), and auto again adds into them (accumulation) */
    typedef struct variant {
        const char *name;
        cuda_gemm_mode_t mode;
        bool swiglu_gemm, accumulate;
    } variant_t;
    const variant_t variants[] = {{"auto", CUDA_GEMM_AUTO, false, false},
                                  {"loop", CUDA_GEMM_LOOP, false, false},
                                  {"streams", CUDA_GEMM_STREAMS, false, false},
                                  {"batched", CUDA_GEMM_BATCHED, false, false},
                                  {"grouped", CUDA_GEMM_GROUPED, false, false},
                                  {"hopper", CUDA_GEMM_HOPPER, false, false},
                                  {"auto, SwiGLU GEMMs", CUDA_GEMM_AUTO, true, false},
                                  {"auto, dW +=", CUDA_GEMM_AUTO, false, true}};
    bool as_set = c->swiglu_gemm;
    bool extra = !as_set && !(forced && *forced) && moe_cuda_swiglu_gemm_supported(c->device);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        if (only >= 0 && (size_t)only != s) continue;
        int32_t el = (int32_t)shapes[s][0];
        int64_t t = shapes[s][1], h = shapes[s][2], f = shapes[s][3], r = el * t;
        int64_t *off = calloc((size_t)el + 1, sizeof(int64_t));
        int64_t *rows = calloc((size_t)el, sizeof(int64_t));
        int replay_layers = 0;
        int64_t *replay = counts_file && *counts_file
                              ? replay_counts(counts_file, el, &replay_layers)
                              : NULL;
        experts_arg_t a = {.be = be, .offsets = off};
        a.x = (moe_experts_t){.h = h,
                              .f = f,
                              .el = el,
                              .host_offsets = off,
                              .w1 = dalloc(2 * el * h * 2 * f),
                              .w2 = dalloc(2 * el * f * h),
                              .xp = dalloc(2 * r * h),
                              .hpre = dalloc(2 * r * 2 * f),
                              .act = dalloc(2 * r * f),
                              .out = dalloc(2 * r * h),
                              .d_out = dalloc(2 * r * h),
                              .d_xp = dalloc(2 * r * h),
                              .dw1 = dalloc(4 * el * h * 2 * f),
                              .dw2 = dalloc(4 * el * f * h),
                              .scratch = dalloc(2 * r * 3 * f)};
        CU(bench_fill_bf16((void *)a.x.w1, el * h * 2 * f, 11, 1.0f / sqrtf((float)h), stream));
        CU(bench_fill_bf16((void *)a.x.w2, el * f * h, 12, 1.0f / sqrtf((float)f), stream));
        CU(bench_fill_bf16((void *)a.x.xp, r * h, 13, 1.0f, stream));
        CU(bench_fill_bf16((void *)a.x.d_out, r * h, 14, 1.0f, stream));
        CU(bench_fill_f32(a.x.dw1, el * h * 2 * f, 15, 0.0f, stream));
        CU(bench_fill_f32(a.x.dw2, el * f * h, 16, 0.0f, stream));
        const char *load_names[] = {"",        " routed", " uneven",
                                    " skewed", " hot",    " skewed, fresh counts"};
        for (int load = 0; load < LOAD_REPLAY + replay_layers; load++) {
            int kind = load < LOAD_REPLAY ? load : LOAD_REPLAY;
            expert_rows(kind, el, t, replay ? replay + (size_t)(load - kind) * el : NULL, rows);
            int64_t most = 0;
            for (int32_t e = 0; e < el; e++) {
                off[e + 1] = off[e] + rows[e];
                most = rows[e] > most ? rows[e] : most;
            }
            char shape[96];
            if (kind == LOAD_REPLAY)
                snprintf(shape, sizeof shape, "E=%d T=%lld H=%lld F=%lld replay L%d", el,
                         (long long)t, (long long)h, (long long)f, load - kind);
            else
                snprintf(shape, sizeof shape, "E=%d T=%lld H=%lld F=%lld%s", el, (long long)t,
                         (long long)h, (long long)f, load_names[load]);
            fprintf(stderr, "%s: busiest expert %.2f x the mean rows\n", shape,
                    (double)most / (double)t);
            /* the mode auto takes on these counts, so that its pick's own column can be read
             * against the fastest (auto's runs come first, at another clock) */
            c->gemm_mode = CUDA_GEMM_AUTO;
            c->swiglu_gemm = as_set;
            printf("{\"impl\":\"libmoe\",\"bench\":\"experts_pick\",\"shape\":\"%s\","
                   "\"variant\":\"auto\",\"picks\":\"%s\"}\n",
                   shape, mode_name(moe_cuda_experts_mode(c, &a.x)));
            a.fresh = kind == LOAD_FRESH ? rows : NULL;
            double flops = 6.0 * r * h * f;
            for (size_t m = 0; m < sizeof variants / sizeof variants[0]; m++) {
                const variant_t *v = &variants[m];
                if (kind != LOAD_EVEN && v->mode == CUDA_GEMM_BATCHED) continue;
                if (kind == LOAD_FRESH &&
                    (v->swiglu_gemm || v->accumulate || v->mode == CUDA_GEMM_GROUPED))
                    continue;
                if (v->swiglu_gemm && !extra) continue;
                if (forced && *forced && strcmp(forced, v->name) != 0) continue;
                c->gemm_mode = v->mode;
                c->swiglu_gemm = as_set || v->swiglu_gemm;
                a.x.overwrite_grads = !v->accumulate;
                a.variant = (int)m;
                double ms;
                if (!v->accumulate) {
                    ms = time_median(stream, run_experts_fwd, &a, 3, 20);
                    emit("experts_fwd", shape, v->name, ms, flops / TC_FLOPS * 1e3, "tc",
                         flops / ms * 1e-9);
                }
                ms = time_median(stream, run_experts_bwd, &a, 3, 10);
                emit("experts_bwd", shape, v->name, ms, 2 * flops / TC_FLOPS * 1e3, "tc",
                     2 * flops / ms * 1e-9);
            }
            c->gemm_mode = CUDA_GEMM_AUTO;
            c->swiglu_gemm = as_set;
            a.fresh = NULL;
        }
        CU(cudaDeviceSynchronize());
        void *p[] = {(void *)a.x.w1, (void *)a.x.w2, (void *)a.x.xp,    a.x.hpre,
                     a.x.act,        a.x.out,        (void *)a.x.d_out, a.x.d_xp,
                     a.x.dw1,        a.x.dw2,        a.x.scratch};
        for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
        free(off);
        free(rows);
        free(replay);
    }
}

/* ---- layer -------------------------------------------------------------------------------- */

typedef struct layer_arg {
    moe_layer_t *layer;
    moe_tensor_t x, y, dy, dx;
} layer_arg_t;

/* One training step's share of the layer: gradients discarded (the step's start, as
 * torch_moe.py's set_to_none), forward, backward. */
static void run_layer(void *p, int i)
{
    (void)i;
    layer_arg_t *a = p;
    CK(moe_layer_discard_grad(a->layer));
    CK(moe_layer_forward(a->layer, 0, &a->x, &a->y));
    CK(moe_layer_backward(a->layer, 0, &a->dy, &a->dx));
}

static void run_layer_fwd(void *p, int i)
{
    (void)i;
    layer_arg_t *a = p;
    CK(moe_layer_forward(a->layer, 0, &a->x, &a->y));
    CK(moe_layer_release_slot(a->layer, 0));
}

#define SUSTAIN_MS 3000.0 /* of layer steps before the sustained figure is timed */

/* Skewed routing, as early training produces (expert popularity Zipf-like): a constant last
 * feature of x (1) and router weights in its row of -alpha * tau * ln(1 + e) for expert e,
 * tau = 0.02 sqrt(H / 3) the spread of the other logits (x uniform in [-1, 1), weights
 * N(0, 0.02^2)), so each logit gets a shift of alpha * ln(1 + e) noise widths.
 * bench/torch_moe.py builds its layer's the same way. */
static void skew_routing(moe_layer_t *layer, moe_tensor_t *x, int64_t n, int64_t h, int64_t e,
                         double alpha)
{
    moe_param_info_t wg = {.struct_size = sizeof wg};
    CK(moe_layer_param(layer, 0, &wg));
    double tau = 0.02 * sqrt((double)h / 3.0);
    uint16_t *row = malloc(sizeof(uint16_t) * (size_t)e),
             *ones = malloc(sizeof(uint16_t) * (size_t)n);
    if (!row || !ones) exit(1);
    for (int64_t t = 0; t < n; t++) ones[t] = 0x3F80; /* bf16 1.0 */
    for (int64_t i = 0; i < e; i++) {
        float v = (float)(-alpha * tau * log1p((double)i));
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        row[i] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16); /* round to nearest even */
    }
    CU(cudaMemcpy((uint16_t *)wg.value.data + (h - 1) * e, row, sizeof(uint16_t) * (size_t)e,
                  cudaMemcpyHostToDevice));
    CU(cudaMemcpy2D((uint16_t *)x->data + (h - 1), sizeof(uint16_t) * (size_t)h, ones,
                    sizeof(uint16_t), sizeof(uint16_t), (size_t)n, cudaMemcpyHostToDevice));
    free(row);
    free(ones);
}

static void bench_layer(cudaStream_t stream, int only, bool profile)
{
    const int64_t shapes[][5] = {
        {16384, 4096, 1408, 64, 2}, {16384, 2048, 8192, 8, 2}, {32768, 4096, 14336, 8, 2}};
    /* the skew's alpha a shape: the busiest expert gets ~1.75 x the mean load (a simulation of
     * top-2 over Gaussian logits; the run prints the measured ratio) */
    const double skew_alpha[] = {0.08, 0.4, 0.4};
    const char *names[] = {"auto", "loop", "streams", "hopper"};
    const cuda_gemm_mode_t modes[] = {CUDA_GEMM_AUTO, CUDA_GEMM_LOOP, CUDA_GEMM_STREAMS,
                                      CUDA_GEMM_HOPPER};
    const char *forced = getenv("MOE_CUDA_EXPERT_GEMM");
    int nmodes = forced && *forced ? 1 : 4;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        if (only >= 0 && (size_t)only != s) continue;
        int64_t n = shapes[s][0], h = shapes[s][1], f = shapes[s][2], e = shapes[s][3],
                k = shapes[s][4];
        moe_runtime_config_t rc = moe_runtime_config_default();
        rc.backend = MOE_BACKEND_CUDA;
        moe_runtime_t *rt;
        CK(moe_runtime_create(&rc, &rt));
        CK(moe_runtime_set_stream(rt, stream));
        moe_layer_config_t cfg = moe_layer_config_default();
        cfg.hidden = h;
        cfg.ffn_hidden = f;
        cfg.num_experts = (int32_t)e;
        cfg.top_k = (int32_t)k;
        layer_arg_t a;
        CK(moe_layer_create(rt, &cfg, &a.layer));
        int64_t shape[2] = {n, h};
        moe_tensor_t *ts[] = {&a.x, &a.y, &a.dy, &a.dx};
        for (int i = 0; i < 4; i++)
            CK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, MOE_DEVICE_CUDA, 2, shape, ts[i]));
        CU(bench_fill_bf16(a.x.data, n * h, 21 + s, 1.0f, stream));
        CU(bench_fill_bf16(a.dy.data, n * h, 22 + s, 1.0f, stream));
        char sh[96];
        snprintf(sh, sizeof sh, "N=%lld H=%lld F=%lld E=%lld K=%lld", (long long)n, (long long)h,
                 (long long)f, (long long)e, (long long)k);
        double r = (double)n * k;
        double flops = 3 * (2.0 * n * h * e) + 3 * (6.0 * r * h * f);
        cuda_ctx_t *c = MOE_CTX(rt);
        if (profile) {
            const char *warm = getenv("MOE_PROFILE_WARMUP");
            int steps = warm && *warm ? atoi(warm) : 2;
            for (int i = 0; i < steps; i++) run_layer(&a, i);
            CU(cudaStreamSynchronize(stream));
            CU(cudaProfilerStart());
            run_layer(&a, steps);
            CU(cudaStreamSynchronize(stream));
            CU(cudaProfilerStop());
        } else {
            /* the modes, then (on Hopper, no mode forced) auto with the opt-in SwiGLU GEMMs;
             * again with skewed routing */
            bool as_set = c->swiglu_gemm;
            bool extra = !as_set && nmodes > 1 && moe_cuda_swiglu_gemm_supported(c->device);
            for (int skewed = 0; skewed < 2; skewed++) {
                char name[128];
                snprintf(name, sizeof name, "%s%s", sh, skewed ? " skewed" : "");
                if (skewed) {
                    skew_routing(a.layer, &a.x, n, h, e, skew_alpha[s]);
                    run_layer_fwd(&a, 0);
                    moe_layer_stats_t st = {.struct_size = sizeof st};
                    CK(moe_layer_stats(a.layer, &st, NULL));
                    fprintf(stderr, "%s: busiest expert %.2f x the mean load\n", name,
                            st.max_load / st.mean_load);
                }
                double first_ms = 0;
                for (int m = 0; m < nmodes + extra; m++) {
                    bool fused = m == nmodes; /* the extra run */
                    const char *v = fused               ? "auto, SwiGLU GEMMs"
                                    : forced && *forced ? forced
                                                        : names[m];
                    if (nmodes > 1) c->gemm_mode = fused ? CUDA_GEMM_AUTO : modes[m];
                    c->swiglu_gemm = as_set || fused;
                    double ms = time_median(stream, run_layer, &a, 2, 10);
                    emit("layer_fwd_bwd", name, v, ms, flops / TC_FLOPS * 1e3, "tc",
                         flops / ms * 1e-9);
                    if (m == 0) first_ms = ms;
                    ms = time_median(stream, run_layer_fwd, &a, 2, 10);
                    emit("layer_fwd", name, v, ms, flops / 3 / TC_FLOPS * 1e3, "tc",
                         flops / 3 / ms * 1e-9);
                }
                if (nmodes > 1) c->gemm_mode = modes[0];
                c->swiglu_gemm = as_set;
                if (skewed) continue;
                /* The first variant again, timed after SUSTAIN_MS of steps: at the smaller
                 * shapes the 12 steps above end before the GPU's power cap has lowered the
                 * clock all the way, and a training job runs at the lowered clock */
                double ms = time_median(stream, run_layer, &a, (int)(SUSTAIN_MS / first_ms) + 2,
                                        20);
                emit("layer_fwd_bwd_sustained", sh, forced && *forced ? forced : names[0], ms,
                     flops / TC_FLOPS * 1e3, "tc", flops / ms * 1e-9);
            }
        }
        for (int i = 0; i < 4; i++) CK(moe_tensor_free(rt, ts[i]));
        CK(moe_layer_destroy(a.layer));
        CK(moe_runtime_set_stream(rt, NULL));
        CK(moe_runtime_destroy(rt));
    }
}

int main(int argc, char **argv)
{
    const char *what = argc > 1 ? argv[1] : "all";
    if (moe_backend_cuda_device_count() <= 0) {
        fprintf(stderr, "no CUDA device\n");
        return 77;
    }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    snprintf(gpu_name, sizeof gpu_name, "%s", prop.name);
    time_t now = time(NULL);
    strftime(today, sizeof today, "%Y-%m-%dT%H:%MZ", gmtime(&now));
    cudaStream_t stream;
    CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    moe_backend_params_t bp = {.device_index = 0, .deterministic = true, .logger = NULL};
    moe_backend_t be;
    CK(moe_backend_cuda_create(&bp, &be));
    CK(be.ops->set_stream(be.ctx, stream));
    int only = argc > 2 ? atoi(argv[2]) : -1;
    if (!strcmp(what, "router") || !strcmp(what, "all")) bench_router(be, stream, only);
    if (!strcmp(what, "experts") || !strcmp(what, "all")) bench_experts(be, stream, only);
    CK(be.ops->set_stream(be.ctx, NULL));
    be.ops->destroy(be.ctx);
    if (!strcmp(what, "layer") || !strcmp(what, "all")) bench_layer(stream, only, false);
    if (!strcmp(what, "profile")) bench_layer(stream, only, true);
    cudaStreamDestroy(stream);
    return 0;
}
