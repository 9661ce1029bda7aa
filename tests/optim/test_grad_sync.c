/*
 * Overlapped gradient reduction: under mpirun -np 4 with the mesh (tp,ep,dp,pp) = (1,2,2,1),
 * a model of two MoE layers (y = L2(L1(x)), loss = <y, G>) is trained for two steps twice:
 *   A: moe_adamw_start_grad_sync(L2) right after L2's backward, then L1's backward, then
 *      moe_adamw_start_grad_sync(L1), then the step (the reductions overlap L1's backward);
 *   B: no start calls, the step reduces everything.
 * Every rank's inputs differ. Checked: A and B give the same parameters (rel err <= 1e-6),
 * the router weights are identical across the dense group after a step (so the reduction
 * did happen), and misuse is refused: a second start in one batch, an unregistered layer.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <mpi.h>

#include <moe/moe.h>

#include "test_support.h"

enum { N = 6, H = 8, F = 4, E = 4, K = 2 };

static int R, failures;

typedef struct model {
    moe_layer_t *l[2];
    moe_adamw_t *opt;
} model_t;

static void model_init(moe_runtime_t *rt, model_t *m)
{
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = H;
    lc.ffn_hidden = F;
    lc.num_experts = E;
    lc.top_k = K;
    lc.init_std = 0.4f;
    TEST_OK(moe_layer_create(rt, &lc, &m->l[0]));
    TEST_OK(moe_layer_create(rt, &lc, &m->l[1]));
    TEST_OK(moe_adamw_create(rt, NULL, &m->opt));
    TEST_OK(moe_adamw_add_layer(m->opt, m->l[0], "layers.0."));
    TEST_OK(moe_adamw_add_layer(m->opt, m->l[1], "layers.1."));
}

static void train_step(model_t *m, uint64_t seed, int overlap)
{
    test_rng_t rng = {seed * 977 + (uint64_t)R};
    float x[N * H], y1[N * H], y2[N * H], g[N * H], d1[N * H], d0[N * H];
    test_fill_normal(&rng, x, N * H, 1.0);
    test_fill_normal(&rng, g, N * H, 1.0);
    int64_t shape[2] = {N, H};
    moe_tensor_t tx, ty1, ty2, tg, td1, td0;
    TEST_OK(moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &tx));
    TEST_OK(moe_tensor_view(y1, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &ty1));
    TEST_OK(moe_tensor_view(y2, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &ty2));
    TEST_OK(moe_tensor_view(g, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &tg));
    TEST_OK(moe_tensor_view(d1, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &td1));
    TEST_OK(moe_tensor_view(d0, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &td0));
    TEST_OK(moe_layer_zero_grad(m->l[0]));
    TEST_OK(moe_layer_zero_grad(m->l[1]));
    TEST_OK(moe_layer_forward(m->l[0], 0, &tx, &ty1));
    TEST_OK(moe_layer_forward(m->l[1], 0, &ty1, &ty2));
    TEST_OK(moe_layer_backward(m->l[1], 0, &tg, &td1));
    if (overlap) {
        TEST_OK(moe_adamw_start_grad_sync(m->opt, m->l[1]));
        moe_status_t again = moe_adamw_start_grad_sync(m->opt, m->l[1]);
        RANK_CHECK(again == MOE_STATUS_INVALID_ARGUMENT &&
                       strstr(moe_last_error(), "already started"),
                   "a second start in one batch: %s", moe_last_error());
    }
    TEST_OK(moe_layer_backward(m->l[0], 0, &td1, &td0));
    if (overlap) TEST_OK(moe_adamw_start_grad_sync(m->opt, m->l[0]));
    TEST_OK(moe_adamw_step(m->opt, 0, 1.0f));
}

static void model_free(model_t *m)
{
    TEST_OK(moe_adamw_destroy(m->opt));
    TEST_OK(moe_layer_destroy(m->l[0]));
    TEST_OK(moe_layer_destroy(m->l[1]));
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    int W;
    MPI_Comm_rank(MPI_COMM_WORLD, &R);
    MPI_Comm_size(MPI_COMM_WORLD, &W);
    if (W != 4) {
        if (R == 0) fprintf(stderr, "test_grad_sync needs 4 ranks\n");
        MPI_Finalize();
        return 1;
    }
    uint64_t seed = test_seed();
    MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    moe_mesh_config_t mesh = moe_mesh_config_default();
    mesh.ep = 2;
    mesh.dp = 2;
    mesh.timeout_ms = 20000;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mesh;
    moe_runtime_t *rt;
    TEST_OK(moe_runtime_create(&rc, &rt));

    model_t a, b;
    model_init(rt, &a);
    model_init(rt, &b);
    moe_layer_t *stranger;
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = H;
    lc.ffn_hidden = F;
    lc.num_experts = E;
    lc.top_k = K;
    TEST_OK(moe_layer_create(rt, &lc, &stranger));
    moe_status_t st = moe_adamw_start_grad_sync(a.opt, stranger);
    RANK_CHECK(st == MOE_STATUS_INVALID_ARGUMENT &&
                   strstr(moe_last_error(), "no parameters registered"),
               "an unregistered layer: %s", moe_last_error());
    TEST_OK(moe_layer_destroy(stranger));

    for (int step = 0; step < 2; step++) {
        train_step(&a, seed + (uint64_t)step, 1);
        train_step(&b, seed + (uint64_t)step, 0);
    }
    double worst = 0;
    for (int li = 0; li < 2; li++)
        for (int32_t p = 0; p < 3; p++) {
            moe_param_info_t pa = {.struct_size = sizeof pa}, pb = {.struct_size = sizeof pb};
            TEST_OK(moe_layer_param(a.l[li], p, &pa));
            TEST_OK(moe_layer_param(b.l[li], p, &pb));
            int64_t n = moe_tensor_numel(&pa.value);
            double e = test_rel_err(pa.value.data, pb.value.data, n);
            worst = e > worst ? e : worst;
            RANK_CHECK(e <= 1e-6, "layer %d %s: overlapped vs step-time reduction rel err %.3g", li,
                       pa.name, e);
            if (p == 0) { /* the router is replicated: equal on every rank after the step */
                float *mx = malloc(sizeof(float) * (size_t)n),
                      *mn = malloc(sizeof(float) * (size_t)n);
                MPI_Allreduce(pa.value.data, mx, (int)n, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
                MPI_Allreduce(pa.value.data, mn, (int)n, MPI_FLOAT, MPI_MIN, MPI_COMM_WORLD);
                RANK_CHECK(memcmp(mx, mn, sizeof(float) * (size_t)n) == 0,
                           "layer %d router.weight differs across the dense group", li);
                free(mx);
                free(mn);
            }
        }
    model_free(&a);
    model_free(&b);
    TEST_OK(moe_runtime_destroy(rt));
    int total = 0;
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (R == 0)
        printf("overlapped gradient reduction: worst rel err vs step-time %.3g, %d failed checks\n",
               worst, total);
    MPI_Finalize();
    return total ? 1 : 0;
}
