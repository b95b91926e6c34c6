"""DRY ("Don't Repeat Yourself"): a penalty on the tokens that would extend a repetition.

The sampler of llama.cpp (``src/llama-sampling.cpp`` ``llama_sampler_dry``, ported there from
koboldcpp PR 982 by pi6am; the idea is p-e-w's, text-generation-webui PR 5677). Over the last
``dry_penalty_last_n`` accepted tokens (the prompt's included), for every earlier place where the
sequence's current suffix of length ``n >= dry_allowed_length`` also occurs, the token that
followed it there would make the repetition ``n + 1`` long; its logit loses

    dry_multiplier * dry_base ** (n - dry_allowed_length)

(the largest such ``n`` per token; the exponent is clamped where ``dry_base ** e`` would leave
float32: ``e <= int(88.7228391 / ln dry_base)`` for ``dry_base > 1.000001``). Off when
``dry_multiplier == 0``, ``dry_base < 1`` or ``dry_penalty_last_n == 0``, and while the history is
no longer than ``dry_allowed_length``.

Sequence breakers (strings, by default ``"\\n"``, ``":"``, ``'"'``, ``"*"``) cut repetitions: a
suffix is not matched across the last breaker in the history, and a token that is a breaker on
its own is never penalized. A breaker becomes token sequences as in llama.cpp's
``get_overlapping_token_sequences``: every token whose text (``detokenize([id], special=True)``)
contains the breaker is a one-token breaker; a token whose text ends with a proper prefix of
the breaker is a breaker's head, followed by the tokenization of the rest (at most
``MAX_TAIL_TOKENS`` tokens). A breaker is cut to ``MAX_BREAKER_BYTES`` UTF-8 bytes.

The repeat lengths (llama.cpp's reverse Z-algorithm, capped at the distance to the last breaker)
are computed here by a vectorised longest-common-prefix over the reversed history: step ``s``
keeps the offsets whose ``s``-th token still matches, so the work is the history's length times
the longest repeat counted; a repeat is counted only up to where its penalty stops growing
(``dry_allowed_length`` + the clamp above), which bounds a degenerate history (one token
repeated) at ~160 steps for the default base 1.75. The penalties equal llama.cpp's.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Mapping, Optional, Sequence

import numpy as np


__all__ = ["MAX_BREAKER_BYTES", "MAX_TAIL_TOKENS", "Breakers", "as_breakers", "sampler_breakers",
           "process_breakers", "dry_penalties", "dry_on"]

MAX_BREAKER_BYTES = 40  # llama_sampler_init_dry's MAX_CHAR_LEN
MAX_TAIL_TOKENS = 20  # ... and MAX_SEQ_LEN
_FLOAT_MAX_LOG = np.float32(88.7228391)  # ~ ln(FLT_MAX), llama.cpp's constant


class Breakers(dict):
    """Sequence breakers as token sequences: head token id -> the tails (tuples of token ids;
    ``()``: the head alone is a breaker) that follow it. ``heads`` (int64, the keys) and ``solo``
    (int64, the one-token breakers) are the arrays ``dry_penalties`` scans, made once (read-only
    after construction: the arrays do not follow later edits)."""

    def __init__(self, seqs: Mapping[int, Sequence[tuple[int, ...]]] = ()):
        super().__init__((int(h), tuple(tuple(t) for t in tails)) for h, tails in dict(seqs).items())
        self.heads = np.fromiter(self.keys(), dtype=np.int64, count=len(self))
        self.solo = np.fromiter((h for h, tails in self.items() if () in tails), dtype=np.int64)


def as_breakers(seqs: Optional[Mapping]) -> Breakers:
    """``seqs`` itself when it is a ``Breakers`` (``process_breakers``' lists are cached and
    shared), else a ``Breakers`` of it (None: none)."""
    return seqs if isinstance(seqs, Breakers) else Breakers(seqs or {})


_CACHE_LISTS = 32  # breaker lists kept per tokenizer (least recently used dropped)

_INDEX: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> _VocabIndex
_LOCK = threading.Lock()


class _VocabIndex:
    """Each token's text as llama.cpp's ``vocab.detokenize({id}, true)`` gives it, laid out for
    vectorised scans: ``buf`` (uint8, the texts back to back), ``starts`` / ``ends`` (int64 [n]),
    ``last`` (uint8 [n, MAX_BREAKER_BYTES], each text's last bytes right-aligned, 0-padded),
    ``lens`` (int64 [n]); and the processed breaker lists (an LRU of ``_CACHE_LISTS``)."""

    def __init__(self, tokenizer):
        words = [tokenizer.detokenize_bytes([t], special=True) for t in range(tokenizer.n_vocab)]
        self.buf = np.frombuffer(b"".join(words) + b"\0", dtype=np.uint8)  # one pad byte: never empty
        self.lens = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        self.ends = np.cumsum(self.lens)
        self.starts = self.ends - self.lens
        w = MAX_BREAKER_BYTES
        self.last = np.zeros((len(words), w), np.uint8)
        for j in range(w):
            pos = self.ends - w + j
            ok = pos >= self.starts
            self.last[ok, j] = self.buf[pos[ok]]
        self.lists: collections.OrderedDict = collections.OrderedDict()

    def containing(self, s: bytes) -> np.ndarray:
        """Ids of the tokens whose text contains ``s`` (sorted, unique)."""
        b = self.buf[:-1]
        if b.size < len(s):
            return np.zeros(0, np.int64)
        pos = np.flatnonzero(b[:b.size - len(s) + 1] == s[0])
        for j in range(1, len(s)):
            pos = pos[b[pos + j] == s[j]]
        tid = np.searchsorted(self.ends, pos, side="right")
        return np.unique(tid[pos + len(s) <= self.ends[tid]])

    def ending_with(self, p: bytes) -> np.ndarray:
        """Ids of the tokens whose text ends with ``p`` (1 <= len(p) <= MAX_BREAKER_BYTES)."""
        w, n = MAX_BREAKER_BYTES, len(p)
        ids = np.flatnonzero((self.last[:, w - 1] == p[-1]) & (self.lens >= n))
        for j in range(n - 1):
            ids = ids[self.last[ids, w - n + j] == p[j]]
        return ids


def _index(tokenizer) -> _VocabIndex:
    with _LOCK:
        got = _INDEX.get(tokenizer)
    if got is None:
        got = _VocabIndex(tokenizer)
        with _LOCK:
            got = _INDEX.setdefault(tokenizer, got)
    return got


def process_breakers(tokenizer, breakers: Sequence[str]) -> Breakers:
    """The token sequences of ``breakers`` (strings) over ``tokenizer``'s vocabulary (see the
    module doc; llama.cpp ``get_overlapping_token_sequences``). Returns ``Breakers``: ``{head id:
    (tail, ...)}`` with each tail a tuple of token ids (``()`` for a one-token breaker). Empty strings are
    skipped. The vocabulary's texts are laid out once per tokenizer (~0.5 s for 262,144 tokens),
    then a list costs a few vectorised passes per breaker byte (~ms); the last ``_CACHE_LISTS``
    lists are cached. Callers with other sessions to serve call it off the engine thread first
    (the HTTP layer does, while it validates a request)."""
    key = tuple(breakers)
    index = _index(tokenizer)
    with _LOCK:
        got = index.lists.get(key)
        if got is not None:
            index.lists.move_to_end(key)
            return got
    out: dict[int, list[tuple[int, ...]]] = {}
    for text in key:
        s = text.encode("utf-8")[:MAX_BREAKER_BYTES]
        if not s:
            continue
        whole = index.containing(s)
        for tid in whole.tolist():
            _add(out, tid, ())
        # a text ending with s[:n] (0 < n < len(s)) heads the rest of s, tokenized; llama.cpp
        # finds these scanning each text's s[0] left to right, so the longest n comes first
        for n in range(len(s) - 1, 0, -1):
            ids = index.ending_with(s[:n])
            ids = ids[~np.isin(ids, whole)]
            if ids.size:
                rest = s[n:].decode("utf-8", errors="replace")
                tail = tuple(tokenizer.tokenize(rest, add_special=False)[:MAX_TAIL_TOKENS])
                for tid in ids.tolist():
                    _add(out, tid, tail)
    got = Breakers(out)
    with _LOCK:
        index.lists[key] = got
        while len(index.lists) > _CACHE_LISTS:
            index.lists.popitem(last=False)
    return got


def sampler_breakers(tokenizer, sp) -> Optional[Breakers]:
    """``process_breakers`` of a ``SamplingParams``' ``dry_sequence_breakers``, or None when its
    DRY is off or it has no breakers (what ``Sampler(dry_breakers=...)`` takes)."""
    if not dry_on(sp.dry_multiplier, sp.dry_base, sp.dry_penalty_last_n) or not sp.dry_sequence_breakers:
        return None
    return process_breakers(tokenizer, sp.dry_sequence_breakers)


def _add(out: dict, head: int, tail: tuple) -> None:
    seqs = out.setdefault(head, [])
    if tail not in seqs:
        seqs.append(tail)


def dry_penalties(history: Sequence[int], breakers: Breakers, multiplier: float, base: float,
                  allowed_length: int) -> tuple[np.ndarray, np.ndarray]:
    """DRY's penalties for the next token after ``history`` (the last ``dry_penalty_last_n``
    accepted token ids, oldest first).

    Returns ``(ids, penalty)``: int64 [m] distinct token ids and float32 [m] amounts to subtract
    from their logits (llama.cpp computes ``multiplier * pow(base, e)`` in double and subtracts it
    as float); both empty when DRY does nothing. ``breakers``: a ``Breakers``
    (``process_breakers``) or a plain mapping of the same. The
    caller checks the on/off conditions of the module doc except the history's length.
    """
    breakers = as_breakers(breakers)
    r = np.asarray(history, dtype=np.int64)[::-1]  # r[i]: i tokens back from the newest
    n = r.size
    empty = (np.zeros(0, np.int64), np.zeros(0, np.float32))
    if n <= allowed_length:
        return empty
    # step 1: the repeat length limit, the distance to the newest complete breaker
    rep_limit = n
    if breakers:
        for i in np.flatnonzero(np.isin(r, breakers.heads)).tolist():
            longest = -1
            for tail in breakers[int(r[i])]:
                m = len(tail)
                if longest < m <= i and all(tail[o] == r[i - o - 1] for o in range(m)):
                    longest = m
            if longest >= 0:
                rep_limit = i - longest
                break
    if rep_limit < allowed_length:
        return empty
    max_exponent = 0
    if np.float32(base) > np.float32(1.000001):
        max_exponent = int(_FLOAT_MAX_LOG / np.log(np.float32(base)))
    cap = rep_limit
    if max_exponent > 0:  # longer repeats all get the clamped penalty
        cap = min(cap, max(0, allowed_length + max_exponent))
    # step 2: z[k] = min(LCP(r, r[k:]), cap), for k = 1 .. n-1
    z = np.zeros(n, np.int64)
    alive = np.arange(1, n, dtype=np.int64)
    s = 0
    while alive.size and s < cap:
        alive = alive[alive + s < n]
        alive = alive[r[alive + s] == r[s]]
        s += 1
        z[alive] = s
    # step 3: the token after each earlier occurrence (r[k - 1]) would extend it to z[k] + 1
    k = np.flatnonzero(z[1:] >= allowed_length) + 1
    if k.size == 0:
        return empty
    toks, lens = r[k - 1], z[k]
    order = np.lexsort((-lens, toks))
    toks, lens = toks[order], lens[order]
    first = np.ones(toks.size, bool)
    first[1:] = toks[1:] != toks[:-1]
    toks, lens = toks[first], lens[first]  # each token's longest
    keep = ~np.isin(toks, breakers.solo)  # a token that is a breaker on its own is never penalized
    toks, lens = toks[keep], lens[keep]
    exp = lens - allowed_length
    if max_exponent > 0:
        exp = np.minimum(exp, max_exponent)
    pen = float(np.float32(multiplier)) * np.power(float(np.float32(base)), exp.astype(np.float64))
    return toks, pen.astype(np.float32)


def dry_on(multiplier: float, base: float, penalty_last_n: int) -> bool:
    """Whether DRY runs at all (llama.cpp ``llama_sampler_dry_apply``'s first check)."""
    return multiplier != 0.0 and base >= 1.0 and penalty_last_n != 0
