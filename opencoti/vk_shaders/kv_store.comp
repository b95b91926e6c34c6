#version 450
// Store T tokens' K (or V) rows into KV cells in any KV tier (kv_quant.glsl codes),
// quantizing on the way with the bytes of kv_tiers/scalar.py's reference quantizers.
//
// src: f32 [T, n] (n = n_kv * d values per token, from element src_off); dst: the
// layer's storage viewed as 32-bit words, cell c at byte c * cell_bytes (cell_bytes =
// n / block values * block bytes); cell[t] = meta[cell_off + t] (flat stream * n_cells + cell).
// One invocation per unit: a value (f32), a pair of values (f16, bf16: one word) or a
// 32-value block (q*). A block's bytes need not be word-aligned: words it shares with a
// neighbouring block (of another cell or of this one) are updated with atomicAnd/atomicOr
// on its own bytes only, so concurrent blocks never clobber each other.
#include "common.glsl"
#include "kv_quant.glsl"

layout(local_size_x = 128) in;
layout(binding = 0) readonly buffer SB { float src[]; };
layout(binding = 1) buffer DB { uint dst[]; };
layout(binding = 2) readonly buffer MB { int meta[]; };
layout(push_constant) uniform PC { uint T, n, type, cell_off, src_off, cell_bytes; } p;

uint by[34];

// bytes by[0 .. nb) to byte b0 of dst
void put_bytes(uint b0, uint nb) {
    uint w0 = b0 >> 2, w1 = (b0 + nb - 1u) >> 2;
    for (uint w = w0; w <= w1; w++) {
        uint val = 0u, mask = 0u;
        for (uint k = 0u; k < 4u; k++) {
            uint b = 4u * w + k;
            if (b >= b0 && b < b0 + nb) {
                val |= by[b - b0] << (8u * k);
                mask |= 0xFFu << (8u * k);
            }
        }
        if (mask == 0xFFFFFFFFu) {
            dst[w] = val;
        } else {
            atomicAnd(dst[w], ~mask);
            atomicOr(dst[w], val);
        }
    }
}

void put16(uint at, uint h) { by[at] = h & 0xFFu; by[at + 1u] = (h >> 8) & 0xFFu; }

