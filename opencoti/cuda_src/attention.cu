// Attention over KV cells (paged at cell granularity), flash-decoding style.
//
// Query row r (one token of the ubatch) belongs to view vw = row_view[r]; its
// candidate cells are cells[view_off[vw] .. view_off[vw+1]) (flat indices into
// the f16 K/V storage [n_cells_total, n_kv, D]) with positions cell_pos[]. A
// cell is visible when cell_pos <= q_pos and, with n_swa > 0,
// q_pos - cell_pos < n_swa (llama.cpp's standard SWA). GQA: query head
// h reads kv head h / G.
//
// attn_partial: grid (T, n_kv * ceil(G / MAXG), n_split), 4 warps; a block serves up
// to MAXG query heads of one kv head (any G: larger groups take several blocks).
// The block's (scaled) queries sit in shared memory. Each warp takes tiles of 8
// cells (4 in the _l8 kernels: short splits at head sizes 256 / 512): 4 lanes per cell (8)
// compute the scores (each a quarter (an eighth) of the K row, 16-byte loads),
// the tile's softmax update is one warp max + sum, then the lanes switch to
// dims and accumulate p * V cell by cell (each V row read coalesced). Split s of a view covers an
// equal slice of its cells; the online softmax is Milakov & Gimelshein 2018. Warps merge in shared memory; with n_split == 1 the
// normalized output is written directly, else (max, sum, acc) partials that
// attn_merge combines by log-sum-exp (Dao et al., flash-decoding).
#include "quants.cuh"
#include "lse_merge.cuh"
#include "digits.cuh"
#include "attn_stream.cuh"

#define NWARP 4
#ifndef ATTN_V_PREFETCH
#define ATTN_V_PREFETCH 1  // cuda.py ATTN_V_PREFETCH: 1 L1, 2 L2, 0 none
#endif
#define NEG_INF (-__int_as_float(0x7f800000))

// E consecutive f16 values -> float (16-byte loads when E is a multiple of 8, 8-byte for 4)
template <int E>
__device__ __forceinline__ void load_halves(const u16* __restrict__ p, float* f) {
    if constexpr (E % 8 == 0) {
#pragma unroll
        for (int c = 0; c < E / 8; c++) {
            uint4 w = ((const uint4*)p)[c];
            u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; j++) { f[8 * c + 2 * j] = h2f((u16)(ws[j] & 0xFFFF)); f[8 * c + 2 * j + 1] = h2f((u16)(ws[j] >> 16)); }
        }
    } else if constexpr (E == 4) {
        uint2 w = *(const uint2*)p;
        f[0] = h2f((u16)(w.x & 0xFFFF)); f[1] = h2f((u16)(w.x >> 16)); f[2] = h2f((u16)(w.y & 0xFFFF)); f[3] = h2f((u16)(w.y >> 16));
    } else {
#pragma unroll
        for (int e = 0; e < E; e++) f[e] = h2f(p[e]);
    }
}

// Merge the block's NWARP warps' online-softmax partials (per lane: acc[g][0..E) for dims
// lane * E.., m[g], l[g] of query head g < Gb) through the shared arrays s_acc / s_m / s_l;
// then emit(g, d, M, L, A) once per (head, dim), spread over the block's threads: M the
// running max (NEG_INF when no cell was visible), L the sum of exp, A the unnormalised output.
template <int D, int MAXG, int E, class Emit>
__device__ __forceinline__ void merge_warps(const float (&acc)[MAXG][E], const float (&m)[MAXG],
                                            const float (&l)[MAXG], int Gb, int warp, int lane,
                                            float (*s_acc)[MAXG][D], float (*s_m)[MAXG], float (*s_l)[MAXG],
                                            Emit emit) {
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g < Gb) {
#pragma unroll
            for (int e = 0; e < E; e++) s_acc[warp][g][lane * E + e] = acc[g][e];
            if (lane == 0) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < Gb * D; idx += blockDim.x) {
        int g = idx / D, d = idx % D;
        float M = NEG_INF;
        for (int w = 0; w < NWARP; w++) M = fmaxf(M, s_m[w][g]);
        float L = 0.f, A = 0.f;
        if (M != NEG_INF) {
            for (int w = 0; w < NWARP; w++) {
                if (s_m[w][g] == NEG_INF) continue;
                float f = __expf(s_m[w][g] - M);
                L += s_l[w][g] * f;
                A += s_acc[w][g][d] * f;
            }
        }
        emit(g, d, M, L, A);
    }
}

// Online-softmax update for one tile of cells whose lanes hold LPC lanes per cell (each lane's
// s[g] a partial score of its cell: summed over the cell's LPC lanes first): the tile's max and
// sum over the warp's cells, the running (m, l) and the accumulators rescaled; p[g] = each lane's
// cell's exp(score - max) (0 for masked cells, ok false). Softcap as llama.cpp (tanh).
template <int LPC, int MAXG, int E>
__device__ __forceinline__ void softmax_tile(const float (&s)[MAXG], bool ok, int Gb, float softcap,
                                             float (&m)[MAXG], float (&l)[MAXG], float (&acc)[MAXG][E],
                                             float (&p)[MAXG]) {
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g < Gb) {
            float sg = s[g];
#pragma unroll
            for (int o = 1; o < LPC; o <<= 1) sg += __shfl_xor_sync(0xffffffffu, sg, o);
            if (softcap > 0.f) sg = softcap * tanhf(sg / softcap);
            float tm = ok ? sg : NEG_INF;
#pragma unroll
            for (int o = 16; o >= LPC; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
            float mn = fmaxf(m[g], tm);
            float corr = m[g] == NEG_INF ? 0.f : __expf(m[g] - mn);
            p[g] = ok ? __expf(sg - mn) : 0.f;
            float ps = p[g];  // a cell's p is held by its LPC lanes: sum over one lane per cell
#pragma unroll
            for (int o = 16; o >= LPC; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l[g] = l[g] * corr + ps;
#pragma unroll
            for (int e = 0; e < E; e++) acc[g][e] *= corr;
            m[g] = mn;
        }
    }
}

