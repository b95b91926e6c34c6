// Asynchronous global -> shared copies (sm_80+, PTX ISA "cp.async"): a thread's copies run in the
// background until it waits for their commit group, so a kernel keeps several tiles in flight
// while it computes on an older one (the multi-stage pipeline of CUTLASS's sm80 mainloops).
// cp_async16z / cp_async4z copy src_bytes (0 or the full size) and zero-fill the rest: a tile
// slot past the data holds zeros instead of what an earlier tile left there.

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async16z(void* smem, const void* gmem, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4z(void* smem, const void* gmem, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async8z(void* smem, const void* gmem, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
// N-byte copy (N = 16, 8 or 4; both addresses N-aligned), zero-filled when valid is false
template <int N>
__device__ __forceinline__ void cp_async_z(void* smem, const void* gmem, bool valid) {
    if constexpr (N == 16) cp_async16z(smem, gmem, valid ? 16 : 0);
    else if constexpr (N == 8) cp_async8z(smem, gmem, valid ? 8 : 0);
    else cp_async4z(smem, gmem, valid ? 4 : 0);
}
