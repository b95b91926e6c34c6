"""The real-shape random-weight GGUF generator (opencoti/tools/synth_shapes.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from opencoti.engine.runner import eval_logits
from opencoti.model.gguf_file import GGUFFile
from opencoti.model.loader import load_model
from opencoti.tools import synth_shapes as S

SMALL = dict(n_layer=3, n_embd=512, n_ff=1024, n_vocab=3000, n_head=8, n_head_kv=2, head_dim=64)


def test_gemma3_270m_preset_matches_the_real_file(model_path):
    """Every tensor of the real gemma-3-270m Q4_K_M: same name, shape and ggml type,
    in the same order; and the preset's hyperparameters are the file's."""
    real = GGUFFile(model_path)
    want = [(n, tuple(int(x) for x in t.ne), t.ggml_type) for n, t in real.tensors.items()]
    got = S.tensor_list(S.PRESETS["gemma-3-270m-q4_k_m"])
    assert sorted(got) == sorted(want)
    md, sh = real.metadata, S.PRESETS["gemma-3-270m-q4_k_m"]
    assert (md["gemma3.embedding_length"], md["gemma3.feed_forward_length"], md["gemma3.block_count"],
            md["gemma3.attention.head_count"], md["gemma3.attention.head_count_kv"],
            md["gemma3.attention.key_length"], md["gemma3.attention.sliding_window"],
            len(md["tokenizer.ggml.tokens"])) == (sh.n_embd, sh.n_ff, sh.n_layer, sh.n_head, sh.n_head_kv,
                                                  sh.head_dim, sh.n_swa, sh.n_vocab)


def test_preset_sizes_match_the_published_files():
    """Tensor bytes of the presets vs the real Q4_K_M files' sizes (GiB, header excluded):
    Qwen2.5-7B 4.36, Llama-3-8B 4.58, Gemma-3-12B 6.79; 270m: the real file's tensor bytes."""
    gib = {k: S.file_bytes(k) / 2**30 for k in S.PRESETS}
    assert abs(gib["qwen2.5-7b-q4_k_m"] - 4.36) < 0.01
    assert abs(gib["llama-3-8b-q4_k_m"] - 4.58) < 0.01
    assert abs(gib["gemma-3-12b-q4_k_m"] - 6.79) < 0.01
    assert S.file_bytes("gemma-3-270m-q4_k_m") == 246_587_904  # the real file: sum of its tensors


def test_use_more_bits_layers():
    assert [i for i in range(18) if S.use_more_bits(i, 18)] == [0, 1, 4, 7, 10, 13, 15, 16, 17]
    q7 = {n: t for n, _, t in S.tensor_list(S.PRESETS["qwen2.5-7b-q4_k_m"])}
    assert q7["output.weight"] == QT.Q6_K and q7["token_embd.weight"] == QT.Q4_K
    assert q7["blk.0.attn_v.weight"] == QT.Q6_K and q7["blk.5.attn_v.weight"] == QT.Q6_K
    assert q7["blk.4.ffn_down.weight"] == QT.Q4_K and q7["blk.27.ffn_down.weight"] == QT.Q6_K
    assert q7["blk.3.attn_q.bias"] == QT.F32


@pytest.mark.parametrize("t", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K,
                               QT.Q6_K, QT.F16, QT.F32])
def test_random_blocks_have_the_target_statistics(t):
    """Dequantized random blocks: mean ~0 and std ~WEIGHT_STD for every block type."""
    import gguf

    data = S.tensor_data("blk.0.ffn_up.weight", (512, 256), t, seed=1)
    x = data.astype(np.float32) if t in (QT.F16, QT.F32) else gguf.quants.dequantize(data, t)
    assert x.shape == (256, 512)
    assert abs(float(x.mean())) < 0.15 * S.WEIGHT_STD
    assert abs(float(x.std()) / S.WEIGHT_STD - 1) < 0.15


def test_written_file_is_deterministic_loads_and_runs(tmp_path):
    """A reduced qwen2.5-7b-shaped file: same seed, same bytes; tensor bytes as
    ``file_bytes``; loads with its tokenizer; finite, non-degenerate logits."""
    a = S.write_model("qwen2.5-7b-q4_k_m", tmp_path / "a.gguf", seed=3, **SMALL)
    b = S.write_model("qwen2.5-7b-q4_k_m", tmp_path / "b.gguf", seed=3, **SMALL)
    assert a.read_bytes() == b.read_bytes()
    g = GGUFFile(str(a))
    assert sum(t.n_bytes for t in g.tensors.values()) == S.file_bytes("qwen2.5-7b-q4_k_m", **SMALL)
    m = load_model(str(a))
    ids = m.tokenizer.tokenize("hello world")
    assert len(ids) >= 2
    lg = eval_logits(m, list(range(5, 40)))
    assert lg.shape == (35, 3000) and np.isfinite(lg).all()
    assert 0.05 < float(lg.std()) < 50
    assert len(set(lg.argmax(-1).tolist())) > 3  # not one collapsed token


