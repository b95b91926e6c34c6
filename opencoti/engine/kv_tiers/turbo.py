"""TurboQuant KV tiers turbo2 / turbo3 / turbo4 / turbo8: a rotation of the head vector,
then a Lloyd–Max scalar codebook per rotated coordinate with one scale per 64-value block.

Source: Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate" (2025): randomly rotate, then quantize each coordinate with
the MSE-optimal scalar quantizer of the rotated coordinates' (Beta) distribution. Here the
rotation is a fixed sign flip followed by the normalized Walsh–Hadamard transform (as the
llama.cpp TurboQuant forks do, e.g. TheTom/llama-cpp-turboquant ``ggml-turbo-quant.c``),
and each block of 64 rotated coordinates carries its own f16 scale. The codebooks are
computed once by ``codebooks.py`` and shipped in ``_tables.py``.

Rotation (head size ``d`` a power of two, 64 <= d <= 512)::

    y = R x,   R = H_d diag(s[:d]) / sqrt(d),   H_d[i, j] = (-1)^popcount(i & j)

``s`` are the shipped signs (``_tables.SIGNS_HEX``); ``H_d`` is the Sylvester Hadamard
matrix in natural order, which is what the in-place butterfly fast WHT computes (stages
h = 1, 2, 4, ..., d/2: ``(a, b) -> (a + b, a - b)`` for element pairs ``(i, i + h)``),
followed by the scale ``1/sqrt(d)``. ``R`` is orthonormal, so ``x = R^T y = diag(s) H_d y /
sqrt(d)`` and ``q . k = (R q) . (R k)``: attention may score queries against keys in the
rotated domain (rotate q once per head, dot with the dequantized but not un-rotated K
rows) and un-rotate only the attention output for V (``o = R^T sum_c p_c y_c``), so no
per-cell inverse transform is needed. ``dequantize_rotated`` returns that domain.

Block ``b`` (values ``y[64b : 64b+64]``): with ``n`` its L2 norm, ``u = y * 8 / n`` has unit
RMS and each ``u_j`` is coded as the index of the nearest level of ``LLOYD_MAX[bits]``
(``c``, ascending, float16 numbers: ``codebooks.lloyd_max``; a value exactly halfway takes
the lower level). The stored scale is the least-squares gain ``scale = sum_j y_j c_j /
sum_j c_j^2`` (rounded to f16), which minimizes the block's error for those indices;
decoding is ``y_j = scale * c[idx_j]``.
A zero block stores scale -0 (f16 bytes ``00 80``): its ``u`` are all 0, the middle threshold
exactly, so each takes the level below it, a negative one, and the products ``0 * c`` that
the gain sums are -0. It decodes to zeros (signed as those levels).

Arithmetic (fixed, so any device reproduces the bytes; ``kv_rot.comp`` does): everything is
float32 with one IEEE rounding per operation. ``y = fwht(x * s) * f32(1/sqrt(d))`` (the
butterfly above, stage by stage); ``n = sqrt(block_sum(y * y))`` (correctly rounded);
``u = y * (8 / n)``; codes compare ``u`` with the float32 midpoints ``(c[i] + c[i+1]) / 2``;
``scale = block_sum(y * c) / block_sum(c * c)``, then rounded to f16 (nearest even).
``block_sum`` adds a block's 64 values pairwise: element j += element j + h for h = 32,
16, ..., 1. (A BLAS product or NumPy's SIMD reductions would have a library- and
CPU-dependent summation order.)

Bytes per 64-value block (little-endian; ``idx_j`` for j = 0..63)::

    turbo2: 18 bytes, 2.25 bits/value: [0:2] f16 scale, [2:18]  byte 2+j//4 bits 2*(j%4)   = idx_j
    turbo3: 26 bytes, 3.25 bits/value: [0:2] f16 scale, [2:18]  byte 2+j//4 bits 2*(j%4)   = idx_j & 3,
                                                      [18:26] byte 18+j//8 bit j%8      = idx_j >> 2
    turbo4: 34 bytes, 4.25 bits/value: [0:2] f16 scale, [2:34]  byte 2+j//2 bits 4*(j%2)   = idx_j
    turbo8: 66 bytes, 8.25 bits/value: [0:2] f16 scale, [2:66]  byte 2+j                  = idx_j

A row (one cell, one KV head) is ``d/64`` such blocks in order.
"""

from __future__ import annotations

