"""JSON schema -> GBNF grammar, as llama.cpp's converter does it
(``common/json-schema-to-grammar.cpp`` and ``examples/json_schema_to_grammar.py``;
the supported subset is listed in llama.cpp's ``grammars/README.md``).

Supported:

- ``type``: object, array, string, number, integer, boolean, null, and lists of
  types; an empty schema ``{}`` means any JSON object (llama.cpp's choice, used for
  ``response_format: {"type": "json_object"}``), a schema with no structural
  keyword (e.g. only ``description``) means any JSON value; ``true`` = any value.
- objects: ``properties`` (emitted in schema order, required ones first, then the
  optional ones, each optional, in order), ``required``, ``additionalProperties``
  (absent or false = none, as llama.cpp; true or a schema = extra keys that are
  not declared property names).
- arrays: ``items``, ``prefixItems`` (or a list ``items``: a fixed tuple,
  followed by extra items when ``items`` is also a schema), ``minItems``,
  ``maxItems``.
- ``enum``, ``const`` (any JSON values, matched as compact JSON text).
- ``anyOf`` / ``oneOf`` (alternatives; sibling keywords are merged into each
  alternative), ``allOf`` (merged: properties, required and the other keywords).
- ``$ref`` to ``#/definitions/...``, ``#/$defs/...`` or any local JSON pointer,
  recursion included; remote references are rejected.
- strings: ``minLength``/``maxLength``, ``pattern`` (a regular-expression subset:
  literals, escapes, ``.``, classes, ``\\d \\w \\s`` and negations, groups,
  ``|``, ``* + ? {m} {m,} {m,n}``; unanchored patterns match anywhere, as JSON
  schema says), ``format`` date, time, date-time, uuid.
- integers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``
  (exact digit-range rules).

Not enforced (as in llama.cpp, these are ignored): number bounds,
``multipleOf``, ``uniqueItems``, ``contains``, ``not``, ``if/then/else``,
``patternProperties``, formats other than the four above. What cannot be
compiled (unknown type, bad ``$ref``, unsupported regex syntax, an empty
integer range, ``false`` schema) raises ``GrammarError``, so a server can answer
400 instead of generating unconstrained text.

Output grammar style: every value rule matches the bare value; containers put
``space`` (``| " " | "\\n"{1,2} [ \\t]{0,20}``, llama.cpp's bounded whitespace)
after ``{``, ``[``, ``:``, ``,`` and after each value; no whitespace at the very
start or end of the document.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

from opencoti.engine.grammar import GrammarError, compile_grammar

__all__ = ["schema_to_grammar", "json_object_grammar", "grammar_from_request", "GrammarError"]

_SPACE = '| " " | "\\n"{1,2} [ \\t]{0,20}'
_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'

# name -> (body, dependencies)
_PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "space": (_SPACE, ()),
    "boolean": ('"true" | "false"', ()),
    "null": ('"null"', ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integer": ('"-"? integral-part', ("integral-part",)),
    "number": ('"-"? integral-part ("." decimal-part)? ([eE] [-+]? integral-part)?',
               ("integral-part", "decimal-part")),
    "char": (_CHAR, ()),
    "string": ('"\\"" char* "\\""', ("char",)),
    "value": ("object | array | string | number | boolean | null",
              ("object", "array", "string", "number", "boolean", "null")),
    "object": ('"{" space ( string space ":" space value space ( "," space string space ":" space value space )* )? "}"',
               ("space", "string", "value")),
    "array": ('"[" space ( value space ( "," space value space )* )? "]"', ("space", "value")),
    "uuid": ('"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
             '[0-9a-fA-F]{12} "\\""', ()),
    "date": ('[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [12] [0-9] | "3" [01] )', ()),
    "time": ('( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? '
             '( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )', ()),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": ('"\\"" date "\\""', ("date",)),
    "time-string": ('"\\"" time "\\""', ("time",)),
    "date-time-string": ('"\\"" date-time "\\""', ("date-time",)),
}
_RESERVED = set(_PRIMITIVES) | {"root", "dot", "any-char"}
_FORMATS = {"date": "date-string", "time": "time-string", "date-time": "date-time-string"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
                "writeOnly", "deprecated", "definitions", "$defs", "$anchor", "format_hint", "strict"}
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_MAX_DIGITS = 16  # integers without a bound get at most 16 digits (llama.cpp's integral-part)


def _literal(text: str) -> str:
    """A GBNF string literal matching ``text`` exactly."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# character sets (for regex patterns): sorted, disjoint inclusive ranges of code points
