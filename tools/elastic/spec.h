/*
 * The job spec of moe_elastic: its options (slots, spares, world limits, the lease TTL,
 * restarts, etcd, events, mpirun, stragglers) and the trainer command after "--", and the
 * model shape read from the trainer itself (its --print-config), which the mesh choice needs.
 */
#ifndef MOE_TOOLS_SPEC_H
#define MOE_TOOLS_SPEC_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "elastic/mesh_choice.h"
#include "straggler.h"

#define SPEC_MAX_MPIRUN_ARGS 32

typedef struct job_spec {
    int slots, spares;        /* ranks of the job; spare slots taken when one fails */
    int min_world, max_world; /* the world never goes below / above these */
    int ttl_ms;               /* a rank's lease TTL */
    int max_restarts;
    int grace_ms;         /* SIGTERM to SIGKILL when ending an incarnation */
    int start_timeout_ms; /* every rank registered in etcd */
    int poll_ms;
    const char *etcd; /* an existing etcd's endpoints (commas); NULL: a private one */
    int etcd_members; /* the private etcd's members (1, or 3 to survive a lost one) */
    const char *etcd_binary;
    const char *events;     /* JSON-lines file */
    const char *mpirun_log; /* mpirun's whole output (the launcher relays it without noise) */
    const char *mpirun;
    const char *job; /* keys under /moe/<job>/ */
    const char *mpirun_args[SPEC_MAX_MPIRUN_ARGS];
    int n_mpirun_args;
    /* agent mode (agent.h): this host's name and slots (--slots), the job's ranks */
    bool agent;
    const char *host; /* default: gethostname (host_name) */
    char host_name[256];
    int ranks;
    bool host_session; /* this host's ranks are the agent's session's (simulated) */
    char **trainer;    /* argv of the trainer (after "--"), NULL-terminated */
    int n_trainer;
    straggler_config_t straggler; /* --straggler-* */
} job_spec_t;

/* Returns 0, 1 for --help, or -1 with a message naming the option in err. */
int job_spec_parse(job_spec_t *s, int argc, char **argv, char *err, size_t len);
void job_spec_usage(FILE *f);
/* The launcher's and agents' etcd request timeout: TTL/4 within 250 ms .. 2 s, short because a
 * poll tries every member while a cluster has lost its quorum and must not keep the process
 * checks waiting. */
int job_spec_request_ms(const job_spec_t *s);

typedef struct trainer_info {
    el_model_shape_t shape;
    int64_t steps, ckpt_every;
    char ckpt_dir[1024];
} trainer_info_t;

/* Runs the trainer with --print-config --print-meshes <slots + spares> on the job's slots (so
 * its own checks run on the job's mesh) and reads the job's mesh, its settings and the list of
 * meshes the trainer accepts (info->shape.valid, owned: trainer_info_free). Returns 0, or -1
 * with a message in err. */
int trainer_info_query(const job_spec_t *s, trainer_info_t *info, char *err, size_t len);

void trainer_info_free(trainer_info_t *info);

#endif /* MOE_TOOLS_SPEC_H */
