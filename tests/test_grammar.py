"""GBNF parser, matcher and token masks (opencoti.engine.grammar), sampler integration.

Grammars here are our own small ones in the spirit of llama.cpp's grammars/ folder
(json, arithmetic, list, chess, japanese). Masks are checked against an independent
plain re-implementation of llama.cpp's stack matcher (tests/grammar_helpers.py), on a
synthetic vocabulary and on the real gemma-3 vocabulary.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from grammar_helpers import Ref, random_completion, synthetic_pieces
from opencoti.engine.api import SamplingParams
from opencoti.engine.grammar import (
    Grammar, GrammarError, GrammarMatcher, VocabIndex, compile_grammar, decode_utf8, vocab_index,
)
from opencoti.engine.sampling import Sampler

JSON_GBNF = r"""
# any JSON value at the top, llama.cpp-style
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

ws ::= | " " | "\n" [ \t]{0,20}
"""

ARITH_GBNF = r"""
root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] ws term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
"""

LIST_GBNF = r"""
root ::= item+
# one line per item, no line breaks inside
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
"""

CHESS_GBNF = r"""
root ::= (
    "1. " move " " move "\n"
    ([1-9] [0-9]? ". " move " " move "\n")+
)
move    ::= (pawn | nonpawn | castle) [+#]?
pawn    ::= file ("x" file)? [1-8] ("=" piece)?
nonpawn ::= piece file? [1-8]? "x"? file [1-8]
castle  ::= "O-O" "-O"?
piece   ::= [NBKQR]
file    ::= [a-h]
"""

JAPANESE_GBNF = r"""
root      ::= jp-char+ ([ \t\n] jp-char+)*
jp-char   ::= hiragana | katakana | punct | cjk
hiragana  ::= [ぁ-ゟ]
katakana  ::= [ァ-ヿ]
punct     ::= [、-〾]
cjk       ::= [一-鿿]
"""


def ok(grammar: str, text: str) -> bool:
    return GrammarMatcher(Grammar.parse(grammar)).matches(text)


# -- parser + matcher on strings ----------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ('{"a": 1}', True),
    ('{"a": [1, 2.5e+3, {"b": null}], "c": "x\\n\\u00e9y"}', True),
    ("{}", True),
    ('{\n  "k": true\n}', True),
    ('{"a" 1}', False),
    ("[]", False),  # root is an object
    ('{"a": tru}', False),
    ('{"a": "unterminated}', False),
    ('{"a": 01}', False),
    ('{"a": "bad \\q escape"}', False),
])
def test_json_grammar(text, expected):
    assert ok(JSON_GBNF, text) is expected


@pytest.mark.parametrize("grammar,good,bad", [
    (ARITH_GBNF, ["a+b=c\n", "(x1 * 3) / y = 42\n", "a=b\nc-d=e\n"], ["a+=b\n", "a=b", "=a\n", "A=b\n"]),
    (LIST_GBNF, ["- milk\n", "- milk\n- eggs and ham\n"], ["- \n", "milk\n", "- milk", "- a\rb\n"]),
    (CHESS_GBNF, ["1. e4 e5\n2. Nf3 Nc6\n", "1. d4 Nf6\n2. c4 e6\n10. O-O O-O-O+\n"],
     ["1. e4 e5\n", "1. e9 e5\n2. a3 a6\n", "1. e4 e5\n0. a3 a6\n"]),
    (JAPANESE_GBNF, ["こんにちは", "日本語 テスト、です"], ["hello", "日本 ", ""]),
])
def test_example_grammars(grammar, good, bad):
    m = GrammarMatcher(Grammar.parse(grammar))
    for t in good:
        assert m.matches(t), t
    for t in bad:
        assert not m.matches(t), t


def test_repetitions_exact_counts():
    cases = {
        'root ::= "ab"{2,3}': {2, 3},
        'root ::= "ab"{2}': {2},
        'root ::= "ab"{2,}': set(range(2, 8)),
        'root ::= "ab"{0,2}': {0, 1, 2},
        'root ::= "ab"*': set(range(0, 8)),
        'root ::= "ab"+': set(range(1, 8)),
        'root ::= "ab"?': {0, 1},
        'root ::= ("a" "b"){1,3} "c"?': {1, 2, 3},
    }
    for g, counts in cases.items():
        m = GrammarMatcher(Grammar.parse(g))
        got = {n for n in range(8) if m.matches("ab" * n)}
        assert got == counts, g
    m = GrammarMatcher(Grammar.parse('root ::= ("a" "b"){1,3} "c"?'))
    assert m.matches("ababc") and not m.matches("c")


def test_escapes_classes_and_any_char():
    g = r'root ::= "\x41\u00e9\U0001F600\t\"\\" [\[\]\-a-c] [^x-z\n] . "\n"'
    assert ok(g, 'Aé😀\t"\\]w\x01\n')
    assert ok(g, 'Aé😀\t"\\-ab\n')
    assert not ok(g, 'Aé😀\t"\\dwx\n')  # 'd' not in [\[\]\-a-c]
    assert not ok(g, 'Aé😀\t"\\ay1\n')  # 'y' excluded by [^x-z\n]
    # comments everywhere, newline after '|' continues the rule
    g2 = 'root ::= "a" | # first\n  "b" # second\n# own line\nother ::= "c"'
    assert ok(g2, "a") and ok(g2, "b") and not ok(g2, "c")
    # trailing '-' in a class is literal
    assert ok('root ::= [a-]+', "a-a") and not ok('root ::= [a-]+', "b")
    # '_' accepted in rule names (the README's documented set)
    assert ok('root ::= rule_1\nrule_1 ::= "x"', "x")


def test_dump_rules_shows_rewrites():
    g = Grammar.parse('root ::= "a"{1,2} [b-d]')
    text = g.dump_rules()
    assert text.splitlines()[0] == "root ::= [a] root_1 [b-d]"
    assert "root_1 ::= [a] |" in text


@pytest.mark.parametrize("src,needle", [
    ('root ::= "a" undefined-rule', "undefined rule identifier 'undefined-rule' at line 1"),
    ('start ::= "a"', "does not contain a 'root' rule"),
    ('root ::= root "a"', "left recursion detected in rule 'root'"),
    ('root ::= x "a"\nx ::= y root\ny ::= "b"?', "left recursion"),
    ('root ::= "\\q"', "unknown escape at line 1"),
    ('root ::= "abc', "unexpected end of input"),
    ('root ::= * "a"', "expecting preceding item"),
    ('root ::= "a"{3000}', "exceeds the limit"),
    ('root ::= "a"{3,2}', "below the minimum"),
    ('root "a"', "expecting ::="),
    ('root ::= ("a" | "b"', "expecting ')'"),
    ('root ::= [abc', "unexpected end of input"),
    ('root ::= "a" ) "b"', "expecting newline or end at line 1, column 14"),
    ('root ::= [z-a]', "reversed"),
    ('root ::= "\\x4"', "expecting 2 hex chars"),
    ('root ::= <think>', "needs a vocabulary"),
    ('root ::= "a"\n\nx ::= "b" q', "undefined rule identifier 'q' at line 3, column 11"),
    ("", "empty"),
])
def test_parse_errors(src, needle):
    with pytest.raises(GrammarError) as ei:
        Grammar.parse(src)
    assert needle in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_matcher_state_and_errors():
    m = GrammarMatcher(Grammar.parse('root ::= "ab" ("c" | "")'))
    assert not m.is_complete() and m.can_continue()
    m.accept_string("a")
    with pytest.raises(GrammarError):
        m.accept_string("x")
    m.accept_string("b")  # the failed call changed nothing
    assert m.is_complete() and m.can_continue()
    m.accept_string("c")
    assert m.is_complete() and not m.can_continue()
    m.reset()
    assert not m.is_complete()


def test_partial_utf8_across_accepts():
    m = GrammarMatcher(Grammar.parse("root ::= [日本]+"))
    data = "日本".encode()
    for b in data[:4]:
        m.accept_bytes(bytes([b]))
    assert m.partial[1] == 2 and m.is_complete()  # 日 is complete; llama.cpp ignores the pending bytes
    m.accept_bytes(data[4:])
    assert m.is_complete() and m.partial == (0, 0)
    with pytest.raises(GrammarError):
        GrammarMatcher(Grammar.parse("root ::= [日本]+")).accept_bytes("語".encode())


def test_decode_utf8_like_llama_cpp():
    assert decode_utf8("aé日🙂".encode()) == ([0x61, 0xE9, 0x65E5, 0x1F642], 0, 0)
    assert decode_utf8(b"a\xe6\x97") == ([0x61], 0x6 << 6 | 0x17, 1)
    assert decode_utf8(b"\xa5b", 0x6 << 6 | 0x17, 1) == ([0x65E5, 0x62], 0, 0)
    assert decode_utf8(b"b", 0x6, 2)[2] == -1  # not a continuation byte
    assert decode_utf8(b"\xff")[2] == -1  # opencoti: F8-FF never start UTF-8 (llama.cpp: a 4-byte lead)
    assert decode_utf8(b"\xf4\x90\x80\x80")[2] == -1  # above U+10FFFF
    assert decode_utf8(b"ab\x00cd") == ([0x61, 0x62], 0, 0)


def test_compile_cache_and_left_recursion_free_right_recursion():
    assert compile_grammar('root ::= "x"') is compile_grammar('root ::= "x"')
    g = Grammar.parse('root ::= "(" root ")" | ""')  # right/center recursion is fine
    m = GrammarMatcher(g)
    assert m.matches("((()))") and not m.matches("(()")


# -- token masks --------------------------------------------------------------------------

SYN = synthetic_pieces()
SYN_VI = VocabIndex(SYN, eog_ids=[0])


def ref_mask(g, stacks, partial, vi):
    r = Ref(g)
    return np.array([r.token_allowed(stacks, partial, t, vi.pieces[t], bool(vi.is_eog[t]))
                     for t in range(vi.n_vocab)])


@pytest.mark.parametrize("grammar,prefixes", [
    (JSON_GBNF, ["", "{", '{"na', '{"a": ', '{"a": 1', '{"a": 12.', '{"a": [', '{"a": "x\\', '{"a": "\\u00',
                 '{"a": {}}', '{"日本": "é', '{"a": true}\n']),
    (JAPANESE_GBNF, ["", "日", "日本 "]),
    (LIST_GBNF, ["", "- ", "- a", "- a\n"]),
    ('root ::= "yes" | "no" | "ab" "c"*', ["", "y", "ab", "abcc"]),
    (r'root ::= [^"]* "\"" [🙂€ß]{1,3}', ["", "ab", 'x"', 'x"🙂']),
])
def test_masks_match_reference_on_synthetic_vocab(grammar, prefixes):
    g = Grammar.parse(grammar)
    r = Ref(g)
    for prefix in prefixes:
        m = GrammarMatcher(g, SYN_VI)
        m.accept_string(prefix)
        stacks = r.accept_text(r.initial(), prefix)
        assert set(m.stacks) == set(stacks), prefix  # same llama.cpp stacks
        want = ref_mask(g, stacks, (0, 0), SYN_VI)
        got = m.allowed_mask()
        assert np.array_equal(got, want), (prefix, [SYN[i] for i in np.flatnonzero(got != want)])
        ids = np.array([0, 3, 5, len(SYN) - 1, 120, len(SYN) - 5])
        assert np.array_equal(m.allowed_tokens(ids), want[ids])
        for t in np.flatnonzero(want)[:40]:
            assert m.is_allowed(int(t))


def test_partial_byte_tokens_mask():
    g = Grammar.parse("root ::= [日本é]+")
    r = Ref(g)
    m = GrammarMatcher(g, SYN_VI)
    ids = {p: i for i, p in enumerate(SYN)}
    mask = m.allowed_mask()
    assert mask[ids[b"\xe6"]] and mask[ids[b"\xc3"]] and mask[ids["日本".encode()]] and mask[ids["é".encode()]]
    assert not mask[ids[b"\x97"]] and not mask[ids[b"\xff"]] and not mask[ids[b""]] and not mask[0]
    assert not mask[ids[b"\xf0\x9f"]]  # a 4-byte lead cannot become 日, 本 or é
    m.accept_token(ids[b"\xe6"])
    assert m.partial[1] == 2
    got = m.allowed_mask()
    want = ref_mask(g, r.initial(), m.partial, SYN_VI)
    assert np.array_equal(got, want)
    assert set(np.flatnonzero(got)) == {ids[b"\x97"]}  # E6 97 .. is 日 (U+65E5)
    m.accept_token(ids[b"\x97"])
    assert np.flatnonzero(m.allowed_mask()).tolist() == [ids[b"\xa5"]]
    m.accept_token(ids[b"\xa5"])
    assert m.is_complete() and m.is_allowed(0)
    with pytest.raises(GrammarError):
        m.accept_token(ids[b"a"])


def test_token_elements():
    ids = {p: i for i, p in enumerate(SYN)}
    yes, no = ids[b"yes"], ids[b"no"]
    g = Grammar.parse(f"root ::= <[{yes}]> \" \" !<[{no}]> \"!\"")
    m = GrammarMatcher(g, SYN_VI)
    assert np.flatnonzero(m.allowed_mask()).tolist() == [yes]
    assert not m.is_allowed(ids[b"y"])  # the text "yes" spelt in chars is not the token
    m.accept_token(yes)
    m.accept_token(ids[b" "])
    mask = m.allowed_mask()
    assert not mask[no] and mask[ids[b"ab"]] and mask[yes] and not mask[0] and not mask[ids[b""]]
    m.accept_token(ids[b"ab"])
    assert np.flatnonzero(m.allowed_mask()).tolist() == [ids[b"!"]]
    with pytest.raises(GrammarError):
        Grammar.parse('root ::= <[12]')


def test_random_completions_are_accepted_by_reference():
    rng = np.random.default_rng(5)
    for grammar in (JSON_GBNF, ARITH_GBNF, LIST_GBNF, 'root ::= ("yes" | "no") "."?'):
        g = Grammar.parse(grammar)
        r = Ref(g)
        done = 0
        for _ in range(12):
            out = random_completion(g, SYN_VI, rng)
            if out is None:
                continue
            text = out.decode("utf-8")
            assert any(not s for s in r.accept_text(r.initial(), text)), text
            done += 1
        assert done >= 8


@pytest.fixture(scope="module")
def gemma_tok(model_path):
    from opencoti.model.loader import load_model

    return load_model(model_path).tokenizer


def test_real_vocab_masks(gemma_tok):
    vi = vocab_index(gemma_tok)
    assert vi is vocab_index(gemma_tok) and vi.n_vocab == 262144
    g = Grammar.parse(JSON_GBNF)
    r = Ref(g)
    rng = np.random.default_rng(0)
    sample = rng.choice(vi.n_vocab, 1500, replace=False)
    for prefix, some_allowed, some_rejected in [
        ("{", [b'"', b' "', b"}", b'{"'[1:]], [b"a", b"{", b"<eos>"]),
        ('{"name": "Bo', [b"b", b" Smith", b'"', b'",'], [b"<eos>", b"\n"]),
        ('{"n": 12', [b"3", b",", b"}", b" "], [b"a", b'"']),
        ('{"n": 12}', [b"\n", b" "], [b"1", b"}"]),
    ]:
        m = GrammarMatcher(g, gemma_tok)
        m.accept_string(prefix)
        mask = m.allowed_mask()
        stacks = r.accept_text(r.initial(), prefix)
        check = np.concatenate([sample, np.flatnonzero(mask)[:300]])
        for t in check.tolist():
            want = r.token_allowed(stacks, (0, 0), t, vi.pieces[t], bool(vi.is_eog[t]))
            assert mask[t] == want, (prefix, t, vi.pieces[t])
        ids_of = {}
        for t in range(vi.n_vocab):
            ids_of.setdefault(vi.pieces[t], t)
        for p in some_allowed:
            assert mask[ids_of[p]], (prefix, p)
        for p in some_rejected:
            assert not mask[ids_of[p]], (prefix, p)
    m = GrammarMatcher(g, gemma_tok)
    m.accept_string('{"a": 1}')
    eog = sorted(gemma_tok.eog_ids)
    assert m.allowed_mask()[eog].all()


# -- sampler integration ------------------------------------------------------------------


def _logits(favour: dict[int, float], n: int) -> np.ndarray:
    x = np.zeros(n, dtype=np.float32)
    for t, v in favour.items():
        x[t] = v
    return x


def test_sampler_grammar_greedy_and_resample():
    ids = {p: i for i, p in enumerate(SYN)}
    n = len(SYN)
    g = compile_grammar('root ::= "yes" | "no"')
    s = Sampler(SamplingParams(temperature=0), n, grammar=GrammarMatcher(g, SYN_VI))
    lg = _logits({ids[b"a"]: 9.0, ids[b"no"]: 5.0, ids[b"yes"]: 4.0, 0: 8.0}, n)
    t = s.sample(lg)
    assert t == ids[b"no"]  # 'a' and EOG are masked; best allowed is "no"
    s.accept(t)
    assert s.grammar.is_complete()
    assert s.sample(lg) == 0  # only EOG is left
    # the grammar is not advanced by prompt tokens
    s2 = Sampler(SamplingParams(temperature=0), n, grammar=GrammarMatcher(g, SYN_VI))
    s2.accept_many([ids[b"a"], ids[b"b"]])
    assert s2.history == [ids[b"a"], ids[b"b"]] and not s2.grammar.is_complete()
    assert s2.sample(lg) == ids[b"no"]


def test_sampler_takes_unconstrained_choice_when_allowed():
    n = len(SYN)
    g = compile_grammar("root ::= [a-z]+")
    rng = np.random.default_rng(1)
    for seed in range(5):
        lg = rng.normal(size=n).astype(np.float32)
        for i, p in enumerate(SYN):
            if len(p) == 1 and b"a"[0] <= p[0] <= b"z"[0]:
                lg[i] += 6.0  # make lowercase letters likely
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        free = Sampler(params, n).sample(lg)
        guided = Sampler(params, n, grammar=GrammarMatcher(g, SYN_VI))
        t = guided.sample(lg)
        if GrammarMatcher(g, SYN_VI).is_allowed(free):
            assert t == free  # same draw, no resampling
        assert GrammarMatcher(g, SYN_VI).is_allowed(t)


def test_sampler_resampled_distribution_is_masked():
    n = len(SYN)
    ids = {p: i for i, p in enumerate(SYN)}
    g = compile_grammar('root ::= "x" | "y"')
    lg = _logits({ids[b"q"]: 10.0, ids[b"x"]: 2.0, ids[b"y"]: 2.0}, n)
    seen = set()
    for seed in range(40):
        s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed), n,
                    grammar=GrammarMatcher(g, SYN_VI))
        seen.add(s.sample(lg))
    assert seen == {ids[b"x"], ids[b"y"]}


def test_sampler_dead_grammar_raises():
    n = len(SYN)
    g = compile_grammar(r'root ::= "\u0416"')  # no token can start 'Ж'
    s = Sampler(SamplingParams(temperature=0), n, grammar=GrammarMatcher(g, SYN_VI))
    with pytest.raises(GrammarError):
        s.sample(np.zeros(n, dtype=np.float32))


def test_all_small_strings_agree_with_reference():
    # exhaustive: every string of length <= 4 over a small alphabet, several grammars
    grammars = [ARITH_GBNF, 'root ::= ("a" | "ab")* "b"?', 'root ::= x{1,3}\nx ::= [ab] | "a" "b"',
                'root ::= "a" root? "b" | ""']
    for src in grammars:
        g = Grammar.parse(src)
        r = Ref(g)
        for n in range(5):
            for tup in itertools.product("ab=\n", repeat=n):
                text = "".join(tup)
                ref_ok = any(not s for s in r.accept_text(r.initial(), text))
                assert GrammarMatcher(g).matches(text) == ref_ok, (src, text)
