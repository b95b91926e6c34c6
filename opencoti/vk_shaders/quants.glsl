// GGUF block formats, dequantized 32 elements ("a chunk") at a time.
//
// Layouts: ggml-common.h (block_q4_0 ... block_q6_K); element order as
// ggml-quants.c dequantize_row_*. Chunk c of a row is block c for 32-element
// types; a 256-element K-quant super-block holds chunks 8b .. 8b+7. The including
// shader declares `wq` (uint[]), the weight window, and defines QTYPE (ggml type id).
// Row r starts at byte r * row_bytes of the window; blocks need not be 4-byte
// aligned, so bytes are picked out of 32-bit words.

#define QT_F32 0
#define QT_F16 1
#define QT_Q4_0 2
#define QT_Q4_1 3
#define QT_Q5_0 6
#define QT_Q5_1 7
#define QT_Q8_0 8
#define QT_Q2_K 10
#define QT_Q3_K 11
#define QT_Q4_K 12
#define QT_Q5_K 13
#define QT_Q6_K 14
#define QT_BF16 30

uint ld8(uint b) { return (wq[b >> 2] >> ((b & 3u) << 3)) & 0xFFu; }
uint ld16(uint b) { return (wq[b >> 2] >> ((b & 2u) << 3)) & 0xFFFFu; }  // b even
uint ld32(uint b) {  // any alignment; reads only the words holding bytes b .. b+3
    uint s = (b & 3u) << 3;
    uint w0 = wq[b >> 2];
    return s == 0u ? w0 : (w0 >> s) | (wq[(b >> 2) + 1u] << (32u - s));
}
float ldh(uint b) { return unpackHalf2x16(ld16(b)).x; }
uint byte_of(uint w, uint k) { return (w >> (8u * k)) & 0xFFu; }

// K-quant 6-bit scale / min pairs packed in 12 bytes at q (ggml get_scale_min_k4)
void scale_min_k4(uint j, uint q, out float d, out float m) {
    if (j < 4u) {
        d = float(ld8(q + j) & 63u);
        m = float(ld8(q + j + 4u) & 63u);
    } else {
        d = float((ld8(q + j + 4u) & 0xFu) | ((ld8(q + j - 4u) >> 6) << 4));
        m = float((ld8(q + j + 4u) >> 4) | ((ld8(q + j) >> 6) << 4));
    }
}

int q3k_scale(uint sc, uint is) {
    uint us;
    if (is < 4u) us = (ld8(sc + is) & 0xFu) | (((ld8(sc + is + 8u) >> 0) & 3u) << 4);
    else if (is < 8u) us = (ld8(sc + is) & 0xFu) | (((ld8(sc + is + 4u) >> 2) & 3u) << 4);
    else if (is < 12u) us = (ld8(sc + is - 8u) >> 4) | (((ld8(sc + is) >> 4) & 3u) << 4);
    else us = (ld8(sc + is - 8u) >> 4) | (((ld8(sc + is - 4u) >> 6) & 3u) << 4);
    return int(us) - 32;
}

// v[0..31] = elements 32c .. 32c+31 of the row starting at byte rb
void dq_chunk(uint rb, uint c, out float v[32]) {
#if QTYPE == QT_F32
    uint w = (rb >> 2) + 32u * c;
    [[unroll]] for (uint i = 0u; i < 32u; i++) v[i] = uintBitsToFloat(wq[w + i]);
#elif QTYPE == QT_F16
    uint w = (rb >> 2) + 16u * c;
    [[unroll]] for (uint i = 0u; i < 16u; i++) { vec2 h = unpackHalf2x16(wq[w + i]); v[2u * i] = h.x; v[2u * i + 1u] = h.y; }
#elif QTYPE == QT_BF16
    uint w = (rb >> 2) + 16u * c;
    [[unroll]] for (uint i = 0u; i < 16u; i++) {
        uint x = wq[w + i];
        v[2u * i] = uintBitsToFloat(x << 16);
        v[2u * i + 1u] = uintBitsToFloat(x & 0xFFFF0000u);
    }
#elif QTYPE == QT_Q4_0
    uint b = rb + 18u * c; float d = ldh(b);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        uint q = ld32(b + 2u + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            uint x = byte_of(q, k);
            v[4u * j + k] = d * (float(x & 15u) - 8.0);
            v[4u * j + k + 16u] = d * (float(x >> 4) - 8.0);
        }
    }
#elif QTYPE == QT_Q4_1
    uint b = rb + 20u * c; float d = ldh(b), m = ldh(b + 2u);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        uint q = ld32(b + 4u + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            uint x = byte_of(q, k);
            v[4u * j + k] = d * float(x & 15u) + m;
            v[4u * j + k + 16u] = d * float(x >> 4) + m;
        }
    }
#elif QTYPE == QT_Q5_0
    uint b = rb + 22u * c; float d = ldh(b); uint qh = ld32(b + 2u);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        uint q = ld32(b + 6u + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            uint i = 4u * j + k, x = byte_of(q, k);
            v[i] = d * (float((x & 15u) | (((qh >> i) & 1u) << 4)) - 16.0);
            v[i + 16u] = d * (float((x >> 4) | (((qh >> (i + 16u)) & 1u) << 4)) - 16.0);
        }
    }
