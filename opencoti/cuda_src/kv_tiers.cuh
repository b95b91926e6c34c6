// KV cache tiers on the GPU: one struct per tier (opencoti/engine/kv_tiers), with
//   - decoders for attention: code()/scale() read a block from registers holding a
//     segment of a row (QK: a lane per cell), val() reads one value from memory (PV:
//     the lanes over dims; the read kernel);
//   - the scalar encoder q32() (the 32-value scalar tiers, one warp per block: kv_write.cu's
//     quantize kernels and rope_store.cu's fused store); the rotated tiers are encoded a row
//     per block (kv_store.cuh turbo_row; the trellis tiers by kv_write.cu's Viterbi kernels).
// The byte layouts are the CPU tiers' (scalar.py, turbo.py, tcq.py module docs). Rotated
// tiers (ROT) decode to the rotated domain y = R x (turbo.py): attention rotates q once
// and un-rotates the P.V output once. Needs the tables prefix of cuda_kv.tables_prefix().
//
// Tier struct members:
//   BS, BB: values / bytes of a block (the float tiers use a 32-value virtual block);
//   SV: values per register segment in QK (keeps a segment <= ~36 registers);
//   ROT: rotated domain; HASMIN: q5_1's / q4_1's "+ m" term; PVF16: f16 rows (PV loads them 16 bytes
//   at a time); NT: code-table entries (0 = none),
//   tab(): that __constant__ table (copied to shared memory by the kernels);
//   scale(w, b) / mn(w, b): block b's scale / offset from a segment's words w;
//   code(w, b, j, tab): value j of block b without the scale (an integer or a table level);
//   val(row, i, tab): value i of a row, scaled (from global memory);
//   vals<E>(row, i0, tab, vf): the E values [i0, i0 + E) of a row (E even, <= 16, E | BS,
//     i0 % E == 0: one block), its scale loaded once and its code bytes in few loads (PV; the
//     trellis tiers call val() E times);
//   SUB (the turbo tiers): a part of a block for QK (attention.cu kv_qk, the _l8 kernels):
//     sub_words<NV>(block, sub, w) loads part `sub` of NV values' code bytes, sub_code<NV>(w, j,
//     tab) gives its code j;
//   NP (turbo2/3/4; else 0): entries of a table of level pairs for the short-row attention
//     kernels: values j, j + 1 (j even) as one index into it (pair(w, b, j), sub_pair<NV>(w, j)),
//     one shared-memory load for both levels; pair_level(e) builds entry e, vals2<E> is vals<E>
//     through it without the scale (returned: the caller folds it into p).
#include "quants.cuh"

