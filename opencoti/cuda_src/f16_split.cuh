// float32 operands of f16 tensor-core products as two f16 terms, x = hi + lo with hi = f16(x)
// and lo = f16(x - hi): against an exact f16 operand (K / V rows) both products are exact, so
// hi * k + lo * k keeps ~2^-22 relative accuracy instead of f16's 2^-11 (the split-operand idea
// of CUTLASS's 3xTF32 emulation; Markidis et al. 2018).
#include "quants.cuh"

__device__ __forceinline__ u16 sp_f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// (hi, lo) f16x2 pairs of two floats (a in the low half: the lower column index)
__device__ __forceinline__ void sp_split2(float a, float b, u32& hi, u32& lo) {
    u16 ah = sp_f2h(a), bh = sp_f2h(b);
    u16 al = sp_f2h(a - h2f(ah)), bl = sp_f2h(b - h2f(bh));
    hi = (u32)ah | ((u32)bh << 16);
    lo = (u32)al | ((u32)bl << 16);
}

// A query's staging factor: 2^e with e = exponent(mx) - 13 when the largest |q * scale| of the
// query, mx, reaches 2^14 (inf included), else 1; q * scale / factor < 2^15 keeps the f16 hi term
// finite, and the query's scores are multiplied back by the factor (exact: a power of two).
__device__ __forceinline__ float sp_stage_factor(float mx) {
    const int e = mx >= 16384.f ? ((__float_as_int(mx) >> 23) & 0xff) - 127 - 13 : 0;
    return __int_as_float((127 + e) << 23);
}
