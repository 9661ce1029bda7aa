/*
 * The runtime handle: the backend, the mesh, logging and the seed. Modules above core
 * (moe/, optim/, pipeline/, ckpt/) reach the backend and the mesh through it.
 */
#ifndef MOE_RUNTIME_INTERNAL_H
#define MOE_RUNTIME_INTERNAL_H

#include <moe/core.h>
#include <moe/mesh.h>

#include "../backend/backend.h"
#include "../core/log.h"
#include "../mesh/mesh.h"

struct moe_runtime {
    uint64_t magic;
    moe_backend_t backend;
    moe_mesh_t *mesh;
    moe_logger_t logger;
    uint64_t seed;
    int32_t device_index;
};

/* Shorthand for enqueuing backend ops: MOE_OPS(rt)->op(MOE_CTX(rt), ...). */
#define MOE_OPS(rt) ((rt)->backend.ops)
#define MOE_CTX(rt) ((rt)->backend.ctx)

#endif /* MOE_RUNTIME_INTERNAL_H */
