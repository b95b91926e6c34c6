// Shared-prefix attention for PolyKV groups (issue 5): the pool's prefix cells are read
// once for every sharer's query rows, then merged with each row's private-suffix partials.
//
// sp_attn_d<D>: one group of sequences that share `cells` (flat indices into the f16 K/V
// storage [n_cells_total, n_kv, D], positions `cell_pos`, count *n_cells_p). The group's
// query rows are rows[0..R); with G = n_head / n_kv query heads per kv head, the R * G
// (row, head) pairs of kv head kh form the query matrix of that kv head, ordered
// row-major (pair i = row i / G, head kh * G + i % G). Grid (ceil(R*G / SP_QT), n_kv,
// n_split), 4 warps: the block stages SP_QT queries (scaled) in shared memory and walks
// its split of the cells in tiles of CT (a split is a whole number of tiles; an empty one's
// partial has m = -inf); each K/V tile is loaded into shared memory once
// and applied to all SP_QT queries (16 per warp, one m16 tile) with tensor-core MMA
// (mma.sync m16n8k16, f16 inputs, f32 accumulation). To keep float32 accuracy the f32
// operands are split into two f16 terms (x = hi + lo, hi = f16(x), lo = f16(x - hi);
// K and V are f16 already, so hi*k and lo*k are exact products): S = Qhi K^T + Qlo K^T
// and O += Phi V + Plo V, relative error ~2^-22 instead of f16's 2^-11. (The same
// split-operand idea as 3xTF32 emulation in CUTLASS; Markidis et al. 2018.)
// Online softmax per query row (Milakov & Gimelshein 2018), S fragments reused as the P
// operand of the second MMA in registers (the FlashAttention-2 layout, Dao 2023).
// Masks by position exactly as attention.cu: a cell is visible when cell_pos <= q_pos
// and, with n_swa > 0, q_pos - cell_pos < n_swa; softcap as there.
// Output: unnormalised partials part_acc[(i * n_head + h) * n_split + sp][D] and
// part_ml[.. * 2] = (running max, sum of exp) for group row i, the format of attn_partial.
// A query whose largest |q * scale| reaches 2^14 is staged times 2^-e (e: its exponent - 13,
// exact) so the f16 hi term cannot overflow, and its scores are multiplied back by 2^e
// before the masks (no precondition on q's range, no host-side check).
//
// sp_merge: out[r, h] = log-sum-exp merge of the row's private partials (n_sp splits,
// from attention.cu's attn_partial over the private cell lists) and, when
// row_slot[r] >= 0, the shared partials of that group row (n_ss splits).
#include "quants.cuh"
#include "lse_merge.cuh"
#include "digits.cuh"
#include "mma.cuh"
#include "f16_split.cuh"

#define SP_NW 4
#define SP_QT (16 * SP_NW)
#define SP_NEG_INF (-__int_as_float(0x7f800000))

