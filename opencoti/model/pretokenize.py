"""BPE pre-tokenization: llama.cpp's per-model split regexes and its regex semantics.

A BPE vocabulary does not merge across "words"; the words come from a list of
regexes chosen by the GGUF key ``tokenizer.ggml.pre``. Each regex in the list
refines the split produced by the previous one: the text between matches is kept
as a word of its own, so nothing is ever dropped.

Sources (llama.cpp, MIT): ``src/llama-vocab.cpp`` (``llm_tokenizer_bpe``: the
regex list of every ``LLAMA_VOCAB_PRE_TYPE_*``, and ``llama_vocab::impl::load``:
which ``tokenizer.ggml.pre`` names select which type and which flags) and
``src/unicode.cpp`` (``unicode_regex_split``).

How llama.cpp evaluates a regex, and how this module reproduces it:

* The GPT-2, Llama-3, Qwen2 and Qwen3.5 patterns (and Kimi-K2's, and the digit
  grouping of AFMoE and Tiny-Aya) have hand-written state machines there that
  behave like the regex over llama.cpp's code point table (Unicode 15.1). Running
  the same patterns through the ``regex`` package, with code points assigned
  after 15.1 replaced by an unassigned stand-in, gives the same split.
* Every other pattern that names a Unicode category runs through C++
  ``std::regex`` on a *collapsed* text: ASCII stays as is, every other code point
  becomes one byte standing for its class (whitespace -> 0x0B, number 0xD1,
  letter 0xD2, punctuation 0xD3, mark 0xD4, symbol 0xD5, anything else 0xD0),
  and ``\\p{X}`` in the pattern becomes ``[<class byte><its ASCII members>]``.
  Quirks follow from that and are kept: ``\\s`` is ASCII whitespace plus the
  0x0B stand-in.
* Patterns without a category (e.g. deepseek's literal ranges) run through
  ``std::wregex`` on the code points, with non-ASCII whitespace replaced by 0x0B.
* ECMAScript ``$`` means end of input (Python ``\\Z``); matching is leftmost,
  first alternative wins, as in Python.

Words are then mapped to GPT-2's byte-level alphabet (``bytes_to_unicode``),
except for the vocabularies that keep raw UTF-8 (Gemma-4: ``byte_encode=False``).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

import regex

# ---------------------------------------------------------------------------
# GPT-2 byte <-> unicode alphabet (llama.cpp unicode.cpp unicode_byte_to_utf8_map;
# OpenAI GPT-2 encoder.py bytes_to_unicode)
# ---------------------------------------------------------------------------


def _byte_alphabet() -> list[str]:
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table: dict[int, str] = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


BYTE_TO_UNICODE: list[str] = _byte_alphabet()
"""``BYTE_TO_UNICODE[b]`` is the one-character stand-in for byte ``b`` (0..255)."""
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
"""Inverse of :data:`BYTE_TO_UNICODE`."""
_BYTE_ENCODE_TABLE = {i: BYTE_TO_UNICODE[i] for i in range(256)}


def byte_encode(word: str) -> str:
    """Map the UTF-8 bytes of ``word`` to GPT-2's byte alphabet (one char per byte)."""
    if word.isascii() and word.isprintable() and " " not in word:
        return word  # 0x21..0x7E map to themselves
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


