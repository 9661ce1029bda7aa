/*
 * libmoe 4D process mesh: world = tp x ep x dp x pp.
 *
 * Rank order names the axes from fastest- to slowest-varying; the default "tp-ep-dp-pp"
 * keeps tp and ep inside a node's fast links and lets pp cross nodes. Experts are sharded
 * over ep and replicated over dp; the expert-data-parallel group (edp) of a rank is the ranks
 * holding the same experts (same tp, ep, pp coordinates; all dp).
 */
#ifndef MOE_MESH_H
#define MOE_MESH_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moe_comm_backend {
    MOE_COMM_AUTO =
        0, /* NCCL for the CUDA backend when every axis maps to distinct GPUs, else MPI */
    MOE_COMM_MPI = 1, /* host buffers; device buffers staged through pinned host memory */
    MOE_COMM_NCCL = 2 /* device buffers on NCCL's own stream */
} moe_comm_backend_t;

struct moe_mesh_config {
    size_t struct_size;
    int32_t tp, ep, dp, pp; /* each >= 1; product must equal the world size */
    const char *rank_order; /* NULL: "tp-ep-dp-pp" */
    moe_comm_backend_t comm;
    void *mpi_comm; /* pointer to an MPI_Comm to use as the world; NULL: MPI_COMM_WORLD */
    int32_t
        timeout_ms; /* collectives that take longer fail with MOE_STATUS_TIMEOUT; default 300000 */
};

MOE_API moe_mesh_config_t moe_mesh_config_default(void);

typedef enum moe_axis {
    MOE_AXIS_TP = 0,
    MOE_AXIS_EP = 1,
    MOE_AXIS_DP = 2,
    MOE_AXIS_PP = 3,
    MOE_AXIS_EDP = 4, /* expert-data-parallel */
    MOE_AXIS_WORLD = 5
} moe_axis_t;

/* [out] this rank's coordinate along `axis` and the axis size. A runtime without a mesh is a
 * world of one. */
MOE_API moe_status_t moe_runtime_axis(const moe_runtime_t *rt, moe_axis_t axis, int32_t *rank,
                                      int32_t *size);

#ifdef __cplusplus
}
#endif
#endif /* MOE_MESH_H */
