#version 450
// RMSNorm over rows of n floats (ggml rms_norm + mul): y = x / sqrt(mean(x^2) + eps) * w.
// x, y: f32 [rows, n]; w: f32 [n] (ignored when has_w == 0). One workgroup per row.
// l2 != 0: L2 norm instead (ggml_l2_norm): y = x / max(sqrt(sum(x^2)), eps).
#include "common.glsl"

layout(local_size_x = 128) in;
layout(binding = 0) readonly buffer XB { float xs[]; };
layout(binding = 1) readonly buffer WB { float ws[]; };
layout(binding = 2) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC { uint n, rows, has_w; float eps; uint l2; } p;

shared float red[128];

void main() {
    uint r = wg_index();
    if (r >= p.rows) return;  // uniform per workgroup
    uint tid = gl_LocalInvocationID.x, o = r * p.n;
    float s = 0.0;
    for (uint i = tid; i < p.n; i += 128u) { float v = xs[o + i]; s += v * v; }
    red[tid] = s;
    barrier();
    for (uint st = 64u; st > 0u; st >>= 1) {
        if (tid < st) red[tid] += red[tid + st];
        barrier();
    }
    float sc = p.l2 != 0u ? 1.0 / max(sqrt(red[0]), p.eps) : 1.0 / sqrt(red[0] / float(p.n) + p.eps);
    for (uint i = tid; i < p.n; i += 128u) {
        float v = xs[o + i] * sc;
        ys[o + i] = p.has_w != 0u ? v * ws[i] : v;
    }
}