def test_gemma3_shaped_file_runs(tmp_path):
    p = S.write_model("gemma-3-12b-q4_k_m", tmp_path / "g.gguf", n_layer=6, n_embd=256, n_ff=512,
                      n_vocab=1000, n_head=4, n_head_kv=2, head_dim=64, n_swa=8)
    m = load_model(str(p))
    assert m.hparams.n_swa == 8
    lg = eval_logits(m, list(range(3, 30)))
    assert np.isfinite(lg).all() and float(lg.std()) > 0.05


# -- Gemma-4 / Qwen3.5 presets (issue 7 benchmarks) ------------------------------------------------
def _types(key):
    return {n: t for n, _, t in S.tensor_list(S.PRESETS[key])}


def _ne(key):
    return {n: ne for n, ne, _ in S.tensor_list(S.PRESETS[key])}


def _counts(key):
    from collections import Counter

    return dict(Counter(t.name for _, _, t in S.tensor_list(S.PRESETS[key])))


def test_gemma4_26b_a4b_preset():
    """30 layers (globals 5, 11, .., 29: no attn_v, K = V), 128 experts of 704, dense MLP 2112.
    658 tensors (the count public Q4_K_M files have); 16.80 GB as ggml-org's Q4_K_M (header ~7 MB)."""
    k = "gemma-4-26b-a4b-q4_k_m"
    ty, ne = _types(k), _ne(k)
    assert len(ty) == 658
    # F32: 13 per layer (scale, q/k norm, 4 norms, router + its scale, expert scale, 3 MoE norms) + 2
    assert _counts(k) == {"F32": 392, "Q4_K": 192, "Q5_0": 32, "Q8_0": 28, "Q6_K": 14}
    assert ne["blk.0.ffn_gate_up_exps.weight"] == (2816, 1408, 128) and ne["blk.0.ffn_down_exps.weight"] == (704, 2816, 128)
    assert ne["blk.5.attn_q.weight"] == (2816, 8192) and ne["blk.5.attn_k.weight"] == (2816, 1024)
    assert ne["blk.4.attn_k.weight"] == (2816, 2048) and "blk.5.attn_v.weight" not in ty
    assert ne["rope_freqs.weight"] == (256,) and ty["token_embd.weight"] == QT.Q6_K and "output.weight" not in ty
    # ffn_down rows 2112 and 704 are not multiples of 256: Q6_K -> Q8_0 on use_more_bits(layer, 30), else Q4_K -> Q5_0
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    for il in range(30):
        want = QT.Q8_0 if il in more else QT.Q5_0
        assert ty[f"blk.{il}.ffn_down.weight"] == want and ty[f"blk.{il}.ffn_down_exps.weight"] == want
        assert ty[f"blk.{il}.ffn_gate_up_exps.weight"] == QT.Q4_K and ty[f"blk.{il}.ffn_gate_inp.weight"] == QT.F32
    # attn_v: use_more_bits over the 25 attn_v tensors (index i, n = 25), not over layers
    v6 = {il for il in range(30) if f"blk.{il}.attn_v.weight" in ty and ty[f"blk.{il}.attn_v.weight"] == QT.Q6_K}
    assert v6 == {0, 1, 2, 6, 9, 13, 16, 20, 24, 25, 26, 27, 28}
    assert S.file_bytes(k) == 16_780_192_888
    assert abs(S.file_bytes(k) / 1e9 - 16.80) < 0.03


def test_gemma4_12b_preset():
    """48 layers (8 global with one KV head of 512 and no attn_v), dense MLP 15360."""
    k = "gemma-4-12b-q4_k_m"
    ty, ne = _types(k), _ne(k)
    assert len(ty) == 667 and _counts(k) == {"F32": 338, "Q4_K": 284, "Q6_K": 45}
    assert ne["blk.11.attn_k.weight"] == (3840, 512) and "blk.11.attn_v.weight" not in ty
    assert ne["blk.10.attn_v.weight"] == (3840, 2048) and ne["blk.10.attn_output.weight"] == (4096, 3840)
    assert ne["blk.11.attn_output.weight"] == (8192, 3840) and ne["blk.0.ffn_down.weight"] == (15360, 3840)
    assert ty["blk.6.ffn_down.weight"] == QT.Q4_K and ty["blk.8.ffn_down.weight"] == QT.Q6_K
    # attn_v index 5 sits on layer 6 (layer 5 is global): use_more_bits(5, 40) is False
    assert ty["blk.6.attn_v.weight"] == QT.Q4_K and ty["blk.8.attn_v.weight"] == QT.Q6_K
    assert S.file_bytes(k) == 7_365_558_464


