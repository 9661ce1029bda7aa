/*
 * The launcher's choice of mesh on the slots that are left: the largest world (at most
 * max_world, at least min_world) on which the model has a valid mesh, keeping the global batch.
 * Valid, as the trainer checks it: world = tp*ep*dp*pp, E % ep == 0, F % tp == 0,
 * L % (pp*v) == 0, B % (ep*dp*m) == 0, and v > 1 only with pp >= 2 and m % pp == 0. Among the
 * valid meshes of that world the one nearest the job's own is taken (tp kept first: it splits
 * every expert; then the smallest change of ep, pp, dp in factors of two), and the
 * microbatches m nearest the job's.
 */
#ifndef MOE_ELASTIC_MESH_CHOICE_H
#define MOE_ELASTIC_MESH_CHOICE_H

#include <stdint.h>

#include <moe/core.h>

typedef struct el_mesh {
    int64_t tp, ep, dp, pp;
    int64_t microbatches;
} el_mesh_t;

typedef struct el_model_shape {
    int64_t experts, ffn_hidden, layers, virtual_stages, batch; /* E, F, L, v, B */
    el_mesh_t job;  /* the job's own mesh and microbatches: the preferred ones */
} el_model_shape_t;

/* [out] out. NOT_FOUND, naming the shape, when no world in [min_world, max_world] has one. */
moe_status_t el_choose_mesh(const el_model_shape_t *shape, int64_t max_world, int64_t min_world,
                            el_mesh_t *out);
/* 1 when m is valid for shape (the rules above), else 0. */
int el_mesh_valid(const el_model_shape_t *shape, const el_mesh_t *m);

#endif /* MOE_ELASTIC_MESH_CHOICE_H */
