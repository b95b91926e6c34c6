// K-quant weights x float32 activations on the integer tensor cores, at float32 accuracy.
//
// A K-quant weight is an integer code times per-sub-block integer scales and one f16 scale per
// 256-element super-block (ggml-common.h block_q4_K / block_q6_K; ggml-quants.c
// dequantize_row_q4_K / _q6_K):
//   Q4_K: w = d * sc_s * q - dmin * m_s      (q in 0..15, sc_s, m_s in 0..63, 8 sub-blocks of 32)
//   Q6_K: w = d * sc_g * (q - 32)            (q in 0..63, sc_g in -128..127, 16 groups of 16)
// so sum_k w_k x_k is d * sum_s sc_s * (sum_{k in s} q_k x_k) (- dmin * sum_s m_s sum_{k in s} x_k):
// the inner sums are products of small integers with x (the minimum's term too, through the
// activation's sub-block sums, see xm below; Q6_K's codes enter as signed q - 32).
// xq_digits writes each activation row as a fixed-point value with one scale per 256 elements,
// split into D = 3 (or 2) signed base-256 digits,
//   x = sx * (d0 + d1 / 256 + d2 / 65536),   sx = max|x| / 127 over the 256 elements,
// (|error| <= sx / 131072, i.e. 2^-24 of the block's largest |x|: float32's own rounding; with
// D = 2, x = sx * (d0 + d1 / 256) and |error| <= sx / 512, 2^-16: a third less integer work per
// token, cuda.py IMMA_DIGITS) and each digit of each token is one column of the B matrix. One
// integer MMA then computes the inner sums of 16 weight rows for every (token, digit) column
// exactly in int32, the sub-block scales are applied in int32, and only d, dmin and the column's
// scale (sx, sx / 256, sx / 65536) in float once per super-block; a token's D digit columns are
// summed at the end. The dequantize work per weight is one or two bit operations per 4 codes (the
// float GEMV spends ~6 instructions per weight, which bounds it below memory bandwidth on the H200).
//
// Columns: a block computes TPB tokens (CW = 8 * NT columns, TPB = CW / D: with D = 3, NT = 1 -> 2
// tokens, 3 -> 8, 6 -> 16; with D = 2, 4, 12, 24; gemmi 16 tokens, with D = 2 also 32, NT = 8:
// there column D t + i either way); token t's digit i is column
// (t / TPB) * CW + D * (t % TPB) + i (ncp columns in all, a multiple of CW; columns of no token
// hold zero digits). Every kernel takes D as its last argument.
//   xq   [K/16, ncp, 16] int8 digits, 16 elements of each column in a row, so that the
//                     B fragment of one MMA is one or two 128-byte lines (a [ncp, K] layout
//                     made it 8 lines, one per column: the loads were L1-bound)
//   xs   [K/256, ncp] f32   column scale per super-block
//   xm   [K/256, ncp, 16] int8 the column's digit sum S_s over each 32-element sub-block s of a
//                     super-block as lo_s = S_s & 63 (bytes 0..7) and hi_s = S_s >> 6 (bytes
//                     8..15): S_s = lo_s + 64 hi_s (|S_s| <= 4096). Q4_K's minimum term
//                     sum_s m_s S_s is then two m16n8k16 MMAs per super-block (A = m_s in k 0..7,
//                     resp. 8..15) instead of one m16n8k32 MMA per sub-block.
// Weight rows: a block takes 16 (one MMA tile, rows gid and gid + 8 per lane); its warps split
// the super-blocks of the row (split-K) and are summed in shared memory in warp order
// (deterministic). grid = (ncp / CW, ceil(nrows / 16)), blockDim = 32 * ks (ks <= nsb).
// A decode GEMV is bound by how many weight bytes are in flight. One column tile (gemvi_ring):
// each warp streams its super-blocks through a ring of S shared-memory slots (cp.async, 16-byte
// chunks), S - 1 of them in flight while it multiplies the oldest, no registers holding them
// (prefetching one super-block into registers took 104 registers per thread: 2 blocks of 8 warps
// per SM, 4.5 waves for a 7B's ffn_up, 1.5 TB/s); dynamic shared memory ks * S * 16 * SEG bytes.
// 3 or 6 column tiles (gemvi_impl): each warp prefetches its next super-block into registers.
#include "quants.cuh"
#include "digits.cuh"
#include "mma.cuh"
#include "async_copy.cuh"

#define FULL 0xffffffffu

