"""Qwen3 (dense): ``general.architecture = qwen3``.

The llama recipe with per-head RMS norms on q and k (before RoPE), no
biases, NEOX RoPE (llama.cpp ``src/models/qwen3.cpp``).
"""

from __future__ import annotations

from opencoti.engine.arch.base import DecoderModel


class Qwen3(DecoderModel):
    arch_names = ("qwen3",)
    rope_type = "neox"
