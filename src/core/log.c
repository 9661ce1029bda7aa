/* Per-runtime logging to a callback or stderr. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *level_name(moe_log_level_t level)
{
    switch (level) {
    case MOE_LOG_ERROR: return "error";
    case MOE_LOG_WARN: return "warn";
    case MOE_LOG_INFO: return "info";
    case MOE_LOG_DEBUG: return "debug";
    }
    return "?";
}

void moe_log(const moe_logger_t *logger, moe_log_level_t level, const char *fmt, ...)
{
    moe_log_level_t max = logger ? logger->level : MOE_LOG_WARN;
    if (level > max) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (logger && logger->fn)
        logger->fn(level, msg, logger->user_data);
    else
        fprintf(stderr, "libmoe %s: %s\n", level_name(level), msg);
}
