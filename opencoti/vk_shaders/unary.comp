#version 450
// Elementwise y = f(x) over n floats: op 0 scale (x * s), 1 gelu_tanh, 2 silu.
#include "common.glsl"

layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer XB { float xs[]; };
layout(binding = 1) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC { uint n, op; float s; } p;

void main() {
    uint i = wg_index() * 256u + gl_LocalInvocationID.x;
    if (i >= p.n) return;
    float v = xs[i];
    ys[i] = p.op == 0u ? v * p.s : (p.op == 1u ? gelu_tanh_f(v) : silu_f(v));
}