// ---- exact IEEE float32 arithmetic for the encoders: PTX round-to-nearest without .ftz, so
// --use_fast_math neither flushes denormals nor contracts into FMAs (NumPy does neither)
__device__ __forceinline__ float xadd(float a, float b) { float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float xsub(float a, float b) { float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float xmul(float a, float b) { float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float xdiv(float a, float b) { float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float xsqrt(float a) { float r; asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); return r; }
// comparisons, min/max/abs and negation without .ftz: --use_fast_math makes the C operators
// flush subnormal operands to zero (setp.lt.ftz, max.ftz, abs.ftz, neg.ftz), NumPy does not
__device__ __forceinline__ bool xlt(float a, float b) {
    u32 r; asm("{ .reg .pred p; setp.lt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b)); return r != 0u;
}
__device__ __forceinline__ bool xle(float a, float b) {
    u32 r; asm("{ .reg .pred p; setp.le.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b)); return r != 0u;
}
__device__ __forceinline__ bool xeq(float a, float b) {
    u32 r; asm("{ .reg .pred p; setp.eq.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b)); return r != 0u;
}
__device__ __forceinline__ float xmax(float a, float b) { float r; asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float xmin(float a, float b) { float r; asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float xabs(float a) { return __uint_as_float(__float_as_uint(a) & 0x7FFFFFFFu); }
__device__ __forceinline__ float xneg(float a) { return __uint_as_float(__float_as_uint(a) ^ 0x80000000u); }
// C roundf (halves away from zero), as scalar.py's _roundf
__device__ __forceinline__ float xround(float v) {
    float t = truncf(v);
    return xle(0.5f, xabs(xsub(v, t))) ? xadd(t, copysignf(1.f, v)) : t;
}
__device__ __forceinline__ bool kv_neg(int i) { return (KV_SIGNS[i >> 5] >> (i & 31)) & 1u; }  // sign s_i = -1
// the sign word of thread t's value t % D of a rotated row (fwht_column: bit t % 32 set = s_{t % D} = -1).
// The KV stores read it before their GRID_DEP_WAIT (pdl.cuh; no kernel writes KV_SIGNS). ptxas
// issues that load right after the wait, beside the row's load, not once the row's value is
// there, where a constant-cache miss was an L2 round trip on the rotation's path.
template <int D>
__device__ __forceinline__ u32 kv_sign_word() { return KV_SIGNS[(threadIdx.x & (D - 1)) >> 5]; }

// ---- register segments: NB bytes at an A-aligned address as little-endian u32 words
template <int NB, int A>
__device__ __forceinline__ void ldw(const u8* __restrict__ p, u32* w) {
    if constexpr (A >= 16) {
#pragma unroll
        for (int i = 0; i < NB / 16; i++) { uint4 v = ((const uint4*)p)[i]; w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w; }
    } else if constexpr (A == 8) {
#pragma unroll
        for (int i = 0; i < NB / 8; i++) { uint2 v = ((const uint2*)p)[i]; w[2 * i] = v.x; w[2 * i + 1] = v.y; }
    } else if constexpr (A == 4) {
#pragma unroll
        for (int i = 0; i < NB / 4; i++) w[i] = ((const u32*)p)[i];
    } else {
#pragma unroll
        for (int i = 0; i < NB / 2; i++) {
            u32 h = ((const u16*)p)[i];
            if (i & 1) w[i >> 1] |= h << 16; else w[i >> 1] = h;
        }
    }
}
__device__ __forceinline__ u32 wb(const u32* w, int i) { return (w[i >> 2] >> ((i & 3) * 8)) & 0xFFu; }
__device__ __forceinline__ u16 wh(const u32* w, int i) { return (u16)((w[i >> 2] >> ((i & 3) * 8)) & 0xFFFFu); }  // i even
__device__ __forceinline__ u16 ldh(const u8* p) { return *(const u16*)p; }  // 2-aligned
// (float)((int)c - off) for a code 0 <= c < 2^23, exactly, on the FP32 / integer pipes: c in the
// mantissa of 2^23 (a bit OR), minus 2^23 + off (exact in float32 for off < 2^23). The decoders'
// I2F conversions ran on sm_90's conversion unit (16 results a clock per SM): the short-row kernels'
// q8_0 K / V decode at head size 256 issued 131 of them per tile.
__device__ __forceinline__ float code_f(u32 c, int off) { return __int_as_float(0x4B000000u | c) - (8388608.f + (float)off); }

// ---- float tiers (native storage: the cache's float32 / float16 array; bf16 as 2 bytes)
struct KF32 {
    static constexpr int BS = 32, BB = 128, SV = 32, ROT = 0, HASMIN = 0, NT = 0, PVF16 = 0, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32*, int) { return 1.f; }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) { return __uint_as_float(w[32 * b + j]); }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) { return ((const float*)row)[i]; }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float*, float* vf) {
        u32 w[E];
        ldw<4 * E, (4 * E) % 16 == 0 ? 16 : 8>(row + 4 * i0, w);
#pragma unroll
        for (int e = 0; e < E; e++) vf[e] = __uint_as_float(w[e]);
    }
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) { ((float*)dst)[lane] = v; }
};
struct KF16 {
    static constexpr int BS = 32, BB = 64, SV = 64, ROT = 0, HASMIN = 0, NT = 0, PVF16 = 1, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32*, int) { return 1.f; }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) { return h2f(wh(w, 64 * b + 2 * j)); }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) { return h2f(((const u16*)row)[i]); }
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) { ((u16*)dst)[lane] = f2h(v); }
};
struct KBF16 {
    static constexpr int BS = 32, BB = 64, SV = 64, ROT = 0, HASMIN = 0, NT = 0, PVF16 = 0, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32*, int) { return 1.f; }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) { return bf2f(wh(w, 64 * b + 2 * j)); }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) { return bf2f(((const u16*)row)[i]); }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float*, float* vf) {
        u32 w[E / 2];
        ldw<2 * E, (2 * E) % 16 == 0 ? 16 : (2 * E) % 8 == 0 ? 8 : 4>(row + 2 * i0, w);
#pragma unroll
        for (int e = 0; e < E; e++) vf[e] = bf2f(wh(w, 2 * e));
    }
    // ggml_compute_fp32_to_bf16: round to nearest even, NaN -> quiet NaN
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) {
        u32 u = __float_as_uint(v);
        u32 h = (u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 64u : (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;
        ((u16*)dst)[lane] = (u16)h;
    }
};

// ---- warp helpers of the scalar encoders (one warp = one 32-value block, lane j = value j)
__device__ __forceinline__ float wmax(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = xmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float wmin(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = xmin(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// the value of largest magnitude, the first one on ties (scalar.py _signed_absmax)
__device__ __forceinline__ float wsabsmax(float v, int lane) {
    float a = xabs(v);
    int i = lane;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float oa = __shfl_xor_sync(0xffffffffu, a, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (xlt(a, oa) || (xeq(oa, a) && oi < i)) { a = oa; i = oi; }
    }
    return __shfl_sync(0xffffffffu, v, i);
}
__device__ __forceinline__ float xinv(float d) { return !xeq(d, 0.f) ? xdiv(1.f, d) : 0.f; }
// a block's f16 field as one 16-bit store (p 2-aligned, as ldh; see f2h in quants.cuh for why not bytes)
__device__ __forceinline__ void st16(u8* p, u16 h) { *(u16*)p = h; }
// qs[j] = (q_j & 15) | (q_{j+16} & 15) << 4, written by lanes j < 16
__device__ __forceinline__ void st_nibbles(u8* qs, int q, int lane) {
    int hi = __shfl_down_sync(0xffffffffu, q, 16);
    if (lane < 16) qs[lane] = (u8)((q & 15) | ((hi & 15) << 4));
}
__device__ __forceinline__ void st_qh32(u8* qh, int q, int lane) {
    u32 m = __ballot_sync(0xffffffffu, (q >> 4) & 1);
    if (lane < 4) qh[lane] = (u8)(m >> (8 * lane));
}

// ---- ggml scalar tiers (scalar.py)
struct KQ8_0 {
    static constexpr int BS = 32, BB = 34, SV = 128, ROT = 0, HASMIN = 0, NT = 0, PVF16 = 0, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32* w, int b) { return h2f(wh(w, 34 * b)); }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) { return code_f(wb(w, 34 * b + 2 + j) ^ 0x80u, 128); }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) {
        const u8* b = row + 34 * (i >> 5);
        return h2f(ldh(b)) * code_f(b[2 + (i & 31)] ^ 0x80u, 128);
    }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float*, float* vf) {
        const u8* b = row + 34 * (i0 >> 5);
        u32 w[(E + 3) / 4];
        ldw<E, 2>(b + 2 + (i0 & 31), w);
        const float d = h2f(ldh(b));
#pragma unroll
        for (int e = 0; e < E; e++) vf[e] = d * code_f(wb(w, e) ^ 0x80u, 128);
    }
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) {  // quantize_row_q8_0_ref
        float d = xdiv(wmax(xabs(v)), 127.f), id = xinv(d);
        dst[2 + lane] = (u8)(i8)(int)xround(xmul(v, id));
        if (lane == 0) st16(dst, f2h(d));
    }
};
struct KQ6_0 {
    static constexpr int BS = 32, BB = 26, SV = 128, ROT = 0, HASMIN = 0, NT = 0, PVF16 = 0, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32* w, int b) { return h2f(wh(w, 26 * b)); }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ u32 q_of(u32 qs, u32 qhb, int j) {  // qs = qs[j&15], qhb = qh[j&7]; code + 32
        int jj = j & 15;
        u32 h = (qhb >> (4 * (jj >> 3))) & 15u;
        return j < 16 ? ((qs & 15u) | ((h & 3u) << 4)) : ((qs >> 4) | (((h >> 2) & 3u) << 4));
    }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) {
        return code_f(q_of(wb(w, 26 * b + 10 + (j & 15)), wb(w, 26 * b + 2 + (j & 7)), j), 32);
    }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) {
        const u8* b = row + 26 * (i >> 5);
        int j = i & 31;
        return h2f(ldh(b)) * code_f(q_of(b[10 + (j & 15)], b[2 + (j & 7)], j), 32);
    }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float*, float* vf) {
        const u8* b = row + 26 * (i0 >> 5);
        const int j0 = i0 & 31;
        u32 qh[2], qs[(E + 3) / 4];
        ldw<8, 2>(b + 2, qh);
        ldw<E, 2>(b + 10 + (j0 & 15), qs);
        const float d = h2f(ldh(b));
#pragma unroll
        for (int e = 0; e < E; e++) vf[e] = d * code_f(q_of(wb(qs, e), wb(qh, (j0 + e) & 7), j0 + e), 32);
    }
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) {  // quantize_row_q6_0_ref
        float d = xdiv(wsabsmax(v, lane), -32.f), id = xinv(d);
        int q = min(63, (int)truncf(xadd(xmul(v, id), 32.5f)));
        int q2 = __shfl_down_sync(0xffffffffu, q, 16);
        int h = (q >> 4) | ((q2 >> 4) << 2);            // h_j, lanes j < 16
        int h8 = __shfl_down_sync(0xffffffffu, h, 8);
        if (lane < 8) dst[2 + lane] = (u8)(h | (h8 << 4));
        if (lane < 16) dst[10 + lane] = (u8)((q & 15) | ((q2 & 15) << 4));
        if (lane == 0) st16(dst, f2h(d));
    }
};
// low 4 bits of code j of a 32-value block from its qs byte qs[j & 15] (the q4_0 / q4_1 /
// iq4_nl / q5_x layout: the low nibble for j < 16, else the high one)
__device__ __forceinline__ u32 nib4(u32 qs, int j) { return j < 16 ? (qs & 15u) : (qs >> 4); }
// 5-bit code j of a q5_0 / q5_1 block: low 4 bits in qs[j & 15] (nib4), bit 4 at bit j & 7 of
// qh byte j >> 3 (qs = that qs byte, qhb = that qh byte)
__device__ __forceinline__ u32 q5_code(u32 qs, u32 qhb, int j) {
    return nib4(qs, j) | (((qhb >> (j & 7)) & 1u) << 4);
}
struct KQ5_1 {
    static constexpr int BS = 32, BB = 24, SV = 128, ROT = 0, HASMIN = 1, NT = 0, PVF16 = 0, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32* w, int b) { return h2f(wh(w, 24 * b)); }
    static __device__ __forceinline__ float mn(const u32* w, int b) { return h2f(wh(w, 24 * b + 2)); }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) {
        return code_f(q5_code(wb(w, 24 * b + 8 + (j & 15)), wb(w, 24 * b + 4 + (j >> 3)), j), 0);
    }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) {
        const u8* b = row + 24 * (i >> 5);
        int j = i & 31;
        return h2f(ldh(b)) * code_f(q5_code(b[8 + (j & 15)], b[4 + (j >> 3)], j), 0) + h2f(ldh(b + 2));
    }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float*, float* vf) {
        const u8* b = row + 24 * (i0 >> 5);
        const int j0 = i0 & 31;
        u32 qs[(E + 3) / 4];
        ldw<E, 2>(b + 8 + (j0 & 15), qs);
        const u32 qh = *(const u32*)(b + 4);  // 4-aligned: blocks of 24 bytes
        const float d = h2f(ldh(b)), m = h2f(ldh(b + 2));
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = j0 + e;
            const u32 c = wb(qs, e);
            vf[e] = d * code_f(nib4(c, j) | (((qh >> j) & 1u) << 4), 0) + m;
        }
    }
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) {  // quantize_row_q5_1_ref
        float lo = wmin(v), hi = wmax(v);
        float d = xdiv(xsub(hi, lo), 31.f), id = xinv(d);
        int q = (int)truncf(xadd(xmul(xsub(v, lo), id), 0.5f));
        st_qh32(dst + 4, q, lane);
        st_nibbles(dst + 8, q, lane);
        if (lane == 0) { st16(dst, f2h(d)); st16(dst + 2, f2h(lo)); }
    }
};
struct KQ5_0 {
    static constexpr int BS = 32, BB = 22, SV = 128, ROT = 0, HASMIN = 0, NT = 0, PVF16 = 0, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32* w, int b) { return h2f(wh(w, 22 * b)); }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) {
        return code_f(q5_code(wb(w, 22 * b + 6 + (j & 15)), wb(w, 22 * b + 2 + (j >> 3)), j), 16);
    }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) {
        const u8* b = row + 22 * (i >> 5);
        int j = i & 31;
        return h2f(ldh(b)) * code_f(q5_code(b[6 + (j & 15)], b[2 + (j >> 3)], j), 16);
    }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float*, float* vf) {
        const u8* b = row + 22 * (i0 >> 5);
        const int j0 = i0 & 31;
        u32 qs[(E + 3) / 4];
        ldw<E, 2>(b + 6 + (j0 & 15), qs);
        const u32 qh = (u32)ldh(b + 2) | ((u32)ldh(b + 4) << 16);
        const float d = h2f(ldh(b));
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = j0 + e;
            const u32 c = wb(qs, e);
            vf[e] = d * code_f(nib4(c, j) | (((qh >> j) & 1u) << 4), 16);
        }
    }
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) {  // quantize_row_q5_0_ref
        float d = xdiv(wsabsmax(v, lane), -16.f), id = xinv(d);
        int q = min(31, (int)truncf(xadd(xmul(v, id), 16.5f)));
        st_qh32(dst + 2, q, lane);
        st_nibbles(dst + 6, q, lane);
        if (lane == 0) st16(dst, f2h(d));
    }
};
// the 18-byte nibble blocks (ggml block_q4_0, block_iq4_nl): d (f16) + 16 bytes of codes (nib4),
// value d * T::level(code); T (q4_0, iq4_nl) adds level() and its quantizer q32
template <class T>
struct KNib18 {
    static constexpr int BS = 32, BB = 18, SV = 128, ROT = 0, HASMIN = 0, NT = 0, PVF16 = 0, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32* w, int b) { return h2f(wh(w, 18 * b)); }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) {
        u32 qs = wb(w, 18 * b + 2 + (j & 15));
        return T::level(nib4(qs, j));
    }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) {
        const u8* b = row + 18 * (i >> 5);
        int j = i & 31;
        u32 qs = b[2 + (j & 15)];
        return h2f(ldh(b)) * T::level(nib4(qs, j));
    }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float*, float* vf) {
        const u8* b = row + 18 * (i0 >> 5);
        const int j0 = i0 & 31;
        u32 qs[(E + 3) / 4];
        ldw<E, 2>(b + 2 + (j0 & 15), qs);
        const float d = h2f(ldh(b));
#pragma unroll
        for (int e = 0; e < E; e++) {
            const u32 c = wb(qs, e);
            vf[e] = d * T::level(nib4(c, j0));
        }
    }
};
struct KQ4_0 : KNib18<KQ4_0> {
    static __device__ __forceinline__ float level(u32 c) { return code_f(c, 8); }  // code - 8
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) {  // quantize_row_q4_0_ref
        float d = xdiv(wsabsmax(v, lane), -8.f), id = xinv(d);
        int q = min(15, (int)truncf(xadd(xmul(v, id), 8.5f)));
        st_nibbles(dst + 2, q, lane);
        if (lane == 0) st16(dst, f2h(d));
    }
};

