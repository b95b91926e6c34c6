#version 450
// Recurrent (gated delta-net) layers of the hybrid models: per-sequence state updated in
// place (CPUBackend.ssm_conv / gated_delta_net; llama.cpp ggml_ssm_conv /
// ggml_gated_delta_net; Yang et al. 2024, "Gated Delta Networks").
//
// The recurrent plan (recurrent_state.RSPlan) arrives as int32 meta: view_off[n_views + 1]
// (at vo_off), the views' rows concatenated (at rw_off, in position order), slots[n_views]
// (at sl_off). Sequences are independent; each walks its own rows in order.
//
// SSM_CONV: invocation per (view, channel c): window = state[slot, :, c] (K-1 rows), then
// per row r: y[r, c] = sum_j w[c, j] * (window ++ x[r, c])[j]; the window slides; the last
// K-1 inputs go back to the state. x, y: f32 [T, C]; w: f32 rows of w_stride floats.
// else (delta rule): workgroup per (view, head h, 64 value columns); invocation j owns
// column j of S[slot, h] (d_k floats in registers). Per row: S *= exp(g); kv = S^T k;
// S += k (beta (v - kv))^T; o = scale S^T q. q, k: f32 [T, H, dk]; v, o: [T, H, dv];
// g, beta: [T, H]; state f32 [n_seq, H, dk, dv].
#include "common.glsl"

#define KMAX 8u
#define DKMAX 256u

#ifdef SSM_CONV
layout(local_size_x = 128) in;
layout(binding = 0) readonly buffer XB { float xs[]; };
layout(binding = 1) buffer SB { float st[]; };
layout(binding = 2) readonly buffer WB { float ws[]; };
layout(binding = 3) readonly buffer MB { int meta[]; };
layout(binding = 4) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC { uint C, K, w_stride, vo_off, rw_off, sl_off, x_off, w_off, s_off; } p;

void main() {
    uint vw = gl_WorkGroupID.x, c = gl_WorkGroupID.y * 128u + gl_LocalInvocationID.x;
    if (c >= p.C) return;
    int r0 = meta[p.vo_off + vw], r1 = meta[p.vo_off + vw + 1u];
    uint slot = uint(meta[p.sl_off + vw]);
    uint km = p.K - 1u;
    uint sb = p.s_off + slot * km * p.C + c;
    float win[KMAX];
    float wc[KMAX];
    for (uint j = 0u; j < km; j++) win[j] = st[sb + j * p.C];
    for (uint j = 0u; j < p.K; j++) wc[j] = ws[p.w_off + c * p.w_stride + j];
    for (int i = r0; i < r1; i++) {
        uint r = uint(meta[p.rw_off + uint(i)]);
        float xv = xs[p.x_off + r * p.C + c];
        float acc = 0.0;
        for (uint j = 0u; j < km; j++) acc += wc[j] * win[j];
        acc += wc[km] * xv;
        ys[r * p.C + c] = acc;
        for (uint j = 0u; j + 1u < km; j++) win[j] = win[j + 1u];
        if (km > 0u) win[km - 1u] = xv;
    }
    for (uint j = 0u; j < km; j++) st[sb + j * p.C] = win[j];
}
#else
layout(local_size_x = 64) in;
layout(binding = 0) readonly buffer QB { float qs[]; };
layout(binding = 1) readonly buffer KB { float ks[]; };
layout(binding = 2) readonly buffer VB { float vs[]; };
layout(binding = 3) readonly buffer GB { float gs[]; };
layout(binding = 4) readonly buffer BB { float bs[]; };
layout(binding = 5) buffer SB { float st[]; };
layout(binding = 6) readonly buffer MB { int meta[]; };
layout(binding = 7) writeonly buffer OB { float outs[]; };
layout(push_constant) uniform PC {
    uint H, dk, dv, vo_off, rw_off, sl_off, q_off, k_off, v_off, g_off, be_off, s_off;
    float scale;
} p;

shared float sk[DKMAX], sq[DKMAX];

void main() {
    uint vw = gl_WorkGroupID.x, h = gl_WorkGroupID.y;
    uint j = gl_WorkGroupID.z * 64u + gl_LocalInvocationID.x;
    bool live = j < p.dv;
    int r0 = meta[p.vo_off + vw], r1 = meta[p.vo_off + vw + 1u];
    uint slot = uint(meta[p.sl_off + vw]);
    uint sb = p.s_off + (slot * p.H + h) * p.dk * p.dv + j;
    float S[DKMAX];
    for (uint i = 0u; i < p.dk; i++) S[i] = live ? st[sb + i * p.dv] : 0.0;
    for (int ri = r0; ri < r1; ri++) {
        uint r = uint(meta[p.rw_off + uint(ri)]);
        uint qk = (r * p.H + h) * p.dk;
        for (uint i = gl_LocalInvocationID.x; i < p.dk; i += 64u) {
            sk[i] = ks[p.k_off + qk + i];
            sq[i] = qs[p.q_off + qk + i] * p.scale;
        }
        barrier();
        float decay = exp(gs[p.g_off + r * p.H + h]);
        float beta = bs[p.be_off + r * p.H + h];
        float kv = 0.0;
        for (uint i = 0u; i < p.dk; i++) {
            S[i] *= decay;
            kv += S[i] * sk[i];
        }
        float vj = live ? vs[p.v_off + (r * p.H + h) * p.dv + j] : 0.0;
        float delta = (vj - kv) * beta;
        float o = 0.0;
        for (uint i = 0u; i < p.dk; i++) {
            S[i] += sk[i] * delta;
            o += S[i] * sq[i];
        }
        if (live) outs[(r * p.H + h) * p.dv + j] = o;
        barrier();
    }
    if (live)
        for (uint i = 0u; i < p.dk; i++) st[sb + i * p.dv] = S[i];
}
#endif
