"""Gemma 3 (text): ``general.architecture = gemma3``.

Differences from the llama recipe (llama.cpp ``src/models/gemma3.cpp`` and
``llama_model::load_hparams``; HF ``modeling_gemma3.py``):

- embeddings scaled by sqrt(n_embd); output tied to ``token_embd`` when
  ``output.weight`` is absent;
- RMSNorm weights already carry Gemma's ``1 + w`` (the GGUF converter adds 1);
- per-head RMS norms on q and k; post-attention and post-FFN norms;
- GELU-tanh gated FFN; NEOX RoPE;
- sliding-window attention on five of every six layers (layer il is global
  when ``il % 6 == 5``), window ``gemma3.attention.sliding_window``, those
  layers with RoPE base 10000 and no scaling; global layers use
  ``rope.freq_base`` (and linear ``rope.scaling`` when present);
- query scale 1/sqrt(head_dim), except the 27B (62 layers):
  1/sqrt(n_embd / n_head).
"""

from __future__ import annotations

import math

from opencoti.engine.arch.base import DecoderModel
from opencoti.model.hparams import HParams

SWA_PATTERN = 6


class Gemma3(DecoderModel):
    arch_names = ("gemma3",)
    rope_type = "neox"
    ffn_act = "gelu_tanh"
    scale_embeddings = True

    @classmethod
    def adjust_hparams(cls, hp: HParams, md: dict) -> None:
        hp.n_swa = int(md.get("gemma3.attention.sliding_window", 0) or 0)
        pattern = int(md.get("gemma3.attention.sliding_window_pattern", SWA_PATTERN) or SWA_PATTERN)
        hp.swa_layers = [hp.n_swa > 0 and (il % pattern < pattern - 1) for il in range(hp.n_layer)]
        hp.rope_freq_base_swa = 10000.0
        hp.rope_freq_scale_swa = 1.0
        if hp.n_layer == 62:
            hp.f_attention_scale = 1.0 / math.sqrt(hp.n_embd / hp.n_head)
        else:
            hp.f_attention_scale = 1.0 / math.sqrt(hp.n_embd_head_k)
