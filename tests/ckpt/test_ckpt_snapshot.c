/* The snapshot is the state at the save call while training keeps writing it during the
 * copy: save_async returns before the copy is done, the optimizer steps right after it, and
 * the checkpoint must equal, byte for byte, one saved synchronously (save, then wait) of the
 * same state. Then the caller's own write (zeros over big.master, at once) after
 * moe_ckpt_fence, checked the same way.
 *
 *   test_ckpt_snapshot [host|cuda]    (cuda exits 77 without a GPU)
 *
 * The state: AdamW over two user parameters, "big" (BIG_N elements: a copy of tens of
 * milliseconds on the host, several on the GPU, so an unfenced write lands inside it) and
 * "small" (1000 elements: copied first, under its own event), with their masters and moments:
 * 8 tensors. Gradients are a fixed pattern; 2 steps before the first save. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_common.h"

#define SMALL_N 1000

typedef struct run {
    moe_runtime_t *rt;
    moe_device_kind_t dev;
    moe_dtype_t act;
    moe_adamw_t *opt;
    moe_tensor_t value[2], grad[2];
    moe_param_info_t info[6];
    moe_ckpt_tensor_t t[8];
} run_t;

static void make_param(run_t *r, int i, int64_t n)
{
    TEST_OK(moe_tensor_alloc(r->rt, r->act, r->dev, 1, &n, &r->value[i]));
    TEST_OK(moe_tensor_alloc(r->rt, MOE_DTYPE_F32, r->dev, 1, &n, &r->grad[i]));
    float *g = malloc(sizeof *g * (size_t)n), *v = malloc(sizeof *v * (size_t)n);
    for (int64_t k = 0; k < n; k++) {
        g[k] = ct_f32(ct_hash(7, (uint64_t)i, (uint64_t)k));
        v[k] = ct_f32(ct_hash(8, (uint64_t)i, (uint64_t)k));
    }
    moe_tensor_t hg, hv;
    TEST_OK(moe_tensor_view(g, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &n, &hg));
    TEST_OK(moe_tensor_view(v, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &n, &hv));
    TEST_OK(moe_tensor_copy(r->rt, &r->grad[i], &hg));
    TEST_OK(moe_tensor_copy(r->rt, &r->value[i], &hv)); /* converted to the compute dtype */
    free(g);
    free(v);
}

static int setup(run_t *r, bool cuda)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = cuda ? MOE_BACKEND_CUDA : MOE_BACKEND_HOST;
    rc.log_fn = ct_log_fn;
    moe_status_t s = moe_runtime_create(&rc, &r->rt);
    if (s == MOE_STATUS_UNSUPPORTED) return 77;
    TEST_OK(s);
    r->dev = cuda ? MOE_DEVICE_CUDA : MOE_DEVICE_HOST;
    r->act = cuda ? MOE_DTYPE_BF16 : MOE_DTYPE_F32;
    /* host: 8M elements (4 x 32 MiB of state); CUDA: 64M (0.9 GiB, ~17 ms at 55 GB/s) */
    int64_t big = cuda ? (int64_t)64 << 20 : (int64_t)8 << 20;
    make_param(r, 0, big);
    make_param(r, 1, SMALL_N);
    moe_adamw_config_t ac = moe_adamw_config_default();
    TEST_OK(moe_adamw_create(r->rt, &ac, &r->opt));
    TEST_OK(moe_adamw_add_param(r->opt, "big", MOE_PARAM_DENSE, &r->value[0], &r->grad[0]));
    TEST_OK(moe_adamw_add_param(r->opt, "small", MOE_PARAM_DENSE, &r->value[1], &r->grad[1]));
    static const char *const names[8] = {"big",   "small",        "big.master", "big.m",
                                         "big.v", "small.master", "small.m",    "small.v"};
    r->t[0] = moe_ckpt_tensor_whole(names[0], &r->value[0]);
    r->t[1] = moe_ckpt_tensor_whole(names[1], &r->value[1]);
    for (int32_t i = 0; i < 6; i++) {
        r->info[i] = (moe_param_info_t){.struct_size = sizeof r->info[i]};
        TEST_OK(moe_adamw_state(r->opt, i, &r->info[i]));
        r->t[2 + i] = moe_ckpt_tensor_whole(names[2 + i], &r->info[i].value);
    }
    for (int k = 0; k < 2; k++) TEST_OK(moe_adamw_step(r->opt, MOE_ADAMW_LR_CONFIGURED, 1.0f));
    TEST_OK(moe_runtime_synchronize(r->rt));
    return 0;
}

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*len + 1);
    if (fread(b, 1, *len, f) != *len) exit(1);
    fclose(f);
    return b;
}