# ---------------------------------------------------------------------------------------------

_MAXCP = 0x10FFFF


def _norm(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]


def _complement(ranges) -> list[tuple[int, int]]:
    out, cur = [], 0
    for lo, hi in _norm(ranges):
        if lo > cur:
            out.append((cur, lo - 1))
        cur = hi + 1
    if cur <= _MAXCP:
        out.append((cur, _MAXCP))
    return out


def _intersect(a, b) -> list[tuple[int, int]]:
    out = []
    for lo1, hi1 in _norm(a):
        for lo2, hi2 in _norm(b):
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if lo <= hi:
                out.append((lo, hi))
    return _norm(out)


def _class_char(cp: int) -> str:
    c = chr(cp)
    if c in "\\]-^[\"":
        return "\\" + c if c != "^" else "\\x5E"
    if 0x20 <= cp < 0x7F:
        return c
    if cp <= 0xFF:
        return f"\\x{cp:02X}"
    if cp <= 0xFFFF:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def _class(ranges) -> str:
    return "[" + "".join(_class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
                         for lo, hi in ranges) + "]"


_SPECIAL = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # must be escaped inside a JSON string
_SHORT_ESC = {0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t", 0x22: '"', 0x5C: "\\"}


def _json_chars(ranges) -> str:
    """GBNF for one character of the set, written as it appears inside a JSON string
    (quote, backslash and control characters escaped)."""
    ranges = _norm(ranges)
    if not ranges:
        raise GrammarError("pattern: empty character class")
    plain = _intersect(ranges, _complement(_SPECIAL))
    special = _intersect(ranges, _SPECIAL)
    alts = []
    if plain:
        alts.append(_class(plain))
    for lo, hi in special:
        for cp in range(lo, hi + 1):
            esc = _SHORT_ESC.get(cp)
            alts.append(_literal("\\" + esc) if esc else _literal(f"\\u{cp:04x}"))
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE_CHARS = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
_CLASS_ESC = {"d": _DIGIT, "w": _WORD, "s": _SPACE_CHARS}
_DOT = _complement([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)])  # ECMA-262 '.'
_CHAR_ESC = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}


