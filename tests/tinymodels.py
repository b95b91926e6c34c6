"""Test helpers for random-weight tiny models (see opencoti/tools/synth_gguf.py).

``ref_forward`` is a deliberately plain NumPy forward pass that reads a GGUF
file with llama.cpp's semantics (src/models/llama.cpp, qwen2.cpp, qwen3.cpp,
gemma3.cpp; ggml_rope normal vs NEOX modes; iSWA with
``set_swa_pattern(6)``). It is not the engine: it exists so the tests can show
that a synthetic GGUF file encodes the transformers model correctly (file vs
transformers), independently of the engine's forward (engine vs
transformers). When both hold, a disagreement is the engine's.
"""

from __future__ import annotations

import numpy as np

from opencoti.model.gguf_file import GGUFFile

# Fixed token sequences, longer than gemma3's tiny sliding window (8).
SEQUENCES = [
    [2, 17, 300, 45, 45, 45, 120, 9, 250, 33, 77, 310, 5, 88, 140, 141, 142, 60, 61, 200, 201, 19, 270, 3],
    [(i * 37 + 11) % 384 for i in range(40)],
    [(i * i * 7 + 3) % 384 for i in range(31)],
]


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def _rope(x: np.ndarray, pos: np.ndarray, base: float, neox: bool, factors: np.ndarray | None,
          freq_scale: float = 1.0, yarn_orig_ctx: int = 0) -> np.ndarray:
    """x: [T, H, D]. Normal mode rotates pairs (2i, 2i+1); NEOX rotates (i, i + D/2).
    theta = pos * freq_scale * base^(-2i/D) / factors[i] (ggml_rope_ext with freq_factors;
    freq_scale = 1/factor for linear scaling). ``yarn_orig_ctx`` > 0: YaRN as the paper
    (Peng et al. 2023) and transformers' ``_compute_yarn_parameters`` write it: frequencies
    below the beta_slow=1 dim keep theta, above beta_fast=32 take theta*freq_scale, a linear
    ramp between; cos/sin scaled by 0.1*ln(1/freq_scale) + 1."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    mscale = 1.0
    if yarn_orig_ctx:
        def corr(rot):
            return d * np.log(yarn_orig_ctx / (rot * 2 * np.pi)) / (2 * np.log(base))
        lo, hi = max(np.floor(corr(32.0)), 0), min(np.ceil(corr(1.0)), d - 1)
        extrap = 1 - np.clip((np.arange(d // 2) - lo) / max(hi - lo, 0.001), 0, 1)
        inv = inv * freq_scale * (1 - extrap) + inv * extrap
        mscale = 0.1 * np.log(1 / freq_scale) + 1
    else:
        inv = inv * freq_scale
    if factors is not None:
        inv = inv / factors.astype(np.float64)
    ang = pos[:, None].astype(np.float64) * inv[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :] * mscale, np.sin(ang)[:, None, :] * mscale
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def ref_forward(path: str, tokens: list[int]) -> np.ndarray:
    """Logits ``[len(tokens), n_vocab]`` (float64) of the GGUF model at ``path``, all
    positions, fresh context, computed in float64 from the dequantized tensors."""
    g = GGUFFile(path)
    md = g.metadata
    arch = md["general.architecture"]

    def w(name):
        return g.dequantize(name).astype(np.float64) if name in g.tensors else None

    def key(k, default=None):
        return md.get(f"{arch}.{k}", default)

    n_embd, n_layer = key("embedding_length"), key("block_count")
    n_head, n_kv = key("attention.head_count"), key("attention.head_count_kv")
    hd = key("attention.key_length", n_embd // n_head)
    eps = key("attention.layer_norm_rms_epsilon")
    base = key("rope.freq_base", 10000.0)
    neox = arch in ("qwen2", "qwen3", "gemma3")
    factors = w("rope_freqs.weight")
    n_swa = key("attention.sliding_window", 0)
    scaled = key("rope.scaling.type") in ("linear", "yarn")
    freq_scale = 1.0 / key("rope.scaling.factor") if scaled else 1.0
    yarn_ctx = key("rope.scaling.original_context_length", 0) if key("rope.scaling.type") == "yarn" else 0
    T = len(tokens)
    pos = np.arange(T)
    x = w("token_embd.weight")[np.asarray(tokens)]
    if arch == "gemma3":
        x = x * np.sqrt(n_embd)
    qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
    for il in range(n_layer):
        p = f"blk.{il}."
        h = _rms_norm(x, w(p + "attn_norm.weight"), eps)
        q = h @ w(p + "attn_q.weight").T
        k = h @ w(p + "attn_k.weight").T
        v = h @ w(p + "attn_v.weight").T
        if (b := w(p + "attn_q.bias")) is not None:
            q, k, v = q + b, k + w(p + "attn_k.bias"), v + w(p + "attn_v.bias")
        q, k, v = q.reshape(T, n_head, hd), k.reshape(T, n_kv, hd), v.reshape(T, n_kv, hd)
        if (qn := w(p + "attn_q_norm.weight")) is not None:
            q, k = _rms_norm(q, qn, eps), _rms_norm(k, w(p + "attn_k_norm.weight"), eps)
        is_swa = arch == "gemma3" and n_swa > 0 and il % 6 < 5
        # llama.cpp hard-codes gemma3's local layers to base 10000, no scaling
        lbase, lscale = (10000.0, 1.0) if is_swa else (base, freq_scale)
        lyarn = 0 if is_swa else yarn_ctx
        q, k = _rope(q, pos, lbase, neox, factors, lscale, lyarn), _rope(k, pos, lbase, neox, factors, lscale, lyarn)
        allowed = ki <= qi
        if is_swa:
            allowed &= (qi - ki) < n_swa
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = np.where(allowed[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", s, v).reshape(T, n_head * hd) @ w(p + "attn_output.weight").T
        if (ob := w(p + "attn_output.bias")) is not None:
            a = a + ob
        if arch == "gemma3":
            a = _rms_norm(a, w(p + "post_attention_norm.weight"), eps)
        x = x + a
        h = _rms_norm(x, w(p + "ffn_norm.weight"), eps)
        gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        act = _gelu_tanh(gate) if arch == "gemma3" else gate / (1.0 + np.exp(-gate))
        f = (act * up) @ w(p + "ffn_down.weight").T
        if arch == "gemma3":
            f = _rms_norm(f, w(p + "post_ffw_norm.weight"), eps)
        x = x + f
    x = _rms_norm(x, w("output_norm.weight"), eps)
    out_w = w("output.weight")
    logits = x @ (out_w if out_w is not None else w("token_embd.weight")).T
    if (cap := key("final_logit_softcapping")):
        logits = np.tanh(logits / cap) * cap
    g.close()
    return logits
