"""The storage-class interface every KV tier implements (STYLE lesson 9).

A tier turns float32 head vectors ``[..., d]`` into the bytes one KV cell row
holds and back. The cache stores per layer ``[n_stream, n_cells, n_head_kv,
row]``: for the native float tiers (f32, f16) ``row`` is ``d`` elements of that
dtype, for every other tier ``row`` is ``bytes_per_row(d)`` uint8. A row is a
whole number of blocks, each ``block_bytes`` long and holding ``block_size``
values, laid out one after the other (block ``b`` starts at byte
``b * block_bytes``); each module documents its block's bytes exactly.
Multi-byte fields are little-endian; ``f16`` fields are IEEE half precision.
"""

from __future__ import annotations

import numpy as np


class KVTier:
    """One KV storage format.

    Attributes:
        name: the type name the flags take (``-ctk``/``-ctv``), llama.cpp's where one exists.
        block_size: values per block.
        block_bytes: bytes per block.
        native: True when rows are stored as a NumPy float dtype (``dtype``)
            rather than bytes; ``quantize`` / ``dequantize`` are then casts.
        dtype: storage element dtype (float32 / float16 for native tiers, uint8 otherwise).
        family: "float", "scalar", "turbo" or "tcq" (the module that defines it).
    """

    name: str = ""
    block_size: int = 1
    block_bytes: int = 1
    native: bool = False
    dtype = np.dtype(np.uint8)
    family: str = ""

    @property
    def bits_per_value(self) -> float:
        """Storage bits per cached value, scales and norms included."""
        return 8.0 * self.block_bytes / self.block_size

    def check_dim(self, d: int) -> None:
        """Raise ``ValueError`` unless rows of ``d`` values can be stored (a multiple of
        ``block_size``; the rotated tiers need more, see theirs)."""
        if d <= 0 or d % self.block_size:
            raise ValueError(f"KV cache type {self.name} stores rows in blocks of {self.block_size} values; "
                             f"head size {d} is not a multiple of {self.block_size}")

    def bytes_per_row(self, d: int) -> int:
        """Bytes of one stored row of ``d`` values."""
        self.check_dim(d)
        return d // self.block_size * self.block_bytes

    def row_len(self, d: int) -> int:
        """Last-axis length of the storage array for rows of ``d`` values: ``d`` for
        native tiers, ``bytes_per_row(d)`` otherwise."""
        return d if self.native else self.bytes_per_row(d)

    def dim_of(self, row_len: int) -> int:
        """Values per row from a storage row's last-axis length (inverse of ``row_len``)."""
        if self.native:
            return row_len
        if row_len % self.block_bytes:
            raise ValueError(f"{self.name}: a row of {row_len} bytes is not a whole number of "
                             f"{self.block_bytes}-byte blocks")
        return row_len // self.block_bytes * self.block_size

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """``x`` float ``[..., d]`` -> storage ``[..., row_len(d)]`` of ``dtype``."""
        raise NotImplementedError

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """Storage ``[..., row_len]`` -> float32 ``[..., d]``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<KV tier {self.name}: {self.block_size} values / {self.block_bytes} bytes>"


def to_blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, tuple]:
    """``x [..., d]`` float -> (float32 ``[n_blocks, block]`` C-contiguous, leading shape)."""
    x = np.asarray(x, dtype=np.float32)
    lead = x.shape[:-1]
    return np.ascontiguousarray(x.reshape(-1, block)), lead


def blocks_as_rows(b: np.ndarray, lead: tuple) -> np.ndarray:
    """``[n_blocks, k]`` -> ``[*lead, n_blocks_per_row * k]`` (inverse of ``to_blocks``' split)."""
    return b.reshape(*lead, -1)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """float ``[n, 1]`` -> its IEEE half bits as uint8 ``[n, 2]`` (little-endian; round to nearest even)."""
    return np.ascontiguousarray(np.asarray(v, dtype=np.float32).astype(np.float16)).view(np.uint8).reshape(-1, 2)


def f16_from(b: np.ndarray) -> np.ndarray:
    """uint8 ``[n, 2]`` little-endian half bits -> float32 ``[n, 1]``."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1, 1)
