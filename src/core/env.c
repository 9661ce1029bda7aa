/* Settings read from the environment (see env.h). */
#include "env.h"

#include <stdlib.h>

size_t moe_env_positive(const char *name, size_t fallback, const moe_logger_t *log)
{
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end || x == 0) {
        moe_log(log, MOE_LOG_WARN, "ignoring %s=%s (not a positive integer)", name, v);
        return fallback;
    }
    moe_log(log, MOE_LOG_INFO, "%s=%llu overrides %zu", name, x, fallback);
    return (size_t)x;
}
