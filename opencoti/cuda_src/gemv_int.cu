// K-quant weights x float32 activations on the integer tensor cores, at float32 accuracy.
//
// A K-quant weight is an integer code times per-sub-block integer scales and one f16 scale per
// 256-element super-block (ggml-common.h block_q4_K / block_q6_K; ggml-quants.c
// dequantize_row_q4_K / _q6_K):
//   Q4_K: w = d * sc_s * q - dmin * m_s      (q in 0..15, sc_s, m_s in 0..63, 8 sub-blocks of 32)
//   Q6_K: w = d * sc_g * (q - 32)            (q in 0..63, sc_g in -128..127, 16 groups of 16)
// so sum_k w_k x_k is d * sum_s sc_s * (sum_{k in s} q_k x_k) (- dmin * sum_s m_s sum_{k in s} x_k):
// the inner sums are products of small integers with x. xq_digits writes each activation row as
// a fixed-point value with one scale per 256 elements, split into three signed base-256 digits,
//   x = sx * (d0 + d1 / 256 + d2 / 65536),   sx = max|x| / 127 over the 256 elements,
// (|error| <= sx / 131072, i.e. 2^-24 of the block's largest |x|: float32's own rounding) and
// each digit of each token is one column of the B matrix. One integer MMA then computes the inner
// sums of 16 weight rows for every (token, digit) column exactly in int32, the sub-block scales
// are applied in int32, and only d, dmin and the column's scale (sx, sx / 256, sx / 65536) in
// float once per super-block; a token's three digit columns are summed at the end. The dequantize
// work per weight is one or two bit operations per 4 codes (the float GEMV spends ~6 instructions
// per weight, which bounds it below memory bandwidth on the H200).
//
// Columns: a block computes TPB tokens (CW = 8 * NT columns, TPB = CW / 3: NT = 1 -> 2 tokens,
// 3 -> 8, 6 -> 16); token t's digit i is column (t / TPB) * CW + 3 * (t % TPB) + i (ncp columns
// in all, a multiple of CW; columns of no token hold zero digits).
//   xq   [K/16, ncp, 16] int8 digits, 16 elements of each column in a row, so that the
//                     B fragment of one MMA is one or two 128-byte lines (a [ncp, K] layout
//                     made it 8 lines, one per column: the loads were L1-bound)
//   xs   [K/256, ncp] f32   column scale per super-block
//   xd16 [K/16, ncp]  int32 digit sums per 16 elements (Q6_K's -32 offset)
//   xd32 [K/32, ncp]  int32 digit sums per 32 elements (Q4_K's minimum)
// Weight rows: a block takes 16 (one MMA tile, rows gid and gid + 8 per lane); its warps split
// the super-blocks of the row (split-K) and are summed in shared memory in warp order
// (deterministic). grid = (ncp / CW, ceil(nrows / 16)), blockDim = 32 * min(KS_MAX(NT), K / 256).
// A decode GEMV is latency-bound (a warp waits for its weight bytes, then computes): many warps
// per row tile (up to 16) and each warp's next super-block loaded while it computes the current
// one keep more bytes in flight.
#include "quants.cuh"
#include "mma.cuh"

#define FULL 0xffffffffu

