// Merging attention partials by log-sum-exp (flash-decoding, Dao et al.): partial s of a
// (row, head) holds acc_s[D] (unnormalised sum of p * v), m_s (its running max score) and
// l_s (its sum of e^{score - m_s}); the merged row is sum_s acc_s e^{m_s - M} / sum_s l_s
// e^{m_s - M} with M the largest m_s. Partials with m_s = -inf (no visible cell) drop out.
// (Included once per source by cuda_kernels.read_source.)
//
// lse_merge_window: a block of LSE_THREADS threads merges a window of 256 consecutive elements
// of one row's [n_head * D] output (heads e / D, dims e % D; the window may span several heads
// when D < 256, or part of one when D = 512). A decode step's merge is latency bound: a thread
// per element walking every split in turn took 31 us at 128 splits on the H200 (gemma-3-270m at
// depth 32,768), longer than the attention it merged. Here (1) one warp per head of the window
// reduces (M, L) over the splits, 32 splits per load, and (2) LSE_GROUPS groups of 256 threads
// each sum every LSE_GROUPS-th split of the values, summed in a fixed order at the end (the
// result is deterministic, and the same for every kernel that merges through it).
// lse_merge_window<NR, true> (sm_90+) runs the LSE_GROUPS groups as the blocks of a thread-block
// cluster of LSE_GROUPS 256-thread blocks instead (CUDA Programming Guide, "Thread Block
// Clusters" / "Distributed Shared Memory"; PTX ISA mapa, st.shared::cluster, barrier.cluster):
// block z of the cluster sums the chain that group z sums in one block, the other blocks store
// their sums into block 0's shared memory, and block 0 adds them in the same order: the same
// bits. A 256-thread block fits on an SM beside a KV tier's 8-warp streaming block, where the
// 1,024-thread one waits for it to finish (CUDA_NOTES session 34), and the chains' loads spread
// over four SMs.

#define LSE_NEG_INF (-__int_as_float(0x7f800000))
#define LSE_GROUPS 4
#define LSE_THREADS (256 * LSE_GROUPS)

#ifndef FLT_MAX
#define FLT_MAX 3.402823466e+38f
#endif

// One run of partials of a (row, head): n of them, partial i's acc at acc[(first + i) * D], its
// (m, l) at ml[2 * (first + i)] (8-byte aligned).
struct LseRun {
    const float* __restrict__ acc;
    const float* __restrict__ ml;
    long long first;
    int n;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LSE_CLUSTER 1
// the cluster merges' shape: LSE_GROUPS blocks along z (their cluster ranks are blockIdx.z)
#define LSE_CLUSTER_DIMS __cluster_dims__(1, 1, LSE_GROUPS)
// the cluster barrier: every thread of every block of the cluster arrives, then waits for the
// rest (release / acquire: shared-memory stores before it, remote ones included, are visible
// after it). arrive.relaxed + wait alone: every block of the cluster has started (a block's
// shared memory may be written remotely only then).
#define LSE_CLUSTER_ARRIVE() asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory")
#define LSE_CLUSTER_WAIT() asm volatile("barrier.cluster.wait.aligned;" ::: "memory")
#define LSE_CLUSTER_SYNC() \
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory")
// v stored at shared address s of block rank of this block's cluster
__device__ __forceinline__ void lse_cluster_put(float* s, unsigned int rank, float v) {
    unsigned int a = (unsigned int)__cvta_generic_to_shared(s), r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(r), "f"(v) : "memory");
}
#else
#define LSE_CLUSTER 0
#endif

