// Tensor-core tile product for sm_80+: c += A B for one m16n8k16 tile, f16 operands, float32
// accumulators (PTX ISA, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"). Fragments,
// with gid = lane / 4 and tig = lane % 4 (each u32 holds two f16, the lower column first):
//   A (16 x 16, row-major): a0 = A[gid][2tig..], a1 = A[gid + 8][2tig..],
//                           a2 = A[gid][2tig + 8..], a3 = A[gid + 8][2tig + 8..]
//   B (16 x 8, "col": stored as B^T rows): b0 = B[2tig..][gid], b1 = B[2tig + 8..][gid]
//   C (16 x 8): c[0], c[1] = C[gid][2tig, 2tig + 1]; c[2], c[3] = C[gid + 8][2tig, 2tig + 1]
#include "quants.cuh"

__device__ __forceinline__ void mma_m16n8k16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Integer tile products (PTX ISA "mma.sync.aligned.m16n8k32 .s32.u8.s8.s32", "m16n8k16
// .s32.s8.s8.s32"): A bytes (a quant's codes), B signed bytes (activation digits), exact int32
// accumulators. Fragments (gid = lane / 4, tig = lane % 4; each u32 holds 4 bytes, lowest k first):
//   k32: a0 = A[gid][4tig..], a1 = A[gid + 8][4tig..], a2 = A[gid][16 + 4tig..],
//        a3 = A[gid + 8][16 + 4tig..]; b0 = B[4tig..][gid], b1 = B[16 + 4tig..][gid]
//   k16: a0 = A[gid][4tig..], a1 = A[gid + 8][4tig..]; b0 = B[4tig..][gid]
//   C as above: c[0], c[1] = C[gid][2tig, 2tig + 1]; c[2], c[3] = C[gid + 8][2tig, 2tig + 1]
__device__ __forceinline__ void imma_k32(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void imma_k16s(int* c, u32 a0, u32 a1, u32 b0) {  // A signed bytes
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// Fragment moves (PTX ISA "ldmatrix", "movmatrix"; sm_75+) of 8 x 8 f16 matrices, held one row
// pair per thread as the MMA's fragments are: thread t holds row t / 4, columns 2 (t % 4) and + 1.
// ldsm4: four matrices from shared memory, lane l giving the address of row l % 8 of matrix l / 8
// (16-byte aligned), r[i] = matrix i; ldsm4t: the same, each matrix transposed.
__device__ __forceinline__ void ldsm4(const void* p, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((u32)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void ldsm4t(const void* p, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((u32)__cvta_generic_to_shared(p)));
}
// the transpose of the matrix whose row pairs the warp holds in x (a C fragment's f16 pairs ->
// the B fragment of the transposed tile)
__device__ __forceinline__ u32 movm_t(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}
