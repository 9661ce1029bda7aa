/* Launch sizes and the grid-stride loop of the element-wise kernels. */
#ifndef MOE_KERNELS_GRID_CUH
#define MOE_KERNELS_GRID_CUH

#include <stdint.h>

#include <cuda_runtime.h>

/* Blocks of 256 threads for `work` items: enough to fill the current device several times
 * over (32 per SM), at least one; the grid-stride loops cover the rest. The SM count is asked
 * of the device at each launch (an attribute query, not the slow cudaGetDeviceProperties), so
 * no state is kept; 132 (the H200) stands in should the query fail. */
static inline unsigned grid_for(int64_t work)
{
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms < 1)
        sms = 132;
    int64_t b = (work + 255) / 256, most = (int64_t)sms * 32;
    return (unsigned)(b < 1 ? 1 : b > most ? most : b);
}

#define GRID_STRIDE(i, n)                                                                  \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);              \
         i += (int64_t)gridDim.x * blockDim.x)

#endif /* MOE_KERNELS_GRID_CUH */
