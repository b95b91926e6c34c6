"""Scalar KV tiers: float passthrough (f32, f16, bf16) and ggml's 32-value block formats.

Sources: llama.cpp ``ggml/src/ggml-common.h`` (block structs), ``ggml/src/ggml-quants.c``
(``quantize_row_q8_0_ref``, ``_q5_1_ref``, ``_q5_0_ref``, ``_q4_1_ref``, ``_q4_0_ref``,
``_iq4_nl_ref`` with ``quantize_row_iq4_nl_impl`` and ``best_index_int8``, the matching
``dequantize_row_*``, ``kvalues_iq4nl``), ``ggml/src/ggml-impl.h`` (``ggml_compute_fp32_to_bf16``), and
ik_llama.cpp ``ggml-quants.c`` (``quantize_row_q6_0_ref``, ``block_q6_0``). Quantization
follows those reference functions bit for bit (float32 arithmetic, ``roundf`` = round half
away from zero, ``(int8_t)`` casts truncate, f16 by round-to-nearest-even), so the bytes
equal what llama.cpp writes into its cache. Every block holds 32 values ``x[0..31]`` and
starts with its f16 scale ``d``; multi-byte fields are little-endian.

=====  ===========  ====  =====  ========================================================
type   bytes/block  bits  value  block layout (byte offsets)
=====  ===========  ====  =====  ========================================================
f32    4 / 1 value  32    x      native float32 (the cache keeps a float32 array)
f16    2 / 1 value  16    x      native float16 (the cache keeps a float16 array)
bf16   2 / 1 value  16    x      [0:2] bfloat16 bits (top half of the float32, rounded
                                 to nearest even; NaN stays a quiet NaN)
q8_0   34           8.5   d*q    [0:2] d = amax/127; [2:34] q int8, value j at 2+j,
                                 q = roundf(x/d)
q6_0   26           6.5   d*q    [0:2] d = max/-32 (max: the value of largest magnitude);
                                 [2:10] qh; [10:26] qs. q = min(63, trunc(x/d + 32.5)) in
                                 0..63, value = d*(q-32). qs[j] = (q_j & 15) | (q_{j+16} & 15)<<4
                                 (j < 16); high bits h_j = (q_j>>4) | (q_{j+16}>>4)<<2 go to
                                 qh[j % 8] at bit 4*(j / 8)
q5_1   24           6.0   d*q+m  [0:2] d = (max-min)/31; [2:4] m = min; [4:8] qh uint32;
                                 [8:24] qs. q = trunc((x-min)/d + 0.5) in 0..31.
                                 qs as q6_0's; bit 4 of q_j is bit j of qh
q5_0   22           5.5   d*q    [0:2] d = max/-16; [2:6] qh uint32; [6:22] qs.
                                 q = min(31, trunc(x/d + 16.5)), value = d*(q-16); qs/qh as q5_1
q4_1   20           5.0   d*q+m  [0:2] d = (max-min)/15; [2:4] m = min; [4:20] qs.
                                 q = min(15, trunc((x-min)/d + 0.5)); qs as q4_0's
q4_0   18           4.5   d*q    [0:2] d = max/-8; [2:18] qs. q = min(15, trunc(x/d + 8.5)),
                                 value = d*(q-8); qs[j] = q_j | q_{j+16}<<4
iq4_nl 18           4.5   d*K[q] [0:2] d; [2:18] qs as q4_0's; K = kvalues_iq4nl, 16 int8
                                 levels -127 .. 113. First d0 = max/-127 and q_j = the
                                 level index nearest x_j/d0 (best_index_int8: ties to the
                                 upper one); then the weighted least-squares scale
                                 d = sum(w q x) / sum(w q^2), w_j = x_j^2, the sums taken
                                 in order j = 0..31 (the reference with no importance
                                 matrix and ntry = -1: no scale search)
=====  ===========  ====  =====  ========================================================

In every type ``d`` (and ``m``) is stored as f16 and the 1/d used to quantize is
computed from the float32 ``d`` before that rounding, as ggml does; a block of zeros
has d = 0 and dequantizes to zeros. iq4_nl's reference skips a block whose largest
magnitude is below 1e-15 (``GROUP_MAX_EPS``): d = 0, and its codes are never set (what the
previous block of the call left in the scratch array, or uninitialised stack for the first);
here they are 8 (the level nearest 0, what ``best_index_int8(0)`` gives and what llama.cpp's
CUDA copy writes for a zero block), so such a block's bytes are ``00 00`` then sixteen
``88``. llama.cpp's CUDA copy (``quantize_f32_iq4_nl_block``) writes other iq4_nl bytes than
its CPU: no 1e-15 cut-off, sums of value pairs that nvcc may fuse, d0 when the second sum is
0; these tiers follow the CPU's reference on every backend. iq4_nl's sums are not contracted
into FMAs (as an x86-64 build of ggml-base, which has no FMA flags, computes them; an aarch64
build may contract them and differ in d's last bit).
"""

