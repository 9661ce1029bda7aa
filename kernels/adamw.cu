/*
 * The optimizer's passes over every parameter (kernels.h): the AdamW update and the gradient
 * norm's sum of squares over a list of tensors, one launch per MOE_MT_TENSORS tensors. The
 * tensors' pointers and sizes travel in the kernel's parameters (no table to upload, nothing
 * to wait for); block b takes chunk b of the list, MOE_MT_CHUNK elements of one tensor, found
 * by a binary search over the tensors' first blocks. Memory-bound: AdamW moves 4+4+4+4 bytes
 * in and 4+4+4+2 out per element, the sum of squares reads 4.
 *
 * AdamW's arithmetic is the host twin's operation for operation (host_experts.c): the moments
 * in fp32, the bias corrections, the step and the decay in fp64, each rounded as written
 * (the _rn intrinsics: no contraction into FMAs), so masters and moments are bitwise equal.
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_optimizer_passes: AdamW bitwise the host twin's, the sum of squares)
 * Time: MODELS=small bash scripts/gpu-machine/trainer.sh build bench (the optimizer's
 *       bandwidth in each model's line)
 */
#include <cuda_bf16.h>

#include "kernels.h"

#define THREADS 256 /* a default, not measured against others (kernels/tuning.h) */
typedef __nv_bfloat16 bf16;

static_assert(MOE_MT_CHUNK % (4 * THREADS) == 0, "a chunk is whole float4 rows of the block");

/* the tensors of one launch: [first[t], first[t+1]) are tensor t's blocks */
typedef struct adamw_group {
    float *master[MOE_MT_TENSORS], *m[MOE_MT_TENSORS], *v[MOE_MT_TENSORS];
    bf16 *param[MOE_MT_TENSORS];
    const float *grad[MOE_MT_TENSORS];
    int64_t n[MOE_MT_TENSORS];
    int32_t first[MOE_MT_TENSORS + 1];
    unsigned long long vec; /* bit t: tensor t's pointers allow 16-byte (param 8-byte) access */
    int32_t count;
} adamw_group_t;

typedef struct sq_group {
    const float *x[MOE_MT_TENSORS];
    int64_t n[MOE_MT_TENSORS];
    int32_t first[MOE_MT_TENSORS + 1];
    unsigned long long vec;
    int32_t count;
} sq_group_t;

typedef struct adamw_scalars {
    float lr, b1, b2, omb1, omb2, eps, wd, gscale; /* omb: 1 - beta, rounded in fp32 */
    double bc1, bc2;                               /* 1 - beta^step */
} adamw_scalars_t;

/* The tensor whose blocks hold block b: the last t with first[t] <= b (empty tensors have
 * no blocks, so the search passes over them). */
