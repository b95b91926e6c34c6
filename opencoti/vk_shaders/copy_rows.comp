#version 450
// Row gather / scatter of 32-bit words: dst[dst_row(i), :row_words] = src[src_row(i), :row_words]
// for i < n rows; rows start every src_stride / dst_stride words. src_row(i) =
// idx[src_idx_off + i] when use_src != 0, else i; dst_row likewise. Used for get_rows
// on f32 activations, KV cell reads and writes (seq_cp across streams, K shift),
// padding rows to a multiple of 32 columns, and plain copies.
#include "common.glsl"

layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer SB { uint src[]; };
layout(binding = 1) writeonly buffer DB { uint dst[]; };
layout(binding = 2) readonly buffer IB { int idx[]; };
layout(push_constant) uniform PC {
    uint row_words, n, use_src, src_idx_off, use_dst, dst_idx_off, src_off, dst_off, src_stride, dst_stride;
} p;

void main() {
    uint g = wg_index() * 256u + gl_LocalInvocationID.x;
    uint total = p.n * p.row_words;
    if (g >= total) return;
    uint i = g / p.row_words, j = g % p.row_words;
    uint s = p.use_src != 0u ? uint(idx[p.src_idx_off + i]) : i;
    uint d = p.use_dst != 0u ? uint(idx[p.dst_idx_off + i]) : i;
    dst[p.dst_off + d * p.dst_stride + j] = src[p.src_off + s * p.src_stride + j];
}
