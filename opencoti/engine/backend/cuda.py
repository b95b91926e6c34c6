"""CUDA backend: the op set on an NVIDIA GPU through CuPy.

Weights stay in their GGUF block format in device memory (``QTensor``: the
tensor's raw bytes, uploaded once). Kernels from ``opencoti/cuda_src`` are
compiled with NVRTC on first use and cached (``cuda_kernels.py``):

- ``mul_mat`` with up to ``GEMV_MAX_TOKENS`` activation rows: a GEMV that
  dequantizes the weight's blocks in registers (one warp per output row, as
  ggml-cuda ``mul_mat_vec``); more rows (prefill): the weight is dequantized to
  float32 in a scratch buffer and multiplied by cuBLAS (``cupy.matmul``).
- ``attention_cells``: split-K online-softmax attention that reads f16 K/V
  through the cache plan's per-sequence cell lists (``attention.cu``).
- ``rms_norm``, ``rope`` (norm/neox, freq factors), activations, ``kv_write``.

Activations are float32 CuPy arrays ``[n_tokens, n]``; only logits (the rows
that need them) come back to the host (``to_host``). Per step, the ubatch's
token ids, positions and output rows go to the device once
(``begin_ubatch``), and each cache plan's index arrays once (first use).

Errors: ``RuntimeError`` when CuPy or a GPU is missing (from the registry's
creator), ``NotImplementedError`` for a head size / GQA ratio without a
kernel, ``ValueError`` for a KV tier other than f16 (``kv_types``; the runner
checks it at boot).
"""

from __future__ import annotations

import os

import numpy as np

from opencoti.engine.backend.cuda_kernels import load_module
from opencoti.model.gguf_file import GGUFFile

GEMV_MAX_TOKENS = 8
ATTN_HEAD_DIMS = (32, 64, 128, 256)
ATTN_GROUPS = (1, 2, 4, 8)
QTYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
          10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_NULL = np.uint64(0)