struct KQ4_1 {
    static constexpr int BS = 32, BB = 20, SV = 128, ROT = 0, HASMIN = 1, NT = 0, PVF16 = 0, SUB = 0, NP = 0;
    static __device__ __forceinline__ const float* tab() { return nullptr; }
    static __device__ __forceinline__ float scale(const u32* w, int b) { return h2f(wh(w, 20 * b)); }
    static __device__ __forceinline__ float mn(const u32* w, int b) { return h2f(wh(w, 20 * b + 2)); }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float*) {
        u32 qs = wb(w, 20 * b + 4 + (j & 15));
        return code_f(nib4(qs, j), 0);
    }
    static __device__ __forceinline__ float val(const u8* row, int i, const float*) {
        const u8* b = row + 20 * (i >> 5);
        int j = i & 31;
        u32 qs = b[4 + (j & 15)];
        return h2f(ldh(b)) * code_f(nib4(qs, j), 0) + h2f(ldh(b + 2));
    }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float*, float* vf) {
        const u8* b = row + 20 * (i0 >> 5);
        const int j0 = i0 & 31;
        u32 qs[(E + 3) / 4];
        ldw<E, 2>(b + 4 + (j0 & 15), qs);
        const float d = h2f(ldh(b)), m = h2f(ldh(b + 2));
#pragma unroll
        for (int e = 0; e < E; e++) {
            const u32 c = wb(qs, e);
            vf[e] = d * code_f(nib4(c, j0), 0) + m;
        }
    }
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) {  // quantize_row_q4_1_ref
        float lo = wmin(v), hi = wmax(v);
        float d = xdiv(xsub(hi, lo), 15.f), id = xinv(d);
        int q = min(15, (int)truncf(xadd(xmul(xsub(v, lo), id), 0.5f)));
        st_nibbles(dst + 4, q, lane);
        if (lane == 0) { st16(dst, f2h(d)); st16(dst + 2, f2h(lo)); }
    }
};
// iq4_nl's level i (ggml-common.h kvalues_iq4nl: -127 .. 113), exactly, from registers: the 16
// int8 levels are the bytes of four words, byte i picked by one PRMT
__device__ __forceinline__ float iq4nl_level(u32 i) {
    const u32 b = __byte_perm(i < 8u ? 0xBFAD9881u : 0x26190D01u, i < 8u ? 0xF6EADDCFu : 0x71594535u, i & 7u) & 0xFFu;
    return code_f(b ^ 0x80u, 128);
}
// ggml best_index_int8(16, kvalues_iq4nl, x) (scalar.py best_index_iq4nl): the nearest level's
// index, an exact midpoint to the upper one, NaN to 15
__device__ __forceinline__ int iq4nl_index(float x) {
    if (xle(x, -127.f)) return 0;
    if (!xlt(x, 113.f)) return 15;
    int mu = 1;  // levels 0 .. mu - 1 are <= x < level mu
#pragma unroll
    for (int k = 1; k < 15; k++) mu += xle(iq4nl_level(k), x) ? 1 : 0;
    return xlt(xsub(x, iq4nl_level(mu - 1)), xsub(iq4nl_level(mu), x)) ? mu - 1 : mu;
}
struct KIQ4_NL : KNib18<KIQ4_NL> {
    static __device__ __forceinline__ float level(u32 c) { return iq4nl_level(c); }  // kvalues_iq4nl[c]
    // quantize_row_iq4_nl_ref: codes of x / d0 (d0 = max / -127), then d = sum(w q x) / sum(w q^2)
    // with w = x^2, both sums in order j = 0..31 (lane 0's chain of shuffles; every lane gets it);
    // a block below GROUP_MAX_EPS gets d = 0 and codes 8 (scalar.py)
    static __device__ __forceinline__ void q32(float v, u8* dst, int lane) {
        const float mx = wsabsmax(v, lane);
        float d = 0.f;
        int q = 8;
        if (xle(1e-15f, xabs(mx))) {  // uniform per warp
            const float id = xdiv(1.f, xdiv(mx, -127.f));
            q = iq4nl_index(xmul(id, v));
            const float l = iq4nl_level((u32)q), wq = xmul(xmul(v, v), l);
            const float tqx = xmul(wq, v), tq2 = xmul(wq, l);
            float sqx = 0.f, sq2 = 0.f;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                sqx = xadd(sqx, __shfl_sync(0xffffffffu, tqx, j));
                sq2 = xadd(sq2, __shfl_sync(0xffffffffu, tq2, j));
            }
            d = xdiv(sqx, sq2);
        }
        st_nibbles(dst + 2, q, lane);
        if (lane == 0) st16(dst, f2h(d));
    }
};

