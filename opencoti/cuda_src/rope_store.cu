// An attention layer's rope + quantized KV store in one launch (cpu.rope_kv_write with scalar or
// turbo tiers: the launches of rope, rope and kv_write's quantize kernels), compiled per KV tier
// pair by cuda_kv.rope_store_source with RS_TK / RS_TV (kv_tiers.cuh tier structs: the float,
// scalar and turbo tiers) and RS_D (the head size of a rotated tier, 0 when neither is rotated).
//
// One module per pair, not one kernel that switches on runtime tier indices: a decode step runs
// this kernel once per layer as a few dozen blocks, one per SM, every one of them fetching its
// instructions cold; the switching kernel held every tier's encoder (14 K SASS instructions), and
// its warps stalled on instruction fetch (ncu "no instruction": 9.5 cycles per issue against
// 0.7 for f16's rope_kv_write, gemma-3-270m, H200).
//
// rope_kv_write_q: grid T * (Hq + 2 Hk) blocks of blockDim (a multiple of 32) threads; blocks
// [0, T * Hq) rope q head rows (q_norm first) into q_out -- and for a rotated K tier rotate them
// into its domain (R q, turbo.py's rotation: the attention kernels then skip theirs, cuda.py
// RotatedQ) --, the next T * Hk take one (token, kv
// head) each: its K row roped (k_norm first; a rotated tier's with its norm scale on the block
// scales instead, RS_K_NORM_LATE below) and quantized to RS_TK, and the last T * Hk its V row (dv values) quantized to RS_TV (apart, so that V's store runs beside K's
// rope instead of after it), at the token's cell (flat index cell[t]; rows [n_kv][n / BS blocks of
// BB bytes]). A scalar tier's warp w quantizes the 32-value blocks w, w + n_warps, ... (the scalar
// quantizers are warp-collective: lane = value), so the stored bytes are kv_quant_<T>'s; a rotated
// tier's row takes all the block's threads (turbo_row: a rotated K needs blockDim == D == RS_D --
// its q blocks' rotation too --, a rotated V blockDim == dv == RS_D, a power of two up to 256). Dynamic shared memory: 2 D floats,
// 4 D with a rotated tier.
#include "kv_store.cuh"
#include "rope.cuh"

// RS_K_NORM_LATE (default 1; cuda.py ROPE_K_NORM_LATE, OPENCOTI_CUDA_ROPE_K_NORM_LATE=0 builds 0): a
// rotated K tier's row with a k_norm is encoded from its unnormed rope (rope.cuh
// rope_value_unnormed) with the norm's scale on the block scales (kv_store.cuh turbo_row's GAIN),
// not roped after the norm's block sum and then encoded: the K row is the store's longest chain
// (its load, the norm's two barriers, rope, the rotation, the encode), and the attention after the
// store waits for it. The stored codes and scales are those of the normed row up to rounding (a
// code where a value sits within rounding of a threshold, a scale by one f16 unit), not its bits.
// 0: rope_row's normed value, encoded (the bits of rope, then kv_write.cu's quantize kernel).
#ifndef RS_K_NORM_LATE
#define RS_K_NORM_LATE 1
#endif

// the calling thread's sign word of a rotated tier's rows (kv_tiers.cuh kv_sign_word; 0 with
// neither tier rotated), read before the wait
#define RS_DT (RS_D > 0 ? RS_D : 64)
__device__ __forceinline__ u32 rs_sign_word() { return RS_TK::ROT || RS_TV::ROT ? kv_sign_word<RS_DT>() : 0u; }

// a row of n values stored at dst in tier T: value(i) gives value i; sw: rs_sign_word
template <class T, class Val>
__device__ __forceinline__ void rs_store_row(int n, u8* dst, float* sc, u32 sw, Val value) {
    if constexpr (T::ROT) {
        turbo_row<T, RS_DT>(value(threadIdx.x), sw, dst, sc);
    } else {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
        for (int b = warp; b < n / 32; b += nw) T::q32(value(32 * b + lane), dst + b * T::BB, lane);
    }
}

