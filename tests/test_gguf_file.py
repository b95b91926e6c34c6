"""GGUF reading: metadata, every dequantizable tensor type, and bad files."""

import re

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from opencoti.model.gguf_file import GGUFError, GGUFFile
from opencoti.model.loader import load_model

PLAIN = {"F32", "F16", "F64", "I8", "I16", "I32", "I64"}


def _dequantizable():
    out = []
    for t in GGMLQuantizationType:
        if t not in GGML_QUANT_SIZES:
            continue
        block, size = GGML_QUANT_SIZES[t]
        try:
            dequantize(np.zeros((1, size), np.uint8), t)
        except NotImplementedError:
            if t.name not in PLAIN:
                continue
        out.append(t)
    return out


TYPES = _dequantizable()


def test_type_coverage():
    names = {t.name for t in TYPES}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "MXFP4"} <= names


@pytest.fixture(scope="module")
def every_type_file(tmp_path_factory):
    """A GGUF holding one 3-row tensor of every type: random values (plain types) or random block bytes."""
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_string("test.string", "héllo")
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.strs", ["a", "bc"])
    w.add_float32("test.f", 0.5)
    w.add_bool("test.b", True)
    rng = np.random.default_rng(0)
    raws = {}
    for t in TYPES:
        block, size = GGML_QUANT_SIZES[t]
        n_per_row = block * 2 if block > 1 else 8
        if t.name in PLAIN or t.name == "BF16":
            dt = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.float32}.get(t.name)
            if dt is not None:
                vals = rng.standard_normal((3, n_per_row)).astype(dt)
                raw = vals.view(np.uint8) if t.name != "BF16" else (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            else:
                raw = rng.integers(-100, 100, (3, n_per_row)).astype({"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}[t.name]).view(np.uint8)
        else:
            raw = rng.integers(0, 256, (3, n_per_row // block * size), dtype=np.uint8)
        raws[t] = raw.reshape(3, -1)
        w.add_tensor(f"t.{t.name}", raws[t], raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, raws


def test_metadata_roundtrip(every_type_file):
    f = GGUFFile(every_type_file[0])
    assert f.architecture == "llama"
    assert f.get("test.string") == "héllo"
    assert list(f.get("test.ints")) == [1, 2, 3]
    assert f.get("test.strs") == ["a", "bc"]
    assert f.get("test.f") == 0.5 and f.get("test.b") is True


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_every_type_dequantizes_like_gguf(every_type_file, t):
    path, raws = every_type_file
    f = GGUFFile(path)
    info = f.tensors[f"t.{t.name}"]
    assert info.ggml_type == t
    raw = raws[t]
    assert np.array_equal(f.raw(info.name), raw)  # mapped bytes, no copy needed to compare
    got = f.dequantize(info.name, np.float64)
    if t.name in PLAIN:
        want = raw.view({"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                         "I16": np.int16, "I32": np.int32, "I64": np.int64}[t.name])
    else:
        want = dequantize(raw, t)
    assert got.shape == info.shape == want.shape
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want.astype(np.float64)))


def test_bad_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)


def test_truncated_header_and_data(tmp_path, every_type_file):
    data = every_type_file[0].read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:100])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(p)
    p.write_bytes(data[:-10])
    with pytest.raises(GGUFError, match="truncated GGUF file: tensor"):
        GGUFFile(p)


def test_bad_version(tmp_path):
    p = tmp_path / "v.gguf"
    p.write_bytes(b"GGUF" + (99).to_bytes(4, "little") + b"\0" * 16)
    with pytest.raises(GGUFError, match="unsupported GGUF version 99"):
        GGUFFile(p)


def test_unknown_architecture(tmp_path):
    p = tmp_path / "a.gguf"
    w = GGUFWriter(str(p), "mamba9000")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="unknown model architecture 'mamba9000'"):
        load_model(str(p), with_tokenizer=False)


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        load_model("/nonexistent/model.gguf")


def test_real_model_is_memory_mapped(model_path):
    f = GGUFFile(model_path)
    v = f.raw("token_embd.weight")
    assert isinstance(v.base, np.ndarray) or v.base is not None  # a view, not a copy
    assert not v.flags.writeable
    assert f.tensors["token_embd.weight"].ggml_type.name == "Q8_0"
    assert f.tensors["token_embd.weight"].shape == (262144, 640)


def test_unmappable_files_name_the_path(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for p in (empty, tmp_path, "/dev/null"):
        with pytest.raises(GGUFError, match=re.escape(str(p))):
            GGUFFile(p)
