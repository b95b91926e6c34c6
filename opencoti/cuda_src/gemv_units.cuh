// GGUF blocks read as "units" for the decode GEMV: a unit is the part of a block that
// one lane handles, R runs of 4 consecutive row elements (4*R values), chosen so that
// the 32 lanes of a warp read consecutive 32-bit words of the row's bytes (one 128-byte
// transaction per load instruction for the quant bits; scales are warp broadcasts).
// This is ggml-cuda mmvq's thread layout (vdr ints per thread), with f32 activations.
//
//   Q::R                       runs per unit
//   Q::unit(row, u, v, p)      unit u of a row: v[r][0..3] = values, at row elements
//                              p[r] .. p[r] + 3 (p[r] % 4 == 0)
//
// Layouts: ggml-common.h; element order: ggml-quants.c dequantize_row_*. Blocks of 18,
// 22, 34, 110, 210 bytes are only 2-byte aligned: their words are read as two u16.
#include "quants.cuh"

__device__ __forceinline__ u32 ldw2(const u8* p) {  // 32-bit word at a 2-aligned address
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}
__device__ __forceinline__ u32 ldw4(const u8* p) { return *(const u32*)p; }
__device__ __forceinline__ float hf(const u8* p) { return h2f(*(const u16*)p); }
// q - bias as float for a small unsigned q (< 2^22) and integer bias, exactly, without the
// int->float conversion (quarter rate on sm_80/sm_90): the bits 0x4B000000 | q are the
// float 2^23 + q, and subtracting 2^23 + bias is exact. The GEMV is instruction-bound on
// these conversions (one per weight).
__device__ __forceinline__ float qf(u32 q, float bias) { return __int_as_float(0x4B000000u | q) - (8388608.f + bias); }

struct UF32 { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        const float4* s = (const float4*)row + 2 * u;
        float4 a = s[0], b = s[1];
        v[0][0] = a.x; v[0][1] = a.y; v[0][2] = a.z; v[0][3] = a.w;
        v[1][0] = b.x; v[1][1] = b.y; v[1][2] = b.z; v[1][3] = b.w;
        p[0] = 8 * u; p[1] = 8 * u + 4; } };
struct UF16 { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        uint4 w = ((const uint4*)row)[u];
        u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i >> 1][(i & 1) * 2] = h2f((u16)(ws[i] & 0xFFFF));
            v[i >> 1][(i & 1) * 2 + 1] = h2f((u16)(ws[i] >> 16));
        }
        p[0] = 8 * u; p[1] = 8 * u + 4; } };
struct UBF16 { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        uint4 w = ((const uint4*)row)[u];
        u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i >> 1][(i & 1) * 2] = __uint_as_float(ws[i] << 16);
            v[i >> 1][(i & 1) * 2 + 1] = __uint_as_float(ws[i] & 0xFFFF0000u);
        }
        p[0] = 8 * u; p[1] = 8 * u + 4; } };

// 32-element blocks: 4 units per block, unit l covers qs bytes 4l..4l+3 (low nibbles:
// elements 4l.., high nibbles: 16 + 4l..).
struct UQ4_0 { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 2, l = u & 3; const u8* blk = row + 18 * b;
        float d = hf(blk); u32 w = ldw2(blk + 2 + 4 * l);
#pragma unroll
        for (int k = 0; k < 4; k++) { u32 q = (w >> (8 * k)) & 255; v[0][k] = d * qf(q & 15, 8.f); v[1][k] = d * qf(q >> 4, 8.f); }
        p[0] = 32 * b + 4 * l; p[1] = p[0] + 16; } };
struct UQ4_1 { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 2, l = u & 3; const u8* blk = row + 20 * b;
        float d = hf(blk), m = hf(blk + 2); u32 w = ldw4(blk + 4 + 4 * l);
#pragma unroll
        for (int k = 0; k < 4; k++) { u32 q = (w >> (8 * k)) & 255; v[0][k] = d * qf(q & 15, 0.f) + m; v[1][k] = d * qf(q >> 4, 0.f) + m; }
        p[0] = 32 * b + 4 * l; p[1] = p[0] + 16; } };
struct UQ5_0 { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 2, l = u & 3; const u8* blk = row + 22 * b;
        float d = hf(blk); u32 qh = ldw2(blk + 2), w = ldw2(blk + 6 + 4 * l);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = 4 * l + k; u32 q = (w >> (8 * k)) & 255;
            v[0][k] = d * qf((q & 15) | (((qh >> i) & 1) << 4), 16.f);
            v[1][k] = d * qf((q >> 4) | (((qh >> (i + 16)) & 1) << 4), 16.f); }
        p[0] = 32 * b + 4 * l; p[1] = p[0] + 16; } };
