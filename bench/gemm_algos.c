/*
 * Every algorithm cublasLt's heuristic offers for a GEMM, timed one by one against
 * cublasGemmEx's default choice (variant "gemmex"): is a GEMM slow because of the pick?
 * Groups (the first argument; default all):
 *   router_dx   the router backward's dx = dlogits . wg^T (bf16 C), beta 1 (add) and 0 (write),
 *               at the two large router bench shapes;
 *   logits      the router forward's logits GEMM at N=65536 H=7168 E=256 (f32 C);
 *   experts     the six expert GEMM kinds of layer shape 1 (H=2048 F=8192) for one expert
 *               of 4096 rows, as cuda_experts.c issues them (f32 weight gradients, beta 0);
 *   wgrad       layer shape 0's weight gradients (H=4096 F=1408, 64 experts padded to 584
 *               rows: strided batched, k = 584), with f32 output as the layer writes them and
 *               with bf16 output for comparison.
 * Method as bench_moe: CUDA events around each call, warm-up, median of 20, random data.
 * Each algorithm's line also gives its configuration (cublasLtMatmulAlgoConfigAttributes_t:
 * id, tile, stages, split-K, reduction scheme, swizzle, custom option, cluster shape) and
 * whether its output equals the default's bit for bit ("same").
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "bench_fill.h"

#define CU(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
#define BL(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d cublas %d\n", __FILE__, __LINE__, (int)s_); exit(1); } } while (0)

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
    int batch; /* problems; > 1: strided batched, operands packed one after the other */
} gemm_t;

typedef struct operands {
    void *a, *b, *c;
} operands_t;

