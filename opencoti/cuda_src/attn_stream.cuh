// Decode attention over long rows, K / V streamed through shared memory (attention.cu's
// attn_stream_d<D> for f16 rows, attn_kv_stream for a KV tier pair).
//
// attn_partial keeps one tile of 8 cells in flight per warp (cell index -> K row -> V row, three
// dependent round trips per tile): at 32k cells a 7B layer took ~150 us for its 67 MB of K / V
// (0.45 TB/s, H200). Here a block (one query row, one kv head, up to 16 of its query heads, one
// split of the row's cells: grid (T, n_kv * ceil(G / 16), n_split), 2 CT threads) walks its cells
// in tiles of CT (AsLayout: 128 cells and 8 warps at head sizes up to 128, else 64 and 4). Each
// tile's K and V rows are copied, as their bytes, into a ring of NS shared-memory stages with
// cp.async (two threads per row; zero-filled past the split), NS - 1 tiles in flight while the
// block computes on the oldest; a thread's next cell index is loaded into a register one tile
// ahead. Each warp takes 16 cells of a tile: S = Q K^T and O += P V on the tensor cores (mma
// m16n8k16) as sp_attn (shared_prefix.cu): the block's query heads are the rows of one m16 tile,
// Q and P are split into f16 hi + lo terms (float32 accuracy, f16_split.cuh), S stays in registers
// as P's fragments (FlashAttention-2's layout). f16 rows are exact f16 operands (the V fragments by
// ldmatrix .trans); q8_0, q4_0 and turbo2/3/4 codes are f16 operands too, their block scales
// applied outside the products (K: on each block's partial scores; V: on the integer codes as
// hi + lo, on P for the turbo levels; kv_codes.cuh); any other tier's values are decoded (policy dec():
// scale * code [+ min]) and split into hi + lo. Each warp keeps its own online softmax (Milakov &
// Gimelshein 2018) over its cells; the warps are merged at the end as attn_partial's are. Masks,
// softcap and the output format (n_split == 1: normalized rows, else (acc, m, l) partials for
// attn_merge) are attn_partial's.
//
// Row policy P (K and V each): RB bytes per (cell, kv head) row, copied in CA-byte chunks; F16
// (raw f16 rows); CODES (kv_codes.cuh's operands: C = KvCodes<tier>; kperm / vperm map the MMA's
// k / n index to the dim); TBK / TBV table bytes (tab_k / tab_v fill them); ROT (a rotated tier:
// the queries are rotated before the split, the output un-rotated after the merge). Only where
// used: dec(w, i, tab) value i of a row whose bytes start at w (neither F16 nor CODES),
// rotate(rows, n, inverse) (ROT). Decoded values must lie in f16's range (their hi term): cuda.py
// keeps the f32 / bf16 tiers on attn_kv_g*.
#include "quants.cuh"
#include "mma.cuh"
#include "async_copy.cuh"
#include "f16_split.cuh"

// cells per tile: AS_CT_BIG (8 warps) up to head size 128 where two stages of them take at most
// AS_BIG_BYTES of shared memory, else AS_CT (4 warps): at head size 256 (gemma-3-270m: one kv head,
// splits of ~256 cells at 32k) the 8-warp block's prologue and merge cost more than its tiles gain
#define AS_CT 64
#define AS_CT_BIG 128
#define AS_BIG_BYTES 196608
#define AS_NEG_INF (-__int_as_float(0x7f800000))

