// KV tier codes as tensor-core operands for the streaming decode kernel (attn_stream.cuh): a
// tier's stored codes become exact f16 MMA operands in a few instructions per pair, and the
// block scales are applied outside the products, instead of decoding every value to float32
// and splitting it (dec(), ~8 instructions a value).
//
//   S = Q K^T: the codes of a block are the B operand as they are (the integer tiers: q8_0's int8,
//     q4_0's nibble - 8, q4_1's nibble; exact in f16), or as their levels (iq4_nl: its integer
//     levels by byte permutes, lut16; turbo2/3/4: f16 numbers, one shared memory load of a pair
//     table gives two values' levels); each block's partial scores are
//     multiplied by that cell's block scale in float32 and summed.
//   O += P V: the integer tiers' B registers are their codes, each of a register's two cells
//     times its block scale d: hi = f16(code * d), lo = code * d - hi by an f16 fma (exact
//     where lo stays a normal f16: code * d has at most 19 significant bits; scale_pair), three
//     MMAs (P hi x hi, P lo x hi, P hi x lo). The turbo levels (PD) are the B registers as they
//     are and the block scales ride on P instead: per block, P' = p d in float32, split into
//     hi = f16(P') and lo = f16((P' - hi) 2^11) (attn_stream.cuh pt_frags<2048>), two MMAs: hi x
//     levels, lo x levels 2^-11 (an f16 mul; exact: every turbo2/3/4 level times 2^-11 is an f16
//     number, test_turbo_levels_scaled_are_f16). The scaled lo stays a normal f16 down to P' ~
//     2^-13, where an unscaled one would leave the normal range below 2^-3 and, with P' = p d,
//     lose accuracy as 1 / d for small block scales d.
//
// The MMA's k index (dims in S) and n index (dims in O) may run over a block's dims in any
// order: each tier picks the order in which a thread's codes sit together in its bytes. kdim(L)
// is the block dim of a block's k index L (the queries are staged in that order), vdim(c, k) the
// block dim of column c of the block's n8 tile k (the output is stored back in dim order).
//
// Members of KvCodes<T> (ON = false: the tier keeps dec()):
//   BS, BB: block values / bytes;
//   TBK, TBV: table bytes in shared memory (K pair table, V pair table), built by tab_k / tab_v;
//   kraw(blk, tig, a4, w) / kpair(w, s, r, tk): thread tig's code bytes of a block (blk: the
//     block's first byte in shared memory; or those bits laid out once for kpair), and its B
//     registers for k step s, register r;
//   vraw(blk, gid, a4) / vcodes(ra, rb, k, tv): column gid's codes of a cell's block (or laid out
//     once for vcodes), and the f16x2 codes (or levels) of n8 tile k for two cells (ra, rb),
//     unscaled;
//   PD: the block scales are folded into P (the turbo levels) instead of into the codes;
//   MIN: the blocks also store a minimum m (value d code + m: q4_1), mh(blk) its f16 bits: K adds
//     m times the head's sum of q over the block (the block sums staged in the K table's bytes,
//     TBK: HN x D / BS floats), V adds sum over cells of p m per block to the block's dims;
//   dh(blk): the block scale's f16 bits.
// a4: the reads of that block are 4-aligned (rows start 16-aligned in shared memory; a block at
// byte o of its row reads from o + 2: aligned when o % 4 == 2).
// Byte layouts: kv_tiers.cuh / the CPU tiers (scalar.py, turbo.py).
#include "quants.cuh"
#include "f16_split.cuh"

// 4 bytes at p (2-aligned; a4: 4-aligned, a constant where the caller's loop is unrolled)
__device__ __forceinline__ u32 ld4b(const u8* p, bool a4) {
    return a4 ? *(const u32*)p : (u32)*(const u16*)p | ((u32)*(const u16*)(p + 2) << 16);
}
// the 4-byte table entry at byte offset o of table t (shared memory)
__device__ __forceinline__ u32 tab_at(const u8* t, u32 o) { return *(const u32*)(t + o); }
// the nibbles at bits sh and 16 + sh of x as an f16 pair 1024 + nibble - bias (q4_0 / q4_1:
// bias 0x64086408, nibble - 8; 0x64006400, the nibble itself)
__device__ __forceinline__ u32 nib_pair(u32 x, int sh, u32 bias) {
    return hsub2(((x >> sh) & 0x000F000Fu) | 0x64006400u, bias);
}
template <class T>
struct KvCodes {
    static constexpr bool ON = false, PD = false, MIN = false;
    static constexpr int BS = 32, BB = 0, TBK = 0, TBV = 0, NW = 1;
    static __host__ __device__ constexpr int kdim(int L) { return L; }
    static __host__ __device__ constexpr int vdim(int c, int k) { return 8 * k + c; }
};