// The row of RB bytes at `row` asked for ahead of its loads (ATTN_V_PREFETCH: into L1 or L2; 0:
// nothing) by a warp: lane l the line of byte l (RB - 1) / 31 (lane 31 the row's last byte; steps
// of at most 128 bytes), so every line of the row. The short-row kernels with tiles of up to 8
// cells ask for a tile's V rows before its QK: a decode step's tile is one dependent chain (cell
// index -> K row -> dot products -> softmax -> V row), and the V rows' memory latency then
// overlaps the K rows' and the dot products instead of following them.
template <int RB>
__device__ __forceinline__ void prefetch_row(const void* row, int lane) {
    static_assert(RB >= 1 && (RB - 1 + 30) / 31 <= 128, "prefetch_row: a lane's step of at most a line");
    const char* a = (const char*)row + lane * (RB - 1) / 31;
#if ATTN_V_PREFETCH == 1
    asm volatile("prefetch.global.L1 [%0];" ::"l"(a));
#elif ATTN_V_PREFETCH == 2
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
#else
    (void)a;
#endif
}

// A tile's cells (cell: each lane's, the tile's cell j at lane LPC j) into cjs, and their V rows
// (RB bytes each, kv head kh of n_kv, from V) asked for (prefetch_row). Every lane of the warp.
template <int TILE, int LPC, int RB>
__device__ __forceinline__ void tile_cells(int cell, const void* V, int n_kv, int kh, int lane, int (&cjs)[TILE]) {
#pragma unroll
    for (int j = 0; j < TILE; j++) {
        cjs[j] = __shfl_sync(0xffffffffu, cell, LPC * j);
        prefetch_row<RB>((const u8*)V + ((long long)cjs[j] * n_kv + kh) * RB, lane);
    }
}

// ATTN_EARLY (default 1; cuda.py ATTN_EARLY, OPENCOTI_CUDA_ATTN_EARLY=0 builds 0): the short-row
// kernels ask for their first tile's K and V rows (RBK / RBV bytes, kv head kh of n_kv) into L1
// before their PDL wait, while the kernel before them (the layer's KV store) still runs, so that
// after the wait the tile's loads hit L1 instead of going to memory. Only cells the store cannot
// be writing: a ubatch's new cells are the last ones of each view's list, at most one a row
// (kv_cache.py CachePlan.flat), so the first len - T of a view (T = gridDim.x, the ubatch's
// rows) were written by kernels that have completed (pdl.cuh: when this kernel starts, every
// kernel before the store has). It reads only the plan's row_view / view_off / cells and asks for
// its q_pos / cell_pos (all host-staged: every one of them). A prefetch changes no value: the
// same bits with 0. The whole warp calls it.
#ifndef ATTN_EARLY
#define ATTN_EARLY 1
#endif
template <int TILE, int LPC, int RBK, int RBV>
__device__ __forceinline__ void early_rows(const int* __restrict__ q_pos, const int* __restrict__ row_view,
                                           const int* __restrict__ view_off, const int* __restrict__ cells,
                                           const int* __restrict__ cell_pos, const void* K, const void* V, int n_kv,
                                           int kh, int n_split, int warp, int lane) {
#if ATTN_EARLY
    static_assert(RBV >= 1 && (RBV - 1 + 30) / 31 <= 128, "early_rows: a lane's step of at most a line");
    const int vw = row_view[blockIdx.x];
    const int b0 = view_off[vw], len = view_off[vw + 1] - b0;
    const int chunk = (len + n_split - 1) / n_split, c0 = b0 + (int)blockIdx.z * chunk;
    const int c1 = min(c0 + chunk, b0 + len - (int)gridDim.x);  // the split's cells that are not new
    const int i = c0 + TILE * warp + lane / LPC;                 // (the warp's first tile, as the loop)
    const int cell = i < c1 ? cells[i] : -1;
    if (lane == 0) asm volatile("prefetch.global.L1 [%0];" ::"l"(q_pos + blockIdx.x));
    if (lane % LPC == 0 && i < b0 + len) asm volatile("prefetch.global.L1 [%0];" ::"l"(cell_pos + i));
    if (cell >= 0) {  // K: the cell's LPC lanes take the row's lines in turn (bytes 0, 128, ..., RBK - 1)
        const char* row = (const char*)K + ((long long)cell * n_kv + kh) * RBK;
        for (int k = lane % LPC; k <= (RBK - 1 + 127) / 128; k += LPC)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(row + min(128 * k, RBK - 1)));
    }
#pragma unroll
    for (int j = 0; j < TILE; j++) {  // V: the whole warp each row (lane l byte l (RBV - 1) / 31)
        const int cj = __shfl_sync(0xffffffffu, cell, LPC * j);
        if (cj >= 0)
            asm volatile("prefetch.global.L1 [%0];" ::"l"((const char*)V + ((long long)cj * n_kv + kh) * RBV +
                                                          lane * (RBV - 1) / 31));
    }
#else
    (void)q_pos; (void)row_view; (void)view_off; (void)cells; (void)cell_pos; (void)K; (void)V;
    (void)n_kv; (void)kh; (void)n_split; (void)warp; (void)lane;
#endif
}

