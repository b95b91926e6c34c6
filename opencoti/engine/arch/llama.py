"""Llama (1/2/3): ``general.architecture = llama``.

The base recipe as is (llama.cpp ``src/models/llama.cpp``): SiLU-gated FFN,
RMSNorm, NORM-mode RoPE (the GGUF converter permutes q/k rows so adjacent
pairs rotate). Llama-3.1 RoPE frequency scaling arrives as the
``rope_freqs.weight`` tensor (per-pair divisors written by llama.cpp's
converter) and is applied inside ``rope``.
"""

from __future__ import annotations

from opencoti.engine.arch.base import DecoderModel


class Llama(DecoderModel):
    arch_names = ("llama",)
    rope_type = "norm"