// q8_0: d (f16) + 32 int8. K: thread tig's bytes 8 tig .. 8 tig + 7, as f16 pairs 1024 + (b ^ 0x80)
// - 1152; V: column c's bytes 4c .. 4c + 3 (n8 tile k: byte k)
template <>
struct KvCodes<KQ8_0> {
    static constexpr bool ON = true, PD = false, MIN = false;
    static constexpr int BS = 32, BB = 34, TBK = 0, TBV = 0, NW = 2;
    static __host__ __device__ constexpr int kdim(int L) { return 8 * ((L & 7) >> 1) + 4 * (L >> 4) + 2 * ((L >> 3) & 1) + (L & 1); }
    static __host__ __device__ constexpr int vdim(int c, int k) { return 4 * c + k; }
    static __device__ __forceinline__ u16 dh(const u8* blk) { return *(const u16*)blk; }
    static __device__ __forceinline__ void kraw(const u8* blk, int tig, bool a4, u32 (&w)[NW]) {
        w[0] = ld4b(blk + 2 + 8 * tig, a4) ^ 0x80808080u;
        w[1] = ld4b(blk + 6 + 8 * tig, a4) ^ 0x80808080u;
    }
    static __device__ __forceinline__ u32 kpair(const u32 (&w)[NW], int s, int r, const u8*) {
        return hsub2(__byte_perm(w[s], 0x64646464u, r ? 0x4342 : 0x4140), 0x64806480u);
    }
    static __device__ __forceinline__ u32 vraw(const u8* blk, int gid, bool a4) { return ld4b(blk + 2 + 4 * gid, a4) ^ 0x80808080u; }
    static __device__ __forceinline__ u32 vcodes(u32 ra, u32 rb, int k, const u8*) {
        return hsub2((__byte_perm(ra, rb, k | ((4 + k) << 8)) & 0x00FF00FFu) | 0x64006400u, 0x64806480u);
    }
};

// q4_0: d (f16) + 16 bytes, code j in the low nibble of byte j (j < 16) or the high nibble of byte
// j - 16, value (code - 8) d; f16 pairs 1024 + nibble - 1032. K: thread tig's bytes 4 tig .. 4 tig
// + 3 (dims 4 tig .. + 3 and 16 + those); V: column c's bytes 2c, 2c + 1 (dims 2c, 2c + 1, 16 + 2c,
// 17 + 2c)
template <>
struct KvCodes<KQ4_0> {
    static constexpr bool ON = true, PD = false, MIN = false;
    static constexpr int BS = 32, BB = 18, TBK = 0, TBV = 0, NW = 1;
    static __host__ __device__ constexpr int kdim(int L) { return 16 * (L >> 4) + 4 * ((L & 7) >> 1) + ((L >> 3) & 1) + 2 * (L & 1); }
    static __host__ __device__ constexpr int vdim(int c, int k) { return 16 * (k >> 1) + 2 * c + (k & 1); }
    static __device__ __forceinline__ u16 dh(const u8* blk) { return *(const u16*)blk; }
    static __device__ __forceinline__ void kraw(const u8* blk, int tig, bool a4, u32 (&w)[NW]) { w[0] = ld4b(blk + 2 + 4 * tig, a4); }
    static __device__ __forceinline__ u32 kpair(const u32 (&w)[NW], int s, int r, const u8*) {
        return nib_pair(w[0], 4 * s + 8 * r, 0x64086408u);
    }
    static __device__ __forceinline__ u32 vraw(const u8* blk, int gid, bool a4) { return *(const u16*)(blk + 2 + 2 * gid); }
    static __device__ __forceinline__ u32 vcodes(u32 ra, u32 rb, int k, const u8*) {
        return nib_pair(__byte_perm(ra, rb, 0x5410), 8 * (k & 1) + 4 * (k >> 1), 0x64086408u);
    }
};

