// Merging attention partials by log-sum-exp (flash-decoding, Dao et al.): partial s of a
// (row, head) holds acc_s[D] (unnormalised sum of p * v), m_s (its running max score) and
// l_s (its sum of e^{score - m_s}); the merged row is sum_s acc_s e^{m_s - M} / sum_s l_s
// e^{m_s - M} with M the largest m_s. Partials with m_s = -inf (no visible cell) drop out.
// Partial i of a run of n starting at `first`: acc at acc[(first + i) * D], (m, l) at
// ml[2 * (first + i)]. (Included once per source by cuda_kernels.read_source.)

#define LSE_NEG_INF (-__int_as_float(0x7f800000))

// (The loops load before they test, unrolled, so a long run of partials keeps several loads in
// flight instead of one round trip per partial.)
__device__ __forceinline__ float lse_max(const float* __restrict__ ml, long long first, int n, float M) {
#pragma unroll 8
    for (int s = 0; s < n; s++) M = fmaxf(M, ml[2 * (first + s)]);
    return M;
}

// adds the n partials' dim d, rescaled to the common max M, into L (weights) and A (values)
__device__ __forceinline__ void lse_add(const float* __restrict__ acc, const float* __restrict__ ml, long long first,
                                        int n, int D, int d, float M, float& L, float& A) {
#pragma unroll 8
    for (int s = 0; s < n; s++) {
        const long long pi = first + s;
        const float ms = ml[2 * pi], ls = ml[2 * pi + 1], as = acc[pi * D + d];
        if (ms != LSE_NEG_INF) {
            const float f = __expf(ms - M);
            L += ls * f;
            A += as * f;
        }
    }
}