def test_qwen35_35b_a3b_preset():
    """40 layers: 30 gated delta-net + 10 gated attention, 256 experts of 512 + a shared expert
    in every layer; the attn_v-like tensors (attn_qkv, attn_v) are one per layer. 21.2 GB as
    the published Q4_K_M."""
    k = "qwen3.5-35b-a3b-q4_k_m"
    ty, ne = _types(k), _ne(k)
    assert len(ty) == 733 and _counts(k) == {"F32": 301, "Q4_K": 371, "Q6_K": 61}
    assert ne["blk.0.attn_qkv.weight"] == (2048, 8192) and ne["blk.0.attn_gate.weight"] == (2048, 4096)
    assert ne["blk.0.ssm_conv1d.weight"] == (4, 8192) and ne["blk.0.ssm_out.weight"] == (4096, 2048)
    assert ne["blk.0.ssm_alpha.weight"] == (2048, 32) and ne["blk.0.ssm_a"] == (32,)
    assert ne["blk.3.attn_q.weight"] == (2048, 8192) and ne["blk.3.attn_k.weight"] == (2048, 512)
    assert ne["blk.3.ffn_gate_exps.weight"] == (2048, 512, 256) and ne["blk.3.ffn_down_shexp.weight"] == (512, 2048)
    assert "blk.3.attn_qkv.weight" not in ty and "blk.2.attn_q.weight" not in ty
    more = {il for il in range(40) if S.use_more_bits(il, 40)}
    assert len(more) == 20
    for il in range(40):
        v = f"blk.{il}.attn_v.weight" if (il + 1) % 4 == 0 else f"blk.{il}.attn_qkv.weight"
        want = QT.Q6_K if il in more else QT.Q4_K
        assert ty[v] == want and ty[f"blk.{il}.ffn_down_exps.weight"] == want
        assert ty[f"blk.{il}.ffn_down_shexp.weight"] == want and ty[f"blk.{il}.ffn_up_exps.weight"] == QT.Q4_K
        assert ty[f"blk.{il}.ffn_gate_inp_shexp.weight"] == QT.F32
    assert ty["token_embd.weight"] == QT.Q4_K and ty["output.weight"] == QT.Q6_K
    assert S.file_bytes(k) == 21_155_768_832
    assert abs(S.file_bytes(k) / 1e9 - 21.2) < 0.06


# reduced shapes for CI: 2 layers (one of each kind), small width / vocab / expert count; the
# Gemma-4 expert width 96 keeps the non-256 fallback types (Q5_0 / Q8_0) of the real file
TINY = {
    "gemma-4-26b-a4b-q4_k_m": dict(n_layer=2, swa_period=2, n_embd=256, n_ff=160, n_head=2, n_head_kv=2,
                                   n_head_kv_global=1, n_vocab=1000, n_expert=8, n_expert_used=2, n_ff_exp=96,
                                   n_swa=8),
    "gemma-4-12b-q4_k_m": dict(n_layer=2, swa_period=2, n_embd=256, n_ff=512, n_head=2, n_head_kv=2,
                               n_head_kv_global=1, n_vocab=1000, n_swa=8),
    "qwen3.5-35b-a3b-q4_k_m": dict(n_layer=2, full_attn_interval=2, n_embd=256, n_head=2, n_vocab=1000,
                                   n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, ssm_n_group=2,
                                   ssm_dt_rank=4),
}


@pytest.mark.parametrize("key", sorted(TINY))
def test_reduced_new_presets_load_and_decode(tmp_path, key):
    """The reduced file loads (every tensor used, shapes as the arch expects) and decodes on
    the CPU backend: finite, non-degenerate logits, and one-token decode steps (n_ubatch 1:
    KV / recurrent state carried step to step) equal to a 12-token prefill."""
    p = S.write_model(key, tmp_path / "m.gguf", seed=1, **TINY[key])
    g = GGUFFile(str(p))
    want = {n: (ne, t) for n, ne, t in S.tensor_list(S._shape(key, **TINY[key]))}
    assert {n: (tuple(int(x) for x in t.ne), t.ggml_type) for n, t in g.tensors.items()} == want
    m = load_model(str(p))
    toks = list(range(5, 17))
    pre = eval_logits(m, toks)
    step = eval_logits(m, toks, n_ubatch=1)
    assert pre.shape == (12, 1000) and np.isfinite(pre).all() and np.isfinite(step).all()
    assert 0.05 < float(pre.std()) < 50 and len(set(pre.argmax(-1).tolist())) > 3
    np.testing.assert_allclose(step, pre, atol=2e-3, rtol=0)