// The merged value of element e0 + threadIdx.x of a row of HD = n_head * D values, for threads
// 0..255 of the block (the others return 0): runs(h, k) gives run k < NR of head h (the runs
// of a head merge as one list of partials). Every thread of the LSE_THREADS-thread block calls
// it, once per kernel. Window elements at or past HD return 0. CL (LSE_CLUSTER only): every
// thread of each 256-thread block of an LSE_GROUPS-block cluster (LSE_CLUSTER_DIMS) calls it;
// block 0's threads get the values, the other blocks' 0.
template <int NR, bool CL = false, class Runs>
__device__ __forceinline__ float lse_merge_window(Runs runs, int HD, int D, int e0) {
    __shared__ float s_ml[256 / 32][2];  // (M, L) of the window's heads: at most 8 for D a multiple of 32 (merge_launch)
    __shared__ float s_a[LSE_GROUPS - 1][256];
    static_assert(!CL || LSE_CLUSTER, "lse_merge_window: clusters need sm_90+");
#if LSE_CLUSTER
    if (CL) LSE_CLUSTER_ARRIVE();  // this block has started (waited for before the remote stores)
#endif
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, i = threadIdx.x & 255;
    const int grp = CL ? (int)blockIdx.z : threadIdx.x >> 8;
    const int e1 = min(HD, e0 + 256), h0 = e0 / D, nh = (e1 - 1) / D - h0 + 1;
    if (warp < nh) {
        float M = LSE_NEG_INF, L = 0.f;
#pragma unroll
        for (int k = 0; k < NR; k++) {
            const LseRun u = runs(h0 + warp, k);
#pragma unroll 4
            for (int s = lane; s < u.n; s += 32) M = fmaxf(M, u.ml[2 * (u.first + s)]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        if (M != LSE_NEG_INF) {
#pragma unroll
            for (int k = 0; k < NR; k++) {
                const LseRun u = runs(h0 + warp, k);
#pragma unroll 4
                for (int s = lane; s < u.n; s += 32) {
                    const float2 v = *(const float2*)(u.ml + 2 * (u.first + s));  // (m, l): one load
                    if (v.x != LSE_NEG_INF) L += v.y * __expf(v.x - M);
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_down_sync(0xffffffffu, L, o);
        if (lane == 0) { s_ml[warp][0] = M; s_ml[warp][1] = L; }
    }
    __syncthreads();
    const int e = e0 + i, h = min(e, e1 - 1) / D, d = e % D;
    const float M = s_ml[h - h0][0];
    float A = 0.f;
    if (e < e1 && M != LSE_NEG_INF) {
#pragma unroll
        for (int k = 0; k < NR; k++) {
            const LseRun u = runs(h, k);
#pragma unroll 8
            for (int s = grp; s < u.n; s += LSE_GROUPS) {
                // exp(-inf) = 0 drops a partial with no visible cell, whose acc may be anything:
                // clamped (finite values unchanged) so that 0 * acc is 0, and so that the load
                // is used unconditionally (a load predicated on its m_s waits for that load first)
                const long long pi = u.first + s;
                const float ms = u.ml[2 * pi], as = fminf(fmaxf(u.acc[pi * D + d], -FLT_MAX), FLT_MAX);
                A += as * __expf(ms - M);
            }
        }
    }
#if LSE_CLUSTER
    if (CL) {  // the chains' sums into block 0's s_a
        LSE_CLUSTER_WAIT();
        if (grp > 0) lse_cluster_put(&s_a[grp - 1][i], 0u, A);
        LSE_CLUSTER_SYNC();
    } else
#endif
    {
        if (grp > 0) s_a[grp - 1][i] = A;
        __syncthreads();
    }
    if (grp > 0) return 0.f;
#pragma unroll
    for (int g = 0; g < LSE_GROUPS - 1; g++) A += s_a[g][i];
    const float L = s_ml[h - h0][1];
    return L > 0.f ? A / L : 0.f;
}

// A rotated V tier's merged output un-rotated (turbo.py: x = s * (H y) / sqrt(D), the sign flips
// s_i = -1 where bit i of signs[i / 32] is set; cuda_kv.tables_prefix's KV_SIGNS) once per head
// in the merge instead of in every split's block: v is lse_merge_window's value of element
// e0 + threadIdx.x (threads 0..255; the window's heads whole: D = 64, 128 or 256), the result
// that element's un-rotated value (0 for threads 256..). Stages h < 32 by shuffles, one sync,
// then each thread's column (its head's D / 32 values c + 32 k) in registers. Every thread of the
// block calls it. sw: the thread's sign word (lse_sign_word, loaded before the merge, so that its
// round trip is not on the merge's path).
__device__ __forceinline__ unsigned int lse_sign_word(int D, const unsigned int* __restrict__ signs) {
    return signs[((threadIdx.x & 255) & (D - 1)) >> 5];
}
__device__ __forceinline__ float lse_unrotate(float v, int D, unsigned int sw) {
    __shared__ float s_r[256];
    const int i = threadIdx.x & 255, lane = threadIdx.x & 31;
    const bool act = threadIdx.x < 256;
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, h);
        v = (lane & h) ? o - v : v + o;
    }
    if (act) s_r[i] = v;
    __syncthreads();
    if (!act) return 0.f;
    const int nk = D >> 5, d = i & (D - 1), c = d & 31, kk = d >> 5;
    const float* col = s_r + (i - d) + c;
    float x[8];
#pragma unroll
    for (int k = 0; k < 8; k++) x[k] = k < nk ? col[32 * k] : 0.f;
#pragma unroll
    for (int s = 1; s < 8; s <<= 1) {  // stage h = 32 s: pairs (k, k + s)
#pragma unroll
        for (int k = 0; k < 8; k++) {
            if ((k & s) == 0 && s < nk) {
                const float a = x[k], b = x[k + s];
                x[k] = a + b;
                x[k + s] = a - b;
            }
        }
    }
    float y = x[0];
#pragma unroll
    for (int k = 1; k < 8; k++) y = k == kk ? x[k] : y;
    y *= D == 64 ? 0.125f : D == 128 ? __int_as_float(0x3db504f3) : 0.0625f;  // float32(1 / sqrt(D))
    return (sw >> (d & 31)) & 1u ? -y : y;
}