extern "C" __global__ void rope_kv_write_q(ROPE_KV_WRITE_PARAMS(u8)) {
    const RopePre pre = ROPE_PRE();  // (before the wait: rope.cuh ROPE_ANGLE_PRE)
    const u32 sw = rs_sign_word();   // (before the wait: a constant)
    GRID_DEP_WAIT();
    const QKVIn in = ROPE_KV_WRITE_IN;
    extern __shared__ float rbuf[];  // rope's normed input, the K row (scalar tiers), a rotated tier's scratch
    __shared__ float sh[32];
    long long row;
    float *kb = rbuf + D, *sc = rbuf + 2 * D;
    if constexpr (RS_TK::ROT) {  // a rotated K tier: the q rows roped, then rotated into its domain (R q)
        if (blockIdx.x < T * Hq) {
            float y = 0.f;  // thread i's value i (blockDim == D)
            rope_head_row(in.q, in.ldq, in.nsq, in.slq, in.bq, blockIdx.x, Hq, pos, D, n_rot, base, freq_scale, mode, ff,
                          q_norm, eps, ext_factor, corr_lo, corr_hi, mscale, rbuf, sh, [&](int i, float x) { y = x; }, pre);
            q_out[(long long)blockIdx.x * D + threadIdx.x] = fwht_thread<RS_DT>(y, sw, sc);
            return;
        }
    }
    if (rope_q_block(in, q_out, T, Hq, pos, D, n_rot, base, freq_scale, mode, ff, q_norm, eps, ext_factor, corr_lo,
                     corr_hi, mscale, rbuf, sh, row, pre))
        return;
    const bool is_v = row >= (long long)T * Hk;
    if (is_v) row -= (long long)T * Hk;
    const int t = (int)(row / Hk), h = (int)(row % Hk);
    const long long c = (long long)cell[t] * Hk + h;  // the (cell, kv head) row
    if (is_v) {
        rs_store_row<RS_TV>(dv, V + c * (dv / RS_TV::BS * RS_TV::BB), sc, sw, [&](int i) { return in.v_at(t, h, dv, i); });
        return;
    }
    // a rotated K tier with a k_norm (RS_K_NORM_LATE): the row x * w roped and encoded at once, the
    // norm's 1 / rms applied to the block scales (turbo_row's GAIN: its sum rides on the encoder's
    // shuffles and syncs), so the row's chain after the wait is its load, rope and the encoder
    if constexpr (RS_TK::ROT && RS_K_NORM_LATE) {
        if (k_norm && pre.on) {
            float xx;
            const float y = rope_value_unnormed(in.k_row(t, h, D), in.nsk, in.slk, in.bk != nullptr, n_rot, mode, pre, xx);
            turbo_row<RS_TK, RS_DT, true>(y, sw, K + c * (D / RS_TK::BS * RS_TK::BB), sc, xx, eps, sh);
            return;
        }
    }
    // a rotated K tier's thread i keeps value i (blockDim == D: turbo_row's one value per thread), a
    // scalar tier's warps read the row from kb after the sync
    float y = 0.f;
    rope_row(in.k_row(t, h, D), in.nsk, in.slk, in.k_bias(h, D), pos[t], D, n_rot, base, freq_scale, mode, ff, k_norm, eps, ext_factor,
             corr_lo, corr_hi, mscale, rbuf, sh, [&](int i, float x) {
                 if constexpr (RS_TK::ROT) y = x;
                 else kb[i] = x;
             }, pre);
    if constexpr (!RS_TK::ROT) __syncthreads();
    rs_store_row<RS_TK>(D, K + c * (D / RS_TK::BS * RS_TK::BB), sc, sw, [&](int i) { return RS_TK::ROT ? y : kb[i]; });
}
