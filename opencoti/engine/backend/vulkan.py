"""Vulkan backend: the op set as compute pipelines over the shipped SPIR-V.

Runs on any Vulkan 1.1 device (AMD, Intel, NVIDIA, Mesa's lavapipe on the CPU)
through the ``vulkan`` package; the GLSL sources and their committed ``.spv``
live in ``opencoti/vk_shaders`` (``python -m opencoti.vk_shaders.build``).
``vk_runtime.py`` holds the device plumbing.

- Weights stay in their GGUF block format on the device (``QTensor``: the
  tensor's raw bytes, uploaded once, in row *parts* that each fit one
  storage-buffer binding). ``mul_mat`` with up to ``GEMV_MAX_TOKENS`` activation
  rows is a GEMV that dequantizes in registers (``mul_mat_vec.comp``, as
  ggml-vulkan ``mul_mat_vec``); more rows use a tiled GEMM whose loader
  dequantizes weight tiles into shared memory (``mul_mm.comp``), except on CPU
  drivers, where the GEMV (8 rows per workgroup) is faster at any count. Types: F32,
  F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
- ``attention_cells``: split-K online-softmax attention reading the KV storage
  through the cache plan's per-sequence cell lists (``attn.comp``); causal and
  sliding-window masks, softcap, GQA, head size up to 512. KV tiers (``kv_types``):
  f32, f16, bf16, q8_0, q6_0, q5_1, q5_0, q4_1, q4_0, iq4_nl, turbo8, turbo4, turbo3,
  turbo2, turbo3_tcq, turbo2_tcq, any per half: f16 or f32 K and V of one type use their
  own variants; every other choice ``attn_any``, which dequantizes each half's tier
  in registers (rotated tiers: q rotated once per head, the output un-rotated once,
  see ``attn.comp``). ``kv_write`` quantizes on the device to exactly the bytes of
  the tier's reference ``quantize`` (``kv_store.comp`` for the scalar tiers,
  ``kv_rot.comp`` for the rotated ones: the Walsh-Hadamard butterfly, pairwise block
  sums, Lloyd-Max codes or the trellis Viterbi search, in the float32 operations
  ``kv_tiers/turbo.py`` fixes; division by integer long division, a correctly
  rounded sqrt, expressions without contraction).
- ``rope`` (norm / neox, freq base and scale, freq factors, per-layer bases,
  YaRN, the fused per-head q/k norm) rotates with a (cos, sin) table the host
  computes in float64 per ubatch, as the CPU backend does; ``rms_norm``,
  ``add_rms_norm``, ``l2_norm``, ``gelu_tanh``, ``silu``, ``sigmoid``, ``softplus``,
  gated FFN, add / mul / scale.
- Mixture of experts (``moe_ffn``, ``moe_ffn_gate_up``): 3-D expert tensors stay in
  their block format (``QExperts``); routing (softmax, top-k) and the weighted sum
  run on the device (``moe.comp``), every (token, slot) pair through an expert GEMV
  that reads its expert by the routed id (``mul_mat_vec.comp`` MUL_MAT_ID): no host
  sync, so decode graphs hold MoE layers; a prefill runs T*k GEMV rows (no grouped GEMM).
- Gated delta-net layers of the hybrid models (``ssm_conv``, ``gated_delta_net``,
  ``recurrent.comp``), per-sequence states on the device, updated in place, one
  token after another per sequence.
- Architectures: llama, qwen2 (incl. YaRN), qwen3, gemma3, gemma4 dense, E-series
  and MoE, qwen35, qwen35moe, qwen3next.

Activations are ``VkTensor`` (float32, row-major ``[n_tokens, n]``) and stay on
the device; the arithmetic the architectures write (``x + h``, ``x * c``,
``q + bias``) records device ops. All ops of a forward pass are recorded into
one command buffer and submitted when the logits are read (``to_host``).
KV storage (``zeros``) is a ``VkTensor`` too; indexing it with
``[stream, cells]`` reads those cells back to the host and assigning writes them
(the rare K-shift and cross-stream ``seq_cp`` paths; cells of a quantized tier
whose rows end mid-word go through a host copy of the layer). ``t[i]`` is a view
of row i (recurrent state slots: zeroed, copied on the device); ``t[..., a:b]``
copies a column range (the hybrid models' fused projections).

Decode steps (ubatches of up to ``GEMV_MAX_TOKENS`` rows) are recorded once per
shape into a reusable command buffer and replayed (``run_graph``, as the CUDA
backend's graphs): per step only the inputs are written (token ids, positions,
cell lists padded to a power-of-two bucket >= 256, rope tables, a hybrid model's
recurrent plan: rows and state slots) and the buffer
is submitted, so the Python cost of recording ~370 dispatches is paid once per
shape. ``OPENCOTI_VK_GRAPHS=0`` turns this off.

Shared-prefix groups (``plan.groups``) are not used: each sequence attends over
its complete cell list (``view.cells``), which is exact.

Errors: ``VulkanUnavailable`` from the registry's creator when the package,
loader, driver or device is missing; ``NotImplementedError`` for a weight type,
head size or shape without a shader; ``ValueError`` for mismatched shapes and
for a KV tier outside ``kv_types`` (the runner checks that at boot).
"""

from __future__ import annotations

import functools
import math
import os
import struct

import numpy as np

from opencoti.engine.backend.cpu import CPUBackend, rope_cos_sin, rope_kv_write
from opencoti.engine.backend.experts import ExpertRows
from opencoti.engine.backend.vk_runtime import GraphTooLarge, Runtime, describe
from opencoti.model.gguf_file import GGUFFile
from opencoti.vk_shaders import KV_NAMES, QTYPE_NAMES

GEMV_MAX_TOKENS = 8
MAX_GRAPHS = 64  # recorded decode graphs kept per runner (oldest dropped first)
ATTN_MAX_HEAD_DIM = 512
QTYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
          10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_KV_DTYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}
# KV tiers with kernels here -> their code in kv_quant.glsl (kv_store.comp, attn.comp KV_ANY)
# (in kv_tiers.TIER_NAMES order, which kv_types keeps; q4_1 and iq4_nl came after the rest were numbered)
KV_TIER_CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q6_0": 4, "q5_1": 5, "q5_0": 6, "q4_1": 8, "q4_0": 7,
                 "iq4_nl": 9, "turbo8": 10, "turbo4": 11, "turbo3": 12, "turbo2": 13, "turbo3_tcq": 14,
                 "turbo2_tcq": 15}
_KV_ROTATED = 10  # codes from here on: rotated tiers (kv_rot.comp writes them)
_OP_ADD, _OP_MUL, _OP_GELU_MUL, _OP_SILU_MUL = 0, 1, 2, 3
_U_SCALE, _U_GELU, _U_SILU, _U_SIGMOID, _U_SOFTPLUS = 0, 1, 2, 3, 4
SSM_MAX_CONV = 8  # ssm_conv kernel taps (recurrent.comp KMAX)
GDN_MAX_DK = 256  # gated_delta_net key head size (recurrent.comp DKMAX)


def _u32(*v) -> bytes:
    return struct.pack(f"<{len(v)}I", *v)


def _is_rs(plan) -> bool:
    """Whether a ubatch plan is a recurrent-state plan (``recurrent_state.RSPlan``), not a KV one."""
    return hasattr(plan, "fresh")


class _NotCapturable(RuntimeError):
    """A forward pass that a graph cannot hold (or a replay that left its tape)."""


def _taped(fn):
    """An op of the interface as graphs see it: while a graph is recorded, its result
    goes on the graph's tape; on replay the op records nothing and returns the result
    it returned then (the replayed command buffer computes the values). Ops called
    from inside a taped op run normally (only the outermost call is taped)."""
    name = fn.__name__

    @functools.wraps(fn)
    def op(self, *args, **kw):
        mode = self._mode
        if mode is None or mode == "done" or self._depth:
            return fn(self, *args, **kw)
        g = self._graph
        if mode == "replay":
            i = g.tape_pos
            if i >= len(g.tape) or g.tape[i][0] != name:
                raise _NotCapturable(f"replay diverged at op {i} ({name})")
            g.tape_pos = i + 1
            return g.tape[i][1]
        self._depth += 1
        try:
            out = fn(self, *args, **kw)
        finally:
            self._depth -= 1
        g.tape.append((name, out))
        return out
    return op


