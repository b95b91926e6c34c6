"""KV tier storage formats (opencoti.engine.kv_tiers): layouts, round trips, ggml agreement.

- every tier: sizes per block/row, quantize -> dequantize error within bounds measured
  on Gaussian rows (and on rows with outlier channels, where the rotation matters);
- q8_0 / q4_0 / q6_0: bytes of hand-computed blocks (ties, clamps, nibble and qh order);
- q8_0, q4_1, q4_0, q5_0, q5_1, bf16: bytes and values equal gguf-py's independent
  implementation (``gguf.quants``), which mirrors ggml's reference quantizers; iq4_nl's
  values equal its dequantizer (gguf-py has no iq4_nl quantizer: hand blocks, the level
  search's ties and the least-squares scale are checked instead);
- turbo / tcq: a decoder written here from the module docs' byte layout, rotation and
  trellis definition reproduces the tiers' dequantize; the rotation is orthonormal and
  is the butterfly fast Walsh-Hadamard transform; scores can be taken in the rotated domain;
- the Viterbi search is exact (brute force on a small trellis);
- the shipped tables equal the generator's output.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf import quants as gq

from opencoti.engine.kv_tiers import TIER_NAMES, _registry, _tables, convert, get_tier

# (block_size, block_bytes) per tier
LAYOUT = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q6_0": (32, 26), "q5_1": (32, 24),
    "q5_0": (32, 22), "q4_1": (32, 20), "q4_0": (32, 18), "iq4_nl": (32, 18), "turbo8": (64, 66), "turbo4": (64, 34),
    "turbo3": (64, 26),
    "turbo2": (64, 18), "turbo3_tcq": (64, 26), "turbo2_tcq": (64, 18),
}

# relative squared error sum((x - x')^2) / sum(x^2) measured on the rows of _rows() (Gaussian;
# Gaussian with every 37th channel x8), bounds = measurement x 1.25
ROUND_TRIP = {
    "f32": (0.0, 0.0), "f16": (4.34e-08, 4.02e-08), "bf16": (2.76e-06, 2.67e-06),
    "q8_0": (2.85e-05, 1.09e-04), "q6_0": (4.55e-04, 1.69e-03), "q5_1": (1.45e-03, 2.65e-03),
    "q5_0": (1.85e-03, 6.84e-03), "q4_1": (6.15e-03, 1.14e-02), "q4_0": (7.47e-03, 2.67e-02),
    "iq4_nl": (6.13e-03, 1.49e-02), "turbo8": (3.66e-05, 3.51e-05),
    "turbo4": (8.65e-03, 8.21e-03), "turbo3": (3.14e-02, 2.91e-02), "turbo2": (1.10e-01, 9.97e-02),
    "turbo3_tcq": (2.19e-02, 2.09e-02), "turbo2_tcq": (8.14e-02, 7.83e-02),
}


def _rows():
    rng = np.random.default_rng(123)
    x = rng.standard_normal((64, 2, 128)).astype(np.float32)
    return x, x * np.where(np.arange(128) % 37 == 0, 8, 1).astype(np.float32)


def test_registry_and_errors():
    assert tuple(_registry()) == TIER_NAMES
    with pytest.raises(ValueError, match="allowed: f32, f16, bf16, q8_0"):
        get_tier("q3_0")
    assert get_tier("Q8_0") is get_tier("q8_0")
    with pytest.raises(ValueError, match="power of two"):
        get_tier("turbo3").check_dim(96)
    with pytest.raises(ValueError, match="head size 48 is not a multiple of 32"):
        get_tier("q4_0").check_dim(48)


@pytest.mark.parametrize("name", TIER_NAMES)
def test_sizes(name):
    t = get_tier(name)
    assert (t.block_size, t.block_bytes) == LAYOUT[name]
    assert t.bits_per_value == 8 * t.block_bytes / t.block_size
    assert t.bytes_per_row(256) == 256 // t.block_size * t.block_bytes
    q = t.quantize(np.ones((3, 2, 128), np.float32))
    assert q.shape == (3, 2, t.row_len(128)) and q.dtype == t.dtype
    assert q.nbytes == 3 * 2 * t.bytes_per_row(128)
    assert t.dim_of(q.shape[-1]) == 128


@pytest.mark.parametrize("name", TIER_NAMES)
def test_round_trip_error(name):
    for x, bound in zip(_rows(), ROUND_TRIP[name]):
        t = get_tier(name)
        y = t.dequantize(t.quantize(x))
        assert y.shape == x.shape and y.dtype == np.float32
        rel = float(((x - y) ** 2).sum() / (x ** 2).sum())
        assert rel <= bound * 1.25, (name, rel, bound)
    # zeros stay zeros
    z = np.zeros((2, 1, 128), np.float32)
    assert np.array_equal(t.dequantize(t.quantize(z)), z)


def test_q8_0_hand_block():
    # amax 127 -> d = 1, 1/d = 1: the codes are roundf(x), halves away from zero
    x = np.zeros(32, np.float32)
    x[:8] = [127, 2.5, -2.5, 0.5, -0.5, 1.49, -126.6, 3.0]
    want_q = [127, 3, -3, 1, -1, 1, -127, 3] + [0] * 24
    want = struct.pack("<e", 1.0) + struct.pack("<32b", *want_q)
    got = get_tier("q8_0").quantize(x[None])[0]
    assert got.tobytes() == want
    # a general scale: d = amax / 127 in float32, stored as f16
    x2 = np.linspace(-3, 2, 32, dtype=np.float32)
    d = np.float32(3) / np.float32(127)
    q = [int(np.trunc(v)) + (int(np.sign(v)) if abs(v - np.trunc(v)) >= 0.5 else 0)
         for v in (x2 * (np.float32(1) / d)).astype(np.float32)]
    assert get_tier("q8_0").quantize(x2[None])[0].tobytes() == struct.pack("<e", d) + struct.pack("<32b", *q)


def test_q4_0_hand_block():
    # max by magnitude is -8 -> d = -8 / -8 = 1; code = min(15, trunc(x + 8.5)); value = (code - 8) * d
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2], x[3], x[4] = -8, 7.4, 7.6, 0.49, -0.5
    x[16], x[17], x[31] = 3.0, -7.9, 0.5
    codes = [int(min(15, np.trunc(np.float32(v) + np.float32(8.5)))) for v in x]
    assert codes[:5] == [0, 15, 15, 8, 8] and codes[16] == 11 and codes[17] == 0 and codes[31] == 9
    qs = bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
    got = get_tier("q4_0").quantize(x[None])[0]
    assert got.tobytes() == struct.pack("<e", 1.0) + qs
    np.testing.assert_array_equal(get_tier("q4_0").dequantize(got[None])[0], np.array(codes, np.float32) - 8)


def test_q6_0_hand_block():
    # x_j = 2j - 32: max by magnitude -32 -> d = 1, code q_j = trunc(x_j + 32.5) = 2j
    x = (2 * np.arange(32) - 32).astype(np.float32)
    q = 2 * np.arange(32)
    qs = bytes(int((q[j] & 15) | ((q[j + 16] & 15) << 4)) for j in range(16))
    qh = bytearray(8)
    for j in range(16):
        h = (q[j] >> 4) | ((q[j + 16] >> 4) << 2)
        qh[j % 8] |= int(h) << (4 * (j // 8))
    got = get_tier("q6_0").quantize(x[None])[0]
    assert got.tobytes() == struct.pack("<e", 1.0) + bytes(qh) + qs
    np.testing.assert_array_equal(get_tier("q6_0").dequantize(got[None])[0], x)


def _edge_blocks():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 32)).astype(np.float32) * rng.uniform(0.01, 30, (40, 1)).astype(np.float32)
    x[0] = 0
    x[1] = np.float32(0.5) * np.arange(-16, 16)  # halves
    x[2, 5] = 1e4  # one outlier
    x[3] = -3.0  # constant block (q5_1: max == min)
    return x.reshape(10, 128)


@pytest.mark.parametrize("name,qtype", [("q8_0", GQ.Q8_0), ("q4_0", GQ.Q4_0), ("q5_0", GQ.Q5_0),
                                        ("q5_1", GQ.Q5_1), ("q4_1", GQ.Q4_1), ("bf16", GQ.BF16)])
def test_agrees_with_gguf_quants(name, qtype):
    t = get_tier(name)
    x = _edge_blocks()
    ours = t.quantize(x)
    ref = gq.quantize(x, qtype)
    assert ours.shape == ref.shape and np.array_equal(ours, ref)
    np.testing.assert_array_equal(t.dequantize(ours), gq.dequantize(ref, qtype))


def test_iq4_nl_dequantizes_as_gguf():
    t = get_tier("iq4_nl")
    q = t.quantize(_edge_blocks())
    np.testing.assert_array_equal(t.dequantize(q), gq.dequantize(q, GQ.IQ4_NL))


# sha256 of the bytes ggml's reference writes for _ggml_pin_blocks(): quantize_row_iq4_nl_ref /
# quantize_row_q4_1_ref (ggml-quants.c) transcribed to C and built with gcc -O2 -ffp-contract=off
# (an x86-64 build of ggml-base: no FMA), session 47
GGML_PIN = {"iq4_nl": "64dacb39ac3f6043428788467226d7bea0144e55d0620aba68b22e53ef3659f7",
            "q4_1": "7f6bb30de2580159afe65ae074b6c6a597e73303a819cb83743efac9f4ef4b92"}


def _ggml_pin_blocks():
    """100,000 Gaussian blocks at scales 1e-3 .. 1e3, 64 with x / d0 on iq4_nl's midpoints (d0 a
    power of two: the level search's ties) and 64 of exact halves (q4_1's + 0.5 truncation)."""
    from opencoti.engine.kv_tiers.scalar import IQ4_NL_LEVELS

    rng = np.random.default_rng(2026)
    x = rng.standard_normal((100000, 32)) * 10.0 ** rng.uniform(-3, 3, (100000, 1))
    mids = (IQ4_NL_LEVELS[:-1] + IQ4_NL_LEVELS[1:]) / 2
    ties = np.stack([np.concatenate([[-127], mids, mids[::-1], [0]]) * 2.0 ** (i % 16 - 8) for i in range(64)])
    halves = np.round(rng.standard_normal((64, 32)) * 8) / 2
    return np.concatenate([x, ties, halves]).astype(np.float32)


@pytest.mark.parametrize("name", ["iq4_nl", "q4_1"])
def test_bytes_equal_ggml_reference(name):
    """Our bytes equal ggml's reference quantizer's on 100,128 blocks (a digest of them, taken from
    a C build of the reference): the level search, its ties, the in-order float32 sums of
    iq4_nl's scale (a pairwise sum differs in the last bit of a few dozen d's) and q4_1's clamp."""
    import hashlib

    q = get_tier(name).quantize(_ggml_pin_blocks())
    assert hashlib.sha256(np.ascontiguousarray(q).tobytes()).hexdigest() == GGML_PIN[name]


