/* Launch sizes and the grid-stride loop of the element-wise kernels. */
#ifndef MOE_KERNELS_GRID_CUH
#define MOE_KERNELS_GRID_CUH

#include <stdint.h>

/* Blocks of 256 threads for `work` items: enough to fill the GPU several times over (132 SMs
 * x 32), at least one; the grid-stride loops cover the rest. */
static inline unsigned grid_for(int64_t work)
{
    int64_t b = (work + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > 132 * 32 ? 132 * 32 : b);
}

#define GRID_STRIDE(i, n)                                                                  \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);              \
         i += (int64_t)gridDim.x * blockDim.x)

#endif /* MOE_KERNELS_GRID_CUH */