// shared-memory stride of a row of rb bytes: 16-byte aligned and an odd multiple of 16, so the 8
// rows of an MMA fragment fall in different banks
__host__ __device__ constexpr int as_srb(int rb) {
    return ((rb + 15) / 16 * 16) % 32 == 0 ? (rb + 15) / 16 * 16 + 16 : (rb + 15) / 16 * 16;
}
// The block's tile (CT cells, NW = CT / 16 warps of 32 threads) and the byte offsets of its
// dynamic shared memory (cuda.py _as_tile / _as_smem mirror CT / BYTES): queries hi / lo [16][D + 8]
// halves; NS stages of K rows [CT][SRBK] then V rows [CT][SRBV] (also the rotated queries' float32
// staging and the warps' merge tile); positions [NS][CT]; staging factors [16]; the K and V tables
// (TBK / TBV bytes: AsTier)
template <int D, int RBK, int RBV, int TBK, int TBV>
struct AsLayout {
    static constexpr int LDQ = D + 8, SRBK = as_srb(RBK), SRBV = as_srb(RBV);
    static constexpr int CT = D <= 128 && 2 * AS_CT_BIG * (SRBK + SRBV) <= AS_BIG_BYTES ? AS_CT_BIG : AS_CT;
    static constexpr int NW = CT / 16;
    static constexpr int SB = CT * (SRBK + SRBV);
    static constexpr int NS = 3 * SB <= 110592 ? 3 : 2;
    static constexpr int MS = NW * 16 * D * 4 + 2 * NW * 16 * 4;
    static constexpr int R = NS * SB > MS ? NS * SB : MS;
    static constexpr int ST = 2 * 16 * LDQ * 2, POS = ST + R, UP = POS + NS * CT * 4, TAB = UP + 64;
    static constexpr int TABV = TAB + TBK, BYTES = TABV + TBV;
};

// One (row r, head h, dim d) of a block's result from its merged max M, sum L and unnormalised
// value A: the normalized output when the row's cells are one split, else the split's partial
// (acc at part_acc[((r * n_head + h) * n_split + sp) * D + d], (M, L) at part_ml[2 * that index]).
__device__ __forceinline__ void store_head(float* __restrict__ out, float* __restrict__ part_acc,
                                           float* __restrict__ part_ml, int r, int n_head, int h, int D, int d,
                                           int n_split, int sp, float M, float L, float A) {
    if (n_split == 1) {
        out[((long long)r * n_head + h) * D + d] = L > 0.f ? A / L : 0.f;
    } else {
        const long long pi = ((long long)r * n_head + h) * n_split + sp;
        part_acc[pi * D + d] = A;
        if (d == 0) { part_ml[2 * pi] = M; part_ml[2 * pi + 1] = L; }
    }
}
// store_head for a rotated V tier, whose row is un-rotated in between: rot_head stores the
// partial's (M, L) and returns the value to un-rotate (the normalized output, or the partial's
// acc); store_rot stores an un-rotated value where store_head would.
__device__ __forceinline__ float rot_head(float* __restrict__ part_ml, int r, int n_head, int h, int d, int n_split,
                                          int sp, float M, float L, float A) {
    if (n_split > 1 && d == 0) {
        const long long pi = ((long long)r * n_head + h) * n_split + sp;
        part_ml[2 * pi] = M; part_ml[2 * pi + 1] = L;
    }
    return n_split == 1 ? (L > 0.f ? A / L : 0.f) : A;
}
__device__ __forceinline__ void store_rot(float* __restrict__ out, float* __restrict__ part_acc, int r, int n_head,
                                          int h, int D, int d, int n_split, int sp, float v) {
    const long long rh = (long long)r * n_head + h;
    if (n_split == 1) out[rh * D + d] = v;
    else part_acc[(rh * n_split + sp) * D + d] = v;
}

