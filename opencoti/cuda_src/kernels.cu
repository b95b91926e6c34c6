// opencoti CUDA kernels: quantized GEMV (also per routed expert) / dequantize / get_rows over GGUF
// blocks, MoE routing, RMSNorm, L2 norm, RoPE (YaRN), activations, KV writes. (Attention over KV
// cells: attention.cu; gated delta-net recurrences: recurrent.cu.)
// Compiled at first GPU run with NVRTC (opencoti/engine/backend/cuda_kernels.py).
//
// Conventions: activations are row-major float32 [rows, n]; weights are the
// GGUF tensor bytes, row r at W + r * row_bytes; KV storage is f16
// [n_stream * n_cells, n_head_kv, D] addressed by flat cell index.
#include "quants.cuh"
#include "gemv_units.cuh"
#include "rope.cuh"
#include "digits.cuh"

#define WARP 32

// act(g) * u: act 1 = GELU (tanh), 0 = SiLU
__device__ __forceinline__ float gated(float v, float u, int act) {
    const float a = act == 1 ? 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)))
                             : v / (1.f + expf(-v));
    return a * u;
}

// ---------------------------------------------------------------------------------------
// y[t, r] = sum_k W[r, k] * x[t, k] for the nt token rows: wpr warps per output row (1, 2,
// 4 or 8: long rows get several, summed through shared memory); the lanes walk the row's
// units (gemv_units.cuh) so that a warp's loads are coalesced, and dequantize in registers
// (ggml-cuda mul_mat_vec_q's layout, f32 activations).
// grid = (ceil(nt / NT), ceil(nrows / rows per block)): blockIdx.x picks a tile of NT
// token rows (passed in as ``tile``) and is the fastest grid index, so the tiles that read
// the same weight rows run back to back and the weight comes from L2 after the first tile.
// The expert GEMV (gemv_id) calls it with tile 0 and pointers already offset per pair.
template <class U, int NT, int RPW>
__device__ __forceinline__ void gemv_impl(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                                          float* __restrict__ y, int nrows, int ncols, int nt, int wpr, int tile) {
    constexpr int R = U::R;
    __shared__ float red[8][RPW * NT];  // wpr > 1: per-warp partial sums (blockDim <= 256)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // a warp (or wpr warps) computes RPW consecutive rows, so each x load serves RPW rows
    const int row0 = (blockIdx.y * ((blockDim.x >> 5) / wpr) + warp / wpr) * RPW, sub = warp % wpr;
    const bool active = row0 < nrows;
    x += (long long)tile * NT * ncols;
    y += (long long)tile * NT * nrows;
    nt = min(NT, nt - tile * NT);
    const u8* wr[RPW];
#pragma unroll
    for (int k = 0; k < RPW; k++) wr[k] = W + (long long)(active ? min(row0 + k, nrows - 1) : 0) * row_bytes;
    float acc[RPW][NT];
#pragma unroll
    for (int k = 0; k < RPW; k++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[k][t] = 0.f;
    const int nunits = active ? ncols / (4 * R) : 0;
    for (int u = sub * WARP + lane; u < nunits; u += WARP * wpr) {
        float v[RPW][R][4];
        int p[R];
#pragma unroll
        for (int k = 0; k < RPW; k++) U::unit(wr[k], u, v[k], p);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xt = x + (long long)t * ncols;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float4 q = __ldg((const float4*)(xt + p[r]));
#pragma unroll
                    for (int k = 0; k < RPW; k++)
                        acc[k][t] += v[k][r][0] * q.x + v[k][r][1] * q.y + v[k][r][2] * q.z + v[k][r][3] * q.w;
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < RPW; k++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[k][t] = warp_sum(acc[k][t]);
    if (wpr > 1) {
        if (lane == 0) {
#pragma unroll
            for (int k = 0; k < RPW; k++)
#pragma unroll
                for (int t = 0; t < NT; t++) red[warp][k * NT + t] = acc[k][t];
        }
        __syncthreads();
        if (sub == 0) {
#pragma unroll
            for (int k = 0; k < RPW; k++)
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float s = 0.f;
                    for (int w = 0; w < wpr; w++) s += red[warp + w][k * NT + t];
                    acc[k][t] = s;
                }
        }
    }
    if (active && sub == 0 && lane == 0) {
#pragma unroll
        for (int k = 0; k < RPW; k++)
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < nt && row0 + k < nrows) y[(long long)t * nrows + row0 + k] = acc[k][t];
    }
}