from __future__ import annotations

import numpy as np

from opencoti.engine.kv_tiers.base import KVTier, blocks_as_rows, f16_bytes, f16_from, to_blocks

QK = 32  # values per block in every ggml scalar format here


class NativeFloat(KVTier):
    """f32 / f16: rows stay a float array of that dtype (what the cache held before tiers existed)."""

    native = True
    family = "float"

    def __init__(self, name: str, dtype):
        self.name = name
        self.dtype = np.dtype(dtype)
        self.block_size = 1
        self.block_bytes = self.dtype.itemsize

    def quantize(self, x):
        """``x [..., d]`` -> the same values cast to ``dtype`` (f16: round to nearest even).
        Works on NumPy and CuPy arrays alike."""
        return x.astype(self.dtype)

    def dequantize(self, q):
        """``q [..., d]`` of ``dtype`` -> float32 (no copy for f32)."""
        return q.astype(np.float32, copy=False)


class BF16(KVTier):
    """bfloat16 as 2 little-endian bytes per value (ggml ``ggml_compute_fp32_to_bf16``)."""

    name = "bf16"
    family = "float"
    block_size = 1
    block_bytes = 2

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., 2d]``: round to nearest even, NaN -> quiet NaN."""
        u = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        h = np.where(nan, (u >> 16) | 64, r).astype(np.uint16)
        return h.view(np.uint8).reshape(*h.shape[:-1], -1)

    def dequantize(self, q):
        """uint8 ``[..., 2d]`` -> float32 ``[..., d]`` (exact)."""
        h = np.ascontiguousarray(q).view(np.uint16).astype(np.uint32)
        return (h << 16).view(np.float32)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: nearest integer, halves away from zero (exact in float32)."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= 0.5, np.sign(v), 0).astype(v.dtype)


def _signed_absmax(b: np.ndarray) -> np.ndarray:
    """Per block the value of largest magnitude, the first one on ties (ggml's ``amax < fabsf(v)`` scan):
    ``[n, 32]`` -> ``[n, 1]`` float32."""
    i = np.abs(b).argmax(axis=1)[:, None]
    return np.take_along_axis(b, i, axis=1)


def _inv(d: np.ndarray) -> np.ndarray:
    """``d ? 1/d : 0`` in float32."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)


def _min_scale(b: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The offset tiers' block fields (q5_1, q4_1): blocks ``[n, 32]`` -> (min, d = (max - min) /
    steps, 1/d or 0), each float32 ``[n, 1]``."""
    lo = b.min(axis=1, keepdims=True)
    d = ((b.max(axis=1, keepdims=True) - lo) / np.float32(steps)).astype(np.float32)
    return lo, d, _inv(d)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """codes ``[n, 32]`` (0..63) -> qs ``[n, 16]``: low nibble value j, high nibble value j+16."""
    return ((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)).astype(np.uint8)


def _unnibble(qs: np.ndarray) -> np.ndarray:
    """qs ``[n, 16]`` -> low 4 bits of the 32 codes ``[n, 32]`` (int32)."""
    qs = qs.astype(np.int32)
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _qh32(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of 32 codes -> ``qh`` uint32 as 4 little-endian bytes ``[n, 4]`` (bit j = value j)."""
    return np.packbits(((q >> 4) & 1).astype(np.uint8), axis=1, bitorder="little")


def _unqh32(qh: np.ndarray) -> np.ndarray:
    """``qh`` bytes ``[n, 4]`` -> bit 4 of each code, as 0/16 ``[n, 32]`` int32."""
    return np.unpackbits(qh, axis=1, bitorder="little").astype(np.int32) << 4


class Q8_0(KVTier):
    """ggml ``block_q8_0``: f16 d + 32 int8, 8.5 bits/value (see the module table)."""

    name, family, block_size, block_bytes = "q8_0", "scalar", QK, 34

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/32*34]`` (``quantize_row_q8_0_ref``)."""
        b, lead = to_blocks(x, QK)
        d = (np.abs(b).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
        q = _roundf(b * _inv(d)).astype(np.int8)
        return blocks_as_rows(np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=1), lead)

    def dequantize(self, q):
        """uint8 ``[..., n*34]`` -> float32 ``[..., n*32]``."""
        b, lead = _byte_blocks(q, self.block_bytes)
        v = b[:, 2:].view(np.int8).astype(np.float32) * f16_from(b[:, :2])
        return blocks_as_rows(v, lead)


class Q6_0(KVTier):
    """ik_llama.cpp ``block_q6_0``: f16 d + 8 bytes qh + 16 bytes qs, 6.5 bits/value."""

    name, family, block_size, block_bytes = "q6_0", "scalar", QK, 26

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/32*26]`` (``quantize_row_q6_0_ref``)."""
        b, lead = to_blocks(x, QK)
        d = (_signed_absmax(b) / np.float32(-32)).astype(np.float32)
        q = np.minimum(63, np.trunc(b * _inv(d) + np.float32(32.5))).astype(np.int32)
        h = (q[:, :16] >> 4) | ((q[:, 16:] >> 4) << 2)  # [n, 16], 4 bits each
        qh = (h[:, :8] | (h[:, 8:] << 4)).astype(np.uint8)  # qh[j % 8] |= h_j << 4*(j/8)
        return blocks_as_rows(np.concatenate([f16_bytes(d), qh, _nibbles(q)], axis=1), lead)

    def dequantize(self, q):
        """uint8 ``[..., n*26]`` -> float32 ``[..., n*32]``."""
        b, lead = _byte_blocks(q, self.block_bytes)
        qh = b[:, 2:10].astype(np.int32)
        h = np.concatenate([qh & 15, qh >> 4], axis=1)  # h_j for j < 16
        hi = np.concatenate([(h & 3) << 4, ((h >> 2) & 3) << 4], axis=1)
        v = (_unnibble(b[:, 10:26]) | hi) - 32
        return blocks_as_rows(v.astype(np.float32) * f16_from(b[:, :2]), lead)