// Stages one warp's 16 queries (group pairs qa .. qa + 15 of nq; pair i = row rows[i / G], head
// kh * G + i % G) into shared memory as hi / lo f16 rows (ld D + 8 halves, times scale / the
// query's factor), with their positions (-1 past nq: sees nothing) and factors (sp_stage_factor).
// Lane l first fetches pair qa + (l & 15)'s row and position (one round trip for all 16), then
// the values come in batches of QB queries whose loads are in flight together, D / 32 per lane
// (a warp per query walking its values, query after query, took about half of a 4-tile block's
// time). Pairs past nq stage zeros.
template <int D>
__device__ __forceinline__ void sp_stage_queries(const float* __restrict__ q, const int* __restrict__ q_pos,
                                                 const int* __restrict__ rows, int nq, int G, int n_head, int kh,
                                                 int qa, float scale, u16* qh, u16* ql, int* qpos, float* qup) {
    constexpr int LD = D + 8, DV = D / 32, QB = DV >= 8 ? 4 : 8;
    const int lane = threadIdx.x & 31, mine = qa + (lane & 15);
    const int my_row = mine < nq ? rows[mine / G] : 0;
    const long long my_off = mine < nq ? ((long long)my_row * n_head + kh * G + mine % G) * D : -1;
    const int my_pos = mine < nq ? q_pos[my_row] : -1;
    if (lane < 16) qpos[lane] = my_pos;
    const bool vec = DV % 4 == 0 && ((unsigned long long)q & 15) == 0;
#pragma unroll
    for (int j0 = 0; j0 < 16; j0 += QB) {
        float v[QB][DV];
#pragma unroll
        for (int j = 0; j < QB; j++) {
            const long long off = __shfl_sync(0xffffffffu, my_off, j0 + j);
            const float* src = q + off + lane * DV;
#pragma unroll
            for (int e = 0; e < DV; e += 4) {
                if (off < 0) {
                    v[j][e] = 0.f;
                    if (DV > 1) v[j][e + 1] = 0.f;
                    if (DV > 2) v[j][e + 2] = v[j][e + 3] = 0.f;
                } else if (vec) {
                    const float4 t = *(const float4*)(src + e);
                    v[j][e] = t.x; v[j][e + 1] = t.y; v[j][e + 2] = t.z; v[j][e + 3] = t.w;
                } else {
#pragma unroll
                    for (int k = 0; k < 4 && e + k < DV; k++) v[j][e + k] = src[e + k];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < QB; j++) {
            float mx = 0.f;
#pragma unroll
            for (int e = 0; e < DV; e++) mx = fmaxf(mx, fabsf(v[j][e] * scale));
#pragma unroll
            for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float f = sp_stage_factor(mx);
            if (lane == 0) qup[j0 + j] = f;
            u16* h = qh + (j0 + j) * LD + lane * DV;
            u16* l = ql + (j0 + j) * LD + lane * DV;
#pragma unroll
            for (int e = 0; e < DV; e++) {
                const float x = v[j][e] * scale / f;
                const u16 hx = sp_f2h(x);
                h[e] = hx;
                l[e] = sp_f2h(x - h2f(hx));
            }
        }
    }
}

template <int D, int CT>
__device__ __forceinline__ void sp_attn_impl(
    const float* __restrict__ q, const int* __restrict__ q_pos, const int* __restrict__ rows,
    const int* __restrict__ cells, const int* __restrict__ cell_pos, const int* __restrict__ n_cells_p,
    const u16* __restrict__ K, const u16* __restrict__ V, int R, int n_head, int n_kv, float scale, int n_swa,
    float softcap, int n_split, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    constexpr int LD = D + 8;  // halves per shared row: 16-byte aligned, bank-conflict-free fragments
    constexpr int NT = CT / 8;  // n8 tiles of scores per warp
    constexpr int ND = D / 8;   // n8 tiles of output dims
    extern __shared__ __align__(16) unsigned char sp_smem[];
    u16* s_qh = (u16*)sp_smem;            // [SP_QT][LD]
    u16* s_ql = s_qh + SP_QT * LD;        // [SP_QT][LD]
    u16* s_k = s_ql + SP_QT * LD;         // [CT][LD]
    u16* s_v = s_k + CT * LD;             // [CT][LD]
    int* s_cpos = (int*)(s_v + CT * LD);  // [CT]
    int* s_qpos = s_cpos + CT;            // [SP_QT]
    float* s_qup = (float*)(s_qpos + SP_QT);  // [SP_QT] 2^e: a query's scores scale back by it

    const int G = n_head / n_kv;
    const int kh = blockIdx.y, sp = blockIdx.z;
    const int nq = R * G, q0 = blockIdx.x * SP_QT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, tig = lane & 3;
    const int len = *n_cells_p;
    const int chunk = ((len + n_split - 1) / n_split + CT - 1) / CT * CT;  // whole tiles (last splits may be empty)
    const int c0 = sp * chunk, c1 = min(len, c0 + chunk);

    sp_stage_queries<D>(q, q_pos, rows, R * G, G, n_head, kh, q0 + 16 * warp, scale, s_qh + 16 * warp * LD,
                        s_ql + 16 * warp * LD, s_qpos + 16 * warp, s_qup + 16 * warp);
    __syncthreads();

    const int mr = warp * 16;  // this warp's first query of the block
    const bool active = q0 + mr < nq;
    const int qp[2] = {s_qpos[mr + gid], s_qpos[mr + gid + 8]};
    const float up[2] = {s_qup[mr + gid], s_qup[mr + gid + 8]};
    float m[2] = {SP_NEG_INF, SP_NEG_INF}, l[2] = {0.f, 0.f};
    float o[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;

    for (int t0 = c0; t0 < c1; t0 += CT) {
        const int n = min(CT, c1 - t0);
        __syncthreads();  // the previous tile is consumed
#pragma unroll 2
        for (int i = threadIdx.x; i < CT * (D / 8); i += 32 * SP_NW) {  // 128 threads (the launch's)
            int c = i / (D / 8), u = i % (D / 8);
            uint4 kw = make_uint4(0, 0, 0, 0), vw = kw;
            if (c < n) {
                long long base = ((long long)cells[t0 + c] * n_kv + kh) * D;
                kw = ((const uint4*)(K + base))[u];
                vw = ((const uint4*)(V + base))[u];
            }
            *(uint4*)(s_k + c * LD + 8 * u) = kw;
            *(uint4*)(s_v + c * LD + 8 * u) = vw;
        }
        for (int i = threadIdx.x; i < CT; i += 32 * SP_NW) s_cpos[i] = i < n ? cell_pos[t0 + i] : 0x7fffffff;
        __syncthreads();
        if (!active) continue;

        // S = Q K^T (16 x CT per warp), Q as hi + lo
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            u32 h[4], lo[4];
            ld_a_frag(s_qh + (mr + gid) * LD + kk * 16 + 2 * tig, LD, h);
            ld_a_frag(s_ql + (mr + gid) * LD + kk * 16 + 2 * tig, LD, lo);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const u16* kb = s_k + (nt * 8 + gid) * LD + kk * 16 + 2 * tig;
                u32 b0 = *(const u32*)kb, b1 = *(const u32*)(kb + 8);
                mma_m16n8k16(s[nt], h[0], h[1], h[2], h[3], b0, b1);
                mma_m16n8k16(s[nt], lo[0], lo[1], lo[2], lo[3], b0, b1);
            }
        }
        // masks, softcap, online softmax (rows gid and gid + 8 of the warp's tile)
        float mx[2] = {SP_NEG_INF, SP_NEG_INF};
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int cpos = s_cpos[nt * 8 + 2 * tig + (j & 1)], p = qp[j >> 1];
                bool ok = cpos <= p && !(n_swa > 0 && p - cpos >= n_swa);
                float v = s[nt][j] * up[j >> 1];
                if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                s[nt][j] = ok ? v : SP_NEG_INF;
                mx[j >> 1] = fmaxf(mx[j >> 1], s[nt][j]);
            }
        }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            float mn = fmaxf(m[r], mx[r]);
            corr[r] = m[r] == SP_NEG_INF ? 0.f : __expf(m[r] - mn);
            m[r] = mn;
            l[r] *= corr[r];
        }
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
            o[nd][0] *= corr[0]; o[nd][1] *= corr[0];
            o[nd][2] *= corr[1]; o[nd][3] *= corr[1];
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float v = s[nt][j];
                float p = v == SP_NEG_INF ? 0.f : __expf(v - m[j >> 1]);
                s[nt][j] = p;
                l[j >> 1] += p;
            }
        }
        // O += P V: the S fragments of cells 16kc..16kc+15 are the A operand (P as hi + lo);
        // V's B fragments come transposed from shared memory (ldmatrix .trans, two n8 tiles each)
