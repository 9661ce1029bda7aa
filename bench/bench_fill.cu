/* Bench helper: fill a device buffer with hash-based uniform random values (no host round
 * trip, different per seed), so every benchmark runs on fresh non-zero data. */
#include <cuda_bf16.h>
#include <stdint.h>

#include "bench_fill.h"

__global__ void fill_bf16(__nv_bfloat16 *p, int64_t n, uint64_t seed, float scale)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t z = (uint64_t)i * 0x9e3779b97f4a7c15ull + seed;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f); /* [0,1) */
        p[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * scale);
    }
}

__global__ void fill_f32(float *p, int64_t n, uint64_t seed, float scale)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t z = (uint64_t)i * 0x9e3779b97f4a7c15ull + seed;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        p[i] = ((float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
    }
}

extern "C" int bench_fill_bf16(void *p, int64_t n, uint64_t seed, float scale, cudaStream_t s)
{
    fill_bf16<<<4096, 256, 0, s>>>((__nv_bfloat16 *)p, n, seed, scale);
    return (int)cudaGetLastError();
}

extern "C" int bench_fill_f32(float *p, int64_t n, uint64_t seed, float scale, cudaStream_t s)
{
    fill_f32<<<4096, 256, 0, s>>>(p, n, seed, scale);
    return (int)cudaGetLastError();
}