// x [T, K] f32 -> digits (layout above). grid = (K / 256, (ncp / CW) * ceil(CW / 3)), 32 threads:
// one warp per (super-block, column triple); a lane quantizes 8 consecutive elements.
extern "C" __global__ void xq_digits(const float* __restrict__ x, i8* __restrict__ xq, float* __restrict__ xs,
                                     int* __restrict__ xd16, int* __restrict__ xd32, int T, int K, int CW, int ncp) {
    const int sb = blockIdx.x, lane = threadIdx.x;
    const int tpb = CW / 3, spg = (CW + 2) / 3, gi = blockIdx.y / spg, js = blockIdx.y % spg;
    const int t = gi * tpb + js, col0 = gi * CW + 3 * js, e0 = sb * 256 + 8 * lane;
    float v[8];
    if (js < tpb && t < T) {
        const float4 a = *(const float4*)(x + (long long)t * K + e0), b = *(const float4*)(x + (long long)t * K + e0 + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = 0.f;
    }
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(v[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    const float inv = m > 0.f ? 8323072.f / m : 0.f;  // 127 * 65536 / max|x|
    u32 dg[3][2] = {{0u, 0u}, {0u, 0u}, {0u, 0u}};
    int s[3] = {0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int q = __float2int_rn(v[i] * inv);  // |q| <= 127 * 65536
        const int d2 = ((q + 128) & 255) - 128, q1 = (q - d2) >> 8;  // balanced digits in -128..127
        const int d1 = ((q1 + 128) & 255) - 128, d0 = (q1 - d1) >> 8;
        dg[0][i >> 2] |= (u32)(d0 & 255) << (8 * (i & 3));
        dg[1][i >> 2] |= (u32)(d1 & 255) << (8 * (i & 3));
        dg[2][i >> 2] |= (u32)(d2 & 255) << (8 * (i & 3));
        s[0] += d0; s[1] += d1; s[2] += d2;
    }
#pragma unroll
    for (int d = 0; d < 3; d++) {
        if (3 * js + d >= CW) break;  // uniform in the warp
        const long long c = col0 + d;
        *(uint2*)(xq + ((long long)(e0 >> 4) * ncp + c) * 16 + 8 * (lane & 1)) = make_uint2(dg[d][0], dg[d][1]);
        const int s16 = s[d] + __shfl_xor_sync(FULL, s[d], 1);  // lanes 2i, 2i + 1: 16 elements
        const int s32 = s16 + __shfl_xor_sync(FULL, s16, 2);
        if ((lane & 1) == 0) xd16[(long long)(e0 >> 4) * ncp + c] = s16;
        if ((lane & 3) == 0) xd32[(long long)(e0 >> 5) * ncp + c] = s32;
        if (lane == 0) xs[(long long)sb * ncp + c] = m * (1.f / 127.f) * (d == 0 ? 1.f : d == 1 ? 1.f / 256.f : 1.f / 65536.f);
    }
}

// Sums the warps' partial tiles (acc[nt][i]: rows gid / gid + 8, columns 8 nt + 2 tig + {0, 1})
// and a token's three digit columns; writes y[t, row] for the block's tokens and rows.
#define KS_MAX(NT) ((NT) <= 3 ? 16 : 8)  // warps per block (shared memory of gemvi_store)
template <int NT>
__device__ __forceinline__ void gemvi_store(const float (&acc)[NT][4], float* __restrict__ y, int nrows, int T) {
    constexpr int CW = 8 * NT, TPB = CW / 3;
    __shared__ float red[KS_MAX(NT)][16][CW + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, ks = blockDim.x >> 5;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        red[warp][g][8 * nt + 2 * c] = acc[nt][0];
        red[warp][g][8 * nt + 2 * c + 1] = acc[nt][1];
        red[warp][g + 8][8 * nt + 2 * c] = acc[nt][2];
        red[warp][g + 8][8 * nt + 2 * c + 1] = acc[nt][3];
    }
    __syncthreads();
    const int row0 = blockIdx.y * 16, t0 = blockIdx.x * TPB;
    for (int o = threadIdx.x; o < 16 * TPB; o += blockDim.x) {
        const int r = o & 15, tl = o >> 4, t = t0 + tl, row = row0 + r;
        if (t >= T || row >= nrows) continue;
        float sum = 0.f;
        for (int w = 0; w < ks; w++) sum += red[w][r][3 * tl] + red[w][r][3 * tl + 1] + red[w][r][3 * tl + 2];
        y[(long long)t * nrows + row] = sum;
    }
}

__device__ __forceinline__ u32 byte_of(const u32 (&w)[3], int k) { return (w[k >> 2] >> (8 * (k & 3))) & 255u; }
// Q4_K sub-block s's 6-bit scale and minimum from the 12 scale bytes (ggml get_scale_min_k4)
__device__ __forceinline__ void scale_min_int(int s, const u32 (&q)[3], int& sc, int& mn) {
    if (s < 4) { sc = byte_of(q, s) & 63; mn = byte_of(q, s + 4) & 63; }
    else {
        sc = (byte_of(q, s + 4) & 15) | ((byte_of(q, s - 4) >> 6) << 4);
        mn = (byte_of(q, s + 4) >> 4) | ((byte_of(q, s) >> 6) << 4);
    }
}

// Q4_K (144-byte super-blocks: d, dmin (f16), 12 scale bytes, 128 code bytes; code byte 32j + i
// holds element 64j + i in its low nibble (sub-block 2j) and 64j + 32 + i in its high nibble).
// Lane tig reads code bytes 32j + 8tig .. + 7 of each row: its MMA k slots 4tig + i and
// 16 + 4tig + i stand for elements 8tig + i and 8tig + 4 + i of the sub-block (a permutation of
// k; the B digits are read in the same order, so the dot products are unchanged).
// One Q4_K super-block of rows w0 / w1 as lane tig reads it: header (d, dmin, 12 scale bytes)
// and code bytes 32j + 8tig .. + 7 (j = 0..3).
struct Q4KRegs { uint4 h0, h1; uint2 q0[4], q1[4]; };
__device__ __forceinline__ void q4k_load(Q4KRegs& r, const u8* w0, const u8* w1, int sb, int c) {
    const u8* b0 = w0 + 144LL * sb;
    const u8* b1 = w1 + 144LL * sb;
    r.h0 = *(const uint4*)b0;
    r.h1 = *(const uint4*)b1;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        r.q0[j] = *(const uint2*)(b0 + 16 + 32 * j + 8 * c);
        r.q1[j] = *(const uint2*)(b1 + 16 + 32 * j + 8 * c);
    }
}

// Q4_K (144-byte super-blocks: d, dmin (f16), 12 scale bytes, 128 code bytes; code byte 32j + i
// holds element 64j + i in its low nibble (sub-block 2j) and 64j + 32 + i in its high nibble).
// Lane tig reads code bytes 32j + 8tig .. + 7 of each row: its MMA k slots 4tig + i and
// 16 + 4tig + i stand for elements 8tig + i and 8tig + 4 + i of the sub-block (a permutation of
// k; the B digits are read in the same order, so the dot products are unchanged).
template <int NT>
__device__ __forceinline__ void gemvi_q4k(const u8* __restrict__ W, long long rb, const i8* __restrict__ xq,
                                          const float* __restrict__ xs, const int* __restrict__ xd32,
                                          float* __restrict__ y, int nrows, int K, int T, int ncp) {
    constexpr int CW = 8 * NT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, ks = blockDim.x >> 5;
    const int cb = blockIdx.x * CW, row0 = blockIdx.y * 16;
    const int nsb = K >> 8, sb0 = warp * nsb / ks, sb1 = (warp + 1) * nsb / ks;
    const u8* w0 = W + (long long)min(row0 + g, nrows - 1) * rb;
    const u8* w1 = W + (long long)min(row0 + g + 8, nrows - 1) * rb;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    Q4KRegs cur, nxt;
    if (sb0 < sb1) q4k_load(cur, w0, w1, sb0, c);
    for (int sb = sb0; sb < sb1; sb++) {
        if (sb + 1 < sb1) q4k_load(nxt, w0, w1, sb + 1, c);
        const u32 sw0[3] = {cur.h0.y, cur.h0.z, cur.h0.w}, sw1[3] = {cur.h1.y, cur.h1.z, cur.h1.w};
        int cs[NT][4], cm[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) cs[nt][i] = cm[nt][i] = 0;
#pragma unroll
        for (int s = 0; s < 8; s++) {
            const int j = s >> 1, sh = 4 * (s & 1);
            const u32 a0 = (cur.q0[j].x >> sh) & 0x0F0F0F0Fu, a1 = (cur.q1[j].x >> sh) & 0x0F0F0F0Fu;
            const u32 a2 = (cur.q0[j].y >> sh) & 0x0F0F0F0Fu, a3 = (cur.q1[j].y >> sh) & 0x0F0F0F0Fu;
            int s0, m0, s1, m1;
            scale_min_int(s, sw0, s0, m0);
            scale_min_int(s, sw1, s1, m1);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const long long grp = 16LL * sb + 2 * s + (c >> 1), col = cb + 8 * nt + g;
                const uint2 bq = *(const uint2*)(xq + (grp * ncp + col) * 16 + 8 * (c & 1));
                const int2 xd = *(const int2*)(xd32 + (long long)(8 * sb + s) * ncp + cb + 8 * nt + 2 * c);
                int cc[4] = {0, 0, 0, 0};
                imma_k32(cc, a0, a1, a2, a3, bq.x, bq.y);
                cs[nt][0] += s0 * cc[0]; cs[nt][1] += s0 * cc[1]; cs[nt][2] += s1 * cc[2]; cs[nt][3] += s1 * cc[3];
                cm[nt][0] += m0 * xd.x; cm[nt][1] += m0 * xd.y; cm[nt][2] += m1 * xd.x; cm[nt][3] += m1 * xd.y;
            }
        }
        const float d0 = h2f((u16)(cur.h0.x & 0xFFFF)), n0 = h2f((u16)(cur.h0.x >> 16));
        const float d1 = h2f((u16)(cur.h1.x & 0xFFFF)), n1 = h2f((u16)(cur.h1.x >> 16));
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float2 sx = *(const float2*)(xs + (long long)sb * ncp + cb + 8 * nt + 2 * c);
            acc[nt][0] += sx.x * (d0 * (float)cs[nt][0] - n0 * (float)cm[nt][0]);
            acc[nt][1] += sx.y * (d0 * (float)cs[nt][1] - n0 * (float)cm[nt][1]);
            acc[nt][2] += sx.x * (d1 * (float)cs[nt][2] - n1 * (float)cm[nt][2]);
            acc[nt][3] += sx.y * (d1 * (float)cs[nt][3] - n1 * (float)cm[nt][3]);
        }
        cur = nxt;
    }
    gemvi_store<NT>(acc, y, nrows, T);
}

