"""The CUDA KV-tier kernels' math, proven on the CPU (no GPU needed; the GPU tests are in
test_cuda.py, ``-k kv_tier``).

- ``tables_prefix`` carries the rotated tiers' tables into the CUDA source exactly.
- A NumPy port of each tier's single-value decoder ``val(row, i)`` in ``kv_tiers.cuh`` (the
  byte offsets, nibble/bit placement and the trellis window) equals the tier's own
  ``dequantize`` (``dequantize_rotated`` for the rotated tiers).
- The rotation trick of the attention kernel: rotate q by the butterfly WHT, score against
  the stored rotated rows, accumulate P.V rotated and un-rotate the output once; this equals
  ``CPUBackend.attention`` over the dequantized cells (float32 rounding apart); the kernel's
  register-held rotation (``fwht_regs``, every head group and head size) is ``fwht_shared``'s
  transform bit for bit.
- The streaming kernel's turbo3 table offsets (kv_codes.cuh: the code bits laid out once per
  block, then a byte per lookup) name the indices the tier packed.
- An op-by-op port of the rotated tiers' write kernels (warp-shuffle rotation and 64-value sums,
  equal in every rounding to the shared-memory versions) gives the CPU tier's bytes.
The compile / PTX / SASS checks of the same modules need the CUDA toolkit and live in
test_cuda.py (``-k kv_module or kv_write_ or kv_sass``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from opencoti.engine.backend import cuda_kv
from opencoti.engine.backend.cuda_kernels import read_source
from opencoti.engine.backend.cpu import CPUBackend
from opencoti.engine.kv_tiers import TIER_NAMES, get_tier, turbo
from opencoti.engine.kv_tiers.scalar import IQ4_NL_LEVELS


def _consts(src: str) -> dict:
    """The __constant__ float arrays of a CUDA text by name, and its immediate tables (cuda_kv._imm:
    ``name(i)`` as ``i == 0 ? v0 : i == 1 ? v1 : ... : 0.0f``) as arrays by function name."""
    out = {}
    for name, body in re.findall(r"__constant__ float (\w+)\[\d+\] = \{([^}]*)\}", src):
        out[name] = np.array([float.fromhex(v.strip()[:-1]) for v in body.split(",")], dtype=np.float32)
    for name, body in re.findall(r"constexpr float (\w+)\(int i\) \{ return (.*) : 0\.0f; \}", src):
        terms = re.findall(r"i == (\d+) \? (\S+)f", body)
        assert [int(i) for i, _ in terms] == list(range(len(terms))), name
        out[name] = np.array([float.fromhex(v) for _, v in terms], dtype=np.float32)
    return out


def test_tables_prefix_is_exact():
    src = cuda_kv.tables_prefix()
    c = _consts(src)
    for bits in (2, 3, 4, 8):
        t = get_tier(f"turbo{bits}")
        np.testing.assert_array_equal(c[f"KV_LM{bits}"], t.levels)
        np.testing.assert_array_equal(c[f"KV_TH{bits}"], t.thresholds)
        if bits <= 4:  # the immediates turbo_row's code search takes (kv_store.cuh)
            for a, want in ((c[f"kv_lm{bits}"], t.levels), (c[f"kv_th{bits}"], t.thresholds)):
                assert a.view(np.uint32).tolist() == np.asarray(want, np.float32).view(np.uint32).tolist()
    for k in (2, 3):
        np.testing.assert_array_equal(c[f"KV_TCQ{k}"], get_tier(f"turbo{k}_tcq").levels)
    words = re.search(r"KV_SIGNS\[16\] = \{([^}]*)\}", src).group(1)
    w = np.array([int(x.strip().rstrip("u"), 16) for x in words.split(",")], dtype=np.uint32)
    bits = (w[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_array_equal(np.where(bits.reshape(-1), -1.0, 1.0).astype(np.float32), turbo.SIGNS)
    for d in cuda_kv.KV_HEAD_DIMS:
        lit = re.search(rf"d == {d} \? (\S+)f", src).group(1)
        assert np.float32(float.fromhex(lit)) == np.float32(1.0 / np.sqrt(d))
    assert set(cuda_kv.TIER_STRUCTS) == set(TIER_NAMES)


def _h2f(b, o):
    return np.ascontiguousarray(b[:, o:o + 2]).view(np.float16)[:, 0].astype(np.float32)


def _code_f(c: np.ndarray, off: int) -> np.ndarray:
    """NumPy port of ``code_f(c, off)`` (kv_tiers.cuh): ``c`` (uint32, < 2^23) in the mantissa of
    2^23, minus 2^23 + off, in float32."""
    return (np.uint32(0x4B000000) | np.asarray(c, dtype=np.uint32)).view(np.float32) - np.float32(2 ** 23 + off)


def test_code_f_is_the_integer_value():
    """The decoders' integer-to-float trick is exact for every code a scalar tier stores (and far
    past: all of [0, 2^16)) at every offset they use."""
    c = np.arange(1 << 16, dtype=np.uint32)
    for off in (0, 8, 16, 32, 128):
        np.testing.assert_array_equal(_code_f(c, off), c.astype(np.int64).astype(np.float32) - np.float32(off))
    b = np.arange(256, dtype=np.uint32)  # q8_0: the byte ^ 0x80 at offset 128 is the int8 value
    np.testing.assert_array_equal(_code_f(b ^ 0x80, 128), b.astype(np.uint8).view(np.int8).astype(np.float32))


def _byte_perm(x, y, s):
    """CUDA ``__byte_perm(x, y, s)``, result byte 0 only: byte ``s & 7`` of the 8-byte value y:x
    (uint32 arrays in, uint32 out)."""
    xy = (np.asarray(y, np.uint64) << np.uint64(32)) | np.asarray(x, np.uint64)
    return ((xy >> ((np.asarray(s, np.uint64) & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint32)


def _iq4nl_level(i) -> np.ndarray:
    """NumPy port of ``iq4nl_level(i)`` (kv_tiers.cuh): one PRMT over four words of int8 levels."""
    i = np.asarray(i, dtype=np.uint32)
    lo = np.where(i < 8, np.uint32(0xBFAD9881), np.uint32(0x26190D01))
    hi = np.where(i < 8, np.uint32(0xF6EADDCF), np.uint32(0x71594535))
    return _code_f(_byte_perm(lo, hi, i) ^ 0x80, 128)


def _iq4nl_index(x) -> np.ndarray:
    """NumPy port of ``iq4nl_index(x)`` (kv_tiers.cuh): the levels <= x counted, then the nearer
    neighbour by float32 differences."""
    x = np.asarray(x, dtype=np.float32)
    lev = _iq4nl_level(np.arange(16))
    mu = 1 + sum((lev[k] <= x).astype(np.int32) for k in range(1, 15))
    lower = (x - lev[np.clip(mu - 1, 0, 15)]) < (lev[np.clip(mu, 0, 15)] - x)
    i = np.where(lower, mu - 1, mu)
    return np.where(x <= np.float32(-127), 0, np.where(~(x < np.float32(113)), 15, i))


def test_iq4nl_level_and_search_ports():
    """The kernels' register-only iq4_nl level table and level search (kv_tiers.cuh iq4nl_level,
    iq4nl_index) equal scalar.py's levels and best_index_iq4nl: at every level, every midpoint
    and its float32 neighbours, the range ends, NaN and 20,000 random values."""
    from opencoti.engine.kv_tiers.scalar import IQ4_NL_LEVELS, best_index_iq4nl

    src = read_source("kv_tiers.cuh")
    for word in ("0xBFAD9881u", "0xF6EADDCFu", "0x26190D01u", "0x71594535u"):
        assert word in src
    np.testing.assert_array_equal(_iq4nl_level(np.arange(16)), IQ4_NL_LEVELS)
    mids = (IQ4_NL_LEVELS[:-1] + IQ4_NL_LEVELS[1:]) / np.float32(2)
    pts = np.concatenate([IQ4_NL_LEVELS, mids,
                          np.nextafter(mids, np.float32(-1e9)), np.nextafter(mids, np.float32(1e9)),
                          np.array([-1e30, -127.5, 113.5, 1e30, np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32),
                          np.random.default_rng(1).uniform(-140, 130, 20000).astype(np.float32)]).astype(np.float32)
    np.testing.assert_array_equal(_iq4nl_index(pts), best_index_iq4nl(pts))


def _val(t, b: np.ndarray, i: int) -> np.ndarray:
    """NumPy port of ``T::val(row, i, tab)`` (kv_tiers.cuh) over rows ``b`` uint8 ``[N, row]``."""
    n, j = t.name, i & 31
    b32 = b.astype(np.uint32)
    if n == "f32":
        return np.ascontiguousarray(b).view(np.float32)[:, i]
    if n == "f16":
        return np.ascontiguousarray(b).view(np.float16)[:, i].astype(np.float32)
    if n == "bf16":
        return (np.ascontiguousarray(b).view(np.uint16)[:, i].astype(np.uint32) << 16).view(np.float32)
    if n == "q8_0":
        o = 34 * (i >> 5)
        return _h2f(b, o) * _code_f(b32[:, o + 2 + j] ^ 0x80, 128)
    if n == "q6_0":
        o, jj = 26 * (i >> 5), j & 15
        qs, qhb = b32[:, o + 10 + jj], b32[:, o + 2 + (j & 7)]
        h = (qhb >> (4 * (jj >> 3))) & 15
        q = ((qs & 15) | ((h & 3) << 4)) if j < 16 else ((qs >> 4) | (((h >> 2) & 3) << 4))
        return _h2f(b, o) * _code_f(q, 32)
    if n in ("q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"):
        o = {"q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18, "iq4_nl": 18}[n] * (i >> 5)
        qs_at = {"q5_1": 8, "q5_0": 6, "q4_1": 4, "q4_0": 2, "iq4_nl": 2}[n]
        qs = b32[:, o + qs_at + (j & 15)]
        q = (qs & 15) if j < 16 else (qs >> 4)
        if n == "iq4_nl":
            return _h2f(b, o) * _iq4nl_level(q)
        if n == "q4_1":
            return _h2f(b, o) * _code_f(q, 0) + _h2f(b, o + 2)
        if n != "q4_0":
            qh_at = 4 if n == "q5_1" else 2
            q = q | (((b32[:, o + qh_at + (j >> 3)] >> (j & 7)) & 1) << 4)
        if n == "q5_1":
            return _h2f(b, o) * _code_f(q, 0) + _h2f(b, o + 2)
        return _h2f(b, o) * _code_f(q, 16 if n == "q5_0" else 8)
    o, j = t.block_bytes * (i >> 6), i & 63
    if t.family == "turbo":
        bits = t.bits
        if bits == 8:
            idx = b32[:, o + 2 + j]
        elif bits == 4:
            idx = (b32[:, o + 2 + (j >> 1)] >> (4 * (j & 1))) & 15
        else:
            idx = (b32[:, o + 2 + (j >> 2)] >> (2 * (j & 3))) & 3
            if bits == 3:
                idx = idx | (((b32[:, o + 18 + (j >> 3)] >> (j & 7)) & 1) << 2)
        return _h2f(b, o) * t.levels[idx]
    k, nsb = t.k, 8 * t.k
    p = j * k
    s = (b32[:, o + 2 + (p >> 3)] | (b32[:, o + 2 + ((p >> 3) + 1) % nsb] << 8)) >> (p & 7)
    return _h2f(b, o) * t.levels[s & 255]


@pytest.mark.parametrize("name", TIER_NAMES)
def test_kernel_value_decoder_matches_tier(name):
    t = get_tier(name)
    rng = np.random.default_rng(3)
    d = 128
    x = rng.standard_normal((20, d)).astype(np.float32)
    x[3, 5] = 30.0
    q = t.quantize(x)
    b = np.ascontiguousarray(q).view(np.uint8).reshape(len(x), -1)
    got = np.stack([_val(t, b, i) for i in range(d)], axis=1)
    want = t.dequantize_rotated(q) if t.family in ("turbo", "tcq") else t.dequantize(q)
    np.testing.assert_array_equal(got, want)


def _pair_level(bits, levels, e):
    """KTurbo::pair_level: entry e of the level-pair table -> (level of value j, of value j + 1)."""
    lb = 2 if bits == 3 else bits
    m = (1 << lb) - 1
    i0, i1 = e & m, (e >> lb) & m
    if bits == 3:
        i0, i1 = i0 | (((e >> 4) & 1) << 2), i1 | (((e >> 5) & 1) << 2)
    return levels[i0], levels[i1]


def _pair_block(bits, b32, o, j):
    """KTurbo::pair(w, b, j): the pair index of values j, j + 1 of the block at byte o."""
    if bits == 4:
        return b32[:, o + 2 + (j >> 1)]
    e = (b32[:, o + 2 + (j >> 2)] >> (2 * (j & 3))) & 15
    if bits == 3:
        e = e | (((b32[:, o + 18 + (j >> 3)] >> (j & 7)) & 3) << 4)
    return e


def _words(byts):
    """ldw's little-endian u32 words of a byte run [R, n] (n a multiple of 2; zero padded)."""
    pad = (-byts.shape[1]) % 4
    byts = np.concatenate([byts, np.zeros((len(byts), pad), np.uint8)], axis=1)
    return np.ascontiguousarray(byts).view("<u4").astype(np.int64)


