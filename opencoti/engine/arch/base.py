"""The decoder-only transformer recipe shared by every architecture.

norm -> q/k/v -> (q/k norm) -> rope -> attention over the KV cells -> output
-> (post-norm) -> residual -> norm -> gated FFN -> (post-norm) -> residual,
then the output norm and the vocabulary projection for the rows that need
logits. Architecture modules set class attributes and override the few hooks
where they differ (llama.cpp ``src/models/<arch>.cpp`` over shared
``build_attn`` / ``build_ffn``).

Tensor names are llama.cpp's GGUF names (``gguf-py/gguf/constants.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from opencoti.engine.backend.offload import LayerSplit, transfer
from opencoti.engine.batch import UBatch
from opencoti.engine.kv_cache import KVCacheSet
from opencoti.model.gguf_file import GGUFError, GGUFFile
from opencoti.model.hparams import HParams, load_hparams


@dataclass
class LayerWeights:
    """One block's tensors in the backend's representation (None = absent)."""

    attn_norm: object
    wq: object
    wk: object
    wv: object
    wo: object
    ffn_norm: object
    ffn_gate: object
    ffn_up: object
    ffn_down: object
    bq: Optional[object] = None
    bk: Optional[object] = None
    bv: Optional[object] = None
    bo: Optional[object] = None
    q_norm: Optional[object] = None
    k_norm: Optional[object] = None
    post_attention_norm: Optional[object] = None
    post_ffw_norm: Optional[object] = None


def require_backend_ops(backend, arch: str, feature: str, ops: tuple[str, ...]) -> None:
    """Fail at load, naming the feature, when ``backend`` lacks an op it needs
    (issue 7b: e.g. the gated delta-net ops or YaRN on a backend without them)."""
    missing = [o for o in ops if not callable(getattr(backend, o, None))]
    if missing:
        raise GGUFError(f"{arch}: {feature} is not supported on the {getattr(backend, 'name', '?')} backend "
                        f"(missing op(s): {', '.join(missing)}); run it on the CPU backend (--gpu disable)")


def require_rope_yarn(backend, hp: HParams) -> None:
    """Fail at load when the model uses YaRN and the backend's ``rope`` has no ``yarn`` argument."""
    if hp.rope_yarn is not None and "yarn" not in inspect.signature(backend.rope).parameters:
        raise GGUFError(f"{hp.arch}: YaRN RoPE scaling is not supported on the {getattr(backend, 'name', '?')} "
                        "backend; run it on the CPU backend (--gpu disable)")


