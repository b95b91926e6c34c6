#version 450
// Store T tokens' K (or V) rows into KV cells in a rotated tier (turbo8/4/3/2,
// turbo3_tcq, turbo2_tcq: kv_quant.glsl codes 8..13), quantizing on the device with the
// exact float32 operations of kv_tiers/turbo.py (module doc, "Arithmetic") and, for the
// trellis tiers, the tail-biting Viterbi search of kv_tiers/trellis.py, so the bytes equal
// the CPU tier's quantize.
//
// src: f32 [T, n_kv, D] from element src_off; dst: the layer's storage as 32-bit words,
// cell c at byte c * cell_bytes, head h at + h * (D / 64) * block bytes; cell[t] =
// meta[cell_off + t]; tab: the tiers' tables (kv_quant.glsl). One workgroup of 256 per
// (token, head) row, D a power of two in [64, 512]:
//  1. y = fwht(x * s) * rs (rs = float32(1 / sqrt(D))), butterfly stage by stage;
//  2. per 64-value block n = sqrt(pairwise sum of y^2), u = y * (8 / n) (0 when n = 0);
//  3. codes: turbo: the number of midpoints below u; tcq: Viterbi (one thread per state);
//  4. scale = pairwise sum(y c) / pairwise sum(c c) (0 when the latter is 0), f16;
//  5. one thread per block packs its bytes (put_bytes: words shared with a neighbouring
//     block, of this row or another cell, are updated with atomics on its own bytes only).
// Products and sums are `precise` (no contraction), divisions div_rn, sqrt sqrt_rn.
#include "common.glsl"
#include "kv_quant.glsl"

layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer SB { float src[]; };
layout(binding = 1) buffer DB { uint dst[]; };
layout(binding = 2) readonly buffer MB { int meta[]; };
layout(binding = 3) readonly buffer TB { float tab[]; };
layout(push_constant) uniform PC { uint T, n_kv, D, type, cell_off, src_off, cell_bytes; float rs; } p;

#define BIG 1.0e30      // a masked trellis state (NumPy: inf; never on the chosen path either way)

shared float y[512];    // the rotated row
shared float uu[512];   // unit-RMS values; then the levels c of the codes
shared float red[512];  // pairwise sums
shared uint code[512];  // turbo: level index; tcq: trellis state
shared float blk[8];    // per block: 8 / n, then the scale
shared float sum2[8];
shared float cost[256];
shared float best[64];
shared uint back[64 * 16];  // Viterbi back-pointers: step t, group g -> byte g % 4 of word t * 16 + g / 4
shared float tgt[64];
shared uint path8;

uint by[66];