// x [T, K] f32 -> digits (layout above). grid = (K / 256, (ncp / CW) * ceil(CW / D)), 32 threads:
// one warp per (super-block, a token's D columns); a lane quantizes 8 consecutive elements.
extern "C" __global__ void xq_digits(const float* __restrict__ x, i8* __restrict__ xq, float* __restrict__ xs,
                                     i8* __restrict__ xm, int T, int K, int CW, int ncp, int D) { GRID_DEP_WAIT();
    const int sb = blockIdx.x, lane = threadIdx.x;
    const int tpb = CW / D, spg = (CW + D - 1) / D, gi = blockIdx.y / spg, js = blockIdx.y % spg;
    const int t = gi * tpb + js, col0 = gi * CW + D * js, e0 = sb * 256 + 8 * lane;
    float v[8];
    if (js < tpb && t < T) {
        const float4 a = *(const float4*)(x + (long long)t * K + e0), b = *(const float4*)(x + (long long)t * K + e0 + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = 0.f;
    }
    digits_store(v, sb, lane, col0, CW - D * js, ncp, D, xq, xs, xm);
}

// Sums the warps' partial tiles (acc[t][nt][i]: rows 16 t + gid / + 8, columns 8 nt + 2 tig +
// {0, 1}) in warp order and a token's D digit columns; writes y[t, row] for the block's tokens and
// its R = 16 RT rows, row tile by (rows R by ...). red: shared memory for ks x R x (CW + 1) floats.
template <int NT, int RT>
__device__ __forceinline__ void gemvi_store_rt(const float (&acc)[RT][NT][4], float* red, float* __restrict__ y,
                                               int nrows, int T, int D, int by) {
    constexpr int CW = 8 * NT, LD = CW + 1, R = 16 * RT, LR = RT == 1 ? 4 : RT == 2 ? 5 : 6;  // log2 R
    static_assert(RT == 1 || RT == 2 || RT == 4, "gemvi_store_rt: 1, 2 or 4 row tiles");
    const int TPB = CW / D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, ks = blockDim.x >> 5;
    float* mine = red + warp * R * LD;
#pragma unroll
    for (int t = 0; t < RT; t++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            mine[(16 * t + g) * LD + 8 * nt + 2 * c] = acc[t][nt][0];
            mine[(16 * t + g) * LD + 8 * nt + 2 * c + 1] = acc[t][nt][1];
            mine[(16 * t + g + 8) * LD + 8 * nt + 2 * c] = acc[t][nt][2];
            mine[(16 * t + g + 8) * LD + 8 * nt + 2 * c + 1] = acc[t][nt][3];
        }
    __syncthreads();
    const int row0 = by * R, t0 = blockIdx.x * TPB;
    for (int o = threadIdx.x; o < R * TPB; o += blockDim.x) {
        const int r = o & (R - 1), tl = o >> LR, t = t0 + tl, row = row0 + r;
        if (t >= T || row >= nrows) continue;
        float sum = 0.f;
        for (int w = 0; w < ks; w++)
            for (int d = 0; d < D; d++) sum += red[(w * R + r) * LD + D * tl + d];
        y[(long long)t * nrows + row] = sum;
    }
}
template <int NT>
__device__ __forceinline__ void gemvi_store(const float (&acc)[NT][4], float* red, float* __restrict__ y, int nrows,
                                            int T, int D) {
    gemvi_store_rt<NT, 1>(reinterpret_cast<const float (&)[1][NT][4]>(acc), red, y, nrows, T, D, blockIdx.y);
}

// Q4_K's eight 6-bit scales and minima from the 12 scale bytes w[0..2] (ggml get_scale_min_k4),
// four per word, one byte each: sc[0] = sub-blocks 0..3, sc[1] = 4..7; the same for mn.
struct Q4KScales { u32 sc[2], mn[2]; };
__device__ __forceinline__ Q4KScales q4k_scales(u32 w0, u32 w1, u32 w2) {
    Q4KScales o;
    o.sc[0] = w0 & 0x3F3F3F3Fu;
    o.mn[0] = w1 & 0x3F3F3F3Fu;
    o.sc[1] = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
    o.mn[1] = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
    return o;
}

// Q4_K (144-byte super-blocks: d, dmin (f16), 12 scale bytes, 128 code bytes; code byte 32j + i
// holds element 64j + i in its low nibble (sub-block 2j) and 64j + 32 + i in its high nibble).
// Lane tig reads code bytes 32j + 8tig .. + 7 of each row: its MMA k slots 4tig + i and
// 16 + 4tig + i stand for elements 8tig + i and 8tig + 4 + i of the sub-block (a permutation of
// k; the B digits are read in the same order, so the dot products are unchanged). Rows w0 / w1
// (gid, gid + 8 of the lane's tile): the header (d, dmin, 12 scale bytes) and those code bytes.
struct Q4KRegs { uint4 h0, h1; uint2 q0[4], q1[4]; };
// SBS: bytes from one super-block of a row to the next (144; 16 x 144 in 16-row tiles, quants.cuh qrow)
template <int SBS = 144>
__device__ __forceinline__ void q4k_load(Q4KRegs& r, const u8* w0, const u8* w1, int sb, int c) {
    const u8* b0 = w0 + (long long)SBS * sb;
    const u8* b1 = w1 + (long long)SBS * sb;
    r.h0 = *(const uint4*)b0;
    r.h1 = *(const uint4*)b1;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        r.q0[j] = *(const uint2*)(b0 + 16 + 32 * j + 8 * c);
        r.q1[j] = *(const uint2*)(b1 + 16 + 32 * j + 8 * c);
    }
}
// Sub-block s of a loaded super-block: the code fragment a[4] and both rows' integer scales.
struct Q4KStep { u32 a[4]; int s0, s1; };
__device__ __forceinline__ Q4KStep q4k_step(const Q4KRegs& r, const Q4KScales& k0, const Q4KScales& k1, int s) {
    Q4KStep o;
    const int j = s >> 1, sh = 4 * (s & 1);
    o.a[0] = (r.q0[j].x >> sh) & 0x0F0F0F0Fu; o.a[1] = (r.q1[j].x >> sh) & 0x0F0F0F0Fu;
    o.a[2] = (r.q0[j].y >> sh) & 0x0F0F0F0Fu; o.a[3] = (r.q1[j].y >> sh) & 0x0F0F0F0Fu;
    o.s0 = (int)((k0.sc[s >> 2] >> (8 * (s & 3))) & 255u);
    o.s1 = (int)((k1.sc[s >> 2] >> (8 * (s & 3))) & 255u);
    return o;
}
// One column tile: cs += sc * (codes . digits).
__device__ __forceinline__ void q4k_mma(const Q4KStep& o, uint2 bq, int (&cs)[4]) {
    int cc[4] = {0, 0, 0, 0};
    imma_k32(cc, o.a[0], o.a[1], o.a[2], o.a[3], bq.x, bq.y);
    cs[0] += o.s0 * cc[0]; cs[1] += o.s0 * cc[1]; cs[2] += o.s1 * cc[2]; cs[3] += o.s1 * cc[3];
}
// The minimum's term of one column tile, sum_s m_s S_s, from the columns' xm bytes bm (this
// lane's k = 4c..4c+3: lo sums for c < 2, hi sums for c >= 2): ma / mb hold m_s in the lo resp.
// hi k slots (zero elsewhere), so cm = (m . lo) + 64 (m . hi).
__device__ __forceinline__ void q4k_min(u32 ma0, u32 ma1, u32 mb0, u32 mb1, u32 bm, int (&cm)[4]) {
    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
    imma_k16s(lo, ma0, ma1, bm);
    imma_k16s(hi, mb0, mb1, bm);
#pragma unroll
    for (int i = 0; i < 4; i++) cm[i] = lo[i] + 64 * hi[i];
}
__device__ __forceinline__ void q4k_finish(const Q4KRegs& r, float2 sx, const int (&cs)[4], const int (&cm)[4],
                                           float (&acc)[4]) {
    const float d0 = h2f((u16)(r.h0.x & 0xFFFF)), n0 = h2f((u16)(r.h0.x >> 16));
    const float d1 = h2f((u16)(r.h1.x & 0xFFFF)), n1 = h2f((u16)(r.h1.x >> 16));
    acc[0] += sx.x * (d0 * (float)cs[0] - n0 * (float)cm[0]);
    acc[1] += sx.y * (d0 * (float)cs[1] - n0 * (float)cm[1]);
    acc[2] += sx.x * (d1 * (float)cs[2] - n1 * (float)cm[2]);
    acc[3] += sx.y * (d1 * (float)cs[3] - n1 * (float)cm[3]);
}

__device__ __forceinline__ u32 ldw2i(const u8* p) {  // 32-bit word at a 2-aligned address
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}

