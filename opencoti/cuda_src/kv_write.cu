// KV tier write and read kernels (compiled with cuda_kv.tables_prefix(); see kv_tiers.cuh).
//
// Quantize: x float32 [n_rows, D] with row r = (token t = r / n_kv, kv head h = r % n_kv) goes
// to the cell row store + (cell[t] * n_kv + h) * ROWB (ROWB = D / BS * BB: the cache layout
// [n_stream * n_cells, n_kv, ROWB], cell[] flat = stream * n_cells + cell). The stored bytes
// equal the CPU tier's quantize() (kv_tiers/*.py) bit for bit:
//   kv_quant_<T>        float and ggml scalar tiers: one warp per 32-value block (lane = value);
//   kv_quant_<T>_d<D>   turbo: one block of D threads per row (rotation, per-64 norms, codes,
//                       least-squares scale); tcq: grid (rows, D / 64), 256 threads = the trellis
//                       states, the tail-biting Viterbi search of trellis.py.
// Dequantize (kv_dequant_<T>_d<D>): rows of cell[] -> float32 [n_cells_listed, n_kv, D], the
// rotated tiers un-rotated (KVCache.read_k on the GPU; context shift).
#include "kv_store.cuh"

#define KV_INF (__int_as_float(0x7f800000))

template <class T>
__device__ __forceinline__ void kv_quant_scalar(const float* __restrict__ x, u8* __restrict__ store,
                                                const int* __restrict__ cell, int n_rows, int n_kv, int D) {
    const int wid = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    const int nb = D / 32;
    if (wid >= n_rows * nb) return;  // uniform per warp
    const int r = wid / nb, b = wid % nb, t = r / n_kv, h = r % n_kv;
    u8* dst = store + ((long long)cell[t] * n_kv + h) * (long long)(nb * T::BB) + (long long)b * T::BB;
    T::q32(x[(long long)r * D + 32 * b + lane], dst, lane);
}
#define DEF_QS(T)                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) kv_quant_##T(const float* x, u8* store, const int* cell, \
                                                                    int n_rows, int n_kv, int D) { GRID_DEP_WAIT();        \
        kv_quant_scalar<T>(x, store, cell, n_rows, n_kv, D); }
DEF_QS(KF32) DEF_QS(KF16) DEF_QS(KBF16) DEF_QS(KQ8_0) DEF_QS(KQ6_0) DEF_QS(KQ5_1) DEF_QS(KQ5_0) DEF_QS(KQ4_1)
DEF_QS(KQ4_0) DEF_QS(KIQ4_NL)

// sum of p[0..64) into p[0] by halving (turbo.block_sum's order: p[j] += p[j + h], h = 32, ..., 1); all threads of the block call it,
// threads with j = threadIdx.x & 63 < 64 of block base b0 own p[b0 + j]
__device__ __forceinline__ void tree64(float* p, int tid, int j, bool active) {
#pragma unroll
    for (int h = 32; h > 0; h >>= 1) {
        if (active && j < h) p[tid] = xadd(p[tid], p[tid + h]);
        __syncthreads();
    }
}

// sw: the thread's kv_sign_word<D> (read before the kernel's wait)
template <class T, int D>
__device__ __forceinline__ void kv_quant_turbo(const float* __restrict__ x, u8* __restrict__ store,
                                               const int* __restrict__ cell, int n_kv, u32 sw) {
    __shared__ float sc[D];  // turbo_row's scratch
    const int r = blockIdx.x, t = r / n_kv, h = r % n_kv;
    turbo_row<T, D>(x[(long long)r * D + threadIdx.x], sw,
                    store + ((long long)cell[t] * n_kv + h) * (long long)(D / 64 * T::BB), sc);
}

