/*
 * The trainer under the elastic launcher (moe_elastic, docs/elastic.md): when the launcher
 * started it (MOE_ELASTIC_* in the environment) each rank holds a member (moe/elastic.h):
 * a lease kept alive in etcd, its progress (resumed at step N, at step N), and, before any
 * exit, an exit record with the code and cause. Without the launcher every call is a no-op.
 */
#ifndef TRAINER_MEMBERSHIP_H
#define TRAINER_MEMBERSHIP_H

#include <stdint.h>

#include <moe/elastic.h>

/* Joins when the launcher asks; returns 0, or -1 after printing why. */
int membership_join(int rank);
void membership_resumed(int64_t step);
void membership_step(int64_t step);
/* Records the exit (code and cause) and leaves (revokes the lease). */
void membership_leave(int code, const char *cause);

#endif /* TRAINER_MEMBERSHIP_H */
