// Decode attention over long rows, K / V streamed through shared memory (attention.cu's
// attn_stream_d<D> for f16 rows, attn_kv_stream for a KV tier pair).
//
// attn_partial keeps one tile of 8 (_l8: 4) cells in flight per warp (cell index -> K row -> V row, three
// dependent round trips per tile): at 32k cells a 7B layer took ~150 us for its 67 MB of K / V
// (0.45 TB/s, H200). Here a block (one query row, one kv head, HN = 8 or 16 of its query heads,
// one split of the row's cells: grid (T, n_kv * ceil(G / HN), n_split), 2 CT threads) walks its
// cells in tiles of CT (AsLayout: 128 cells and 8 warps up to head size AS_BIG_D, else 64 and 4).
// Each tile's K and V rows are copied, as their bytes, into a ring of NS shared-memory stages with
// cp.async (two threads per row; zero-filled past the split), NS - 1 tiles in flight while the
// block computes on the oldest; a thread's next cell index is loaded into a register one tile
// ahead. Each warp takes 16 cells of a tile and computes S^T = K Q^T and O^T += V^T P^T on the
// tensor cores (mma m16n8k16): the warp's cells (in S^T) and the head's dims (in O^T) are the
// m16 rows, the block's query heads the n8 columns, one n8 tile per 8 heads. A decode step has
// few query heads per kv head (G: 4 on gemma-3-270m, 7 on a Qwen2.5-7B), so with the heads as the
// columns a k step takes one MMA per operand term where the heads as an m16 tile's rows (the
// FlashAttention-2 layout of sp_attn, shared_prefix.cu) took two, and the accumulators hold
// HN, not 16, heads: half the products and half the O registers at HN = 8. Q and P are split into
// f16 hi + lo terms (float32 accuracy, f16_split.cuh); Q's B fragments come from shared memory by
// ldmatrix; S^T's C fragments become P^T's B fragments in registers (the f16 pairs transposed by
// movmatrix, pt_frags). f16 rows are exact f16 operands (K's A fragments by ldmatrix, V's by
// ldmatrix .trans); q8_0, q4_0, q4_1, iq4_nl and turbo2/3/4 codes are f16 operands too, their block scales
// applied outside the products (K: on each block's partial scores; V: on the integer codes as
// hi + lo, on P for the turbo levels; kv_codes.cuh); any other tier's values are decoded (policy
// dec(): scale * code [+ min]) and split into hi + lo. Each warp keeps its own online softmax
// (Milakov & Gimelshein 2018) over its cells; the warps are merged at the end as attn_partial's
// are. Masks, softcap and the output format (n_split == 1: normalized rows, else (acc, m, l)
// partials for attn_merge) are attn_partial's.
//
// Row policy P (K and V each): RB bytes per (cell, kv head) row, copied in CA-byte chunks; F16
// (raw f16 rows); CODES (kv_codes.cuh's operands: C = KvCodes<tier>; kperm / vperm map the MMA's
// k / n index to the dim; PD: C's block scales ride on P); TBK / TBV table bytes (tab_k / tab_v fill them); ROT (a rotated tier:
// the queries are rotated before the split unless they come rotated, q_rot, the output
// un-rotated after the merge). Only where
// used: dec(w, i, tab) value i of a row whose bytes start at w (neither F16 nor CODES),
// rotate(rows, n, inverse) (ROT). Decoded values must lie in f16's range (their hi term): cuda.py
// keeps the f32 / bf16 tiers on attn_kv_g*.
#include "quants.cuh"
#include "mma.cuh"
#include "async_copy.cuh"
#include "f16_split.cuh"

// cells per tile: AS_CT_BIG (8 warps) up to head size AS_BIG_D where two stages of them take at
// most AS_BIG_BYTES of shared memory, else AS_CT (4 warps). f16 keeps 128 (at head size 256 two
// stages of its 128-cell tiles would not fit); a tier module takes cuda.py ATTN_STREAM_BIG_D, 256:
// there a tier's block is issue bound on its decode with one warp per scheduler (turbo3, gemma-3-270m
// at 32k: 10.8 K instructions a warp at 3 cycles each), and 8 warps halve each warp's tiles
// (graph replay, H200: turbo3 18.6 -> 16.1 us a call, q8_0 19.7 -> 18.3)
#define AS_CT 64
#define AS_CT_BIG 128
#define AS_BIG_BYTES 196608
#ifndef AS_BIG_D
#define AS_BIG_D 128  // (a tier module's: cuda_kv.attention_source's big_d)
#endif
#define AS_NEG_INF (-__int_as_float(0x7f800000))
#ifndef ATTN_EARLY
#define ATTN_EARLY 1  // (attention.cu early_rows: the streaming kernel's early copies take the same switch)
#endif

