"""Qwen3-Next: ``general.architecture = qwen3next``.

The hybrid recipe of ``qwen35.py`` (gated delta-net + gated attention, MoE
FFN with a gated shared expert) with the Qwen3-Next layout (llama.cpp
``src/models/qwen3next.cpp``; convert_hf_to_gguf ``Qwen3NextModel``):

- beta and alpha come from one projection ``ssm_ba`` ``[2 H_v, n_embd]``
  whose rows are, per key head, ``[b_0..b_{r-1}, a_0..a_{r-1}]`` (r = H_v / H_k);
- value heads keep the *grouped* order (head j reads key head ``j // r``);
- plain NEOX RoPE (no M-RoPE sections); no NextN blocks in the file.
"""

from __future__ import annotations

from opencoti.engine.arch.qwen35 import HybridLayer, Qwen35


class Qwen3Next(Qwen35):
    arch_names = ("qwen3next",)
    v_heads_tiled = False

    def _load_beta_alpha(self, L: HybridLayer, p: str, req) -> None:
        L.ssm_beta_alpha = req(p + "ssm_ba.weight")

    def beta_alpha(self, L: HybridLayer, h):
        B, hp = self.backend, self.hp
        T, n_k = h.shape[0], hp.ssm_n_group
        r = hp.ssm_dt_rank // n_k
        ba = B.mul_mat(h, L.ssm_beta_alpha).reshape(T, n_k, 2 * r)
        return ba[..., :r].reshape(T, n_k * r), ba[..., r:].reshape(T, n_k * r)