template <int D, int MAXG, int LPC = 4>
__device__ __forceinline__ void attn_partial_impl(
    const float* __restrict__ q, const int* __restrict__ q_pos, const int* __restrict__ row_view,
    const int* __restrict__ view_off, const int* __restrict__ cells, const int* __restrict__ cell_pos,
    const u16* __restrict__ K, const u16* __restrict__ V, int n_head, int n_kv, float scale, int n_swa,
    float softcap, int n_split, float* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    constexpr int E = D / 32;  // V dims per lane
    const int r = blockIdx.x, sp = blockIdx.z;
    const int G = n_head / n_kv;
    const int n_hg = (G + MAXG - 1) / MAXG;  // blocks per kv head when G > MAXG
    const int kh = blockIdx.y / n_hg, g0 = (blockIdx.y % n_hg) * MAXG;
    const int Gb = min(MAXG, G - g0);        // query heads of this block: kh * G + g0 + [0, Gb)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    early_rows<32 / LPC, LPC, 2 * D, 2 * D>(q_pos, row_view, view_off, cells, cell_pos, K, V, n_kv, kh, n_split, warp,
                                            lane);
    GRID_DEP_WAIT();
    const int qp = q_pos[r];
    const int vw = row_view[r];
    const int b0 = view_off[vw], len = view_off[vw + 1] - b0;
    const int chunk = (len + n_split - 1) / n_split;
    const int c0 = b0 + sp * chunk, c1 = min(b0 + len, c0 + chunk);

    __shared__ __align__(16) float s_q[MAXG][D];
    {
        float x[QRows<MAXG, D, 32 * NWARP>::NV];
        load_q_rows<MAXG, D, 32 * NWARP>(q, (long long)r * n_head + kh * G + g0, Gb, scale, x);
        store_q_rows<MAXG, D, 32 * NWARP>(x, s_q);
    }
    __syncthreads();

    float acc[MAXG][E], m[MAXG], l[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        m[g] = NEG_INF; l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) acc[g][e] = 0.f;
    }
    // tiles of 32 / LPC cells per warp (8; 4 in the _l8 kernels): QK with LPC lanes per cell
    // (each lane a 1 / LPC part of the dims, the partial dot products summed over the cell's
    // lanes), softmax across the warp, then PV with the lanes over dims (each cell's V row read
    // coalesced by the whole warp). A tile is short so that a block's warps share a split's
    // cells: a decode step is latency-bound, and a warp that walked 32 cells alone issued one
    // instruction per ~8 cycles for ~20 us (H200, ncu). The _l8 kernels halve a warp's tile for
    // splits of 16 cells (cuda.py _attn_lanes8): each warp's serial QK and PV work halves.
    static_assert(LPC == 4 || LPC == 8, "attn_partial_impl: 4 or 8 lanes per cell");
    constexpr int DQ = D / LPC, TILE = 32 / LPC;  // dims per lane in QK, cells per tile
    static_assert(DQ % 8 == 0, "attn_partial_impl: 16-byte K loads");
    const int slot = lane / LPC, part = lane % LPC;
    for (int t0 = c0 + TILE * warp; t0 < c1; t0 += TILE * NWARP) {
        const int i = t0 + slot;
        int cell = 0;
        bool ok = false;
        if (i < c1) {
            int cp = cell_pos[i];
            ok = cp <= qp && !(n_swa > 0 && qp - cp >= n_swa);
            cell = cells[i];
        }
        if (!__any_sync(0xffffffffu, ok)) continue;
        int cjs[TILE];  // the tile's cells (masked: a valid index, 0 past the list's end)
        tile_cells<TILE, LPC, 2 * D>(cell, V, n_kv, kh, lane, cjs);
        float s[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) s[g] = 0.f;
        if (ok) {
            const u16* kr = K + ((long long)cell * n_kv + kh) * D + part * DQ;
#pragma unroll
            for (int c = 0; c < DQ / 8; c++) {
                float kf[8];
                load_halves<8>(kr + 8 * c, kf);
#pragma unroll
                for (int g = 0; g < MAXG; g++) {
                    if (g < Gb) {
                        const float4* qq = (const float4*)&s_q[g][part * DQ + 8 * c];
                        float4 a = qq[0], b = qq[1];
                        s[g] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3]
                              + b.x * kf[4] + b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
                    }
                }
            }
        }
        float p[MAXG];
        softmax_tile<LPC, MAXG, E>(s, ok, Gb, softcap, m, l, acc, p);
        // PV over the tile's cells (masked cells carry p = 0 and a valid cell index: 0 past
        // the list's end), all V loads issued before the FMAs
#pragma unroll
        for (int j = 0; j < TILE; j++) {
            const u16* vr = V + ((long long)cjs[j] * n_kv + kh) * D + lane * E;
            float vf[E];
            load_halves<E>(vr, vf);
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                if (g < Gb) {
                    float pj = __shfl_sync(0xffffffffu, p[g], LPC * j);
#pragma unroll
                    for (int e = 0; e < E; e++) acc[g][e] += pj * vf[e];
                }
            }
        }
    }
    __shared__ float s_acc[NWARP][MAXG][D];
    __shared__ float s_m[NWARP][MAXG], s_l[NWARP][MAXG];
    merge_warps<D, MAXG, E>(acc, m, l, Gb, warp, lane, s_acc, s_m, s_l, [&](int g, int d, float M, float L, float A) {
        store_head(out, part_acc, part_ml, r, n_head, kh * G + g0 + g, D, d, n_split, sp, M, L, A);
    });
}

#ifndef KV_TK  // the f16 module (the tier modules below use its attn_merge)
#define DEF_ATTN1(D, G, NAME, LPC)                                                                             \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                    \
        const float* q, const int* q_pos, const int* row_view, const int* view_off, const int* cells,          \
        const int* cell_pos, const u16* K, const u16* V, int n_head, int n_kv, float scale, int n_swa,         \
        float softcap, int n_split, float* out, float* part_acc, float* part_ml) { /* (waits inside) */         \
        attn_partial_impl<D, G, LPC>(q, q_pos, row_view, view_off, cells, cell_pos, K, V, n_head, n_kv, scale, \
                                     n_swa, softcap, n_split, out, part_acc, part_ml); }
