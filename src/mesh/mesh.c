/*
 * The process mesh: validation, rank order, coordinates and the axis communicators.
 *
 * Creation is collective over the world: the world's duplicate and its watch, then one
 * agreement on the mesh config (so a rank with a different or invalid config makes every
 * rank fail at once, naming it), then the same sequence of splits on every rank, so
 * communicator creation itself obeys the collective ordering rule (docs/mesh.md). A world of
 * one (no config, or 1 x 1 x 1 x 1 without a launcher) touches no MPI at all.
 */
#include "mesh.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/env.h"
#include "core/error.h"

static const char *const axis_names[MOE_MESH_GROUPS] = {"tp",  "ep",    "dp",    "pp",
                                                        "edp", "world", "dense", "stage"};

moe_mesh_config_t moe_mesh_config_default(void)
{
    moe_mesh_config_t c = {
        .struct_size = sizeof c,
        .tp = 1,
        .ep = 1,
        .dp = 1,
        .pp = 1,
        .rank_order = NULL,
        .comm = MOE_COMM_AUTO,
        .mpi_comm = NULL,
        .timeout_ms = 300000,
    };
    return c;
}

/* ---- rank order and coordinates ------------------------------------------------------------ */

moe_status_t moe_mesh_parse_order(const char *text, int32_t order[4])
{
    if (!text) text = "tp-ep-dp-pp";
    int n = 0, seen = 0;
    const char *p = text;
    while (*p) {
        const char *end = p;
        while (*end && *end != '-' && *end != ',') end++;
        int axis = -1;
        for (int a = 0; a < 4; a++)
            if ((size_t)(end - p) == 2 && strncmp(p, axis_names[a], 2) == 0) axis = a;
        if (axis < 0 || (seen & (1 << axis)) || n == 4)
            return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                            "rank_order \"%s\" must name tp, ep, dp and pp once each, fastest "
                            "first, separated by '-' (e.g. \"tp-ep-dp-pp\")",
                            text);
        seen |= 1 << axis;
        order[n++] = axis;
        p = *end ? end + 1 : end;
        if (*end && !*p) n = 5; /* trailing separator */
    }
    if (n != 4)
        return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                        "rank_order \"%s\" must name tp, ep, dp and pp once each, fastest first, "
                        "separated by '-' (e.g. \"tp-ep-dp-pp\")",
                        text);
    return MOE_STATUS_SUCCESS;
}

int32_t moe_mesh_rank_of(const int32_t size[4], const int32_t order[4], const int32_t coord[4])
{
    int32_t rank = 0;
    for (int i = 3; i >= 0; i--) rank = rank * size[order[i]] + coord[order[i]];
    return rank;
}

void moe_mesh_coords_of(const int32_t size[4], const int32_t order[4], int32_t rank,
                        int32_t coord[4])
{
    for (int i = 0; i < 4; i++) {
        coord[order[i]] = rank % size[order[i]];
        rank /= size[order[i]];
    }
}

int32_t moe_mesh_group_size(const moe_mesh_t *m, int group)
{
    if (group == MOE_AXIS_WORLD) return m->world_size;
    if (group == MOE_MESH_DENSE) return m->size[MOE_AXIS_EP] * m->size[MOE_AXIS_DP];
    if (group == MOE_MESH_STAGE)
        return m->size[MOE_AXIS_TP] * m->size[MOE_AXIS_EP] * m->size[MOE_AXIS_DP];
    return m->size[group];
}

