/*
 * Ranks that disagree are told so: every rank of the world fails at once with
 * INVALID_ARGUMENT naming the field, the world ranks and both values, or naming the rank whose
 * own config is invalid — never a timeout, an INTERNAL error or silent divergence.
 *
 * 4 ranks, host backend, a 20 s mesh timeout (every failure must come well before it):
 *   mesh shape     ranks 0,1 tp=2 ep=2; ranks 2,3 tp=1 ep=4 (the same world size)
 *   rank order     rank 3 "pp-dp-ep-tp", the others the default
 *   invalid mesh   rank 3 tp=0; then rank 2 tp=3 (3 ranks of a world of 4)
 *   runtime        rank 1 seed 99; then rank 2 deterministic = 0
 * and at the end a valid runtime, so the world is still usable after all of them.
 */
#include <stdint.h>
#include <string.h>

#include <moe/moe.h>

#include "fault_support.h"

#define TIMEOUT_MS 20000
#define FAST_S 5.0

typedef struct setup {
    moe_mesh_config_t mesh;
    moe_runtime_config_t rt;
} setup_t;

static setup_t base(void)
{
    setup_t s = {moe_mesh_config_default(), moe_runtime_config_default()};
    s.mesh.ep = 4;
    s.mesh.timeout_ms = TIMEOUT_MS;
    s.rt.backend = MOE_BACKEND_HOST;
    return s;
}

/* Create with this rank's setup; every rank must fail fast with INVALID_ARGUMENT and a
 * message holding every needle (NULL-terminated list; this rank's own list). */
static void expect_refused(setup_t *s, const char *what, const char *const *needles)
{
    s->rt.mesh = &s->mesh;
    moe_runtime_t *rt = (moe_runtime_t *)0x1;
    double t0 = fault_now_s();
    moe_status_t st = moe_runtime_create(&s->rt, &rt);
    double dt = fault_now_s() - t0;
    const char *msg = moe_last_error();
    FCHECK(st == MOE_STATUS_INVALID_ARGUMENT, "%s: %s (%s)", what, moe_status_string(st), msg);
    FCHECK(rt == NULL, "%s: a runtime came back", what);
    FCHECK(dt < FAST_S, "%s: took %.2f s", what, dt);
    for (int i = 0; needles[i]; i++)
        FCHECK(strstr(msg, needles[i]) != NULL, "%s: message lacks '%s': %s", what, needles[i],
               msg);
    fprintf(stderr, "rank %d: %s refused after %.2f s: %s\n", fault_rank, what, dt, msg);
    if (st == MOE_STATUS_SUCCESS) moe_runtime_destroy(rt);
}

static void t_mesh_shape(void)
{
    setup_t s = base();
    s.mesh.tp = fault_rank < 2 ? 2 : 1;
    s.mesh.ep = fault_rank < 2 ? 2 : 4;
    const char *n[] = {"the mesh config differs", "tp is 1 on world rank 2 and 2 on world rank 0",
                       "ep is 2 on world rank 0 and 4 on world rank 2", NULL};
    expect_refused(&s, "mesh shape", n);
}

static void t_rank_order(void)
{
    setup_t s = base();
    if (fault_rank == 3) s.mesh.rank_order = "pp-dp-ep-tp";
    const char *n[] = {"rank_order", "is 1234 on world rank 0 and 4321 on world rank 3", NULL};
    expect_refused(&s, "rank order", n);
}

static void t_invalid_mesh(void)
{
    setup_t s = base();
    if (fault_rank == 3) s.mesh.tp = 0;
    const char *own[] = {"mesh sizes must be >= 1 (tp=0", NULL};
    const char *told[] = {"world rank 3 rejected its own", "mesh sizes must be >= 1 (tp=0", NULL};
    expect_refused(&s, "invalid mesh", fault_rank == 3 ? own : told);

    s = base();
    if (fault_rank == 2) s.mesh.ep = 1, s.mesh.tp = 3;
    const char *own2[] = {"= 3 ranks, but the world communicator has 4 ranks", NULL};
    const char *told2[] = {"world rank 2 rejected its own",
                           "= 3 ranks, but the world communicator has 4 ranks", NULL};
    expect_refused(&s, "mesh of the wrong size", fault_rank == 2 ? own2 : told2);
}

static void t_runtime(void)
{
    setup_t s = base();
    if (fault_rank == 1) s.rt.seed = 99;
    const char *n[] = {"the runtime config differs", "seed is 99 on world rank 1 and 1234 on "
                       "world rank 0", NULL};
    expect_refused(&s, "seed", n);

    s = base();
    if (fault_rank == 2) s.rt.deterministic = 0;
    const char *n2[] = {"deterministic is 0 on world rank 2 and 1 on world rank 0", NULL};
    expect_refused(&s, "deterministic", n2);
}

int main(int argc, char **argv)
{
    fault_init(&argc, &argv, 4);
    t_mesh_shape();
    t_rank_order();
    t_invalid_mesh();
    t_runtime();
    /* the world is still usable */
    setup_t s = base();
    s.rt.mesh = &s.mesh;
    moe_runtime_t *rt = NULL;
    moe_status_t st = moe_runtime_create(&s.rt, &rt);
    FCHECK(st == MOE_STATUS_SUCCESS, "valid runtime: %s", moe_last_error());
    if (st == MOE_STATUS_SUCCESS) {
        st = moe_runtime_destroy(rt);
        FCHECK(st == MOE_STATUS_SUCCESS, "destroy: %s", moe_last_error());
    }
    fault_verdict(NULL, 0, 1);
}
