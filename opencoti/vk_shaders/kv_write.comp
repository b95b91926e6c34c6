#version 450
// Store T tokens' K and V into KV cells: K[cell[t], :] = k[t, :] (kw floats per
// token), V likewise (vw floats). KV_F16: storage is f16 pairs in 32-bit words
// (round to nearest even, as NumPy); else f32. cell[t]: flat cell index
// (stream * n_cells + cell), int32 at meta[cell_off + t].
#include "common.glsl"

layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer KB { float ks[]; };
layout(binding = 1) readonly buffer VB { float vs[]; };
layout(binding = 2) writeonly buffer KS { uint K[]; };
layout(binding = 3) writeonly buffer VS { uint V[]; };
layout(binding = 4) readonly buffer MB { int meta[]; };
layout(push_constant) uniform PC { uint T, kw, vw, cell_off; } p;

#ifdef KV_F16
#define EPW 2u
#else
#define EPW 1u
#endif

void main() {
    uint kwd = p.kw / EPW, vwd = p.vw / EPW;
    uint W = max(kwd, vwd);
    uint g = wg_index() * 256u + gl_LocalInvocationID.x;
    if (g >= p.T * W) return;
    uint t = g / W, j = g % W;
    uint c = uint(meta[p.cell_off + t]);
#ifdef KV_F16
    if (j < kwd) K[c * kwd + j] = f32_to_f16(ks[t * p.kw + 2u * j]) | (f32_to_f16(ks[t * p.kw + 2u * j + 1u]) << 16);
    if (j < vwd) V[c * vwd + j] = f32_to_f16(vs[t * p.vw + 2u * j]) | (f32_to_f16(vs[t * p.vw + 2u * j + 1u]) << 16);
#else
    if (j < kwd) K[c * kwd + j] = floatBitsToUint(ks[t * p.kw + j]);
    if (j < vwd) V[c * vwd + j] = floatBitsToUint(vs[t * p.vw + j]);
#endif
}