// Two weights of one type over the same x (FFN gate and up), then out = act(gate) * up.
// One warp per output row; ``rowblk`` is the block's index along the rows (blockIdx.x for
// gemv_gated, blockIdx.y for the expert variant gemv_id_gated).
template <class U>
__device__ __forceinline__ void gemv_gated_impl(const u8* __restrict__ Wg, const u8* __restrict__ Wu, long long row_bytes,
                                                const float* __restrict__ x, float* __restrict__ y,
                                                int nrows, int ncols, int act, int rowblk) {
    constexpr int R = U::R;
    int row = (int)((rowblk * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (row >= nrows) return;
    float ag = 0.f, au = 0.f;
    const int nunits = ncols / (4 * R);
    for (int u = lane; u < nunits; u += WARP) {
        float v[R][4], w[R][4];
        int p[R];
        U::unit(Wg + (long long)row * row_bytes, u, v, p);
        U::unit(Wu + (long long)row * row_bytes, u, w, p);
#pragma unroll
        for (int r = 0; r < R; r++) {
            float4 q = __ldg((const float4*)(x + p[r]));
            ag += v[r][0] * q.x + v[r][1] * q.y + v[r][2] * q.z + v[r][3] * q.w;
            au += w[r][0] * q.x + w[r][1] * q.y + w[r][2] * q.z + w[r][3] * q.w;
        }
    }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) y[row] = gated(ag, au, act);
}

// Dequantize a whole [nrows, ncols] weight for a prefill GEMM: one thread per 32-value chunk
// (thread i: chunk i % (ncols / 32) of row i / (ncols / 32)), blockDim 256. A warp's 32 chunks
// pass through shared memory so that the stores are coalesced (a lane storing its own chunk
// wrote 32 lines per warp store: ~190 GB/s on the H200).
// MODE 0: f32 [nrows, ncols]; 1: f16 [nrows, ncols]; 2: the f16 pair of each value,
// hi = f16(w) and lo = f16((w - hi) * 2^12) (scaled out of the f16 subnormals: |w - hi| <=
// 2^-11 |w|), as rows [hi(0..ncols), lo(0..ncols)] of 2 ncols (the split-f16 GEMM, cuda.py
// _gemm_f16x3).
// TBS: the weight's row layout (quants.cuh qrow: 0 GGUF rows, else 16-row tiles of TBS-byte blocks).
template <class Q, int MODE, int TBS = 0>
__device__ __forceinline__ void dequant_impl(const u8* __restrict__ W, long long row_bytes, void* out, int nrows, int ncols) {
    __shared__ float sv[8][32][33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long i0 = (blockIdx.x * (long long)blockDim.x) + 32 * warp;  // the warp's first chunk
    const int nch = ncols >> 5;
    const long long total = (long long)nrows * nch, i = i0 + lane;
    if (i0 >= total) return;  // uniform in the warp
    if (i < total) {
        float v[32];
        Q::chunk(qchunk_row<TBS>(qrow<TBS>(W, row_bytes, i / nch), (int)(i % nch)), (int)(i % nch), v);
#pragma unroll
        for (int k = 0; k < 32; k++) sv[warp][lane][k] = v[k];
    }
    __syncwarp();
    for (int k = 0; k < 32 && i0 + k < total; k++) {  // chunk i0 + k, value lane
        const long long ci = i0 + k, row = ci / nch;
        const int c = (int)(ci % nch);
        const float x = sv[warp][k][lane];
        if (MODE == 2) {
            u16* p = (u16*)out + row * 2 * ncols + 32 * c + lane;
            const u16 h = f2h(x);
            p[0] = h;
            p[ncols] = f2h((x - h2f(h)) * 4096.f);
        } else if (MODE == 1) {
            ((u16*)out)[32 * ci + lane] = f2h(x);
        } else {
            ((float*)out)[32 * ci + lane] = x;
        }
    }
}

// out[i, :] = W[ids[i], :] (embedding lookup); grid = n ids, threads over chunks.
template <class Q, int TBS = 0>
__device__ __forceinline__ void get_rows_impl(const u8* __restrict__ W, long long row_bytes, const int* __restrict__ ids,
                                              float* __restrict__ out, int ncols) {
    int r = blockIdx.x;
    const u8* wr = qrow<TBS>(W, row_bytes, ids[r]);
    int nch = ncols >> 5;
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
        float v[32];
        Q::chunk(qchunk_row<TBS>(wr, c), c, v);
        float* p = out + (long long)r * ncols + 32 * c;
#pragma unroll
        for (int k = 0; k < 32; k++) p[k] = v[k];
    }
}

// Expert GEMVs (mixture of experts, ggml-cuda mul_mat_vec with ids): pair p of P (token t,
// slot k: p = t * n_used + k) multiplies expert ids[p]'s matrix, at W + ids[p] * eb bytes
// (rows of row_bytes each, as a 2-D weight), by input row p / x_div of x
// ([*, ncols]; x_div = n_used to read each token's row once per slot, 1 for per-pair rows)
// into y[p] ([P, nrows]). grid = (P, row blocks as gemv1), 256 threads.
template <class U>
__device__ __forceinline__ void gemv_id_impl(const u8* __restrict__ W, long long rb, long long eb,
                                             const int* __restrict__ ids, const float* __restrict__ x, int x_div,
                                             float* __restrict__ y, int nrows, int ncols, int wpr) {
    const int p = blockIdx.x;
    gemv_impl<U, 1, 1>(W + (long long)ids[p] * eb, rb, x + (long long)(p / x_div) * ncols, y + (long long)p * nrows,
                    nrows, ncols, 1, wpr, 0);
}
// Gated expert GEMV: y[p] = act(Wg_e x) * (Wu_e x) with e = ids[p] (gate and up of one type and
// expert stride eb; e.g. the two halves of a fused gate_up tensor). grid = (P, ceil(nrows / 8)).
template <class U>
__device__ __forceinline__ void gemv_id_gated_impl(const u8* __restrict__ Wg, const u8* __restrict__ Wu, long long rb,
                                                   long long eb, const int* __restrict__ ids,
                                                   const float* __restrict__ x, int x_div, float* __restrict__ y,
                                                   int nrows, int ncols, int act) {
    const int p = blockIdx.x;
    const long long off = (long long)ids[p] * eb;
    gemv_gated_impl<U>(Wg + off, Wu + off, rb, x + (long long)(p / x_div) * ncols, y + (long long)p * nrows,
                       nrows, ncols, act, blockIdx.y);
}

#define DEF_UKERNELS(ID, U, U8)                                                                                   \
    extern "C" __global__ void gemv1_##ID(const u8* W, long long rb, const float* x, float* y, int nr, int nc, int nt, \
                                          int wpr) { GRID_DEP_WAIT(); gemv_impl<U, 1, 1>(W, rb, x, y, nr, nc, nt, wpr, blockIdx.x); } \
    extern "C" __global__ void gemv1r2_##ID(const u8* W, long long rb, const float* x, float* y, int nr, int nc, \
                                            int nt, int wpr) { GRID_DEP_WAIT(); gemv_impl<U, 1, 2>(W, rb, x, y, nr, nc, nt, wpr, blockIdx.x); } \
    extern "C" __global__ void gemv1r8_##ID(const u8* W, long long rb, const float* x, float* y, int nr, int nc, \
                                            int nt, int wpr) { GRID_DEP_WAIT(); gemv_impl<U, 1, 8>(W, rb, x, y, nr, nc, nt, wpr, blockIdx.x); } \
    extern "C" __global__ void gemv8_##ID(const u8* W, long long rb, const float* x, float* y, int nr, int nc, int nt, \
                                          int wpr) { GRID_DEP_WAIT(); gemv_impl<U8, 8, 1>(W, rb, x, y, nr, nc, nt, wpr, blockIdx.x); } \
    extern "C" __global__ void gemv_gated_##ID(const u8* Wg, const u8* Wu, long long rb, const float* x, float* y, \
                                               int nr, int nc, int act) { GRID_DEP_WAIT();                                     \
        gemv_gated_impl<U>(Wg, Wu, rb, x, y, nr, nc, act, blockIdx.x); }                                       \
    extern "C" __global__ void gemv_id_##ID(const u8* W, long long rb, long long eb, const int* ids, const float* x, \
                                            int x_div, float* y, int nr, int nc, int wpr) { GRID_DEP_WAIT();                  \
        gemv_id_impl<U>(W, rb, eb, ids, x, x_div, y, nr, nc, wpr); }                                          \
    extern "C" __global__ void gemv_id_gated_##ID(const u8* Wg, const u8* Wu, long long rb, long long eb,      \
                                                  const int* ids, const float* x, int x_div, float* y, int nr, \
                                                  int nc, int act) { GRID_DEP_WAIT();                                          \
        gemv_id_gated_impl<U>(Wg, Wu, rb, eb, ids, x, x_div, y, nr, nc, act); }
