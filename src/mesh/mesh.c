/* The process mesh. This file holds the world-of-one case; the distributed mesh lives
 * beside it once MPI is available. */
#include "mesh.h"

#include <stdlib.h>

#include "../core/error.h"

moe_mesh_config_t moe_mesh_config_default(void)
{
    moe_mesh_config_t c = {
        .struct_size = sizeof c, .tp = 1, .ep = 1, .dp = 1, .pp = 1, .rank_order = NULL,
        .comm = MOE_COMM_AUTO, .mpi_comm = NULL, .timeout_ms = 300000,
    };
    return c;
}

moe_status_t moe_mesh_create(const moe_mesh_config_t *cfg, bool device_buffers,
                             const moe_logger_t *logger, moe_mesh_t **out)
{
    (void)device_buffers;
    (void)logger;
    if (cfg) {
        MOE_CHECK_STRUCT_SIZE(cfg, moe_mesh_config_t, sizeof(moe_mesh_config_t));
        MOE_CHECK_ARG(cfg->tp >= 1 && cfg->ep >= 1 && cfg->dp >= 1 && cfg->pp >= 1,
                      "mesh sizes must be >= 1 (tp=%d ep=%d dp=%d pp=%d)", cfg->tp, cfg->ep,
                      cfg->dp, cfg->pp);
        if ((int64_t)cfg->tp * cfg->ep * cfg->dp * cfg->pp != 1)
            return MOE_FAIL(MOE_STATUS_UNSUPPORTED,
                            "a mesh of tp=%d ep=%d dp=%d pp=%d needs the distributed mesh, "
                            "which this build does not have",
                            cfg->tp, cfg->ep, cfg->dp, cfg->pp);
    }
    moe_mesh_t *m = calloc(1, sizeof *m);
    if (!m) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "mesh allocation");
    for (int a = 0; a < 5; a++) m->size[a] = 1;
    m->world_size = 1;
    *out = m;
    return MOE_STATUS_SUCCESS;
}

void moe_mesh_destroy(moe_mesh_t *mesh)
{
    if (!mesh) return;
    for (int a = 0; a < 6; a++) moe_comm_destroy(mesh->comm[a]);
    free(mesh);
}