def test_iq4_nl_hand_block():
    """x_j = level_{j % 16} / 4: max by magnitude -31.75 (first at j = 0) -> d0 = 1/4, codes j % 16
    (each value sits on its level); w q^2 = 4 w q x term by term, so the least-squares d is 1/4
    exactly. A block below 1e-15 in magnitude: d = 0 and every code 8 (the level nearest 0)."""
    from opencoti.engine.kv_tiers.scalar import IQ4_NL_LEVELS

    t = get_tier("iq4_nl")
    x = IQ4_NL_LEVELS[np.arange(32) % 16] / np.float32(4)
    got = t.quantize(x[None])[0]
    assert got.tobytes() == struct.pack("<e", 0.25) + bytes(j | j << 4 for j in range(16))
    np.testing.assert_array_equal(t.dequantize(got[None])[0], x)
    for tiny in (0.0, 9e-16, -9e-16):
        z = np.full((1, 32), tiny, np.float32)
        assert t.quantize(z)[0].tobytes() == b"\x00\x00" + b"\x88" * 16
    assert t.quantize(np.full((1, 32), 1e-15, np.float32))[0, :2].tobytes() != b"\x00\x00"


def test_iq4_nl_level_search():
    """best_index_int8: below / above the range -> 0 / 15, an exact midpoint -> the upper level,
    NaN -> 15; elsewhere the nearest level (float64 brute force where the two distances differ)."""
    from opencoti.engine.kv_tiers.scalar import IQ4_NL_LEVELS as v
    from opencoti.engine.kv_tiers.scalar import best_index_iq4nl

    x = np.array([-500, -127, -115.5, -115.6, 7.0, 6.99, 101.0, 113, 1e9, np.nan, 1.0, -10.0], np.float32)
    assert best_index_iq4nl(x).tolist() == [0, 0, 1, 0, 9, 8, 15, 15, 15, 15, 8, 7]
    r = np.random.default_rng(0).uniform(-140, 130, 20000).astype(np.float32)
    dist = np.abs(r.astype(np.float64)[:, None] - v.astype(np.float64)[None])
    srt = np.sort(dist, axis=1)
    clear = srt[:, 1] - srt[:, 0] > 1e-3
    np.testing.assert_array_equal(best_index_iq4nl(r)[clear], dist.argmin(axis=1)[clear])


