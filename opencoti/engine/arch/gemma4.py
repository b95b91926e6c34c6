"""Gemma 4 (text): ``general.architecture = gemma4``.

One module for every Gemma-4 text model: the dense ones (31B: head dim 256 on
sliding layers, 512 on global layers), the MoE one (26B-A4B: a dense FFN and
routed experts side by side in every layer) and the E-series (E2B/E4B:
per-layer embeddings and KV-sharing layers). Sources: llama.cpp
``src/models/gemma4-iswa.cpp`` (graph), ``src/llama-model.cpp`` (hparams,
tensors, the KV layer-reuse rule), ``conversion/gemma.py`` ``Gemma4Model``
(converter); HF ``transformers/models/gemma4/modeling_gemma4.py``.

The recipe per layer ``il`` (T tokens, float32 activations ``[T, n_embd]``):

- input: ``x = token_embd[tokens] * sqrt(n_embd)``;
- attention: ``h = rms_norm(x, attn_norm)``; ``q = rms_norm(h @ attn_q, attn_q_norm)``
  per head; unless the layer reuses another layer's KV: ``k = h @ attn_k``,
  ``v = h @ attn_v`` (or ``v = k`` before any norm when ``attn_v`` is absent:
  HF ``attention_k_eq_v`` on global layers), ``k = rms_norm(k, attn_k_norm)``,
  ``v = rms_norm(v)`` (no weight); NEOX RoPE on q and k; attention scale 1.0
  (the q/k norms carry it); ``x += rms_norm(attn @ attn_output, post_attention_norm)``;
- sliding layers (``attention.sliding_window_pattern[il]``): window
  ``attention.sliding_window``, head dim ``attention.key_length_swa``, RoPE base
  ``rope.freq_base_swa`` over ``rope.dimension_count_swa`` dims; global layers:
  head dim ``attention.key_length``, base ``rope.freq_base`` over
  ``rope.dimension_count`` dims with ``rope_freqs.weight`` as frequency divisors
  (HF "proportional" RoPE: 1 for the rotated pairs, 1e30 for the rest, which
  leaves them unrotated);
- KV heads per layer: ``attention.head_count_kv`` (an array when global layers
  have fewer);
- FFN: ``f = ffn(rms_norm(x, ffn_norm))`` (GELU-tanh gated). MoE layers (with
  ``ffn_gate_inp``) add routed experts: router logits
  ``(rms_norm(x) / sqrt(n_embd) * ffn_gate_inp.scale) @ ffn_gate_inp``; softmax,
  top ``expert_used_count``, renormalised, times ``ffn_down_exps.scale[e]``
  (backend op ``moe_ffn_gate_up``) over ``rms_norm(x, pre_ffw_norm_2)``; then
  ``f = rms_norm(f, post_ffw_norm_1) + rms_norm(moe, post_ffw_norm_2)``;
  ``x += rms_norm(f, post_ffw_norm)``;
- per-layer embeddings (``embedding_length_per_layer_input`` > 0):
  ``pl = (rms_norm((x0 @ per_layer_model_proj) / sqrt(n_embd), per_layer_proj_norm)
  + per_layer_token_embd[tokens] * sqrt(n_pl)) / sqrt(2)``, ``[T, n_layer, n_pl]``
  from the scaled input embeddings x0; each layer then adds
  ``rms_norm((gelu(x @ inp_gate) * pl[:, il]) @ proj, post_norm)``;
- ``x *= layer_output_scale`` (when present);
- output: ``rms_norm(x, output_norm) @ output`` (tied to ``token_embd`` when
  ``output.weight`` is absent), then ``final_logit_softcapping``.

Norm weights are stored as used (Gemma-4's RMSNorm multiplies by ``w``, not
``1 + w``: the converter adds nothing). KV sharing (``attention.shared_kv_layers``
= n): the last n layers compute no K/V; as in llama.cpp's reuse rule, a sliding
one reads layer ``n_layer - n - 2``'s cache and a global one layer
``n_layer - n - 1``'s (HF: the last earlier layer of the same kind; the two
agree on every released model, and a file where they do not is refused).

Refused at load, naming the feature: MoE on a backend without the ``moe_ffn_gate_up``
op, split ``ffn_gate_exps``/``ffn_up_exps``
expert tensors (the converter writes the fused ``ffn_gate_up_exps``), per-layer
varying ``attention.head_count``, K and V head dims that differ, a KV-sharing
layout whose llama.cpp and HF readings disagree, a per-layer embedding
table whose vocabulary differs from ``token_embd``'s, and any tensor the graph
does not use (e.g. ``attn_q.bias`` from HF ``attention_bias``; llama.cpp
refuses such files too: "wrong number of tensors").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from opencoti.engine.arch.base import DecoderModel
from opencoti.engine.batch import UBatch
from opencoti.engine.kv_cache import KVCacheSet
from opencoti.model.gguf_file import GGUFError, GGUFFile
from opencoti.model.hparams import HParams, load_hparams

ARCH = "gemma4"


@dataclass
class Gemma4Layer:
    """One block's tensors (backend representation; None = absent).

    Shapes are NumPy's (``[out, in]`` for matrices): ``wq [n_head*hd, n_embd]``,
    ``wk``/``wv`` ``[n_head_kv*hd, n_embd]`` (None on KV-sharing layers; ``wv``
    None when V = K), ``ffn_gate_up_exps [n_expert, 2*n_ff_exp, n_embd]``,
    ``ffn_down_exps [n_expert, n_embd, n_ff_exp]``, ``inp_gate [n_pl, n_embd]``,
    ``proj [n_embd, n_pl]``.
    """

    attn_norm: object
    wq: object
    wk: Optional[object]
    wv: Optional[object]
    wo: object
    q_norm: object
    k_norm: Optional[object]
    post_attention_norm: object
    ffn_norm: object
    ffn_gate: object
    ffn_up: object
    ffn_down: object
    post_ffw_norm: object
    out_scale: Optional[object] = None
    # MoE
    ffn_gate_inp: Optional[object] = None
    ffn_gate_inp_s: Optional[object] = None
    ffn_gate_up_exps: Optional[object] = None
    ffn_down_exps: Optional[object] = None
    ffn_down_exps_s: Optional[object] = None
    pre_ffw_norm_2: Optional[object] = None
    post_ffw_norm_1: Optional[object] = None
    post_ffw_norm_2: Optional[object] = None
    # per-layer embeddings
    inp_gate: Optional[object] = None
    proj: Optional[object] = None
    post_norm: Optional[object] = None


def _key(name: str) -> str:
    return f"{ARCH}.{name}"


def _per_layer(md: dict, name: str, n_layer: int, path: str) -> Optional[list]:
    """The value of ``gemma4.<name>`` as a per-layer list when it is an array, else None."""
    v = md.get(_key(name))
    if isinstance(v, (np.ndarray, list)):
        if len(v) != n_layer:
            raise GGUFError(f"{path}: {_key(name)} has {len(v)} entries for {n_layer} layers")
        return [x.item() if hasattr(x, "item") else x for x in v]
    return None


def kv_reuse_layers(swa_layers: list[bool], n_shared: int, path: str = "<gguf>") -> list[int]:
    """Per layer: -1 (own KV) or the layer whose cache it reads, for
    ``attention.shared_kv_layers = n_shared`` (llama.cpp: ``n_layer_kv_from_start
    - (is_swa(il) ? 2 : 1)``). Raises ``GGUFError`` when that layer is not of the
    same kind (sliding / global), where HF would read a different layer."""
    n_layer = len(swa_layers)
    if not 0 <= n_shared < n_layer:
        raise GGUFError(f"{path}: {_key('attention.shared_kv_layers')} = {n_shared} with {n_layer} layers "
                        f"is not supported (at least one layer must compute its own KV)")
    start = n_layer - n_shared
    reuse = [-1] * n_layer
    for il in range(start, n_layer):
        src = start - (2 if swa_layers[il] else 1)
        if src < 0 or swa_layers[src] != swa_layers[il]:
            raise GGUFError(
                f"{path}: KV sharing layout not supported: layer {il} "
                f"({'sliding' if swa_layers[il] else 'global'}) would reuse layer {src}'s KV, which is "
                f"not a {'sliding' if swa_layers[il] else 'global'} layer (llama.cpp reads layer "
                f"n_layer_kv_from_start-{2 if swa_layers[il] else 1}; HF the last layer of the same kind)")
        reuse[il] = src
    return reuse


class Gemma4(DecoderModel):
    arch_names = (ARCH,)
    rope_type = "neox"
    ffn_act = "gelu_tanh"
    scale_embeddings = True

    # -- hparams ------------------------------------------------------------------------
    @classmethod
    def load_hparams(cls, md: dict, path: str) -> HParams:
        """``HParams`` with Gemma-4's per-layer shapes (llama.cpp ``llama_model_gemma4::load_arch_hparams``)."""
        n_layer = md.get(_key("block_count"))
        if n_layer is None:
            raise GGUFError(f"{path}: missing metadata key {_key('block_count')!r}")
        n_layer = int(n_layer)
        if _per_layer(md, "attention.head_count", n_layer, path) is not None and \
                len(set(_per_layer(md, "attention.head_count", n_layer, path))) > 1:
            raise GGUFError(f"{path}: per-layer varying {_key('attention.head_count')} is not supported")
        head_kv = _per_layer(md, "attention.head_count_kv", n_layer, path)
        n_ff = _per_layer(md, "feed_forward_length", n_layer, path)
        uniform = dict(md)  # the generic reader takes scalars; the arrays go to the per-layer fields
        for name, arr in (("attention.head_count_kv", head_kv), ("feed_forward_length", n_ff)):
            if arr is not None:
                uniform[_key(name)] = int(arr[0])
        hp = load_hparams(uniform, path)
        hp.rope_type = cls.rope_type
        hp.n_head_kv_arr = [int(v) for v in head_kv] if head_kv is not None else []
        hp.n_ff_arr = [int(v) for v in n_ff] if n_ff is not None else []

        if _key("attention.sliding_window") not in md:
            raise GGUFError(f"{path}: missing metadata key {_key('attention.sliding_window')!r}")
        hp.n_swa = int(md[_key("attention.sliding_window")])
        pattern = md.get(_key("attention.sliding_window_pattern"))
        if pattern is None:
            raise GGUFError(f"{path}: missing metadata key {_key('attention.sliding_window_pattern')!r}")
        swa = _per_layer(md, "attention.sliding_window_pattern", n_layer, path)
        hp.swa_layers = [bool(v) for v in swa] if swa is not None else [bool(pattern)] * n_layer
        if hp.n_swa <= 0 and any(hp.swa_layers):
            raise GGUFError(f"{path}: sliding layers with {_key('attention.sliding_window')} = {hp.n_swa}")

        hp.n_embd_head_k_swa = int(md.get(_key("attention.key_length_swa"), hp.n_embd_head_k))
        hp.n_embd_head_v_swa = int(md.get(_key("attention.value_length_swa"), hp.n_embd_head_v))
        if hp.n_embd_head_k != hp.n_embd_head_v or hp.n_embd_head_k_swa != hp.n_embd_head_v_swa:
            raise GGUFError(f"{path}: Gemma 4 with K and V head dims that differ is not supported")
        hp.n_rot_swa = int(md.get(_key("rope.dimension_count_swa"), hp.n_embd_head_k_swa))
        if _key("rope.freq_base_swa") in md:
            hp.rope_freq_base_swa = float(md[_key("rope.freq_base_swa")])
            hp.rope_freq_scale_swa = 1.0
        hp.f_attention_scale = 1.0  # HF self.scaling = 1.0: q_norm / k_norm set the scale
        hp.attn_logit_softcapping = 0.0  # gemma4's graph has none

        n_shared = int(md.get(_key("attention.shared_kv_layers"), 0) or 0)
        hp.kv_reuse = kv_reuse_layers(hp.swa_layers, n_shared, path) if n_shared else []
        hp.n_embd_per_layer = int(md.get(_key("embedding_length_per_layer_input"), 0) or 0)
        hp.n_expert = int(md.get(_key("expert_count"), 0) or 0)
        hp.n_expert_used = int(md.get(_key("expert_used_count"), 0) or 0)
        hp.n_ff_exp = int(md.get(_key("expert_feed_forward_length"), 0) or 0)
        return hp

    # -- weights ------------------------------------------------------------------------
    def __init__(self, gguf: GGUFFile, hp: HParams, backend):  # noqa: C901 - one tensor table
        self.hp = hp
        self.gguf = gguf
        self.place(backend)  # one backend, or a LayerSplit (-ngl): weights go to their layer's backend

        req, opt = self.require, self.optional

        n_embd, n_layer = hp.n_embd, hp.n_layer
        for b in self.backends:
            if any(n.endswith(".ffn_gate_inp.weight") for n in gguf.tensors) and not hasattr(b, "moe_ffn_gate_up"):
                raise NotImplementedError(f"{gguf.path}: {ARCH} MoE (routed experts) is not supported on the "
                                          f"{b.name} backend (no moe_ffn_gate_up op)")
        self.tok_embd = req("token_embd.weight")
        if self.tok_embd.shape[1] != n_embd:
            raise GGUFError(f"{gguf.path}: token_embd.weight has {self.tok_embd.shape[1]} columns, "
                            f"embedding_length is {n_embd}")
        if self.tok_embd.shape[0] != hp.n_vocab:
            hp.n_vocab = self.tok_embd.shape[0]
        self.output_norm = req("output_norm.weight", (n_embd,))
        self.output = self.output_weight(opt("output.weight", (hp.n_vocab, n_embd)))

        n_pl = hp.n_embd_per_layer
        self.per_layer_tok_embd = self.per_layer_model_proj = self.per_layer_proj_norm = None
        if n_pl > 0:
            self.per_layer_tok_embd = req("per_layer_token_embd.weight", (hp.n_vocab, n_layer * n_pl))
            self.per_layer_model_proj = req("per_layer_model_proj.weight", (n_layer * n_pl, n_embd))
            self.per_layer_proj_norm = req("per_layer_proj_norm.weight", (n_pl,))

        # proportional RoPE of the global layers (one tensor shared by all of them)
        self.rope_freqs = (opt if all(hp.swa_layers) else req)("rope_freqs.weight", (hp.n_embd_head_k // 2,))
        self.replicate("rope_freqs", "rope_freqs.weight")

        self.layers: list[Gemma4Layer] = []
        for il in range(n_layer):
            p = f"blk.{il}."
            hd, n_kv, n_head = hp.n_embd_head_k_l(il), hp.n_head_kv_l(il), hp.n_head
            own_kv = hp.kv_src(il) == il
            kv = req if own_kv else opt
            n_ff = hp.n_ff_l(il)
            if p + "ffn_gate_exps.weight" in gguf.tensors or p + "ffn_up_exps.weight" in gguf.tensors:
                raise GGUFError(f"{gguf.path}: split ffn_gate_exps/ffn_up_exps expert tensors are not "
                                f"supported for {ARCH} (expected the fused {p}ffn_gate_up_exps.weight)")
            L = Gemma4Layer(
                attn_norm=req(p + "attn_norm.weight", (n_embd,)),
                wq=req(p + "attn_q.weight", (n_head * hd, n_embd)),
                wk=kv(p + "attn_k.weight", (n_kv * hd, n_embd)),
                wv=opt(p + "attn_v.weight", (n_kv * hd, n_embd)),
                wo=req(p + "attn_output.weight", (n_embd, n_head * hd)),
                q_norm=req(p + "attn_q_norm.weight", (hd,)),
                k_norm=kv(p + "attn_k_norm.weight", (hd,)),
                post_attention_norm=req(p + "post_attention_norm.weight", (n_embd,)),
                ffn_norm=req(p + "ffn_norm.weight", (n_embd,)),
                ffn_gate=req(p + "ffn_gate.weight", (n_ff, n_embd)),
                ffn_up=req(p + "ffn_up.weight", (n_ff, n_embd)),
                ffn_down=req(p + "ffn_down.weight", (n_embd, n_ff)),
                post_ffw_norm=req(p + "post_ffw_norm.weight", (n_embd,)),
                out_scale=opt(p + "layer_output_scale.weight", (1,)),
            )
            if p + "ffn_gate_inp.weight" in gguf.tensors:
                n_exp, n_ff_exp = hp.n_expert, hp.n_ff_exp
                if n_exp <= 0 or not 0 < hp.n_expert_used <= n_exp or n_ff_exp <= 0:
                    raise GGUFError(f"{gguf.path}: MoE layer {il} needs {_key('expert_count')}, "
                                    f"{_key('expert_used_count')} and {_key('expert_feed_forward_length')}")
                L.ffn_gate_inp = req(p + "ffn_gate_inp.weight", (n_exp, n_embd))
                L.ffn_gate_inp_s = req(p + "ffn_gate_inp.scale", (n_embd,))
                L.ffn_gate_up_exps = req(p + "ffn_gate_up_exps.weight", (n_exp, 2 * n_ff_exp, n_embd))
                L.ffn_down_exps = req(p + "ffn_down_exps.weight", (n_exp, n_embd, n_ff_exp))
                L.ffn_down_exps_s = opt(p + "ffn_down_exps.scale", (n_exp,))
                L.pre_ffw_norm_2 = req(p + "pre_ffw_norm_2.weight", (n_embd,))
                L.post_ffw_norm_1 = req(p + "post_ffw_norm_1.weight", (n_embd,))
                L.post_ffw_norm_2 = req(p + "post_ffw_norm_2.weight", (n_embd,))
            if n_pl > 0:
                L.inp_gate = req(p + "inp_gate.weight", (n_pl, n_embd))
                L.proj = req(p + "proj.weight", (n_embd, n_pl))
                L.post_norm = req(p + "post_norm.weight", (n_embd,))
            self.layers.append(L)
        extra = sorted(set(gguf.tensors) - self.tensors_read)
        if extra:  # llama.cpp: "wrong number of tensors"; a feature this graph does not have
            raise GGUFError(f"{gguf.path}: {ARCH}: {len(extra)} tensor(s) of features this architecture does "
                            f"not support, e.g. {', '.join(extra[:4])}")

    # -- forward ------------------------------------------------------------------------
    def forward(self, ub: UBatch, kv: KVCacheSet) -> np.ndarray:
        """Run one planned ubatch. Returns logits float32 ``[len(ub.out_rows), n_vocab]``."""
        hp = self.hp
        eps = hp.f_norm_rms_eps
        B = self.begin_ubatch(ub)
        x = B.get_rows(self.tok_embd, ub.tokens) * np.float32(math.sqrt(hp.n_embd))
        pl = self.per_layer_inputs(x, ub.tokens) if self.per_layer_tok_embd is not None else None
        for il, L in enumerate(self.layers):
            if self.layer_backends[il] is not B:  # a split's boundary (-ngl): the stream moves
                x, pl = self.cross(self.layer_backends[il], x, pl)
                B = self.backend
            h = B.rms_norm(x, L.attn_norm, eps)
            h = self.attention(il, L, h, ub, kv)
            x = x + B.rms_norm(h, L.post_attention_norm, eps)
            f = B.mul_mat(B.gated_ffn(B.rms_norm(x, L.ffn_norm, eps), L.ffn_gate, L.ffn_up, self.ffn_act),
                          L.ffn_down)
            if L.ffn_gate_inp is not None:
                f = B.rms_norm(f, L.post_ffw_norm_1, eps) + B.rms_norm(self.moe(L, x), L.post_ffw_norm_2, eps)
            x = x + B.rms_norm(f, L.post_ffw_norm, eps)
            if pl is not None:
                g = B.gelu_tanh(B.mul_mat(x, L.inp_gate)) * pl[:, il]
                x = x + B.rms_norm(B.mul_mat(g, L.proj), L.post_norm, eps)
            if L.out_scale is not None:
                x = x * L.out_scale
        return self.output_logits(B, x, ub)

    def per_layer_inputs(self, x: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Per-layer embedding inputs ``[T, n_layer, n_pl]`` from the scaled input
        embeddings ``x [T, n_embd]`` (llama.cpp ``build_inp_per_layer`` +
        ``project_per_layer_inputs``; HF ``get_per_layer_inputs`` +
        ``project_per_layer_inputs``)."""
        B, hp = self.backend, self.hp
        T, n_pl = x.shape[0], hp.n_embd_per_layer
        tok = B.get_rows(self.per_layer_tok_embd, tokens).reshape(T, hp.n_layer, n_pl) * np.float32(math.sqrt(n_pl))
        proj = B.mul_mat(x, self.per_layer_model_proj) * np.float32(1.0 / math.sqrt(hp.n_embd))
        proj = B.rms_norm(proj.reshape(T, hp.n_layer, n_pl), self.per_layer_proj_norm, hp.f_norm_rms_eps)
        return (proj + tok) * np.float32(1.0 / math.sqrt(2.0))

    def moe(self, L: Gemma4Layer, x: np.ndarray) -> np.ndarray:
        """The routed-expert branch of a MoE layer over the attention output ``x [T, n_embd]``."""
        B, hp = self.backend, self.hp
        eps = hp.f_norm_rms_eps
        r = B.rms_norm(x, None, eps) * np.float32(1.0 / math.sqrt(hp.n_embd)) * L.ffn_gate_inp_s
        logits = B.mul_mat(r, L.ffn_gate_inp)  # [T, n_expert]
        return B.moe_ffn_gate_up(B.rms_norm(x, L.pre_ffw_norm_2, eps), logits, L.ffn_gate_up_exps, L.ffn_down_exps,
                         hp.n_expert_used, act=self.ffn_act, norm_w=True, down_scale=L.ffn_down_exps_s)

    def rope_layer(self, il: int):
        """(n_rot, freq_base, freq_scale, freq_factors) of layer ``il``."""
        base, scale = self.rope_params(il)
        return self.hp.n_rot_l(il), base, scale, (None if self.hp.swa_layers[il] else self.rope_freqs)

    def attention(self, il: int, L: Gemma4Layer, h: np.ndarray, ub: UBatch, kv: KVCacheSet) -> np.ndarray:
        B, hp = self.backend, self.hp
        T, eps = h.shape[0], hp.f_norm_rms_eps
        hd = hp.n_embd_head_k_l(il)
        n_rot, base, scale, ff = self.rope_layer(il)
        q = B.rms_norm(B.mul_mat(h, L.wq).reshape(T, hp.n_head, hd), L.q_norm, eps)
        q = B.rope(q, ub.pos, n_rot, base, scale, self.rope_type, ff)
        src = hp.kv_src(il)
        cache = kv.layer_cache[il]
        plan = ub.plans[kv.caches.index(cache)]
        if src == il:
            n_kv = hp.n_head_kv_l(il)
            k = B.mul_mat(h, L.wk)
            v = B.mul_mat(h, L.wv) if L.wv is not None else k  # attention_k_eq_v: V is K's projection
            k = B.rms_norm(k.reshape(T, n_kv, hd), L.k_norm, eps)
            v = B.rms_norm(v.reshape(T, n_kv, hd), None, eps)
            k = B.rope(k, ub.pos, n_rot, base, scale, self.rope_type, ff)
            B.kv_write(cache, il, plan, k, v)
        n_swa = hp.n_swa if hp.swa_layers[il] else 0
        k_store, v_store = self.kv_store(cache, src)  # a copy when src is across a split (-ngl)
        out = B.attention_cells(q, ub.pos, k_store, v_store, plan, hp.attention_scale, n_swa,
                                hp.attn_logit_softcapping, type_k=cache.tier_k, type_v=cache.tier_v)
        return B.mul_mat(out, L.wo)

    def shift_k(self, cache, stream: int, cells: np.ndarray, delta: np.ndarray) -> None:
        """Re-rotate cached K of ``cells`` by ``delta`` positions (per-layer RoPE dims and factors)."""
        for il in cache.layers:
            B = self.use(self.layer_backend(il))  # the layer's K lives on its backend
            n_rot, base, scale, ff = self.rope_layer(il)
            k = cache.read_k(il, stream, cells)
            k = B.rope(k, delta, n_rot, base, scale, self.rope_type, ff)
            cache.store_k(il, stream, cells, k)