// ---- turbo{2,3,4,8} (turbo.py): 64-value blocks, f16 scale, Lloyd-Max indices
__device__ __forceinline__ u32 turbo_idx_w(const u32* w, int o, int bits, int j) {  // o: block's byte offset
    if (bits == 8) return wb(w, o + 2 + j);
    if (bits == 4) return (wb(w, o + 2 + (j >> 1)) >> (4 * (j & 1))) & 15u;
    u32 lo = (wb(w, o + 2 + (j >> 2)) >> (2 * (j & 3))) & 3u;
    if (bits == 2) return lo;
    return lo | (((wb(w, o + 18 + (j >> 3)) >> (j & 7)) & 1u) << 2);
}
__device__ __forceinline__ u32 turbo_idx_m(const u8* b, int bits, int j) {
    if (bits == 8) return b[2 + j];
    if (bits == 4) return (b[2 + (j >> 1)] >> (4 * (j & 1))) & 15u;
    u32 lo = (b[2 + (j >> 2)] >> (2 * (j & 3))) & 3u;
    if (bits == 2) return lo;
    return lo | (((b[18 + (j >> 3)] >> (j & 7)) & 1u) << 2);
}
template <int BITS>
struct KTurbo {
    static constexpr int BS = 64, BB = 2 + 64 * BITS / 8, SV = 128, ROT = 1, HASMIN = 0, NT = 1 << BITS, KBITS = BITS, PVF16 = 0, SUB = 1;
    static __device__ __forceinline__ const float* tab() {
        return BITS == 2 ? KV_LM2 : BITS == 3 ? KV_LM3 : BITS == 4 ? KV_LM4 : KV_LM8;
    }
    static __device__ __forceinline__ const float* thr() {
        return BITS == 2 ? KV_TH2 : BITS == 3 ? KV_TH3 : BITS == 4 ? KV_TH4 : KV_TH8;
    }
    // level / threshold i as a literal (up to 4 bits: cuda_kv.tables_prefix's kv_lm* / kv_th*)
    static __device__ __forceinline__ constexpr float lev_at(int i) {
        return BITS == 2 ? kv_lm2(i) : BITS == 3 ? kv_lm3(i) : BITS == 4 ? kv_lm4(i) : 0.f;
    }
    static __device__ __forceinline__ constexpr float thr_at(int i) {
        return BITS == 2 ? kv_th2(i) : BITS == 3 ? kv_th3(i) : BITS == 4 ? kv_th4(i) : 0.f;
    }
    static __device__ __forceinline__ float scale(const u32* w, int b) { return h2f(wh(w, BB * b)); }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float* t) { return t[turbo_idx_w(w, BB * b, BITS, j)]; }
    // part `sub` of NV values (NV | 64, NV >= 16) of the block at b (SUB: kv_qk's parts of a
    // block): its low-bit payload bytes [2 + sub NV LB / 8, + NV LB / 8) as words, then (turbo3)
    // its high bits [18 + sub NV / 8, + NV / 8); every offset even (2-byte loads)
    static constexpr int LB = BITS == 3 ? 2 : BITS;  // bits of a value in the low payload
    template <int NV> struct SubWords {
        static constexpr int LO = NV * LB / 8, HI = BITS == 3 ? NV / 8 : 0, N = (LO + 3) / 4 + (HI + 3) / 4;
    };
    template <int NV> static __device__ __forceinline__ void sub_words(const u8* b, int sub, u32* w) {
        using S = SubWords<NV>;
        ldw<S::LO, 2>(b + 2 + sub * S::LO, w);
        if constexpr (S::HI > 0) ldw<S::HI, 2>(b + 18 + sub * S::HI, w + (S::LO + 3) / 4);
    }
    // code j < NV of such a part (turbo_idx_w's bit order: value j's low bits at bit LB j of the
    // low words, its high bit at bit j of the high words)
    template <int NV> static __device__ __forceinline__ float sub_code(const u32* w, int j, const float* t) {
        constexpr int PW = 32 / LB;  // values per low word
        u32 ix = (w[j / PW] >> (LB * (j % PW))) & ((1u << LB) - 1u);
        if constexpr (BITS == 3) ix |= ((w[(SubWords<NV>::LO + 3) / 4 + j / 32] >> (j % 32)) & 1u) << 2;
        return t[ix];
    }
    static __device__ __forceinline__ float val(const u8* row, int i, const float* t) {
        const u8* b = row + BB * (i >> 6);
        return h2f(ldh(b)) * t[turbo_idx_m(b, BITS, i & 63)];
    }
    // Level pairs: the index e of values j, j + 1 (j even) is their 2 LB low bits as stored (value
    // j's first) | (turbo3) their two high bits << 4 -- contiguous in the payload, so e takes a
    // shift and a mask (turbo3: two of each) where two single codes take twice that, and one
    // shared-memory load (tp[e], a float2) gives both levels. turbo2: 16 entries, turbo3 64,
    // turbo4 256 (2 KB); turbo8's 65,536 would not fit.
    static constexpr int NP = BITS <= 4 ? NT * NT : 0;
    static __device__ __forceinline__ float2 pair_level(u32 e) {
        constexpr u32 M = (1u << LB) - 1u;
        u32 i0 = e & M, i1 = (e >> LB) & M;
        if constexpr (BITS == 3) {
            i0 |= ((e >> 4) & 1u) << 2;
            i1 |= ((e >> 5) & 1u) << 2;
        }
        return make_float2(tab()[i0], tab()[i1]);
    }
    static __device__ __forceinline__ u32 pair(const u32* w, int b, int j) {  // block b of a segment's words (code()'s)
        const int o = BB * b;
        if (BITS == 4) return wb(w, o + 2 + (j >> 1));
        u32 e = (wb(w, o + 2 + (j >> 2)) >> (2 * (j & 3))) & 15u;
        if (BITS == 3) e |= ((wb(w, o + 18 + (j >> 3)) >> (j & 7)) & 3u) << 4;
        return e;
    }
    template <int NV> static __device__ __forceinline__ u32 sub_pair(const u32* w, int j) {  // a part's words (sub_words)
        constexpr int PW = 32 / LB;
        u32 e = (w[j / PW] >> (LB * (j % PW))) & ((1u << (2 * LB)) - 1u);
        if constexpr (BITS == 3) e |= ((w[(SubWords<NV>::LO + 3) / 4 + j / 32] >> (j % 32)) & 3u) << 4;
        return e;
    }
    // vals<E> through the pair table tp, without the block's scale: returns it (the caller
    // multiplies once per use, not per value); the E values' low bits in one load where they fill
    // 2 bytes or more (2-aligned: lane parts of E LB / 8 bytes), else their byte
    template <int E> static __device__ __forceinline__ float vals2(const u8* row, int i0, const float2* tp, float* vf) {
        static_assert(E % 2 == 0 && E <= 16 && NP > 0, "vals2: pairs of one block's values");
        const u8* b = row + BB * (i0 >> 6);
        const int j0 = i0 & 63;
        constexpr int NLB = E * LB >= 16 ? E * LB / 8 : 1;  // low payload bytes read
        u32 lo[(NLB + 3) / 4], hi = 0;
        if constexpr (NLB == 1) lo[0] = (u32)b[2 + j0 * LB / 8] >> (LB * (j0 % (8 / LB)));
        else ldw<NLB, 2>(b + 2 + j0 * LB / 8, lo);
        if constexpr (BITS == 3) {
            if constexpr (E == 16) hi = ldh(b + 18 + (j0 >> 3));
            else hi = (u32)b[18 + (j0 >> 3)] >> (j0 & 7);
        }
        const float d = h2f(ldh(b));
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            u32 ix = (lo[LB * e / 32] >> (LB * e % 32)) & ((1u << (2 * LB)) - 1u);
            if constexpr (BITS == 3) ix |= ((hi >> e) & 3u) << 4;
            const float2 v = tp[ix];
            vf[e] = v.x;
            vf[e + 1] = v.y;
        }
        return d;
    }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float* t, float* vf) {
        const u8* b = row + BB * (i0 >> 6);
        const int j0 = i0 & 63;
        constexpr int PER = BITS == 8 ? 1 : BITS == 4 ? 2 : 4;  // indices per payload byte (the low bits)
        constexpr int NL = (E + PER - 1) / PER, NH = (E + 7) / 8;
        u32 lo[NL], hi[NH];
#pragma unroll
        for (int k = 0; k < NL; k++) lo[k] = b[2 + j0 / PER + k];
        if constexpr (BITS == 3) {
#pragma unroll
            for (int k = 0; k < NH; k++) hi[k] = b[18 + (j0 >> 3) + k];
        }
        const float d = h2f(ldh(b));
#pragma unroll
        for (int e = 0; e < E; e++) {
            // E >= PER: j0 % PER == 0, byte e / PER; else all E indices share byte 0 (likewise hi)
            const int j = j0 + e;
            u32 ix = (lo[E >= PER ? e / PER : 0] >> ((BITS == 8 ? 0 : BITS == 4 ? 4 : 2) * (j % PER))) &
                     ((1u << (BITS == 3 ? 2 : BITS)) - 1u);
            if constexpr (BITS == 3) ix |= ((hi[E >= 8 ? e >> 3 : 0] >> (j & 7)) & 1u) << 2;
            vf[e] = d * t[ix];
        }
    }
};
typedef KTurbo<8> KTurbo8;
typedef KTurbo<4> KTurbo4;
typedef KTurbo<3> KTurbo3;
typedef KTurbo<2> KTurbo2;