class _Regex:
    """A small regex (ECMA-262 subset) -> GBNF translator for JSON-schema ``pattern``.

    The produced expression matches the *JSON-encoded* characters of a string
    whose decoded value matches the pattern (quotes not included).
    """

    def __init__(self, pattern: str, dotall: bool = False, any_char: str = "char"):
        self.p = pattern
        self.i = 0
        self.dot = [(0, _MAXCP)] if dotall else _DOT
        self.any_char = any_char  # rule name for one JSON string character (unanchored ends)

    def error(self, msg: str) -> GrammarError:
        return GrammarError(f"pattern /{self.p}/: {msg} at index {self.i}")

    def peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def translate(self) -> str:
        p = self.p
        start_anchor = p.startswith("^")
        if start_anchor:
            self.i = 1
        expr = self.alternation(top=True)
        end_anchor = self.i < len(p) and p[self.i] == "$"
        if end_anchor:
            self.i += 1
        if self.i != len(p):
            raise self.error("unsupported or unbalanced syntax" if self.peek() != "$" else "'$' inside the pattern")
        anyc = self.any_char
        return ("" if start_anchor else f"{anyc}* ") + f"({expr})" + ("" if end_anchor else f" {anyc}*")

    def alternation(self, top: bool = False) -> str:
        alts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence())
        return " | ".join(a if a else '""' for a in alts)

    def sequence(self) -> str:
        items: list[str] = []
        while True:
            c = self.peek()
            if c in ("", "|", ")"):
                break
            if c == "$":
                if self.i == len(self.p) - 1:
                    break  # trailing anchor, handled by translate
                raise self.error("'$' is only supported at the end")
            if c == "^":
                raise self.error("'^' is only supported at the start")
            atom = self.atom()
            items.append(self.quantifier(atom))
        return " ".join(items)

    _BRACES = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")

    def at_quantifier(self) -> bool:
        c = self.peek()
        return c in ("*", "+", "?") or (c == "{" and self._BRACES.match(self.p, self.i) is not None)

    def quantifier(self, atom: str) -> str:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            q = c
        elif c == "{" and self._BRACES.match(self.p, self.i):
            m = self._BRACES.match(self.p, self.i)
            self.i = m.end()
            lo = int(m.group(1)) if m.group(1) else 0
            if m.group(2) is None:
                q = f"{{{lo}}}"
            else:
                hi = m.group(3)
                if hi and int(hi) < lo:
                    raise self.error(f"quantifier {{{lo},{hi}}} has max < min")
                q = f"{{{lo},{hi}}}"
        else:
            return atom
        if self.peek() in ("?", "+"):  # lazy / possessive: same language
            self.i += 1
        if self.at_quantifier():
            raise self.error("nested quantifier")
        return f"({atom}){q}"

    def atom(self) -> str:
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?<", self.i) and not self.p.startswith(("?<=", "?<!"), self.i) \
                    or self.p.startswith("?P<", self.i):
                end = self.p.find(">", self.i)
                if end < 0:
                    raise self.error("unterminated group name")
                self.i = end + 1
            elif self.peek() == "?":
                raise self.error("lookaround and inline-flag groups are not supported")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.i += 1
            return f"({inner})" if inner else '""'
        if c == "[":
            return _json_chars(self.char_class())
        if c == ".":
            self.i += 1
            return _json_chars(self.dot)
        if c == "\\":
            return _json_chars(self.escape(in_class=False))
        if self.at_quantifier():
            raise self.error("quantifier without a preceding item")
        if c == ")":
            raise self.error("unbalanced ')'")
        self.i += 1
        return _json_chars([(ord(c), ord(c))])

    def escape(self, in_class: bool) -> list[tuple[int, int]]:
        """Parse ``\\x`` at the cursor; returns the character set it stands for."""
        self.i += 1
        e = self.peek()
        if e == "":
            raise self.error("dangling backslash")
        self.i += 1
        if e.lower() in _CLASS_ESC:
            s = _CLASS_ESC[e.lower()]
            return _complement(s) if e.isupper() else list(s)
        if e in _CHAR_ESC:
            return [(_CHAR_ESC[e], _CHAR_ESC[e])]
        if e == "x" or e == "u":
            n = 2 if e == "x" else 4
            h = self.p[self.i:self.i + n]
            if e == "u" and self.p.startswith("{", self.i):
                end = self.p.find("}", self.i)
                h = self.p[self.i + 1:end] if end > 0 else ""
                n = len(h) + 2
                if not re.fullmatch(r"[0-9a-fA-F]{1,6}", h):
                    raise self.error("bad \\u{...} escape")
            elif not re.fullmatch(r"[0-9a-fA-F]{%d}" % n, h):
                raise self.error(f"bad \\{e} escape")
            self.i += n
            v = int(h, 16)
            return [(v, v)]
        if e == "b" and in_class:
            return [(8, 8)]
        if e.isalnum():
            raise self.error(f"unsupported escape \\{e}")
        return [(ord(e), ord(e))]

    def char_class(self) -> list[tuple[int, int]]:
        self.i += 1  # '['
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c == "":
                raise self.error("missing ']'")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo_set = self.class_atom()
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                hi_set = self.class_atom()
                if len(lo_set) != 1 or lo_set[0][0] != lo_set[0][1] or len(hi_set) != 1 or \
                        hi_set[0][0] != hi_set[0][1]:
                    raise self.error("character class escapes cannot bound a range")
                lo, hi = lo_set[0][0], hi_set[0][0]
                if hi < lo:
                    raise self.error("reversed range in character class")
                ranges.append((lo, hi))
            else:
                ranges.extend(lo_set)
        ranges = _norm(ranges)
        return _complement(ranges) if negate else ranges

    def class_atom(self) -> list[tuple[int, int]]:
        c = self.peek()
        if c == "\\":
            return self.escape(in_class=True)
        self.i += 1
        return [(ord(c), ord(c))]


# ---------------------------------------------------------------------------------------------
# integer ranges
# ---------------------------------------------------------------------------------------------


