#version 450
// Tiled GEMM for prefill: y[t, row] = sum_k W[row, k] * x[t, k], W in GGUF blocks.
//
// Tile 64 weight rows x 64 activation rows x 32 (one chunk) of k; 256 threads, each
// accumulating a 4 x 4 block. The weight tile is dequantized chunk-wise into shared
// memory (ggml-vulkan mul_mm does the same in its loader). Shapes as mul_mat_vec.comp;
// grid (ceil(nrows / 64), ceil(ntok / 64)).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer WB { uint wq[]; };
layout(binding = 1) readonly buffer XB { float xs[]; };
layout(binding = 2) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC {
    uint ncols, nrows, row_bytes, ntok, x_off, y_off, y_stride, y_col;
} p;

#include "quants.glsl"

shared float sa[32 * 65];  // [k][m], padded
shared float sb[32 * 65];  // [k][n]

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint tx = tid & 15u, ty = tid >> 4;
    uint m0 = gl_WorkGroupID.x * 64u, n0 = gl_WorkGroupID.y * 64u;
    float acc[4][4];
    for (uint i = 0u; i < 4u; i++)
        for (uint j = 0u; j < 4u; j++) acc[i][j] = 0.0;
    uint nch = p.ncols >> 5;
    for (uint c = 0u; c < nch; c++) {
        if (tid < 64u) {
            uint row = m0 + tid;
            float v[32];
            if (row < p.nrows) {
                dq_chunk(row * p.row_bytes, c, v);
            } else {
                for (uint k = 0u; k < 32u; k++) v[k] = 0.0;
            }
            for (uint k = 0u; k < 32u; k++) sa[k * 65u + tid] = v[k];
        }
        for (uint e = tid; e < 2048u; e += 256u) {
            uint n = e >> 5, k = e & 31u, tok = n0 + n;
            sb[k * 65u + n] = tok < p.ntok ? xs[p.x_off + tok * p.ncols + 32u * c + k] : 0.0;
        }
        barrier();
        for (uint k = 0u; k < 32u; k++) {
            float a[4], b[4];
            for (uint i = 0u; i < 4u; i++) a[i] = sa[k * 65u + tx + 16u * i];
            for (uint j = 0u; j < 4u; j++) b[j] = sb[k * 65u + ty + 16u * j];
            for (uint i = 0u; i < 4u; i++)
                for (uint j = 0u; j < 4u; j++) acc[i][j] += a[i] * b[j];
        }
        barrier();
    }
    for (uint j = 0u; j < 4u; j++) {
        uint tok = n0 + ty + 16u * j;
        if (tok >= p.ntok) continue;
        for (uint i = 0u; i < 4u; i++) {
            uint row = m0 + tx + 16u * i;
            if (row < p.nrows) ys[p.y_off + tok * p.y_stride + p.y_col + row] = acc[i][j];
        }
    }
}
