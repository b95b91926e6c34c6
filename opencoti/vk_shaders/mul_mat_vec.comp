#version 450
// y[t, row] = sum_k W[row, k] * x[t, k] (GEMV; ggml-vulkan mul_mat_vec), W in GGUF blocks.
//
// W: blocks of type QTYPE (the binding holds one weight part: tensor rows
// y_col .. y_col + nrows, see QTensor in vulkan.py); x: f32 [ntok, ncols];
// y: f32 [ntok, y_stride], this part at columns y_col ..
// Each workgroup takes up to NT tokens (gl_WorkGroupID.z = token block), so one
// dequantization of a chunk serves them all; rows fold into (x, y) workgroups.
// Specialization constants pick the layout:
// - GPUs: LPR = 32 lanes per row (RPI = 1): lanes stride over the row's 32-element
//   chunks dequantizing in registers, then a shared-memory tree sum per row.
// - CPU drivers (lavapipe): LPR = 1, RPI = 4 rows per invocation, no barrier; each
//   token's x chunk is loaded once for the 4 rows. Their SIMD code generation runs
//   this ~40x faster than the GPU layout (x loads become per-lane gathers there).
// Requires ncols % 32 == 0.
//
// MUL_MAT_ID (mixture of experts, ggml mul_mat_id): the binding holds experts e0 ..
// e0 + n_exp of a 3-D expert tensor (expert_bytes apart); "token" t is a (token, slot)
// pair whose expert is ids[id_off + t], its weight rows start w_off bytes into that
// expert (a row slice such as the gate half of gate_up), x row t / x_div (x_div = experts
// per token for the first projection, 1 for the second), y row t. NT must be 1; a pair
// whose expert lies in another binding (part) is skipped, uniformly per workgroup.
#include "common.glsl"

layout(local_size_x = 128) in;
layout(constant_id = 0) const uint LPR = 32;  // lanes per row
layout(constant_id = 1) const uint NT = 8;    // tokens per workgroup (1 or 8)
layout(constant_id = 2) const uint RPI = 1;   // rows per invocation (LPR == 1 only)
layout(binding = 0) readonly buffer WB { uint wq[]; };
layout(binding = 1) readonly buffer XB { float xs[]; };
layout(binding = 2) writeonly buffer YB { float ys[]; };
layout(push_constant) uniform PC {
    uint ncols, nrows, row_bytes, ntok, x_off, y_off, y_stride, y_col;
#ifdef MUL_MAT_ID
    uint expert_bytes, w_off, id_off, x_div, e0, n_exp;
#endif
} p;
#ifdef MUL_MAT_ID
layout(binding = 3) readonly buffer IB { int ids[]; };
#define XROW(t) ((t) / p.x_div)
#else
#define XROW(t) (t)
#endif

#include "quants.glsl"

shared float red[NT * 128u];

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint t0 = gl_WorkGroupID.z * NT;
    uint nt = min(NT, p.ntok - t0);
    uint nch = p.ncols >> 5;
    uint wb = 0u;  // byte of the weight's row 0 in the binding
#ifdef MUL_MAT_ID
    uint e = uint(ids[p.id_off + t0]);
    if (e < p.e0 || e >= p.e0 + p.n_exp) return;  // this pair's expert is in another part
    wb = (e - p.e0) * p.expert_bytes + p.w_off;
#endif
    if (LPR == 1u) {
        uint row0 = (wg_index() * 128u + tid) * RPI;
        if (row0 >= p.nrows) return;
        float acc[RPI][NT];
        [[unroll]] for (uint r = 0u; r < RPI; r++)
            [[unroll]] for (uint t = 0u; t < NT; t++) acc[r][t] = 0.0;
        for (uint c = 0u; c < nch; c++) {
            float v[RPI][32];
            [[unroll]] for (uint r = 0u; r < RPI; r++) dq_chunk(wb + min(row0 + r, p.nrows - 1u) * p.row_bytes, c, v[r]);
            [[unroll]] for (uint t = 0u; t < NT; t++) {
                if (t < nt) {
                    float xv[32];
                    uint xo = p.x_off + XROW(t0 + t) * p.ncols + 32u * c;
                    [[unroll]] for (uint i = 0u; i < 32u; i++) xv[i] = xs[xo + i];
                    [[unroll]] for (uint r = 0u; r < RPI; r++) {
                        float s = 0.0;
                        [[unroll]] for (uint i = 0u; i < 32u; i++) s += v[r][i] * xv[i];
                        acc[r][t] += s;
                    }
                }
            }
        }
        [[unroll]] for (uint r = 0u; r < RPI; r++) {
            if (row0 + r < p.nrows) {
                [[unroll]] for (uint t = 0u; t < NT; t++)
                    if (t < nt) ys[p.y_off + (t0 + t) * p.y_stride + p.y_col + row0 + r] = acc[r][t];
            }
        }
        return;
    }
    uint lane = tid % LPR;
    uint row = wg_index() * (128u / LPR) + tid / LPR;
    float acc[NT];
    [[unroll]] for (uint t = 0u; t < NT; t++) acc[t] = 0.0;
    if (row < p.nrows) {
        uint rb = wb + row * p.row_bytes;
        for (uint c = lane; c < nch; c += LPR) {
            float v[32];
            dq_chunk(rb, c, v);
            [[unroll]] for (uint t = 0u; t < NT; t++) {
                if (t < nt) {
                    uint xo = p.x_off + XROW(t0 + t) * p.ncols + 32u * c;
                    float s = 0.0;
                    [[unroll]] for (uint i = 0u; i < 32u; i++) s += v[i] * xs[xo + i];
                    acc[t] += s;
                }
            }
        }
    }
    [[unroll]] for (uint t = 0u; t < NT; t++) red[t * 128u + tid] = acc[t];
    barrier();
    for (uint st = LPR / 2u; st > 0u; st >>= 1) {
        if (lane < st) {
            for (uint t = 0u; t < nt; t++) red[t * 128u + tid] += red[t * 128u + tid + st];
        }
        barrier();
    }
    if (lane == 0u && row < p.nrows) {
        [[unroll]] for (uint t = 0u; t < NT; t++)
            if (t < nt) ys[p.y_off + (t0 + t) * p.y_stride + p.y_col + row] = red[t * 128u + tid];
    }
}