// Viterbi search of the right-shift trellis (trellis.py _viterbi) over ys[0..n), 256 threads
// (thread s = state s). first_low / last_high < 0: unconstrained. Leaves the best state path in
// path[0..n). Ties go to the lowest index, as NumPy's argmin; costs in exact float32.
template <int K>
__device__ __forceinline__ void viterbi(const float* ys, int n, int first_low, int last_high, const float* cb,
                                        float (*cost)[256], u8* back, float* rv, int* ri, int* path) {
    constexpr int G = 1 << (8 - K), KK = 1 << K;
    const int s = threadIdx.x;
    float c0 = xsub(ys[0], cb[s]);
    c0 = xmul(c0, c0);
    if (first_low >= 0 && (s & (G - 1)) != first_low) c0 = KV_INF;
    cost[0][s] = c0;
    int cur = 0;
    for (int t = 1; t < n; t++) {
        __syncthreads();
        const int g = s & (G - 1);
        float best = cost[cur][g * KK];
        int bj = 0;
#pragma unroll
        for (int jj = 1; jj < KK; jj++) {
            float c = cost[cur][g * KK + jj];
            if (xlt(c, best)) { best = c; bj = jj; }
        }
        if (s < G) back[t * G + s] = (u8)bj;
        float d = xsub(ys[t], cb[s]);
        cost[cur ^ 1][s] = xadd(xmul(d, d), best);
        cur ^= 1;
    }
    __syncthreads();
    float c = cost[cur][s];
    if (last_high >= 0 && (s >> K) != last_high) c = KV_INF;
    rv[s] = c;
    ri[s] = s;
    __syncthreads();
    for (int o = 128; o > 0; o >>= 1) {
        if (s < o) {
            float ov = rv[s + o];
            int oi = ri[s + o];
            if (xlt(ov, rv[s]) || (xeq(ov, rv[s]) && oi < ri[s])) { rv[s] = ov; ri[s] = oi; }
        }
        __syncthreads();
    }
    if (s == 0) {
        int st = ri[0];
        path[n - 1] = st;
        for (int t = n - 1; t > 0; t--) {
            int g = st & (G - 1);
            st = g * KK + back[t * G + g];
            path[t - 1] = st;
        }
    }
    __syncthreads();
}

template <class T, int D>
__device__ __forceinline__ void kv_quant_tcq(const float* __restrict__ x, u8* __restrict__ store,
                                             const int* __restrict__ cell, int n_kv) {
    constexpr int K = T::KBITS, G = 1 << (8 - K), W = 8;  // W: trellis.py WRAP_WINDOW
    __shared__ float v[D], cb[256], cost[2][256], rv[256];
    __shared__ float yb[64], u[64], p[64], p2[64], yw[2 * W];
    __shared__ int ri[256], path[64];
    __shared__ u8 back[64 * G];
    const int r = blockIdx.x, blk = blockIdx.y, tid = threadIdx.x, j = tid & 63;
    const bool act = tid < 64;
    for (int i = tid; i < D; i += blockDim.x) v[i] = x[(long long)r * D + i];
    cb[tid] = T::tab()[tid];
    __syncthreads();
    fwht_shared<D>(v, 1, false, true);
    if (act) { float y = v[64 * blk + j]; yb[j] = y; p[j] = xmul(y, y); }
    __syncthreads();
    tree64(p, tid, j, act);
    const float n = xsqrt(p[0]);
    if (act) u[j] = xlt(0.f, n) ? xmul(yb[j], xdiv(8.f, n)) : 0.f;
    __syncthreads();
    if (tid < 2 * W) yw[tid] = tid < W ? u[64 - W + tid] : u[tid - W];
    __syncthreads();
    viterbi<K>(yw, 2 * W, -1, -1, cb, cost, back, rv, ri, path);
    const int shared_bits = path[W] & (G - 1);
    __syncthreads();
    viterbi<K>(u, 64, shared_bits, shared_bits, cb, cost, back, rv, ri, path);
    if (act) { float c = cb[path[j]]; p[j] = xmul(yb[j], c); p2[j] = xmul(c, c); }
    __syncthreads();
    tree64(p, tid, j, act);
    tree64(p2, tid, j, act);
    const float num = p[0], den = p2[0];
    const float scale = xlt(0.f, den) ? xdiv(num, den) : 0.f;
    const int t = r / n_kv, h = r % n_kv;
    u8* dst = store + ((long long)cell[t] * n_kv + h) * (long long)(D / 64 * T::BB) + (long long)blk * T::BB;
    if (tid == 0) st16(dst, f2h(scale));
    if (tid < 8 * K) {  // stream byte m: bits 8m .. 8m+7; stream bit i = bit i % K of state i / K
        int byte = 0;
#pragma unroll
        for (int bt = 0; bt < 8; bt++) {
            int i = 8 * tid + bt;
            byte |= ((path[i / K] >> (i % K)) & 1) << bt;
        }
        dst[2 + tid] = (u8)byte;
    }
}

