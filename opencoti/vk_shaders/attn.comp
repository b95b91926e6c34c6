#version 450
// Attention over KV cells (paged at cell granularity), flash-decoding style.
//
// Query row r (one token of the ubatch) belongs to view vw = row_view[r]; its
// candidate cells are cells[view_off[vw] .. view_off[vw + 1]) (flat indices
// stream * n_cells + cell into K/V [n_cells_total, n_kv, D]) at positions
// cell_pos[]. A cell is visible when cell_pos <= q_pos and, with n_swa > 0,
// q_pos - cell_pos < n_swa (llama.cpp's standard SWA). GQA: query head h reads
// kv head h / G. Scores get softcap * tanh(s / softcap) when softcap > 0.
// meta holds row_view, view_off, cells and cell_pos (int32) at the *_off offsets.
//
// Grid (T, n_kv, n_split * n_gsub): a workgroup takes up to 8 query heads of one
// kv head (sub-group gs of ceil(G / 8)) and split sp of the view's cells. It walks
// its cells in tiles of 128: each thread scores one cell against the group's
// heads (q in shared memory), an online softmax (Milakov & Gimelshein 2018)
// rescales the running sums, and each thread accumulates its pairs of output
// dims over the tile. n_split == 1 writes normalised rows out[T, n_head, D];
// otherwise unnormalised partials out[(r, h, sp), D] and (m, l) pairs at ml_off,
// merged by attn_merge.comp (log-sum-exp, Dao et al., flash-decoding).
// KV_F16: K/V are f16 pairs in 32-bit words; KV_ANY: K and V each in the tier whose
// code (kv_quant.glsl) is tk / tv, rows of rbk / rbv bytes, dequantized in registers
// (blocks of 32 values for the q* tiers: D % 32 == 0); else f32. D even, <= 512.
// Rotated tiers (turbo*, *_tcq; D a power of two): their rows hold y = R x per 64-value
// block (kv_tiers/turbo.py); since R is orthonormal, q . k = (R q) . y_k and
// sum_c p_c x_c = R^T sum_c p_c y_c. So with K rotated, each head's q is rotated once in
// shared memory (sign flips, butterfly, * rs) and scored against the dequantized y; with V
// rotated, the (partial) output is accumulated in the rotated domain and un-rotated once
// per head before it is written (linear, so split-K partials merge as before). Levels come
// from the tables buffer (binding 6, kv_quant.glsl).
#include "common.glsl"
#ifdef KV_ANY
#include "kv_quant.glsl"
#endif

layout(local_size_x = 128) in;
layout(binding = 0) readonly buffer QB { float qs[]; };
layout(binding = 1) readonly buffer KB { uint K[]; };
layout(binding = 2) readonly buffer VB { uint V[]; };
layout(binding = 3) readonly buffer MB { int meta[]; };
layout(binding = 4) readonly buffer PB { int qpos[]; };
layout(binding = 5) writeonly buffer OB { float outs[]; };
#ifdef KV_ANY
layout(binding = 6) readonly buffer TB { float tab[]; };
#endif
layout(push_constant) uniform PC {
    uint n_head, n_kv, D, G, n_split, n_gsub;
    float scale; int n_swa; float softcap;
    uint rv_off, vo_off, cl_off, cp_off, qp_off, ml_off;
#ifdef KV_ANY
    uint tk, tv, rbk, rbv;
    float rs;  // float32(1 / sqrt(D)): the rotation's scale
#endif
} p;

#define MAXG 8u
#define DMAX 512u
#define TC 128u
#define PPT 2u            // dim pairs per thread: DMAX / 2 / 128
#define NEG (-3.0e38)     // "no score": finite, so no driver needs IEEE infinities

shared float sq[MAXG * DMAX];
shared float sp[MAXG * TC];
shared float sm[MAXG], sl[MAXG], scr[MAXG];
shared int scell[TC];

#ifdef KV_ANY
uint kvw(bool is_k, uint w) { return is_k ? K[w] : V[w]; }
uint kvb(bool is_k, uint b) { return (kvw(is_k, b >> 2) >> ((b & 3u) << 3)) & 0xFFu; }
float kvh(bool is_k, uint b) { return unpackHalf2x16((kvw(is_k, b >> 2) >> ((b & 2u) << 3)) & 0xFFFFu).x; }

