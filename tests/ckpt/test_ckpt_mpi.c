/*
 * Reshard under mpirun (W = 4 or 8 ranks, host backend): a layer saved at ep = 4 loads at
 * ep = 2, ep = 1 and (W = 8) ep = 8 and computes the same outputs. Meshes below are for W = 4;
 * with W = 8 dp doubles (phase A saves at (1,4,2,1): the dp replicas' expert pieces overlap),
 * and a phase at (1,8,1,1), round-robin, follows phase C.
 *
 *   phase A  mesh (tp,ep,dp,pp) = (1,4,1,1), E = 8 experts, round-robin placement (rank r
 *            holds experts r and r+4). Every parameter is perturbed by a function of its
 *            global index (so the seed's initialisation is not what a load must produce);
 *            all ranks save step 5 (every rank passes every parameter: dense ones overlap),
 *            then each runs forward on its own tokens X_r -> Y_r (the reference) while the
 *            write is in flight (forward updates the expert bias: the snapshot must not see it).
 *            The manifest must list 4 rank files and ep = 4.
 *   phase B  mesh (1,2,2,1), contiguous placement (rank holds experts [4 ep, 4 ep + 4)).
 *            Before loading, forward(X_r) differs from Y_r (the test can fail); after
 *            load_latest it equals Y_r (relative error <= 1e-6).
 *   phase C  mesh (1,1,4,1): every rank holds all 8 experts. Same checks.
 *   phase E  at (1,2,2,1) rank 2 calls save_async(6) with a duplicate tensor name: it gets
 *            INVALID_ARGUMENT at once, the other ranks get ABORTED from wait (the agreement
 *            failed), step 6 never becomes a checkpoint and nobody hangs.
 *   phase F  ranks 0 and 1 save the same half [0, 4) of a global [8] tensor (replicas whose
 *            pieces overlap and leave [4, 8) out; the other ranks save another tensor):
 *            loading [0, 4) gives the values, loading all of [8] is refused (the pieces'
 *            sizes add up to 8, their union does not).
 *   phase H  rank 0 cannot write step 9's manifest (a directory is in the way of its temporary
 *            file): wait gives rank 0 the I/O error and every other rank ABORTED naming rank
 *            0 (before, they reported success), and destroy returns at once on every rank.
 *   phase G  (with s3rver) keep_last = 1 and the S3 mirror, 80 saves each followed by a
 *            wait for the local commit only: retention on rank 0 runs while the ranks agree
 *            on the previous step's upload, and must not remove that step before rank 0 has
 *            put its manifest (it did: "manifest.json ... No such file or directory").
 *   phase D  (when rank 0 can start s3rver) phase A also mirrored to S3 (each rank uploads
 *            its shard, the ranks agree, rank 0 puts the manifest); mesh (1,2,2,1) with an
 *            empty local directory restores step 5 from S3 and computes the same outputs.
 * The checkpoint directory is shared (one file system, as on a cluster with shared storage).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <mpi.h>

#include <moe/moe.h>

#include "ckpt/ckpt_internal.h"
#include "s3_fixture.h"
#include "test_support.h"

enum { H = 8, F = 8, E = 8, K = 2, NTOK = 6 };

static int R, W, failures;

static moe_runtime_t *make_runtime(int ep, int dp)
{
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.tp = 1, mc.ep = ep, mc.dp = dp, mc.pp = 1;
    mc.timeout_ms = 60000;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.seed = 77;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    TEST_OK(moe_runtime_create(&rc, &rt));
    return rt;
}

static moe_layer_t *make_layer(moe_runtime_t *rt, moe_expert_placement_t placement)
{
    moe_layer_config_t c = moe_layer_config_default();
    c.hidden = H;
    c.ffn_hidden = F;
    c.num_experts = E;
    c.top_k = K;
    c.placement = placement;
    c.init_std = 0.5f;
    c.expert_bias = 1;
    moe_layer_t *l = NULL;
    TEST_OK(moe_layer_create(rt, &c, &l));
    return l;
}

/* The layer's parameters as checkpoint entries (expert ids from the layer's placement). */
static int32_t entries(moe_layer_t *l, moe_ckpt_tensor_t *t, moe_param_info_t *info,
                       int32_t ids[][E])
{
    int32_t n;
    TEST_OK(moe_layer_num_params(l, &n));
    for (int32_t i = 0; i < n; i++) {
        info[i] = (moe_param_info_t){.struct_size = sizeof info[i]};
        TEST_OK(moe_layer_param(l, i, &info[i]));
        t[i] = moe_ckpt_tensor_whole(info[i].name, &info[i].value);
        memcpy(t[i].global_shape, info[i].global_shape, sizeof t[i].global_shape);
        memcpy(t[i].offset, info[i].shard_offset, sizeof t[i].offset);
        t[i].expert_dim = info[i].expert_dim;
        if (info[i].expert_dim >= 0) {
            for (int64_t k = 0; k < info[i].value.shape[info[i].expert_dim]; k++)
                TEST_OK(moe_layer_expert_id(l, (int32_t)k, &ids[i][k]));
            t[i].expert_ids = ids[i];
        }
    }
    return n;
}