class Q5_1(KVTier):
    """ggml ``block_q5_1``: f16 d, f16 m, uint32 qh, 16 bytes qs, 6 bits/value."""

    name, family, block_size, block_bytes = "q5_1", "scalar", QK, 24

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/32*24]`` (``quantize_row_q5_1_ref``)."""
        b, lead = to_blocks(x, QK)
        lo, d, inv = _min_scale(b, 31)
        q = np.trunc((b - lo) * inv + np.float32(0.5)).astype(np.int32)
        return blocks_as_rows(np.concatenate([f16_bytes(d), f16_bytes(lo), _qh32(q), _nibbles(q)], axis=1), lead)

    def dequantize(self, q):
        """uint8 ``[..., n*24]`` -> float32 ``[..., n*32]``."""
        b, lead = _byte_blocks(q, self.block_bytes)
        v = _unnibble(b[:, 8:24]) | _unqh32(b[:, 4:8])
        return blocks_as_rows(v.astype(np.float32) * f16_from(b[:, :2]) + f16_from(b[:, 2:4]), lead)


class Q5_0(KVTier):
    """ggml ``block_q5_0``: f16 d, uint32 qh, 16 bytes qs, 5.5 bits/value."""

    name, family, block_size, block_bytes = "q5_0", "scalar", QK, 22

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/32*22]`` (``quantize_row_q5_0_ref``)."""
        b, lead = to_blocks(x, QK)
        d = (_signed_absmax(b) / np.float32(-16)).astype(np.float32)
        q = np.minimum(31, np.trunc(b * _inv(d) + np.float32(16.5))).astype(np.int32)
        return blocks_as_rows(np.concatenate([f16_bytes(d), _qh32(q), _nibbles(q)], axis=1), lead)

    def dequantize(self, q):
        """uint8 ``[..., n*22]`` -> float32 ``[..., n*32]``."""
        b, lead = _byte_blocks(q, self.block_bytes)
        v = (_unnibble(b[:, 6:22]) | _unqh32(b[:, 2:6])) - 16
        return blocks_as_rows(v.astype(np.float32) * f16_from(b[:, :2]), lead)


