#version 450
// Rotary position embedding (ggml_rope_ext without YaRN) with a precomputed table.
//
// x, y: f32 [T, H, D]; cs: f32 [T, n_rot / 2, 2] = (cos, sin) of each token's angle
// per pair, computed on the host in float64 as the CPU backend does (so positions
// of any size rotate exactly; no double-precision shader support is needed).
// mode 0 (norm) rotates pairs (2i, 2i+1); mode 2 (neox) pairs (i, i + n_rot/2).
// Dims >= n_rot pass through. One invocation per (t, h, pair).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer XB { float xs[]; };
layout(binding = 1) readonly buffer CB { float cs[]; };
layout(binding = 2) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC { uint T, H, D, n_rot, mode; } p;

void main() {
    uint g = wg_index() * 256u + gl_LocalInvocationID.x;
    uint hp = p.D >> 1, half_ = p.n_rot >> 1;
    if (g >= p.T * p.H * hp) return;
    uint i = g % hp, row = g / hp, t = row / p.H;
    uint o = row * p.D;
    if (i >= half_) {  // pass-through pair of dims n_rot + 2 (i - half) ..
        uint d = p.n_rot + 2u * (i - half_);
        ys[o + d] = xs[o + d];
        ys[o + d + 1u] = xs[o + d + 1u];
        return;
    }
    float c = cs[(t * half_ + i) * 2u], s = cs[(t * half_ + i) * 2u + 1u];
    uint i0 = p.mode == 2u ? i : 2u * i;
    uint i1 = p.mode == 2u ? i + half_ : 2u * i + 1u;
    float x0 = xs[o + i0], x1 = xs[o + i1];
    ys[o + i0] = x0 * c - x1 * s;
    ys[o + i1] = x0 * s + x1 * c;
}
