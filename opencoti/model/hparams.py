"""Typed hyper-parameters read from GGUF metadata.

Keys follow llama.cpp's ``LLM_KV_*`` names (``src/llama-arch.cpp``), prefixed
with ``general.architecture`` (e.g. ``gemma3.attention.head_count``). Per-arch
defaults and quirks (Gemma-3's sliding-window pattern and local RoPE base)
follow ``llama_model::load_hparams`` in ``src/llama-model.cpp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from opencoti.model.gguf_file import GGUFError

# rope types (llama.cpp llama_rope_type): NORM rotates adjacent pairs, NEOX the two halves.
ROPE_NORM = "norm"
ROPE_NEOX = "neox"


@dataclass
class HParams:
    """Model shape and numerics.

    Dimensions are counts; ``rope_*`` bases are in radians' inverse-frequency
    base units as in the RoPE paper (Su et al. 2021). ``swa_layers[il]`` is
    True for sliding-window layers (window ``n_swa`` tokens: a key at position
    p0 is visible to a query at p1 when ``0 <= p1 - p0 < n_swa``).
    """

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ff: int
    f_norm_rms_eps: float
    rope_type: str
    rope_freq_base: float
    rope_freq_scale: float = 1.0
    rope_freq_base_swa: Optional[float] = None
    rope_freq_scale_swa: float = 1.0
    n_rot: int = 0
    n_swa: int = 0
    swa_layers: list[bool] = field(default_factory=list)
    f_attention_scale: float = 0.0  # 0 -> 1/sqrt(n_embd_head_k)
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    rope_scaling_type: str = "none"
    rope_scaling_factor: float = 0.0
    n_ctx_orig_yarn: int = 0
    tie_embeddings: bool = False
    # -- per-layer shapes and KV sharing (Gemma-4; llama.cpp ``llama_hparams``) ---------------
    # Empty lists / 0 mean "uniform": the scalars above hold for every layer.
    n_head_kv_arr: list[int] = field(default_factory=list)  # ``attention.head_count_kv`` array
    n_ff_arr: list[int] = field(default_factory=list)  # ``feed_forward_length`` array
    n_embd_head_k_swa: int = 0  # ``attention.key_length_swa``: head dim of sliding layers
    n_embd_head_v_swa: int = 0  # ``attention.value_length_swa``
    n_rot_swa: int = 0  # ``rope.dimension_count_swa``
    # kv_reuse[il] = -1: layer il stores its own K/V; j >= 0: it attends over layer j's cache
    # and writes none (llama.cpp ``n_layer_kv_from_start`` + the KV cache's layer-reuse callback).
    kv_reuse: list[int] = field(default_factory=list)
    n_embd_per_layer: int = 0  # ``embedding_length_per_layer_input``: per-layer embedding width
    n_expert: int = 0  # ``expert_count``
    n_expert_used: int = 0  # ``expert_used_count``
    n_ff_exp: int = 0  # ``expert_feed_forward_length``

    def n_head_kv_l(self, il: int) -> int:
        """KV heads of layer ``il`` (llama.cpp ``hparams.n_head_kv(il)``)."""
        return self.n_head_kv_arr[il] if self.n_head_kv_arr else self.n_head_kv

    def n_embd_head_k_l(self, il: int) -> int:
        """K head dim of layer ``il``: the ``_swa`` value on sliding layers when set."""
        return self.n_embd_head_k_swa if (self.n_embd_head_k_swa and self.swa_layers[il]) else self.n_embd_head_k

    def n_embd_head_v_l(self, il: int) -> int:
        """V head dim of layer ``il`` (as ``n_embd_head_k_l``)."""
        return self.n_embd_head_v_swa if (self.n_embd_head_v_swa and self.swa_layers[il]) else self.n_embd_head_v

    def n_rot_l(self, il: int) -> int:
        """Rotated dims of layer ``il`` (``rope.dimension_count[_swa]``)."""
        return self.n_rot_swa if (self.n_rot_swa and self.swa_layers[il]) else self.n_rot

    def n_ff_l(self, il: int) -> int:
        """FFN width of layer ``il``."""
        return self.n_ff_arr[il] if self.n_ff_arr else self.n_ff

    def kv_src(self, il: int) -> int:
        """The layer whose KV cache layer ``il`` reads (``il`` itself unless it reuses one)."""
        return self.kv_reuse[il] if self.kv_reuse and self.kv_reuse[il] >= 0 else il
    # -- issue 7b (Qwen3.5 / Qwen3-next / Qwen2.5-1M): YaRN, hybrid recurrent layers, MoE, NextN --
    rope_yarn: Optional["RopeYarn"] = None  # set when rope.scaling.type is yarn
    rope_sections: list[int] = field(default_factory=list)  # M-RoPE sections (rope.dimension_sections)
    recurrent_layers: list[bool] = field(default_factory=list)  # llama.cpp hparams.is_recr(il)
    ssm_d_conv: int = 0  # short causal conv kernel width (ssm.conv_kernel)
    ssm_d_inner: int = 0  # value heads * value head dim (ssm.inner_size)
    ssm_d_state: int = 0  # key head dim (ssm.state_size)
    ssm_dt_rank: int = 0  # value heads (ssm.time_step_rank)
    ssm_n_group: int = 0  # key heads (ssm.group_count)
    n_ff_shexp: int = 0  # shared expert FFN width (expert_shared_feed_forward_length)
    n_layer_nextn: int = 0  # NextN / MTP blocks stored after the trunk (nextn_predict_layers)

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_embd_head_v * self.n_head_kv

    @property
    def is_iswa(self) -> bool:
        """True when the model mixes sliding-window and global layers (two KV caches)."""
        return self.n_swa > 0 and any(self.swa_layers) and not all(self.swa_layers)

    @property
    def attention_scale(self) -> float:
        return self.f_attention_scale or 1.0 / math.sqrt(self.n_embd_head_k)

    # -- issue 7b: hybrid (recurrent) models --
    @property
    def is_recurrent(self) -> bool:
        """True when some layers keep a recurrent state instead of KV (gated delta-net)."""
        return any(self.recurrent_layers)

    @property
    def ssm_head_v_dim(self) -> int:
        """Value head dim of a gated delta-net layer (llama.cpp ``d_inner / num_v_heads``)."""
        return self.ssm_d_inner // self.ssm_dt_rank if self.ssm_dt_rank else 0

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of the short conv: q, k (``ssm_n_group * ssm_d_state`` each) and v (``ssm_d_inner``)."""
        return self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state


