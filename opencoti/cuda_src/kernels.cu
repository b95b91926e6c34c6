// opencoti CUDA kernels: quantized GEMV / dequantize / get_rows over GGUF
// blocks, RMSNorm, RoPE, activations, KV writes and attention over KV cells.
// Compiled at first GPU run with NVRTC (opencoti/engine/backend/cuda_kernels.py).
//
// Conventions: activations are row-major float32 [rows, n]; weights are the
// GGUF tensor bytes, row r at W + r * row_bytes; KV storage is f16
// [n_stream * n_cells, n_head_kv, D] addressed by flat cell index.
#include "quants.cuh"
#include "gemv_units.cuh"

#define WARP 32
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------
// y[t, r] = sum_k W[r, k] * x[t, k] for the nt token rows: wpr warps per output row (1, 2,
// 4 or 8: long rows get several, summed through shared memory); the lanes walk the row's
// units (gemv_units.cuh) so that a warp's loads are coalesced, and dequantize in registers
// (ggml-cuda mul_mat_vec_q's layout, f32 activations).
// grid = (ceil(nt / NT), ceil(nrows / rows per block)): blockIdx.x picks a tile of NT
// token rows and is the fastest grid index, so the tiles that read the same weight
// rows run back to back and the weight comes from L2 after the first tile.
template <class U, int NT>
__device__ __forceinline__ void gemv_impl(const u8* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                                          float* __restrict__ y, int nrows, int ncols, int nt, int wpr) {
    constexpr int R = U::R;
    __shared__ float red[8][NT];  // wpr > 1: per-warp partial sums (blockDim <= 256)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.y * ((blockDim.x >> 5) / wpr) + warp / wpr, sub = warp % wpr;
    const bool active = row < nrows;
    x += (long long)blockIdx.x * NT * ncols;
    y += (long long)blockIdx.x * NT * nrows;
    nt = min(NT, nt - (int)blockIdx.x * NT);
    const u8* wr = W + (long long)(active ? row : 0) * row_bytes;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    const int nunits = active ? ncols / (4 * R) : 0;
    for (int u = sub * WARP + lane; u < nunits; u += WARP * wpr) {
        float v[R][4];
        int p[R];
        U::unit(wr, u, v, p);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xt = x + (long long)t * ncols;
                float s = 0.f;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float4 q = __ldg((const float4*)(xt + p[r]));
                    s += v[r][0] * q.x + v[r][1] * q.y + v[r][2] * q.z + v[r][3] * q.w;
                }
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
    if (wpr > 1) {
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < NT; t++) red[warp][t] = acc[t];
        }
        __syncthreads();
        if (sub == 0) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float s = 0.f;
                for (int w = 0; w < wpr; w++) s += red[warp + w][t];
                acc[t] = s;
            }
        }
    }
    if (active && sub == 0 && lane == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < nt) y[(long long)t * nrows + row] = acc[t];
    }
}

// Two weights of one type over the same x (FFN gate and up), then out = act(gate) * up.
template <class U>
__device__ __forceinline__ void gemv_gated_impl(const u8* __restrict__ Wg, const u8* __restrict__ Wu, long long row_bytes,
                                                const float* __restrict__ x, float* __restrict__ y,
                                                int nrows, int ncols, int act) {
    constexpr int R = U::R;
    int row = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
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
    if (lane == 0) {
        float g;
        if (act == 1) {  // gelu tanh
            g = 0.5f * ag * (1.f + tanhf(0.7978845608028654f * (ag + 0.044715f * ag * ag * ag)));
        } else {  // silu
            g = ag / (1.f + expf(-ag));
        }
        y[row] = g * au;
    }
}

// Dequantize a whole [nrows, ncols] weight to f32 or f16 (prefill GEMMs): one thread per chunk.
template <class Q, bool HALF>
__device__ __forceinline__ void dequant_impl(const u8* __restrict__ W, long long row_bytes, void* out, int nrows, int ncols) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    int nch = ncols >> 5;
    if (i >= (long long)nrows * nch) return;
    int row = (int)(i / nch), c = (int)(i % nch);
    float v[32];
    Q::chunk(W + (long long)row * row_bytes, c, v);
    long long o = (long long)row * ncols + 32 * c;
    if (HALF) {
        u16* p = (u16*)out + o;
#pragma unroll
        for (int k = 0; k < 32; k++) p[k] = f2h(v[k]);
    } else {
        float4* p = (float4*)((float*)out + o);
#pragma unroll
        for (int k = 0; k < 8; k++) p[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
}

// out[i, :] = W[ids[i], :] (embedding lookup); grid = n ids, threads over chunks.
template <class Q>
__device__ __forceinline__ void get_rows_impl(const u8* __restrict__ W, long long row_bytes, const int* __restrict__ ids,
                                              float* __restrict__ out, int ncols) {
    int r = blockIdx.x;
    const u8* wr = W + (long long)ids[r] * row_bytes;
    int nch = ncols >> 5;
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
        float v[32];
        Q::chunk(wr, c, v);
        float* p = out + (long long)r * ncols + 32 * c;
#pragma unroll
        for (int k = 0; k < 32; k++) p[k] = v[k];
    }
}

#define DEF_UKERNELS(ID, U, U8)                                                                                   \
    extern "C" __global__ void gemv1_##ID(const u8* W, long long rb, const float* x, float* y, int nr, int nc, int nt, \
                                          int wpr) { gemv_impl<U, 1>(W, rb, x, y, nr, nc, nt, wpr); }         \
    extern "C" __global__ void gemv8_##ID(const u8* W, long long rb, const float* x, float* y, int nr, int nc, int nt, \
                                          int wpr) { gemv_impl<U8, 8>(W, rb, x, y, nr, nc, nt, wpr); }         \
    extern "C" __global__ void gemv_gated_##ID(const u8* Wg, const u8* Wu, long long rb, const float* x, float* y, \
                                               int nr, int nc, int act) {                                     \
        gemv_gated_impl<U>(Wg, Wu, rb, x, y, nr, nc, act); }