class VkTensor:
    """A device array: ``shape``, ``dtype`` and ``nbytes`` bytes at ``offset`` of a
    runtime allocation (``alloc``), row-major. Reshapes share the allocation.

    Arithmetic (``+``, ``*`` with a tensor, a broadcast vector or a scalar) records
    device ops on the owning backend. ``get()`` / ``np.asarray`` / ``astype`` copy to
    the host (and wait for the device). ``t[stream, cells]`` on 4-D KV storage
    reads those cells to the host; ``t[stream, cells] = a`` writes them. ``t[:, i]``
    of a 3-D tensor ``[A, B, C]`` is the device tensor ``[A, C]`` (``select_mid``).
    """

    __array_ufunc__ = None  # numpy defers to our operators instead of converting
    __slots__ = ("be", "alloc", "shape", "dtype", "offset", "host", "size", "nbytes")

    def __init__(self, be: "VulkanBackend", alloc, shape, dtype, offset: int = 0, host=None):
        self.be = be
        self.alloc = alloc
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.offset = offset
        self.host = host  # optional host copy (small weights: rope factors)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"VkTensor(shape={self.shape}, dtype={self.dtype})"

    def reshape(self, *shape) -> "VkTensor":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = list(shape)
        if -1 in shape:
            i = shape.index(-1)
            rest = math.prod(s for j, s in enumerate(shape) if j != i)
            shape[i] = self.size // max(rest, 1)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {tuple(shape)}")
        return VkTensor(self.be, self.alloc, shape, self.dtype, self.offset, self.host)

    # -- arithmetic (device ops) ----------------------------------------------------------
    def __add__(self, o):
        return self.be.add(self, o)

    __radd__ = __add__

    def __mul__(self, o):
        if np.isscalar(o) or (isinstance(o, np.ndarray) and o.ndim == 0):
            return self.be.scale(self, float(o))
        return self.be.mul(self, o)

    __rmul__ = __mul__

    # -- host access ----------------------------------------------------------------------
    def get(self) -> np.ndarray:
        """A host copy (waits for the device)."""
        raw = self.be.rt.download(self.alloc, self.offset, self.nbytes)
        return raw.view(self.dtype).reshape(self.shape)

    def __array__(self, dtype=None, copy=None):
        a = self.get()
        return a.astype(dtype) if dtype is not None else a

    def astype(self, dtype, copy=True) -> np.ndarray:
        """A host copy converted to ``dtype`` (the K-shift path reads cells this way)."""
        return self.get().astype(dtype)

    def _cells(self, key):
        if not (isinstance(key, tuple) and len(key) == 2 and self.ndim == 4):
            raise TypeError("VkTensor supports indexing [stream, cells] on KV storage only")
        stream, cells = key
        cells = np.asarray(cells, dtype=np.int64).reshape(-1)
        n_cells = self.shape[1]
        if cells.size and (cells.min() < 0 or cells.max() >= n_cells):
            raise IndexError("cell index out of range")
        return (int(stream) * n_cells + cells).astype(np.int32)

    def _flat_cells(self) -> "VkTensor":
        return self.reshape((self.shape[0] * self.shape[1],) + self.shape[2:])

    def _word_rows(self) -> bool:
        """Whether a cell row (``shape[2:]``) is a whole number of 32-bit words (the copy shader's unit)."""
        return (math.prod(self.shape[2:]) * self.dtype.itemsize) % 4 == 0

    def __getitem__(self, key):
        if (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and self.ndim == 3
                and isinstance(key[1], (int, np.integer))):
            return self.be.select_mid(self, int(key[1]))  # t[:, i] of [A, B, C]: a device tensor [A, C]
        if isinstance(key, (int, np.integer)):
            return self._row_view(int(key))
        if isinstance(key, tuple) and self.ndim >= 2 and (key[0] is Ellipsis or key[0] == slice(None)) \
                and len(key) == (2 if key[0] is Ellipsis else self.ndim) and isinstance(key[-1], slice) \
                and all(k == slice(None) for k in key[1:-1]):
            return self.be.slice_last(self, key[-1])  # t[..., a:b] / t[:, a:b]: a new device tensor
        rows = self._cells(key)
        if not self._word_rows():  # rows of a quantized tier that end mid-word: through the host
            return self.get()[int(key[0]), rows % self.shape[1]]
        return self.be.gather_rows(self._flat_cells(), rows).get()

    def _row_view(self, i: int) -> "VkTensor":
        """``t[i]``: a view (no copy) of row ``i`` along the first axis."""
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"index {i} out of range for axis 0 of size {self.shape[0]}")
        step = self.nbytes // self.shape[0]
        return VkTensor(self.be, self.alloc, self.shape[1:], self.dtype, self.offset + i * step)

    def __setitem__(self, key, value) -> None:
        if isinstance(key, (int, np.integer)):  # t[i] = tensor / array / scalar (recurrent state slots)
            dst = self._row_view(int(key))
            if isinstance(value, VkTensor):
                if value.nbytes != dst.nbytes:
                    raise ValueError(f"cannot assign {value.shape} to {dst.shape}")
                self.be.rt.copy(value.alloc, value.offset, dst.alloc, dst.offset, dst.nbytes)
            elif np.isscalar(value) and float(value) == 0.0 and dst.nbytes % 4 == 0 and dst.offset % 4 == 0:
                self.be.rt.fill(dst.alloc, dst.offset, dst.nbytes, 0)
            else:
                a = np.ascontiguousarray(np.broadcast_to(np.asarray(value, dtype=self.dtype), dst.shape))
                self.be.rt.upload(dst.alloc, dst.offset, a)
            return
        rows = self._cells(key)
        row_shape = self.shape[2:]
        if isinstance(value, VkTensor):
            value = value.get()
        value = np.broadcast_to(np.asarray(value, dtype=self.dtype), (len(rows),) + row_shape)
        if not self._word_rows():  # rows of a quantized tier that end mid-word: the whole tensor via the host
            host = self.get().copy()
            host[int(key[0]), rows % self.shape[1]] = value
            self.be.rt.upload(self.alloc, self.offset, host)
            return
        self.be.scatter_rows(self._flat_cells(), rows, np.ascontiguousarray(value))


