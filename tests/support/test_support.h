/* Shared test helpers: a seeded RNG, fills, norms, and GPU-skip handling. */
#ifndef MOE_TEST_SUPPORT_H
#define MOE_TEST_SUPPORT_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <moe/moe.h>

/* splitmix64: small, seedable, identical on every platform */
typedef struct test_rng {
    uint64_t state;
} test_rng_t;

uint64_t test_rng_next(test_rng_t *r);
double test_rng_uniform(test_rng_t *r);                      /* [0, 1) */
double test_rng_normal(test_rng_t *r);                       /* N(0, 1) */
int64_t test_rng_int(test_rng_t *r, int64_t lo, int64_t hi); /* [lo, hi] */
void test_fill_normal(test_rng_t *r, float *x, int64_t n, double std);
/* idx [n,k]: k distinct experts of e per token, skewed towards the low indices (so that a
 * capacity bites) */
void test_fill_routing(test_rng_t *r, int32_t *idx, int64_t n, int32_t e, int32_t k);
/* p[0..n): a random permutation of 0..n-1 */
void test_fill_permutation(test_rng_t *r, int32_t *p, int32_t n);

/* ||a - b|| / ||b|| in fp64 (0 when both are zero) */
double test_rel_err(const float *a, const float *b, int64_t n);
/* Median of v[0..n) (sorts v in place). */
double test_median(double *v, int n);

/* Abort the test with the library's message when a call fails. */
#define TEST_OK(call)                                                                              \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) {                                                            \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,                    \
                    moe_status_string(s_), moe_last_error());                                      \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* Multi-rank tests count failed checks instead of aborting, so that every rank reaches the
 * final all-reduce of failures. RANK_CHECK expects `R` (this rank) and `failures` (an int
 * counter) in the including file. */
void test_rank_fail(int rank, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define RANK_CHECK(cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            test_rank_fail(R, __FILE__, __LINE__, __VA_ARGS__);                                    \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

/* A fresh seed per run unless MOE_TEST_SEED is set; printed so a failure can be replayed. */
uint64_t test_seed(void);

#endif /* MOE_TEST_SUPPORT_H */
