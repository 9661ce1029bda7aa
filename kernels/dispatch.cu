/*
 * Dispatch kernels: the plan (stable counting sort of (token, k) slots by expert with
 * capacity drop), the row gather into expert-contiguous order, the gather-based combine and
 * the combine-weight gradient.
 *
 * Shape legend: N tokens, K top-k, S = N*K slots (slot s = t*K + k), E experts, H hidden,
 * R kept rows. Rows of expert e are [offset_e, offset_e + kept_e) in slot order.
 *
 * The plan runs in three passes over fixed chunks of CHUNK slots, so the result is the
 * host's exactly (integer counting, slot order inside each expert):
 *   1. plan_count: per-chunk expert histograms
 *   2. plan_scan:  per expert, exclusive scan over chunks -> each chunk's first rank; totals,
 *                  kept = min(total, capacity - first)
 *   3. plan_place: one warp per chunk walks its slots in order, 32 at a time (match_any
 *                  ranks equal experts inside the 32), and writes row_of_slot / slot_of_row.
 * pad_plan re-lays a plan with a fixed number of rows per expert (filler rows: slot -1).
 * Row gathers and combines move bf16 rows with 16-byte accesses when H % 8 == 0 and sum in
 * fp32 in a fixed order (no atomics).
 *
 * Test: ctest --test-dir build -R test_cuda_ops --output-on-failure
 *       (test_plan, test_rows)
 * Time: build/bench/bench_moe layer (within the layer's step; `bench_moe profile` for
 *       its kernels alone)
 */
#include <cuda_bf16.h>
#include <limits.h>

#include "bf16_vec.cuh"
#include "grid.cuh"
#include "kernels.h"

/* Defaults, not measured against others (kernels/tuning.h): slots a plan chunk (one warp
 * walks it in plan_place; any size gives the same plan) and plan_place's warps a block. */
#define CHUNK 1024
#define PLACE_WARPS 4
#define MAX_PLAN_E 2048 /* plan_place keeps (PLACE_WARPS + 2) x E ints in shared memory */
static_assert(sizeof(int32_t) * MAX_PLAN_E * (PLACE_WARPS + 2) <= 48 * 1024,
              "plan_place's shared memory must fit the default 48 KiB");

/* ---- plan ---------------------------------------------------------------------------------- */

__global__ void plan_count(const int32_t *__restrict__ idx, int64_t slots, int e,
                           int32_t *__restrict__ hist)
{
    extern __shared__ int32_t s_hist[];
    for (int j = threadIdx.x; j < e; j += blockDim.x) s_hist[j] = 0;
    __syncthreads();
    int64_t s0 = (int64_t)blockIdx.x * CHUNK;
    for (int i = threadIdx.x; i < CHUNK && s0 + i < slots; i += blockDim.x)
        atomicAdd(&s_hist[idx[s0 + i]], 1);
    __syncthreads();
    for (int j = threadIdx.x; j < e; j += blockDim.x) hist[(int64_t)blockIdx.x * e + j] = s_hist[j];
}

/* Block j scans expert j's counts over the chunks in place: hist[c][j] becomes the rank of
 * the chunk's first slot of expert j. */
__global__ void plan_scan(int32_t *__restrict__ hist, int nchunks, int e, int64_t capacity,
                          const int32_t *__restrict__ first, int32_t *__restrict__ kept)
{
    __shared__ int32_t s_sum[256];
    int j = blockIdx.x;
    int per = (nchunks + blockDim.x - 1) / blockDim.x;
    int c0 = threadIdx.x * per, c1 = min(c0 + per, nchunks);
    int32_t sum = 0;
    for (int c = c0; c < c1; c++) sum += hist[(int64_t)c * e + j];
    s_sum[threadIdx.x] = sum;
    __syncthreads();
    /* Hillis-Steele inclusive scan over the block's thread sums */
    for (int o = 1; o < blockDim.x; o <<= 1) {
        int32_t v = threadIdx.x >= o ? s_sum[threadIdx.x - o] : 0;
        __syncthreads();
        s_sum[threadIdx.x] += v;
        __syncthreads();
    }
    int32_t run = s_sum[threadIdx.x] - sum;
    for (int c = c0; c < c1; c++) {
        int32_t h = hist[(int64_t)c * e + j];
        hist[(int64_t)c * e + j] = run;
        run += h;
    }
    if (threadIdx.x == blockDim.x - 1) {
        int64_t total = s_sum[threadIdx.x], room = capacity - (first ? first[j] : 0);
        kept[j] = (int32_t)(capacity < 0 || total < room ? total : room);
    }
}

