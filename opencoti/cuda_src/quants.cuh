// GGUF block formats, dequantized 32 elements at a time in registers.
//
// Layouts: ggml's ggml-common.h (block_q4_0 ... block_q6_K); dequantization
// order: ggml-quants.c dequantize_row_*. Every supported type is read as
// "chunks" of 32 consecutive elements of a row: chunk c of a 32-element block
// type is block c; a 256-element K-quant super-block holds chunks 8b..8b+7.
// No CUDA headers are included (NVRTC needs none): f16/bf16 are converted with
// PTX cvt instructions.
#include "pdl.cuh"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
// f2h zero-extends the half's bits into a 32-bit register inside the asm: ptxas (nvcc 13 for sm_90; also NVRTC on the H200)
// compiles `st.u8 [p], %rs` whose %rs comes straight from cvt.rn.f16.f32 as a numeric f16 -> u8
// conversion (F2I.U8.F16.TRUNC) instead of storing the low 8 bits, so byte stores of the half's low
// byte (st16 in kv_tiers.cuh) wrote 0. Through a u32 the store gets the bits.
__device__ __forceinline__ u16 f2h(float f) {
    u32 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; cvt.u32.u16 %0, t; }" : "=r"(h) : "f"(f));
    return (u16)h;
}
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 ld16(const u8* p) { return (u16)(p[0] | (p[1] << 8)); }
__device__ __forceinline__ u32 ld32(const u8* p) { return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24); }

// A weight's rows on the device (cuda.py QTensor.tiled). TBS = 0: GGUF rows, block j of row r at
// W + r rb + j BS. TBS = BS, the bytes of a K-quant super-block (Q4_K 144, Q6_K 210), "16-row
// tiles": rows 16 i .. 16 i + 15 keep their 16 rb bytes at W + 16 i rb but lie interleaved block by
// block there, block j of row r at W + (r / 16) 16 rb + (16 j + r % 16) BS, so that one super-block
// of a tile's 16 rows (what a one-token GEMV warp multiplies at a time, gemv_int.cu) is one run of
// 16 BS bytes, and a warp's run of super-blocks one stretch of memory. qrow gives row r's block 0;
// its block j is j * (TBS ? 16 TBS : BS) bytes further; qchunk_row the pointer that Q::chunk (which
// adds (c / 8) BS itself) takes for chunk c of the row.
template <int TBS>
__device__ __forceinline__ const u8* qrow(const u8* W, long long rb, long long r) {
    return TBS ? W + (r >> 4) * 16 * rb + (r & 15) * TBS : W + r * rb;
}
template <int TBS>
__device__ __forceinline__ const u8* qchunk_row(const u8* row, int c) {
    return TBS ? row + (long long)(c >> 3) * 15 * TBS : row;
}

// K-quant 6-bit scale/min pairs packed in 12 bytes (ggml get_scale_min_k4)
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float& d, float& m) {
    if (j < 4) { d = q[j] & 63; m = q[j + 4] & 63; }
    else { d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

struct QF32 {  static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const float* p = (const float*)row + 32 * c;
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = p[i]; } };
struct QF16 {  static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u16* p = (const u16*)row + 32 * c;
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = h2f(p[i]); } };
struct QBF16 { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u16* p = (const u16*)row + 32 * c;
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = bf2f(p[i]); } };

struct QQ4_0 { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 18 * c; float d = h2f(ld16(b)); const u8* qs = b + 2;
#pragma unroll
    for (int i = 0; i < 16; i++) { v[i] = d * ((qs[i] & 15) - 8); v[i + 16] = d * ((qs[i] >> 4) - 8); } } };
struct QQ4_1 { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 20 * c; float d = h2f(ld16(b)), m = h2f(ld16(b + 2)); const u8* qs = b + 4;
#pragma unroll
    for (int i = 0; i < 16; i++) { v[i] = d * (qs[i] & 15) + m; v[i + 16] = d * (qs[i] >> 4) + m; } } };
struct QQ5_0 { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 22 * c; float d = h2f(ld16(b)); u32 qh = ld32(b + 2); const u8* qs = b + 6;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        v[i] = d * ((int)((qs[i] & 15) | (((qh >> i) & 1) << 4)) - 16);
        v[i + 16] = d * ((int)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16); } } };
struct QQ5_1 { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 24 * c; float d = h2f(ld16(b)), m = h2f(ld16(b + 2)); u32 qh = ld32(b + 4); const u8* qs = b + 8;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        v[i] = d * (float)((qs[i] & 15) | (((qh >> i) & 1) << 4)) + m;
        v[i + 16] = d * (float)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) + m; } } };
