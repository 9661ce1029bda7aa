/*
 * The peer watch: the failure detector a mesh shares among its communicators.
 *
 * Open MPI 4.1 has no fault tolerance (no ULFM): once a peer is dead or stalled, no
 * collective that includes it can finish, and neither can MPI_Finalize. What a rank can do is
 * fail fast, say which rank is to blame, and tell everyone else, so that the whole job exits
 * and the launcher restarts it. The watch does that:
 *
 *  - The first failure of any watched communicator (a timeout, an MPI or NCCL error, an
 *    abort) poisons them all: every later call on any of them fails at once with ABORTED and
 *    that first cause, so one dead peer costs one timeout, not one per communicator.
 *  - Naming: after a timeout the waiting rank pings the members that did not deliver (the
 *    peers of a transfer, or every member of a collective) and waits a grace period: those
 *    that do not answer are dead or stalled. An answer says whom the answering rank itself
 *    waits for, and those are pinged too, so a chain of waits (stage 1 waits for stage 2,
 *    which waits for the dead stage 3) is followed to its end. When everyone answers, the
 *    rank waits one more grace period for another rank's notice.
 *  - Telling: the rank that found (or caused) the failure sends a notice with its cause to
 *    every other rank of the world; a rank learns of it in its next wait or test, which then
 *    fails at once with ABORTED and the notice's text.
 *  - Leaving: a rank whose watch is destroyed without a failure (its run is over) tells every
 *    other rank that it left. A rank that later times out waiting for it says that it left
 *    normally and that the ranks ran different work (a different number of steps or calls),
 *    and never names it as dead or stalled.
 *
 * The channel is a duplicate of the mesh's world (MPI, host buffers) with one receive always
 * posted; every wait and test on a watched communicator polls it, so a rank answers pings and
 * takes notices while it waits for anything. A rank that stays outside libmoe longer than the
 * grace period (a long computation of its own) does not answer either, and is reported as
 * not answering. The grace period is a quarter of the mesh's timeout, between 50 ms and 2 s.
 *
 * Buffers that MPI may still read or write after a failure (the receive, pings and notices in
 * flight) are leaked on purpose when the watch is destroyed after a failure. The channel itself
 * is never freed (MPI_Finalize does): a peer's LEFT may arrive after this rank's destroy.
 */
#ifndef MOE_COMM_PEER_WATCH_H
#define MOE_COMM_PEER_WATCH_H

#include <stdbool.h>

#include <moe/core.h>

#include "core/log.h"

/* The watch knows the communicators only by these opaque pointers, handed back to the
 * moe_comm_late_fn their wait gave (it reads none of their fields). */
typedef struct moe_comm moe_comm_t;
typedef struct moe_comm_req moe_comm_req_t;
typedef struct moe_comm_watch moe_comm_watch_t;

/* The world ranks an operation in flight still needs (at most max of them): what a rank
 * reports, in its answers to pings, that it waits for. */
typedef int (*moe_comm_late_fn)(const moe_comm_t *c, moe_comm_req_t *r, int *late, int max);

/* A watch over the world of `size` ranks in which this one is `rank`: its channel duplicates
 * `mpi_comm` (a pointer to an MPI_Comm: the mesh's world, host buffers) within timeout_ms,
 * and its grace period is derived from timeout_ms; logger (may be NULL) takes the failure it
 * records. Collective over that communicator. The caller hands the watch to the communicators
 * it watches (moe_comm_mpi_watch sets the world's, which its splits inherit). UNSUPPORTED in
 * a build without MPI. */
moe_status_t moe_comm_watch_create(const void *mpi_comm, int rank, int size, int timeout_ms,
                                   const moe_logger_t *logger, moe_comm_watch_t **out);
/* NULL: no-op. Without a failure, tells every peer that this rank left (see the top). After a
 * failure nothing MPI may still touch is freed. */
void moe_comm_watch_destroy(moe_comm_watch_t *w);

/* Answer pings and take notices (called by every wait and test of a watched communicator). */
void moe_comm_watch_poll(moe_comm_watch_t *w);
/* A wait on operation r of c begins (late names whom it needs) or, with late NULL, ends.
 * NULL w: no-op. */
void moe_comm_watch_waiting(moe_comm_watch_t *w, const moe_comm_t *c, moe_comm_req_t *r,
                            moe_comm_late_fn late);
/* The first failure, or SUCCESS; [out] cause (may be NULL): its text ("" when none), valid
 * until the watch is destroyed. */
moe_status_t moe_comm_watch_failure(const moe_comm_watch_t *w, const char **cause);

/* `what` on the communicator named comm_name ("ep", "world") did not complete within
 * timeout_ms; late[0..nlate) are the world ranks it was waiting for. Finds which ranks do not
 * answer, records the failure, tells every other rank, and writes what is known about the
 * culprits to text[0..size). */
void moe_comm_watch_timed_out(moe_comm_watch_t *w, const char *comm_name, const char *what,
                              int timeout_ms, const int *late, int nlate, char *text, size_t size);
/* A local failure (an MPI error, an abort) that makes the mesh unusable: recorded with
 * `status` and told to every other rank with `cause`. A failure already recorded stays. */
void moe_comm_watch_fail(moe_comm_watch_t *w, moe_status_t status, const char *cause);

#endif /* MOE_COMM_PEER_WATCH_H */
