/*
 * Every algorithm cublasLt's heuristic offers for a GEMM, timed one by one against
 * cublasGemmEx's default choice (variant "gemmex"): is a GEMM slow because of the pick?
 * Groups (the first argument; default all):
 *   router_dx   the router backward's dx = dlogits . wg^T (bf16 C), beta 1 (add) and 0 (write),
 *               at the two large router bench shapes;
 *   logits      the router forward's logits GEMM at N=65536 H=7168 E=256 (f32 C);
 *   logits_small the same GEMM at the small router shapes and N=16384 H=4096 E=64, x rotated
 *               over 3 copies as bench_moe does (cold);
 *   logits_sweep the shape N=4096 H=2048 E=64 as in logits_small, and beside the heuristic's
 *               offers every configuration cublasLt accepts (each algorithm id and each offer x
 *               tile x cluster shape x custom option x split-K x reduction scheme); only the
 *               fastest 12 of those are printed, re-timed;
 *   experts     the six expert GEMM kinds of layer shape 1 (H=2048 F=8192) for one expert
 *               of 4096 rows, as cuda_experts.c issues them (f32 weight gradients, beta 0);
 *   wgrad       layer shape 0's weight gradients (H=4096 F=1408, 64 experts padded to 584
 *               rows: strided batched, k = 584), with f32 output as the layer writes them and
 *               with bf16 output for comparison.
 * Method as bench_moe: CUDA events around each call, warm-up, median of 20, random data.
 * Each algorithm's line also gives its configuration (cublasLtMatmulAlgoConfigAttributes_t:
 * id, tile, stages, split-K, reduction scheme, swizzle, custom option, cluster shape) and
 * whether its output equals the default's bit for bit ("same") and its own on a second call
 * ("repeat": run-to-run determinism, which a split-K reduction could lose).
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "bench_fill.h"

#define CU(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));             \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define BL(x)                                                                                      \
    do {                                                                                           \
        cublasStatus_t s_ = (x);                                                                   \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            fprintf(stderr, "%s:%d cublas %d\n", __FILE__, __LINE__, (int)s_);                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define RUNS 20
#define WS_BYTES (32u << 20)

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* column-major C[m,n] = op(A)[m,k] . op(B)[k,n], bf16 A and B, f32 compute */
typedef struct gemm {
    const char *group, *label;
    cublasOperation_t ta, tb;
    int64_t m, n, k;
    cudaDataType_t ctype;
    float beta;
    int batch;  /* problems; > 1: strided batched, operands packed one after the other */
    int copies; /* B rotates over this many (<= MAX_COPIES), call i using copy i % copies */
} gemm_t;

#define MAX_COPIES 3 /* bench_moe's router inputs rotate over 3 buffers: cold x */

typedef struct operands {
    void *a, *b[MAX_COPIES], *c;
} operands_t;

