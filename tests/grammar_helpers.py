"""Helpers for the grammar / JSON-schema tests.

- ``synthetic_pieces()``: a small vocabulary (single chars, multi-char tokens,
  partial UTF-8 byte tokens, an invalid byte, an empty piece; id 0 is EOG).
- ``Ref*``: an independent, deliberately plain re-implementation of llama.cpp's
  grammar matching (``src/llama-grammar.cpp``: ``advance_stack`` with a seen-set,
  ``match_char``, ``match_partial_char``, per-stack candidate rejection) over the
  compiled element arrays. It shares nothing with the fast matcher except the
  parser output and ``decode_utf8``, so agreement checks the state machine and the
  trie walk.
- ``random_completion``: sample random allowed tokens until the grammar may end.
"""

from __future__ import annotations

import numpy as np

from opencoti.engine.grammar import (
    ALT, CHAR, CHAR_ALT, CHAR_ANY, CHAR_RNG_UPPER, END, RULE_REF, TOKEN, TOKEN_NOT,
    GrammarMatcher, decode_utf8,
)

MULTI = [
    '{"', '":', '",', '"}', ' "', ', "', "{}", "[]", "[{", "}]", "],", "true", "false", "null", "12", "00",
    "0.", ".5", "e+", "E-", "\\n", '\\"', "\\\\", "\\u00", "name", "age", "ab", "-1", "é", "ü", "日本", "  ",
    "\n  ", "yes", "no", "2024-", "-01", "T12:", ":00Z", "abc", "AB-", "A", "ZZ", "-42", "x1", '":"', '"]',
    "ß", "€", "🙂",
]


def synthetic_pieces() -> list[bytes]:
    pieces = [b"<eos>"]  # id 0: end of generation
    pieces += [bytes([c]) for c in range(0x20, 0x7F)]
    pieces += [b"\n", b"\t", b"\r"]
    pieces += [m.encode("utf-8") for m in MULTI]
    pieces += [b"\xe6", b"\x97", b"\xa5", b"\xc3", b"\xa9", b"\xf0\x9f", b"\x99\x82", b"\xff", b"", b"\x00a"]
    return pieces


class Ref:
    """llama.cpp's stack matcher, written plainly over a compiled ``Grammar``."""

    def __init__(self, g):
        self.g = g
        self.t, self.v = g.etype, g.evalue

    def eos(self, p):
        return self.t[p] in (END, ALT)

    def alts(self, r):
        p = self.g.rule_start[r]
        out = [p]
        while True:
            while not self.eos(p):
                p += 1
            if self.t[p] == END:
                return out
            p += 1
            out.append(p)

    def advance(self, stack):
        out, todo, seen = [], [tuple(stack)], set()
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if not cur:
                if cur not in out:
                    out.append(cur)
                continue
            p = cur[-1]
            if self.t[p] == RULE_REF:
                for a in self.alts(self.v[p]):
                    nxt = cur[:-1]
                    if not self.eos(p + 1):
                        nxt += (p + 1,)
                    if not self.eos(a):
                        nxt += (a,)
                    todo.append(nxt)
            elif cur not in out:
                out.append(cur)
        return out

    def initial(self):
        out = []
        for a in self.alts(self.g.root_id):
            for s in self.advance(() if self.eos(a) else (a,)):
                if s not in out:
                    out.append(s)
        return out

    def match_char(self, p, cp):
        positive = self.t[p] in (CHAR, CHAR_ANY)
        found = False
        while True:
            if self.t[p + 1] == CHAR_RNG_UPPER:
                found = found or self.v[p] <= cp <= self.v[p + 1]
                p += 2
            elif self.t[p] == CHAR_ANY:
                found = True
                p += 1
            else:
                found = found or self.v[p] == cp
                p += 1
            if self.t[p] != CHAR_ALT:
                return found == positive, p

    def match_partial(self, p, val, rem):
        positive = self.t[p] in (CHAR, CHAR_ANY)
        if rem < 0 or (rem == 1 and val < 2):
            return False
        low = val << (rem * 6)
        high = low | ((1 << (rem * 6)) - 1)
        if low == 0:
            low = {2: 1 << 11, 3: 1 << 16}.get(rem, low)
        if low > 0x10FFFF:
            return False  # opencoti: never a code point (llama.cpp lets [^...] accept it)
        while True:
            if self.t[p + 1] == CHAR_RNG_UPPER:
                if self.v[p] <= high and low <= self.v[p + 1]:
                    return positive
                p += 2
            elif self.t[p] == CHAR_ANY:
                return True
            else:
                if low <= self.v[p] <= high:
                    return positive
                p += 1
            if self.t[p] != CHAR_ALT:
                return not positive

    def is_token_top(self, s):
        return bool(s) and self.t[s[-1]] in (TOKEN, TOKEN_NOT)

    def accept_chr(self, stacks, cp):
        out = []
        for s in stacks:
            if not s or self.is_token_top(s):
                continue
            ok, nxt = self.match_char(s[-1], cp)
            if ok:
                for n in self.advance(s[:-1] + (() if self.eos(nxt) else (nxt,))):
                    if n not in out:
                        out.append(n)
        return out

    def accept_text(self, stacks, text: str):
        for ch in text:
            stacks = self.accept_chr(stacks, ord(ch))
        return stacks

    def stack_accepts(self, s, cps, val, rem):
        if not s:
            return not cps and rem == 0
        if self.is_token_top(s):
            return not cps and rem == 0
        if not cps:
            return rem == 0 or self.match_partial(s[-1], val, rem)
        ok, nxt = self.match_char(s[-1], cps[0])
        if not ok:
            return False
        return any(self.stack_accepts(n, cps[1:], val, rem)
                   for n in self.advance(s[:-1] + (() if self.eos(nxt) else (nxt,))))

    def token_allowed(self, stacks, partial, tid, piece, is_eog):
        """llama.cpp ``llama_grammar_apply_impl`` for one candidate."""
        if is_eog:
            return any(not s for s in stacks)
        if not piece or piece[0] == 0:
            return False
        cps, val, rem = decode_utf8(piece, *partial)
        if rem < 0:
            return False
        for s in stacks:
            if self.is_token_top(s) and partial[1] == 0:
                p = s[-1]
                if cps and (self.v[p] == tid) == (self.t[p] == TOKEN):
                    return True
                continue
            if self.stack_accepts(s, cps, val, rem):
                return True
        return False


def random_completion(g, vi, rng, max_steps: int = 400, p_stop: float = 0.4):
    """Random allowed tokens until EOG (bias toward closing tokens as steps grow).
    Returns the bytes, or None when ``max_steps`` ran out."""
    m = GrammarMatcher(g, vi)
    out = bytearray()
    for step in range(max_steps):
        mask = m.allowed_mask()
        ids = np.flatnonzero(mask)
        non = [int(i) for i in ids if not vi.is_eog[i]]
        if mask[vi.is_eog].any() and (not non or rng.random() < p_stop):
            return bytes(out)
        assert non, f"dead end after {bytes(out)!r}"
        if step > 20 and rng.random() < min(0.95, step / 60):
            closers = [i for i in non if any(c in vi.pieces[i] for c in b'"}]\n=.')]
            if closers:
                non = closers
        t = non[int(rng.integers(len(non)))]
        m.accept_token(t)
        out += vi.pieces[t]
    return None
