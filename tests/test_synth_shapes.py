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