// Q6_K (210-byte super-blocks, 2-byte aligned: ql[128] low 4 bits, qh[64] high 2 bits, 16 int8
// scales, d f16). Group (n, q, h) of 16 elements 128n + 32q + 16h + l (l < 16) has scale
// 8n + 2q + h, low bits in the (q >> 1 ? high : low) nibble of ql[64n + 32(q & 1) + 16h + l] and
// high bits at bit 2q of qh[32n + 16h + l]. One m16n8k16 MMA per group; lane tig holds l = 4tig..
// Rows w0 / w1: ql at 64n + 16h + 4tig (qa) and 64n + 32 + 16h + 4tig (qb), qh at
// 128 + 32n + 16h + 4tig (i = 2n + h), the scales' word i, d. al4: the row bases are 4-byte
// aligned, so even super-blocks are (one 32-bit load per word there, else two 16-bit loads).
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
// SBS as q4k_load's (210, or 16 x 210); al4: w0 and w1 are 4-byte aligned
template <int SBS = 210>
__device__ __forceinline__ void q6k_load(Q6KRegs& r, const u8* w0, const u8* w1, int sb, int c, bool al4) {
    const u8* b0 = w0 + (long long)SBS * sb;
    const u8* b1 = w1 + (long long)SBS * sb;
    if (al4 && (SBS % 4 == 0 || (sb & 1) == 0)) q6k_words<true>(r, b0, b1, c);
    else q6k_words<false>(r, b0, b1, c);
}
// q - 32 of four 6-bit codes (bytes 0..63) as signed bytes: flipping bit 5 gives q - 32 in 6-bit
// two's complement; (bit 5) * 6 = 0xC0 per byte sign-extends it (no carry between bytes).
__device__ __forceinline__ u32 q6_signed(u32 v) {
    v ^= 0x20202020u;
    return v | ((v & 0x20202020u) * 6u);
}
// Group (i = 2n + h, q) of a loaded super-block: the signed code fragment of both rows and their scales.
struct Q6KStep { u32 v0, v1; int s0, s1; };
__device__ __forceinline__ Q6KStep q6k_step(const Q6KRegs& r, int i, int q) {
    Q6KStep o;
    const int gi = 8 * (i >> 1) + 2 * q + (i & 1), sh = 4 * (q >> 1), hs = 2 * q;
    const u32 l0 = (q & 1) ? r.qb0[i] : r.qa0[i], l1 = (q & 1) ? r.qb1[i] : r.qa1[i];
    o.v0 = q6_signed(((l0 >> sh) & 0x0F0F0F0Fu) | (((r.qh0[i] >> hs) & 0x03030303u) << 4));
    o.v1 = q6_signed(((l1 >> sh) & 0x0F0F0F0Fu) | (((r.qh1[i] >> hs) & 0x03030303u) << 4));
    o.s0 = (int)(signed char)(r.sc0[gi >> 2] >> (8 * (gi & 3)));
    o.s1 = (int)(signed char)(r.sc1[gi >> 2] >> (8 * (gi & 3)));
    return o;
}
__device__ __forceinline__ void q6k_mma(const Q6KStep& o, u32 bq, int (&cs)[4]) {
    int cc[4] = {0, 0, 0, 0};
    imma_k16s(cc, o.v0, o.v1, bq);
    cs[0] += o.s0 * cc[0]; cs[1] += o.s0 * cc[1]; cs[2] += o.s1 * cc[2]; cs[3] += o.s1 * cc[3];
}
__device__ __forceinline__ void q6k_finish(const Q6KRegs& r, float2 sx, const int (&cs)[4], float (&acc)[4]) {
    const float d0 = h2f((u16)(r.d & 0xFFFF)), d1 = h2f((u16)(r.d >> 16));
    acc[0] += sx.x * d0 * (float)cs[0];
    acc[1] += sx.y * d0 * (float)cs[1];
    acc[2] += sx.x * d1 * (float)cs[2];
    acc[3] += sx.y * d1 * (float)cs[3];
}

// One super-block of RT row tiles (a lane's rows 16 t + gid and + 8 of tile t: a4[t] / a6[t])
// against NT column tiles, added to acc[t][nt]; each B fragment is read once for all the row
// tiles. B fragments are read from xqb: the super-block's 16 groups of 16 elements, group j's
// columns at xqb + (j * stride + column) * 16 (the global digit array with stride ncp, or a shared
// stage); xsb: the columns' scales. Columns from rc on hold zero digits (no token): not read.
// SWZ: xqb is a gemmi stage (GmStage), whose odd digit groups hold column j at j ^ 4.
template <int NT, int RT, bool Q6, bool SWZ = false>
__device__ __forceinline__ void superblock_tiles(const Q4KRegs (&a4)[RT], const Q6KRegs (&a6)[RT],
                                                 const i8* __restrict__ xqb, long long stride,
                                                 const float* __restrict__ xsb, const i8* __restrict__ xmb, int g,
                                                 int c, int rc, float (&acc)[RT][NT][4]) {
    int cs[RT][NT][4], cm[NT][4];
#pragma unroll
    for (int t = 0; t < RT; t++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) cs[t][nt][i] = 0;
    if (!Q6) {
        Q4KScales k0[RT], k1[RT];
#pragma unroll
        for (int t = 0; t < RT; t++) {
            k0[t] = q4k_scales(a4[t].h0.y, a4[t].h0.z, a4[t].h0.w);
            k1[t] = q4k_scales(a4[t].h1.y, a4[t].h1.z, a4[t].h1.w);
        }
#pragma unroll
        for (int s = 0; s < 8; s++) {
            Q4KStep o[RT];
#pragma unroll
            for (int t = 0; t < RT; t++) o[t] = q4k_step(a4[t], k0[t], k1[t], s);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                // in group 2s + (c >> 1); a lane of no token's column reads its tile's first
                // column (a valid address, the same sector as lane g = 0) and keeps zeros: a
                // load without a branch, so the sub-blocks' loads and MMAs schedule as one block
                const bool tok = 8 * nt + g < rc;
                const int col = 8 * nt + (tok ? g ^ (SWZ ? (c >> 1) << 2 : 0) : 0);
                const uint2 v = *(const uint2*)(xqb + ((2 * s + (c >> 1)) * stride + col) * 16 + 8 * (c & 1));
                const uint2 bq = tok ? v : make_uint2(0u, 0u);
#pragma unroll
                for (int t = 0; t < RT; t++) q4k_mma(o[t], bq, cs[t][nt]);
            }
        }
#pragma unroll
        for (int t = 0; t < RT; t++) {
            const u32 m0 = (c & 1) ? k0[t].mn[1] : k0[t].mn[0], m1 = (c & 1) ? k1[t].mn[1] : k1[t].mn[0];
            const u32 ma0 = c < 2 ? m0 : 0u, ma1 = c < 2 ? m1 : 0u, mb0 = c < 2 ? 0u : m0, mb1 = c < 2 ? 0u : m1;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                q4k_min(ma0, ma1, mb0, mb1, *(const u32*)(xmb + (8 * nt + g) * 16 + 4 * c), cm[nt]);
                q4k_finish(a4[t], *(const float2*)(xsb + 8 * nt + 2 * c), cs[t][nt], cm[nt], acc[t][nt]);
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                Q6KStep o[RT];
#pragma unroll
                for (int t = 0; t < RT; t++) o[t] = q6k_step(a6[t], i, q);
                const int gi = 8 * (i >> 1) + 2 * q + (i & 1);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const bool tok = 8 * nt + g < rc;  // as Q4_K's: no branch
                    const int col = 8 * nt + (tok ? g ^ (SWZ ? (gi & 1) << 2 : 0) : 0);
                    const u32 v = *(const u32*)(xqb + (gi * stride + col) * 16 + 4 * c);
                    const u32 bq = tok ? v : 0u;
#pragma unroll
                    for (int t = 0; t < RT; t++) q6k_mma(o[t], bq, cs[t][nt]);
                }
            }