def _digits(n: int) -> str:
    return "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def _same_len(a: str, b: str) -> str:
    """GBNF for the digit strings of length len(a) == len(b) between a and b (inclusive)."""
    if a == b:
        return f'"{a}"'
    i = 0
    while a[i] == b[i]:
        i += 1
    prefix, a, b = a[:i], a[i:], b[i:]
    n = len(a) - 1
    if n == 0:
        body, n_alts = f"[{a[0]}-{b[0]}]", 1
    else:
        low_full = a[1:] == "0" * n
        high_full = b[1:] == "9" * n
        alts = []
        if not low_full:
            alts.append(f'"{a[0]}" ({_same_len(a[1:], "9" * n)})')
        lo = int(a[0]) + (0 if low_full else 1)
        hi = int(b[0]) - (0 if high_full else 1)
        if lo <= hi:
            alts.append(f"[{lo}-{hi}] {_digits(n)}" if lo != hi else f'"{lo}" {_digits(n)}')
        if not high_full:
            alts.append(f'"{b[0]}" ({_same_len("0" * n, b[1:])})')
        body, n_alts = " | ".join(alts), len(alts)
    if prefix:
        return f'"{prefix}" ({body})'
    return f"({body})" if n_alts > 1 else body


def _nonneg_range(lo: int, hi: Optional[int]) -> str:
    """GBNF for the canonical decimal integers in [lo, hi] (hi None: up to 16 digits)."""
    alts = []
    lo_len = len(str(lo))
    hi_len = len(str(hi)) if hi is not None else max(lo_len, _MAX_DIGITS)
    for k in range(lo_len, hi_len + 1):
        a = max(lo, 10 ** (k - 1) if k > 1 else 0)
        b = 10 ** k - 1 if hi is None else min(hi, 10 ** k - 1)
        if a > b:
            continue
        if hi is None and k > lo_len:
            # every k-digit number, and all longer ones, in one rule
            alts.append(f"[1-9] [0-9]{{{k - 1},{hi_len - 1}}}")
            break
        alts.append(_same_len(str(a), str(b)))
    return " | ".join(alts)


def _int_range(lo: Optional[int], hi: Optional[int]) -> str:
    any_pos = "[1-9] [0-9]{0,%d}" % (_MAX_DIGITS - 1)
    alts = []
    if lo is None or lo < 0:
        # negative numbers -x with x in [max(1, -hi), -lo]
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        if lo is None:
            alts.append(f'"-" ({_nonneg_range(neg_lo, None) if neg_lo > 1 else any_pos})')
        else:
            alts.append(f'"-" ({_nonneg_range(neg_lo, -lo)})')
    if hi is None or hi >= 0:
        alts.append(_nonneg_range(max(lo or 0, 0), hi))
    return " | ".join(f"({a})" for a in alts) if len(alts) > 1 else alts[0]


# ---------------------------------------------------------------------------------------------
# converter
# ---------------------------------------------------------------------------------------------