#pragma unroll
        for (int kc = 0; kc < CT / 16; kc++) {
            u32 ph[4], pl[4];
            split_p(s[2 * kc], s[2 * kc + 1], ph, pl);
            pv_f16<ND>(o, ph, pl, s_v + (kc * 16 + (lane & 15)) * LD + (lane >> 4) * 8);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if (!active) return;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int qg = q0 + mr + gid + 8 * r;
        if (qg >= nq) continue;
        long long pi = ((long long)(qg / G) * n_head + kh * G + qg % G) * n_split + sp;
        float* dst = part_acc + pi * D + 2 * tig;
#pragma unroll
        for (int nd = 0; nd < ND; nd++) *(float2*)(dst + nd * 8) = make_float2(o[nd][2 * r], o[nd][2 * r + 1]);
        if (tig == 0) { part_ml[2 * pi] = m[r]; part_ml[2 * pi + 1] = l[r]; }
    }
}

// shared memory bytes of sp_attn_d<D> (cuda.py SP_SMEM mirrors this)
#define SP_SMEM(D, CT) ((2 * SP_QT + 2 * (CT)) * ((D) + 8) * 2 + 4 * ((CT) + 2 * SP_QT))

#define DEF_SP(D, CT)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) sp_attn_d##D(                                           \
        const float* q, const int* q_pos, const int* rows, const int* cells, const int* cell_pos,            \
        const int* n_cells_p, const u16* K, const u16* V, int R, int n_head, int n_kv, float scale, int n_swa, \
        float softcap, int n_split, float* part_acc, float* part_ml) { GRID_DEP_WAIT();                                       \
        sp_attn_impl<D, CT>(q, q_pos, rows, cells, cell_pos, n_cells_p, K, V, R, n_head, n_kv, scale, n_swa, \
                            softcap, n_split, part_acc, part_ml); }