void put_bytes(uint b0, uint nb) {  // bytes by[0 .. nb) to byte b0 of dst
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

// pairwise sums of red[] per 64-value block (turbo.py block_sum): result at red[64 b]
void block_sums(uint tid, uint D) {
    for (uint h = 32u; h >= 1u; h >>= 1) {
        barrier();
        for (uint i = tid; i < D; i += 256u) {
            if ((i & 63u) < h) {
                precise float v = red[i] + red[i + h];
                red[i] = v;
            }
        }
    }
    barrier();
}

// Viterbi over tgt[0 .. n) (trellis.py _viterbi); thread s = state. With fix >= 0 the first
// state's low L-k bits and the last state's high L-k bits must equal fix. Writes the
// path's states to code[o .. o + n) (all n) or, with only8, the state at step 8 to path8.
void viterbi(uint s, uint n, uint k, int fix, uint lev, uint o, bool only8) {
    uint G = 1u << (8u - k), K = 1u << k;
    for (uint w = s; w < 64u * 16u; w += 256u) back[w] = 0u;
    precise float d0 = tgt[0] - tab[lev + s];
    precise float c0 = d0 * d0;
    cost[s] = (fix >= 0 && (s & (G - 1u)) != uint(fix)) ? BIG : c0;
    barrier();
    for (uint t = 1u; t < n; t++) {
        if (s < G) {  // group s: predecessors s * K + j, the first minimum
            float bm = cost[s * K];
            uint bj = 0u;
            for (uint j = 1u; j < K; j++) {
                float v = cost[s * K + j];
                if (v < bm) { bm = v; bj = j; }
            }
            best[s] = bm;
            atomicOr(back[t * 16u + (s >> 2)], bj << (8u * (s & 3u)));
        }
        barrier();
        precise float d = tgt[t] - tab[lev + s];
        precise float c = d * d + best[s & (G - 1u)];
        cost[s] = c;
        barrier();
    }
    if (s == 0u) {
        uint bs = 0u;
        float bm = (fix >= 0 && (0u >> k) != uint(fix)) ? BIG : cost[0];
        for (uint j = 1u; j < 256u; j++) {
            float v = (fix >= 0 && (j >> k) != uint(fix)) ? BIG : cost[j];
            if (v < bm) { bm = v; bs = j; }
        }
        uint st = bs;
        if (!only8) code[o + n - 1u] = st;
        for (uint t = n - 1u; t > 0u; t--) {
            uint g = st & (G - 1u);
            st = g * K + ((back[t * 16u + (g >> 2)] >> (8u * (g & 3u))) & 0xFFu);
            if (!only8) code[o + t - 1u] = st;
            if (t - 1u == 8u) path8 = st;
        }
    }
    barrier();
}

void main() {
    uint row = wg_index();
    if (row >= p.T * p.n_kv) return;
    uint tid = gl_LocalInvocationID.x;
    uint tok = row / p.n_kv, hd = row % p.n_kv;
    uint D = p.D, t = p.type, nblk = D >> 6;
    uint lev = KVT_LEV(t);
    uint s0 = p.src_off + row * D;

    // 1. rotation
    for (uint i = tid; i < D; i += 256u) y[i] = src[s0 + i] * tab[i];  // sign flips: exact
    for (uint h = 1u; h < D; h <<= 1) {
        barrier();
        for (uint q = tid; q < (D >> 1); q += 256u) {
            uint i = (q / h) * 2u * h + (q % h);
            float a = y[i], b = y[i + h];
            precise float sa = a + b, sb = a - b;
            y[i] = sa;
            y[i + h] = sb;
        }
    }
    barrier();
    for (uint i = tid; i < D; i += 256u) {
        precise float v = y[i] * p.rs;
        y[i] = v;
        precise float sq = v * v;
        red[i] = sq;
    }
    // 2. block norms, unit-RMS values
    block_sums(tid, D);
    if (tid < nblk) {
        float nrm = sqrt_rn(red[64u * tid]);
        blk[tid] = nrm > 0.0 ? div_rn(8.0, nrm) : 0.0;
    }
    barrier();
    for (uint i = tid; i < D; i += 256u) {
        precise float v = y[i] * blk[i >> 6];
        uu[i] = v;
    }
    barrier();
    // 3. codes; uu[] becomes the levels c
    if (kvt_tcq(t)) {
        uint k = kvt_bits(t);
        for (uint b = 0u; b < nblk; b++) {
            if (tid < 16u) tgt[tid] = uu[64u * b + (tid < 8u ? 56u + tid : tid - 8u)];  // the wrap: last 8, first 8
            barrier();
            viterbi(tid, 16u, k, -1, lev, 0u, true);
            int fix = int(path8 & ((1u << (8u - k)) - 1u));
            if (tid < 64u) tgt[tid] = uu[64u * b + tid];
            barrier();
            viterbi(tid, 64u, k, fix, lev, 64u * b, false);
        }
        for (uint i = tid; i < D; i += 256u) uu[i] = tab[lev + code[i]];
    } else {
        uint nl = 1u << kvt_bits(t);
        for (uint i = tid; i < D; i += 256u) {
            float u = uu[i];
            uint idx = 0u;
            for (uint j = 0u; j + 1u < nl; j++) idx += tab[lev + 256u + j] < u ? 1u : 0u;
            code[i] = idx;
            uu[i] = tab[lev + idx];
        }
    }
    barrier();
    // 4. least-squares scale
    for (uint i = tid; i < D; i += 256u) {
        float c = uu[i];
        precise float v = c * c;
        red[i] = v;
    }
    block_sums(tid, D);
    if (tid < nblk) sum2[tid] = red[64u * tid];
    barrier();
    for (uint i = tid; i < D; i += 256u) {
        precise float v = y[i] * uu[i];
        red[i] = v;
    }
    block_sums(tid, D);
    // 5. pack one block per thread
    if (tid < nblk) {
        float den = sum2[tid];
        float scale = den > 0.0 ? div_rn(red[64u * tid], den) : 0.0;
        uint nb = kvt_block_bytes(t), bits = kvt_bits(t), o = 64u * tid;
        uint h = f32_to_f16(scale);
        by[0] = h & 0xFFu;
        by[1] = h >> 8;
        for (uint j = 2u; j < nb; j++) by[j] = 0u;
        if (kvt_tcq(t)) {  // value j's k low state bits are stream bits j*k .. j*k + k - 1
            for (uint j = 0u; j < 64u; j++) {
                for (uint e = 0u; e < bits; e++) {
                    uint pos = j * bits + e;
                    by[2u + (pos >> 3)] |= ((code[o + j] >> e) & 1u) << (pos & 7u);
                }
            }
        } else if (bits == 8u) {
            for (uint j = 0u; j < 64u; j++) by[2u + j] = code[o + j];
        } else if (bits == 4u) {
            for (uint j = 0u; j < 64u; j++) by[2u + (j >> 1)] |= code[o + j] << (4u * (j & 1u));
        } else {  // 2 low bits 4 per byte; turbo3: bit 2 at byte 18 + j / 8
            for (uint j = 0u; j < 64u; j++) {
                by[2u + (j >> 2)] |= (code[o + j] & 3u) << (2u * (j & 3u));
                if (bits == 3u) by[18u + (j >> 3)] |= (code[o + j] >> 2) << (j & 7u);
            }
        }
        uint c = uint(meta[p.cell_off + tok]);
        put_bytes(c * p.cell_bytes + (hd * nblk + tid) * nb, nb);
    }
}