#pragma unroll
        for (int t = 0; t < RT; t++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) q6k_finish(a6[t], *(const float2*)(xsb + 8 * nt + 2 * c), cs[t][nt], acc[t][nt]);
    }
}
// one row tile (gemvi_impl; gemmi with SWZ)
template <int NT, bool Q6, bool SWZ = false>
__device__ __forceinline__ void superblock(const Q4KRegs& a4, const Q6KRegs& a6, const i8* __restrict__ xqb,
                                           long long stride, const float* __restrict__ xsb,
                                           const i8* __restrict__ xmb, int g, int c, int rc, float (&acc)[NT][4]) {
    superblock_tiles<NT, 1, Q6, SWZ>(reinterpret_cast<const Q4KRegs (&)[1]>(a4), reinterpret_cast<const Q6KRegs (&)[1]>(a6),
                                xqb, stride, xsb, xmb, g, c, rc, reinterpret_cast<float (&)[1][NT][4]>(acc));
}

// More token rows (NT = 3 or 6 column tiles, up to IMMA_MAX_ROWS rows): the warps split the
// super-blocks of the block's 16 rows, each prefetching its next super-block into registers
// (measured faster than the ring for these column counts: bench_gemv, 7B ffn_down 8 rows 51 vs
// 70 us), B fragments from the digit array (L1 / L2).
// TL: W in 16-row tiles (quants.cuh qrow).
template <int NT, bool Q6, bool TL = false>
__device__ __forceinline__ void gemvi_impl(const u8* __restrict__ W, long long rb, const i8* __restrict__ xq,
                                           const float* __restrict__ xs, const i8* __restrict__ xm,
                                           float* __restrict__ y, int nrows, int K, int T, int ncp, int D) {
    GRID_DEP_WAIT();
    constexpr int CW = 8 * NT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, ks = blockDim.x >> 5;
    const int cb = blockIdx.x * CW, row0 = blockIdx.y * 16;
    const int nsb = K >> 8, sb0 = warp * nsb / ks, sb1 = (warp + 1) * nsb / ks;
    constexpr int BS = Q6 ? 210 : 144, TBS = TL ? BS : 0, SBS = TL ? 16 * BS : BS;
    const u8* w0 = qrow<TBS>(W, rb, min(row0 + g, nrows - 1));
    const u8* w1 = qrow<TBS>(W, rb, min(row0 + g + 8, nrows - 1));
    const bool al4 = !TL && (rb & 3) == 0 && ((unsigned long long)W & 3) == 0;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    Q4KRegs a4, n4;
    Q6KRegs a6, n6;
    if (sb0 < sb1) {
        if (Q6) q6k_load<SBS>(a6, w0, w1, sb0, c, al4); else q4k_load<SBS>(a4, w0, w1, sb0, c);
    }
    for (int sb = sb0; sb < sb1; sb++) {
        if (sb + 1 < sb1) {
            if (Q6) q6k_load<SBS>(n6, w0, w1, sb + 1, c, al4); else q4k_load<SBS>(n4, w0, w1, sb + 1, c);
        }
        superblock<NT, Q6>(a4, a6, xq + (16LL * sb * ncp + cb) * 16, ncp, xs + (long long)sb * ncp + cb,
                           xm + ((long long)sb * ncp + cb) * 16, g, c, 8 * NT, acc);
        if (Q6) a6 = n6; else a4 = n4;
    }
    __shared__ float red[4 * 16 * (8 * NT + 1)];  // <= 4 warps (cuda.py IMMA_WARPS)
    gemvi_store<NT>(acc, red, y, nrows, T, D);
}

// One token row group (NT = 1): a block's warps split the super-blocks of its R = 16 RT rows (RT
// MMA row tiles per warp, sharing each B fragment); each warp's pass through the ring (slot i % S
// holds its i-th super-block, rows at SEG-byte strides), B fragments straight from the digit array
// (L1 / L2).
// Q4_K blocks (144 bytes) stay 16-byte aligned in a row; a Q6_K block (210 bytes, 2-aligned) is
// copied as the 14 16-byte chunks that hold it (its offset in the first is even, <= 14; SEG = 240
// leaves the 15th chunk of each row's segment unused), at offset (its address & 15).
// A lane's share of filling one slot: the slot's R * NCH chunks are i = lane + 32 j; chunk i
// is 16-byte piece i % NCH of row i / NCH's block. The lane's source offsets within the tile's
// rows (super-block 0) are computed once (RingPlan), so a fill is an add and a cp.async per chunk.
// TL (16-row tiles, quants.cuh qrow): a tile's super-block is one run of 16 BS bytes, copied whole
// (BS chunks; SEG = BS: a slot holds the run as it lies, row r of the tile at r BS); a tile past
// the last row (the second of RT = 2 at the end of a weight of 16 (2 i + 1) rows) copies the last
// tile again.
template <bool Q6, int RT, bool TL = false>
struct RingPlan {
    static constexpr int BS = Q6 ? 210 : 144, SEG = TL ? BS : Q6 ? 240 : 144, NCH = SEG / 16, R = 16 * RT;
    static constexpr int NJ = TL ? (RT * BS + 31) / 32 : (R * NCH + 31) / 32;
    u32 off[NJ];  // Q4_K: the chunk's offset; Q6_K: its row's (the chunk's place depends on sb); TL: the chunk's
    __device__ __forceinline__ RingPlan(long long rb, int last_row, int lane) {
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int i = lane + 32 * j;
            if (TL) {
                off[j] = (u32)(min(16 * (i / BS), last_row & ~15) * rb) + 16u * (i % BS);
            } else {
                const int r = min(i / NCH, last_row), k = i % NCH;
                off[j] = (u32)(r * rb) + (Q6 ? 0u : 16u * k);
            }
        }
    }
    // copy super-block sb of the tile's R rows (from Wt, the tile's first row) into slot
    __device__ __forceinline__ void fill(u8* slot, const u8* __restrict__ Wt, int sb, int lane) const {
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int i = lane + 32 * j;
            if (TL) {
                if (i >= RT * BS) break;
                cp_async16(slot + 16 * i, Wt + off[j] + 16LL * BS * sb);
                continue;
            }
            if (i >= R * NCH) break;
            if (!Q6) {
                cp_async16(slot + 16 * i, Wt + off[j] + 144LL * sb);
            } else {
                const int k = i % NCH;
                const u8* b = Wt + off[j] + 210LL * sb;
                const u8* a = (const u8*)((unsigned long long)b & ~15ull);
                if (a + 16 * k < b + 210) cp_async16(slot + 16 * i, a + 16 * k);  // the chunks that hold the block
            }
        }
    }
};

