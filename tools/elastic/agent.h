/*
 * An agent: moe_elastic on one host of a multi-host job (docs/elastic.md, "Agents and the
 * leader"). It owns the host's slots and its ranks' processes:
 *   - it holds a lease of one TTL, renewed by a thread of its own, and, on it,
 *     /moe/<job>/agents/<host> = {"host", "slots", "pid"}: the key is the host's liveness (a
 *     lost host's key expires with its lease);
 *   - at every poll it finds the ranks of the current incarnation on this host (processes whose
 *     environment names the incarnation's prefix, proc_job_ranks) and, for one stopped or gone
 *     without an exit record, writes that record itself (create-if-absent, so a rank's own
 *     record is never overwritten): code 128 + the signal, the cause naming the host, which the
 *     leader's watch blames like any failing exit record;
 *   - when the leader ends an incarnation (/moe/<job>/inc/<n>/end, or a newer incarnation) it
 *     ends its ranks there (stopped ones SIGKILLed, the rest SIGTERM, SIGKILL after the grace
 *     period) and acknowledges with inc/<n>/ended/<host>;
 *   - it stands for leader: /moe/<job>/leader, created in one transaction on its lease
 *     (el_etcd_create_key); the agent that creates it runs the job (the leader function), and
 *     keeps doing all of the above at every poll of the leader's loop (agent_tick). When the
 *     leader's host is lost its lease expires, the key with it, and the next agent to poll
 *     takes it; that leader ends what is left of the incarnation and relaunches.
 * The agent exits with the job's exit code once the leader writes it (/moe/<job>/exit: 0 done),
 * or, as the leader, with its own.
 */
#ifndef MOE_TOOLS_AGENT_H
#define MOE_TOOLS_AGENT_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "elastic/etcd.h"
#include "events.h"
#include "spec.h"

typedef struct agent agent_t;

/* The leader's job loop (main.c): runs the job over the agents' hosts; returns the exit code. */
typedef int (*agent_leader_fn)(job_spec_t *s, agent_t *a);

/* Runs an agent with s->host, s->slots, s->etcd until the job is done; returns the exit code. */
int agent_main(job_spec_t *s, agent_leader_fn lead);

/* The agent's duties, for the leader's polls: its lease, its ranks, ended incarnations. */
void agent_tick(agent_t *a);
el_etcd_t *agent_etcd(agent_t *a);
events_t *agent_events(agent_t *a);
int64_t agent_lease(agent_t *a);
/* True once the agent's lease expired (etcd away longer than the TTL): its host key and any
 * leader key on it are gone, another agent may lead; a leader stops (its incarnation is the
 * new leader's to end) and the agent leaves the job. */
bool agent_deposed(agent_t *a);

#endif /* MOE_TOOLS_AGENT_H */