/* the algorithm's configuration as a JSON fragment */
static void describe_algo(const cublasLtMatmulAlgo_t *algo, char *out, size_t len)
{
    const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
        CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
        CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
        CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
    const char *names[] = {"id", "tile", "stages", "splitk", "reduction", "swizzle", "custom",
                           "cluster"};
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

/* median ms of RUNS calls of the given algorithm (NULL: cublasGemmEx's default) */
static float time_gemm(cublasHandle_t h, cublasLtHandle_t lt, cublasLtMatmulDesc_t desc,
                       cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                       cublasLtMatrixLayout_t lc, const cublasLtMatmulAlgo_t *algo, void *ws,
                       const gemm_t *g, const operands_t *o, cudaStream_t s)
{
    const float one = 1.0f;
    cudaEvent_t ev[2 * RUNS];
    float ms[RUNS];
    for (int i = 0; i < 2 * RUNS; i++) CU(cudaEventCreate(&ev[i]));
    for (int i = -3; i < RUNS; i++) {
        if (i >= 0) CU(cudaEventRecord(ev[2 * i], s));
        if (algo)
            BL(cublasLtMatmul(lt, desc, &one, o->a, la, o->b, lb, &g->beta, o->c, lc, o->c, lc,
                              algo, ws, WS_BYTES, s));
        else if (g->batch > 1)
            BL(cublasGemmStridedBatchedEx(
                h, g->ta, g->tb, (int)g->m, (int)g->n, (int)g->k, &one, o->a, CUDA_R_16BF,
                (int)lda_of(g), g->m * g->k, o->b, CUDA_R_16BF, (int)ldb_of(g), g->k * g->n,
                &g->beta, o->c, g->ctype, (int)g->m, g->m * g->n, g->batch, CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT));
        else
            BL(cublasGemmEx(h, g->ta, g->tb, (int)g->m, (int)g->n, (int)g->k, &one, o->a,
                            CUDA_R_16BF, (int)lda_of(g), o->b, CUDA_R_16BF, (int)ldb_of(g),
                            &g->beta, o->c, g->ctype, (int)g->m, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        if (i >= 0) CU(cudaEventRecord(ev[2 * i + 1], s));
    }
    CU(cudaStreamSynchronize(s));
    for (int i = 0; i < RUNS; i++) CU(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    for (int i = 0; i < 2 * RUNS; i++) cudaEventDestroy(ev[i]);
    qsort(ms, RUNS, sizeof(float), cmp_float);
    return 0.5f * (ms[RUNS / 2 - 1] + ms[RUNS / 2]);
}

int main(int argc, char **argv)
{
    const char *only = argc > 1 ? argv[1] : NULL;
    const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
    const cudaDataType_t BF = CUDA_R_16BF, F32 = CUDA_R_32F;
    /* router dx: m = H, n = N, k = E; experts: H = 2048, F = 8192, 4096 rows (see describe()
     * in cuda_experts.c for the operands) */
    gemm_t gemms[] = {
        {"router_dx", "dx add", T, N, 7168, 65536, 256, BF, 1.0f, 1},
        {"router_dx", "dx write", T, N, 7168, 65536, 256, BF, 0.0f, 1},
        {"router_dx", "dx add", T, N, 4096, 65536, 64, BF, 1.0f, 1},
        {"router_dx", "dx write", T, N, 4096, 65536, 64, BF, 0.0f, 1},
        {"logits", "logits", N, N, 256, 65536, 7168, F32, 0.0f, 1},
        {"experts", "fwd1", N, N, 16384, 4096, 2048, BF, 0.0f, 1},
        {"experts", "fwd2", N, N, 2048, 4096, 8192, BF, 0.0f, 1},
        {"experts", "d_act", T, N, 8192, 4096, 2048, BF, 0.0f, 1},
        {"experts", "dw2", N, T, 2048, 8192, 4096, F32, 0.0f, 1},
        {"experts", "d_xp", T, N, 2048, 4096, 16384, BF, 0.0f, 1},
        {"experts", "dw1", N, T, 16384, 2048, 4096, F32, 0.0f, 1},
        {"wgrad", "dw1 x64", N, T, 2816, 4096, 584, F32, 0.0f, 64},
        {"wgrad", "dw2 x64", N, T, 4096, 1408, 584, F32, 0.0f, 64},
        {"wgrad", "dw1 x64 bf16 out", N, T, 2816, 4096, 584, BF, 0.0f, 64},
        {"wgrad", "dw2 x64 bf16 out", N, T, 4096, 1408, 584, BF, 0.0f, 64},
    };
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasHandle_t h;
    cublasLtHandle_t lt;
    BL(cublasCreate(&h));
    BL(cublasSetStream(h, s));
    BL(cublasLtCreate(&lt));
    void *ws;
    CU(cudaMalloc(&ws, WS_BYTES));
    BL(cublasSetWorkspace(h, ws, WS_BYTES));
    for (size_t gi = 0; gi < sizeof gemms / sizeof gemms[0]; gi++) {
        gemm_t g = gemms[gi];
        operands_t o;
        int64_t batch = g.batch;
        if (only && strcmp(only, g.group)) continue;
        size_t csize = g.ctype == F32 ? 4 : 2;
        CU(cudaMalloc(&o.a, 2 * g.m * g.k * batch));
        CU(cudaMalloc(&o.b, 2 * g.k * g.n * batch));
        CU(cudaMalloc(&o.c, csize * g.m * g.n * batch));
        CU(bench_fill_bf16(o.a, g.m * g.k * batch, 1, 0.05f, s));
        CU(bench_fill_bf16(o.b, g.k * g.n * batch, 2, 0.05f, s));
        CU(cudaMemsetAsync(o.c, 0, csize * g.m * g.n * batch, s));
        cublasLtMatmulDesc_t desc;
        BL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        BL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof g.ta));
        BL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof g.tb));
        cublasLtMatrixLayout_t la, lb, lc;
        BL(cublasLtMatrixLayoutCreate(&la, BF, (uint64_t)(g.ta == N ? g.m : g.k),
                                      (uint64_t)(g.ta == N ? g.k : g.m), lda_of(&g)));
        BL(cublasLtMatrixLayoutCreate(&lb, BF, (uint64_t)(g.tb == N ? g.k : g.n),
                                      (uint64_t)(g.tb == N ? g.n : g.k), ldb_of(&g)));
        BL(cublasLtMatrixLayoutCreate(&lc, g.ctype, (uint64_t)g.m, (uint64_t)g.n, g.m));
        if (batch > 1) {
            int32_t count = g.batch;
            int64_t strides[3] = {g.m * g.k, g.k * g.n, g.m * g.n};
            cublasLtMatrixLayout_t ls[3] = {la, lb, lc};
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
        BL(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 32, res, &found));
        double flops = 2.0 * g.m * g.n * g.k * batch;
        double bytes = batch * (2.0 * (g.m * g.k + g.k * g.n) +
                                (double)csize * g.m * g.n * (g.beta != 0 ? 2 : 1));
        char shape[128];
        snprintf(shape, sizeof shape, "%s m=%lld n=%lld k=%lld beta=%g", g.label, (long long)g.m,
                 (long long)g.n, (long long)g.k, g.beta);
        size_t cbytes = csize * (size_t)(g.m * g.n * batch);
        unsigned char *ref = malloc(cbytes), *out = malloc(cbytes);
        if (!ref || !out) {
            fprintf(stderr, "out of host memory\n");
            return 1;
        }
        for (int i = -1; i < found; i++) {
            if (i >= 0 && res[i].state != CUBLAS_STATUS_SUCCESS) continue;
            const cublasLtMatmulAlgo_t *algo = i < 0 ? NULL : &res[i].algo;
            float ms = time_gemm(h, lt, desc, la, lb, lc, algo, ws, &g, &o, s);
            /* beta 0 overwrites C, so the last call's output is the algorithm's */
            bool same = true;
            if (g.beta == 0) {
                CU(cudaMemcpy(i < 0 ? ref : out, o.c, cbytes, cudaMemcpyDeviceToHost));
                same = i < 0 || !memcmp(ref, out, cbytes);
            }
            char variant[16], config[256] = "";
            snprintf(variant, sizeof variant, i < 0 ? "gemmex" : "lt%d", i);
            if (i >= 0) describe_algo(&res[i].algo, config, sizeof config);
            printf("{\"bench\":\"gemm_algo\",\"shape\":\"%s\",\"variant\":\"%s\",\"ms\":%.4f,"
                   "\"tbps\":%.2f,\"tflops\":%.1f,\"waves\":%.2f,\"same\":%s%s}\n", shape, variant,
                   ms, bytes / ms * 1e-9, flops / ms * 1e-9, i < 0 ? 0.0f : res[i].wavesCount,
                   g.beta != 0 ? "null" : same ? "true" : "false", config);
        }
        free(ref);
        free(out);
        fflush(stdout);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(desc);
        cudaFree(o.a);
        cudaFree(o.b);
        cudaFree(o.c);
    }
    cudaFree(ws);
    cublasLtDestroy(lt);
    cublasDestroy(h);
    cudaStreamDestroy(s);
    return 0;
}
