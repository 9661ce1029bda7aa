/* GPU test helpers: both backends side by side, bf16/f32/i32 transfers, poisoning, bounds. */
#ifndef MOE_TEST_GPU_CHECK_H
#define MOE_TEST_GPU_CHECK_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "test_support.h"

typedef struct gpu_pair {
    moe_backend_t host, cuda;
} gpu_pair_t;

/* Exit 77 (CTest skip) when no GPU is visible; otherwise create both backends. */
void gpu_pair_init(gpu_pair_t *p);
void gpu_pair_free(gpu_pair_t *p);

/* Round host values to bf16 in place (so host and GPU see the same numbers), then upload. */
void *gpu_up_bf16(gpu_pair_t *p, float *host, int64_t n);
float *gpu_up_f32(gpu_pair_t *p, const float *host, int64_t n);
int32_t *gpu_up_i32(gpu_pair_t *p, const int32_t *host, int64_t n);
/* Device buffers filled with a poison pattern: NaN for floats, 0x7f7f7f7f for ints. */
void *gpu_poison(gpu_pair_t *p, size_t bytes, bool integers);
void gpu_down_bf16(gpu_pair_t *p, float *host, const void *dev, int64_t n);
void gpu_down_f32(gpu_pair_t *p, float *host, const float *dev, int64_t n);
void gpu_down_i32(gpu_pair_t *p, int32_t *host, const int32_t *dev, int64_t n);
void gpu_free(gpu_pair_t *p, void *dev);

float *rand_f32(test_rng_t *rng, int64_t n, double std);

/* Print ||a-b||/||b|| and fail the test (cmocka) when it exceeds tol or is NaN. */
void check_close(const char *what, const float *gpu, const float *ref, int64_t n, double tol);

#endif
