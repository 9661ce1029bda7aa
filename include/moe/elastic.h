/*
 * libmoe elastic membership: a rank's side of the elastic launcher (moe_elastic,
 * docs/elastic.md).
 *
 * The launcher runs a training program as successive mpirun incarnations and watches them
 * through etcd. Each rank holds a member: an etcd lease with a TTL, kept alive by a
 * background thread, with one key <prefix>/member/<slot> attached to it that says who the rank
 * is (slot, rank, pid) and how far it got: {"slot", "rank", "pid", "phase" (started, resumed,
 * training), "step", "resumed_step" (the checkpoint's step once resumed, else -1), "busy"
 * (the last MOE_ELASTIC_BUSY_WINDOW steps' busy times, [[step, seconds], ...], once
 * reported)}. A rank that dies or stops (SIGSTOP, a hung host) stops renewing, its lease
 * expires within the TTL, etcd deletes the key and the launcher sees which slot is gone. A rank
 * that fails by itself (a lost peer, a training error) says so first with
 * moe_elastic_member_report_exit, in a key <prefix>/exit/<slot> that outlives it.
 *
 * The launcher describes the member through the environment of every rank:
 *   MOE_ELASTIC_ENDPOINT  etcd's JSON gateway, "http://127.0.0.1:2379", or a cluster's members
 *                         comma-separated (requests fail over between them)
 *   MOE_ELASTIC_PREFIX    the incarnation's keys, "/moe/<job>/inc/<n>"
 *   MOE_ELASTIC_SLOTS     the slot of each world rank, "0,1,2,4" (rank r has the r-th)
 *   MOE_ELASTIC_TTL_MS    the lease TTL
 *   MOE_ELASTIC_LAUNCHER_KEY  the launcher's own key on its lease, "/moe/<job>/launcher/member/0"
 *   MOE_ELASTIC_ORPHAN_MS     how long etcd may stay unreachable before the rank counts as
 *                             orphaned
 * moe_elastic_member_create_from_env reads them; without MOE_ELASTIC_ENDPOINT the program was
 * not started by the launcher and no member is made.
 *
 * Not collective. One member per rank; its calls may come from any one thread at a time.
 */
#ifndef MOE_ELASTIC_H
#define MOE_ELASTIC_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_elastic_member moe_elastic_member_t;

/* Busy times the member key carries (moe_elastic_member_report_busy). */
#define MOE_ELASTIC_BUSY_WINDOW 16

typedef enum moe_elastic_phase {
    MOE_ELASTIC_PHASE_STARTED = 0,  /* registered; step: the step it starts from (0 until known) */
    MOE_ELASTIC_PHASE_RESUMED = 1,  /* a checkpoint is loaded; step: its step */
    MOE_ELASTIC_PHASE_TRAINING = 2, /* step: the last optimizer step completed */
} moe_elastic_phase_t;

typedef struct moe_elastic_member_config {
    size_t struct_size;
    const char *endpoint;       /* etcd's JSON gateway, http://host:port, or several members
                                   comma-separated, failed over in order (required) */
    const char *prefix;         /* the incarnation's key prefix (required) */
    int32_t slot;               /* the launcher's slot of this rank, >= 0 */
    int32_t rank;               /* the world rank, >= 0 */
    int32_t ttl_ms;             /* lease TTL, rounded up to whole seconds; default 5000 */
    int32_t request_timeout_ms; /* each etcd request; default 2000 */
} moe_elastic_member_config_t;

/* Called once, from the keep-alive thread, when the member is orphaned: the launcher's key
 * (moe_elastic_member_watch_launcher) is gone, etcd stayed unreachable for orphan_ms, or the
 * member's own lease expired (the launcher has given the rank up). why is static text for the
 * message. The program should end (a rank left running by a dead launcher is an orphan); the
 * library never ends it. */
typedef void (*moe_elastic_orphan_fn)(void *user, const char *why);

MOE_API moe_elastic_member_config_t moe_elastic_member_config_default(void);

/* Grants the lease, writes the member key (phase STARTED) and starts the keep-alive thread,
 * which renews the lease every third of the TTL (at most every second) and writes each
 * reported phase. [out] out. Fails (REMOTE_ERROR, TIMEOUT) when etcd does not answer. */
MOE_API moe_status_t moe_elastic_member_create(const moe_elastic_member_config_t *config,
                                               moe_elastic_member_t **out);
/* The member the launcher describes in the environment (above) for world rank `rank`;
 * [out] *out = NULL and SUCCESS when MOE_ELASTIC_ENDPOINT is unset. INVALID_ARGUMENT names the
 * variable when one is malformed or the rank has no slot. */
MOE_API moe_status_t moe_elastic_member_create_from_env(int32_t rank, moe_elastic_member_t **out);

/* Records the rank's progress; the keep-alive thread writes it to etcd (never blocks on etcd).
 * The member's first failure to renew (the lease expired: the process was stopped for longer
 * than the TTL, or etcd is gone) is returned here and by every later call. */
MOE_API moe_status_t moe_elastic_member_report(moe_elastic_member_t *m, moe_elastic_phase_t phase,
                                               int64_t step);
/* Records the busy time of optimizer step `step` (>= 0): the step's wall time minus the time
 * the rank spent blocked waiting for its peers (the growth of moe_runtime_wait_stats'
 * wait_seconds over the step), in seconds >= 0. The member key carries the last
 * MOE_ELASTIC_BUSY_WINDOW of them, written by the keep-alive thread (never blocks on etcd), so
 * a launcher that polls less often than steps end still sees every step; moe_elastic finds
 * slow ranks (stragglers) from them (docs/elastic.md). Returns the member's first failure to
 * renew, as report does. */
MOE_API moe_status_t moe_elastic_member_report_busy(moe_elastic_member_t *m, int64_t step,
                                                    double busy_s);
/* [out] slot: the launcher's slot of this member (the same across incarnations for one slot,
 * where the world rank may change). */
MOE_API moe_status_t moe_elastic_member_slot(const moe_elastic_member_t *m, int32_t *slot);
/* Writes <prefix>/exit/<slot> = {"rank", "slot", "code", "step" (the last reported), "cause"} at once (no lease: the key
 * outlives the process), before the program exits with `code` (0: done; MOE_EXIT_PEER_LOST: a
 * peer was lost; other: this rank failed). cause may be NULL. */
MOE_API moe_status_t moe_elastic_member_report_exit(moe_elastic_member_t *m, int32_t code,
                                                    const char *cause);
/* Watches the launcher's key at every renewal: once etcd says it is gone, or etcd has not
 * answered for orphan_ms (> 0), the member is orphaned. create_from_env calls it with
 * MOE_ELASTIC_LAUNCHER_KEY and MOE_ELASTIC_ORPHAN_MS (default 60000) when the first is set. */
MOE_API moe_status_t moe_elastic_member_watch_launcher(moe_elastic_member_t *m,
                                                       const char *launcher_key, int32_t orphan_ms);
/* Sets the orphan handler (NULL: none). Not collective. */
MOE_API moe_status_t moe_elastic_member_set_orphan_handler(moe_elastic_member_t *m,
                                                           moe_elastic_orphan_fn fn, void *user);
/* Stops the keep-alive thread and revokes the lease (its member key goes with it). NULL is a
 * no-op. Returns the member's first failure, if any; the member is freed either way. */
MOE_API moe_status_t moe_elastic_member_destroy(moe_elastic_member_t *m);

#ifdef __cplusplus
}
#endif

#endif /* MOE_ELASTIC_H */
