/*
 * Inline-PTX wrappers for the warp-level tensor-core path and thread-block clusters, for
 * kernels that build into every image (sm_90a and compute_90) and so cannot use sm90.cuh's
 * Hopper-only forms: cp.async copies global -> shared, ldmatrix and the bf16 mma.sync
 * m16n8k16 (sm_80 and later), and cluster ranks, barriers and distributed-shared-memory stores
 * (sm_90 and later). Used by the fused router (router_fused.cu).
 */
#ifndef MOE_KERNELS_PTX_CUH
#define MOE_KERNELS_PTX_CUH

#include <stdint.h>

namespace ptx
{

/* ---- cp.async ------------------------------------------------------------------------------- */

/* 16 bytes global -> shared, zero-filled when !full; L2 fetches the 256 aligned bytes around
 * them */
static __device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool full)
{
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(full ? 16 : 0));
}
static __device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> static __device__ __forceinline__ void cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* ---- ldmatrix and mma.sync ------------------------------------------------------------------ */

/* four 8x8 b16 matrices; .trans delivers them column-wise (the mma's B operand) */
template <bool TRANS> static __device__ __forceinline__ void ldsm(uint32_t *r, uint32_t addr)
{
    if constexpr (!TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
}

/* c += a . b for one m16n8k16 step, bf16 in, f32 accumulate */
static __device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ---- thread-block clusters ------------------------------------------------------------------ */

/* This block's rank, the two halves of a barrier of every thread of the cluster
 * (shared-memory accesses before a releasing arrive are ordered with those after the wait),
 * and a float4 store into block `rank`'s shared memory at the offset of `local` in this one. */
static __device__ __forceinline__ unsigned cluster_rank()
{
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

static __device__ __forceinline__ void cluster_arrive()
{
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

static __device__ __forceinline__ void cluster_arrive_relaxed()
{
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

static __device__ __forceinline__ void cluster_wait()
{
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

static __device__ __forceinline__ void st_cluster(float *local, unsigned rank, float4 v)
{
    uint32_t remote, a = (uint32_t)__cvta_generic_to_shared(local);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "f"(v.x),
                 "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
}

} /* namespace ptx */

#endif /* MOE_KERNELS_PTX_CUH */