/* 1 when step's data file is the same bytes in both directories. */
static int same_data(const char *a, const char *b, int64_t step)
{
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/step-%012lld/rank-00000.bin", a, (long long)step);
    snprintf(pb, sizeof pb, "%s/step-%012lld/rank-00000.bin", b, (long long)step);
    size_t la, lb;
    uint8_t *x = read_file(pa, &la), *y = read_file(pb, &lb);
    size_t first = la;
    for (size_t i = 0; i < la && i < lb; i++)
        if (x[i] != y[i]) {
            first = i;
            break;
        }
    int same = la == lb && first == la;
    if (!same)
        fprintf(stderr, "step %lld: %zu vs %zu bytes, first difference at byte %zu\n",
                (long long)step, la, lb, first);
    free(x);
    free(y);
    return same;
}

/* A host copy of the small parameter's value (to see that training did change it). */
static void small_value(run_t *r, float *out)
{
    int64_t n = SMALL_N;
    moe_tensor_t h;
    TEST_OK(moe_tensor_view(out, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &n, &h));
    TEST_OK(moe_tensor_copy(r->rt, &h, &r->value[1]));
}

int main(int argc, char **argv)
{
    bool cuda = argc > 1 && !strcmp(argv[1], "cuda");
    run_t r;
    memset(&r, 0, sizeof r);
    if (setup(&r, cuda) == 77) {
        printf("no CUDA device: skipped (%s)\n", moe_last_error());
        return 77;
    }
    char dsync[256], dasync[256];
    ct_tempdir(dsync, sizeof dsync, "snap-sync");
    ct_tempdir(dasync, sizeof dasync, "snap-async");
    moe_ckpt_config_t c = moe_ckpt_config_default();
    c.keep_last = 0;
    c.chunk_bytes = 4 << 20;
    c.pinned_budget_bytes = (size_t)2 << 30; /* the whole state: the zero-stall path */
    moe_ckpt_t *cs, *ca;
    c.dir = dsync;
    TEST_OK(moe_ckpt_create(r.rt, &c, &cs));
    c.dir = dasync;
    TEST_OK(moe_ckpt_create(r.rt, &c, &ca));

    /* 1. the optimizer steps right after the save */
    TEST_OK(moe_ckpt_save_async(cs, 2, r.t, 8));
    TEST_OK(moe_ckpt_wait(cs, 0, -1));
    float before[SMALL_N], after[SMALL_N];
    small_value(&r, before);
    TEST_OK(moe_ckpt_save_async(ca, 2, r.t, 8));
    moe_ckpt_status_t st = {.struct_size = sizeof st};
    TEST_OK(moe_ckpt_status(ca, &st));
    double stall = st.last_stall_s;
    for (int k = 0; k < 3; k++) TEST_OK(moe_adamw_step(r.opt, MOE_ADAMW_LR_CONFIGURED, 1.0f));
    TEST_OK(moe_ckpt_wait(ca, 0, -1));
    small_value(&r, after);
    int trained = memcmp(before, after, sizeof before) != 0;
    int same1 = same_data(dsync, dasync, 2);

    /* 2. the caller writes a saved tensor after moe_ckpt_fence */
    TEST_OK(moe_ckpt_save_async(cs, 3, r.t, 8));
    TEST_OK(moe_ckpt_wait(cs, 0, -1));
    int64_t big = moe_tensor_numel(&r.info[0].value);
    float *zeros = calloc((size_t)big, sizeof *zeros);
    moe_tensor_t hz;
    TEST_OK(moe_tensor_view(zeros, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &big, &hz));
    TEST_OK(moe_ckpt_save_async(ca, 3, r.t, 8));
    TEST_OK(moe_ckpt_fence(ca));
    TEST_OK(moe_tensor_copy(r.rt, &r.info[0].value, &hz)); /* big.master: f32, no conversion */
    TEST_OK(moe_ckpt_wait(ca, 0, -1));
    free(zeros);
    int same2 = same_data(dsync, dasync, 3);

    printf("%s backend: save_async stall %.4f s; after 3 optimizer steps during the copy the "
           "checkpoint %s the synchronous one (training %s the state); after the fence and a "
           "write, %s\n",
           cuda ? "cuda" : "host", stall, same1 ? "equals" : "DIFFERS FROM",
           trained ? "changed" : "DID NOT CHANGE", same2 ? "equal" : "DIFFERENT");
    TEST_OK(moe_ckpt_destroy(cs));
    TEST_OK(moe_ckpt_destroy(ca));
    TEST_OK(moe_adamw_destroy(r.opt));
    for (int i = 0; i < 2; i++) {
        moe_tensor_free(r.rt, &r.value[i]);
        moe_tensor_free(r.rt, &r.grad[i]);
    }
    TEST_OK(moe_runtime_destroy(r.rt));
    ct_rmrf(dsync);
    ct_rmrf(dasync);
    return same1 && same2 && trained ? 0 : 1;
}