// iq4_nl: q4_0's bytes, value kvalues_iq4nl[code] d (ggml-common.h; the 16 levels are the
// integers -127 .. 113, exact f16 operands). A code's level + 128 comes from byte permutes of the
// 16-byte table in four immediates (lut16), then q8_0's f16 pairs 1024 + (level + 128) - 1152.
// K: thread tig's bytes 4 tig .. 4 tig + 3 as q4_0's (the same kdim), their eight levels laid out
// once per block so that each B register is one permute; V: column c's bytes 2c, 2c + 1 as
// q4_0's (the same vdim), their four levels once per cell and block.
template <>
struct KvCodes<KIQ4_NL> {
    static constexpr bool ON = true, PD = false, MIN = false;
    static constexpr int BS = 32, BB = 18, TBK = 0, TBV = 0, NW = 2;
    static __host__ __device__ constexpr int kdim(int L) { return KvCodes<KQ4_0>::kdim(L); }
    static __host__ __device__ constexpr int vdim(int c, int k) { return KvCodes<KQ4_0>::vdim(c, k); }
    static __device__ __forceinline__ u16 dh(const u8* blk) { return *(const u16*)blk; }
    // byte k of the result: level + 128 of code (x >> 4k) & 15, k = 0 .. 3 (the low 16 bits of x;
    // sel: that code's bit 3 picks the upper table half)
    static __device__ __forceinline__ u32 lut16(u32 x, u32 sel) {
        const u32 lo = __byte_perm(0x3F2D1801u, 0x766A5D4Fu, x & 0x7777u);
        const u32 hi = __byte_perm(0xA6998D81u, 0xF1D9C5B5u, x & 0x7777u);
        return __byte_perm(lo, hi, sel);
    }
    static __device__ __forceinline__ u32 lut_sel(u32 x) { return 0x32103210u | ((x >> 1) & 0x44444444u); }
    // w[s]: levels of nibble s of bytes 0, 1, 2, 3 (bytes 0 .. 3 of the word)
    static __device__ __forceinline__ void kraw(const u8* blk, int tig, bool a4, u32 (&w)[NW]) {
        const u32 x = ld4b(blk + 2 + 4 * tig, a4), sel = lut_sel(x);
        const u32 a = lut16(x, sel), b = lut16(x >> 16, sel >> 16);  // nibbles lo, hi of bytes 0, 1 | 2, 3
        w[0] = __byte_perm(a, b, 0x6420);
        w[1] = __byte_perm(a, b, 0x7531);
    }
    static __device__ __forceinline__ u32 kpair(const u32 (&w)[NW], int s, int r, const u8*) {
        return hsub2(__byte_perm(w[s], 0x64646464u, r ? 0x4341 : 0x4240), 0x64806480u);
    }
    // levels of nibbles lo, hi of byte 2 gid, then lo, hi of byte 2 gid + 1
    static __device__ __forceinline__ u32 vraw(const u8* blk, int gid, bool) {
        const u32 x = *(const u16*)(blk + 2 + 2 * gid);
        return lut16(x, lut_sel(x));
    }
    // q8_0's pairs of levels + 128 bytes, byte 2 (k & 1) + (k >> 1) of each cell's word (q4_0's order)
    static __device__ __forceinline__ u32 vcodes(u32 ra, u32 rb, int k, const u8* tv) {
        return KvCodes<KQ8_0>::vcodes(ra, rb, 2 * (k & 1) + (k >> 1), tv);
    }
};