static __device__ int tensor_of(const int32_t *first, int count, int32_t b)
{
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static __device__ __forceinline__ float adamw_one(float grad, float *m, float *v, float master,
                                                  const adamw_scalars_t &a)
{
    float g = __fmul_rn(grad, a.gscale);
    float mi = __fadd_rn(__fmul_rn(a.b1, *m), __fmul_rn(a.omb1, g));
    float vi = __fadd_rn(__fmul_rn(a.b2, *v), __fmul_rn(__fmul_rn(a.omb2, g), g));
    *m = mi;
    *v = vi;
    double mhat = __ddiv_rn((double)mi, a.bc1), vhat = __ddiv_rn((double)vi, a.bc2);
    double p = (double)master;
    double step = __dadd_rn(__ddiv_rn(mhat, __dadd_rn(__dsqrt_rn(vhat), (double)a.eps)),
                            __dmul_rn((double)a.wd, p));
    return __double2float_rn(__dadd_rn(p, -__dmul_rn((double)a.lr, step)));
}

__global__ void __launch_bounds__(THREADS)
    adamw_multi(const adamw_group_t g, const adamw_scalars_t a)
{
    int t = tensor_of(g.first, g.count, (int32_t)blockIdx.x);
    int64_t n = g.n[t], lo = (int64_t)(blockIdx.x - g.first[t]) * MOE_MT_CHUNK;
    int64_t hi = lo + MOE_MT_CHUNK < n ? lo + MOE_MT_CHUNK : n;
    float *__restrict__ master = g.master[t], *__restrict__ m = g.m[t], *__restrict__ v = g.v[t];
    bf16 *__restrict__ param = g.param[t];
    const float *__restrict__ grad = g.grad[t];
    int64_t vec_end = (g.vec >> t) & 1 ? lo + (hi - lo) / 4 * 4 : lo;
    for (int64_t i = lo + 4 * (int64_t)threadIdx.x; i < vec_end; i += 4 * THREADS) {
        float4 gr = *(const float4 *)(grad + i), ms = *(const float4 *)(master + i);
        float4 mm = *(const float4 *)(m + i), vv = *(const float4 *)(v + i);
        ms.x = adamw_one(gr.x, &mm.x, &vv.x, ms.x, a);
        ms.y = adamw_one(gr.y, &mm.y, &vv.y, ms.y, a);
        ms.z = adamw_one(gr.z, &mm.z, &vv.z, ms.z, a);
        ms.w = adamw_one(gr.w, &mm.w, &vv.w, ms.w, a);
        *(float4 *)(master + i) = ms;
        *(float4 *)(m + i) = mm;
        *(float4 *)(v + i) = vv;
        __nv_bfloat162 p01 = __floats2bfloat162_rn(ms.x, ms.y),
                       p23 = __floats2bfloat162_rn(ms.z, ms.w);
        uint2 packed = {*(unsigned *)&p01, *(unsigned *)&p23};
        *(uint2 *)(param + i) = packed;
    }
    for (int64_t i = vec_end + threadIdx.x; i < hi; i += THREADS) {
        float p = adamw_one(grad[i], &m[i], &v[i], master[i], a);
        master[i] = p;
        param[i] = __float2bfloat16_rn(p);
    }
}

/* The sum over the block's THREADS threads in a fixed tree; thread 0 gets it. */
static __device__ double block_tree_sum(double v)
{
    __shared__ double part[THREADS];
    part[threadIdx.x] = v;
    __syncthreads();
    for (unsigned w = THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    return part[0];
}

__global__ void __launch_bounds__(THREADS) sum_squares_multi(const sq_group_t g, double *partial)
{
    int t = tensor_of(g.first, g.count, (int32_t)blockIdx.x);
    int64_t n = g.n[t], lo = (int64_t)(blockIdx.x - g.first[t]) * MOE_MT_CHUNK;
    int64_t hi = lo + MOE_MT_CHUNK < n ? lo + MOE_MT_CHUNK : n;
    const float *__restrict__ x = g.x[t];
    int64_t vec_end = (g.vec >> t) & 1 ? lo + (hi - lo) / 4 * 4 : lo;
    double s = 0;
    for (int64_t i = lo + 4 * (int64_t)threadIdx.x; i < vec_end; i += 4 * THREADS) {
        float4 q = *(const float4 *)(x + i);
        s += (double)q.x * q.x + (double)q.y * q.y + (double)q.z * q.z + (double)q.w * q.w;
    }
    for (int64_t i = vec_end + threadIdx.x; i < hi; i += THREADS) s += (double)x[i] * x[i];
    s = block_tree_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(THREADS)
    sum_partials(const double *partial, int64_t count, double *out)
{
    double s = 0;
    for (int64_t b = threadIdx.x; b < count; b += THREADS) s += partial[b];
    s = block_tree_sum(s);
    if (threadIdx.x == 0) out[0] = s;
}

static int64_t chunks_of(int64_t n) { return n > 0 ? (n + MOE_MT_CHUNK - 1) / MOE_MT_CHUNK : 0; }

static bool aligned(const void *p, uintptr_t to) { return ((uintptr_t)p & (to - 1)) == 0; }

extern "C" int64_t moe_cuda_mt_chunks(const int64_t *n, int32_t count)
{
    int64_t total = 0;
    for (int32_t i = 0; i < count; i++) total += chunks_of(n[i]);
    return total;
}

/* The launches of a multi-tensor pass. Consecutive tensors fill a group (the kernel's
 * parameters: adamw_group_t or sq_group_t, which share n, first, vec and count) until it holds
 * MOE_MT_TENSORS of them or the next would take its blocks past a grid; put(g, c, i) stores
 * tensor i's pointers in slot c and says whether they allow vector access, launch(g, blocks)
 * enqueues the group's kernel. */
template <typename Group, typename Size, typename Put, typename Launch>
static cudaError_t launch_groups(int32_t count, Size size, Put put, Launch launch)
{
    for (int32_t at = 0; at < count;) {
        Group g;
        g.count = 0;
        g.vec = 0;
        int64_t blocks = 0;
        for (; at < count && g.count < MOE_MT_TENSORS &&
               blocks + chunks_of(size(at)) < ((int64_t)1 << 31);
             at++) {
            int c = g.count++;
            g.n[c] = size(at);
            g.first[c] = (int32_t)blocks;
            if (put(g, c, at)) g.vec |= 1ull << c;
            blocks += chunks_of(g.n[c]);
        }
        g.first[g.count] = (int32_t)blocks;
        if (blocks > 0) launch(g, blocks);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

extern "C" cudaError_t moe_cuda_adamw_multi(const moe_cuda_adamw_tensor_t *t, int32_t count,
                                            float lr, float beta1, float beta2, float eps,
                                            float weight_decay, float grad_scale, double bc1,
                                            double bc2, cudaStream_t stream)
{
    adamw_scalars_t a = {lr,  beta1,        beta2,      1.0f - beta1, 1.0f - beta2,
                         eps, weight_decay, grad_scale, bc1,          bc2};
    return launch_groups<adamw_group_t>(
        count, [&](int32_t i) { return t[i].n; },
        [&](adamw_group_t &g, int c, int32_t i) {
            const moe_cuda_adamw_tensor_t *p = &t[i];
            g.master[c] = p->master;
            g.m[c] = p->m;
            g.v[c] = p->v;
            g.param[c] = (bf16 *)p->param;
            g.grad[c] = p->grad;
            return aligned(p->master, 16) && aligned(p->m, 16) && aligned(p->v, 16) &&
                   aligned(p->grad, 16) && aligned(p->param, 8);
        },
        [&](const adamw_group_t &g, int64_t blocks) {
            adamw_multi<<<(unsigned)blocks, THREADS, 0, stream>>>(g, a);
        });
}

extern "C" cudaError_t moe_cuda_sum_squares_multi(const float *const *x, const int64_t *n,
                                                  int32_t count, double *partial, double *out,
                                                  cudaStream_t stream)
{
    int64_t done = 0; /* partials written so far: the launches fill consecutive ranges */
    cudaError_t e = launch_groups<sq_group_t>(
        count, [&](int32_t i) { return n[i]; },
        [&](sq_group_t &g, int c, int32_t i) {
            g.x[c] = x[i];
            return aligned(x[i], 16);
        },
        [&](const sq_group_t &g, int64_t blocks) {
            sum_squares_multi<<<(unsigned)blocks, THREADS, 0, stream>>>(g, partial + done);
            done += blocks;
        });
    if (e != cudaSuccess) return e;
    sum_partials<<<1, THREADS, 0, stream>>>(partial, done, out);
    return cudaGetLastError();
}
