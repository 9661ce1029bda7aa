/*
 * Save -> load -> resume reproduces training bitwise (host backend, world of one).
 *
 * A layer (H 8, F 16, E 4, K 2) and its AdamW optimizer train 3 steps on
 * batches b_1..b_3 (x and dy from a seed per step); the parameters, the expert-bias buffer
 * and the optimizer state ("<name>.master/.exp_avg/.exp_avg_sq") are saved as step 3; the run
 * continues with b_4, b_5 -> reference. A fresh runtime, layer and optimizer (same seed)
 * load step 3, restore the optimizer step count, train on b_4, b_5 and must end with every
 * parameter and every optimizer state bitwise equal to the reference. The fresh layer's
 * parameters before loading differ from the saved ones (the test can fail).
 *
 * `test_ckpt_resume bias` turns the layer's expert bias on: the loaded bias must be the one
 * the sign rule continues from (regression: the layer once kept a host shadow of
 * "router.expert_bias" that overwrote a loaded value at the next forward).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_common.h"

enum { H = 8, F = 16, E = 4, K = 2, N = 12, MAXT = 64 };

typedef struct model {
    moe_runtime_t *rt;
    moe_layer_t *l;
    moe_adamw_t *opt;
} model_t;

static int g_bias;

static void model_init(model_t *m)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.seed = 4242;
    rc.log_fn = ct_log_fn;
    TEST_OK(moe_runtime_create(&rc, &m->rt));
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = H;
    lc.ffn_hidden = F;
    lc.num_experts = E;
    lc.top_k = K;
    lc.expert_bias = g_bias;
    lc.expert_bias_rate = 0.01f;
    lc.init_std = 0.3f;
    TEST_OK(moe_layer_create(m->rt, &lc, &m->l));
    TEST_OK(moe_adamw_create(m->rt, NULL, &m->opt));
    TEST_OK(moe_adamw_add_layer(m->opt, m->l, "layer0."));
}

static void model_free(model_t *m)
{
    moe_adamw_destroy(m->opt);
    moe_layer_destroy(m->l);
    moe_runtime_destroy(m->rt);
}

static void train_step(model_t *m, int64_t step)
{
    float x[N * H], dy[N * H], y[N * H];
    test_rng_t r = {1000 + (uint64_t)step};
    test_fill_normal(&r, x, N * H, 1.0);
    test_fill_normal(&r, dy, N * H, 0.1);
    int64_t shp[2] = {N, H};
    moe_tensor_t tx, ty, tdy;
    TEST_OK(moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &tx));
    TEST_OK(moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &ty));
    TEST_OK(moe_tensor_view(dy, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shp, &tdy));
    TEST_OK(moe_layer_zero_grad(m->l));
    TEST_OK(moe_layer_forward(m->l, 0, &tx, &ty));
    TEST_OK(moe_layer_backward(m->l, 0, &tdy, NULL));
    TEST_OK(moe_adamw_step(m->opt, 0, 1.0f));
}

/* Layer parameters (with buffers) and optimizer states as checkpoint entries. */
static int32_t entries(model_t *m, moe_ckpt_tensor_t *t, moe_param_info_t *info, char names[][128])
{
    int32_t np, ns, n = 0;
    TEST_OK(moe_layer_num_params(m->l, &np));
    TEST_OK(moe_adamw_num_states(m->opt, &ns));
    if (np + ns > MAXT) abort();
    for (int32_t i = 0; i < np + ns; i++, n++) {
        info[n] = (moe_param_info_t){.struct_size = sizeof info[n]};
        if (i < np) {
            TEST_OK(moe_layer_param(m->l, i, &info[n]));
            snprintf(names[n], 128, "layer0.%s", info[n].name);
        } else {
            TEST_OK(moe_adamw_state(m->opt, i - np, &info[n]));
            snprintf(names[n], 128, "optim.%s", info[n].name);
        }
        t[n] = moe_ckpt_tensor_whole(names[n], &info[n].value);
        memcpy(t[n].global_shape, info[n].global_shape, sizeof t[n].global_shape);
        memcpy(t[n].offset, info[n].shard_offset, sizeof t[n].offset);
        t[n].expert_dim = info[n].expert_dim;
    }
    return n;
}