# ---------------------------------------------------------------------------
# Code point classes, as llama.cpp's unicode-data table has them
# ---------------------------------------------------------------------------
# llama.cpp classifies code points with a table generated from UnicodeData.txt of
# Unicode 15.1 (src/unicode-data.cpp). The `regex` package knows a newer Unicode;
# its \p{N} \p{L} \p{P} \p{M} \p{S} and \s agree with that table on every code
# point except those assigned after 15.1, which the table leaves undefined. They
# are listed here (inclusive ranges) and treated as undefined.
_ASSIGNED_AFTER_15_1 = (
    (0x558, 0x558), (0x58B, 0x58C), (0x5C8, 0x5C9), (0x88F, 0x88F), (0x897, 0x897), (0xB53, 0xB54),
    (0xC5C, 0xC5C), (0xCDC, 0xCDC), (0x1ACF, 0x1AF0), (0x1B4E, 0x1B4F), (0x1B7F, 0x1B7F),
    (0x1C89, 0x1C8A), (0x208F, 0x208F), (0x209D, 0x209F), (0x20C1, 0x20C4), (0x2427, 0x2429),
    (0x2B96, 0x2B96), (0x2E60, 0x2E63), (0x31E4, 0x31E5), (0xA7CB, 0xA7CF), (0xA7D2, 0xA7D2),
    (0xA7D4, 0xA7D4), (0xA7DA, 0xA7DD), (0xA7E2, 0xA7E2), (0xA7F1, 0xA7F1), (0xAB6C, 0xAB6D),
    (0xFBC3, 0xFBD2), (0xFD90, 0xFD91), (0xFDC8, 0xFDCE), (0x105C0, 0x105F3), (0x107BB, 0x107BF),
    (0x10940, 0x10959), (0x10D40, 0x10D65), (0x10D69, 0x10D85), (0x10D8E, 0x10D8F),
    (0x10EC2, 0x10EC7), (0x10EC9, 0x10EEE), (0x10EF0, 0x10EFC), (0x11380, 0x11389),
    (0x1138B, 0x1138B), (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113C0),
    (0x113C2, 0x113C2), (0x113C5, 0x113C5), (0x113C7, 0x113CA), (0x113CC, 0x113D5),
    (0x113D7, 0x113D8), (0x113E1, 0x113E2), (0x116D0, 0x116E3), (0x11B0A, 0x11B0A),
    (0x11B60, 0x11B67), (0x11BC0, 0x11BE1), (0x11BF0, 0x11BF9), (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9), (0x11DF0, 0x11DF1), (0x11F5A, 0x11F5A), (0x1246F, 0x1246F),
    (0x12475, 0x1247F), (0x12550, 0x12686), (0x13460, 0x143FA), (0x16100, 0x16139),
    (0x16D40, 0x16D79), (0x16EA0, 0x16EB8), (0x16EBB, 0x16ED3), (0x16FF2, 0x16FF6),
    (0x187F8, 0x187FF), (0x18CD6, 0x18CDA), (0x18CFF, 0x18CFF), (0x18D09, 0x18D20),
    (0x18D80, 0x18DF2), (0x18E00, 0x19191), (0x191A0, 0x191D2), (0x1B123, 0x1B128),
    (0x1B168, 0x1B168), (0x1CC00, 0x1CCFC), (0x1CD00, 0x1CEB3), (0x1CEBA, 0x1CED0),
    (0x1CED2, 0x1CED4), (0x1CEDD, 0x1CEFD), (0x1D127, 0x1D128), (0x1D1EB, 0x1D1FF),
    (0x1D250, 0x1D281), (0x1D6A6, 0x1D6A6), (0x1DB00, 0x1DB1C), (0x1DF1F, 0x1DF24),
    (0x1DF2B, 0x1DF81), (0x1DF90, 0x1DF96), (0x1DFCD, 0x1DFFF), (0x1E5D0, 0x1E5FA),
    (0x1E5FF, 0x1E5FF), (0x1E6C0, 0x1E6DE), (0x1E6E0, 0x1E6F5), (0x1E6FE, 0x1E6FF),
    (0x1F1AE, 0x1F1AE), (0x1F6D8, 0x1F6D9), (0x1F777, 0x1F77A), (0x1F7DA, 0x1F7DB),
    (0x1F7F1, 0x1F7FF), (0x1F8B2, 0x1F8BB), (0x1F8C0, 0x1F8C1), (0x1F8D0, 0x1F8D8),
    (0x1FA54, 0x1FA57), (0x1FA89, 0x1FA8F), (0x1FABE, 0x1FABE), (0x1FAC6, 0x1FAC6),
    (0x1FAC8, 0x1FAC8), (0x1FACC, 0x1FACD), (0x1FADC, 0x1FADD), (0x1FADF, 0x1FADF),
    (0x1FAE9, 0x1FAEB), (0x1FAEF, 0x1FAEF), (0x1FAF9, 0x1FAFA), (0x1FBCB, 0x1FBEF),
    (0x1FBFA, 0x1FBFA), (0x2B73A, 0x2B73F), (0x2B81E, 0x2B81E), (0x2CEA2, 0x2CEAD),
    (0x323B0, 0x33479), (0x3D000, 0x3FC3F),
)
_NEW_STARTS = [r[0] for r in _ASSIGNED_AFTER_15_1]
_UNDEFINED_STANDIN = 0xFDD0  # a noncharacter: undefined (Cn) in every Unicode version


