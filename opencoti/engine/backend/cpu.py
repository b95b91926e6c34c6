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


def rope_kv_write(B, q, k, v, pos, cache, il: int, plan, q_norm=None, k_norm=None, bias=None, **rope):
    """An attention layer's step after the q / k / v projections, as ops of backend ``B``:
    ``q' = B.rope(q, pos, norm=q_norm, **rope)``, ``B.kv_write(cache, il, plan,
    B.rope(k, pos, norm=k_norm, **rope), v)``; returns ``q'``. ``q [T, n_head, d_k]``,
    ``k [T, n_kv, d_k]``, ``v [T, n_kv, d_v]``; ``bias``: the projections' biases ``(bq, bk, bv)``
    (flat, any None), added first. ``rope``: ``B.rope``'s keyword arguments (n_rot, base,
    freq_scale, mode, freq_factors, eps, yarn). The op set's ``rope_kv_write`` is this
    composition; a backend may fuse it into fewer launches (CUDA: one kernel) with the same
    results -- except that CUDA's, for a rotated (turbo) K tier, returns q already rotated into
    that tier's domain as a ``cuda.RotatedQ``, which only its ``attention_cells`` takes."""
    if bias is not None:
        q, k, v = (x if b is None else x + b.reshape(x.shape[1:]) for x, b in zip((q, k, v), bias))
    q = B.rope(q, pos, norm=q_norm, **rope)
    B.kv_write(cache, il, plan, B.rope(k, pos, norm=k_norm, **rope), v)
    return q


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
    def asarray(a, dtype=None) -> np.ndarray:
        """A host array as this backend's tensor (a contiguous NumPy array; no copy when it
        is one already): the receiving end of ``offload.transfer``."""
        return np.ascontiguousarray(a, dtype=dtype)

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

    def mul_mat_split(self, x: np.ndarray, ws, bs=None) -> list:
        """``[x @ w.T + b for w, b in zip(ws, bs)]``, each ``[n, rows_i]`` float32 (``bs`` None: no
        biases; a None bias: none): several weights over one input, e.g. a layer's q / k / v
        projections, which a GPU backend may read as one product (``cuda.py``). Any backend's
        ``mul_mat`` and ``+`` serve (the Vulkan backend uses this one)."""
        bs = bs if bs is not None else (None,) * len(ws)
        return [self.mul_mat(x, w) if b is None else self.mul_mat(x, w) + b for w, b in zip(ws, bs)]

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

    def moe_ffn_gate_up(self, x: np.ndarray, logits: np.ndarray, gate_up_exps: np.ndarray, down_exps: np.ndarray,
                n_expert_used: int, act: str = "gelu_tanh", norm_w: bool = True,
                down_scale: np.ndarray | None = None) -> np.ndarray:
        """Mixture-of-experts FFN (Gemma-4 layout) with softmax routing over router ``logits``
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
        yarn=None,
    ) -> np.ndarray:
        """Rotary position embedding (Su et al. 2021), as ggml_rope_ext.

        x: ``[n_tokens, n_heads, head_dim]`` float32; pos: int ``[n_tokens]``.
        Rotates the first ``n_rot`` dims: ``mode="norm"`` pairs (2i, 2i+1),
        ``mode="neox"`` pairs (i, i + n_rot/2). Angle for pair i:
        ``pos * freq_scale * base**(-2i/n_rot) / freq_factors[i]``. With ``norm``
        (``[head_dim]``), each head vector is first RMS-normalized and scaled by it
        (q/k norms, as ``rms_norm(x, norm, eps)``).

        ``yarn`` (``opencoti.model.hparams.RopeYarn`` or None): YaRN (Peng et
        al. 2023) as ggml's ``rope_yarn``: with ``theta_e`` the unscaled angle,
        ``theta = freq_scale*theta_e*(1 - m_i) + theta_e*m_i`` where ``m_i =
        ext_factor * (1 - clamp((i - lo)/max(0.001, hi - lo), 0, 1))`` and
        ``[lo, hi]`` are the correction dims of ``beta_fast`` / ``beta_slow``
        (``ggml_rope_yarn_corr_dims``); cos and sin are scaled by
        ``attn_factor * (1 + 0.1 ln(1/freq_scale))`` (only the rotated dims).
        Returns a new array.
        """
        if norm is not None:
            x = CPUBackend.rms_norm(x, norm, eps)
        half = n_rot // 2
        cos, sin = rope_cos_sin(pos, n_rot, base, freq_scale, freq_factors, yarn)
        cos, sin = cos[:, None, :], sin[:, None, :]
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

    rope_kv_write = rope_kv_write  # the composition (module function) as the op

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

    # -- issue 7b: hybrid gated delta-net (Qwen3.5 / Qwen3-next) and MoE ops ---------------
    @staticmethod
    def sigmoid(x: np.ndarray) -> np.ndarray:
        """Logistic function ``1 / (1 + e^-x)`` (ggml_sigmoid), overflow-free."""
        return (0.5 * (1.0 + np.tanh(0.5 * x))).astype(np.float32, copy=False)

    @staticmethod
    def softplus(x: np.ndarray) -> np.ndarray:
        """``ln(1 + e^x)`` (ggml_softplus), overflow-free."""
        return np.logaddexp(np.float32(0.0), x).astype(np.float32, copy=False)

    @staticmethod
    def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
        """``x / max(||x||_2, eps)`` over the last axis (ggml_l2_norm)."""
        n = np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True))
        return x / np.maximum(n, np.float32(eps))

    @staticmethod
    def ssm_conv(x: np.ndarray, conv_states, w: np.ndarray, plan) -> np.ndarray:
        """Short causal depthwise convolution with a per-sequence carry (ggml_ssm_conv).

        x: float32 ``[T, C]`` (ubatch rows); w: ``[C, K]`` (GGUF ``ssm_conv1d``
        ``{K, C}``); conv_states: the layer's store float32 ``[n_seq_max, K-1, C]``;
        plan: ``recurrent_state.RSPlan`` (rows and slot of each sequence).
        For a sequence with rows ``r`` and state ``c``, ``xin = concat(c, x[r])``
        and ``y[r][t] = sum_j w[:, j] * xin[t + j]``; afterwards the slot holds
        ``xin[-(K-1):]``. Returns y float32 ``[T, C]`` (no activation).
        """
        K = w.shape[1]
        y = np.empty_like(x)
        for v in plan.views:
            n = len(v.rows)
            xin = np.concatenate([conv_states[v.slot], x[v.rows]], axis=0)  # [K-1+n, C]
            acc = xin[0:n] * w[:, 0]
            for j in range(1, K):  # kernel taps (K = 4), not tokens
                acc += xin[j:j + n] * w[:, j]
            y[v.rows] = acc
            conv_states[v.slot] = xin[n:]
        return y

    def gated_delta_net(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                        ssm_states, plan, scale: float) -> np.ndarray:
        """Gated delta rule over each sequence of a ubatch (Yang et al. 2024,
        "Gated Delta Networks"; llama.cpp ``build_recurrent_attn`` /
        ``ggml_gated_delta_net``; transformers ``torch_recurrent_gated_delta_rule``).

        q, k: float32 ``[T, H, d_k]`` (already L2-normalised, one per value head);
        v: ``[T, H, d_v]``; g: ``[T, H]`` log decay (<= 0); beta: ``[T, H]`` in
        (0, 1); ssm_states: the layer's store float32 ``[n_seq_max, H, d_k, d_v]``
        (updated in place); plan: ``recurrent_state.RSPlan``. Per token, head h:

            S <- exp(g_t) S
            S <- S + k_t (beta_t (v_t - S^T k_t))^T
            o_t = scale * S^T q_t

        Returns o float32 ``[T, H, d_v]``. Single-token sequences (decode) run as
        one batched step; longer ones in chunks of ``GDN_CHUNK`` tokens with the
        WY/UT form (a triangular solve per chunk instead of a loop over tokens).
        """
        T, H, _ = q.shape
        out = np.empty((T, H, v.shape[-1]), dtype=np.float32)
        qs = q * np.float32(scale)
        step = [x for x in plan.views if len(x.rows) == 1]
        if step:
            rows = np.array([x.rows[0] for x in step])
            slots = np.array([x.slot for x in step])
            S = ssm_states[slots] * np.exp(g[rows])[:, :, None, None]  # [n, H, dk, dv]
            kt = k[rows]
            kv = np.einsum("nhkv,nhk->nhv", S, kt)
            delta = (v[rows] - kv) * beta[rows][:, :, None]
            S = S + kt[:, :, :, None] * delta[:, :, None, :]
            out[rows] = np.einsum("nhkv,nhk->nhv", S, qs[rows])
            ssm_states[slots] = S
        for x in plan.views:
            if len(x.rows) == 1:
                continue
            S = np.array(ssm_states[x.slot], dtype=np.float32)  # [H, dk, dv]
            for c0 in range(0, len(x.rows), GDN_CHUNK):
                r = x.rows[c0:c0 + GDN_CHUNK]
                o, S = _gdn_chunk(qs[r], k[r], v[r], g[r], beta[r], S)
                out[r] = o
            ssm_states[x.slot] = S
        return out

    def moe_ffn(self, x: np.ndarray, gate_inp, up_exps, gate_exps, down_exps, n_expert_used: int,
                norm_w: bool = True, act: str = "silu", w_scale: float = 0.0) -> np.ndarray:
        """Routed mixture of experts (llama.cpp ``build_moe_ffn`` with softmax gating).

        x: float32 ``[T, n_embd]``; gate_inp: ``[n_expert, n_embd]``
        (``ffn_gate_inp``); up_exps, gate_exps: ``[n_expert, n_ff_exp, n_embd]``;
        down_exps: ``[n_expert, n_embd, n_ff_exp]``. Per token: ``p =
        softmax(x @ gate_inp.T)``; the ``n_expert_used`` largest ``p`` pick the
        experts, their weights are those ``p`` (divided by their sum when
        ``norm_w``, times ``w_scale`` when non-zero); output
        ``sum_e w_e * down_e(act(gate_e x) * up_e x)``, act "silu" or "gelu_tanh".
        Returns float32 ``[T, n_embd]``.
        """
        logits = self.mul_mat(x, gate_inp)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        sel = np.argsort(-p, axis=-1, kind="stable")[:, :n_expert_used]  # [T, k]
        w = np.take_along_axis(p, sel, axis=-1)
        if norm_w:
            w = w / w.sum(axis=-1, keepdims=True)
        if w_scale:
            w = w * np.float32(w_scale)
        out = np.zeros((x.shape[0], down_exps.shape[1]), dtype=np.float32)
        for e in np.unique(sel):  # experts hit by this ubatch
            tok, slot = np.nonzero(sel == e)  # a token picks an expert at most once
            h = self.gated_ffn(x[tok], gate_exps[e], up_exps[e], act)
            out[tok] += self.mul_mat(h, down_exps[e]) * w[tok, slot][:, None].astype(np.float32)
        return out


GDN_CHUNK = 64  # tokens per chunk of the gated delta rule (llama.cpp CHUNK_SIZE, transformers chunk_size)


def _gdn_chunk(q, k, v, g, beta, S):
    """One chunk of the gated delta rule for one sequence, all heads at once.

    q (pre-scaled), k: ``[C, H, d_k]``; v: ``[C, H, d_v]``; g, beta: ``[C, H]``;
    S: ``[H, d_k, d_v]`` state before the chunk. With ``G = cumsum(g)`` and the
    decays ``D[i, j] = exp(G_i - G_j)`` (j <= i), the delta-rule updates
    ``u`` solve ``(I + A) U = beta (V - exp(G) K S)``, ``A[i, j] = beta_i
    D[i, j] k_i.k_j`` for j < i; then ``O = exp(G) Q S + (Q K^T * D) U`` and
    ``S' = exp(G_C) S + (K exp(G_C - G))^T U``. Returns (O ``[C, H, d_v]``, S').
    """
    C = q.shape[0]
    qh, kh, vh = (np.ascontiguousarray(a.transpose(1, 0, 2)) for a in (q, k, v))  # [H, C, d]
    G = np.cumsum(g.T.astype(np.float32), axis=-1)  # [H, C]
    bh = beta.T[:, :, None]  # [H, C, 1]
    diff = G[:, :, None] - G[:, None, :]  # [H, C(i), C(j)]
    incl = np.tril(np.ones((C, C), dtype=bool))
    D = np.exp(np.where(incl, diff, -np.inf)).astype(np.float32)
    A = bh * (kh @ kh.transpose(0, 2, 1)) * D
    A[:, ~np.tril(np.ones((C, C), dtype=bool), -1)] = 0.0  # strictly lower
    eG = np.exp(G)[:, :, None]
    rhs = bh * (vh - eG * (kh @ S))
    U = np.linalg.solve(A + np.eye(C, dtype=np.float32), rhs)  # unit lower triangular
    O = eG * (qh @ S) + ((qh @ kh.transpose(0, 2, 1)) * D) @ U
    tail = np.exp(G[:, -1:] - G)[:, :, None]  # [H, C, 1]
    S = np.exp(G[:, -1])[:, None, None] * S + (kh * tail).transpose(0, 2, 1) @ U
    return O.transpose(1, 0, 2).astype(np.float32), S.astype(np.float32)


def rope_cos_sin(pos, n_rot: int, base: float, freq_scale: float, freq_factors=None, yarn=None):
    """cos and sin of the RoPE angles, float32 ``[T, n_rot/2]`` each, for int positions
    ``pos [T]``: pair i turns by ``pos * freq_scale * base**(-2i/n_rot) / freq_factors[i]``
    (float64 angles, as ggml_rope_ext); with ``yarn`` (``hparams.RopeYarn``) YaRN's angle
    mix and magnitude scale (ggml ``rope_yarn``, see ``CPUBackend.rope``). Shared by the
    CPU rope and the device backends that build the table on the host."""
    half = n_rot // 2
    inv = base ** (-np.arange(0, half, dtype=np.float64) * 2.0 / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors[:half], dtype=np.float64)
    theta_e = np.asarray(pos).astype(np.float64).reshape(-1)[:, None] * inv[None, :]  # [T, half]
    mscale = 1.0
    if yarn is not None and yarn.ext_factor != 0.0:
        lo, hi = yarn_corr_dims(n_rot, yarn.n_ctx_orig, base, yarn.beta_fast, yarn.beta_slow)
        ramp = 1.0 - np.clip((np.arange(half, dtype=np.float64) - lo) / max(0.001, hi - lo), 0.0, 1.0)
        mix = ramp * yarn.ext_factor
        theta = theta_e * freq_scale * (1.0 - mix) + theta_e * mix
        mscale = yarn.attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    else:
        theta = theta_e * freq_scale
        if yarn is not None:
            mscale = yarn.attn_factor
    return (np.cos(theta) * mscale).astype(np.float32), (np.sin(theta) * mscale).astype(np.float32)


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float
                   ) -> tuple[float, float]:
    """YaRN correction range ``[lo, hi]`` in rotary pair indices (ggml
    ``ggml_rope_yarn_corr_dims``): the dims whose wavelength makes ``beta_fast``
    resp. ``beta_slow`` turns over ``n_ctx_orig`` positions, floored / ceiled
    and clamped to ``[0, n_dims - 1]``."""

    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr_dim(beta_fast))), min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))


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
