/*
 * A private etcd on loopback for a single-host job and for the tests: one member, or a cluster
 * of several (three: one may be lost with nothing changed) so that the clients' fail-over and a
 * lost quorum can be exercised on one machine. Free ports, each member's data in a folder of
 * one fresh temporary folder, each member in its own session, ready once the cluster answers a
 * write; supervised (a member that exits is started again on the same folder and ports: its
 * keys and leases come back with it, a cluster member rejoins); stopped with SIGTERM, then
 * SIGKILL, and the folder removed. The members get SIGTERM when the launcher dies.
 */
#ifndef MOE_TOOLS_ETCD_SERVER_H
#define MOE_TOOLS_ETCD_SERVER_H

#include <sys/types.h>

#define ETCD_SERVER_MAX_MEMBERS 7

typedef struct etcd_server_member {
    pid_t pid; /* 0: not running */
    char name[16];
    char client[64]; /* http://127.0.0.1:<port> */
    char peer[64];
} etcd_server_member_t;

typedef struct etcd_server {
    int n; /* members; 0: none started */
    etcd_server_member_t m[ETCD_SERVER_MAX_MEMBERS];
    char dir[256]; /* member i's data in <dir>/<name>, its log <dir>/<name>.log */
    char endpoint[ETCD_SERVER_MAX_MEMBERS * 64]; /* the clients' list: every member, commas */
    char cluster[ETCD_SERVER_MAX_MEMBERS * 96];  /* etcd's --initial-cluster */
    char binary[256];
} etcd_server_t;

/* Starts n members (1 .. ETCD_SERVER_MAX_MEMBERS) of `binary` (NULL: "etcd" on PATH) and waits
 * up to ready_ms for the cluster to answer. Returns 0, or -1 with a message in err. */
int etcd_server_start(etcd_server_t *s, const char *binary, int n, int ready_ms, char *err,
                      size_t len);
/* When a member has exited: *member, *wait_status, a restart, and 1 (-1 when it could not be
 * started again); 0 while every member runs. Never blocks; call again for the next one. */
int etcd_server_supervise(etcd_server_t *s, int *member, int *wait_status);
/* Stops every member (SIGTERM, SIGKILL after 5 s) and removes the folder; a no-op when none. */
void etcd_server_stop(etcd_server_t *s);

#endif /* MOE_TOOLS_ETCD_SERVER_H */
