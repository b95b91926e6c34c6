"""The two-sequence session of the CUDA-vs-CPU architecture test, and a CPU emulation of
the CUDA backend's f16 GEMM rows (test helpers, shared by tests/test_cuda.py and the
CPU-only tests/test_qwen_hybrid.py).

``mixed_run`` is the script of ``test_new_arch_cuda_matches_cpu`` (issue 7c).
``F16GemmCPU`` is the CPU backend with the one CUDA numerical path that is not float32:
``CUDABackend.mul_mat`` for ``F16_GEMM_MIN_ROWS <= n <= GEMV_MAX_TOKENS`` activation rows
(eager, not while a graph is captured) rounds the activations and the dequantized weight
to f16 (round to nearest even: ``x.astype(cp.float16)``, ``f2h`` in ``dequant_f16``) and
multiplies with f32 accumulation (cuBLAS ``gemmEx``, CUBLAS_COMPUTE_32F). What goes
through ``mul_mat`` there: every projection, the dense ``gated_ffn`` halves, the MoE router
``x @ ffn_gate_inp.T`` and the shared-expert gate; the routed experts of up to
``GEMV_MAX_TOKENS`` rows do not (``_moe_pairs``: float32 GEMVs by expert id).
"""

from __future__ import annotations

import numpy as np

from opencoti.engine.backend.cpu import CPUBackend
from opencoti.engine.batch import UBatch

GEMV_MAX_TOKENS = 64  # opencoti.engine.backend.cuda.GEMV_MAX_TOKENS (asserted equal by the test)
SCRIPT_A = [(i * 37 + 11) % 384 for i in range(110)]
SCRIPT_B = [(i * i * 7 + 3) % 384 for i in range(45)]


def mixed_run(runner, a=SCRIPT_A, b=SCRIPT_B) -> np.ndarray:
    """One scripted session on ``runner`` (2 sequences); returns the logits of every step,
    concatenated: float32 ``[155, n_vocab]``. Seq 0 prefills ``a[:100]`` in one ubatch
    (over the GEMV limit: cuBLAS, host-grouped MoE); seq 1 prefills ``b[:30]`` in ubatches
    of 16 + 14 (GEMV path, graph captures), rows 100..129; then seq 0's next token rides
    with seq 1's next 5 prompt tokens (decode + prefill in one ubatch), 4 steps that decode
    both sequences in one ubatch, and 6 single-token steps alternating the sequences (same
    graph key, other rows / slots / cells)."""
    out = []

    def step(toks, pos, seqs):
        out.append(runner.decode(UBatch.build(toks, pos, seqs, np.arange(len(toks)))))

    step(a[:100], np.arange(100), [0] * 100)
    step(b[:16], np.arange(16), [1] * 16)
    step(b[16:30], np.arange(16, 30), [1] * 14)
    step([a[100]] + b[30:35], [100] + list(range(30, 35)), [0] + [1] * 5)
    for i in range(4):
        step([a[101 + i], b[35 + i]], [101 + i, 35 + i], [0, 1])
    for i in range(6):
        s = i % 2
        p = (105 if s == 0 else 39) + i // 2
        step([(a if s == 0 else b)[p]], [p], [s])
    return np.concatenate(out)


class F16GemmCPU(CPUBackend):
    """CPU backend whose ``mul_mat`` rounds like CUDA's f16 GEMM for ``min_rows <= n <=
    GEMV_MAX_TOKENS`` rows (module docstring); ``min_rows`` 0: plain CPU. ``routes`` logs
    every MoE call's expert choice: ``(n_rows, sel int [n, k] sorted per row, p float32
    [n, n_expert] softmax)``."""

    def __init__(self, min_rows: int):
        super().__init__()
        self.key = f"cpu-f16gemm-{min_rows}"  # Model.network caches one network per backend key
        self.min_rows = min_rows
        self.routes: list = []
        self._experts = 0

    def mul_mat(self, x, w):
        n = x.shape[0]
        if self._experts or not self.min_rows or not self.min_rows <= n <= GEMV_MAX_TOKENS:
            return x @ w.T
        x16 = x.astype(np.float16).astype(np.float32)
        w16 = w.astype(np.float16).astype(np.float32)
        return (x16.astype(np.float64) @ w16.astype(np.float64).T).astype(np.float32)

    def moe_ffn(self, x, gate_inp, up_exps, gate_exps, down_exps, n_expert_used: int, norm_w: bool = True,
                act: str = "silu", w_scale: float = 0.0):
        """``CPUBackend.moe_ffn`` with the router through ``self.mul_mat`` and the experts in
        float32 (as ``CUDABackend._moe_pairs``); logs the routing."""
        logits = self.mul_mat(x, gate_inp)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        sel = np.argsort(-p, axis=-1, kind="stable")[:, :n_expert_used]
        self.routes.append((x.shape[0], np.sort(sel, axis=-1), p))
        w = np.take_along_axis(p, sel, axis=-1)
        if norm_w:
            w = w / w.sum(axis=-1, keepdims=True)
        if w_scale:
            w = w * np.float32(w_scale)
        out = np.zeros((x.shape[0], down_exps.shape[1]), dtype=np.float32)
        self._experts += 1
        try:
            for e in np.unique(sel):
                tok, slot = np.nonzero(sel == e)
                h = self.gated_ffn(x[tok], gate_exps[e], up_exps[e], act)
                out[tok] += self.mul_mat(h, down_exps[e]) * w[tok, slot][:, None].astype(np.float32)
        finally:
            self._experts -= 1
        return out
