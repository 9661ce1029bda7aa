/* Bench helper: fill a device buffer with hash-based uniform random values (no host round
 * trip, different per seed), so every benchmark runs on fresh non-zero data. */
#include <cuda_bf16.h>
#include <stdint.h>

#include "bench_fill.h"
#include "grid.cuh"

/* A hash of (i, seed) mapped to [-1, 1). */
static __device__ float hash_uniform(int64_t i, uint64_t seed)
{
    uint64_t z = (uint64_t)i * 0x9e3779b97f4a7c15ull + seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 16777216.0f); /* [0,1) */
    return 2.0f * u - 1.0f;
}

static __device__ void put(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
static __device__ void put(float *p, float v) { *p = v; }

template <typename T> __global__ void fill(T *p, int64_t n, uint64_t seed, float scale)
{
    GRID_STRIDE(i, n) put(p + i, hash_uniform(i, seed) * scale);
}

extern "C" int bench_fill_bf16(void *p, int64_t n, uint64_t seed, float scale, cudaStream_t s)
{
    fill<<<4096, 256, 0, s>>>((__nv_bfloat16 *)p, n, seed, scale);
    return (int)cudaGetLastError();
}

extern "C" int bench_fill_f32(float *p, int64_t n, uint64_t seed, float scale, cudaStream_t s)
{
    fill<<<4096, 256, 0, s>>>(p, n, seed, scale);
    return (int)cudaGetLastError();
}
