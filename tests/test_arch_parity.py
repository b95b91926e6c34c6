"""Architecture parity on random-weight tiny models: our CPU forward vs transformers.

Each variant is a tiny random transformers model (float32, eager attention)
written to GGUF by ``opencoti.tools.synth_gguf`` with llama.cpp converter
semantics. Three claims are tested separately, so a failure points at one
place:

1. the file is what convert_hf_to_gguf.py would write (tensor names, shapes,
   transforms, metadata) -- ``test_gguf_layout``;
2. the file encodes the transformers model under llama.cpp's semantics: a
   plain float64 NumPy forward over the file (``tests/tinymodels.py``) matches
   transformers within 1e-4 -- ``test_file_matches_transformers``;
3. our engine matches transformers: with an f32 KV cache max |dlogit| < 1e-3
   and the same argmax at every position whose top-2 margin exceeds twice the
   observed error; with the default f16 KV cache (``eval_logits``, as
   llama.cpp's default) within 2e-2. Quantized files (Q8_0, and a K-quant mix)
   are compared against transformers run on the file's dequantized weights,
   within 1e-3 (the CPU backend computes in float32 on dequantized weights).
Also: ubatch size and multi-sequence batching do not change logits, and the
K-quant encoders produce blocks that gguf-py decodes back within their step.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

from opencoti.engine.runner import ModelRunner, eval_logits, iter_logits
from opencoti.model.gguf_file import GGUFFile
from opencoti.model.loader import load_model
from opencoti.params import Params
from opencoti.tools import synth_gguf as sg

from tinymodels import SEQUENCES, ref_forward

# name -> (arch, config overrides)
VARIANTS = {
    "llama": ("llama", {}),
    "llama3_rope": ("llama", {"rope_parameters": dict(sg.LLAMA3_ROPE), "tie_word_embeddings": True}),
    "llama_bias_mqa": ("llama", {"attention_bias": True, "num_key_value_heads": 1, "num_hidden_layers": 3}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    # Qwen2.5-1M-style long context (issue 7): theta 1e7 and a ~1M training context; llama.cpp
    # has no dual-chunk attention, so DCA settings never reach the GGUF
    "qwen2_1m": ("qwen2", dict(sg.QWEN25_1M)),
    # the same with YaRN, as llama.cpp converts a config carrying rope_scaling yarn (factor 4);
    # a small original context so a 40-token prompt crosses the correction range
    "qwen2_1m_yarn": ("qwen2", dict(sg.QWEN25_1M, rope_parameters=dict(sg.QWEN25_1M_YARN_ROPE))),
    "gemma3": ("gemma3", {}),
    # as Gemma 3 4B+: linear RoPE scaling on the global layers only; plus a final logit softcap
    "gemma3_linear_softcap": ("gemma3", {
        "final_logit_softcapping": 4.0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        }}),
}
ALL = list(VARIANTS)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(variant, qtype="F32", **extra) -> (hf_model, gguf_path); cached per argument set."""
    root = tmp_path_factory.mktemp("tiny")

    @functools.lru_cache(maxsize=None)
    def _build(variant: str, qtype: str = "F32", extra: tuple = ()):
        arch, overrides = VARIANTS[variant]
        kw = dict(overrides, **dict(extra))
        path = root / f"{variant}-{qtype}-{abs(hash(extra))}.gguf"
        model = sg.write_random_model(arch, path, qtype, seed=1, **kw)
        return model, str(path)

    return lambda variant, qtype="F32", **extra: _build(variant, qtype, tuple(sorted(extra.items())))


def _runner(path: str, n_ubatch: int = 512, kv: str = "f32", n_seq_max: int = 1) -> ModelRunner:
    model = load_model(path, Params(), with_tokenizer=False)
    return ModelRunner(model, n_ctx=256, n_seq_max=n_seq_max, n_ubatch=n_ubatch, type_k=kv, type_v=kv)


