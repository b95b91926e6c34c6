"""Random-weight tiny models written to GGUF, for architecture parity tests.

A tiny Hugging Face ``transformers`` model (random init, float32, CPU) is
built for one of ``llama``, ``qwen2``, ``qwen3``, ``gemma3`` (text-only
``Gemma3ForCausalLM``) or ``gemma4`` (text-only ``Gemma4ForCausalLM``; its
family members are ``GEMMA4_VARIANTS``) and written to GGUF with ``gguf.GGUFWriter`` using the
tensor names, tensor transforms and metadata keys that llama.cpp's
``convert_hf_to_gguf.py`` writes for that architecture (``conversion/base.py``
``TextModel.set_gguf_parameters``, ``conversion/llama.py``,
``conversion/qwen.py``, ``conversion/gemma.py``; tensor names from
``gguf-py/gguf/tensor_mapping.py`` through ``gguf.get_tensor_name_map``):

- ``llama``: the rows of ``q_proj``/``k_proj`` (weight and bias) are permuted
  from the HF rotate-half layout to ggml's interleaved-pair RoPE layout
  (``LlamaModel.permute``); ``llama.vocab_size`` and
  ``llama.rope.dimension_count`` are written; with ``rope_type: llama3`` the
  per-frequency divisors are written as the F32 tensor ``rope_freqs.weight``
  (``LlamaModel.generate_extra_tensors``) and no ``rope.scaling.*`` key.
- ``qwen2`` / ``qwen3``: no permutation (NEOX RoPE); qwen2 carries q/k/v
  biases, qwen3 ``attn_q_norm`` / ``attn_k_norm``.
- ``gemma3``: every ``*norm.weight`` is stored as ``w + 1`` (HF's
  ``Gemma3RMSNorm`` computes ``x * (1 + w)``, llama.cpp ``x * w``);
  ``rope.freq_base`` is the global layers' theta, ``rope.freq_base_swa`` the
  local one; ``attention.sliding_window`` is written. llama.cpp fixes the
  layer pattern (every 6th layer global, ``set_swa_pattern(6)``), the local
  RoPE base (10000) and the attention scale (``1/sqrt(head_dim)`` below 27B),
  so the tiny configs use exactly those values. The embedding scale
  ``sqrt(n_embd)`` is applied in the forward pass, never stored.
- ``gemma4`` (``conversion/gemma.py`` ``Gemma4Model``): norm weights as they
  are (Gemma-4's RMSNorm multiplies by ``w``); ``attention.key_length`` is the
  global layers' head dim and ``attention.key_length_swa`` the sliding
  layers'; ``attention.head_count_kv`` / ``feed_forward_length`` become
  per-layer arrays when layers differ; ``attention.sliding_window_pattern``
  is a bool per layer; ``attention.shared_kv_layers``,
  ``embedding_length_per_layer_input``, ``rope.dimension_count[_swa]``,
  ``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``;
  the global layers' "proportional" RoPE is the tensor ``rope_freqs.weight``
  (1 for rotated pairs, 1e30 for the rest); ``layer_scalar`` ->
  ``blk.N.layer_output_scale.weight``, ``router.scale`` ->
  ``blk.N.ffn_gate_inp.scale``, ``router.per_expert_scale`` ->
  ``blk.N.ffn_down_exps.scale``, ``experts.gate_up_proj`` ->
  ``blk.N.ffn_gate_up_exps.weight`` (fused, gate rows first). KV-sharing
  layers have no ``attn_k``/``attn_v``/``attn_k_norm``; global layers with
  ``attention_k_eq_v`` no ``attn_v``.
- tied embeddings: no ``output.weight`` tensor.
- 1-D tensors, ``*_norm.weight`` and MoE routers (``ffn_gate_inp.weight``) are always F32; 2-D weights take the
  requested type (converter ``prepare_tensors``); rows that a K-quant cannot
  hold (length not a multiple of 256) fall back like llama-quantize does
  (``llama-quant.cpp``: Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0, then F16).

Quantization: ``gguf.quants.quantize`` where the gguf package implements it
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16, TQ1_0, TQ2_0, MXFP4); Q4_K, Q5_K and Q6_K
(which gguf-py can only dequantize) are encoded here in ggml's block layouts
(``ggml-common.h`` ``block_q4_K`` / ``block_q5_K`` / ``block_q6_K``) with a
plain min/max scale choice, not llama.cpp's error-minimising search: the
blocks are valid and dequantize exactly through ``gguf.quants.dequantize``.

A minimal vocabulary is written too (``tokenizer.ggml.model`` ``"llama"``
for SentencePiece-style or ``"gpt2"`` for byte-level BPE, with merges/scores
trained on a short built-in text), so a loader can build a tokenizer; parity
tests feed token ids directly.

``torch`` and ``transformers`` are imported inside the functions that need
them (the ``[dev]`` extra); vocabulary and quantization helpers need only
NumPy and gguf.

CLI: ``python -m opencoti.tools.synth_gguf --arch qwen2 --out x.gguf``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import gguf
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES, LlamaFileType, MODEL_ARCH

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "gemma4")

_GGUF_ARCH = {
    "llama": MODEL_ARCH.LLAMA,
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3": MODEL_ARCH.QWEN3,
    "gemma3": MODEL_ARCH.GEMMA3,
    "gemma4": MODEL_ARCH.GEMMA4,
}
# HF config.model_type -> our arch name
_MODEL_TYPE_TO_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
                       "gemma4_text": "gemma4"}

# The tiny default shapes. qwen3 and gemma3 use head_dim != hidden/heads, as the real
# models do, so that attention.key_length matters.
_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, head_dim=16, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen2": dict(_COMMON, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(_COMMON, head_dim=32, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # 8 layers: llama.cpp's fixed pattern makes layer 5 global, the others local
    "gemma3": dict(_COMMON, num_hidden_layers=8, head_dim=32,
                   sliding_window=8, tie_word_embeddings=True,
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                   }),
    # Gemma-4 dense with one head dim (256) on every layer; see GEMMA4_VARIANTS for the others.
    # Real head dims (256 / 512) on a 64-wide model: the tensors stay tiny, the shapes are real.
    "gemma4": dict(_COMMON, num_hidden_layers=6, num_key_value_heads=1, head_dim=256, global_head_dim=256,
                   sliding_window=8, tie_word_embeddings=True, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                   hidden_size_per_layer_input=0, vocab_size_per_layer_input=384,
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                          "rope_theta": 1000000.0},
                   }),
}

# Gemma-4 family members as config overrides of _DEFAULTS["gemma4"]:
# - dense_hd512: the 31B's attention: global layers with head dim 512, one KV head, V = K
#   (attention_k_eq_v) and 4x fewer KV heads than sliding layers;
# - moe: the 26B-A4B's FFN: a dense MLP plus routed experts (softmax top-k) in every layer;
# - e_series: E2B/E4B: per-layer embeddings, the last 4 of 8 layers reusing the KV of
#   layers 2 (sliding) and 3 (global), double-wide MLPs on the KV-sharing layers.
GEMMA4_VARIANTS: dict[str, dict[str, Any]] = {
    "dense_hd256": {},
    "dense_hd512": dict(num_key_value_heads=2, global_head_dim=512, num_global_key_value_heads=1,
                        attention_k_eq_v=True),
    "moe": dict(num_key_value_heads=2, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
                enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32),
    "e_series": dict(num_hidden_layers=8, global_head_dim=512, hidden_size_per_layer_input=16,
                     num_kv_shared_layers=4, use_double_wide_mlp=True,
                     layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2),
}

# llama 3.1-style frequency scaling, with an original context small enough that the
# factors change the rotation angles of a 40-token test prompt noticeably.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# Qwen2.5-7B-Instruct-1M-style long context: RoPE theta 1e7 and max_position_embeddings 1010000
# (its dual_chunk_attention_config is not converted by llama.cpp, so it is left out).
QWEN25_1M = {"max_position_embeddings": 1010000,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0}}
# YaRN on top (what a config with rope_scaling {type: yarn, factor: 4} converts to); the original
# context is tiny so that short test prompts reach the interpolated frequencies.
QWEN25_1M_YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                       "rope_theta": 10000000.0}


# ---------------------------------------------------------------------------------------
# transformers side
# ---------------------------------------------------------------------------------------
def tiny_config(arch: str, **overrides: Any):
    """A tiny ``transformers`` config for ``arch`` (one of ``ARCHS``).

    ``overrides`` replace config fields (e.g. ``num_hidden_layers=3``,
    ``rope_parameters=LLAMA3_ROPE``, ``attention_bias=True``). The attention
    implementation is ``"eager"``. For gemma3, unless overridden,
    ``query_pre_attn_scalar`` follows ``head_dim`` and ``layer_types`` follows
    llama.cpp's fixed pattern (layer ``il`` global iff ``il % 6 == 5``), since
    llama.cpp reads neither from the file. Raises ``ValueError`` for an
    unknown arch.
    """
    import transformers

    if arch in HYBRID_ARCHS:  # issue 7b
        return _hybrid_config(arch, **overrides)
    if arch not in _DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    kw = dict(_DEFAULTS[arch])
    kw.update(overrides)
    if arch == "gemma3" and "query_pre_attn_scalar" not in overrides:
        # llama.cpp scales gemma3 attention by 1/sqrt(head_dim) (except 27B); keep HF equal
        kw["query_pre_attn_scalar"] = kw["head_dim"]
    if arch == "gemma4":  # what a gemma4 GGUF cannot say (llama.cpp's graph hard-codes it)
        if kw.get("use_bidirectional_attention"):
            raise ValueError("gemma4: use_bidirectional_attention has no GGUF key (llama.cpp is causal)")
        if kw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError("gemma4: hidden_activation other than gelu_pytorch_tanh has no GGUF key")
        swa_rope = (kw.get("rope_parameters") or {}).get("sliding_attention", {})
        if swa_rope.get("rope_type", "default") != "default":
            raise ValueError("gemma4: sliding layers' RoPE must be rope_type 'default'")
    if arch == "gemma3" and "layer_types" not in overrides:
        # llama.cpp: set_swa_pattern(6) -> layer il is global iff il % 6 == 5
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(n)]
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
        "gemma4": transformers.Gemma4TextConfig,
    }[arch]
    cfg = cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _arch_of(model) -> str:
    mt = model.config.model_type
    if mt in _HYBRID_MODEL_TYPES:  # issue 7b
        return _HYBRID_MODEL_TYPES[mt]
    if mt not in _MODEL_TYPE_TO_ARCH:
        raise ValueError(f"unsupported transformers model_type {mt!r}")
    return _MODEL_TYPE_TO_ARCH[mt]


def random_hf_model(arch: str, seed: int = 0, **overrides: Any):
    """Build a tiny random ``*ForCausalLM`` (float32, CPU, eval mode, eager attention).

    Weights are drawn from a ``torch.Generator`` seeded with ``seed``, with
    scales chosen so that attention is far from uniform and logits spread
    over several units: embeddings N(0, 0.25^2); linear weights N(0, 1/fan_in);
    biases N(0, 0.2^2); RMSNorm weights 1 + N(0, 0.2^2) (Gemma 3: N(0, 0.2^2),
    since its norm multiplies by ``1 + w``). Gemma 4 (attention scale 1, so the
    q/k norms set the score scale): q/k norm weights ``hd^-1/4 (1 + N(0, 0.2^2))``
    so scores spread over a few units; expert weights N(0, 1/fan_in); the router
    projection 4x that (decisive routing); router and per-expert scales and the
    per-layer output scalars 1 + N(0, 0.2^2). Same seed and overrides give the
    same model.
    """
    import torch
    import transformers

    if arch in HYBRID_ARCHS:  # issue 7b
        return _random_hybrid_model(arch, seed, **overrides)
    cfg = tiny_config(arch, **overrides)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "gemma4": transformers.Gemma4ForCausalLM,
    }[arch]
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    tied = bool(cfg.tie_word_embeddings)
    with torch.no_grad():
        params = list(model.named_parameters())
        if arch == "gemma4":  # the per-layer output scalars are buffers
            params += [(n, b) for n, b in model.named_buffers() if n.endswith("layer_scalar")]
        for name, p in sorted(params, key=lambda kv: kv[0]):
            if tied and name == "lm_head.weight":
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if arch == "gemma4" and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_((1.0 + 0.2 * noise) * p.shape[0] ** -0.25)
            elif arch == "gemma4" and name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.2 * noise)
            elif arch == "gemma4" and name.endswith("router.proj.weight"):
                p.copy_(4.0 * noise / math.sqrt(p.shape[1]))
            elif p.ndim == 3:  # stacked expert matrices [n_expert, out, in]
                p.copy_(noise / math.sqrt(p.shape[2]))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * noise if arch == "gemma3" else 1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.25 * noise)
            elif p.ndim == 2:
                p.copy_(noise / math.sqrt(p.shape[1]))
            else:
                p.copy_(0.2 * noise)
    if tied:
        model.tie_weights()
    return model


def hf_logits(model, tokens: list[int]):
    """Logits of ``model`` for one sequence: ``np.ndarray`` float32 ``[len(tokens), n_vocab]``."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float32).numpy()