#define DEF_ATTN(D, G) DEF_ATTN1(D, G, attn_partial_d##D##_g##G, 4)
// head sizes 256 and 512 also with 8 lanes per cell (cuda.py ATTN_L8_DIMS)
#define DEF_ATTN8(D, G) DEF_ATTN(D, G) DEF_ATTN1(D, G, attn_partial_d##D##_g##G##_l8, 8)
DEF_ATTN(32, 1) DEF_ATTN(32, 2) DEF_ATTN(32, 4) DEF_ATTN(32, 8)
DEF_ATTN(64, 1) DEF_ATTN(64, 2) DEF_ATTN(64, 4) DEF_ATTN(64, 8)
DEF_ATTN(128, 1) DEF_ATTN(128, 2) DEF_ATTN(128, 4) DEF_ATTN(128, 8)
DEF_ATTN8(256, 1) DEF_ATTN8(256, 2) DEF_ATTN8(256, 4) DEF_ATTN8(256, 8)
DEF_ATTN8(512, 1) DEF_ATTN8(512, 2) DEF_ATTN8(512, 4)

// row blockIdx.x's output merged (lse_merge.cuh) from attn_partial's n_split partials per head:
// the block's window blockIdx.y (CL: as one block of the window's cluster)
template <bool CL>
__device__ __forceinline__ float attn_merge_window(const float* part_acc, const float* part_ml, int n_head, int D,
                                                   int n_split) {
    const int r = blockIdx.x;
    return lse_merge_window<1, CL>([&](int h, int) {
        return LseRun{part_acc, part_ml, ((long long)r * n_head + h) * n_split, n_split};
    }, n_head * D, D, blockIdx.y * 256);
}
// out[r, :] merged (lse_merge.cuh), 256 elements per block (CL: per cluster of LSE_GROUPS
// blocks, block 0 writing them). v_signs: a rotated V tier's sign bits (KV_SIGNS) when the
// partials are in its rotated domain (merge_unrotates: the merge un-rotates each head once,
// lse_unrotate), else null. xq: null, or the rows' digit columns for gemv_int.cu written as well
// (digits.cuh; row t's from column nd t of ncp), for an integer GEMV that reads the output next
// (the attention output projection).
template <bool CL>
__device__ __forceinline__ void attn_merge_impl(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                                float* __restrict__ out, int n_head, int D, int n_split,
                                                const unsigned int* __restrict__ v_signs, i8* __restrict__ xq,
                                                float* __restrict__ xs, i8* __restrict__ xm, int ncp, int nd) {
    const int r = blockIdx.x, HD = n_head * D, e = blockIdx.y * 256 + threadIdx.x;
    const unsigned int sw = v_signs ? lse_sign_word(D, v_signs) : 0u;
    float v = attn_merge_window<CL>(part_acc, part_ml, n_head, D, n_split);
    if (CL && blockIdx.z) return;
    if (v_signs) v = lse_unrotate(v, D, sw);
    if (threadIdx.x < 256 && e < HD) out[(long long)r * HD + e] = v;
    if (xq) digits_block256(v, blockIdx.y, (long long)nd * r, ncp, nd, xq, xs, xm);
}
// attn_merge: grid (T, ceil(n_head * D / 256)), LSE_THREADS threads. attn_merge_digits writes the
// digits as well (n_head * D a multiple of 256; bit for bit the same merge).
extern "C" __global__ void __launch_bounds__(LSE_THREADS) attn_merge(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, float* __restrict__ out, int n_head, int D,
    int n_split, const unsigned int* __restrict__ v_signs) { GRID_DEP_WAIT();
    attn_merge_impl<false>(part_acc, part_ml, out, n_head, D, n_split, v_signs, nullptr, nullptr, nullptr, 0, 0);
}
extern "C" __global__ void __launch_bounds__(LSE_THREADS) attn_merge_digits(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, float* __restrict__ out, int n_head, int D,
    int n_split, const unsigned int* __restrict__ v_signs, i8* __restrict__ xq, float* __restrict__ xs,
    i8* __restrict__ xm, int ncp, int nd) { GRID_DEP_WAIT();
    attn_merge_impl<false>(part_acc, part_ml, out, n_head, D, n_split, v_signs, xq, xs, xm, ncp, nd);
}
#if LSE_CLUSTER
// attn_merge / attn_merge_digits by clusters (sm_90+): grid (T, ceil(n_head * D / 256),
// LSE_GROUPS), 256 threads, a cluster per window (cuda.py merge_launch with cluster=True)
extern "C" __global__ void __launch_bounds__(256) LSE_CLUSTER_DIMS attn_merge_c(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, float* __restrict__ out, int n_head, int D,
    int n_split, const unsigned int* __restrict__ v_signs) { GRID_DEP_WAIT();
    attn_merge_impl<true>(part_acc, part_ml, out, n_head, D, n_split, v_signs, nullptr, nullptr, nullptr, 0, 0);
}
extern "C" __global__ void __launch_bounds__(256) LSE_CLUSTER_DIMS attn_merge_digits_c(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, float* __restrict__ out, int n_head, int D,
    int n_split, const unsigned int* __restrict__ v_signs, i8* __restrict__ xq, float* __restrict__ xs,
    i8* __restrict__ xm, int ncp, int nd) { GRID_DEP_WAIT();
    attn_merge_impl<true>(part_acc, part_ml, out, n_head, D, n_split, v_signs, xq, xs, xm, ncp, nd);
}
#endif
// attn_stream_d<D>: attn_partial's partials for long rows, K / V streamed through shared memory
// (attn_stream.cuh) from f16 rows
template <int D>
struct AsF16 {
    static constexpr int RB = 2 * D, CA = 16, TBK = 0, TBV = 0;
    static constexpr bool F16 = true, ROT = false, CODES = false, PD = false, MIN = false;
    static __host__ __device__ constexpr int kperm(int d) { return d; }
    static __host__ __device__ constexpr int vperm(int nd, int c) { return 8 * nd + c; }
};
// (attn_stream_d<D>: 8 query heads per block; attn_stream_d<D>_h16: 16, for more than 8 query
// heads per kv head)
#define DEF_ATTN_STREAM1(D, HN, NAME)                                                                         \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                    \
        const float* q, const int* q_pos, const int* row_view, const int* view_off, const int* cells,          \
        const int* cell_pos, const u8* K, const u8* V, int n_head, int n_kv, float scale, int n_swa,           \
        float softcap, int n_split, float* out, float* part_acc, float* part_ml) { /* (waits inside) */         \
        attn_stream_impl<D, HN, AsF16<D>, AsF16<D>>(q, q_pos, row_view, view_off, cells, cell_pos, K, V,       \
                                                    n_head, n_kv, scale, n_swa, softcap, n_split, out,         \
                                                    part_acc, part_ml, false); }
