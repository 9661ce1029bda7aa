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
/* Step `step` done, with this rank's busy time of it (its wall time minus its waits for
 * peers), from which the launcher finds slow ranks. */
void membership_step(int64_t step, double busy_s);
/* The launcher's slot of this rank, -1 without the launcher. */
int membership_slot(void);
/* Records the exit (code and cause) and leaves (revokes the lease). */
void membership_leave(int code, const char *cause);

#endif /* TRAINER_MEMBERSHIP_H */