// shared-memory stride of a row of rb bytes: 16-byte aligned and an odd multiple of 16, so the 8
// rows of an MMA fragment fall in different banks
__host__ __device__ constexpr int as_srb(int rb) {
    return ((rb + 15) / 16 * 16) % 32 == 0 ? (rb + 15) / 16 * 16 + 16 : (rb + 15) / 16 * 16;
}
// The block's tile (CT cells, NW = CT / 16 warps of 32 threads) and the byte offsets of its
// dynamic shared memory (cuda.py _as_tile / _as_smem mirror CT / BYTES): queries hi / lo [HN][D + 8]
// halves; NS stages of K rows [CT][SRBK] then V rows [CT][SRBV] (also the warps' merge tile, MS
// bytes); positions [NS][CT]; staging factors [16]; the K and V tables (TBK / TBV bytes: AsTier).
// The queries' float32 staging (QB bytes) starts at the last stage, QF: the first NS - 1 tiles'
// copies, issued before it, land in the stages below it. It fits: from QF on lie at least SB
// bytes, and MS - QO > 2 QB where SB < QB (MS >= NW QB, NW >= 4, NS <= 3).
template <int D, int HN, int RBK, int RBV, int TBK, int TBV>
struct AsLayout {
    static constexpr int LDQ = D + 8, SRBK = as_srb(RBK), SRBV = as_srb(RBV);
    static constexpr int CT = D <= AS_BIG_D && 2 * AS_CT_BIG * (SRBK + SRBV) <= AS_BIG_BYTES ? AS_CT_BIG : AS_CT;
    static constexpr int NW = CT / 16;
    static constexpr int SB = CT * (SRBK + SRBV);
    static constexpr int NS = 3 * SB <= 110592 ? 3 : 2;
    static constexpr int MS = NW * HN * D * 4 + 2 * NW * HN * 4;
    static constexpr int R = NS * SB > MS ? NS * SB : MS;
    static constexpr int QB = HN * D * 4, QO = (NS - 1) * SB;
    static_assert(QO + QB <= R, "AsLayout: the queries' staging fits from the last stage on");
    static constexpr int ST = 2 * HN * LDQ * 2, QF = ST + QO, POS = ST + R, UP = POS + NS * CT * 4, TAB = UP + 64;
    static constexpr int TABV = TAB + TBK, BYTES = TABV + TBV;
};