__device__ __forceinline__ u32 ldw2i(const u8* p) {  // 32-bit word at a 2-aligned address
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}

// The words of one Q6_K super-block that lane tig needs, rows w0 and w1 (i = 2n + h): ql at
// 64n + 16h + 4tig (qa) and 64n + 32 + 16h + 4tig (qb), qh at 128 + 32n + 16h + 4tig, the
// scales' word i, d. al4: the row bases are 4-byte aligned, so even super-blocks are (one 32-bit
// load per word there, else two 16-bit loads).
struct Q6KRegs { u32 qa0[4], qb0[4], qh0[4], sc0[4], qa1[4], qb1[4], qh1[4], sc1[4]; u32 d; };
template <bool A4>
__device__ __forceinline__ void q6k_words(Q6KRegs& r, const u8* b0, const u8* b1, int c) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int n = i >> 1, h = i & 1;
        const int oa = 64 * n + 16 * h + 4 * c, ob = oa + 32, oh = 128 + 32 * n + 16 * h + 4 * c;
        if (A4) {
            r.qa0[i] = *(const u32*)(b0 + oa); r.qb0[i] = *(const u32*)(b0 + ob); r.qh0[i] = *(const u32*)(b0 + oh);
            r.qa1[i] = *(const u32*)(b1 + oa); r.qb1[i] = *(const u32*)(b1 + ob); r.qh1[i] = *(const u32*)(b1 + oh);
            r.sc0[i] = *(const u32*)(b0 + 192 + 4 * i); r.sc1[i] = *(const u32*)(b1 + 192 + 4 * i);
        } else {
            r.qa0[i] = ldw2i(b0 + oa); r.qb0[i] = ldw2i(b0 + ob); r.qh0[i] = ldw2i(b0 + oh);
            r.qa1[i] = ldw2i(b1 + oa); r.qb1[i] = ldw2i(b1 + ob); r.qh1[i] = ldw2i(b1 + oh);
            r.sc0[i] = ldw2i(b0 + 192 + 4 * i); r.sc1[i] = ldw2i(b1 + 192 + 4 * i);
        }
    }
    r.d = (u32)*(const u16*)(b0 + 208) | ((u32)*(const u16*)(b1 + 208) << 16);
}
__device__ __forceinline__ void q6k_load(Q6KRegs& r, const u8* w0, const u8* w1, int sb, int c, bool al4) {
    const u8* b0 = w0 + 210LL * sb;
    const u8* b1 = w1 + 210LL * sb;
    if (al4 && (sb & 1) == 0) q6k_words<true>(r, b0, b1, c);
    else q6k_words<false>(r, b0, b1, c);
}

