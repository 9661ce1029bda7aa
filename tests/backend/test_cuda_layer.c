/*
 * The whole MoE layer on the GPU against the same layer on the host backend: same parameters
 * (the CUDA layer's bf16 values copied into the host layer), same bf16-rounded x and dy, fresh
 * random draws each run. Compares y, dx, every parameter gradient (bf16 bound 1e-2), the
 * routing (indices exactly, redrawing x if a near-tie flips a choice), the statistics, and
 * that two GPU runs give bitwise-identical results (deterministic mode).
 * Shapes: N tokens, H hidden, F expert width, E experts, K top-k (listed per case).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "core/bf16.h"
#include "gpu_check.h"
#include "layer/layer_internal.h"

static uint64_t seed;

typedef struct layer_case {
    const char *name;
    int64_t n, h, f;
    int32_t e, k;
    moe_score_fn_t fn;
    float capacity_factor;
    int expert_bias;
    int swiglu_gemm; /* MOE_CUDA_SWIGLU_GEMM=1 (on Hopper: SwiGLU in the expert GEMMs) */
} layer_case_t;

typedef struct side {
    moe_runtime_t *rt;
    moe_layer_t *layer;
    moe_tensor_t x, y, dy, dx;
} side_t;

static void side_init(side_t *s, moe_backend_kind_t kind, const moe_layer_config_t *cfg, int64_t n)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = kind;
    rc.seed = seed;
    TEST_OK(moe_runtime_create(&rc, &s->rt));
    TEST_OK(moe_layer_create(s->rt, cfg, &s->layer));
    moe_dtype_t dt;
    moe_device_kind_t dev;
    int32_t idx;
    TEST_OK(moe_runtime_compute_dtype(s->rt, &dt));
    TEST_OK(moe_runtime_device(s->rt, &dev, &idx));
    int64_t shape[2] = {n, cfg->hidden};
    moe_tensor_t *t[] = {&s->x, &s->y, &s->dy, &s->dx};
    for (int i = 0; i < 4; i++) TEST_OK(moe_tensor_alloc(s->rt, dt, dev, 2, shape, t[i]));
}

static void side_free(side_t *s)
{
    moe_tensor_t *t[] = {&s->x, &s->y, &s->dy, &s->dx};
    for (int i = 0; i < 4; i++) TEST_OK(moe_tensor_free(s->rt, t[i]));
    TEST_OK(moe_layer_destroy(s->layer));
    TEST_OK(moe_runtime_destroy(s->rt));
}

/* Copy host f32 values into a tensor of either side (rounded to bf16 on the GPU side). */
static void put(side_t *s, moe_tensor_t *dst, float *vals)
{
    moe_tensor_t src;
    TEST_OK(moe_tensor_view(vals, MOE_DTYPE_F32, MOE_DEVICE_HOST, dst->ndim, dst->shape, &src));
    TEST_OK(moe_tensor_copy(s->rt, dst, &src));
}

static float *get(side_t *s, const moe_tensor_t *src)
{
    int64_t n = moe_tensor_numel(src);
    float *v = malloc(4 * (size_t)(n + 1));
    moe_tensor_t dst;
    TEST_OK(moe_tensor_view(v, MOE_DTYPE_F32, MOE_DEVICE_HOST, src->ndim, src->shape, &dst));
    TEST_OK(moe_tensor_copy(s->rt, &dst, src));
    return v;
}

static int32_t *get_idx(side_t *s, int64_t count)
{
    int32_t *v = malloc(4 * (size_t)count);
    moe_runtime_t *rt = s->rt;
    TEST_OK(MOE_OPS(rt)->copy(MOE_CTX(rt), v, s->layer->slots[0].topk_idx, 4 * (size_t)count));
    return v;
}

static void fill_bf16(test_rng_t *rng, float *v, int64_t n, double std)
{
    test_fill_normal(rng, v, n, std);
    for (int64_t i = 0; i < n; i++) v[i] = moe_bf16_to_f32(moe_f32_to_bf16(v[i]));
}

/* One forward+backward on the GPU side, started with zero_grad or discard_grad; returns y, dx
 * and the three gradients (f32 host). */
static void gpu_step(side_t *g, bool discard, float **out)
{
    TEST_OK(discard ? moe_layer_discard_grad(g->layer) : moe_layer_zero_grad(g->layer));
    TEST_OK(moe_layer_forward(g->layer, 0, &g->x, &g->y));
    TEST_OK(moe_layer_backward(g->layer, 0, &g->dy, &g->dx));
    TEST_OK(moe_runtime_synchronize(g->rt));
    out[0] = get(g, &g->y);
    out[1] = get(g, &g->dx);
    for (int i = 0; i < 3; i++) {
        moe_param_info_t p = {.struct_size = sizeof p};
        TEST_OK(moe_layer_param(g->layer, i, &p));
        out[2 + i] = get(g, &p.grad);
    }
}

