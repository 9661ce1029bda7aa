/* The monotonic clock, for timeouts and the time statistics (seconds and milliseconds). */
#ifndef MOE_CORE_CLOCK_H
#define MOE_CORE_CLOCK_H

#include <time.h>

static inline double moe_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline double moe_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

#endif /* MOE_CORE_CLOCK_H */