/* Expert row offsets (exclusive scan of kept, experts in row order) and kept into shared
 * memory, by one warp, 32 experts a step; the block synchronises before reading them. */
static __device__ void expert_offsets(const int32_t *__restrict__ kept,
                                      const int32_t *__restrict__ row_order, int e, int32_t *s_off,
                                      int32_t *s_kept)
{
    int lane = threadIdx.x % 32;
    int32_t carry = 0;
    for (int g0 = 0; g0 < e; g0 += 32) {
        int g = g0 + lane, j = g < e && row_order ? row_order[g] : g;
        int32_t v = g < e ? kept[j] : 0, incl = v;
        for (int o = 1; o < 32; o <<= 1) {
            int32_t u = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += u;
        }
        if (g < e) {
            s_off[j] = carry + incl - v;
            s_kept[j] = v;
        }
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
}

__global__ void plan_place(const int32_t *__restrict__ idx, int64_t slots, int nchunks, int e,
                           const int32_t *__restrict__ base, const int32_t *__restrict__ kept,
                           const int32_t *__restrict__ row_order, int32_t *__restrict__ row_of_slot,
                           int32_t *__restrict__ slot_of_row)
{
    extern __shared__ int32_t smem[];
    int32_t *s_off = smem, *s_kept = smem + e, *s_rank = smem + 2 * e;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0) expert_offsets(kept, row_order, e, s_off, s_kept);
    int c = blockIdx.x * PLACE_WARPS + warp;
    int32_t *rank = s_rank + warp * e;
    if (c < nchunks)
        for (int j = lane; j < e; j += 32) rank[j] = base[(int64_t)c * e + j];
    __syncthreads();
    if (c >= nchunks) return;
    int64_t s0 = (int64_t)c * CHUNK, s1 = min(s0 + CHUNK, slots);
    for (int64_t s = s0; s < s1; s += 32) {
        int64_t my = s + lane;
        bool active = my < s1;
        int ex = active ? idx[my] : -1 - lane; /* inactive lanes match nobody */
        unsigned peers = __match_any_sync(0xffffffffu, ex);
        if (active) {
            int32_t r = rank[ex] + __popc(peers & ((1u << lane) - 1u));
            int32_t row = r < s_kept[ex] ? s_off[ex] + r : -1;
            row_of_slot[my] = row;
            if (row >= 0) slot_of_row[row] = (int32_t)my;
        }
        __syncwarp();
        if (active && lane == __ffs(peers) - 1) rank[ex] += __popc(peers);
        __syncwarp();
    }
}

extern "C" int64_t moe_cuda_plan_scratch(int64_t n, int32_t k, int32_t e)
{
    int64_t chunks = (n * k + CHUNK - 1) / CHUNK;
    return chunks * e;
}

extern "C" cudaError_t moe_cuda_plan(const int32_t *topk_idx, int64_t n, int32_t k, int32_t e,
                                     int64_t capacity, const int32_t *first,
                                     const int32_t *row_order, int32_t *row_of_slot,
                                     int32_t *slot_of_row, int32_t *kept, int32_t *scratch,
                                     cudaStream_t stream)
{
    if (e > MAX_PLAN_E) return cudaErrorInvalidValue;
    int64_t slots = n * k;
    int nchunks = (int)((slots + CHUNK - 1) / CHUNK);
    if (nchunks == 0) return cudaMemsetAsync(kept, 0, sizeof(int32_t) * (size_t)e, stream);
    plan_count<<<nchunks, 256, sizeof(int32_t) * (size_t)e, stream>>>(topk_idx, slots, e, scratch);
    plan_scan<<<e, 256, 0, stream>>>(scratch, nchunks, e, capacity, first, kept);
    size_t smem = sizeof(int32_t) * (size_t)e * (2 + PLACE_WARPS);
    plan_place<<<(nchunks + PLACE_WARPS - 1) / PLACE_WARPS, PLACE_WARPS * 32, smem, stream>>>(
        topk_idx, slots, nchunks, e, scratch, kept, row_order, row_of_slot, slot_of_row);
    return cudaGetLastError();
}