/* Color (which group) and key (position inside it) of this rank for a group. */
static void group_color_key(const moe_mesh_t *m, int group, int *color, int *key)
{
    const int32_t *c = m->coord, *s = m->size;
    switch (group) {
    case MOE_AXIS_TP:
    case MOE_AXIS_EP:
    case MOE_AXIS_DP:
    case MOE_AXIS_PP: {
        int32_t other[4];
        memcpy(other, c, sizeof other);
        other[group] = 0; /* the rank of the group's first member identifies the group */
        *color = moe_mesh_rank_of(s, m->order, other);
        *key = c[group];
        return;
    }
    case MOE_AXIS_EDP: group_color_key(m, MOE_AXIS_DP, color, key); return;
    case MOE_MESH_DENSE: {
        int32_t other[4] = {c[MOE_AXIS_TP], 0, 0, c[MOE_AXIS_PP]};
        *color = moe_mesh_rank_of(s, m->order, other);
        *key = c[MOE_AXIS_EP] + s[MOE_AXIS_EP] * c[MOE_AXIS_DP];
        return;
    }
    case MOE_MESH_STAGE: {
        int32_t other[4] = {0, 0, 0, c[MOE_AXIS_PP]};
        *color = moe_mesh_rank_of(s, m->order, other);
        *key = c[MOE_AXIS_TP] + s[MOE_AXIS_TP] * (c[MOE_AXIS_EP] + s[MOE_AXIS_EP] * c[MOE_AXIS_DP]);
        return;
    }
    default: *color = 0; *key = m->world_rank;
    }
}

/* ---- communicators ------------------------------------------------------------------------- */

/* Split `root` into every group (collective over root, same order on every rank); groups of
 * size 1 stay NULL, the world is `root` itself, and the stage group is made only with
 * `host` (it carries control messages alone). */
static moe_status_t build_groups(moe_mesh_t *m, moe_comm_t *root, bool host,
                                 moe_comm_t *out[MOE_MESH_GROUPS])
{
    for (int g = 0; g < MOE_MESH_GROUPS; g++) {
        if (g == MOE_AXIS_WORLD || (g == MOE_MESH_STAGE && !host)) continue;
        int color, key;
        group_color_key(m, g, &color, &key);
        moe_comm_t *c = NULL;
        moe_status_t st = moe_comm_split(root, color, key, axis_names[g], &c);
        if (st != MOE_STATUS_SUCCESS)
            return moe_error_wrap(st, "creating the %s communicator of the mesh", axis_names[g]);
        if (c->size != moe_mesh_group_size(m, g) || c->rank != key) {
            int cs = c->size, cr = c->rank;
            moe_comm_destroy(c);
            return MOE_FAIL(MOE_STATUS_INTERNAL,
                            "the %s communicator has %d ranks and this is rank %d; the mesh "
                            "expects %d and %d",
                            axis_names[g], cs, cr, moe_mesh_group_size(m, g), key);
        }
        if (c->size == 1) {
            moe_comm_destroy(c);
            c = NULL;
        }
        out[g] = c;
    }
    out[MOE_AXIS_WORLD] = root;
    return MOE_STATUS_SUCCESS;
}

/* AUTO: NCCL when the backend is CUDA, NCCL is built, and no two ranks of a host share a GPU
 * (NCCL needs one GPU per rank); else MPI with staging. Collective over the host world. */