#define DEF_QKERNELS(ID, Q)                                                                                   \
    extern "C" __global__ void dequant_f32_##ID(const u8* W, long long rb, float* out, int nr, int nc) { GRID_DEP_WAIT();     \
        dequant_impl<Q, 0>(W, rb, out, nr, nc); }                                                             \
    extern "C" __global__ void dequant_f16_##ID(const u8* W, long long rb, u16* out, int nr, int nc) { GRID_DEP_WAIT();       \
        dequant_impl<Q, 1>(W, rb, out, nr, nc); }                                                             \
    extern "C" __global__ void dequant_f16x2_##ID(const u8* W, long long rb, u16* out, int nr, int nc) { GRID_DEP_WAIT();     \
        dequant_impl<Q, 2>(W, rb, out, nr, nc); }                                                             \
    extern "C" __global__ void get_rows_##ID(const u8* W, long long rb, const int* ids, float* out, int nc) { GRID_DEP_WAIT(); \
        get_rows_impl<Q>(W, rb, ids, out, nc); }

// The same on K-quant weights in 16-row tiles (cuda.py QTensor.tiled, TILED_BLOCK_BYTES): <name>_t16_<type>.
#define DEF_TKERNELS(ID, Q, BS)                                                                               \
    extern "C" __global__ void dequant_f32_t16_##ID(const u8* W, long long rb, float* out, int nr, int nc) { GRID_DEP_WAIT(); \
        dequant_impl<Q, 0, BS>(W, rb, out, nr, nc); }                                                         \
    extern "C" __global__ void dequant_f16_t16_##ID(const u8* W, long long rb, u16* out, int nr, int nc) { GRID_DEP_WAIT(); \
        dequant_impl<Q, 1, BS>(W, rb, out, nr, nc); }                                                         \
    extern "C" __global__ void dequant_f16x2_t16_##ID(const u8* W, long long rb, u16* out, int nr, int nc) { GRID_DEP_WAIT(); \
        dequant_impl<Q, 2, BS>(W, rb, out, nr, nc); }                                                         \
    extern "C" __global__ void get_rows_t16_##ID(const u8* W, long long rb, const int* ids, float* out, int nc) { GRID_DEP_WAIT(); \
        get_rows_impl<Q, BS>(W, rb, ids, out, nc); }

