/*
 * The launcher's mesh choice (mesh_choice.h): every factorisation of each world from the
 * largest down, scored by its distance from the job's mesh. Worlds are small (a job's ranks),
 * so the search is exhaustive and exact.
 */
#include <math.h>
#include <stdlib.h>

#include "../core/error.h"
#include "mesh_choice.h"

int el_mesh_valid(const el_model_shape_t *s, const el_mesh_t *m)
{
    if (m->tp < 1 || m->ep < 1 || m->dp < 1 || m->pp < 1 || m->microbatches < 1) return 0;
    if (s->experts % m->ep || s->ffn_hidden % m->tp) return 0;
    if (s->layers % (m->pp * s->virtual_stages)) return 0;
    if (s->virtual_stages > 1 && (m->pp < 2 || m->microbatches % m->pp)) return 0;
    return s->batch % (m->ep * m->dp * m->microbatches) == 0;
}

static double log2_ratio(int64_t a, int64_t b)
{
    return fabs(log2((double)a / (double)b));
}

/* The valid microbatch count nearest the job's (in factors of two; the larger on a tie), or 0. */
static int64_t nearest_microbatches(const el_model_shape_t *s, el_mesh_t m)
{
    int64_t best = 0;
    double best_d = 0;
    for (int64_t mb = 1; mb <= s->batch; mb++) {
        m.microbatches = mb;
        if (!el_mesh_valid(s, &m)) continue;
        double d = log2_ratio(mb, s->job.microbatches);
        if (!best || d <= best_d) best = mb, best_d = d;
    }
    return best;
}

moe_status_t el_choose_mesh(const el_model_shape_t *s, int64_t max_world, int64_t min_world,
                            el_mesh_t *out)
{
    MOE_CHECK_ARG(s && out, "mesh choice: NULL argument");
    MOE_CHECK_ARG(s->experts >= 1 && s->ffn_hidden >= 1 && s->layers >= 1 &&
                  s->virtual_stages >= 1 && s->batch >= 1 && s->job.microbatches >= 1 &&
                  s->job.tp >= 1 && s->job.ep >= 1 && s->job.dp >= 1 && s->job.pp >= 1,
                  "mesh choice: every size of the model shape and the job's mesh must be >= 1");
    MOE_CHECK_ARG(min_world >= 1, "mesh choice: min_world %lld must be >= 1", (long long)min_world);
    for (int64_t w = max_world; w >= min_world; w--) {
        el_mesh_t best = {0};
        double best_d = 0;
        for (int64_t tp = 1; tp <= w; tp++) {
            if (w % tp) continue;
            for (int64_t ep = 1; ep <= w / tp; ep++) {
                if ((w / tp) % ep) continue;
                for (int64_t pp = 1; pp <= w / tp / ep; pp++) {
                    if ((w / tp / ep) % pp) continue;
                    el_mesh_t m = {tp, ep, w / tp / ep / pp, pp, 0};
                    m.microbatches = nearest_microbatches(s, m);
                    if (!m.microbatches) continue;
                    /* tp first (x16), then ep, pp, dp; the microbatches last */
                    double d = 16 * log2_ratio(tp, s->job.tp) + 4 * log2_ratio(ep, s->job.ep) +
                               2 * log2_ratio(pp, s->job.pp) + log2_ratio(m.dp, s->job.dp) +
                               0.5 * log2_ratio(m.microbatches, s->job.microbatches);
                    if (!best.tp || d < best_d) best = m, best_d = d;
                }
            }
        }
        if (best.tp) {
            *out = best;
            return MOE_STATUS_SUCCESS;
        }
    }
    return MOE_FAIL(MOE_STATUS_NOT_FOUND,
                    "no valid mesh on %lld..%lld ranks for E=%lld F=%lld L=%lld v=%lld B=%lld",
                    (long long)min_world, (long long)max_world, (long long)s->experts,
                    (long long)s->ffn_hidden, (long long)s->layers, (long long)s->virtual_stages,
                    (long long)s->batch);
}
