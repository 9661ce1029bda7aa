/*
 * The 4D process mesh inside a runtime: this rank's coordinates and one communicator per
 * axis. A runtime without a mesh config (or with a mesh of 1 x 1 x 1 x 1 outside mpirun) is a
 * world of one: every axis has size 1 and every communicator pointer is NULL, so callers
 * skip communication when an axis size is 1.
 *
 * Rank layout: order[0] is the fastest-varying axis. With the default "tp-ep-dp-pp"
 *   world_rank = tp + TP * (ep + EP * (dp + DP * pp)).
 * Groups (every member of a group has equal coordinates on the other axes):
 *   tp, ep, dp, pp   vary one axis
 *   edp              ranks holding the same experts: same tp, ep, pp, all dp (the members of
 *                    dp, on its own communicator so expert-gradient reductions never queue
 *                    behind other dp traffic)
 *   dense            ranks holding the same replicated (router/dense) parameters: same tp, pp,
 *                    all ep x dp, ordered by ep + EP * dp
 *   stage            the ranks of one pp stage (same pp, all tp x ep x dp, ordered by
 *                    tp + TP * (ep + EP * dp)): they share the stage's layers, whose configs
 *                    they compare at creation (host only)
 *   world            everyone
 * comm[] carries the layer's data (device buffers on the CUDA backend: staged MPI or NCCL);
 * host[] are MPI communicators over the same groups for small host-side control messages
 * (counts, statistics). On the host backend they are the same objects.
 *
 * All of them share the mesh's watch (comm/peer_watch.h): the first failure of any poisons the
 * mesh, and destroy then leaks what MPI may still touch and leaves MPI unfinalised.
 */
#ifndef MOE_MESH_INTERNAL_H
#define MOE_MESH_INTERNAL_H

#include <stdbool.h>

#include <moe/mesh.h>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/log.h"

#define MOE_MESH_DENSE 6 /* index of the dense (ep x dp) group in comm[] / host[] */
#define MOE_MESH_STAGE 7 /* index of the stage (tp x ep x dp) group; host[] only */
#define MOE_MESH_GROUPS 8

typedef struct moe_mesh {
    int32_t size[5]; /* indexed by moe_axis_t: tp, ep, dp, pp, edp */
    int32_t coord[5];
    int32_t world_rank, world_size;
    moe_comm_t *comm[MOE_MESH_GROUPS]; /* moe_axis_t, DENSE; NULL where size 1 (and STAGE) */
    moe_comm_t *host[MOE_MESH_GROUPS]; /* the same groups over MPI with host buffers */
    moe_comm_watch_t *watch;           /* NULL in a world of one */
    moe_comm_waited_t waited;          /* the time every communicator above spent waiting */
    int32_t order[4];                  /* axes, fastest-varying first */
    moe_comm_backend_t comm_backend;   /* resolved: MPI or NCCL (MPI for a world of one) */
    bool mpi_initialised; /* this mesh acquired MPI (released, or abandoned, by destroy) */
    bool lost;            /* creation failed in a way the other ranks cannot follow */
} moe_mesh_t;

/* [in] cfg may be NULL (world of one). [in] backend: the runtime's compute backend (device
 * staging, NCCL choice), may be NULL for host buffers. [in] device_index: this rank's CUDA
 * device (for AUTO's choice of NCCL), ignored on the host. Collective over the world: the
 * ranks compare their mesh configs first, and a rank whose own config is invalid tells the
 * others, so every rank fails at once with the same message. */
moe_status_t moe_mesh_create(const moe_mesh_config_t *cfg, const moe_backend_t *backend,
                             int32_t device_index, const moe_logger_t *logger, moe_mesh_t **out);
/* NULL: SUCCESS. Returns within the mesh's timeout: ABORTED (TIMEOUT when the departure check
 * below timed out) when the mesh lost a peer, then nothing MPI may still touch is freed and
 * MPI is not finalised (it could not finish: the process should exit). When this mesh's
 * release would finalise MPI, the ranks first meet in a barrier under the timeout, so that a
 * peer lost after the last collective is found here rather than in a hanging MPI_Finalize. */
moe_status_t moe_mesh_destroy(moe_mesh_t *mesh);
/* The mesh's first failure (SUCCESS while healthy); [out] cause, may be NULL. */
moe_status_t moe_mesh_failure(const moe_mesh_t *mesh, const char **cause);
/* Compare the fields of a configuration across `group` (moe_axis_t, MOE_MESH_DENSE or
 * MOE_MESH_STAGE) with moe_comm_agree (comm.h); returns `local` alone where the group has a
 * single rank. Collective over the group. */
moe_status_t moe_mesh_agree(moe_mesh_t *mesh, int group, const char *what,
                            const moe_agree_field_t *fields, int n, moe_status_t local);

/* Size of a group (moe_axis_t or MOE_MESH_DENSE). */
int32_t moe_mesh_group_size(const moe_mesh_t *mesh, int group);

/* Parse "tp-ep-dp-pp" (any order of the four names, '-' or ',' between them) into axes,
 * fastest first. INVALID_ARGUMENT naming the text when it is not a permutation. */
moe_status_t moe_mesh_parse_order(const char *text, int32_t order[4]);

/* World rank of the rank at coordinates coord[0..3] (tp, ep, dp, pp) for the given sizes
 * and order, and the inverse. Pure functions, shared with the tests. */
int32_t moe_mesh_rank_of(const int32_t size[4], const int32_t order[4], const int32_t coord[4]);
void moe_mesh_coords_of(const int32_t size[4], const int32_t order[4], int32_t rank,
                        int32_t coord[4]);

#endif /* MOE_MESH_INTERNAL_H */