/* value += 0.1 * h(param, global index): a global function, identical for every mesh */
static void perturb(moe_layer_t *l, const moe_param_info_t *p, int32_t pi)
{
    int64_t n = moe_tensor_numel(&p->value);
    float *v = p->value.data;
    for (int64_t i = 0; i < n; i++) {
        int64_t idx[4], rem = i, g = 0;
        for (int d = p->value.ndim - 1; d >= 0; d--) {
            idx[d] = rem % p->value.shape[d];
            rem /= p->value.shape[d];
        }
        for (int d = 0; d < p->value.ndim; d++) {
            int64_t gi = idx[d] + p->shard_offset[d];
            if (d == p->expert_dim) {
                int32_t ge;
                TEST_OK(moe_layer_expert_id(l, (int32_t)idx[d], &ge));
                gi = ge;
            }
            g = g * p->global_shape[d] + gi;
        }
        test_rng_t r = {(uint64_t)pi * 1000003u + (uint64_t)g};
        v[i] += (float)(0.1 * (test_rng_uniform(&r) - 0.5));
    }
}

static void forward(moe_layer_t *l, const float *x, float *y)
{
    int64_t shp[2] = {NTOK, H};
    moe_tensor_t tx, ty;
    TEST_OK(moe_tensor_view((void *)x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &tx));
    TEST_OK(moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &ty));
    TEST_OK(moe_layer_forward(l, 0, &tx, &ty));
    TEST_OK(moe_layer_release_slot(l, 0));
}

static s3_fixture_t g_s3;
static int g_have_s3;
static char g_endpoint[64];

static void add_s3(moe_ckpt_config_t *c)
{
    if (!g_have_s3) return;
    s3_fixture_config(c, g_endpoint, "mpi-bucket", "reshard");
}

static void load_and_compare(const char *dir, int ep, int dp, moe_expert_placement_t pl,
                             const float *x, const float *yref)
{
    moe_runtime_t *rt = make_runtime(ep, dp);
    moe_layer_t *l = make_layer(rt, pl);
    float y[NTOK * H];
    forward(l, x, y);
    double before = test_rel_err(y, yref, NTOK * H);
    RANK_CHECK(before > 1e-3, "ep=%d: outputs already equal before loading (rel err %.3g)", ep,
               before);
    moe_ckpt_config_t c = moe_ckpt_config_default();
    c.dir = dir;
    c.chunk_bytes = 64 << 10;
    c.pinned_budget_bytes = 1 << 20;
    add_s3(&c);
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(rt, &c, &ck));
    moe_ckpt_tensor_t t[16];
    moe_param_info_t info[16];
    int32_t ids[16][E];
    int32_t n = entries(l, t, info, ids);
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, t, n, &step));
    RANK_CHECK(step == 5, "ep=%d: loaded step %lld", ep, (long long)step);
    forward(l, x, y);
    double after = test_rel_err(y, yref, NTOK * H);
    RANK_CHECK(after <= 1e-6, "ep=%d dp=%d: outputs differ after loading: rel err %.3g", ep, dp,
               after);
    if (R == 0)
        printf("ep=%d dp=%d: rel err before load %.3g, after %.3g\n", ep, dp, before, after);
    TEST_OK(moe_ckpt_destroy(ck));
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));
}

