/*
 * The one-call training state (moe/train_state.h), host backend, world of one.
 *
 * A layer with round-robin placement and the expert bias (H 8, F 16, E 4, K 2), its AdamW
 * optimizer after 2 steps, and a user tensor go into one state set, saved as step 2. The
 * parameters, states, bias and user tensor are then overwritten and the optimizer's step count
 * changed; loading the newest checkpoint must restore every byte and the step count. An entry
 * of a kind that is not a moe_param_kind_t is refused.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_common.h"

enum { H = 8, F = 16, E = 4, K = 2, N = 12 };

/* Every byte the state covers, concatenated (malloc'd). */
static uint8_t *state_bytes(moe_layer_t *l, moe_adamw_t *opt, const float *user, size_t *len)
{
    int32_t np, ns;
    TEST_OK(moe_layer_num_params(l, &np));
    TEST_OK(moe_adamw_num_states(opt, &ns));
    uint8_t *buf = NULL;
    size_t n = 0;
    for (int32_t i = 0; i < np + ns; i++) {
        moe_param_info_t info = {.struct_size = sizeof info};
        if (i < np)
            TEST_OK(moe_layer_param(l, i, &info));
        else
            TEST_OK(moe_adamw_state(opt, i - np, &info));
        size_t k = sizeof(float) * (size_t)moe_tensor_numel(&info.value);
        buf = realloc(buf, n + k);
        memcpy(buf + n, info.value.data, k);
        n += k;
    }
    buf = realloc(buf, n + 3 * sizeof(float));
    memcpy(buf + n, user, 3 * sizeof(float));
    *len = n + 3 * sizeof(float);
    return buf;
}

static void scribble(moe_layer_t *l, moe_adamw_t *opt, float *user)
{
    int32_t np, ns;
    TEST_OK(moe_layer_num_params(l, &np));
    TEST_OK(moe_adamw_num_states(opt, &ns));
    for (int32_t i = 0; i < np + ns; i++) {
        moe_param_info_t info = {.struct_size = sizeof info};
        if (i < np)
            TEST_OK(moe_layer_param(l, i, &info));
        else
            TEST_OK(moe_adamw_state(opt, i - np, &info));
        float *v = info.value.data;
        for (int64_t j = 0; j < moe_tensor_numel(&info.value); j++) v[j] = -7.0f;
    }
    user[0] = user[1] = user[2] = 0;
    TEST_OK(moe_adamw_set_step_count(opt, 99));
}

int main(void)
{
    char dir[256];
    ct_tempdir(dir, sizeof dir, "train-state");
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.log_fn = ct_log_fn;
    moe_runtime_t *rt;
    TEST_OK(moe_runtime_create(&rc, &rt));
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = H;
    lc.ffn_hidden = F;
    lc.num_experts = E;
    lc.top_k = K;
    lc.expert_bias = 1;
    lc.placement = MOE_PLACEMENT_ROUND_ROBIN;
    moe_layer_t *l;
    TEST_OK(moe_layer_create(rt, &lc, &l));
    moe_adamw_t *opt;
    TEST_OK(moe_adamw_create(rt, NULL, &opt));
    TEST_OK(moe_adamw_add_layer(opt, l, NULL));
    float x[N * H], y[N * H], dy[N * H];
    test_rng_t r = {7};
    int64_t shp[2] = {N, H};
    moe_tensor_t tx, ty, tdy;
    TEST_OK(moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &tx));
    TEST_OK(moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &ty));
    TEST_OK(moe_tensor_view(dy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &tdy));
    for (int s = 0; s < 2; s++) {
        test_fill_normal(&r, x, N * H, 1.0);
        test_fill_normal(&r, dy, N * H, 0.1);
        TEST_OK(moe_layer_zero_grad(l));
        TEST_OK(moe_layer_forward(l, 0, &tx, &ty));
        TEST_OK(moe_layer_backward(l, 0, &tdy, NULL));
        TEST_OK(moe_adamw_step(opt, MOE_ADAMW_LR_CONFIGURED, 1.0f));
    }
    float user[3] = {1.5f, -2.0f, 3.25f};
    int64_t ushape[1] = {3};
    moe_tensor_t tu;
    TEST_OK(moe_tensor_view(user, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, ushape, &tu));
    moe_ckpt_tensor_t ue = moe_ckpt_tensor_whole("user.thing", &tu);

    moe_train_state_t *st;
    TEST_OK(moe_train_state_create(&st));
    TEST_OK(moe_train_state_add_layer(st, l, "layer."));
    TEST_OK(moe_train_state_add_adamw(st, opt, "optim."));
    TEST_OK(moe_train_state_add_tensor(st, &ue, MOE_PARAM_DENSE));
    if (moe_train_state_add_tensor(st, &ue, (moe_param_kind_t)7) != MOE_STATUS_INVALID_ARGUMENT) {
        fprintf(stderr, "kind 7 was accepted\n");
        return 1;
    }
    moe_ckpt_config_t cc = ct_config(dir);
    moe_ckpt_t *ck;
    TEST_OK(moe_ckpt_create(rt, &cc, &ck));
    size_t len, len2;
    uint8_t *before = state_bytes(l, opt, user, &len);
    TEST_OK(moe_ckpt_save_train_state(ck, 2, st));
    TEST_OK(moe_ckpt_wait(ck, 1, 60000));
    scribble(l, opt, user);
    int64_t step = -1, steps = -1;
    TEST_OK(moe_ckpt_load_train_state(ck, -1, st, &step));
    TEST_OK(moe_adamw_step_count(opt, &steps));
    uint8_t *after = state_bytes(l, opt, user, &len2);
    int rc_ = 0;
    if (step != 2 || steps != 2 || len != len2 || memcmp(before, after, len) != 0) {
        fprintf(stderr, "restore differs: step %lld, optimizer steps %lld, bytes %s\n",
                (long long)step, (long long)steps,
                len == len2 && !memcmp(before, after, len) ? "equal" : "differ");
        rc_ = 1;
    }
    free(before);
    free(after);
    TEST_OK(moe_ckpt_destroy(ck));
    TEST_OK(moe_train_state_destroy(st));
    TEST_OK(moe_train_state_destroy(NULL));
    TEST_OK(moe_adamw_destroy(opt));
    TEST_OK(moe_layer_destroy(l));
    TEST_OK(moe_runtime_destroy(rt));
    ct_rmrf(dir);
    if (rc_ == 0)
        printf("train state: layer, optimizer (step 2) and user tensor restored bitwise\n");
    return rc_;
}