DEF_SP(32, 64) DEF_SP(64, 64) DEF_SP(128, 64) DEF_SP(256, 32)

// row r's output merged (lse_merge.cuh) from its private partials (n_sp per head) and, when
// slot >= 0, the shared partials of that group row (n_ss per head): the block's window blockIdx.y
__device__ __forceinline__ float sp_merge_window(const float* p_acc, const float* p_ml, int n_sp, const float* s_acc,
                                                 const float* s_ml, int n_ss, int slot, int r, int n_head, int D) {
    return lse_merge_window<2>([&](int h, int k) {
        return k == 0 ? LseRun{p_acc, p_ml, ((long long)r * n_head + h) * n_sp, n_sp}
                      : LseRun{s_acc, s_ml, slot >= 0 ? ((long long)slot * n_head + h) * n_ss : 0, slot >= 0 ? n_ss : 0};
    }, n_head * D, D, blockIdx.y * 256);
}

// sp_merge writing the rows' digit columns for gemv_int.cu as well (digits.cuh; row t's from
// column nd t of ncp; attention.cu attn_merge_digits): grid (T, n_head * D / 256), LSE_THREADS
// threads.
extern "C" __global__ void __launch_bounds__(LSE_THREADS) sp_merge_digits(
    const float* __restrict__ p_acc, const float* __restrict__ p_ml, int n_sp, const float* __restrict__ s_acc,
    const float* __restrict__ s_ml, int n_ss, const int* __restrict__ row_slot, float* __restrict__ out, int n_head,
    int D, i8* __restrict__ xq, float* __restrict__ xs, i8* __restrict__ xm, int ncp, int nd) { GRID_DEP_WAIT();
    const int r = blockIdx.x, e = blockIdx.y * 256 + threadIdx.x;
    const float v = sp_merge_window(p_acc, p_ml, n_sp, s_acc, s_ml, n_ss, row_slot[r], r, n_head, D);
    if (threadIdx.x < 256) out[(long long)r * n_head * D + e] = v;
    digits_block256(v, blockIdx.y, (long long)nd * r, ncp, nd, xq, xs, xm);
}

// grid (T, ceil(n_head * D / 256)), LSE_THREADS threads
extern "C" __global__ void __launch_bounds__(LSE_THREADS) sp_merge(
    const float* __restrict__ p_acc, const float* __restrict__ p_ml, int n_sp, const float* __restrict__ s_acc,
    const float* __restrict__ s_ml, int n_ss, const int* __restrict__ row_slot, float* __restrict__ out, int n_head,
    int D) { GRID_DEP_WAIT();
    const int r = blockIdx.x, e = blockIdx.y * 256 + threadIdx.x;
    const float v = sp_merge_window(p_acc, p_ml, n_sp, s_acc, s_ml, n_ss, row_slot[r], r, n_head, D);
    if (threadIdx.x < 256 && e < n_head * D) out[(long long)r * n_head * D + e] = v;
}