def test_iq4_nl_scale_is_the_weighted_least_squares_one():
    """quantize_row_iq4_nl_ref (ntry = -1): codes are the nearest levels of x / d0 with d0 = max /
    -127, and d minimises sum x^2 (x - d q)^2 over those codes: d = sum(x^3 q) / sum(x^2 q^2)
    (float64 here, to float32 rounding of the in-order sums)."""
    from opencoti.engine.kv_tiers.scalar import IQ4_NL_LEVELS, best_index_iq4nl

    t = get_tier("iq4_nl")
    x = _edge_blocks().reshape(-1, 32)[1:]
    b = t.quantize(x).reshape(-1, 18)
    codes = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1)
    mx = np.take_along_axis(x, np.abs(x).argmax(1)[:, None], 1)
    d0 = (mx / np.float32(-127)).astype(np.float32)
    np.testing.assert_array_equal(codes, best_index_iq4nl((np.float32(1) / d0) * x))
    q = IQ4_NL_LEVELS[codes].astype(np.float64)
    x64 = x.astype(np.float64)
    d = (x64 ** 3 * q).sum(1) / (x64 ** 2 * q ** 2).sum(1)
    np.testing.assert_allclose(np.frombuffer(b[:, :2].tobytes(), np.float16).astype(np.float64), d, rtol=2e-3)