/* the algorithm's configuration as a JSON fragment */
static void describe_algo(const cublasLtMatmulAlgo_t *algo, char *out, size_t len)
{
    const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {CUBLASLT_ALGO_CONFIG_ID,
                                                          CUBLASLT_ALGO_CONFIG_TILE_ID,
                                                          CUBLASLT_ALGO_CONFIG_STAGES_ID,
                                                          CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                          CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                          CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
                                                          CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
                                                          CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
    const char *names[] = {"id",        "tile",    "stages", "splitk",
                           "reduction", "swizzle", "custom", "cluster"};
    size_t used = 0;
    for (size_t i = 0; i < sizeof attrs / sizeof attrs[0] && used < len; i++) {
        /* the attributes are 2 or 4 bytes: ask the size, then read that many (little-endian) */
        uint64_t v = 0;
        size_t size = 0;
        if (cublasLtMatmulAlgoConfigGetAttribute(algo, attrs[i], NULL, 0, &size) !=
                CUBLAS_STATUS_SUCCESS ||
            size > sizeof v ||
            cublasLtMatmulAlgoConfigGetAttribute(algo, attrs[i], &v, size, &size) !=
                CUBLAS_STATUS_SUCCESS)
            continue;
        used += (size_t)snprintf(out + used, len - used, ",\"%s\":%llu", names[i],
                                 (unsigned long long)v);
    }
}

static int64_t lda_of(const gemm_t *g) { return g->ta == CUBLAS_OP_N ? g->m : g->k; }
static int64_t ldb_of(const gemm_t *g) { return g->tb == CUBLAS_OP_N ? g->k : g->n; }

typedef struct lt_call {
    cublasHandle_t h;
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    void *ws;
    cudaStream_t s;
} lt_call_t;

/* one call of the algorithm (NULL: cublasGemmEx's default) on B copy `copy` */
static void run_gemm(const lt_call_t *c, const cublasLtMatmulAlgo_t *algo, const gemm_t *g,
                     const operands_t *o, int copy)
{
    const float one = 1.0f;
    const void *b = o->b[copy];
    if (algo)
        BL(cublasLtMatmul(c->lt, c->desc, &one, o->a, c->la, b, c->lb, &g->beta, o->c, c->lc, o->c,
                          c->lc, algo, c->ws, WS_BYTES, c->s));
    else if (g->batch > 1)
        BL(cublasGemmStridedBatchedEx(c->h, g->ta, g->tb, (int)g->m, (int)g->n, (int)g->k, &one,
                                      o->a, CUDA_R_16BF, (int)lda_of(g), g->m * g->k, b,
                                      CUDA_R_16BF, (int)ldb_of(g), g->k * g->n, &g->beta, o->c,
                                      g->ctype, (int)g->m, g->m * g->n, g->batch,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else
        BL(cublasGemmEx(c->h, g->ta, g->tb, (int)g->m, (int)g->n, (int)g->k, &one, o->a,
                        CUDA_R_16BF, (int)lda_of(g), b, CUDA_R_16BF, (int)ldb_of(g), &g->beta, o->c,
                        g->ctype, (int)g->m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* median ms of RUNS calls, B rotating over its copies */
static float time_gemm(const lt_call_t *c, const cublasLtMatmulAlgo_t *algo, const gemm_t *g,
                       const operands_t *o)
{
    cudaEvent_t ev[2 * RUNS];
    float ms[RUNS];
    for (int i = 0; i < 2 * RUNS; i++) CU(cudaEventCreate(&ev[i]));
    for (int i = -3; i < RUNS; i++) {
        if (i >= 0) CU(cudaEventRecord(ev[2 * i], c->s));
        run_gemm(c, algo, g, o, (i + 3) % g->copies);
        if (i >= 0) CU(cudaEventRecord(ev[2 * i + 1], c->s));
    }
    CU(cudaStreamSynchronize(c->s));
    for (int i = 0; i < RUNS; i++) CU(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    for (int i = 0; i < 2 * RUNS; i++) cudaEventDestroy(ev[i]);
    qsort(ms, RUNS, sizeof(float), cmp_float);
    return 0.5f * (ms[RUNS / 2 - 1] + ms[RUNS / 2]);
}

/* C after one call on B copy 0, into out (beta 0 only: C is then the call's own output) */
static void output_of(const lt_call_t *c, const cublasLtMatmulAlgo_t *algo, const gemm_t *g,
                      const operands_t *o, void *out, size_t bytes)
{
    run_gemm(c, algo, g, o, 0);
    CU(cudaMemcpyAsync(out, o->c, bytes, cudaMemcpyDeviceToHost, c->s));
    CU(cudaStreamSynchronize(c->s));
}

typedef struct timed {
    cublasLtMatmulAlgo_t algo;
    float ms, waves;
} timed_t;

static int cmp_timed(const void *a, const void *b)
{
    float x = ((const timed_t *)a)->ms, y = ((const timed_t *)b)->ms;
    return (x > y) - (x < y);
}

/* the configuration's fields that sweep_configs varies */
static void set_config(cublasLtMatmulAlgo_t *algo, uint32_t tile, uint16_t cluster, uint32_t custom,
                       int32_t splitk, uint32_t scheme)
{
    cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile);
    cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster,
                                         sizeof cluster);
    cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom,
                                         sizeof custom);
    cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                         sizeof splitk);
    cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                         sizeof scheme);
}

static int algo_id(const cublasLtMatmulAlgo_t *algo)
{
    int32_t id = -1;
    size_t size = 0;
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &size);
    return id;
}

/* the heuristic's offer i is the first with its algorithm id (the sweep varies the rest) */
static bool first_of_its_id(const cublasLtMatmulHeuristicResult_t *offers, int i)
{
    for (int j = 0; j < i; j++)
        if (algo_id(&offers[j].algo) == algo_id(&offers[i].algo)) return false;
    return true;
}

/* Every configuration cublasLt accepts for this GEMM, starting from each algorithm id and from
 * each of the heuristic's offers (whose ids GetIds may not list): each tile the algorithm
 * lists (else its own), each cluster shape id up to 40 and custom option up to its maximum,
 * split-K 1 (no reduction) or 2/3/4/8 with each reduction scheme it supports. Returns how many
 * were timed (at most cap), in out. */
static int sweep_configs(const lt_call_t *c, const gemm_t *g, const operands_t *o,
                         const cublasLtMatmulHeuristicResult_t *offers, int noffers, timed_t *out,
                         int cap)
{
    int ids[256], nids = 0, n = 0;
    cudaDataType_t ct = g->ctype;
    BL(cublasLtMatmulAlgoGetIds(c->lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, ct,
                                ct, 256, ids, &nids));
    for (int a = 0; a < nids + noffers; a++) {
        cublasLtMatmulAlgo_t algo;
        if (a >= nids) {
            if (!first_of_its_id(offers, a - nids)) continue;
            algo = offers[a - nids].algo;
        } else if (cublasLtMatmulAlgoInit(c->lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF,
                                          CUDA_R_16BF, ct, ct, ids[a],
                                          &algo) != CUBLAS_STATUS_SUCCESS) {
            continue;
        }
        uint32_t tiles[256], nt = 0, splitk_ok = 0, schemes = 0, custom_max = 0;
        size_t size = 0;
        if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, tiles,
                                              sizeof tiles, &size) == CUBLAS_STATUS_SUCCESS)
            nt = (uint32_t)(size / sizeof tiles[0]);
        if (nt == 0 &&
            cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tiles[0],
                                                 sizeof tiles[0], &size) == CUBLAS_STATUS_SUCCESS)
            nt = 1;
        cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk_ok,
                                          sizeof splitk_ok, &size);
        cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &schemes,
                                          sizeof schemes, &size);
        cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max,
                                          sizeof custom_max, &size);
        const int32_t splits[] = {1, 2, 3, 4, 8};
        for (uint32_t t = 0; t < nt; t++)
            for (uint16_t cl = 0; cl <= 40; cl++)
                for (uint32_t cu = 0; cu <= custom_max && cu < 16; cu++)
                    for (size_t si = 0; si < sizeof splits / sizeof splits[0]; si++) {
                        if (splits[si] > 1 && !splitk_ok) break;
                        for (uint32_t scheme = 0; scheme <= CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
                             scheme = scheme ? scheme << 1 : 1) {
                            if ((splits[si] == 1) != (scheme == 0)) continue;
                            if (scheme && !(schemes & scheme)) continue;
                            set_config(&algo, tiles[t], cl, cu, splits[si], scheme);
                            cublasLtMatmulHeuristicResult_t r;
                            if (n == cap ||
                                cublasLtMatmulAlgoCheck(c->lt, c->desc, c->la, c->lb, c->lc, c->lc,
                                                        &algo, &r) != CUBLAS_STATUS_SUCCESS ||
                                r.workspaceSize > WS_BYTES)
                                continue;
                            out[n] = (timed_t){algo, time_gemm(c, &algo, g, o), r.wavesCount};
                            n++;
                        }
                    }
    }
    return n;
}