template <int D, class KP, class VP>
__device__ __forceinline__ void attn_stream_impl(
    const float* __restrict__ q, const int* __restrict__ q_pos, const int* __restrict__ row_view,
    const int* __restrict__ view_off, const int* __restrict__ cells, const int* __restrict__ cell_pos,
    const u8* __restrict__ K, const u8* __restrict__ V, int n_head, int n_kv, float scale, int n_swa,
    float softcap, int n_split, float* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    using L = AsLayout<D, KP::RB, VP::RB, KP::TBK, VP::TBV>;
    constexpr int CT = L::CT, NW = L::NW, NS = L::NS, LDQ = L::LDQ, ND = D / 8;
    constexpr int NCK = KP::RB / KP::CA, NCV = VP::RB / VP::CA;  // copy chunks per row
    extern __shared__ __align__(16) unsigned char as_smem[];
    u16* s_qh = (u16*)as_smem;
    u16* s_ql = s_qh + 16 * LDQ;
    u8* s_st = as_smem + L::ST;
    int* s_pos = (int*)(as_smem + L::POS);
    float* s_up = (float*)(as_smem + L::UP);
    u8* s_tk = as_smem + L::TAB;
    u8* s_tv = as_smem + L::TABV;

    const int r = blockIdx.x, sp = blockIdx.z;
    const int G = n_head / n_kv, n_hg = (G + 15) / 16;
    const int kh = blockIdx.y / n_hg, g0 = (blockIdx.y % n_hg) * 16, Gb = min(16, G - g0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const int qp = q_pos[r], vw = row_view[r];
    const int b0 = view_off[vw], len = view_off[vw + 1] - b0;
    const int chunk = (len + n_split - 1) / n_split;
    const int c0 = b0 + min(len, sp * chunk), c1 = min(b0 + len, c0 + chunk);
    const int ntile = (c1 - c0 + CT - 1) / CT;

    // this thread's row of every tile (two threads per row: chunks ch, ch + 2, ...), its cell
    // index (-1 past the split)
    const int crow = threadIdx.x >> 1, ch = threadIdx.x & 1;
    auto cell_of = [&](int j) {
        const int i = c0 + j * CT + crow;
        return j < ntile && i < c1 ? cells[i] : -1;
    };
    int pre[NS - 1];
#pragma unroll
    for (int j = 0; j < NS - 1; j++) pre[j] = cell_of(j);
    auto fill = [&](int j, int cell) {
        u8* st = s_st + (j % NS) * L::SB;
        const bool ok = cell >= 0;
        if (ch == 0) cp_async_z<4>(s_pos + (j % NS) * CT + crow, cell_pos + (ok ? c0 + j * CT + crow : c0), ok);
        const u8* kr = K + ((long long)(ok ? cell : 0) * n_kv + kh) * KP::RB;
        const u8* vr = V + ((long long)(ok ? cell : 0) * n_kv + kh) * VP::RB;
        u8* dk = st + crow * L::SRBK;
        u8* dv = st + CT * L::SRBK + crow * L::SRBV;
#pragma unroll
        for (int u = ch; u < NCK; u += 2) cp_async_z<KP::CA>(dk + u * KP::CA, kr + u * KP::CA, ok);
#pragma unroll
        for (int u = ch; u < NCV; u += 2) cp_async_z<VP::CA>(dv + u * VP::CA, vr + u * VP::CA, ok);
    };

    // tables, then the heads' scaled queries (rows g >= Gb zero) as f16 hi + lo
    if constexpr (KP::TBK > 0) KP::tab_k(s_tk);
    if constexpr (VP::TBV > 0) VP::tab_v(s_tv);
    // q * scale in float32 (rotated for a rotated K tier: q -> R q; only the Gb heads' rows, the
    // rest are zero) in the stages, free until the first fill; each head's staging factor from
    // those values; then the hi + lo split
    float* qf = (float*)s_st;
    for (int i = threadIdx.x; i < 16 * D; i += blockDim.x) {
        const int g = i / D;
        qf[i] = g < Gb ? q[((long long)r * n_head + kh * G + g0 + g) * D + i % D] * scale : 0.f;
    }
    __syncthreads();
    if constexpr (KP::ROT) KP::rotate(qf, Gb, false);
    for (int g = warp; g < 16; g += NW) {
        float mx = 0.f;
        for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(qf[g * D + d]));
#pragma unroll
        for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (lane == 0) s_up[g] = sp_stage_factor(mx);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * D; i += blockDim.x) {
        const int g = i / D, d = i % D;  // d: the MMA's k index (the tier's dim order)
        const float x = qf[g * D + KP::kperm(d)] / s_up[g];
        const u16 h = sp_f2h(x);
        s_qh[g * LDQ + d] = h;
        s_ql[g * LDQ + d] = sp_f2h(x - h2f(h));
    }
    __syncthreads();  // the queries are staged (and the stages free)
#pragma unroll
    for (int j = 0; j < NS - 1; j++) {
        if (j < ntile) fill(j, pre[j]);
        cp_async_commit();
    }
    int nxt = cell_of(NS - 1);

    const int cw = 16 * warp;  // the warp's first cell of a tile
    const float up[2] = {s_up[gid], s_up[gid + 8]};
    float m[2] = {AS_NEG_INF, AS_NEG_INF}, l[2] = {0.f, 0.f};
    float o[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;

    for (int j = 0; j < ntile; j++) {
        if (j + NS - 1 < ntile) {
            fill(j + NS - 1, nxt);
            nxt = cell_of(j + NS);
        }
        cp_async_commit();
        cp_async_wait<NS - 1>();  // this thread's copies of tile j have landed
        __syncthreads();          // ... and every thread's
        const u8* sk = s_st + (j % NS) * L::SB;
        const u8* sv = sk + CT * L::SRBK;
        const int* spos = s_pos + (j % NS) * CT;
        const int n = c1 - (c0 + j * CT);  // cells of the tile (the rest are zero-filled)

        // S = Q K^T for the warp's 16 cells (two n8 tiles); four accumulators per n8 tile (hi /
        // lo terms, even / odd k steps) keep the MMA chains short
        float sa[2][2][4], sb[2][2][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) sa[a][nt][e] = sb[a][nt][e] = 0.f;
        if constexpr (KP::CODES) {  // per block: codes times the query, then times the block scale
            using C = typename KP::C;
            constexpr int NSB = C::BS / 16;
#pragma unroll
            for (int b = 0; b < D / C::BS; b++) {
                u32 w[2][C::NW];
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const u8* blk = sk + (cw + nt * 8 + gid) * L::SRBK + b * C::BB;
                    C::kraw(blk, tig, (C::BB * b + 2) % 4 == 0, w[nt]);
                }
                float t[2][2][4];
#pragma unroll
                for (int a = 0; a < 2; a++)
#pragma unroll
                    for (int nt = 0; nt < 2; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) t[a][nt][e] = 0.f;
#pragma unroll
                for (int s = 0; s < NSB; s++) {
                    const int kk = b * NSB + s;
                    u32 h[4], lo[4];
                    ld_a_frag(s_qh + gid * LDQ + kk * 16 + 2 * tig, LDQ, h);
                    ld_a_frag(s_ql + gid * LDQ + kk * 16 + 2 * tig, LDQ, lo);
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        const u32 bh0 = C::kpair(w[nt], s, 0, s_tk), bh1 = C::kpair(w[nt], s, 1, s_tk);
                        mma_m16n8k16(t[s & 1][nt], h[0], h[1], h[2], h[3], bh0, bh1);
                        mma_m16n8k16(t[s & 1][nt], lo[0], lo[1], lo[2], lo[3], bh0, bh1);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {  // column 2 tig + e: that cell's block scale
                        const float d = h2f(C::dh(sk + (cw + nt * 8 + 2 * tig + e) * L::SRBK + b * C::BB));
                        sa[b & 1][nt][e] += (t[0][nt][e] + t[1][nt][e]) * d;
                        sa[b & 1][nt][2 + e] += (t[0][nt][2 + e] + t[1][nt][2 + e]) * d;
                    }
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                u32 h[4], lo[4];
                ld_a_frag(s_qh + gid * LDQ + kk * 16 + 2 * tig, LDQ, h);
                ld_a_frag(s_ql + gid * LDQ + kk * 16 + 2 * tig, LDQ, lo);
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const u8* row = sk + (cw + nt * 8 + gid) * L::SRBK;
                    if constexpr (KP::F16) {
                        const u16* kb = (const u16*)row + kk * 16 + 2 * tig;
                        const u32 b0 = *(const u32*)kb, b1 = *(const u32*)(kb + 8);
                        mma_m16n8k16(sa[kk & 1][nt], h[0], h[1], h[2], h[3], b0, b1);
                        mma_m16n8k16(sb[kk & 1][nt], lo[0], lo[1], lo[2], lo[3], b0, b1);
                    } else {
                        const u32* w = (const u32*)row;
                        const int i0 = kk * 16 + 2 * tig;
                        u32 bh0, bl0, bh1, bl1;
                        const float* tk = (const float*)s_tk;
                        sp_split2(KP::dec(w, i0, tk), KP::dec(w, i0 + 1, tk), bh0, bl0);
                        sp_split2(KP::dec(w, i0 + 8, tk), KP::dec(w, i0 + 9, tk), bh1, bl1);
                        mma_m16n8k16(sa[kk & 1][nt], h[0], h[1], h[2], h[3], bh0, bh1);
                        mma_m16n8k16(sb[kk & 1][nt], lo[0], lo[1], lo[2], lo[3], bh0, bh1);
                        mma_m16n8k16(sb[kk & 1][nt], h[0], h[1], h[2], h[3], bl0, bl1);
                    }
                }
            }
        }
        // masks (cells past the split included), softcap, online softmax of rows gid, gid + 8
        float s[2][4], mx[2] = {AS_NEG_INF, AS_NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int c = cw + nt * 8 + 2 * tig + e, cpos = spos[c];
                const bool ok = c < n && cpos <= qp && !(n_swa > 0 && qp - cpos >= n_swa);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int x = 2 * h + e;
                    float v = (sa[0][nt][x] + sa[1][nt][x] + sb[0][nt][x] + sb[1][nt][x]) * up[h];
                    if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                    s[nt][x] = ok ? v : AS_NEG_INF;
                    mx[h] = fmaxf(mx[h], s[nt][x]);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float mn = fmaxf(m[h], mx[h]);
            const float corr = m[h] == AS_NEG_INF ? 0.f : __expf(m[h] - mn);
            m[h] = mn;
            l[h] *= corr;
#pragma unroll
            for (int nd = 0; nd < ND; nd++) { o[nd][2 * h] *= corr; o[nd][2 * h + 1] *= corr; }
        }
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float v = s[nt][e];
                const float p = v == AS_NEG_INF ? 0.f : __expf(v - m[e >> 1]);
                s[nt][e] = p;
                l[e >> 1] += p;
            }
        }
        // O += P V: P of the warp's 16 cells as the A operand (hi + lo)
        u32 ph[4], pl[4];
        split_p(s[0], s[1], ph, pl);
        if constexpr (VP::F16) {
            pv_f16<ND>(o, ph, pl, (const u16*)(sv + (cw + (lane & 15)) * L::SRBV) + (lane >> 4) * 8);
        } else if constexpr (VP::CODES) {  // B = the codes of cells (2tig, 2tig + 1 | + 8, + 9) ...
            using C = typename VP::C;
            constexpr int NK = C::BS / 8;
            const u8* v0 = sv + (cw + 2 * tig) * L::SRBV;
            const u8* v1 = v0 + L::SRBV;
            const u8* v2 = v0 + 8 * L::SRBV;
            const u8* v3 = v0 + 9 * L::SRBV;
#pragma unroll
            for (int b = 0; b < D / C::BS; b++) {
                const int ob = b * C::BB;
                const bool a4 = (C::BB * b + 2) % 4 == 0;
                const u32 r0 = C::vraw(v0 + ob, gid, a4), r1 = C::vraw(v1 + ob, gid, a4);
                const u32 r2 = C::vraw(v2 + ob, gid, a4), r3 = C::vraw(v3 + ob, gid, a4);
                if constexpr (C::PD) {  // ... as they are, their block scales on P: P' = p d (hi + lo 2^11)
                    const float d0 = h2f(C::dh(v0 + ob)), d1 = h2f(C::dh(v1 + ob));
                    const float d2 = h2f(C::dh(v2 + ob)), d3 = h2f(C::dh(v3 + ob));
                    const float s0[4] = {s[0][0] * d0, s[0][1] * d1, s[0][2] * d0, s[0][3] * d1};
                    const float s1[4] = {s[1][0] * d2, s[1][1] * d3, s[1][2] * d2, s[1][3] * d3};
                    u32 qh[4], ql[4];
                    split_p<2048>(s0, s1, qh, ql);
#pragma unroll
                    for (int k = 0; k < NK; k++) {  // lo x (levels 2^-11): exact, the levels' test
                        const u32 b0 = C::vcodes(r0, r1, k, s_tv), b1 = C::vcodes(r2, r3, k, s_tv);
                        float* acc = o[b * NK + k];
                        mma_m16n8k16(acc, qh[0], qh[1], qh[2], qh[3], b0, b1);
                        mma_m16n8k16(acc, ql[0], ql[1], ql[2], ql[3], hmul2(b0, H2_2M11), hmul2(b1, H2_2M11));
                    }
                } else {  // ... times their block scales (hi + lo)
                    const u32 d01 = (u32)C::dh(v0 + ob) | (u32)C::dh(v1 + ob) << 16;
                    const u32 d23 = (u32)C::dh(v2 + ob) | (u32)C::dh(v3 + ob) << 16;
#pragma unroll
                    for (int k = 0; k < NK; k++) {
                        u32 h0, l0, h1, l1;
                        scale_pair(C::vcodes(r0, r1, k, s_tv), d01, h0, l0);
                        scale_pair(C::vcodes(r2, r3, k, s_tv), d23, h1, l1);
                        float* acc = o[b * NK + k];
                        mma_m16n8k16(acc, ph[0], ph[1], ph[2], ph[3], h0, h1);
                        mma_m16n8k16(acc, pl[0], pl[1], pl[2], pl[3], h0, h1);
                        mma_m16n8k16(acc, ph[0], ph[1], ph[2], ph[3], l0, l1);
                    }
                }
            }
        } else {  // B = V[cells 2tig, 2tig + 1 | + 8, + 9][dim nd * 8 + gid], decoded
            const u32* w0 = (const u32*)(sv + (cw + 2 * tig) * L::SRBV);
            const u32* w1 = (const u32*)(sv + (cw + 2 * tig + 1) * L::SRBV);
            const u32* w2 = (const u32*)(sv + (cw + 2 * tig + 8) * L::SRBV);
            const u32* w3 = (const u32*)(sv + (cw + 2 * tig + 9) * L::SRBV);
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                const int i = nd * 8 + gid;
                u32 bh0, bl0, bh1, bl1;
                const float* tv = (const float*)s_tv;
                sp_split2(VP::dec(w0, i, tv), VP::dec(w1, i, tv), bh0, bl0);
                sp_split2(VP::dec(w2, i, tv), VP::dec(w3, i, tv), bh1, bl1);
                mma_m16n8k16(o[nd], ph[0], ph[1], ph[2], ph[3], bh0, bh1);
                mma_m16n8k16(o[nd], pl[0], pl[1], pl[2], pl[3], bh0, bh1);
                mma_m16n8k16(o[nd], ph[0], ph[1], ph[2], ph[3], bl0, bl1);
            }
        }
        __syncthreads();  // the stage is refilled next iteration
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    // merge the warps (their tiles reuse the stages): s_o [NW][16][D], s_m / s_l [NW][16]
    __syncthreads();
    float* s_o = (float*)s_st;
    float* s_m = s_o + NW * 16 * D;
    float* s_l = s_m + NW * 16;
