"""Gemma-4 parity on random-weight tiny models: our CPU forward vs transformers' ``gemma4``.

Variants (``opencoti.tools.synth_gguf.GEMMA4_VARIANTS``, 64-wide models with the real
head dims):

- ``dense_hd256``: one head dim (256) on every layer, GQA 4:1, final logit softcap;
- ``dense_hd512``: the 31B's attention: global layers with head dim 512, one KV head
  and V = K (no ``attn_v``), sliding layers with head dim 256 and two KV heads
  (``attention.head_count_kv`` is a per-layer array);
- ``moe``: the 26B-A4B's FFN: dense MLP + 8 routed experts (top 2) in every layer;
- ``e_series``: E2B/E4B: per-layer embeddings, the last 4 of 8 layers reuse the KV of
  layers 2 (sliding) and 3 (global), double-wide MLPs on those layers.

Each is written to GGUF (F32, Q8_0, and Q4_0 for one) the way llama.cpp's converter
writes it. Claims, tested separately: the file layout (names, shapes, metadata,
transforms) is the converter's; with an F32 file and an f32 KV cache our logits match
transformers within 1e-4 (measured ~1e-5) with the same argmax at every decisive
position; a quantized file matches transformers run on the file's own dequantized
weights within 1e-4; ubatch splits and interleaved sequences do not change logits;
features we cannot run are refused at load with a message naming them.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

from gguf import GGMLQuantizationType as QT

from opencoti.engine.batch import UBatch
from opencoti.engine.runner import ModelRunner, eval_logits, iter_logits
from opencoti.model.gguf_file import GGUFError, GGUFFile
from opencoti.model.kv_override import parse_kv_overrides
from opencoti.model.loader import load_model
from opencoti.params import Params
from opencoti.tools import synth_gguf as sg

from tinymodels import SEQUENCES

VARIANTS = list(sg.GEMMA4_VARIANTS)
TOL_F32 = 1e-4  # |dlogit| bound, F32 file + f32 KV vs transformers (float32)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(variant, qtype="F32") -> (hf_model, gguf_path); cached."""
    root = tmp_path_factory.mktemp("gemma4")

    @functools.lru_cache(maxsize=None)
    def _build(variant: str, qtype: str = "F32"):
        path = root / f"{variant}-{qtype}.gguf"
        if qtype == "F32":
            model = sg.write_random_model("gemma4", path, qtype, seed=1, **sg.GEMMA4_VARIANTS[variant])
        else:  # the same weights as the F32 file
            model = _build(variant)[0]
            sg.write_gguf(model, path, qtype)
        return model, str(path)

    return _build


def _runner(path: str, n_ubatch: int = 512, kv: str = "f32", n_seq_max: int = 1, overrides=()) -> ModelRunner:
    model = load_model(path, Params(kv_overrides=parse_kv_overrides(overrides)), with_tokenizer=False)
    return ModelRunner(model, n_ctx=256, n_seq_max=n_seq_max, n_ubatch=n_ubatch, type_k=kv, type_v=kv)


def _engine_logits(path: str, tokens: list[int], n_ubatch: int = 512) -> np.ndarray:
    r = _runner(path, n_ubatch)
    return np.concatenate([lg for _, lg in iter_logits(r, tokens)], axis=0)


def _assert_close(ours: np.ndarray, ref: np.ndarray, tol: float, what: str) -> float:
    """max |ours - ref| < tol, and the same argmax wherever ref's top-2 margin exceeds 2x the error."""
    assert ours.shape == ref.shape and np.isfinite(ours).all(), what
    diff = np.abs(ours.astype(np.float64) - ref)
    d = float(diff.max())
    assert d < tol, f"{what}: max |dlogit| = {d:.3g} >= {tol} at {np.unravel_index(diff.argmax(), diff.shape)}"
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * d
    assert decisive.mean() >= 0.9, f"{what}: too few decisive rows for an argmax check"
    bad = np.nonzero((ours.argmax(-1) != ref.argmax(-1)) & decisive)[0]
    assert bad.size == 0, f"{what}: greedy token differs at positions {bad.tolist()}"
    return d


# --- the file ---------------------------------------------------------------------------------

_BASE = {"attn_norm.weight", "attn_q.weight", "attn_q_norm.weight", "attn_output.weight",
         "post_attention_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
         "ffn_down.weight", "post_ffw_norm.weight", "layer_output_scale.weight"}