// ---- turbo{2,3}_tcq (tcq.py): value t's state is the 8-bit window at bit t*k of the block's
// circular 64k-bit stream (bytes 2 .. 2+8k of the block)
template <int K>
struct KTcq {
    static constexpr int BS = 64, BB = 2 + 8 * K, SV = 128, ROT = 1, HASMIN = 0, NT = 256, KBITS = K, PVF16 = 0, SUB = 0, NP = 0;
    static constexpr int NSB = 8 * K;  // stream bytes
    static __device__ __forceinline__ const float* tab() { return K == 2 ? KV_TCQ2 : KV_TCQ3; }
    static __device__ __forceinline__ float scale(const u32* w, int b) { return h2f(wh(w, BB * b)); }
    static __device__ __forceinline__ float mn(const u32*, int) { return 0.f; }
    static __device__ __forceinline__ float code(const u32* w, int b, int j, const float* t) {
        int p = j * K, o = BB * b + 2;
        u32 s = (wb(w, o + (p >> 3)) | (wb(w, o + ((p >> 3) + 1) % NSB) << 8)) >> (p & 7);
        return t[s & 255u];
    }
    static __device__ __forceinline__ float val(const u8* row, int i, const float* t) {
        const u8* b = row + BB * (i >> 6);
        int p = (i & 63) * K;
        u32 s = ((u32)b[2 + (p >> 3)] | ((u32)b[2 + ((p >> 3) + 1) % NSB] << 8)) >> (p & 7);
        return h2f(ldh(b)) * t[s & 255u];
    }
    template <int E> static __device__ __forceinline__ void vals(const u8* row, int i0, const float* t, float* vf) {
#pragma unroll
        for (int e = 0; e < E; e++) vf[e] = val(row, i0 + e, t);
    }
};
typedef KTcq<3> KTcq3;
typedef KTcq<2> KTcq2;

