"""``--override-kv KEY=TYPE:VALUE`` (llama.cpp ``string_parse_kv_override``): parsing,
type checks against the file, and the loader applying overrides before hparams and
tokenizer are read."""

from __future__ import annotations

import re

import pytest

from opencoti.cli import build_params
from opencoti.model.kv_override import (
    KVOverride,
    KVOverrideError,
    apply_kv_overrides,
    parse_kv_override,
    parse_kv_overrides,
)
from opencoti.model.gguf_file import GGUFError
from opencoti.model.loader import load_model
from opencoti.params import Params
from opencoti.tools import synth_gguf as sg


def test_parse_each_type():
    assert parse_kv_override("gemma4.context_length=int:1048576") == \
        KVOverride("gemma4.context_length", "int", 1048576)
    assert parse_kv_override("a.b=float:-2.5e-3") == KVOverride("a.b", "float", -2.5e-3)
    assert parse_kv_override("tokenizer.ggml.add_bos_token=bool:false") == \
        KVOverride("tokenizer.ggml.add_bos_token", "bool", False)
    assert parse_kv_override("x=bool:true").value is True
    assert parse_kv_override("general.name=str:a=b:c") == KVOverride("general.name", "str", "a=b:c")
    assert parse_kv_override("general.name=str:") == KVOverride("general.name", "str", "")
    assert str(parse_kv_override("x=bool:true")) == "x=bool:true"


def test_parse_lists_and_repeats():
    got = parse_kv_overrides(["a=int:1,b=bool:true", '"c=str:x,y",d=float:2', "e=int:-3"])
    assert [(o.key, o.value) for o in got] == [("a", 1), ("b", True), ("c", "x,y"), ("d", 2.0), ("e", -3)]
    assert parse_kv_overrides([]) == []


@pytest.mark.parametrize("spec, needle", [
    ("", "malformed KV override ''"),
    ("no_equals", "malformed KV override"),
    ("=int:1", "malformed KV override"),
    ("k" * 128 + "=int:1", "key longer than 127"),
    ("k=int", "invalid type"),
    ("k=double:1", "invalid type"),
    ("k=int:12x", "'12x' is not an integer"),
    ("k=int:", "'' is not an integer"),
    ("k=float:abc", "'abc' is not a number"),
    ("k=bool:1", "'1' is not true or false"),
    ("k=bool:True", "'True' is not true or false"),
    ("k=str:" + "x" * 128, "value longer than 127 bytes"),
    ("a=int:1,", "malformed KV override ''"),
])
def test_malformed_specs_are_clear_errors(spec, needle):
    with pytest.raises(KVOverrideError, match=needle.replace("(", r"\(")):
        parse_kv_overrides([spec])


def test_apply_checks_types_against_the_file():
    md = {"a.n": 7, "a.f": 1.5, "a.b": True, "a.s": "x", "a.arr": [1, 2]}
    out = apply_kv_overrides(md, parse_kv_overrides(["a.n=int:9,a.f=float:2,a.b=bool:false,a.s=str:y,new.k=int:3"]))
    assert out == {"a.n": 9, "a.f": 2.0, "a.b": False, "a.s": "y", "a.arr": [1, 2], "new.k": 3}
    assert md["a.n"] == 7  # the input is not modified
    with pytest.raises(KVOverrideError, match="bad metadata override type for 'a.n': the file has int"):
        apply_kv_overrides(md, parse_kv_overrides(["a.n=float:1"]))
    with pytest.raises(KVOverrideError, match="the file has bool, the override is int"):
        apply_kv_overrides(md, parse_kv_overrides(["a.b=int:1"]))
    with pytest.raises(KVOverrideError, match="is an array in the file"):
        apply_kv_overrides(md, parse_kv_overrides(["a.arr=int:1"]))