_KV = {"attn_k.weight", "attn_k_norm.weight"}
_MOE = {"ffn_gate_inp.weight", "ffn_gate_inp.scale", "ffn_gate_up_exps.weight", "ffn_down_exps.weight",
        "ffn_down_exps.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight", "post_ffw_norm_2.weight"}
_PLE = {"inp_gate.weight", "proj.weight", "post_norm.weight"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_layout(build, variant):
    model, path = build(variant)
    cfg = model.config
    n = cfg.num_hidden_layers
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    g = GGUFFile(path)
    md = g.metadata
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    k_eq_v = bool(cfg.attention_k_eq_v)
    n_shared = cfg.num_kv_shared_layers
    moe, ple = bool(cfg.enable_moe_block), bool(cfg.hidden_size_per_layer_input)

    expected = {"token_embd.weight", "output_norm.weight", "rope_freqs.weight"}
    for il in range(n):
        names = set(_BASE)
        if il < n - n_shared:
            names |= _KV | ({"attn_v.weight"} if (swa[il] or not k_eq_v) else set())
        names |= _MOE if moe else set()
        names |= _PLE if ple else set()
        expected |= {f"blk.{il}.{t}" for t in names}
    if ple:
        expected |= {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight"}
    assert set(g.tensors) == expected
    assert all(t.ggml_type == QT.F32 for t in g.tensors.values())

    # metadata: the converter's keys (conversion/gemma.py Gemma4Model.set_gguf_parameters)
    hd_swa, hd_full = 256, cfg.per_layer_config["full_attention"].head_dim
    assert md["general.architecture"] == "gemma4"
    assert md["gemma4.block_count"] == n and md["gemma4.embedding_length"] == 64
    assert md["gemma4.attention.key_length"] == md["gemma4.attention.value_length"] == hd_full
    assert md["gemma4.attention.key_length_swa"] == md["gemma4.attention.value_length_swa"] == hd_swa
    assert md["gemma4.rope.dimension_count"] == hd_full and md["gemma4.rope.dimension_count_swa"] == hd_swa
    assert md["gemma4.rope.freq_base"] == 1e6 and md["gemma4.rope.freq_base_swa"] == 1e4
    assert md["gemma4.attention.sliding_window"] == 8
    assert md["gemma4.attention.sliding_window_pattern"] == swa
    assert md["gemma4.attention.shared_kv_layers"] == n_shared
    assert md["gemma4.embedding_length_per_layer_input"] == (cfg.hidden_size_per_layer_input or 0)
    assert md["gemma4.final_logit_softcapping"] == 30.0
    kv = [cfg.per_layer_config[il].num_key_value_heads for il in range(n)]
    if len(set(kv)) > 1:
        assert md["gemma4.attention.head_count_kv"].tolist() == kv == [1 if not s else 2 for s in swa]
    else:
        assert md["gemma4.attention.head_count_kv"] == kv[0]
    if cfg.use_double_wide_mlp:
        assert md["gemma4.feed_forward_length"].tolist() == [128] * (n - n_shared) + [256] * n_shared
    else:
        assert md["gemma4.feed_forward_length"] == 128
    if moe:
        assert (md["gemma4.expert_count"], md["gemma4.expert_used_count"],
                md["gemma4.expert_feed_forward_length"]) == (8, 2, 32)
    else:
        assert "gemma4.expert_count" not in md

    # proportional RoPE of the global layers: 1 for the rotated quarter of the pairs, 1e30 for the rest
    ff = g.dequantize("rope_freqs.weight")
    assert ff.shape == (hd_full // 2,)
    np.testing.assert_array_equal(ff[: hd_full // 8], 1.0)
    np.testing.assert_array_equal(ff[hd_full // 8:], np.float32(1e30))

    # tensors as HF has them: no norm shift (Gemma-4's RMSNorm multiplies by w), no permutation
    L = "model.layers.0."
    np.testing.assert_array_equal(g.dequantize("blk.0.attn_norm.weight"), sd[L + "input_layernorm.weight"])
    np.testing.assert_array_equal(g.dequantize("blk.0.attn_q.weight"), sd[L + "self_attn.q_proj.weight"])
    np.testing.assert_array_equal(g.dequantize("blk.0.ffn_norm.weight"), sd[L + "pre_feedforward_layernorm.weight"])
    np.testing.assert_array_equal(g.dequantize("blk.0.layer_output_scale.weight"), sd[L + "layer_scalar"])
    np.testing.assert_array_equal(g.dequantize("token_embd.weight"), sd["model.embed_tokens.weight"])
    if moe:
        np.testing.assert_array_equal(g.dequantize("blk.0.ffn_gate_up_exps.weight"), sd[L + "experts.gate_up_proj"])
        assert g.tensors["blk.0.ffn_gate_up_exps.weight"].ne == (64, 64, 8)  # {n_embd, 2*n_ff_exp, n_expert}
        np.testing.assert_array_equal(g.dequantize("blk.0.ffn_down_exps.scale"), sd[L + "router.per_expert_scale"])
        np.testing.assert_array_equal(g.dequantize("blk.0.ffn_gate_inp.scale"), sd[L + "router.scale"])
        np.testing.assert_array_equal(g.dequantize("blk.0.ffn_gate_inp.weight"), sd[L + "router.proj.weight"])
    if ple:
        np.testing.assert_array_equal(g.dequantize("per_layer_token_embd.weight"),
                                      sd["model.embed_tokens_per_layer.weight"])
        assert g.tensors["per_layer_token_embd.weight"].ne == (n * 16, 384)
        assert g.tensors[f"blk.{n - 1}.ffn_up.weight"].ne == (64, 256)  # double-wide on a KV-sharing layer
    g.close()


# --- our engine vs transformers -----------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_matches_transformers(build, variant):
    model, path = build(variant)
    worst = 0.0
    for seq in SEQUENCES:
        hf = sg.hf_logits(model, seq).astype(np.float64)
        assert hf.std() > 1.0  # logits spread over units: the bound is not vacuous
        worst = max(worst, _assert_close(_engine_logits(path, seq), hf, TOL_F32, f"{variant} F32"))
    print(f"{variant}: max |dlogit| = {worst:.2e}")


QUANTIZED = [(v, "Q8_0") for v in VARIANTS] + [("moe", "Q4_0")]


@pytest.mark.parametrize("variant,qtype", QUANTIZED)
def test_quantized_matches_its_dequantized_reference(build, variant, qtype):
    model, path = build(variant, qtype)
    g = GGUFFile(path)
    assert g.tensors["blk.0.ffn_down.weight"].ggml_type == QT[qtype]
    assert g.tensors["blk.0.attn_norm.weight"].ggml_type == QT.F32
    if variant == "moe":
        assert g.tensors["blk.0.ffn_gate_up_exps.weight"].ggml_type == QT[qtype]
        assert g.tensors["blk.0.ffn_gate_inp.weight"].ggml_type == QT.F32  # routers stay F32
    g.close()
    deq = copy.deepcopy(model)
    sg.load_gguf_into_hf(deq, path)
    seq = SEQUENCES[1]
    hf_deq = sg.hf_logits(deq, seq).astype(np.float64)
    # the quantization is visible at this tolerance, so matching the dequantized model means something
    assert np.abs(hf_deq - sg.hf_logits(model, seq)).max() > 1e-2
    _assert_close(_engine_logits(path, seq), hf_deq, TOL_F32, f"{variant} {qtype}")


def test_default_f16_kv_cache(build):
    model, path = build("e_series")
    seq = SEQUENCES[1]
    ours = eval_logits(load_model(path, Params(), with_tokenizer=False), seq)
    _assert_close(ours, sg.hf_logits(model, seq).astype(np.float64), 2e-2, "e_series f16 KV")


@pytest.mark.parametrize("variant", VARIANTS)
def test_ubatch_splits_and_interleaved_sequences(build, variant):
    _, path = build(variant)
    seq = SEQUENCES[1]  # 40 tokens: several windows of 8
    full = _engine_logits(path, seq)
    for n_ubatch in (1, 7):
        np.testing.assert_allclose(_engine_logits(path, seq, n_ubatch), full, atol=2e-5, rtol=0,
                                   err_msg=f"{variant} n_ubatch={n_ubatch}")
    # two sequences interleaved row by row, 3 ubatches of 20 rows
    a, b = SEQUENCES[1][:30], SEQUENCES[2][:30]
    r = _runner(path, n_seq_max=2)
    got = {0: [], 1: []}
    for s in range(0, 30, 10):
        toks, pos, sid = [], [], []
        for i in range(s, s + 10):
            toks += [a[i], b[i]]
            pos += [i, i]
            sid += [0, 1]
        lg = r.decode(UBatch.build(toks, pos, sid, np.arange(20)))
        got[0].append(lg[0::2])
        got[1].append(lg[1::2])
    np.testing.assert_allclose(np.concatenate(got[0]), full[:30], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate(got[1]), _engine_logits(path, b), atol=2e-5, rtol=0)


def test_kv_layout(build):
    """Global and sliding caches carry their own head shapes; KV-sharing layers store nothing."""
    _, path = build("e_series")
    r = _runner(path)
    glob, swa = r.kv.caches
    assert glob.layers == [3] and swa.layers == [0, 1, 2]  # layers 4..7 reuse 2 (sliding) and 3 (global)
    assert glob.k[3].shape[-2:] == (1, 512) and swa.k[0].shape[-2:] == (1, 256)
    assert [r.kv.layer_cache[il] is (glob if il in (3, 7) else swa) for il in range(8)] == [True] * 8
    assert r.model.hparams.kv_reuse == [-1, -1, -1, -1, 2, 2, 2, 3]
    _, path = build("dense_hd512")
    r = _runner(path)
    glob, swa = r.kv.caches
    assert glob.k[2].shape[-2:] == (1, 512) and swa.k[0].shape[-2:] == (2, 256)


def test_context_shift_rerotates_k(build):
    """seq_add on a Gemma-4 cache (per-layer RoPE dims and factors) equals evaluating at the shifted positions."""
    _, path = build("dense_hd512")
    seq = SEQUENCES[0][:12]
    r = _runner(path)
    list(iter_logits(r, seq))  # positions 0..11
    r.seq_add(0, 0, 12, 5)  # now 5..16
    nxt = r.decode(UBatch.build([seq[0]], [17], [0], [0]))
    r2 = _runner(path)
    list(iter_logits(r2, seq, pos0=5))
    ref = r2.decode(UBatch.build([seq[0]], [17], [0], [0]))
    np.testing.assert_allclose(nxt, ref, atol=1e-4, rtol=0)


# --- the MoE op ---------------------------------------------------------------------------------

def test_moe_ffn_op_matches_a_plain_loop():
    from opencoti.engine.backend.cpu import CPUBackend

    rng = np.random.default_rng(0)
    T, D, F, E, K = 9, 16, 8, 6, 3
    x = rng.standard_normal((T, D)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[0, :] = 0.5  # a full tie: lower expert ids win
    gu = rng.standard_normal((E, 2 * F, D)).astype(np.float32)
    down = rng.standard_normal((E, D, F)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, E).astype(np.float32)
    B = CPUBackend()
    for norm_w, act, ds in ((True, "gelu_tanh", scale), (False, "silu", None)):
        got = B.moe_ffn_gate_up(x, logits, gu, down, K, act=act, norm_w=norm_w, down_scale=ds)
        want = np.zeros((T, D))
        for t in range(T):
            p = np.exp(logits[t] - logits[t].max())
            p /= p.sum()
            sel = sorted(range(E), key=lambda e: (-p[e], e))[:K]
            if t == 0:
                assert sel == [0, 1, 2]
            w = p[sel] / (p[sel].sum() if norm_w else 1.0)
            for e, we in zip(sel, w):
                h = gu[e] @ x[t]
                g = B.gelu_tanh(h[:F]) if act == "gelu_tanh" else B.silu(h[:F])
                want[t] += we * (1.0 if ds is None else ds[e]) * (down[e] @ (g * h[F:]))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- refused features ---------------------------------------------------------------------------

def test_override_reaches_the_forward(build):
    """--override-kv rewrites metadata before hparams: a different logit softcap gives
    transformers' logits for that softcap."""
    model, path = build("dense_hd256")
    seq = SEQUENCES[0]
    r = _runner(path, overrides=["gemma4.final_logit_softcapping=float:3.0"])
    ours = np.concatenate([lg for _, lg in iter_logits(r, seq)])
    m3 = copy.deepcopy(model)
    m3.config.final_logit_softcapping = 3.0
    _assert_close(ours, sg.hf_logits(m3, seq).astype(np.float64), TOL_F32, "softcap override")
    assert np.abs(ours).max() < 3.0


@pytest.mark.parametrize("variant,override,needle", [
    # layer 5 (sliding) would read layer 3 (global) in llama.cpp, layer 4 in HF
    ("e_series", "gemma4.attention.shared_kv_layers=int:3", "KV sharing layout not supported"),
    ("dense_hd256", "gemma4.attention.value_length=int:128", "K and V head dims that differ"),
    ("moe", "gemma4.expert_used_count=int:0", "MoE layer 0 needs"),
    ("dense_hd256", "gemma4.attention.sliding_window=int:0", "sliding layers with"),
])
def test_unsupported_metadata_is_refused(build, variant, override, needle):
    _, path = build(variant)
    with pytest.raises(GGUFError, match=needle):
        _runner(path, overrides=[override])


@pytest.mark.parametrize("override, needle", [
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                           "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                              "rope_theta": 1e6}}), "sliding layers' RoPE"),
])
def test_synth_refuses_configs_gguf_cannot_express(override, needle):
    with pytest.raises(ValueError, match=needle):
        sg.tiny_config("gemma4", **override)


def test_synth_cli_writes_a_variant(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert sg.main(["--arch", "gemma4", "--variant", "moe", "--out", str(out), "--qtype", "Q8_0",
                    "--set", "num_experts=4"]) == 0
    g = GGUFFile(out)
    assert g.metadata["gemma4.expert_count"] == 4 and g.tensors["blk.0.ffn_gate_up_exps.weight"].ne[2] == 4
    assert g.tensors["blk.0.ffn_gate_up_exps.weight"].ggml_type == QT.Q8_0
    g.close()
    with pytest.raises(SystemExit):
        sg.main(["--arch", "qwen3", "--variant", "moe", "--out", str(tmp_path / "x.gguf")])
    assert "--variant applies to --arch gemma4 only" in capsys.readouterr().err


def test_attention_biases_are_refused(tmp_path):
    path = tmp_path / "bias.gguf"
    sg.write_random_model("gemma4", path, seed=1, attention_bias=True)
    assert "blk.0.attn_q.bias" in GGUFFile(path).tensors
    with pytest.raises(GGUFError, match=r"tensor\(s\) of features this architecture does not support, "
                                        r"e.g. blk.0.attn_k.bias"):
        _runner(str(path))


def test_moe_needs_the_backend_op(build):
    from opencoti.engine.arch.gemma4 import Gemma4
    from opencoti.engine.backend.cpu import CPUBackend

    class NoMoE:  # a backend whose op set lacks moe_ffn_gate_up (as the Vulkan backend's does today)
        name = "nomoe"

        def __getattr__(self, attr):
            if attr == "moe_ffn_gate_up":
                raise AttributeError(attr)
            return getattr(CPUBackend(), attr)

    _, path = build("moe")
    m = load_model(path, Params(), with_tokenizer=False)
    with pytest.raises(NotImplementedError, match="MoE .routed experts. is not supported on the nomoe backend"):
        Gemma4(m.gguf, m.hparams, NoMoE())
    _, path = build("dense_hd512")  # a dense model needs no such op
    m = load_model(path, Params(), with_tokenizer=False)
    Gemma4(m.gguf, m.hparams, NoMoE())


def test_split_expert_tensors_are_refused(tmp_path, monkeypatch):
    orig = sg.gguf_tensors

    def split(model):  # ffn_gate_exps + ffn_up_exps instead of the fused tensor
        out = []
        for name, data in orig(model):
            if name.endswith("ffn_gate_up_exps.weight"):
                f = data.shape[1] // 2
                out += [(name.replace("gate_up", "gate"), data[:, :f]), (name.replace("gate_up", "up"), data[:, f:])]
            else:
                out.append((name, data))
        return out

    monkeypatch.setattr(sg, "gguf_tensors", split)
    path = tmp_path / "split.gguf"
    sg.write_random_model("gemma4", path, seed=1, **sg.GEMMA4_VARIANTS["moe"])
    with pytest.raises(GGUFError, match="split ffn_gate_exps/ffn_up_exps"):
        _runner(str(path))


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_kv_reaches_attention_as_its_tier(build, kv):
    """-ctk/-ctv on Gemma-4: attention reads the cells through their tier (dequantized),
    so the logits stay near the f32 cache's (q8_0 is near-lossless), also after a context
    shift that re-rotates K through dequantize -> rope -> quantize."""
    _, path = build("dense_hd512")
    seq = SEQUENCES[0][:16]
    want = _engine_logits(path, seq)
    r = _runner(path, kv=kv)
    got = np.concatenate([lg for _, lg in iter_logits(r, seq)])
    tol = 0.05 if kv == "q8_0" else 0.5
    assert np.abs(got - want).max() < tol * max(1.0, float(np.abs(want).max()))
    shifted = []
    for k in ("f32", kv):
        rr = _runner(path, kv=k)
        list(iter_logits(rr, seq[:12]))
        rr.seq_add(0, 0, 12, 5)
        shifted.append(rr.decode(UBatch.build([seq[0]], [17], [0], [0])))
    assert np.abs(shifted[1] - shifted[0]).max() < tol * max(1.0, float(np.abs(shifted[0]).max()))
