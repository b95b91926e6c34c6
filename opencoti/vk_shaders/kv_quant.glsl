// KV cache tiers (opencoti/engine/kv_tiers/scalar.py): type codes, block sizes and the
// float32 arithmetic their reference quantizers use, reproduced bit for bit.
//
// Type codes (push constants of kv_store.comp, kv_rot.comp and attn.comp's KV_ANY variant;
// vulkan.py KV_TIER_CODES): 0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q6_0, 5 q5_1,
// 6 q5_0, 7 q4_0, 8 q4_1, 9 iq4_nl, and the rotated tiers (kv_tiers/turbo.py, tcq.py;
// kv_rot.comp writes them) 10 turbo8, 11 turbo4, 12 turbo3, 13 turbo2, 14 turbo3_tcq,
// 15 turbo2_tcq. Block types 3..9 hold 32 values and start with an f16 scale; see
// scalar.py's table for the byte layout of each (ggml-common.h block_q8_0 / q5_1 / q5_0 /
// q4_1 / q4_0 / iq4_nl, ik_llama.cpp q6_0); the rotated tiers hold 64 rotated values per
// block after an f16 scale.
//
// The rotated tiers' tables (vulkan.py _kv_tables, one float32 buffer): [0, 512) the sign
// flips (+1 / -1, _tables.SIGNS_HEX); for code t >= 10, at KVT_LEV(t) the reconstruction
// levels (LLOYD_MAX[bits] or TCQ[k], up to 256) and at KVT_LEV(t) + 256 the float32
// decision midpoints (c[i] + c[i+1]) / 2 of the turbo tiers.
//
// Bit-exactness: Vulkan guarantees correctly rounded +, -, * but not /, and may fuse a*b+c;
// so divisions go through div_rn (integer long division, round to nearest even) and the
// quantizers' expressions are `precise` (no contraction), as the NumPy reference computes
// them in float32 with one rounding per operation.

#define KVT_F32 0u
#define KVT_F16 1u
#define KVT_BF16 2u
#define KVT_Q8_0 3u
#define KVT_Q6_0 4u
#define KVT_Q5_1 5u
#define KVT_Q5_0 6u
#define KVT_Q4_0 7u
#define KVT_Q4_1 8u
#define KVT_IQ4_NL 9u
#define KVT_TURBO8 10u
#define KVT_TURBO4 11u
#define KVT_TURBO3 12u
#define KVT_TURBO2 13u
#define KVT_TCQ3 14u
#define KVT_TCQ2 15u
#define KVT_LEV(t) (512u * ((t) - KVT_TURBO8 + 1u))

// iq4_nl's levels (ggml-common.h kvalues_iq4nl, scalar.py IQ4_NL_LEVELS), in units of d
const float IQ4NL[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                  1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);

bool kvt_rotated(uint t) { return t >= KVT_TURBO8; }
bool kvt_tcq(uint t) { return t >= KVT_TCQ3; }
// bits per value of a rotated tier (turbo{bits}, turbo{k}_tcq)
uint kvt_bits(uint t) { return t == KVT_TURBO8 ? 8u : t == KVT_TURBO4 ? 4u : (t == KVT_TURBO3 || t == KVT_TCQ3) ? 3u : 2u; }

uint kvt_block_bytes(uint t) {  // bytes of one block (32 values; 64 for the rotated tiers)
    if (t >= KVT_TURBO8) return 2u + 8u * kvt_bits(t);
    return t == KVT_Q8_0 ? 34u : t == KVT_Q6_0 ? 26u : t == KVT_Q5_1 ? 24u : t == KVT_Q5_0 ? 22u
         : t == KVT_Q4_1 ? 20u : 18u;
}

// a / b in float32, correctly rounded (round to nearest even) for normal a, b and a normal
// result; zero a gives a signed zero; anything else (subnormal, inf, nan) falls back to a / b.
float div_rn(float a, float b) {
    uint ua = floatBitsToUint(a), ub = floatBitsToUint(b);
    uint sg = (ua ^ ub) & 0x80000000u;
    if ((ua & 0x7FFFFFFFu) == 0u) return uintBitsToFloat(sg);
    uint ea = (ua >> 23) & 255u, eb = (ub >> 23) & 255u;
    if (ea == 0u || eb == 0u || ea == 255u || eb == 255u) return a / b;
    uint ma = (ua & 0x7FFFFFu) | 0x800000u, mb = (ub & 0x7FFFFFu) | 0x800000u;
    int e = int(ea) - int(eb) + 127;
    if (ma < mb) { ma <<= 1; e -= 1; }   // now ma / mb in [1, 2)
    uint q = 0u, r = ma;                 // 24 quotient bits + 1 round bit; r < 2 mb < 2^25
    for (int i = 0; i < 25; i++) {
        q <<= 1;
        if (r >= mb) { r -= mb; q |= 1u; }
        r <<= 1;
    }
    uint sig = q >> 1;
    if ((q & 1u) != 0u && (r != 0u || (sig & 1u) != 0u)) sig += 1u;
    if (sig == 0x1000000u) { sig >>= 1; e += 1; }
    if (e <= 0 || e >= 255) return a / b;
    return uintBitsToFloat(sg | (uint(e) << 23) | (sig & 0x7FFFFFu));
}