// A block's NH query rows staged: rows first .. first + Gb - 1 of q [.., D] (the block's heads of
// its query row) times scale, zero past Gb, into s [NH][D] (shared memory). Thread t of the block's NT
// holds values t + NT k in registers: every load is issued before the first store (a loop of load
// -> shared store waited a round trip per value). load_q_rows fills x (a rotated K tier rotates
// them there, fwht_regs), store_q_rows writes them to s.
template <int NH, int D, int NT>
struct QRows {
    static constexpr int NV = (NH * D + NT - 1) / NT;
};
template <int NH, int D, int NT>
__device__ __forceinline__ void load_q_rows(const float* __restrict__ q, long long first, int Gb, float scale,
                                            float (&x)[QRows<NH, D, NT>::NV]) {
#pragma unroll
    for (int k = 0; k < QRows<NH, D, NT>::NV; k++) {
        const int i = threadIdx.x + NT * k, g = i / D;
        x[k] = i < NH * D && g < Gb ? q[(first + g) * D + i % D] * scale : 0.f;
    }
}
template <int NH, int D, int NT>
__device__ __forceinline__ void store_q_rows(const float (&x)[QRows<NH, D, NT>::NV], float (*s)[D]) {
#pragma unroll
    for (int k = 0; k < QRows<NH, D, NT>::NV; k++) {
        const int i = threadIdx.x + NT * k;
        if (i < NH * D) s[i / D][i % D] = x[k];
    }
}

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
// A rotated V tier's split partials stay in its rotated domain where attn_merge un-rotates the
// merged head (lse_unrotate, once per head: its 256-element window holds whole heads up to D =
// 256; cuda.py passes it the signs on the same condition); else (one split, or D = 512) the
// attention kernel un-rotates its block's result (rot_head / store_rot).
#ifndef KV_MERGE_UNROTATE
#define KV_MERGE_UNROTATE 1  // 0: the kernels un-rotate every split's partial (cuda.py MERGE_UNROTATE)
#endif
__host__ __device__ constexpr bool merge_unrotates(int D, int n_split) {
    return KV_MERGE_UNROTATE != 0 && n_split > 1 && D <= 256;
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

// P^T's B fragments (mma.cuh; cells 2 tig.. | 2 tig + 8.., head gid) of a head tile from this
// thread's probabilities x of S^T's C fragment (cells gid | gid + 8, heads 2 tig, + 1), those cells'
// times d0 | d1: f16 hi + lo pairs (LO as sp_split2's), each moved to the transposed tile
template <int LO>
__device__ __forceinline__ void pt_frags(const float (&x)[4], float d0, float d1, u32 (&bh)[2], u32 (&bl)[2]) {
    u32 h0, l0, h1, l1;
    sp_split2<LO>(x[0] * d0, x[1] * d0, h0, l0);
    sp_split2<LO>(x[2] * d1, x[3] * d1, h1, l1);
    bh[0] = movm_t(h0); bh[1] = movm_t(h1);
    bl[0] = movm_t(l0); bl[1] = movm_t(l1);
}

template <int D, int HN, class KP, class VP>
__device__ __forceinline__ void attn_stream_impl(
    const float* __restrict__ q, const int* __restrict__ q_pos, const int* __restrict__ row_view,
    const int* __restrict__ view_off, const int* __restrict__ cells, const int* __restrict__ cell_pos,
    const u8* __restrict__ K, const u8* __restrict__ V, int n_head, int n_kv, float scale, int n_swa,
    float softcap, int n_split, float* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml,
    bool q_rot) {
    static_assert(HN == 8 || HN == 16, "attn_stream_impl: 8 or 16 query heads per block");
    using L = AsLayout<D, HN, KP::RB, VP::RB, KP::TBK, VP::TBV>;
    constexpr int CT = L::CT, NW = L::NW, NS = L::NS, LDQ = L::LDQ, NH = HN / 8, MD = D / 16;
    constexpr int NCK = KP::RB / KP::CA, NCV = VP::RB / VP::CA;  // copy chunks per row
    extern __shared__ __align__(16) unsigned char as_smem[];
    u16* s_qh = (u16*)as_smem;
    u16* s_ql = s_qh + HN * LDQ;
    u8* s_st = as_smem + L::ST;
    int* s_pos = (int*)(as_smem + L::POS);
    float* s_up = (float*)(as_smem + L::UP);
    u8* s_tk = as_smem + L::TAB;
    u8* s_tv = as_smem + L::TABV;
    // Before the wait on the kernel's predecessor (pdl.cuh; in a decode graph, while the layer's
    // store still runs): the tables (from __constant__ levels), the plan's indices (host-staged:
    // q_pos, row_view, view_off, cells, cell_pos; attention.cu early_rows) and, with ATTN_EARLY,
    // the first NS - 1 tiles' copies of the rows no running kernel writes: a view's cells but
    // for its last T (its new cells, at most one a row: early_rows), and the zero fills past the
    // split. The rest of those tiles' rows are copied after the wait, into the same cp.async
    // groups (the first group holds every early copy). Nothing before the wait reads q or
    // writes global memory.
    if constexpr (KP::TBK > 0) KP::tab_k(s_tk);
    if constexpr (VP::TBV > 0) VP::tab_v(s_tv);

    const int r = blockIdx.x, sp = blockIdx.z;
    const int G = n_head / n_kv, n_hg = (G + HN - 1) / HN;
    const int kh = blockIdx.y / n_hg, g0 = (blockIdx.y % n_hg) * HN, Gb = min(HN, G - g0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const int qp = q_pos[r], vw = row_view[r];
    const int b0 = view_off[vw], len = view_off[vw + 1] - b0;
    const int chunk = (len + n_split - 1) / n_split;
    const int c0 = b0 + min(len, sp * chunk), c1 = min(b0 + len, c0 + chunk);
    const int ntile = (c1 - c0 + CT - 1) / CT;
    const int c_new = b0 + len - (int)gridDim.x;  // the view's possibly new cells: c_new ..

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
    // this thread's row of tile j (cell index cell) is copied before the wait
    auto early = [&](int j, int cell) { return ATTN_EARLY != 0 && (cell < 0 || c0 + j * CT + crow < c_new); };
#pragma unroll
    for (int j = 0; j < NS - 1; j++)
        if (j < ntile && early(j, pre[j])) fill(j, pre[j]);
    GRID_DEP_WAIT();

    // The first NS - 1 tiles' other copies, then the heads' scaled queries (rows g >= Gb zero) as
    // f16 hi + lo. Program order: q's loads are issued before the copies, which wait on pre[]'s
    // cell indices where ATTN_EARLY is 0 (a warp issues in order: after them q's loads would
    // queue behind that round trip); the copies land in stages 0 .. NS - 2 while q is staged at
    // QF, the last stage, in float32: q * scale (rotated for a rotated K tier: q -> R q; only the
    // Gb heads' rows, the rest are zero), each head's staging factor from those values, then the
    // hi + lo split.
    float* qf = (float*)(as_smem + L::QF);
    float qx[QRows<HN, D, 32 * NW>::NV];
    load_q_rows<HN, D, 32 * NW>(q, (long long)r * n_head + kh * G + g0, Gb, scale, qx);
#pragma unroll
    for (int j = 0; j < NS - 1; j++) {
        if (j < ntile && !early(j, pre[j])) fill(j, pre[j]);
        cp_async_commit();
    }
    int nxt = cell_of(NS - 1);
    store_q_rows<HN, D, 32 * NW>(qx, (float (*)[D])qf);
    __syncthreads();
    if constexpr (KP::ROT) {
        if (!q_rot) KP::rotate(qf, Gb, false);  // (q_rot: the fused rope + store rotated q)
    }
    for (int g = warp; g < HN; g += NW) {
        float mx = 0.f;
        for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(qf[g * D + d]));
#pragma unroll
        for (int sh = 16; sh; sh >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, sh));
        if (lane == 0) s_up[g] = sp_stage_factor(mx);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < HN * D; i += blockDim.x) {
        const int g = i / D, d = i % D;  // d: the MMA's k index (the tier's dim order)
        const float x = qf[g * D + KP::kperm(d)] / s_up[g];
        const u16 h = sp_f2h(x);
        s_qh[g * LDQ + d] = h;
        s_ql[g * LDQ + d] = sp_f2h(x - h2f(h));
    }
    if constexpr (KP::MIN) {  // a minimum K tier: each head's sum of those values over each block, [HN][D / BS]
        constexpr int BS = KP::C::BS;
        static_assert(!KP::MIN || HN * (D / BS) * 4 <= KP::TBK, "attn_stream_impl: the block sums fit the K table");
        for (int i = threadIdx.x; i < HN * (D / BS); i += blockDim.x) {
            const int g = i / (D / BS), b = i % (D / BS);
            float z = 0.f;  // (each thread from its own bank on: i + jj)
            for (int jj = 0; jj < BS; jj++) z += qf[g * D + b * BS + (i + jj) % BS];
            ((float*)s_tk)[i] = z / s_up[g];  // (a power of two: the staged values' sum)
        }
    }
    __syncthreads();  // the queries are staged (and the last stage free for tile NS - 1)

    // The warp's 16 cells of a tile are the rows of the MMAs' m16 tiles, the block's heads their
    // n8 columns: this thread's accumulators hold cells (S^T) or dims (O^T) gid, gid + 8 of heads
    // 8 nh + 2 tig + e, e = 0, 1
    const int cw = 16 * warp;  // the warp's first cell of a tile
    float up[NH][2], m[NH][2], l[NH][2];
#pragma unroll
    for (int nh = 0; nh < NH; nh++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            up[nh][e] = s_up[8 * nh + 2 * tig + e];
            m[nh][e] = AS_NEG_INF;
            l[nh][e] = 0.f;
        }
    float o[MD][NH][4];
#pragma unroll
    for (int md = 0; md < MD; md++)
#pragma unroll
        for (int nh = 0; nh < NH; nh++) o[md][nh][0] = o[md][nh][1] = o[md][nh][2] = o[md][nh][3] = 0.f;
    // a minimum V tier: sum over the warp's cells of p m per block (this thread's cells gid, gid + 8;
    // summed over gid at the end) for heads 8 nh + 2 tig + e, added to the block's dims
    constexpr int VB = VP::MIN ? D / 32 : 1;
    float mv[VB][NH][2];
#pragma unroll
    for (int b = 0; b < VB; b++)
#pragma unroll
        for (int nh = 0; nh < NH; nh++) mv[b][nh][0] = mv[b][nh][1] = 0.f;
    // the lane's ldmatrix rows: query head (lane & 7) of a head tile at dim (lane >> 3) 8 of two k
    // steps (B fragments of both); K cell cw + (lane & 15) at dim (lane >> 4) 8 of a k step (A);
    // V cell cw + (lane & 7) + (lane >> 4) 8 at dim ((lane >> 3) & 1) 8 of an m16 tile (A, .trans)
    const u16* qlh = s_qh + (lane & 7) * LDQ + (lane >> 3) * 8;
    const u16* qll = s_ql + (lane & 7) * LDQ + (lane >> 3) * 8;
    auto ld_q = [&](int kk, u32 (&qh)[NH][4], u32 (&ql)[NH][4]) {  // k steps kk, kk + 1
#pragma unroll
        for (int nh = 0; nh < NH; nh++) {
            ldsm4(qlh + 8 * nh * LDQ + kk * 16, qh[nh]);
            ldsm4(qll + 8 * nh * LDQ + kk * 16, ql[nh]);
        }
    };

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

        // S^T = K Q^T for the warp's 16 cells; four accumulators per head tile (hi / lo query
        // terms, even / odd k steps) keep the MMA chains short
        float sa[2][NH][4], sb[2][NH][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int nh = 0; nh < NH; nh++)
#pragma unroll
                for (int e = 0; e < 4; e++) sa[a][nh][e] = sb[a][nh][e] = 0.f;
        if constexpr (KP::CODES) {  // per block: the codes times the query, then times the block scale
            using C = typename KP::C;
            constexpr int NSB = C::BS / 16;
#pragma unroll
            for (int b = 0; b < D / C::BS; b++) {
                u32 w[2][C::NW];  // cells gid, gid + 8
#pragma unroll
                for (int h = 0; h < 2; h++)
                    C::kraw(sk + (cw + 8 * h + gid) * L::SRBK + b * C::BB, tig, (C::BB * b + 2) % 4 == 0, w[h]);
                float t[2][NH][4];
#pragma unroll
                for (int a = 0; a < 2; a++)
#pragma unroll
                    for (int nh = 0; nh < NH; nh++)
#pragma unroll
                        for (int e = 0; e < 4; e++) t[a][nh][e] = 0.f;
#pragma unroll
                for (int s = 0; s < NSB; s += 2) {
                    u32 qh[NH][4], ql[NH][4];
                    ld_q(b * NSB + s, qh, ql);
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const u32 a0 = C::kpair(w[0], s + u, 0, s_tk), a1 = C::kpair(w[1], s + u, 0, s_tk);
                        const u32 a2 = C::kpair(w[0], s + u, 1, s_tk), a3 = C::kpair(w[1], s + u, 1, s_tk);
#pragma unroll
                        for (int nh = 0; nh < NH; nh++) {
                            mma_m16n8k16(t[u][nh], a0, a1, a2, a3, qh[nh][2 * u], qh[nh][2 * u + 1]);
                            mma_m16n8k16(t[u][nh], a0, a1, a2, a3, ql[nh][2 * u], ql[nh][2 * u + 1]);
                        }
                    }
                }
                // rows gid, gid + 8: those cells' block scales
                const float d0 = h2f(C::dh(sk + (cw + gid) * L::SRBK + b * C::BB));
                const float d1 = h2f(C::dh(sk + (cw + 8 + gid) * L::SRBK + b * C::BB));
#pragma unroll
                for (int nh = 0; nh < NH; nh++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        sa[b & 1][nh][e] += (t[0][nh][e] + t[1][nh][e]) * d0;
                        sa[b & 1][nh][2 + e] += (t[0][nh][2 + e] + t[1][nh][2 + e]) * d1;
                    }
                if constexpr (KP::MIN) {  // + the cells' block minima times the heads' block sums of q
                    const float m0 = h2f(C::mh(sk + (cw + gid) * L::SRBK + b * C::BB));
                    const float m1 = h2f(C::mh(sk + (cw + 8 + gid) * L::SRBK + b * C::BB));
#pragma unroll
                    for (int nh = 0; nh < NH; nh++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const float z = ((const float*)s_tk)[(8 * nh + 2 * tig + e) * (D / C::BS) + b];
                            sa[b & 1][nh][e] += m0 * z;
                            sa[b & 1][nh][2 + e] += m1 * z;
                        }
                }
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < MD; kk += 2) {
                u32 qh[NH][4], ql[NH][4];
                ld_q(kk, qh, ql);
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    if constexpr (KP::F16) {
                        u32 a[4];
                        ldsm4(sk + (cw + (lane & 15)) * L::SRBK + ((kk + u) * 16 + (lane >> 4) * 8) * 2, a);
#pragma unroll
                        for (int nh = 0; nh < NH; nh++) {
                            mma_m16n8k16(sa[u][nh], a[0], a[1], a[2], a[3], qh[nh][2 * u], qh[nh][2 * u + 1]);
                            mma_m16n8k16(sb[u][nh], a[0], a[1], a[2], a[3], ql[nh][2 * u], ql[nh][2 * u + 1]);
                        }
                    } else {  // decoded: A = K hi + lo, rows gid, gid + 8
                        const u32* w0 = (const u32*)(sk + (cw + gid) * L::SRBK);
                        const u32* w1 = (const u32*)(sk + (cw + 8 + gid) * L::SRBK);
                        const int i0 = (kk + u) * 16 + 2 * tig;
                        const float* tk = (const float*)s_tk;
                        u32 ah[4], al[4];
                        sp_split2(KP::dec(w0, i0, tk), KP::dec(w0, i0 + 1, tk), ah[0], al[0]);
                        sp_split2(KP::dec(w1, i0, tk), KP::dec(w1, i0 + 1, tk), ah[1], al[1]);
                        sp_split2(KP::dec(w0, i0 + 8, tk), KP::dec(w0, i0 + 9, tk), ah[2], al[2]);
                        sp_split2(KP::dec(w1, i0 + 8, tk), KP::dec(w1, i0 + 9, tk), ah[3], al[3]);
#pragma unroll
                        for (int nh = 0; nh < NH; nh++) {
                            const u32 bh0 = qh[nh][2 * u], bh1 = qh[nh][2 * u + 1];
                            mma_m16n8k16(sa[u][nh], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
                            mma_m16n8k16(sb[u][nh], ah[0], ah[1], ah[2], ah[3], ql[nh][2 * u], ql[nh][2 * u + 1]);
                            mma_m16n8k16(sb[u][nh], al[0], al[1], al[2], al[3], bh0, bh1);
                        }
                    }
                }
            }
        }
        // masks (cells past the split included), softcap, online softmax of heads 8 nh + 2 tig + e
        // over the warp's cells (rows gid, gid + 8 here, the rest in the lanes of the other gid)
        bool ok[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int c = cw + 8 * h + gid, cpos = spos[c];
            ok[h] = c < n && cpos <= qp && !(n_swa > 0 && qp - cpos >= n_swa);
        }
        float s[NH][4];