FOR_EACH_UTYPE(DEF_UKERNELS)
FOR_EACH_QTYPE(DEF_QKERNELS)
DEF_TKERNELS(12, QQ4_K, 144)
DEF_TKERNELS(14, QQ6_K, 210)

// ---------------------------------------------------------------------------------------
// The split-f16 GEMM's activations (cuda.py _gemm_f16x3): row t of x [n, k] f32, scaled by a power
// of two s[t] > max |x[t]| (exact; the f16 range then holds every value), as hi = f16(x / s) and
// lo = f16((x / s - hi) * 2^12): xa[t] = [lo, hi] (2k halves). One block per row.
extern "C" __global__ void split_f16_rows(const float* __restrict__ x, u16* __restrict__ xa, float* __restrict__ s,
                                          int k) { GRID_DEP_WAIT();
    __shared__ float sh[32];
    const long long t = blockIdx.x;
    const float* xr = x + t * k;
    float m = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) m = fmaxf(m, fabsf(xr[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    if (l == 0) sh[w] = m;
    __syncthreads();
    m = l < nw ? sh[l] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    int e = 0;
    if (m > 0.f && m <= 3.4028235e38f) frexpf(m, &e);  // m < 2^e (inf / NaN rows: scale 1)
    const float sc = ldexpf(1.f, e), inv = ldexpf(1.f, -e);
    if (threadIdx.x == 0) s[t] = sc;
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const float v = xr[i] * inv;
        const u16 h = f2h(v);
        xa[t * 2 * k + i] = f2h((v - h2f(h)) * 4096.f);
        xa[t * 2 * k + k + i] = h;
    }
}

// Row kernels keep a row's values in registers: element tid + k * blockDim of the row in v[k]
// (NV per thread; the launch picks blockDim >= n / NV up to 1024, longer rows loop over the
// rest), so that every load of the row is issued before the first sum needs it (a strided loop
// waited for each load in turn: ~13 us for one 3,584-float row on the H200).
#define NV 8
// The norms' digit epilogue: the block's row's values v[k] * r * w[k] (NV per thread, element
// threadIdx.x + k * blockDim.x; n <= NV * blockDim) through shared memory (4 n bytes of dynamic
// shared memory) into digits.cuh's digits_row, as token blockIdx.x's columns (D blockIdx.x: one
// row, or a gemmi layout's rows). Every thread of the block calls it.
__device__ __forceinline__ void norm_row_digits(const float (&v)[NV], float r, const float (&w)[NV], int n, int ncp,
                                                int D, i8* __restrict__ xq, float* __restrict__ xs,
                                                i8* __restrict__ xm) {
    extern __shared__ float row_sh[];
    const int t = threadIdx.x, bd = blockDim.x;
#pragma unroll
    for (int k = 0; k < NV; k++)
        if (t + k * bd < n) row_sh[t + k * bd] = v[k] * r * w[k];
    __syncthreads();
    digits_row(row_sh, n, ncp, D, (long long)D * blockIdx.x, xq, xs, xm);
}
// y = x / sqrt(mean(x^2) + eps) * w (w may be null); one block per row of n. With xq (one row or
// a gemmi layout's rows, n a multiple of 256, at most NV * blockDim; 4 n bytes of dynamic shared
// memory): y's digit columns for gemv_int.cu too (digits.cuh digits_row; D digit columns per row
// of ncp), so the integer GEMV that reads y needs no xq_digits launch. Launched with up to 1,024
// threads (cuda.py _row_threads), hence the bound: at most 64 registers a thread.
extern "C" __global__ void __launch_bounds__(1024)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
         int n, float eps, i8* __restrict__ xq, float* __restrict__ xs,
         i8* __restrict__ xm, int ncp, int D) { GRID_DEP_WAIT();
    __shared__ float sh[32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    const int bd = blockDim.x, t = threadIdx.x;
    float v[NV], wv[NV], s = 0.f;
#pragma unroll
    for (int k = 0; k < NV; k++) {  // the weights load with the row, not after the sum
        int i = t + k * bd;
        v[k] = i < n ? xr[i] : 0.f;
        wv[k] = i < n && w ? w[i] : 1.f;
        s += v[k] * v[k];
    }
    for (int i = t + NV * bd; i < n; i += bd) s += xr[i] * xr[i];
    s = block_sum(s, sh);
    float r = rsqrtf(s / n + eps);
#pragma unroll
    for (int k = 0; k < NV; k++) {
        int i = t + k * bd;
        if (i < n) yr[i] = v[k] * r * wv[k];
    }
    for (int i = t + NV * bd; i < n; i += bd) yr[i] = xr[i] * r * (w ? w[i] : 1.f);
    if (xq) norm_row_digits(v, r, wv, n, ncp, D, xq, xs, xm);
}

// x_out = x + rms_norm(h) * w_post; h_out = rms_norm(x_out) * w_next (post-norm, residual, next norm).
// h: n_split partial slabs of the product (gemv_int.cu gemmi's split-K), slab floats apart, summed
// here in split order (mmq_reduce's bits). xq ... D: h_out's digit columns too, as rms_norm's.
// Bounded as rms_norm: unbounded, nvcc gave it 72 registers, and the 1,024-thread launch for a
// row over 8,192 floats failed for want of registers (test_row_norms_match_cpu[9000], H200).
extern "C" __global__ void __launch_bounds__(1024)
post_norm_add_norm(const float* __restrict__ x, const float* __restrict__ h,
                   const float* __restrict__ w_post, const float* __restrict__ w_next,
                   float* __restrict__ x_out, float* __restrict__ h_out, int n, float eps,
                   int n_split, long long slab, i8* __restrict__ xq,
                   float* __restrict__ xs, i8* __restrict__ xm, int ncp, int D) { GRID_DEP_WAIT();
    __shared__ float sh[32];
    const long long o = (long long)blockIdx.x * n;
    const int bd = blockDim.x, t = threadIdx.x;
    float hv[NV], xv[NV], wp[NV], wn[NV], s = 0.f;
#pragma unroll
    for (int k = 0; k < NV; k++) {  // the first slab's and the weights' loads issued up front
        int i = t + k * bd;
        hv[k] = i < n ? h[o + i] : 0.f;
        xv[k] = i < n ? x[o + i] : 0.f;
        wp[k] = i < n && w_post ? w_post[i] : 1.f;
        wn[k] = i < n && w_next ? w_next[i] : 1.f;
    }
    for (int z = 1; z < n_split; z++) {  // the other slabs, a round trip per slab for all NV values
        float hz[NV];
#pragma unroll
        for (int k = 0; k < NV; k++) {
            int i = t + k * bd;
            hz[k] = i < n ? h[z * slab + o + i] : 0.f;
        }
#pragma unroll
        for (int k = 0; k < NV; k++) hv[k] += hz[k];
    }
#pragma unroll
    for (int k = 0; k < NV; k++) s += hv[k] * hv[k];
    for (int i = t + NV * bd; i < n; i += bd) {
        const float v = slab_sum(h, o + i, n_split, slab);
        s += v * v;
    }
    // without a post-norm (Qwen, Llama: the residual add and the next norm only) the first sum
    // is not needed; w_post is uniform in the block, so the skipped barriers are everyone's
    const float r = w_post ? rsqrtf(block_sum(s, sh) / n + eps) : 1.f;
    float s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NV; k++) {
        int i = t + k * bd;
        if (i < n) {
            xv[k] += hv[k] * r * wp[k];
            x_out[o + i] = xv[k];
            s2 += xv[k] * xv[k];
        }
    }
    for (int i = t + NV * bd; i < n; i += bd) {
        float v = x[o + i] + slab_sum(h, o + i, n_split, slab) * r * (w_post ? w_post[i] : 1.f);
        x_out[o + i] = v;
        s2 += v * v;
    }
    s2 = block_sum(s2, sh);
    if (!h_out) return;
    const float r2 = rsqrtf(s2 / n + eps);
#pragma unroll
    for (int k = 0; k < NV; k++) {
        int i = t + k * bd;
        if (i < n) h_out[o + i] = xv[k] * r2 * wn[k];
    }
    for (int i = t + NV * bd; i < n; i += bd) h_out[o + i] = x_out[o + i] * r2 * w_next[i];
    if (xq) norm_row_digits(xv, r2, wn, n, ncp, D, xq, xs, xm);
}