// C roundf: nearest integer, halves away from zero (exact: v - trunc(v) is exact)
float roundf_c(float v) {
    float t = trunc(v);
    return abs(v - t) >= 0.5 ? t + sign(v) : t;
}

// d ? 1/d : 0 (scalar.py _inv)
float inv_or_zero(float d) { return d != 0.0 ? div_rn(1.0, d) : 0.0; }

// float32 -> bfloat16 bits, round to nearest even, NaN -> quiet NaN (ggml_compute_fp32_to_bf16)
uint f32_to_bf16(float f) {
    uint u = floatBitsToUint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 64u;
    return (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;
}

// ggml best_index_int8(16, kvalues_iq4nl, x) (scalar.py best_index_iq4nl): the nearest
// level's index, an exact midpoint to the upper one, NaN to 15
uint iq4nl_index(float x) {
    if (x <= IQ4NL[0]) return 0u;
    if (x >= IQ4NL[15] || isnan(x)) return 15u;
    uint ml = 0u, mu = 15u;
    while (mu - ml > 1u) {
        uint m = (ml + mu) / 2u;
        if (x < IQ4NL[m]) mu = m; else ml = m;
    }
    precise float below = x - IQ4NL[mu - 1u], above = IQ4NL[mu] - x;
    return below < above ? mu - 1u : mu;
}

// 64-bit unsigned compare of (ah, al) with (bh, bl): -1, 0, 1
int cmp64(uint ah, uint al, uint bh, uint bl) {
    if (ah != bh) return ah < bh ? -1 : 1;
    if (al != bl) return al < bl ? -1 : 1;
    return 0;
}

// sign of (A * 2^ea)^2 - X * 2^ex for integers A < 2^26, X < 2^24 (exact; needs
// 0 <= ex - 2 ea < 40, else returns 0 = unknown)
int cmp_sq(uint A, int ea, uint X, int ex) {
    int k = ex - 2 * ea;
    if (k < 0 || k >= 40) return 0;
    uint ph, pl;
    umulExtended(A, A, ph, pl);
    uint xh = k >= 32 ? X << uint(k - 32) : (k == 0 ? 0u : X >> uint(32 - k));
    uint xl = k >= 32 ? 0u : X << uint(k);
    return cmp64(ph, pl, xh, xl);
}

// sqrt(x) in float32, correctly rounded (IEEE, as NumPy's) for normal x > 0: the driver's
// sqrt (which Vulkan allows to be a few ulp off) corrected by exact integer comparisons of
// x with the squares of the midpoints to its neighbours (a midpoint's square is never a
// float, so there are no ties). Zero, subnormal, inf and NaN: the driver's sqrt.
float sqrt_rn(float x) {
    uint ux = floatBitsToUint(x);
    uint bx = ux >> 23;
    if (bx == 0u || bx >= 255u) return sqrt(x);
    uint X = (ux & 0x7FFFFFu) | 0x800000u;
    int ex = int(bx) - 150;                     // x = X * 2^ex
    float s = sqrt(x);
    for (int it = 0; it < 8; it++) {
        uint us = floatBitsToUint(s);
        uint bs = us >> 23;
        if (bs == 0u || bs >= 255u) return s;
        uint M = (us & 0x7FFFFFu) | 0x800000u;
        int es = int(bs) - 150;                 // s = M * 2^es
        if (cmp_sq(2u * M + 1u, es - 1, X, ex) < 0) { s = uintBitsToFloat(us + 1u); continue; }  // x above the upper midpoint
        bool lo_binade = M == 0x800000u;        // the lower neighbour is in the binade below: half the gap
        int lo = lo_binade ? cmp_sq(4u * M - 1u, es - 2, X, ex) : cmp_sq(2u * M - 1u, es - 1, X, ex);
        if (lo > 0) { s = uintBitsToFloat(us - 1u); continue; }  // x below the lower midpoint
        return s;
    }
    return s;
}