/* The plan re-laid with `stride` rows per expert (moe_pad_plan_t): slots' rows move to their
 * expert's block, the padded slot_of_row gets -1 past each expert's kept rows. */
__global__ void pad_plan_kernel(const int32_t *__restrict__ idx, int64_t slots, int e,
                                const int32_t *__restrict__ kept, int64_t stride,
                                const int32_t *__restrict__ slot_of_row,
                                int32_t *__restrict__ row_of_slot, int32_t *__restrict__ padded)
{
    extern __shared__ int32_t smem[];
    int32_t *s_off = smem, *s_kept = smem + e;
    if (threadIdx.x < 32) expert_offsets(kept, NULL, e, s_off, s_kept);
    __syncthreads();
    int64_t total = (int64_t)e * stride, n = slots > total ? slots : total;
    GRID_STRIDE(i, n)
    {
        if (i < slots) {
            int32_t r = row_of_slot[i];
            if (r >= 0) {
                int ex = idx[i];
                row_of_slot[i] = (int32_t)(ex * stride + (r - s_off[ex]));
            }
        }
        if (i < total) {
            int ex = (int)(i / stride);
            int64_t j = i - ex * stride;
            padded[i] = j < s_kept[ex] ? slot_of_row[s_off[ex] + j] : -1;
        }
    }
}

extern "C" cudaError_t moe_cuda_pad_plan(const int32_t *topk_idx, int64_t n, int32_t k, int32_t e,
                                         const int32_t *kept, int64_t stride,
                                         const int32_t *slot_of_row, int32_t *row_of_slot,
                                         int32_t *padded_slot_of_row, cudaStream_t stream)
{
    if (e > MAX_PLAN_E || stride <= 0) return cudaErrorInvalidValue;
    int64_t slots = n * k, total = (int64_t)e * stride, work = slots > total ? slots : total;
    int64_t blocks = (work + 255) / 256;
    pad_plan_kernel<<<(unsigned)(blocks < 1024 ? blocks : 1024), 256,
                      2 * sizeof(int32_t) * (size_t)e, stream>>>(
        topk_idx, slots, e, kept, stride, slot_of_row, row_of_slot, padded_slot_of_row);
    return cudaGetLastError();
}

/* ---- rows ----------------------------------------------------------------------------------- */

template <int VEC>
__global__ void gather_rows_kernel(__nv_bfloat16 *__restrict__ dst,
                                   const __nv_bfloat16 *__restrict__ src,
                                   const int32_t *__restrict__ slot_of_row, int k,
                                   const float *__restrict__ scale, int64_t h)
{
    int64_t r = blockIdx.x;
    int32_t slot = slot_of_row[r];
    bool pad = slot < 0; /* a padded layout's filler row: zeros */
    const __nv_bfloat16 *in = src + (int64_t)(pad ? 0 : slot / k) * h;
    __nv_bfloat16 *out = dst + r * h;
    float c = pad ? 0.0f : scale ? scale[slot] : 1.0f;
    for (int64_t i = (int64_t)threadIdx.x * VEC; i < h; i += (int64_t)blockDim.x * VEC) {
        float v[VEC] = {};
        if (!pad) load_vec<VEC>(in + i, v);
#pragma unroll
        for (int j = 0; j < VEC; j++) v[j] *= c;
        store_vec<VEC>(out + i, v);
    }
}

