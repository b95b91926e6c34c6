// Batched-decode matmul on tensor cores: y[t, r] = sum_k W[r, k] * x[t, k] for 9..64 token
// rows (several sequences decoding at once), the weight read from DRAM once per call in its
// GGUF block format. The role of ggml-cuda's mmq.cuh (quantized weight tiles in shared memory,
// tensor-core products), with a different operand format: instead of q8_1 activations and
// int8 dot products, both operands go to f16 and the float32 accuracy of the GEMV is kept by
// splitting each into two f16 terms (w = wh + wl, x = xh + xl, wl = f16(w - wh)) and summing
// wh*xh + wh*xl + wl*xh (the wl*xl term is below float32 rounding): relative error ~2^-22
// per product, as 3xTF32 in CUTLASS (Markidis et al. 2018, "NVIDIA tensor core
// programmability, performance & precision"). So a batch of sequences decodes to the same
// logits as one sequence at a time, up to float32 summation order.
//
// mmq_<type>(W, row_bytes, x, y, nrows, ncols, nt, stages_per_split):
//   grid (ceil(nrows / MQ_BM), n_split), MQ_WARPS warps. Block (bx, s) owns weight rows
//   [bx * MQ_BM, +MQ_BM) and the column stages [s * stages_per_split, ...) of MQ_BK columns.
//   Per stage: the MQ_BM x MQ_BK weight tile is dequantized through gemv_units.cuh's units
//   (coalesced 32-bit reads; for every type a stage is a contiguous range of units, since a
//   unit's runs stay inside one 128-column half of a K-quant super-block) into shared memory
//   as (hi, lo) f16 pairs, the nt x MQ_BK activation tile likewise from float32 x; then each
//   warp multiplies its 16 rows by all token rows with mma.sync m16n8k16 (f16 in, f32 acc).
//   Output: y[s][t][r] float32 (n_split partial slabs; mmq_reduce sums them in split order).
// Columns past ncols (a last partial stage; ncols % 32 == 0) are zero in both tiles.
#include "gemv_units.cuh"
#include "mma.cuh"

#define MQ_WARPS 8
#define MQ_BM (16 * MQ_WARPS)  // weight rows per block
#define MQ_BK 128              // columns per stage
#define MQ_LD (MQ_BK + 8)      // halves per shared row: conflict-free fragment loads
#define MQ_MAXT 64             // token rows (8 n8 tiles)

// (hi, lo) f16 terms of one float: hi = f16(v), lo = f16(v - hi)
__device__ __forceinline__ void mq_split(float v, u16& hi, u16& lo) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hi) : "f"(v));
    float r = v - h2f(hi);
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(lo) : "f"(r));
}

// four consecutive values -> (hi, lo) halves at s_hi[o..o+3], s_lo[o..o+3] (o % 4 == 0)
__device__ __forceinline__ void mq_store4(u16* s_hi, u16* s_lo, int o, float a, float b, float c, float d) {
    u16 h0, l0, h1, l1, h2, l2, h3, l3;
    mq_split(a, h0, l0); mq_split(b, h1, l1); mq_split(c, h2, l2); mq_split(d, h3, l3);
    *(uint2*)(s_hi + o) = make_uint2((u32)h0 | ((u32)h1 << 16), (u32)h2 | ((u32)h3 << 16));
    *(uint2*)(s_lo + o) = make_uint2((u32)l0 | ((u32)l1 << 16), (u32)l2 | ((u32)l3 << 16));
}