// Q6_K (210-byte super-blocks, 2-byte aligned: ql[128] low 4 bits, qh[64] high 2 bits, 16 int8
// scales, d f16). Group (n, q, h) of 16 elements 128n + 32q + 16h + l (l < 16) has scale
// 8n + 2q + h, low bits in the (q >> 1 ? high : low) nibble of ql[64n + 32(q & 1) + 16h + l] and
// high bits at bit 2q of qh[32n + 16h + l]. One m16n8k16 MMA per group; lane tig holds l = 4tig..
// The codes enter unsigned (0..63) and the accumulator starts at -32 * (the column's digit sum
// over the group), so the MMA returns sum (q - 32) * digit.
template <int NT>
__device__ __forceinline__ void gemvi_q6k(const u8* __restrict__ W, long long rb, const i8* __restrict__ xq,
                                          const float* __restrict__ xs, const int* __restrict__ xd16,
                                          float* __restrict__ y, int nrows, int K, int T, int ncp) {
    constexpr int CW = 8 * NT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, ks = blockDim.x >> 5;
    const int cb = blockIdx.x * CW, row0 = blockIdx.y * 16;
    const int nsb = K >> 8, sb0 = warp * nsb / ks, sb1 = (warp + 1) * nsb / ks;
    const u8* w0 = W + (long long)min(row0 + g, nrows - 1) * rb;
    const u8* w1 = W + (long long)min(row0 + g + 8, nrows - 1) * rb;
    const bool al4 = (rb & 3) == 0 && ((unsigned long long)W & 3) == 0;  // then even super-blocks are 4-aligned
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    Q6KRegs cur, nxt;
    if (sb0 < sb1) q6k_load(cur, w0, w1, sb0, c, al4);
    for (int sb = sb0; sb < sb1; sb++) {
        if (sb + 1 < sb1) q6k_load(nxt, w0, w1, sb + 1, c, al4);
        const float d0 = h2f((u16)(cur.d & 0xFFFF)), d1 = h2f((u16)(cur.d >> 16));
        int cs[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) cs[nt][i] = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int n = i >> 1, h = i & 1;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int gi = 8 * n + 2 * q + h, sh = 4 * (q >> 1), hs = 2 * q;
                const u32 l0 = (q & 1) ? cur.qb0[i] : cur.qa0[i], l1 = (q & 1) ? cur.qb1[i] : cur.qa1[i];
                const u32 v0 = ((l0 >> sh) & 0x0F0F0F0Fu) | (((cur.qh0[i] >> hs) & 0x03030303u) << 4);
                const u32 v1 = ((l1 >> sh) & 0x0F0F0F0Fu) | (((cur.qh1[i] >> hs) & 0x03030303u) << 4);
                const int s0 = (int)(signed char)(cur.sc0[gi >> 2] >> (8 * (gi & 3)));
                const int s1 = (int)(signed char)(cur.sc1[gi >> 2] >> (8 * (gi & 3)));
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const long long col = cb + 8 * nt + g;
                    const u32 bq = *(const u32*)(xq + ((16LL * sb + gi) * ncp + col) * 16 + 4 * c);
                    const int2 xd = *(const int2*)(xd16 + (long long)(16 * sb + gi) * ncp + cb + 8 * nt + 2 * c);
                    int cc[4] = {-32 * xd.x, -32 * xd.y, -32 * xd.x, -32 * xd.y};
                    imma_k16(cc, v0, v1, bq);
                    cs[nt][0] += s0 * cc[0]; cs[nt][1] += s0 * cc[1]; cs[nt][2] += s1 * cc[2]; cs[nt][3] += s1 * cc[3];
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float2 sx = *(const float2*)(xs + (long long)sb * ncp + cb + 8 * nt + 2 * c);
            acc[nt][0] += sx.x * d0 * (float)cs[nt][0];
            acc[nt][1] += sx.y * d0 * (float)cs[nt][1];
            acc[nt][2] += sx.x * d1 * (float)cs[nt][2];
            acc[nt][3] += sx.y * d1 * (float)cs[nt][3];
        }
        cur = nxt;
    }
    gemvi_store<NT>(acc, y, nrows, T);
}

#define GEMVI_ARGS const u8* W, long long rb, const i8* xq, const float* xs, const int* xd16, const int* xd32, \
    float* y, int nrows, int K, int T, int ncp
#define GEMVI(NT)                                                                                            \
    extern "C" __global__ void gemvi_12_n##NT(GEMVI_ARGS) { gemvi_q4k<NT>(W, rb, xq, xs, xd32, y, nrows, K, T, ncp); } \
    extern "C" __global__ void gemvi_14_n##NT(GEMVI_ARGS) { gemvi_q6k<NT>(W, rb, xq, xs, xd16, y, nrows, K, T, ncp); }
GEMVI(1)
GEMVI(3)
GEMVI(6)
