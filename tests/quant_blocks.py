"""Random GGUF weight blocks and their reference dequantization, shared by the GPU
backend tests (tests/test_cuda.py, tests/test_vulkan.py)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

# byte offsets of the f16 scale fields inside one block (ggml-common.h)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qname: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random valid GGUF data ``uint8 [rows, row_bytes]`` of type ``qname``: random
    bits with the f16 scales set to sane values (random f16 bits can be NaN)."""
    t = GGMLQuantizationType[qname]
    if qname == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    if qname == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qname == "BF16":
        return (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blk, size = GGML_QUANT_SIZES[t]
    nb = cols // blk
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    for off in F16_FIELDS[qname]:
        d = rng.uniform(0.002, 0.05, (rows, nb)).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * size)


def ref_dequant(qname: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """float32 ``[rows, cols]`` of ``raw`` blocks of type ``qname`` (gguf's dequantizer)."""
    if qname == "F32":
        return raw.view(np.float32).reshape(-1, cols)
    if qname == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(-1, cols)
    return gguf_dequantize(raw, GGMLQuantizationType[qname]).astype(np.float32).reshape(-1, cols)