def _sub_pair(bits, b, o, nv, sub, j):
    """KTurbo::sub_words<nv>(block, sub) then sub_pair<nv>(w, j): part `sub` of nv values."""
    lb = 2 if bits == 3 else bits
    lo_n, hi_n = nv * lb // 8, (nv // 8 if bits == 3 else 0)
    w = _words(b[:, o + 2 + sub * lo_n: o + 2 + (sub + 1) * lo_n])
    pw = 32 // lb
    e = (w[:, j // pw] >> (lb * (j % pw))) & ((1 << (2 * lb)) - 1)
    if bits == 3:
        wh = _words(b[:, o + 18 + sub * hi_n: o + 18 + (sub + 1) * hi_n])
        e = e | (((wh[:, j // 32] >> (j % 32)) & 3) << 4)
    return e


def _vals2(bits, levels, b, i0, n_e):
    """KTurbo::vals2<E>(row, i0, tp): values [i0, i0 + E) through the pair table, without the
    block's scale, and that scale: ``(d [rows], levels [rows, E])``."""
    lb = 2 if bits == 3 else bits
    o, j0 = (2 + 64 * bits // 8) * (i0 >> 6), i0 & 63
    nlb = n_e * lb // 8 if n_e * lb >= 16 else 1
    if nlb == 1:
        lo = [b[:, o + 2 + j0 * lb // 8].astype(np.int64) >> (lb * (j0 % (8 // lb)))]
    else:
        lo = list(_words(b[:, o + 2 + j0 * lb // 8: o + 2 + j0 * lb // 8 + nlb]).T)
    hi = 0
    if bits == 3:
        hi = (b[:, o + 18 + (j0 >> 3)].astype(np.int64) | (b[:, o + 19 + (j0 >> 3)].astype(np.int64) << 8)
              if n_e == 16 else b[:, o + 18 + (j0 >> 3)].astype(np.int64) >> (j0 & 7))
    d = _h2f(b, o)
    out = []
    for e in range(0, n_e, 2):
        ix = (lo[lb * e // 32] >> (lb * e % 32)) & ((1 << (2 * lb)) - 1)
        if bits == 3:
            ix = ix | (((hi >> e) & 3) << 4)
        v0, v1 = _pair_level(bits, levels, ix)
        out += [v0, v1]
    return d, np.stack(out, axis=1)


@pytest.mark.parametrize("name", ["turbo4", "turbo3", "turbo2"])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_kernel_pair_decoder_matches_tier(name, d):
    """The short-row attention kernels' level-pair decode (kv_tiers.cuh KTurbo: pair_level's
    table, the whole-block pair(), the _l8 parts' sub_pair<NV> and PV's vals2<E>, E = d / 32 per
    lane) gives the tier's own levels and values, for every pair of every block."""
    t = get_tier(name)
    rng = np.random.default_rng(d + t.bits)
    x = rng.standard_normal((12, d)).astype(np.float32)
    q = t.quantize(x)
    b = np.ascontiguousarray(q).view(np.uint8).reshape(len(x), -1)
    want = t.dequantize_rotated(q)
    bb = t.block_bytes
    for blk in range(d // 64):
        o = bb * blk
        sc = _h2f(b, o)[:, None]
        for j in range(0, 64, 2):
            got = sc * np.stack(_pair_level(t.bits, t.levels, _pair_block(t.bits, b.astype(np.int64), o, j)), axis=1)
            np.testing.assert_array_equal(got, want[:, 64 * blk + j: 64 * blk + j + 2])
        for nv in (16, 32):  # the _l8 kernels' parts (d / 8 values per lane at head sizes 128 / 256)
            for sub in range(64 // nv):
                for j in range(0, nv, 2):
                    e = _sub_pair(t.bits, b, o, nv, sub, j)
                    got = sc * np.stack(_pair_level(t.bits, t.levels, e), axis=1)
                    i = 64 * blk + sub * nv + j
                    np.testing.assert_array_equal(got, want[:, i: i + 2])
    n_e = d // 32
    parts = [_vals2(t.bits, t.levels, b, lane * n_e, n_e) for lane in range(32)]
    got = np.concatenate([d[:, None] * v for d, v in parts], axis=1)  # the PV loop's p * d, then * v
    np.testing.assert_array_equal(got, want)


def _prmt(x, y, sel):
    """CUDA ``__byte_perm(x, y, sel)`` of uint32 words x, y and selectors sel (arrays or ints):
    result byte i is byte ``(sel >> 4 i) & 7`` of the 8-byte value y:x (the documented semantics;
    nvcc masks each selector nibble with 7 before its PRMT, whose bit 3 would sign-replicate).
    The kernels' selectors keep bit 3 clear, asserted here so that the two cannot part."""
    x, y, sel = (np.asarray(v, np.int64) for v in (x, y, sel))
    assert not (sel & 0x8888).any(), "a selector nibble with bit 3 set"
    byts = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    byts = np.broadcast_arrays(*byts, sel)[:8]
    return sum(np.choose((sel >> (4 * i)) & 7, byts) << (8 * i) for i in range(4))


def test_stream_turbo3_index_layouts():
    """The streaming kernel's turbo3 operands (kv_codes.cuh KvCodes<KTurbo<3>>), ported op by op:
    kraw's two words per thread hold, as byte s of word r, the byte offset (4 e) of the K pair
    table entry e of indices 16 tig + 2 (2s + r), + 1 (tab_k's pair_of(e) gives them back);
    vraw's nibbles and vcodes' even / odd words hold, as byte k / 2, 4 (a | b << 3) for two
    cells' index 8c + k (tab_v's entry a | b << 3). Against the indices the tier packed
    (TurboTier.pack: the low 2 bits four to a byte, then the high bits eight to a byte). The
    port's expressions are the source's (checked in the text of kv_codes.cuh)."""
    src = re.sub(r"\s+", " ", read_source("kv_codes.cuh"))
    for expr in ("hn = __byte_perm(hi, 0, 0x4140)", "hn = (hn | (hn << 4)) & 0x0F0F0F0Fu",
                 "w[0] = ((lo << 2) & 0x3C3C3C3Cu) | ((hn << 6) & 0xC0C0C0C0u)",
                 "w[1] = ((lo >> 2) & 0x3C3C3C3Cu) | ((hn << 4) & 0xC0C0C0C0u)",
                 "tab_at(tk, __byte_perm(w[r], 0, 0x4440 | s))",
                 "t = __byte_perm(lo, 0, 0x4140)", "t = (t | (t << 4)) & 0x0F0F0F0Fu",
                 "t = (t | (t << 2)) & 0x33333333u", "h = (hi | (hi << 12)) & 0x000F000Fu",
                 "h = (h | (h << 6)) & 0x03030303u", "h = (h | (h << 3)) & 0x11111111u", "return t | (h << 2)",
                 "const u32 a = (k & 1) ? ra >> 4 : ra, b = (k & 1) ? rb >> 4 : rb",
                 "const u32 w = ((a << 2) & 0x1C1C1C1Cu) | ((b << 5) & 0xE0E0E0E0u)",
                 "tab_at(tv, __byte_perm(w, 0, 0x4440 | (k >> 1)))"):
        assert expr in src, expr
    t = get_tier("turbo3")
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 8, (512, 64))
    payload = t.pack(idx).astype(np.int64)  # [N, 24]: 16 bytes of low bits, 8 of high bits
    le = lambda cols: sum(payload[:, c] << (8 * i) for i, c in enumerate(cols))  # noqa: E731
    for tig in range(4):  # K: kraw, then kpair(w, s, r)
        lo, hi = le(range(4 * tig, 4 * tig + 4)), le(range(16 + 2 * tig, 18 + 2 * tig))
        hn = _prmt(hi, 0, 0x4140)
        hn = (hn | (hn << 4)) & 0x0F0F0F0F
        w = [((lo << 2) & 0x3C3C3C3C) | ((hn << 6) & 0xC0C0C0C0), ((lo >> 2) & 0x3C3C3C3C) | ((hn << 4) & 0xC0C0C0C0)]
        for s in range(4):
            for r in range(2):
                e4 = _prmt(w[r], 0, 0x4440 | s)
                assert (e4 % 4 == 0).all() and (e4 < 256).all()
                e = e4 >> 2
                a, b = (e & 3) | ((e >> 4) & 1) << 2, ((e >> 2) & 3) | ((e >> 5) & 1) << 2  # pair_of
                p = 16 * tig + 2 * (2 * s + r)
                np.testing.assert_array_equal(a, idx[:, p])
                np.testing.assert_array_equal(b, idx[:, p + 1])

    def vraw(c):
        lo, hi = le([2 * c, 2 * c + 1]), payload[:, 16 + c]
        x = _prmt(lo, 0, 0x4140)
        x = (x | (x << 4)) & 0x0F0F0F0F
        x = (x | (x << 2)) & 0x33333333
        h = (hi | (hi << 12)) & 0x000F000F
        h = (h | (h << 6)) & 0x03030303
        h = (h | (h << 3)) & 0x11111111
        return x | (h << 2)

    half = len(idx) // 2  # cells a (rows 0..) and b (rows half..) of each pair
    for c in range(8):  # V: column c = gid
        x = vraw(c)
        for k in range(8):
            np.testing.assert_array_equal((x >> (4 * k)) & 7, idx[:, 8 * c + k])  # nibble k
            ra, rb = x[:half], x[half:]
            a, b = (ra >> 4, rb >> 4) if k & 1 else (ra, rb)
            e4 = _prmt(((a << 2) & 0x1C1C1C1C) | ((b << 5) & 0xE0E0E0E0), 0, 0x4440 | (k >> 1))
            np.testing.assert_array_equal(e4, 4 * (idx[:half, 8 * c + k] | idx[half:, 8 * c + k] << 3))


_HEX = r"(0x[0-9A-Fa-f]+)u?"  # a hex constant of the CUDA text, its u suffix optional


def _codes_text(struct: str) -> tuple[str, str]:
    """kv_codes.cuh with its whitespace runs as single spaces, and the body of KvCodes<struct>."""
    src = re.sub(r"\s+", " ", read_source("kv_codes.cuh"))
    body = src[src.index(f"struct KvCodes<{struct}> {{"):]
    return src, body[:body.index("};")]


def _grab(body: str, pattern: str) -> list:
    """The groups of ``pattern``'s match in ``body`` (which must match): hex and decimal numbers
    as ints, other text as it is."""
    m = re.search(pattern, body)
    assert m, pattern
    return [int(g, 16) if g.startswith("0x") else int(g) if g.isdigit() else g for g in m.groups()]


def _one_block_rows(name: str, block_bytes: int, seed: int):
    """256 random rows of one 32-value block quantized by tier ``name``: their bytes as int64
    [256, block_bytes], the tier's dequantized values [256, 32] and ``f16(o)``, the float32 of
    the f16 at byte o of every row."""
    t = get_tier(name)
    q = t.quantize(np.random.default_rng(seed).standard_normal((256, 32)).astype(np.float32))
    b = np.ascontiguousarray(q).view(np.uint8).reshape(256, -1).astype(np.int64)
    assert b.shape[1] == block_bytes
    f16 = lambda o: (b[:, o] | b[:, o + 1] << 8).astype(np.uint16).view(np.float16).astype(np.float32)  # noqa: E731
    return b, t.dequantize(q).reshape(256, 32), f16


def _q4_0_kdim(L: int) -> int:  # kv_codes.cuh KvCodes<KQ4_0>::kdim
    return 16 * (L >> 4) + 4 * ((L & 7) >> 1) + ((L >> 3) & 1) + 2 * (L & 1)


def _q4_0_vdim(c: int, k: int) -> int:  # kv_codes.cuh KvCodes<KQ4_0>::vdim
    return 16 * (k >> 1) + 2 * c + (k & 1)


def test_stream_iq4nl_operands():
    """The streaming kernel's iq4_nl operands (kv_codes.cuh KvCodes<KIQ4_NL>), ported op by op
    with the constants read from the source (so an edit there moves the port): lut16's three
    permutes give level + 128 of four codes from the table's immediates; kpair's B register
    (s, r) of thread tig holds, as f16 pairs 1024 + (level + 128) less 1152, the levels at the
    block dims kdim(L) of its MMA k indices L = 16 s + 2 tig + 8 r + e (q4_0's order); vcodes(ra,
    rb, k) holds two cells' levels at dim vdim(c, k) of column c (q4_0's order). Against the
    tier's own bytes and dequantized values (d * level, bit for bit), every level seen."""
    src, body = _codes_text("KIQ4_NL")
    h = _HEX

    def grab(pattern):
        return _grab(body, pattern)

    assert "return KvCodes<KQ4_0>::kdim(L)" in body and "return KvCodes<KQ4_0>::vdim(c, k)" in body
    assert "return 16 * (L >> 4) + 4 * ((L & 7) >> 1) + ((L >> 3) & 1) + 2 * (L & 1)" in src
    assert "return 16 * (k >> 1) + 2 * c + (k & 1)" in src
    t0, t1, m0 = grab(rf"lo = __byte_perm\({h}, {h}, x & {h}\)")
    t2, t3, m1 = grab(rf"hi = __byte_perm\({h}, {h}, x & {h}\)")
    assert "return __byte_perm(lo, hi, sel)" in body
    sb, ss, sm = grab(rf"return {h} \| \(\(x >> (\d+)\) & {h}\)")
    assert "const u32 x = ld4b(blk + 2 + 4 * tig, a4), sel = lut_sel(x)" in body
    assert "a = lut16(x, sel), b = lut16(x >> 16, sel >> 16)" in body
    w0s, = grab(rf"w\[0\] = __byte_perm\(a, b, {h}\)")
    w1s, = grab(rf"w\[1\] = __byte_perm\(a, b, {h}\)")
    kc, k1, k0, kb = grab(rf"return hsub2\(__byte_perm\(w\[s\], {h}, r \? {h} : {h}\), {h}\)")
    assert "const u32 x = *(const u16*)(blk + 2 + 2 * gid)" in body and "return lut16(x, lut_sel(x))" in body
    # vcodes: q8_0's, at byte iexpr of each cell's word
    iexpr, = grab(r"return KvCodes<KQ8_0>::vcodes\(ra, rb, ([^,]+), tv\);")
    vm, vo, vb = _grab(_codes_text("KQ8_0")[1],
                       rf"return hsub2\(\(__byte_perm\(ra, rb, k \| \(\(4 \+ k\) << 8\)\) & {h}\) \| {h}, {h}\)")
    assert kb == vb == 0x64806480  # f16 1152 in both halves: 1024 + (level + 128) - 1152 = level

    levels = np.asarray(IQ4_NL_LEVELS, np.int64)
    table = (t0, t1, t2, t3)

    def lut16(x, sel):
        return _prmt(_prmt(t0, t1, x & m0), _prmt(t2, t3, x & m1), sel)

    def lut_sel(x):
        return sb | ((x >> int(ss)) & sm)

    def f16_pair(p):  # hsub2(p, 1152 | 1152), exact for f16 1024 + u (u < 256): the pair's values
        assert ((p >> 8) & 0xFF == 0x64).all() and ((p >> 24) & 0xFF == 0x64).all()
        return (p & 0xFF) - 128, ((p >> 16) & 0xFF) - 128

    assert [(table[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(16)] == (levels + 128).tolist()
    b, want, f16 = _one_block_rows("iq4_nl", 18, 41)
    d = f16(0)  # the block scale
    le = lambda cols: sum(b[:, c] << (8 * i) for i, c in enumerate(cols))  # noqa: E731
    seen = set()
    for tig in range(4):
        w32 = le(range(2 + 4 * tig, 6 + 4 * tig))
        sel = lut_sel(w32)
        lo_w, hi_w = lut16(w32, sel), lut16(w32 >> 16, sel >> 16)
        w = [_prmt(lo_w, hi_w, w0s), _prmt(lo_w, hi_w, w1s)]
        for s_ in range(2):
            for r in range(2):
                for e, v in enumerate(f16_pair(_prmt(w[s_], kc, k1 if r else k0))):
                    seen.update(v.tolist())
                    dim = _q4_0_kdim(16 * s_ + 2 * tig + 8 * r + e)
                    np.testing.assert_array_equal(d * v.astype(np.float32), want[:, dim], err_msg=f"K {tig} {s_} {r} {e}")
    assert seen == set(levels.tolist())
    half = len(b) // 2  # cells a (rows 0..) and b (rows half..)
    for c in range(8):
        w16 = le([2 + 2 * c, 3 + 2 * c])
        raw = lut16(w16, lut_sel(w16))
        for k in range(4):
            i = eval(iexpr, {"k": k})  # the source's C expression (Python's operators agree here)
            va, vb_ = f16_pair((_prmt(raw[:half], raw[half:], i | ((4 + i) << 8)) & vm) | vo)
            np.testing.assert_array_equal(d[:half] * va.astype(np.float32), want[:half, _q4_0_vdim(c, k)])
            np.testing.assert_array_equal(d[half:] * vb_.astype(np.float32), want[half:, _q4_0_vdim(c, k)])


@pytest.mark.parametrize("struct,name,block_bytes,bias", [("KQ4_0", "q4_0", 18, 0x64086408),
                                                         ("KQ4_1", "q4_1", 20, 0x64006400)],
                         ids=["q4_0", "q4_1"])
def test_stream_nibble_operands(struct, name, block_bytes, bias):
    """The streaming kernel's q4_0 and q4_1 operands (kv_codes.cuh KvCodes<KQ4_0> / <KQ4_1>),
    ported with the constants read from the source: kraw's word at block byte 2 + 4 tig (q4_0;
    q4_1: 4 + 4 tig), kpair's f16 pairs (nib_pair) 1024 + nibble less 1032 (q4_0: code - 8)
    or 1024 (q4_1: the code) at q4_0's kdim, vraw's two bytes at 2 + 2 gid (q4_1: 4 + 2 gid)
    and vcodes' pairs at q4_0's vdim; with the block's d (and q4_1's m, mh: bytes 2, 3) each
    value is the tier's, bit for bit, every code seen."""
    src, body = _codes_text(struct)
    h = _HEX

    def grab(pattern):
        return _grab(body, pattern)

    q4_1 = name == "q4_1"
    assert f"static constexpr bool ON = true, PD = false, MIN = {'true' if q4_1 else 'false'};" in body
    if q4_1:
        assert "return KvCodes<KQ4_0>::kdim(L)" in body and "return KvCodes<KQ4_0>::vdim(c, k)" in body
        assert "return *(const u16*)(blk + 2);" in body  # mh
        ko, = grab(r"w\[0\] = \*\(const u32\*\)\(blk \+ (\d+) \+ 4 \* tig\)")
    else:
        ko, = grab(r"w\[0\] = ld4b\(blk \+ (\d+) \+ 4 \* tig, a4\)")
    nm, nor = _grab(src, rf"u32 nib_pair\(u32 x, int sh, u32 bias\) {{ return hsub2\(\(\(x >> sh\) & {h}\) \| {h}, bias\);")
    kb, = grab(rf"return nib_pair\(w\[0\], 4 \* s \+ 8 \* r, {h}\)")
    vo, = grab(r"return \*\(const u16\*\)\(blk \+ (\d+) \+ 2 \* gid\)")
    vs, vb = grab(rf"return nib_pair\(__byte_perm\(ra, rb, {h}\), 8 \* \(k & 1\) \+ 4 \* \(k >> 1\), {h}\)")
    assert kb == vb == bias and nor == 0x64006400  # (1024 + n) - (1024 + 8 or 0) in both halves

    def f16_pair(p):  # hsub2(p, bias): exact for f16 1024 + n (n < 16) less 1032 or 1024
        assert ((p >> 10) & 0x3F == 0x19).all() and ((p >> 26) & 0x3F == 0x19).all()  # 1024 <= value < 2048
        off = (bias & 0x3FF)
        return (p & 0x3FF) - off, ((p >> 16) & 0x3FF) - off

    b, want, f16 = _one_block_rows(name, block_bytes, 43)
    d = f16(0)
    m = f16(2) if q4_1 else np.zeros_like(d)
    le = lambda cols: sum(b[:, c] << (8 * i) for i, c in enumerate(cols))  # noqa: E731
    seen = set()
    for tig in range(4):
        w = le(range(ko + 4 * tig, ko + 4 * tig + 4))
        for s_ in range(2):
            for r in range(2):
                for e, n in enumerate(f16_pair(((w >> (4 * s_ + 8 * r)) & nm) | nor)):
                    seen.update(n.tolist())
                    dim = _q4_0_kdim(16 * s_ + 2 * tig + 8 * r + e)
                    np.testing.assert_array_equal(d * n.astype(np.float32) + m, want[:, dim])
    assert seen == set(range(16) if q4_1 else range(-8, 8))
    half = len(b) // 2
    for c in range(8):
        raw = le([vo + 2 * c, vo + 1 + 2 * c])
        mm = _prmt(raw[:half], raw[half:], vs)
        for k in range(4):
            na, nb = f16_pair(((mm >> (8 * (k & 1) + 4 * (k >> 1))) & nm) | nor)
            np.testing.assert_array_equal(d[:half] * na.astype(np.float32) + m[:half], want[:half, _q4_0_vdim(c, k)])
            np.testing.assert_array_equal(d[half:] * nb.astype(np.float32) + m[half:], want[half:, _q4_0_vdim(c, k)])


def _fwht(v: np.ndarray, inverse: bool) -> np.ndarray:
    """``fwht_shared`` (kv_tiers.cuh) over the last axis: forward y = H (s x) / sqrt(d),
    inverse x = s (H y) / sqrt(d)."""
    d = v.shape[-1]
    s = turbo.SIGNS[:d]
    v = np.array(v, dtype=np.float32).reshape(-1, d)
    if not inverse:
        v = v * s
    h = 1
    while h < d:
        p = v.reshape(len(v), d // (2 * h), 2, h)
        v = np.stack([p[:, :, 0] + p[:, :, 1], p[:, :, 0] - p[:, :, 1]], axis=2).reshape(len(v), d)
        h *= 2
    v = v * np.float32(1.0 / np.sqrt(d))
    return v * s if inverse else v


@pytest.mark.parametrize("tk,tv,d", [("turbo3", "turbo3", 256), ("q8_0", "turbo3", 128),
                                     ("turbo3_tcq", "q4_0", 64), ("turbo8", "turbo2_tcq", 512)])
def test_rotation_trick_equals_cpu_attention(tk, tv, d):
    """The attention kernel's rotated-domain math (turbo.py: q.k = (Rq).(Rk), o = R^T sum p y)
    gives CPUBackend.attention over the dequantized cells, with GQA and a causal mask."""
    rng = np.random.default_rng(9)
    Tk, Tv = get_tier(tk), get_tier(tv)
    C, n_kv, n_head, T = 70, 2, 6, 3
    kq = Tk.quantize(rng.standard_normal((C, n_kv, d)).astype(np.float32))
    vq = Tv.quantize(rng.standard_normal((C, n_kv, d)).astype(np.float32))
    q = rng.standard_normal((T, n_head, d)).astype(np.float32)
    q_pos = np.array([40, 55, 69])
    kv_pos = np.arange(C)
    scale = 1 / np.sqrt(d)
    want = CPUBackend.attention(q, q_pos, Tk.dequantize(kq), Tv.dequantize(vq), kv_pos, scale)

    rot = lambda t: t.family in ("turbo", "tcq")  # noqa: E731
    kr = Tk.dequantize_rotated(kq) if rot(Tk) else Tk.dequantize(kq)  # what the kernel decodes
    vr = Tv.dequantize_rotated(vq) if rot(Tv) else Tv.dequantize(vq)
    qs = (q * np.float32(scale)).reshape(T * n_head, d)
    if rot(Tk):
        qs = _fwht(qs, inverse=False)  # rotate the queries once
    qs = qs.reshape(T, n_kv, n_head // n_kv, d)
    s = np.einsum("tkgd,ckd->tkgc", qs, kr)
    s = np.where(kv_pos[None, None, None, :] <= q_pos[:, None, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("tkgc,ckd->tkgd", p, vr) / p.sum(-1, keepdims=True)
    o = o.reshape(T * n_head, d)
    if rot(Tv):
        o = _fwht(o, inverse=True)  # un-rotate the output once per head
    np.testing.assert_allclose(o.reshape(T, -1), want, rtol=1e-4, atol=1e-5)


def test_turbo_rotate_is_the_orthonormal_rotation():
    """turbo.rotate (butterflies, the order the write kernels repeat) is R = H diag(s) / sqrt(d)."""
    rng = np.random.default_rng(1)
    for d in cuda_kv.KV_HEAD_DIMS:
        x = rng.standard_normal((4, d)).astype(np.float32)
        np.testing.assert_allclose(turbo.rotate(x), x @ turbo.rotation(d), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_fwht(turbo.rotate(x), inverse=True), x, rtol=1e-5, atol=1e-5)


# ---- the write kernels of the rotated tiers (kv_write.cu kv_quant_turbo / kv_quant_tcq), ported
# op by op to NumPy float32. Every float operation of those kernels is an IEEE round-to-nearest
# PTX instruction without .ftz (add/sub/mul/div/sqrt .rn, setp/min/max without .ftz, sign flips on
# the bit pattern; test_kv_write_ptx_float_ops_exact checks the PTX), which is exactly what NumPy's
# float32 scalar/array operations compute, so the port computes the kernels' bytes. The tables
# come from the CUDA source (tables_prefix), not from the Python tiers.

def _prefix_tables():
    src = cuda_kv.tables_prefix()
    c = _consts(src)
    words = re.search(r"KV_SIGNS\[16\] = \{([^}]*)\}", src).group(1)
    w = np.array([int(x.strip().rstrip("u"), 16) for x in words.split(",")], dtype=np.uint32)
    c["neg"] = (((w[:, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(-1) == 1)
    c["isqrt"] = {d: np.float32(float.fromhex(re.search(rf"d == {d} \? (\S+)f", src).group(1)))
                  for d in cuda_kv.KV_HEAD_DIMS}
    return c


_TAB = _prefix_tables()


def _emu_fwht_fwd(x):
    """fwht_shared<D>(v, rows, inverse=false, exact=true) over rows ``x [R, D]``: per thread t of
    a stage, i = (u / h) * 2h + u % h: (v[i], v[i+h]) <- (v[i] + v[i+h], v[i] - v[i+h])."""
    v = np.array(x, dtype=np.float32)
    D = v.shape[1]
    neg = _TAB["neg"][:D]
    v.view(np.uint32)[:, neg] ^= np.uint32(0x80000000)  # xneg: the sign bit
    u = np.arange(D // 2)
    h = 1
    while h < D:
        i = (u // h) * 2 * h + (u % h)
        a, b = v[:, i].copy(), v[:, i + h].copy()
        v[:, i] = a + b  # xadd
        v[:, i + h] = a - b  # xsub
        h *= 2
    return v * _TAB["isqrt"][D]  # xmul(v, kv_isqrt(D))


def _emu_tree64(p):
    """tree64 over p [R, n] (n a multiple of 64; thread tid, j = tid & 63): for h = 32..1,
    p[tid] = p[tid] + p[tid + h] where j < h. The block sums land at p[:, 64 b]."""
    p = np.array(p, dtype=np.float32)
    tid = np.arange(p.shape[1])
    for h in (32, 16, 8, 4, 2, 1):
        t = tid[(tid & 63) < h]
        p[:, t] = p[:, t] + p[:, t + h]
    return p


def _emu_fwht_column(x):
    """fwht_column<D> (turbo_row's and the q rows' rotation) over rows ``x [R, D]``: thread t holds
    x_t, sign flipped by xneg; stages h < 32 by shuffles: o = the value of lane t ^ h, keeping
    x + o (xadd) where bit h of t is clear, o - x (xsub) where it is set; then column c's D / 32
    values c + 32 k in registers, stage h = 32 s pairing entries (k, k + s): a + b into the lower,
    a - b into the upper; then xmul(v, kv_isqrt(D)). Returns y [R, D] (y[c + 32 k] = column c's
    entry k)."""
    v = np.array(x, dtype=np.float32)
    D = v.shape[1]
    v.view(np.uint32)[:, _TAB["neg"][:D]] ^= np.uint32(0x80000000)
    t = np.arange(D)
    for h in (1, 2, 4, 8, 16):
        o = v[:, t ^ h]
        v = np.where((t & h) == 0, v + o, o - v).astype(np.float32)
    col = v.reshape(len(v), D // 32, 32).copy()  # [R, k, c]
    s = 1
    while s < D // 32:
        for k in range(D // 32):
            if k & s == 0:
                a, b = col[:, k].copy(), col[:, k + s].copy()
                col[:, k], col[:, k + s] = a + b, a - b
        s *= 2
    return col.reshape(len(v), D) * _TAB["isqrt"][D]


def _emu_shfl_down(v, h):
    """__shfl_down_sync(v, h) over warps of the last axis: lane l reads lane l + h, or keeps its
    own value where l + h is past its warp."""
    lane = np.arange(v.shape[-1])
    return v[..., np.where((lane & 31) + h < 32, lane + h, lane)]


def _emu_tree64_warp(p):
    """tree64_warp's sums over rows ``p [R, n]``: warp b holds 64-value block b, lane j its values
    j and j + 32 -> a = lo + hi (xadd), then a = a + shfl_down(a, h) for h = 16 .. 1 (lanes past
    the warp keep their own value: garbage only lanes j >= h hold); lane 0's value is broadcast.
    Returns the sums repeated over each block's 64 positions."""
    p = np.array(p, dtype=np.float32).reshape(len(p), -1, 2, 32)
    a = (p[:, :, 0] + p[:, :, 1]).astype(np.float32)
    for h in (16, 8, 4, 2, 1):
        a = (a + _emu_shfl_down(a, h)).astype(np.float32)
    return np.repeat(a[:, :, 0], 64, axis=1)


def _emu_f2h(v):
    """st16(dst, f2h(v)): cvt.rn.f16.f32 (round to nearest even; overflow to inf) as two
    little-endian bytes."""
    return np.ascontiguousarray(np.asarray(v, dtype=np.float32).astype(np.float16)).view(np.uint8).reshape(-1, 2)


def _emu_norm(y, tree=_emu_tree64):
    """n = xsqrt(tree(y * y)[b0]); u = 0 < n ? y * (8 / n) : 0 -> u [R, n] (tree: tree64, or
    turbo_row's tree64_warp)."""
    p = tree(y * y)
    n = np.sqrt(np.repeat(p[:, 0::64], 64, axis=1))  # sqrt.rn (NumPy's float32 sqrt is IEEE)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.float32(0) < n, y * (np.float32(8) / n), np.float32(0)).astype(np.float32)


def _emu_scale(y, c, tree=_emu_tree64):
    """num = tree(y c), den = tree(c c) per block; scale = 0 < den ? num / den : 0."""
    num, den = tree(y * c)[:, 0::64], tree(c * c)[:, 0::64]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.float32(0) < den, num / den, np.float32(0)).astype(np.float32)


def _emu_search(u, th):
    """The kernel's binary search: lo = 0, hi = NT - 1; while lo < hi: mid = (lo + hi) >> 1;
    if !(u <= th[mid]) lo = mid + 1 else hi = mid."""
    lo = np.zeros(u.shape, np.int64)
    hi = np.full(u.shape, len(th), np.int64)
    while (lo < hi).any():
        act = lo < hi
        mid = (lo + hi) >> 1
        up = ~(u <= th[np.minimum(mid, len(th) - 1)])
        lo = np.where(act & up, mid + 1, lo)
        hi = np.where(act & ~up, mid, hi)
    return lo


def _emu_search_imm(u, th, lv):
    """turbo_row's code search up to 16 levels (immediates): gt[i] = !(u <= th[i]) for every i at
    once, lo = their count, c by halving (node [k, k + 2w) takes its upper half iff gt[k + w - 1])
    -> (lo, c)."""
    gt = [~(u <= th[i]) for i in range(len(th))]
    lo = sum(g.astype(np.int64) for g in gt)
    node = [np.full(u.shape, v, np.float32) for v in lv]
    w = 1
    while w < len(lv):
        for k in range(0, len(lv), 2 * w):
            node[k] = np.where(gt[k + w - 1], node[k + w], node[k])
        w *= 2
    return lo, node[0]


def _emu_quant_turbo(bits, x):
    """kv_quant_turbo<KTurbo<bits>, D> (turbo_row: fwht_column, tree64_warp) over rows x [R, D]
    -> bytes [R, D / 64 * BB]."""
    R, D = x.shape
    y = _emu_fwht_column(x)
    u = _emu_norm(y, _emu_tree64_warp)
    if bits <= 4:  # the immediates' search (its own tables: tables_prefix's kv_th* / kv_lm*)
        idx, c = _emu_search_imm(u, _TAB[f"kv_th{bits}"], _TAB[f"kv_lm{bits}"])
    else:
        idx = _emu_search(u, _TAB[f"KV_TH{bits}"])
        c = _TAB[f"KV_LM{bits}"][idx]
    scale = _emu_scale(y, c, _emu_tree64_warp).reshape(-1)
    BB = 2 + 64 * bits // 8
    idx = idx.reshape(-1, 64)
    out = np.zeros((len(idx), BB), np.uint8)
    out[:, :2] = _emu_f2h(scale)
    for m in range(BB - 2):  # turbo_payload_byte<BITS>(i0, i1, j, k): byte m = j + 32 k of lane j
        out[:, 2 + m] = _emu_payload_byte(bits, idx[:, :32], idx[:, 32:], m % 32, m // 32)
    return out.reshape(R, -1)


def _emu_ballot(bits):
    """__ballot_sync over a warp's lanes: bits [n, 32] (bool) -> uint32 words [n]."""
    return (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32)


def _emu_spread4(x):
    x = (x | (x << 2)) & 0x33
    return (x | (x << 1)) & 0x55


def _emu_payload_byte(bits, i0, i1, j, k):
    """kv_store.cuh turbo_payload_byte<BITS>(i0, i1, j, k) for every block at once: i0 / i1 [n, 32]
    the warp's indices of values lane, lane + 32; lane j's byte [n]."""
    if bits == 8:
        return (i0 if k == 0 else i1)[:, j]
    if bits == 4:
        s = (2 * j) & 31
        a0, a1, b0, b1 = i0[:, s], i0[:, s + 1], i1[:, s], i1[:, s + 1]
        return a0 | a1 << 4 if j < 16 else b0 | b1 << 4
    a0, a1 = _emu_ballot(i0 & 1 != 0), _emu_ballot(i0 & 2 != 0)
    b0, b1 = _emu_ballot(i1 & 1 != 0), _emu_ballot(i1 & 2 != 0)
    q = 4 * (j & 7)
    lo = _emu_spread4(((a0 if j < 8 else b0) >> q) & 15) | _emu_spread4(((a1 if j < 8 else b1) >> q) & 15) << 1
    if bits == 2:
        return lo
    h0, h1 = _emu_ballot(i0 & 4 != 0), _emu_ballot(i1 & 4 != 0)
    mm = (j - 16) & 7
    hi = ((h0 if mm < 4 else h1) >> (8 * (mm & 3))) & 255
    return lo if j < 16 else hi



# The kernel text that _emu_search_imm and _emu_payload_byte port, pinned whole (comments dropped,
# whitespace squeezed): an edit to kv_store.cuh's code search, payload or payload store fails
# test_turbo_row_port_follows_the_kernel_text until the port (and these copies) follow it.
_KERNEL_SEARCH = (
    "if constexpr (IMM) { bool gt[T::NT - 1]; float lv[T::NT]; #pragma unroll for (int i = 0; i < T::NT - 1; i++) { "
    "gt[i] = !xle(u, T::thr_at(i)); lo += gt[i]; } #pragma unroll for (int k = 0; k < T::NT; k++) lv[k] = "
    "T::lev_at(k); #pragma unroll for (int w = 1; w < T::NT; w <<= 1) { #pragma unroll for (int k = 0; k < T::NT; "
    "k += 2 * w) lv[k] = gt[k + w - 1] ? lv[k + w] : lv[k]; } c = lv[0]; ")
_KERNEL_PAYLOAD = (
    "__device__ __forceinline__ u32 spread4(u32 x) { x = (x | (x << 2)) & 0x33u; return (x | (x << 1)) & 0x55u; } "
    "template <int BITS> __device__ __forceinline__ u32 turbo_payload_byte(int i0, int i1, int j, int k) { "
    "if constexpr (BITS == 8) { return (u32)(k == 0 ? i0 : i1); } else if constexpr (BITS == 4) { "
    "const int s = (2 * j) & 31; const int a0 = __shfl_sync(0xffffffffu, i0, s), a1 = __shfl_sync(0xffffffffu, i0, "
    "s + 1); const int b0 = __shfl_sync(0xffffffffu, i1, s), b1 = __shfl_sync(0xffffffffu, i1, s + 1); "
    "return j < 16 ? (u32)(a0 | a1 << 4) : (u32)(b0 | b1 << 4); } else { const u32 a0 = __ballot_sync(0xffffffffu, "
    "i0 & 1), a1 = __ballot_sync(0xffffffffu, i0 & 2); const u32 b0 = __ballot_sync(0xffffffffu, i1 & 1), "
    "b1 = __ballot_sync(0xffffffffu, i1 & 2); const int q = 4 * (j & 7); const u32 lo = spread4(((j < 8 ? a0 : b0) "
    ">> q) & 15u) | spread4(((j < 8 ? a1 : b1) >> q) & 15u) << 1; if constexpr (BITS == 2) return lo; "
    "const u32 h0 = __ballot_sync(0xffffffffu, i0 & 4), h1 = __ballot_sync(0xffffffffu, i1 & 4); "
    "const int mm = (j - 16) & 7; const u32 hi = ((mm < 4 ? h0 : h1) >> (8 * (mm & 3))) & 255u; "
    "return j < 16 ? lo : hi; } } ")
_KERNEL_STORE = (
    "u8* dst = dst_row + (long long)b * T::BB; #pragma unroll for (int k = 0; k < (T::BB - 2 + 31) / 32; k++) { "
    "const u32 byte = turbo_payload_byte<T::KBITS>(ix[0], ix[1], j, k); if (j + 32 * k < T::BB - 2) "
    "dst[2 + j + 32 * k] = (u8)byte; } ")


def test_turbo_row_port_follows_the_kernel_text():
    """_emu_search_imm and _emu_payload_byte port kv_store.cuh turbo_row's code search and
    turbo_payload_byte, and _emu_quant_turbo the payload's store loop: that kernel text is the
    pinned copy above (an edit there fails here until the port follows). The payload port gives
    the old turbo_pack layout (turbo.py's) for every byte of random blocks, and the search port
    gives searchsorted(thresholds, u, side="left") and that level for every tier up to 4 bits at
    NaN, +-inf, +-0, every threshold and its two neighbouring floats."""
    src = re.sub(r"\s+", " ", re.sub(r"/\*.*?\*/|//[^\n]*", "", read_source("kv_store.cuh"), flags=re.S))
    search = src[src.index("if constexpr (IMM) {"):src.index("} else { const float* th = T::thr();")]
    assert search == _KERNEL_SEARCH
    assert src[src.index("__device__ __forceinline__ u32 spread4(u32 x)"):
               src.index("template <class T, int D, bool GAIN")] == _KERNEL_PAYLOAD
    assert src[src.index("u8* dst = dst_row"):src.index("float scale = xlt(0.f, den)")] == _KERNEL_STORE
    for bits in (2, 3, 4):
        th, lv = _TAB[f"kv_th{bits}"], _TAB[f"kv_lm{bits}"]
        u = np.concatenate([th, np.nextafter(th, np.float32(-np.inf)), np.nextafter(th, np.float32(np.inf)),
                            np.float32([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45])])
        u = np.concatenate([u, np.random.default_rng(bits).standard_normal(4096).astype(np.float32) * 3])
        lo, c = _emu_search_imm(u, th, lv)
        want = np.where(np.isnan(u), len(th), np.searchsorted(th, u, side="left"))
        assert (lo == want).all(), bits
        assert c.view(np.uint32).tolist() == lv[want].view(np.uint32).tolist(), bits
    rng = np.random.default_rng(7)
    for bits in (2, 3, 4, 8):
        idx = rng.integers(0, 1 << bits, (64, 64))
        for m in range(64 * bits // 8):
            if bits == 8:
                want = idx[:, m]
            elif bits == 4:
                want = idx[:, 2 * m] | idx[:, 2 * m + 1] << 4
            elif m < 16:
                want = sum((idx[:, 4 * m + r] & 3) << 2 * r for r in range(4))
            else:
                want = sum(((idx[:, 8 * (m - 16) + r] >> 2) & 1) << r for r in range(8))
            got = _emu_payload_byte(bits, idx[:, :32], idx[:, 32:], m % 32, m // 32)
            assert (got == want).all(), (bits, m)


def _emu_viterbi(ys, cb, K, first_low=None, last_high=None):
    """viterbi<K> (kv_write.cu) for rows ys [R, n]: thread s = state; costs with xsub/xmul/xadd,
    the first of the K-group's minima by strict xlt, the final tree reduction by (xlt, or xeq and a
    lower index), back-tracking by thread 0. Returns the state path int64 [R, n]."""
    R, n = ys.shape
    G, KK = 1 << (8 - K), 1 << K
    s = np.arange(256)
    d = ys[:, :1] - cb[None, :]
    cost = d * d
    if first_low is not None:
        cost = np.where((s[None, :] & (G - 1)) != first_low[:, None], np.float32(np.inf), cost)
    back = np.zeros((R, n, G), np.int64)
    pred = (s & (G - 1))[:, None] * KK + np.arange(KK)[None, :]  # thread s reads cost[g * KK + jj]
    for t in range(1, n):
        cand = cost[:, pred]  # [R, 256, KK]
        best, bj = cand[:, :, 0].copy(), np.zeros((R, 256), np.int64)
        for jj in range(1, KK):
            lt = cand[:, :, jj] < best
            best = np.where(lt, cand[:, :, jj], best)
            bj = np.where(lt, jj, bj)
        back[:, t, :] = bj[:, :G]  # threads s < G
        d = ys[:, t:t + 1] - cb[None, :]
        cost = (d * d + best).astype(np.float32)
    c = cost
    if last_high is not None:
        c = np.where((s[None, :] >> K) != last_high[:, None], np.float32(np.inf), c)
    rv, ri = c.copy(), np.broadcast_to(s, c.shape).copy()
    o = 128
    while o:
        ov, oi = rv[:, o:2 * o], ri[:, o:2 * o]
        take = (ov < rv[:, :o]) | ((ov == rv[:, :o]) & (oi < ri[:, :o]))
        rv[:, :o] = np.where(take, ov, rv[:, :o])
        ri[:, :o] = np.where(take, oi, ri[:, :o])
        o //= 2
    path = np.zeros((R, n), np.int64)
    st = ri[:, 0]
    rows = np.arange(R)
    path[:, n - 1] = st
    for t in range(n - 1, 0, -1):
        g = st & (G - 1)
        st = g * KK + back[rows, t, g]
        path[:, t - 1] = st
    return path


def _emu_quant_tcq(k, x):
    """kv_quant_tcq<KTcq<k>, D> over rows x [R, D] (one CUDA block per 64-value block) ->
    bytes [R, D / 64 * BB]."""
    R, D = x.shape
    W, G = 8, 1 << (8 - k)
    cb = _TAB[f"KV_TCQ{k}"]
    yb = _emu_fwht_fwd(x).reshape(-1, 64)
    u = _emu_norm(yb)
    yw = np.concatenate([u[:, 64 - W:], u[:, :W]], axis=1)
    shared = _emu_viterbi(yw, cb, k)[:, W] & (G - 1)
    path = _emu_viterbi(u, cb, k, shared, shared)
    scale = _emu_scale(yb, cb[path]).reshape(-1)
    out = np.zeros((len(yb), 2 + 8 * k), np.uint8)
    out[:, :2] = _emu_f2h(scale)
    for m in range(8 * k):  # thread m: stream byte m
        byte = np.zeros(len(yb), np.int64)
        for bt in range(8):
            i = 8 * m + bt
            byte |= ((path[:, i // k] >> (i % k)) & 1) << bt
        out[:, 2 + m] = byte
    return out.reshape(R, -1)


def _adversarial_rows(d: int, rng) -> np.ndarray:
    """Rows exercising the corners of the write arithmetic: scales from subnormal (1e-42) through
    the range where y * y underflows into subnormals (1e-20 .. 1e-24) to 1e16 (no overflow of
    the block sums), all-zero rows and blocks, one-hot rows (every rotated value of one
    magnitude: equal-cost trellis paths and equal codes), exact dyadic values, sparse rows,
    powers of two and signed zeros."""
    rows = []
    for sc in (1e-42, 1e-38, 1e-24, 1e-22, 1e-20, 1e-12, 1e-4, 1.0, 3.0, 1e4, 1e12, 1e16):
        rows.append(rng.standard_normal((3, d)) * sc)
    rows.append(rng.standard_normal((4, d)) * 10.0 ** rng.uniform(-30, 16, (4, 1)))
    z = np.zeros((6, d))
    z[1, :64] = rng.standard_normal(64)                     # one non-zero block, the rest zero
    z[2, 5] = 1.0                                           # one-hot: |R x| constant
    z[3, d - 1] = -3.0
    z[4, ::7] = 2.0 ** rng.integers(-20, 20, len(z[4, ::7]))  # powers of two
    z[5] = -0.0                                             # negative zeros
    rows.append(z)
    r = np.round(rng.standard_normal((2, d)) * 4) / 4       # dyadic values (exact sums)
    rows.append(r)
    sp = rng.standard_normal((2, d)) * (rng.uniform(0, 1, (2, d)) > 0.9)  # sparse
    rows.append(sp)
    return np.concatenate(rows).astype(np.float32)


@pytest.mark.parametrize("name", ["turbo8", "turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq"])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_write_kernel_port_equals_cpu_bytes(name, d):
    """The op-by-op port of the CUDA write kernel gives exactly the CPU tier's ``quantize``
    bytes (main's turbo.py arithmetic: butterfly FWHT, pairwise block sums, correctly rounded
    sqrt and division, midpoint codes / tail-biting Viterbi, f16 round to nearest even) on
    random rows and adversarial ones (_adversarial_rows)."""
    t = get_tier(name)
    rng = np.random.default_rng(d + len(name))
    x = np.concatenate([rng.standard_normal((24 if d < 512 else 8, d)).astype(np.float32),
                        _adversarial_rows(d, rng)])
    want = t.quantize(x)
    with np.errstate(over="ignore"):
        got = _emu_quant_turbo(t.bits, x) if t.family == "turbo" else _emu_quant_tcq(t.k, x)
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert len(bad) == 0, f"{name} d={d}: rows {bad[:10]} differ"
    assert (want.reshape(-1, t.block_bytes)[:, :2] == 0).all(axis=1).any()  # zero blocks were there


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("d", [64, 512])
def test_write_kernel_port_float32_intermediates(d):
    """Stronger than the bytes (an f16 scale hides most 1-ulp differences): the port's float32
    rotation, unit-RMS values and least-squares scales are bit-identical to main's turbo.py
    (rotate, normalize_blocks, ls_scale) on random and adversarial rows. Controls show the test
    has teeth: a sequential block sum, or flushing subnormals to zero (what --use_fast_math's
    .ftz instructions would do), changes those intermediates on these rows."""
    t = get_tier("turbo3")
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal((16, d)).astype(np.float32), _adversarial_rows(d, rng)])
    y = _emu_fwht_fwd(x)
    np.testing.assert_array_equal(_bits(y), _bits(turbo.rotate(x)))
    b, u_cpu, _ = turbo.normalize_blocks(turbo.rotate(x))
    yb = y.reshape(-1, 64)
    u = _emu_norm(yb)
    np.testing.assert_array_equal(_bits(u), _bits(u_cpu))
    c = t.levels[t.codes(u_cpu)]
    np.testing.assert_array_equal(_bits(_emu_scale(yb, c)), _bits(turbo.ls_scale(b, c)))

    def seq_sum(p):  # control: left-to-right block sums
        p = np.array(p, dtype=np.float32)
        for blk in range(0, p.shape[1], 64):
            acc = p[:, blk].copy()
            for j in range(1, 64):
                acc = acc + p[:, blk + j]
            p[:, blk] = acc
        return p

    assert (_bits(seq_sum(yb * yb)[:, :1]) != _bits(_emu_tree64(yb * yb)[:, :1])).any()

    def ftz(a):  # control: subnormals flushed (sign kept)
        a = np.array(a, dtype=np.float32)
        a[np.abs(a) < np.float32(2.0 ** -126)] *= np.float32(0)
        return a

    yf = ftz(_emu_fwht_fwd(ftz(x)))
    with np.errstate(divide="ignore", invalid="ignore"):
        flushed = ftz(_emu_tree64(ftz(yf * yf)))
    assert (_bits(yf) != _bits(y)).any()  # subnormal rotated values
    assert (_bits(flushed[:, 0::64]) != _bits(_emu_tree64(y * y)[:, 0::64])).any()  # subnormal squares / sums


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_write_kernel_shuffle_orders_equal_shared(d):
    """turbo_row's rotation (fwht_column: shuffles, then each thread's column in registers) and
    64-value sums (tree64_warp: a warp per block, shuffles) round exactly as the shared-memory
    fwht_shared / tree64 that the trellis tiers keep: the same additions in the same pairs and
    order, bit for bit on random and adversarial rows (squares, products and level-sized values as
    the sums' inputs)."""
    rng = np.random.default_rng(d)
    x = np.concatenate([rng.standard_normal((16, d)).astype(np.float32), _adversarial_rows(d, rng)])
    y = _emu_fwht_column(x)
    np.testing.assert_array_equal(_bits(y), _bits(_emu_fwht_fwd(x)))
    with np.errstate(over="ignore", under="ignore"):
        for p in (y * y, y * np.float32(0.7), x):
            np.testing.assert_array_equal(_bits(_emu_tree64_warp(p)[:, 0::64]), _bits(_emu_tree64(p)[:, 0::64]))
    # control: the same butterflies with the stages in the other order (h = D / 2 .. 1) round
    # differently on these rows, so bit equality does pin the order
    v = np.array(x, dtype=np.float32)
    v.view(np.uint32)[:, _TAB["neg"][:d]] ^= np.uint32(0x80000000)
    t, h = np.arange(d), d // 2
    while h:
        o = v[:, t ^ h]
        v = np.where((t & h) == 0, v + o, o - v).astype(np.float32)
        h //= 2
    assert (_bits(v * _TAB["isqrt"][d]) != _bits(y)).any()


def _emu_fwht_regs(rows, inverse):
    """fwht_regs<D, NV, NI> (attention.cu's rotations, 128 threads) over ``rows [MAXG, D]``: thread
    t holds the flat values i = t + 128 k (k < NV; those with i >= NI = MAXG D are padding);
    stage h < 32: the shuffle partner t ^ h; 32 <= h < 128: the shared buffer at (t ^ h) + 128 k,
    written only below NI (asserted: no valid value reads padding); h >= 128: value k ^ (h / 128)
    of the same thread. Keeps x + o where the pair's bit is clear, o - x where it is set."""
    maxg, D = rows.shape
    NI = maxg * D
    NV = -(-NI // 128)
    x = np.zeros(128 * NV, np.float32)
    x[:NI] = rows.reshape(-1)
    x = x.reshape(NV, 128)
    t = np.arange(128)[None, :]
    k = np.arange(NV)[:, None]
    i = t + 128 * k
    neg = _TAB["neg"][i % D]
    if not inverse:
        x = np.where(neg, -x, x)
    h = 1
    while h < D:
        if h < 128:
            o = x[:, t[0] ^ h]
            if h >= 32:
                assert ((t ^ h) + 128 * k < NI)[i < NI].all()
            bit = (t & h) != 0
        else:
            o = x[k[:, 0] ^ (h // 128), :]
            bit = np.broadcast_to((k & (h // 128)) != 0, x.shape)
        x = np.where(bit, o - x, x + o).astype(np.float32)
        h *= 2
    x = x * _TAB["isqrt"][D]
    if inverse:
        x = np.where(neg, -x, x)
    return x.reshape(-1)[:NI].reshape(maxg, D)


def _emu_lse_unrotate(win, d):
    """lse_merge.cuh lse_unrotate over merge windows ``win [R, 256]`` (thread i holds element i;
    heads of d whole in the window): stages h < 32 with the shuffle partner i ^ h (x + o where bit h
    of the lane is clear, o - x where set), then thread i's column (its head's values c + 32 k, c =
    i % 32) through the stages h = 32 s in registers; its own entry times float32(1 / sqrt(d)),
    negated where the sign bit of dim i % d is set."""
    v = np.array(win, dtype=np.float32)
    i = np.arange(256)
    for h in (1, 2, 4, 8, 16):
        o = v[:, i ^ h]
        v = np.where((i & h) == 0, v + o, o - v).astype(np.float32)
    dd = i % d
    out = np.empty_like(v)
    for t in range(256):
        base, c = t - dd[t], dd[t] % 32
        x = [v[:, base + c + 32 * k].copy() for k in range(d // 32)]
        s = 1
        while s < d // 32:
            for k in range(d // 32):
                if k & s == 0:
                    x[k], x[k + s] = x[k] + x[k + s], x[k] - x[k + s]
            s *= 2
        out[:, t] = x[dd[t] // 32]
    out = out * np.float32(1.0 / np.sqrt(d))
    return np.where(_TAB["neg"][dd], -out, out).astype(np.float32)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_merge_unrotation_equals_fwht(d):
    """attn_merge's un-rotation of a rotated V tier's merged heads (lse_unrotate: every head of a
    256-element window at once) is fwht_shared's inverse bit for bit, and undoes the forward
    rotation; the words it reads are KV_SIGNS (cuda_kv.sign_words, tables_prefix's)."""
    rng = np.random.default_rng(d)
    heads = rng.standard_normal((5 * (256 // d), d)).astype(np.float32)
    got = _emu_lse_unrotate(heads.reshape(5, 256), d).reshape(-1, d)
    np.testing.assert_array_equal(_bits(got), _bits(_fwht(heads, True)))
    np.testing.assert_allclose(_emu_lse_unrotate(_fwht(heads, False).reshape(5, 256), d).reshape(-1, d), heads,
                               rtol=1e-5, atol=1e-5)
    words = cuda_kv.sign_words()
    bits = (words[np.arange(512) // 32] >> (np.arange(512) % 32)) & 1
    np.testing.assert_array_equal(bits.astype(bool), turbo.SIGNS[:512] < 0)
    assert "0x%08xu" % words[0] in cuda_kv.tables_prefix()


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("maxg", [1, 2, 4, 8])
def test_attention_register_rotation_equals_fwht(d, maxg):
    """The tier attention kernel's register rotation (fwht_regs: a query's rotation and the
    output's un-rotation, every head group size and head size, padding at 64 x 1) computes
    fwht_shared's transform bit for bit, and the inverse undoes the forward."""
    rng = np.random.default_rng(d * maxg)
    q = rng.standard_normal((maxg, d)).astype(np.float32)
    for inverse in (False, True):
        np.testing.assert_array_equal(_bits(_emu_fwht_regs(q, inverse)), _bits(_fwht(q, inverse)))
    np.testing.assert_allclose(_emu_fwht_regs(_emu_fwht_regs(q, False), True), q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_write_kernel_code_search_ties(bits):
    """The kernel's code search on u exactly at every midpoint (a tie takes the lower level,
    NumPy searchsorted side='left'), one ulp either side, +-0, subnormals, +-inf and NaN equals
    ``TurboTier.codes``."""
    t = get_tier(f"turbo{bits}")
    th = t.thresholds
    u = np.concatenate([th, np.nextafter(th, np.float32(np.inf)), np.nextafter(th, np.float32(-np.inf)),
                        np.array([0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39, np.inf, -np.inf, np.nan, 100, -100])
                        ]).astype(np.float32)
    np.testing.assert_array_equal(_emu_search(u, _TAB[f"KV_TH{bits}"]), t.codes(u))


def test_write_kernel_port_viterbi_equals_trellis():
    """The kernel's Viterbi (thread per state, strict-less group minimum, index-ordered final
    reduction) picks trellis.py's path, constrained and not, including all-equal targets where
    every path of a group costs the same."""
    from opencoti.engine.kv_tiers.trellis import _viterbi

    rng = np.random.default_rng(5)
    for k in (2, 3):
        cb = get_tier(f"turbo{k}_tcq").levels
        G = 1 << (8 - k)
        y = np.concatenate([rng.standard_normal((40, 64)), np.zeros((2, 64)), np.ones((2, 64)),
                            np.tile(cb[:64], (2, 1))]).astype(np.float32)
        np.testing.assert_array_equal(_emu_viterbi(y, cb, k), _viterbi(y, cb, k, 8))
        fix = rng.integers(0, G, len(y))
        np.testing.assert_array_equal(_emu_viterbi(y, cb, k, fix, fix), _viterbi(y, cb, k, 8, fix, fix))