import numpy as np

from opencoti.engine.kv_tiers import _tables
from opencoti.engine.kv_tiers.base import KVTier, f16_bytes, f16_from
from opencoti.engine.kv_tiers.codebooks import BLOCK, D_MAX

SIGNS = (1 - 2 * np.unpackbits(np.frombuffer(bytes.fromhex(_tables.SIGNS_HEX), np.uint8),
                               bitorder="little").astype(np.int8)).astype(np.float32)
_ROT: dict[int, np.ndarray] = {}


def check_rotated_dim(name: str, d: int) -> None:
    """Raise ``ValueError`` unless ``d`` is a power of two in [64, 512] (the rotation's sizes)."""
    if d < BLOCK or d > D_MAX or d & (d - 1):
        raise ValueError(f"KV cache type {name} needs a head size that is a power of two from {BLOCK} "
                         f"to {D_MAX} (Walsh-Hadamard rotation); this model's is {d}")


def hadamard(d: int) -> np.ndarray:
    """Sylvester Hadamard matrix in natural order: float64 ``[d, d]``, entries ±1."""
    i = np.arange(d)
    bits = np.bitwise_and.outer(i, i)
    par = np.zeros_like(bits)
    while bits.any():
        par ^= bits & 1
        bits >>= 1
    return (1 - 2 * par).astype(np.float64)


def rotation(d: int) -> np.ndarray:
    """The orthonormal ``R^T`` as float32 ``[d, d]`` (so ``y = x @ rotation(d)`` up to float32
    rounding), cached per d. The tiers themselves use ``rotate`` / ``unrotate`` (butterfly)."""
    r = _ROT.get(d)
    if r is None:
        r = _ROT[d] = np.ascontiguousarray((SIGNS[:d, None] * hadamard(d) / np.sqrt(d)).astype(np.float32))
    return r


def inv_sqrt(d: int) -> np.float32:
    """``1/sqrt(d)`` rounded once to float32 (the rotation's scale; exact for d = 64, 256)."""
    return np.float32(1.0 / np.sqrt(d))


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalized fast Walsh-Hadamard transform ``H_d x`` over the last axis, float32
    ``[..., d]`` -> float32 ``[..., d]`` (d a power of two): the in-place butterfly, stages
    h = 1, 2, ..., d/2, each ``(a, b) -> (a + b, a - b)`` on pairs ``(i, i + h)``, every
    addition rounded to float32. The order is fixed, so the result is bit-reproducible (the
    Vulkan write shader ``kv_rot.comp`` computes the same operations)."""
    y = np.asarray(x, dtype=np.float32)
    d = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < d:
        v = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return y


def rotate(x: np.ndarray) -> np.ndarray:
    """``y = R x`` over the last axis: float32 ``[..., d]`` -> float32 ``[..., d]``, computed as
    ``fwht(x * s) * inv_sqrt(d)`` in float32 (sign flips exact, then the butterfly, then one
    rounded multiply): bit-reproducible, unlike a BLAS product whose summation order
    depends on the library and the CPU."""
    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    return fwht(x * SIGNS[:d]) * inv_sqrt(d)


def unrotate(y: np.ndarray) -> np.ndarray:
    """``x = R^T y = s * fwht(y) / sqrt(d)`` over the last axis (inverse of ``rotate``)."""
    y = np.asarray(y, dtype=np.float32)
    d = y.shape[-1]
    return fwht(y) * inv_sqrt(d) * SIGNS[:d]


def block_sum(p: np.ndarray) -> np.ndarray:
    """Sum of each row of float32 ``[N, 64]`` -> float32 ``[N, 1]``, pairwise in a fixed order:
    for h = 32, 16, ..., 1 element j (j < h) becomes ``p[j] + p[j + h]``, each addition
    rounded to float32 (so the device computes bit-identical sums; NumPy's own reductions
    have a SIMD-width-dependent order)."""
    p = np.asarray(p, dtype=np.float32)
    h = p.shape[1] // 2
    while h >= 1:
        p = p[:, :h] + p[:, h:2 * h]
        h //= 2
    return p


def normalize_blocks(y: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Rotated rows ``[..., d]`` -> (blocks float32 ``[N, 64]``, unit-RMS blocks ``u = b * 8 / |b|``
    (zero where ``|b| = 0``), leading shape)."""
    b = np.ascontiguousarray(y.reshape(-1, BLOCK), dtype=np.float32)
    n = np.sqrt(block_sum(b * b))  # float32, correctly rounded
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(n > 0, b * (np.float32(np.sqrt(BLOCK)) / n), np.float32(0)).astype(np.float32)
    return b, u, y.shape[:-1]


