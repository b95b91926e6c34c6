// Block-wide sums and one row of RoPE (ggml_rope_ext), shared by kernels.cu (rope, the f16
// rope_kv_write) and rope_store.cu (rope_kv_write_q, the scalar and turbo KV tiers): one definition, so
// the fused kernels give the bits of the separate launches.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = l < nw ? sh[l] : 0.f;
    return warp_sum(v);
}

// RoPE (ggml_rope_ext) of head rows. mode 0 = norm (pairs 2i, 2i+1),
// 2 = neox (pairs i, i + n_rot/2). Angles in double precision. Optional fused per-head
// RMSNorm before rotation (norm_w != null), as q/k norms.
// YaRN (ggml rope_yarn): with theta_e = pos * base^(-2i/n_rot) / ff[i], ext_factor != 0 blends
// theta = theta_e * freq_scale * (1 - m) + theta_e * m, m = ext_factor * ramp(i) with
// ramp(i) = 1 - clamp((i - corr_lo) / max(0.001, corr_hi - corr_lo), 0, 1); otherwise
// theta = theta_e * freq_scale. cos and sin are multiplied by mscale (1 without YaRN; the
// caller folds attn_factor and YaRN's 1 + 0.1 ln(1/freq_scale) into it).
// h[i] given as n_split partial slabs slab floats apart (a split-K product's, unsummed), summed in
// split order: mmq_reduce's bits (n_split = 1: h[i]). Also kernels.cu's norms and gated activation.
__device__ __forceinline__ float slab_sum(const float* __restrict__ h, long long i, int n_split, long long slab) {
    float v = h[i];
    for (int z = 1; z < n_split; z++) v += h[i + z * slab];
    return v;
}

// Rope's pair index k of value i < n_rot: mode 2 (neox) pairs i and i + n_rot / 2, mode 0 pairs
// 2 k and 2 k + 1.
__device__ __forceinline__ int rope_pair(int i, int n_rot, int mode) {
    const int half = n_rot / 2;
    return mode == 2 ? (i < half ? i : i - half) : (i >> 1);
}

// The value that value i < n_rot is rotated with (rope_pair's other member).
__device__ __forceinline__ int rope_partner(int i, int n_rot, int mode) {
    const int half = n_rot / 2;
    return mode == 2 ? (i < half ? i + half : i - half) : (i ^ 1);
}

// Rope's rotation of a pair (x0, x1) by the angle's (cos, sin): the pair's first value when first,
// else its second.
__device__ __forceinline__ float rope_rotate(float x0, float x1, float2 cs, bool first) {
    return first ? x0 * cs.x - x1 * cs.y : x0 * cs.y + x1 * cs.x;
}

// Value i < n_rot rotated, from its own value v and its partner ip's value vp (the pair's order:
// the lower index first).
__device__ __forceinline__ float rope_rotate_own(float v, float vp, int i, int ip, float2 cs) {
    const bool first = i < ip;
    return rope_rotate(first ? v : vp, first ? vp : v, cs, first);
}

// The cos and sin (times mscale) of rope's angle for value i < n_rot of a row at position p:
// theta = p * base^(-2k / n_rot) / ff[k] (k: i's pair), YaRN's blend when ext_factor != 0
// (ggml_rope_ext / rope_yarn's formula), in double precision.
__device__ __forceinline__ float2 rope_cs(int i, int p, int n_rot, float base, float freq_scale, int mode,
                                          const float* __restrict__ ff, float ext_factor, float corr_lo,
                                          float corr_hi, float mscale) {
    const int k = rope_pair(i, n_rot, mode);
    double inv = pow((double)base, -2.0 * k / n_rot);
    if (ff) inv /= (double)ff[k];
    double th_e = (double)p * inv, th = th_e * (double)freq_scale;
    if (ext_factor != 0.f) {
        double ramp = ((double)k - (double)corr_lo) / fmax(0.001, (double)corr_hi - (double)corr_lo);
        double mix = (1.0 - fmin(1.0, fmax(0.0, ramp))) * (double)ext_factor;
        th = th * (1.0 - mix) + th_e * mix;
    }
    double sn, cs;
    sincos(th, &sn, &cs);
    return make_float2((float)(cs * (double)mscale), (float)(sn * (double)mscale));
}

