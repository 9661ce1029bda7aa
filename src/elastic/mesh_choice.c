/*
 * The launcher's mesh choice (mesh_choice.h): every valid mesh of each world from the largest
 * down, scored by its distance from the job's mesh. The list is a job's meshes (small), so the
 * search is exhaustive and exact.
 */
#include <math.h>
#include <stdlib.h>

#include "core/error.h"
#include "mesh_choice.h"

static double log2_ratio(int64_t a, int64_t b) { return fabs(log2((double)a / (double)b)); }

static int same_axes(const el_mesh_t *a, const el_mesh_t *b)
{
    return a->tp == b->tp && a->ep == b->ep && a->dp == b->dp && a->pp == b->pp;
}

moe_status_t el_choose_mesh(const el_model_shape_t *s, int64_t max_world, int64_t min_world,
                            el_mesh_t *out)
{
    MOE_CHECK_ARG(s && out && (s->valid || !s->n_valid), "mesh choice: NULL argument");
    MOE_CHECK_ARG(s->job.tp >= 1 && s->job.ep >= 1 && s->job.dp >= 1 && s->job.pp >= 1 &&
                      s->job.microbatches >= 1,
                  "mesh choice: every axis and the microbatches of the job's mesh must be >= 1");
    MOE_CHECK_ARG(min_world >= 1, "mesh choice: min_world %lld must be >= 1", (long long)min_world);
    for (size_t i = 0; i < s->n_valid; i++) {
        const el_mesh_t *m = &s->valid[i];
        MOE_CHECK_ARG(m->tp >= 1 && m->ep >= 1 && m->dp >= 1 && m->pp >= 1 && m->microbatches >= 1,
                      "mesh choice: valid mesh %zu has an axis below 1", i);
    }
    for (int64_t w = max_world; w >= min_world; w--) {
        const el_mesh_t *best = NULL;
        double best_d = 0;
        for (size_t i = 0; i < s->n_valid; i++) {
            const el_mesh_t *m = &s->valid[i];
            if (m->tp * m->ep * m->dp * m->pp != w) continue;
            /* tp first (x16), then ep, pp, dp; the microbatches last */
            double d = 16 * log2_ratio(m->tp, s->job.tp) + 4 * log2_ratio(m->ep, s->job.ep) +
                       2 * log2_ratio(m->pp, s->job.pp) + log2_ratio(m->dp, s->job.dp) +
                       0.5 * log2_ratio(m->microbatches, s->job.microbatches);
            if (!best || d < best_d ||
                (d == best_d && same_axes(m, best) && m->microbatches > best->microbatches))
                best = m, best_d = d;
        }
        if (best) {
            *out = *best;
            return MOE_STATUS_SUCCESS;
        }
    }
    return MOE_FAIL(MOE_STATUS_NOT_FOUND,
                    "no mesh the trainer accepts on %lld..%lld ranks (of the %zu it lists)",
                    (long long)min_world, (long long)max_world, s->n_valid);
}