def ls_scale(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Least-squares gain of reconstruction levels ``c`` for blocks ``b`` (both ``[N, 64]``):
    ``sum b c / sum c^2`` as float32 ``[N, 1]`` (0 where ``c`` is all zero); products,
    ``block_sum``s and the quotient each rounded to float32."""
    num = block_sum(b * c)
    den = block_sum(c * c)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / den, np.float32(0)).astype(np.float32)


class TurboTier(KVTier):
    """turbo{bits}: rotation + per-block Lloyd–Max codes (module doc for the byte layout)."""

    family = "turbo"
    block_size = BLOCK

    def __init__(self, bits: int):
        if bits not in (2, 3, 4, 8):
            raise ValueError(f"no turbo tier with {bits} bits")
        self.bits = bits
        self.name = f"turbo{bits}"
        self.block_bytes = 2 + BLOCK * bits // 8
        self.levels = np.asarray(_tables.LLOYD_MAX[bits], dtype=np.float32)
        self.thresholds = ((self.levels[1:] + self.levels[:-1]) / 2).astype(np.float32)

    def check_dim(self, d: int) -> None:
        check_rotated_dim(self.name, d)

    def codes(self, u: np.ndarray) -> np.ndarray:
        """Nearest-level indices of unit-RMS values ``u`` (any shape) -> int64, same shape."""
        return np.searchsorted(self.thresholds, u, side="left")

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/64*block_bytes]``."""
        x = np.asarray(x, dtype=np.float32)
        self.check_dim(x.shape[-1])
        b, u, lead = normalize_blocks(rotate(x))
        idx = self.codes(u)
        scale = ls_scale(b, self.levels[idx])
        out = np.concatenate([f16_bytes(scale), self.pack(idx)], axis=1)
        return out.reshape(*lead, -1)

    def dequantize_rotated(self, q) -> np.ndarray:
        """uint8 ``[..., n*block_bytes]`` -> float32 ``[..., 64n]`` in the rotated domain (``R x``)."""
        q = np.ascontiguousarray(q, dtype=np.uint8)
        b = q.reshape(-1, self.block_bytes)
        y = self.levels[self.unpack(b[:, 2:])] * f16_from(b[:, :2])
        return y.reshape(*q.shape[:-1], -1)

    def dequantize(self, q):
        """uint8 ``[..., n*block_bytes]`` -> float32 ``[..., 64n]``."""
        return unrotate(self.dequantize_rotated(q))

    # -- index packing -----------------------------------------------------------------
    def pack(self, idx: np.ndarray) -> np.ndarray:
        """Indices ``[N, 64]`` (0..2^bits-1) -> payload bytes ``[N, block_bytes - 2]``."""
        idx = idx.astype(np.uint8)
        if self.bits == 8:
            return idx
        if self.bits == 4:
            return idx[:, 0::2] | (idx[:, 1::2] << 4)
        lo = idx & 3
        two = lo[:, 0::4] | (lo[:, 1::4] << 2) | (lo[:, 2::4] << 4) | (lo[:, 3::4] << 6)
        if self.bits == 2:
            return two
        return np.concatenate([two, np.packbits(idx >> 2, axis=1, bitorder="little")], axis=1)

    def unpack(self, p: np.ndarray) -> np.ndarray:
        """Payload bytes ``[N, block_bytes - 2]`` -> indices ``[N, 64]`` (int64)."""
        p = p.astype(np.int64)
        if self.bits == 8:
            return p
        if self.bits == 4:
            return np.stack([p & 15, p >> 4], axis=2).reshape(len(p), BLOCK)
        two = np.stack([p[:, :16] & 3, (p[:, :16] >> 2) & 3, (p[:, :16] >> 4) & 3, p[:, :16] >> 6],
                       axis=2).reshape(len(p), BLOCK)
        if self.bits == 2:
            return two
        hi = np.unpackbits(p[:, 16:24].astype(np.uint8), axis=1, bitorder="little").astype(np.int64)
        return two | (hi << 2)


TIERS = [TurboTier(8), TurboTier(4), TurboTier(3), TurboTier(2)]
