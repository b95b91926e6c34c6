#version 450
// Elementwise y = f(x) over n floats: op 0 scale (x * s), 1 gelu_tanh, 2 silu,
// 3 sigmoid (0.5 (1 + tanh(x / 2)), overflow-free), 4 softplus (max(x, 0) + ln(1 + e^-|x|)).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer XB { float xs[]; };
layout(binding = 1) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC { uint n, op; float s; } p;

void main() {
    uint i = wg_index() * 256u + gl_LocalInvocationID.x;
    if (i >= p.n) return;
    float v = xs[i];
    float y;
    if (p.op == 0u) y = v * p.s;
    else if (p.op == 1u) y = gelu_tanh_f(v);
    else if (p.op == 2u) y = silu_f(v);
    else if (p.op == 3u) y = 0.5 * (1.0 + tanh_safe(0.5 * v));
    else y = max(v, 0.0) + log(1.0 + exp(-abs(v)));
    ys[i] = y;
}