static void refused_save(const char *dir)
{
    moe_runtime_t *rt = make_runtime(2, W / 2);
    moe_layer_t *l = make_layer(rt, MOE_PLACEMENT_CONTIGUOUS);
    moe_ckpt_config_t c = moe_ckpt_config_default();
    c.dir = dir;
    c.chunk_bytes = 64 << 10;
    c.pinned_budget_bytes = 1 << 20;
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(rt, &c, &ck));
    moe_ckpt_tensor_t t[16];
    moe_param_info_t info[16];
    int32_t ids[16][E];
    int32_t n = entries(l, t, info, ids);
    if (R == 2) t[1] = t[0]; /* duplicate name on one rank only */
    moe_status_t s = moe_ckpt_save_async(ck, 6, t, n);
    RANK_CHECK(s == (R == 2 ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_SUCCESS), "save_async: %s",
               moe_status_string(s));
    s = moe_ckpt_wait(ck, 1, 60000);
    RANK_CHECK(s == (R == 2 ? MOE_STATUS_SUCCESS : MOE_STATUS_ABORTED), "wait: %s (%s)",
               moe_status_string(s), moe_last_error());
    int64_t steps[4];
    int32_t ns = 0;
    TEST_OK(moe_ckpt_list(ck, MOE_CKPT_TIER_LOCAL, steps, 4, &ns));
    RANK_CHECK(ns == 1 && steps[0] == 5, "after a refused save: %d checkpoints, newest %lld", ns,
               ns ? (long long)steps[ns - 1] : -1LL);
    TEST_OK(moe_ckpt_destroy(ck));
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));
    if (R == 0) printf("phase E (one rank refuses a save) done\n");
}

/* A fresh directory under /tmp made by rank 0 and named to every rank (shared storage). */
static void shared_tempdir(char *dir, size_t n, const char *tag)
{
    snprintf(dir, n, "/tmp/moe-ckpt-mpi-%s-XXXXXX", tag);
    if (R == 0 && !mkdtemp(dir)) MPI_Abort(MPI_COMM_WORLD, 1);
    MPI_Bcast(dir, (int)n, MPI_CHAR, 0, MPI_COMM_WORLD);
}

/* A checkpoint entry of this rank's own tensor, "r<rank>", over v[0..n). */
static moe_ckpt_tensor_t rank_tensor(float *v, int64_t n)
{
    static char name[16];
    snprintf(name, sizeof name, "r%d", R);
    moe_tensor_t t;
    TEST_OK(moe_tensor_view(v, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &n, &t));
    return moe_ckpt_tensor_whole(name, &t);
}

/* Rank 0 removes dir and says that `phase` is done. */
static void remove_dir(const char *dir, const char *phase)
{
    if (R != 0) return;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    printf("%s done\n", phase);
}

static void overlapping_replicas(void)
{
    char dir[256];
    shared_tempdir(dir, sizeof dir, "half");
    moe_runtime_t *rt = make_runtime(1, W);
    moe_ckpt_config_t c = moe_ckpt_config_default();
    c.dir = dir;
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(rt, &c, &ck));
    float half[4] = {1, 2, 3, 4}, got[8];
    int64_t s4[1] = {4}, s8[1] = {8};
    moe_tensor_t th, tg4, tg8;
    TEST_OK(moe_tensor_view(half, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, s4, &th));
    TEST_OK(moe_tensor_view(got, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, s4, &tg4));
    TEST_OK(moe_tensor_view(got, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, s8, &tg8));
    moe_ckpt_tensor_t e = moe_ckpt_tensor_whole(R < 2 ? "half" : "other", &th);
    if (R < 2) e.global_shape[0] = 8;
    TEST_OK(moe_ckpt_save_async(ck, 7, &e, 1));
    TEST_OK(moe_ckpt_wait(ck, 0, 60000));
    for (int i = 0; i < 8; i++) got[i] = -7;
    moe_ckpt_tensor_t l4 = moe_ckpt_tensor_whole("half", &tg4);
    l4.global_shape[0] = 8;
    TEST_OK(moe_ckpt_load_step(ck, 7, &l4, 1));
    RANK_CHECK(got[0] == 1 && got[3] == 4, "the saved half reads back as %g..%g", got[0], got[3]);
    moe_ckpt_tensor_t l8 = moe_ckpt_tensor_whole("half", &tg8);
    moe_status_t st = moe_ckpt_load_step(ck, 7, &l8, 1);
    RANK_CHECK(st == MOE_STATUS_INVALID_ARGUMENT && strstr(moe_last_error(), "does not hold all"),
               "loading all of [8] from overlapping halves: %s (%s)", moe_status_string(st),
               moe_last_error());
    TEST_OK(moe_ckpt_destroy(ck));
    TEST_OK(moe_runtime_destroy(rt));
    remove_dir(dir, "phase F (overlapping replicas with a hole)");
}

