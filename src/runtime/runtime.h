/*
 * The runtime handle: the backend, the mesh, logging and the seed. Modules above core
 * (moe/, optim/, pipeline/, ckpt/) reach the backend and the mesh through it, register the
 * objects they make on it (so it is not destroyed under them), and ask it whether the mesh
 * lost a peer (then nothing a communicator may still touch is freed).
 */
#ifndef MOE_RUNTIME_INTERNAL_H
#define MOE_RUNTIME_INTERNAL_H

#include <moe/core.h>
#include <moe/mesh.h>

#include "backend/backend.h"
#include "core/log.h"
#include "mesh/mesh.h"

/* Kinds of objects made on a runtime, counted while alive. */
typedef enum moe_runtime_child {
    MOE_CHILD_LAYER = 0,
    MOE_CHILD_OPTIMIZER = 1,
    MOE_CHILD_PIPELINE = 2,
    MOE_CHILD_CHECKPOINTER = 3,
    MOE_CHILD_KINDS = 4
} moe_runtime_child_t;

struct moe_runtime {
    uint64_t magic;
    moe_backend_t backend;
    moe_mesh_t *mesh;
    moe_logger_t logger;
    uint64_t seed;
    int32_t device_index;
    int32_t children[MOE_CHILD_KINDS]; /* alive, by kind */
};

/* A create registers its object, its destroy unregisters it. */
void moe_runtime_adopt(moe_runtime_t *rt, moe_runtime_child_t kind);
void moe_runtime_disown(moe_runtime_t *rt, moe_runtime_child_t kind);

/* True once the mesh lost a peer (a timeout, an MPI/NCCL error, an abort, here or reported by
 * another rank): operations that never completed may still read or write their buffers, so
 * the objects on the runtime leak what may back one instead of freeing it. */
bool moe_runtime_poisoned(const moe_runtime_t *rt);

/* Shorthand for enqueuing backend ops: MOE_OPS(rt)->op(MOE_CTX(rt), ...). */
#define MOE_OPS(rt) ((rt)->backend.ops)
#define MOE_CTX(rt) ((rt)->backend.ctx)

#endif /* MOE_RUNTIME_INTERNAL_H */
