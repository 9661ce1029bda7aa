/*
 * The trainer's fused causal attention on CUDA (attention_cuda.h) against the host reference
 * (attention.h, fp32) on the same bf16-rounded inputs: forward o, and dq, dk, dv from a random
 * do, by relative norm error. Shapes (S sequences, T tokens, nh heads of d): the bench models'
 * head dims 64 and 128 and the padded ones 8 and 32, at T that are no multiple of the 64-row
 * tile (77, 200, 19, 130) and one that is (128); fresh random inputs each run (seed printed).
 * Outputs are poisoned (NaN) before each call, so an element left unwritten fails.
 *
 * Bounds: bf16 keeps 8 significant bits (2^-9 relative per value). The kernels round P to bf16
 * before P v, and o once at the end: 1e-2 for o. The gradients also go through dS = P (dP -
 * delta) with delta from the rounded o, a difference that cancels, and dS rounded before
 * dS k and dS^T q: 2e-2 for dq, dk, dv. The reference is fp32 throughout. Measured on the
 * H200: o within 1.8e-3, dq, dk, dv within 3.9e-3. Every case is printed before the checks,
 * so a failure shows all of them.
 * Also: the backward run twice gives the same bits (fixed summation order), and a head dim
 * the kernels do not take (12, 136) is refused with cudaErrorInvalidValue. Exits 77 without
 * a GPU.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "attention.h"
#include "attention_cuda.h"
#include "core/bf16.h"
#include "test_support.h"

#define OUT_BOUND 1e-2
#define GRAD_BOUND 2e-2

#define CUDA_OK(call) assert_int_equal((call), cudaSuccess)

typedef struct attn_case {
    int64_t S, T, nh, d;
} attn_case_t;

/* n values: normal(std) rounded to bf16, as floats and as bf16 bits */
static void fill_bf16(test_rng_t *rng, float *x, uint16_t *bits, int64_t n, double std)
{
    test_fill_normal(rng, x, n, std);
    for (int64_t i = 0; i < n; i++) {
        bits[i] = moe_f32_to_bf16(x[i]);
        x[i] = moe_bf16_to_f32(bits[i]);
    }
}

static void *device_copy(const void *host, size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes));
    CUDA_OK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    return p;
}

static void *device_poisoned(size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes));
    CUDA_OK(cudaMemset(p, 0xff, bytes)); /* bf16 0xffff is a NaN */
    return p;
}