def _assigned_after_15_1(cp: int) -> bool:
    i = bisect.bisect_right(_NEW_STARTS, cp) - 1
    return i >= 0 and cp <= _ASSIGNED_AFTER_15_1[i][1]


_RX_WS = regex.compile(r"\s")
_RX_CLASSES = (
    (regex.compile(r"\p{N}"), 0xD1),
    (regex.compile(r"\p{L}"), 0xD2),
    (regex.compile(r"\p{P}"), 0xD3),
    (regex.compile(r"\p{M}"), 0xD4),
    (regex.compile(r"\p{S}"), 0xD5),
)


def cpt_class(cp: int) -> int:
    """llama.cpp's view of code point ``cp`` as the byte its collapsed text uses.

    0x0B whitespace, 0xD1 number, 0xD2 letter, 0xD3 punctuation, 0xD4 mark,
    0xD5 symbol, 0xD0 anything else (separator, control, undefined).
    """
    ch = chr(cp)
    if _RX_WS.match(ch):
        return 0x0B
    if _assigned_after_15_1(cp):
        return 0xD0
    for rx, code in _RX_CLASSES:
        if rx.match(ch):
            return code
    return 0xD0


def is_whitespace(ch: str) -> bool:
    """True for the code points llama.cpp flags ``is_whitespace`` (the ``regex`` package's ``\\s``)."""
    return _RX_WS.match(ch) is not None


class _CollapseTable(dict):
    """str.translate table: code point -> its collapsed stand-in (ASCII kept), filled lazily."""

    def __missing__(self, cp: int) -> int:
        v = cp if cp < 128 else cpt_class(cp)
        self[cp] = v
        return v


class _WideTable(dict):
    """str.translate table for the wregex path: non-ASCII whitespace -> 0x0B."""

    def __missing__(self, cp: int) -> int:
        v = 0x0B if cp >= 128 and _RX_WS.match(chr(cp)) else cp
        self[cp] = v
        return v


class _Unicode151Table(dict):
    """str.translate table for the state-machine splitters: post-15.1 code points -> a Cn stand-in."""

    def __missing__(self, cp: int) -> int:
        v = _UNDEFINED_STANDIN if _assigned_after_15_1(cp) else cp
        self[cp] = v
        return v


_COLLAPSE = _CollapseTable()
_WIDE = _WideTable()
_UNICODE151 = _Unicode151Table()

# \p{..} names llama.cpp's collapsed path knows, and what each becomes
_UCAT_CODE = {"N": 0xD1, "L": 0xD2, "P": 0xD3, "M": 0xD4, "S": 0xD5,
              "Lu": 0xD2, "Ll": 0xD2, "Lt": 0xD2, "Lm": 0xD2, "Lo": 0xD2}
_UCAT_ASCII = {
    0xD1: "0-9",
    0xD2: "A-Za-z",
    0xD3: "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    0xD4: "",
    0xD5: "\\$\\+<->^`\\|\\~",
}
_UCAT_RX = re.compile(r"\\p\{([A-Za-z]+)\}")


def _uses_categories(expr: str) -> bool:
    return any(m.group(1) in _UCAT_CODE for m in _UCAT_RX.finditer(expr))


