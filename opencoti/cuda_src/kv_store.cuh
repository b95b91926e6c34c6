// The turbo tiers' row encoder shared by kv_write.cu (kv_quant_<T>_d<D>) and rope_store.cu (the
// fused rope + KV store): one row of D values, one value per thread of a D-thread block, encoded
// with turbo.py's float32 arithmetic (the bits of KVTier.quantize; see kv_write.cu's header).
#include "kv_tiers.cuh"

// tree64 (turbo.block_sum's order: p[j] += p[j + h], h = 32, ..., 1) of a 64-value block held
// by one warp, lane j its values j and j + 32: the h = 32 stage inside the lane (lo + hi), the
// others by xor shuffles, every lane's sum the same bits as lane 0's (no broadcast at the end):
// a lane j < h adds lane j ^ h = j + h, tree64's operands in its order, and lanes j and j ^ h add
// the same two values (IEEE addition commutes; a NaN result is the one canonical NaN), so after
// stage h a lane's value depends only on j mod h, and after h = 1 every lane holds lane 0's.
__device__ __forceinline__ float tree64_warp(float lo, float hi) {
    float a = xadd(lo, hi);
#pragma unroll
    for (int h = 16; h > 0; h >>= 1) a = xadd(a, __shfl_xor_sync(0xffffffffu, a, h));
    return a;
}

// Two tree64_warp sums stage by stage (each sum's bits as alone): ptxas issues shuffles in program
// order, so two sums called one after the other run as two chains in turn.
__device__ __forceinline__ void tree64_warp2(float lo0, float hi0, float lo1, float hi1, float& a, float& b) {
    a = xadd(lo0, hi0);
    b = xadd(lo1, hi1);
#pragma unroll
    for (int h = 16; h > 0; h >>= 1) {
        const float oa = __shfl_xor_sync(0xffffffffu, a, h), ob = __shfl_xor_sync(0xffffffffu, b, h);
        a = xadd(a, oa);
        b = xadd(b, ob);
    }
}

// tree64_warp(lo, hi) with rope.cuh warp_sum(ride) beside it, stage by stage (the same bits as each
// alone); ride: in, the lane's value; out, the warp's sum.
__device__ __forceinline__ float tree64_warp_ride(float lo, float hi, float& ride) {
    float a = xadd(lo, hi);
#pragma unroll
    for (int h = 16; h > 0; h >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, a, h);
        ride += __shfl_xor_sync(0xffffffffu, ride, h);
        a = xadd(a, o);
    }
    return a;
}

// bits 0..3 of x at bits 0, 2, 4, 6
__device__ __forceinline__ u32 spread4(u32 x) {
    x = (x | (x << 2)) & 0x33u;
    return (x | (x << 1)) & 0x55u;
}
// Payload byte m = j + 32 k of a turbo block (turbo.py's layout: 2 + m in the block) in lane j of
// the warp that encodes it, from the lanes' indices i0 (value j) and i1 (value j + 32), without
// shared memory or a branch: turbo2/3's low bytes m < 16 (values 4m .. 4m + 3, value 4m + r's two
// low bits at bits 2r, 2r + 1) and turbo3's high bytes 16 + mm (bit r = bit 2 of value 8mm + r) from
// the warp's ballots of those bits, turbo4's bytes (value 2m, value 2m + 1 << 4) from shuffles,
// turbo8's the indices themselves (two bytes a lane: k = 0, 1). Every lane of the warp calls it.
template <int BITS>
__device__ __forceinline__ u32 turbo_payload_byte(int i0, int i1, int j, int k) {
    if constexpr (BITS == 8) {
        return (u32)(k == 0 ? i0 : i1);
    } else if constexpr (BITS == 4) {
        const int s = (2 * j) & 31;  // byte j: values 2j, 2j + 1 (i0 of lanes s, s + 1 for j < 16, else i1)
        const int a0 = __shfl_sync(0xffffffffu, i0, s), a1 = __shfl_sync(0xffffffffu, i0, s + 1);
        const int b0 = __shfl_sync(0xffffffffu, i1, s), b1 = __shfl_sync(0xffffffffu, i1, s + 1);
        return j < 16 ? (u32)(a0 | a1 << 4) : (u32)(b0 | b1 << 4);
    } else {
        const u32 a0 = __ballot_sync(0xffffffffu, i0 & 1), a1 = __ballot_sync(0xffffffffu, i0 & 2);
        const u32 b0 = __ballot_sync(0xffffffffu, i1 & 1), b1 = __ballot_sync(0xffffffffu, i1 & 2);
        const int q = 4 * (j & 7);  // byte j < 16: lanes 4 (j % 8) .., of i0 (j < 8) or i1
        const u32 lo = spread4(((j < 8 ? a0 : b0) >> q) & 15u) | spread4(((j < 8 ? a1 : b1) >> q) & 15u) << 1;
        if constexpr (BITS == 2) return lo;
        const u32 h0 = __ballot_sync(0xffffffffu, i0 & 4), h1 = __ballot_sync(0xffffffffu, i1 & 4);
        const int mm = (j - 16) & 7;  // byte 16 + mm: lanes 8 (mm % 4) .., of i0 (mm < 4) or i1
        const u32 hi = ((mm < 4 ? h0 : h1) >> (8 * (mm & 3))) & 255u;
        return j < 16 ? lo : hi;
    }
}

