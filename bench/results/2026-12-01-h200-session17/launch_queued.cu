// Next-session experiment: the GPU's own cost of one launch between two events, by launch
// configuration, with the host certainly ahead (every run queued behind a hold kernel), for an
// empty kernel and for one that spins 10 us. Build and run on the device:
//   nvcc -O2 -arch=sm_90a -o /tmp/lq next_launch_queued.cu && /tmp/lq
#include <algorithm>
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>

__device__ __forceinline__ long long now()
{
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__global__ void hold(long long ns)
{
    long long t0 = now();
    while (now() - t0 < ns) {}
}
template <bool PDL> __global__ void work(long long ns, int *sink)
{
    if (PDL) {
        cudaGridDependencySynchronize();
        cudaTriggerProgrammaticLaunchCompletion();
    }
    long long t0 = now();
    while (now() - t0 < ns) {}
    if (sink && threadIdx.x == 1023) sink[blockIdx.x] = 1; /* never: keeps the loop */
}

static void run(const char *name, int blocks, int smem, int cluster, bool pdl, long long ns)
{
    cudaStream_t s;
    cudaStreamCreate(&s);
    auto kern = pdl ? work<true> : work<false>;
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
    cudaLaunchAttribute at[2] = {};
    int na = 0;
    if (pdl) {
        at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[na++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster > 1) {
        at[na].id = cudaLaunchAttributeClusterDimension;
        at[na].val.clusterDim.x = cluster;
        at[na].val.clusterDim.y = at[na].val.clusterDim.z = 1;
        na++;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = at;
    cfg.numAttrs = na;
    const int iters = 300;
    std::vector<cudaEvent_t> ev(2 * iters);
    for (auto &e : ev) cudaEventCreate(&e);
    for (int i = 0; i < 20; i++) cudaLaunchKernelEx(&cfg, kern, ns, (int *)nullptr);
    cudaStreamSynchronize(s);
    hold<<<1, 1, 0, s>>>(30000000LL);
    for (int i = 0; i < iters; i++) {
        cudaEventRecord(ev[2 * i], s);
        cudaLaunchKernelEx(&cfg, kern, ns, (int *)nullptr);
        cudaEventRecord(ev[2 * i + 1], s);
    }
    bool ahead = cudaEventQuery(ev[0]) == cudaErrorNotReady;
    cudaStreamSynchronize(s);
    std::vector<float> ms(iters);
    for (int i = 0; i < iters; i++) cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]);
    std::sort(ms.begin(), ms.end());
    printf("%-22s blocks=%3d smem=%6d cluster=%d pdl=%d work=%5.1f us: event-timed median %6.2f us "
           "(p10 %6.2f, p90 %6.2f) %s %s\n",
           name, blocks, smem, cluster, pdl, ns * 1e-3, ms[iters / 2] * 1e3, ms[iters / 10] * 1e3,
           ms[iters * 9 / 10] * 1e3, ahead ? "host ahead" : "HOST BEHIND",
           cudaGetErrorString(cudaGetLastError()));
    for (auto &e : ev) cudaEventDestroy(e);
    cudaStreamDestroy(s);
}

int main()
{
    for (long long ns : {0LL, 10000LL}) {
        run("plain", 128, 0, 1, false, ns);
        run("smem 150K", 128, 150 * 1024, 1, false, ns);
        run("cluster 2", 128, 0, 2, false, ns);
        run("cluster 2 smem 150K", 128, 150 * 1024, 2, false, ns);
        run("pdl", 128, 0, 1, true, ns);
        run("pdl cluster 2 smem", 128, 150 * 1024, 2, true, ns); /* the split kernel's launch */
        run("cluster 4 smem 100K", 128, 100 * 1024, 4, false, ns);
        run("264 blocks", 264, 0, 1, false, ns);
    }
    return 0;
}