#define DEF_QKERNELS(ID, Q)                                                                                   \
    extern "C" __global__ void dequant_f32_##ID(const u8* W, long long rb, float* out, int nr, int nc) {     \
        dequant_impl<Q, false>(W, rb, out, nr, nc); }                                                         \
    extern "C" __global__ void dequant_f16_##ID(const u8* W, long long rb, u16* out, int nr, int nc) {       \
        dequant_impl<Q, true>(W, rb, out, nr, nc); }                                                          \
    extern "C" __global__ void get_rows_##ID(const u8* W, long long rb, const int* ids, float* out, int nc) { \
        get_rows_impl<Q>(W, rb, ids, out, nc); }

FOR_EACH_UTYPE(DEF_UKERNELS)
FOR_EACH_QTYPE(DEF_QKERNELS)

// ---------------------------------------------------------------------------------------
__device__ __forceinline__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = l < nw ? sh[l] : 0.f;
    return warp_sum(v);
}

// y = x / sqrt(mean(x^2) + eps) * w (w may be null); one block per row of n.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                    int n, float eps) {
    __shared__ float sh[32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
    s = block_sum(s, sh);
    float r = rsqrtf(s / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * r * (w ? w[i] : 1.f);
}

// x_out = x + rms_norm(h) * w_post; h_out = rms_norm(x_out) * w_next (post-norm, residual, next norm).
extern "C" __global__ void post_norm_add_norm(const float* __restrict__ x, const float* __restrict__ h,
                                              const float* __restrict__ w_post, const float* __restrict__ w_next,
                                              float* __restrict__ x_out, float* __restrict__ h_out, int n, float eps) {
    __shared__ float sh[32];
    long long o = (long long)blockIdx.x * n;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += h[o + i] * h[o + i];
    s = block_sum(s, sh);
    float r = w_post ? rsqrtf(s / n + eps) : 1.f;
    float s2 = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[o + i] + h[o + i] * r * (w_post ? w_post[i] : 1.f);
        x_out[o + i] = v;
        s2 += v * v;
    }
    s2 = block_sum(s2, sh);
    if (!h_out) return;
    float r2 = rsqrtf(s2 / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) h_out[o + i] = x_out[o + i] * r2 * w_next[i];
}

// RoPE (ggml_rope_ext without YaRN) on x [T, H, D]: grid = T*H rows. mode 0 = norm
// (pairs 2i, 2i+1), 2 = neox (pairs i, i + n_rot/2). Angles in double precision.
// Optional fused per-head RMSNorm before rotation (norm_w != null), as q/k norms.
extern "C" __global__ void rope(const float* __restrict__ x, const int* __restrict__ pos, float* __restrict__ y,
                                int H, int D, int n_rot, float base, float freq_scale, int mode,
                                const float* __restrict__ ff, const float* __restrict__ norm_w, float eps) {
    extern __shared__ float buf[];  // D floats
    __shared__ float sh[32];
    long long row = blockIdx.x;
    int t = (int)(row / H);
    const float* xr = x + row * D;
    float* yr = y + row * D;
    float r = 1.f;
    if (norm_w) {
        float s = 0.f;
        for (int i = threadIdx.x; i < D; i += blockDim.x) s += xr[i] * xr[i];
        s = block_sum(s, sh);
        r = rsqrtf(s / D + eps);
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) buf[i] = xr[i] * r * (norm_w ? norm_w[i] : 1.f);
    __syncthreads();
    int half = n_rot / 2;
    double p = (double)pos[t] * (double)freq_scale;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        if (i >= n_rot) { yr[i] = buf[i]; continue; }
        int k = mode == 2 ? (i < half ? i : i - half) : (i >> 1);
        double inv = pow((double)base, -2.0 * k / n_rot);
        if (ff) inv /= (double)ff[k];
        double sn, cs;
        sincos(p * inv, &sn, &cs);
        float c = (float)cs, s = (float)sn;
        int i0 = mode == 2 ? k : 2 * k, i1 = mode == 2 ? k + half : 2 * k + 1;
        float x0 = buf[i0], x1 = buf[i1];
        yr[i] = (i == i0) ? x0 * c - x1 * s : x0 * s + x1 * c;
    }
}

extern "C" __global__ void gelu_tanh(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; y[i] = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))); }
}
extern "C" __global__ void silu(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; y[i] = v / (1.f + expf(-v)); }
}
// y = act(g) * u
extern "C" __global__ void gated_act(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
                                     long long n, int act) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = g[i], a;
    if (act == 1) a = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    else a = v / (1.f + expf(-v));
    y[i] = a * u[i];
}

// K/V of T tokens into f16 cells: K[cell[t]] = k[t] (kw floats per token), same for V.
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v,
                                    u16* __restrict__ K, u16* __restrict__ V, const int* __restrict__ cell,
                                    int kw, int vw) {
    int t = blockIdx.x;
    long long c = cell[t];
    for (int i = threadIdx.x; i < kw; i += blockDim.x) K[c * kw + i] = f2h(k[(long long)t * kw + i]);
    for (int i = threadIdx.x; i < vw; i += blockDim.x) V[c * vw + i] = f2h(v[(long long)t * vw + i]);
}