def test_decode_bytes_counts_routed_experts_rows_and_head():
    from opencoti.tools.decode_bytes import decode_bytes

    t = [("token_embd.weight", (4, 10), 400), ("blk.0.ffn_up_exps.weight", (4, 8, 4), 1024),
         ("blk.0.attn_q.weight", (4, 4), 64), ("blk.0.ffn_down_exps.scale", (4,), 16),
         ("blk.1.nextn.eh_proj.weight", (8, 4), 128), ("output.weight", (4, 10), 400)]
    d = decode_bytes(t, n_expert=4, n_expert_used=1, n_layer=1)
    assert (d.experts, d.embd_rows, d.output, d.other, d.total, d.file_total) == (256, 40, 400, 80, 776, 2032)
    tied = decode_bytes([x for x in t if x[0] != "output.weight"], 4, 3)  # MTP block kept: n_layer None
    assert (tied.experts, tied.embd_rows, tied.output, tied.other) == (768, 40, 400, 208)
    assert abs(d.bound_tok_s(4.8) - 4.8e12 / 776) < 1e-6
    with pytest.raises(ValueError):
        decode_bytes(t, n_expert=4, n_expert_used=5)


@pytest.mark.parametrize("key", ["gemma-4-26b-a4b-q4_k_m", "qwen3.5-35b-a3b-q4_k_m"])
def test_decode_bytes_of_a_written_moe_file(tmp_path, key):
    """On a reduced file: only n_used / n_expert of every expert tensor, one embedding row,
    the head (tied: token_embd in full), everything else in full."""
    import gguf as G
    from opencoti.tools.decode_bytes import gguf_decode_bytes

    ov = TINY[key]
    g = GGUFFile(str(S.write_model(key, tmp_path / "m.gguf", **ov)))
    d = gguf_decode_bytes(g)
    nb = {n: int(t.n_bytes) for n, t in g.tensors.items()}
    exps = sum(v for n, v in nb.items() if "_exps.weight" in n)
    emb = nb["token_embd.weight"]
    row = G.GGML_QUANT_SIZES[g.tensors["token_embd.weight"].ggml_type]
    row = ov["n_embd"] // row[0] * row[1]
    tied = "output.weight" not in nb
    assert d.file_total == sum(nb.values()) == S.file_bytes(key, **ov)
    assert d.experts == exps * ov["n_expert_used"] // ov["n_expert"] and d.embd_rows == row
    assert d.output == (emb if tied else nb["output.weight"])
    assert d.total == sum(nb.values()) - exps + d.experts - emb + row + (emb if tied else 0)


def test_heads_narrower_than_n_embd_over_n_head(tmp_path, monkeypatch):
    """A llama-shaped file whose heads are 96 wide where n_embd / n_head is 128: synth_shapes
    writes its attention.key_length / value_length, so it loads and decodes; the same file
    without them contradicts itself and fails at load, with a GGUFError naming the q projection's
    shape and the expected one when its network is built (DecoderModel.check_attention_shapes),
    not at the first decode."""
    import gguf

    from opencoti.engine.backend import get_backend
    from opencoti.model.gguf_file import GGUFError

    kw = dict(SMALL, n_embd=512, n_head=4, n_head_kv=2, head_dim=96)
    p = S.write_model("llama-3-8b-q4_k_m", tmp_path / "hd96.gguf", **kw)
    md = GGUFFile(str(p)).metadata
    assert md["llama.attention.key_length"] == 96 and md["llama.attention.value_length"] == 96
    lg = eval_logits(load_model(str(p), with_tokenizer=False), list(range(5, 20)))
    assert lg.shape == (15, 3000) and np.isfinite(lg).all() and float(lg.std()) > 0.05
    for m in ("add_key_length", "add_value_length"):
        monkeypatch.setattr(gguf.GGUFWriter, m, lambda self, n: None)
    bad = S.write_model("llama-3-8b-q4_k_m", tmp_path / "hd96-nokl.gguf", **kw)
    assert "llama.attention.key_length" not in GGUFFile(str(bad)).metadata
    model = load_model(str(bad), with_tokenizer=False)  # (the header alone reads fine)
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight' has shape \(384, 512\), expected \(512, 512\)"):
        model.network(get_backend("cpu"))