struct UQ5_1 { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 2, l = u & 3; const u8* blk = row + 24 * b;
        float d = hf(blk), m = hf(blk + 2); u32 qh = ldw4(blk + 4), w = ldw4(blk + 8 + 4 * l);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = 4 * l + k; u32 q = (w >> (8 * k)) & 255;
            v[0][k] = d * qf((q & 15) | (((qh >> i) & 1) << 4), 0.f) + m;
            v[1][k] = d * qf((q >> 4) | (((qh >> (i + 16)) & 1) << 4), 0.f) + m; }
        p[0] = 32 * b + 4 * l; p[1] = p[0] + 16; } };
struct UQ8_0 { static constexpr int R = 2;  // unit l: qs bytes 8l..8l+7
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 2, l = u & 3; const u8* blk = row + 34 * b;
        float d = hf(blk); u32 w0 = ldw2(blk + 2 + 8 * l), w1 = ldw2(blk + 6 + 8 * l);
#pragma unroll
        for (int k = 0; k < 4; k++) {  // signed byte b = (b ^ 0x80) - 128
            v[0][k] = d * qf(((w0 >> (8 * k)) & 255) ^ 0x80, 128.f); v[1][k] = d * qf(((w1 >> (8 * k)) & 255) ^ 0x80, 128.f); }
        p[0] = 32 * b + 8 * l; p[1] = p[0] + 4; } };

// 256-element K-quant super-blocks.
// Q4_K / Q5_K: 32 units per block; unit w = 8j + i holds qs word w: low nibbles are
// elements 64j + 4i.., high nibbles 64j + 32 + 4i.. (sub-blocks 2j and 2j+1).
// 256-element K-quant super-blocks.
// Q4_K / Q5_K: 32 units per block; unit w = 8j + i holds qs word w: low nibbles are
// elements 64j + 4i.., high nibbles 64j + 32 + 4i.. (sub-blocks 2j and 2j+1).
struct UQ4_K { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 5, w = u & 31, j = w >> 3, i = w & 7; const u8* blk = row + 144 * b;
        float d = hf(blk), dm = hf(blk + 2), s0, m0, s1, m1;
        scale_min_k4(2 * j, blk + 4, s0, m0); scale_min_k4(2 * j + 1, blk + 4, s1, m1);
        float d0 = d * s0, n0 = dm * m0, d1 = d * s1, n1 = dm * m1;
        u32 q = ldw4(blk + 16 + 4 * w);
#pragma unroll
        for (int k = 0; k < 4; k++) { u32 c = (q >> (8 * k)) & 255; v[0][k] = d0 * qf(c & 15, 0.f) - n0; v[1][k] = d1 * qf(c >> 4, 0.f) - n1; }
        p[0] = 256 * b + 64 * j + 4 * i; p[1] = p[0] + 32; } };
// Q4_K for one token row (gemv1, gated): 8 units per block, 32 values each (16 quant bytes in one 16-byte load; d/dmin in
// one word; the 12 scale bytes in three words): unit w = 2j + h covers qs bytes
// 32j + 16h.. : low nibbles are elements 64j + 16h.., high nibbles 64j + 32 + 16h..
struct UQ4_K32 { static constexpr int R = 8;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 3, w = u & 7, j = w >> 1, h = w & 1; const u8* blk = row + 144 * b;
        u32 dd = ldw4(blk);
        float d = h2f((u16)(dd & 0xFFFF)), dm = h2f((u16)(dd >> 16));
        u32 sw[3] = {ldw4(blk + 4), ldw4(blk + 8), ldw4(blk + 12)};
        const u8* sc = (const u8*)sw;
        float s0, m0, s1, m1;
        scale_min_k4(2 * j, sc, s0, m0); scale_min_k4(2 * j + 1, sc, s1, m1);
        float d0 = d * s0, n0 = dm * m0, d1 = d * s1, n1 = dm * m1;
        uint4 q4 = *(const uint4*)(blk + 16 + 32 * j + 16 * h);
        u32 qs[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int r = 0; r < 4; r++) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u32 c = (qs[r] >> (8 * k)) & 255;
                v[r][k] = d0 * qf(c & 15, 0.f) - n0;
                v[4 + r][k] = d1 * qf(c >> 4, 0.f) - n1;
            }
            p[r] = 256 * b + 64 * j + 16 * h + 4 * r;
            p[4 + r] = p[r] + 32;
        } } };
