"""GGUF file reading: metadata, tensor directory, memory-mapped tensor data.

Format: the GGUF specification (ggml ``docs/gguf.md``; ggml ``gguf.c``):

    magic "GGUF" | u32 version (2 or 3) | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to ``general.alignment`` (default 32), then the tensor data blob

Strings are u64 length + UTF-8 bytes; arrays are u32 item type + u64 count +
items. All little-endian.

The ``gguf`` package supplies the type tables (``GGMLQuantizationType``,
``GGML_QUANT_SIZES``) and the dequantizers (``gguf.quants.dequantize``) used
here. The header is parsed by this module rather than ``gguf.GGUFReader``
because the reader builds one NumPy view per array element, which takes ~8 s
for a 262,144-entry vocabulary; this parser reads the same header in ~0.3 s.
The tensor blob is memory-mapped read-only: nothing is copied at load.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.md "gguf_metadata_value_type")
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY_DTYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_T_STRING = 8
_T_ARRAY = 9


class GGUFError(ValueError):
    """A GGUF file is malformed, truncated, or not supported; the message says what and where."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory.

    ``ne`` is ggml's dimension order (ne[0] is the innermost, contiguous one);
    ``shape`` is the NumPy row-major shape, ``tuple(reversed(ne))``.
    ``offset`` is absolute in the file, ``n_bytes`` the size of the data.
    """

    name: str
    ne: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


class _Cursor:
    """Bounds-checked little-endian reader over a memoryview."""

    def __init__(self, buf: memoryview, path: str):
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated GGUF file: need {n} bytes for {what} at offset "
                f"{self.pos}, file has {len(self.buf)} bytes"
            )

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype], what)
        if vtype == _T_STRING:
            return self.string(what)
        if vtype == _T_ARRAY:
            itype = self.scalar("<I", what)
            n = self.scalar("<Q", what)
            if itype in _NUMPY_DTYPES:
                dt = np.dtype(_NUMPY_DTYPES[itype])
                self.need(n * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).copy()
                self.pos += n * dt.itemsize
                return arr.tolist() if itype == 7 else arr
            if itype == _T_STRING:
                return [self.string(what) for _ in range(n)]
            if itype == _T_ARRAY:
                return [self.value(_T_ARRAY, what) for _ in range(n)]
            raise GGUFError(f"{self.path}: unknown array item type {itype} in {what}")
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} in {what}")


class GGUFFile:
    """A GGUF file opened for reading, tensor data memory-mapped.

    Attributes:
        path: the file path.
        version: GGUF version (2 or 3).
        metadata: ``{key: value}``; integers/floats/bools/strings as Python
            scalars, numeric arrays as 1-D ``np.ndarray``, string arrays as ``list[str]``.
        tensors: ``{name: TensorInfo}`` in file order.

    Raises ``GGUFError`` on a bad magic, an unsupported version, a truncated
    header, an unknown tensor type, or tensor data past the end of the file;
    ``OSError`` if the file cannot be opened.
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        if os.path.isdir(self.path):
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file")
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except FileNotFoundError:
            raise
        except (ValueError, OSError) as e:  # empty file, device node, unreadable
            raise GGUFError(f"{self.path}: cannot map the file as GGUF: {e}") from None
        buf = memoryview(self._mm)
        cur = _Cursor(buf, self.path)
        cur.need(4, "magic")
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.scalar("<I", "version")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.scalar("<Q", "tensor count")
        n_kv = cur.scalar("<Q", "metadata count")
        if n_tensors > len(buf) or n_kv > len(buf):
            raise GGUFError(f"{self.path}: corrupt header (n_tensors={n_tensors}, n_kv={n_kv})")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar("<I", f"type of {key}")
            self.metadata[key] = cur.value(vtype, f"metadata value {key!r}")
        raw_infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.scalar("<I", f"n_dims of {name}")
            if n_dims > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dims (corrupt header)")
            ne = tuple(cur.scalar("<Q", f"shape of {name}") for _ in range(n_dims))
            ttype = cur.scalar("<I", f"type of {name}")
            offset = cur.scalar("<Q", f"offset of {name}")
            raw_infos.append((name, ne, ttype, offset))
        align = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment={align} is not a power of two")
        self.data_offset = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, ttype, offset in raw_infos:
            try:
                gtype = GGMLQuantizationType(ttype)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type {ttype}") from None
            block, type_size = GGML_QUANT_SIZES[gtype]
            n_el = 1
            for d in ne:
                n_el *= d
            if ne and ne[0] % block:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} row of {ne[0]} is not a multiple of the "
                    f"{gtype.name} block size {block}"
                )
            n_bytes = n_el // block * type_size
            start = self.data_offset + offset
            if start + n_bytes > len(buf):
                raise GGUFError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} ({gtype.name}, "
                    f"{n_bytes} bytes at {start}) ends past the end of the file ({len(buf)} bytes)"
                )
            self.tensors[name] = TensorInfo(name, ne, gtype, start, n_bytes)

    # -- metadata -----------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value for ``key`` or ``default``."""
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        """``general.architecture``; raises ``GGUFError`` if missing."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: missing general.architecture")
        return arch

    # -- tensor data --------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapping (no copy).

        Shape ``(rows, row_bytes)`` where rows = prod(ne[1:]). Raises ``KeyError``.
        """
        info = self.tensors[name]
        rows = info.n_elements // info.ne[0] if info.ne else 1
        flat = self._mm[info.offset:info.offset + info.n_bytes]
        return flat.reshape(rows, info.n_bytes // max(rows, 1))

    def dequantize(self, name: str, dtype=np.float32) -> np.ndarray:
        """Dequantize tensor ``name`` to ``dtype`` with NumPy shape ``reversed(ne)``.

        Plain types (F32, F16, F64, I8..I64) are viewed; every other type goes
        through ``gguf.quants.dequantize`` (all types the gguf package supports).
        Raises ``KeyError`` for an unknown name, ``GGUFError`` for a type the
        gguf package cannot dequantize.
        """
        info = self.tensors[name]
        raw = self.raw(name)
        t = info.ggml_type
        if t in _PLAIN_DTYPES:
            out = raw.view(_PLAIN_DTYPES[t])
        else:
            try:
                out = _gguf_dequantize(raw, t)
            except NotImplementedError as e:
                raise GGUFError(f"{self.path}: cannot dequantize {name!r} of type {t.name}: {e}") from None
        return np.ascontiguousarray(out.reshape(info.shape), dtype=dtype)

    def close(self) -> None:
        """Drop the mapping (views handed out keep it alive until they are freed)."""
        self._mm = None  # type: ignore[assignment]