def test_cli_flag_and_env_twin(monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("LLAMA_ARG_")]:
        monkeypatch.delenv(k)
    p = build_params(["--override-kv", "gemma4.context_length=int:1048576",
                      "--override-kv", "tokenizer.ggml.add_bos_token=bool:false,general.name=str:x"])
    assert [str(o) for o in p.kv_overrides] == ["gemma4.context_length=int:1048576",
                                                "tokenizer.ggml.add_bos_token=bool:false", "general.name=str:x"]
    assert build_params([]).kv_overrides == [] == Params().kv_overrides
    monkeypatch.setenv("LLAMA_ARG_OVERRIDE_KV", "a=int:1,b=float:2")
    assert [str(o) for o in build_params([]).kv_overrides] == ["a=int:1", "b=float:2.0"]


def test_cli_malformed_override_is_a_usage_error(monkeypatch):
    import click

    with pytest.raises(click.BadParameter, match="invalid value for KV override 'x=int:abc'"):
        build_params(["--override-kv", "x=int:abc"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvo") / "qwen3.gguf"
    sg.write_random_model("qwen3", path, seed=0)
    return str(path)


def test_loader_applies_overrides_before_hparams_and_tokenizer(tiny):
    plain = load_model(tiny, Params())
    assert plain.hparams.n_ctx_train == 4096 and plain.tokenizer.add_bos is False
    ov = parse_kv_overrides(["qwen3.context_length=int:1048576", "tokenizer.ggml.add_bos_token=bool:true",
                             "qwen3.rope.freq_base=float:5000", "general.name=str:renamed"])
    m = load_model(tiny, Params(kv_overrides=ov))
    assert m.hparams.n_ctx_train == 1048576
    assert m.hparams.rope_freq_base == 5000.0
    assert m.tokenizer.add_bos is True
    assert m.name == "renamed" and m.metadata["general.name"] == "renamed"
    assert m.gguf.metadata["qwen3.context_length"] == 4096  # the file itself is untouched


def test_loader_rejects_a_mistyped_override(tiny):
    with pytest.raises(KVOverrideError, match="bad metadata override type for 'qwen3.context_length'"):
        load_model(tiny, Params(kv_overrides=parse_kv_overrides(["qwen3.context_length=str:big"])))


@pytest.mark.parametrize("spec,needle", [
    ("qwen3.context_length=int:-5", "qwen3.context_length = -5: must be a positive integer"),
    ("qwen3.attention.head_count=int:0", "qwen3.attention.head_count = 0: must be a positive integer"),
    ("qwen3.block_count=int:0", "qwen3.block_count = 0: must be a positive integer"),
    ("qwen3.attention.head_count_kv=int:3", "is not a multiple of qwen3.attention.head_count_kv = 3"),
])
def test_loader_names_a_nonsense_size(tiny, spec, needle):
    """QA: ``int:0`` / negative sizes used to surface as 'integer division or modulo by zero'
    or 'negative dimensions are not allowed'."""
    with pytest.raises(GGUFError, match=re.escape(needle)):
        load_model(tiny, Params(kv_overrides=parse_kv_overrides([spec])))


def test_override_that_matches_nothing_warns_naming_the_key(tiny, caplog):
    """QA: a key neither in the file nor read by the loader has no effect: WARN at boot,
    naming it (and the close file key for a typo); a key the file has, or an optional
    key the loader asks for, is silent; the override still lands in ``metadata``."""
    import logging

    ov = parse_kv_overrides(["qwen3.context_lenght=int:8192",  # typo of qwen3.context_length
                             "zz.nothing=bool:true",
                             "qwen3.context_length=int:8192",  # in the file
                             "qwen3.rope.scaling.factor=float:2"])  # optional key the loader reads
    with caplog.at_level(logging.WARNING, logger="opencoti.model"):
        m = load_model(tiny, Params(kv_overrides=ov))
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 2, warns
    assert "'qwen3.context_lenght' is not in the model file" in warns[0]
    assert "did you mean 'qwen3.context_length'?" in warns[0] and "no effect" in warns[0]
    assert "'zz.nothing' is not in the model file" in warns[1] and "check the key's spelling" in warns[1]
    assert m.hparams.n_ctx_train == 8192 and m.hparams.rope_freq_scale == 0.5  # the real ones applied
    assert m.metadata["zz.nothing"] is True and type(m.metadata) is dict
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="opencoti.model"):
        load_model(tiny, Params())
    assert not caplog.records