// RoPE (ggml_rope_ext) on x [T, H, D]: grid = T*H rows (rope.cuh rope_row).
extern "C" __global__ void rope(const float* __restrict__ x, const int* __restrict__ pos, float* __restrict__ y,
                                int H, int D, int n_rot, float base, float freq_scale, int mode,
                                const float* __restrict__ ff, const float* __restrict__ norm_w, float eps,
                                float ext_factor, float corr_lo, float corr_hi, float mscale) { GRID_DEP_WAIT();
    extern __shared__ float buf[];  // D floats
    __shared__ float sh[32];
    rope_head_row(x, (long long)H * D, 1, 0, nullptr, y, blockIdx.x, H, pos, D, n_rot, base, freq_scale, mode, ff, norm_w, eps, ext_factor, corr_lo,
                  corr_hi, mscale, buf, sh);
}

// An attention layer's rope + KV store in one launch (cpu.rope_kv_write, f16 caches): grid
// T * (Hq + Hk) blocks. Blocks [0, T * Hq): q head rows, rotated (q_norm first) into q_out.
// The rest: k head rows, rotated (k_norm first) and stored as f16 into K at the token's cell
// (flat index cell[t]; row layout [n_kv][D]), with the same head's V row (dv values) into V:
// the bits of rope + rope + kv_write.
extern "C" __global__ void rope_kv_write(ROPE_KV_WRITE_PARAMS(u16)) {
    const RopePre pre = ROPE_PRE();  // (before the wait: rope.cuh ROPE_ANGLE_PRE)
    GRID_DEP_WAIT();
    const QKVIn in = ROPE_KV_WRITE_IN;
    extern __shared__ float buf[];  // D floats
    __shared__ float sh[32];
    long long row;
    if (rope_q_block(in, q_out, T, Hq, pos, D, n_rot, base, freq_scale, mode, ff, q_norm, eps, ext_factor, corr_lo,
                     corr_hi, mscale, buf, sh, row, pre))
        return;
    const int t = (int)(row / Hk), h = (int)(row % Hk);
    const long long c = (long long)cell[t] * Hk + h;  // the (cell, kv head) row
    // a value of V a thread (pre.on: blockDim >= D; dv <= blockDim): loaded before K's row and
    // stored after its rope, so both rows' loads are in flight together (stored first, V's loads
    // and K's were two round trips in turn)
    const bool v_reg = pre.on && dv <= (int)blockDim.x;
    float vx = 0.f;
    if (v_reg) {
        if ((int)threadIdx.x < dv) vx = in.v_at(t, h, dv, threadIdx.x);
    } else {
        for (int i = threadIdx.x; i < dv; i += blockDim.x) V[c * dv + i] = f2h(in.v_at(t, h, dv, i));
    }
    u16* kr = K + c * D;
    rope_row(in.k_row(t, h, D), in.nsk, in.slk, in.k_bias(h, D), pos[t], D, n_rot, base, freq_scale, mode, ff, k_norm, eps, ext_factor,
             corr_lo, corr_hi, mscale, buf, sh, [&](int i, float x) { kr[i] = f2h(x); }, pre);
    if (v_reg && (int)threadIdx.x < dv) V[c * dv + threadIdx.x] = f2h(vx);
}

