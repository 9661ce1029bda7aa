/*
 * The 4D process mesh inside a runtime: this rank's coordinates and one communicator per
 * axis. A runtime without a mesh config is a world of one: every axis has size 1 and every
 * communicator pointer is NULL, so callers skip communication when an axis size is 1.
 */
#ifndef MOE_MESH_INTERNAL_H
#define MOE_MESH_INTERNAL_H

#include <stdbool.h>

#include <moe/mesh.h>

#include "../comm/comm.h"
#include "../core/log.h"

typedef struct moe_mesh {
    int32_t size[5];        /* indexed by moe_axis_t: tp, ep, dp, pp, edp */
    int32_t coord[5];
    int32_t world_rank, world_size;
    moe_comm_t *comm[6];    /* indexed by moe_axis_t; NULL where the axis has size 1 */
} moe_mesh_t;

/* [in] cfg may be NULL (world of one). device_buffers: the runtime's tensors live on a GPU. */
moe_status_t moe_mesh_create(const moe_mesh_config_t *cfg, bool device_buffers,
                             const moe_logger_t *logger, moe_mesh_t **out);
void moe_mesh_destroy(moe_mesh_t *mesh);

#endif /* MOE_MESH_INTERNAL_H */