#elif QTYPE == QT_Q5_1
    uint b = rb + 24u * c; float d = ldh(b), m = ldh(b + 2u); uint qh = ld32(b + 4u);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        uint q = ld32(b + 8u + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            uint i = 4u * j + k, x = byte_of(q, k);
            v[i] = d * float((x & 15u) | (((qh >> i) & 1u) << 4)) + m;
            v[i + 16u] = d * float((x >> 4) | (((qh >> (i + 16u)) & 1u) << 4)) + m;
        }
    }
#elif QTYPE == QT_Q8_0
    uint b = rb + 34u * c; float d = ldh(b);
    [[unroll]] for (uint j = 0u; j < 8u; j++) {
        uint q = ld32(b + 2u + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) v[4u * j + k] = d * float(int(q << (24u - 8u * k)) >> 24);
    }
#elif QTYPE == QT_Q2_K
    uint b = rb + 84u * (c >> 3); uint s = c & 7u, n = s >> 2, sh = 2u * (s & 3u);
    float d = ldh(b + 80u), dm = ldh(b + 82u);
    uint q = b + 16u + 32u * n; uint s0 = ld8(b + 2u * s), s1 = ld8(b + 2u * s + 1u);
    float d0 = d * float(s0 & 15u), m0 = dm * float(s0 >> 4), d1 = d * float(s1 & 15u), m1 = dm * float(s1 >> 4);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        uint qa = ld32(q + 4u * j), qb = ld32(q + 16u + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            v[4u * j + k] = d0 * float((byte_of(qa, k) >> sh) & 3u) - m0;
            v[4u * j + k + 16u] = d1 * float((byte_of(qb, k) >> sh) & 3u) - m1;
        }
    }
#elif QTYPE == QT_Q3_K
    uint b = rb + 110u * (c >> 3); uint s = c & 7u, n = s >> 2, sh = 2u * (s & 3u); uint msk = 1u << s;
    float d = ldh(b + 108u);
    uint q = b + 32u + 32u * n;
    float d0 = d * float(q3k_scale(b + 96u, 2u * s)), d1 = d * float(q3k_scale(b + 96u, 2u * s + 1u));
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        uint qa = ld32(q + 4u * j), qb = ld32(q + 16u + 4u * j);
        uint ha = ld32(b + 4u * j), hb = ld32(b + 16u + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            v[4u * j + k] = d0 * float(int((byte_of(qa, k) >> sh) & 3u) - ((byte_of(ha, k) & msk) != 0u ? 0 : 4));
            v[4u * j + k + 16u] = d1 * float(int((byte_of(qb, k) >> sh) & 3u) - ((byte_of(hb, k) & msk) != 0u ? 0 : 4));
        }
    }
#elif QTYPE == QT_Q4_K
    uint b = rb + 144u * (c >> 3); uint s = c & 7u;
    float d = ldh(b), dm = ldh(b + 2u), sc, mn; scale_min_k4(s, b + 4u, sc, mn);
    uint q = b + 16u + 32u * (s >> 1); uint sh = (s & 1u) * 4u; float dd = d * sc, mm = dm * mn;
    [[unroll]] for (uint j = 0u; j < 8u; j++) {
        uint w = ld32(q + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) v[4u * j + k] = dd * float((byte_of(w, k) >> sh) & 15u) - mm;
    }
#elif QTYPE == QT_Q5_K
    uint b = rb + 176u * (c >> 3); uint s = c & 7u;
    float d = ldh(b), dm = ldh(b + 2u), sc, mn; scale_min_k4(s, b + 4u, sc, mn);
    uint q = b + 48u + 32u * (s >> 1); uint sh = (s & 1u) * 4u; float dd = d * sc, mm = dm * mn;
    [[unroll]] for (uint j = 0u; j < 8u; j++) {
        uint w = ld32(q + 4u * j), h = ld32(b + 16u + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++)
            v[4u * j + k] = dd * float(((byte_of(w, k) >> sh) & 15u) + (((byte_of(h, k) >> s) & 1u) << 4)) - mm;
    }
#elif QTYPE == QT_Q6_K
    uint b = rb + 210u * (c >> 3); uint s = c & 7u, hf = s >> 2, k4 = s & 3u;
    float d = ldh(b + 208u);
    uint ql = b + 64u * hf + (k4 & 1u) * 32u, qh = b + 128u + 32u * hf, scb = b + 192u + 8u * hf;
    uint ns = (k4 >> 1) * 4u, hs = 2u * k4;
    float d0 = d * float(int(ld8(scb + 2u * k4) << 24) >> 24), d1 = d * float(int(ld8(scb + 2u * k4 + 1u) << 24) >> 24);
    [[unroll]] for (uint j = 0u; j < 8u; j++) {
        uint wl = ld32(ql + 4u * j), wh = ld32(qh + 4u * j);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            int qv = int(((byte_of(wl, k) >> ns) & 15u) | (((byte_of(wh, k) >> hs) & 3u) << 4)) - 32;
            v[4u * j + k] = (j < 4u ? d0 : d1) * float(qv);
        }
    }
#else
#error "unknown QTYPE"
#endif
}