/* one JSON line: the call's time, configuration, and whether its output equals the default's
 * ("same", beta 0 only) and its own on a second call ("repeat"); out and again: host buffers
 * of cbytes for the two outputs */
static void report(const lt_call_t *c, const gemm_t *g, const operands_t *o, const char *shape,
                   const char *variant, const cublasLtMatmulAlgo_t *algo, float ms, float waves,
                   const unsigned char *ref, unsigned char *out, unsigned char *again,
                   size_t cbytes)
{
    double flops = 2.0 * g->m * g->n * g->k * g->batch;
    size_t csize = g->ctype == CUDA_R_32F ? 4 : 2;
    double bytes = g->batch * (2.0 * (g->m * g->k + g->k * g->n) +
                               (double)csize * g->m * g->n * (g->beta != 0 ? 2 : 1));
    const char *same = "null", *repeat = "null";
    if (g->beta == 0 && algo) {
        output_of(c, algo, g, o, out, cbytes);
        same = memcmp(ref, out, cbytes) ? "false" : "true";
        output_of(c, algo, g, o, again, cbytes);
        repeat = memcmp(again, out, cbytes) ? "false" : "true";
    } else if (g->beta == 0) {
        same = "true";
    }
    char config[256] = "";
    if (algo) describe_algo(algo, config, sizeof config);
    printf("{\"bench\":\"gemm_algo\",\"shape\":\"%s\",\"variant\":\"%s\",\"ms\":%.4f,"
           "\"tbps\":%.2f,\"tflops\":%.1f,\"waves\":%.2f,\"same\":%s,\"repeat\":%s%s}\n",
           shape, variant, ms, bytes / ms * 1e-9, flops / ms * 1e-9, waves, same, repeat, config);
}

