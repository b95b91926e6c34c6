"""JSON schema -> GBNF (opencoti.engine.json_schema) and constrained generation end to end.

Conversions are checked by behaviour: random completions drawn through the grammar
on a synthetic vocabulary must parse with json.loads and validate against the
schema (a small hand-written validator below; the ``jsonschema`` package is not
installed), exact accept/reject sets for integer ranges and patterns, and the real
gemma-3-270m engine producing schema-valid JSON.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from grammar_helpers import random_completion, synthetic_pieces
from opencoti.engine.api import CompletionRequest, ErrorEvent, FinishEvent, SamplingParams, TokenEvent
from opencoti.engine.grammar import Grammar, GrammarError, GrammarMatcher, VocabIndex
from opencoti.engine.json_schema import grammar_from_request, json_object_grammar, schema_to_grammar

# -- a small validator for the keywords the tests use ---------------------------------------

_FORMATS = {
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "time": r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{3})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
_FORMATS["date-time"] = _FORMATS["date"] + "T" + _FORMATS["time"]


def _resolve(root, ref):
    node = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def valid(x, s, root=None) -> bool:
    root = s if root is None else root
    if s is True or s == {}:
        return True
    if "$ref" in s:
        return valid(x, _resolve(root, s["$ref"]), root)
    if "anyOf" in s or "oneOf" in s:
        return any(valid(x, a, root) for a in s.get("anyOf", s.get("oneOf")))
    if "allOf" in s:
        return all(valid(x, a, root) for a in s["allOf"])
    t = s.get("type")
    if isinstance(t, list):
        return any(valid(x, {**s, "type": tt}, root) for tt in t)
    if "const" in s and x != s["const"]:
        return False
    if "enum" in s and not any(x == v and type(x) is type(v) for v in s["enum"]):
        return False
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if t in types and not isinstance(x, types[t]):
        return False
    if t in ("number", "integer") and (isinstance(x, bool) or not isinstance(x, (int, float))):
        return False
    if t == "integer" and not isinstance(x, int):
        return False
    if isinstance(x, int) and not isinstance(x, bool):
        if "minimum" in s and x < s["minimum"] or "maximum" in s and x > s["maximum"]:
            return False
        if "exclusiveMinimum" in s and x <= s["exclusiveMinimum"]:
            return False
        if "exclusiveMaximum" in s and x >= s["exclusiveMaximum"]:
            return False
    if isinstance(x, str):
        if len(x) < s.get("minLength", 0) or len(x) > s.get("maxLength", 1 << 30):
            return False
        if "pattern" in s and not re.search(s["pattern"], x):
            return False
        if s.get("format") in _FORMATS and not re.fullmatch(_FORMATS[s["format"]], x):
            return False
    if isinstance(x, dict):
        props = s.get("properties", {})
        if any(k not in x for k in s.get("required", [])):
            return False
        extra = s.get("additionalProperties", True)  # JSON Schema's default (the grammars are stricter)
        for k, v in x.items():
            if k in props:
                if not valid(v, props[k], root):
                    return False
            elif extra is False or (isinstance(extra, dict) and not valid(v, extra, root)):
                return False
    if isinstance(x, list):
        if len(x) < s.get("minItems", 0) or len(x) > s.get("maxItems", 1 << 30):
            return False
        pre = s.get("prefixItems", [])
        if len(x) < len(pre):
            return False
        if any(not valid(v, p, root) for v, p in zip(x, pre)):
            return False
        items = s.get("items", True)
        if any(not valid(v, items, root) for v in x[len(pre):]):
            return False
    return True


SYN_VI = VocabIndex(synthetic_pieces(), eog_ids=[0])

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 120},
                                      "b": {"type": "string", "pattern": "^[A-Z]{2}-\\d+$"},
                                      "c": {"enum": ["x", 1, None, [1, 2], {"k": "日本"}]},
                                      "d": {"type": "boolean"}}, "required": ["b"]},
    {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "string", "format": "date"}, {"const": "T"},
                                      {"type": "string", "format": "uuid"}]},
    {"anyOf": [{"type": "null"}, {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 15},
               {"type": "string", "minLength": 2, "maxLength": 3}]},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                                  "maxItems": 2}},
                        "required": ["v"]}},
     "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"name": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": ["integer", "null"]}},
     "additionalProperties": True},
    {"allOf": [{"type": "object", "properties": {"p": {"type": "string", "format": "time"}}, "required": ["p"]},
               {"properties": {"q": {"type": "integer", "minimum": 0}}, "required": ["q"]}]},
    {"type": "object"},
    {"type": "string", "pattern": "ab|c[0-9]?"},
    {"definitions": {"color": {"enum": ["red", "green"]}}, "type": "array",
     "items": {"$ref": "#/definitions/color"}, "maxItems": 3},
    {"type": "object", "properties": {"s": {"type": "string", "format": "date-time"},
                                      "o": {"type": "object", "properties": {"z": {"type": "null"}}}},
     "required": ["s"]},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_random_completions_validate(schema):
    g = Grammar.parse(schema_to_grammar(schema))
    rng = np.random.default_rng(7)
    done = 0
    for _ in range(25):
        out = random_completion(g, SYN_VI, rng)
        if out is None:
            continue
        value = json.loads(out.decode("utf-8"))
        assert valid(value, schema), (out, schema)
        done += 1
    assert done >= 15


@pytest.mark.parametrize("lo,hi", [(-5, 120), (0, 9), (10, 15), (7, 1234), (-300, -17), (None, 42), (None, -7),
                                   (-12, None), (33, None), (0, None), (100, 100), (-1, 0)])
def test_integer_ranges_exact(lo, hi):
    schema = {"type": "integer"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    m = GrammarMatcher(Grammar.parse(schema_to_grammar(schema)))
    for n in list(range(-1500, 1500)) + [10 ** 9, -(10 ** 9), 10 ** 15, 10 ** 16]:
        want = (lo is None or n >= lo) and (hi is None or n <= hi) and abs(n) < 10 ** 16
        assert m.matches(str(n)) == want, (lo, hi, n)
    assert not m.matches("-0") and not m.matches("007") and not m.matches("1.0")


def test_exclusive_and_float_bounds():
    m = GrammarMatcher(Grammar.parse(schema_to_grammar(
        {"type": "integer", "exclusiveMinimum": 2.5, "maximum": 7.9})))
    assert [n for n in range(-3, 12) if m.matches(str(n))] == [3, 4, 5, 6, 7]
    m = GrammarMatcher(Grammar.parse(schema_to_grammar(
        {"type": "integer", "minimum": 3, "exclusiveMaximum": 6})))
    assert [n for n in range(-3, 12) if m.matches(str(n))] == [3, 4, 5]


@pytest.mark.parametrize("pattern,strings", [
    ("^[A-Z]{2}-\\d+$", ["AB-1", "AB-", "ab-1", "ABC-12", "XY-0042"]),
    ("^(foo|ba[rz])?x*$", ["", "foo", "bar", "baz", "bax", "fooxxx", "x", "bay"]),
    ("a.c", ["abc", "xxabcyy", "a\nc", "ac", 'a"c', "a\\c"]),
    ("^[^a-c\"]{1,3}$", ["d", "dd", "ddd", "dddd", "a", '"', "\\", "é"]),
    ("^\\w+@\\w+\\.(com|org)$", ["me@x.com", "me@x.net", "@x.com", "m_e@x1.org"]),
    ("^(?:ab){2}\\s?$", ["abab", "abab ", "ab", "ababab", "abab\t"]),
    ('^"q"\\\\$', ['"q"\\', "q\\", '"q"']),
    ("^\\S\\D$", ["a1", "aa", " a", "1a"]),
])
def test_patterns_match_like_python_re(pattern, strings):
    m = GrammarMatcher(Grammar.parse(schema_to_grammar({"type": "string", "pattern": pattern})))
    for s in strings:
        assert m.matches(json.dumps(s, ensure_ascii=False)) == bool(re.search(pattern, s)), (pattern, s)


def test_additional_property_keys_exclude_declared_names():
    schema = {"type": "object", "properties": {"ab": {"type": "integer"}, "a\"b": {"type": "integer"}},
              "additionalProperties": {"type": "string"}}
    m = GrammarMatcher(Grammar.parse(schema_to_grammar(schema)))
    assert m.matches('{"ab": 1, "zz": "x"}')
    assert m.matches('{"a": "x", "abc": "y", "b": "z", "": "e", "a\\\\b": "f"}')
    assert not m.matches('{"ab": "x"}')  # "ab" is declared: an integer, never an extra key
    assert not m.matches('{"a\\"b": "x"}')
    assert m.matches('{"a\\"b": 3, "a\\"": "x", "a\\"bc": "y"}')


def test_property_order_and_optional_properties():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                               "c": {"type": "integer"}}, "required": ["b"]}
    m = GrammarMatcher(Grammar.parse(schema_to_grammar(schema)))
    assert m.matches('{"b": 1}') and m.matches('{"b": 1, "a": 2}') and m.matches('{"b": 1, "a": 2, "c": 3}')
    assert m.matches('{"b":1,"c":3}')
    assert not m.matches('{"a": 2, "b": 1}')  # required first, then optional in schema order
    assert not m.matches("{}") and not m.matches('{"b": 1, "d": 4}')
    m = GrammarMatcher(Grammar.parse(schema_to_grammar({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}})))
    assert m.matches("{}") and m.matches('{"b": 2}') and m.matches('{"a": 1, "b": 2}')
    assert not m.matches('{"b": 2, "a": 1}') and not m.matches('{, "b": 2}')


def test_json_object_mode_accepts_any_object():
    m = GrammarMatcher(Grammar.parse(json_object_grammar()))
    for text in ['{}', '{"a": [1, {"b": null}], "c": "d\\n", "e": -1.5e+3, "f": true}', '{\n  "x": {}\n}']:
        assert m.matches(text), text
    for text in ["[]", '"s"', "1", '{"a": }', "{} ", " {}"]:
        assert not m.matches(text), text
    assert grammar_from_request({"response_format": {"type": "json_object"}}) == json_object_grammar()


@pytest.mark.parametrize("schema,needle", [
    ({"type": "strng"}, "unknown type 'strng'"),
    ({"$ref": "https://example.com/s.json"}, "only local references"),
    ({"$ref": "#/$defs/missing"}, "cannot resolve $ref"),
    (False, "allows no value"),
    ({"type": "string", "pattern": "^(?=a)b$"}, "lookaround"),
    ({"type": "string", "pattern": "^a\\1$"}, "unsupported escape"),
    ({"type": "string", "pattern": "^(ab$"}, "missing ')'"),
    ({"type": "integer", "minimum": 10, "maximum": 3}, "is empty"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "maxLength 2 < minLength 5"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": -1}, "non-negative integer"),
    ("{not json", "not valid JSON"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 5000}, "exceeds the limit"),
])
def test_schema_errors(schema, needle):
    with pytest.raises(GrammarError) as ei:
        schema_to_grammar(schema)
    assert needle in str(ei.value)


def test_grammar_from_request():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    g1 = grammar_from_request({"json_schema": schema})
    g2 = grammar_from_request({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                        "schema": schema}}})
    g3 = grammar_from_request({"response_format": {"type": "json_object", "schema": schema}})
    assert g1 == g2 == g3 == schema_to_grammar(schema)
    assert grammar_from_request({"grammar": 'root ::= "a"'}) == 'root ::= "a"'
    assert grammar_from_request({}) is None and grammar_from_request({"response_format": {"type": "text"}}) is None
    for body, needle in [({"grammar": 'root ::= "a"', "json_schema": schema}, "not both"),
                         ({"grammar": "root ::= x"}, "undefined rule"),
                         ({"response_format": {"type": "yaml"}}, "not supported"),
                         ({"response_format": "json"}, "must be an object"),
                         ({"grammar": 5}, "must be a string")]:
        with pytest.raises(GrammarError) as ei:
            grammar_from_request(body)
        assert needle in str(ei.value)


# -- end to end on the real model ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_path):
    from opencoti.engine.engine import Engine
    from opencoti.model.loader import load_model
    from opencoti.params import Params

    model = load_model(model_path)
    e = Engine(model, Params(n_ctx=512, n_parallel=2, kv_unified=True, n_ubatch=64)).start()
    yield e
    e.stop()


def generate(engine, prompt, grammar, n_predict=64, **sampling):
    toks = engine.model.tokenizer.tokenize(prompt, add_special=True)
    sp = SamplingParams(grammar=grammar, **{"temperature": 0, **sampling})
    h = engine.submit(CompletionRequest(toks, n_predict=n_predict, sampling=sp))
    evs = list(h.events(timeout=120))
    text = "".join(ev.text for ev in evs if isinstance(ev, (TokenEvent, FinishEvent)))
    return text, evs[-1]


def test_engine_json_person(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    text, fin = generate(engine, "Output a JSON person:", schema_to_grammar(schema))
    assert isinstance(fin, FinishEvent) and fin.stop_type == "eos", (text, fin)
    value = json.loads(text)
    assert valid(value, schema) and set(value) == {"name", "age"}
    # without the grammar the same greedy run is not this JSON (the constraint did the work)
    free, _ = generate(engine, "Output a JSON person:", None, n_predict=12)
    assert free != text[: len(free)]


def test_engine_yes_no_and_sampled_json(engine):
    text, fin = generate(engine, "Is the sky blue? Answer:", 'root ::= "yes" | "no"')
    assert text in ("yes", "no") and fin.stop_type == "eos"
    for seed in (1,):
        text, fin = generate(engine, "Make a JSON object:", json_object_grammar(), n_predict=32,
                             temperature=0.9, seed=seed)
        if fin.stop_type == "eos":
            assert isinstance(json.loads(text), dict)
        else:  # ran out of tokens: what came out is still a valid prefix of an object
            assert fin.stop_type == "limit" and text.startswith("{")
            m = GrammarMatcher(Grammar.parse(json_object_grammar()))
            m.accept_string(text)


def test_engine_rejects_bad_grammar(engine):
    text, ev = generate(engine, "x", 'root ::= "a" missing')
    assert isinstance(ev, ErrorEvent) and ev.status == 400 and "undefined rule identifier 'missing'" in ev.message