# ---------------------------------------------------------------------------------------
# vocabulary
# ---------------------------------------------------------------------------------------
_CORPUS = (
    "the quick brown fox jumps over the lazy dog while the other dogs sleep in the warm sun. "
    "a model reads tokens and writes tokens; the server sends them to the client as they arrive. "
    "there is a small house on the hill where the wind turns the old mill and the river runs "
    "under the stone bridge into the sea. in the morning the baker opens the door, and the "
    "smell of bread fills the street. numbers like 1, 2, 3 and 42 appear in the text too. "
    "when the rain comes the children run inside and read their books near the fire, then "
    "they write letters to their friends in the north. The Cat And The Hat Are Here. "
    "what is the answer? it is in the question, or so the teacher says with a smile!"
)

# SentencePiece token types (llama.cpp llama_token_type / gguf TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def _train_merges(words: list[list[str]], n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE training: repeatedly merge the most frequent adjacent pair
    (ties broken by the lexicographically smallest pair). Deterministic."""
    counts = Counter(tuple(w) for w in words)
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, c in counts.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        new_counts: Counter = Counter()
        for w, c in counts.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_counts[tuple(out)] += c
        counts = new_counts
    return merges


@dataclass
class Vocab:
    """A minimal tokenizer vocabulary as GGUF ``tokenizer.ggml.*`` metadata.

    ``tokens``/``token_types``/``scores`` have exactly ``n_vocab`` entries;
    ``merges`` (BPE only) are ``"left right"`` strings in rank order.
    """

    model: str  # "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad/eot
    add_bos: bool = False
    add_space_prefix: bool | None = None

    def write(self, w: gguf.GGUFWriter) -> None:
        """Add the ``tokenizer.ggml.*`` keys to writer ``w``."""
        w.add_tokenizer_model(self.model)
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        w.add_token_types(self.token_types)
        if self.merges is not None:
            w.add_token_merges(self.merges)
        adders = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id,
                  "pad": w.add_pad_token_id, "eot": w.add_eot_token_id}
        for k, v in self.special_ids.items():
            adders[k](v)
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(False)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)


def make_vocab(kind: str, n_vocab: int, arch: str = "llama") -> Vocab:
    """Build a ``Vocab`` of exactly ``n_vocab`` tokens.

    ``kind``: ``"spm"`` -> ``tokenizer.ggml.model = "llama"``: control tokens,
    the 256 byte tokens ``<0x00>``..``<0xFF>`` (type BYTE), the characters of
    a built-in text, then BPE-trained pieces scored by merge rank
    (``"▁"`` marks a space). ``"bpe"`` -> ``"gpt2"``: the 256 byte-level
    characters, merged tokens with their ``merges`` list, then the special
    tokens. Special tokens follow the arch family (Gemma: ``<pad> <eos> <bos>
    <unk> <start_of_turn> <end_of_turn>``; Qwen: ``<|endoftext|> <|im_start|>
    <|im_end|>``; Llama: ``<unk> <s> </s>`` or Llama 3's ``<|begin_of_text|>``...).
    Raises ``ValueError`` if ``n_vocab`` cannot hold the fixed tokens.
    """
    words = _CORPUS.split()
    if kind == "spm":
        if arch in ("gemma3", "gemma4"):
            turns = ["<|turn>", "<turn|>"] if arch == "gemma4" else ["<start_of_turn>", "<end_of_turn>"]
            specials = ["<pad>", "<eos>", "<bos>", "<unk>", *turns]
            ids = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
            add_space_prefix: bool | None = False
        else:
            specials = ["<unk>", "<s>", "</s>"]
            ids = {"unk": 0, "bos": 1, "eos": 2}
            add_space_prefix = None
        spm_words = [list("▁" + w) for w in words]
        chars = sorted({c for w in spm_words for c in w})
        n_fixed = len(specials) + 256 + len(chars)
        if n_vocab < n_fixed:
            raise ValueError(f"n_vocab={n_vocab} is too small for an spm vocab (needs >= {n_fixed})")
        merges = _train_merges(spm_words, n_vocab - n_fixed)
        tokens = list(specials) + [f"<0x{b:02X}>" for b in range(256)] + chars + [a + b for a, b in merges]
        types = [_CONTROL] * len(specials) + [_BYTE] * 256 + [_NORMAL] * (len(chars) + len(merges))
        types[ids["unk"]] = _UNKNOWN
        scores = [0.0] * (len(specials) + 256)
        scores += [-1000.0 - i for i in range(len(chars))]
        scores += [-1.0 - r for r in range(len(merges))]
        i = 0
        while len(tokens) < n_vocab:  # the text ran out of pairs: pad with unused tokens
            tokens.append(f"<unused{i}>")
            types.append(_UNUSED)
            scores.append(-1e9)
            i += 1
        return Vocab("llama", "default", tokens, types, scores, None, ids, add_bos=True,
                     add_space_prefix=add_space_prefix)
    if kind == "bpe":
        if arch == "llama":
            specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"]
            pre, add_bos = "llama-bpe", True
            named = {"bos": 0, "eos": 1, "eot": 4}
        else:
            specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            pre, add_bos = "qwen2", False
            named = {"bos": 0, "eos": 0, "pad": 0, "eot": 2}
        b2u = _bytes_to_unicode()
        bpe_words = [[b2u[b] for b in (" " + w).encode("utf-8")] for w in words]
        n_fixed = 256 + len(specials)
        if n_vocab < n_fixed:
            raise ValueError(f"n_vocab={n_vocab} is too small for a bpe vocab (needs >= {n_fixed})")
        merges = _train_merges(bpe_words, n_vocab - n_fixed)
        tokens = [b2u[b] for b in range(256)] + [a + b for a, b in merges]
        types = [_NORMAL] * len(tokens)
        i = 0
        while len(tokens) < n_vocab - len(specials):
            tokens.append(f"<|reserved_{i}|>")
            types.append(_CONTROL)
            i += 1
        base = len(tokens)
        tokens += specials
        types += [_CONTROL] * len(specials)
        ids = {k: base + v for k, v in named.items()}
        return Vocab("gpt2", pre, tokens, types, None, [f"{a} {b}" for a, b in merges], ids, add_bos=add_bos)
    raise ValueError(f"unknown vocab kind {kind!r}; use 'spm' or 'bpe'")


def _default_vocab_kind(arch: str) -> str:
    return "bpe" if arch in ("qwen2", "qwen3") or arch in HYBRID_ARCHS else "spm"


# ---------------------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------------------
def parse_qtype(q: str | GGMLQuantizationType) -> GGMLQuantizationType:
    """``"q8_0"`` / ``"Q8_0"`` / ``GGMLQuantizationType.Q8_0`` -> the enum; ``ValueError`` otherwise."""
    if isinstance(q, GGMLQuantizationType):
        return q
    try:
        return GGMLQuantizationType[str(q).upper()]
    except KeyError:
        raise ValueError(f"unknown ggml type {q!r}") from None


def _f16_round(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float32 value of the f16-rounded x, its 2 bytes per element as uint8 [..., 2])."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(*x.shape, 2)


def _safe_inv(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(x > 0, 1.0 / np.where(x > 0, x, 1.0), 0.0).astype(np.float32)


def _kquant_scale_min(xs: np.ndarray, qmax: int):
    """Asymmetric sub-block scales for Q4_K/Q5_K. xs: [nb, 8, 32] float32.

    Returns (d, d bytes, dmin, dmin bytes, sc u8 [nb,8], m u8 [nb,8], q u8 [nb,8,32]) with
    x ~= d*sc*q - dmin*m, q in [0, qmax], sc and m in [0, 63].
    """
    mn = np.minimum(xs.min(axis=-1), 0.0)
    scale = (xs.max(axis=-1) - mn) / qmax
    off = -mn
    d, d_b = _f16_round(scale.max(axis=-1) / 63.0)
    dmin, dmin_b = _f16_round(off.max(axis=-1) / 63.0)
    sc = np.clip(np.rint(scale * _safe_inv(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(off * _safe_inv(dmin)[:, None]), 0, 63).astype(np.uint8)
    eff_scale = d[:, None] * sc.astype(np.float32)
    eff_min = dmin[:, None] * m.astype(np.float32)
    q = np.rint((xs + eff_min[..., None]) * _safe_inv(eff_scale)[..., None])
    q = np.clip(q, 0, qmax).astype(np.uint8)
    return d_b, dmin_b, sc, m, q


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins into ggml's 12-byte ``scales`` (get_scale_min_k4 inverse)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _pack_nibbles_q4k(q: np.ndarray) -> np.ndarray:
    """q: [nb, 8, 32] values < 16 -> [nb, 128]: byte l of chunk c holds sub-blocks 2c (low) and 2c+1 (high)."""
    q = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(q.shape[0], 128)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    d_b, dmin_b, sc, m, q = _kquant_scale_min(blocks.reshape(nb, 8, 32), 15)
    return np.concatenate([d_b, dmin_b, _pack_k_scales(sc, m), _pack_nibbles_q4k(q)], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    d_b, dmin_b, sc, m, q = _kquant_scale_min(blocks.reshape(nb, 8, 32), 31)
    qh = np.zeros((nb, 32), dtype=np.uint8)
    for j in range(8):  # bit j of qh[l] is the 5th bit of sub-block j, element l
        qh |= ((q[:, j, :] >> 4) & 1) << j
    return np.concatenate([d_b, dmin_b, _pack_k_scales(sc, m), qh, _pack_nibbles_q4k(q)], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    xs = blocks.reshape(nb, 16, 16)
    scale = np.abs(xs).max(axis=-1) / 31.0  # [nb, 16], >= 0
    d, d_b = _f16_round(scale.max(axis=-1) / 127.0)
    sc = np.clip(np.rint(scale * _safe_inv(d)[:, None]), 0, 127).astype(np.int8)
    eff = d[:, None] * sc.astype(np.float32)
    q = np.clip(np.rint(xs * _safe_inv(eff)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(nb, 256)
    lo = (q & 0x0F).reshape(nb, 2, 2, 64)  # element = h*128 + s*64 + p
    ql = (lo[:, :, 0, :] | (lo[:, :, 1, :] << 4)).reshape(nb, 128)
    hi = (q >> 4).reshape(nb, 2, 4, 32)  # element = h*128 + s*32 + p
    qh = (hi[:, :, 0, :] | (hi[:, :, 1, :] << 2) | (hi[:, :, 2, :] << 4) | (hi[:, :, 3, :] << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_b], axis=1)


_KQUANT_ENCODERS = {
    GGMLQuantizationType.Q4_K: _quantize_q4_k,
    GGMLQuantizationType.Q5_K: _quantize_q5_k,
    GGMLQuantizationType.Q6_K: _quantize_q6_k,
}

# llama-quant.cpp: the type used when a row cannot be split into 256-element super-blocks
_KQUANT_FALLBACK = {
    GGMLQuantizationType.Q2_K: GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.Q3_K: GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.Q4_K: GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_K: GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q6_K: GGMLQuantizationType.Q8_0,
}


def quantize_tensor(data: np.ndarray, qtype: str | GGMLQuantizationType) -> np.ndarray:
    """Encode ``data`` (float32, ``[..., n]``) as ggml type ``qtype``.

    Returns float32 / float16 arrays for F32 / F16, otherwise the raw blocks as
    uint8 ``[..., n // block_size * type_size]`` (what ``GGUFWriter.add_tensor``
    takes with ``raw_dtype``). Raises ``ValueError`` if ``n`` is not a multiple
    of the type's block size or the type has no encoder here or in gguf-py.
    """
    t = parse_qtype(qtype)
    data = np.ascontiguousarray(data, dtype=np.float32)
    if t == GGMLQuantizationType.F32:
        return data
    if t == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    block, type_size = GGML_QUANT_SIZES[t]
    n = data.shape[-1]
    if n % block:
        raise ValueError(f"cannot quantize rows of {n} values as {t.name}: the block size is {block}")
    if t in _KQUANT_ENCODERS:
        blocks = data.reshape(-1, block)
        out = _KQUANT_ENCODERS[t](blocks)
        assert out.shape[1] == type_size
        return out.reshape(*data.shape[:-1], n // block * type_size)
    try:
        return gguf.quants.quantize(data, t)
    except NotImplementedError:
        supported = sorted(["F32", "F16", *(k.name for k in _KQUANT_ENCODERS)] + [
            k.name for k in GGMLQuantizationType if _gguf_can_quantize(k)])
        raise ValueError(f"no quantizer for {t.name}; supported: {', '.join(supported)}") from None


def _gguf_can_quantize(t: GGMLQuantizationType) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, GGML_QUANT_SIZES[t][0]), dtype=np.float32), t)
        return True
    except Exception:  # NotImplementedError, or a type whose encoder needs more setup
        return False


_FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "TQ1_0": LlamaFileType.MOSTLY_TQ1_0, "TQ2_0": LlamaFileType.MOSTLY_TQ2_0,
}


def _tensor_type(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                 tensor_types: dict[str, str] | None) -> GGMLQuantizationType:
    """The storage type of one tensor: F32 for 1-D, norms, rope_freqs and MoE routers
    (``ffn_gate_inp``, which the converter and llama-quantize never quantize); otherwise the
    first matching ``tensor_types`` glob or ``qtype``, with llama-quantize's fallback
    when the row length is not a multiple of the block size."""
    if (len(shape) <= 1 or name.endswith("_norm.weight") or name.startswith("rope_freqs")
            or name.endswith(".ffn_gate_inp.weight")):
        return GGMLQuantizationType.F32
    # convert_hf_to_gguf keeps these in F32 whatever the file type (router, shared-expert gate,
    # short conv kernels) and anything that is not a ".weight"
    if not name.endswith(".weight") or any(name.endswith(x) for x in _ALWAYS_F32):
        return GGMLQuantizationType.F32
    t = qtype
    for pattern, tt in (tensor_types or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            t = parse_qtype(tt)
            break
    n = shape[-1]
    if n % GGML_QUANT_SIZES[t][0]:
        t = _KQUANT_FALLBACK.get(t, t)
        if n % GGML_QUANT_SIZES[t][0]:
            t = GGMLQuantizationType.F16
    return t


# ---------------------------------------------------------------------------------------
# HF -> GGUF conversion (the convert_hf_to_gguf.py equivalent)
# ---------------------------------------------------------------------------------------
def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf ``LlamaModel.permute``: rows [head][half][i] -> [head][i][half].

    HF Llama rotates the two halves of each head (rotate_half); ggml's normal
    RoPE rotates adjacent pairs. ``w``: ``[n_head*head_dim, ...]`` (weight or bias).
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_qk``."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The ``rope_freqs.weight`` tensor for ``rope_type: llama3`` (float32 ``[head_dim/2]``).

    Per frequency ``f_i = theta^(-2i/d)`` with wavelength ``2*pi/f_i``: 1 below
    ``orig_ctx/high_freq_factor``, ``factor`` above ``orig_ctx/low_freq_factor``,
    and ``1/((1-s)/factor + s)`` between, ``s = (orig_ctx/wavelen - lo)/(hi - lo)``
    (``LlamaModel.generate_extra_tensors``; ggml divides the angle by it).
    ``orig_ctx`` is taken from ``rope["original_max_position_embeddings"]`` as
    transformers does; the converter reads a top-level config value of the same
    name (default 8192), which agrees for real Llama 3.x checkpoints.
    """
    import torch

    base = float(rope.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = float(rope.get("factor", 8.0))
    lo = float(rope.get("low_freq_factor", 1.0))
    hi = float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old_ctx / lo, old_ctx / hi
    out = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            s = (old_ctx / wl - lo) / (hi - lo)
            out.append(1.0 / ((1 - s) / factor + s))
    return np.asarray(out, dtype=np.float32)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope_params(cfg) -> dict[str, Any]:
    return dict(getattr(cfg, "rope_parameters", None) or {})


def gemma4_rope_freqs(cfg) -> np.ndarray:
    """Gemma-4's ``rope_freqs.weight`` (float32 ``[global_head_dim/2]``): the global layers'
    "proportional" RoPE as ggml NEOX frequency divisors, 1 for the ``partial_rotary_factor``
    share of pairs that rotate and 1e30 (angle ~0) for the rest (``Gemma4Model.generate_extra_tensors``)."""
    full = _rope_params(cfg)["full_attention"]
    if full.get("rope_type") != "proportional":
        raise ValueError(f"gemma4: global-layer rope_type {full.get('rope_type')!r} is not what the "
                         "converter handles (proportional)")
    if float(full.get("factor", 1.0)) != 1.0:
        raise ValueError("gemma4: a proportional RoPE factor != 1 has no GGUF key")
    hd = cfg.per_layer_config["full_attention"].head_dim
    n_rot = int(hd * full["partial_rotary_factor"] / 2)
    return np.asarray([1.0] * n_rot + [1e30] * (hd // 2 - n_rot), dtype=np.float32)


def _gguf_name(arch: str, tmap, hf_name: str) -> str | None:
    """The GGUF name of HF tensor ``hf_name`` (None if it has none), with the converter's
    renames for Gemma 4 (``Gemma4Model.filter_tensors`` / ``modify_tensors``): the per-layer
    scalar and the stacked expert tensors get a ``.weight`` suffix, ``router.scale`` becomes
    ``ffn_gate_inp.scale`` and ``router.per_expert_scale`` ``ffn_down_exps.scale``."""
    if arch == "gemma4":
        parts = hf_name.split(".")
        bid = next((int(x) for x in parts if x.isdecimal()), None)
        if hf_name.endswith("router.scale"):
            return f"blk.{bid}.ffn_gate_inp.scale"
        if hf_name.endswith("router.per_expert_scale"):
            return f"blk.{bid}.ffn_down_exps.scale"
        if hf_name.endswith("layer_scalar") or (".experts." in hf_name and not hf_name.endswith(".weight")):
            hf_name += ".weight"
    return tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def gguf_tensors(model) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors of an HF model: ``[(gguf_name, float32 array)]`` in write order.

    Names via ``gguf.get_tensor_name_map``; NumPy shapes are the HF shapes
    (GGUF ``ne`` is their reverse). Applies the converter's per-arch transforms
    (module docstring). Raises ``ValueError`` for a tensor with no GGUF name.
    """
    arch = _arch_of(model)
    cfg = model.config
    tmap = gguf.get_tensor_name_map(_GGUF_ARCH[arch], cfg.num_hidden_layers)
    out: list[tuple[str, np.ndarray]] = []
    rope = _rope_params(cfg)
    full = rope.get("full_attention", rope)
    if arch == "llama" and str(full.get("rope_type", "")).lower() == "llama3":
        out.append(("rope_freqs.weight", llama3_rope_factors(full, _head_dim(cfg))))
    if arch == "gemma4" and "full_attention" in cfg.layer_types:
        out.append(("rope_freqs.weight", gemma4_rope_freqs(cfg)))
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = _gguf_name(arch, tmap, hf_name)
        if name is None:
            raise ValueError(f"{arch}: no GGUF name for HF tensor {hf_name!r}")
        data = t.detach().to("cpu").float().numpy().copy()
        if arch == "llama":
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute_qk(data, cfg.num_attention_heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute_qk(data, cfg.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        out.append((name, data))
    return out


def _write_hparams(w: gguf.GGUFWriter, arch: str, cfg) -> None:
    """The ``{arch}.*`` keys convert_hf_to_gguf writes (TextModel.set_gguf_parameters + arch class)."""
    if arch == "gemma4":
        _write_gemma4_hparams(w, cfg)
        return
    rope = _rope_params(cfg)
    full = rope.get("full_attention", rope)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope_type = str(full.get("rope_type", "default"))
    if rope_type == "linear" and full.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))
    elif rope_type == "yarn" and full.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(full["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(full["original_max_position_embeddings"]))
    w.add_rope_freq_base(float(full.get("rope_theta", 10000.0)))
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(float(rope["sliding_attention"].get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if "head_dim" in cfg.to_dict() and cfg.to_dict()["head_dim"] is not None:
        w.add_key_length(_head_dim(cfg))
        w.add_value_length(_head_dim(cfg))
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(_head_dim(cfg))
    if arch == "gemma3":
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
        w.add_sliding_window(int(cfg.sliding_window))


def _write_gemma4_hparams(w: gguf.GGUFWriter, cfg) -> None:
    """The ``gemma4.*`` keys of ``Gemma4Model.set_gguf_parameters`` (over ``Gemma3Model``'s and
    ``TextModel``'s): key/value lengths of the global layers plus ``_swa`` ones for sliding
    layers, per-layer arrays where layers differ (KV heads, FFN width of double-wide
    KV-sharing layers), the sliding-window pattern as a bool per layer, RoPE dims per kind."""
    n = cfg.num_hidden_layers
    rope = _rope_params(cfg)
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    plc = cfg.per_layer_config
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    n_shared = int(cfg.num_kv_shared_layers or 0)
    if cfg.use_double_wide_mlp:
        w.add_feed_forward_length([cfg.intermediate_size * (2 if il >= n - n_shared else 1) for il in range(n)])
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    kv_heads = [plc[il].num_key_value_heads for il in range(n)]
    w.add_head_count_kv(kv_heads if len(set(kv_heads)) > 1 else kv_heads[0])
    w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if cfg.num_experts is not None:
        w.add_expert_count(int(cfg.num_experts))
    if cfg.top_k_experts is not None:
        w.add_expert_used_count(int(cfg.top_k_experts))
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    w.add_sliding_window(int(cfg.sliding_window))
    w.add_shared_kv_layers(n_shared)
    w.add_embedding_length_per_layer_input(int(cfg.hidden_size_per_layer_input or 0))
    w.add_sliding_window_pattern(swa)
    hd = {t: plc[t].head_dim for t in set(cfg.layer_types)}
    hd_full = hd.get("full_attention", hd.get("sliding_attention"))
    hd_swa = hd.get("sliding_attention", hd_full)
    w.add_key_length(hd_full)
    w.add_value_length(hd_full)
    w.add_key_length_swa(hd_swa)
    w.add_value_length_swa(hd_swa)
    if cfg.moe_intermediate_size is not None:
        w.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
    w.add_rope_dimension_count(hd_full)  # proportional RoPE: rope_freqs.weight leaves the rest unrotated
    w.add_rope_dimension_count_swa(hd_swa)


def write_gguf(model, path: str | Path, qtype: str | GGMLQuantizationType = "F32", *,
               tensor_types: dict[str, str] | None = None, vocab: str | Vocab = "auto",
               chat_template: str | None = None, name: str | None = None,
               n_mtp: int = 0) -> dict[str, GGMLQuantizationType]:
    """Write HF ``model`` (one of ``ARCHS``) to the GGUF file ``path``.

    ``n_mtp`` (qwen35 / qwen35moe only): append that many random NextN/MTP blocks
    (``hybrid_mtp_tensors``) after the trunk, as the converter does with a
    checkpoint's ``mtp.*`` tensors.
    ``qtype``: storage type of 2-D weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, ...); ``tensor_types`` maps GGUF-name globs
    to types and wins over ``qtype`` (e.g. ``{"blk.*.ffn_down.weight":
    "Q6_K"}``). ``vocab``: ``"auto"`` (bpe for qwen, spm otherwise), ``"spm"``,
    ``"bpe"`` or a ``Vocab``. Returns ``{gguf tensor name: stored type}``.
    Raises ``ValueError`` for an unsupported model or type.
    """
    arch = _arch_of(model)
    cfg = model.config
    qt = parse_qtype(qtype)
    if isinstance(vocab, str):
        vocab = make_vocab(_default_vocab_kind(arch) if vocab == "auto" else vocab, cfg.vocab_size, arch)
    if len(vocab.tokens) != cfg.vocab_size:
        raise ValueError(f"vocab has {len(vocab.tokens)} tokens, the model {cfg.vocab_size}")
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[_GGUF_ARCH[arch]])
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"opencoti synthetic {arch}")
    if arch in HYBRID_ARCHS:  # issue 7b
        _write_hybrid_hparams(w, arch, cfg, n_mtp)
    elif n_mtp:
        raise ValueError(f"{arch}: NextN/MTP blocks are written for {', '.join(_MTP_ARCHS)} only")
    else:
        _write_hparams(w, arch, cfg)
    w.add_file_type(_FILE_TYPES.get(qt.name, LlamaFileType.GUESSED))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.write(w)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    types: dict[str, GGMLQuantizationType] = {}
    tensors = hybrid_gguf_tensors(model, n_mtp) if arch in HYBRID_ARCHS else gguf_tensors(model)
    for tname, data in tensors:
        t = _tensor_type(tname, data.shape, qt, tensor_types)
        enc = quantize_tensor(data, t)
        if t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(tname, enc)
        else:
            w.add_tensor(tname, enc, raw_dtype=t)
        types[tname] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def write_random_model(arch: str, path: str | Path, qtype: str | GGMLQuantizationType = "F32", seed: int = 0,
                       *, tensor_types: dict[str, str] | None = None, vocab: str | Vocab = "auto",
                       chat_template: str | None = None, **config_overrides: Any):
    """Build ``random_hf_model(arch, seed, **config_overrides)``, write it to ``path``
    as GGUF (``write_gguf``) and return the transformers model (float32, eval)."""
    model = random_hf_model(arch, seed, **config_overrides)
    write_gguf(model, path, qtype, tensor_types=tensor_types, vocab=vocab, chat_template=chat_template)
    return model


# ---------------------------------------------------------------------------------------
# GGUF -> HF (for comparing against transformers on dequantized weights)
# ---------------------------------------------------------------------------------------
def load_gguf_into_hf(model, path: str | Path) -> None:
    """Overwrite ``model``'s weights with the dequantized tensors of GGUF ``path``.

    Undoes the converter transforms (Llama q/k permutation, Gemma 3 ``+1``), so
    running ``model`` afterwards computes what a correct GGUF forward on the
    quantized file computes (up to float32 rounding). Raises ``KeyError`` if
    the file lacks a tensor the model needs.
    """
    import torch
    from opencoti.model.gguf_file import GGUFFile

    arch = _arch_of(model)
    cfg = model.config
    if arch in HYBRID_ARCHS:  # issue 7b
        return _load_gguf_into_hybrid(model, path)
    tmap = gguf.get_tensor_name_map(_GGUF_ARCH[arch], cfg.num_hidden_layers)
    g = GGUFFile(path)
    sd = model.state_dict()
    new: dict[str, Any] = {}
    for hf_name in sd:
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = _gguf_name(arch, tmap, hf_name)
        if gname is None:  # non-persistent or derived buffers (e.g. RoPE tables)
            continue
        data = g.dequantize(gname)
        if arch == "llama":
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = unpermute_qk(data, cfg.num_attention_heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = unpermute_qk(data, cfg.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data - np.float32(1.0)
        new[hf_name] = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(sd[hf_name].shape)
    with torch.no_grad():
        for k, v in new.items():
            sd[k].copy_(v)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    g.close()


# ---------------------------------------------------------------------------------------
# issue 7b: hybrid gated delta-net families (Qwen3.5 dense / MoE, Qwen3-next)
# ---------------------------------------------------------------------------------------
# convert_hf_to_gguf.py (conversion/qwen.py): Qwen3NextModel, _LinearAttentionVReorderBase,
# _Qwen35MRopeMixin, _Qwen35MtpMixin, Qwen3_5TextModel / Qwen3_5MoeTextModel; Qwen2MoeModel
# for the expert tensors. What the converter does, and what these functions replicate:
#
# - ``A_log`` -> ``ssm_a`` = -exp(A_log); ``dt_bias`` -> ``ssm_dt.bias``; the conv kernel
#   [C, 1, K] is squeezed to ``ssm_conv1d`` [C, K]; every ``*norm.weight`` except the gated
#   ``linear_attn.norm`` (-> ``ssm_norm``) is stored as ``1 + w`` (Qwen's zero-centred norm);
# - qwen35 / qwen35moe: ``in_proj_qkv`` -> ``attn_qkv``, ``in_proj_z`` -> ``attn_gate``,
#   ``in_proj_b`` -> ``ssm_beta``, ``in_proj_a`` -> ``ssm_alpha``; when there are fewer key
#   than value heads the value heads are reordered from grouped (by key head) to tiled
#   order in every tensor that carries them (v rows of qkv and conv, z, b, a, A, dt, the
#   columns of ``ssm_out``); ``rope.dimension_sections`` is always written; ``mtp.*``
#   tensors become NextN blocks after the trunk (``block_count`` counts them,
#   ``nextn_predict_layers``);
# - qwen3next: ``in_proj_qkvz`` (per key head [q, k, v, z]) is split into ``attn_qkv``
#   ([all q, all k, all v]) and ``attn_gate``; ``in_proj_ba`` -> ``ssm_ba`` unchanged;
# - experts: ``gate_up_proj`` [E, 2 n_ff, n_embd] -> ``ffn_gate_exps`` + ``ffn_up_exps``,
#   ``down_proj`` -> ``ffn_down_exps``; router ``mlp.gate`` -> ``ffn_gate_inp`` and
#   ``shared_expert_gate`` -> ``ffn_gate_inp_shexp`` (both kept F32).

HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
_MTP_ARCHS = ("qwen35", "qwen35moe")
_GGUF_ARCH.update({"qwen35": MODEL_ARCH.QWEN35, "qwen35moe": MODEL_ARCH.QWEN35MOE, "qwen3next": MODEL_ARCH.QWEN3NEXT})
_HYBRID_MODEL_TYPES = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
_ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")

# 4 layers, alternating gated delta-net and full attention (full_attention_interval 2); 2 key
# heads for 4 value heads so the head broadcast and the converter's V reorder matter;
# partial rotary (a quarter of head_dim 32), as the real models.
_HYBRID_COMMON = dict(
    vocab_size=384, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False, layer_types=["linear_attention", "full_attention"] * 2,
)
_HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_HYBRID_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen35": dict(_HYBRID_COMMON, intermediate_size=128, rope_parameters=_QWEN35_ROPE),
    "qwen35moe": dict(_HYBRID_COMMON, **_HYBRID_MOE, rope_parameters=_QWEN35_ROPE),
    "qwen3next": dict(_HYBRID_COMMON, **_HYBRID_MOE, intermediate_size=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                       "partial_rotary_factor": 0.25}),
}


def _hybrid_config(arch: str, **overrides: Any):
    """The tiny transformers text config of a hybrid arch (``_HYBRID_DEFAULTS`` + overrides)."""
    import copy

    import transformers

    kw = copy.deepcopy(_HYBRID_DEFAULTS[arch])
    kw.update(copy.deepcopy(overrides))
    cls = {"qwen35": transformers.Qwen3_5TextConfig, "qwen35moe": transformers.Qwen3_5MoeTextConfig,
           "qwen3next": transformers.Qwen3NextConfig}[arch]
    cfg = cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _random_init(name: str, shape: tuple[int, ...], noise, gen):
    """Scales of a random hybrid-model tensor (see ``_random_hybrid_model``)."""
    import torch

    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.2 * noise  # plain RMSNorm weight (gated norm)
    if name.endswith("norm.weight") or name.endswith("norm_embedding.weight"):
        return 0.2 * noise  # zero-centred: the model multiplies by 1 + w
    if name.endswith("A_log"):  # decay rates A in [0.05, 2]: state memories from ~1 to ~20 tokens
        return torch.log(0.05 + 1.95 * torch.rand(shape, generator=gen))
    if name.endswith("dt_bias"):
        return 0.5 * noise
    if "embed_tokens" in name:
        return 0.25 * noise
    if len(shape) >= 2:  # linear, conv [C, 1, K] and expert [E, out, in] weights: N(0, 1/fan_in)
        return noise / math.sqrt(shape[-1])
    return 0.2 * noise


def _random_hybrid_model(arch: str, seed: int, **overrides: Any):
    """``random_hf_model`` for a hybrid arch: embeddings N(0, 0.25^2); weights N(0,
    1/fan_in); zero-centred norms N(0, 0.2^2) (the gated norm 1 + N(0, 0.2^2));
    ``A_log = ln U(0.05, 2)``; ``dt_bias`` N(0, 0.5^2)."""
    import torch
    import transformers

    cfg = _hybrid_config(arch, **overrides)
    cls = {"qwen35": transformers.Qwen3_5ForCausalLM, "qwen35moe": transformers.Qwen3_5MoeForCausalLM,
           "qwen3next": transformers.Qwen3NextForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    tied = bool(cfg.tie_word_embeddings)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if tied and name == "lm_head.weight":
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(_random_init(name, tuple(p.shape), noise, gen))
    if tied:
        model.tie_weights()
    return model


def hybrid_mtp_tensors(model, n_mtp: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random NextN/MTP tensors with the checkpoint names (``mtp.fc``,
    ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``,
    ``mtp.layers.{j}.*`` shaped like the model's first full-attention block).
    transformers does not build the MTP head, so the values are drawn here
    (a ``torch.Generator`` seeded from ``seed``), scaled as ``_random_hybrid_model``."""
    import torch

    cfg = model.config
    full = cfg.layer_types.index("full_attention")
    gen = torch.Generator().manual_seed(10_000 + seed)
    n = cfg.hidden_size
    shapes = {"mtp.fc.weight": (n, 2 * n), "mtp.pre_fc_norm_embedding.weight": (n,),
              "mtp.pre_fc_norm_hidden.weight": (n,), "mtp.norm.weight": (n,)}
    pre = f"model.layers.{full}."
    for j in range(n_mtp):
        for k, v in model.state_dict().items():
            if k.startswith(pre):
                shapes[f"mtp.layers.{j}.{k[len(pre):]}"] = tuple(v.shape)
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        out[name] = _random_init(name, shape, noise, gen).numpy().astype(np.float32)
    return out


def _v_reorder(t: np.ndarray, axis: int, n_k: int, r: int, hd: int) -> np.ndarray:
    """Value heads along ``axis`` from grouped ``[n_k][r][hd]`` to tiled ``[r][n_k][hd]``
    (``_LinearAttentionVReorderBase._reorder_v_heads``). The inverse is
    ``_v_reorder(t, axis, r, n_k, hd)``."""
    shape = t.shape
    t = t.reshape(*shape[:axis], n_k, r, hd, *shape[axis + 1:])
    return np.swapaxes(t, axis, axis + 1).reshape(shape)


def _v_reorder_tensor(name: str, t: np.ndarray, cfg, inverse: bool = False) -> np.ndarray:
    """Apply (or undo) the converter's value-head reorder to HF tensor ``name``
    (qwen35 / qwen35moe, only when key and value head counts differ)."""
    n_k, n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if n_k == n_v or "linear_attn." not in name:
        return t
    r, dk, dv = n_v // n_k, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    a, b = (r, n_k) if inverse else (n_k, r)
    qk = 2 * n_k * dk
    if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
        return np.concatenate([t[:qk], _v_reorder(t[qk:], 0, a, b, dv)], axis=0)
    if name.endswith("in_proj_z.weight"):
        return _v_reorder(t, 0, a, b, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return _v_reorder(t, 0, a, b, 1)
    if name.endswith("out_proj.weight"):
        return _v_reorder(t, 1, a, b, dv)
    return t


_NEXTN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
          "norm": "shared_head_norm"}


def _hybrid_gguf_name(arch: str, name: str, n_layer: int, tmap) -> str:
    """GGUF name of a (converter-renamed) HF tensor name; ``mtp.*`` remapped as
    ``_Qwen35MtpMixin.filter_tensors`` (layers after the trunk, ``blk.{n}.nextn.*``)."""
    if name.startswith("mtp."):
        parts = name.split(".", 3)
        if parts[1] == "layers":
            name = f"model.layers.{n_layer + int(parts[2])}.{parts[3]}"
        else:
            return f"blk.{n_layer}.nextn.{_NEXTN[parts[1]]}.weight"
    if name.endswith(".dt_bias"):
        name = name[: -len("dt_bias")] + "dt_proj.bias"
    if name.endswith("mlp.experts.gate_up_proj"):
        name = name[: -len("gate_up_proj")] + "gate_proj.weight"  # (the caller splits gate / up)
    elif name.endswith("mlp.experts.down_proj"):
        name += ".weight"
    gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise ValueError(f"{arch}: no GGUF name for HF tensor {name!r}")
    return gname


def hybrid_gguf_tensors(model, n_mtp: int = 0) -> list[tuple[str, np.ndarray]]:
    """``gguf_tensors`` for a hybrid model: ``[(gguf_name, float32 array)]`` with the
    converter transforms (section comment), plus ``n_mtp`` NextN blocks
    (``hybrid_mtp_tensors``) for qwen35 / qwen35moe."""
    arch = _arch_of(model)
    cfg = model.config
    n_layer = cfg.num_hidden_layers
    if n_mtp and arch not in _MTP_ARCHS:
        raise ValueError(f"{arch}: NextN/MTP blocks are written for {', '.join(_MTP_ARCHS)} only")
    tmap = gguf.get_tensor_name_map(_GGUF_ARCH[arch], n_layer + n_mtp)
    sd = {k: v.detach().to("cpu").float().numpy().copy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    sd.update(hybrid_mtp_tensors(model, n_mtp) if n_mtp else {})
    out: list[tuple[str, np.ndarray]] = []
    for name, data in sd.items():
        if arch in _MTP_ARCHS:
            data = _v_reorder_tensor(name, data, cfg)
        if name.endswith(".A_log"):
            data = -np.exp(data)
        elif "conv1d" in name:
            data = data.reshape(data.shape[0], data.shape[-1])
        elif name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight")) \
                and not name.endswith("linear_attn.norm.weight"):
            data = data + np.float32(1.0)
        gname = _hybrid_gguf_name(arch, name, n_layer, tmap)
        if name.endswith("in_proj_qkvz.weight"):  # qwen3next: [q, k, v, z] per key head -> qkv, z
            n_k, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
            rdv = cfg.linear_num_value_heads // n_k * cfg.linear_value_head_dim
            w = data.T.reshape(data.shape[1], n_k, -1)
            q, k, v, z = (w[..., a:b].reshape(w.shape[0], -1)
                          for a, b in ((0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + rdv), (2 * dk + rdv, 2 * dk + 2 * rdv)))
            bid = gname.split(".")[1]
            out.append((f"blk.{bid}.attn_qkv.weight", np.ascontiguousarray(np.concatenate([q, k, v], axis=1).T)))
            out.append((f"blk.{bid}.attn_gate.weight", np.ascontiguousarray(z.T)))
        elif name.endswith("mlp.experts.gate_up_proj"):
            n_ff = data.shape[1] // 2
            out.append((gname, np.ascontiguousarray(data[:, :n_ff])))
            out.append((gname.replace("ffn_gate_exps", "ffn_up_exps"), np.ascontiguousarray(data[:, n_ff:])))
        else:
            out.append((gname, np.ascontiguousarray(data)))
    return out


def _write_hybrid_hparams(w: gguf.GGUFWriter, arch: str, cfg, n_mtp: int) -> None:
    """The ``{arch}.*`` keys the converter writes for a hybrid model."""
    rope = _rope_params(cfg)
    d = cfg.to_dict()
    w.add_block_count(cfg.num_hidden_layers + n_mtp)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if d.get("intermediate_size") is not None:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if d.get("num_experts"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    # the converter writes config.json's full_attention_interval (default 4); transformers keeps
    # only layer_types, so the interval is recovered from them and must describe them exactly
    types = list(cfg.layer_types)
    interval = types.index("full_attention") + 1
    if types != ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]:
        raise ValueError(f"{arch}: layer_types {types} do not follow one full_attention_interval")
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch in _MTP_ARCHS:
        sec = list(rope.get("mrope_section", [11, 11, 10]))
        w.add_rope_dimension_sections((sec + [0, 0, 0, 0])[:4])
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)


def _load_gguf_into_hybrid(model, path: str | Path) -> None:
    """``load_gguf_into_hf`` for a hybrid model: undoes every converter transform."""
    import torch
    from opencoti.model.gguf_file import GGUFFile

    arch = _arch_of(model)
    cfg = model.config
    n_layer = cfg.num_hidden_layers
    tmap = gguf.get_tensor_name_map(_GGUF_ARCH[arch], n_layer)
    g = GGUFFile(path)
    sd = model.state_dict()
    new: dict[str, Any] = {}
    for name in sd:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = _hybrid_gguf_name(arch, name, n_layer, tmap)
        if name.endswith("in_proj_qkvz.weight"):
            bid = gname.split(".")[1]
            n_k, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
            qkv, z = g.dequantize(f"blk.{bid}.attn_qkv.weight"), g.dequantize(f"blk.{bid}.attn_gate.weight")
            H = qkv.shape[1]
            parts = [qkv[:n_k * dk], qkv[n_k * dk:2 * n_k * dk], qkv[2 * n_k * dk:], z]
            data = np.concatenate([p.T.reshape(H, n_k, -1) for p in parts], axis=-1).reshape(H, -1).T
        elif name.endswith("mlp.experts.gate_up_proj"):
            data = np.concatenate([g.dequantize(gname), g.dequantize(gname.replace("ffn_gate_exps", "ffn_up_exps"))],
                                  axis=1)
        else:
            data = g.dequantize(gname)
        if name.endswith(".A_log"):
            data = np.log(-data)
        elif name.endswith(("norm.weight",)) and not name.endswith("linear_attn.norm.weight"):
            data = data - np.float32(1.0)
        if arch in _MTP_ARCHS:
            data = _v_reorder_tensor(name, data, cfg, inverse=True)
        new[name] = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(sd[name].shape)
    with torch.no_grad():
        for k, v in new.items():
            sd[k].copy_(v)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    g.close()


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------
def _parse_override(s: str) -> tuple[str, Any]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m opencoti.tools.synth_gguf --arch ARCH --out FILE [--qtype T] [--seed N]
    [--variant V] [--rope-scaling llama3] [--vocab spm|bpe] [--set key=json ...]``."""
    ap = argparse.ArgumentParser(prog="python -m opencoti.tools.synth_gguf",
                                 description="Write a tiny random-weight model as GGUF.")
    ap.add_argument("--arch", required=True, choices=ARCHS + HYBRID_ARCHS)
    ap.add_argument("--out", required=True, help="output .gguf path")
    ap.add_argument("--qtype", default="F32", help="type of 2-D weights (F32, F16, Q8_0, Q4_0, Q4_K, Q6_K, ...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", default="auto", choices=("auto", "spm", "bpe"))
    ap.add_argument("--variant", choices=tuple(GEMMA4_VARIANTS), default=None,
                    help="gemma4 only: a family member (GEMMA4_VARIANTS), before --set overrides")
    ap.add_argument("--rope-scaling", choices=("none", "llama3"), default="none",
                    help="llama only: llama 3.1 rope scaling (writes rope_freqs.weight)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], type=_parse_override,
                    metavar="KEY=VALUE", help="config override, value parsed as JSON (repeatable)")
    ap.add_argument("--chat-template", default=None, help="file with a Jinja chat template to embed")
    ap.add_argument("--mtp", type=int, default=0, help="qwen35/qwen35moe: NextN/MTP blocks to append")
    args = ap.parse_args(list(argv) if argv is not None else None)
    overrides = dict(args.overrides)
    if args.variant is not None:
        if args.arch != "gemma4":
            ap.error("--variant applies to --arch gemma4 only")
        overrides = {**GEMMA4_VARIANTS[args.variant], **overrides}
    if args.rope_scaling == "llama3":
        if args.arch != "llama":
            ap.error("--rope-scaling llama3 applies to --arch llama only")
        overrides["rope_parameters"] = dict(LLAMA3_ROPE)
    tmpl = None
    try:
        if args.chat_template:
            tmpl = Path(args.chat_template).read_text(encoding="utf-8")
        model = random_hf_model(args.arch, args.seed, **overrides)
        write_gguf(model, args.out, args.qtype, vocab=args.vocab, chat_template=tmpl, n_mtp=args.mtp)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({args.arch}, {parse_qtype(args.qtype).name}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
