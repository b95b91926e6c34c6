// Recurrent (gated delta-net) layers of the hybrid models (Qwen3.5 / Qwen3-next): the short
// causal depthwise convolution and the gated delta rule, with the per-sequence states on the
// device, updated in place (opencoti/engine/recurrent_state.py; CPU reference
// CPUBackend.ssm_conv / CPUBackend.gated_delta_net).
//
// A ubatch's sequences are "views": view v owns the ubatch rows rows[view_off[v] ..
// view_off[v+1]) in position order and the state slot slots[v]. Both kernels walk a view's
// tokens sequentially (one block per view and channel / head tile): the recurrence is
// inherently ordered, and a decode step (one token per view) is a single iteration.
// The chunked (WY) form that the CPU uses for long prefills is not implemented here yet.

#include "pdl.cuh"
#define WARP 32
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------
// ssm_conv (ggml_ssm_conv): x [T, C] rows of the ubatch, w [C, K] (K <= SSM_MAXK taps),
// state [n_slot, K-1, C] (the last K-1 inputs of each sequence). For the view's tokens in
// order: y[t, c] = sum_{j<K-1} w[c, j] * win[j] + w[c, K-1] * x[t, c], then the window shifts
// in x[t, c]. The window goes back to the slot at the end.
// grid = (n_views, ceil(C / blockDim.x)); a thread per channel.
#define SSM_MAXK 8
extern "C" __global__ void ssm_conv(const float* __restrict__ x, float* __restrict__ state, const float* __restrict__ w,
                                    const int* __restrict__ view_off, const int* __restrict__ rows,
                                    const int* __restrict__ slots, float* __restrict__ y, int C, int K) { GRID_DEP_WAIT();
    const int vw = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float* st = state + (long long)slots[vw] * (K - 1) * C + c;
    float win[SSM_MAXK - 1], wc[SSM_MAXK];
#pragma unroll
    for (int j = 0; j < SSM_MAXK; j++) wc[j] = j < K ? w[(long long)c * K + j] : 0.f;
#pragma unroll
    for (int j = 0; j < SSM_MAXK - 1; j++) win[j] = j < K - 1 ? st[(long long)j * C] : 0.f;
    for (int n = view_off[vw]; n < view_off[vw + 1]; n++) {
        const long long t = rows[n];
        const float xt = x[t * C + c];
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < SSM_MAXK - 1; j++)
            if (j < K - 1) acc += wc[j] * win[j];
#pragma unroll
        for (int j = 0; j < SSM_MAXK; j++)
            if (j == K - 1) acc += wc[j] * xt;
        y[t * C + c] = acc;
#pragma unroll
        for (int j = 0; j < SSM_MAXK - 2; j++)
            if (j < K - 2) win[j] = win[j + 1];
#pragma unroll
        for (int j = 0; j < SSM_MAXK - 1; j++)
            if (j == K - 2) win[j] = xt;
    }
#pragma unroll
    for (int j = 0; j < SSM_MAXK - 1; j++)
        if (j < K - 1) st[(long long)j * C] = win[j];
}

// ---------------------------------------------------------------------------------------
// Gated delta rule (Yang et al. 2024; ggml_gated_delta_net), per sequence view and value head h:
//     S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale * S^T q_t
// q, k [T, H, dk]; v, out [T, H, dv]; g, beta [T, H]; S_all [n_slot, H, dk, dv] (S[i, j] maps
// key dim i to value dim j), updated in place.
// grid = (n_views, H, ceil(dv / (GDN_NW * GDN_CW))), GDN_NW warps per block. Warp w of block z
// owns the GDN_CW value columns j0 = (z * GDN_NW + w) * GDN_CW ..; its lanes split the key dims
// (lane l holds rows l, l + 32, ... < dk: R = ceil(dk / 32) <= MAXR), so S^T k and S^T q
// are a per-lane sum plus a warp reduction per column, and the state stays in registers for
// the whole view.
#define GDN_NW 4
#define GDN_CW 8
template <int MAXR>
__device__ __forceinline__ void gdn_impl(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, const float* __restrict__ g,
                                         const float* __restrict__ beta, float* __restrict__ S_all,
                                         const int* __restrict__ view_off, const int* __restrict__ rows,
                                         const int* __restrict__ slots, float* __restrict__ out,
                                         int H, int dk, int dv, float scale) {
    const int vw = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j0 = (blockIdx.z * GDN_NW + warp) * GDN_CW;
    if (j0 >= dv) return;  // whole warps only; no block-level synchronisation below
    float* S = S_all + ((long long)slots[vw] * H + h) * dk * dv;
    float s[MAXR][GDN_CW];
#pragma unroll
    for (int r = 0; r < MAXR; r++) {
        const int i = lane + 32 * r;
#pragma unroll
        for (int c = 0; c < GDN_CW; c++)
            s[r][c] = (i < dk && j0 + c < dv) ? S[(long long)i * dv + j0 + c] : 0.f;
    }
    for (int n = view_off[vw]; n < view_off[vw + 1]; n++) {
        const long long th = (long long)rows[n] * H + h;
        const float decay = expf(g[th]), b = beta[th];
        float kr[MAXR], qr[MAXR];
#pragma unroll
        for (int r = 0; r < MAXR; r++) {
            const int i = lane + 32 * r;
            kr[r] = i < dk ? k[th * dk + i] : 0.f;
            qr[r] = i < dk ? q[th * dk + i] * scale : 0.f;
        }
#pragma unroll
        for (int c = 0; c < GDN_CW; c++) {
            const int j = j0 + c;
            float kv = 0.f;
#pragma unroll
            for (int r = 0; r < MAXR; r++) { s[r][c] *= decay; kv += s[r][c] * kr[r]; }
            kv = warp_sum(kv);
            const float d = b * ((j < dv ? v[th * dv + j] : 0.f) - kv);
            float o = 0.f;
#pragma unroll
            for (int r = 0; r < MAXR; r++) { s[r][c] += kr[r] * d; o += s[r][c] * qr[r]; }
            o = warp_sum(o);
            if (lane == 0 && j < dv) out[th * dv + j] = o;
        }
    }
#pragma unroll
    for (int r = 0; r < MAXR; r++) {
        const int i = lane + 32 * r;
#pragma unroll
        for (int c = 0; c < GDN_CW; c++)
            if (i < dk && j0 + c < dv) S[(long long)i * dv + j0 + c] = s[r][c];
    }
}

#define DEF_GDN(R)                                                                                              \
    extern "C" __global__ void __launch_bounds__(GDN_NW * 32) gated_delta_net_r##R(                            \
        const float* q, const float* k, const float* v, const float* g, const float* beta, float* S_all,       \
        const int* view_off, const int* rows, const int* slots, float* out, int H, int dk, int dv, float scale) { GRID_DEP_WAIT(); \
        gdn_impl<R>(q, k, v, g, beta, S_all, view_off, rows, slots, out, H, dk, dv, scale); }
DEF_GDN(1) DEF_GDN(2) DEF_GDN(4) DEF_GDN(8)
