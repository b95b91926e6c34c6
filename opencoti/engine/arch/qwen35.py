"""Qwen3.5 / Qwen3.6 dense: ``general.architecture = qwen35``; and the hybrid
recipe shared with ``qwen35moe`` and ``qwen3next``.

A hybrid stack (llama.cpp ``src/models/qwen35.cpp``, ``qwen35moe.cpp``,
``qwen3next.cpp``; transformers ``modeling_qwen3_5.py``,
``modeling_qwen3_next.py``) interleaves two token mixers:

- *gated delta-net* layers (linear attention with a recurrent state per
  sequence; Yang et al. 2024, "Gated Delta Networks"), every layer where
  ``(il + 1) % full_attention_interval != 0``::

      qkv = x Wqkv ; z = x Wgate                              [T, conv_ch], [T, d_inner]
      beta = sigmoid(x Wbeta) ; g = softplus(x Walpha + dt) * a   (a = -exp(A_log))  [T, H_v]
      q, k, v = split(silu(ssm_conv(qkv)))  ;  q, k = l2_norm(q), l2_norm(k)
      o = gated_delta_net(q, k, v, g, beta, scale 1/sqrt(d_k))     [T, H_v, d_v]
      out = (rms_norm(o) * ssm_norm * silu(z)) Wout

  with ``H_k`` key heads broadcast to ``H_v`` value heads (Qwen3.5's GGUF
  stores the value heads *tiled* by the converter, head j reads key head
  ``j % H_k``; Qwen3-next keeps them *grouped*, head j reads ``j // (H_v/H_k)``);
- *gated full attention* layers: ``attn_q`` yields query and an output gate
  per head (``[q_h | gate_h]`` per head), per-head RMS norms on q and k,
  NEOX RoPE on the first ``n_rot`` dims (Qwen3.5's interleaved M-RoPE equals
  NEOX when all sections carry the text position), attention, then
  ``out * sigmoid(gate)`` before ``attn_output``.

Each block: ``x += mixer(rms_norm(x) attn_norm)``, ``x += ffn(rms_norm(x)
post_attention_norm)``; the FFN is a SwiGLU, or (``ffn_gate_inp`` present)
routed experts with softmax top-k and normalised weights plus a shared
expert scaled by ``sigmoid(x ffn_gate_inp_shexp)``.

RMS norm weights in the GGUF already carry Qwen's ``1 + w`` (the converter
adds 1), except ``ssm_norm``. ``ssm_a`` holds ``-exp(A_log)``.

NextN / MTP blocks (``nextn_predict_layers`` > 0) sit after the trunk
(``blk.{n_layer}..``): their tensors are loaded into ``self.nextn`` and not
used by the forward (speculative decoding will).

Not supported (fail at load): a model without full-attention layers, the
legacy ``ssm_in`` layout of early Qwen3-next GGUFs, context shift (the
engine refuses ``--context-shift``: a recurrent state cannot be shifted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from opencoti.engine.arch.base import DecoderModel, require_backend_ops, require_rope_yarn
from opencoti.engine.batch import UBatch
from opencoti.engine.kv_cache import KVCacheSet
from opencoti.model.gguf_file import GGUFError, GGUFFile
from opencoti.model.hparams import HParams


# backend ops a hybrid model needs beyond the dense op set (see backend/cpu.py for their contracts)
GDN_OPS = ("sigmoid", "softplus", "l2_norm", "ssm_conv", "gated_delta_net")


@dataclass
class HybridLayer:
    """One block's tensors (llama.cpp ``llama_layer`` names; None = absent).

    Recurrent layers fill ``wqkv .. ssm_out``; attention layers ``wq .. attn_k_norm``
    (``wq`` is ``[2 * n_head * head_dim, n_embd]``: query and gate per head).
    Dense FFN: ``ffn_gate/up/down``; MoE: ``ffn_gate_inp`` ``[n_expert, n_embd]``,
    ``ffn_{up,gate}_exps`` ``[n_expert, n_ff_exp, n_embd]``, ``ffn_down_exps``
    ``[n_expert, n_embd, n_ff_exp]`` and the shared expert ``*_shexp``.
    """

    attn_norm: object
    attn_post_norm: object
    # gated delta-net
    wqkv: Optional[object] = None
    wqkv_gate: Optional[object] = None
    ssm_conv1d: Optional[object] = None  # [conv_ch, d_conv]
    ssm_dt: Optional[object] = None  # [H_v]
    ssm_a: Optional[object] = None  # [H_v], -exp(A_log)
    ssm_beta: Optional[object] = None  # [H_v, n_embd] (qwen35)
    ssm_alpha: Optional[object] = None  # [H_v, n_embd] (qwen35)
    ssm_beta_alpha: Optional[object] = None  # [2 H_v, n_embd] (qwen3next, per key head [b | a])
    ssm_norm: Optional[object] = None  # [d_v]
    ssm_out: Optional[object] = None  # [n_embd, d_inner]
    # gated attention
    wq: Optional[object] = None
    wk: Optional[object] = None
    wv: Optional[object] = None
    wo: Optional[object] = None
    attn_q_norm: Optional[object] = None
    attn_k_norm: Optional[object] = None
    # FFN
    ffn_gate: Optional[object] = None
    ffn_up: Optional[object] = None
    ffn_down: Optional[object] = None
    ffn_gate_inp: Optional[object] = None
    ffn_up_exps: Optional[object] = None
    ffn_gate_exps: Optional[object] = None
    ffn_down_exps: Optional[object] = None
    ffn_gate_inp_shexp: Optional[object] = None  # [1, n_embd]
    ffn_up_shexp: Optional[object] = None
    ffn_gate_shexp: Optional[object] = None
    ffn_down_shexp: Optional[object] = None


@dataclass
class NextNLayer:
    """A NextN / MTP block (llama.cpp ``layer.nextn``): a full-attention block
    (``block``) plus ``eh_proj`` ``[n_embd, 2 n_embd]``, ``enorm``, ``hnorm`` and the
    optional ``embed_tokens``, ``shared_head_head``, ``shared_head_norm``."""

    block: HybridLayer
    eh_proj: object
    enorm: object
    hnorm: object
    embed_tokens: Optional[object] = None
    shared_head_head: Optional[object] = None
    shared_head_norm: Optional[object] = None


class Qwen35(DecoderModel):
    """The hybrid gated delta-net / gated attention recipe (module docstring)."""

    arch_names = ("qwen35",)
    rope_type = "neox"
    v_heads_tiled = True  # converter reorders value heads to tiled order (Qwen3.5); False: grouped (Qwen3-next)

    # -- loading ----------------------------------------------------------------------
    @classmethod
    def adjust_hparams(cls, hp: HParams, md: dict) -> None:
        """Read the hybrid keys (llama.cpp ``load_arch_hparams``): ssm.*, the
        recurrent layer pattern, experts, NextN; ``block_count`` includes the
        NextN blocks, ``hp.n_layer`` becomes the trunk only."""
        a = hp.arch

        def key(name, default=None, required=False):
            k = f"{a}.{name}"
            if k not in md:
                if required:
                    raise GGUFError(f"missing metadata key {k!r} (needed by the {a} gated delta-net layers)")
                return default
            return md[k]

        hp.ssm_d_conv = int(key("ssm.conv_kernel", required=True))
        hp.ssm_d_inner = int(key("ssm.inner_size", required=True))
        hp.ssm_d_state = int(key("ssm.state_size", required=True))
        hp.ssm_dt_rank = int(key("ssm.time_step_rank", required=True))
        hp.ssm_n_group = int(key("ssm.group_count", required=True))
        if hp.ssm_dt_rank % hp.ssm_n_group:
            raise GGUFError(f"{a}: {hp.ssm_dt_rank} value heads are not a multiple of {hp.ssm_n_group} key heads")
        hp.n_layer_nextn = int(key("nextn_predict_layers", 0) or 0)
        n_all = hp.n_layer
        if not 0 <= hp.n_layer_nextn < n_all:
            raise GGUFError(f"{a}: nextn_predict_layers {hp.n_layer_nextn} must be < block_count {n_all}")
        hp.n_layer = n_all - hp.n_layer_nextn
        rec = key("attention.recurrent_layers")
        if rec is not None:
            hp.recurrent_layers = [bool(x) for x in np.asarray(rec).tolist()[:hp.n_layer]]
        else:
            interval = int(key("full_attention_interval", 4) or 4)
            hp.recurrent_layers = [(il + 1) % interval != 0 for il in range(hp.n_layer)]
        if all(hp.recurrent_layers):
            raise GGUFError(f"{a}: a model without full-attention layers (pure recurrent) is not supported")
        hp.swa_layers = [False] * hp.n_layer
        hp.n_expert = int(key("expert_count", 0) or 0)
        hp.n_expert_used = int(key("expert_used_count", 0) or 0)
        hp.n_ff_exp = int(key("expert_feed_forward_length", 0) or 0)
        hp.n_ff_shexp = int(key("expert_shared_feed_forward_length", 0) or 0)
        if hp.n_expert and not 0 < hp.n_expert_used <= hp.n_expert:
            raise GGUFError(f"{a}: expert_used_count {hp.n_expert_used} out of range (1..{hp.n_expert})")
        sec = key("rope.dimension_sections")
        hp.rope_sections = [int(x) for x in np.asarray(sec).tolist()] if sec is not None else []
        if hp.n_embd_head_k != hp.n_embd_head_v:
            raise GGUFError(f"{a}: key and value head sizes differ ({hp.n_embd_head_k} vs {hp.n_embd_head_v})")

    def __init__(self, gguf: GGUFFile, hp: HParams, backend):
        self.hp = hp
        self.gguf = gguf
        self.place(backend)  # one backend, or a LayerSplit (-ngl): weights go to their layer's backend
        for b in self.backends:
            require_rope_yarn(b, hp)
            require_backend_ops(b, hp.arch, "the gated delta-net (recurrent state) layers", GDN_OPS)
            if hp.n_expert:
                require_backend_ops(b, hp.arch, "the mixture-of-experts FFN", ("moe_ffn",))

        req, opt = self.require, self.optional

        self.tok_embd = req("token_embd.weight")
        if self.tok_embd.shape[0] != hp.n_vocab:
            hp.n_vocab = self.tok_embd.shape[0]
        self.output_norm = req("output_norm.weight")
        self.output = self.output_weight(opt("output.weight"))
        self.rope_freqs = None
        self.layers = [self._load_block(il, req, opt, hp.recurrent_layers[il]) for il in range(hp.n_layer)]
        self.nextn: list[NextNLayer] = []
        for il in range(hp.n_layer, hp.n_layer + hp.n_layer_nextn):
            p = f"blk.{il}.nextn."
            self.nextn.append(NextNLayer(
                block=self._load_block(il, req, opt, False),
                eh_proj=req(p + "eh_proj.weight"), enorm=req(p + "enorm.weight"), hnorm=req(p + "hnorm.weight"),
                embed_tokens=opt(p + "embed_tokens.weight"), shared_head_head=opt(p + "shared_head_head.weight"),
                shared_head_norm=opt(p + "shared_head_norm.weight"),
            ))

    def _load_block(self, il: int, req, opt, recurrent: bool) -> HybridLayer:
        p = f"blk.{il}."
        L = HybridLayer(attn_norm=req(p + "attn_norm.weight"), attn_post_norm=req(p + "post_attention_norm.weight"))
        if recurrent:
            if p + "attn_qkv.weight" not in self.gguf.tensors and p + "ssm_in.weight" in self.gguf.tensors:
                raise GGUFError(f"{self.gguf.path}: the legacy fused ssm_in (qkvz) layout is not supported; "
                                "reconvert with a current convert_hf_to_gguf.py")
            L.wqkv, L.wqkv_gate = req(p + "attn_qkv.weight"), req(p + "attn_gate.weight")
            L.ssm_conv1d, L.ssm_dt, L.ssm_a = req(p + "ssm_conv1d.weight"), req(p + "ssm_dt.bias"), req(p + "ssm_a")
            L.ssm_norm, L.ssm_out = req(p + "ssm_norm.weight"), req(p + "ssm_out.weight")
            self._load_beta_alpha(L, p, req)
        else:
            L.wq, L.wk, L.wv, L.wo = (req(p + f"attn_{t}.weight") for t in ("q", "k", "v", "output"))
            L.attn_q_norm, L.attn_k_norm = req(p + "attn_q_norm.weight"), req(p + "attn_k_norm.weight")
        if p + "ffn_gate_inp.weight" in self.gguf.tensors:
            L.ffn_gate_inp = req(p + "ffn_gate_inp.weight")
            L.ffn_down_exps = req(p + "ffn_down_exps.weight")
            if p + "ffn_gate_up_exps.weight" in self.gguf.tensors:  # fused layout (convert --fuse-gate-up-exps)
                gu = req(p + "ffn_gate_up_exps.weight")
                n = gu.shape[1] // 2
                L.ffn_gate_exps, L.ffn_up_exps = gu[:, :n], gu[:, n:]
            else:
                L.ffn_gate_exps, L.ffn_up_exps = req(p + "ffn_gate_exps.weight"), req(p + "ffn_up_exps.weight")
            L.ffn_up_shexp, L.ffn_gate_shexp = opt(p + "ffn_up_shexp.weight"), opt(p + "ffn_gate_shexp.weight")
            L.ffn_down_shexp, L.ffn_gate_inp_shexp = opt(p + "ffn_down_shexp.weight"), opt(p + "ffn_gate_inp_shexp.weight")
            if self.hp.n_expert_used == 0:
                raise GGUFError(f"{self.gguf.path}: MoE layer {il} but no {self.hp.arch}.expert_used_count")
        else:
            L.ffn_gate, L.ffn_up, L.ffn_down = (req(p + f"ffn_{t}.weight") for t in ("gate", "up", "down"))
        return L

    def _load_beta_alpha(self, L: HybridLayer, p: str, req) -> None:
        L.ssm_beta, L.ssm_alpha = req(p + "ssm_beta.weight"), req(p + "ssm_alpha.weight")

    # -- forward ----------------------------------------------------------------------
    def forward(self, ub: UBatch, kv: KVCacheSet) -> np.ndarray:
        """Run one planned ubatch; logits float32 ``[len(ub.out_rows), n_vocab]``."""
        hp = self.hp
        eps = hp.f_norm_rms_eps
        B = self.begin_ubatch(ub)
        rs_plan = kv.rs_plan(ub.plans)
        x = B.get_rows(self.tok_embd, ub.tokens)
        for il, L in enumerate(self.layers):
            if self.layer_backends[il] is not B:  # a split's boundary (-ngl): the stream moves
                (x,) = self.cross(self.layer_backends[il], x)
                B = self.backend
            h = B.rms_norm(x, L.attn_norm, eps)
            if hp.recurrent_layers[il]:
                h = self.linear_attention(il, L, h, kv, rs_plan)
            else:
                h = self.gated_attention(il, L, h, ub, kv)
            x = x + h
            x = x + self.ffn(L, B.rms_norm(x, L.attn_post_norm, eps))
        return self.output_logits(B, x, ub)

    def beta_alpha(self, L: HybridLayer, h: np.ndarray):
        """``(b, a)`` pre-activations ``[T, H_v]`` in the file's value-head order."""
        B = self.backend
        return B.mul_mat(h, L.ssm_beta), B.mul_mat(h, L.ssm_alpha)

    def linear_attention(self, il: int, L: HybridLayer, h: np.ndarray, kv: KVCacheSet, rs_plan) -> np.ndarray:
        """Gated delta-net mixer (llama.cpp ``build_layer_attn_linear``). h: ``[T, n_embd]``."""
        B, hp = self.backend, self.hp
        T = h.shape[0]
        n_k, n_v, d_k, d_v = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim
        qkv = B.mul_mat(h, L.wqkv)  # [T, 2 n_k d_k + n_v d_v]
        z = B.mul_mat(h, L.wqkv_gate).reshape(T, n_v, d_v)
        b, a = self.beta_alpha(L, h)
        beta = B.sigmoid(b)
        g = B.softplus(a + L.ssm_dt) * L.ssm_a  # log decay, <= 0
        rs = kv.recurrent
        conv = B.silu(B.ssm_conv(qkv, rs.conv[il], L.ssm_conv1d, rs_plan))
        kd = n_k * d_k
        q = B.l2_norm(conv[:, :kd].reshape(T, n_k, d_k), hp.f_norm_rms_eps)
        k = B.l2_norm(conv[:, kd:2 * kd].reshape(T, n_k, d_k), hp.f_norm_rms_eps)
        v = conv[:, 2 * kd:].reshape(T, n_v, d_v)
        if n_v != n_k:  # broadcast key heads to value heads (module docstring)
            r = n_v // n_k
            xp = B.xp
            q, k = ((xp.tile(t, (1, r, 1)) if self.v_heads_tiled else xp.repeat(t, r, axis=1)) for t in (q, k))
        o = B.gated_delta_net(q, k, v, g, beta, rs.ssm[il], rs_plan, 1.0 / float(np.sqrt(d_k)))
        o = B.rms_norm(o, L.ssm_norm, hp.f_norm_rms_eps) * B.silu(z)
        return B.mul_mat(o.reshape(T, n_v * d_v), L.ssm_out)

    def gated_attention(self, il: int, L: HybridLayer, h: np.ndarray, ub: UBatch, kv: KVCacheSet) -> np.ndarray:
        """Full attention with a sigmoid output gate (llama.cpp ``build_layer_attn``)."""
        B, hp = self.backend, self.hp
        T, hd = h.shape[0], hp.n_embd_head_k
        qg = B.mul_mat(h, L.wq).reshape(T, hp.n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, hp.n_head * hd)
        k = B.mul_mat(h, L.wk).reshape(T, hp.n_head_kv, hd)
        v = B.mul_mat(h, L.wv).reshape(T, hp.n_head_kv, hd)
        q = B.rms_norm(q, L.attn_q_norm, hp.f_norm_rms_eps)
        k = B.rms_norm(k, L.attn_k_norm, hp.f_norm_rms_eps)
        base, scale = self.rope_params(il)
        q = B.rope(q, ub.pos, hp.n_rot, base, scale, self.rope_type, None, **self.rope_ext)
        k = B.rope(k, ub.pos, hp.n_rot, base, scale, self.rope_type, None, **self.rope_ext)
        cache = kv.layer_cache[il]
        plan = ub.plans[kv.caches.index(cache)]
        B.kv_write(cache, il, plan, k, v)
        out = B.attention_cells(q, ub.pos, cache.k[il], cache.v[il], plan, hp.attention_scale, 0, 0.0,
                                type_k=cache.tier_k, type_v=cache.tier_v)
        return B.mul_mat(out * B.sigmoid(gate), L.wo)

    def ffn(self, L: HybridLayer, h: np.ndarray) -> np.ndarray:
        """SwiGLU, or routed experts + gated shared expert (llama.cpp ``build_layer_ffn``)."""
        B, hp = self.backend, self.hp
        if L.ffn_gate_inp is None:
            return B.mul_mat(B.gated_ffn(h, L.ffn_gate, L.ffn_up, "silu"), L.ffn_down)
        out = B.moe_ffn(h, L.ffn_gate_inp, L.ffn_up_exps, L.ffn_gate_exps, L.ffn_down_exps, hp.n_expert_used,
                        norm_w=True, act="silu")
        if L.ffn_up_shexp is not None:
            sh = B.mul_mat(B.gated_ffn(h, L.ffn_gate_shexp, L.ffn_up_shexp, "silu"), L.ffn_down_shexp)
            if L.ffn_gate_inp_shexp is not None:
                sh = sh * B.sigmoid(B.mul_mat(h, L.ffn_gate_inp_shexp.reshape(1, -1)))
            out = out + sh
        return out

    def shift_k(self, cache, stream: int, cells: np.ndarray, delta: np.ndarray) -> None:
        raise ValueError(f"{self.hp.arch}: context shift is not possible on a recurrent (gated delta-net) state")
