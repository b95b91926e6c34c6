// gemv_int.cu's activation digits (layout in gemv_int.cu's header), written by one warp for one
// 256-element super-block of one token: xq_digits, and the kernels whose output feeds an integer
// GEMV directly (kernels.cu's norms and gated activation, the attention merges of attention.cu and
// shared_prefix.cu, for one-token decode steps and for gemmi's 9..64 rows), so that the GEMV needs
// no digit pass of its own. The bits are xq_digits' in every case.
#include "quants.cuh"

// v: the lane's 8 consecutive values, elements 8 * lane .. of super-block sb; col0: the token's
// first digit column; nc: how many of its D digit columns exist (a block's last token may have
// fewer than D inside CW). Every lane of the warp calls it.
__device__ __forceinline__ void digits_store(const float (&v)[8], int sb, int lane, long long col0, int nc, int ncp,
                                             int D, i8* __restrict__ xq, float* __restrict__ xs, i8* __restrict__ xm) {
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(v[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    // 127 * 256^(D - 1) / max|x|: q = x / sx * 256^(D - 1), |q| <= 127 * 256^(D - 1)
    const float inv = m > 0.f ? (D == 3 ? 8323072.f : 32512.f) / m : 0.f;
    u32 dg[3][2] = {{0u, 0u}, {0u, 0u}, {0u, 0u}};
    int ds[3] = {0, 0, 0};  // the lane's digit sums
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int q = __float2int_rn(v[i] * inv);
        const int lo = ((q + 128) & 255) - 128, q1 = (q - lo) >> 8;  // balanced digits in -128..127
        const int mid = ((q1 + 128) & 255) - 128, top = (q1 - mid) >> 8;
        const int dd[3] = {D == 3 ? top : q1, D == 3 ? mid : lo, lo};  // d0, d1 (, d2)
#pragma unroll
        for (int d = 0; d < 3; d++) {
            dg[d][i >> 2] |= (u32)(dd[d] & 255) << (8 * (i & 3));
            ds[d] += dd[d];
        }
    }
#pragma unroll
    for (int d = 0; d < 3; d++) {  // sub-block sums: 4 lanes per 32 elements
        ds[d] += __shfl_xor_sync(0xffffffffu, ds[d], 1);
        ds[d] += __shfl_xor_sync(0xffffffffu, ds[d], 2);
    }
    const int e0 = sb * 256 + 8 * lane;
#pragma unroll
    for (int d = 0; d < 3; d++) {
        if (d >= D || d >= nc) break;  // uniform in the warp
        const long long c = col0 + d;
        *(uint2*)(xq + ((long long)(e0 >> 4) * ncp + c) * 16 + 8 * (lane & 1)) = make_uint2(dg[d][0], dg[d][1]);
        if (lane == 0) xs[(long long)sb * ncp + c] = m * (1.f / 127.f) * (d == 0 ? 1.f : d == 1 ? 1.f / 256.f : 1.f / 65536.f);
        if ((lane & 3) == 0) {
            i8* o = xm + ((long long)sb * ncp + c) * 16 + (lane >> 2);
            o[0] = (i8)(ds[d] & 63);
            o[8] = (i8)(ds[d] >> 6);
        }
    }
}

// One token's row y [K] (K a multiple of 256; the block's own values, e.g. in shared memory after
// a __syncthreads) as its digit columns col0 .. col0 + D - 1: 0 for a single-token GEMV, D t for
// token t of a gemmi layout (whose groups of CW = D x tokens-per-group columns put token t's digit
// i at column D t + i). The other columns of the ncp are left as they are: a column's products
// never reach another's (gemvi_store / gemmi_store sum a token's own columns only), so a column
// of no token needs no zeros. Warp w takes super-blocks w, w + warps, ...
__device__ __forceinline__ void digits_row(const float* y, int K, int ncp, int D, long long col0,
                                           i8* __restrict__ xq, float* __restrict__ xs, i8* __restrict__ xm) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int sb = threadIdx.x >> 5; sb < K / 256; sb += nw) {
        const float* r = y + sb * 256 + 8 * lane;
        const float v[8] = {r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]};
        digits_store(v, sb, lane, col0, D, ncp, D, xq, xs, xm);
    }
}

// A block of 256 or more threads, thread i < 256 holding element i of super-block sb of one
// token's row (a kernel that makes the row 256 values per block, e.g. the attention merges; the
// other threads' v is ignored): the values go through shared memory to warp 0, which stores their
// digit columns col0 .. col0 + D - 1 (as digits_row). Every thread of the block calls it, once
// per kernel (no barrier guards s_v against a second call).
__device__ __forceinline__ void digits_block256(float v, int sb, long long col0, int ncp, int D,
                                                i8* __restrict__ xq, float* __restrict__ xs, i8* __restrict__ xm) {
    __shared__ __align__(16) float s_v[256];
    if (threadIdx.x < 256) s_v[threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        const float4 a = *(const float4*)(s_v + 8 * threadIdx.x), b = *(const float4*)(s_v + 8 * threadIdx.x + 4);
        const float w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        digits_store(w, sb, threadIdx.x, col0, D, ncp, D, xq, xs, xm);
    }
}