static moe_status_t resolve_backend(moe_mesh_t *m, const moe_mesh_config_t *cfg,
                                    const moe_backend_t *backend, int32_t device_index,
                                    const moe_logger_t *logger)
{
    bool cuda = backend && backend->ops->device == MOE_DEVICE_CUDA;
    if (cfg->comm == MOE_COMM_MPI || !cuda) {
        if (cfg->comm == MOE_COMM_NCCL)
            return MOE_FAIL(MOE_STATUS_UNSUPPORTED,
                            "comm=NCCL needs the CUDA backend; this runtime uses %s",
                            backend ? backend->ops->name : "host buffers");
        m->comm_backend = MOE_COMM_MPI;
        return MOE_STATUS_SUCCESS;
    }
    if (!moe_comm_have_nccl()) {
        if (cfg->comm == MOE_COMM_NCCL)
            return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "comm=NCCL but libmoe was built without NCCL");
        m->comm_backend = MOE_COMM_MPI;
        return MOE_STATUS_SUCCESS;
    }
    /* (host id, device) of every rank: an all-reduce of a table each rank fills one row of */
    int W = m->world_size;
    int64_t *tab = calloc((size_t)W * 2 + 1, sizeof *tab); /* + ranks asking for NCCL */
    if (!tab) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "device table");
    char host[256] = "";
    FILE *f = fopen("/proc/sys/kernel/hostname", "r");
    if (f) {
        if (!fgets(host, sizeof host, f)) host[0] = '\0';
        fclose(f);
    }
    uint64_t h = 1469598103934665603ull;
    for (const char *p = host; *p && *p != '\n'; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
    tab[2 * m->world_rank] = (int64_t)(h >> 1);
    tab[2 * m->world_rank + 1] = device_index;
    tab[2 * W] = cfg->comm == MOE_COMM_NCCL;
    moe_status_t st = moe_comm_allreduce(m->host[MOE_AXIS_WORLD], tab, tab, (size_t)W * 2 + 1,
                                         MOE_COMM_I64, MOE_REDUCE_SUM);
    int dup_a = -1, dup_b = -1;
    for (int a = 0; a < W && st == MOE_STATUS_SUCCESS && dup_a < 0; a++)
        for (int b = a + 1; b < W; b++)
            if (tab[2 * a] == tab[2 * b] && tab[2 * a + 1] == tab[2 * b + 1]) {
                dup_a = a;
                dup_b = b;
                break;
            }
    int dev = dup_a >= 0 ? (int)tab[2 * dup_a + 1] : -1;
    bool asked_nccl = tab[2 * W] > 0;
    if (st != MOE_STATUS_SUCCESS) return st; /* tab is leaked: MPI may still write it */
    free(tab);
    if (dup_a >= 0) { /* every rank fails where one asked for NCCL: AUTO alone would go on */
        if (asked_nccl)
            return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                            "comm=NCCL (on some rank) needs one GPU per rank, but world ranks "
                            "%d and %d share GPU %d; use comm=MPI (staged through pinned "
                            "memory) to share GPUs",
                            dup_a, dup_b, dev);
        moe_log(logger, MOE_LOG_INFO,
                "mesh: world ranks %d and %d share GPU %d; using the MPI communicator", dup_a,
                dup_b, dev);
        m->comm_backend = MOE_COMM_MPI;
    } else {
        m->comm_backend = MOE_COMM_NCCL;
    }
    return MOE_STATUS_SUCCESS;
}

/* ---- create / destroy ---------------------------------------------------------------------- */

static moe_status_t validate(const moe_mesh_config_t *cfg, int32_t order[4])
{
    MOE_CHECK_ARG(cfg->tp >= 1 && cfg->ep >= 1 && cfg->dp >= 1 && cfg->pp >= 1,
                  "mesh sizes must be >= 1 (tp=%d ep=%d dp=%d pp=%d)", cfg->tp, cfg->ep, cfg->dp,
                  cfg->pp);
    /* multiplied one axis at a time so that the bound is checked before the product could
     * overflow */
    const int32_t sizes[4] = {cfg->tp, cfg->ep, cfg->dp, cfg->pp};
    int64_t product = 1;
    for (int a = 0; a < 4 && product <= (1 << 24); a++) product *= sizes[a];
    MOE_CHECK_ARG(product <= (1 << 24), "mesh tp=%d x ep=%d x dp=%d x pp=%d is too large", cfg->tp,
                  cfg->ep, cfg->dp, cfg->pp);
    MOE_CHECK_ARG(cfg->comm >= MOE_COMM_AUTO && cfg->comm <= MOE_COMM_NCCL,
                  "unknown comm backend %d (0 auto, 1 mpi, 2 nccl)", (int)cfg->comm);
    MOE_CHECK_ARG(cfg->timeout_ms > 0, "mesh timeout_ms is %d; it must be > 0 (milliseconds)",
                  cfg->timeout_ms);
    return moe_mesh_parse_order(cfg->rank_order, order);
}

/* World size announced by a launcher (mpirun, srun), or 1. */
static int launcher_world_size(void)
{
    const moe_env_id_t names[] = {MOE_ENV_OMPI_WORLD_SIZE, MOE_ENV_PMI_SIZE, MOE_ENV_PMIX_SIZE,
                                  MOE_ENV_SLURM_NTASKS};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        long v = moe_env_int(names[i], 1, NULL);
        if (v > 1 && v <= INT_MAX) return (int)v;
    }
    return 1;
}

