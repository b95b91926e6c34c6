#version 450
// Elementwise y[i] = a[i] (op) b[i % m] over n floats (b broadcast over rows when
// m < n, e.g. a bias): op 0 add, 1 mul, 2 gelu_tanh(a) * b, 3 silu(a) * b (gated FFN).
// div > 1: b[(i / div) % m] instead (b [rows, 1] against a [rows, div]: one value per row).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer AB { float as_[]; };
layout(binding = 1) readonly buffer BB { float bs[]; };
layout(binding = 2) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC { uint n, m, op, div; } p;

void main() {
    uint i = wg_index() * 256u + gl_LocalInvocationID.x;
    if (i >= p.n) return;
    float a = as_[i], b = bs[(i / p.div) % p.m];
    float y;
    if (p.op == 0u) y = a + b;
    else if (p.op == 1u) y = a * b;
    else if (p.op == 2u) y = gelu_tanh_f(a) * b;
    else y = silu_f(a) * b;
    ys[i] = y;
}