// q4_1: d (f16), m (f16) + 16 bytes as q4_0's, value code d + m (code 0 .. 15: f16 pairs 1024 +
// nibble - 1024). q4_0's dim orders; the minimum term outside the products (MIN). K reads its
// words 4-aligned (rows start 16-aligned, blocks 20 bytes apart, codes at + 4).
template <>
struct KvCodes<KQ4_1> {
    static constexpr bool ON = true, PD = false, MIN = true;
    static constexpr int BS = 32, BB = 20, TBK = 512, TBV = 0, NW = 1;  // TBK: HN x D / 32 floats at most
    static __host__ __device__ constexpr int kdim(int L) { return KvCodes<KQ4_0>::kdim(L); }
    static __host__ __device__ constexpr int vdim(int c, int k) { return KvCodes<KQ4_0>::vdim(c, k); }
    static __device__ __forceinline__ u16 dh(const u8* blk) { return *(const u16*)blk; }
    static __device__ __forceinline__ u16 mh(const u8* blk) { return *(const u16*)(blk + 2); }
    static __device__ __forceinline__ void tab_k(u8*) {}  // (the block sums are staged with q)
    static __device__ __forceinline__ void tab_v(u8*) {}
    static __device__ __forceinline__ void kraw(const u8* blk, int tig, bool, u32 (&w)[NW]) { w[0] = *(const u32*)(blk + 4 + 4 * tig); }
    static __device__ __forceinline__ u32 kpair(const u32 (&w)[NW], int s, int r, const u8*) {
        return nib_pair(w[0], 4 * s + 8 * r, 0x64006400u);
    }
    static __device__ __forceinline__ u32 vraw(const u8* blk, int gid, bool) { return *(const u16*)(blk + 4 + 2 * gid); }
    static __device__ __forceinline__ u32 vcodes(u32 ra, u32 rb, int k, const u8*) {
        return nib_pair(__byte_perm(ra, rb, 0x5410), 8 * (k & 1) + 4 * (k >> 1), 0x64006400u);
    }
};

