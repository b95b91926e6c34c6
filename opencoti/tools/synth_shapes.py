"""Random-weight GGUF files with a real model's exact shapes, tensor names and quant types.

For GPU parity and bandwidth tests where the real weights cannot travel (a 7B
Q4_K_M is 4.4 GiB): the file has the same tensors, in the same ggml block
formats, as the real model's llama.cpp quantization, so a decode step reads the
same bytes and runs the same kernels. Only NumPy and ``gguf`` are needed (no
torch), so it runs on the GPU machine itself.

Presets (``PRESETS``): ``gemma-3-270m-q4_k_m``, ``gemma-3-12b-q4_k_m``,
``qwen2.5-7b-q4_k_m``, ``llama-3-8b-q4_k_m``, ``gemma-4-26b-a4b-q4_k_m`` (MoE),
``gemma-4-12b-q4_k_m`` (dense), ``qwen3.5-35b-a3b-q4_k_m`` (gated delta-net +
MoE hybrid). Hyperparameters are the models' ``config.json`` values as
llama.cpp's ``convert_hf_to_gguf.py`` (``conversion/gemma.py``,
``conversion/qwen.py``) writes them; each preset's comment names its sources.

Quant types follow llama.cpp's ``llama_tensor_get_type`` (``src/llama-quant.cpp``,
the version with ``tensor_category``) for ``LLAMA_FTYPE_MOSTLY_Q4_K_M``:

- not quantized (kept as the converter wrote them, F32 here): tensors with
  fewer than 2 dims (ggml_n_dims: trailing 1s do not count), names that do not
  end in ``weight`` (``ffn_gate_inp.scale``, ``ssm_a``, biases), ``*_norm.weight``,
  ``ffn_gate_inp.weight`` (routers), ``ssm_conv1d``.
- ``output.weight``, or ``token_embd.weight`` when the output is tied: Q6_K
  (Q8_0 when a row is not a multiple of 256).
- the "attn_v-like" tensors ``attn_v.weight`` and ``attn_qkv.weight`` (the
  gated delta-net input projection): Q6_K where ``use_more_bits(i, n)`` holds
  (``i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2``, integer division), with
  ``i`` the tensor's index among all attn_v-like tensors in llama.cpp's
  weight order (by layer) and ``n`` their count (Gemma-4 global layers have no
  ``attn_v``, so ``n`` < n_layer there), else Q4_K.
- every tensor whose name contains ``ffn_down`` (dense, routed ``_exps`` and
  shared ``_shexp``): Q6_K where ``use_more_bits(layer, n_layer)``, else Q4_K.
- a model with exactly 8 experts gets attn_v/attn_k Q8_0 and attn_output Q5_K.
- every other matrix (expert tensors included): Q4_K.
- a K-quant needs rows of a multiple of 256 values; otherwise llama-quantize
  falls back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (Gemma-4 26B-A4B:
  ``ffn_down`` rows of 2112 and ``ffn_down_exps`` rows of 704).

On the real gemma-3-270m Q4_K_M this reproduces every tensor's type and shape
(tests/test_synth_shapes.py checks it against the real file's header).

Weights: each block gets random quant bits and sub-block scales; its f16
super-scale fields (``d``, and ``dmin``/``m`` where the type has one) are set
once per tensor so that the dequantized values have mean ~0 and standard
deviation ``WEIGHT_STD`` (solved from the dequantization, which is linear in
those fields). Norm weights are ~1, biases small. Every tensor's data comes
from a generator seeded by ``(seed, name)``, so the same call writes the same
bytes anywhere. The vocabulary is ``synth_gguf.make_vocab``'s (valid
SentencePiece / BPE tokens padded to ``n_vocab``), so the file loads with a
tokenizer and serves.

CLI: ``python -m opencoti.tools.synth_shapes --preset qwen2.5-7b-q4_k_m --out q7b.gguf``
(``--layers N`` for fewer layers, ``--set key=value`` to change a shape, e.g. a CI-sized
Gemma-4 MoE: ``--preset gemma-4-26b-a4b-q4_k_m --layers 2 --set swa_period=2 --set n_expert=8``).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

WEIGHT_STD = 0.02

# (offset, role) of each f16 super-scale field in a block: role "d" multiplies the
# quants, "m" is the min term (ggml-common.h block layouts).
_SCALE_FIELDS = {
    QT.Q4_0: [(0, "d")], QT.Q4_1: [(0, "d"), (2, "m")], QT.Q5_0: [(0, "d")], QT.Q5_1: [(0, "d"), (2, "m")],
    QT.Q8_0: [(0, "d")], QT.Q2_K: [(80, "d"), (82, "m")], QT.Q3_K: [(108, "d")],
    QT.Q4_K: [(0, "d"), (2, "m")], QT.Q5_K: [(0, "d"), (2, "m")], QT.Q6_K: [(208, "d")],
}
_K_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0, QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_1}


@dataclass(frozen=True)
class Shape:
    """Hyperparameters of one model (the GGUF ``<arch>.*`` keys).

    arch: ``general.architecture`` ("gemma3", "gemma4", "qwen2", "qwen35moe", "llama");
    n_embd, n_ff, n_layer, n_head, n_head_kv, head_dim, n_vocab: sizes (for gemma4
    ``n_head_kv`` / ``head_dim`` are the sliding layers');
    n_ctx_train: ``context_length``; rope_base (global layers), rope_base_swa;
    rope_scale_linear: a linear RoPE factor (gemma-3 12B: 8) or 0;
    n_swa: sliding window (gemma3/4) or 0; eps: RMSNorm epsilon;
    tied: the output projection is ``token_embd``; qkv_bias: q/k/v biases (qwen2).

    Gemma-4: swa_period (layer ``il`` is global when ``(il + 1) % swa_period == 0``),
    n_head_kv_global, head_dim_global (0: as the sliding layers), k_eq_v (global
    layers have no ``attn_v``: V is K's projection), softcap (final logit softcapping).
    MoE: n_expert, n_expert_used, n_ff_exp (routed expert width), n_ff_shexp
    (shared expert width, 0: none). Hybrid (qwen35moe): full_attn_interval (layer
    ``il`` is full attention when ``(il + 1) % full_attn_interval == 0``, else a
    gated delta-net layer), ssm_d_conv (conv kernel), ssm_d_state (key head dim),
    ssm_n_group (key heads), ssm_dt_rank (value heads), ssm_head_v_dim (value head
    dim); n_rot: rotated dims (0: head_dim); rope_sections: M-RoPE sections.
    """

    name: str
    arch: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    eps: float
    tied: bool
    qkv_bias: bool = False
    n_swa: int = 0
    rope_base_swa: float = 10000.0
    rope_scale_linear: float = 0.0
    ftype: str = "Q4_K_M"
    # gemma4
    swa_period: int = 0
    n_head_kv_global: int = 0
    head_dim_global: int = 0
    k_eq_v: bool = False
    softcap: float = 0.0
    # MoE
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    # hybrid gated delta-net (qwen35moe)
    full_attn_interval: int = 0
    ssm_d_conv: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    ssm_dt_rank: int = 0
    ssm_head_v_dim: int = 0
    n_rot: int = 0
    rope_sections: tuple = ()

    def is_global(self, il: int) -> bool:
        """Gemma-4: layer ``il`` is a global (full-attention) layer."""
        return self.swa_period > 0 and (il + 1) % self.swa_period == 0

    def is_recurrent(self, il: int) -> bool:
        """qwen35moe: layer ``il`` is a gated delta-net layer."""
        return self.full_attn_interval > 0 and (il + 1) % self.full_attn_interval != 0


PRESETS = {
    "gemma-3-270m-q4_k_m": Shape("Gemma 3 270m (synthetic)", "gemma3", 640, 2048, 18, 4, 1, 256, 262144, 32768,
                                 1e6, 1e-6, True, n_swa=512),
    "gemma-3-12b-q4_k_m": Shape("Gemma 3 12b (synthetic)", "gemma3", 3840, 15360, 48, 16, 8, 256, 262208, 131072,
                                1e6, 1e-6, True, n_swa=1024, rope_scale_linear=8.0),
    "qwen2.5-7b-q4_k_m": Shape("Qwen2.5 7B (synthetic)", "qwen2", 3584, 18944, 28, 28, 4, 128, 152064, 32768,
                               1e6, 1e-6, False, qkv_bias=True),
    "llama-3-8b-q4_k_m": Shape("Llama 3 8B (synthetic)", "llama", 4096, 14336, 32, 32, 8, 128, 128256, 8192,
                               5e5, 1e-5, False),
    # Gemma 4 26B-A4B (google/gemma-4-26B-A4B[-it], text_config): hidden_size 2816, 30 layers,
    # intermediate_size 2112 (the dense MLP every layer has), 16 heads, num_key_value_heads 8
    # (sliding) / num_global_key_value_heads 2, head_dim 256 / global_head_dim 512,
    # attention_k_eq_v true, layer_types 5 sliding + 1 full (x5), sliding_window 1024,
    # enable_moe_block: num_experts 128, top_k_experts 8, moe_intermediate_size 704;
    # vocab_size 262144, max_position_embeddings 262144, tie_word_embeddings true,
    # final_logit_softcapping 30, rope_theta 1e6 (full, proportional, partial 0.25) / 1e4
    # (sliding), rms_norm_eps 1e-6. Sources: the config.json text_config as quoted
    # verbatim in public code (mlx-community/gemma-4-26b-a4b-it-4bit pinned config in a
    # Swift test; vLLM-/GGUF-tool test fixtures "real google/gemma-4-26B-A4B shape"); GGUF
    # names/keys from llama.cpp conversion/gemma.py Gemma4Model (fused ffn_gate_up_exps,
    # ffn_gate_inp.scale, ffn_down_exps.scale, layer_output_scale, rope_freqs) and
    # opencoti/engine/arch/gemma4.py.
    "gemma-4-26b-a4b-q4_k_m": Shape("Gemma 4 26B-A4B (synthetic)", "gemma4", 2816, 2112, 30, 16, 8, 256, 262144,
                                    262144, 1e6, 1e-6, True, n_swa=1024, swa_period=6, n_head_kv_global=2,
                                    head_dim_global=512, k_eq_v=True, softcap=30.0, n_expert=128,
                                    n_expert_used=8, n_ff_exp=704),
    # Gemma 4 12B (google/gemma-4-12B[-it], "Gemma 4 12B Unified", Gemma4UnifiedForConditionalGeneration;
    # llama.cpp converts it as Gemma4UnifiedModel -> arch gemma4, text graph as the others):
    # hidden_size 3840, 48 layers, intermediate_size 15360, 16 heads, num_key_value_heads 8 /
    # num_global_key_value_heads 1, head_dim 256 / global_head_dim 512, attention_k_eq_v true,
    # 5 sliding + 1 full, sliding_window 1024, vocab_size 262144, max_position_embeddings 262144,
    # no PLE (hidden_size_per_layer_input 0), no KV sharing, tied, softcap 30, rope as 26B.
    # Sources: config.json text_config quoted in public code (a Go test's gemma4_unified
    # config; a JAX port's "configs from the official google/gemma-4-* checkpoints"); the model
    # card (11.95B params, 48 layers, 1024 window, 262K vocab).
    "gemma-4-12b-q4_k_m": Shape("Gemma 4 12B (synthetic)", "gemma4", 3840, 15360, 48, 16, 8, 256, 262144, 262144,
                                1e6, 1e-6, True, n_swa=1024, swa_period=6, n_head_kv_global=1, head_dim_global=512,
                                k_eq_v=True, softcap=30.0),
    # Qwen3.5-35B-A3B (Qwen3_5MoeForConditionalGeneration, text_config qwen3_5_moe_text): hidden_size
    # 2048, 40 layers, full_attention_interval 4 (30 gated delta-net + 10 gated attention layers),
    # attention: 16 heads, 2 KV heads, head_dim 256, partial_rotary_factor 0.25 (n_rot 64),
    # rope_theta 1e7, mrope_section [11, 11, 10]; linear attention: linear_num_key_heads 16,
    # linear_num_value_heads 32, linear_key_head_dim 128, linear_value_head_dim 128,
    # linear_conv_kernel_dim 4; MoE in every layer: num_experts 256, num_experts_per_tok 8,
    # moe_intermediate_size 512, shared_expert_intermediate_size 512 (gated by
    # shared_expert_gate); vocab_size 248320, max_position_embeddings 262144, untied, eps 1e-6.
    # Sources: config.json as quoted in public code (several Qwen3.5/3.6-35B-A3B config fixtures)
    # and the GGUF keys llama.cpp's converter writes for it (qwen35moe.ssm.inner_size 4096,
    # state_size 128, group_count 16, time_step_rank 32, rope.dimension_count 64); tensor names
    # from conversion/qwen.py (Qwen3_5MoeTextModel: separate ffn_gate_exps / ffn_up_exps) and
    # opencoti/engine/arch/qwen35.py. The trunk only: the MTP block (mtp_num_hidden_layers 1),
    # which current converters append as blk.40.nextn.*, is left out (convert --no-mtp; not
    # read by plain decoding).
    "qwen3.5-35b-a3b-q4_k_m": Shape("Qwen3.5 35B-A3B (synthetic)", "qwen35moe", 2048, 0, 40, 16, 2, 256, 248320,
                                    262144, 1e7, 1e-6, False, n_expert=256, n_expert_used=8, n_ff_exp=512,
                                    n_ff_shexp=512, full_attn_interval=4, ssm_d_conv=4, ssm_d_state=128,
                                    ssm_n_group=16, ssm_dt_rank=32, ssm_head_v_dim=128, n_rot=64,
                                    rope_sections=(11, 11, 10, 0)),
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp ``use_more_bits``: the layers Q4_K_M gives a wider type."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims: dims up to the last one larger than 1."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def _quantizable(name: str, ne: tuple[int, ...]) -> bool:
    """llama.cpp ``tensor_allows_quantization`` for the tensors these presets have."""
    return (_n_dims(ne) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ssm_conv1d" not in name
            and "per_layer_model_proj" not in name)


def _attn_v_like(name: str) -> bool:
    return any(k in name for k in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"))


def _layer_of(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def tensor_type(name: str, ne: tuple[int, ...], shape: Shape, wv: tuple[int, int] | None = None) -> QT:
    """ggml type of tensor ``name`` (GGUF ``ne`` order: ``ne[0]`` = row length) under
    ``shape.ftype`` (only "Q4_K_M"). ``wv``: ``(index, count)`` of an attn_v-like
    tensor among all of them (default ``(layer, n_layer)``, right when every layer has
    one; ``tensor_list`` passes the real ones). Raises ``ValueError`` for another ftype."""
    if shape.ftype != "Q4_K_M":
        raise ValueError(f"ftype {shape.ftype!r}: only Q4_K_M is modelled")
    if not _quantizable(name, ne):
        return QT.F32
    il = _layer_of(name)
    if name == "output.weight" or (shape.tied and name in ("token_embd.weight", "per_layer_token_embd.weight")):
        t = QT.Q8_0 if ne[0] % 256 else QT.Q6_K
    elif _attn_v_like(name):
        i, n = wv if wv is not None else (il, shape.n_layer)
        t = QT.Q8_0 if shape.n_expert == 8 else (QT.Q6_K if use_more_bits(i, n) else QT.Q4_K)
    elif "attn_k.weight" in name and shape.n_expert == 8:
        t = QT.Q8_0
    elif "ffn_down" in name:
        t = QT.Q6_K if use_more_bits(il, shape.n_layer) else QT.Q4_K
    elif "attn_output.weight" in name and shape.n_expert == 8:
        t = QT.Q5_K
    else:
        t = QT.Q4_K
    if ne[0] % gguf.GGML_QUANT_SIZES[t][0]:
        t = _K_FALLBACK.get(t, t)
    return t


def _dense_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """llama / qwen2 / gemma3 blocks."""
    e, f, hd = shape.n_embd, shape.n_ff, shape.head_dim
    q, kv = shape.n_head * hd, shape.n_head_kv * hd
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (e, shape.n_vocab))]
    for il in range(shape.n_layer):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (e, q)), (b + "attn_k.weight", (e, kv)),
                (b + "attn_v.weight", (e, kv)), (b + "attn_output.weight", (q, e))]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        if shape.arch == "gemma3":
            out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,)),
                    (b + "post_attention_norm.weight", (e,)), (b + "post_ffw_norm.weight", (e,))]
        out += [(b + "ffn_norm.weight", (e,)), (b + "ffn_gate.weight", (e, f)), (b + "ffn_up.weight", (e, f)),
                (b + "ffn_down.weight", (f, e))]
    out.append(("output_norm.weight", (e,)))
    if not shape.tied:
        out.append(("output.weight", (e, shape.n_vocab)))
    return out


def _gemma4_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Gemma-4 (no per-layer embeddings, no KV sharing): what ``Gemma4Model`` writes."""
    e, f, h = shape.n_embd, shape.n_ff, shape.n_head
    hd_g = shape.head_dim_global or shape.head_dim
    out: list[tuple[str, tuple[int, ...]]] = []
    if any(shape.is_global(il) for il in range(shape.n_layer)):
        out.append(("rope_freqs.weight", (hd_g // 2,)))  # proportional RoPE of the global layers
    out.append(("token_embd.weight", (e, shape.n_vocab)))
    for il in range(shape.n_layer):
        b = f"blk.{il}."
        glob = shape.is_global(il)
        hd = hd_g if glob else shape.head_dim
        kv = (shape.n_head_kv_global or shape.n_head_kv) if glob else shape.n_head_kv
        out += [(b + "layer_output_scale.weight", (1,)), (b + "attn_q.weight", (e, h * hd)),
                (b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,)),
                (b + "attn_k.weight", (e, kv * hd))]
        if not (glob and shape.k_eq_v):
            out.append((b + "attn_v.weight", (e, kv * hd)))
        out += [(b + "attn_output.weight", (h * hd, e)), (b + "ffn_gate.weight", (e, f)),
                (b + "ffn_up.weight", (e, f)), (b + "ffn_down.weight", (f, e)), (b + "attn_norm.weight", (e,)),
                (b + "post_attention_norm.weight", (e,)), (b + "ffn_norm.weight", (e,)),
                (b + "post_ffw_norm.weight", (e,))]
        if shape.n_expert:
            x, fe = shape.n_expert, shape.n_ff_exp
            out += [(b + "ffn_gate_inp.scale", (e,)), (b + "ffn_down_exps.scale", (x,)),
                    (b + "ffn_gate_inp.weight", (e, x)), (b + "ffn_gate_up_exps.weight", (e, 2 * fe, x)),
                    (b + "ffn_down_exps.weight", (fe, e, x)), (b + "post_ffw_norm_1.weight", (e,)),
                    (b + "post_ffw_norm_2.weight", (e,)), (b + "pre_ffw_norm_2.weight", (e,))]
    out.append(("output_norm.weight", (e,)))
    return out


def _qwen35moe_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3.5 MoE trunk: what ``Qwen3_5MoeTextModel`` writes (no MTP block)."""
    e, h, hd = shape.n_embd, shape.n_head, shape.head_dim
    n_k, d_k, n_v, d_v = shape.ssm_n_group, shape.ssm_d_state, shape.ssm_dt_rank, shape.ssm_head_v_dim
    conv_ch = 2 * n_k * d_k + n_v * d_v
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (e, shape.n_vocab))]
    for il in range(shape.n_layer):
        b = f"blk.{il}."
        if shape.is_recurrent(il):
            out += [(b + "ssm_dt.bias", (n_v,)), (b + "ssm_a", (n_v,)), (b + "ssm_conv1d.weight", (shape.ssm_d_conv, conv_ch)),
                    (b + "ssm_norm.weight", (d_v,)), (b + "ssm_out.weight", (n_v * d_v, e)),
                    (b + "attn_qkv.weight", (e, conv_ch)), (b + "attn_gate.weight", (e, n_v * d_v)),
                    (b + "ssm_beta.weight", (e, n_v)), (b + "ssm_alpha.weight", (e, n_v))]
        else:
            kv = shape.n_head_kv * hd
            out += [(b + "attn_q.weight", (e, 2 * h * hd)), (b + "attn_k.weight", (e, kv)),
                    (b + "attn_v.weight", (e, kv)), (b + "attn_output.weight", (h * hd, e)),
                    (b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        x, fe = shape.n_expert, shape.n_ff_exp
        out += [(b + "ffn_gate_inp.weight", (e, x)), (b + "ffn_gate_exps.weight", (e, fe, x)),
                (b + "ffn_up_exps.weight", (e, fe, x)), (b + "ffn_down_exps.weight", (fe, e, x))]
        if shape.n_ff_shexp:
            fs = shape.n_ff_shexp
            out += [(b + "ffn_gate_shexp.weight", (e, fs)), (b + "ffn_up_shexp.weight", (e, fs)),
                    (b + "ffn_down_shexp.weight", (fs, e)), (b + "ffn_gate_inp_shexp.weight", (e, 1))]
        out += [(b + "attn_norm.weight", (e,)), (b + "post_attention_norm.weight", (e,))]
    out.append(("output_norm.weight", (e,)))
    if not shape.tied:
        out.append(("output.weight", (e, shape.n_vocab)))
    return out


def tensor_list(shape: Shape) -> list[tuple[str, tuple[int, ...], QT]]:
    """``(name, ne, type)`` of every tensor, in llama.cpp's converter order
    (``ne`` in GGUF order: ``(n_in, n_out)`` for a matrix, ``(n_in, n_out, n_expert)``
    for an expert tensor). Raises ``ValueError`` for an arch without a recipe."""
    if shape.arch in ("llama", "qwen2", "gemma3"):
        out = _dense_tensors(shape)
    elif shape.arch == "gemma4":
        out = _gemma4_tensors(shape)
    elif shape.arch == "qwen35moe":
        out = _qwen35moe_tensors(shape)
    else:
        raise ValueError(f"no tensor recipe for arch {shape.arch!r}")
    # llama-quantize visits tensors sorted by layer, then name (llama_model_loader weight_name_comparer)
    wv = sorted((n for n, _ in out if _attn_v_like(n)), key=lambda n: (_layer_of(n), n))
    idx = {n: i for i, n in enumerate(wv)}
    return [(n, ne, tensor_type(n, ne, shape, (idx[n], len(wv)) if n in idx else None)) for n, ne in out]


def _rng(seed: int, name: str) -> np.random.Generator:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def _calibrate(t: QT, rng: np.random.Generator, std: float) -> dict[str, float]:
    """f16 values of the type's scale fields giving dequantized mean ~0, std ``std``."""
    bsz, tsz = gguf.GGML_QUANT_SIZES[t]
    sample = rng.integers(0, 256, (64, tsz), dtype=np.uint8)
    fields = _SCALE_FIELDS[t]

    def deq(vals: dict[str, float]) -> np.ndarray:
        b = sample.copy()
        for off, role in fields:
            b[:, off:off + 2] = np.full((len(b), 1), vals[role], np.float16).view(np.uint8)
        return gguf.quants.dequantize(b, t).astype(np.float64).ravel()

    a = deq({"d": 1.0, "m": 0.0})
    if len(fields) == 1:
        base = a - a.mean() if t == QT.Q8_0 else a  # symmetric types are centred already
        return {"d": std / max(base.std(), 1e-12)}
    m1 = deq({"d": 0.0, "m": 1.0})
    m = -a.mean() / m1.mean()
    s = std / max((a + m * m1).std(), 1e-12)
    return {"d": s, "m": m * s}


def tensor_data(name: str, ne: tuple[int, ...], t: QT, seed: int = 0, std: float = WEIGHT_STD) -> np.ndarray:
    """Random data of one tensor: float32 ``[rows, ne[0]]`` for F32/F16 types
    (F16 as float16), uint8 ``[rows, row_bytes]`` blocks for a quantized type, with
    ``rows = prod(ne[1:])`` (1 for a vector, which comes back 1-D).

    Values with a meaning: ``rope_freqs.weight`` (Gemma-4 proportional RoPE, partial
    factor 0.25: 1 for the first quarter of the pairs, 1e30 for the rest, as
    ``Gemma4Model.generate_extra_tensors``); ``ssm_a`` = ``-U(0.05, 2)`` (``-exp(A_log)``);
    norms and ``*scale*`` tensors ~1; other vectors (biases, ``ssm_dt``) small."""
    rng = _rng(seed, name)
    rows, cols = int(np.prod(ne[1:])) if len(ne) > 1 else 1, ne[0]
    if t in (QT.F32, QT.F16, QT.BF16):
        if len(ne) == 1:
            if name == "rope_freqs.weight":
                k = cols // 4
                return np.array([1.0] * k + [1e30] * (cols - k), dtype=np.float32)
            if name.endswith(".ssm_a"):
                return (-(0.05 + 1.95 * rng.random(cols))).astype(np.float32)
            is_norm = "norm" in name or "scale" in name
            x = (1.0 + 0.1 * rng.standard_normal(cols)) if is_norm else 0.1 * std * rng.standard_normal(cols)
            return x.astype(np.float32)
        x = (std * rng.standard_normal((rows, cols))).astype(np.float32)
        return x.astype(np.float16) if t == QT.F16 else x
    if t not in _SCALE_FIELDS:
        raise ValueError(f"{name}: no random block recipe for {t.name}")
    bsz, tsz = gguf.GGML_QUANT_SIZES[t]
    vals = _calibrate(t, rng, std)
    nb = rows * cols // bsz
    data = np.frombuffer(rng.bytes(nb * tsz), dtype=np.uint8).reshape(nb, tsz).copy()
    for off, role in _SCALE_FIELDS[t]:
        data[:, off:off + 2] = np.full((1, 1), vals[role], np.float16).view(np.uint8)
    return data.reshape(rows, cols // bsz * tsz)


def _write_metadata(w: gguf.GGUFWriter, shape: Shape) -> None:
    """The ``<arch>.*`` keys llama.cpp's converter writes for ``shape``, and a vocabulary."""
    from opencoti.tools.synth_gguf import make_vocab

    a = shape.arch
    w.add_name(shape.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    if shape.n_ff:
        w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    if a == "gemma4":  # Gemma4Model.set_gguf_parameters: per-layer KV heads, _swa head dims
        swa = [not shape.is_global(il) for il in range(shape.n_layer)]
        kv_g = shape.n_head_kv_global or shape.n_head_kv
        w.add_head_count_kv([shape.n_head_kv if s else kv_g for s in swa])
    else:
        w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_rope_freq_base(shape.rope_base)
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        w.add_expert_feed_forward_length(shape.n_ff_exp)
        if shape.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(shape.n_ff_shexp)
    if a == "gemma3":
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_sliding_window(shape.n_swa)
        if shape.rope_scale_linear:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(shape.rope_scale_linear)
    elif a == "gemma4":
        hd_g = shape.head_dim_global or shape.head_dim
        w.add_rope_freq_base_swa(shape.rope_base_swa)
        if shape.softcap:
            w.add_final_logit_softcapping(shape.softcap)
        w.add_sliding_window(shape.n_swa)
        w.add_shared_kv_layers(0)
        w.add_embedding_length_per_layer_input(0)
        w.add_sliding_window_pattern(swa)
        w.add_key_length(hd_g)
        w.add_value_length(hd_g)
        w.add_key_length_swa(shape.head_dim)
        w.add_value_length_swa(shape.head_dim)
        w.add_rope_dimension_count(hd_g)  # proportional RoPE: rope_freqs.weight leaves the rest unrotated
        w.add_rope_dimension_count_swa(shape.head_dim)
    elif a == "qwen35moe":
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_ssm_conv_kernel(shape.ssm_d_conv)
        w.add_ssm_state_size(shape.ssm_d_state)
        w.add_ssm_group_count(shape.ssm_n_group)
        w.add_ssm_time_step_rank(shape.ssm_dt_rank)
        w.add_ssm_inner_size(shape.ssm_dt_rank * shape.ssm_head_v_dim)
        w.add_full_attention_interval(shape.full_attn_interval)
        w.add_rope_dimension_count(shape.n_rot or shape.head_dim)
        w.add_rope_dimension_sections(list(shape.rope_sections))
    else:
        w.add_vocab_size(shape.n_vocab)
        w.add_rope_dimension_count(shape.head_dim)
        if shape.head_dim * shape.n_head != shape.n_embd:  # (else the reader's default, n_embd / n_head)
            w.add_key_length(shape.head_dim)
            w.add_value_length(shape.head_dim)
    if a in ("gemma3", "gemma4"):
        make_vocab("spm", shape.n_vocab, a).write(w)
    else:
        make_vocab("bpe", shape.n_vocab, "llama" if a == "llama" else "qwen2").write(w)


def _byte_shape(ne: tuple[int, ...], t: QT) -> tuple[int, ...]:
    """NumPy shape of a quantized tensor's bytes: ``reversed(ne)`` with the row in bytes."""
    bsz, tsz = gguf.GGML_QUANT_SIZES[t]
    return tuple(ne[1:][::-1]) + (ne[0] // bsz * tsz,)


def write_model(shape: Shape | str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the random-weight GGUF of ``shape`` (a ``Shape`` or a ``PRESETS`` key;
    ``overrides`` replace its fields, e.g. ``n_layer=2``) to ``path``, one tensor
    at a time (memory stays at one tensor). Returns the path. Raises ``KeyError``
    for an unknown preset."""
    shape = _shape(shape, **overrides)
    path = Path(path)
    tensors = tensor_list(shape)
    w = gguf.GGUFWriter(str(path), shape.arch)
    _write_metadata(w, shape)
    for name, ne, t in tensors:
        bsz, tsz = gguf.GGML_QUANT_SIZES[t]
        n = int(np.prod(ne))
        if t == QT.F32:
            w.add_tensor_info(name, ne[::-1], np.dtype(np.float32), n * 4)
        elif t == QT.F16:
            w.add_tensor_info(name, ne[::-1], np.dtype(np.float16), n * 2)
        else:
            nbytes = n // bsz * tsz
            w.add_tensor_info(name, _byte_shape(ne, t), np.dtype(np.uint8), nbytes, raw_dtype=t)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, ne, t in tensors:
        d = tensor_data(name, ne, t, seed)
        w.write_tensor_data(d.reshape(ne[::-1] if t in (QT.F32, QT.F16) else _byte_shape(ne, t)))
    w.close()
    return path


def _shape(shape: Shape | str, **overrides) -> Shape:
    """``shape`` (a ``Shape`` or a ``PRESETS`` key) with ``overrides`` applied."""
    return replace(PRESETS[shape] if isinstance(shape, str) else shape, **overrides)


def file_bytes(shape: Shape | str, **overrides) -> int:
    """Bytes of tensor data ``write_model`` writes (without header and padding)."""
    shape = _shape(shape, **overrides)
    tot = 0
    for _, ne, t in tensor_list(shape):
        bsz, tsz = gguf.GGML_QUANT_SIZES[t]
        tot += int(np.prod(ne)) // bsz * tsz
    return tot


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="n_layer override")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a Shape field (int, float or bool)")
    a = ap.parse_args(argv)
    ov = {}
    for s in a.set:
        k, _, v = s.partition("=")
        cur = getattr(PRESETS[a.preset], k)
        ov[k] = v.lower() in ("1", "true") if isinstance(cur, bool) else type(cur)(v)
    if a.layers is not None:
        ov["n_layer"] = a.layers
    p = write_model(a.preset, a.out, a.seed, **ov)
    print(f"wrote {p} ({p.stat().st_size / 2**30:.2f} GiB, {file_bytes(a.preset, **ov) / 2**30:.2f} GiB of tensors)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
