/* Thread-local last-error message and status names. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define MOE_ERROR_MAX 1024

static _Thread_local char last_error[MOE_ERROR_MAX];

static const char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

moe_status_t moe_error_set(moe_status_t status, const char *file, int line, const char *fmt, ...)
{
    int n = snprintf(last_error, sizeof last_error, "%s (%s:%d): ", moe_status_string(status),
                     base_name(file), line);
    if (n < 0 || (size_t)n >= sizeof last_error) return status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
    va_end(ap);
    return status;
}

moe_status_t moe_error_wrap(moe_status_t status, const char *fmt, ...)
{
    char prefix[MOE_ERROR_MAX], old[MOE_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, last_error, sizeof old);
    snprintf(last_error, sizeof last_error, "%.300s: %.700s", prefix, old);
    return status;
}

void moe_error_clear(void) { last_error[0] = '\0'; }

const char *moe_last_error(void) { return last_error; }

const char *moe_status_string(moe_status_t status)
{
    switch (status) {
    case MOE_STATUS_SUCCESS: return "success";
    case MOE_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case MOE_STATUS_INVALID_HANDLE: return "invalid handle";
    case MOE_STATUS_UNSUPPORTED: return "unsupported";
    case MOE_STATUS_OUT_OF_MEMORY: return "out of memory";
    case MOE_STATUS_BACKEND_ERROR: return "backend error";
    case MOE_STATUS_COMM_ERROR: return "communication error";
    case MOE_STATUS_TIMEOUT: return "timeout";
    case MOE_STATUS_IO_ERROR: return "I/O error";
    case MOE_STATUS_CORRUPT: return "corrupt data";
    case MOE_STATUS_NOT_FOUND: return "not found";
    case MOE_STATUS_REMOTE_ERROR: return "remote store error";
    case MOE_STATUS_IN_PROGRESS: return "in progress";
    case MOE_STATUS_ABORTED: return "aborted";
    case MOE_STATUS_INTERNAL: return "internal error";
    }
    return "unknown status";
}
