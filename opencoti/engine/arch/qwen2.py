"""Qwen2 / Qwen2.5: ``general.architecture = qwen2``.

The llama recipe with biases on q, k and v, and NEOX RoPE
(llama.cpp ``src/models/qwen2.cpp``).
"""

from __future__ import annotations

from opencoti.engine.arch.base import DecoderModel


class Qwen2(DecoderModel):
    arch_names = ("qwen2",)
    rope_type = "neox"
