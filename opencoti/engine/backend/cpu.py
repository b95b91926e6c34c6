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

    @staticmethod
    def free_memory():
        """Bytes the host can still hand out (``MemAvailable`` of /proc/meminfo), None if unknown."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

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
    ) -> np.ndarray:
        """Rotary position embedding (Su et al. 2021), as ggml_rope_ext without YaRN.

        x: ``[n_tokens, n_heads, head_dim]`` float32; pos: int ``[n_tokens]``.
        Rotates the first ``n_rot`` dims: ``mode="norm"`` pairs (2i, 2i+1),
        ``mode="neox"`` pairs (i, i + n_rot/2). Angle for pair i:
        ``pos * freq_scale * base**(-2i/n_rot) / freq_factors[i]``.
        Returns a new array.
        """
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
    kv_types = None  # every KV tier (opencoti.engine.kv_tiers); device backends list theirs

    @staticmethod
    def kv_write(cache, il: int, plan, k: np.ndarray, v: np.ndarray) -> None:
        """Store a layer's new K ``[T, n_head_kv, d_k]`` / V into the plan's cells, quantized
        to the cache's tiers (``KVCache.write``)."""
        cache.write(il, plan, k, v)

    def attention_cells(self, q: np.ndarray, q_pos: np.ndarray, k_store, v_store, plan, scale: float,
                        n_swa: int = 0, softcap: float = 0.0, type_k=None, type_v=None) -> np.ndarray:
        """Attention of ``q [T, n_head, d_k]`` over each row's sequence cells
        (``plan.views``: rows, stream, cells, cell_pos) in the layer's storage
        ``k_store [n_stream, n_cells, n_head_kv, row_k]`` / ``v_store``, whose tiers are
        ``type_k`` / ``type_v`` (``KVTier``; None = a float array). The gathered cells are
        dequantized to float32 here (the reference path; a kernel decodes in registers).
        Returns ``[T, n_head * d_v]`` float32."""
        def gather(store, tier, stream, cells):
            x = store[stream, cells]
            return x if tier is None else tier.dequantize(x)

        T, n_head, _ = q.shape
        d_v = v_store.shape[-1] if type_v is None else type_v.dim_of(v_store.shape[-1])
        out = np.empty((T, n_head * d_v), dtype=np.float32)
        grouped = set()
        for g in getattr(plan, "groups", ()):
            # shared-prefix attention: the pool's cells are read once for every sharer's queries
            views = [plan.views[i] for i in g.views]
            rows = np.concatenate([v.rows for v in views])
            o_s, l_s = self.attention_lse(q[rows], q_pos[rows], gather(k_store, type_k, g.stream, g.cells),
                                          gather(v_store, type_v, g.stream, g.cells), g.cell_pos, scale,
                                          n_swa, softcap)
            at = 0
            for v in views:
                n = len(v.rows)
                o_p, l_p = self.attention_lse(q[v.rows], q_pos[v.rows], gather(k_store, type_k, v.stream, v.private),
                                              gather(v_store, type_v, v.stream, v.private), v.private_pos, scale,
                                              n_swa, softcap)
                out[v.rows] = merge_lse(o_s[at:at + n], l_s[at:at + n], o_p, l_p).reshape(n, -1)
                at += n
            grouped.update(g.views)
        for i, view in enumerate(plan.views):
            if i in grouped:
                continue
            out[view.rows] = self.attention(
                q[view.rows], q_pos[view.rows], gather(k_store, type_k, view.stream, view.cells),
                gather(v_store, type_v, view.stream, view.cells), view.cell_pos, scale, n_swa, softcap,
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
