/* Settings read from the environment: the table's getters (see env.h). */
#include "env.h"

#include "error.h"

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { ENV_POSITIVE, ENV_INT, ENV_FLAG, ENV_CHOICE, ENV_STRING, ENV_SECRET } env_type_t;

typedef struct {
    const char *name;
    env_type_t type;
    const char *meaning;
} env_var_t;

static const env_var_t vars[MOE_ENV_COUNT] = {
#define MOE_ENV_ROW_(id, name, type, def, doc) [MOE_ENV_##id] = {name, ENV_##type, doc},
    MOE_ENV_TABLE(MOE_ENV_ROW_)
#undef MOE_ENV_ROW_
};

/* Whether a variable's value was logged (or its bad value warned about). The environment is
 * the process's, so "once" is per process: the one piece of process-wide state here, and it
 * only quiets repeated log lines. */
static atomic_bool reported[MOE_ENV_COUNT];

static bool first_report(moe_env_id_t id) { return !atomic_exchange(&reported[id], true); }

/* The raw value of a variable of the expected type, or NULL when unset or empty. */
static const char *raw(moe_env_id_t id, env_type_t type)
{
    if ((unsigned)id >= MOE_ENV_COUNT || vars[id].type != type) return NULL;
    const char *v = getenv(vars[id].name);
    return v && *v ? v : NULL;
}

static void log_set(moe_env_id_t id, const char *v, const moe_logger_t *log)
{
    if (first_report(id))
        moe_log(log, MOE_LOG_INFO, "%s=%s", vars[id].name,
                vars[id].type == ENV_SECRET ? "(set)" : v);
}

static void warn_bad(moe_env_id_t id, const char *v, const char *expected, const moe_logger_t *log)
{
    if (first_report(id))
        moe_log(log, MOE_LOG_WARN, "ignoring %s=%s (not %s)", vars[id].name, v, expected);
}

const char *moe_env_string(moe_env_id_t id, const moe_logger_t *log)
{
    const char *v = raw(id, ENV_STRING);
    if (!v) v = raw(id, ENV_SECRET);
    if (v) log_set(id, v, log);
    return v;
}

/* v as a whole decimal integer into *x. */
static bool parse_long(const char *v, long *x)
{
    char *end;
    errno = 0;
    *x = strtol(v, &end, 10);
    return errno == 0 && *end == 0;
}

/* v as a whole decimal integer > 0 into *x. */
static bool parse_positive(const char *v, size_t *x)
{
    char *end;
    errno = 0;
    unsigned long long u = strtoull(v, &end, 10);
    if (errno || *end || u == 0 || v[0] == '-' || u > SIZE_MAX) return false;
    *x = (size_t)u;
    return true;
}

size_t moe_env_positive(moe_env_id_t id, size_t fallback, const moe_logger_t *log)
{
    const char *v = raw(id, ENV_POSITIVE);
    size_t x;
    if (!v) return fallback;
    if (!parse_positive(v, &x)) {
        warn_bad(id, v, "a positive integer", log);
        return fallback;
    }
    log_set(id, v, log);
    return x;
}

moe_status_t moe_env_positive_checked(moe_env_id_t id, size_t max, size_t *value,
                                      const moe_logger_t *log)
{
    const char *v = raw(id, ENV_POSITIVE);
    size_t x;
    if (!v) return MOE_STATUS_SUCCESS;
    if (!parse_positive(v, &x) || x > max)
        return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                        "%s (\"%s\") must be a positive integer up to %zu", vars[id].name, v, max);
    log_set(id, v, log);
    *value = x;
    return MOE_STATUS_SUCCESS;
}

long moe_env_int(moe_env_id_t id, long fallback, const moe_logger_t *log)
{
    const char *v = raw(id, ENV_INT);
    long x;
    if (!v) return fallback;
    if (!parse_long(v, &x)) {
        warn_bad(id, v, "an integer", log);
        return fallback;
    }
    log_set(id, v, log);
    return x;
}

bool moe_env_flag(moe_env_id_t id, bool fallback, const moe_logger_t *log)
{
    const char *v = raw(id, ENV_FLAG);
    if (!v) return fallback;
    if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0) {
        warn_bad(id, v, "0 or 1", log);
        return fallback;
    }
    log_set(id, v, log);
    return v[0] == '1';
}

int moe_env_choice(moe_env_id_t id, int fallback, const moe_logger_t *log)
{
    const char *v = raw(id, ENV_CHOICE);
    if (!v) return fallback;
    const char *words = vars[id].meaning, *stop = strchr(words, ':');
    size_t n = strlen(v);
    int index = 0;
    for (const char *w = words; w < stop; index++) {
        const char *bar = memchr(w, '|', (size_t)(stop - w));
        const char *end = bar ? bar : stop;
        if ((size_t)(end - w) == n && strncmp(w, v, n) == 0) {
            log_set(id, v, log);
            return index;
        }
        w = end + 1;
    }
    char expected[128];
    snprintf(expected, sizeof expected, "one of %.*s", (int)(stop - words), words);
    warn_bad(id, v, expected, log);
    return fallback;
}
