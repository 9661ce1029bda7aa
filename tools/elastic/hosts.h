/*
 * The leader's view of the hosts (agent.h): which agents are alive and their slots, stable
 * slot numbers per host, the hostfile of an incarnation, and an incarnation ended on every
 * host.
 *
 * Slot numbers: each host gets a fixed range the first time a leader sees its agent
 * (/moe/<job>/slotmap = {"<host>": first slot, ...}, no lease), so a slot names the same
 * host's same place under every leader. Failed slots are kept in /moe/<job>/failed ("3,4"),
 * so a new leader does not use them again either.
 */
#ifndef MOE_TOOLS_HOSTS_H
#define MOE_TOOLS_HOSTS_H

#include <stdbool.h>

#include "elastic/etcd.h"

#define HOSTS_MAX 64

typedef struct hosts {
    el_etcd_t *etcd;
    const char *job;
    int n;
    char name[HOSTS_MAX][64];
    int first[HOSTS_MAX], slots[HOSTS_MAX];
    bool live[HOSTS_MAX]; /* its agent's key is there */
    int total;            /* slot numbers in use: 0 .. total-1 */
} hosts_t;

/* Reads the live agents and the slot map, giving new hosts their slots (written back). Returns
 * 0, or -1 when etcd did not answer (message in moe_last_error). */
int hosts_refresh(hosts_t *h);
/* The host of a slot (index into name), or -1. */
int hosts_of_slot(const hosts_t *h, int slot);
/* Writes "<host> slots=<n>" for the hosts of slots[0..world) (each host's slots contiguous, in
 * slot order: mpirun then places world rank k on slots[k]'s host). Returns 0 or -1. */
int hosts_write_hostfile(const hosts_t *h, const int *slots, int world, const char *path);
/* The failed slots kept in etcd: read into failed[0..max) (true: failed) / written. */
int hosts_failed_read(hosts_t *h, bool *failed, int max);
int hosts_failed_write(hosts_t *h, const bool *failed, int max);
/* Ends incarnation inc on every host: writes its end key, then waits up to wait_s for each
 * host of slots[0..world) to acknowledge (its ranks there ended) or to be lost (its agent's key
 * gone). Calls tick while it waits. [out] lost[i] for host i. Returns the seconds it took. */
double hosts_end_incarnation(hosts_t *h, int inc, const int *slots, int world, double wait_s,
                             bool *lost, void (*tick)(void *), void *tick_user);

#endif /* MOE_TOOLS_HOSTS_H */