// Rows 16 t + gid and + 8 of a slot's row tile (st: the tile's first row, SEG bytes per row) into
// a4 / a6, as the ring fill laid super-block sb out: a Q6_K block at offset (its address & 15) of
// its first chunk, the rows' addresses being r0 / r1 (gemvi_ring, gemmi_ring); TL: row r at r SEG.
template <bool Q6, int SEG, bool TL = false>
__device__ __forceinline__ void slot_load(Q4KRegs& a4, Q6KRegs& a6, const u8* st, unsigned long long r0,
                                          unsigned long long r1, int sb, int g, int c) {
    if (Q6 && TL) {
        q6k_load(a6, st + g * SEG, st + (g + 8) * SEG, 0, c, false);
    } else if (Q6) {
        const int o0 = (int)((r0 + 210ull * sb) & 15), o1 = (int)((r1 + 210ull * sb) & 15);
        q6k_load(a6, st + g * SEG + o0, st + (g + 8) * SEG + o1, 0, c, false);
    } else {
        q4k_load(a4, st + g * SEG, st + (g + 8) * SEG, 0, c);
    }
}

// A one-column-tile GEMV's share of GEMVI_L2_PREFETCH bytes: super-blocks [s0, s1) of rows
// 0 .. R - 1 (clamped to last_row) from Wt, rb bytes apart, into L2 (prefetch.global.L2, one
// 128-byte line per lane and step), about GEMVI_L2_PREFETCH / n_warps bytes for this warp (n_warps:
// the grid's warps, each prefetching its own super-blocks; whole lines, so up to a line more per
// row), whole super-blocks in order. The budget keeps a large weight's prefetched lines from
// evicting each other before they are read (H200 L2: 50 MB); a 7B's q + k or attn_output
// (7-9 MB) is prefetched whole.
#define GEMVI_L2_PREFETCH (16 << 20)
// TL (16-row tiles): the unit is a tile, whose super-blocks [s0, s0 + n) are one run of 16 n BPS
// bytes, instead of a row.
template <bool Q6, bool TL = false>
__device__ __forceinline__ void l2_prefetch_rows(const u8* __restrict__ Wt, long long rb, int last_row, int R, int s0,
                                                 int s1, int n_warps, int lane) {
    constexpr int BPS = Q6 ? 210 : 144, U = TL ? 16 : 1;  // bytes of a super-block of a row; rows per unit
    const int n = min(s1 - s0, (int)(GEMVI_L2_PREFETCH / ((long long)n_warps * R * BPS)));
    if (n <= 0) return;
    const int lines = (U * n * BPS + 127) / 128 + 1;  // per unit, the first line's offset included
    const int last = TL ? last_row & ~15 : last_row;  // the last unit's first row
    for (int i = lane; i < (R / U) * lines; i += 32) {
        const int r = min(U * (i / lines), last), l = i % lines;
        const unsigned long long b = (unsigned long long)(Wt + r * rb + (long long)U * BPS * s0);
        const unsigned long long a = (b & ~127ull) + 128ull * l;
        if (a < b + (unsigned long long)U * n * BPS) asm volatile("prefetch.global.L2 [%0];" ::"l"(a));  // unit r's lines
    }
}