#pragma unroll
        for (int nh = 0; nh < NH; nh++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float mx = AS_NEG_INF;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int x = 2 * h + e;
                    float v = (sa[0][nh][x] + sa[1][nh][x] + sb[0][nh][x] + sb[1][nh][x]) * up[nh][e];
                    if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                    s[nh][x] = ok[h] ? v : AS_NEG_INF;
                    mx = fmaxf(mx, s[nh][x]);
                }
#pragma unroll
                for (int sh = 4; sh < 32; sh <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, sh));
                const float mn = fmaxf(m[nh][e], mx);
                const float corr = m[nh][e] == AS_NEG_INF ? 0.f : __expf(m[nh][e] - mn);
                m[nh][e] = mn;
                l[nh][e] *= corr;
#pragma unroll
                for (int md = 0; md < MD; md++) { o[md][nh][e] *= corr; o[md][nh][2 + e] *= corr; }
                if constexpr (VP::MIN) {
#pragma unroll
                    for (int b = 0; b < VB; b++) mv[b][nh][e] *= corr;
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float v = s[nh][2 * h + e];
                    const float p = v == AS_NEG_INF ? 0.f : __expf(v - mn);
                    s[nh][2 * h + e] = p;
                    l[nh][e] += p;
                }
            }
        // O^T += V^T P^T (pt_frags: P^T's B fragments). A tier's A fragments take their columns
        // from the V rows of cells 2 tig, + 1 | + 8, + 9
        const u8* v0 = sv + (cw + 2 * tig) * L::SRBV;
        const u8* v1 = v0 + L::SRBV;
        const u8* v2 = v0 + 8 * L::SRBV;
        const u8* v3 = v0 + 9 * L::SRBV;
        if constexpr (VP::MIN) {  // p m of the cells gid, gid + 8 (rows h = 0, 1 of s)
            static_assert(!VP::MIN || VP::C::BS == 32, "attn_stream_impl: a minimum V tier of 32-value blocks");
#pragma unroll
            for (int b = 0; b < VB; b++) {
                const float m0 = h2f(VP::C::mh(sv + (cw + gid) * L::SRBV + b * VP::C::BB));
                const float m1 = h2f(VP::C::mh(sv + (cw + 8 + gid) * L::SRBV + b * VP::C::BB));
#pragma unroll
                for (int nh = 0; nh < NH; nh++)
#pragma unroll
                    for (int e = 0; e < 2; e++) mv[b][nh][e] += s[nh][e] * m0 + s[nh][2 + e] * m1;
            }
        }
        u32 ph[NH][2], pl[NH][2];  // P^T's B fragments where the block scales do not ride on P
        if constexpr (!VP::PD) {
#pragma unroll
            for (int nh = 0; nh < NH; nh++) pt_frags<1>(s[nh], 1.f, 1.f, ph[nh], pl[nh]);
        }
        if constexpr (VP::CODES) {  // A = the codes of column gid of n8 tiles k, k + 1 (NK per block)
            using C = typename VP::C;
            constexpr int NK = C::BS / 8;
#pragma unroll
            for (int b = 0; b < D / C::BS; b++) {
                const int ob = b * C::BB;
                const bool a4 = (C::BB * b + 2) % 4 == 0;
                const u32 r0 = C::vraw(v0 + ob, gid, a4), r1 = C::vraw(v1 + ob, gid, a4);
                const u32 r2 = C::vraw(v2 + ob, gid, a4), r3 = C::vraw(v3 + ob, gid, a4);
                if constexpr (VP::PD) {  // the levels as they are, the block scales on P (P' = p d,
                                         // hi + lo 2^11; d of the rows gid | gid + 8 before the transpose)
                    const float d0 = h2f(C::dh(sv + (cw + gid) * L::SRBV + ob));
                    const float d1 = h2f(C::dh(sv + (cw + 8 + gid) * L::SRBV + ob));
                    u32 qh[NH][2], ql[NH][2];
#pragma unroll
                    for (int nh = 0; nh < NH; nh++) pt_frags<2048>(s[nh], d0, d1, qh[nh], ql[nh]);
#pragma unroll
                    for (int k = 0; k < NK; k += 2) {  // lo x (levels 2^-11): exact, the levels' test
                        const u32 a0 = C::vcodes(r0, r1, k, s_tv), a1 = C::vcodes(r0, r1, k + 1, s_tv);
                        const u32 a2 = C::vcodes(r2, r3, k, s_tv), a3 = C::vcodes(r2, r3, k + 1, s_tv);
                        const u32 x0 = hmul2(a0, H2_2M11), x1 = hmul2(a1, H2_2M11);
                        const u32 x2 = hmul2(a2, H2_2M11), x3 = hmul2(a3, H2_2M11);
#pragma unroll
                        for (int nh = 0; nh < NH; nh++) {
                            float* acc = o[(b * NK + k) / 2][nh];
                            mma_m16n8k16(acc, a0, a1, a2, a3, qh[nh][0], qh[nh][1]);
                            mma_m16n8k16(acc, x0, x1, x2, x3, ql[nh][0], ql[nh][1]);
                        }
                    }
                } else {  // the codes times their cells' block scales (hi + lo)
                    const u32 d01 = (u32)C::dh(v0 + ob) | (u32)C::dh(v1 + ob) << 16;
                    const u32 d23 = (u32)C::dh(v2 + ob) | (u32)C::dh(v3 + ob) << 16;
#pragma unroll
                    for (int k = 0; k < NK; k += 2) {
                        u32 ah[4], al[4];
                        scale_pair(C::vcodes(r0, r1, k, s_tv), d01, ah[0], al[0]);
                        scale_pair(C::vcodes(r0, r1, k + 1, s_tv), d01, ah[1], al[1]);
                        scale_pair(C::vcodes(r2, r3, k, s_tv), d23, ah[2], al[2]);
                        scale_pair(C::vcodes(r2, r3, k + 1, s_tv), d23, ah[3], al[3]);
#pragma unroll
                        for (int nh = 0; nh < NH; nh++) {
                            float* acc = o[(b * NK + k) / 2][nh];
                            mma_m16n8k16(acc, ah[0], ah[1], ah[2], ah[3], ph[nh][0], ph[nh][1]);
                            mma_m16n8k16(acc, ah[0], ah[1], ah[2], ah[3], pl[nh][0], pl[nh][1]);
                            mma_m16n8k16(acc, al[0], al[1], al[2], al[3], ph[nh][0], ph[nh][1]);
                        }
                    }
                }
            }
        } else if constexpr (VP::F16) {
            const u8* vr = sv + (cw + (lane & 7) + (lane >> 4) * 8) * L::SRBV + ((lane >> 3) & 1) * 16;
#pragma unroll
            for (int md = 0; md < MD; md++) {
                u32 a[4];
                ldsm4t(vr + md * 32, a);
#pragma unroll
                for (int nh = 0; nh < NH; nh++) {
                    mma_m16n8k16(o[md][nh], a[0], a[1], a[2], a[3], ph[nh][0], ph[nh][1]);
                    mma_m16n8k16(o[md][nh], a[0], a[1], a[2], a[3], pl[nh][0], pl[nh][1]);
                }
            }
        } else {  // A = V^T[dims md 16 + gid (+ 8)][cells 2tig, 2tig + 1 | + 8, + 9], decoded
            const u32 *w0 = (const u32*)v0, *w1 = (const u32*)v1, *w2 = (const u32*)v2, *w3 = (const u32*)v3;
            const float* tv = (const float*)s_tv;
#pragma unroll
            for (int md = 0; md < MD; md++) {
                const int i = md * 16 + gid;
                u32 ah[4], al[4];
                sp_split2(VP::dec(w0, i, tv), VP::dec(w1, i, tv), ah[0], al[0]);
                sp_split2(VP::dec(w0, i + 8, tv), VP::dec(w1, i + 8, tv), ah[1], al[1]);
                sp_split2(VP::dec(w2, i, tv), VP::dec(w3, i, tv), ah[2], al[2]);
                sp_split2(VP::dec(w2, i + 8, tv), VP::dec(w3, i + 8, tv), ah[3], al[3]);
#pragma unroll
                for (int nh = 0; nh < NH; nh++) {
                    mma_m16n8k16(o[md][nh], ah[0], ah[1], ah[2], ah[3], ph[nh][0], ph[nh][1]);
                    mma_m16n8k16(o[md][nh], ah[0], ah[1], ah[2], ah[3], pl[nh][0], pl[nh][1]);
                    mma_m16n8k16(o[md][nh], al[0], al[1], al[2], al[3], ph[nh][0], ph[nh][1]);
                }
            }
        }
        __syncthreads();  // the stage is refilled next iteration
    }
    cp_async_wait<0>();
