// Shared helpers of the opencoti compute shaders (included after #version).
//
// Conventions (see opencoti/engine/backend/vulkan.py):
// - every buffer is a storage buffer of 32-bit words (float, int or uint), so no
//   8/16-bit storage feature is needed: f16 pairs are read with unpackHalf2x16 and
//   written with f32_to_f16 below; quantized blocks are read byte-wise from words;
// - grids larger than 65535 workgroups fold into (x, y): wg_index() is the flat id;
// - push constants carry shapes and the element offset of each bound window.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

uint wg_index() { return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x; }

// numerically safe tanh (GLSL's may overflow to NaN for large |x| on some drivers)
float tanh_safe(float x) {
    float t = exp(-2.0 * abs(x));
    return sign(x) * (1.0 - t) / (1.0 + t);
}

// GELU, tanh approximation (ggml_gelu); sqrt(2/pi) = 0.7978845608028654
float gelu_tanh_f(float x) { return 0.5 * x * (1.0 + tanh_safe(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
float silu_f(float x) { return x / (1.0 + exp(-x)); }

// float -> IEEE half bits, round to nearest even (as NumPy's astype(float16)),
// with overflow to inf, subnormals and NaN; done in integers so every driver agrees.
uint f32_to_f16(float f) {
    uint x = floatBitsToUint(f);
    uint sgn = (x >> 16) & 0x8000u;
    uint ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return sgn | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u);  // inf / nan
    if (ax >= 0x477FF000u) return sgn | 0x7C00u;  // rounds to >= 65520: inf
    if (ax < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
        if (ax < 0x33000000u) return sgn;  // < 2^-25: rounds to 0
        uint e = ax >> 23;                  // 102 .. 112
        uint m = (ax & 0x7FFFFFu) | 0x800000u;
        uint shift = 126u - e;              // 14 .. 24
        uint h = m >> shift;
        uint rem = m & ((1u << shift) - 1u);
        uint half_ = 1u << (shift - 1u);
        if (rem > half_ || (rem == half_ && (h & 1u) != 0u)) h += 1u;
        return sgn | h;
    }
    uint h = ((ax >> 13) - (112u << 10));   // rebias exponent 127 -> 15
    uint rem = ax & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0u)) h += 1u;
    return sgn | h;
}
