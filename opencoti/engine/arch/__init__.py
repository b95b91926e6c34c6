"""Architecture registry: GGUF ``general.architecture`` -> model class.

Classes are imported lazily, one module per architecture family.
"""

from __future__ import annotations

import importlib

ARCHITECTURES: dict[str, str] = {
    "llama": "opencoti.engine.arch.llama:Llama",
    "qwen2": "opencoti.engine.arch.qwen2:Qwen2",
    "qwen3": "opencoti.engine.arch.qwen3:Qwen3",
    "gemma3": "opencoti.engine.arch.gemma3:Gemma3",
    "gemma4": "opencoti.engine.arch.gemma4:Gemma4",
    # issue 7b: hybrid gated delta-net families
    "qwen35": "opencoti.engine.arch.qwen35:Qwen35",
    "qwen35moe": "opencoti.engine.arch.qwen35moe:Qwen35MoE",
    "qwen3next": "opencoti.engine.arch.qwen3next:Qwen3Next",
}


def arch_class(name: str):
    """The model class for architecture ``name``; ``KeyError`` if unknown."""
    mod, cls = ARCHITECTURES[name].split(":")
    return getattr(importlib.import_module(mod), cls)