/* The communicator this rank's config leads to, as far as it can tell alone: MPI when asked,
 * or when AUTO has no CUDA backend or no NCCL; else NCCL (AUTO falls back to MPI only where
 * two ranks share a GPU, which every rank learns from the same table in resolve_backend). */
static int32_t comm_choice(const moe_mesh_config_t *cfg, const moe_backend_t *backend)
{
    bool cuda = backend && backend->ops->device == MOE_DEVICE_CUDA;
    if (cfg->comm == MOE_COMM_NCCL) return MOE_COMM_NCCL;
    if (cfg->comm == MOE_COMM_MPI || !cuda || !moe_comm_have_nccl()) return MOE_COMM_MPI;
    return MOE_COMM_NCCL;
}

/* The mesh config every rank must hold alike; comm as resolved (AUTO and an explicit choice
 * that lead to the same communicator agree). The rank order reads as its axes fastest first,
 * one digit each (1 tp, 2 ep, 3 dp, 4 pp): "tp-ep-dp-pp" is 1234. */
static moe_status_t agree_config(moe_mesh_t *m, const moe_mesh_config_t *cfg,
                                 const moe_backend_t *backend, const int32_t order[4],
                                 moe_status_t local)
{
    int64_t order_code = 0;
    for (int i = 0; i < 4; i++) order_code = order_code * 10 + order[i] + 1;
    moe_agree_field_t f[] = {
        moe_agree_int("tp", cfg->tp),
        moe_agree_int("ep", cfg->ep),
        moe_agree_int("dp", cfg->dp),
        moe_agree_int("pp", cfg->pp),
        moe_agree_int("rank_order (axes fastest first: 1 tp, 2 ep, 3 dp, 4 pp)", order_code),
        moe_agree_int("comm (resolved: 1 MPI, 2 NCCL)", comm_choice(cfg, backend)),
        moe_agree_int("timeout_ms", cfg->timeout_ms),
    };
    return moe_comm_agree(m->host[MOE_AXIS_WORLD], "the mesh config", f,
                          (int)(sizeof f / sizeof f[0]), local);
}

/* The world's host communicator, its watch, and the agreement on the config. A rank whose own
 * config is invalid (`local`) still joins, so that the others learn it at once. */
static moe_status_t join_world(moe_mesh_t *m, const moe_mesh_config_t *cfg,
                               const moe_backend_t *backend, int32_t order[4], moe_status_t local,
                               const moe_logger_t *logger, int64_t product)
{
    int wr = 0, ws = 1;
    MOE_TRY(moe_comm_mpi_rank_size(cfg->mpi_comm, &wr, &ws));
    m->world_rank = wr;
    m->world_size = ws;
    if (local == MOE_STATUS_SUCCESS && ws != product)
        local = MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT,
                         "the mesh tp=%d x ep=%d x dp=%d x pp=%d = %lld ranks, but the world "
                         "communicator has %d ranks",
                         cfg->tp, cfg->ep, cfg->dp, cfg->pp, (long long)product, ws);
    if (ws == 1) return local; /* a world of one under a launcher: nothing to compare */
    /* the handshake needs a deadline even when this rank's own one is invalid */
    int timeout = cfg->timeout_ms > 0 ? cfg->timeout_ms : moe_mesh_config_default().timeout_ms;
    MOE_TRY(moe_comm_mpi_create(cfg->mpi_comm, "world", timeout, NULL, logger,
                                &m->host[MOE_AXIS_WORLD]));
    MOE_TRY(moe_comm_mpi_watch(m->host[MOE_AXIS_WORLD], &m->watch));
    return agree_config(m, cfg, backend, order, local);
}

/* Destroy the communicators and the watch (each leaks what MPI may still touch once the
 * mesh failed), then release MPI, or abandon it when the mesh is `lost`. Sets no error. */
