/* Random device-side fills for the C benchmarks (bench_fill.cu). */
#ifndef MOE_BENCH_FILL_H
#define MOE_BENCH_FILL_H
#include <stdint.h>
#include <cuda_runtime.h>
#ifdef __cplusplus
extern "C" {
#endif
/* Uniform random values in [-scale, scale); return a cudaError_t as int. */
int bench_fill_bf16(void *p, int64_t n, uint64_t seed, float scale, cudaStream_t s);
int bench_fill_f32(float *p, int64_t n, uint64_t seed, float scale, cudaStream_t s);
#ifdef __cplusplus
}
#endif
#endif
