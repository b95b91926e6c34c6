"""Random-weight GGUF files with a real model's exact shapes, tensor names and quant types.

For GPU parity and bandwidth tests where the real weights cannot travel (a 7B
Q4_K_M is 4.4 GiB): the file has the same tensors, in the same ggml block
formats, as the real model's llama.cpp quantization, so a decode step reads the
same bytes and runs the same kernels. Only NumPy and ``gguf`` are needed (no
torch), so it runs on the GPU machine itself.

Presets (``PRESETS``): ``gemma-3-270m-q4_k_m``, ``gemma-3-12b-q4_k_m``,
``qwen2.5-7b-q4_k_m``, ``llama-3-8b-q4_k_m``. Hyperparameters are the models'
``config.json`` values as llama.cpp's ``convert_hf_to_gguf.py`` writes them.

Quant types follow llama.cpp's ``llama_tensor_get_type`` (``src/llama-quant.cpp``)
for ``LLAMA_FTYPE_MOSTLY_Q4_K_M``:

- 1-D tensors (norms, biases): F32.
- ``output.weight``, or ``token_embd.weight`` when the output is tied: Q6_K.
- ``attn_v.weight`` and ``ffn_down.weight``: Q6_K on the layers where
  ``use_more_bits(i, n)`` holds (``i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2``,
  integer division), else Q4_K.
- every other matrix: Q4_K.
- a K-quant needs rows of a multiple of 256 values; otherwise llama-quantize
  falls back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0.

On the real gemma-3-270m Q4_K_M this reproduces every tensor's type and shape
(tests/test_synth_shapes.py checks it against the real file's header).

Weights: each block gets random quant bits and sub-block scales; its f16
super-scale fields (``d``, and ``dmin``/``m`` where the type has one) are set
once per tensor so that the dequantized values have mean ~0 and standard
deviation ``WEIGHT_STD`` (solved from the dequantization, which is linear in
those fields). Norm weights are ~1, biases small. Every tensor's data comes
from a generator seeded by ``(seed, name)``, so the same call writes the same
bytes anywhere. The vocabulary is ``synth_gguf.make_vocab``'s (valid
SentencePiece / BPE tokens padded to ``n_vocab``), so the file loads with a
tokenizer and serves.

CLI: ``python -m opencoti.tools.synth_shapes --preset qwen2.5-7b-q4_k_m --out q7b.gguf``
(``--layers N`` for fewer layers, ``--set key=value`` to change a shape).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

WEIGHT_STD = 0.02

# (offset, role) of each f16 super-scale field in a block: role "d" multiplies the
# quants, "m" is the min term (ggml-common.h block layouts).
_SCALE_FIELDS = {
    QT.Q4_0: [(0, "d")], QT.Q4_1: [(0, "d"), (2, "m")], QT.Q5_0: [(0, "d")], QT.Q5_1: [(0, "d"), (2, "m")],
    QT.Q8_0: [(0, "d")], QT.Q2_K: [(80, "d"), (82, "m")], QT.Q3_K: [(108, "d")],
    QT.Q4_K: [(0, "d"), (2, "m")], QT.Q5_K: [(0, "d"), (2, "m")], QT.Q6_K: [(208, "d")],
}
_K_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0, QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_1}


@dataclass(frozen=True)
class Shape:
    """Hyperparameters of one model (the GGUF ``<arch>.*`` keys).

    arch: ``general.architecture`` ("gemma3", "qwen2", "llama");
    n_embd, n_ff, n_layer, n_head, n_head_kv, head_dim, n_vocab: sizes;
    n_ctx_train: ``context_length``; rope_base (global layers), rope_base_swa;
    rope_scale_linear: a linear RoPE factor (gemma-3 12B: 8) or 0;
    n_swa: sliding window (gemma3) or 0; eps: RMSNorm epsilon;
    tied: the output projection is ``token_embd``; qkv_bias: q/k/v biases (qwen2).
    """

    name: str
    arch: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    eps: float
    tied: bool
    qkv_bias: bool = False
    n_swa: int = 0
    rope_base_swa: float = 10000.0
    rope_scale_linear: float = 0.0
    ftype: str = "Q4_K_M"


PRESETS = {
    "gemma-3-270m-q4_k_m": Shape("Gemma 3 270m (synthetic)", "gemma3", 640, 2048, 18, 4, 1, 256, 262144, 32768,
                                 1e6, 1e-6, True, n_swa=512),
    "gemma-3-12b-q4_k_m": Shape("Gemma 3 12b (synthetic)", "gemma3", 3840, 15360, 48, 16, 8, 256, 262208, 131072,
                                1e6, 1e-6, True, n_swa=1024, rope_scale_linear=8.0),
    "qwen2.5-7b-q4_k_m": Shape("Qwen2.5 7B (synthetic)", "qwen2", 3584, 18944, 28, 28, 4, 128, 152064, 32768,
                               1e6, 1e-6, False, qkv_bias=True),
    "llama-3-8b-q4_k_m": Shape("Llama 3 8B (synthetic)", "llama", 4096, 14336, 32, 32, 8, 128, 128256, 8192,
                               5e5, 1e-5, False),
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp ``use_more_bits``: the layers Q4_K_M gives a wider type."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, ne: tuple[int, ...], shape: Shape) -> QT:
    """ggml type of tensor ``name`` (GGUF ``ne`` order: ``ne[0]`` = row length) under
    ``shape.ftype`` (only "Q4_K_M"). Raises ``ValueError`` for another ftype."""
    if shape.ftype != "Q4_K_M":
        raise ValueError(f"ftype {shape.ftype!r}: only Q4_K_M is modelled")
    if len(ne) == 1:
        return QT.F32
    il = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        t = QT.Q6_K
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(il, shape.n_layer):
        t = QT.Q6_K
    else:
        t = QT.Q4_K
    if ne[0] % 256:
        t = _K_FALLBACK.get(t, t)
    return t


def tensor_list(shape: Shape) -> list[tuple[str, tuple[int, ...], QT]]:
    """``(name, ne, type)`` of every tensor, in llama.cpp's converter order
    (``ne`` in GGUF order: ``(n_in, n_out)`` for a matrix)."""
    e, f, hd = shape.n_embd, shape.n_ff, shape.head_dim
    q, kv = shape.n_head * hd, shape.n_head_kv * hd
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (e, shape.n_vocab))]
    for il in range(shape.n_layer):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (e, q)), (b + "attn_k.weight", (e, kv)),
                (b + "attn_v.weight", (e, kv)), (b + "attn_output.weight", (q, e))]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        if shape.arch == "gemma3":
            out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,)),
                    (b + "post_attention_norm.weight", (e,)), (b + "post_ffw_norm.weight", (e,))]
        out += [(b + "ffn_norm.weight", (e,)), (b + "ffn_gate.weight", (e, f)), (b + "ffn_up.weight", (e, f)),
                (b + "ffn_down.weight", (f, e))]
    out.append(("output_norm.weight", (e,)))
    if not shape.tied:
        out.append(("output.weight", (e, shape.n_vocab)))
    return [(n, ne, tensor_type(n, ne, shape)) for n, ne in out]


def _rng(seed: int, name: str) -> np.random.Generator:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def _calibrate(t: QT, rng: np.random.Generator, std: float) -> dict[str, float]:
    """f16 values of the type's scale fields giving dequantized mean ~0, std ``std``."""
    bsz, tsz = gguf.GGML_QUANT_SIZES[t]
    sample = rng.integers(0, 256, (64, tsz), dtype=np.uint8)
    fields = _SCALE_FIELDS[t]

    def deq(vals: dict[str, float]) -> np.ndarray:
        b = sample.copy()
        for off, role in fields:
            b[:, off:off + 2] = np.full((len(b), 1), vals[role], np.float16).view(np.uint8)
        return gguf.quants.dequantize(b, t).astype(np.float64).ravel()

    a = deq({"d": 1.0, "m": 0.0})
    if len(fields) == 1:
        base = a - a.mean() if t == QT.Q8_0 else a  # symmetric types are centred already
        return {"d": std / max(base.std(), 1e-12)}
    m1 = deq({"d": 0.0, "m": 1.0})
    m = -a.mean() / m1.mean()
    s = std / max((a + m * m1).std(), 1e-12)
    return {"d": s, "m": m * s}