// dims 2j, 2j+1 of KV row `row` (cell * n_kv + kv head), as kv_tiers/scalar.py dequantizes
vec2 kv_pair(uint row, uint j, bool is_k) {
    uint t = is_k ? p.tk : p.tv;
    uint rb = row * (is_k ? p.rbk : p.rbv);
    if (t == KVT_F32) {
        uint w = (rb >> 2) + 2u * j;
        return vec2(uintBitsToFloat(kvw(is_k, w)), uintBitsToFloat(kvw(is_k, w + 1u)));
    }
    if (t == KVT_F16) return unpackHalf2x16(kvw(is_k, (rb >> 2) + j));
    if (t == KVT_BF16) {
        uint w = kvw(is_k, (rb >> 2) + j);
        return vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xFFFF0000u));
    }
    if (kvt_rotated(t)) {  // values 2j, 2j+1 of the rotated row: scale * level
        uint i = 2u * j, m = i & 63u, nb = kvt_block_bytes(t), bits = kvt_bits(t);
        uint bb = rb + (i >> 6) * nb;
        float d = kvh(is_k, bb);
        uint lev = KVT_LEV(t);
        uint c0, c1;
        if (kvt_tcq(t)) {  // the 8-bit window of the circular stream starting at bit m * k
            uint nbits = 64u * bits;
            uint p0 = m * bits, p1 = p0 + bits;
            uint w0 = kvb(is_k, bb + 2u + (p0 >> 3)) | (kvb(is_k, bb + 2u + (((p0 >> 3) + 1u) % (nbits >> 3))) << 8);
            uint w1 = kvb(is_k, bb + 2u + (p1 >> 3)) | (kvb(is_k, bb + 2u + (((p1 >> 3) + 1u) % (nbits >> 3))) << 8);
            c0 = (w0 >> (p0 & 7u)) & 255u;
            c1 = (w1 >> (p1 & 7u)) & 255u;
        } else if (bits == 8u) {
            c0 = kvb(is_k, bb + 2u + m);
            c1 = kvb(is_k, bb + 3u + m);
        } else if (bits == 4u) {
            uint b = kvb(is_k, bb + 2u + (m >> 1));  // m even: the pair shares a byte
            c0 = b & 15u;
            c1 = b >> 4;
        } else {
            uint b = kvb(is_k, bb + 2u + (m >> 2)) >> (2u * (m & 3u));  // m even: same byte
            c0 = b & 3u;
            c1 = (b >> 2) & 3u;
            if (bits == 3u) {
                uint hb = kvb(is_k, bb + 18u + (m >> 3)) >> (m & 7u);
                c0 |= (hb & 1u) << 2;
                c1 |= ((hb >> 1) & 1u) << 2;
            }
        }
        return vec2(tab[lev + c0] * d, tab[lev + c1] * d);
    }
    uint i = 2u * j, k = i & 31u;                  // value k, k + 1 of block i / 32
    uint bb = rb + (i >> 5) * kvt_block_bytes(t);  // the block's first byte
    float d = kvh(is_k, bb);
    if (t == KVT_Q8_0) {
        int q0 = int(kvb(is_k, bb + 2u + k) << 24) >> 24, q1 = int(kvb(is_k, bb + 3u + k) << 24) >> 24;
        return vec2(float(q0) * d, float(q1) * d);
    }
    uint qs0 = t == KVT_Q6_0 ? 10u : (t == KVT_Q5_1 ? 8u : (t == KVT_Q5_0 ? 6u : (t == KVT_Q4_1 ? 4u : 2u)));
    uint sh = k < 16u ? 0u : 4u;
    uint q0 = (kvb(is_k, bb + qs0 + (k & 15u)) >> sh) & 15u, q1 = (kvb(is_k, bb + qs0 + (k & 15u) + 1u) >> sh) & 15u;
    if (t == KVT_Q4_0) return vec2(float(int(q0) - 8) * d, float(int(q1) - 8) * d);
    if (t == KVT_IQ4_NL) return vec2(IQ4NL[q0] * d, IQ4NL[q1] * d);
    if (t == KVT_Q4_1) {
        precise vec2 r = vec2(float(q0), float(q1)) * d + kvh(is_k, bb + 2u);  // q * d + m
        return r;
    }
    if (t == KVT_Q6_0) {  // high 2 bits: h_m = qh[m % 8] >> 4 (m / 8), bits 0-1 for k < 16, 2-3 above
        uint m = k & 15u, hs = k < 16u ? 0u : 2u;
        uint h0 = (kvb(is_k, bb + 2u + (m & 7u)) >> (4u * (m >> 3))) >> hs;
        uint h1 = (kvb(is_k, bb + 2u + ((m + 1u) & 7u)) >> (4u * ((m + 1u) >> 3))) >> hs;
        q0 |= (h0 & 3u) << 4;
        q1 |= (h1 & 3u) << 4;
        return vec2(float(int(q0) - 32) * d, float(int(q1) - 32) * d);
    }
    uint qh0 = bb + (t == KVT_Q5_1 ? 4u : 2u);     // bit k of the uint32 qh = bit 4 of value k
    q0 |= ((kvb(is_k, qh0 + (k >> 3)) >> (k & 7u)) & 1u) << 4;
    q1 |= ((kvb(is_k, qh0 + ((k + 1u) >> 3)) >> ((k + 1u) & 7u)) & 1u) << 4;
    if (t == KVT_Q5_0) return vec2(float(int(q0) - 16) * d, float(int(q1) - 16) * d);
    precise vec2 r = vec2(float(q0), float(q1)) * d + kvh(is_k, bb + 2u);  // q5_1: q * d + m
    return r;
}
// in-place butterfly (unnormalized Walsh-Hadamard) over rows g < ng of sq; ends with a barrier
void fwht_sq(uint tid, uint ng, uint D) {
    for (uint h = 1u; h < D; h <<= 1) {
        barrier();
        for (uint e = tid; e < ng * (D >> 1); e += 128u) {
            uint g = e / (D >> 1), q = e % (D >> 1);
            uint i = g * DMAX + (q / h) * 2u * h + (q % h);
            float a = sq[i], b = sq[i + h];
            sq[i] = a + b;
            sq[i + h] = a - b;
        }
    }
    barrier();
}
#else
vec2 kv_pair(uint row, uint j, bool is_k) {  // dims 2j, 2j+1 of KV row `row` (cell * n_kv + kv head)
    uint w = row * (p.D >> 1) + j;
#ifdef KV_F16
    return unpackHalf2x16(is_k ? K[w] : V[w]);
#else
    return is_k ? vec2(uintBitsToFloat(K[2u * w]), uintBitsToFloat(K[2u * w + 1u]))
                : vec2(uintBitsToFloat(V[2u * w]), uintBitsToFloat(V[2u * w + 1u]));
#endif
}
#endif