// turbo2/3/4 (turbo.py): d (f16) + 64 Lloyd-Max indices of BITS bits (turbo3: the low 2 bits four
// to a byte, then the high bits eight to a byte), value d * level. The levels are f16 numbers
// (codebooks.lloyd_max), so a level is an exact f16 operand and the K operand has no lo term.
// K: thread tig's indices 16 tig .. 16 tig + 15, as 8 pairs of adjacent indices; the pair table
// (TBK bytes) maps a pair's bits to its f16x2 register. V: column c's indices 8c .. 8c + 7 (n8
// tile k: index 8c + k); two cells' indices k make one entry of the V pair table (TBV bytes: the
// two levels as f16x2); their block scales ride on P (PD).
template <int BITS>
struct KvCodes<KTurbo<BITS>> {
    static constexpr bool ON = BITS <= 4, PD = true, MIN = false;
    static constexpr int BS = 64, BB = 2 + 8 * BITS, TBK = 4 << (2 * BITS), TBV = 4 << (2 * BITS);
    static constexpr int NW = BITS == 2 ? 1 : 2;
    static __host__ __device__ constexpr int kdim(int L) { return 16 * ((L & 7) >> 1) + 2 * (2 * (L >> 4) + ((L >> 3) & 1)) + (L & 1); }
    static __host__ __device__ constexpr int vdim(int c, int k) { return 8 * c + k; }
    static __device__ __forceinline__ u16 dh(const u8* blk) { return *(const u16*)blk; }
    // the two indices of pair table entry e
    static __device__ __forceinline__ void pair_of(int e, int& a, int& b) {
        if constexpr (BITS == 3) {
            a = (e & 3) | ((e >> 4) & 1) << 2;
            b = ((e >> 2) & 3) | ((e >> 5) & 1) << 2;
        } else {
            a = e & ((1 << BITS) - 1);
            b = e >> BITS;
        }
    }
    // a level's f16 bits (exact: the levels are f16 numbers)
    static __device__ __forceinline__ u32 lev(int i) { return sp_f2h(KTurbo<BITS>::tab()[i]); }
    // the tables from the float32 levels (every thread of the block; the caller syncs)
    static __device__ __forceinline__ void tab_k(u8* tk) {
        for (int e = threadIdx.x; e < (1 << (2 * BITS)); e += blockDim.x) {
            int a, b;
            pair_of(e, a, b);
            ((u32*)tk)[e] = lev(a) | lev(b) << 16;
        }
    }
    static __device__ __forceinline__ void tab_v(u8* tv) {  // entry a | b << BITS: levels a, b
        for (int e = threadIdx.x; e < (1 << (2 * BITS)); e += blockDim.x)
            ((u32*)tv)[e] = lev(e & ((1 << BITS) - 1)) | lev(e >> BITS) << 16;
    }
    // turbo3: the pair table entries of pairs p = 2j (w[0]) and 2j + 1 (w[1]) as byte j, laid out
    // once per block from the low bits (pair p: bits 4p .. 4p + 3) and the high bits (bits 2p, 2p
    // + 1), times 4 (their byte offsets in the table): kpair then takes a byte (one PRMT), not two
    // fields, and the load adds it to the table's address as it is
    static __device__ __forceinline__ void kraw(const u8* blk, int tig, bool a4, u32 (&w)[NW]) {
        if constexpr (BITS == 4) {
            w[0] = ld4b(blk + 2 + 8 * tig, a4);
            w[1] = ld4b(blk + 6 + 8 * tig, a4);
        } else if constexpr (BITS == 3) {
            const u32 lo = ld4b(blk + 2 + 4 * tig, a4), hi = *(const u16*)(blk + 18 + 2 * tig);
            u32 hn = __byte_perm(hi, 0, 0x4140);   // high bits' bytes 0, 1 -> bytes 0, 2
            hn = (hn | (hn << 4)) & 0x0F0F0F0Fu;  // their nibble j (pairs 2j, 2j + 1) -> byte j
            w[0] = ((lo << 2) & 0x3C3C3C3Cu) | ((hn << 6) & 0xC0C0C0C0u);
            w[1] = ((lo >> 2) & 0x3C3C3C3Cu) | ((hn << 4) & 0xC0C0C0C0u);
        } else {
            w[0] = ld4b(blk + 2 + 4 * tig, a4);
        }
    }
    static __device__ __forceinline__ u32 kpair(const u32 (&w)[NW], int s, int r, const u8* tk) {
        const int p = 2 * s + r;  // indices 16 tig + 2p, + 1
        if constexpr (BITS == 3) return tab_at(tk, __byte_perm(w[r], 0, 0x4440 | s));  // byte s of w[r]: pair 2s + r
        u32 e;
        if constexpr (BITS == 4) e = (w[p >> 2] >> (8 * (p & 3))) & 0xFFu;
        else e = (w[0] >> (4 * p)) & 15u;
        return ((const u32*)tk)[e];
    }
    // column c's indices 8c .. 8c + 7 (turbo3: index k whole in nibble k, from its low bits (bits
    // 2k, 2k + 1 of the 16) and its high bit (bit k of the byte after them), laid out once per cell
    // and block)
    static __device__ __forceinline__ u32 vraw(const u8* blk, int gid, bool a4) {
        if constexpr (BITS == 4) {
            return ld4b(blk + 2 + 4 * gid, a4);
        } else if constexpr (BITS == 3) {
            const u32 lo = *(const u16*)(blk + 2 + 2 * gid), hi = blk[18 + gid];
            u32 t = __byte_perm(lo, 0, 0x4140);  // bytes 0, 1 -> bytes 0, 2
            t = (t | (t << 4)) & 0x0F0F0F0Fu;    // indices 2j, 2j + 1's low bits -> byte j
            t = (t | (t << 2)) & 0x33333333u;    // index k's -> nibble k
            u32 h = (hi | (hi << 12)) & 0x000F000Fu;  // high bits 0-3 -> bits 0-3, 4-7 -> 16-19
            h = (h | (h << 6)) & 0x03030303u;         // bits 2j, 2j + 1 -> byte j
            h = (h | (h << 3)) & 0x11111111u;         // bit k -> nibble k
            return t | (h << 2);
        } else {
            return *(const u16*)(blk + 2 + 2 * gid);
        }
    }
    // index k of a turbo2 / turbo4 column (turbo3's vcodes reads its laid-out nibbles itself)
    static __device__ __forceinline__ u32 vidx(u32 x, int k) { return (x >> (BITS * k)) & ((1u << BITS) - 1u); }
    static __device__ __forceinline__ u32 vcodes(u32 ra, u32 rb, int k, const u8* tv) {
        if constexpr (BITS == 3) {  // byte k / 2 of the two cells' even or odd indices, (a | b << 3) 4: the
                                    // entry's byte offset (the same words for every k of the pair:
                                    // computed once)
            const u32 a = (k & 1) ? ra >> 4 : ra, b = (k & 1) ? rb >> 4 : rb;
            const u32 w = ((a << 2) & 0x1C1C1C1Cu) | ((b << 5) & 0xE0E0E0E0u);
            return tab_at(tv, __byte_perm(w, 0, 0x4440 | (k >> 1)));
        } else {
            return ((const u32*)tv)[vidx(ra, k) | vidx(rb, k) << BITS];
        }
    }
};