template <class U>
__device__ __forceinline__ void mmq_impl(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                                         float* __restrict__ y, int nrows, int ncols, int nt, int stages_per_split) {
    constexpr int R = U::R;
    constexpr int UPS = MQ_BK / (4 * R);  // units per row per stage
    extern __shared__ __align__(16) unsigned char mq_smem[];
    const int ntp = (nt + 7) & ~7;
    u16* s_wh = (u16*)mq_smem;      // [MQ_BM][MQ_LD]
    u16* s_wl = s_wh + MQ_BM * MQ_LD;
    u16* s_xh = s_wl + MQ_BM * MQ_LD;  // [ntp][MQ_LD]
    u16* s_xl = s_xh + ntp * MQ_LD;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const int r0 = blockIdx.x * MQ_BM;
    const int nunits = ncols / (4 * R);
    const int nstages = (ncols + MQ_BK - 1) / MQ_BK;
    const int s0 = blockIdx.y * stages_per_split, s1 = min(nstages, s0 + stages_per_split);
    const int n8 = ntp >> 3;

    float acc[MQ_MAXT / 8][4];
#pragma unroll
    for (int j = 0; j < MQ_MAXT / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    for (int st = s0; st < s1; st++) {
        const int k0 = st * MQ_BK;
        __syncthreads();  // the previous stage's fragments are read
        if (k0 + MQ_BK > ncols) {  // last partial stage: zero both tiles first
            for (int i = threadIdx.x; i < (2 * MQ_BM + 2 * ntp) * MQ_LD / 2; i += blockDim.x) ((u32*)mq_smem)[i] = 0u;
            __syncthreads();
        }
        for (int i = threadIdx.x; i < MQ_BM * UPS; i += blockDim.x) {
            const int rr = i / UPS, u = st * UPS + i % UPS;
            if (u >= nunits) continue;
            const int row = min(r0 + rr, nrows - 1);
            float v[R][4];
            int p[R];
            U::unit(W + (long long)row * row_bytes, u, v, p);
#pragma unroll
            for (int r = 0; r < R; r++)
                mq_store4(s_wh, s_wl, rr * MQ_LD + p[r] - k0, v[r][0], v[r][1], v[r][2], v[r][3]);
        }
        const int kc = min(MQ_BK, ncols - k0) >> 2;  // float4 columns in this stage
        for (int i = threadIdx.x; i < nt * (MQ_BK / 4); i += blockDim.x) {
            const int t = i / (MQ_BK / 4), c = i % (MQ_BK / 4);
            if (c >= kc) continue;
            float4 q = __ldg((const float4*)(x + (long long)t * ncols + k0) + c);
            mq_store4(s_xh, s_xl, t * MQ_LD + 4 * c, q.x, q.y, q.z, q.w);
        }
        __syncthreads();
        const u16* ah = s_wh + (warp * 16 + gid) * MQ_LD + 2 * tig;
        const u16* al = s_wl + (warp * 16 + gid) * MQ_LD + 2 * tig;
#pragma unroll 2
        for (int ks = 0; ks < MQ_BK; ks += 16) {
            const u32 h0 = *(const u32*)(ah + ks), h1 = *(const u32*)(ah + 8 * MQ_LD + ks),
                      h2 = *(const u32*)(ah + ks + 8), h3 = *(const u32*)(ah + 8 * MQ_LD + ks + 8);
            const u32 l0 = *(const u32*)(al + ks), l1 = *(const u32*)(al + 8 * MQ_LD + ks),
                      l2 = *(const u32*)(al + ks + 8), l3 = *(const u32*)(al + 8 * MQ_LD + ks + 8);
#pragma unroll
            for (int j = 0; j < MQ_MAXT / 8; j++) {
                if (j < n8) {
                    const int o = (8 * j + gid) * MQ_LD + ks + 2 * tig;
                    const u32 bh0 = *(const u32*)(s_xh + o), bh1 = *(const u32*)(s_xh + o + 8);
                    const u32 bl0 = *(const u32*)(s_xl + o), bl1 = *(const u32*)(s_xl + o + 8);
                    mma_m16n8k16(acc[j], l0, l1, l2, l3, bh0, bh1);  // small terms first
                    mma_m16n8k16(acc[j], h0, h1, h2, h3, bl0, bl1);
                    mma_m16n8k16(acc[j], h0, h1, h2, h3, bh0, bh1);
                }
            }
        }
    }
    // c0, c1: row gid, token columns 2 tig, 2 tig + 1; c2, c3: row gid + 8
    float* out = y + (long long)blockIdx.y * nt * nrows;
    const int row = r0 + warp * 16 + gid;
#pragma unroll
    for (int j = 0; j < MQ_MAXT / 8; j++) {
        if (j < n8) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int rw = row + (e >> 1) * 8, t = 8 * j + 2 * tig + (e & 1);
                if (rw < nrows && t < nt) out[(long long)t * nrows + rw] = acc[j][e];
            }
        }
    }
}

// y[i] = sum over the n_split partial slabs part[s][i] (i < n), in split order.
extern "C" __global__ void mmq_reduce(const float* __restrict__ part, float* __restrict__ y, long long n, int n_split) { GRID_DEP_WAIT();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = part[i];
    for (int k = 1; k < n_split; k++) s += part[k * n + i];
    y[i] = s;
}

#define DEF_MMQ(ID, U, U8)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MQ_WARPS) mmq_##ID(                                    \
        const u8* W, long long rb, const float* x, float* y, int nr, int nc, int nt, int sps) { GRID_DEP_WAIT();              \
        mmq_impl<U8>(W, rb, x, y, nr, nc, nt, sps); }
FOR_EACH_UTYPE(DEF_MMQ)
