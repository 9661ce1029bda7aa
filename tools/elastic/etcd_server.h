/*
 * A private etcd on loopback for a single-host job (and for the tests): free ports, a data
 * directory in a fresh temporary folder, its own session, ready once it answers a write;
 * supervised (restarted on the same folder and ports when it exits: its keys and leases come
 * back with it); stopped with SIGTERM, then SIGKILL, and its folder removed. It gets SIGTERM
 * when the launcher dies.
 */
#ifndef MOE_TOOLS_ETCD_SERVER_H
#define MOE_TOOLS_ETCD_SERVER_H

#include <sys/types.h>

typedef struct etcd_server {
    pid_t pid;
    char dir[256];       /* data directory and etcd.log */
    char endpoint[64];   /* http://127.0.0.1:<port> */
    char peer[64];
    char binary[256];
} etcd_server_t;

/* Starts `binary` (NULL: "etcd" on PATH) and waits up to ready_ms for it to answer.
 * Returns 0, or -1 with a message in err. */
int etcd_server_start(etcd_server_t *s, const char *binary, int ready_ms, char *err, size_t len);
/* When the server has exited: *wait_status, a restart, and 1 (-1 when it could not be started
 * again); 0 while it runs. Never blocks. */
int etcd_server_supervise(etcd_server_t *s, int *wait_status);
/* Stops it (SIGTERM, SIGKILL after 5 s) and removes its folder; a no-op on a stopped server. */
void etcd_server_stop(etcd_server_t *s);

#endif /* MOE_TOOLS_ETCD_SERVER_H */