class DecoderModel:
    """A decoder-only transformer over a backend's op set.

    Subclasses set:
        arch_names: GGUF ``general.architecture`` values handled.
        rope_type: "norm" or "neox" (llama.cpp ``llama_model_rope_type``).
        ffn_act: "silu" or "gelu_tanh" (gated FFN activation).
        scale_embeddings: multiply embeddings by sqrt(n_embd) (Gemma).
    and may override ``adjust_hparams``.

    ``backend`` is one backend or a ``LayerSplit`` (partial offload, ``-ngl``): see ``place``.
    """

    arch_names: tuple[str, ...] = ()
    rope_type = "norm"
    ffn_act = "silu"
    scale_embeddings = False

    # -- loading ----------------------------------------------------------------------
    @classmethod
    def load_hparams(cls, md: dict, path: str) -> HParams:
        hp = load_hparams(md, path)
        hp.rope_type = cls.rope_type
        cls.adjust_hparams(hp, md)
        return hp

    @classmethod
    def adjust_hparams(cls, hp: HParams, md: dict) -> None:
        """Per-architecture hparams fix-ups (llama_model::load_hparams)."""

    def __init__(self, gguf: GGUFFile, hp: HParams, backend):
        self.hp = hp
        self.gguf = gguf
        self.place(backend)
        for b in self.backends:
            require_rope_yarn(b, hp)

        req, opt = self.require, self.optional
        self.tok_embd = req("token_embd.weight")
        if self.tok_embd.shape[0] != hp.n_vocab:
            hp.n_vocab = self.tok_embd.shape[0]
        self.output_norm = req("output_norm.weight")
        self.output = self.output_weight(opt("output.weight"))
        self.rope_freqs = opt("rope_freqs.weight")
        self.replicate("rope_freqs", "rope_freqs.weight")
        self.layers: list[LayerWeights] = []
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            bq, bk, bv = (opt(p + f"attn_{n}.bias") for n in "qkv")
            self.check_attention_shapes(il)
            wq, wk, wv = self.require_rows([p + f"attn_{n}.weight" for n in "qkv"])
            ffn_gate, ffn_up = self.require_rows([p + "ffn_gate.weight", p + "ffn_up.weight"])
            self.layers.append(
                LayerWeights(
                    attn_norm=req(p + "attn_norm.weight"),
                    wq=wq,
                    wk=wk,
                    wv=wv,
                    wo=req(p + "attn_output.weight"),
                    ffn_norm=req(p + "ffn_norm.weight"),
                    ffn_gate=ffn_gate,
                    ffn_up=ffn_up,
                    ffn_down=req(p + "ffn_down.weight"),
                    bq=bq,
                    bk=bk,
                    bv=bv,
                    bo=opt(p + "attn_output.bias"),
                    q_norm=opt(p + "attn_q_norm.weight"),
                    k_norm=opt(p + "attn_k_norm.weight"),
                    post_attention_norm=opt(p + "post_attention_norm.weight"),
                    post_ffw_norm=opt(p + "post_ffw_norm.weight"),
                )
            )

    def check_attention_shapes(self, il: int) -> None:
        """Layer ``il``'s q / k / v / output projections against the header's head counts and
        sizes (llama.cpp's load-time tensor shape check, llama-model.cpp ``create_tensor``):
        q ``[n_head * n_embd_head_k, n_embd]``, k ``[n_head_kv * n_embd_head_k, n_embd]``, v
        ``[n_head_kv * n_embd_head_v, n_embd]``, output ``[n_embd, n_head * n_embd_head_v]``
        (NumPy order: rows, columns). Raises ``GGUFError`` naming the first tensor whose shape
        differs (e.g. a file whose heads are not ``n_embd / n_head`` wide and that lacks
        ``attention.key_length``), which would otherwise fail at the first decode; a missing tensor
        is left to ``require``."""
        hp, p = self.hp, f"blk.{il}."
        want = {"attn_q": (hp.n_head * hp.n_embd_head_k, hp.n_embd), "attn_k": (hp.n_head_kv * hp.n_embd_head_k, hp.n_embd),
                "attn_v": (hp.n_head_kv * hp.n_embd_head_v, hp.n_embd),
                "attn_output": (hp.n_embd, hp.n_head * hp.n_embd_head_v)}
        why = (f" (n_embd {hp.n_embd}, n_head {hp.n_head}, n_head_kv {hp.n_head_kv}, head size k {hp.n_embd_head_k} / "
               f"v {hp.n_embd_head_v})")
        for n, shape in want.items():
            if p + n + ".weight" in self.gguf.tensors:
                self.check_shape(p + n + ".weight", shape, why)

    def check_shape(self, name: str, shape: tuple, why: str = "") -> None:
        """Raise ``GGUFError`` unless the file's tensor ``name`` has NumPy shape ``shape`` (``why``
        is appended to the message)."""
        t = self.gguf.tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}{why}")

    # -- placement (partial offload, -ngl) --------------------------------------------
    def place(self, backend) -> None:
        """Say where the model runs: ``backend`` is one backend, or a ``LayerSplit``
        (``backend/offload.py``) putting each repeating layer on the CPU or the GPU.

        Sets ``layer_backends`` (one per layer), ``backend_in`` (token embeddings),
        ``backend_out`` (final norm, vocabulary projection), ``backends`` (the distinct
        ones) and ``backend``: the backend of the ops being run, which the layer hooks
        (``attention``, ``ffn``, ...) read; ``forward`` switches it at a split's boundaries
        (``use``). Call before loading weights (``load_weight`` routes by tensor name)."""
        split = backend if isinstance(backend, LayerSplit) else None
        self.split = split
        self.layer_backends = [split.layer(il) if split else backend for il in range(self.hp.n_layer)]
        self.backend_in = split.input if split else backend
        self.backend_out = split.output if split else backend
        self.backends = split.backends if split else (backend,)
        self.backend = self.backend_in
        self._replicas: dict = {}  # attribute -> {id(backend): tensor} for tensors every layer reads
        self._kv_copies: dict = {}  # (layer, id(backend)) -> (k, v) copied this ubatch (kv_store)

    def layer_backend(self, il: int):
        """The backend of layer ``il`` (layers past ``n_layer``, e.g. MTP heads: the output's)."""
        return self.layer_backends[il] if il < len(self.layer_backends) else self.backend_out

    def backend_of(self, name: str):
        """The backend holding GGUF tensor ``name``: ``blk.{il}.*`` layer ``il``'s,
        ``output*`` the output's, anything else (token and per-layer embeddings) the input's."""
        if name.startswith("blk."):
            return self.layer_backend(int(name.split(".")[1]))
        if name.startswith("output"):
            return self.backend_out
        return self.backend_in

    def load_weight(self, name: str):
        """Tensor ``name`` loaded by (and living on) ``backend_of(name)``."""
        return self.backend_of(name).load_weight(self.gguf, name)

    def require(self, name: str, shape: tuple | None = None):
        """Tensor ``name`` of the file, loaded on its backend (``load_weight``). Raises
        ``GGUFError`` when the file lacks it or, with ``shape``, when its shape differs."""
        self.tensors_read.add(name)
        t = self.gguf.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.gguf.path}: missing tensor {name!r} for architecture {self.hp.arch}")
        if shape is not None:
            self.check_shape(name, shape)
        return self.load_weight(name)

    @property
    def tensors_read(self) -> set:
        """Names ``require`` / ``optional`` loaded so far (an architecture that must use every
        tensor of its file compares them with ``gguf.tensors``)."""
        return self.__dict__.setdefault("_tensors_read", set())

    def require_rows(self, names: list) -> list:
        """``[require(n) for n in names]`` for matrices that one input multiplies (a layer's q / k /
        v projections, its FFN gate / up): their backend may load them as views of one
        row-concatenated weight (``fuse_rows``, an optional backend op: the CUDA backend's),
        which ``mul_mat_split`` and ``gated_ffn`` then read in one launch. Tries all of
        ``names``, then fewer (v's type often differs: Q4_K_M's Q6_K layers), then loads them
        one by one."""
        B = self.backend_of(names[0])
        fuse = getattr(B, "fuse_rows", None)
        if fuse is not None and all(n in self.gguf.tensors for n in names):
            for m in range(len(names), 1, -1):
                views = fuse(self.gguf, names[:m])
                if views is not None:
                    self.tensors_read.update(names[:m])
                    return views + [self.require(n) for n in names[m:]]
        return [self.require(n) for n in names]

    def optional(self, name: str, shape: tuple | None = None):
        """``require(name, shape)`` when the file has tensor ``name``, else None."""
        return self.require(name, shape) if name in self.gguf.tensors else None

    def output_weight(self, out):
        """The vocabulary projection: ``out`` (``output.weight``), or, when the file ties it
        to ``token_embd.weight`` (``out`` None, sets ``hp.tie_embeddings``), the embeddings,
        loaded once more on the output backend when that is not the input's (llama.cpp
        duplicates the tied tensor the same way)."""
        self.hp.tie_embeddings = out is None
        if out is not None:
            return out
        if self.backend_out is self.backend_in:
            return self.tok_embd
        return self.backend_out.load_weight(self.gguf, "token_embd.weight")

    def replicate(self, attr: str, name: str) -> None:
        """Keep a copy of tensor ``name`` (held in ``self.<attr>``, loaded on the input
        backend; None = absent) on every backend of a split, for a tensor that layers on
        both sides read (``rope_freqs``); ``use`` swaps the attribute. No-op without a split."""
        if self.split is None or getattr(self, attr) is None:
            return
        self._replicas[attr] = {id(b): (getattr(self, attr) if b is self.backend_in
                                        else b.load_weight(self.gguf, name)) for b in self.backends}

    def use(self, B):
        """Make ``B`` the current backend (``self.backend`` and the replicated tensors); returns it."""
        if B is not self.backend:
            self.backend = B
            for attr, copies in self._replicas.items():
                setattr(self, attr, copies[id(B)])
        return B

    def begin_ubatch(self, ub: UBatch):
        """Start a ubatch on every backend in use (they upload its index arrays); returns the
        input backend, now current."""
        for b in self.backends:
            b.begin_ubatch(ub)
        self._kv_copies = {}
        return self.use(self.backend_in)

    def kv_store(self, cache, src: int) -> tuple:
        """Layer ``src``'s K and V storage (``cache.k[src]``, ``cache.v[src]``) as the current
        backend can read it. A KV-sharing layer (Gemma-4 E-series) whose source layer lives
        on the other side of a split reads a copy, made once per ubatch after the source
        wrote its cells (``src`` precedes every layer that reuses it); otherwise the
        storage itself."""
        k, v = cache.k[src], cache.v[src]
        owner = self.layer_backend(src)
        if owner is self.backend:
            return k, v
        key = (src, id(self.backend))
        if key not in self._kv_copies:
            self._kv_copies[key] = (transfer(k, owner, self.backend), transfer(v, owner, self.backend))
        return self._kv_copies[key]

    def cross(self, B, *xs):
        """Move activations ``xs`` from the current backend to ``B`` (``offload.transfer``: a
        host <-> device copy; None stays None) and make ``B`` current. Returns the moved
        tensors as a tuple."""
        src = self.backend
        moved = tuple(None if x is None else transfer(x, src, B) for x in xs)
        self.use(B)
        return moved

    # -- forward ----------------------------------------------------------------------
    def forward(self, ub: UBatch, kv: KVCacheSet) -> np.ndarray:
        """Run one ubatch whose cells are already planned and applied
        (``ub.plans``). Returns logits float32 ``[len(ub.out_rows), n_vocab]``."""
        hp = self.hp
        eps = hp.f_norm_rms_eps
        B = self.begin_ubatch(ub)
        x = B.get_rows(self.tok_embd, ub.tokens)
        if self.scale_embeddings:
            x = x * np.float32(np.sqrt(hp.n_embd))
        h = None  # the next layer's normed input, when fused into the previous residual step
        n_layer = len(self.layers)
        for il, L in enumerate(self.layers):
            if self.layer_backends[il] is not B:  # a split's boundary: the residual stream moves
                (x,) = self.cross(self.layer_backends[il], x)
                B, h = self.backend, None
            if h is None:
                h = B.rms_norm(x, L.attn_norm, eps)
            h = self.attention(il, L, h, ub, kv)
            x, h = B.add_rms_norm(x, h, L.post_attention_norm, L.ffn_norm, eps)
            h = self.ffn(L, h)
            nxt = (self.layers[il + 1].attn_norm
                   if il + 1 < n_layer and self.layer_backends[il + 1] is B else None)
            x, h = B.add_rms_norm(x, h, L.post_ffw_norm, nxt, eps)
        return self.output_logits(B, x, ub)

    def output_logits(self, B, x, ub: UBatch) -> np.ndarray:
        """The head: the rows ``ub.out_rows`` of the last layer's residual stream ``x``
        ``[T, n_embd]`` (on backend ``B``) moved to the output's backend, normed
        (``output_norm``), projected on ``output`` and soft-capped
        (``final_logit_softcapping``, when > 0). Returns logits float32
        ``[len(ub.out_rows), n_vocab]`` on the host; ``[0, n_vocab]`` for a prefill chunk that
        is not a prompt's end (no logits wanted)."""
        hp = self.hp
        if len(ub.out_rows) == 0:
            return np.zeros((0, hp.n_vocab), dtype=np.float32)
        x = B.get_rows(x, ub.out_rows)
        if self.backend_out is not B:
            (x,) = self.cross(self.backend_out, x)
            B = self.backend
        x = B.rms_norm(x, self.output_norm, hp.f_norm_rms_eps)
        logits = B.to_host(B.mul_mat(x, self.output))
        if hp.final_logit_softcapping > 0:
            c = np.float32(hp.final_logit_softcapping)
            logits = c * np.tanh(logits / c)
        return logits

    def rope_params(self, il: int) -> tuple[float, float]:
        """(freq_base, freq_scale) of layer ``il``; sliding layers may have their own."""
        hp = self.hp
        if hp.swa_layers[il] and hp.rope_freq_base_swa is not None:
            return hp.rope_freq_base_swa, hp.rope_freq_scale_swa
        return hp.rope_freq_base, hp.rope_freq_scale

    def shift_k(self, cache, stream: int, cells: np.ndarray, delta: np.ndarray) -> None:
        """Rotate cached K of ``cells`` by ``delta`` positions in every layer of
        ``cache`` (RoPE angles add: R(p + d) = R(d) R(p); llama.cpp ``build_k_shift``).
        A quantized K tier goes dequantize -> rotate -> quantize (``KVCache.store_k``)."""
        hp = self.hp
        for il in cache.layers:
            B = self.use(self.layer_backend(il))  # the layer's K lives on its backend
            base, scale = self.rope_params(il)
            k = cache.read_k(il, stream, cells)
            k = B.rope(k, delta, hp.n_rot, base, scale, self.rope_type, self.rope_freqs, **self.rope_ext_shift)
            cache.store_k(il, stream, cells, k)

    @property
    def rope_ext(self) -> dict:
        """Extra ``rope`` op arguments: ``yarn`` when the model uses YaRN scaling (issue 7b),
        else nothing (so a backend without YaRN still runs every other model)."""
        return {"yarn": self.hp.rope_yarn} if self.hp.rope_yarn is not None else {}

    @property
    def rope_ext_shift(self) -> dict:
        """``rope_ext`` for re-rotating cached K: a pure rotation, so YaRN's cos/sin
        magnitude scale (already in the cached K) is cancelled to 1."""
        y = self.hp.rope_yarn
        if y is None:
            return {}
        m = 1.0 + 0.1 * math.log(1.0 / self.hp.rope_freq_scale) if y.ext_factor != 0.0 else 1.0
        return {"yarn": dataclasses.replace(y, attn_factor=1.0 / m)}

    def attention(self, il: int, L: LayerWeights, h: np.ndarray, ub: UBatch, kv: KVCacheSet):
        """The layer's attention output projected (``project``: a backend array, or on CUDA
        possibly unsummed split-K partials that only its ``add_rms_norm`` takes)."""
        B, hp = self.backend, self.hp
        T = h.shape[0]
        # the biases are added by rope_kv_write, which may also sum a split product's partials
        split = getattr(B, "mul_mat_split_partials", B.mul_mat_split)
        q, k, v = split(h, (L.wq, L.wk, L.wv))
        q = q.reshape(T, hp.n_head, hp.n_embd_head_k)
        k = k.reshape(T, hp.n_head_kv, hp.n_embd_head_k)
        v = v.reshape(T, hp.n_head_kv, hp.n_embd_head_v)
        base, scale = self.rope_params(il)  # q/k norms (if any) are fused into rope
        cache = kv.layer_cache[il]
        plan = ub.plans[kv.caches.index(cache)]
        bias = (L.bq, L.bk, L.bv) if any(b is not None for b in (L.bq, L.bk, L.bv)) else None
        q = B.rope_kv_write(q, k, v, ub.pos, cache, il, plan, L.q_norm, L.k_norm, bias, n_rot=hp.n_rot, base=base,
                            freq_scale=scale, mode=self.rope_type, freq_factors=self.rope_freqs,
                            eps=hp.f_norm_rms_eps, **self.rope_ext)
        n_swa = hp.n_swa if hp.swa_layers[il] else 0
        out = B.attention_cells(q, ub.pos, cache.k[il], cache.v[il], plan,
                                hp.attention_scale, n_swa, hp.attn_logit_softcapping,
                                type_k=cache.tier_k, type_v=cache.tier_v)
        return self.project(out, L.wo, L.bo)

    def ffn(self, L: LayerWeights, h: np.ndarray):
        """The gated FFN's output (``project``, as ``attention``'s)."""
        B = self.backend
        return self.project(B.gated_ffn(h, L.ffn_gate, L.ffn_up, self.ffn_act), L.ffn_down)

    def project(self, a, w, b=None):
        """``a @ w.T`` (``+ b``) for the residual step that takes it next (``forward``'s
        ``add_rms_norm``): a backend with ``mul_mat_partials`` (CUDA) may return its split-K
        partials unsummed, for its ``add_rms_norm`` to sum (no bias: a bias is added to the
        product). Callers that use the result otherwise call ``mul_mat``."""
        B = self.backend
        partials = getattr(B, "mul_mat_partials", None)
        if b is None and partials is not None:
            return partials(a, w)
        o = B.mul_mat(a, w)
        return o if b is None else o + b