#pragma unroll
    for (int nh = 0; nh < NH; nh++)
#pragma unroll
        for (int e = 0; e < 2; e++)
#pragma unroll
            for (int sh = 4; sh < 32; sh <<= 1) l[nh][e] += __shfl_xor_sync(0xffffffffu, l[nh][e], sh);
    if constexpr (VP::MIN) {  // the warp's p m sums, on every dim of their block (m16 tiles 2 b, 2 b + 1)
#pragma unroll
        for (int b = 0; b < VB; b++)
#pragma unroll
            for (int nh = 0; nh < NH; nh++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
#pragma unroll
                    for (int sh = 4; sh < 32; sh <<= 1) mv[b][nh][e] += __shfl_xor_sync(0xffffffffu, mv[b][nh][e], sh);
#pragma unroll
                    for (int md = 2 * b; md < 2 * b + 2; md++) { o[md][nh][e] += mv[b][nh][e]; o[md][nh][2 + e] += mv[b][nh][e]; }
                }
    }
    // merge the warps (their tiles reuse the stages): s_o [NW][HN][D], s_m / s_l [NW][HN]
    __syncthreads();
    float* s_o = (float*)s_st;
    float* s_m = s_o + NW * HN * D;
    float* s_l = s_m + NW * HN;
#pragma unroll
    for (int md = 0; md < MD; md++)