extern "C" __global__ void gelu_tanh(const float* __restrict__ x, float* __restrict__ y, long long n) { GRID_DEP_WAIT();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; y[i] = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))); }
}
extern "C" __global__ void silu(const float* __restrict__ x, float* __restrict__ y, long long n) { GRID_DEP_WAIT();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; y[i] = v / (1.f + expf(-v)); }
}
// y = act(g) * u
extern "C" __global__ void gated_act(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
                                     long long n, int act) { GRID_DEP_WAIT();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = gated(g[i], u[i], act);
}

// y = act(g) * u with g, u the two halves of each row of gu [n / nf, 2 nf] (a fused gate + up
// product, CUDABackend.fuse_rows); n = rows * nf.
// gu may be n_split split-K partial slabs of slab floats each (gemmi's, unsummed): they are added
// in split order first, as mmq_reduce would (the same bits).
extern "C" __global__ void gated_act_cat(const float* __restrict__ gu, float* __restrict__ y, long long n, int nf,
                                         int act, int n_split, long long slab) { GRID_DEP_WAIT();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = i / nf, c = i - r * nf, gi = 2 * r * nf + c;
    y[i] = gated(slab_sum(gu, gi, n_split, slab), slab_sum(gu, gi + nf, n_split, slab), act);
}
__device__ __forceinline__ void add4(float4& a, const float* p) {
    const float4 b = *(const float4*)p;
    a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
}
// gated_act_cat for one row or a gemmi layout's rows (nf a multiple of 256; gu's n_split slabs
// as there), also writing y's digit columns for gemv_int.cu (digits.cuh; row t's D digit columns
// from D t of ncp): grid (nf / 256, rows) blocks of 32 threads, a lane 8 consecutive values.
extern "C" __global__ void gated_act_digits(const float* __restrict__ gu, float* __restrict__ y, int nf, int act,
                                            int n_split, long long slab, i8* __restrict__ xq,
                                            float* __restrict__ xs, i8* __restrict__ xm, int ncp, int D) { GRID_DEP_WAIT();
    const int sb = blockIdx.x, lane = threadIdx.x, e0 = sb * 256 + 8 * lane, t = blockIdx.y;
    gu += (long long)t * 2 * nf;
    y += (long long)t * nf;
    float4 g0 = *(const float4*)(gu + e0), g1 = *(const float4*)(gu + e0 + 4);
    float4 u0 = *(const float4*)(gu + nf + e0), u1 = *(const float4*)(gu + nf + e0 + 4);
    for (int z = 1; z < n_split; z++) {
        const float* p = gu + z * slab;
        add4(g0, p + e0); add4(g1, p + e0 + 4); add4(u0, p + nf + e0); add4(u1, p + nf + e0 + 4);
    }
    const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w}, u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = gated(g[i], u[i], act);
    *(float4*)(y + e0) = make_float4(v[0], v[1], v[2], v[3]);
    *(float4*)(y + e0 + 4) = make_float4(v[4], v[5], v[6], v[7]);
    digits_store(v, sb, lane, (long long)D * t, D, ncp, D, xq, xs, xm);  // (digits_row: no other columns)
}