static void failed_commit(void)
{
    char dir[256];
    shared_tempdir(dir, sizeof dir, "commit");
    if (R == 0) {
        char p[320];
        snprintf(p, sizeof p, "%s/step-000000000009", dir);
        RANK_CHECK(mkdir(p, 0755) == 0, "mkdir %s", p);
        snprintf(p, sizeof p, "%s/step-000000000009/manifest.json.tmp", dir);
        RANK_CHECK(mkdir(p, 0755) == 0, "mkdir %s", p);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    moe_runtime_t *rt = make_runtime(1, W);
    moe_ckpt_config_t c = moe_ckpt_config_default();
    c.dir = dir;
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(rt, &c, &ck));
    float v[64] = {0};
    moe_ckpt_tensor_t e = rank_tensor(v, 64);
    TEST_OK(moe_ckpt_save_async(ck, 9, &e, 1));
    moe_status_t st = moe_ckpt_wait(ck, 1, 60000);
    if (R == 0)
        RANK_CHECK(st == MOE_STATUS_IO_ERROR, "wait on rank 0: %s (%s)", moe_status_string(st),
                   moe_last_error());
    else
        RANK_CHECK(st == MOE_STATUS_ABORTED && strstr(moe_last_error(), "rank 0 could not commit"),
                   "wait: %s (%s)", moe_status_string(st), moe_last_error());
    double t0 = MPI_Wtime();
    TEST_OK(moe_ckpt_destroy(ck));
    RANK_CHECK(MPI_Wtime() - t0 < 10, "destroy took %.1f s", MPI_Wtime() - t0);
    TEST_OK(moe_runtime_destroy(rt));
    remove_dir(dir, "phase H (rank 0 cannot commit)");
}