// gemvi_ring_at: row tile by of a grid of nby row tiles (gemvi_duo's grids hold two weights' tiles);
// TL: W in 16-row tiles (quants.cuh qrow; nrows a multiple of 16)
template <bool Q6, int S, int RT, bool TL = false>
__device__ __forceinline__ void gemvi_ring_at(const u8* __restrict__ W, long long rb, const i8* __restrict__ xq,
                                              const float* __restrict__ xs, const i8* __restrict__ xm,
                                              float* __restrict__ y, int nrows, int K, int T, int ncp, int D, int by,
                                              int nby) {
    extern __shared__ __align__(16) u8 ring[];
    constexpr int NT = 1, CW = 8, SEG = RingPlan<Q6, RT, TL>::SEG, R = 16 * RT, SB = R * SEG;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, ks = blockDim.x >> 5;
    const int cb = blockIdx.x * CW, row0 = by * R, tpb = CW / D;
    const int rc = min(T - blockIdx.x * tpb, tpb) * D;  // columns holding a token's digits
    const int nsb = K >> 8, sb0 = warp * nsb / ks, sb1 = (warp + 1) * nsb / ks;
    u8* const mine = ring + warp * S * SB;
    const u8* const Wt = W + (long long)row0 * rb;
    const RingPlan<Q6, RT, TL> plan(rb, nrows - 1 - row0, lane);
    // the lane's rows of each tile (Q6_K: a block's place in its first chunk is its address & 15)
    unsigned long long r0[RT], r1[RT];
#pragma unroll
    for (int t = 0; t < RT; t++) {
        r0[t] = (unsigned long long)Wt + (unsigned long long)min(16 * t + g, nrows - 1 - row0) * rb;
        r1[t] = (unsigned long long)Wt + (unsigned long long)min(16 * t + g + 8, nrows - 1 - row0) * rb;
    }
    // the weights are constants: with OPENCOTI_PDL_EARLY the ring's first slots and (sm_90, where
    // the kernel before can still run) the next super-blocks into L2 are fetched before the wait,
    // while the kernel before (the norm or merge that writes this GEMV's digits) works (pdl.cuh)
#if !OPENCOTI_PDL_EARLY
    GRID_DEP_WAIT();
#endif
#pragma unroll
    for (int i = 0; i < S - 1; i++) {
        if (sb0 + i < sb1) plan.fill(mine + i * SB, Wt, sb0 + i, lane);
        cp_async_commit();
    }
#if OPENCOTI_PDL_EARLY
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (blockIdx.x == 0) l2_prefetch_rows<Q6, TL>(Wt, rb, nrows - 1 - row0, R, sb0 + S - 1, sb1, nby * ks, lane);
#endif
    GRID_DEP_WAIT();
#endif
    float acc[RT][NT][4];
#pragma unroll
    for (int t = 0; t < RT; t++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) acc[t][nt][0] = acc[t][nt][1] = acc[t][nt][2] = acc[t][nt][3] = 0.f;
    Q4KRegs a4[RT];
    Q6KRegs a6[RT];
    for (int sb = sb0; sb < sb1; sb++) {
        const int i = sb - sb0;
        if (sb + S - 1 < sb1) plan.fill(mine + ((i + S - 1) % S) * SB, Wt, sb + S - 1, lane);
        cp_async_commit();
        cp_async_wait<S - 1>();  // this lane's copies of super-block sb have landed
        __syncwarp();            // ... and every lane's
        const u8* slot = mine + (i % S) * SB;
#pragma unroll
        for (int t = 0; t < RT; t++) slot_load<Q6, SEG, TL>(a4[t], a6[t], slot + 16 * t * SEG, r0[t], r1[t], sb, g, c);
        superblock_tiles<NT, RT, Q6>(a4, a6, xq + (16LL * sb * ncp + cb) * 16, ncp, xs + (long long)sb * ncp + cb,
                                     xm + ((long long)sb * ncp + cb) * 16, g, c, rc, acc);
        __syncwarp();  // the slot is refilled next iteration
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring becomes the reduction's tile
    gemvi_store_rt<NT, RT>(acc, (float*)ring, y, nrows, T, D, by);
}
template <bool Q6, int S, int RT, bool TL = false>
__device__ __forceinline__ void gemvi_ring(const u8* __restrict__ W, long long rb, const i8* __restrict__ xq,
                                           const float* __restrict__ xs, const i8* __restrict__ xm,
                                           float* __restrict__ y, int nrows, int K, int T, int ncp, int D) {
    gemvi_ring_at<Q6, S, RT, TL>(W, rb, xq, xs, xm, y, nrows, K, T, ncp, D, blockIdx.y, gridDim.y);
}

#define GEMVI_ARGS                                                                                      \
    const u8* W, long long rb, const i8* xq, const float* xs, const i8* xm, float* y, int nrows, int K, int T, \
        int ncp, int D
// gemvi_12_<SUFFIX> / gemvi_14_<SUFFIX> (Q4_K / Q6_K) calling F12 / F14: n1_s<S> one column tile
// with S ring slots per warp (gemvi_ring), _r2 with two row tiles per warp, n<NT> 3 or 6 column
// tiles (gemvi_impl). F12 / F14 call GRID_DEP_WAIT themselves (gemvi_ring after its weight fetch;
// test_cuda_sources).
#define GEMVI_PAIR(SUFFIX, F12, F14)                                                                       \
    extern "C" __global__ void gemvi_12_##SUFFIX(GEMVI_ARGS) { F12(W, rb, xq, xs, xm, y, nrows, K, T, ncp, D); } \
    extern "C" __global__ void gemvi_14_##SUFFIX(GEMVI_ARGS) { F14(W, rb, xq, xs, xm, y, nrows, K, T, ncp, D); }
GEMVI_PAIR(n1_s2, (gemvi_ring<false, 2, 1>), (gemvi_ring<true, 2, 1>))
GEMVI_PAIR(n1_s4, (gemvi_ring<false, 4, 1>), (gemvi_ring<true, 4, 1>))
GEMVI_PAIR(n1_s2_r2, (gemvi_ring<false, 2, 2>), (gemvi_ring<true, 2, 2>))
GEMVI_PAIR(n3, (gemvi_impl<3, false>), (gemvi_impl<3, true>))
GEMVI_PAIR(n6, (gemvi_impl<6, false>), (gemvi_impl<6, true>))
// _t16: the same on weights in 16-row tiles (quants.cuh qrow; cuda.py QTensor.tiled)
GEMVI_PAIR(n1_s2_t16, (gemvi_ring<false, 2, 1, true>), (gemvi_ring<true, 2, 1, true>))
GEMVI_PAIR(n1_s4_t16, (gemvi_ring<false, 4, 1, true>), (gemvi_ring<true, 4, 1, true>))
GEMVI_PAIR(n1_s2_r2_t16, (gemvi_ring<false, 2, 2, true>), (gemvi_ring<true, 2, 2, true>))
GEMVI_PAIR(n3_t16, (gemvi_impl<3, false, true>), (gemvi_impl<3, true, true>))
GEMVI_PAIR(n6_t16, (gemvi_impl<6, false, true>), (gemvi_impl<6, true, true>))

// gemvi_duo_<A>r<RA>_<B>r<RB>: two one-token products of the same activation digits in one grid
// (a layer's fused q + k in Q4_K and its v in Q6_K: the second's few row tiles run on the SMs the
// first leaves idle instead of in a launch of their own after it): row tiles [0, ny1) are W's (type
// A: 12 Q4_K, 14 Q6_K; RA tiles per warp) into y, the rest W2's (type B, RB) into y2, both with
// 2 ring slots per warp (gemvi_ring; cuda.py _gemvi_duo). Dynamic shared memory: the larger of the
// two weights' ring.
// _t16: both weights in 16-row tiles.
#define GEMVI_DUO(A, RA, B, RB, TL, SFX)                                                                     \
    extern "C" __global__ void gemvi_duo_##A##r##RA##_##B##r##RB##SFX(GEMVI_ARGS, const u8* W2, long long rb2, \
                                                                    float* y2, int nrows2, int ny1) {        \
        if (blockIdx.y < ny1)                                                                               \
            gemvi_ring_at<A == 14, 2, RA, TL>(W, rb, xq, xs, xm, y, nrows, K, T, ncp, D, blockIdx.y, gridDim.y); \
        else                                                                                                \
            gemvi_ring_at<B == 14, 2, RB, TL>(W2, rb2, xq, xs, xm, y2, nrows2, K, T, ncp, D, blockIdx.y - ny1, \
                                              gridDim.y);                                                   \
    }
GEMVI_DUO(12, 2, 14, 1, false, )
GEMVI_DUO(12, 1, 14, 1, false, )
GEMVI_DUO(12, 2, 14, 1, true, _t16)
GEMVI_DUO(12, 1, 14, 1, true, _t16)

