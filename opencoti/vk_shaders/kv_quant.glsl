// KV cache tiers (opencoti/engine/kv_tiers/scalar.py): type codes, block sizes and the
// float32 arithmetic their reference quantizers use, reproduced bit for bit.
//
// Type codes (push constants of kv_store.comp and attn.comp's KV_ANY variant; the order
// of vulkan.py KV_TIER_CODES): 0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q6_0, 5 q5_1, 6 q5_0, 7 q4_0.
// Block types hold 32 values and start with an f16 scale; see scalar.py's table for the
// byte layout of each (ggml-common.h block_q8_0 / q5_1 / q5_0 / q4_0, ik_llama.cpp q6_0).
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

uint kvt_block_bytes(uint t) {  // bytes of one 32-value block (block types only)
    return t == KVT_Q8_0 ? 34u : t == KVT_Q6_0 ? 26u : t == KVT_Q5_1 ? 24u : t == KVT_Q5_0 ? 22u : 18u;
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
