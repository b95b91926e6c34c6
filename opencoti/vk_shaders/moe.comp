#version 450
// Mixture-of-experts routing and combination (llama.cpp build_moe_ffn, softmax gating;
// CPUBackend.moe_ffn / moe_ffn_gate_up).
//
// MOE_ROUTE: one invocation per token t: p = softmax(logits[t, :n_exp]); the k experts
// with the largest p (ties: lower expert id first) -> sel[t, :k] (int32), their weights
// p[sel] -> w[t, :k] (float32), divided by their sum when norm_w != 0, times w_scale
// when w_scale != 0. logits from element l_off.
// else (combine): out[t, j] = sum_s w[t, s] * ds[sel[t, s]] * y[t * k + s, j] (ds: the
// per-expert output scale when has_ds != 0, else 1); one invocation per (t, j).
#include "common.glsl"

#define MAXK 32u

#ifdef MOE_ROUTE
layout(local_size_x = 64) in;
layout(binding = 0) readonly buffer LB { float logits[]; };
layout(binding = 1) writeonly buffer SB { int sel[]; };
layout(binding = 2) writeonly buffer WB { float wout[]; };
layout(push_constant) uniform PC { uint T, n_exp, k, norm_w; float w_scale; uint l_off; } p;

void main() {
    uint t = wg_index() * 64u + gl_LocalInvocationID.x;
    if (t >= p.T) return;
    uint b = p.l_off + t * p.n_exp;
    float m = logits[b];
    for (uint e = 1u; e < p.n_exp; e++) m = max(m, logits[b + e]);
    float sum = 0.0;
    for (uint e = 0u; e < p.n_exp; e++) sum += exp(logits[b + e] - m);
    uint chosen[MAXK];
    float pw[MAXK];
    float wsum = 0.0;
    for (uint s = 0u; s < p.k; s++) {
        int best = -1;
        float bv = 0.0;
        for (uint e = 0u; e < p.n_exp; e++) {
            bool taken = false;
            for (uint r = 0u; r < s; r++) taken = taken || chosen[r] == e;
            if (taken) continue;
            float pe = exp(logits[b + e] - m) / sum;
            if (best < 0 || pe > bv) { best = int(e); bv = pe; }
        }
        chosen[s] = uint(best);
        pw[s] = bv;
        wsum += bv;
    }
    for (uint s = 0u; s < p.k; s++) {
        float w = pw[s];
        if (p.norm_w != 0u) w = w / wsum;
        if (p.w_scale != 0.0) w = w * p.w_scale;
        sel[t * p.k + s] = int(chosen[s]);
        wout[t * p.k + s] = w;
    }
}
#else
layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer YB { float ys[]; };
layout(binding = 1) readonly buffer WB { float ws[]; };
layout(binding = 2) readonly buffer SB { int sel[]; };
layout(binding = 3) readonly buffer DB { float ds[]; };
layout(binding = 4) writeonly buffer OB { float outs[]; };
layout(push_constant) uniform PC { uint T, k, n, has_ds; } p;

void main() {
    uint g = wg_index() * 256u + gl_LocalInvocationID.x;
    if (g >= p.T * p.n) return;
    uint t = g / p.n, j = g % p.n;
    float acc = 0.0;
    for (uint s = 0u; s < p.k; s++) {
        float w = ws[t * p.k + s];
        if (p.has_ds != 0u) w *= ds[sel[t * p.k + s]];
        acc += w * ys[(t * p.k + s) * p.n + j];
    }
    outs[g] = acc;
}
#endif