# -- rotated tiers ---------------------------------------------------------------------------
def _fwht(x):
    """In-place butterfly fast Walsh-Hadamard transform over the last axis (natural order)."""
    x = x.astype(np.float64).copy()
    d = x.shape[-1]
    h = 1
    while h < d:
        for i in range(0, d, 2 * h):
            a = x[..., i:i + h].copy()
            b = x[..., i + h:i + 2 * h].copy()
            x[..., i:i + h], x[..., i + h:i + 2 * h] = a + b, a - b
        h *= 2
    return x


def _signs(d):
    bits = np.unpackbits(np.frombuffer(bytes.fromhex(_tables.SIGNS_HEX), np.uint8), bitorder="little")
    return 1.0 - 2.0 * bits[:d]


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_rotation_is_signed_fwht_and_orthonormal(d):
    from opencoti.engine.kv_tiers.turbo import rotate, unrotate

    x = np.random.default_rng(d).standard_normal((3, d)).astype(np.float32)
    want = _fwht(x * _signs(d)) / np.sqrt(d)
    np.testing.assert_allclose(rotate(x), want, atol=2e-5)
    np.testing.assert_allclose(unrotate(rotate(x)), x, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(rotate(x), axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)


def _decode_turbo_doc(row: bytes, bits: int, d: int) -> np.ndarray:
    """turbo{bits} row -> values, written from turbo.py's docstring only."""
    levels = np.array(_tables.LLOYD_MAX[bits], np.float32)
    nb = 2 + 64 * bits // 8
    y = []
    for b in range(d // 64):
        blk = row[b * nb:(b + 1) * nb]
        scale = np.float32(struct.unpack("<e", blk[:2])[0])
        for j in range(64):
            if bits == 2:
                idx = (blk[2 + j // 4] >> (2 * (j % 4))) & 3
            elif bits == 3:
                idx = ((blk[2 + j // 4] >> (2 * (j % 4))) & 3) | (((blk[18 + j // 8] >> (j % 8)) & 1) << 2)
            elif bits == 4:
                idx = (blk[2 + j // 2] >> (4 * (j % 2))) & 15
            else:
                idx = blk[2 + j]
            y.append(scale * levels[idx])
    y = np.array(y, np.float64)
    return _signs(d) * _fwht(y) / np.sqrt(d)  # x = diag(s) H y / sqrt(d)


def _decode_tcq_doc(row: bytes, k: int, d: int) -> np.ndarray:
    """turbo{k}_tcq row -> values, written from tcq.py's docstring only (L = 8)."""
    cb = np.array(_tables.TCQ[k], np.float32)
    nb, n_bits = 2 + 8 * k, 64 * k
    y = []
    for b in range(d // 64):
        blk = row[b * nb:(b + 1) * nb]
        scale = np.float32(struct.unpack("<e", blk[:2])[0])
        bit = [(blk[2 + i // 8] >> (i % 8)) & 1 for i in range(n_bits)]
        for t in range(64):
            s = sum(bit[(t * k + j) % n_bits] << j for j in range(8))
            y.append(scale * cb[s])
    y = np.array(y, np.float64)
    return _signs(d) * _fwht(y) / np.sqrt(d)


@pytest.mark.parametrize("name", ["turbo2", "turbo3", "turbo4", "turbo8", "turbo2_tcq", "turbo3_tcq"])
def test_rotated_layout_matches_docs(name):
    t = get_tier(name)
    d = 128
    x = np.random.default_rng(11).standard_normal((2, d)).astype(np.float32) * 3
    q = t.quantize(x)
    got = t.dequantize(q)
    for r in range(2):
        if t.family == "tcq":
            want = _decode_tcq_doc(q[r].tobytes(), t.k, d)
        else:
            want = _decode_turbo_doc(q[r].tobytes(), t.bits, d)
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_turbo_zero_block_as_documented(bits):
    """turbo.py: a zero block's u are the middle threshold, so its codes are the level below it
    (negative) and its scale is -0 (f16 bytes 00 80); it decodes to zeros. A block with values
    gets a positive scale."""
    t = get_tier(f"turbo{bits}")
    q = t.quantize(np.zeros((1, 128), np.float32))
    assert q.shape == (1, 2 * t.block_bytes)
    for b in range(2):
        blk = q[0, b * t.block_bytes:(b + 1) * t.block_bytes]
        assert blk[:2].tolist() == [0x00, 0x80]
    mid = len(t.levels) // 2 - 1  # the level just below 0, whose threshold above is 0
    assert t.levels[mid] < 0 < t.levels[mid + 1] and t.thresholds[mid] == 0
    assert t.codes(np.zeros(3, np.float32)).tolist() == [mid] * 3
    np.testing.assert_array_equal(t.dequantize(q), 0.0)
    x = np.zeros((1, 128), np.float32)
    x[0, 3] = 1.0  # rotated: every coordinate of both blocks +-1 / sqrt(128), no zero block
    assert np.frombuffer(t.quantize(x)[0, :2].tobytes(), np.float16)[0] > 0


@pytest.mark.parametrize("name", ["turbo3", "turbo3_tcq"])
def test_scores_in_the_rotated_domain(name):
    """q . k = (R q) . (R k): scoring against dequantize_rotated rows needs no inverse transform."""
    from opencoti.engine.kv_tiers.turbo import rotate

    t = get_tier(name)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((20, 256)).astype(np.float32)
    q = rng.standard_normal((256,)).astype(np.float32)
    stored = t.quantize(k)
    np.testing.assert_allclose(t.dequantize(stored) @ q, t.dequantize_rotated(stored) @ rotate(q), rtol=1e-4,
                               atol=1e-3)


def test_viterbi_is_exact_on_a_small_trellis():
    from itertools import product

    from opencoti.engine.kv_tiers.trellis import _viterbi

    k, L, n = 1, 3, 5
    rng = np.random.default_rng(2)
    cb = rng.standard_normal(1 << L).astype(np.float32)
    y = rng.standard_normal((6, n)).astype(np.float32)
    path = _viterbi(y, cb, k, L)
    for r in range(len(y)):
        best = np.inf
        for bits in product((0, 1), repeat=L + (n - 1) * k):  # every stream, free start
            st = [sum(bits[t * k + j] << j for j in range(L)) for t in range(n)]
            best = min(best, float(((y[r] - cb[st]) ** 2).sum()))
        got = float(((y[r] - cb[path[r]]) ** 2).sum())
        assert got == pytest.approx(best, rel=1e-6)
        assert all(path[r, t + 1] & ((1 << (L - k)) - 1) == path[r, t] >> k for t in range(n - 1))


def test_viterbi_ties_take_the_lowest_state():
    """Equal costs (a codebook with repeated levels) resolve to the lowest state index, as NumPy's
    argmin, at the last step (the path's end state) and along the path (each group's predecessor):
    the kernels break ties the same way (kv_rot.comp, kv_write.cu)."""
    from opencoti.engine.kv_tiers.trellis import _viterbi

    cb = np.array([1.0, 0.0, 0.0, 1.0], np.float32)  # L = 2: states 1 and 2 both code 0
    assert _viterbi(np.zeros((1, 1), np.float32), cb, 1, 2).tolist() == [[1]]
    # two steps: end states 1 (after 2) and 2 (after 1) both cost 0; the end takes 1
    assert _viterbi(np.zeros((1, 2), np.float32), cb, 1, 2).tolist() == [[2, 1]]
    # one level: every path costs the same; the end and each predecessor take the lowest, state 0
    assert _viterbi(np.zeros((1, 3), np.float32), np.zeros(4, np.float32), 1, 2).tolist() == [[0, 0, 0]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_turbo_codes_are_nearest_levels_at_the_midpoints(bits):
    """The decision thresholds are the float32 midpoints of adjacent (f16-valued) levels, exactly:
    a value on a midpoint takes the lower level, its float32 neighbours the nearer one."""
    t = get_tier(f"turbo{bits}")
    lv = t.levels.astype(np.float64)
    mid = ((lv[1:] + lv[:-1]) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64) * 2, lv[1:] + lv[:-1])  # exact in float32
    i = np.arange(len(mid))
    assert np.array_equal(t.codes(mid), i)
    assert np.array_equal(t.codes(np.nextafter(mid, np.float32(-np.inf))), i)
    assert np.array_equal(t.codes(np.nextafter(mid, np.float32(np.inf))), i + 1)


def test_bf16_nan_stays_a_quiet_nan():
    """ggml_compute_fp32_to_bf16: a NaN keeps its sign and top payload bits and gets the quiet bit
    (0x40 of the high half), so a signalling NaN whose payload sits in the low half does not round
    to infinity; infinities and the largest finite values round as any other value."""
    t = get_tier("bf16")
    bits = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F800000] + [0] * 25,
                    np.uint32)
    got = t.quantize(bits.view(np.float32)[None])[0].view(np.uint16)
    assert got[:7].tolist() == [0x7FC0, 0xFFC0, 0x7FC0, 0x7F80, 0xFF80, 0x7F80, 0x3F80]
    back = t.dequantize(got.view(np.uint8)[None])[0]
    assert np.isnan(back[:3]).all() and back[3] == np.inf and back[4] == -np.inf and back[6] == 1.0


def test_tcq_streams_are_tail_biting():
    from opencoti.engine.kv_tiers.trellis import trellis_encode

    t = get_tier("turbo3_tcq")
    u = np.random.default_rng(4).standard_normal((50, 64)).astype(np.float32)
    st = trellis_encode(u, t.levels, 3)
    assert np.array_equal(st[:, 0] & 31, st[:, -1] >> 3)
    assert np.array_equal(t.stream_to_states(t.states_to_stream(st)), st)


def test_convert_to_tail_tier():
    x = np.random.default_rng(9).standard_normal((4, 2, 128)).astype(np.float32)
    q8 = get_tier("q8_0").quantize(x)
    assert np.array_equal(convert(q8, "q8_0", "q4_0"), get_tier("q4_0").quantize(get_tier("q8_0").dequantize(q8)))
    same = convert(q8, "q8_0", "q8_0")
    assert np.array_equal(same, q8) and same is not q8
    t3 = get_tier("turbo3").quantize(x)
    t2 = convert(t3, "turbo3", "turbo2")
    assert t2.shape == (4, 2, get_tier("turbo2").bytes_per_row(128))
    y = get_tier("turbo2").dequantize(t2)
    assert ((x - y) ** 2).sum() / (x ** 2).sum() < 0.2


def test_shipped_tables_equal_the_generator():
    from opencoti.engine.kv_tiers import codebooks

    gen = codebooks.generate()
    assert codebooks.render(gen) == open(_tables.__file__).read()
    # and the codebooks are what their docs claim: symmetric ascending levels, unit variance data
    for bits, lv in gen["lloyd_max"].items():
        assert np.all(np.diff(lv) > 0) and np.allclose(lv, -lv[::-1])
        # f16 numbers (the CUDA kernels' exact MMA operands), within 4.4e-4 of the float32 optimum
        np.testing.assert_array_equal(lv.astype(np.float16).astype(np.float32), lv)
    u = codebooks.sphere_blocks(512, seed=1)
    for bits in (2, 3):  # Lloyd-Max MSE on the block distribution: ~0.113 (2 bits), ~0.0325 (3 bits)
        lv = gen["lloyd_max"][bits]
        idx = np.searchsorted((lv[1:] + lv[:-1]) / 2, u)
        assert np.mean((u - lv[idx]) ** 2) < {2: 0.12, 3: 0.035}[bits]


def test_turbo_levels_scaled_are_f16():
    """The CUDA stream kernel multiplies P's lo term (scaled by 2^11) by the turbo2/3/4 levels
    times 2^-11 in f16 (kv_codes.cuh, KvCodes<KTurbo> PD): exact only while every such level
    stays on f16's grid, subnormals included."""
    for bits in (2, 3, 4):
        lv = get_tier(f"turbo{bits}").levels.astype(np.float64)
        scaled = lv * 2.0 ** -11
        np.testing.assert_array_equal(scaled.astype(np.float16).astype(np.float64), scaled)