class QTensor:
    """A 2-D GGUF weight on the device in its block format.

    ``parts``: ``[(row0, nrows, Alloc)]``, consecutive row ranges, each small
    enough for one storage-buffer binding (row r of a part at byte
    ``(r - row0) * row_bytes``); ``ggml_type``: ggml type id; ``shape``: NumPy
    shape ``(rows, cols)`` = ``reversed(ne)`` (``[out, in]`` for a matrix).
    F32 / F16 / BF16 rows whose length is not a multiple of 32 are stored
    zero-padded to ``kpad`` columns (the shaders work in 32-element chunks).
    """

    def __init__(self, parts, ggml_type: int, shape: tuple[int, int], row_bytes: int, kpad: int | None = None):
        self.parts = parts
        self.ggml_type = int(ggml_type)
        self.shape = (int(shape[0]), int(shape[1]))
        self.row_bytes = int(row_bytes)
        self.kpad = int(kpad or shape[1])  # columns as stored: float rows padded to a multiple of 32

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def reshape(self, *shape) -> "QTensor":
        """The same weight when ``shape`` is its own (``(1, -1)`` of a one-row matrix); other
        shapes raise ``NotImplementedError`` (blocks do not reshape)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if len(shape) == 2 and shape.count(-1) <= 1:
            n = math.prod(self.shape)
            want = tuple(n // max(1, math.prod(v for v in shape if v != -1)) if v == -1 else v for v in shape)
            if want == self.shape:
                return self
        raise NotImplementedError(f"QTensor {self.shape} cannot be reshaped to {shape}")


class _VkXp:
    """``tile`` / ``repeat`` over the head axis of ``[T, n, d]`` device tensors (what the hybrid
    models' head broadcast needs of an array module)."""

    def __init__(self, be):
        self.be = be

    def tile(self, x, reps):
        if len(reps) != 3 or reps[0] != 1 or reps[2] != 1:
            raise NotImplementedError(f"tile {reps}: only (1, r, 1)")
        return self.be.tile_heads(x, int(reps[1]), False)

    def repeat(self, x, r: int, axis: int):
        if axis != 1:
            raise NotImplementedError("repeat: only axis 1")
        return self.be.tile_heads(x, int(r), True)


class QExperts(ExpertRows):
    """A 3-D GGUF expert tensor ``[n_expert, rows, cols]`` on the device in its block format.

    ``parts``: ``[(e0, n_e, Alloc)]``, consecutive expert ranges, each small enough for one
    storage-buffer binding (expert e of a part at byte ``(e - e0) * expert_bytes``, its row r
    at ``+ r * row_bytes``); ``row0`` / ``shape[1]``: the rows this object covers inside each
    expert, so ``x[:, a:b]`` (the gate or up half of a fused ``gate_up``) is a view sharing
    the parts. The expert GEMV (``mul_mat_vec.comp`` with ``MUL_MAT_ID``) reads it.
    """

    def __init__(self, parts, ggml_type: int, shape, row_bytes: int, expert_bytes: int, row0: int = 0):
        super().__init__(ggml_type, shape, row_bytes, expert_bytes, row0)
        self.parts = parts

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.expert_bytes

    def __getitem__(self, key):
        view = self.row_slice(key)
        if view is not None:
            return view
        raise TypeError(f"QExperts supports [:, row_slice], not {key!r}")


class VulkanBackend:
    """Vulkan implementation of the op interface (DESIGN.md "Backends: one op set").

    Args:
        device: Vulkan device index (``--main-gpu``; ``vk_runtime.list_devices`` order).
    """

    name = "vulkan"

    def __init__(self, device: int = 0):
        self.rt = Runtime(device)
        self.device_info = self.rt.info
        self.device_name = describe(self.rt.info)
        self.is_cpu_device = self.rt.info.is_cpu
        # attention split-K: enough workgroups to fill a GPU, each split >= attn_split_cells
        # cells; a CPU device gains nothing from it
        self.attn_target_groups = 1 if self.is_cpu_device else 512
        self.attn_split_cells = 256
        # GEMV layout (mul_mat_vec.comp): a warp per weight row on GPUs; on CPU drivers
        # 4 rows per invocation (lavapipe runs that ~40x faster). CPU drivers also take
        # every token count through the GEMV (8 tokens per workgroup): ~5x faster
        # there than the tiled GEMM, which GPUs use past 8 tokens.
        self.gemv_lanes = 1 if self.is_cpu_device else 32
        self.gemv_max_tokens = 1 << 30 if self.is_cpu_device else GEMV_MAX_TOKENS
        self._ub = None
        self._ub_dev: dict = {}
        self._meta: dict = {}
        self._rope: dict = {}
        self._kv_tab = None  # the rotated KV tiers' tables (_kv_tables), uploaded on first use
        # graphs (run_graph): mode None (eager), "capture", "replay", "done" (after the logits)
        self.graphs = os.environ.get("OPENCOTI_VK_GRAPHS", "1") != "0"
        self.graph_min_cells = 256  # smallest cell-list bucket of a graph
        self._mode = None
        self._graph = None
        self._gcaps = None
        self._depth = 0

    # -- tensors --------------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32) -> VkTensor:
        """Uninitialised device tensor."""
        n = math.prod(shape) * np.dtype(dtype).itemsize
        return VkTensor(self, self.rt.alloc(max(n, 4)), shape, dtype)

    def zeros(self, shape, dtype) -> VkTensor:
        """Zero-filled device tensor (KV storage)."""
        t = self.empty(shape, dtype)
        self.rt.fill(t.alloc, 0, t.alloc.size, 0)
        return t

    def asarray(self, a, dtype=None) -> VkTensor:
        """Upload a host array (``dtype`` converts first)."""
        a = np.ascontiguousarray(a, dtype=dtype)
        t = self.empty(a.shape, a.dtype)
        self.rt.upload(t.alloc, 0, a)
        return t

    def to_host(self, x) -> np.ndarray:
        """Device tensor -> NumPy (submits the recorded work and waits). Inside
        ``run_graph`` this is where the graph is submitted."""
        if not isinstance(x, VkTensor):
            return np.asarray(x)
        if self._mode in ("capture", "replay"):
            g = self._graph
            if self._mode == "capture":
                g.out = x
                self.rt.end_capture()
            elif x is not g.out:
                raise _NotCapturable("replay reads another tensor than the recorded output")
            self._mode = "done"
            return self.rt.run_graph(g, x.alloc, x.offset, x.nbytes).view(x.dtype).reshape(x.shape)
        return x.get()

    def synchronize(self) -> None:
        """Submit recorded work and wait for it."""
        self.rt.flush()

    def _f32(self, x) -> VkTensor:
        if isinstance(x, VkTensor):
            if x.dtype != np.float32:
                raise ValueError(f"expected a float32 tensor, got {x.dtype}")
            return x
        return self.asarray(x, np.float32)

    def _idx(self, a) -> tuple[VkTensor, int]:
        """(int32 device tensor, element offset) of an index array; the ubatch's arrays
        are uploaded by ``begin_ubatch`` already."""
        if isinstance(a, VkTensor):
            if a.dtype != np.int32:
                raise ValueError("index tensors must be int32")
            return a, 0
        hit = self._ub_dev.get(id(a))
        if hit is not None and hit[0] is a:
            return hit[1], hit[2]
        return self.asarray(np.asarray(a, dtype=np.int32).reshape(-1)), 0

    def _bind(self, t: VkTensor, lo: int = 0, hi: int | None = None) -> tuple[tuple, int]:
        """A binding window over bytes [lo, hi) of ``t`` and the element offset (32-bit
        words) of ``lo`` inside it: the window starts at the aligned byte below ``lo``."""
        hi = t.nbytes if hi is None else hi
        start = t.offset + lo
        base = start - start % self.rt.align
        end = min(t.alloc.size, -(-(t.offset + hi) // 4) * 4)
        return (t.alloc, base, max(4, end - base)), (start - base) // 4

    def _input(self, host: np.ndarray, slot: tuple) -> VkTensor:
        """Upload per-step input ``host``; while a graph is recorded, into a buffer the
        graph keeps (an input *slot* described by ``slot``, rewritten on replay)."""
        if self._mode != "capture":
            return self.asarray(host)
        t = self.empty(host.shape, host.dtype)
        self.rt.upload_prologue(t.alloc, 0, host)
        self._graph.slots.append((slot, t))
        return t

    def _refresh_slots(self, ub) -> None:
        """Write a replayed graph's inputs for ``ub``: its ids / positions / output rows,
        each cache plan's index arrays (cells padded to the graph's bucket), the rope tables."""
        for slot, t in self._graph.slots:
            kind = slot[0]
            if kind == "ub":
                host = np.concatenate([ub.tokens, ub.pos, ub.out_rows]).astype(np.int32)
            elif kind == "meta":
                host = self._meta_host(ub.plans[slot[1]], slot[2], slot[3])[0]
            elif kind == "rs":
                host = self._rs_host(ub.plans[slot[1]])
            else:
                host = self._rope_host(ub.pos, *slot[1:])
            if host.nbytes != t.nbytes:
                raise _NotCapturable("a graph input changed size")
            self.rt.upload_prologue(t.alloc, 0, host)

    def run_graph(self, ub, caches, forward, graphs: dict, on_launch=None):
        """Run ``forward()`` (the network on ``ub``) as a replayed command buffer.

        The key is (rows, output rows, per cache: views and cell-list bucket, and the
        device-path switches); cell lists are padded to a power of two >= 256
        (``graph_min_cells``) and
        attention's split count follows the bucket, so one graph serves every step until
        a sequence outgrows its bucket. The first step of a key records the graph (and
        runs it); later ones rewrite its inputs and resubmit it, with the ops returning
        their recorded results (``_taped``). ``graphs``: the caller's store (a graph
        holds that runner's KV addresses). Ubatches over ``GEMV_MAX_TOKENS`` rows, or
        with no output rows, run eagerly. Returns host logits. ``on_launch()`` (optional) runs
        first (the step's submission happens inside ``forward``).
        """
        if on_launch is not None:
            on_launch()
        T = ub.n_tokens
        if not self.graphs or T > GEMV_MAX_TOKENS or len(ub.out_rows) == 0 or self._mode is not None:
            return forward()
        # KV plans: cell lists padded to a bucket; a recurrent plan (hybrid models): cap 0 (its
        # index arrays have a fixed size for a given row and view count)
        tot = [int(p.view_lens().sum()) if not _is_rs(p) else -1 for p in ub.plans]
        caps = [max(self.graph_min_cells, 1 << max(0, t - 1).bit_length()) if t >= 0 else 0 for t in tot]
        key = (T, len(ub.out_rows), tuple((len(p.views) if _is_rs(p) else p.n_views, c) for p, c in zip(ub.plans, caps)),
               self.gemv_lanes, self.gemv_max_tokens, self.attn_target_groups)
        g = graphs.get(key)
        if g is False:
            return forward()
        self._gcaps = caps
        try:
            if g is None:
                self._graph = self.rt.begin_capture()
                self._mode = "capture"
                ok = False
                try:
                    out = forward()
                    ok = self._mode == "done"  # the logits were read: the graph ran
                except (_NotCapturable, GraphTooLarge):
                    pass
                finally:
                    if self.rt._target is not None:  # not finished: drop it (any error propagates)
                        self.rt.abort_capture()
                if ok:
                    graphs[key] = self._graph
                    live = [k for k, v in graphs.items() if v]
                    for k in live[:max(0, len(live) - MAX_GRAPHS)]:  # oldest first: frees its memory
                        del graphs[k]
                    return out
                graphs[key] = False
            else:
                self._graph, self._mode = g, "replay"
                g.tape_pos = 0
                try:
                    out = forward()
                    if g.tape_pos == len(g.tape) and self._mode == "done":
                        return out
                except _NotCapturable:
                    pass
                graphs[key] = False
                self.rt.flush()  # staged inputs land in the graph's own buffers
        finally:
            self._mode = self._graph = self._gcaps = None
            self._depth = 0
        return forward()  # not capturable: eager

    def begin_ubatch(self, ub) -> None:
        """Upload the ubatch's token ids, positions and output rows (one write) and
        forget the previous ubatch's plan metadata and rope tables. On a graph replay:
        write every input the graph reads (see ``_refresh_slots``)."""
        if self._mode == "replay":
            self._ub = ub
            self._refresh_slots(ub)
            return
        host = np.concatenate([ub.tokens, ub.pos, ub.out_rows]).astype(np.int32)
        dev = self._input(host, ("ub",))
        n = len(ub.tokens)
        self._ub = ub
        self._ub_dev = {id(ub.tokens): (ub.tokens, dev, 0), id(ub.pos): (ub.pos, dev, n),
                        id(ub.out_rows): (ub.out_rows, dev, 2 * n)}
        self._meta = {}
        self._rope = {}

    # -- weights --------------------------------------------------------------------------
    def load_weight(self, gguf: GGUFFile, name: str):
        """A matrix as a ``QTensor`` (raw GGUF blocks on the device); a 3-D expert tensor as a
        ``QExperts``; a vector (norm weights, biases, rope factors) as a float32 ``VkTensor``
        (with a host copy)."""
        info = gguf.tensors[name]
        if len(info.ne) == 1:
            a = gguf.dequantize(name, np.float32)
            t = self.asarray(a)
            t.host = a
            return t
        if len(info.ne) not in (2, 3):
            raise NotImplementedError(f"Vulkan backend: {name} has {len(info.ne)} dims")
        tid = int(info.ggml_type)
        if tid not in QTYPES:
            raise NotImplementedError(f"Vulkan backend: {name} has unsupported type {info.ggml_type.name}")
        rows, cols = int(info.ne[1]), int(info.ne[0])
        if len(info.ne) == 3:
            return self.upload_experts(gguf.raw(name), tid, int(info.ne[2]), rows, cols, name)
        return self.upload_weight(gguf.raw(name), tid, rows, cols, name)

    def upload_experts(self, raw: np.ndarray, ggml_type: int, n_exp: int, rows: int, cols: int,
                       name: str = "experts") -> QExperts:
        """``raw``: uint8 ``[n_exp * rows, row_bytes]`` GGUF blocks of ``ggml_type`` (expert-major)
        -> ``QExperts``, in parts of whole experts. ``NotImplementedError`` when ``cols`` is not
        a multiple of 32 or one expert exceeds a storage-buffer binding."""
        if cols % 32:
            raise NotImplementedError(f"Vulkan backend: {name}: expert rows of {cols} (not a multiple of 32)")
        raw = np.ascontiguousarray(raw).reshape(n_exp, -1)
        expert_bytes = raw.shape[1]
        limit = min(self.rt.max_range, self.rt.max_alloc, 1 << 30) - 4096
        if expert_bytes > limit:
            raise NotImplementedError(f"Vulkan backend: {name}: one expert ({expert_bytes} bytes) exceeds a binding")
        per = max(1, limit // expert_bytes)
        parts = []
        for e0 in range(0, n_exp, per):
            e1 = min(n_exp, e0 + per)
            a = self.rt.alloc((e1 - e0) * expert_bytes + 4)
            self.rt.upload(a, 0, raw[e0:e1])
            parts.append((e0, e1 - e0, a))
        return QExperts(parts, ggml_type, (n_exp, rows, cols), expert_bytes // rows, expert_bytes)

    def upload_weight(self, raw: np.ndarray, ggml_type: int, rows: int, cols: int, name: str = "weight") -> QTensor:
        """``raw``: uint8 ``[rows, row_bytes]`` GGUF blocks of ``ggml_type`` -> ``QTensor``."""
        kpad = cols
        if cols % 32:
            if ggml_type not in (0, 1, 30):  # block types always hold whole 32-element chunks
                raise NotImplementedError(f"Vulkan backend: {name}: {cols} columns is not a multiple of 32")
            kpad = -(-cols // 32) * 32
            item = 4 if ggml_type == 0 else 2
            a = np.zeros((rows, kpad * item), np.uint8)
            a[:, :cols * item] = np.asarray(raw).reshape(rows, cols * item)
            raw = a
        raw = np.ascontiguousarray(raw).reshape(rows, -1)
        row_bytes = raw.shape[1]
        limit = min(self.rt.max_range, self.rt.max_alloc, 1 << 30) - 4096  # one binding, one allocation
        per = max(1, limit // max(row_bytes, 1))
        parts = []
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            a = self.rt.alloc((r1 - r0) * row_bytes + 4)
            self.rt.upload(a, 0, raw[r0:r1])
            parts.append((r0, r1 - r0, a))
        return QTensor(parts, ggml_type, (rows, cols), row_bytes, kpad)

    def _as_q(self, w) -> QTensor:
        if isinstance(w, QTensor):
            return w
        if isinstance(w, np.ndarray):
            w = self.asarray(w, np.float32)
        if isinstance(w, VkTensor) and w.ndim == 2 and w.dtype == np.float32:
            if w.shape[1] % 32 or w.nbytes > self.rt.max_range - 4096 or w.offset:  # re-stored as parts
                return self.upload_weight(w.get().view(np.uint8), 0, w.shape[0], w.shape[1])
            return QTensor([(0, w.shape[0], w.alloc)], 0, w.shape, w.shape[1] * 4)
        raise TypeError(f"mul_mat: unsupported weight {type(w).__name__}")

    # -- matmul / rows --------------------------------------------------------------------
    @_taped
    def mul_mat(self, x, w):
        """``x [n, k] @ w[out, k].T`` -> ``[n, out]`` float32 (ggml_mul_mat with w as src0).

        Per weight part, over windows of activation rows small enough to bind."""
        x = self._f32(x)
        w = self._as_q(w)
        if x.ndim != 2:
            x = x.reshape(-1, x.shape[-1])
        n, k = x.shape
        rows, cols = w.shape
        if k != cols:
            raise ValueError(f"mul_mat: x has {k} columns, weight {cols}")
        y = self.empty((n, rows))
        if n == 0:
            return y
        if w.kpad != cols:  # a padded float weight: x gets the same zero columns
            xp = self.zeros((n, w.kpad), np.float32)
            self._copy_rows(x, xp, cols, n, None, None, cols, w.kpad)
            x, k, cols = xp, w.kpad, w.kpad
        gemv = n <= self.gemv_max_tokens
        shader = ("mul_mat_vec_" if gemv else "mul_mm_") + QTYPE_NAMES[w.ggml_type]
        lim = self.rt.max_range - 2 * self.rt.align
        tc = max(1, min(n, lim // (rows * 4), lim // (k * 4)))
        for r0, nr, a in w.parts:
            wb = (a, 0, min(a.size, -(-(nr * w.row_bytes) // 4) * 4 + 4))
            for t0 in range(0, n, tc):
                t1 = min(n, t0 + tc)
                xb, xo = self._bind(x, t0 * k * 4, t1 * k * 4)
                yb, yo = self._bind(y, t0 * rows * 4, t1 * rows * 4)
                push = _u32(cols, nr, w.row_bytes, t1 - t0, xo, yo, rows, r0)
                if gemv:
                    nt = 1 if n == 1 else GEMV_MAX_TOKENS
                    lanes = self.gemv_lanes
                    rpi = 4 if lanes == 1 else 1
                    gx, gy, _ = self.rt.groups_1d(-(-nr * lanes // (128 * rpi)))
                    self.rt.dispatch(shader, [wb, xb, yb], push, (gx, gy, -(-(t1 - t0) // nt)), writes=(2,),
                                     spec=(lanes, nt, rpi))
                else:
                    self.rt.dispatch(shader, [wb, xb, yb], push, (-(-nr // 64), -(-(t1 - t0) // 64), 1),
                                     writes=(2,))
        return y

    mul_mat_split = CPUBackend.mul_mat_split  # one mul_mat per weight

    @_taped
    def gated_ffn(self, x, gate, up, act: str):
        """``act(x @ gate.T) * (x @ up.T)`` -> ``[n, n_ff]`` float32; act "gelu_tanh" or "silu"."""
        g = self.mul_mat(x, gate)
        u = self.mul_mat(x, up)
        return self._binary(g, u, _OP_GELU_MUL if act == "gelu_tanh" else _OP_SILU_MUL)

    # -- mixture of experts -------------------------------------------------------------
    @_taped
    def moe_ffn(self, x, gate_inp, up_exps, gate_exps, down_exps, n_expert_used: int, norm_w: bool = True,
                act: str = "silu", w_scale: float = 0.0):
        """Routed experts, Qwen layout (``CPUBackend.moe_ffn``): ``x [T, n_embd]`` float32;
        ``gate_inp [n_expert, n_embd]`` (router); ``up_exps`` / ``gate_exps`` ``QExperts
        [n_expert, n_ff_exp, n_embd]``; ``down_exps [n_expert, n_embd, n_ff_exp]``. Softmax over
        ``x @ gate_inp.T``, top ``n_expert_used`` (ties: lower id), weights renormalised when
        ``norm_w``, times ``w_scale`` when non-zero. Returns ``[T, n_embd]`` float32."""
        logits = self.mul_mat(x, gate_inp)
        return self._moe(x, logits, gate_exps, up_exps, down_exps, n_expert_used, act, norm_w, w_scale, None)

    @_taped
    def moe_ffn_gate_up(self, x, logits, gate_up_exps, down_exps, n_expert_used: int, act: str = "gelu_tanh",
                        norm_w: bool = True, down_scale=None):
        """Routed experts, Gemma-4 layout (``CPUBackend.moe_ffn_gate_up``): router ``logits
        [T, n_expert]``; fused ``gate_up_exps [n_expert, 2 n_ff_exp, n_embd]`` (gate rows
        first); ``down_exps [n_expert, n_embd, n_ff_exp]``; ``down_scale [n_expert]`` float32
        or None. Returns ``[T, n_embd]`` float32."""
        f = gate_up_exps.shape[1] // 2
        return self._moe(x, logits, gate_up_exps[:, :f], gate_up_exps[:, f:], down_exps, n_expert_used, act,
                         norm_w, 0.0, down_scale)

    def _moe(self, x, logits, gate: QExperts, up: QExperts, down: QExperts, k: int, act: str, norm_w: bool,
             w_scale: float, down_scale):
        """Route on the device (``moe_route``: ``sel`` int32 / ``w`` float32 ``[T, k]``), run
        every (token, slot) pair's expert through the expert GEMV (gate, up, gated act,
        down: ``[T*k, n_embd]``; no host sync, so graphs can hold it), and sum the pairs
        weighted (``moe_combine``). Every token count takes this path (a prefill runs
        ``T*k`` GEMV rows rather than per-expert GEMMs)."""
        x, logits = self._f32(x), self._f32(logits)
        T, n_embd = x.shape
        n_exp, n_ff, _ = gate.shape
        if not all(isinstance(e, QExperts) for e in (gate, up, down)):
            raise TypeError("moe: expert tensors must be QExperts (load_weight of a 3-D tensor)")
        if (tuple(up.shape) != tuple(gate.shape) or (gate.shape[0], gate.shape[2]) != (n_exp, n_embd)
                or tuple(down.shape) != (n_exp, n_embd, n_ff) or tuple(logits.shape) != (T, n_exp)):
            raise ValueError(f"moe: shapes do not fit: x {x.shape}, logits {logits.shape}, gate {gate.shape}, "
                             f"up {up.shape}, down {down.shape}")
        if not 0 < k <= min(n_exp, 32):
            raise ValueError(f"moe: {k} experts per token of {n_exp} (at most 32)")
        out = self.empty((T, n_embd))
        if T == 0:
            return out
        sel = self.empty((T, k), np.int32)
        w = self.empty((T, k))
        lb, lo = self._bind(logits)
        self.rt.dispatch("moe_route", [lb, self._bind(sel)[0], self._bind(w)[0]],
                         _u32(T, n_exp, k, 1 if norm_w else 0) + struct.pack("<f", w_scale) + _u32(lo),
                         self.rt.groups_1d(-(-T // 64)), writes=(1, 2))
        g = self._gemv_id(gate, sel, x, k)
        u = self._gemv_id(up, sel, x, k)
        h = self._binary(g, u, _OP_GELU_MUL if act == "gelu_tanh" else _OP_SILU_MUL)
        y = self._gemv_id(down, sel, h, 1)
        ds = self._f32(down_scale) if down_scale is not None else w
        self.rt.dispatch("moe_combine", [self._bind(y)[0], self._bind(w)[0], self._bind(sel)[0], self._bind(ds)[0],
                                         self._bind(out)[0]], _u32(T, k, n_embd, 1 if down_scale is not None else 0),
                         self.rt.groups_1d(-(-T * n_embd // 256)), writes=(4,))
        return out

    def _gemv_id(self, w: QExperts, ids: VkTensor, x: VkTensor, x_div: int) -> VkTensor:
        """Pair p of ``ids`` (int32, ``P`` entries): ``w[ids[p]] @ x[p // x_div]`` -> ``[P, rows]``
        float32 (``mul_mat_vec_id_<type>``), per expert part, in windows of <= 65535 pairs."""
        P = ids.size
        n_exp, rows, cols = w.shape
        y = self.empty((P, rows))
        xb, xo = self._bind(x)
        ib, io = self._bind(ids)
        if xo or io:
            raise ValueError("moe: unaligned tensor")
        lanes = self.gemv_lanes
        rpi = 4 if lanes == 1 else 1
        gx, gy, _ = self.rt.groups_1d(-(-rows * lanes // (128 * rpi)))
        shader = "mul_mat_vec_id_" + QTYPE_NAMES[w.ggml_type]
        for e0, n_e, a in w.parts:
            wb = (a, 0, min(a.size, -(-(n_e * w.expert_bytes) // 4) * 4 + 4))
            step = 65535 - 65535 % x_div  # windows start at a token's first pair
            for p0 in range(0, P, step):
                p1 = min(P, p0 + step)
                yb, yo = self._bind(y, p0 * rows * 4, p1 * rows * 4)
                push = _u32(cols, rows, w.row_bytes, p1 - p0, xo + p0 // x_div * cols, yo, rows, 0,
                            w.expert_bytes, w.row0 * w.row_bytes, p0, x_div, e0, n_e)
                self.rt.dispatch(shader, [wb, xb, yb, ib], push, (gx, gy, p1 - p0), writes=(2,),
                                 spec=(lanes, 1, rpi))
        return y

    @_taped
    def get_rows(self, table, ids):
        """Rows ``ids`` of ``table`` (a ``QTensor``, dequantized on the fly, or a float32
        ``VkTensor``) -> ``[n, cols]`` float32."""
        if isinstance(table, VkTensor) and table.ndim == 2:
            return self.gather_rows(self._f32(table), ids)
        w = self._as_q(table)
        if not isinstance(ids, VkTensor):
            ids_h = np.asarray(ids).reshape(-1)
            if ids_h.size and (ids_h.min() < 0 or ids_h.max() >= w.shape[0]):
                raise IndexError(f"get_rows: id out of range [0, {w.shape[0]})")
        idx, io = self._idx(ids)
        n = len(ids)
        rows, cols_out = w.shape
        cols = w.kpad
        y = self.empty((n, cols))
        if n == 0:
            return self.empty((n, cols_out))
        ib, io2 = self._bind(idx)
        shader = "get_rows_" + QTYPE_NAMES[w.ggml_type]
        for r0, nr, a in w.parts:
            wb = (a, 0, min(a.size, -(-(nr * w.row_bytes) // 4) * 4 + 4))
            push = _u32(cols, w.row_bytes, n, r0, nr, io + io2, 0)
            self.rt.dispatch(shader, [wb, ib, self._bind(y)[0]], push, self.rt.groups_1d(n), writes=(2,))
        if cols != cols_out:  # drop a padded float table's zero columns
            out = self.empty((n, cols_out))
            self._copy_rows(y, out, cols_out, n, None, None, cols, cols_out)
            return out
        return y

    def gather_rows(self, src: VkTensor, rows) -> VkTensor:
        """``src`` viewed as ``[R, row]`` -> rows ``rows`` (a new tensor ``[n] + src.shape[1:]``)."""
        idx, io = self._idx(rows)
        n = len(rows)
        out = self.empty((n,) + src.shape[1:], src.dtype)
        row_words = src.nbytes // max(src.shape[0], 1) // 4
        if n and row_words:
            self._copy_rows(src, out, row_words, n, (idx, io), None)
        return out

    @_taped
    def select_mid(self, x: VkTensor, i: int) -> VkTensor:
        """``x[:, i]`` of ``x [A, B, C]`` -> a new ``[A, C]`` tensor (rows ``a * B + i`` of ``x``
        viewed as ``[A * B, C]``)."""
        A, B, C = x.shape
        if not 0 <= i < B:
            raise IndexError(f"index {i} out of range for axis 1 of size {B}")
        rows = self.asarray(np.arange(A, dtype=np.int32) * B + i)
        return self.gather_rows(x.reshape(A * B, C), rows)

    def scatter_rows(self, dst: VkTensor, rows, values: np.ndarray) -> None:
        """Write host ``values`` ``[n, ...]`` into rows ``rows`` of ``dst`` viewed as ``[R, row]``."""
        n = len(rows)
        if n == 0:
            return
        src = self.asarray(values, dst.dtype)
        idx, io = self._idx(rows)
        row_words = dst.nbytes // dst.shape[0] // 4
        self._copy_rows(src, dst, row_words, n, None, (idx, io))

    def _copy_rows(self, src, dst, row_words, n, src_idx, dst_idx, src_stride=None, dst_stride=None) -> None:
        """copy_rows.comp: ``n`` rows of ``row_words`` words, gathered through ``src_idx``
        and / or scattered through ``dst_idx`` ((int32 tensor, offset) or None: row i)."""
        if src_idx and dst_idx and src_idx[0] is not dst_idx[0]:
            raise ValueError("gather and scatter indices must share one buffer")
        sb, so = self._bind(src)
        db, do = self._bind(dst)
        ref = src_idx or dst_idx
        ib, ibo = self._bind(ref[0]) if ref else (sb, 0)  # no index list: any buffer fills the binding
        push = _u32(row_words, n, 1 if src_idx else 0, src_idx[1] + ibo if src_idx else 0,
                    1 if dst_idx else 0, dst_idx[1] + ibo if dst_idx else 0, so, do,
                    src_stride or row_words, dst_stride or row_words)
        self.rt.dispatch("copy_rows", [sb, db, ib], push, self.rt.groups_1d(-(-(n * row_words) // 256)),
                         writes=(1,))

    # -- elementwise / norms --------------------------------------------------------------
    @_taped
    def rms_norm(self, x, w, eps: float):
        """RMSNorm over the last axis, times ``w`` if given (same shape as ``x``)."""
        return self._norm(x, w, eps, 0)

    @_taped
    def l2_norm(self, x, eps: float):
        """``x / max(||x||_2, eps)`` over the last axis (ggml_l2_norm)."""
        return self._norm(x, None, eps, 1)

    def _norm(self, x, w, eps: float, l2: int):
        x = self._f32(x)
        n = x.shape[-1]
        rows = x.size // n
        y = self.empty(x.shape)
        wt = self._f32(w) if w is not None else x
        xb, xo = self._bind(x)
        yb, yo = self._bind(y)
        if xo or yo:
            raise ValueError("rms_norm: unaligned tensor")
        push = _u32(n, rows, 1 if w is not None else 0) + struct.pack("<f", eps) + _u32(l2)
        self.rt.dispatch("rms_norm", [xb, self._bind(wt)[0], yb], push, self.rt.groups_1d(rows), writes=(2,))
        return y

    @_taped
    def add_rms_norm(self, x, h, w_post, w_next, eps: float):
        """``x + rms_norm(h, w_post)`` and ``rms_norm(that, w_next)`` (see
        ``CPUBackend.add_rms_norm``) from the norm and add shaders. Returns ``(x_out, h_out or None)``."""
        x = self.add(x, self.rms_norm(h, w_post, eps) if w_post is not None else h)
        return x, (self.rms_norm(x, w_next, eps) if w_next is not None else None)

    def _unary(self, x, op: int, s: float = 0.0):
        x = self._f32(x)
        y = self.empty(x.shape)
        xb, xo = self._bind(x)
        if xo:
            raise ValueError("unaligned tensor")
        n = x.size
        self.rt.dispatch("unary", [xb, self._bind(y)[0]], _u32(n, op) + struct.pack("<f", s),
                         self.rt.groups_1d(-(-n // 256)), writes=(1,))
        return y

    def _binary(self, a, b, op: int):
        a, b = self._f32(a), self._f32(b)
        n, m = a.size, b.size
        div = 1
        if b.ndim >= 2 and b.shape[-1] == 1 and a.ndim == b.ndim and a.shape[:-1] == b.shape[:-1] and a.shape[-1] > 1:
            div = a.shape[-1]  # b [..., 1]: one value per row of a
        if m == 0 or n % m:
            raise ValueError(f"cannot broadcast {b.shape} over {a.shape}")
        y = self.empty(a.shape)
        ab, ao = self._bind(a)
        bb, bo = self._bind(b)
        if ao or bo:
            raise ValueError("unaligned tensor")
        self.rt.dispatch("binary", [ab, bb, self._bind(y)[0]], _u32(n, m, op, div),
                         self.rt.groups_1d(-(-n // 256)), writes=(2,))
        return y

    @_taped
    def add(self, a, b):
        """``a + b`` (``b`` same size, or a vector broadcast over ``a``'s rows)."""
        if np.isscalar(b):
            raise TypeError("add: scalar operands are not supported")
        return self._binary(a, b, _OP_ADD)

    @_taped
    def mul(self, a, b):
        """``a * b`` elementwise (``b`` same size or broadcast over rows)."""
        return self._binary(a, b, _OP_MUL)

    @_taped
    def scale(self, x, s: float):
        """``x * s``."""
        return self._unary(x, _U_SCALE, s)

    @_taped
    def gelu_tanh(self, x):
        """GELU, tanh approximation (ggml_gelu)."""
        return self._unary(x, _U_GELU)

    @_taped
    def silu(self, x):
        """x * sigmoid(x)."""
        return self._unary(x, _U_SILU)

    @_taped
    def sigmoid(self, x):
        """Logistic function (ggml_sigmoid), overflow-free."""
        return self._unary(x, _U_SIGMOID)

    @_taped
    def softplus(self, x):
        """``ln(1 + e^x)`` (ggml_softplus), overflow-free."""
        return self._unary(x, _U_SOFTPLUS)

    @_taped
    def slice_last(self, x: VkTensor, sl: slice) -> VkTensor:
        """``x[..., a:b]`` (step 1) as a new contiguous tensor (the column split of the hybrid
        models' fused projections)."""
        n = x.shape[-1]
        a, b, step = sl.indices(n)
        if step != 1:
            raise NotImplementedError("VkTensor slices need step 1")
        b = max(a, b)
        rows = x.size // max(n, 1)
        out = self.empty(x.shape[:-1] + (b - a,), x.dtype)
        if rows and b > a:
            src = VkTensor(self, x.alloc, (x.size - a,), x.dtype, x.offset + a * x.dtype.itemsize)
            self._copy_rows(src, out, b - a, rows, None, None, n, b - a)
        return out

    @_taped
    def tile_heads(self, x: VkTensor, r: int, grouped: bool) -> VkTensor:
        """``x [T, n, d]`` -> ``[T, n * r, d]``: head j is head ``j % n`` (NumPy ``tile(x, (1, r,
        1))``) or, ``grouped``, head ``j // r`` (``repeat(x, r, axis=1)``)."""
        T, n, d = x.shape
        j = np.arange(n * r)
        src = (np.arange(T)[:, None] * n + (j // r if grouped else j % n)[None, :]).astype(np.int32).reshape(-1)
        return self.gather_rows(x.reshape(T * n, d), self.asarray(src)).reshape(T, n * r, d)

    @property
    def xp(self):
        """The two array functions the architectures call on activations (``tile``,
        ``repeat`` along the head axis), for device tensors."""
        return _VkXp(self)

    # -- rope -----------------------------------------------------------------------------
    @staticmethod
    def _rope_host(pos, n_rot: int, base: float, freq_scale: float, freq_factors, yarn=None) -> np.ndarray:
        """(cos, sin) table ``[T, n_rot/2, 2]`` float32 for positions ``pos``, computed as
        ``CPUBackend.rope`` does (float64 angles; YaRN's angle mix and magnitude scale
        included, ggml ``rope_yarn``)."""
        p = pos.get() if isinstance(pos, VkTensor) else np.asarray(pos)
        ff = freq_factors
        if ff is not None:
            ff = ff.host if isinstance(ff, VkTensor) and ff.host is not None else np.asarray(ff)
        return np.stack(rope_cos_sin(p, n_rot, base, freq_scale, ff, yarn), axis=-1)

    def _rope_table(self, pos, n_rot: int, base: float, freq_scale: float, freq_factors, yarn=None):
        """Device (cos, sin) table of ``_rope_host``, uploaded once per ubatch and rope setting."""
        key = (id(pos), n_rot, float(base), float(freq_scale), id(freq_factors), id(yarn))
        hit = self._rope.get(key)
        if hit is not None and hit[0] is pos and hit[1] is freq_factors and hit[2] is yarn:
            return hit[3]
        if self._mode == "capture" and (self._ub is None or pos is not self._ub.pos):
            raise _NotCapturable("rope at positions other than the ubatch's")
        args = (n_rot, float(base), float(freq_scale), freq_factors, yarn)
        t = self._input(self._rope_host(pos, *args), ("rope",) + args)
        self._rope[key] = (pos, freq_factors, yarn, t)
        return t

    @_taped
    def rope(self, x, pos, n_rot: int, base: float, freq_scale: float = 1.0, mode: str = "norm",
             freq_factors=None, norm=None, eps: float = 0.0, yarn=None):
        """RoPE on ``x [T, H, D]`` as ``CPUBackend.rope`` (freq factors, YaRN; ``norm``:
        per-head RMSNorm first, the q/k norms); returns a new tensor."""
        if norm is not None:
            x = self.rms_norm(x, norm, eps)
        x = self._f32(x)
        T, H, D = x.shape
        if n_rot % 2 or n_rot > D or D % 2:
            raise NotImplementedError(f"rope: n_rot {n_rot} with head size {D}")
        y = self.empty(x.shape)
        cs = self._rope_table(pos, n_rot, base, freq_scale, freq_factors, yarn)
        xb, xo = self._bind(x)
        if xo:
            raise ValueError("rope: unaligned tensor")
        push = _u32(T, H, D, n_rot, 2 if mode == "neox" else 0)
        self.rt.dispatch("rope", [xb, self._bind(cs)[0], self._bind(y)[0]], push,
                         self.rt.groups_1d(-(-(T * H * (D // 2)) // 256)), writes=(2,))
        return y

    # -- recurrent layers (gated delta-net) --------------------------------------------------
    @staticmethod
    def _rs_host(plan) -> np.ndarray:
        """A recurrent-state plan (``recurrent_state.RSPlan``) as int32: ``view_off [n_views +
        1]``, the views' rows concatenated, ``slots [n_views]``."""
        off = np.zeros(len(plan.views) + 1, dtype=np.int64)
        off[1:] = np.cumsum([len(v.rows) for v in plan.views])
        rows = (np.concatenate([np.asarray(v.rows, dtype=np.int64) for v in plan.views]) if plan.views
                else np.zeros(0, np.int64))
        slots = np.asarray([v.slot for v in plan.views], dtype=np.int64)
        return np.concatenate([off, rows, slots, np.zeros(1, np.int64)]).astype(np.int32)

    def _rs_meta(self, plan):
        """Device copy of ``_rs_host(plan)`` (once per ubatch; a graph input while recording)
        and the offsets of its three parts: ``(tensor, vo_off, rw_off, sl_off)`` in elements."""
        hit = self._meta.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        host = self._rs_host(plan)
        if self._mode == "capture":
            idx = next((i for i, q in enumerate(self._ub.plans) if q is plan), None) if self._ub else None
            if idx is None:
                raise _NotCapturable("a recurrent plan outside the ubatch")
            buf = self._input(host, ("rs", idx))
        else:
            buf = self.asarray(host)
        nv = len(plan.views)
        nr = int(sum(len(v.rows) for v in plan.views))
        m = (buf, 0, nv + 1, nv + 1 + nr)
        self._meta[id(plan)] = (plan, m)
        return m

    def _state(self, a, what: str) -> VkTensor:
        if not isinstance(a, VkTensor) or a.dtype != np.float32:
            raise ValueError(f"{what}: the recurrent state must be a float32 device tensor")
        return a

    @_taped
    def ssm_conv(self, x, conv_states, w, plan):
        """Short causal depthwise convolution with a per-sequence carry (``CPUBackend.ssm_conv``).

        x: ``[T, C]`` float32; conv_states: the layer's store float32 ``[n_seq_max, K-1, C]``,
        updated in place; w: ``[C, K]`` (a float ``VkTensor``, or the F32 ``QTensor`` that
        ``load_weight`` makes of it, rows zero-padded; K <= ``SSM_MAX_CONV``); plan:
        ``recurrent_state.RSPlan``. One invocation per (sequence, channel) walks that
        sequence's rows in order. Returns y ``[T, C]`` float32 (no activation)."""
        x = self._f32(x)
        self._state(conv_states, "ssm_conv")
        T, C = x.shape
        if isinstance(w, QTensor):
            if w.ggml_type != 0 or len(w.parts) != 1:
                raise NotImplementedError("ssm_conv: the conv weight must be F32")
            K, stride = w.shape[1], w.kpad
            wt = VkTensor(self, w.parts[0][2], (w.shape[0], w.kpad), np.float32)
        else:
            wt = self._f32(w)
            K, stride = wt.shape[1], wt.shape[1]
        if w.shape[0] != C or not 1 <= K <= SSM_MAX_CONV or tuple(conv_states.shape[1:]) != (K - 1, C):
            raise ValueError(f"ssm_conv: x {x.shape}, w {w.shape}, state {conv_states.shape} do not fit "
                             f"(at most {SSM_MAX_CONV} taps)")
        y = self.empty((T, C))
        if T == 0 or not plan.views:
            return y
        mt, vo, rw, sl = self._rs_meta(plan)
        mb, mo = self._bind(mt)
        xb, xo = self._bind(x)
        sb, so = self._bind(conv_states)
        wb, wo = self._bind(wt)
        yb, yo = self._bind(y)
        if yo:
            raise ValueError("ssm_conv: unaligned output")
        self.rt.dispatch("ssm_conv", [xb, sb, wb, mb, yb],
                         _u32(C, K, stride, vo + mo, rw + mo, sl + mo, xo, wo, so),
                         (len(plan.views), -(-C // 128), 1), writes=(1, 4))
        return y

    @_taped
    def gated_delta_net(self, q, k, v, g, beta, ssm_states, plan, scale: float):
        """Gated delta rule over each sequence of the ubatch (``CPUBackend.gated_delta_net``).

        q, k: ``[T, H, d_k]`` float32 (L2-normalised; d_k <= ``GDN_MAX_DK``); v: ``[T, H, d_v]``;
        g (log decay), beta: ``[T, H]``; ssm_states: the layer's store float32 ``[n_seq_max,
        H, d_k, d_v]``, updated in place; plan: ``RSPlan``. Sequential over each sequence's
        tokens (workgroups: sequence x head x 64 value columns, a state column per
        invocation in registers): the CPU's chunked form gives the same result up to
        rounding. Returns ``[T, H, d_v]`` float32."""
        q, k, v, g, beta = (self._f32(a) for a in (q, k, v, g, beta))
        self._state(ssm_states, "gated_delta_net")
        T, H, dk = q.shape
        dv = v.shape[-1]
        if (tuple(k.shape) != tuple(q.shape) or tuple(v.shape[:2]) != (T, H) or g.size != T * H
                or beta.size != T * H or tuple(ssm_states.shape[1:]) != (H, dk, dv)):
            raise ValueError(f"gated_delta_net: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
                             f"beta {beta.shape}, state {ssm_states.shape} do not fit")
        if dk > GDN_MAX_DK:
            raise NotImplementedError(f"gated_delta_net: key head dim {dk} > {GDN_MAX_DK}")
        out = self.empty((T, H, dv))
        if T == 0 or not plan.views:
            return out
        mt, vo, rw, sl = self._rs_meta(plan)
        mb, mo = self._bind(mt)
        bq, bk, bv, bg, bb, bs = (self._bind(a) for a in (q, k, v, g, beta, ssm_states))
        ob, oo = self._bind(out)
        if oo:
            raise ValueError("gated_delta_net: unaligned output")
        push = _u32(H, dk, dv, vo + mo, rw + mo, sl + mo, bq[1], bk[1], bv[1], bg[1], bb[1], bs[1]) \
            + struct.pack("<f", scale)
        self.rt.dispatch("gated_delta_net", [bq[0], bk[0], bv[0], bg[0], bb[0], bs[0], mb, ob], push,
                         (len(plan.views), H, -(-dv // 64)), writes=(5, 7))
        return out

    # -- KV cache + attention ---------------------------------------------------------------
    @staticmethod
    def _meta_host(plan, n_cells: int, cap: int | None = None):
        """A cache plan's index arrays as one int32 array: write cells (flat
        ``stream * n_cells + cell``), row -> view, view offsets, the views' flat cell
        lists and their positions; cell lists padded to ``cap`` entries when given.
        Returns (array, offsets of the five parts, longest view)."""
        lens = plan.view_lens()
        if cap is not None and lens.sum() > cap:
            raise _NotCapturable("cell lists outgrew the graph's bucket")
        parts = plan.flat(n_cells, cap)
        o = np.cumsum([0] + [len(p) for p in parts]).tolist()
        host = np.concatenate(parts + [np.zeros(1, np.int64)]).astype(np.int32)
        return host, o, int(lens.max(initial=0))

    def _plan_meta(self, plan, n_cells: int):
        """Device index arrays of a cache plan (``_meta_host``), uploaded once per ubatch.
        While a graph is recorded: padded to the graph's cell bucket, whose size also
        stands in for the longest view (attention's split count)."""
        hit = self._meta.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        if self._mode == "capture":
            idx = next((i for i, p in enumerate(self._ub.plans) if p is plan), None) if self._ub else None
            if idx is None:
                raise _NotCapturable("a cache plan outside the ubatch")
            cap = self._gcaps[idx]
            host, o, _ = self._meta_host(plan, n_cells, cap)
            buf, max_len = self._input(host, ("meta", idx, n_cells, cap)), cap
        else:
            host, o, max_len = self._meta_host(plan, n_cells)
            buf = self.asarray(host)
        m = {"buf": buf, "write": o[0], "row_view": o[1], "view_off": o[2], "cells": o[3], "cell_pos": o[4],
             "max_len": max_len}
        self._meta[id(plan)] = (plan, m)  # the plan stays referenced, so its id is not reused meanwhile
        return m

    kv_types = tuple(KV_TIER_CODES)  # the runner refuses other -ctk / -ctv values at boot

    def _kv_tables(self) -> VkTensor:
        """The rotated tiers' tables on the device (uploaded once; layout in kv_quant.glsl):
        float32 [512 signs, then per code 10..15: 256 levels, 256 midpoints]."""
        t = self._kv_tab
        if t is None:
            from opencoti.engine.kv_tiers import get_tier
            from opencoti.engine.kv_tiers.turbo import SIGNS

            host = np.zeros(512 * (1 + len(KV_TIER_CODES) - _KV_ROTATED), np.float32)
            host[:512] = SIGNS[:512]
            for name, code in KV_TIER_CODES.items():
                if code >= _KV_ROTATED:
                    tier = get_tier(name)
                    o = 512 * (code - _KV_ROTATED + 1)
                    host[o:o + len(tier.levels)] = tier.levels
                    thr = getattr(tier, "thresholds", None)  # turbo: float32 (c[i] + c[i+1]) / 2
                    if thr is not None:
                        host[o + 256:o + 256 + len(thr)] = thr
            t = self._kv_tab = self.empty(host.shape, np.float32)
            self.rt.upload_prologue(t.alloc, 0, host)  # in the main command buffer even while a graph records
        return t

    def _kv_tier(self, store: VkTensor, tier) -> str:
        """The KV tier name of ``store`` (``tier``: a ``KVTier``; None = a float array, f16 or f32)."""
        if tier is None:
            kind = _KV_DTYPES.get(store.dtype)
            if kind is None:
                raise ValueError(f"KV storage of dtype {store.dtype} needs its tier (type_k / type_v)")
        else:
            kind = tier.name
            if kind not in KV_TIER_CODES:
                raise ValueError(f"the Vulkan backend supports KV cache types {', '.join(self.kv_types)}, "
                                 f"not {kind}")
        if store.nbytes > self.rt.max_range:
            raise NotImplementedError(f"a layer's KV ({store.nbytes / 2**20:.0f} MiB) exceeds the device's "
                                      f"storage-buffer range ({self.rt.max_range / 2**20:.0f} MiB): lower -c")
        return kind

    # cpu.rope_kv_write's composition of the taped ``rope`` and ``kv_write`` (graphs record those)
    rope_kv_write = rope_kv_write

    @_taped
    def kv_write(self, cache, il: int, plan, k, v) -> None:
        """Store K ``[T, n_head_kv, d_k]`` / V of a layer into the plan's cells, in the cache's
        tiers (``cache.tier_k`` / ``tier_v``): f16 (rounded to nearest even, as NumPy) or f32
        K and V of one type in one dispatch (``kv_write.comp``); any other tier, or a mix, one
        dispatch per half (``kv_store.comp``; the rotated tiers ``kv_rot.comp``, a workgroup
        per (token, head) row), quantizing to the bytes of the tier's reference ``quantize``
        (``kv_tiers/scalar.py``, ``turbo.py``, ``tcq.py``)."""
        K, V = cache.k[il], cache.v[il]
        tk = self._kv_tier(K, getattr(cache, "tier_k", None))
        tv = self._kv_tier(V, getattr(cache, "tier_v", None))
        k, v = self._f32(k), self._f32(v)
        T = k.shape[0]
        if T == 0:
            return
        kw, vw = k.size // T, v.size // T
        meta = self._plan_meta(plan, K.shape[1])
        mb, mo = self._bind(meta["buf"])
        if tk == tv and tk in KV_NAMES:
            kind = tk
            if kind == "f16" and (kw % 2 or vw % 2):
                raise NotImplementedError("f16 KV needs an even row size")
            words = max(kw, vw) // (2 if kind == "f16" else 1)
            self.rt.dispatch(f"kv_write_{kind}", [self._bind(k)[0], self._bind(v)[0], self._bind(K)[0],
                                                  self._bind(V)[0], mb],
                             _u32(T, kw, vw, meta["write"] + mo), self.rt.groups_1d(-(-(T * words) // 256)),
                             writes=(2, 3))
            return
        for x, store, name, n in ((k, K, tk, kw), (v, V, tv, vw)):
            code = KV_TIER_CODES[name]
            if code >= _KV_ROTATED:
                n_kv, d = store.shape[2], n // store.shape[2]
                if d < 64 or d > 512 or d & (d - 1) or n != n_kv * d:
                    raise NotImplementedError(f"KV type {name}: head size {d} is not a power of two in [64, 512]")
                cell_bytes = store.nbytes // (store.shape[0] * store.shape[1])
                xb, xo = self._bind(x)
                sb, so = self._bind(store)
                if so:
                    raise ValueError("kv_write: unaligned KV storage")
                self.rt.dispatch("kv_rot", [xb, sb, mb, self._bind(self._kv_tables())[0]],
                                 _u32(T, n_kv, d, code, meta["write"] + mo, xo, cell_bytes)
                                 + struct.pack("<f", np.float32(1.0 / np.sqrt(d))),
                                 self.rt.groups_1d(T * n_kv), writes=(1,))
                continue
            unit = 1 if code == 0 else (2 if code <= 2 else 32)
            if n % unit:
                raise NotImplementedError(f"KV type {name}: {n} values per cell is not a multiple of {unit}")
            cell_bytes = store.nbytes // (store.shape[0] * store.shape[1])
            xb, xo = self._bind(x)
            sb, so = self._bind(store)
            if so:
                raise ValueError("kv_write: unaligned KV storage")
            self.rt.dispatch("kv_store", [xb, sb, mb], _u32(T, n, code, meta["write"] + mo, xo, cell_bytes),
                             self.rt.groups_1d(-(-(T * n // unit) // 128)), writes=(1,))

    @_taped
    def attention_cells(self, q, q_pos, k_store, v_store, plan, scale: float, n_swa: int = 0,
                        softcap: float = 0.0, type_k=None, type_v=None):
        """Attention of the ubatch's queries ``q [T, n_head, d]`` over each row's sequence
        cells in the plan (``plan.views``), reading ``k_store`` / ``v_store``
        ``[n_stream, n_cells, n_head_kv, row]`` in the tiers ``type_k`` / ``type_v``
        (``KVTier``; None = a float array, f16 or f32), dequantized in registers.
        Masks as ``CPUBackend.attention``. Returns ``[T, n_head * d]`` float32."""
        q = self._f32(q)
        T, H, D = q.shape
        tk, tv = self._kv_tier(k_store, type_k), self._kv_tier(v_store, type_v)
        kind = tk if tk == tv and tk in KV_NAMES else "any"
        n_kv = k_store.shape[2]
        dk = type_k.dim_of(k_store.shape[3]) if type_k is not None else k_store.shape[3]
        dv = type_v.dim_of(v_store.shape[3]) if type_v is not None else v_store.shape[3]
        if dv != D or dk != D:
            raise NotImplementedError("Vulkan attention needs d_k == d_v == the query head size")
        if D % 2 or D > ATTN_MAX_HEAD_DIM or H % n_kv:
            raise NotImplementedError(f"Vulkan attention: head_dim {D} (even, <= {ATTN_MAX_HEAD_DIM}), "
                                      f"{H} heads over {n_kv} KV heads")
        G = H // n_kv
        n_gsub = -(-G // 8)
        out = self.empty((T, H * D))
        if T == 0:
            return out
        meta = self._plan_meta(plan, k_store.shape[1])
        mb, mo = self._bind(meta["buf"])
        pos_t, po = self._idx(q_pos)
        pb, po2 = self._bind(pos_t)
        base = T * n_kv * n_gsub
        n_split = 1
        if base < self.attn_target_groups:
            n_split = int(max(1, min(meta["max_len"] // self.attn_split_cells, -(-self.attn_target_groups // base),
                                     64)))
        kb, vb = self._bind(k_store)[0], self._bind(v_store)[0]
        extra = b"" if kind != "any" else (_u32(KV_TIER_CODES[tk], KV_TIER_CODES[tv],
                                                     k_store.shape[3] * k_store.dtype.itemsize,
                                                     v_store.shape[3] * v_store.dtype.itemsize)
                                                + struct.pack("<f", np.float32(1.0 / np.sqrt(D))))
        rot = KV_TIER_CODES[tk] >= _KV_ROTATED or KV_TIER_CODES[tv] >= _KV_ROTATED
        if rot and (D < 64 or D & (D - 1)):
            raise NotImplementedError(f"rotated KV tiers need a power-of-two head size >= 64, not {D}")
        binds = [self._bind(q)[0], kb, vb, mb, pb]
        tab = [self._bind(self._kv_tables())[0]] if kind == "any" else []
        pc = lambda ml_off: (_u32(H, n_kv, D, G, n_split, n_gsub) + struct.pack("<fif", scale, int(n_swa), softcap)  # noqa: E731
                             + _u32(meta["row_view"] + mo, meta["view_off"] + mo, meta["cells"] + mo,
                                    meta["cell_pos"] + mo, po + po2, ml_off) + extra)
        groups = (T, n_kv, n_split * n_gsub)
        if n_split == 1:
            self.rt.dispatch(f"attn_{kind}", binds + [self._bind(out)[0]] + tab, pc(0), groups, writes=(5,))
            return out
        n_acc = T * H * n_split * D
        part = self.empty((n_acc + T * H * n_split * 2,))
        self.rt.dispatch(f"attn_{kind}", binds + [self._bind(part)[0]] + tab, pc(n_acc), groups, writes=(5,))
        self.rt.dispatch("attn_merge", [self._bind(part)[0], self._bind(out)[0]], _u32(H, D, n_split, n_acc),
                         (T, H, 1), writes=(1,))
        return out