static void release(moe_mesh_t *mesh, bool lost)
{
    for (int g = 0; g < MOE_MESH_GROUPS; g++) {
        if (mesh->comm[g] != mesh->host[g]) moe_comm_destroy(mesh->comm[g]);
        moe_comm_destroy(mesh->host[g]);
    }
    moe_comm_watch_destroy(mesh->watch);
    if (mesh->mpi_initialised) {
        if (lost)
            moe_comm_mpi_abandon();
        else
            moe_comm_mpi_release();
    }
    free(mesh);
}

/* Every communicator of the mesh adds its waits to the mesh's one clock (comm.h). */
static void time_waits(moe_mesh_t *m)
{
    for (int g = 0; g < MOE_MESH_GROUPS; g++) {
        if (m->comm[g]) m->comm[g]->waited = &m->waited;
        if (m->host[g]) m->host[g]->waited = &m->waited;
    }
}

moe_status_t moe_mesh_create(const moe_mesh_config_t *cfg, const moe_backend_t *backend,
                             int32_t device_index, const moe_logger_t *logger, moe_mesh_t **out)
{
    *out = NULL;
    int32_t order[4] = {MOE_AXIS_TP, MOE_AXIS_EP, MOE_AXIS_DP, MOE_AXIS_PP};
    moe_status_t local = MOE_STATUS_SUCCESS;
    if (cfg) {
        MOE_CHECK_STRUCT_SIZE(cfg, moe_mesh_config_t, sizeof(moe_mesh_config_t));
        local = validate(cfg, order);
    }
    int64_t product = 1;
    if (cfg && local == MOE_STATUS_SUCCESS)
        product = (int64_t)cfg->tp * cfg->ep * cfg->dp * cfg->pp;
    bool need_mpi = cfg && (product > 1 || cfg->mpi_comm || launcher_world_size() > 1 ||
                            moe_comm_mpi_ready());
    if (!need_mpi) {
        MOE_TRY(local);
        if (cfg && cfg->comm == MOE_COMM_NCCL)
            moe_log(logger, MOE_LOG_INFO, "mesh: a world of one needs no communicator");
    }
    moe_mesh_t *m = calloc(1, sizeof *m);
    if (!m) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "mesh allocation");
    memcpy(m->order, order, sizeof order);
    for (int a = 0; a < 5; a++) m->size[a] = 1;
    m->world_size = 1;
    m->comm_backend = MOE_COMM_MPI;
    if (!need_mpi) {
        *out = m;
        return MOE_STATUS_SUCCESS;
    }

    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!moe_comm_have_mpi()) {
        st = MOE_FAIL(MOE_STATUS_UNSUPPORTED,
                      "a mesh of tp=%d ep=%d dp=%d pp=%d needs MPI, which this build does not "
                      "have",
                      cfg->tp, cfg->ep, cfg->dp, cfg->pp);
        goto fail;
    }
    MOE_TRY_GOTO(st, moe_comm_mpi_acquire());
    m->mpi_initialised = true; /* balanced by a release in destroy */
    MOE_TRY_GOTO(st, join_world(m, cfg, backend, order, local, logger, product));
    int wr = m->world_rank, ws = m->world_size;
    m->size[MOE_AXIS_TP] = cfg->tp;
    m->size[MOE_AXIS_EP] = cfg->ep;
    m->size[MOE_AXIS_DP] = cfg->dp;
    m->size[MOE_AXIS_PP] = cfg->pp;
    m->size[MOE_AXIS_EDP] = cfg->dp;
    moe_mesh_coords_of(m->size, m->order, wr, m->coord);
    m->coord[MOE_AXIS_EDP] = m->coord[MOE_AXIS_DP];
    if (ws == 1) { /* a world of one under a launcher: nothing to communicate */
        time_waits(m);
        *out = m;
        return MOE_STATUS_SUCCESS;
    }

    /* host control groups, then the data groups on the chosen backend */
    moe_comm_t *hworld = m->host[MOE_AXIS_WORLD];
    MOE_TRY_GOTO(st, build_groups(m, hworld, true, m->host));
    MOE_TRY_GOTO(st, resolve_backend(m, cfg, backend, device_index, logger));
    bool device = backend && backend->ops->device != MOE_DEVICE_HOST;
    if (!device) {
        memcpy(m->comm, m->host, sizeof m->comm);
    } else {
        moe_comm_t *dworld = NULL;
        if (m->comm_backend == MOE_COMM_NCCL) {
            MOE_TRY_GOTO(st, moe_comm_nccl_create(hworld, "world", &dworld));
            dworld->backend = backend; /* orders NCCL after the compute stream; splits inherit */
        } else {
            MOE_TRY_GOTO(st, moe_comm_mpi_create(cfg->mpi_comm, "world", cfg->timeout_ms, backend,
                                                 logger, &dworld));
            dworld->watch = m->watch;
        }
        m->comm[MOE_AXIS_WORLD] = dworld;
        MOE_TRY_GOTO(st, build_groups(m, dworld, false, m->comm));
    }
    time_waits(m);
    moe_log(logger, MOE_LOG_INFO,
            "mesh: world rank %d of %d = (tp %d/%d, ep %d/%d, dp %d/%d, pp %d/%d), comm %s", wr, ws,
            m->coord[0], m->size[0], m->coord[1], m->size[1], m->coord[2], m->size[2], m->coord[3],
            m->size[3], m->comm_backend == MOE_COMM_NCCL ? "nccl" : "mpi");
    *out = m;
    return MOE_STATUS_SUCCESS;