#pragma unroll
        for (int nh = 0; nh < NH; nh++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 2; e++)  // row gid + 8 h of m16 tile md: dim vperm(2 md + h, gid)
                    s_o[(warp * HN + 8 * nh + 2 * tig + e) * D + VP::vperm(2 * md + h, gid)] = o[md][nh][2 * h + e];
    if (gid == 0) {
#pragma unroll
        for (int nh = 0; nh < NH; nh++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                s_m[warp * HN + 8 * nh + 2 * tig + e] = m[nh][e];
                s_l[warp * HN + 8 * nh + 2 * tig + e] = l[nh][e];
            }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < Gb * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float M = AS_NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; w++) M = fmaxf(M, s_m[w * HN + g]);
        float Ls = 0.f, A = 0.f;
        if (M != AS_NEG_INF) {
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const float mw = s_m[w * HN + g];
                if (mw == AS_NEG_INF) continue;
                const float f = __expf(mw - M);
                Ls += s_l[w * HN + g] * f;
                A += s_o[(w * HN + g) * D + d] * f;
            }
        }
        if (VP::ROT && !merge_unrotates(D, n_split)) {  // un-rotated below; only this thread reads (., g, d)
            s_o[g * D + d] = rot_head(part_ml, r, n_head, kh * G + g0 + g, d, n_split, sp, M, Ls, A);
        } else {
            store_head(out, part_acc, part_ml, r, n_head, kh * G + g0 + g, D, d, n_split, sp, M, Ls, A);
        }
    }
    if constexpr (VP::ROT) {
        if (!merge_unrotates(D, n_split)) {  // o = R^T y, once per head (n_split uniform: the syncs)
            __syncthreads();
            VP::rotate(s_o, Gb, true);
            for (int i = threadIdx.x; i < Gb * D; i += blockDim.x) {
                const int g = i / D, d = i % D;
                store_rot(out, part_acc, r, n_head, kh * G + g0 + g, D, d, n_split, sp, s_o[g * D + d]);
            }
        }
    }
}
