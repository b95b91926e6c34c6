#version 450
// Embedding lookup from GGUF blocks: y[i, :] = W[ids[i], :] (ggml get_rows).
//
// The binding holds one weight part (tensor rows row0 .. row0 + nrows); ids
// outside it are left to the dispatch of the part that holds them. ids: int32;
// y: f32 [n, ncols]. One workgroup per id; 64 threads over 32-element chunks.
#include "common.glsl"

layout(local_size_x = 64) in;
layout(binding = 0) readonly buffer WB { uint wq[]; };
layout(binding = 1) readonly buffer IB { int ids[]; };
layout(binding = 2) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC {
    uint ncols, row_bytes, n, row0, nrows, ids_off, y_off;
} p;

#include "quants.glsl"

void main() {
    uint i = wg_index();
    if (i >= p.n) return;
    int r = ids[p.ids_off + i] - int(p.row0);
    if (r < 0 || uint(r) >= p.nrows) return;
    uint rb = uint(r) * p.row_bytes, nch = p.ncols >> 5;
    for (uint c = gl_LocalInvocationID.x; c < nch; c += 64u) {
        float v[32];
        dq_chunk(rb, c, v);
        uint o = p.y_off + i * p.ncols + 32u * c;
        for (uint k = 0u; k < 32u; k++) ys[o + k] = v[k];
    }
}