class SchemaConverter:
    """Builds the rules for one schema (``convert``); see the module doc for the subset.

    prop_order: property names to emit first (llama.cpp's ``--prop-order``);
    dotall: ``.`` in patterns also matches line breaks.
    """

    def __init__(self, schema: Any, prop_order: Optional[list[str]] = None, dotall: bool = False):
        self.schema = schema
        self.prop_order = {n: i for i, n in enumerate(prop_order or [])}
        self.dotall = dotall
        self.rules: dict[str, str] = {}
        self.ref_rules: dict[str, str] = {}

    # -- rules -----------------------------------------------------------------------------
    def add_rule(self, name: str, body: str) -> str:
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", name) or "rule"
        if base in _RESERVED and name != "root":
            base += "-"
        key, i = base, 0
        while key in self.rules and self.rules[key] != body:
            key = f"{base}{i}"
            i += 1
        self.rules[key] = body
        return key

    def primitive(self, name: str) -> str:
        body, deps = _PRIMITIVES[name]
        if name not in self.rules:
            self.rules[name] = body
            for d in deps:
                self.primitive(d)
        return name

    # -- refs ------------------------------------------------------------------------------
    def resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str):
            raise GrammarError(f"$ref must be a string, got {ref!r}")
        if not ref.startswith("#"):
            raise GrammarError(f"unsupported $ref {ref!r}: only local references (#/...) are supported")
        target = self.schema
        frag = ref[1:]
        if frag and not frag.startswith("/"):
            raise GrammarError(f"unsupported $ref {ref!r}: anchors are not supported")
        for part in frag.split("/")[1:] if frag else []:
            from urllib.parse import unquote

            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise GrammarError(f"cannot resolve $ref {ref!r}: {part!r} not found")
        return target

    def visit_ref(self, ref: str) -> str:
        name = self.ref_rules.get(ref)
        if name is not None:
            return name
        target = self.resolve(ref)
        base = "ref" + re.sub(r"[^a-zA-Z0-9-]+", "-", ref[1:])
        name, i = base, 0
        while name in self.rules or name in self.ref_rules.values():
            name = f"{base}{i}"
            i += 1
        self.ref_rules[ref] = name
        self.rules[name] = ""  # reserved while visiting (recursive references resolve to it)
        inner = self.visit(target, name + "-def")
        self.rules[name] = inner
        return name

    # -- schema ----------------------------------------------------------------------------
    def convert(self) -> str:
        top = self.visit(self.schema, "root")
        if top != "root":
            self.rules["root"] = top
        return "\n".join(f"{k} ::= {v}" for k, v in sorted(self.rules.items(), key=lambda kv: kv[0] != "root"))

    def visit(self, schema: Any, name: str) -> str:
        """Rule name matching values of ``schema`` (rules added under names derived from ``name``)."""
        if schema is True:
            return self.primitive("value")
        if schema is False:
            raise GrammarError(f"schema 'false' at {name!r} allows no value")
        if not isinstance(schema, dict):
            raise GrammarError(f"a schema must be an object or a boolean, got {type(schema).__name__} at {name!r}")
        typ = schema.get("type")
        sub = name if name != "root" else ""
        pre = f"{sub}-" if sub else ""

        if "$ref" in schema:
            others = {k: v for k, v in schema.items() if k != "$ref" and k not in _ANNOTATIONS}
            if not others:
                return self.visit_ref(schema["$ref"])
            merged = _merge([self.resolve(schema["$ref"]), others])
            return self.visit(merged, name)

        for key in ("anyOf", "oneOf"):
            if key in schema:
                alts = schema[key]
                if not isinstance(alts, list) or not alts:
                    raise GrammarError(f"{key} must be a non-empty list at {name!r}")
                base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf") and k not in _ANNOTATIONS}
                if base:
                    alts = [_merge([base, self.deref(a)]) for a in alts]
                names = [self.visit(a, f"{pre}{key.lower()}-{i}" if pre else f"alternative-{i}")
                         for i, a in enumerate(alts)]
                return self.add_rule(name, " | ".join(names))

        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or not parts:
                raise GrammarError(f"allOf must be a non-empty list at {name!r}")
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            return self.visit(_merge([rest] + [self.deref(p) for p in parts]), name)

        if isinstance(typ, list):
            if not typ:
                raise GrammarError(f"empty type list at {name!r}")
            names = [self.visit({**schema, "type": t}, f"{pre}{t}" if pre else f"type-{t}") for t in typ]
            return self.add_rule(name, " | ".join(names))
        if typ is not None and typ not in _TYPES:
            raise GrammarError(f"unknown type {typ!r} at {name!r}")

        if "const" in schema:
            return self.add_rule(name, _literal(_json_text(schema["const"])))
        if "enum" in schema:
            vals = schema["enum"]
            if not isinstance(vals, list) or not vals:
                raise GrammarError(f"enum must be a non-empty list at {name!r}")
            return self.add_rule(name, " | ".join(_literal(_json_text(v)) for v in vals))

        if typ in (None, "object") and ("properties" in schema or (
                "additionalProperties" in schema and schema["additionalProperties"] is not True)):
            return self.add_rule(name, self.object_rule(schema, pre))

        if (typ is None and ("items" in schema or "prefixItems" in schema)) or (typ == "array" and any(
                k in schema for k in ("items", "prefixItems", "minItems", "maxItems"))):
            return self.add_rule(name, self.array_rule(schema, pre))

        if typ in (None, "string") and "pattern" in schema:
            pat = schema["pattern"]
            if not isinstance(pat, str):
                raise GrammarError(f"pattern must be a string at {name!r}")
            expr = _Regex(pat, self.dotall, self.primitive("char")).translate()
            return self.add_rule(name, f'"\\"" {expr} "\\""')

        fmt = schema.get("format")
        if typ in (None, "string") and isinstance(fmt, str) and re.fullmatch(r"uuid[1-5]?", fmt):
            return self.primitive("uuid")
        if typ in (None, "string") and fmt in _FORMATS:
            return self.primitive(_FORMATS[fmt])

        if typ == "string" and ("minLength" in schema or "maxLength" in schema):
            lo = _nonneg_int(schema.get("minLength", 0), "minLength")
            hi = schema.get("maxLength")
            hi = None if hi is None else _nonneg_int(hi, "maxLength")
            if hi is not None and hi < lo:
                raise GrammarError(f"maxLength {hi} < minLength {lo} at {name!r}")
            self.primitive("char")
            return self.add_rule(name, f'"\\"" {_repeat("char", lo, hi)} "\\""')

        if typ in (None, "integer") and any(k in schema for k in
                                            ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            lo, hi = _int_bounds(schema, name)
            if lo is None and hi is None:
                return self.primitive("integer")
            return self.add_rule(name, _int_range(lo, hi))

        if typ == "object" or (not schema and name == "root"):
            return self.primitive("object")  # llama.cpp: an empty top-level schema means "a JSON object"
        if typ is None:
            return self.primitive("value")
        return self.primitive(typ)

    def deref(self, s: Any) -> Any:
        while isinstance(s, dict) and "$ref" in s and len([k for k in s if k not in _ANNOTATIONS]) == 1:
            s = self.resolve(s["$ref"])
        return s

    def object_rule(self, schema: dict, pre: str) -> str:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise GrammarError(f"properties must be an object at {pre or 'root'!r}")
        required = schema.get("required", [])
        if not isinstance(required, list):
            raise GrammarError(f"required must be a list at {pre or 'root'!r}")
        names = sorted(props, key=lambda k: (self.prop_order.get(k, len(self.prop_order)), list(props).index(k)))
        kv: dict[str, str] = {}
        self.primitive("space")
        for p in names:
            val = self.visit(props[p], f"{pre}{p}")
            kv[p] = self.add_rule(f"{pre}{p}-kv", f'{_literal(_json_text(p))} space ":" space {val} space')
        req = [p for p in names if p in required]
        opt = [p for p in names if p not in required]
        extra = schema.get("additionalProperties")
        if extra is not None and extra is not False:
            value = self.visit(extra, f"{pre}additional-value") if isinstance(extra, dict) else self.primitive("value")
            key = self.add_rule(f"{pre}additional-k", self.not_strings(names)) if names else self.primitive("string")
            kv["*"] = self.add_rule(f"{pre}additional-kv", f'{key} space ":" space {value} space')
            opt.append("*")
        body = '"{" space '
        body += ' "," space '.join(kv[p] for p in req)
        if opt:
            def tail(items: list[str]) -> str:
                # optional items in order, each with a leading comma
                parts = []
                for p in items:
                    parts.append(f'( "," space {kv[p]} )' + ("*" if p == "*" else "?"))
                return " ".join(parts)

            if req:
                body += " " + tail(opt)
            else:
                alts = []
                for i, p in enumerate(opt):
                    first = kv[p] + (f' ( "," space {kv[p]} )*' if p == "*" else "")
                    rest = opt[i + 1:]
                    if rest:
                        rest_rule = self.add_rule(f"{pre}{p}-rest", tail(rest))
                        first += " " + rest_rule
                    alts.append(first)
                body += "( " + " | ".join(alts) + " )?"
        return body + ' "}"'

    def not_strings(self, names: list[str]) -> str:
        """A JSON string (with quotes) whose raw text is none of ``names`` (JSON-encoded)."""
        self.primitive("char")
        trie: dict = {}
        for n in names:
            node = trie
            for ch in _json_text(n)[1:-1]:
                node = node.setdefault(ch, {})
            node[""] = {}
        hexd = [(0x30, 0x39), (0x41, 0x46), (0x61, 0x66)]
        escd = [(ord(c), ord(c)) for c in '"\\/bfnrt']

        def minus(ranges, kids):
            return _intersect(ranges, _complement([(ord(k), ord(k)) for k in kids]))

        def visit(node: dict, ctx) -> str:
            # ctx: "text", "esc" (after a backslash) or an int (hex digits left in \uXXXX)
            kids = sorted(k for k in node if k)
            alts = []
            for k in kids:
                if ctx == "text":
                    nctx = "esc" if k == "\\" else "text"
                elif ctx == "esc":
                    nctx = 4 if k == "u" else "text"
                else:
                    nctx = ctx - 1 if ctx > 1 else "text"
                alts.append(f"{_literal(k)} {visit(node[k], nctx)}")
            # a first character that leaves every name, then anything
            if ctx == "text":
                excl = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)]
                other = [_class(_complement(excl + [(ord(k), ord(k)) for k in kids]))]
                if "\\" not in kids:
                    other.append('[\\\\] (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4})')
            elif ctx == "esc":
                other = [_class(r) for r in [minus(escd, kids)] if r]
                if "u" not in kids:
                    other.append('"u" [0-9a-fA-F]{4}')
            else:
                rest = minus(hexd, kids)
                other = [_class(rest) + (f" [0-9a-fA-F]{{{ctx - 1}}}" if ctx > 1 else "")] if rest else []
            if other:
                alts.append("( " + " | ".join(other) + " ) char*")
            body = " | ".join(alts) if alts else '""'
            if ctx == "text" and "" not in node:
                return f"( {body} )?"  # a proper prefix of a name (or nothing) is fine
            return f"( {body} )"

        return f'"\\"" {visit(trie, "text")} "\\""'

    def array_rule(self, schema: dict, pre: str) -> str:
        items = schema.get("items")
        prefix = schema.get("prefixItems")
        if isinstance(items, list):  # draft 4-2019: tuple form
            prefix, items = items, schema.get("additionalItems", False)
        lo = _nonneg_int(schema.get("minItems", 0), "minItems")
        hi = schema.get("maxItems")
        hi = None if hi is None else _nonneg_int(hi, "maxItems")
        if hi is not None and hi < lo:
            raise GrammarError(f"maxItems {hi} < minItems {lo} at {pre or 'root'!r}")
        self.primitive("space")
        if prefix is not None:
            if not isinstance(prefix, list):
                raise GrammarError("prefixItems must be a list")
            names = [self.visit(s, f"{pre}tuple-{i}") for i, s in enumerate(prefix)]
            body = '"[" space ' + ' "," space '.join(f"{n} space" for n in names)
            if items not in (None, False) and (hi is None or hi > len(names)):
                item = self.visit(items, f"{pre}item") if items is not True else self.primitive("value")
                extra_hi = None if hi is None else hi - len(names)
                extra_lo = max(0, lo - len(names))
                if names:
                    body += " " + _repeat(f'( "," space {item} space )', extra_lo, extra_hi)
                else:
                    body += _separated(f"{item} space", extra_lo, extra_hi)
            return body + ' "]"'
        item = self.visit(items, f"{pre}item") if items not in (None, True) else self.primitive("value")
        return '"[" space ' + _separated(f"{item} space", lo, hi) + ' "]"'


