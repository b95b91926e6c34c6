// The turbo tiers' row encoder shared by kv_write.cu (kv_quant_<T>_d<D>) and rope_store.cu (the
// fused rope + KV store): one row of D values, one value per thread of a D-thread block, encoded
// with turbo.py's float32 arithmetic (the bits of KVTier.quantize; see kv_write.cu's header).
#include "kv_tiers.cuh"

// tree64 of two quantities a, b held one value per thread of whole 64-thread groups (the block's
// threads: value j = threadIdx.x & 63 of group base b0): the group sums (a_0 + .., b_0 + ..) in
// tree64's order -- h = 32 through sc (the upper warp's values), h = 16 .. 1 by shuffles down (lane
// j < h adds lane j + h) -- broadcast to every thread of the group. sc: 2 * blockDim floats, free
// again after the block's next sync.
__device__ __forceinline__ float2 tree64_pair(float a, float b, float* sc) {
    const int tid = threadIdx.x, j = tid & 63, n = blockDim.x;
    if (j >= 32) { sc[tid] = a; sc[n + tid] = b; }
    __syncthreads();
    if (j < 32) {  // a whole (lower) warp
        a = xadd(a, sc[tid + 32]);
        b = xadd(b, sc[n + tid + 32]);
#pragma unroll
        for (int h = 16; h > 0; h >>= 1) {
            const float oa = __shfl_down_sync(0xffffffffu, a, h), ob = __shfl_down_sync(0xffffffffu, b, h);
            a = xadd(a, oa);
            b = xadd(b, ob);
        }
        if (j == 0) { sc[tid] = a; sc[n + tid] = b; }
    }
    __syncthreads();
    return make_float2(sc[tid - j], sc[n + tid - j]);
}

// payload byte m of a turbo block from its 64 indices
template <int BITS>
__device__ __forceinline__ u8 turbo_pack(const int* idx, int m) {
    if (BITS == 8) return (u8)idx[m];
    if (BITS == 4) return (u8)(idx[2 * m] | (idx[2 * m + 1] << 4));
    if (m < 16) return (u8)((idx[4 * m] & 3) | ((idx[4 * m + 1] & 3) << 2) | ((idx[4 * m + 2] & 3) << 4) | ((idx[4 * m + 3] & 3) << 6));
    int mm = m - 16, v = 0;  // turbo3 high bits
#pragma unroll
    for (int r = 0; r < 8; r++) v |= ((idx[8 * mm + r] >> 2) & 1) << r;
    return (u8)v;
}

// One row of D values quantized to the turbo tier T at dst_row (its D / 64 blocks): thread tid
// (of exactly D) holds value x = row[tid]; sc: 4 D floats of shared scratch, free again after the
// block's next sync. turbo.py's arithmetic: the rotation (fwht_thread), per-64 norms and
// least-squares scales summed in tree64's order (tree64_pair), the code search over the thresholds.
template <class T, int D>
__device__ __forceinline__ void turbo_row(float x, u8* __restrict__ dst_row, float* sc) {
    const int tid = threadIdx.x, j = tid & 63, b0 = tid - j;
    int* idx = (int*)sc;  // after the rotation's buffers are read (tree64_pair's syncs follow)
    const float y = fwht_thread<D>(x, sc);
    const float n = xsqrt(tree64_pair(xmul(y, y), 0.f, sc + 2 * D).x);
    const float u = xlt(0.f, n) ? xmul(y, xdiv(8.f, n)) : 0.f;
    const float* th = T::thr();
    // searchsorted(thresholds, u, side="left"): the thresholds below u (th < u; a NaN u counts
    // all, as NumPy sorts it last). Up to 15 thresholds by counting (every thread reads the same
    // th[i]: one constant-cache broadcast each, no dependent chain), else a binary search.
    int lo = 0;
    if constexpr (T::NT <= 16) {
#pragma unroll
        for (int i = 0; i < T::NT - 1; i++) lo += !xle(u, th[i]);
    } else {
        int hi = T::NT - 1;
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if (!xle(u, th[mid])) lo = mid + 1; else hi = mid;
        }
    }
    const float c = T::tab()[lo];
    idx[tid] = lo;
    const float2 nd = tree64_pair(xmul(y, c), xmul(c, c), sc + 2 * D);  // its syncs publish idx
    const float scale = xlt(0.f, nd.y) ? xdiv(nd.x, nd.y) : 0.f;
    u8* dst = dst_row + (long long)(tid >> 6) * T::BB;
    if (j == 0) st16(dst, f2h(scale));
    if (j < T::BB - 2) dst[2 + j] = turbo_pack<T::KBITS>(idx + b0, j);
}
