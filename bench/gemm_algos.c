/*
 * Every algorithm cublasLt's heuristic offers for the backend's GEMMs that cuBLAS's default
 * choice leaves far from their floor, timed one by one: are they slow because of the pick?
 * Shapes: the router backward's dx += dlogits . wg^T (bf16 in, bf16 C, beta 1) at the two
 * router bench shapes, and the same with beta 0 for comparison.
 * Method as bench_moe: CUDA events around each call, warm-up, median of 20, random data.
 * Usage: gemm_algos (prints JSON lines; the default cublasGemmEx call is variant "gemmex").
 */
#include <stdio.h>
#include <stdlib.h>

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

typedef struct gemm {
    int64_t m, n, k; /* column-major C[m,n] = op(A)[m,k] . B[k,n], A transposed */
    float beta;
    void *a, *b, *c;
} gemm_t;

/* median ms of RUNS calls of the given algorithm (NULL: cublasGemmEx's default) */
static float time_gemm(cublasHandle_t h, cublasLtHandle_t lt, cublasLtMatmulDesc_t desc,
                       cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                       cublasLtMatrixLayout_t lc, const cublasLtMatmulAlgo_t *algo, void *ws,
                       const gemm_t *g, cudaStream_t s)
{
    const float one = 1.0f;
    cudaEvent_t ev[2 * RUNS];
    float ms[RUNS];
    for (int i = 0; i < 2 * RUNS; i++) CU(cudaEventCreate(&ev[i]));
    for (int i = -3; i < RUNS; i++) {
        if (i >= 0) CU(cudaEventRecord(ev[2 * i], s));
        if (algo)
            BL(cublasLtMatmul(lt, desc, &one, g->a, la, g->b, lb, &g->beta, g->c, lc, g->c, lc, algo,
                              ws, WS_BYTES, s));
        else
            BL(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)g->m, (int)g->n, (int)g->k, &one,
                            g->a, CUDA_R_16BF, (int)g->k, g->b, CUDA_R_16BF, (int)g->k, &g->beta,
                            g->c, CUDA_R_16BF, (int)g->m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        if (i >= 0) CU(cudaEventRecord(ev[2 * i + 1], s));
    }
    CU(cudaStreamSynchronize(s));
    for (int i = 0; i < RUNS; i++) CU(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    for (int i = 0; i < 2 * RUNS; i++) cudaEventDestroy(ev[i]);
    qsort(ms, RUNS, sizeof(float), cmp_float);
    return 0.5f * (ms[RUNS / 2 - 1] + ms[RUNS / 2]);
}

int main(void)
{
    /* router dx: m = H, n = N, k = E */
    const int64_t shapes[][3] = {{7168, 65536, 256}, {4096, 65536, 64}};
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
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        for (int bi = 0; bi < 2; bi++) {
            gemm_t g = {.m = shapes[si][0], .n = shapes[si][1], .k = shapes[si][2],
                       .beta = bi == 0 ? 1.0f : 0.0f};
            CU(cudaMalloc(&g.a, 2 * g.m * g.k));
            CU(cudaMalloc(&g.b, 2 * g.k * g.n));
            CU(cudaMalloc(&g.c, 2 * g.m * g.n));
            CU(bench_fill_bf16(g.a, g.m * g.k, 1, 0.05f, s));
            CU(bench_fill_bf16(g.b, g.k * g.n, 2, 0.05f, s));
            CU(bench_fill_bf16(g.c, g.m * g.n, 3, 0.01f, s));
            cublasLtMatmulDesc_t desc;
            BL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            cublasOperation_t ta = CUBLAS_OP_T;
            BL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
            cublasLtMatrixLayout_t la, lb, lc;
            BL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, (uint64_t)g.k, (uint64_t)g.m, g.k));
            BL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, (uint64_t)g.k, (uint64_t)g.n, g.k));
            BL(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, (uint64_t)g.m, (uint64_t)g.n, g.m));
            cublasLtMatmulPreference_t pref;
            BL(cublasLtMatmulPreferenceCreate(&pref));
            uint64_t wsb = WS_BYTES;
            BL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &wsb, sizeof wsb));
            cublasLtMatmulHeuristicResult_t res[32];
            int found = 0;
            BL(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 32, res, &found));
            double bytes = 2.0 * (g.m * g.k + g.k * g.n + g.m * g.n * (bi == 0 ? 2 : 1));
            char shape[96];
            snprintf(shape, sizeof shape, "m=%lld n=%lld k=%lld beta=%g", (long long)g.m,
                     (long long)g.n, (long long)g.k, g.beta);
            float ms = time_gemm(h, lt, desc, la, lb, lc, NULL, ws, &g, s);
            printf("{\"bench\":\"gemm_algo\",\"shape\":\"%s\",\"variant\":\"gemmex\",\"ms\":%.4f,"
                   "\"tbps\":%.2f}\n", shape, ms, bytes / ms * 1e-9);
            for (int i = 0; i < found; i++) {
                if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
                ms = time_gemm(h, lt, desc, la, lb, lc, &res[i].algo, ws, &g, s);
                printf("{\"bench\":\"gemm_algo\",\"shape\":\"%s\",\"variant\":\"lt%d\",\"ms\":%.4f,"
                       "\"tbps\":%.2f,\"waves\":%.2f}\n", shape, i, ms, bytes / ms * 1e-9,
                       res[i].wavesCount);
            }
            fflush(stdout);
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(la);
            cublasLtMatrixLayoutDestroy(lb);
            cublasLtMatrixLayoutDestroy(lc);
            cublasLtMatmulDescDestroy(desc);
            cudaFree(g.a);
            cudaFree(g.b);
            cudaFree(g.c);
        }
    }
    cudaFree(ws);
    cublasLtDestroy(lt);
    cublasDestroy(h);
    cudaStreamDestroy(s);
    return 0;
}