#define DEF_QT(T, D)                                                                                            \
    extern "C" __global__ void __launch_bounds__(D) kv_quant_##T##_d##D(const float* x, u8* store, const int* cell, \
                                                                     int n_kv) {                                            \
        const u32 sw = kv_sign_word<D>(); /* (before the wait: a constant) */                                    \
        GRID_DEP_WAIT();                                                                                        \
        kv_quant_turbo<T, D>(x, store, cell, n_kv, sw); }
#define DEF_QC(T, D)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) kv_quant_##T##_d##D(const float* x, u8* store, const int* cell, \
                                                                       int n_kv) { GRID_DEP_WAIT();                         \
        kv_quant_tcq<T, D>(x, store, cell, n_kv); }
#define DEF_QT_ALL(T) DEF_QT(T, 64) DEF_QT(T, 128) DEF_QT(T, 256) DEF_QT(T, 512)
#define DEF_QC_ALL(T) DEF_QC(T, 64) DEF_QC(T, 128) DEF_QC(T, 256) DEF_QC(T, 512)
DEF_QT_ALL(KTurbo8) DEF_QT_ALL(KTurbo4) DEF_QT_ALL(KTurbo3) DEF_QT_ALL(KTurbo2)
DEF_QC_ALL(KTcq3) DEF_QC_ALL(KTcq2)

// rows of the listed cells -> float32 [n_listed, n_kv, D]; grid n_listed * n_kv, D threads
template <class T, int D>
__device__ __forceinline__ void kv_dequant(const u8* __restrict__ store, const int* __restrict__ cell, int n_kv,
                                           float* __restrict__ out) {
    __shared__ float v[D];
    __shared__ float tab[T::NT > 0 ? T::NT : 1];
    const int r = blockIdx.x, tid = threadIdx.x;
    if constexpr (T::NT > 0) {
        for (int i = tid; i < T::NT; i += blockDim.x) tab[i] = T::tab()[i];
        __syncthreads();
    }
    const int c = r / n_kv, h = r % n_kv;
    const u8* row = store + ((long long)cell[c] * n_kv + h) * (long long)(D / T::BS * T::BB);
    float y = T::val(row, tid, tab);
    if constexpr (T::ROT) {
        v[tid] = y;
        __syncthreads();
        fwht_shared<D>(v, 1, true, false);
        y = v[tid];
    }
    out[(long long)r * D + tid] = y;
}
#define DEF_DQ(T, D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(D) kv_dequant_##T##_d##D(const u8* store, const int* cell,     \
                                                                       int n_kv, float* out) { GRID_DEP_WAIT();             \
        kv_dequant<T, D>(store, cell, n_kv, out); }
#define DEF_DQ_ALL(T) DEF_DQ(T, 64) DEF_DQ(T, 128) DEF_DQ(T, 256) DEF_DQ(T, 512)
DEF_DQ_ALL(KF32) DEF_DQ_ALL(KF16) DEF_DQ_ALL(KBF16) DEF_DQ_ALL(KQ8_0) DEF_DQ_ALL(KQ6_0) DEF_DQ_ALL(KQ5_1)
DEF_DQ_ALL(KQ5_0) DEF_DQ_ALL(KQ4_1) DEF_DQ_ALL(KQ4_0) DEF_DQ_ALL(KIQ4_NL) DEF_DQ_ALL(KTurbo8) DEF_DQ_ALL(KTurbo4)
DEF_DQ_ALL(KTurbo3)
DEF_DQ_ALL(KTurbo2) DEF_DQ_ALL(KTcq3) DEF_DQ_ALL(KTcq2)