void main() {
    uint r = gl_WorkGroupID.x, kh = gl_WorkGroupID.y;
    uint spl = gl_WorkGroupID.z / p.n_gsub, gs = gl_WorkGroupID.z % p.n_gsub;
    uint tid = gl_LocalInvocationID.x;
    uint h0 = kh * p.G + gs * MAXG;
    uint ng = min(MAXG, p.G - gs * MAXG);
    uint D = p.D, hp = D >> 1;
    int qp = qpos[p.qp_off + r];
    int vw = meta[p.rv_off + r];
    int b0 = meta[p.vo_off + vw], len = meta[p.vo_off + vw + 1] - b0;
    int chunk = (len + int(p.n_split) - 1) / int(p.n_split);
    int c0 = b0 + int(spl) * chunk, c1 = min(b0 + len, c0 + chunk);

    for (uint e = tid; e < ng * D; e += 128u) {
        uint g = e / D, d = e % D;
        sq[g * DMAX + d] = qs[(r * p.n_head + h0 + g) * D + d] * p.scale;
    }
#ifdef KV_ANY
    if (kvt_rotated(p.tk)) {  // q -> R q per head: sign flips and rs, then the butterfly
        barrier();
        for (uint e = tid; e < ng * D; e += 128u) sq[(e / D) * DMAX + e % D] *= tab[e % D] * p.rs;
        fwht_sq(tid, ng, D);
    }
#endif
    if (tid < MAXG) { sm[tid] = NEG; sl[tid] = 0.0; scr[tid] = 0.0; }
    float acc[MAXG][2 * PPT];
    for (uint g = 0u; g < MAXG; g++)
        for (uint k = 0u; k < 2u * PPT; k++) acc[g][k] = 0.0;
    barrier();

    for (int base = c0; base < c1; base += int(TC)) {
        // 1. one cell per thread: visibility and scores against every head of the group
        int i = base + int(tid);
        int cell = -1;
        if (i < c1) {
            int cp = meta[p.cp_off + i];
            if (cp <= qp && (p.n_swa <= 0 || qp - cp < p.n_swa)) cell = meta[p.cl_off + i];
        }
        scell[tid] = cell;
        float s[MAXG];
        for (uint g = 0u; g < MAXG; g++) s[g] = 0.0;
        if (cell >= 0) {
            uint krow = uint(cell) * p.n_kv + kh;
            for (uint j = 0u; j < hp; j++) {
                vec2 k2 = kv_pair(krow, j, true);
                for (uint g = 0u; g < MAXG; g++) {
                    if (g < ng) s[g] += sq[g * DMAX + 2u * j] * k2.x + sq[g * DMAX + 2u * j + 1u] * k2.y;
                }
            }
        }
        for (uint g = 0u; g < ng; g++) {
            float v = s[g];
            if (p.softcap > 0.0) v = p.softcap * tanh_safe(v / p.softcap);
            sp[g * TC + tid] = cell >= 0 ? v : NEG;
        }
        barrier();
        // 2. online softmax per head: new max, rescale factor, probabilities
        if (tid < ng) {
            uint g = tid;
            float mx = sm[g];
            for (uint j = 0u; j < TC; j++) if (scell[j] >= 0) mx = max(mx, sp[g * TC + j]);
            float corr = sm[g] > NEG ? exp(sm[g] - mx) : 0.0;
            float sum = 0.0;
            for (uint j = 0u; j < TC; j++) {
                float pj = scell[j] >= 0 ? exp(sp[g * TC + j] - mx) : 0.0;
                sp[g * TC + j] = pj;
                sum += pj;
            }
            sl[g] = sl[g] * corr + sum;
            sm[g] = mx;
            scr[g] = corr;
        }
        barrier();
        // 3. accumulate V: each thread owns dim pairs tid + 128 k
        for (uint g = 0u; g < MAXG; g++) {
            if (g < ng) {
                float f = scr[g];
                for (uint k = 0u; k < 2u * PPT; k++) acc[g][k] *= f;
            }
        }
        for (uint k = 0u; k < PPT; k++) {
            uint j2 = tid + 128u * k;
            if (j2 >= hp) break;
            for (uint j = 0u; j < TC; j++) {
                int c = scell[j];
                if (c < 0) continue;
                vec2 v2 = kv_pair(uint(c) * p.n_kv + kh, j2, false);
                for (uint g = 0u; g < MAXG; g++) {
                    if (g < ng) {
                        float pr = sp[g * TC + j];
                        acc[g][2u * k] += pr * v2.x;
                        acc[g][2u * k + 1u] += pr * v2.y;
                    }
                }
            }
        }
        barrier();
    }

#ifdef KV_ANY
    if (kvt_rotated(p.tv)) {  // acc -> R^T acc per head, through sq (free now)
        for (uint g = 0u; g < MAXG; g++) {
            if (g < ng) {
                for (uint k = 0u; k < PPT; k++) {
                    uint j2 = tid + 128u * k;
                    if (j2 >= hp) break;
                    sq[g * DMAX + 2u * j2] = acc[g][2u * k];
                    sq[g * DMAX + 2u * j2 + 1u] = acc[g][2u * k + 1u];
                }
            }
        }
        fwht_sq(tid, ng, D);
        for (uint g = 0u; g < MAXG; g++) {
            if (g < ng) {
                for (uint k = 0u; k < PPT; k++) {
                    uint j2 = tid + 128u * k;
                    if (j2 >= hp) break;
                    acc[g][2u * k] = sq[g * DMAX + 2u * j2] * p.rs * tab[2u * j2];
                    acc[g][2u * k + 1u] = sq[g * DMAX + 2u * j2 + 1u] * p.rs * tab[2u * j2 + 1u];
                }
            }
        }
    }
#endif
    for (uint g = 0u; g < ng; g++) {
        uint h = h0 + g;
        for (uint k = 0u; k < PPT; k++) {
            uint j2 = tid + 128u * k;
            if (j2 >= hp) break;
            if (p.n_split == 1u) {
                float inv = sl[g] > 0.0 ? 1.0 / sl[g] : 0.0;
                uint o = (r * p.n_head + h) * D + 2u * j2;
                outs[o] = acc[g][2u * k] * inv;
                outs[o + 1u] = acc[g][2u * k + 1u] * inv;
            } else {
                uint pi = (r * p.n_head + h) * p.n_split + spl;
                outs[pi * D + 2u * j2] = acc[g][2u * k];
                outs[pi * D + 2u * j2 + 1u] = acc[g][2u * k + 1u];
            }
        }
        if (p.n_split > 1u && tid == 0u) {
            uint pi = (r * p.n_head + h) * p.n_split + spl;
            outs[p.ml_off + 2u * pi] = sm[g];
            outs[p.ml_off + 2u * pi + 1u] = sl[g];
        }
    }
}
