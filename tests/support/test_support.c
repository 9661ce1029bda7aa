/* Shared test helpers. */
#include "test_support.h"

#include <math.h>
#include <stdarg.h>
#include <time.h>

uint64_t test_rng_next(test_rng_t *r)
{
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double test_rng_uniform(test_rng_t *r) { return (double)(test_rng_next(r) >> 11) * 0x1.0p-53; }

double test_rng_normal(test_rng_t *r)
{
    double u1 = test_rng_uniform(r), u2 = test_rng_uniform(r);
    return sqrt(-2.0 * log(u1 + 1e-300)) * cos(6.283185307179586 * u2);
}

int64_t test_rng_int(test_rng_t *r, int64_t lo, int64_t hi)
{
    return lo + (int64_t)(test_rng_next(r) % (uint64_t)(hi - lo + 1));
}

void test_fill_normal(test_rng_t *r, float *x, int64_t n, double std)
{
    for (int64_t i = 0; i < n; i++) x[i] = (float)(std * test_rng_normal(r));
}

void test_fill_routing(test_rng_t *r, int32_t *idx, int64_t n, int32_t e, int32_t k)
{
    for (int64_t t = 0; t < n; t++)
        for (int32_t j = 0; j < k; j++) {
            int32_t v;
            int dup;
            do {
                double u = test_rng_uniform(r);
                v = (int32_t)(u * u * e);
                dup = 0;
                for (int32_t q = 0; q < j; q++) dup |= idx[t * k + q] == v;
            } while (dup);
            idx[t * k + j] = v;
        }
}

void test_fill_permutation(test_rng_t *r, int32_t *p, int32_t n)
{
    for (int32_t j = 0; j < n; j++) p[j] = j;
    for (int32_t j = n - 1; j > 0; j--) { /* Fisher-Yates */
        int32_t q = (int32_t)(test_rng_uniform(r) * (j + 1)), v = p[j];
        p[j] = p[q];
        p[q] = v;
    }
}

double test_rel_err(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    if (den == 0) return num == 0 ? 0 : INFINITY;
    return sqrt(num / den);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double test_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

uint64_t test_seed(void)
{
    const char *v = getenv("MOE_TEST_SEED");
    uint64_t seed = v ? strtoull(v, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
    fprintf(stderr, "test seed %llu (replay with MOE_TEST_SEED)\n", (unsigned long long)seed);
    return seed;
}

void test_rank_fail(int rank, const char *file, int line, const char *fmt, ...)
{
    fprintf(stderr, "rank %d: %s:%d: ", rank, file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
}