// ---- the fast Walsh-Hadamard transform in shared memory (turbo.rotate's order): rows of D
// floats, n_rows of them at stride D; every thread of the block takes part (syncs inside).
// fwd: y = H (s * x) * isqrt; inverse: x = s * (H y) * isqrt. exact: PTX add/sub/mul. The sign
// flips ride on the first butterfly stage's loads and the scaling on the last stage's stores
// (the same operations in the same order: one sync per stage).
template <int D>
__device__ __forceinline__ void fwht_shared(float* v, int n_rows, bool inverse, bool exact) {
    static_assert(D == 32 || D == 64 || D == 128 || D == 256 || D == 512, "fwht_shared: D a power of two, 32 .. 512");
    const int nt = blockDim.x, tid = threadIdx.x;
    constexpr int LD = D >= 512 ? 9 : D >= 256 ? 8 : D >= 128 ? 7 : D >= 64 ? 6 : 5;  // log2 D
#pragma unroll 1
    for (int lh = 0; lh < LD; lh++) {  // stage h = 2^lh: pairs (i, i + h), u = the pair's rank in its row
        const int h = 1 << lh;
        for (int t = tid; t < n_rows * (D / 2); t += nt) {
            const int u = t % (D / 2), i = t / (D / 2) * D + ((u >> lh) << (lh + 1)) + (u & (h - 1)), c = i % D;
            float a = v[i], b = v[i + h];
            if (lh == 0 && !inverse) {  // x * s, exact
                a = kv_neg(c) ? xneg(a) : a;
                b = kv_neg(c + h) ? xneg(b) : b;
            }
            float y0 = exact ? xadd(a, b) : a + b, y1 = exact ? xsub(a, b) : a - b;
            if (lh == LD - 1) {
                y0 = exact ? xmul(y0, kv_isqrt(D)) : y0 * kv_isqrt(D);
                y1 = exact ? xmul(y1, kv_isqrt(D)) : y1 * kv_isqrt(D);
                if (inverse) {
                    y0 = kv_neg(c) ? xneg(y0) : y0;
                    y1 = kv_neg(c + h) ? xneg(y1) : y1;
                }
            }
            v[i] = y0;
            v[i + h] = y1;
        }
        __syncthreads();
    }
}