def _ecmascript_to_python(expr: str) -> str:
    """Rewrite the ECMAScript bits that differ in Python: unescaped ``$`` outside [] -> ``\\Z``."""
    out = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "\\" and i + 1 < len(expr):
            out.append(expr[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            out.append(r"\Z")
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _collapse_regex(expr: str) -> str:
    """Translate ``\\p{X}`` into the collapsed-text class, the way unicode_regex_split does."""
    out = []
    inside = False
    i = 0
    n = len(expr)
    while i < n:
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
            i += 1
            continue
        if inside and c == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
            i += 1
            continue
        if c == "\\" and i + 3 < n and expr[i + 1] == "p" and expr[i + 2] == "{":
            close = expr.find("}", i + 3)
            if close != -1 and close <= i + 10:
                name = expr[i + 3:close]
                if name in _UCAT_CODE:
                    code = _UCAT_CODE[name]
                    body = chr(code) + _UCAT_ASCII[code]
                    out.append(body if inside else "[" + body + "]")
                    i = close + 1
                    continue
        out.append(c)
        i += 1
    return "".join(out)


# ---------------------------------------------------------------------------
# The regexes (llama-vocab.cpp llm_tokenizer_bpe, one list per pre-tokenizer type)
# ---------------------------------------------------------------------------

_CONTR = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTR + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
JAIS2 = (_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
         r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
_DEEPSEEK_LETTERS = (  # cased letters; escapes where NFC would rewrite the character
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
    "ℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_ASCII_PUNCT_CLASS = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"""
# deepseek-v3 family: CR/LF are literal characters in llama.cpp's source here ...
_DEEPSEEK3_MAIN = (_ASCII_PUNCT_CLASS + "[A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                   "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
# ... and escapes in AFMoE's copy (same meaning)
_AFMOE_MAIN = (_ASCII_PUNCT_CLASS + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED_WORDS_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTR + r"?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTR + r"?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED_WORDS_GRANITE = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTR + r"?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTR + r"?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER_LOWER = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTR + r"?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTR + r"?")
_BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"
_NEWLINES = r"[^\n]+|[\n]+"
_TINY_AYA_DIGITS_RX = r"\d{1,3}(?=(?:\d{3})*\b)"

# Special markers for the state-machine splitters of unicode.cpp
KIMI_K2 = r"\p{Han}+"
AFMOE_DIGITS = r"\p{AFMoE_digits}"

PRE_TYPE_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "llama3": [LLAMA3],
    "jais2": [JAIS2],
    "dbrx": [LLAMA3],
    "smaug": [LLAMA3],
    "deepseek-llm": ["[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                     r"\s+$", "[一-龥ࠀ-一가-퟿]+", r"\p{N}+"],
    "deepseek3-llm": [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3_MAIN],
    "spark2_5": [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                 _ASCII_PUNCT_CLASS + "[A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+"
                 "|[\r\n]|\\s+(?!\\S)|\\s+", r"\p{N}"],
    "youtu": ["[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
              _UPPER_LOWER + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
    "starcoder": [r"\p{N}", GPT2],
    "gpt2": [GPT2],
    "qwen2": [QWEN2],
    "qwen35": [QWEN35],
    "bloom": [_BLOOM],
    "chatglm4": [LLAMA3],
    "viking": [_BLOOM, r"\p{N}"],
    "tekken": [_TEKKEN],
    "chameleon": ["<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                  r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2],
    "gpt4o": [_CASED_WORDS_GPT4O],
    "granite-emb-multi": [_CASED_WORDS_GRANITE],
    "tiny-aya": [_TINY_AYA_DIGITS_RX,
                 _UPPER_LOWER + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "kimi-k2": [KIMI_K2],
    "superbpe": [r"\p{N}+", r"(?=(\d{3})+(?!\d))"],
    "bailingmoe": [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
    "seed-coder": [_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                   r"|\s+(?!\S)|\s+"],
    "ufakzeka": [r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "afmoe": [AFMOE_DIGITS, "[一-鿿㐀-䶿\u8c48-\ufaff぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
              _AFMOE_MAIN],
    "laguna": [_NEWLINES, QWEN2],
    "exaone-moe": [_CONTR + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"],
    "gemma4": [_NEWLINES],
    "mmbert": [_NEWLINES],
    "minicpm5": [r"\p{N}{1,3}", _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "whitespace": [r"\S+"],
}
"""Regex list per pre-tokenizer type (keys are our names for ``LLAMA_VOCAB_PRE_TYPE_*``)."""

# Types sharing another's list in llama.cpp
for _alias, _same in {
    "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "trillion": "gpt2", "granite-docling": "gpt2",
    "refact": "starcoder", "command-r": "starcoder", "smollm": "starcoder", "codeshell": "starcoder",
    "exaone": "starcoder", "minerva": "starcoder", "mellum2": "starcoder",
    "stablelm2": "qwen2", "hunyuan": "qwen2", "solar-open": "qwen2", "grok-2": "qwen2",
    "poro": "bloom", "gpt3-finnish": "bloom",
    "hunyuan-dense": "deepseek3-llm", "joyai-llm": "deepseek3-llm", "hy-v4": "deepseek3-llm",
    "minimax-m2": "gpt4o", "sarvam-moe": "gemma4",
}.items():
    PRE_TYPE_REGEXES[_alias] = PRE_TYPE_REGEXES[_same]

RAW_UTF8_PRE_TYPES = frozenset({"gemma4", "sarvam-moe", "mmbert", "whitespace"})
"""Pre-tokenizer types whose words are not mapped to the GPT-2 byte alphabet."""


@dataclass(frozen=True)
class PreTokenizerConfig:
    """What one ``tokenizer.ggml.pre`` value selects (llama-vocab.cpp ``impl::load``).

    ``pre_type`` keys :data:`PRE_TYPE_REGEXES`. The booleans are overrides of the
    BPE defaults (clean_spaces=True, ignore_merges=False, escape_whitespaces=False);
    ``None`` leaves the default.
    """

    pre_type: str
    clean_spaces: bool | None = None
    ignore_merges: bool = False
    add_bos: bool | None = None
    escape_whitespaces: bool = False
    no_bos_token: bool = False
    add_sep: bool = False


def _cfg(pre_type: str, **kw) -> PreTokenizerConfig:
    return PreTokenizerConfig(pre_type, **kw)


_NOCLEAN = {"clean_spaces": False}
PRE_NAMES: dict[str, PreTokenizerConfig] = {}
"""``tokenizer.ggml.pre`` value -> :class:`PreTokenizerConfig`."""


def _names(names: tuple[str, ...], cfg: PreTokenizerConfig) -> None:
    for n in names:
        PRE_NAMES[n] = cfg


_names(("default",), _cfg("default"))
_names(("minicpm5",), _cfg("minicpm5", ignore_merges=True))
_names(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
        "jina-v5-nano"), _cfg("llama3", ignore_merges=True, add_bos=True))
_names(("deepseek-llm",), _cfg("deepseek-llm", **_NOCLEAN))
_names(("deepseek-coder",), _cfg("deepseek-coder", **_NOCLEAN))
_names(("deepseek-v3",), _cfg("deepseek3-llm", **_NOCLEAN))
_names(("spark2_5",), _cfg("spark2_5", **_NOCLEAN))
_names(("youtu",), _cfg("youtu", ignore_merges=True, **_NOCLEAN))
_names(("falcon",), _cfg("falcon"))
_names(("mpt",), _cfg("mpt"))
_names(("starcoder",), _cfg("starcoder"))
_names(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
        "mellum", "modern-bert", "exaone4"), _cfg("gpt2"))
_names(("jais-2",), _cfg("jais2"))
_names(("gemma4", "granite-embed-multi-311m"), _cfg("gemma4", escape_whitespaces=True))
_names(("mmbert",), _cfg("mmbert", escape_whitespaces=True))
_names(("sarvam-moe",), _cfg("sarvam-moe", escape_whitespaces=True, **_NOCLEAN))
_names(("jina-v1-en", "jina-v2-code", "roberta-bpe"), _cfg("gpt2", add_sep=True))
_names(("whitespace",), _cfg("whitespace"))
_names(("refact",), _cfg("refact"))
_names(("command-r",), _cfg("command-r", **_NOCLEAN))
_names(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), _cfg("qwen2", **_NOCLEAN))
_names(("megrez",), _cfg("qwen2"))
_names(("qwen35",), _cfg("qwen35", **_NOCLEAN))
_names(("stablelm2",), _cfg("stablelm2"))
_names(("olmo",), _cfg("olmo"))
_names(("dbrx",), _cfg("dbrx"))
_names(("smaug-bpe",), _cfg("smaug"))
_names(("poro-chat",), _cfg("poro", **_NOCLEAN))
_names(("chatglm-bpe",), _cfg("chatglm4", no_bos_token=True))
_names(("glm4", "glm5"), _cfg("chatglm4", no_bos_token=True, ignore_merges=True))
_names(("viking",), _cfg("viking", **_NOCLEAN))
_names(("jais",), _cfg("jais"))
_names(("tekken",), _cfg("tekken", ignore_merges=True, add_bos=True, **_NOCLEAN))
_names(("smollm",), _cfg("smollm", **_NOCLEAN))
_names(("codeshell",), _cfg("codeshell"))
_names(("bloom",), _cfg("bloom"))
_names(("gpt3-finnish",), _cfg("gpt3-finnish"))
_names(("exaone",), _cfg("exaone"))
_names(("exaone-moe",), _cfg("exaone-moe"))
_names(("chameleon",), _cfg("chameleon", add_bos=True, **_NOCLEAN))
_names(("minerva-7b",), _cfg("minerva"))
_names(("gpt-4o", "llama4", "kanana2", "talkie"), _cfg("gpt4o", **_NOCLEAN))
_names(("granite-embed-multi-97m",), _cfg("granite-emb-multi", ignore_merges=True, **_NOCLEAN))
_names(("tiny_aya", "cohere2moe"), _cfg("tiny-aya", **_NOCLEAN))
_names(("superbpe",), _cfg("superbpe", **_NOCLEAN))
_names(("trillion",), _cfg("trillion", **_NOCLEAN))
_names(("granite-docling",), _cfg("granite-docling", **_NOCLEAN))
_names(("bailingmoe", "bailingmoe2", "llada-moe"), _cfg("bailingmoe", **_NOCLEAN))
_names(("seed-coder",), _cfg("seed-coder", **_NOCLEAN))
_names(("hunyuan",), _cfg("hunyuan", **_NOCLEAN))
_names(("hunyuan-dense",), _cfg("hunyuan-dense", **_NOCLEAN))
_names(("hy_v4",), _cfg("hy-v4", **_NOCLEAN))
_names(("joyai-llm",), _cfg("joyai-llm", **_NOCLEAN))
_names(("kimi-k2",), _cfg("kimi-k2", **_NOCLEAN))
_names(("ufakzeka",), _cfg("ufakzeka", **_NOCLEAN))
_names(("grok-2",), _cfg("grok-2", **_NOCLEAN))
_names(("afmoe",), _cfg("afmoe", **_NOCLEAN))
_names(("laguna",), _cfg("laguna", **_NOCLEAN))
_names(("minimax-m2",), _cfg("minimax-m2", **_NOCLEAN))
_names(("solar-open",), _cfg("solar-open", **_NOCLEAN))
_names(("mellum2",), _cfg("mellum2"))


# ---------------------------------------------------------------------------
# Compiled splitters
# ---------------------------------------------------------------------------

# Kimi-K2's state machine (unicode.cpp unicode_regex_split_custom_kimi_k2) as one regex;
# Han is its explicit range list, not the Unicode script.
_HAN = ("\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f"
        "\U0002b820-\U0002ceaf\U0002ceb0-\U0002ebef\uf900-\ufaff\U0002f800-\U0002fa1f")
_KIMI_RX = (f"[{_HAN}]+|[^\\r\\n\\p{{L}}\\p{{N}}]?[[\\p{{L}}]--[{_HAN}]]+{_CONTR}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _Splitter:
    kind: str  # "unicode" (regex pkg on the text), "collapsed", "wide", "digits3"
    rx: object = None


_SPLITTER_CACHE: dict[str, _Splitter] = {}
_TINY_AYA_DIGITS = _TINY_AYA_DIGITS_RX


def _splitter(expr: str) -> _Splitter:
    sp = _SPLITTER_CACHE.get(expr)
    if sp is not None:
        return sp
    if expr == GPT2:
        # unicode.cpp's GPT-2 state machine also takes a lone \s run the pattern leaves
        sp = _Splitter("unicode", regex.compile(GPT2 + r"|\s+"))
    elif expr in (LLAMA3, QWEN2, QWEN35):
        sp = _Splitter("unicode", regex.compile(expr))
    elif expr == KIMI_K2:
        sp = _Splitter("unicode", regex.compile(_KIMI_RX, regex.V1))
    elif expr in (AFMOE_DIGITS, _TINY_AYA_DIGITS):
        sp = _Splitter("digits3")
    elif _uses_categories(expr):
        if any(ord(c) >= 128 for c in expr):
            raise ValueError("regex mixes unicode categories and non-ASCII characters (unsupported, as in llama.cpp)")
        sp = _Splitter("collapsed", re.compile(_ecmascript_to_python(_collapse_regex(expr)), re.ASCII))
    else:
        sp = _Splitter("wide", re.compile(_ecmascript_to_python(expr), re.ASCII))
    _SPLITTER_CACHE[expr] = sp
    return sp


def _split_offsets(rx, text: str, offsets: list[int]) -> list[int]:
    """Apply one regex to each segment; matches and the gaps between them become segments.

    Mirrors unicode.cpp unicode_regex_split_stl (an empty match yields a 0-length entry).
    """
    out: list[int] = []
    start = 0
    finditer = rx.finditer
    for off in offsets:
        seg = text[start:start + off]
        idx = 0
        for m in finditer(seg):
            s, e = m.span()
            if s > idx:
                out.append(s - idx)
            out.append(e - s)
            idx = e
        if idx < off:
            out.append(off - idx)
        start += off
    return out


def _split_digits3(text: str, offsets: list[int]) -> list[int]:
    """unicode.cpp unicode_regex_split_custom_afmoe: digit runs grouped from the right by 3.

    As there, the non-digit text before a digit run is emitted together with the run's first group.
    """
    out: list[int] = []
    start = 0
    for off in offsets:
        ini, end = start, start + off
        prev = ini
        pos = ini
        while pos < end:
            if _is_number(text[pos]):
                d0 = pos
                while pos < end and _is_number(text[pos]):
                    pos += 1
                count = pos - d0
                cur = d0
                rem = count % 3
                if rem:
                    cur += rem
                    if cur - prev > 0:
                        out.append(cur - prev)
                    prev = cur
                while cur < d0 + count:
                    cur += 3
                    if cur - prev > 0:
                        out.append(cur - prev)
                    prev = cur
                continue
            pos += 1
        if prev < end:
            out.append(end - prev)
        start = end
    return out


def _is_number(ch: str) -> bool:
    return ch.isascii() and ch.isdigit() or _COLLAPSE[ord(ch)] == 0xD1


def regex_split(text: str, exprs: list[str]) -> list[str]:
    """Split ``text`` into pre-tokenizer words with llama.cpp's semantics (no byte encoding).

    ``exprs`` is a list from :data:`PRE_TYPE_REGEXES`; each regex refines the
    previous split. Returns the words in order; their concatenation is ``text``
    (empty words, from empty matches, are kept).
    Source: llama.cpp unicode.cpp ``unicode_regex_split``.
    """
    offsets = [len(text)]
    collapsed = wide = uni = None
    for expr in exprs:
        sp = _splitter(expr)
        if sp.kind == "unicode":
            if uni is None:
                uni = text if text.isascii() else text.translate(_UNICODE151)
            res = _split_offsets(sp.rx, uni, offsets)
        elif sp.kind == "digits3":
            res = _split_digits3(text, offsets)
        elif sp.kind == "collapsed":
            if collapsed is None:
                collapsed = text.translate(_COLLAPSE)
            res = _split_offsets(sp.rx, collapsed, offsets)
        else:
            if wide is None:
                wide = text.translate(_WIDE)
            res = _split_offsets(sp.rx, wide, offsets)
        offsets = res
    words = []
    start = 0
    for off in offsets:
        words.append(text[start:start + off])
        start += off
    return words