// K/V of T tokens into f16 cells: K[cell[t]] = k[t] (kw floats per token), same for V.
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v,
                                    u16* __restrict__ K, u16* __restrict__ V, const int* __restrict__ cell,
                                    int kw, int vw) { GRID_DEP_WAIT();
    int t = blockIdx.x;
    long long c = cell[t];
    for (int i = threadIdx.x; i < kw; i += blockDim.x) K[c * kw + i] = f2h(k[(long long)t * kw + i]);
    for (int i = threadIdx.x; i < vw; i += blockDim.x) V[c * vw + i] = f2h(v[(long long)t * vw + i]);
}

// Logistic 1 / (1 + e^-x) as 0.5 (1 + tanh(x / 2)) (overflow-free; CPUBackend.sigmoid).
extern "C" __global__ void sigmoid(const float* __restrict__ x, float* __restrict__ y, long long n) { GRID_DEP_WAIT();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = 0.5f * (1.f + tanhf(0.5f * x[i]));
}
// ln(1 + e^x) = max(x, 0) + log1p(e^-|x|) (overflow-free; CPUBackend.softplus).
extern "C" __global__ void softplus(const float* __restrict__ x, float* __restrict__ y, long long n) { GRID_DEP_WAIT();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; y[i] = fmaxf(v, 0.f) + log1pf(expf(-fabsf(v))); }
}
// y = x / max(||x||_2, eps) per row of n (ggml_l2_norm); one block per row.
extern "C" __global__ void l2_norm(const float* __restrict__ x, float* __restrict__ y, int n, float eps) { GRID_DEP_WAIT();
    __shared__ float sh[32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
    s = block_sum(s, sh);
    float d = fmaxf(sqrtf(s), eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] / d;
}

// ---------------------------------------------------------------------------------------
// Mixture-of-experts routing (llama.cpp build_moe_ffn, softmax gating): per token t (one warp,
// grid = T), p = softmax(logits[t, :E]); the n_used largest p in order (ties: lower expert id),
// sel[t, k] = expert, w[t, k] = p (divided by their sum when norm_w, times w_scale when != 0).
// Dynamic shared memory: E floats per block.
extern "C" __global__ void moe_route(const float* __restrict__ logits, int E, int n_used, int norm_w, float w_scale,
                                     int* __restrict__ sel, float* __restrict__ w) { GRID_DEP_WAIT();
    extern __shared__ float p[];
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)t * E;
    float m = -3.402823466e38f;
    for (int e = lane; e < E; e += WARP) m = fmaxf(m, l[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.f;
    for (int e = lane; e < E; e += WARP) { float v = expf(l[e] - m); p[e] = v; s += v; }
    s = warp_sum(s);
    for (int e = lane; e < E; e += WARP) p[e] = p[e] / s;
    __syncwarp();
    float wsum = 0.f;
    for (int k = 0; k < n_used; k++) {
        float bv = -1.f;
        int bi = E;
        for (int e = lane; e < E; e += WARP) {
            float v = p[e];  // taken experts hold -1 (every probability is >= 0)
            if (v > bv) { bv = v; bi = e; }  // ascending e per lane: the first max has the lowest id
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (bi >= E) bi = 0;  // NaN logits: keep the index in range (the weights are NaN anyway)
        if (lane == 0) {
            sel[(long long)t * n_used + k] = bi;
            w[(long long)t * n_used + k] = bv;
            p[bi] = -1.f;
        }
        wsum += bv;
        __syncwarp();
    }
    if (lane == 0 && (norm_w || w_scale != 0.f)) {
        for (int k = 0; k < n_used; k++) {
            float v = w[(long long)t * n_used + k];
            if (norm_w) v = v / wsum;
            if (w_scale != 0.f) v = v * w_scale;
            w[(long long)t * n_used + k] = v;
        }
    }
}

// out[t, i] = sum_k w[t, k] * ds[sel[t, k]] * y[t * n_used + k, i] (ds null: 1), slots in order.
// grid = T, threads over the n columns.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                       const int* __restrict__ sel, const float* __restrict__ ds,
                                       float* __restrict__ out, int n_used, int n) { GRID_DEP_WAIT();
    const long long t = blockIdx.x;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float acc = 0.f;
        for (int k = 0; k < n_used; k++) {
            long long pk = t * n_used + k;
            float s = w[pk];
            if (ds) s = s * ds[sel[pk]];
            acc += y[pk * n + i] * s;
        }
        out[t * n + i] = acc;
    }
}
