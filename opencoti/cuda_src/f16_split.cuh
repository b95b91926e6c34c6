// float32 operands of f16 tensor-core products as two f16 terms, x = hi + lo with hi = f16(x)
// and lo = f16(x - hi): against an exact f16 operand (K / V rows) both products are exact, so
// hi * k + lo * k keeps ~2^-22 relative accuracy instead of f16's 2^-11 (the split-operand idea
// of CUTLASS's 3xTF32 emulation; Markidis et al. 2018).
#include "quants.cuh"
#include "mma.cuh"

__device__ __forceinline__ u16 sp_f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// (hi, lo) f16x2 pairs of two floats (a in the low half: the lower column index). LO = 2048: lo
// scaled by 2^11, lo = f16((x - hi) 2^11), a normal f16 down to |x| ~ 2^-13 (unscaled, lo leaves
// the normal range below |x| ~ 2^-3); a product with that lo takes its other operand times 2^-11
// (H2_2M11; exact where that operand stays on f16's grid). No overflow: |x - hi| <= |x| 2^-11.
template <int LO = 1>
__device__ __forceinline__ void sp_split2(float a, float b, u32& hi, u32& lo) {
    u16 ah = sp_f2h(a), bh = sp_f2h(b);
    u16 al = sp_f2h((a - h2f(ah)) * (float)LO), bl = sp_f2h((b - h2f(bh)) * (float)LO);
    hi = (u32)ah | ((u32)bh << 16);
    lo = (u32)al | ((u32)bl << 16);
}
#define H2_2M11 0x10001000u  // f16x2 (2^-11, 2^-11): the other operand of a 2^11-scaled lo

// f16x2 arithmetic (round to nearest)
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) { u32 d; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) { u32 d; asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
// (hi, lo) of integer code pair c (f16x2) times block scales d2: hi = f16(c d), lo = c d - hi
// (fma; exact while lo is a normal f16, at any normal scale)
__device__ __forceinline__ void scale_pair(u32 c, u32 d2, u32& hi, u32& lo) {
    hi = hmul2(c, d2);
    lo = hfma2(c, d2, hi ^ 0x80008000u);
}

// A query's staging factor: 2^e with e = exponent(mx) - 13 when the largest |q * scale| of the
// query, mx, reaches 2^14 (inf included), else 1; q * scale / factor < 2^15 keeps the f16 hi term
// finite, and the query's scores are multiplied back by the factor (exact: a power of two).
__device__ __forceinline__ float sp_stage_factor(float mx) {
    const int e = mx >= 16384.f ? ((__float_as_int(mx) >> 23) & 0xff) - 127 - 13 : 0;
    return __int_as_float((127 + e) << 23);
}

// The A fragments (mma.cuh) of a 16 x 16 f16 tile at p (row-major, ld halves per row; p points at
// row gid, column 2 tig): a[0..3]
__device__ __forceinline__ void ld_a_frag(const u16* p, int ld, u32 (&a)[4]) {
    a[0] = *(const u32*)p; a[1] = *(const u32*)(p + 8 * ld); a[2] = *(const u32*)(p + 8); a[3] = *(const u32*)(p + 8 * ld + 8);
}

// P's A fragments as hi + lo from the score fragments of two n8 tiles (16 cells: s0 the first 8)
__device__ __forceinline__ void split_p(const float (&s0)[4], const float (&s1)[4], u32 (&ph)[4], u32 (&pl)[4]) {
    sp_split2(s0[0], s0[1], ph[0], pl[0]);
    sp_split2(s0[2], s0[3], ph[1], pl[1]);
    sp_split2(s1[0], s1[1], ph[2], pl[2]);
    sp_split2(s1[2], s1[3], ph[3], pl[3]);
}

// o += (ph + pl) V for 16 cells of f16 V rows in shared memory: vrow = row (lane & 15) of the 16,
// column (lane >> 4) * 8; V's B fragments by ldmatrix .trans (ldsm4t), two n8 tiles of dims each
template <int ND>
__device__ __forceinline__ void pv_f16(float (&o)[ND][4], const u32 (&ph)[4], const u32 (&pl)[4], const u16* vrow) {
#pragma unroll
    for (int nd = 0; nd < ND; nd += 2) {
        u32 b[4];
        ldsm4t(vrow + nd * 8, b);
        mma_m16n8k16(o[nd], ph[0], ph[1], ph[2], ph[3], b[0], b[1]);
        mma_m16n8k16(o[nd], pl[0], pl[1], pl[2], pl[3], b[0], b[1]);
        mma_m16n8k16(o[nd + 1], ph[0], ph[1], ph[2], ph[3], b[2], b[3]);
        mma_m16n8k16(o[nd + 1], pl[0], pl[1], pl[2], pl[3], b[2], b[3]);
    }
}
