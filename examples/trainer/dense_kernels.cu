/*
 * The CUDA model's own kernels (dense_kernels.h). Row kernels give a row to a block (RMSNorm:
 * H up to a few thousand) or to a warp (cross-entropy rows of V = 256);
 * element-wise ones are grid-stride loops. fp32 arithmetic throughout, bf16 in and out.
 */
#include <cuda_bf16.h>

#include "dense_kernels.h"

typedef __nv_bfloat16 bf16;

#define THREADS 256
#define WARPS (THREADS / 32)

static unsigned grid_for(int64_t n)
{
    int64_t blocks = (n + THREADS - 1) / THREADS;
    return (unsigned)(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

#define GRID_STRIDE(i, n)                                                                          \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                      \
         i += (int64_t)gridDim.x * blockDim.x)

static __device__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* The sum over the block's THREADS threads, returned to every thread (fixed order). */
static __device__ float block_sum(float v)
{
    __shared__ float part[WARPS];
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0;
    for (int w = 0; w < WARPS; w++) total += part[w];
    __syncthreads(); /* part is reused by the next call */
    return total;
}

/* ---- embedding ------------------------------------------------------------------------------ */

__global__ void embed_forward(const uint8_t *tok, const bf16 *embed, const bf16 *pos, bf16 *out,
                              int64_t N, int64_t T, int64_t H)
{
    GRID_STRIDE(k, N * H)
    {
        int64_t t = k / H, i = k % H;
        out[k] = __float2bfloat16_rn(__bfloat162float(embed[(int64_t)tok[t] * H + i]) +
                                     __bfloat162float(pos[(t % T) * H + i]));
    }
}

/* grid (V, H / THREADS): token v's rows, in row order */
__global__ void embed_grad(const int32_t *order, const int32_t *offsets, const bf16 *dx,
                           float *dembed, int64_t H)
{
    int64_t v = blockIdx.x, i = (int64_t)blockIdx.y * THREADS + threadIdx.x;
    if (i >= H) return;
    float acc = 0;
    for (int32_t j = offsets[v]; j < offsets[v + 1]; j++)
        acc += __bfloat162float(dx[(int64_t)order[j] * H + i]);
    dembed[v * H + i] += acc;
}

/* grid (T, H / THREADS): position p's rows s*T + p */
__global__ void pos_grad(const bf16 *dx, float *dpos, int64_t N, int64_t T, int64_t H)
{
    int64_t p = blockIdx.x, i = (int64_t)blockIdx.y * THREADS + threadIdx.x;
    if (i >= H) return;
    float acc = 0;
    for (int64_t row = p; row < N; row += T) acc += __bfloat162float(dx[row * H + i]);
    dpos[p * H + i] += acc;
}

extern "C" cudaError_t dk_embed_forward(const uint8_t *tok, const void *embed, const void *pos,
                                        void *out, int64_t N, int64_t T, int64_t H,
                                        cudaStream_t stream)
{
    embed_forward<<<grid_for(N * H), THREADS, 0, stream>>>(tok, (const bf16 *)embed,
                                                           (const bf16 *)pos, (bf16 *)out, N, T, H);
    return cudaGetLastError();
}

extern "C" cudaError_t dk_embed_backward(const int32_t *order, const int32_t *offsets,
                                         const void *dx, float *dembed, float *dpos, int64_t N,
                                         int64_t T, int64_t H, int64_t V, cudaStream_t stream)
{
    unsigned cols = (unsigned)((H + THREADS - 1) / THREADS);
    embed_grad<<<dim3((unsigned)V, cols), THREADS, 0, stream>>>(order, offsets, (const bf16 *)dx,
                                                                dembed, H);
    pos_grad<<<dim3((unsigned)T, cols), THREADS, 0, stream>>>((const bf16 *)dx, dpos, N, T, H);
    return cudaGetLastError();
}

/* ---- RMSNorm -------------------------------------------------------------------------------- */

__global__ void rmsnorm_forward(const bf16 *x, const bf16 *g, bf16 *y, float *r, int64_t H,
                                float eps)
{
    const bf16 *xt = x + (int64_t)blockIdx.x * H;
    float ss = 0;
    for (int64_t i = threadIdx.x; i < H; i += THREADS) {
        float v = __bfloat162float(xt[i]);
        ss += v * v;
    }
    float rt = rsqrtf(block_sum(ss) / (float)H + eps);
    if (threadIdx.x == 0) r[blockIdx.x] = rt;
    bf16 *yt = y + (int64_t)blockIdx.x * H;
    for (int64_t i = threadIdx.x; i < H; i += THREADS)
        yt[i] = __float2bfloat16_rn(__bfloat162float(xt[i]) * rt * __bfloat162float(g[i]));
}

__global__ void rmsnorm_backward(const bf16 *x, const bf16 *g, const float *r, const bf16 *dy,
                                 const bf16 *res, bf16 *dx, int64_t H)
{
    int64_t base = (int64_t)blockIdx.x * H;
    float rt = r[blockIdx.x], ux = 0;
    for (int64_t i = threadIdx.x; i < H; i += THREADS)
        ux += __bfloat162float(g[i]) * __bfloat162float(dy[base + i]) *
              __bfloat162float(x[base + i]);
    float c = block_sum(ux) / (float)H * rt * rt * rt;
    for (int64_t i = threadIdx.x; i < H; i += THREADS) {
        float d = rt * __bfloat162float(g[i]) * __bfloat162float(dy[base + i]) -
                  __bfloat162float(x[base + i]) * c;
        if (res) d += __bfloat162float(res[base + i]);
        dx[base + i] = __float2bfloat16_rn(d);
    }
}

/* grid (H / THREADS, DK_GAIN_CHUNKS): partial[chunk, i] over the chunk's rows */
__global__ void gain_partial(const bf16 *x, const float *r, const bf16 *dy, float *partial,
                             int64_t N, int64_t H)
{
    int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (i >= H) return;
    int64_t per = (N + DK_GAIN_CHUNKS - 1) / DK_GAIN_CHUNKS;
    int64_t lo = blockIdx.y * per, hi = lo + per < N ? lo + per : N;
    float acc = 0;
    for (int64_t t = lo; t < hi; t++)
        acc += __bfloat162float(dy[t * H + i]) * __bfloat162float(x[t * H + i]) * r[t];
    partial[blockIdx.y * H + i] = acc;
}

__global__ void gain_sum(const float *partial, float *dg, int64_t H)
{
    int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (i >= H) return;
    float acc = 0;
    for (int c = 0; c < DK_GAIN_CHUNKS; c++) acc += partial[c * H + i];
    dg[i] += acc;
}

extern "C" cudaError_t dk_rmsnorm_forward(const void *x, const void *g, void *y, float *r,
                                          int64_t N, int64_t H, float eps, cudaStream_t stream)
{
    rmsnorm_forward<<<(unsigned)N, THREADS, 0, stream>>>((const bf16 *)x, (const bf16 *)g,
                                                         (bf16 *)y, r, H, eps);
    return cudaGetLastError();
}

extern "C" cudaError_t dk_rmsnorm_backward(const void *x, const void *g, const float *r,
                                           const void *dy, const void *res, void *dx, int64_t N,
                                           int64_t H, cudaStream_t stream)
{
    rmsnorm_backward<<<(unsigned)N, THREADS, 0, stream>>>(
        (const bf16 *)x, (const bf16 *)g, r, (const bf16 *)dy, (const bf16 *)res, (bf16 *)dx, H);
    return cudaGetLastError();
}

extern "C" cudaError_t dk_rmsnorm_gain_grad(const void *x, const float *r, const void *dy,
                                            float *partial, float *dg, int64_t N, int64_t H,
                                            cudaStream_t stream)
{
    unsigned cols = (unsigned)((H + THREADS - 1) / THREADS);
    gain_partial<<<dim3(cols, DK_GAIN_CHUNKS), THREADS, 0, stream>>>(
        (const bf16 *)x, r, (const bf16 *)dy, partial, N, H);
    gain_sum<<<cols, THREADS, 0, stream>>>(partial, dg, H);
    return cudaGetLastError();
}

/* ---- element-wise ---------------------------------------------------------------------------- */

__global__ void add(const bf16 *a, const bf16 *b, bf16 *out, int64_t n)
{
    GRID_STRIDE(i, n) out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

extern "C" cudaError_t dk_add(const void *a, const void *b, void *out, int64_t n,
                              cudaStream_t stream)
{
    add<<<grid_for(n), THREADS, 0, stream>>>((const bf16 *)a, (const bf16 *)b, (bf16 *)out, n);
    return cudaGetLastError();
}

/* ---- cross-entropy (a warp per row) --------------------------------------------------------- */

__global__ void cross_entropy(const float *logits, const uint8_t *y, float *loss, bf16 *dlogits,
                              float w, int64_t N, int64_t V)
{
    int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= N) return;
    const float *l = logits + row * V;
    float mx = -INFINITY;
    for (int64_t v = lane; v < V; v += 32) mx = fmaxf(mx, l[v]);
    mx = warp_max(mx);
    float sum = 0;
    for (int64_t v = lane; v < V; v += 32) sum += expf(l[v] - mx);
    sum = warp_sum(sum);
    int64_t target = y[row];
    if (lane == 0) loss[row] = logf(sum) + mx - l[target];
    if (!dlogits) return;
    for (int64_t v = lane; v < V; v += 32)
        dlogits[row * V + v] = __float2bfloat16_rn(
            w * (expf(l[v] - mx) / sum - (v == target ? 1.0f : 0.0f)));
}

extern "C" cudaError_t dk_cross_entropy(const float *logits, const uint8_t *y, float *loss,
                                        void *dlogits, float w, int64_t N, int64_t V,
                                        cudaStream_t stream)
{
    unsigned blocks = (unsigned)((N + WARPS - 1) / WARPS);
    cross_entropy<<<blocks, THREADS, 0, stream>>>(logits, y, loss, (bf16 *)dlogits, w, N, V);
    return cudaGetLastError();
}