struct UQ5_K { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 5, w = u & 31, j = w >> 3, i = w & 7; const u8* blk = row + 176 * b;
        float d = hf(blk), dm = hf(blk + 2), s0, m0, s1, m1;
        scale_min_k4(2 * j, blk + 4, s0, m0); scale_min_k4(2 * j + 1, blk + 4, s1, m1);
        float d0 = d * s0, n0 = dm * m0, d1 = d * s1, n1 = dm * m1;
        u32 q = ldw4(blk + 48 + 4 * w), h = ldw4(blk + 16 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 c = (q >> (8 * k)) & 255, hb = (h >> (8 * k)) & 255;
            v[0][k] = d0 * qf((c & 15) | (((hb >> (2 * j)) & 1) << 4), 0.f) - n0;
            v[1][k] = d1 * qf((c >> 4) | (((hb >> (2 * j + 1)) & 1) << 4), 0.f) - n1; }
        p[0] = 256 * b + 64 * j + 4 * i; p[1] = p[0] + 32; } };
// Q6_K: 32 units per block; unit w: half n = w / 16, ql word r = w % 16 of that half.
// r < 8: ql[l] for l = 4r..: low nibble -> element 128n + l (qh bits 0-1), high -> +64 (bits 4-5);
// r >= 8: ql[l + 32], l = 4(r - 8)..: low -> 128n + 32 + l (bits 2-3), high -> +64 (bits 6-7).
struct UQ6_K { static constexpr int R = 2;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 5, w = u & 31, n = w >> 4, r = w & 15, hi = r >> 3, l0 = 4 * (r & 7);
        const u8* blk = row + 210 * b;
        float d = hf(blk + 208);
        u32 ql = ldw2(blk + 64 * n + 4 * r), qh = ldw2(blk + 128 + 32 * n + l0);
        const signed char* sc = (const signed char*)(blk + 192) + 8 * n + (l0 >> 4) + 2 * hi;
        float da = d * sc[0], db = d * sc[4];
        int sa = 2 * hi, sb = 4 + 2 * hi;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 c = (ql >> (8 * k)) & 255, h = (qh >> (8 * k)) & 255;
            v[0][k] = da * qf((c & 15) | (((h >> sa) & 3) << 4), 32.f);
            v[1][k] = db * qf((c >> 4) | (((h >> sb) & 3) << 4), 32.f); }
        p[0] = 256 * b + 128 * n + 32 * hi + l0; p[1] = p[0] + 64; } };
// Q2_K / Q3_K: 16 units per block, 4 runs each; unit w: half n = w / 8, lb = 4 (w % 8):
// quant bytes q[32n + lb..], shift 2j gives elements 128n + 32j + lb.. (j = 0..3),
// sub-block scale index 8n + 2j + (lb >= 16).
struct UQ2_K { static constexpr int R = 4;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 4, w = u & 15, n = w >> 3, lb = 4 * (w & 7); const u8* blk = row + 84 * b;
        float d = hf(blk + 80), dm = hf(blk + 82);
        u32 q = ldw4(blk + 16 + 32 * n + lb);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 s = blk[8 * n + 2 * j + (lb >= 16)];
            float dl = d * (s & 15), ml = dm * (s >> 4);
#pragma unroll
            for (int k = 0; k < 4; k++) v[j][k] = dl * ((q >> (8 * k + 2 * j)) & 3) - ml;
            p[j] = 256 * b + 128 * n + 32 * j + lb; } } };
struct UQ3_K { static constexpr int R = 4;
    static __device__ __forceinline__ void unit(const u8* row, int u, float (&v)[R][4], int (&p)[R]) {
        int b = u >> 4, w = u & 15, n = w >> 3, lb = 4 * (w & 7); const u8* blk = row + 110 * b;
        float d = hf(blk + 108);
        u32 q = ldw2(blk + 32 + 32 * n + lb), hm = ldw2(blk + lb);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float dl = d * q3k_scale(blk + 96, 8 * n + 2 * j + (lb >= 16));
            int bit = 4 * n + j;
#pragma unroll
            for (int k = 0; k < 4; k++)
                v[j][k] = dl * (float)((int)((q >> (8 * k + 2 * j)) & 3) - (((hm >> (8 * k + bit)) & 1) ? 0 : 4));
            p[j] = 256 * b + 128 * n + 32 * j + lb; } } };

// X(macro) list: ggml type id, unit for one token row, unit for tiles of 8 rows (wide
// units need fewer loads per value but hold more registers per token row)
#define FOR_EACH_UTYPE(X) X(0, UF32, UF32) X(1, UF16, UF16) X(30, UBF16, UBF16) X(2, UQ4_0, UQ4_0) \
    X(3, UQ4_1, UQ4_1) X(6, UQ5_0, UQ5_0) X(7, UQ5_1, UQ5_1) X(8, UQ8_0, UQ8_0) X(10, UQ2_K, UQ2_K) \
    X(11, UQ3_K, UQ3_K) X(12, UQ4_K32, UQ4_K) X(13, UQ5_K, UQ5_K) X(14, UQ6_K, UQ6_K)