struct QQ8_0 { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 34 * c; float d = h2f(ld16(b)); const i8* qs = (const i8*)(b + 2);
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = d * qs[i]; } };

struct QQ2_K { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 84 * (c >> 3); int s = c & 7, n = s >> 2, j = s & 3, sh = 2 * j;
    float d = h2f(ld16(b + 80)), dm = h2f(ld16(b + 82));
    const u8* q = b + 16 + 32 * n; u8 s0 = b[2 * s], s1 = b[2 * s + 1];
    float d0 = d * (s0 & 15), m0 = dm * (s0 >> 4), d1 = d * (s1 & 15), m1 = dm * (s1 >> 4);
#pragma unroll
    for (int l = 0; l < 16; l++) { v[l] = d0 * ((q[l] >> sh) & 3) - m0; v[l + 16] = d1 * ((q[l + 16] >> sh) & 3) - m1; } } };

__device__ __forceinline__ int q3k_scale(const u8* sc, int is) {
    int us = is < 4 ? (sc[is] & 0xF) | (((sc[is + 8] >> 0) & 3) << 4)
           : is < 8 ? (sc[is] & 0xF) | (((sc[is + 4] >> 2) & 3) << 4)
           : is < 12 ? (sc[is - 8] >> 4) | (((sc[is] >> 4) & 3) << 4)
           : (sc[is - 8] >> 4) | (((sc[is - 4] >> 6) & 3) << 4);
    return us - 32;
}
struct QQ3_K { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 110 * (c >> 3); int s = c & 7, n = s >> 2, j = s & 3, sh = 2 * j; u8 m = (u8)(1 << s);
    float d = h2f(ld16(b + 108)); const u8* hm = b; const u8* q = b + 32 + 32 * n; const u8* sc = b + 96;
    float d0 = d * q3k_scale(sc, 2 * s), d1 = d * q3k_scale(sc, 2 * s + 1);
#pragma unroll
    for (int l = 0; l < 16; l++) {
        v[l] = d0 * (float)((int)((q[l] >> sh) & 3) - ((hm[l] & m) ? 0 : 4));
        v[l + 16] = d1 * (float)((int)((q[l + 16] >> sh) & 3) - ((hm[l + 16] & m) ? 0 : 4)); } } };
struct QQ4_K { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 144 * (c >> 3); int s = c & 7;
    float d = h2f(ld16(b)), dm = h2f(ld16(b + 2)), sc, mn; scale_min_k4(s, b + 4, sc, mn);
    const u8* q = b + 16 + 32 * (s >> 1); int sh = (s & 1) * 4; float dd = d * sc, mm = dm * mn;
#pragma unroll
    for (int l = 0; l < 32; l++) v[l] = dd * ((q[l] >> sh) & 15) - mm; } };
struct QQ5_K { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 176 * (c >> 3); int s = c & 7;
    float d = h2f(ld16(b)), dm = h2f(ld16(b + 2)), sc, mn; scale_min_k4(s, b + 4, sc, mn);
    const u8* qh = b + 16; const u8* q = b + 48 + 32 * (s >> 1); int sh = (s & 1) * 4; float dd = d * sc, mm = dm * mn;
#pragma unroll
    for (int l = 0; l < 32; l++) v[l] = dd * (float)(((q[l] >> sh) & 15) + (((qh[l] >> s) & 1) << 4)) - mm; } };
struct QQ6_K { static __device__ __forceinline__ void chunk(const u8* row, int c, float* v) {
    const u8* b = row + 210 * (c >> 3); int s = c & 7, h = s >> 2, k = s & 3;
    float d = h2f(ld16(b + 208));
    const u8* ql = b + 64 * h + (k & 1) * 32; const u8* qh = b + 128 + 32 * h; const i8* sc = (const i8*)(b + 192) + 8 * h;
    int ns = (k >> 1) * 4, hs = 2 * k; float d0 = d * sc[2 * k], d1 = d * sc[2 * k + 1];
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int q = (int)(((ql[l] >> ns) & 15) | (((qh[l] >> hs) & 3) << 4)) - 32;
        v[l] = (l < 16 ? d0 : d1) * q; } } };

// X(macro) list: ggml type id, struct
#define FOR_EACH_QTYPE(X) X(0, QF32) X(1, QF16) X(30, QBF16) X(2, QQ4_0) X(3, QQ4_1) X(6, QQ5_0) X(7, QQ5_1) \
    X(8, QQ8_0) X(10, QQ2_K) X(11, QQ3_K) X(12, QQ4_K) X(13, QQ5_K) X(14, QQ6_K)