template <int VEC>
__global__ void combine_kernel(__nv_bfloat16 *__restrict__ dst,
                               const __nv_bfloat16 *__restrict__ src,
                               const int32_t *__restrict__ row_of_slot, const float *__restrict__ w,
                               int k, int64_t h, bool accumulate)
{
    int64_t t = blockIdx.x;
    for (int64_t i = (int64_t)threadIdx.x * VEC; i < h; i += (int64_t)blockDim.x * VEC) {
        float acc[VEC] = {};
        if (accumulate) load_vec<VEC>(dst + t * h + i, acc);
        for (int j = 0; j < k; j++) {
            int32_t row = row_of_slot[t * k + j];
            if (row < 0) continue;
            float c = w ? w[t * k + j] : 1.0f, v[VEC];
            load_vec<VEC>(src + (int64_t)row * h + i, v);
#pragma unroll
            for (int q = 0; q < VEC; q++) acc[q] += c * v[q];
        }
        store_vec<VEC>(dst + t * h + i, acc);
    }
}

/* Block per token; warp j takes slots j, j+8, ...; fixed-order warp reduction. */
template <int VEC>
__global__ void
combine_weight_grad_kernel(float *__restrict__ dw, const __nv_bfloat16 *__restrict__ dy,
                           const __nv_bfloat16 *__restrict__ rows,
                           const int32_t *__restrict__ row_of_slot, int k, int64_t h)
{
    int64_t t = blockIdx.x;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int j = warp; j < k; j += warps) {
        int32_t row = row_of_slot[t * k + j];
        float acc = 0;
        if (row >= 0)
            for (int64_t i = (int64_t)lane * VEC; i < h; i += 32 * VEC) {
                float a[VEC], b[VEC];
                load_vec<VEC>(dy + t * h + i, a);
                load_vec<VEC>(rows + (int64_t)row * h + i, b);
#pragma unroll
                for (int q = 0; q < VEC; q++) acc += a[q] * b[q];
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) dw[t * k + j] = acc;
    }
}

static unsigned row_threads(int64_t h, int vec)
{
    int64_t t = (h / vec + 31) / 32 * 32;
    return (unsigned)(t < 32 ? 32 : t > 256 ? 256 : t);
}

extern "C" cudaError_t moe_cuda_gather_rows(void *dst, const void *src, const int32_t *slot_of_row,
                                            int32_t k, const float *scale, int64_t rows, int64_t h,
                                            cudaStream_t stream)
{
    if (rows <= 0) return cudaSuccess;
    if (h % 8 == 0)
        gather_rows_kernel<8><<<(unsigned)rows, row_threads(h, 8), 0, stream>>>(
            (__nv_bfloat16 *)dst, (const __nv_bfloat16 *)src, slot_of_row, k, scale, h);
    else
        gather_rows_kernel<1><<<(unsigned)rows, row_threads(h, 1), 0, stream>>>(
            (__nv_bfloat16 *)dst, (const __nv_bfloat16 *)src, slot_of_row, k, scale, h);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_combine(void *dst, const void *src, const int32_t *row_of_slot,
                                        const float *w, int64_t n, int32_t k, int64_t h,
                                        bool accumulate, cudaStream_t stream)
{
    if (n <= 0) return cudaSuccess;
    if (h % 8 == 0)
        combine_kernel<8><<<(unsigned)n, row_threads(h, 8), 0, stream>>>(
            (__nv_bfloat16 *)dst, (const __nv_bfloat16 *)src, row_of_slot, w, k, h, accumulate);
    else
        combine_kernel<1><<<(unsigned)n, row_threads(h, 1), 0, stream>>>(
            (__nv_bfloat16 *)dst, (const __nv_bfloat16 *)src, row_of_slot, w, k, h, accumulate);
    return cudaGetLastError();
}

extern "C" cudaError_t moe_cuda_combine_weight_grad(float *dw, const void *dy, const void *rows,
                                                    const int32_t *row_of_slot, int64_t n,
                                                    int32_t k, int64_t h, cudaStream_t stream)
{
    if (n <= 0) return cudaSuccess;
    unsigned threads = (unsigned)(32 * (k < 8 ? k : 8));
    if (h % 8 == 0)
        combine_weight_grad_kernel<8><<<(unsigned)n, threads, 0, stream>>>(
            dw, (const __nv_bfloat16 *)dy, (const __nv_bfloat16 *)rows, row_of_slot, k, h);
    else
        combine_weight_grad_kernel<1><<<(unsigned)n, threads, 0, stream>>>(
            dw, (const __nv_bfloat16 *)dy, (const __nv_bfloat16 *)rows, row_of_slot, k, h);
    return cudaGetLastError();
}