#define DEF_ATTN_STREAM(D) DEF_ATTN_STREAM1(D, 8, attn_stream_d##D) DEF_ATTN_STREAM1(D, 16, attn_stream_d##D##_h16)
DEF_ATTN_STREAM(64) DEF_ATTN_STREAM(128) DEF_ATTN_STREAM(256)

#endif  // KV_TK

#ifdef KV_TK
// ---- the same kernel over the KV tiers (opencoti/engine/kv_tiers), one module per
// (KV_TK, KV_TV, KV_D): K and V rows are read as the tier's blocks and dequantized in
// registers (no f16 copy of the cache). QK, LPC lanes per cell (each a 1 / LPC part of the row,
// whole blocks, or in the _l8 kernels at head size 256 a turbo block's half): the part is read a segment at a time into registers with the widest loads its
// alignment allows, and each block's dot product is scaled once (kv_tiers.cuh code()/scale()).
// PV, the lanes over dims: vals(). Three kernels per group size: attn_kv_g<G> takes a lane per
// cell (tiles of 32 cells per warp: long splits), attn_kv_g<G>_l KV_LPC lanes (up to 4, whole
// blocks each; tiles of 32 / KV_LPC cells: short splits keep all four warps busy and each
// lane's serial QK short), attn_kv_g<G>_l8 8 lanes (KV_L8_OK: splits of up to 16 cells, one
// tile of 4 cells per warp).
// Rotated tiers (turbo*, *_tcq; turbo.py): q . k = (R q) . (R k), so a rotated K tier rotates
// the block's queries once (fast WHT in shared memory) -- or takes them rotated (q_rot: the
// fused rope + store did it once for the layer) -- and scores against the stored rotated
// rows; a rotated V tier accumulates P.V in the rotated domain and un-rotates the output once
// per head, o = R^T sum_c p_c y_c: attn_merge does it after merging a row's splits (the rotation
// is linear, so the log-sum-exp merge is unchanged) up to head size 256, the kernel itself for
// one split or at 512 (merge_unrotates).
#include "kv_tiers.cuh"
#include "kv_codes.cuh"

__host__ __device__ constexpr int kv_align(int nb) { return (nb & 15) == 0 ? 16 : (nb & 7) == 0 ? 8 : (nb & 3) == 0 ? 4 : 2; }

// s[g] += (q_g . k[o0, o0 + DL)) for the Gb queries sq[g] (shared, scaled): the DL values of
// the K row whose bytes start at `row`, from value o0 (a multiple of DL). Whole blocks (DL a
// multiple of BS): segments of SB bytes divide a lane's part and a row's bytes, so kv_align(SB)
// is the alignment of every segment. A part of one block (DL < BS, the turbo tiers' SUB parts:
// the _l8 kernels at head size 256): its scale and code bytes only (TK::sub_words), decoded from
// sub-block indices that are the same on every lane.
// sb[g] += (q_g . c[0, N)) (sx[g] += the sum of q_g's values, q5_1's "+ m" term) for the Gb
// queries sq[g] from value o, (c[j], c[j + 1]) = code2(j) for even j: a K block's (or part's)
// codes without their scale, two at a time (the turbo tiers' level pairs: one table load)
template <class TK, int N, int D, int MAXG, class Code2>
__device__ __forceinline__ void kv_dot(Code2 code2, const float (*sq)[D], int o, int Gb, float (&sb)[MAXG],
                                       float (&sx)[MAXG]) {
#pragma unroll
    for (int g = 0; g < MAXG; g++) { sb[g] = 0.f; sx[g] = 0.f; }
#pragma unroll
    for (int j = 0; j < N; j += 4) {
        const float2 c01 = code2(j), c23 = code2(j + 2);
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            if (g < Gb) {
                const float4 qq = *(const float4*)&sq[g][o + j];
                sb[g] += qq.x * c01.x + qq.y * c01.y + qq.z * c23.x + qq.w * c23.y;
                if constexpr (TK::HASMIN) sx[g] += (qq.x + qq.y) + (qq.z + qq.w);
            }
        }
    }
}

