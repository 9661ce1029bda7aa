// XEXP: event-timed launch overhead of empty kernels by launch configuration
#include <cstdio>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>
__global__ void k_empty(int *p) { if (p && threadIdx.x == 1023) p[blockIdx.x] = 1; }
__global__ void k_pdl(int *p) {
    cudaGridDependencySynchronize();
    cudaTriggerProgrammaticLaunchCompletion();
    if (p && threadIdx.x == 1023) p[blockIdx.x] = 1;
}
__global__ void __cluster_dims__(2, 1, 1) k_cl2(int *p) { if (p && threadIdx.x == 1023) p[blockIdx.x] = 1; }
static float run(const char *name, int blocks, int smem, int cluster, bool pdl, bool cl_static) {
    cudaStream_t s; cudaStreamCreate(&s);
    auto kern = pdl ? k_pdl : cl_static ? k_cl2 : k_empty;
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
    cudaLaunchAttribute at[2] = {}; int na = 0;
    if (pdl) { at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[na].val.programmaticStreamSerializationAllowed = 1; na++; }
    if (cluster > 1) { at[na].id = cudaLaunchAttributeClusterDimension; at[na].val.clusterDim.x = cluster; at[na].val.clusterDim.y = 1; at[na].val.clusterDim.z = 1; na++; }
    cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(blocks); cfg.blockDim = dim3(256); cfg.dynamicSmemBytes = smem; cfg.stream = s; cfg.attrs = at; cfg.numAttrs = na;
    int iters = 400;
    std::vector<cudaEvent_t> ev(2 * iters);
    for (auto &e : ev) cudaEventCreate(&e);
    for (int i = 0; i < 20; i++) cudaLaunchKernelEx(&cfg, kern, (int *)nullptr);
    cudaStreamSynchronize(s);
    for (int i = 0; i < iters; i++) { cudaEventRecord(ev[2*i], s); cudaLaunchKernelEx(&cfg, kern, (int *)nullptr); cudaEventRecord(ev[2*i+1], s); }
    cudaStreamSynchronize(s);
    std::vector<float> ms(iters);
    for (int i = 0; i < iters; i++) cudaEventElapsedTime(&ms[i], ev[2*i], ev[2*i+1]);
    std::sort(ms.begin(), ms.end());
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    cudaEventRecord(a, s);
    for (int i = 0; i < iters; i++) cudaLaunchKernelEx(&cfg, kern, (int *)nullptr);
    cudaEventRecord(b, s); cudaStreamSynchronize(s);
    float tot; cudaEventElapsedTime(&tot, a, b);
    printf("XLAUNCH %-28s blocks=%d smem=%d cluster=%d pdl=%d  event median %.2f us (p10 %.2f p90 %.2f)  back-to-back %.2f us  err=%s\n", name, blocks, smem, cluster, pdl, ms[iters/2]*1e3, ms[iters/10]*1e3, ms[iters*9/10]*1e3, tot/iters*1e3, cudaGetErrorString(cudaGetLastError()));
    return ms[iters/2];
}
int main() {
    run("plain", 128, 0, 1, false, false);
    run("plain 1 block", 1, 0, 1, false, false);
    run("smem 133K", 128, 136000, 1, false, false);
    run("cluster2", 128, 0, 2, false, false);
    run("cluster4", 128, 0, 4, false, false);
    run("cluster2 smem", 128, 136000, 2, false, false);
    run("pdl", 128, 0, 1, true, false);
    run("pdl cluster2 smem", 128, 136000, 2, true, false);
    run("plain 264", 264, 0, 1, false, false);
    return 0;
}