// ---------------------------------------------------------------------------------------------
// gemmi: the same integer products for batches of 9..64 token rows (batched decode). A block takes
// 64 weight rows (4 warps, a 16-row MMA tile each) x 16 tokens (CW = 16 D digit columns: NT = 2 D
// column tiles, 6 with 3 digits, 4 with 2; gemmi_ring also 32 tokens with 2 digits, NT = 8: each
// weight fragment and scale decoded once for twice the tokens) and walks its split of the super-blocks; each
// super-block's digit columns (and their sums and scales) are staged once in shared memory with
// cp.async, double-buffered, and serve all four warps; each warp streams its rows' weight bytes
// from global memory (next super-block prefetched in registers).
// grid = (ceil(T / (CW / D)), ceil(nrows / 64), n_split), 128 threads; y[z][t][row] partial sums per
// split z (mmq.cu's mmq_reduce adds them in split order).
// The digits are swizzled: group gq's column j sits at j ^ 4 (gq & 1) (16-byte units; CW is a
// multiple of 8). Q4_K's B fragment (superblock_tiles) reads groups 2s and 2s + 1 in one
// half-warp, which the plain layout (a group every CW * 16 bytes, a multiple of 128) put on the
// same 16 banks: a 2-way conflict on every fragment load.
template <int CW>
struct GmStage {
    __align__(16) i8 xq[16 * CW * 16];  // digit bytes of one super-block
    __align__(16) i8 xm[CW * 16];
    __align__(16) float xs[CW];
};

// Stage super-block sb's columns [cb, cb + CW) into st (all threads; 16-byte chunks).
template <int CW>
__device__ __forceinline__ void gm_stage(GmStage<CW>& st, const i8* __restrict__ xq, const float* __restrict__ xs,
                                         const i8* __restrict__ xm, int sb, int cb, int ncp) {
    for (int i = threadIdx.x; i < 17 * CW + CW / 4; i += blockDim.x) {
        if (i < 16 * CW) {  // digits: 16 groups x CW columns x 16 bytes = CW chunks per group
            const int gq = i / CW, ch = i % CW;
            cp_async16(st.xq + (gq * CW + (ch ^ ((gq & 1) << 2))) * 16, xq + ((16LL * sb + gq) * ncp + cb) * 16 + ch * 16);
        } else if (i < 17 * CW) {  // sub-block sums: CW columns x 16 bytes
            const int ch = i - 16 * CW;
            cp_async16(st.xm + ch * 16, xm + ((long long)sb * ncp + cb) * 16 + ch * 16);
        } else {
            const int ch = i - 17 * CW;
            cp_async16(st.xs + 4 * ch, xs + (long long)sb * ncp + cb + 4 * ch);
        }
    }
}

// Sums a token's D digit columns of the block's 64 x CW tile (acc per warp as in gemvi) and
// writes y[t, row] for the block's CW / D tokens (16, or 32 with NT = 8) and rows; red: 64 x
// (CW + 1) floats of shared memory.
template <int NT>
__device__ __forceinline__ void gemmi_store(const float (&acc)[NT][4], float* red, float* __restrict__ y, int nrows,
                                            int T, int D) {
    constexpr int LD = 8 * NT + 1;
    const int tpb = 8 * NT / D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r0 = 16 * warp + g;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        red[r0 * LD + 8 * nt + 2 * c] = acc[nt][0];
        red[r0 * LD + 8 * nt + 2 * c + 1] = acc[nt][1];
        red[(r0 + 8) * LD + 8 * nt + 2 * c] = acc[nt][2];
        red[(r0 + 8) * LD + 8 * nt + 2 * c + 1] = acc[nt][3];
    }
    __syncthreads();
    const int row0 = blockIdx.y * 64, t0 = blockIdx.x * tpb;
    for (int o = threadIdx.x; o < 64 * tpb; o += blockDim.x) {
        const int r = o & 63, tl = o >> 6, t = t0 + tl, row = row0 + r;
        if (t < T && row < nrows) {
            float sum = 0.f;
            for (int d = 0; d < D; d++) sum += red[r * LD + D * tl + d];
            y[(long long)t * nrows + row] = sum;
        }
    }
}

template <int NT, bool Q6, bool TL = false>  // TL: W in 16-row tiles (quants.cuh qrow)
__device__ __forceinline__ void gemmi_impl(const u8* __restrict__ W, long long rb, const i8* __restrict__ xq,
                                           const float* __restrict__ xs, const i8* __restrict__ xm,
                                           float* __restrict__ y, int nrows, int K, int T, int ncp, int D) {
    constexpr int CW = 8 * NT;
    __shared__ GmStage<CW> st[2];
    static_assert(sizeof(st) >= 64 * (CW + 1) * sizeof(float), "gemmi_store's tile reuses the stages");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int cb = blockIdx.x * CW, row0 = blockIdx.y * 64 + 16 * warp;
    const int nsb = K >> 8, ns = gridDim.z, sb0 = blockIdx.z * nsb / ns, sb1 = (blockIdx.z + 1) * nsb / ns;
    y += (long long)blockIdx.z * T * nrows;
    constexpr int BS = Q6 ? 210 : 144, TBS = TL ? BS : 0, SBS = TL ? 16 * BS : BS;
    const u8* w0 = qrow<TBS>(W, rb, min(row0 + g, nrows - 1));
    const u8* w1 = qrow<TBS>(W, rb, min(row0 + g + 8, nrows - 1));
    const bool al4 = !TL && (rb & 3) == 0 && ((unsigned long long)W & 3) == 0;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    Q4KRegs a4, n4;
    Q6KRegs a6, n6;
    if (sb0 < sb1) {
        gm_stage<CW>(st[0], xq, xs, xm, sb0, cb, ncp);
        if (Q6) q6k_load<SBS>(a6, w0, w1, sb0, c, al4); else q4k_load<SBS>(a4, w0, w1, sb0, c);
    }
    cp_async_commit();
    for (int sb = sb0; sb < sb1; sb++) {
        const int cur = (sb - sb0) & 1;
        if (sb + 1 < sb1) {
            gm_stage<CW>(st[cur ^ 1], xq, xs, xm, sb + 1, cb, ncp);
            if (Q6) q6k_load<SBS>(n6, w0, w1, sb + 1, c, al4); else q4k_load<SBS>(n4, w0, w1, sb + 1, c);
        }
        cp_async_commit();
        cp_async_wait<1>();  // this super-block's stage has landed (the next may be in flight)
        __syncthreads();
        superblock<NT, Q6, true>(a4, a6, st[cur].xq, CW, st[cur].xs, st[cur].xm, g, c, CW, acc);
        if (Q6) a6 = n6; else a4 = n4;
        __syncthreads();  // every warp is done with st[cur] before the next iteration refills it
    }
    gemmi_store<NT>(acc, (float*)st, y, nrows, T, D);
}

