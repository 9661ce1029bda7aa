/*
 * One incarnation, watched: mpirun's exit, and every rank's member key and exit record in etcd
 * (moe/elastic.h), until the job is done or an incarnation fails; then its end (the whole
 * session: SIGTERM, SIGKILL after the grace period; stopped ranks SIGKILLed at once).
 *
 * A failure is: a rank's process gone without an exit record, or stopped (ranks are found in
 * mpirun's session by their OMPI_COMM_WORLD_RANK before they register, so a rank lost during
 * start-up is blamed at once); a rank's lease expired (its member key is gone without an exit
 * record: a rank killed, stopped or hung where its process cannot be seen); a rank reported an
 * exit code other than 0 and MOE_EXIT_PEER_LOST; ranks reported a lost peer and a rank that
 * holds its lease still runs peer_lost_grace_s later (hung where its keep-alive thread is
 * not); mpirun exited (not a rank's failure: only ranks with a failing exit record are
 * blamed); or not every rank registered within the start timeout (the unregistered ones are
 * blamed); or a straggler to replace (straggler_watch.h); in agent mode, a host holding ranks
 * lost (its agent's key expired), whose ranks are blamed. The slots to blame are those, plus
 * any rank whose process is then found gone or stopped (two ranks lost at once); ranks that
 * only report a lost peer are survivors. mpirun exiting 0 is the job done, whether or not etcd
 * still answers.
 */
#ifndef MOE_TOOLS_INCARNATION_WATCH_H
#define MOE_TOOLS_INCARNATION_WATCH_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "elastic/etcd.h"
#include "events.h"
#include "straggler_watch.h"

#define WATCH_MAX_RANKS 256

typedef struct watch_config {
    el_etcd_t *etcd;
    events_t *events;
    const char *prefix; /* the incarnation's keys */
    int incarnation;
    int world;
    const int *slots; /* slot of each rank */
    pid_t mpirun;     /* leader of the incarnation's session */
    double start_timeout_s, poll_s, peer_lost_grace_s;
    volatile int *stop;       /* set by a signal: end the incarnation */
    void (*tick)(void *user); /* called at every poll (etcd's supervision, the relay, reaping) */
    void *tick_user;
    const char *endpoint; /* named in the etcd events */
    /* the ranks run on other hosts (agent mode): their processes are not this machine's to
     * check; the hosts' agents check them and write an exit record for a rank gone or stopped */
    bool remote_ranks;
    /* after a failure: the recovery event is emitted at this incarnation's first step */
    bool recovering;
    int64_t previous_step; /* the highest step reached before */
    double failed_at;      /* monotonic s: the failure's detection */
    double teardown_s;     /* the failed incarnation's end */
    /* slow ranks (NULL: not watched): reported, and under the replace policy the incarnation
     * ends after the next checkpoint with the straggler blamed ("straggler") */
    straggler_watch_t *straggler;
    /* agent mode (NULL otherwise): at every poll, the ranks (indices) whose host's agent is gone
     * (its key expired with its lease: the host is lost), into lost, and each one's host name
     * into host (both at most world); how many, 0 when etcd did not answer. Blamed "host lost",
     * whether or not their leases still live: a host without its agent cannot check or end its
     * ranks */
    int (*lost_ranks)(void *user, int *lost, const char **host);
    void *lost_ranks_user;
} watch_config_t;

typedef struct watch_result {
    bool done;          /* mpirun exited 0: the trainer finished */
    bool stopped;       /* *stop was set */
    bool mpirun_exited; /* mpirun ended by itself (killed or failed) with no rank to blame */
    int n_registered;   /* ranks that registered */
    int n_blamed;
    int blamed[WATCH_MAX_RANKS]; /* slots to mark failed */
    int64_t last_step;           /* the highest step any rank reported */
    int64_t resume_step;         /* the step the ranks resumed from (-1 before they report it) */
    double launched_at, detected_at; /* monotonic s */
} watch_result_t;

/* Watches until done or failure (emitting ranks_up, resumed, first_step, failure). */
void watch_incarnation(const watch_config_t *c, watch_result_t *r);
/* The highest step in the incarnation's keys now (-1: none, or etcd did not answer). Read after
 * the teardown: a rank's last steps reach etcd through its member thread, after the watch's
 * last poll when the failure was found at once. */
int64_t watch_last_step(const watch_config_t *c);
/* Ends the session of mpirun (calling tick while it waits); returns its seconds, or -1 when
 * processes survived SIGKILL. */
double watch_teardown(pid_t mpirun, double grace_s, void (*tick)(void *), void *tick_user);

#endif /* MOE_TOOLS_INCARNATION_WATCH_H */