static void run_case(const layer_case_t *lc)
{
    fprintf(stderr, "layer %s: N=%lld H=%lld F=%lld E=%d K=%d\n", lc->name, (long long)lc->n,
            (long long)lc->h, (long long)lc->f, lc->e, lc->k);
    moe_layer_config_t cfg = moe_layer_config_default();
    cfg.hidden = lc->h;
    cfg.ffn_hidden = lc->f;
    cfg.num_experts = lc->e;
    cfg.top_k = lc->k;
    cfg.score_fn = lc->fn;
    cfg.capacity_factor = lc->capacity_factor;
    cfg.expert_bias = lc->expert_bias;
    cfg.aux_loss_coef = 0.1f;
    cfg.z_loss_coef = 0.01f;
    cfg.init_std = 0.05f;
    side_t hs, gs;
    side_init(&hs, MOE_BACKEND_HOST, &cfg, lc->n);
    side_init(&gs, MOE_BACKEND_CUDA, &cfg, lc->n);
    /* the GPU layer's bf16 parameters, exactly, on the host layer */
    for (int i = 0; i < 3; i++) {
        moe_param_info_t ph = {.struct_size = sizeof ph}, pg = {.struct_size = sizeof pg};
        TEST_OK(moe_layer_param(hs.layer, i, &ph));
        TEST_OK(moe_layer_param(gs.layer, i, &pg));
        TEST_OK(moe_tensor_copy(gs.rt, &ph.value, &pg.value));
    }
    int64_t nh = lc->n * lc->h, nk = lc->n * lc->k;
    test_rng_t rng = {seed ^ (uint64_t)lc->n};
    float *x = malloc(4 * nh), *dy = malloc(4 * nh);
    int attempt;
    float *hy = NULL;
    for (attempt = 0; attempt < 5; attempt++) {
        if (lc->expert_bias) { /* equal non-zero selection biases on both sides */
            float bias[512];
            test_fill_normal(&rng, bias, lc->e, 0.01);
            moe_param_info_t bh = {.struct_size = sizeof bh}, bg = {.struct_size = sizeof bg};
            TEST_OK(moe_layer_param(hs.layer, 3, &bh));
            TEST_OK(moe_layer_param(gs.layer, 3, &bg));
            put(&hs, &bh.value, bias);
            put(&gs, &bg.value, bias);
        }
        fill_bf16(&rng, x, nh, 1.0);
        put(&hs, &hs.x, x);
        put(&gs, &gs.x, x);
        TEST_OK(moe_layer_zero_grad(hs.layer));
        TEST_OK(moe_layer_zero_grad(gs.layer));
        TEST_OK(moe_layer_forward(hs.layer, 0, &hs.x, &hs.y));
        TEST_OK(moe_layer_forward(gs.layer, 0, &gs.x, &gs.y));
        int32_t *hi = get_idx(&hs, nk), *gi = get_idx(&gs, nk);
        int same = memcmp(hi, gi, 4 * (size_t)nk) == 0;
        free(hi);
        free(gi);
        if (same) break;
        fprintf(stderr, "  a near-tie routed differently; redrawing x\n");
        TEST_OK(moe_layer_release_slot(hs.layer, 0));
        TEST_OK(moe_layer_release_slot(gs.layer, 0));
    }
    assert_true(attempt < 5);
    if (lc->expert_bias) { /* the sign rule ran on the device, from the same counts */
        moe_param_info_t bh = {.struct_size = sizeof bh}, bg = {.struct_size = sizeof bg};
        TEST_OK(moe_layer_param(hs.layer, 3, &bh));
        TEST_OK(moe_layer_param(gs.layer, 3, &bg));
        float *b_h = get(&hs, &bh.value), *b_g = get(&gs, &bg.value);
        assert_memory_equal(b_g, b_h, 4 * (size_t)lc->e);
        free(b_h);
        free(b_g);
    }
    hy = get(&hs, &hs.y);
    float *gy = get(&gs, &gs.y);
    check_close("y", gy, hy, nh, 1e-2);
    moe_layer_stats_t sh = {.struct_size = sizeof sh}, sg = {.struct_size = sizeof sg};
    int64_t *th = malloc(8 * (size_t)lc->e), *tg = malloc(8 * (size_t)lc->e);
    TEST_OK(moe_layer_stats(hs.layer, &sh, th));
    TEST_OK(moe_layer_stats(gs.layer, &sg, tg));
    assert_memory_equal(th, tg, 8 * (size_t)lc->e);
    assert_int_equal(sh.dropped_slots, sg.dropped_slots);
    float st_h[3] = {(float)sh.aux_loss, (float)sh.z_loss, (float)sh.entropy};
    float st_g[3] = {(float)sg.aux_loss, (float)sg.z_loss, (float)sg.entropy};
    check_close("stats (aux, z, entropy)", st_g, st_h, 3, 1e-5);
    fprintf(stderr, "  dropped %lld of %lld slots\n", (long long)sg.dropped_slots,
            (long long)sg.slots);
    /* the rows the GPU experts ran: compact, or padded where the backend asked for it (the
     * host side is always compact, so the comparisons below cover the padded layout) */
    int64_t kept = 0;
    for (int32_t j = 0; j < lc->e; j++) kept += tg[j];
    int64_t stride = MOE_OPS(gs.rt)->expert_row_stride(MOE_CTX(gs.rt), lc->e, tg);
    assert_int_equal(gs.layer->slots[0].rows, stride > 0 ? lc->e * stride : kept);
    fprintf(stderr, "  expert rows %s: %lld for %lld kept\n", stride > 0 ? "padded" : "compact",
            (long long)gs.layer->slots[0].rows, (long long)kept);

    fill_bf16(&rng, dy, nh, 1.0);
    put(&hs, &hs.dy, dy);
    put(&gs, &gs.dy, dy);
    TEST_OK(moe_layer_backward(hs.layer, 0, &hs.dy, &hs.dx));
    TEST_OK(moe_layer_backward(gs.layer, 0, &gs.dy, &gs.dx));
    float *hdx = get(&hs, &hs.dx), *gdx = get(&gs, &gs.dx);
    check_close("dx", gdx, hdx, nh, 1e-2);
    const char *names[3] = {"d router.weight", "d experts.w1", "d experts.w2"};
    for (int i = 0; i < 3; i++) {
        moe_param_info_t ph = {.struct_size = sizeof ph}, pg = {.struct_size = sizeof pg};
        TEST_OK(moe_layer_param(hs.layer, i, &ph));
        TEST_OK(moe_layer_param(gs.layer, i, &pg));
        float *a = get(&hs, &ph.grad), *b = get(&gs, &pg.grad);
        check_close(names[i], b, a, moe_tensor_numel(&ph.grad), 1e-2);
        free(a);
        free(b);
    }

    /* determinism: two more GPU steps on the same inputs agree bit for bit; a third started
     * with discard_grad (the expert gradients written by beta = 0 GEMMs over the second's)
     * agrees with them up to the GEMMs' choice of kernel */
    if (!lc->expert_bias) { /* (the sign rule moves the bias between runs) */
        float *r1[5], *r2[5], *r3[5];
        gpu_step(&gs, false, r1);
        gpu_step(&gs, false, r2);
        gpu_step(&gs, true, r3);
        int64_t sizes[5] = {nh, nh, lc->h * lc->e, lc->e * lc->h * 2 * lc->f,
                            lc->e * lc->f * lc->h};
        for (int i = 0; i < 5; i++) {
            assert_memory_equal(r1[i], r2[i], 4 * (size_t)sizes[i]);
            check_close(i < 2 ? "discard_grad step output" : "discard_grad step gradient", r3[i],
                        r1[i], sizes[i], 1e-6);
            free(r1[i]);
            free(r2[i]);
            free(r3[i]);
        }
        fprintf(stderr, "  two GPU runs bitwise identical; discard_grad's equal\n");
    }
    free(x);
    free(dy);
    free(hy);
    free(gy);
    free(hdx);
    free(gdx);
    free(th);
    free(tg);
    side_free(&hs);
    side_free(&gs);
}