def _repeat(item: str, lo: int, hi: Optional[int]) -> str:
    if hi == 0:
        return '""'
    if lo == 0 and hi is None:
        return f"{item}*"
    if lo == 1 and hi is None:
        return f"{item}+"
    if lo == 0 and hi == 1:
        return f"{item}?"
    if hi is None:
        return f"{item}{{{lo},}}"
    if lo == hi:
        return f"{item}{{{lo}}}"
    return f"{item}{{{lo},{hi}}}"


def _separated(item: str, lo: int, hi: Optional[int]) -> str:
    """``item ("," space item)*`` with between lo and hi items."""
    if hi == 0:
        return ""
    rest = _repeat(f'( "," space {item} )', max(lo - 1, 0), None if hi is None else hi - 1)
    body = f"{item} {rest}" if rest != '""' else item
    return f"( {body} )?" if lo == 0 else body


def _nonneg_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (isinstance(v, float) and not v.is_integer()):
        raise GrammarError(f"{what} must be a non-negative integer, got {v!r}")
    return int(v)


def _int_bounds(schema: dict, name: str) -> tuple[Optional[int], Optional[int]]:
    def num(key):
        v = schema.get(key)
        if v is None or isinstance(v, bool):
            return v
        if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            raise GrammarError(f"{key} must be a number at {name!r}, got {v!r}")
        return v

    lo = hi = None
    mn, emn, mx, emx = num("minimum"), num("exclusiveMinimum"), num("maximum"), num("exclusiveMaximum")
    if mn is not None and not isinstance(mn, bool):
        lo = math.ceil(mn) if emn is not True else math.floor(mn) + 1  # draft-4 boolean exclusive flag
    if emn is not None and not isinstance(emn, bool):
        v = math.floor(emn) + 1
        lo = v if lo is None else max(lo, v)
    if mx is not None and not isinstance(mx, bool):
        hi = math.floor(mx) if emx is not True else math.ceil(mx) - 1
    if emx is not None and not isinstance(emx, bool):
        v = math.ceil(emx) - 1
        hi = v if hi is None else min(hi, v)
    if lo is not None and hi is not None and lo > hi:
        raise GrammarError(f"integer range [{lo}, {hi}] at {name!r} is empty")
    return lo, hi