static void retention_beside_uploads(void)
{
    char dir[256];
    shared_tempdir(dir, sizeof dir, "keep1");
    moe_runtime_t *rt = make_runtime(1, W);
    moe_ckpt_config_t c = moe_ckpt_config_default();
    c.dir = dir;
    c.keep_last = 1;
    add_s3(&c);
    c.s3_prefix = "keep1";
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(rt, &c, &ck));
    float v[256] = {0};
    moe_ckpt_tensor_t e = rank_tensor(v, 256);
    int bad = 0;
    for (int64_t step = 1; step <= 80 && !bad; step++) {
        v[0] = (float)step;
        moe_status_t st = moe_ckpt_save_async(ck, step, &e, 1);
        if (st == MOE_STATUS_SUCCESS) st = moe_ckpt_wait(ck, 0, 60000);
        if (st != MOE_STATUS_SUCCESS) {
            RANK_CHECK(0, "step %lld: %s (%s)", (long long)step, moe_status_string(st),
                       moe_last_error());
            bad = 1;
        }
    }
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!bad) {
        TEST_OK(moe_ckpt_wait(ck, 1, 60000));
        moe_ckpt_status_t st = {.struct_size = sizeof st};
        TEST_OK(moe_ckpt_status(ck, &st));
        RANK_CHECK(st.last_uploaded_step == 80, "last uploaded %lld",
                   (long long)st.last_uploaded_step);
        TEST_OK(moe_ckpt_destroy(ck));
    } else {
        moe_ckpt_abort(ck);
        moe_ckpt_destroy(ck);
    }
    TEST_OK(moe_runtime_destroy(rt));
    remove_dir(dir, "phase G (keep_last 1 beside the S3 mirror, 80 steps)");
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    MPI_Comm_size(MPI_COMM_WORLD, &W);
    if (W != 4 && W != 8) {
        if (R == 0) fprintf(stderr, "run with 4 or 8 ranks\n");
        MPI_Finalize();
        return 77;
    }
    char dir[256];
    shared_tempdir(dir, sizeof dir, "reshard");

    if (R == 0) {
        g_have_s3 = s3_fixture_start(&g_s3, "mpi-bucket");
        if (g_have_s3) snprintf(g_endpoint, sizeof g_endpoint, "%s", g_s3.endpoint);
    }
    MPI_Bcast(&g_have_s3, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Bcast(g_endpoint, sizeof g_endpoint, MPI_CHAR, 0, MPI_COMM_WORLD);

    float x[NTOK * H], yref[NTOK * H];
    test_rng_t rng = {1000u + (uint64_t)R};
    test_fill_normal(&rng, x, NTOK * H, 1.0);

    /* phase A: ep = 4, round robin */
    moe_runtime_t *rt = make_runtime(4, W / 4);
    moe_layer_t *l = make_layer(rt, MOE_PLACEMENT_ROUND_ROBIN);
    moe_ckpt_tensor_t t[16];
    moe_param_info_t info[16];
    int32_t ids[16][E];
    int32_t n = entries(l, t, info, ids);
    for (int32_t i = 0; i < n; i++) perturb(l, &info[i], i);
    moe_ckpt_config_t c = moe_ckpt_config_default();
    c.dir = dir;
    c.chunk_bytes = 64 << 10;
    c.pinned_budget_bytes = 1 << 20;
    add_s3(&c);
    moe_ckpt_t *ck = NULL;
    TEST_OK(moe_ckpt_create(rt, &c, &ck));
    TEST_OK(moe_ckpt_save_async(ck, 5, t, n));
    /* the snapshot is taken: this forward changes the expert bias (sign rule) while the
     * write is in flight; the checkpoint holds the state before it, which produced yref */
    forward(l, x, yref);
    TEST_OK(moe_ckpt_wait(ck, 1, 60000));
    moe_ckpt_status_t st = {.struct_size = sizeof st};
    TEST_OK(moe_ckpt_status(ck, &st));
    RANK_CHECK(st.last_committed_step == 5, "last committed %lld",
               (long long)st.last_committed_step);
    if (g_have_s3)
        RANK_CHECK(st.last_uploaded_step == 5, "last uploaded %lld",
                   (long long)st.last_uploaded_step);
    TEST_OK(moe_ckpt_destroy(ck));
    if (R == 0) {
        char sd[300];
        snprintf(sd, sizeof sd, "%s/step-000000000005", dir);
        ck_manifest_t m;
        TEST_OK(ck_manifest_read(sd, &m));
        RANK_CHECK(m.nfiles == W && m.world == W && m.mesh[1] == 4,
                   "manifest: %d files, world %d, ep %d", m.nfiles, m.world, m.mesh[1]);
        ck_manifest_free(&m);
    }
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));

    load_and_compare(dir, 2, W / 2, MOE_PLACEMENT_CONTIGUOUS, x, yref);
    load_and_compare(dir, 1, W, MOE_PLACEMENT_CONTIGUOUS, x, yref);
    if (W == 8) load_and_compare(dir, 8, 1, MOE_PLACEMENT_ROUND_ROBIN, x, yref);
    refused_save(dir);
    load_and_compare(dir, 2, W / 2, MOE_PLACEMENT_CONTIGUOUS, x, yref); /* still step 5 */
    overlapping_replicas();
    failed_commit();
    if (g_have_s3) retention_beside_uploads();
    if (g_have_s3) { /* phase D: nothing local, everything from S3 */
        char empty[256];
        shared_tempdir(empty, sizeof empty, "s3");
        load_and_compare(empty, 2, W / 2, MOE_PLACEMENT_ROUND_ROBIN, x, yref);
        remove_dir(empty, "phase D (restore from S3 at ep=2)");
    } else if (R == 0) {
        printf("S3 test server unavailable: phase D skipped\n");
    }

    int total = 0;
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (R == 0) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
        printf("%s: %d failure(s)\n", total ? "FAILED" : "passed", total);
    }
    if (R == 0 && g_have_s3) s3_fixture_destroy(&g_s3);
    MPI_Finalize();
    return total ? 1 : 0;
}