// s[g] += (q_g . k[o0, o0 + DL)) for the Gb queries sq[g] (shared, scaled): the DL values of
// the K row whose bytes start at `row`, from value o0 (a multiple of DL). Whole blocks (DL a
// multiple of BS): segments of SB bytes divide a lane's part and a row's bytes, so kv_align(SB)
// is the alignment of every segment. A part of one block (DL < BS, the turbo tiers' SUB parts:
// the _l8 kernels at head size 256): its scale and code bytes only (TK::sub_words), decoded from
// sub-block indices that are the same on every lane.
// tab: TK's levels, tp: its level pairs (TK::NP > 0)
template <class TK, int D, int DL, int MAXG>
__device__ __forceinline__ void kv_qk(const u8* __restrict__ row, const float (*sq)[D], int o0, int Gb,
                                      const float* tab, const float2* tp, float* s) {
    row += (long long)(o0 / TK::BS) * TK::BB;
    float sb[MAXG], sx[MAXG];
    if constexpr (DL < TK::BS) {
        static_assert(TK::SUB != 0 && TK::BS % DL == 0, "kv_qk: a part of a block needs the tier's sub-block decode");
        u32 w[TK::template SubWords<DL>::N];
        TK::template sub_words<DL>(row, (o0 % TK::BS) / DL, w);
        kv_dot<TK, DL, D, MAXG>([&](int j) {
            if constexpr (TK::NP > 0) return tp[TK::template sub_pair<DL>(w, j)];
            else return make_float2(TK::template sub_code<DL>(w, j, tab), TK::template sub_code<DL>(w, j + 1, tab));
        }, sq, o0, Gb, sb, sx);
        const float d = h2f(ldh(row));
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            if (g < Gb) s[g] += d * sb[g];
        }
    } else {
        constexpr int SV = TK::SV < DL ? TK::SV : DL;  // values per register segment
        constexpr int NBL = SV / TK::BS, SB = NBL * TK::BB, A = kv_align(SB), NW = (SB + 3) / 4;
#pragma unroll
        for (int sg = 0; sg < DL / SV; sg++) {
            u32 w[NW];
            ldw<SB, A>(row + sg * SB, w);
#pragma unroll
            for (int b = 0; b < NBL; b++) {
                kv_dot<TK, TK::BS, D, MAXG>([&](int j) {
                    if constexpr (TK::NP > 0) return tp[TK::pair(w, b, j)];
                    else return make_float2(TK::code(w, b, j, tab), TK::code(w, b, j + 1, tab));
                }, sq, o0 + sg * SV + b * TK::BS, Gb, sb, sx);
                const float d = TK::scale(w, b), m = TK::mn(w, b);
#pragma unroll
                for (int g = 0; g < MAXG; g++) {
                    if (g < Gb) s[g] += TK::HASMIN ? d * sb[g] + m * sx[g] : d * sb[g];
                }
            }
        }
    }
}

// the E values [lane * E, lane * E + E) of a V row (tab: TV's levels, tp: its level pairs) are
// the returned scale times vf: the level-pair tiers leave their block's scale out of vf (one
// multiply per query head into p instead of one per value), the others return 1
template <class TV, int E>
__device__ __forceinline__ float kv_pv_vals(const u8* __restrict__ row, int lane, const float* tab, const float2* tp,
                                            float* vf) {
    if constexpr (TV::PVF16) {
        load_halves<E>((const u16*)row + lane * E, vf);
    } else if constexpr (TV::NP > 0) {
        return TV::template vals2<E>(row, lane * E, tp, vf);
    } else {
        TV::template vals<E>(row, lane * E, tab, vf);
    }
    return 1.f;
}

// lanes per cell of the _l kernels: up to 4, each a whole number of K blocks
#define KV_LPC (KV_D / KV_TK::BS >= 4 ? 4 : KV_D / KV_TK::BS)
// the _l8 kernels (8 lanes per cell) where a lane's part is whole K blocks or a turbo block's
// part (kv_qk); elsewhere they are empty and cuda.py does not launch them (cuda_kv.lanes8_ok)
constexpr bool KV_L8_OK = KV_D % 256 == 0 && (KV_D / 8 >= KV_TK::BS || (KV_TK::SUB != 0 && KV_TK::BS % (KV_D / 8) == 0));