int main(int argc, char **argv)
{
    const char *only = argc > 1 ? argv[1] : NULL;
    const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
    const cudaDataType_t BF = CUDA_R_16BF, F32 = CUDA_R_32F;
    /* router dx: m = H, n = N, k = E; experts: H = 2048, F = 8192, 4096 rows (see describe()
     * in cuda_experts.c for the operands) */
    gemm_t gemms[] = {
        {"router_dx", "dx add", T, N, 7168, 65536, 256, BF, 1.0f, 1, 1},
        {"router_dx", "dx write", T, N, 7168, 65536, 256, BF, 0.0f, 1, 1},
        {"router_dx", "dx add", T, N, 4096, 65536, 64, BF, 1.0f, 1, 1},
        {"router_dx", "dx write", T, N, 4096, 65536, 64, BF, 0.0f, 1, 1},
        {"logits", "logits", N, N, 256, 65536, 7168, F32, 0.0f, 1, 1},
        {"logits_sweep", "logits", N, N, 64, 4096, 2048, F32, 0.0f, 1, 3},
        {"logits_small", "logits", N, N, 64, 4096, 2048, F32, 0.0f, 1, 3},
        {"logits_small", "logits", N, N, 64, 2048, 1024, F32, 0.0f, 1, 3},
        {"logits_small", "logits", N, N, 32, 1024, 512, F32, 0.0f, 1, 3},
        {"logits_small", "logits", N, N, 64, 16384, 4096, F32, 0.0f, 1, 3},
        {"experts", "fwd1", N, N, 16384, 4096, 2048, BF, 0.0f, 1, 1},
        {"experts", "fwd2", N, N, 2048, 4096, 8192, BF, 0.0f, 1, 1},
        {"experts", "d_act", T, N, 8192, 4096, 2048, BF, 0.0f, 1, 1},
        {"experts", "dw2", N, T, 2048, 8192, 4096, F32, 0.0f, 1, 1},
        {"experts", "d_xp", T, N, 2048, 4096, 16384, BF, 0.0f, 1, 1},
        {"experts", "dw1", N, T, 16384, 2048, 4096, F32, 0.0f, 1, 1},
        {"wgrad", "dw1 x64", N, T, 2816, 4096, 584, F32, 0.0f, 64, 1},
        {"wgrad", "dw2 x64", N, T, 4096, 1408, 584, F32, 0.0f, 64, 1},
        {"wgrad", "dw1 x64 bf16 out", N, T, 2816, 4096, 584, BF, 0.0f, 64, 1},
        {"wgrad", "dw2 x64 bf16 out", N, T, 4096, 1408, 584, BF, 0.0f, 64, 1},
    };
    lt_call_t c = {0};
    CU(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
    BL(cublasCreate(&c.h));
    BL(cublasSetStream(c.h, c.s));
    BL(cublasLtCreate(&c.lt));
    CU(cudaMalloc(&c.ws, WS_BYTES));
    BL(cublasSetWorkspace(c.h, c.ws, WS_BYTES));
    enum { SWEEP_CAP = 20000, SWEEP_SHOWN = 12 };
    timed_t *swept = malloc(sizeof(timed_t) * SWEEP_CAP);
    if (!swept) return 1;
    for (size_t gi = 0; gi < sizeof gemms / sizeof gemms[0]; gi++) {
        gemm_t g = gemms[gi];
        operands_t o = {0};
        int64_t batch = g.batch;
        if (only && strcmp(only, g.group)) continue;
        size_t csize = g.ctype == F32 ? 4 : 2;
        CU(cudaMalloc(&o.a, 2 * g.m * g.k * batch));
        CU(bench_fill_bf16(o.a, g.m * g.k * batch, 1, 0.05f, c.s));
        for (int i = 0; i < g.copies; i++) {
            CU(cudaMalloc(&o.b[i], 2 * g.k * g.n * batch));
            CU(bench_fill_bf16(o.b[i], g.k * g.n * batch, 2 + (uint64_t)i, 0.05f, c.s));
        }
        CU(cudaMalloc(&o.c, csize * g.m * g.n * batch));
        CU(cudaMemsetAsync(o.c, 0, csize * g.m * g.n * batch, c.s));
        BL(cublasLtMatmulDescCreate(&c.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        BL(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof g.ta));
        BL(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof g.tb));
        BL(cublasLtMatrixLayoutCreate(&c.la, BF, (uint64_t)(g.ta == N ? g.m : g.k),
                                      (uint64_t)(g.ta == N ? g.k : g.m), lda_of(&g)));
        BL(cublasLtMatrixLayoutCreate(&c.lb, BF, (uint64_t)(g.tb == N ? g.k : g.n),
                                      (uint64_t)(g.tb == N ? g.n : g.k), ldb_of(&g)));
        BL(cublasLtMatrixLayoutCreate(&c.lc, g.ctype, (uint64_t)g.m, (uint64_t)g.n, g.m));
        if (batch > 1) {
            int32_t count = g.batch;
            int64_t strides[3] = {g.m * g.k, g.k * g.n, g.m * g.n};
            cublasLtMatrixLayout_t ls[3] = {c.la, c.lb, c.lc};
            for (int i = 0; i < 3; i++) {
                BL(cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                    &count, sizeof count));
                BL(cublasLtMatrixLayoutSetAttribute(ls[i],
                                                    CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                    &strides[i], sizeof strides[i]));
            }
        }
        cublasLtMatmulPreference_t pref;
        BL(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t wsb = WS_BYTES;
        BL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &wsb, sizeof wsb));
        cublasLtMatmulHeuristicResult_t res[32];
        int found = 0;
        BL(cublasLtMatmulAlgoGetHeuristic(c.lt, c.desc, c.la, c.lb, c.lc, c.lc, pref, 32, res,
                                          &found));
        char shape[128];
        snprintf(shape, sizeof shape, "%s m=%lld n=%lld k=%lld beta=%g", g.label, (long long)g.m,
                 (long long)g.n, (long long)g.k, g.beta);
        size_t cbytes = csize * (size_t)(g.m * g.n * batch);
        unsigned char *ref = malloc(cbytes), *out = malloc(cbytes), *again = malloc(cbytes);
        if (!ref || !out || !again) {
            fprintf(stderr, "out of host memory\n");
            return 1;
        }
        if (g.beta == 0) output_of(&c, NULL, &g, &o, ref, cbytes);
        report(&c, &g, &o, shape, "gemmex", NULL, time_gemm(&c, NULL, &g, &o), 0, ref, out, again,
               cbytes);
        for (int i = 0; i < found; i++) {
            if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
            char variant[16];
            snprintf(variant, sizeof variant, "lt%d", i);
            report(&c, &g, &o, shape, variant, &res[i].algo, time_gemm(&c, &res[i].algo, &g, &o),
                   res[i].wavesCount, ref, out, again, cbytes);
        }
        if (!strcmp(g.group, "logits_sweep")) {
            int n = sweep_configs(&c, &g, &o, res, found, swept, SWEEP_CAP);
            qsort(swept, (size_t)n, sizeof swept[0], cmp_timed);
            fprintf(stderr, "%s: %d configurations swept\n", shape, n);
            for (int i = 0; i < n && i < SWEEP_SHOWN; i++) {
                char variant[24];
                snprintf(variant, sizeof variant, "sweep%d", i);
                /* re-timed: the sweep's figure is the best of many, so biased low */
                report(&c, &g, &o, shape, variant, &swept[i].algo,
                       time_gemm(&c, &swept[i].algo, &g, &o), swept[i].waves, ref, out, again,
                       cbytes);
            }
        }
        free(ref);
        free(out);
        free(again);
        fflush(stdout);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(c.la);
        cublasLtMatrixLayoutDestroy(c.lb);
        cublasLtMatrixLayoutDestroy(c.lc);
        cublasLtMatmulDescDestroy(c.desc);
        cudaFree(o.a);
        for (int i = 0; i < g.copies; i++) cudaFree(o.b[i]);
        cudaFree(o.c);
    }
    free(swept);
    cudaFree(c.ws);
    cublasLtDestroy(c.lt);
    cublasDestroy(c.h);
    cudaStreamDestroy(c.s);
    return 0;
}