/* All entries' bytes, concatenated (malloc'd). */
static uint8_t *snapshot(const moe_ckpt_tensor_t *t, int32_t n, size_t *len)
{
    size_t total = 0;
    for (int32_t i = 0; i < n; i++)
        total += (size_t)moe_tensor_numel(&t[i].tensor) * moe_dtype_size(t[i].tensor.dtype);
    uint8_t *b = malloc(total + 1), *p = b;
    for (int32_t i = 0; i < n; i++) {
        size_t k = (size_t)moe_tensor_numel(&t[i].tensor) * moe_dtype_size(t[i].tensor.dtype);
        memcpy(p, t[i].tensor.data, k);
        p += k;
    }
    *len = total;
    return b;
}

int main(int argc, char **argv)
{
    g_bias = argc > 1 && !strcmp(argv[1], "bias");
    char dir[256];
    ct_tempdir(dir, sizeof dir, "resume");
    moe_ckpt_config_t cc = ct_config(dir);

    model_t a;
    model_init(&a);
    moe_ckpt_t *ck;
    TEST_OK(moe_ckpt_create(a.rt, &cc, &ck));
    for (int64_t s = 1; s <= 3; s++) train_step(&a, s);
    moe_ckpt_tensor_t ta[MAXT];
    moe_param_info_t ia[MAXT];
    char na[MAXT][128];
    int32_t n = entries(&a, ta, ia, na);
    size_t saved_len;
    uint8_t *saved = snapshot(ta, n, &saved_len);
    TEST_OK(moe_ckpt_save_async(ck, 3, ta, n));
    for (int64_t s = 4; s <= 5; s++) train_step(&a, s); /* while the write is in flight */
    TEST_OK(moe_ckpt_wait(ck, 1, 60000));
    TEST_OK(moe_ckpt_destroy(ck));
    size_t ref_len;
    uint8_t *ref = snapshot(ta, n, &ref_len);

    model_t b;
    model_init(&b);
    moe_ckpt_tensor_t tb[MAXT];
    moe_param_info_t ib[MAXT];
    char nb[MAXT][128];
    int32_t m = entries(&b, tb, ib, nb);
    int bad = m != n;
    size_t fresh_len;
    uint8_t *fresh = snapshot(tb, m, &fresh_len);
    bad |= fresh_len == saved_len && memcmp(fresh, saved, saved_len) == 0; /* must differ */
    TEST_OK(moe_ckpt_create(b.rt, &cc, &ck));
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, tb, m, &step));
    TEST_OK(moe_ckpt_destroy(ck));
    bad |= step != 3;
    size_t loaded_len;
    uint8_t *loaded = snapshot(tb, m, &loaded_len);
    bad |= loaded_len != saved_len || memcmp(loaded, saved, saved_len) != 0;
    TEST_OK(moe_adamw_set_step_count(b.opt, step));
    for (int64_t s = 4; s <= 5; s++) train_step(&b, s);
    size_t out_len;
    uint8_t *out = snapshot(tb, m, &out_len);
    int resumed_equal = out_len == ref_len && memcmp(out, ref, ref_len) == 0;
    if (!resumed_equal) { /* name the tensors that differ */
        size_t off = 0;
        for (int32_t i = 0; i < m && out_len == ref_len; i++) {
            size_t k = (size_t)moe_tensor_numel(&tb[i].tensor) * moe_dtype_size(tb[i].tensor.dtype);
            if (memcmp(out + off, ref + off, k)) printf("  differs: %s\n", tb[i].name);
            off += k;
        }
    }
    bad |= !resumed_equal;
    printf("%d tensors (%zu bytes): loaded state %s the saved one; resumed run %s the "
           "uninterrupted one\n",
           n, saved_len,
           loaded_len == saved_len && !memcmp(loaded, saved, saved_len) ? "equals" : "DIFFERS FROM",
           resumed_equal ? "bitwise equals" : "DIFFERS FROM");
    free(saved), free(ref), free(fresh), free(loaded), free(out);
    model_free(&a);
    model_free(&b);
    ct_rmrf(dir);
    return bad ? 1 : 0;
}