fail:
    /* an invalid, different or unsupported config fails on every rank alike (the ranks agreed
     * on it); anything else (a rank that never came, an MPI error, memory) is this rank's
     * alone and leaves the others unable to finish: they are told */
    m->lost = st != MOE_STATUS_INVALID_ARGUMENT && st != MOE_STATUS_UNSUPPORTED;
    if (m->lost && m->watch) {
        char cause[768];
        snprintf(cause, sizeof cause, "world rank %d could not create its mesh: %s", m->world_rank,
                 moe_last_error());
        moe_comm_watch_fail(m->watch, st, cause);
    }
    release(m, m->lost || moe_mesh_failure(m, NULL) != MOE_STATUS_SUCCESS);
    return st;
}

moe_status_t moe_mesh_failure(const moe_mesh_t *mesh, const char **cause)
{
    return moe_comm_watch_failure(mesh->watch, cause);
}

moe_status_t moe_mesh_agree(moe_mesh_t *mesh, int group, const char *what,
                            const moe_agree_field_t *fields, int n, moe_status_t local)
{
    moe_comm_t *c = mesh->host[group];
    if (!c) return local;
    return moe_comm_agree(c, what, fields, n, local);
}

moe_status_t moe_mesh_destroy(moe_mesh_t *mesh)
{
    if (!mesh) return MOE_STATUS_SUCCESS;
    moe_status_t st = MOE_STATUS_SUCCESS;
    const char *cause = NULL;
    bool lost = mesh->lost || moe_mesh_failure(mesh, &cause) != MOE_STATUS_SUCCESS;
    /* MPI_Finalize waits for every rank, for ever: meet them under the deadline first */
    if (!lost && mesh->mpi_initialised && mesh->host[MOE_AXIS_WORLD] &&
        moe_comm_mpi_release_finalizes()) {
        st = moe_comm_barrier(mesh->host[MOE_AXIS_WORLD]);
        if (st != MOE_STATUS_SUCCESS)
            moe_error_wrap(st, "destroying the mesh (the ranks meet before MPI_Finalize)");
        lost = st != MOE_STATUS_SUCCESS;
    } else if (lost && cause && *cause) {
        st = MOE_FAIL(MOE_STATUS_ABORTED,
                      "the mesh lost a peer: %s; its communicators and "
                      "buffers are leaked and MPI is left unfinalised (exit the process)",
                      cause);
    } else if (lost) {
        st = MOE_FAIL(MOE_STATUS_ABORTED, "the mesh could not be completed; MPI is left "
                                          "unfinalised (exit the process)");
    }
    release(mesh, lost);
    return st;
}