// fwht_shared of n_rows = NI / D rows held in registers by a block of NT threads: thread t holds
// values i = t + NT k (k < NV; row i / D, dim i % D; those with i >= NI are padding and stay out
// of shared memory). Stages h < 32 by warp shuffles (the thread with bit h clear keeps a + b, its
// partner a - b: fwht_shared's roundings), 32 <= h < NT through buf's two NI-float halves in turn
// (one sync each; buf is free again after the block's next sync), h >= NT inside a thread (values
// k and k + h / NT).
template <int D, int NV, int NI, int NT = 128>
__device__ __forceinline__ void fwht_regs(float (&x)[NV], float* buf, bool inverse) {
    const int tid = threadIdx.x;
    auto valid = [&](int k) { return NI % NT == 0 || tid + NT * k < NI; };
    if (!inverse) {
#pragma unroll
        for (int k = 0; k < NV; k++) x[k] = kv_neg((tid + NT * k) & (D - 1)) ? -x[k] : x[k];
    }
#pragma unroll
    for (int h = 1, s = 0; h < D; h <<= 1) {
        if (h < 32) {
#pragma unroll
            for (int k = 0; k < NV; k++) {
                const float o = __shfl_xor_sync(0xffffffffu, x[k], h);
                x[k] = (tid & h) ? o - x[k] : x[k] + o;
            }
        } else if (h < NT) {
            float* b = buf + s * NI;
            s ^= 1;
#pragma unroll
            for (int k = 0; k < NV; k++) if (valid(k)) b[tid + NT * k] = x[k];
            __syncthreads();
#pragma unroll
            for (int k = 0; k < NV; k++) {
                if (valid(k)) {
                    const float o = b[(tid ^ h) + NT * k];
                    x[k] = (tid & h) ? o - x[k] : x[k] + o;
                }
            }
        } else {
#pragma unroll
            for (int k = 0; k < NV; k++) {
                if ((k & (h / NT)) == 0 && k + h / NT < NV) {
                    const float a = x[k], c = x[k + h / NT];
                    x[k] = a + c;
                    x[k + h / NT] = a - c;
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const float y = x[k] * kv_isqrt(D);
        x[k] = inverse && kv_neg((tid + NT * k) & (D - 1)) ? -y : y;
    }
}

// fwht_shared's exact forward transform of one row held one value per thread (the block's first D
// threads, D a power of two 32 .. 512: thread t holds x_t) with one sync: the stages h < 32 by
// warp shuffles (fwht_regs'), then each thread reads its column c = t % 32 -- the D / 32 values
// c + 32 k -- from sc (D floats, free again after the block's next sync) and runs the stages
// h >= 32 on it in registers: v[k] = y_{c + 32 k}. Every output takes fwht_shared's exact
// operations in their order (y0 = a + b, y1 = a - b, a the lower index; the sign flips first, the
// scaling last), so the bits are fwht_shared's. Three syncs fewer than fwht_regs at D = 256 (the
// KV store's rotation is latency bound: a decode step's few dozen blocks).
// ride (RIDE true): a second value per thread summed over its warp on the way (rope.cuh
// warp_sum's order: xor 16, 8, .., 1, its shuffles interleaved with the transform's, which ptxas
// otherwise issues one chain after the other), the warp's sum stored to ride_sh[warp] before the
// sync: a block sum's first half at no barrier of its own (turbo_row's gain).
// sw: the thread's sign word (kv_sign_word<D>, read before the kernel's wait).
template <int D, bool RIDE = false>
__device__ __forceinline__ void fwht_column(float x, u32 sw, float* sc, float (&v)[D / 32], float ride = 0.f,
                                            float* ride_sh = nullptr) {
    static_assert(D == 32 || D == 64 || D == 128 || D == 256 || D == 512, "fwht_column: D a power of two, 32 .. 512");
    constexpr int NK = D / 32;
    const int tid = threadIdx.x;
    x = (sw >> (tid & 31)) & 1u ? xneg(x) : x;
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, x, h);
        if constexpr (RIDE) ride += __shfl_xor_sync(0xffffffffu, ride, 16 / h);
        x = (tid & h) ? xsub(o, x) : xadd(x, o);
    }
    sc[tid] = x;
    if constexpr (RIDE) {
        if ((tid & 31) == 0) ride_sh[tid >> 5] = ride;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < NK; k++) v[k] = sc[(tid & 31) + 32 * k];
#pragma unroll
    for (int s = 1; s < NK; s <<= 1) {  // stage h = 32 s: pairs (k, k + s), k with bit s clear
#pragma unroll
        for (int k = 0; k < NK; k++) {
            if ((k & s) == 0) {
                const float a = v[k], b = v[k + s];
                v[k] = xadd(a, b);
                v[k + s] = xsub(a, b);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < NK; k++) v[k] = xmul(v[k], kv_isqrt(D));
}

// fwht_column's output y_t of thread t's own value (the q rows' rotation in the fused rope + KV
// store); sw: kv_sign_word<D>; sc: D floats.
template <int D>
__device__ __forceinline__ float fwht_thread(float x, u32 sw, float* sc) {
    float v[D / 32];
    fwht_column<D>(x, sw, sc, v);
    float y = v[0];
#pragma unroll
    for (int k = 1; k < D / 32; k++) y = (int)(threadIdx.x >> 5) == k ? v[k] : y;
    return y;
}