void main() {
    uint t = p.type;
    uint upt = t == KVT_F32 ? p.n : (t <= KVT_BF16 ? p.n / 2u : p.n / 32u);  // units per token
    uint g = wg_index() * 128u + gl_LocalInvocationID.x;
    if (g >= p.T * upt) return;
    uint tok = g / upt, u = g % upt;
    uint c = uint(meta[p.cell_off + tok]);
    uint s0 = p.src_off + tok * p.n;
    if (t == KVT_F32) {
        dst[c * p.n + u] = floatBitsToUint(src[s0 + u]);
        return;
    }
    if (t == KVT_F16) {
        dst[c * (p.n / 2u) + u] = f32_to_f16(src[s0 + 2u * u]) | (f32_to_f16(src[s0 + 2u * u + 1u]) << 16);
        return;
    }
    if (t == KVT_BF16) {
        dst[c * (p.n / 2u) + u] = f32_to_bf16(src[s0 + 2u * u]) | (f32_to_bf16(src[s0 + 2u * u + 1u]) << 16);
        return;
    }
    float x[32];
    for (uint j = 0u; j < 32u; j++) x[j] = src[s0 + 32u * u + j];
    // the value of largest magnitude (first on ties), min and max
    float amax = 0.0, mx = 0.0, lo = x[0], hi = x[0];
    for (uint j = 0u; j < 32u; j++) {
        float a = abs(x[j]);
        if (a > amax) { amax = a; mx = x[j]; }
        lo = min(lo, x[j]);
        hi = max(hi, x[j]);
    }
    uint q[32];
    uint nb = kvt_block_bytes(t);
    if (t == KVT_Q8_0) {
        float d = div_rn(amax, 127.0);
        float id = inv_or_zero(d);
        put16(0u, f32_to_f16(d));
        for (uint j = 0u; j < 32u; j++) {
            precise float v = x[j] * id;
            by[2u + j] = uint(int(roundf_c(v))) & 0xFFu;
        }
    } else if (t == KVT_Q5_1) {
        precise float span = hi - lo;
        float d = div_rn(span, 31.0);
        float id = inv_or_zero(d);
        put16(0u, f32_to_f16(d));
        put16(2u, f32_to_f16(lo));
        for (uint j = 0u; j < 32u; j++) {
            precise float v = (x[j] - lo) * id + 0.5;
            q[j] = uint(trunc(v));
        }
    } else if (t == KVT_Q4_1) {  // q5_1's form with 15 steps, codes clamped to 15
        precise float span = hi - lo;
        float d = div_rn(span, 15.0);
        float id = inv_or_zero(d);
        put16(0u, f32_to_f16(d));
        put16(2u, f32_to_f16(lo));
        for (uint j = 0u; j < 32u; j++) {
            precise float v = (x[j] - lo) * id + 0.5;
            q[j] = min(15u, uint(trunc(v)));
        }
    } else if (t == KVT_IQ4_NL) {  // nearest level of x / d0, then the weighted least-squares scale
        float d = 0.0;
        if (amax >= 1e-15) {
            float d0 = div_rn(mx, -127.0);
            float id = div_rn(1.0, d0);
            precise float sqx = 0.0, sq2 = 0.0;
            for (uint j = 0u; j < 32u; j++) {
                precise float al = id * x[j];
                q[j] = iq4nl_index(al);
                precise float wq = (x[j] * x[j]) * IQ4NL[q[j]];
                sqx = sqx + wq * x[j];
                sq2 = sq2 + wq * IQ4NL[q[j]];
            }
            d = div_rn(sqx, sq2);
        } else {
            for (uint j = 0u; j < 32u; j++) q[j] = 8u;  // scalar.py: the level nearest 0
        }
        put16(0u, f32_to_f16(d));
    } else {  // q6_0, q5_0, q4_0: d = mx / -2^(bits-1), q = min(qmax, trunc(x / d + 2^(bits-1) + 0.5))
        float half_ = t == KVT_Q6_0 ? 32.0 : (t == KVT_Q5_0 ? 16.0 : 8.0);
        uint qmax = t == KVT_Q6_0 ? 63u : (t == KVT_Q5_0 ? 31u : 15u);
        float d = div_rn(mx, -half_);
        float id = inv_or_zero(d);
        put16(0u, f32_to_f16(d));
        for (uint j = 0u; j < 32u; j++) {
            precise float v = x[j] * id + (half_ + 0.5);
            q[j] = min(qmax, uint(max(trunc(v), 0.0)));
        }
    }
    if (t != KVT_Q8_0) {
        // low nibbles: qs[j] = (q_j & 15) | (q_{j+16} & 15) << 4, after the scale(s) and qh
        uint qs0 = t == KVT_Q6_0 ? 10u : (t == KVT_Q5_1 ? 8u : (t == KVT_Q5_0 ? 6u : (t == KVT_Q4_1 ? 4u : 2u)));
        for (uint j = 0u; j < 16u; j++) by[qs0 + j] = (q[j] & 15u) | ((q[j + 16u] & 15u) << 4);
        if (t == KVT_Q6_0) {  // h_j = (q_j >> 4) | (q_{j+16} >> 4) << 2 into qh[j % 8] at bit 4 (j / 8)
            for (uint j = 0u; j < 8u; j++) {
                uint h0 = (q[j] >> 4) | ((q[j + 16u] >> 4) << 2);
                uint h1 = (q[j + 8u] >> 4) | ((q[j + 24u] >> 4) << 2);
                by[2u + j] = h0 | (h1 << 4);
            }
        } else if (t == KVT_Q5_1 || t == KVT_Q5_0) {  // qh: bit j = bit 4 of q_j, uint32 LE
            uint qh = 0u;
            for (uint j = 0u; j < 32u; j++) qh |= ((q[j] >> 4) & 1u) << j;
            uint at = t == KVT_Q5_1 ? 4u : 2u;
            for (uint k = 0u; k < 4u; k++) by[at + k] = (qh >> (8u * k)) & 0xFFu;
        }
    }
    put_bytes(c * p.cell_bytes + u * nb, nb);
}