class Q4_0(KVTier):
    """ggml ``block_q4_0``: f16 d + 16 bytes of nibbles, 4.5 bits/value."""

    name, family, block_size, block_bytes = "q4_0", "scalar", QK, 18

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/32*18]`` (``quantize_row_q4_0_ref``)."""
        b, lead = to_blocks(x, QK)
        d = (_signed_absmax(b) / np.float32(-8)).astype(np.float32)
        q = np.minimum(15, np.trunc(b * _inv(d) + np.float32(8.5))).astype(np.int32)
        return blocks_as_rows(np.concatenate([f16_bytes(d), _nibbles(q)], axis=1), lead)

    def dequantize(self, q):
        """uint8 ``[..., n*18]`` -> float32 ``[..., n*32]``."""
        b, lead = _byte_blocks(q, self.block_bytes)
        v = _unnibble(b[:, 2:18]) - 8
        return blocks_as_rows(v.astype(np.float32) * f16_from(b[:, :2]), lead)


class Q4_1(KVTier):
    """ggml ``block_q4_1``: f16 d, f16 m, 16 bytes of nibbles, 5 bits/value."""

    name, family, block_size, block_bytes = "q4_1", "scalar", QK, 20

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/32*20]`` (``quantize_row_q4_1_ref``)."""
        b, lead = to_blocks(x, QK)
        lo, d, inv = _min_scale(b, 15)
        q = np.minimum(15, np.trunc((b - lo) * inv + np.float32(0.5))).astype(np.int32)
        return blocks_as_rows(np.concatenate([f16_bytes(d), f16_bytes(lo), _nibbles(q)], axis=1), lead)

    def dequantize(self, q):
        """uint8 ``[..., n*20]`` -> float32 ``[..., n*32]``."""
        b, lead = _byte_blocks(q, self.block_bytes)
        v = _unnibble(b[:, 4:20])
        return blocks_as_rows(v.astype(np.float32) * f16_from(b[:, :2]) + f16_from(b[:, 2:4]), lead)


# ggml-common.h kvalues_iq4nl: iq4_nl's 16 levels (a non-uniform 4-bit codebook, in units of d)
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
IQ4_NL_EPS = np.float32(1e-15)  # ggml-quants.c GROUP_MAX_EPS: a block below it gets d = 0


def best_index_iq4nl(x: np.ndarray) -> np.ndarray:
    """ggml ``best_index_int8(16, kvalues_iq4nl, x)``: the index of the level nearest each
    float32 ``x`` (any shape) -> int32 of that shape. Below the first level 0, above the last 15;
    between levels ``v[m-1] <= x < v[m]`` the lower one when ``x - v[m-1] < v[m] - x`` (float32
    differences), else the upper one, so an exact midpoint goes up; NaN gives 15."""
    x = np.asarray(x, dtype=np.float32)
    v = IQ4_NL_LEVELS
    m = np.clip(np.searchsorted(v, x, side="right"), 1, 15)
    lower = (x - v[m - 1]) < (v[m] - x)
    i = np.where(lower, m - 1, m)
    i = np.where(x <= v[0], 0, np.where(x >= v[15], 15, i))
    return np.where(np.isnan(x), 15, i).astype(np.int32)


class IQ4_NL(KVTier):
    """ggml ``block_iq4_nl``: f16 d + 16 bytes of nibbles indexing ``kvalues_iq4nl``,
    4.5 bits/value (see the module table)."""

    name, family, block_size, block_bytes = "iq4_nl", "scalar", QK, 18

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/32*18]`` (``quantize_row_iq4_nl_ref``)."""
        b, lead = to_blocks(x, QK)
        mx = _signed_absmax(b)
        live = np.abs(mx) >= IQ4_NL_EPS  # [n, 1]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d0 = (mx / IQ4_NL_LEVELS[0]).astype(np.float32)
            q = best_index_iq4nl(np.where(live, (np.float32(1) / d0) * b, np.float32(0)))
            lv = IQ4_NL_LEVELS[q]
            w = b * b
            sqx = np.zeros(len(b), np.float32)
            sq2 = np.zeros(len(b), np.float32)
            for j in range(QK):  # in order, one rounding per operation (the reference's loop)
                wq = w[:, j] * lv[:, j]
                sqx = sqx + wq * b[:, j]
                sq2 = sq2 + wq * lv[:, j]
            d = np.where(live[:, 0], sqx / sq2, np.float32(0)).astype(np.float32)[:, None]
        return blocks_as_rows(np.concatenate([f16_bytes(d), _nibbles(q)], axis=1), lead)

    def dequantize(self, q):
        """uint8 ``[..., n*18]`` -> float32 ``[..., n*32]``."""
        b, lead = _byte_blocks(q, self.block_bytes)
        v = IQ4_NL_LEVELS[_unnibble(b[:, 2:18])]
        return blocks_as_rows(v * f16_from(b[:, :2]), lead)


def _byte_blocks(q: np.ndarray, block_bytes: int) -> tuple[np.ndarray, tuple]:
    """Stored rows uint8 ``[..., n*block_bytes]`` -> (``[N, block_bytes]``, leading shape)."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    return q.reshape(-1, block_bytes), q.shape[:-1]


TIERS = [NativeFloat("f32", np.float32), NativeFloat("f16", np.float16), BF16(),
         Q8_0(), Q6_0(), Q5_1(), Q5_0(), Q4_1(), Q4_0(), IQ4_NL()]
