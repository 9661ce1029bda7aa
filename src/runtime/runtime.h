/*
 * The runtime handle: the backend, the mesh, logging and the seed. Modules above core
 * (moe/, optim/, pipeline/, ckpt/) reach the backend and the mesh through it, and ask it
 * whether the mesh lost a peer (then nothing a communicator may still touch is freed).
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

/* True once the mesh lost a peer (a timeout, an MPI/NCCL error, an abort, here or reported by
 * another rank): operations that never completed may still read or write their buffers, so
 * the objects on the runtime leak what may back one instead of freeing it. */
bool moe_runtime_poisoned(const moe_runtime_t *rt);

/* Shorthand for enqueuing backend ops: MOE_OPS(rt)->op(MOE_CTX(rt), ...). */
#define MOE_OPS(rt) ((rt)->backend.ops)
#define MOE_CTX(rt) ((rt)->backend.ctx)

#endif /* MOE_RUNTIME_INTERNAL_H */
