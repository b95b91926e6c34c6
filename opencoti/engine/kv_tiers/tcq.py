"""Trellis-coded KV tiers turbo2_tcq / turbo3_tcq: the turbo rotation and per-block scale,
with the 64 unit-RMS values of a block coded jointly by a tail-biting bitshift trellis
(Viterbi search on write, a table lookup per value on read).

Sources: trellis-coded quantization (Marcellin & Fischer, "Trellis coded quantization of
memoryless and Gauss-Markov sources", IEEE Trans. Commun. 1990); the bitshift trellis,
whose state is a sliding window of the bitstream so that any value decodes on its own
(Tseng, Sun, Hou, De Sa, "QTIP: Quantization with Trellises and Incoherence Processing",
NeurIPS 2024); its use for KV caches in the llama.cpp fork spiritbuun/buun-llama-cpp
(``block_turbo3_tcq``). Rotation, normalization and the least-squares scale are exactly
``turbo.py``'s; read that module first.

Trellis (k = bits per value, L = 8 state bits, 256 states): a block's code is a circular
stream of ``N = 64k`` bits, bit ``i`` stored at byte ``i // 8``, bit ``i % 8`` (least
significant first). Value ``t`` (t = 0..63) has the state ::

    s_t = sum_{j < L} bit[(t*k + j) mod N] << j        (an L-bit window starting at bit t*k)

and decodes to ``scale * TCQ[k][s_t]`` (``_tables.TCQ``, 2^L float32 entries). Moving from
``t`` to ``t + 1`` drops the state's k low bits and shifts in k new bits at the top
(``s_{t+1} = (s_t >> k) | (b << (L - k))``): a right-shift trellis with 2^k branches per
state; the wrap-around makes it tail-biting, so every value costs exactly k bits. The
encoder (``trellis_encode``) is a Viterbi search for the stream minimizing the block's
squared error: it first picks the L - k bits shared by the last and the first state with
a short unconstrained search over the 8 values on either side of the wrap, then runs the
full search with the first state's low and the last state's high L - k bits fixed to them.

Bytes per 64-value block (little-endian)::

    turbo2_tcq: 18 bytes, 2.25 bits/value: [0:2] f16 scale, [2:18] the 128-bit stream
    turbo3_tcq: 26 bytes, 3.25 bits/value: [0:2] f16 scale, [2:26] the 192-bit stream

A row (one cell, one KV head) is ``d/64`` such blocks in order.
"""

from __future__ import annotations

import numpy as np

from opencoti.engine.kv_tiers import _tables
from opencoti.engine.kv_tiers.base import KVTier, f16_bytes, f16_from
from opencoti.engine.kv_tiers.codebooks import BLOCK, TCQ_L
from opencoti.engine.kv_tiers.trellis import trellis_encode
from opencoti.engine.kv_tiers.turbo import check_rotated_dim, ls_scale, normalize_blocks, rotate, unrotate

def _state_bit_index(k: int, n: int = BLOCK, L: int = TCQ_L) -> np.ndarray:
    """Stream bit positions of each value's state window: int ``[n, L]``."""
    return (np.arange(n)[:, None] * k + np.arange(L)[None, :]) % (n * k)


class TCQTier(KVTier):
    """turbo{k}_tcq: rotation + per-block scale + tail-biting trellis codes (module doc)."""

    family = "tcq"
    block_size = BLOCK

    def __init__(self, k: int, L: int = TCQ_L):
        if k not in (2, 3):
            raise ValueError(f"no trellis tier with {k} bits")
        self.k, self.L = k, L
        self.name = f"turbo{k}_tcq"
        self.block_bytes = 2 + BLOCK * k // 8
        self.levels = np.asarray(_tables.TCQ[k], dtype=np.float32)
        self._win = _state_bit_index(k)
        self._pow = (1 << np.arange(L)).astype(np.int64)

    def check_dim(self, d: int) -> None:
        check_rotated_dim(self.name, d)

    def states_to_stream(self, st: np.ndarray) -> np.ndarray:
        """States ``[N, 64]`` -> stream bytes ``[N, 8k]`` (value t's k low state bits are stream
        bits t*k .. t*k+k-1)."""
        bits = (st[:, :, None] >> np.arange(self.k)[None, None, :]) & 1
        return np.packbits(bits.reshape(len(st), -1).astype(np.uint8), axis=1, bitorder="little")

    def stream_to_states(self, p: np.ndarray) -> np.ndarray:
        """Stream bytes ``[N, 8k]`` -> states int64 ``[N, 64]``."""
        bits = np.unpackbits(np.ascontiguousarray(p, dtype=np.uint8), axis=1, bitorder="little").astype(np.int64)
        return bits[:, self._win] @ self._pow

    def quantize(self, x):
        """float ``[..., d]`` -> uint8 ``[..., d/64*block_bytes]`` (Viterbi search per block)."""
        x = np.asarray(x, dtype=np.float32)
        self.check_dim(x.shape[-1])
        b, u, lead = normalize_blocks(rotate(x))
        st = trellis_encode(u, self.levels, self.k, self.L)
        scale = ls_scale(b, self.levels[st])
        return np.concatenate([f16_bytes(scale), self.states_to_stream(st)], axis=1).reshape(*lead, -1)

    def dequantize_rotated(self, q) -> np.ndarray:
        """uint8 ``[..., n*block_bytes]`` -> float32 ``[..., 64n]`` in the rotated domain."""
        q = np.ascontiguousarray(q, dtype=np.uint8)
        b = q.reshape(-1, self.block_bytes)
        y = self.levels[self.stream_to_states(b[:, 2:])] * f16_from(b[:, :2])
        return y.reshape(*q.shape[:-1], -1)

    def dequantize(self, q):
        """uint8 ``[..., n*block_bytes]`` -> float32 ``[..., 64n]``."""
        return unrotate(self.dequantize_rotated(q))


TIERS = [TCQTier(3), TCQTier(2)]
