/* Launch sizes and the grid-stride loop of the element-wise kernels. */
#ifndef MOE_KERNELS_GRID_CUH
#define MOE_KERNELS_GRID_CUH

#include <stdint.h>

#include <cuda_runtime.h>

/* Blocks of 256 threads for `work` items: enough to fill a device of `sms` SMs several times
 * over (32 per SM), at least one; the grid-stride loops cover the rest. The caller passes the
 * SM count it asked the device for once (the CUDA backend's context keeps it), so a launch
 * makes no device query and no state is kept here. */
static inline unsigned grid_for(int64_t work, int sms)
{
    int64_t b = (work + 255) / 256, most = (int64_t)(sms > 0 ? sms : 1) * 32;
    return (unsigned)(b < 1 ? 1 : b > most ? most : b);
}

#define GRID_STRIDE(i, n)                                                                          \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                      \
         i += (int64_t)gridDim.x * blockDim.x)

#endif /* MOE_KERNELS_GRID_CUH */
