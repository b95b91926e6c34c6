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
// The block's (scaled) queries sit in shared memory. Each warp takes tiles of 32
// cells: a lane per cell computes the scores (K row read with 16-byte loads),
// the tile's softmax update is one warp max + sum, then the lanes switch to
// dims and accumulate p * V cell by cell (each V row read coalesced). Split s of a view covers an
// equal slice of its cells; the online softmax is Milakov & Gimelshein 2018. Warps merge in shared memory; with n_split == 1 the
// normalized output is written directly, else (max, sum, acc) partials that
// attn_merge combines by log-sum-exp (Dao et al., flash-decoding).
#include "quants.cuh"
#include "lse_merge.cuh"

#define NWARP 4
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float wsum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

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

template <int D, int MAXG>
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
    const int qp = q_pos[r];
    const int vw = row_view[r];
    const int b0 = view_off[vw], len = view_off[vw + 1] - b0;
    const int chunk = (len + n_split - 1) / n_split;
    const int c0 = b0 + sp * chunk, c1 = min(b0 + len, c0 + chunk);

    __shared__ __align__(16) float s_q[MAXG][D];
    for (int i = threadIdx.x; i < MAXG * D; i += blockDim.x) {
        int g = i / D, d = i % D;
        s_q[g][d] = g < Gb ? q[((long long)r * n_head + kh * G + g0 + g) * D + d] * scale : 0.f;
    }
    __syncthreads();

    float acc[MAXG][E], m[MAXG], l[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        m[g] = NEG_INF; l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) acc[g][e] = 0.f;
    }
    // tiles of 32 cells per warp: QK with a lane per cell, softmax across the warp, then
    // PV with the lanes over dims (each cell's V row read coalesced by the whole warp)
    for (int t0 = c0 + 32 * warp; t0 < c1; t0 += 32 * NWARP) {
        int i = t0 + lane;
        int cell = 0;
        bool ok = false;
        if (i < c1) {
            int cp = cell_pos[i];
            ok = cp <= qp && !(n_swa > 0 && qp - cp >= n_swa);
            cell = cells[i];
        }
        unsigned mask = __ballot_sync(0xffffffffu, ok);
        if (!mask) continue;
        float s[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) s[g] = 0.f;
        if (ok) {
            const uint4* kr = (const uint4*)(K + ((long long)cell * n_kv + kh) * D);
#pragma unroll 8
            for (int c = 0; c < D / 8; c++) {
                uint4 w = kr[c];
                u32 ws[4] = {w.x, w.y, w.z, w.w};
                float kf[8];
#pragma unroll
                for (int j = 0; j < 4; j++) { kf[2 * j] = h2f((u16)(ws[j] & 0xFFFF)); kf[2 * j + 1] = h2f((u16)(ws[j] >> 16)); }
#pragma unroll
                for (int g = 0; g < MAXG; g++) {
                    if (g < Gb) {
                        const float4* qq = (const float4*)&s_q[g][8 * c];
                        float4 a = qq[0], b = qq[1];
                        s[g] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3]
                              + b.x * kf[4] + b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
                    }
                }
            }
        }
        float p[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            if (g < Gb) {
                float sg = s[g];
                if (softcap > 0.f) sg = softcap * tanhf(sg / softcap);
                float tm = ok ? sg : NEG_INF;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
                float mn = fmaxf(m[g], tm);
                float corr = m[g] == NEG_INF ? 0.f : __expf(m[g] - mn);
                p[g] = ok ? __expf(sg - mn) : 0.f;
                l[g] = l[g] * corr + wsum(p[g]);
#pragma unroll
                for (int e = 0; e < E; e++) acc[g][e] *= corr;
                m[g] = mn;
            }
        }
        // PV over the tile's 32 cells in a fixed-count loop, so the compiler issues several
        // cells' V loads before their FMAs (a data-dependent loop serialized one DRAM round
        // trip per cell: ~40 us per layer at depth 512); masked cells carry p = 0 and a valid
        // cell index (0 past the list's end), so reading them is harmless
#pragma unroll 8
        for (int j = 0; j < 32; j++) {
            int cj = __shfl_sync(0xffffffffu, cell, j);
            const u16* vr = V + ((long long)cj * n_kv + kh) * D + lane * E;
            float vf[E];
            load_halves<E>(vr, vf);
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                if (g < Gb) {
                    float pj = __shfl_sync(0xffffffffu, p[g], j);
#pragma unroll
                    for (int e = 0; e < E; e++) acc[g][e] += pj * vf[e];
                }
            }
        }
    }
    // merge the warps: shared [NWARP][MAXG][D] acc + [NWARP][MAXG] m, l
    __shared__ float s_acc[NWARP][MAXG][D];
    __shared__ float s_m[NWARP][MAXG], s_l[NWARP][MAXG];
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
        int h = kh * G + g0 + g;
        if (n_split == 1) {
            out[((long long)r * n_head + h) * D + d] = L > 0.f ? A / L : 0.f;
        } else {
            long long pi = ((long long)r * n_head + h) * n_split + sp;
            part_acc[pi * D + d] = A;
            if (d == 0) { part_ml[2 * pi] = M; part_ml[2 * pi + 1] = L; }
        }
    }
}

#define DEF_ATTN(D, G)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) attn_partial_d##D##_g##G(                               \
        const float* q, const int* q_pos, const int* row_view, const int* view_off, const int* cells,          \
        const int* cell_pos, const u16* K, const u16* V, int n_head, int n_kv, float scale, int n_swa,         \
        float softcap, int n_split, float* out, float* part_acc, float* part_ml) {                             \
        attn_partial_impl<D, G>(q, q_pos, row_view, view_off, cells, cell_pos, K, V, n_head, n_kv, scale,    \
                                n_swa, softcap, n_split, out, part_acc, part_ml); }
DEF_ATTN(32, 1) DEF_ATTN(32, 2) DEF_ATTN(32, 4) DEF_ATTN(32, 8)
DEF_ATTN(64, 1) DEF_ATTN(64, 2) DEF_ATTN(64, 4) DEF_ATTN(64, 8)
DEF_ATTN(128, 1) DEF_ATTN(128, 2) DEF_ATTN(128, 4) DEF_ATTN(128, 8)
DEF_ATTN(256, 1) DEF_ATTN(256, 2) DEF_ATTN(256, 4) DEF_ATTN(256, 8)
DEF_ATTN(512, 1) DEF_ATTN(512, 2) DEF_ATTN(512, 4)

// out[r, h, :] = sum_s acc_s e^{m_s - M} / sum_s l_s e^{m_s - M}; grid (T, n_head), D threads.
extern "C" __global__ void attn_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                      float* __restrict__ out, int n_head, int D, int n_split) {
    long long rh = (long long)blockIdx.x * n_head + blockIdx.y;
    const float M = lse_max(part_ml, rh * n_split, n_split, NEG_INF);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float L = 0.f, A = 0.f;
        if (M != NEG_INF) lse_add(part_acc, part_ml, rh * n_split, n_split, D, d, M, L, A);
        out[rh * D + d] = L > 0.f ? A / L : 0.f;
    }
}