@dataclass
class RopeYarn:
    """YaRN RoPE extension (Peng et al. 2023, "YaRN: Efficient Context Window
    Extension of Large Language Models"), parameterised as ggml's ``ggml_rope_ext``:

    ``ext_factor`` mixes extrapolated and interpolated angles (1.0 for YaRN),
    ``attn_factor`` scales cos/sin (times ``1 + 0.1 ln(1/freq_scale)``),
    ``beta_fast`` / ``beta_slow`` bound the correction ramp (32 / 1), and
    ``n_ctx_orig`` is the pre-training context (``rope.scaling.original_context_length``).
    The frequency scale itself is ``HParams.rope_freq_scale`` (1 / factor).
    """

    ext_factor: float = 1.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0


def _req(md: dict, key: str, path: str) -> Any:
    if key not in md:
        raise GGUFError(f"{path}: missing metadata key {key!r}")
    return md[key]


def _scalar(v: Any) -> Any:
    """Metadata that may be an array per layer: take the first (uniform models only)."""
    if isinstance(v, np.ndarray):
        if v.size and not np.all(v == v.flat[0]):
            raise GGUFError(f"per-layer varying value {v.tolist()} is not supported")
        return v.flat[0].item()
    return v


def load_hparams(md: dict, path: str = "<gguf>", supported: tuple[str, ...] = ()) -> HParams:
    """Build ``HParams`` from GGUF metadata ``md``.

    Raises ``GGUFError`` naming the missing key, or the unknown architecture
    (listing ``supported``).
    """
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: missing general.architecture")
    if supported and arch not in supported:
        raise GGUFError(
            f"{path}: unknown model architecture {arch!r} (supported: {', '.join(sorted(supported))})"
        )

    def k(name: str, default: Any = None, required: bool = False) -> Any:
        key = f"{arch}.{name}"
        if required:
            return _scalar(_req(md, key, path))
        return _scalar(md.get(key, default))

    def positive(name: str, value: int) -> int:
        # a nonsense size (a bad file, or --override-kv KEY=int:0) is named here, not left to
        # fail as a division by zero or a negative array shape deep in the loader
        if value <= 0:
            raise GGUFError(f"{path}: {arch}.{name} = {value}: must be a positive integer "
                            f"(from the file or --override-kv)")
        return value

    n_embd = positive("embedding_length", int(k("embedding_length", required=True)))
    n_head = positive("attention.head_count", int(k("attention.head_count", required=True)))
    n_head_kv = positive("attention.head_count_kv", int(k("attention.head_count_kv", n_head)))
    if n_head % n_head_kv:
        raise GGUFError(f"{path}: {arch}.attention.head_count = {n_head} is not a multiple of "
                        f"{arch}.attention.head_count_kv = {n_head_kv}")
    head_k = positive("attention.key_length", int(k("attention.key_length", n_embd // n_head)))
    head_v = positive("attention.value_length", int(k("attention.value_length", n_embd // n_head)))
    n_layer = positive("block_count", int(k("block_count", required=True)))
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = int(k("vocab_size", len(tokens) if tokens is not None else 0))
    hp = HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=positive("context_length", int(k("context_length", 2048))),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_ff=int(k("feed_forward_length", 0)),  # absent on MoE-only models (qwen35moe)
        f_norm_rms_eps=float(k("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_type=ROPE_NORM,
        rope_freq_base=float(k("rope.freq_base", 10000.0)),
        n_rot=int(k("rope.dimension_count", head_k)),
        swa_layers=[False] * n_layer,
        attn_logit_softcapping=float(k("attn_logit_softcapping", 0.0) or 0.0),
        final_logit_softcapping=float(k("final_logit_softcapping", 0.0) or 0.0),
    )
    scaling = k("rope.scaling.type", None)
    factor = float(k("rope.scaling.factor", 0.0) or 0.0)
    if scaling in (None, "none") and factor > 0:
        scaling = "linear"
    if scaling == "linear" and factor > 0:
        hp.rope_freq_scale = 1.0 / factor
    elif scaling == "yarn":
        if factor <= 0:
            raise GGUFError(f"{path}: YaRN RoPE scaling needs {arch}.rope.scaling.factor > 0")
        hp.rope_freq_scale = 1.0 / factor
    elif scaling not in (None, "none", "linear"):
        raise GGUFError(f"{path}: RoPE scaling type {scaling!r} is not supported (supported: none, linear, yarn)")
    hp.rope_scaling_type = scaling or "none"
    hp.rope_scaling_factor = factor
    hp.n_ctx_orig_yarn = int(k("rope.scaling.original_context_length", hp.n_ctx_train))
    if scaling == "yarn":
        # llama.cpp (llama-context.cpp): ext_factor 1 for YaRN, attn_factor 1, betas 32 / 1 unless the file says
        hp.rope_yarn = RopeYarn(
            ext_factor=float(k("rope.scaling.yarn_ext_factor", 1.0)),
            attn_factor=float(k("rope.scaling.yarn_attn_factor", 1.0)),
            beta_fast=float(k("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(k("rope.scaling.yarn_beta_slow", 1.0)),
            n_ctx_orig=hp.n_ctx_orig_yarn,
        )
        if float(k("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) != 0.0:
            raise GGUFError(f"{path}: YaRN log multiplier (DeepSeek-style mscale) is not supported")
    return hp