template <int D, int MAXG, class TK, class TV, int LPC>
__device__ __forceinline__ void attn_kv_impl(
    const float* __restrict__ q, const int* __restrict__ q_pos, const int* __restrict__ row_view,
    const int* __restrict__ view_off, const int* __restrict__ cells, const int* __restrict__ cell_pos,
    const u8* __restrict__ K, const u8* __restrict__ V, int n_head, int n_kv, float scale, int n_swa,
    float softcap, int n_split, float* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml,
    bool q_rot) {
    constexpr int E = D / 32;  // V dims per lane
    constexpr long long RBK = D / TK::BS * TK::BB, RBV = D / TV::BS * TV::BB;  // row bytes
    constexpr int TILE = 32 / LPC, DL = D / LPC;  // cells per tile; a lane's K values
    // a tier's levels, or (turbo2/3/4) its level pairs instead, filled from the __constant__
    // tables before the kernel waits on its predecessor (pdl.cuh): in a decode graph the fill
    // runs while the kernel before it (the layer's store) still does, as does early_rows. Nothing
    // before the wait writes memory or reads what a running kernel writes.
    __shared__ float s_tk[TK::NT > 0 && TK::NP == 0 ? TK::NT : 1], s_tv[TV::NT > 0 && TV::NP == 0 ? TV::NT : 1];
    __shared__ float2 s_pk[TK::NP > 0 ? TK::NP : 1], s_pv[TV::NP > 0 ? TV::NP : 1];
    if constexpr (TK::NP > 0) for (int i = threadIdx.x; i < TK::NP; i += blockDim.x) s_pk[i] = TK::pair_level(i);
    else if constexpr (TK::NT > 0) for (int i = threadIdx.x; i < TK::NT; i += blockDim.x) s_tk[i] = TK::tab()[i];
    if constexpr (TV::NP > 0) for (int i = threadIdx.x; i < TV::NP; i += blockDim.x) s_pv[i] = TV::pair_level(i);
    else if constexpr (TV::NT > 0) for (int i = threadIdx.x; i < TV::NT; i += blockDim.x) s_tv[i] = TV::tab()[i];
    const int r = blockIdx.x, sp = blockIdx.z;
    const int G = n_head / n_kv;
    const int n_hg = (G + MAXG - 1) / MAXG;
    const int kh = blockIdx.y / n_hg, g0 = (blockIdx.y % n_hg) * MAXG;
    const int Gb = min(MAXG, G - g0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    early_rows<32 / LPC, LPC, (int)RBK, (int)RBV>(q_pos, row_view, view_off, cells, cell_pos, K, V, n_kv, kh, n_split,
                                                  warp, lane);
    GRID_DEP_WAIT();
    const int qp = q_pos[r];
    const int vw = row_view[r];
    const int b0 = view_off[vw], len = view_off[vw + 1] - b0;
    const int chunk = (len + n_split - 1) / n_split;
    const int c0 = b0 + sp * chunk, c1 = min(b0 + len, c0 + chunk);

    __shared__ __align__(16) float s_q[MAXG][D];
    __shared__ float s_acc[NWARP][MAXG][D];
    constexpr int NV = QRows<MAXG, D, 32 * NWARP>::NV;  // a row's values per thread (fwht_regs)
    {  // a rotated K tier's q -> R q in registers unless the fused store rotated it (q_rot; s_acc
       // as the exchange buffer, freed by the sync below)
        float x[NV];
        load_q_rows<MAXG, D, 32 * NWARP>(q, (long long)r * n_head + kh * G + g0, Gb, scale, x);
        if constexpr (TK::ROT) {
            if (!q_rot) fwht_regs<D, NV, MAXG * D>(x, &s_acc[0][0][0], false);
        }
        store_q_rows<MAXG, D, 32 * NWARP>(x, s_q);
    }
    __syncthreads();

    float acc[MAXG][E], m[MAXG], l[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        m[g] = NEG_INF; l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) acc[g][e] = 0.f;
    }
    const int slot = lane / LPC, part = lane % LPC;
    for (int t0 = c0 + TILE * warp; t0 < c1; t0 += TILE * NWARP) {
        int i = t0 + slot;
        int cell = 0;
        bool ok = false;
        if (i < c1) {
            int cp = cell_pos[i];
            ok = cp <= qp && !(n_swa > 0 && qp - cp >= n_swa);
            cell = cells[i];
        }
        if (!__any_sync(0xffffffffu, ok)) continue;
        // short tiles (up to 8 cells: 4 or 8 lanes per cell): the cells held, their V rows asked
        // for before the QK (prefetch_row); 16- and 32-cell tiles (2 lanes or 1 per cell: the
        // K tiers of 64-value blocks at head size 128, long splits) leave both out
        constexpr bool PF = TILE <= 8;
        int cjs[PF ? TILE : 1];
        if constexpr (PF) tile_cells<TILE, LPC, RBV>(cell, V, n_kv, kh, lane, cjs);
        float s[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) s[g] = 0.f;
        if (ok) kv_qk<TK, D, DL, MAXG>(K + ((long long)cell * n_kv + kh) * RBK, s_q, part * DL, Gb, s_tk, s_pk, s);
        float p[MAXG];
        softmax_tile<LPC, MAXG, E>(s, ok, Gb, softcap, m, l, acc, p);
        // PV over the tile's cells in a fixed-count loop, as the f16 kernel (masked cells: p = 0
        // and a valid cell index, 0 past the list's end)
#pragma unroll 8
        for (int j = 0; j < TILE; j++) {
            int cj;
            if constexpr (PF) cj = cjs[j];
            else cj = __shfl_sync(0xffffffffu, cell, LPC * j);
            float vf[E];
            const float dv = kv_pv_vals<TV, E>(V + ((long long)cj * n_kv + kh) * RBV, lane, s_tv, s_pv, vf);
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                if (g < Gb) {
                    const float pj = __shfl_sync(0xffffffffu, p[g], LPC * j) * dv;
#pragma unroll
                    for (int e = 0; e < E; e++) acc[g][e] += pj * vf[e];
                }
            }
        }
    }
    __shared__ float s_m[NWARP][MAXG], s_l[NWARP][MAXG];
    const bool rot = TV::ROT && !merge_unrotates(D, n_split);  // else stored rotated, attn_merge un-rotates
    merge_warps<D, MAXG, E>(acc, m, l, Gb, warp, lane, s_acc, s_m, s_l, [&](int g, int d, float M, float L, float A) {
        const int h = kh * G + g0 + g;
        if (rot) s_acc[0][g][d] = rot_head(part_ml, r, n_head, h, d, n_split, sp, M, L, A);  // only this thread reads s_acc[*][g][d]
        else store_head(out, part_acc, part_ml, r, n_head, h, D, d, n_split, sp, M, L, A);
    });
    if (rot) {  // o = R^T y, once per head, in registers (s_acc[1..] as the exchange buffer; n_split uniform: the syncs)
        __syncthreads();
        float x[NV];
#pragma unroll
        for (int k = 0; k < NV; k++) {
            const int i = threadIdx.x + 128 * k;
            x[k] = i < Gb * D ? s_acc[0][i / D][i % D] : 0.f;
        }
        fwht_regs<D, NV, MAXG * D>(x, &s_acc[1][0][0], true);
#pragma unroll
        for (int k = 0; k < NV; k++) {
            const int i = threadIdx.x + 128 * k;
            if (i < Gb * D) store_rot(out, part_acc, r, n_head, kh * G + g0 + i / D, D, i % D, n_split, sp, x[k]);
        }
    }
}

