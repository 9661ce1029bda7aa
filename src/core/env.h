/*
 * Settings read from the environment: a positive integer that overrides a value the caller
 * already has (configured, or the default).
 */
#ifndef MOE_CORE_ENV_H
#define MOE_CORE_ENV_H

#include <stddef.h>

#include "log.h"

/* $name as a positive integer, or `fallback` when unset or empty; a value that is not a
 * positive integer is ignored with a warning, and an override is logged at info level. */
size_t moe_env_positive(const char *name, size_t fallback, const moe_logger_t *log);

#endif /* MOE_CORE_ENV_H */