// One row of D values quantized to the turbo tier T at dst_row (its D / 64 blocks): thread tid
// (of exactly D) holds value x = row[tid]; sw: its sign word (kv_sign_word<D>, read before the
// kernel's wait); sc: D floats of shared scratch, free again after the block's next sync.
// turbo.py's arithmetic: the rotation (fwht_column: the block's one sync), then warp b < D / 64
// encodes 64-value block b, lane j its values j and j + 32 (both in the lane's rotation column):
// per-64 norms and least-squares scales summed in tree64's order by shuffles (tree64_warp), the
// code search over the thresholds. The other warps return after the rotation.
//
// The code search reads no memory up to 16 levels (turbo2/3/4): the thresholds and levels are
// immediates (T::thr_at / lev_at, cuda_kv.tables_prefix), a value's level picked by a tree of
// selects on its threshold tests. Read from __constant__ memory at that point (c[3] operands, the
// level's per-lane LDC) they came from the constant cache on the encode's path, where a miss is
// an L2 round trip (bench/CUDA_NOTES.md session 45). (Loaded into registers before the wait
// instead, at per-lane addresses, ptxas issued those loads right after it and the row's own load
// came ~350 cycles later.)
//
// GAIN: the row stored is g x for the gain g = rsqrtf(sum_t gss_t / D + eps) (rope.cuh rope_row's
// RMSNorm scale: block_sum's order, the same bits) of one more value gss per thread: the codes are
// x's (a block's codes do not depend on a common factor of its values, up to rounding), and each
// block's least-squares scale is multiplied by g before its f16 rounding. The sum rides on the
// rotation's shuffles and sync (fwht_column's ride, gsh: D / 32 floats of shared memory) and on
// the block norm's (tree64_warp_ride), so the row's encode does not wait for it: the fused store's
// K row with a k_norm (rope_store.cu). The bytes equal quantizing the normed row up to rounding:
// g x rounds once per value there, and once per scale here.
template <class T, int D, bool GAIN = false>
__device__ __forceinline__ void turbo_row(float x, u32 sw, u8* __restrict__ dst_row, float* sc, float gss = 0.f,
                                          float eps = 0.f, float* gsh = nullptr) {
    static_assert(D % 64 == 0, "turbo_row: whole 64-value blocks");
    const int b = threadIdx.x >> 5, j = threadIdx.x & 31;
    constexpr bool IMM = T::NT <= 16;  // thresholds and levels as immediates
    float v[D / 32];
    fwht_column<D, GAIN>(x, sw, sc, v, gss, gsh);
    if (b >= D / 64) return;
    float y[2] = {v[0], v[1]};  // y_{64 b + j}, y_{64 b + j + 32}: column entries 2 b, 2 b + 1
#pragma unroll
    for (int k = 1; k < D / 64; k++) {
        if (b == k) { y[0] = v[2 * k]; y[1] = v[2 * k + 1]; }
    }
    float g = 1.f;
    float nn;
    if constexpr (GAIN) {
        float gs = j < D / 32 ? gsh[j] : 0.f;  // block_sum's second half
        nn = tree64_warp_ride(xmul(y[0], y[0]), xmul(y[1], y[1]), gs);
        g = rsqrtf(gs / D + eps);
    } else {
        nn = tree64_warp(xmul(y[0], y[0]), xmul(y[1], y[1]));
    }
    const float n = xsqrt(nn);
    int ix[2];  // the indices of values j, j + 32
    const bool pos = xlt(0.f, n);
    const float s8 = pos ? xdiv(8.f, n) : 0.f;  // (once for both values: their searches run side by side)
    float yc[2], cc[2];
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const float u = pos ? xmul(y[p], s8) : 0.f;
        // searchsorted(thresholds, u, side="left"): the thresholds below u (th < u; a NaN u counts
        // all, as NumPy sorts it last), and c = levels[lo]. Up to 15 thresholds: every test at
        // once (gt[i]: th_i < u, true for i < lo as the thresholds ascend), lo their count and c
        // by halving: the node over levels [k, k + 2 w) takes its upper half iff gt[k + w - 1]
        // (lo >= k + w). Else a binary search and a table load.
        int lo = 0;
        float c;
        if constexpr (IMM) {
            bool gt[T::NT - 1];
            float lv[T::NT];
#pragma unroll
            for (int i = 0; i < T::NT - 1; i++) {
                gt[i] = !xle(u, T::thr_at(i));
                lo += gt[i];
            }
#pragma unroll
            for (int k = 0; k < T::NT; k++) lv[k] = T::lev_at(k);
#pragma unroll
            for (int w = 1; w < T::NT; w <<= 1) {
#pragma unroll
                for (int k = 0; k < T::NT; k += 2 * w) lv[k] = gt[k + w - 1] ? lv[k + w] : lv[k];
            }
            c = lv[0];
        } else {
            const float* th = T::thr();
            int hi = T::NT - 1;
            while (lo < hi) {
                int mid = (lo + hi) >> 1;
                if (!xle(u, th[mid])) lo = mid + 1; else hi = mid;
            }
            c = T::tab()[lo];
        }
        ix[p] = lo;
        yc[p] = xmul(y[p], c);
        cc[p] = xmul(c, c);
    }
    // the scale's two sums, and the payload from the indices in registers (turbo_payload_byte: no
    // shared memory and no branch, so ptxas places its ballots and stores in the sums' shuffle
    // latencies instead of before them)
    float num, den;
    tree64_warp2(yc[0], yc[1], cc[0], cc[1], num, den);
    u8* dst = dst_row + (long long)b * T::BB;
#pragma unroll
    for (int k = 0; k < (T::BB - 2 + 31) / 32; k++) {
        const u32 byte = turbo_payload_byte<T::KBITS>(ix[0], ix[1], j, k);
        if (j + 32 * k < T::BB - 2) dst[2 + j + 32 * k] = (u8)byte;
    }
    float scale = xlt(0.f, den) ? xdiv(num, den) : 0.f;
    if constexpr (GAIN) scale = xmul(scale, g);
    if (j == 0) st16(dst, f2h(scale));
}