def _engine_logits(path: str, tokens: list[int], n_ubatch: int = 512) -> np.ndarray:
    r = _runner(path, n_ubatch)
    return np.concatenate([lg for _, lg in iter_logits(r, tokens)], axis=0)


def _assert_logits_close(ours: np.ndarray, ref: np.ndarray, tol: float, what: str) -> float:
    """max |ours - ref| < tol, and the same argmax wherever ref's top-2 margin > 2x the error."""
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    assert np.isfinite(ours).all(), f"{what}: non-finite logits"
    diff = np.abs(ours.astype(np.float64) - ref)
    d = float(diff.max())
    worst = np.unravel_index(diff.argmax(), diff.shape)
    assert d < tol, f"{what}: max |dlogit| = {d:.3g} >= {tol} (position {worst[0]}, token {worst[1]})"
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * d
    assert decisive.mean() >= 0.9, f"{what}: argmax check would be vacuous ({decisive.sum()} decisive rows)"
    bad = np.nonzero((ours.argmax(-1) != ref.argmax(-1)) & decisive)[0]
    assert bad.size == 0, f"{what}: argmax differs at positions {bad.tolist()}"
    return d


# --- 1. the file -----------------------------------------------------------------------

_LAYER_TENSORS = {
    "llama": {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
              "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"},
}
_LAYER_TENSORS["qwen2"] = _LAYER_TENSORS["llama"] | {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
_LAYER_TENSORS["qwen3"] = _LAYER_TENSORS["llama"] | {"attn_q_norm.weight", "attn_k_norm.weight"}
_LAYER_TENSORS["gemma3"] = _LAYER_TENSORS["qwen3"] | {"post_attention_norm.weight", "post_ffw_norm.weight"}


@pytest.mark.parametrize("variant", ALL)
def test_gguf_layout(build, variant):
    model, path = build(variant)
    arch = VARIANTS[variant][0]
    cfg = model.config
    g = GGUFFile(path)
    md = g.metadata
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_layer = cfg.num_hidden_layers

    # names: exactly the converter's set
    per_layer = set(_LAYER_TENSORS[arch])
    if variant == "llama_bias_mqa":
        per_layer |= {"attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"}
    expected = {"token_embd.weight", "output_norm.weight"}
    expected |= {f"blk.{i}.{t}" for i in range(n_layer) for t in per_layer}
    if not cfg.tie_word_embeddings:
        expected.add("output.weight")
    if variant == "llama3_rope":
        expected.add("rope_freqs.weight")
    assert set(g.tensors) == expected

    # ggml ne order: attn_q is {n_embd, n_head*head_dim}, token_embd {n_embd, n_vocab}
    assert g.tensors["blk.0.attn_q.weight"].ne == (cfg.hidden_size, cfg.num_attention_heads * hd)
    assert g.tensors["blk.0.attn_k.weight"].ne == (cfg.hidden_size, cfg.num_key_value_heads * hd)
    assert g.tensors["token_embd.weight"].ne == (cfg.hidden_size, cfg.vocab_size)
    assert all(t.ggml_type == QT.F32 for t in g.tensors.values())

    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    L = "model.layers.0."
    q_hf, k_hf = sd[L + "self_attn.q_proj.weight"], sd[L + "self_attn.k_proj.weight"]
    q_gg, k_gg = g.dequantize("blk.0.attn_q.weight"), g.dequantize("blk.0.attn_k.weight")
    if arch == "llama":
        # ggml row h*hd + 2i + j  <-  HF row h*hd + j*hd/2 + i  (rotate-half -> adjacent pairs)
        for w_gg, w_hf, nh in ((q_gg, q_hf, cfg.num_attention_heads), (k_gg, k_hf, cfg.num_key_value_heads)):
            for h in range(nh):
                for i in range(hd // 2):
                    for j in range(2):
                        np.testing.assert_array_equal(w_gg[h * hd + 2 * i + j], w_hf[h * hd + j * hd // 2 + i])
        assert not np.array_equal(q_gg, q_hf)
    else:
        np.testing.assert_array_equal(q_gg, q_hf)
        np.testing.assert_array_equal(k_gg, k_hf)
    np.testing.assert_array_equal(g.dequantize("blk.0.attn_v.weight"), sd[L + "self_attn.v_proj.weight"])
    np.testing.assert_array_equal(g.dequantize("token_embd.weight"), sd["model.embed_tokens.weight"])
    norm_shift = np.float32(1.0) if arch == "gemma3" else np.float32(0.0)  # Gemma stores 1 + w
    np.testing.assert_array_equal(g.dequantize("output_norm.weight"), sd["model.norm.weight"] + norm_shift)
    np.testing.assert_array_equal(g.dequantize("blk.0.attn_norm.weight"), sd[L + "input_layernorm.weight"] + norm_shift)
    if arch == "gemma3":
        np.testing.assert_array_equal(g.dequantize("blk.0.attn_q_norm.weight"), sd[L + "self_attn.q_norm.weight"] + 1)
        np.testing.assert_array_equal(g.dequantize("blk.0.post_ffw_norm.weight"),
                                      sd[L + "post_feedforward_layernorm.weight"] + 1)
    if arch == "qwen2":
        np.testing.assert_array_equal(g.dequantize("blk.0.attn_q.bias"), sd[L + "self_attn.q_proj.bias"])
    if not cfg.tie_word_embeddings:
        np.testing.assert_array_equal(g.dequantize("output.weight"), sd["lm_head.weight"])

    # metadata
    p = arch + "."
    assert md["general.architecture"] == arch
    assert md[p + "block_count"] == n_layer
    assert md[p + "embedding_length"] == cfg.hidden_size
    assert md[p + "feed_forward_length"] == cfg.intermediate_size
    assert md[p + "attention.head_count"] == cfg.num_attention_heads
    assert md[p + "attention.head_count_kv"] == cfg.num_key_value_heads
    assert md[p + "context_length"] == cfg.max_position_embeddings
    assert md[p + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert md["general.file_type"] == 0 and md["general.quantization_version"] == 2
    if arch == "qwen2":
        assert p + "attention.key_length" not in md  # Qwen2Config has no head_dim field
    else:
        assert md[p + "attention.key_length"] == hd and md[p + "attention.value_length"] == hd
    if arch == "llama":
        assert md["llama.vocab_size"] == cfg.vocab_size and md["llama.rope.dimension_count"] == hd
        assert md["llama.rope.freq_base"] == 10000.0
        assert not any(k.startswith("llama.rope.scaling") for k in md)
    if variant in ("qwen2", "qwen3"):
        assert md[p + "rope.freq_base"] == 1e6
    if variant.startswith("qwen2_1m"):
        assert md["qwen2.rope.freq_base"] == 1e7 and md["qwen2.context_length"] == 1010000
    if variant == "qwen2_1m":
        assert not any(k.startswith("qwen2.rope.scaling") for k in md)
    if variant == "qwen2_1m_yarn":
        assert md["qwen2.rope.scaling.type"] == "yarn" and md["qwen2.rope.scaling.factor"] == 4.0
        assert md["qwen2.rope.scaling.original_context_length"] == 32
    if variant == "gemma3":
        assert "gemma3.final_logit_softcapping" not in md and "gemma3.rope.scaling.type" not in md
    if arch == "gemma3":
        assert md["gemma3.rope.freq_base"] == 1e6 and md["gemma3.rope.freq_base_swa"] == 10000.0
        assert md["gemma3.attention.sliding_window"] == 8
    if variant == "gemma3_linear_softcap":
        assert md["gemma3.final_logit_softcapping"] == 4.0
        assert md["gemma3.rope.scaling.type"] == "linear" and md["gemma3.rope.scaling.factor"] == 8.0
    if variant == "llama3_rope":
        # factors for head_dim 16, theta 1e4, factor 8, low/high 1/4, original context 64:
        # wavelengths 2*pi*1e4^(2i/16); < 16 -> 1, > 64 -> 8, between -> 1/((1-s)/8 + s)
        ff = g.dequantize("rope_freqs.weight")
        wl = 2 * np.pi * 10000.0 ** (np.arange(0, 16, 2) / 16)
        s = (64 / wl - 1) / (4 - 1)
        want = np.where(wl < 16, 1.0, np.where(wl > 64, 8.0, 1 / ((1 - s) / 8 + s)))
        np.testing.assert_allclose(ff, want, rtol=1e-6)
        assert ff[0] == 1.0 and ff[-1] == 8.0 and 1.0 < ff[1] < 8.0
    g.close()


@pytest.mark.parametrize("kind,arch", [("spm", "gemma3"), ("spm", "llama"), ("bpe", "qwen2"), ("bpe", "llama")])
def test_vocab_metadata(kind, arch):
    v = sg.make_vocab(kind, 384, arch)
    assert len(v.tokens) == len(v.token_types) == 384
    assert len(set(v.tokens)) == 384
    toks = set(v.tokens)
    for k, i in v.special_ids.items():
        assert v.token_types[i] in (2, 3), (k, i)  # UNKNOWN / CONTROL
    if kind == "spm":
        assert v.model == "llama" and len(v.scores) == 384
        assert v.tokens[v.tokens.index("<0x00>"):][:256] == [f"<0x{b:02X}>" for b in range(256)]
        assert {"▁the", "▁t", "▁"} <= toks
    else:
        assert v.model == "gpt2" and v.merges
        for m in v.merges:
            a, b = m.split(" ")
            assert a in toks and b in toks and a + b in toks
        assert "Ġthe" in toks and v.tokens[32] == "Ġ" and v.tokens[65] == "A"
    if arch == "gemma3":
        assert v.tokens[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"] and v.add_space_prefix is False
    with pytest.raises(ValueError, match="too small"):
        sg.make_vocab(kind, 200, arch)


def test_cli_writes_a_model(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    rc = sg.main(["--arch", "llama", "--out", str(out), "--qtype", "Q8_0", "--rope-scaling", "llama3",
                  "--set", "num_hidden_layers=3", "--seed", "5"])
    assert rc == 0
    g = GGUFFile(out)
    assert g.metadata["llama.block_count"] == 3
    assert g.metadata["general.file_type"] == 7  # MOSTLY_Q8_0
    assert g.tensors["blk.2.ffn_up.weight"].ggml_type == QT.Q8_0
    assert g.tensors["rope_freqs.weight"].ggml_type == QT.F32
    assert g.tensors["blk.2.ffn_norm.weight"].ggml_type == QT.F32
    g.close()
    assert sg.main(["--arch", "qwen2", "--out", str(tmp_path / "x.gguf"), "--qtype", "Q9_9"]) == 1
    assert "unknown ggml type" in capsys.readouterr().err


# --- 2. the file encodes the transformers model ------------------------------------------

@pytest.mark.parametrize("variant", ALL)
def test_file_matches_transformers(build, variant):
    model, path = build(variant)
    for seq in SEQUENCES:
        _assert_logits_close(ref_forward(path, seq), sg.hf_logits(model, seq).astype(np.float64), 1e-4,
                             f"{variant} reference forward")


# --- 3. our engine --------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ALL)
def test_engine_matches_transformers(build, variant):
    model, path = build(variant)
    for seq in SEQUENCES:
        hf = sg.hf_logits(model, seq).astype(np.float64)
        _assert_logits_close(_engine_logits(path, seq), hf, 1e-3, f"{variant} f32 KV")


@pytest.mark.parametrize("variant", ["llama3_rope", "qwen2", "gemma3"])
def test_eval_logits_default_f16_kv(build, variant):
    model, path = build(variant)
    seq = SEQUENCES[1]
    ours = eval_logits(load_model(path, Params(), with_tokenizer=False), seq)
    assert ours.dtype == np.float32
    _assert_logits_close(ours, sg.hf_logits(model, seq).astype(np.float64), 2e-2, f"{variant} eval_logits")


@pytest.mark.parametrize("variant", ALL)
def test_ubatch_sizes_agree(build, variant):
    _, path = build(variant)
    seq = SEQUENCES[1]  # 40 tokens: several ubatches cross gemma3's window of 8
    full = _engine_logits(path, seq, n_ubatch=512)
    for n_ubatch in (1, 3, 8, 13):
        np.testing.assert_allclose(_engine_logits(path, seq, n_ubatch=n_ubatch), full, atol=2e-5, rtol=0,
                                   err_msg=f"{variant} n_ubatch={n_ubatch}")


@pytest.mark.parametrize("variant", ["llama", "gemma3"])
def test_two_sequences_in_one_ubatch(build, variant):
    """Two sequences interleaved row by row in the same ubatches give each one's own logits."""
    from opencoti.engine.batch import UBatch

    _, path = build(variant)
    a, b = SEQUENCES[1][:30], SEQUENCES[2][:30]
    r = _runner(path, n_seq_max=2)
    got = {0: [], 1: []}
    for s in range(0, 30, 10):  # 3 ubatches of 20 rows
        toks, pos, sid = [], [], []
        for i in range(s, s + 10):
            toks += [a[i], b[i]]
            pos += [i, i]
            sid += [0, 1]
        lg = r.decode(UBatch.build(toks, pos, sid, np.arange(20)))
        got[0].append(lg[0::2])
        got[1].append(lg[1::2])
    np.testing.assert_allclose(np.concatenate(got[0]), _engine_logits(path, a), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate(got[1]), _engine_logits(path, b), atol=2e-5, rtol=0)


@pytest.mark.parametrize("variant", ALL)
def test_q8_0_matches_transformers_on_dequantized_weights(build, variant):
    model, path = build(variant, "Q8_0")
    g = GGUFFile(path)
    assert g.tensors["blk.0.ffn_down.weight"].ggml_type == QT.Q8_0
    assert g.tensors["token_embd.weight"].ggml_type == QT.Q8_0
    assert g.tensors["output_norm.weight"].ggml_type == QT.F32
    g.close()
    deq = copy.deepcopy(model)
    sg.load_gguf_into_hf(deq, path)
    seq = SEQUENCES[1]
    hf_deq = sg.hf_logits(deq, seq).astype(np.float64)
    # the quantization is visible at this tolerance, so matching the dequantized model means something
    assert np.abs(hf_deq - sg.hf_logits(model, seq)).max() > 1e-2
    _assert_logits_close(ref_forward(path, seq), hf_deq, 1e-4, f"{variant} Q8_0 reference forward")
    _assert_logits_close(_engine_logits(path, seq), hf_deq, 1e-3, f"{variant} Q8_0 engine")


K_MIX = {"blk.*.ffn_down.weight": "Q6_K", "blk.*.attn_v.weight": "Q5_K", "token_embd.weight": "Q8_0",
         "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "Q5_0"}


@pytest.mark.parametrize("variant", ["qwen3", "gemma3"])
def test_kquant_mix_matches_transformers_on_dequantized_weights(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    kw = dict(overrides, hidden_size=256, intermediate_size=512, head_dim=64)
    if variant == "gemma3":
        kw["num_hidden_layers"] = 6
    model = sg.random_hf_model(arch, seed=2, **kw)
    path = tmp_path / "kmix.gguf"
    types = sg.write_gguf(model, path, "Q4_K", tensor_types=K_MIX)
    assert types["blk.0.ffn_up.weight"] == QT.Q4_K and types["blk.0.ffn_down.weight"] == QT.Q6_K
    assert types["blk.0.attn_v.weight"] == QT.Q5_K and types["token_embd.weight"] == QT.Q8_0
    assert types["blk.1.attn_q.weight"] == QT.Q4_0 and types["blk.0.attn_q.weight"] == QT.Q4_K
    deq = copy.deepcopy(model)
    sg.load_gguf_into_hf(deq, path)
    seq = SEQUENCES[0]
    hf_deq = sg.hf_logits(deq, seq).astype(np.float64)
    assert np.abs(hf_deq - sg.hf_logits(model, seq)).max() > 1e-2
    _assert_logits_close(ref_forward(str(path), seq), hf_deq, 1e-4, f"{variant} K-mix reference forward")
    _assert_logits_close(_engine_logits(str(path), seq), hf_deq, 1e-3, f"{variant} K-mix engine")


# --- quantizers -------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype,rms_bound", [("Q4_K", 0.12), ("Q5_K", 0.06), ("Q6_K", 0.03),
                                             ("Q8_0", 0.01), ("Q4_0", 0.12)])
def test_quantizers_round_trip_through_gguf_py(qtype, rms_bound):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 4.0, (6, 1))).astype(np.float32)
    x[0] = 0.0  # an all-zero row stays zero
    x[1] = np.abs(x[1])  # non-negative rows (min 0)
    x[2, :256] = -1.5  # a constant block
    t = sg.parse_qtype(qtype)
    enc = sg.quantize_tensor(x, t)
    block, type_size = gguf.GGML_QUANT_SIZES[t]
    assert enc.dtype == np.uint8 and enc.shape == (6, 512 // block * type_size)
    y = gguf.quants.dequantize(enc, t).reshape(x.shape)
    np.testing.assert_array_equal(y[0], 0.0)
    np.testing.assert_allclose(y[2, :256], -1.5, rtol=2e-3)
    for row in range(1, 6):
        rel = np.sqrt(np.mean((y[row] - x[row]) ** 2) / np.mean(x[row] ** 2))
        assert rel < rms_bound, (qtype, row, rel)
    with pytest.raises(ValueError, match="block size"):
        sg.quantize_tensor(x[:, :100], t)


def test_kquant_rows_fall_back_like_llama_quantize(tmp_path):
    # rows of 64 cannot hold 256-value super-blocks: Q4_K -> Q5_0, Q6_K -> Q8_0 (llama-quant.cpp)
    model = sg.random_hf_model("llama", seed=0)
    types = sg.write_gguf(model, tmp_path / "fb.gguf", "Q4_K", tensor_types={"output.weight": "Q6_K"})
    assert types["blk.0.attn_q.weight"] == QT.Q5_0
    assert types["output.weight"] == QT.Q8_0
    assert types["blk.0.attn_norm.weight"] == QT.F32


def test_yarn_context_shift_is_a_pure_rotation(build):
    """Re-rotating cached K by d (``shift_k``) equals RoPE at p + d on a YaRN model: the
    angle blend is linear in the position and the cos/sin magnitude is not applied twice."""
    from opencoti.engine.backend.cpu import CPUBackend

    _, path = build("qwen2_1m_yarn")
    model = load_model(path, Params(), with_tokenizer=False)
    net = model.network(CPUBackend())
    hp = model.hparams
    assert hp.rope_yarn is not None and hp.rope_freq_scale == 0.25 and hp.rope_yarn.n_ctx_orig == 32
    x = np.random.default_rng(0).standard_normal((6, 2, hp.n_rot)).astype(np.float32)
    p, d = np.arange(6) * 7, np.full(6, 11)
    B = CPUBackend()
    base, scale = net.rope_params(0)
    once = B.rope(x, p + d, hp.n_rot, base, scale, "neox", None, **net.rope_ext)
    twice = B.rope(B.rope(x, p, hp.n_rot, base, scale, "neox", None, **net.rope_ext), d, hp.n_rot, base, scale,
                   "neox", None, **net.rope_ext_shift)
    np.testing.assert_allclose(twice, once, atol=2e-5)
    plain = B.rope(x, p + d, hp.n_rot, base, scale, "neox", None)
    assert np.abs(plain - once).max() > 0.1  # YaRN changes the rotation (and its magnitude)