// gemmi with the weights in the stages too: stage i holds super-block sb0 + i's digit columns
// (GmStage) and the block's 64 weight rows' blocks (SEG bytes each, laid out as gemvi_ring's
// slots: Q6_K's at offset (address & 15) of their first 16-byte chunk), S stages in a ring of
// dynamic shared memory, S - 1 of them in flight (cp.async) while the warps multiply the oldest,
// with no registers holding the next super-block (gemmi_impl prefetches one into registers: the
// loads' latency was 18 % of its stall samples under ncu, at ~2.8 warps per scheduler). One
// barrier per super-block: after it every warp is done with the slot the next fill overwrites.
// Each warp copies its own 16 rows (RingPlan), all threads the digit columns (gm_stage).
// Dynamic shared memory S * (sizeof(GmStage<CW>) + 64 SEG) bytes.
template <int NT, bool Q6, int S, bool TL = false>  // TL: W in 16-row tiles (quants.cuh qrow)
__device__ __forceinline__ void gemmi_ring(const u8* __restrict__ W, long long rb, const i8* __restrict__ xq,
                                           const float* __restrict__ xs, const i8* __restrict__ xm,
                                           float* __restrict__ y, int nrows, int K, int T, int ncp, int D) {
    extern __shared__ __align__(16) u8 ring[];
    constexpr int CW = 8 * NT, SEG = RingPlan<Q6, 1, TL>::SEG, GS = (int)sizeof(GmStage<CW>), SB = GS + 64 * SEG;
    static_assert(S >= 2 && GS % 16 == 0 && S * SB >= 64 * (CW + 1) * (int)sizeof(float), "gemmi_ring's stages");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    // the warp's first row (a warp past the end takes the last row; TL: the last tile's first)
    const int cb = blockIdx.x * CW, rw = min(blockIdx.y * 64 + 16 * warp, TL ? nrows - 16 : nrows - 1);
    const int last = nrows - 1 - rw;
    const int nsb = K >> 8, ns = gridDim.z, sb0 = blockIdx.z * nsb / ns, sb1 = (blockIdx.z + 1) * nsb / ns;
    y += (long long)blockIdx.z * T * nrows;
    const u8* const Wt = W + (long long)rw * rb;
    const RingPlan<Q6, 1, TL> plan(rb, last, lane);
    const unsigned long long r0 = (unsigned long long)Wt + (unsigned long long)min(g, last) * rb;
    const unsigned long long r1 = (unsigned long long)Wt + (unsigned long long)min(g + 8, last) * rb;
#pragma unroll
    for (int i = 0; i < S - 1; i++) {
        if (sb0 + i < sb1) {
            u8* st = ring + i * SB;
            gm_stage<CW>(*(GmStage<CW>*)st, xq, xs, xm, sb0 + i, cb, ncp);
            plan.fill(st + GS + warp * 16 * SEG, Wt, sb0 + i, lane);
        }
        cp_async_commit();
    }
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    Q4KRegs a4;
    Q6KRegs a6;
    for (int sb = sb0; sb < sb1; sb++) {
        const int i = sb - sb0;
        cp_async_wait<S - 2>();  // this thread's copies of super-block sb have landed
        __syncthreads();         // ... every thread's, and every warp is done with super-block sb - 1
        if (sb + S - 1 < sb1) {  // into the slot of super-block sb - 1
            u8* st = ring + ((i + S - 1) % S) * SB;
            gm_stage<CW>(*(GmStage<CW>*)st, xq, xs, xm, sb + S - 1, cb, ncp);
            plan.fill(st + GS + warp * 16 * SEG, Wt, sb + S - 1, lane);
        }
        cp_async_commit();
        const u8* st = ring + (i % S) * SB;
        const GmStage<CW>& gs = *(const GmStage<CW>*)st;
        slot_load<Q6, SEG, TL>(a4, a6, st + GS + warp * 16 * SEG, r0, r1, sb, g, c);
        superblock<NT, Q6, true>(a4, a6, gs.xq, CW, gs.xs, gs.xm, g, c, CW, acc);
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring becomes the reduction's tile
    gemmi_store<NT>(acc, (float*)ring, y, nrows, T, D);
}

// The batched products wait without letting their dependents launch early (GRID_DEP_WAIT_LATE,
// pdl.cuh): with the early trigger a 7B's 32-sequence decode ran 4.6 % slower than with none,
// 2.2 % slower with it everywhere but here (H200, session 22).
// _o<B>_n<NT>: compiled for B resident blocks per SM (registers capped at 65536 / (128 B)), NT = 2 D
#define GEMMI_(B, NT, TL, SFX)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128, B) gemmi_12_o##B##_n##NT##SFX(GEMVI_ARGS) { GRID_DEP_WAIT_LATE(); \
        gemmi_impl<NT, false, TL>(W, rb, xq, xs, xm, y, nrows, K, T, ncp, D); }                                         \
    extern "C" __global__ void __launch_bounds__(128, B) gemmi_14_o##B##_n##NT##SFX(GEMVI_ARGS) { GRID_DEP_WAIT_LATE(); \
        gemmi_impl<NT, true, TL>(W, rb, xq, xs, xm, y, nrows, K, T, ncp, D); }
// each also as _t16, on weights in 16-row tiles (quants.cuh qrow)
#define GEMMI(B, NT) GEMMI_(B, NT, false, ) GEMMI_(B, NT, true, _t16)
GEMMI(2, 6)
GEMMI(3, 6)
GEMMI(4, 6)
GEMMI(2, 4)
GEMMI(3, 4)
GEMMI(4, 4)

// _s<S>_n<NT>: the ring variant with S stages, compiled for B resident blocks per SM (with 2 digits
// the Q4_K kernel needs 114 registers, Q6_K 129 without the cap; with 3 stages 4 Q4_K blocks fit
// an H200 SM's shared memory, 3 Q6_K blocks)
#define GEMMI_RING_(B, S, NT, TL, SFX)                                                                                  \
    extern "C" __global__ void __launch_bounds__(128, B) gemmi_12_s##S##_n##NT##SFX(GEMVI_ARGS) { GRID_DEP_WAIT_LATE(); \
        gemmi_ring<NT, false, S, TL>(W, rb, xq, xs, xm, y, nrows, K, T, ncp, D); }                                      \
    extern "C" __global__ void __launch_bounds__(128, B) gemmi_14_s##S##_n##NT##SFX(GEMVI_ARGS) { GRID_DEP_WAIT_LATE(); \
        gemmi_ring<NT, true, S, TL>(W, rb, xq, xs, xm, y, nrows, K, T, ncp, D); }
#define GEMMI_RING(B, S, NT) GEMMI_RING_(B, S, NT, false, ) GEMMI_RING_(B, S, NT, true, _t16)
GEMMI_RING(4, 2, 4)
GEMMI_RING(4, 3, 4)
GEMMI_RING(3, 4, 4)
GEMMI_RING(3, 2, 6)
GEMMI_RING(3, 3, 6)
GEMMI_RING(3, 2, 8)
GEMMI_RING(2, 3, 8)
