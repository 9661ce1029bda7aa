/* Round trip of GPU tensors through the checkpointer on the CUDA backend: device -> pinned
 * staging (the state is 3x the pinned budget, so save_async double-buffers) -> disk ->
 * load into other device tensors, compared bitwise on the host; plus a device tensor saved
 * as bf16 and loaded into a host f32 tensor. Exits 77 (skip) without a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_common.h"

#define N1 (3 * 1000003) /* bf16, ~6 MB */
#define N2 (257 * 1031)  /* f32, ~1 MB */

int main(void)
{
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_CUDA;
    rc.log_fn = ct_log_fn;
    moe_runtime_t *rt = NULL;
    moe_status_t s = moe_runtime_create(&rc, &rt);
    if (s == MOE_STATUS_UNSUPPORTED) {
        printf("no CUDA device: skipped (%s)\n", moe_last_error());
        return 77;
    }
    TEST_OK(s);
    uint16_t *h1 = malloc(N1 * 2), *g1 = malloc(N1 * 2);
    float *h2 = malloc(N2 * 4), *g2 = malloc(N2 * 4), *f1 = malloc((size_t)N1 * 4);
    for (int64_t i = 0; i < N1; i++) h1[i] = (uint16_t)(ct_hash(1, 1, (uint64_t)i) & 0x7f7f);
    for (int64_t i = 0; i < N2; i++) h2[i] = ct_f32(ct_hash(1, 2, (uint64_t)i));
    int64_t n1 = N1, n2[2] = {257, 1031};
    moe_tensor_t th1, th2, d1, d2, e1, e2, hf;
    TEST_OK(moe_tensor_view(h1, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 1, &n1, &th1));
    TEST_OK(moe_tensor_view(h2, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, n2, &th2));
    TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, MOE_DEVICE_CUDA, 1, &n1, &d1));
    TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_CUDA, 2, n2, &d2));
    TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_BF16, MOE_DEVICE_CUDA, 1, &n1, &e1));
    TEST_OK(moe_tensor_alloc(rt, MOE_DTYPE_F32, MOE_DEVICE_CUDA, 2, n2, &e2));
    TEST_OK(moe_tensor_copy(rt, &d1, &th1));
    TEST_OK(moe_tensor_copy(rt, &d2, &th2));

    char dir[256];
    ct_tempdir(dir, sizeof dir, "cuda");
    moe_ckpt_config_t c = ct_config(dir);
    c.chunk_bytes = 1 << 20;
    c.pinned_budget_bytes = 2 << 20;
    moe_ckpt_t *ck;
    TEST_OK(moe_ckpt_create(rt, &c, &ck));
    moe_ckpt_tensor_t t[2] = {moe_ckpt_tensor_whole("w1", &d1), moe_ckpt_tensor_whole("w2", &d2)};
    TEST_OK(moe_ckpt_save_async(ck, 5, t, 2));
    TEST_OK(moe_ckpt_wait(ck, 1, 120000));
    moe_ckpt_tensor_t u[2] = {moe_ckpt_tensor_whole("w1", &e1), moe_ckpt_tensor_whole("w2", &e2)};
    int64_t step = -1;
    TEST_OK(moe_ckpt_load_latest(ck, u, 2, &step));
    moe_tensor_t tg1, tg2;
    TEST_OK(moe_tensor_view(g1, MOE_DTYPE_BF16, MOE_DEVICE_HOST, 1, &n1, &tg1));
    TEST_OK(moe_tensor_view(g2, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, n2, &tg2));
    TEST_OK(moe_tensor_copy(rt, &tg1, &e1));
    TEST_OK(moe_tensor_copy(rt, &tg2, &e2));
    int bad = step != 5 || memcmp(g1, h1, N1 * 2) != 0 || memcmp(g2, h2, N2 * 4) != 0;
    /* bf16 on the device -> f32 on the host */
    TEST_OK(moe_tensor_view(f1, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, &n1, &hf));
    moe_ckpt_tensor_t v = moe_ckpt_tensor_whole("w1", &hf);
    TEST_OK(moe_ckpt_load_step(ck, 5, &v, 1));
    for (int64_t i = 0; i < N1 && !bad; i++) {
        uint32_t bits = (uint32_t)h1[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        if (f1[i] != f) bad = 1;
    }
    moe_ckpt_status_t st = {.struct_size = sizeof st};
    TEST_OK(moe_ckpt_status(ck, &st));
    printf("cuda round trip: step %lld, %s, stall %.4f s, durable %.4f s, direct_io %d\n",
           (long long)step, bad ? "MISMATCH" : "bitwise equal", st.last_stall_s, st.last_durable_s,
           st.direct_io);
    TEST_OK(moe_ckpt_destroy(ck));
    moe_tensor_free(rt, &d1);
    moe_tensor_free(rt, &d2);
    moe_tensor_free(rt, &e1);
    moe_tensor_free(rt, &e2);
    moe_runtime_destroy(rt);
    ct_rmrf(dir);
    free(h1), free(g1), free(h2), free(g2), free(f1);
    return bad;
}