def _merge(parts: list) -> dict:
    """Shallow merge of schemas (allOf): properties and required are unioned, other
    keywords from later parts win."""
    out: dict = {}
    props: dict = {}
    required: list = []
    for p in parts:
        if p is True or p == {}:
            continue
        if not isinstance(p, dict):
            raise GrammarError("allOf/anyOf parts must be schema objects")
        for k, v in p.items():
            if k == "properties" and isinstance(v, dict):
                props.update(v)
            elif k == "required" and isinstance(v, list):
                required.extend(x for x in v if x not in required)
            else:
                out[k] = v
    if props:
        out["properties"] = props
    if required:
        out["required"] = required
    return out


def schema_to_grammar(schema: Any, prop_order: Optional[list[str]] = None, dotall: bool = False) -> str:
    """GBNF text for JSON ``schema`` (a dict/bool, or JSON text). The result is checked
    by compiling it. Raises ``GrammarError`` for what cannot be converted."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    try:
        text = SchemaConverter(schema, prop_order, dotall).convert()
    except RecursionError:
        raise GrammarError("the schema nests too deeply") from None
    compile_grammar(text)
    return text


def json_object_grammar() -> str:
    """GBNF for any JSON object (OpenAI ``response_format: {"type": "json_object"}``)."""
    return schema_to_grammar({"type": "object"})


def grammar_from_request(body: dict) -> Optional[str]:
    """The grammar a llama.cpp / OpenAI request body asks for, or None.

    Fields (llama.cpp server): ``grammar`` (GBNF text), ``json_schema`` (a schema),
    ``response_format`` ``{"type": "json_object"[, "schema": ...]}`` or
    ``{"type": "json_schema", "json_schema": {"schema": ...}}`` (also ``"schema"``
    directly), ``{"type": "text"}``. Raises ``GrammarError`` (answer 400) for
    malformed values, both ``grammar`` and ``json_schema``, or a schema/grammar
    that does not compile.
    """
    grammar = body.get("grammar")
    schema = body.get("json_schema")
    rf = body.get("response_format")
    if grammar not in (None, "") and not isinstance(grammar, str):
        raise GrammarError('"grammar" must be a string')
    if rf not in (None, {}):
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise GrammarError('"response_format" must be an object with a string "type"')
        t = rf["type"]
        if t == "json_object":
            schema = rf.get("schema", {"type": "object"})
        elif t == "json_schema":
            js = rf.get("json_schema")
            if isinstance(js, dict) and "schema" in js:
                schema = js["schema"]
            elif "schema" in rf:
                schema = rf["schema"]
            else:
                raise GrammarError('response_format "json_schema" needs "json_schema": {"schema": ...}')
        elif t != "text":
            raise GrammarError(f'response_format type "{t}" is not supported')
    if schema not in (None, "") and grammar not in (None, ""):
        raise GrammarError('either "json_schema" (or response_format) or "grammar" can be given, not both')
    if schema not in (None, ""):
        return schema_to_grammar(schema)
    if grammar:
        compile_grammar(grammar)
        return grammar
    return None