class QTensor:
    """A 2-D GGUF weight on the GPU in its block format.

    ``data``: uint8 CuPy array of the tensor's bytes (row r at ``r * row_bytes``);
    ``ggml_type``: ggml type id; ``shape``: NumPy shape ``(rows, cols)`` =
    ``reversed(ne)`` (``[out, in]`` for a matrix).
    """

    def __init__(self, data, ggml_type: int, shape: tuple[int, int], row_bytes: int):
        self.data = data
        self.ggml_type = int(ggml_type)
        self.shape = shape
        self.row_bytes = int(row_bytes)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class CUDABackend:
    """CuPy implementation of the op interface (DESIGN.md "Backends: one op set").

    Args:
        device: CUDA device index (``--main-gpu``).
    """

    name = "cuda"
    kv_types = ("f16",)  # KV tiers with kernels here (the quantized tiers come later)

    def __init__(self, device: int = 0):
        import cupy as cp

        self.cp = cp
        self.xp = cp
        self.device = cp.cuda.Device(device)
        self.device.use()
        self._mods = {"k": load_module("kernels.cu"), "a": load_module("attention.cu")}
        self._fns: dict = {}
        self._ub = None
        self._dev: dict = {}
        self._meta: dict = {}
        self._staged = False
        self._capturing = False
        self.graphs = os.environ.get("OPENCOTI_CUDA_GRAPHS", "1") != "0"
        self.n_sm = cp.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
        self.device_name = cp.cuda.runtime.getDeviceProperties(device)["name"].decode()

    # -- plumbing -----------------------------------------------------------------------
    def _fn(self, mod: str, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self._mods[mod].get_function(name)
        return f

    def _qfn(self, prefix: str, w: QTensor):
        if w.ggml_type not in QTYPES:
            raise NotImplementedError(f"CUDA backend: no kernels for ggml type {w.ggml_type}")
        return self._fn("k", f"{prefix}_{w.ggml_type}")

    def zeros(self, shape, dtype):
        """Zero-filled device array (KV storage)."""
        return self.cp.zeros(shape, dtype=dtype)

    def free_memory(self) -> int:
        """Free bytes on the device (``cudaMemGetInfo``), for auto-tier's KV budget."""
        return int(self.cp.cuda.runtime.memGetInfo()[0])

    def to_host(self, x) -> np.ndarray:
        """Device array -> NumPy (synchronizes). While a graph is captured or run
        through ``run_graph`` the device array itself (the graph's output) is returned."""
        if self._staged:
            return x
        return self.cp.asnumpy(x)

    def begin_ubatch(self, ub) -> None:
        """Upload the ubatch's token ids, positions and output rows (one copy)."""
        cp = self.cp
        if self._staged:  # run_graph staged them in fixed buffers already
            return
        host = np.concatenate([ub.tokens, ub.pos, ub.out_rows]).astype(np.int32)
        dev = cp.asarray(host)
        n, m = len(ub.tokens), len(ub.out_rows)
        self._ub = ub
        self._dev = {id(ub.tokens): dev[:n], id(ub.pos): dev[n:2 * n], id(ub.out_rows): dev[2 * n:2 * n + m]}
        self._meta = {}

    def _idx(self, a):
        """int32 device copy of an index array (the ubatch's arrays are uploaded already)."""
        if isinstance(a, self.cp.ndarray):
            return a.astype(self.cp.int32, copy=False)
        ub = self._ub
        if ub is not None and (a is ub.tokens or a is ub.pos or a is ub.out_rows):
            return self._dev[id(a)]
        return self.cp.asarray(np.asarray(a, dtype=np.int32))

    # -- weights ------------------------------------------------------------------------
    def load_weight(self, gguf: GGUFFile, name: str):
        """A matrix as a ``QTensor`` (raw GGUF blocks on the device); a vector (norm
        weights, biases, rope factors) as a float32 CuPy array."""
        info = gguf.tensors[name]
        if len(info.ne) == 1:
            return self.cp.asarray(gguf.dequantize(name, np.float32))
        if len(info.ne) != 2:
            raise NotImplementedError(f"CUDA backend: {name} has {len(info.ne)} dims")
        raw = gguf.raw(name)
        rows, cols = info.ne[1], info.ne[0]
        if int(info.ggml_type) not in QTYPES:
            raise NotImplementedError(f"CUDA backend: {name} has unsupported type {info.ggml_type.name}")
        data = self.cp.asarray(np.ascontiguousarray(raw).reshape(-1))
        return QTensor(data, int(info.ggml_type), (rows, cols), raw.shape[1] if rows else 0)

    def dequantize(self, w: QTensor, dtype=np.float32):
        """Whole weight as a dense ``[rows, cols]`` device array (float32 or float16)."""
        cp = self.cp
        rows, cols = w.shape
        half = np.dtype(dtype) == np.float16
        out = cp.empty((rows, cols), dtype=np.float16 if half else np.float32)
        n = rows * (cols // 32)
        self._qfn("dequant_f16" if half else "dequant_f32", w)(
            ((n + 255) // 256,), (256,), (w.data, np.int64(w.row_bytes), out, np.int32(rows), np.int32(cols)))
        return out

    # -- matmul / rows --------------------------------------------------------------------
    def mul_mat(self, x, w):
        """``x [n, k] @ w[out, k].T`` -> ``[n, out]`` float32."""
        cp = self.cp
        if not isinstance(w, QTensor):
            return cp.matmul(x, w.T)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n, k = x.shape
        rows, cols = w.shape
        if k != cols:
            raise ValueError(f"mul_mat: x has {k} columns, weight {cols}")
        if n > GEMV_MAX_TOKENS:
            return cp.matmul(x, self.dequantize(w).T)
        y = cp.empty((n, rows), dtype=cp.float32)
        fn = self._qfn("gemv1" if n == 1 else "gemv8", w)
        fn(((rows * 32 + 255) // 256,), (256,),
           (w.data, np.int64(w.row_bytes), x, y, np.int32(rows), np.int32(cols), np.int32(n)))
        return y

    def gated_ffn(self, x, gate, up, act: str):
        """``act(x @ gate.T) * (x @ up.T)`` -> ``[n, n_ff]`` float32; act "gelu_tanh" or "silu".
        One token with gate and up of one type: a single fused GEMV."""
        cp = self.cp
        a = 1 if act == "gelu_tanh" else 0
        if (x.shape[0] == 1 and isinstance(gate, QTensor) and isinstance(up, QTensor)
                and gate.ggml_type == up.ggml_type and gate.shape == up.shape and gate.row_bytes == up.row_bytes):
            x = cp.ascontiguousarray(x, dtype=cp.float32)
            rows, cols = gate.shape
            y = cp.empty((1, rows), dtype=cp.float32)
            self._qfn("gemv_gated", gate)(((rows * 32 + 255) // 256,), (256,),
                                          (gate.data, up.data, np.int64(gate.row_bytes), x, y,
                                           np.int32(rows), np.int32(cols), np.int32(a)))
            return y
        g = self.mul_mat(x, gate)
        u = self.mul_mat(x, up)
        y = cp.empty_like(g)
        n = g.size
        self._fn("k", "gated_act")(((n + 255) // 256,), (256,), (g, u, y, np.int64(n), np.int32(a)))
        return y

    def get_rows(self, table, ids):
        """Rows ``ids`` of ``table`` (a ``QTensor``, dequantized on the fly, or a device
        array) -> ``[n, cols]`` float32."""
        cp = self.cp
        ids_d = self._idx(ids)
        if not isinstance(table, QTensor):
            return cp.ascontiguousarray(table[ids_d], dtype=cp.float32)
        n = int(ids_d.size)
        rows, cols = table.shape
        out = cp.empty((n, cols), dtype=cp.float32)
        if n:
            self._qfn("get_rows", table)((n,), (min(256, max(32, cols // 32)),),
                                         (table.data, np.int64(table.row_bytes), ids_d, out, np.int32(cols)))
        return out

    # -- elementwise / norms ----------------------------------------------------------------
    def rms_norm(self, x, w, eps: float):
        """RMSNorm over the last axis, times ``w`` if given (same shape as ``x``)."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = x.shape[-1]
        rows = x.size // n
        y = cp.empty_like(x)
        self._fn("k", "rms_norm")((rows,), (min(256, (n + 31) // 32 * 32),),
                                  (x, w if w is not None else _NULL, y, np.int32(n), np.float32(eps)))
        return y

    def _unary(self, name: str, x):
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        y = cp.empty_like(x)
        self._fn("k", name)(((x.size + 255) // 256,), (256,), (x, y, np.int64(x.size)))
        return y

    def gelu_tanh(self, x):
        """GELU, tanh approximation."""
        return self._unary("gelu_tanh", x)

    def silu(self, x):
        """x * sigmoid(x)."""
        return self._unary("silu", x)

    def rope(self, x, pos, n_rot: int, base: float, freq_scale: float = 1.0, mode: str = "norm",
             freq_factors=None):
        """RoPE on ``x [T, H, D]`` (see ``CPUBackend.rope``); returns a new array."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        T, H, D = x.shape
        y = cp.empty_like(x)
        self._fn("k", "rope")((T * H,), (min(256, (D + 31) // 32 * 32),),
                              (x, self._idx(pos), y, np.int32(H), np.int32(D), np.int32(n_rot),
                               np.float32(base), np.float32(freq_scale), np.int32(2 if mode == "neox" else 0),
                               freq_factors if freq_factors is not None else _NULL, _NULL, np.float32(0)),
                              shared_mem=4 * D)
        return y

    # -- KV cache -------------------------------------------------------------------------
    def _plan_meta(self, plan, n_cells: int):
        """Device index arrays of a cache plan (uploaded once per ubatch):
        write cells, and per-view cell lists for attention."""
        hit = self._meta.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        T = len(plan.cell)
        row_view = np.zeros(T, dtype=np.int32)
        off = [0]
        cells, cpos = [], []
        for i, v in enumerate(plan.views):
            row_view[v.rows] = i
            cells.append(v.stream * n_cells + np.asarray(v.cells, dtype=np.int64))
            cpos.append(v.cell_pos)
            off.append(off[-1] + len(v.cells))
        cells_a = np.concatenate(cells) if cells else np.zeros(0, np.int64)
        cpos_a = np.concatenate(cpos) if cpos else np.zeros(0, np.int32)
        write = plan.stream * n_cells + plan.cell
        parts = [write, row_view, np.asarray(off), cells_a, cpos_a]
        dev = self.cp.asarray(np.concatenate(parts).astype(np.int32))
        o = np.cumsum([0] + [len(p) for p in parts])
        m = {"write": dev[o[0]:o[1]], "row_view": dev[o[1]:o[2]], "view_off": dev[o[2]:o[3]],
             "cells": dev[o[3]:o[4]], "cell_pos": dev[o[4]:o[5]],
             "max_len": max((len(v.cells) for v in plan.views), default=0)}
        self._meta[id(plan)] = (plan, m)  # the plan is kept alive so its id cannot be reused meanwhile
        return m

    @staticmethod
    def _plan_host(plan, n_cells: int, cap: int):
        """Host int32 arrays of a plan's metadata, cells padded to ``cap``."""
        T = len(plan.cell)
        row_view = np.zeros(T, dtype=np.int64)
        off = [0]
        cells, cpos = [], []
        for i, v in enumerate(plan.views):
            row_view[v.rows] = i
            cells.append(v.stream * n_cells + np.asarray(v.cells, dtype=np.int64))
            cpos.append(np.asarray(v.cell_pos, dtype=np.int64))
            off.append(off[-1] + len(v.cells))
        pad = cap - off[-1]
        cells.append(np.zeros(pad, np.int64))
        cpos.append(np.zeros(pad, np.int64))
        write = plan.stream * n_cells + plan.cell
        return [write, row_view, np.asarray(off), np.concatenate(cells), np.concatenate(cpos)]

    # -- CUDA graphs ----------------------------------------------------------------------
    def run_graph(self, ub, caches, forward, graphs: dict):
        """Run ``forward()`` (the network on ``ub``) as a replayed CUDA graph.

        Decode steps launch ~200 small kernels; from Python each costs ~9 us, inside a
        graph ~1 us (DESIGN.md). Everything a step changes (token ids, positions,
        cell lists) is copied into buffers fixed per graph key before replay, in one
        host->device copy; kernels read them through pointers. The key is (n_tokens,
        n_out, per cache: views, cell-list bucket): cell lists are padded to a power of
        two >= 256, and attention's split count follows the bucket, so one graph serves
        every step until a sequence outgrows its bucket. ``caches``: the KV caches in
        ``ub.plans`` order (their per-stream cell counts). ``graphs``: the caller's
        graph store (one per runner: a graph holds that network's weights and KV
        storage addresses, so it must never serve another runner). Returns host logits.
        Falls back to eager execution for ubatches over ``GEMV_MAX_TOKENS`` rows
        (cuBLAS prefill is not captured).
        """
        cp = self.cp
        T = ub.n_tokens
        if T > GEMV_MAX_TOKENS:
            return forward()
        ncells = [c.k[c.layers[0]].shape[1] for c in caches]
        tot = [sum(len(v.cells) for v in p.views) for p in ub.plans]
        caps = [max(256, 1 << (t - 1).bit_length()) for t in tot]
        key = (T, len(ub.out_rows), tuple((len(p.views), cap) for p, cap in zip(ub.plans, caps)))
        host = [ub.tokens, ub.pos, ub.out_rows]
        for p, n, cap in zip(ub.plans, ncells, caps):
            host += self._plan_host(p, n, cap)
        flat = np.concatenate(host).astype(np.int32)
        g = graphs.get(key)
        if g is None:
            buf = cp.empty(flat.size, dtype=cp.int32)
        else:
            buf = g["buf"]
        buf.set(flat)
        # views of the staged buffer stand in for begin_ubatch / _plan_meta uploads
        o = np.cumsum([0] + [len(h) for h in host])
        self._ub = ub
        self._dev = {id(ub.tokens): buf[o[0]:o[1]], id(ub.pos): buf[o[1]:o[2]], id(ub.out_rows): buf[o[2]:o[3]]}
        self._meta = {}
        for i, (p, cap) in enumerate(zip(ub.plans, caps)):
            j = 3 + 5 * i
            self._meta[id(p)] = (p, {"write": buf[o[j]:o[j + 1]], "row_view": buf[o[j + 1]:o[j + 2]],
                                     "view_off": buf[o[j + 2]:o[j + 3]], "cells": buf[o[j + 3]:o[j + 4]],
                                     "cell_pos": buf[o[j + 4]:o[j + 5]], "max_len": cap})
        self._staged = True
        try:
            if g is None:
                cp.cuda.get_current_stream().synchronize()
                stream = cp.cuda.Stream(non_blocking=True)
                # a private pool per graph (as PyTorch's graph pools): the graph's scratch
                # memory is never handed to anything else while the graph lives
                pool = cp.cuda.MemoryPool()
                with cp.cuda.using_allocator(pool.malloc), stream:
                    forward()  # warm-up on the capture stream: compiles CuPy kernels, fills its pool
                    stream.synchronize()
                    self._capturing = True
                    try:
                        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
                    except (AttributeError, TypeError):
                        stream.begin_capture()
                    out = forward()
                    graph = stream.end_capture()
                self._capturing = False
                g = graphs[key] = {"buf": buf, "graph": graph, "out": out, "pool": pool, "stream": stream}
            g["graph"].launch(stream=cp.cuda.get_current_stream())
            return cp.asnumpy(g["out"])
        finally:
            self._staged = False
            self._capturing = False

    def kv_write(self, cache, il: int, plan, k, v) -> None:
        """Store K ``[T, n_head_kv, d_k]`` / V of a layer into the plan's cells (as f16)."""
        cp = self.cp
        K, V = cache.k[il], cache.v[il]
        if K.dtype != np.float16 or V.dtype != np.float16:
            raise ValueError(f"the CUDA backend supports KV cache types {', '.join(self.kv_types)} only "
                             f"(got -ctk {cache.type_k} -ctv {cache.type_v}); use --gpu disable for the others")
        meta = self._plan_meta(plan, K.shape[1])
        k = cp.ascontiguousarray(k, dtype=cp.float32)
        v = cp.ascontiguousarray(v, dtype=cp.float32)
        T = k.shape[0]
        if T:
            self._fn("k", "kv_write")((T,), (256,), (k, v, K, V, meta["write"],
                                                     np.int32(k.size // T), np.int32(v.size // T)))

    def attention_cells(self, q, q_pos, k_store, v_store, plan, scale: float, n_swa: int = 0,
                        softcap: float = 0.0, type_k=None, type_v=None):
        """Attention of the ubatch's queries ``q [T, n_head, d]`` over each row's sequence
        cells in the plan (``plan.views``), reading f16 ``k_store``/``v_store``
        ``[n_stream, n_cells, n_head_kv, d]`` (``type_k`` / ``type_v``: their tiers, f16 or
        None). Masks as ``CPUBackend.attention``. Returns ``[T, n_head * d]`` float32.
        Raises ``ValueError`` for any other tier."""
        cp = self.cp
        for t in (type_k, type_v):
            if t is not None and t.name not in self.kv_types:
                raise ValueError(f"the CUDA backend has no attention kernel for KV cache type {t.name} "
                                 f"(supported: {', '.join(self.kv_types)})")
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        T, H, D = q.shape
        n_kv, dv = k_store.shape[2], v_store.shape[3]
        if dv != D or k_store.shape[3] != D:
            raise NotImplementedError("CUDA attention needs d_k == d_v")
        G = H // n_kv
        g = next((x for x in ATTN_GROUPS if x >= G), None)
        if D not in ATTN_HEAD_DIMS or g is None:
            raise NotImplementedError(f"CUDA attention: head_dim {D} / GQA group {G} not supported "
                                      f"(head_dim {ATTN_HEAD_DIMS}, group <= {ATTN_GROUPS[-1]})")
        meta = self._plan_meta(plan, k_store.shape[1])
        out = cp.empty((T, H * D), dtype=cp.float32)
        base = T * n_kv
        n_split = 1
        if base < 2 * self.n_sm:
            n_split = int(max(1, min(meta["max_len"] // 128, (2 * self.n_sm + base - 1) // base, 64)))
        if n_split > 1:
            part_acc = cp.empty((T * H * n_split * D,), dtype=cp.float32)
            part_ml = cp.empty((T * H * n_split * 2,), dtype=cp.float32)
        else:
            part_acc = part_ml = out
        self._fn("a", f"attn_partial_d{D}_g{g}")(
            (T, n_kv, n_split), (128,),
            (q, self._idx(q_pos), meta["row_view"], meta["view_off"], meta["cells"], meta["cell_pos"],
             k_store, v_store, np.int32(H), np.int32(n_kv), np.float32(scale), np.int32(n_swa),
             np.float32(softcap), np.int32(n_split), out, part_acc, part_ml))
        if n_split > 1:
            self._fn("a", "attn_merge")((T, H), (min(256, D),),
                                        (part_acc, part_ml, out, np.int32(H), np.int32(D), np.int32(n_split)))
        return out
