"""CPU backend: the op set in NumPy, float32 activations.

This is the reference every other backend is tested against. Weights are
dequantized to float32 once at load (``load_weight``): on the CPU an f16 or
quantized matvec in NumPy has no BLAS and is ~30x slower than f32 GEMV.

Shapes: activations are ``[n_tokens, n]`` float32 (row-major, one row per
token of the ubatch); per-head tensors are ``[n_tokens, n_heads, head_dim]``.
"""

from __future__ import annotations

import math

import numpy as np

from opencoti.model.gguf_file import GGUFFile


class CPUBackend:
    """NumPy implementation of the op interface (DESIGN.md "Backends: one op set")."""

    name = "cpu"
    xp = np

    # -- device plumbing (no-ops on the host) --------------------------------------------
    @staticmethod
    def zeros(shape, dtype) -> np.ndarray:
        """Zero-filled array (KV storage)."""
        return np.zeros(shape, dtype=dtype)

    @staticmethod
    def to_host(x: np.ndarray) -> np.ndarray:
        return x

    def begin_ubatch(self, ub) -> None:
        """Per-step hook where a device backend uploads the ubatch's index arrays."""

    # -- weights ----------------------------------------------------------------------
    def load_weight(self, gguf: GGUFFile, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, NumPy shape ``reversed(ne)`` (``[out, in]`` for matrices)."""
        return gguf.dequantize(name, np.float32)

    # -- elementwise / norms ----------------------------------------------------------
    @staticmethod
    def get_rows(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Embedding lookup: ``table [n_vocab, n_embd]``, ``ids int [n]`` -> ``[n, n_embd]`` float32."""
        return table[ids].astype(np.float32, copy=True)

    @staticmethod
    def mul_mat(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``x [n, k] @ w[out, k].T`` -> ``[n, out]`` float32 (ggml_mul_mat with w as src0)."""
        return x @ w.T

    @staticmethod
    def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        """RMSNorm over the last axis (Zhang & Sennrich 2019), times ``w`` if given."""
        ms = np.mean(np.square(x), axis=-1, keepdims=True)
        y = x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)
        return y * w if w is not None else y

    @classmethod
    def add_rms_norm(cls, x: np.ndarray, h: np.ndarray, w_post: np.ndarray | None, w_next: np.ndarray | None,
                     eps: float) -> tuple[np.ndarray, np.ndarray | None]:
        """Residual step of a block: ``x_out = x + rms_norm(h, w_post)`` (``x + h``
        without a post-norm), then ``h_out = rms_norm(x_out, w_next)`` (None without
        ``w_next``). x, h: float32 ``[n_tokens, n_embd]``. Returns ``(x_out, h_out)``."""
        x = x + (cls.rms_norm(h, w_post, eps) if w_post is not None else h)
        return x, (cls.rms_norm(x, w_next, eps) if w_next is not None else None)

    @staticmethod
    def gelu_tanh(x: np.ndarray) -> np.ndarray:
        """GELU, tanh approximation (Hendrycks & Gimpel 2016; ggml_gelu)."""
        return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)))

    @staticmethod
    def silu(x: np.ndarray) -> np.ndarray:
        """x * sigmoid(x)."""
        return x / (1.0 + np.exp(-x))

    def gated_ffn(self, x: np.ndarray, gate, up, act: str) -> np.ndarray:
        """``act(x @ gate.T) * (x @ up.T)``; act "gelu_tanh" or "silu"."""
        g = self.mul_mat(x, gate)
        g = self.gelu_tanh(g) if act == "gelu_tanh" else self.silu(g)
        return g * self.mul_mat(x, up)

    def moe_ffn(self, x: np.ndarray, logits: np.ndarray, gate_up_exps: np.ndarray, down_exps: np.ndarray,
                n_expert_used: int, act: str = "gelu_tanh", norm_w: bool = True,
                down_scale: np.ndarray | None = None) -> np.ndarray:
        """Mixture-of-experts FFN with softmax routing over router ``logits``
        (llama.cpp ``llm_graph_context::build_moe_ffn`` with
        ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX``, a fused ``ffn_gate_up_exps``
        tensor and a per-expert output scale ``ffn_down_exps.scale``; HF
        ``Gemma4TextRouter`` + ``Gemma4TextExperts``).

        x: ``[T, n_embd]`` float32; logits: ``[T, n_expert]`` float32;
        gate_up_exps: ``[n_expert, 2*n_ff_exp, n_embd]`` (rows ``[0, n_ff_exp)``
        are the gate, the rest the up projection); down_exps:
        ``[n_expert, n_embd, n_ff_exp]``; down_scale: ``[n_expert]`` or None.

        Per token t: ``p = softmax(logits[t])``; ``sel`` = the ``n_expert_used``
        experts with the largest ``p`` (ties: lower expert id first);
        ``w = p[sel]``, divided by ``sum(w)`` when ``norm_w``; then
        ``out[t] = sum_k w[k] * down_scale[e] * down_exps[e] @ (act(g) * u)``
        with ``e = sel[k]`` and ``g, u`` the two halves of ``gate_up_exps[e] @ x[t]``;
        ``act`` is "gelu_tanh" or "silu". Returns ``[T, n_embd]`` float32.
        """
        T = x.shape[0]
        m = np.max(logits, axis=-1, keepdims=True)
        p = np.exp(logits - m)
        p /= np.sum(p, axis=-1, keepdims=True)
        sel = np.argsort(-p, axis=-1, kind="stable")[:, :n_expert_used]  # [T, k]
        w = np.take_along_axis(p, sel, axis=-1)
        if norm_w:
            w = w / np.sum(w, axis=-1, keepdims=True)
        out = np.zeros((T, down_exps.shape[1]), dtype=np.float32)
        for e in np.unique(sel):  # loop over the experts hit, never over tokens
            rows, slot = np.nonzero(sel == e)  # a token picks an expert at most once: rows are unique
            h = x[rows] @ gate_up_exps[e].T
            f = h.shape[1] // 2
            g = self.gelu_tanh(h[:, :f]) if act == "gelu_tanh" else self.silu(h[:, :f])
            y = (g * h[:, f:]) @ down_exps[e].T
            s = w[rows, slot]
            if down_scale is not None:
                s = s * down_scale[e]
            out[rows] += y * s[:, None].astype(np.float32)
        return out

    # -- rope -------------------------------------------------------------------------
    @staticmethod
    def rope(
        x: np.ndarray,
        pos: np.ndarray,
        n_rot: int,
        base: float,
        freq_scale: float = 1.0,
        mode: str = "norm",
        freq_factors: np.ndarray | None = None,
        norm: np.ndarray | None = None,
        eps: float = 0.0,
    ) -> np.ndarray:
        """Rotary position embedding (Su et al. 2021), as ggml_rope_ext without YaRN.

        x: ``[n_tokens, n_heads, head_dim]`` float32; pos: int ``[n_tokens]``.
        Rotates the first ``n_rot`` dims: ``mode="norm"`` pairs (2i, 2i+1),
        ``mode="neox"`` pairs (i, i + n_rot/2). Angle for pair i:
        ``pos * freq_scale * base**(-2i/n_rot) / freq_factors[i]``. With ``norm``
        (``[head_dim]``), each head vector is first RMS-normalized and scaled by it
        (q/k norms, as ``rms_norm(x, norm, eps)``). Returns a new array.
        """
        if norm is not None:
            x = CPUBackend.rms_norm(x, norm, eps)
        half = n_rot // 2
        inv = base ** (-np.arange(0, half, dtype=np.float64) * 2.0 / n_rot)
        if freq_factors is not None:
            inv = inv / freq_factors[:half].astype(np.float64)
        theta = (pos.astype(np.float64)[:, None] * freq_scale) * inv[None, :]  # [T, half]
        cos = np.cos(theta).astype(np.float32)[:, None, :]
        sin = np.sin(theta).astype(np.float32)[:, None, :]
        out = x.copy()
        if mode == "neox":
            x0 = x[..., :half]
            x1 = x[..., half:n_rot]
            out[..., :half] = x0 * cos - x1 * sin
            out[..., half:n_rot] = x0 * sin + x1 * cos
        else:
            x0 = x[..., 0:n_rot:2]
            x1 = x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = x0 * cos - x1 * sin
            out[..., 1:n_rot:2] = x0 * sin + x1 * cos
        return out

    # -- KV cache + attention ----------------------------------------------------------
    @staticmethod
    def kv_write(cache, il: int, plan, k: np.ndarray, v: np.ndarray) -> None:
        """Store a layer's new K ``[T, n_head_kv, d_k]`` / V into the plan's cells."""
        cache.write(il, plan, k, v)

    def attention_cells(self, q: np.ndarray, q_pos: np.ndarray, k_store, v_store, plan, scale: float,
                        n_swa: int = 0, softcap: float = 0.0) -> np.ndarray:
        """Attention of ``q [T, n_head, d_k]`` over each row's sequence cells
        (``plan.views``: rows, stream, cells, cell_pos) in the layer's storage
        ``k_store [n_stream, n_cells, n_head_kv, d_k]`` / ``v_store``. Returns
        ``[T, n_head * d_v]`` float32."""
        T, n_head, _ = q.shape
        out = np.empty((T, n_head * v_store.shape[-1]), dtype=np.float32)
        grouped = set()
        for g in getattr(plan, "groups", ()):
            # shared-prefix attention: the pool's cells are read once for every sharer's queries
            views = [plan.views[i] for i in g.views]
            rows = np.concatenate([v.rows for v in views])
            o_s, l_s = self.attention_lse(q[rows], q_pos[rows], k_store[g.stream, g.cells],
                                          v_store[g.stream, g.cells], g.cell_pos, scale, n_swa, softcap)
            at = 0
            for v in views:
                n = len(v.rows)
                o_p, l_p = self.attention_lse(q[v.rows], q_pos[v.rows], k_store[v.stream, v.private],
                                              v_store[v.stream, v.private], v.private_pos, scale, n_swa, softcap)
                out[v.rows] = merge_lse(o_s[at:at + n], l_s[at:at + n], o_p, l_p).reshape(n, -1)
                at += n
            grouped.update(g.views)
        for i, view in enumerate(plan.views):
            if i in grouped:
                continue
            out[view.rows] = self.attention(
                q[view.rows], q_pos[view.rows], k_store[view.stream, view.cells], v_store[view.stream, view.cells],
                view.cell_pos, scale, n_swa, softcap,
            )
        return out

    @staticmethod
    def attention(
        q: np.ndarray,
        q_pos: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        kv_pos: np.ndarray,
        scale: float,
        n_swa: int = 0,
        softcap: float = 0.0,
    ) -> np.ndarray:
        """Causal (optionally sliding-window) softmax attention of one sequence.

        q: ``[T, n_head, d_k]`` float32, q_pos int ``[T]``;
        k: ``[C, n_head_kv, d_k]``, v: ``[C, n_head_kv, d_v]`` (any float dtype),
        kv_pos int ``[C]``: the sequence's cells, gathered by the cache.
        Query t sees cell c when ``kv_pos[c] <= q_pos[t]`` and, if ``n_swa`` > 0,
        ``q_pos[t] - kv_pos[c] < n_swa`` (llama.cpp's standard SWA).
        GQA: query head h reads kv head ``h // (n_head / n_head_kv)``.
        ``softcap`` > 0 applies ``softcap * tanh(s / softcap)`` to the scores.
        Returns ``[T, n_head * d_v]`` float32.
        """
        T, n_head, _ = q.shape
        o, _ = CPUBackend.attention_lse(q, q_pos, k, v, kv_pos, scale, n_swa, softcap)
        return o.reshape(T, -1)

    @staticmethod
    def attention_lse(q, q_pos, k, v, kv_pos, scale: float, n_swa: int = 0, softcap: float = 0.0):
        """``attention`` over a subset of a sequence's cells, also returning the
        log-sum-exp of the visible scores so partial results merge exactly
        (flash-decoding's split-K merge; Dao et al. 2023): returns
        ``o [T, n_head, d_v]`` (softmax-normalised over these cells, 0 where
        none is visible) and ``lse [T, n_head]`` (-inf where none is visible)."""
        T, n_head, _ = q.shape
        C, n_kv, d_v = v.shape
        g = n_head // n_kv
        kf = k.astype(np.float32, copy=False)
        vf = v.astype(np.float32, copy=False)
        # [n_kv, g, T, d] @ [n_kv, d, C] -> [n_kv, g, T, C]
        qh = q.reshape(T, n_kv, g, -1).transpose(1, 2, 0, 3)
        s = np.matmul(qh, kf.transpose(1, 2, 0)[:, None, :, :]) * np.float32(scale)
        if softcap > 0:
            s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
        delta = q_pos[:, None].astype(np.int64) - kv_pos[None, :].astype(np.int64)  # [T, C]
        visible = delta >= 0
        if n_swa > 0:
            visible &= delta < n_swa
        s = np.where(visible[None, None], s, np.float32(-np.inf))
        if C == 0:
            return np.zeros((T, n_head, d_v), np.float32), np.full((T, n_head), -np.inf, np.float32)
        m = np.max(s, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        denom = np.sum(p, axis=-1, keepdims=True)
        p /= np.where(denom > 0, denom, 1.0)
        o = np.matmul(p, vf.transpose(1, 0, 2)[:, None, :, :])  # [n_kv, g, T, d_v]
        with np.errstate(divide="ignore"):
            lse = (np.log(denom) + m)[..., 0]  # [n_kv, g, T]
        o = np.ascontiguousarray(o.transpose(2, 0, 1, 3)).reshape(T, n_head, d_v).astype(np.float32, copy=False)
        return o, np.ascontiguousarray(lse.transpose(2, 0, 1)).reshape(T, n_head).astype(np.float32)


def merge_lse(o1: np.ndarray, l1: np.ndarray, o2: np.ndarray, l2: np.ndarray) -> np.ndarray:
    """Merge two attention partials over disjoint cell sets:
    ``o = (o1 e^{l1} + o2 e^{l2}) / (e^{l1} + e^{l2})`` computed stably.
    o*: ``[T, n_head, d_v]``, l*: ``[T, n_head]`` (-inf = empty part)."""
    m = np.maximum(l1, l2)
    m = np.where(np.isfinite(m), m, 0.0)
    w1 = np.exp(l1 - m)[..., None]
    w2 = np.exp(l2 - m)[..., None]
    den = w1 + w2
    return (o1 * w1 + o2 * w2) / np.where(den > 0, den, 1.0)