// attn_kv_stream: attn_stream_impl over the module's tiers (long rows): each tier row is copied
// as its bytes (kv_align chunks, at least 4 bytes: head sizes whose rows are only 2-aligned keep
// attn_kv_g*). q8_0, q4_0, q4_1, iq4_nl and turbo2/3/4 feed their codes to the MMAs as f16
// operands with the block scales (and q4_1's minima) outside the products (kv_codes.cuh); the other tiers are decoded into the MMA
// fragments value by value, as float32 split into f16 hi + lo (a third product per tile: hi * hi
// + lo * hi + hi * lo). Rotated tiers rotate the queries and un-rotate the output as attn_kv_impl
// does.
template <class T, int D>
struct AsTier {
    using C = KvCodes<T>;
    static constexpr int RB = D / T::BS * T::BB, CA = kv_align(RB) > 16 ? 16 : kv_align(RB), NT = T::NT;
    static constexpr bool F16 = false, ROT = T::ROT != 0, CODES = C::ON, PD = CODES && C::PD, MIN = CODES && C::MIN;
    // shared-memory table bytes as the K / as the V tier: kv_codes.cuh's, else the float levels
    static constexpr int TBK = CODES ? C::TBK : 4 * NT, TBV = CODES ? C::TBV : 4 * NT;
    static __device__ __forceinline__ void levels(u8* t) {
        for (int i = threadIdx.x; i < NT; i += blockDim.x) ((float*)t)[i] = T::tab()[i];
    }
    static __device__ __forceinline__ void tab_k(u8* t) {
        if constexpr (CODES) C::tab_k(t);
        else levels(t);
    }
    static __device__ __forceinline__ void tab_v(u8* t) {
        if constexpr (CODES) C::tab_v(t);
        else levels(t);
    }
    // the dim of K's MMA k index d / of column c of V's n8 tile nd (CODES: kv_codes.cuh's orders)
    static __host__ __device__ constexpr int kperm(int d) { return CODES ? d / C::BS * C::BS + C::kdim(d % C::BS) : d; }
    static __host__ __device__ constexpr int vperm(int nd, int c) {
        return CODES ? nd / (C::BS / 8) * C::BS + C::vdim(c, nd % (C::BS / 8)) : 8 * nd + c;
    }
    // value i of a row whose bytes start at w (4-aligned): scale * code (+ min)
    static __device__ __forceinline__ float dec(const u32* w, int i, const float* t) {
        const int b = i / T::BS, j = i % T::BS;
        float v = T::scale(w, b) * T::code(w, b, j, t);
        if constexpr (T::HASMIN != 0) v += T::mn(w, b);
        return v;
    }
    static __device__ __forceinline__ void rotate(float* rows, int n, bool inverse) {
        fwht_shared<D>(rows, n, inverse, false);
    }
};
// defined for every module, launched only where its rows allow (cuda.py stream_ok: head size <=
// 256, both rows' bytes a multiple of 4)
constexpr bool AS_KV_OK = KV_D <= 256 && AsTier<KV_TK, KV_D>::RB % 4 == 0 && AsTier<KV_TV, KV_D>::RB % 4 == 0;
#ifndef KV_HN
#define KV_HN 8  // query heads per block of attn_kv_stream (16: a module for more than 8 per kv head)
#endif
// one block per SM is enough: without the 1 ptxas fit some pairs at head size 128 into 128
// registers with spills (turbo3 / turbo3, turbo2 / q8_0), which decoded slower at 32k cells
extern "C" __global__ void __launch_bounds__(256, 1) attn_kv_stream(
    const float* q, const int* q_pos, const int* row_view, const int* view_off, const int* cells,
    const int* cell_pos, const u8* K, const u8* V, int n_head, int n_kv, float scale, int n_swa,
    float softcap, int n_split, float* out, float* part_acc, float* part_ml, int q_rot) {
    if constexpr (AS_KV_OK)  // (waits after its tables)
        attn_stream_impl<KV_D, KV_HN, AsTier<KV_TK, KV_D>, AsTier<KV_TV, KV_D>>(q, q_pos, row_view, view_off,
            cells, cell_pos, K, V, n_head, n_kv, scale, n_swa, softcap, n_split, out, part_acc, part_ml, q_rot != 0);
}

// (the tier kernels' last parameter q_rot: 1 when q is already in a rotated K tier's domain, R q:
// the fused rope + store rotated it, cuda.py RotatedQ; the kernels then skip their rotation)
#define DEF_ATTN_KV1(G, NAME, LPC, OK)                                                                         \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                    \
        const float* q, const int* q_pos, const int* row_view, const int* view_off, const int* cells,          \
        const int* cell_pos, const u8* K, const u8* V, int n_head, int n_kv, float scale, int n_swa,           \
        float softcap, int n_split, float* out, float* part_acc, float* part_ml, int q_rot) {                   \
        if constexpr (OK) /* waits after its tables */                                                         \
            attn_kv_impl<KV_D, G, KV_TK, KV_TV, LPC>(q, q_pos, row_view, view_off, cells, cell_pos, K, V, n_head, \
                                                     n_kv, scale, n_swa, softcap, n_split, out, part_acc, part_ml, \
                                                     q_rot != 0);                                               \
        else                                                                                                   \
            __trap(); /* an _l8 kernel without its lanes (cuda_kv.lanes8_ok launches none) */ }
#define DEF_ATTN_KV(G) DEF_ATTN_KV1(G, attn_kv_g##G, 1, true) DEF_ATTN_KV1(G, attn_kv_g##G##_l, KV_LPC, true)
#define DEF_ATTN_KV8(G) DEF_ATTN_KV1(G, attn_kv_g##G##_l8, 8, KV_L8_OK)
DEF_ATTN_KV(1) DEF_ATTN_KV(2) DEF_ATTN_KV(4)
DEF_ATTN_KV8(1) DEF_ATTN_KV8(2) DEF_ATTN_KV8(4)
#if KV_D < 512
DEF_ATTN_KV(8) DEF_ATTN_KV8(8)
#endif
#endif  // KV_TK
