#version 450
// Merge attention partials over n_split disjoint cell slices (flash-decoding):
// out[r, h, :] = sum_s acc_s e^{m_s - M} / sum_s l_s e^{m_s - M}, M = max_s m_s.
// part: acc [(r, h, s), D] then (m, l) pairs at ml_off (see attn.comp; m <= -1e38
// marks an empty slice). Grid (T, n_head); 128 threads over D.
#include "common.glsl"

layout(local_size_x = 128) in;
layout(binding = 0) readonly buffer PB { float part[]; };
layout(binding = 1) writeonly buffer OB { float outs[]; };
layout(push_constant) uniform PC { uint n_head, D, n_split, ml_off; } p;

void main() {
    uint rh = gl_WorkGroupID.x * p.n_head + gl_WorkGroupID.y;
    float M = -3.0e38;
    for (uint s = 0u; s < p.n_split; s++) M = max(M, part[p.ml_off + 2u * (rh * p.n_split + s)]);
    for (uint d = gl_LocalInvocationID.x; d < p.D; d += 128u) {
        float L = 0.0, A = 0.0;
        for (uint s = 0u; s < p.n_split; s++) {
            uint pi = rh * p.n_split + s;
            float ms = part[p.ml_off + 2u * pi];
            if (ms <= -1.0e38) continue;
            float f = exp(ms - M);
            L += part[p.ml_off + 2u * pi + 1u] * f;
            A += part[pi * p.D + d] * f;
        }
        outs[rh * p.D + d] = L > 0.0 ? A / L : 0.0;
    }
}