def tensor_data(name: str, ne: tuple[int, ...], t: QT, seed: int = 0, std: float = WEIGHT_STD) -> np.ndarray:
    """Random data of one tensor: float32 ``[ne[1], ne[0]]`` for F32/F16 types
    (F16 as float16), uint8 ``[ne[1], row_bytes]`` blocks for a quantized type."""
    rng = _rng(seed, name)
    rows, cols = (ne[1] if len(ne) > 1 else 1), ne[0]
    if t in (QT.F32, QT.F16, QT.BF16):
        if len(ne) == 1:
            is_norm = "norm" in name
            x = (1.0 + 0.1 * rng.standard_normal(cols)) if is_norm else 0.1 * std * rng.standard_normal(cols)
            return x.astype(np.float32)
        x = (std * rng.standard_normal((rows, cols))).astype(np.float32)
        return x.astype(np.float16) if t == QT.F16 else x
    if t not in _SCALE_FIELDS:
        raise ValueError(f"{name}: no random block recipe for {t.name}")
    bsz, tsz = gguf.GGML_QUANT_SIZES[t]
    vals = _calibrate(t, rng, std)
    nb = rows * cols // bsz
    data = np.frombuffer(rng.bytes(nb * tsz), dtype=np.uint8).reshape(nb, tsz).copy()
    for off, role in _SCALE_FIELDS[t]:
        data[:, off:off + 2] = np.full((1, 1), vals[role], np.float16).view(np.uint8)
    return data.reshape(rows, cols // bsz * tsz)


def _write_metadata(w: gguf.GGUFWriter, shape: Shape) -> None:
    from opencoti.tools.synth_gguf import make_vocab

    a = shape.arch
    w.add_name(shape.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_rope_freq_base(shape.rope_base)
    if a == "gemma3":
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_sliding_window(shape.n_swa)
        if shape.rope_scale_linear:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(shape.rope_scale_linear)
    else:
        w.add_vocab_size(shape.n_vocab)
        w.add_rope_dimension_count(shape.head_dim)
    kind = "spm" if a == "gemma3" else "bpe"
    make_vocab(kind, shape.n_vocab, "gemma3" if a == "gemma3" else ("llama" if a == "llama" else "qwen2")).write(w)


def write_model(shape: Shape | str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the random-weight GGUF of ``shape`` (a ``Shape`` or a ``PRESETS`` key;
    ``overrides`` replace its fields, e.g. ``n_layer=2``) to ``path``, one tensor
    at a time (memory stays at one tensor). Returns the path. Raises ``KeyError``
    for an unknown preset."""
    if isinstance(shape, str):
        shape = PRESETS[shape]
    shape = replace(shape, **overrides)
    path = Path(path)
    tensors = tensor_list(shape)
    w = gguf.GGUFWriter(str(path), shape.arch)
    _write_metadata(w, shape)
    for name, ne, t in tensors:
        bsz, tsz = gguf.GGML_QUANT_SIZES[t]
        n = int(np.prod(ne))
        if t == QT.F32:
            w.add_tensor_info(name, ne[::-1], np.dtype(np.float32), n * 4)
        elif t == QT.F16:
            w.add_tensor_info(name, ne[::-1], np.dtype(np.float16), n * 2)
        else:
            nbytes = n // bsz * tsz
            w.add_tensor_info(name, (ne[1], ne[0] // bsz * tsz), np.dtype(np.uint8), nbytes, raw_dtype=t)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, ne, t in tensors:
        w.write_tensor_data(tensor_data(name, ne, t, seed))
    w.close()
    return path


def file_bytes(shape: Shape | str, **overrides) -> int:
    """Bytes of tensor data ``write_model`` writes (without header and padding)."""
    if isinstance(shape, str):
        shape = PRESETS[shape]
    shape = replace(shape, **overrides)
    tot = 0
    for _, ne, t in tensor_list(shape):
        bsz, tsz = gguf.GGML_QUANT_SIZES[t]
        tot += int(np.prod(ne)) // bsz * tsz
    return tot


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="n_layer override")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=INT", help="override a Shape field")
    a = ap.parse_args(argv)
    ov = {}
    for s in a.set:
        k, _, v = s.partition("=")
        ov[k] = type(getattr(PRESETS[a.preset], k))(v)
    if a.layers is not None:
        ov["n_layer"] = a.layers
    p = write_model(a.preset, a.out, a.seed, **ov)
    print(f"wrote {p} ({p.stat().st_size / 2**30:.2f} GiB, {file_bytes(a.preset, **ov) / 2**30:.2f} GiB of tensors)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