static void test_layers(void **state)
{
    (void)state;
    const layer_case_t cases[] = {
        {"softmax dropless", 512, 128, 96, 16, 2, MOE_SCORE_SOFTMAX, 0, 0, 0},
        {"sigmoid capacity 1.0 + bias", 600, 64, 40, 8, 3, MOE_SCORE_SIGMOID, 1.0f, 1, 0},
        {"softmax E=64 K=8", 256, 64, 32, 64, 8, MOE_SCORE_SOFTMAX, 0, 0, 0},
        /* capacity near the mean load: filler under a quarter, so the GPU pads */
        {"softmax E=32 capacity 1.1", 2048, 64, 32, 32, 2, MOE_SCORE_SOFTMAX, 1.1f, 0, 0},
        /* F % 128 == 0, with the SwiGLU GEMMs (on Hopper): padded (E=16) and compact (E=8) rows */
        {"softmax E=16 F=128 SwiGLU GEMMs", 1024, 128, 128, 16, 2, MOE_SCORE_SOFTMAX, 0, 0, 1},
        {"sigmoid E=8 F=256 capacity 1.0 + bias SwiGLU GEMMs", 1000, 192, 256, 8, 2,
         MOE_SCORE_SIGMOID, 1.0f, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].swiglu_gemm) setenv("MOE_CUDA_SWIGLU_GEMM", "1", 1);
        run_case(&cases[i]);
        unsetenv("MOE_CUDA_SWIGLU_GEMM");
    }
}

int main(void)
{
    if (moe_backend_cuda_device_count() <= 0) {
        fprintf(stderr, "no CUDA device: skipping\n");
        return 77;
    }
    seed = test_seed();
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_layers)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