/* the device's bf16 [n] as floats */
static float *host_floats(const void *dev, int64_t n)
{
    uint16_t *bits = malloc(sizeof *bits * (size_t)n);
    float *x = malloc(sizeof *x * (size_t)n);
    assert_non_null(bits);
    assert_non_null(x);
    CUDA_OK(cudaMemcpy(bits, dev, sizeof *bits * (size_t)n, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i++) x[i] = moe_bf16_to_f32(bits[i]);
    free(bits);
    return x;
}

/* part p (q, k or v) of every row of qkv [N,3H] */
static double part_err(const float *got, const float *ref, int64_t N, int64_t H, int p)
{
    float *a = malloc(sizeof *a * (size_t)(N * H)), *b = malloc(sizeof *b * (size_t)(N * H));
    assert_non_null(a);
    assert_non_null(b);
    for (int64_t r = 0; r < N; r++) {
        memcpy(a + r * H, got + r * 3 * H + p * H, sizeof *a * (size_t)H);
        memcpy(b + r * H, ref + r * 3 * H + p * H, sizeof *b * (size_t)H);
    }
    double e = test_rel_err(a, b, N * H);
    free(a);
    free(b);
    return e;
}

/* 1 when every check of the case passed */
static int check_case(test_rng_t *rng, const attn_case_t *c)
{
    int64_t S = c->S, T = c->T, nh = c->nh, H = nh * c->d, N = S * T;
    attention_cuda_shape_t shape = {S, T, H, nh};
    size_t nqkv = (size_t)(N * 3 * H), no = (size_t)(N * H), nlse = (size_t)(S * nh * T);
    float *qkv = malloc(sizeof *qkv * nqkv), *d_o = malloc(sizeof *d_o * no);
    uint16_t *qkv_bits = malloc(sizeof *qkv_bits * nqkv), *do_bits = malloc(sizeof *do_bits * no);
    float *o_ref = malloc(sizeof *o_ref * no), *dqkv_ref = malloc(sizeof *dqkv_ref * nqkv);
    float *probs = malloc(sizeof *probs * (size_t)(S * nh * T * T));
    assert_true(qkv && d_o && qkv_bits && do_bits && o_ref && dqkv_ref && probs);
    /* std 1.5: scores of std ~2 after the 1/sqrt(d), so the softmax is far from uniform */
    fill_bf16(rng, qkv, qkv_bits, (int64_t)nqkv, 1.5);
    fill_bf16(rng, d_o, do_bits, (int64_t)no, 1.0);

    attention_forward(S, T, H, nh, qkv, probs, o_ref);

    void *dqkv_in = device_copy(qkv_bits, sizeof(uint16_t) * nqkv);
    void *ddo = device_copy(do_bits, sizeof(uint16_t) * no);
    void *dev_o = device_poisoned(sizeof(uint16_t) * no);
    void *dev_dqkv = device_poisoned(sizeof(uint16_t) * nqkv);
    float *lse = NULL, *delta = NULL;
    CUDA_OK(cudaMalloc((void **)&lse, sizeof(float) * nlse));
    CUDA_OK(cudaMalloc((void **)&delta, sizeof(float) * nlse));

    CUDA_OK(attention_cuda_forward(&shape, dqkv_in, dev_o, lse, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    float *o = host_floats(dev_o, (int64_t)no);
    attention_backward(S, T, H, nh, qkv, probs, d_o, dqkv_ref);

    CUDA_OK(attention_cuda_backward(&shape, dqkv_in, dev_o, lse, ddo, delta, dev_dqkv, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    float *dqkv = host_floats(dev_dqkv, (int64_t)nqkv);
    uint16_t *first = malloc(sizeof *first * nqkv), *again = malloc(sizeof *again * nqkv);
    assert_true(first && again);
    CUDA_OK(cudaMemcpy(first, dev_dqkv, sizeof *first * nqkv, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemset(dev_dqkv, 0xff, sizeof(uint16_t) * nqkv));
    CUDA_OK(attention_cuda_backward(&shape, dqkv_in, dev_o, lse, ddo, delta, dev_dqkv, NULL));
    CUDA_OK(cudaMemcpy(again, dev_dqkv, sizeof *again * nqkv, cudaMemcpyDeviceToHost));

    double eo = test_rel_err(o, o_ref, (int64_t)no);
    double eq = part_err(dqkv, dqkv_ref, N, H, 0), ek = part_err(dqkv, dqkv_ref, N, H, 1),
           ev = part_err(dqkv, dqkv_ref, N, H, 2);
    int same = !memcmp(first, again, sizeof *first * nqkv);
    /* e <= bound is false for a NaN (an unwritten element) too */
    int ok = eo <= OUT_BOUND && eq <= GRAD_BOUND && ek <= GRAD_BOUND && ev <= GRAD_BOUND && same;
    printf("S %lld T %lld heads %lld d %lld: o %.2e  dq %.2e  dk %.2e  dv %.2e  backward twice "
           "%s: %s\n",
           (long long)S, (long long)T, (long long)nh, (long long)c->d, eo, eq, ek, ev,
           same ? "equal" : "DIFFERENT", ok ? "ok" : "FAILED");

    free(first);
    free(again);
    free(o);
    free(dqkv);
    cudaFree(dqkv_in);
    cudaFree(ddo);
    cudaFree(dev_o);
    cudaFree(dev_dqkv);
    cudaFree(lse);
    cudaFree(delta);
    free(qkv);
    free(d_o);
    free(qkv_bits);
    free(do_bits);
    free(o_ref);
    free(dqkv_ref);
    free(probs);
    return ok;
}

static void test_attention_matches_host(void **state)
{
    (void)state;
    uint64_t seed = test_seed();
    test_rng_t rng = {seed};
    const attn_case_t cases[] = {
        {2, 77, 2, 64},   /* small's head dim; T below two tiles */
        {1, 200, 2, 128}, /* fine's and coarse's */
        {2, 128, 1, 128}, /* whole tiles */
        {3, 19, 2, 8},    /* padded to 16 */
        {1, 130, 3, 32},  /* padded to 32 (test_trainer_cuda's head dim), three heads */
    };
    int failed = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        failed += !check_case(&rng, &cases[i]);
    assert_int_equal(failed, 0);
}

static void test_attention_refuses_head_dims(void **state)
{
    (void)state;
    assert_true(attention_cuda_head_dim_ok(64));
    assert_true(attention_cuda_head_dim_ok(128));
    assert_false(attention_cuda_head_dim_ok(12));
    assert_false(attention_cuda_head_dim_ok(136));
    attention_cuda_shape_t odd = {1, 16, 24, 2}, wide = {1, 16, 272, 2};
    assert_int_equal(attention_cuda_forward(&odd, NULL, NULL, NULL, NULL), cudaErrorInvalidValue);
    assert_int_equal(attention_cuda_backward(&wide, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
                     cudaErrorInvalidValue);
}

int main(void)
{
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        fprintf(stderr, "no CUDA device: skipping\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_attention_matches_host),
                                       cmocka_unit_test(test_attention_refuses_head_dims)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
