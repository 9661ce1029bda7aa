/*
 * Per-runtime logging. A logger is a level plus an optional callback; modules keep a pointer
 * to their runtime's logger. A NULL logger logs warnings and errors to stderr.
 */
#ifndef MOE_CORE_LOG_H
#define MOE_CORE_LOG_H

#include <moe/core.h>

typedef struct moe_logger {
    moe_log_level_t level;
    moe_log_fn fn;
    void *user_data;
} moe_logger_t;

void moe_log(const moe_logger_t *logger, moe_log_level_t level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif /* MOE_CORE_LOG_H */