#pragma unroll
    for (int nd = 0; nd < ND; nd++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float* so = s_o + (warp * 16 + gid + 8 * h) * D;
            if constexpr (VP::CODES) {  // the tier's column order back to dims
                so[VP::vperm(nd, 2 * tig)] = o[nd][2 * h];
                so[VP::vperm(nd, 2 * tig + 1)] = o[nd][2 * h + 1];
            } else {
                *(float2*)(so + nd * 8 + 2 * tig) = make_float2(o[nd][2 * h], o[nd][2 * h + 1]);
            }
        }
    if (tig == 0) {
        s_m[warp * 16 + gid] = m[0]; s_m[warp * 16 + gid + 8] = m[1];
        s_l[warp * 16 + gid] = l[0]; s_l[warp * 16 + gid + 8] = l[1];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < Gb * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float M = AS_NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; w++) M = fmaxf(M, s_m[w * 16 + g]);
        float Ls = 0.f, A = 0.f;
        if (M != AS_NEG_INF) {
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const float mw = s_m[w * 16 + g];
                if (mw == AS_NEG_INF) continue;
                const float f = __expf(mw - M);
                Ls += s_l[w * 16 + g] * f;
                A += s_o[(w * 16 + g) * D + d] * f;
            }
        }
        if constexpr (VP::ROT) {  // un-rotated below; only this thread reads (., g, d)
            s_o[g * D + d] = rot_head(part_ml, r, n_head, kh * G + g0 + g, d, n_split, sp, M, Ls, A);
        } else {
            store_head(out, part_acc, part_ml, r, n_head, kh * G + g0 + g, D, d, n_split, sp, M, Ls, A);
        }
    }
    if constexpr (VP::ROT) {  // o = R^T y, once per head
        __syncthreads();
        VP::rotate(s_o, Gb, true);
        for (int i = threadIdx.x; i < Gb * D; i += blockDim.x) {
            const int g = i / D, d = i % D;
            store_rot(out, part_acc, r, n_head, kh * G + g0 + g, D, d, n_split, sp, s_o[g * D + d]);
        }
    }
}
