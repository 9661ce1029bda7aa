/*
 * The launcher's choice of mesh on the slots that are left: the largest world (at most
 * max_world, at least min_world) that has a valid mesh, keeping the global batch. Which meshes
 * are valid is the trainer's rule, not the launcher's: the trainer lists them (moe_train
 * --print-config --print-meshes N, from its own trainer_config_validate), so the launcher never
 * picks a mesh the trainer would refuse. Among the valid meshes of that world the one nearest
 * the job's own is taken (tp kept first: it splits every expert; then the smallest change of
 * ep, pp, dp in factors of two), and the microbatches m nearest the job's (the larger on a tie).
 */
#ifndef MOE_ELASTIC_MESH_CHOICE_H
#define MOE_ELASTIC_MESH_CHOICE_H

#include <stddef.h>
#include <stdint.h>

#include <moe/core.h>

typedef struct el_mesh {
    int64_t tp, ep, dp, pp;
    int64_t microbatches;
} el_mesh_t;

typedef struct el_model_shape {
    el_mesh_t job;          /* the job's own mesh and microbatches: the preferred ones */
    const el_mesh_t *valid; /* every mesh the trainer accepts (any order) */
    size_t n_valid;
} el_model_shape_t;

/* [out] out. NOT_FOUND when no world in [min_world, max_world] has a valid mesh. */
moe_status_t el_choose_mesh(const el_model_shape_t *shape, int64_t max_world, int64_t min_world,
                            el_mesh_t *out);

#endif /* MOE_ELASTIC_MESH_CHOICE_H */