// What a thread of a fused rope + KV store's q or K block reads before its PDL wait (rope_pre):
// the (cos, sin) of its value i = threadIdx.x (rope_cs; 1, 0 for i >= n_rot), the norm weight of
// value i and of its rope partner (1 without a norm) and the projection bias of value i and of
// its partner (0 without one). on: false where rope_row reads them itself (RopePre{}: V rows,
// blocks of fewer threads than D, ROPE_ANGLE_PRE 0). By value, so it stays in registers across
// the wait (a pointer to it, null or not, had put it in local memory, read back from L2 after the
// wait).
struct RopePre {
    float2 cs = {1.f, 0.f};
    float w = 1.f, wp = 1.f, b = 0.f, bp = 0.f;
    bool on = false;
};

// One row of D values (a head) of rope: xr (ns partial slabs, slab floats apart: slab_sum; plus its
// projection's bias row br, when not null) normed (norm_w != null), rotated at position p, and
// handed to store(i, value) for every i < D. pre.on (rope_pre, only where blockDim >= D): thread
// i < D takes value i alone, with its angle and weights from pre, and reads its rope partner's
// unnormed value from buf after the norm's barriers (normed as the partner's thread does: the same
// bits), so the row takes block_sum's two barriers (one without a norm) and no weight loads;
// else the strided loops, reading the weights and computing the angles here.
// buf: D floats of shared memory; all threads of the block take part (block_sum, __syncthreads).
template <class Store>
__device__ __forceinline__ void rope_row(const float* __restrict__ xr, int ns, long long slab,
                                         const float* __restrict__ br, int pos, int D,
                                         int n_rot, float base, float freq_scale, int mode,
                                         const float* __restrict__ ff, const float* __restrict__ norm_w, float eps,
                                         float ext_factor, float corr_lo, float corr_hi, float mscale, float* buf,
                                         float* sh, Store store, const RopePre pre = RopePre{}) {
    if (pre.on) {
        const int i = threadIdx.x;
        float x = 0.f;
        if (i < D) {
            x = slab_sum(xr, i, ns, slab);
            if (br) x = x + pre.b;
            buf[i] = x;
        }
        float r = 1.f;
        if (norm_w) {
            float s = 0.f;
            if (i < D) s += x * x;
            s = block_sum(s, sh);  // (its barriers order buf's writes before the partner's read)
            r = rsqrtf(s / D + eps);
        } else {
            __syncthreads();
        }
        if (i < D) {
            const float xn = x * r * pre.w;  // (pre's weights are 1 without a norm)
            if (i >= n_rot) {
                store(i, xn);
            } else {
                const int ip = rope_partner(i, n_rot, mode);
                store(i, rope_rotate_own(xn, buf[ip] * r * pre.wp, i, ip, pre.cs));
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) {  // the row (+ bias), once
        const float x = slab_sum(xr, i, ns, slab);
        buf[i] = br ? x + br[i] : x;
    }
    float r = 1.f;
    if (norm_w) {
        float s = 0.f;
        for (int i = threadIdx.x; i < D; i += blockDim.x) s += buf[i] * buf[i];
        s = block_sum(s, sh);  // (its barriers order buf's writes before the reads below)
        r = rsqrtf(s / D + eps);
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) buf[i] = buf[i] * r * (norm_w ? norm_w[i] : 1.f);
    __syncthreads();
    int half = n_rot / 2;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        if (i >= n_rot) { store(i, buf[i]); continue; }
        int k = rope_pair(i, n_rot, mode);
        const float2 cs = rope_cs(i, pos, n_rot, base, freq_scale, mode, ff, ext_factor, corr_lo, corr_hi, mscale);
        int i0 = mode == 2 ? k : 2 * k, i1 = mode == 2 ? k + half : 2 * k + 1;
        store(i, rope_rotate(buf[i0], buf[i1], cs, i == i0));
    }
}


// rope_row's value i = threadIdx.x < D with pre.on, without the norm's scale r: rope of x * w
// (x the row's value plus its bias, w pre's norm weight), its partner read from global memory
// (no barrier). Rope is linear, so rope_row's value (x r w roped) is r times this up to rounding;
// a caller that applies r later (turbo_row's GAIN) takes the norm's block sum off the row's
// dependent chain. xx: x * x, the thread's term of the norm's sum.
__device__ __forceinline__ float rope_value_unnormed(const float* __restrict__ xr, int ns, long long slab, bool bias,
                                                     int n_rot, int mode, const RopePre& pre, float& xx) {
    const int i = threadIdx.x;
    float x = slab_sum(xr, i, ns, slab), xp = 0.f;
    const int ip = i < n_rot ? rope_partner(i, n_rot, mode) : i;
    if (i < n_rot) xp = slab_sum(xr, ip, ns, slab);  // (both loads in flight together)
    if (bias) {
        x = x + pre.b;
        xp = xp + pre.bp;
    }
    xx = x * x;
    const float xw = x * pre.w;
    return i >= n_rot ? xw : rope_rotate_own(xw, xp * pre.wp, i, ip, pre.cs);
}

// Head row `row` of x (H head rows of D per token, a token's rows ldx floats after the last's;
// bias: the projection's [H * D] bias or null) rotated, handed to store(i, value) (rope_row's), or
// without a store written into the same row of y [rows, D] (the rope kernel; the q rows of the
// fused rope + KV store kernels).
template <class Store>
__device__ __forceinline__ void rope_head_row(const float* __restrict__ x, long long ldx, int ns, long long slab,
                                              const float* __restrict__ bias, long long row, int H,
                                              const int* __restrict__ pos, int D, int n_rot, float base,
                                              float freq_scale, int mode, const float* __restrict__ ff,
                                              const float* __restrict__ norm_w, float eps, float ext_factor,
                                              float corr_lo, float corr_hi, float mscale, float* buf, float* sh,
                                              Store store, const RopePre pre = RopePre{}) {
    const long long t = row / H, h = row - t * H;
    rope_row(x + t * ldx + h * D, ns, slab, bias ? bias + h * D : nullptr, pos[t], D, n_rot, base, freq_scale, mode, ff, norm_w,
             eps, ext_factor, corr_lo, corr_hi, mscale, buf, sh, store, pre);
}
__device__ __forceinline__ void rope_head_row(const float* __restrict__ x, long long ldx, int ns, long long slab,
                                              const float* __restrict__ bias, float* __restrict__ y, long long row, int H,
                                              const int* __restrict__ pos, int D, int n_rot, float base,
                                              float freq_scale, int mode, const float* __restrict__ ff,
                                              const float* __restrict__ norm_w, float eps, float ext_factor,
                                              float corr_lo, float corr_hi, float mscale, float* buf, float* sh,
                                              const RopePre pre = RopePre{}) {
    float* yr = y + row * D;
    rope_head_row(x, ldx, ns, slab, bias, row, H, pos, D, n_rot, base, freq_scale, mode, ff, norm_w, eps, ext_factor,
                  corr_lo, corr_hi, mscale, buf, sh, [&](int i, float v) { yr[i] = v; }, pre);
}

// The inputs of the fused rope + KV store kernels: q [T, Hq, D], k [T, Hk, D], v [T, Hk, dv] with
// token strides ldq / ldk / ldv floats (column slices of one fused q / k / v product, or
// contiguous), each the first of nsq / nsk / nsv partial slabs slq / slk / slv floats apart (a
// split-K product left unsummed: slab_sum; 1: the values), plus their projections' biases (null:
// none), added before the norms and rope.
struct QKVIn {
    const float *q, *k, *v, *bq, *bk, *bv;
    long long ldq, ldk, ldv;
    int nsq, nsk, nsv;
    long long slq, slk, slv;
    // k and v rows of (token t, kv head h): their first value and bias row (null without a bias)
    __device__ __forceinline__ const float* k_row(int t, int h, int D) const { return k + t * ldk + (long long)h * D; }
    __device__ __forceinline__ const float* k_bias(int h, int D) const { return bk ? bk + (long long)h * D : nullptr; }
    __device__ __forceinline__ float v_at(int t, int h, int dv, int i) const {
        const float x = slab_sum(v, t * ldv + (long long)h * dv + i, nsv, slv);
        return bv ? x + bv[(long long)h * dv + i] : x;
    }
};

// The fused rope + KV store kernels' parameters (kernels.cu rope_kv_write: KV_T u16, f16 rows;
// rope_store.cu rope_kv_write_q: u8, tier rows), one list for both, and the QKVIn they build from
// the first nine and the last six.
#define ROPE_KV_WRITE_PARAMS(KV_T)                                                                                   \
    const float *q, const float *k, const float *v, const float *bq, const float *bk, const float *bv, long long ldq, \
        long long ldk, long long ldv, const int *__restrict__ pos, float *__restrict__ q_out, KV_T *__restrict__ K,    \
        KV_T *__restrict__ V, const int *__restrict__ cell, int T, int Hq, int Hk, int D, int dv, int n_rot,         \
        float base, float freq_scale, int mode, const float *__restrict__ ff, const float *__restrict__ q_norm,      \
        const float *__restrict__ k_norm, float eps, float ext_factor, float corr_lo, float corr_hi, float mscale,    \
        int nsq, int nsk, int nsv, long long slq, long long slk, long long slv
#define ROPE_KV_WRITE_IN QKVIn{q, k, v, bq, bk, bv, ldq, ldk, ldv, nsq, nsk, nsv, slq, slk, slv}

// The fused rope + KV store kernels' q blocks: blocks [0, T * Hq) rotate one q head row into
// q_out [T * Hq, D] (rope_head_row, bias and q_norm first) and return true; the others return
// false with kv_row = blockIdx.x - T * Hq (f16's rope_kv_write, grid T * (Hq + Hk): their
// (token, kv head) row, token kv_row / Hk; rope_store.cu's rope_kv_write_q, grid T * (Hq + 2 Hk):
// the K rows, then the V rows). pre: rope_row's.
__device__ __forceinline__ bool rope_q_block(const QKVIn& in, float* __restrict__ q_out, int T, int Hq,
                                             const int* __restrict__ pos, int D, int n_rot, float base,
                                             float freq_scale, int mode, const float* __restrict__ ff,
                                             const float* __restrict__ q_norm, float eps, float ext_factor,
                                             float corr_lo, float corr_hi, float mscale, float* buf, float* sh,
                                             long long& kv_row, const RopePre pre = RopePre{}) {
    const long long row = blockIdx.x;
    if (row < (long long)T * Hq) {
        rope_head_row(in.q, in.ldq, in.nsq, in.slq, in.bq, q_out, row, Hq, pos, D, n_rot, base, freq_scale, mode, ff, q_norm, eps,
                      ext_factor, corr_lo, corr_hi, mscale, buf, sh, pre);
        return true;
    }
    kv_row = row - (long long)T * Hq;
    return false;
}

// ROPE_ANGLE_PRE (default 1; OPENCOTI_CUDA_ROPE_ANGLE_PRE=0 builds 0): the fused rope + KV store
// kernels read what their q and K rows' rope needs besides the rows before their PDL wait, while
// the kernel before them (the q / k / v product) still runs (rope_pre): each thread's rope angle
// (rope_cs: a double-precision pow and sincos, the longest dependent chain of a head's rope) and
// its value's norm weights and bias, which rope_row would otherwise load after the wait (a round
// trip to L2 on the store's critical path). It reads only pos (the ubatch's positions, which the
// host stages: no kernel writes them), ff, the q / k norms' weights and the q / k projections'
// biases (model weights), and rope_row computes with them what it would compute itself: the same
// bits. 0: rope_row computes and loads them.
#ifndef ROPE_ANGLE_PRE
#define ROPE_ANGLE_PRE 1
#endif

// A fused rope + KV store kernel's first statement (before GRID_DEP_WAIT): block r < T * Hq a q
// row (token r / Hq, head r % Hq: q_norm, bq), the next T * Hk the K rows (r' = r - T * Hq: token
// r' / Hk, kv head r' % Hk: k_norm, bk): thread i's RopePre (value i, where i < D). RopePre{} (off)
// for the other blocks (V rows), a block of fewer threads than D (rope's strided loops) and
// ROPE_ANGLE_PRE 0.
__device__ __forceinline__ RopePre rope_pre(int T, int Hq, int Hk, const int* __restrict__ pos, int D, int n_rot,
                                            float base, float freq_scale, int mode, const float* __restrict__ ff,
                                            float ext_factor, float corr_lo, float corr_hi, float mscale,
                                            const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                            const float* __restrict__ bq, const float* __restrict__ bk) {
    RopePre p;
    const long long r = blockIdx.x, kq = (long long)T * Hq;
    if (!ROPE_ANGLE_PRE || (int)blockDim.x < D || r >= kq + (long long)T * Hk) return p;
    const bool is_q = r < kq;
    const long long rr = is_q ? r : r - kq;
    const int H = is_q ? Hq : Hk, t = (int)(rr / H), h = (int)(rr % H), i = threadIdx.x;
    const float* nw = is_q ? q_norm : k_norm;
    const float* bias = is_q ? bq : bk;
    p.on = true;
    if (i < D) {
        if (nw) {
            p.w = nw[i];
            if (i < n_rot) p.wp = nw[rope_partner(i, n_rot, mode)];
        }
        if (bias) {
            p.b = bias[(long long)h * D + i];
            if (i < n_rot) p.bp = bias[(long long)h * D + rope_partner(i, n_rot, mode)];
        }
    }
    if (i < n_rot) p.cs = rope_cs(i, pos[t], n_rot, base, freq_scale, mode, ff, ext_factor, corr_lo, corr_hi, mscale);
    return p;
}
#define ROPE_PRE() \
    rope_pre(T, Hq, Hk, pos, D, n_rot, base, freq_scale, mode, ff, ext_factor, corr_lo, corr_hi, mscale, q_norm, k_norm, bq, bk)
