"""The sampler chain: pick the next token from a row of logits.

Semantics follow llama.cpp (``src/llama-sampling.cpp`` for each sampler,
``common/sampling.cpp`` ``common_sampler_init`` for the chain). The default
chain runs, in order:

    penalties -> dry -> top_n_sigma -> top_k -> typical_p -> top_p -> min_p -> xtc
    -> temperature -> dist

or, with ``mirostat`` 1 or 2 (llama.cpp ``common_sampler_init``): logit_bias ->
temperature (plain) -> mirostat, which draws the token itself.

``SamplingParams.samplers`` replaces that order (llama.cpp's request field
``samplers``): the named samplers run in the given order and the others not at
all; ``logit_bias`` always runs first and ``dist`` last (``common_sampler_init``).

Each step narrows a candidate set (token ids with their current logits):

- penalties: for each token seen ``c > 0`` times among the last
  ``repeat_last_n`` accepted tokens, ``logit /= repeat_penalty`` if the logit is
  positive, else ``logit *= repeat_penalty``; then
  ``logit -= c * frequency_penalty + presence_penalty``. Off when
  ``repeat_last_n == 0`` or all three are neutral (1, 0, 0); ``repeat_last_n``
  -1 means every accepted token (llama.cpp: the whole context).
- dry (``opencoti.engine.dry``): each token that would extend a repetition of at least
  ``dry_allowed_length`` tokens found among the last ``dry_penalty_last_n`` accepted ones
  loses ``dry_multiplier * dry_base ** (length - dry_allowed_length)``; repetitions do not
  run across a sequence breaker. Off with ``dry_multiplier == 0`` (the default),
  ``dry_base < 1`` or ``dry_penalty_last_n == 0``.
- top_n_sigma (Tang et al. 2024): with ``n > 0`` and more than one candidate,
  mean and population standard deviation ``sigma`` of the finite candidate
  logits; keep logits ``>= max - n * sigma`` (``<= 0``: off).
- top_k: the ``k`` highest logits (``k <= 0``: off), sorted descending.
- typical_p (locally typical sampling, Meister et al. 2022): softmax over the
  candidates, entropy ``H``; sort by ``|-log p - H|`` ascending and keep the
  shortest prefix whose probability mass exceeds ``typical_p`` (1.0: off).
- top_p (nucleus, Holtzman et al. 2019): softmax over the candidates, sorted by
  probability; keep the shortest prefix whose mass is ``>= top_p`` (1.0: off).
- min_p: keep logits ``>= max_logit + log(min_p)``, i.e. ``p >= min_p * p_max``
  (0: off).
- ``min_keep`` (0: none): typical_p, top_p and min_p keep at least that many
  candidates (the most typical / most probable), as llama.cpp passes it to each.
- xtc ("exclude top choices", llama.cpp ``llama_sampler_xtc``): off when
  ``xtc_probability <= 0``, ``xtc_threshold > 0.5`` or fewer than two candidates;
  else with probability ``xtc_probability`` (one uniform draw a step) the
  candidates, sorted by probability, lose every token at or above the threshold
  except the least probable of them (the scan stops at the first token below it),
  provided at least ``min_keep`` remain.
- temperature: logits ``/= temperature``; ``temperature <= 0`` keeps only the
  highest logit, so the choice is the argmax of the penalised logits among the
  surviving candidates (greedy). Penalties still apply, as in llama.cpp. With
  ``dynatemp_range`` d > 0 (llama.cpp ``llama_sampler_temp_ext``; off with one
  candidate): the temperature is ``t0 + (t1 - t0) * (H / log m) ** dynatemp_exponent``
  for ``t0 = max(0, temperature - d)``, ``t1 = temperature + d``, ``H`` the entropy
  of the candidates' softmax and ``m`` their number.
- mirostat (Basu et al. 2021, "Mirostat: a neural text decoding algorithm that
  directly controls perplexity"; llama.cpp ``llama_sampler_mirostat`` /
  ``_mirostat_v2``): a running ``mu`` (bits, ``2 * mirostat_tau`` at the start);
  v2 keeps the most probable candidates up to the first whose surprise
  ``-log2 p`` exceeds ``mu`` (at least one); v1 estimates the Zipf exponent
  ``s`` from the 100 most probable and keeps the top
  ``k = (e 2^mu / (1 - n_vocab^-e))^(1/s)``, ``e = s - 1``; both draw from what
  is left and set ``mu -= mirostat_eta * (-log2 p_token - mirostat_tau)``.
- dist: softmax over what is left, one uniform draw, first token whose
  cumulative probability reaches the draw.

The random source is a NumPy ``Generator`` (PCG64) seeded from ``seed``; the
same seed and the same logits give the same tokens (not the same tokens as
llama.cpp, whose ``std::mt19937`` streams -- one per random sampler -- we do not
reproduce). XTC's draw comes first in a step, from the same stream, and holds for
the whole step (a grammar's second pass, ``post_sampling_top``). A seed < 0 or
equal to 0xFFFFFFFF (llama.cpp's LLAMA_DEFAULT_SEED) draws a random seed.

Grammar-constrained sampling (``grammar=`` a ``opencoti.engine.grammar.GrammarMatcher``)
follows llama.cpp's ``common_sampler_sample``: sample from the unconstrained
chain; if the grammar allows that token, take it; otherwise set every token the
grammar rejects to -inf (end-of-generation only when the grammar is complete)
and run the chain again. ``accept(token)`` then advances the grammar too.

Everything is vectorised over the vocabulary; the caller's logits are never
modified. With the default parameters one ``sample`` over 262,144 logits costs
about 0.1 ms on a 2-core machine (top_k through ``top_k_ids``: a strided-sample threshold,
one compare over the logits, a selection over the few hundred that pass);
with top_k off and a flat distribution top_p may need a full sort (~9 ms).
Mirostat picks its candidates by ``top_k_ids`` and a threshold, not a full sort:
~2.5 ms a sample over 262,144 logits (its bias and temperature pass over the row).
"""

from __future__ import annotations

import collections
from typing import Iterable, Mapping, Optional

import numpy as np

from opencoti.engine.api import DEFAULT_CHAIN, SamplingParams, sampling_error
from opencoti.engine.dry import as_breakers, dry_on, dry_penalties

__all__ = ["Sampler", "top_logprobs", "token_logprob", "log_softmax", "LLAMA_DEFAULT_SEED"]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

# top_p over an unsorted full vocabulary first tries this many best tokens
# (llama.cpp's adaptive partial sort in llama_sampler_top_p_apply)
_TOP_P_PARTIAL = 256


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest values of ``x`` (float [n], 0 < k <= n), ties at the k-th
    value broken by lower id; int64 [k], grouped as "greater than the k-th value" then "equal
    to it", each in ascending id (so a stable sort by value keeps ties in id order).

    For a large vocabulary (n >= 16,384, k <= n / 64) a threshold from a strided 1/64
    sample (its ~2k/64 + 6 largest) first narrows the candidates to the values at or
    above it (expected ~2k + 384 of them; exact whenever at least k pass, else the whole
    array is used): one compare over ``x`` instead of a selection over it, ~5x faster at
    262,144 logits."""
    n = x.shape[0]
    cand = None
    if n >= 16384 and k * 64 <= n:
        sample = x[::64]
        kk = min(sample.size, 2 * (k // 64 + 1) + 4)
        t = np.partition(sample, sample.size - kk)[sample.size - kk]
        c = np.flatnonzero(x >= t)
        if c.size >= k:
            cand = c
    sub = x if cand is None else x[cand]
    kth = np.partition(sub, sub.size - k)[sub.size - k]
    greater = np.flatnonzero(sub > kth)
    equal = np.flatnonzero(sub == kth)[:k - greater.size]
    ids = np.concatenate((greater, equal))
    return (ids if cand is None else cand[ids]).astype(np.int64, copy=False)


class SamplingParamsError(ValueError):
    """The request's ``logit_bias`` / penalties turned a finite row of logits into NaN, +inf or
    all -inf (float32 overflow, or every token banned): the request's input, not the model, is
    at fault (HTTP 400)."""


# the error text for a logit row with no finite maximum that the request did not cause
_BAD_LOGITS = "logits contain NaN or +inf, or are all -inf"
# ... and for one the request caused
_BIAS_LOGITS = "logit_bias / penalties made the logits NaN or +inf (float32 overflow) or banned every token"


def rows_argmax(logits: np.ndarray, ban=None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of float32 logits ``[n, n_vocab]``: ``(argmax int64 [n], max float32 [n])``, the
    first index of the maximum (NumPy's rule) and the maximum itself (NaN for a row with a NaN:
    ``Sampler.take_argmax`` refuses it as ``sample`` does). ``ban``: ``UBatch.argmax_ban``, ``(rows
    int64 [m], ids int64 [k])`` whose logits count as -inf (the input is not modified), or None."""
    lg = np.asarray(logits)
    ids, mx = lg.argmax(axis=-1).astype(np.int64), lg.max(axis=-1).astype(np.float32)
    if ban is not None:  # the banned rows again, from a copy of those rows
        rows = np.asarray(ban[0], dtype=np.int64)
        sub = lg[rows]
        sub[:, np.asarray(ban[1], dtype=np.int64)] = -np.inf
        ids[rows], mx[rows] = sub.argmax(axis=-1), sub.max(axis=-1)
    return ids, mx


def _nonfinite_error(raw: np.ndarray) -> ValueError:
    """The error for a row whose logits after bias / penalties have no finite maximum:
    ``SamplingParamsError`` when the raw row ``raw`` had one, else ValueError (the model's
    logits themselves are NaN / +inf / all -inf)."""
    if np.isfinite(float(np.max(np.asarray(raw)))):
        return SamplingParamsError(_BIAS_LOGITS)
    return ValueError(_BAD_LOGITS)


def _as_logits(logits: np.ndarray, n_vocab: Optional[int] = None) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1:
        raise ValueError(f"logits must be one row [n_vocab], got shape {x.shape}")
    if n_vocab is not None and x.shape[0] != n_vocab:
        raise ValueError(f"logits have {x.shape[0]} entries, expected n_vocab={n_vocab}")
    if x.shape[0] == 0:
        raise ValueError("logits are empty")
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    return x


def _logsumexp(v: np.ndarray) -> float:
    """log(sum(exp(v))) in float64; v 1-D, at least one finite entry."""
    m = float(np.max(v))
    return m + float(np.log(np.sum(np.exp(v - np.float32(m)), dtype=np.float64)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities (natural log) of a logit row: float32 [n], from a float64 normaliser.

    Raises ValueError on NaN/+inf logits or a row that is all -inf.
    """
    x = _as_logits(logits)
    m = float(np.max(x))
    if not np.isfinite(m):
        raise ValueError(_BAD_LOGITS)
    return (x - np.float32(_logsumexp(x))).astype(np.float32, copy=False)


def top_logprobs(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` most likely tokens under the softmax of the raw logits.

    logits: float32 [n_vocab] (not modified). n: how many (clamped to
    [0, n_vocab]). Returns ``(ids, logprobs)``: int64 [n] and float32 [n],
    sorted by log-probability descending (ties by lower id first), natural log.
    This is what llama.cpp's server reports for ``n_probs`` (softmax over the
    full, unprocessed logits).
    """
    x = _as_logits(logits)
    n = max(0, min(int(n), x.shape[0]))
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    m = float(np.max(x))
    if not np.isfinite(m):
        raise ValueError(_BAD_LOGITS)
    lse = _logsumexp(x)
    if n < x.shape[0]:
        part = top_k_ids(x, n)
    else:
        part = np.arange(x.shape[0])
    # sort by logit descending, then id ascending
    order = np.lexsort((part, -x[part]))
    ids = part[order].astype(np.int64)
    return ids, (x[ids].astype(np.float64) - lse).astype(np.float32)


def token_logprob(logits: np.ndarray, token: int) -> float:
    """log softmax(logits)[token] (natural log) of the raw logits; a float32 value (as a float),
    so that it equals the token's entry in ``top_logprobs`` exactly.

    Raises ValueError for an id outside [0, n_vocab) or invalid logits.
    """
    x = _as_logits(logits)
    t = int(token)
    if not 0 <= t < x.shape[0]:
        raise ValueError(f"token id {t} out of range [0, {x.shape[0]})")
    m = float(np.max(x))
    if not np.isfinite(m):
        raise ValueError(_BAD_LOGITS)
    return float(np.float32(float(x[t]) - _logsumexp(x)))


def _softmax64(vals: np.ndarray) -> np.ndarray:
    v = vals.astype(np.float64)
    e = np.exp(v - v.max())
    return e / e.sum()


class Sampler:
    """One sequence's sampler chain (llama.cpp's ``common_sampler`` with the default order).

    params: SamplingParams (temperature, top_k, top_p, min_p, typical_p,
    repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed).
    n_vocab: size of the logit rows ``sample`` accepts.

    ``accept(token)`` records a token in the penalty history (llama.cpp's server
    accepts the prompt tokens too before the first sample); ``sample(logits)``
    returns the chosen id and does not record it (call ``accept``).
    ``seed`` holds the seed actually used. Raises ValueError for invalid
    parameters (n_vocab < 1, repeat_last_n < -1, negative penalties/p values).

    grammar: optional ``GrammarMatcher`` constraining the output (see the module
    doc); ``sample`` raises ``GrammarError`` (a ValueError) when the grammar
    allows no token at all.

    dry_breakers: DRY's sequence breakers as token sequences
    (``opencoti.engine.dry.process_breakers`` of ``params.dry_sequence_breakers`` over the
    model's tokenizer); None = none.

    ban: token ids whose logits are -inf after ``logit_bias`` (llama.cpp's server adds
    ``logit_bias_eog``, every end-of-generation id at -inf, under ``ignore_eos``). When a
    grammar allows nothing but banned ids, ``sample`` returns the best of them after
    ``logit_bias`` and sets ``grammar_ended`` (the grammar is complete; the request ends there).
    """

    def __init__(self, params: SamplingParams, n_vocab: int, grammar=None,
                 dry_breakers: Optional[Mapping] = None, ban: Iterable[int] = ()):
        if int(n_vocab) < 1:
            raise ValueError(f"n_vocab must be positive, got {n_vocab}")
        self.params = params
        self.n_vocab = int(n_vocab)
        p = params
        err = sampling_error(p)
        if err:
            raise ValueError(err)
        seed = int(p.seed)
        if seed < 0 or seed == LLAMA_DEFAULT_SEED:
            seed = int(np.random.SeedSequence().entropy % LLAMA_DEFAULT_SEED)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._penalties_on = p.repeat_last_n != 0 and (
            p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)
        maxlen = None if p.repeat_last_n < 0 else p.repeat_last_n
        self._history: collections.deque[int] = collections.deque(maxlen=maxlen)
        self._dry_on = dry_on(p.dry_multiplier, p.dry_base, p.dry_penalty_last_n)
        self._dry_breakers = as_breakers(dry_breakers)
        dry_maxlen = None if p.dry_penalty_last_n < 0 else p.dry_penalty_last_n
        self._dry_history: collections.deque[int] = collections.deque(maxlen=dry_maxlen)
        self.grammar = grammar
        ban = np.array(sorted({int(t) for t in ban}), dtype=np.int64)
        self._ban = ban[(ban >= 0) & (ban < self.n_vocab)]
        self.grammar_ended = False  # sample() chose a banned id: the grammar allowed nothing else
        self.mu = 2.0 * float(p.mirostat_tau)  # Mirostat's running surprise bound (bits)
        self._xtc_on = p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5
        self._xtc_u: Optional[float] = None  # this step's XTC draw (sample() draws it)
        self._mirostat_kept: Optional[tuple] = None  # the step's candidates after mirostat's cut

    # -- history -----------------------------------------------------------------------------

    def accept(self, token: int, accept_grammar: bool = True) -> None:
        """Record ``token`` (it was emitted or is part of the prompt) for the penalties;
        with a grammar and ``accept_grammar``, also advance the grammar by it
        (llama.cpp ``common_sampler_accept``)."""
        if self.params.repeat_last_n != 0:
            self._history.append(int(token))
        if self._dry_on:
            self._dry_history.append(int(token))
        if accept_grammar and self.grammar is not None:
            self.grammar.accept_token(int(token))

    def accept_many(self, tokens: Iterable[int]) -> None:
        """Record prompt tokens in order for the penalties and DRY (the grammar is not advanced)."""
        tokens = [int(t) for t in tokens]
        if self.params.repeat_last_n != 0:
            self._history.extend(tokens)
        if self._dry_on:
            self._dry_history.extend(tokens)

    def reset(self) -> None:
        """Forget the histories (penalties, DRY) and Mirostat's ``mu`` (the random stream continues)."""
        self._history.clear()
        self._dry_history.clear()
        self.mu = 2.0 * float(self.params.mirostat_tau)

    @property
    def history(self) -> list[int]:
        """The accepted tokens the penalties currently look at, oldest first."""
        return list(self._history)

    # -- chain -------------------------------------------------------------------------------

    def apply_bias(self, logits: np.ndarray, ban: bool = True) -> np.ndarray:
        """The logits after ``logit_bias`` and, with ``ban``, the banned ids at -inf (float32
        [n_vocab]; the input itself when neither applies, else a copy). llama.cpp runs them
        first, outside ``samplers``."""
        x = _as_logits(logits, self.n_vocab)
        bias = self.params.logit_bias
        if bias:
            ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
            keep = (ids >= 0) & (ids < x.shape[0])
            x = x.copy()
            with np.errstate(over="ignore"):  # a bias past float32: +-inf, refused by the chain's check
                x[ids[keep]] += np.fromiter(bias.values(), dtype=np.float32, count=len(bias))[keep]
        if ban and self._ban.size:
            if not bias:
                x = x.copy()
            x[self._ban[self._ban < x.shape[0]]] = -np.inf
        return x

    def apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        """The logits after ``logit_bias``, repetition/frequency/presence penalties and DRY (the
        default chain's first two samplers): float32 [n_vocab].

        Returns the input itself (no copy) when none of them changes anything, else a modified copy.
        """
        return self._dry(self._penalize(self.apply_bias(logits)))

    def _dry(self, x: np.ndarray) -> np.ndarray:
        """DRY over a full row ``x`` (float32 [n_vocab]): ``x`` itself when it penalizes
        nothing, else a copy (``opencoti.engine.dry``)."""
        if not self._dry_on or not self._dry_history:
            return x
        p = self.params
        ids, pen = dry_penalties(self._dry_history, self._dry_breakers, p.dry_multiplier, p.dry_base,
                                 p.dry_allowed_length)
        keep = (ids >= 0) & (ids < x.shape[0])
        if not keep.any():
            return x
        x = x.copy()
        with np.errstate(over="ignore", invalid="ignore"):  # overflow: the chain's check
            x[ids[keep]] -= pen[keep]
        return x

    def _penalize(self, x: np.ndarray) -> np.ndarray:
        """Repetition/frequency/presence penalties over a full row ``x`` (float32
        [n_vocab]): ``x`` itself when they are off or the history is empty, else a copy."""
        if not self._penalties_on or not self._history:
            return x
        p = self.params
        hist = np.fromiter(self._history, dtype=np.int64, count=len(self._history))
        hist = hist[(hist >= 0) & (hist < self.n_vocab)]
        if hist.size == 0:
            return x
        toks, counts = np.unique(hist, return_counts=True)
        x = x.copy()
        v = x[toks]
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # overflow: the chain's check
            v = np.where(v <= 0, v * np.float32(p.repeat_penalty), v / np.float32(p.repeat_penalty))
            v = v - (counts.astype(np.float32) * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
        x[toks] = v.astype(np.float32)
        return x

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run the chain up to (not including) the final draw.

        Returns ``(ids, logits)``: int64 [m] and float32 [m], the surviving tokens
        and their logits after temperature (with ``temperature <= 0``: the single
        best token). Exposed for tests and ``post_sampling_probs``-style reporting.
        """
        p = self.params
        if p.mirostat:
            return self._mirostat_candidates(logits)
        if p.samplers is not None and tuple(p.samplers) != DEFAULT_CHAIN:
            return self._candidates_ordered(logits, p.samplers)
        x = self.apply_penalties(logits)
        mx = float(np.max(x))
        if not np.isfinite(mx):
            raise _nonfinite_error(logits)
        n = x.shape[0]

        # top_n_sigma (off by default): logits below max - n * sigma leave the set
        if p.top_n_sigma > 0 and n > 1:
            keep = _top_n_sigma_keep(x, p.top_n_sigma)
            if not keep.all():
                x = np.where(keep, x, np.float32(-np.inf))

        # top_k
        k = int(p.top_k)
        if 0 < k < n:
            ids = top_k_ids(x, k)  # ties at the k-th logit: lower ids first
            vals = x[ids]
            order = np.argsort(-vals, kind="stable")
            ids, vals, is_sorted = ids[order], vals[order], True
        else:
            ids, vals, is_sorted = None, x, False  # None: the whole vocabulary, in id order

        # typical_p
        if p.typical_p < 1.0:
            if ids is None:
                ids = np.arange(n, dtype=np.int64)
            if not is_sorted:
                order = np.argsort(-vals)
                ids, vals = ids[order], vals[order]
            lp = vals.astype(np.float64) - _logsumexp(vals)
            pr = np.exp(lp)
            entropy = -float(np.sum(np.where(pr > 0, pr * np.where(pr > 0, lp, 0.0), 0.0)))
            shifted = np.abs(-lp - entropy)
            order = np.argsort(shifted, kind="stable" if shifted.size <= 4096 else None)
            cum = np.cumsum(pr[order])
            over = np.flatnonzero(cum > p.typical_p)
            last = min(max(int(over[0]) + 1, p.min_keep), order.size) if over.size else order.size
            keep = order[:last]
            ids, vals, is_sorted = ids[keep], vals[keep], False

        # top_p
        if p.top_p < 1.0:
            ids, vals = self._top_p(ids, vals, is_sorted, p.top_p, p.min_keep)
            is_sorted = True

        # min_p
        if p.min_p > 0.0:
            vmax = np.float32(np.max(vals))
            threshold = vmax + np.float32(np.log(np.float32(p.min_p)))
            keep = np.flatnonzero(vals >= threshold)
            keep = _min_keep(keep, vals, p.min_keep)
            if ids is None:
                ids = keep.astype(np.int64)
                vals = vals[keep]
            elif keep.size < vals.size:
                ids, vals = ids[keep], vals[keep]

        if ids is None:
            ids = np.arange(n, dtype=np.int64)
        if self._xtc_on:
            ids, vals = self._xtc(ids, vals)
        ids, vals = self._temperature(ids, vals)
        return ids.astype(np.int64, copy=False), vals.astype(np.float32, copy=False)

    def _xtc_draw(self) -> float:
        """This step's XTC draw (uniform [0, 1)), taken on first use in the step."""
        if self._xtc_u is None:
            self._xtc_u = float(self._rng.random())
        return self._xtc_u

    def _xtc(self, ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """XTC over the candidates (module doc): ``(ids, vals)``, sorted by logit when it
        cuts, else as given. Draws this step's number only with two candidates or more."""
        p = self.params
        if vals.size < 2 or self._xtc_draw() > p.xtc_probability:
            return ids, vals
        order = np.argsort(-vals, kind="stable")
        ids, vals = ids[order], vals[order]
        pr = _softmax64(vals)
        above = np.flatnonzero(pr < np.float32(p.xtc_threshold))
        n_above = int(above[0]) if above.size else pr.size  # the leading run at or above
        last = n_above - 1  # the least probable of them stays
        if last > 0 and pr.size - last >= p.min_keep:
            ids, vals = ids[last:], vals[last:]
        return ids, vals

    def _temperature(self, ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The temperature step (module doc): dynamic with ``dynatemp_range`` > 0; a
        temperature <= 0 keeps the first highest logit."""
        p = self.params
        t = float(p.temperature)
        if p.dynatemp_range > 0:
            if vals.size <= 1:
                return ids, vals
            lo, hi = max(0.0, t - p.dynatemp_range), t + p.dynatemp_range
            pr = _softmax64(vals)
            nz = pr > 0
            entropy = -float(np.sum(pr[nz] * np.log(pr[nz])))
            with np.errstate(divide="ignore", over="ignore"):  # 0 ** -e: inf, as llama.cpp's powf
                t = float(lo + (hi - lo) * np.float64(entropy / np.log(vals.size)) ** float(p.dynatemp_exponent))
        return _apply_temperature(ids, vals, t)

    def _mirostat_candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """With ``mirostat``: the candidates of this step's draw when it has been taken
        (after mirostat's cut), else logit_bias then the plain temperature over the row."""
        if self._mirostat_kept is not None:
            return self._mirostat_kept
        x = self.apply_bias(logits)
        if not np.isfinite(float(np.max(x))):
            raise _nonfinite_error(logits)
        return _apply_temperature(np.arange(x.shape[0], dtype=np.int64), x, float(self.params.temperature))

    def _mirostat_sample(self, logits: np.ndarray) -> int:
        """One Mirostat draw (v1 or v2, module doc), ``mu`` updated; the kept candidates
        recorded for ``candidates``."""
        p = self.params
        self._mirostat_kept = None
        ids, vals = self._mirostat_candidates(logits)
        lse = _logsumexp(vals)
        if p.mirostat == 1:
            head = _top_sorted(vals, min(100, vals.size))
            pr = np.exp(vals[head].astype(np.float64) - lse)
            m = head.size - 1
            i = np.arange(m, dtype=np.float64)
            t_i = np.log((i + 2) / (i + 1))
            with np.errstate(all="ignore"):  # float64 scalars throughout: inf / nan, never an exception
                b_i = np.log(pr[:m] / pr[1:m + 1])
                s_hat = np.sum(t_i * b_i) / np.sum(t_i * t_i)
                eps = s_hat - 1
                k = np.power(eps * np.exp2(np.float64(self.mu)) / (1 - np.power(np.float64(self.n_vocab), -eps)),
                             1 / s_hat)
            sel = _top_sorted(vals, min(max(int(k), 1), vals.size) if np.isfinite(k) else vals.size)
        else:  # the most probable while -log2 p <= mu, i.e. logit >= lse - mu ln 2 (at least the best)
            with np.errstate(invalid="ignore"):
                n = int(np.count_nonzero(vals.astype(np.float64) >= lse - self.mu * np.log(2.0)))
            sel = _top_sorted(vals, vals.size if np.isnan(self.mu) else max(n, 1))  # (a NaN mu cuts nothing, as there)
        ids, vals = ids[sel], vals[sel]
        pr = _softmax64(vals)
        cum = np.cumsum(pr)
        j = min(int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right")), ids.size - 1)
        self.mu -= float(p.mirostat_eta) * (-np.log2(pr[j]) - float(p.mirostat_tau))
        self._mirostat_kept = (ids, vals)
        return int(ids[j])

    def _candidates_ordered(self, logits: np.ndarray, chain) -> tuple[np.ndarray, np.ndarray]:
        """``candidates`` for an explicit ``samplers`` order: each named sampler in
        turn over the surviving ``(ids, vals)`` (same semantics as the default path,
        written plainly: full sorts instead of partial ones)."""
        p = self.params
        x = self.apply_bias(logits)
        if not np.isfinite(float(np.max(x))):
            raise _nonfinite_error(logits)
        ids = np.arange(x.shape[0], dtype=np.int64)
        vals = x
        for name in chain:
            if name == "penalties":
                if self._penalties_on and self._history:
                    vals = self._on_full_row(self._penalize, ids, vals)
            elif name == "dry":
                if self._dry_on and self._dry_history:
                    vals = self._on_full_row(self._dry, ids, vals)
            elif name == "top_n_sigma":
                if p.top_n_sigma > 0 and vals.size > 1:  # masked to -inf, as llama.cpp does
                    vals = np.where(_top_n_sigma_keep(vals, p.top_n_sigma), vals, np.float32(-np.inf))
            elif name == "top_k":
                k = int(p.top_k)
                if 0 < k < vals.size:
                    order = np.argsort(-vals, kind="stable")[:k]
                    ids, vals = ids[order], vals[order]
            elif name == "typ_p":
                if p.typical_p < 1.0:
                    order = np.argsort(-vals, kind="stable")
                    ids, vals = ids[order], vals[order]
                    lp = vals.astype(np.float64) - _logsumexp(vals)
                    pr = np.exp(lp)
                    entropy = -float(np.sum(np.where(pr > 0, pr * np.where(pr > 0, lp, 0.0), 0.0)))
                    order = np.argsort(np.abs(-lp - entropy), kind="stable")
                    over = np.flatnonzero(np.cumsum(pr[order]) > p.typical_p)
                    keep = order[:min(max(int(over[0]) + 1, p.min_keep), order.size) if over.size else order.size]
                    ids, vals = ids[keep], vals[keep]
            elif name == "top_p":
                if p.top_p < 1.0:
                    order = np.argsort(-vals, kind="stable")
                    ids, vals = self._top_p(ids[order], vals[order], True, p.top_p, p.min_keep)
            elif name == "min_p":
                if p.min_p > 0.0:
                    threshold = np.float32(np.max(vals)) + np.float32(np.log(np.float32(p.min_p)))
                    keep = _min_keep(np.flatnonzero(vals >= threshold), vals, p.min_keep)
                    ids, vals = ids[keep], vals[keep]
            elif name == "xtc":
                if self._xtc_on:
                    ids, vals = self._xtc(ids, vals)
            elif name == "temperature":
                ids, vals = self._temperature(ids, vals)
        return ids.astype(np.int64, copy=False), vals.astype(np.float32, copy=False)

    @staticmethod
    def _top_p(ids: Optional[np.ndarray], vals: np.ndarray, is_sorted: bool, top_p: float, min_keep: int = 0):
        """Nucleus filter, at least ``min_keep`` kept; returns sorted (ids, vals). ``ids`` None
        means all ids in order."""
        m = vals.size
        if is_sorted:
            pr = _softmax64(vals)
            cum = np.cumsum(pr)
            hit = np.flatnonzero(cum >= top_p)
            last = min(max(int(hit[0]) + 1, min_keep), m) if hit.size else m
            return ids[:last], vals[:last]
        lse = _logsumexp(vals)
        # widen a partial sort until it holds the nucleus (usually the first try does)
        k = _TOP_P_PARTIAL
        while k * 4 <= m:
            part = np.argpartition(vals, m - k)[m - k:]
            part = part[np.argsort(-vals[part])]
            cum = np.cumsum(np.exp(vals[part].astype(np.float64) - lse))
            hit = np.flatnonzero(cum >= top_p)
            if hit.size and min_keep <= k:
                sel = part[: max(int(hit[0]) + 1, min_keep)]
                return (sel.astype(np.int64) if ids is None else ids[sel]), vals[sel]
            k *= 8
        order = np.argsort(-vals)
        cum = np.cumsum(np.exp(vals[order].astype(np.float64) - lse))
        hit = np.flatnonzero(cum >= top_p)
        sel = order[: max(int(hit[0]) + 1, min_keep)] if hit.size else order
        return (sel.astype(np.int64) if ids is None else ids[sel]), vals[sel]

    def apply_grammar(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token the grammar rejects set to -inf
        (float32 [n_vocab]; logit rows longer than the grammar's vocabulary get -inf
        beyond it). Raises ``GrammarError`` if the grammar allows no token."""
        from opencoti.engine.grammar import GrammarError

        x = _as_logits(logits, self.n_vocab)
        allowed = self.grammar.allowed_mask()
        if allowed.shape[0] != x.shape[0]:
            m = np.zeros(x.shape[0], dtype=bool)
            k = min(x.shape[0], allowed.shape[0])
            m[:k] = allowed[:k]
            allowed = m
        if not allowed.any():
            raise GrammarError("the grammar allows no token at this point")
        out = np.full_like(x, -np.inf)
        out[allowed] = x[allowed]
        return out

    @property
    def argmax_only(self) -> bool:
        """Whether ``sample`` is the row's argmax whatever the logits (greedy, default chain, no
        ``logit_bias``, penalties and DRY off, no grammar): the engine then lets the backend reduce the
        logits to ``(argmax, max)`` per row where they are (``ModelRunner.decode(argmax=True)``)
        and calls ``take_argmax``. ``ban_ids`` do not change this: the reduction masks them."""
        p = self.params
        return (self._greedy_chain and not p.logit_bias and not self._penalties_on and not self._dry_on
                and self.grammar is None)

    @property
    def ban_ids(self) -> np.ndarray:
        """The ids this sampler bans (int64 ``[k]``, sorted, within the vocabulary; empty for none):
        ``sample`` sets their logits to -inf itself; an ``argmax_only`` step hands them to the
        runner as ``UBatch.argmax_ban``, which masks them before its reduction."""
        return self._ban

    def _on_full_row(self, fn, ids: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """A full-row sampler ``fn`` (``_penalize``, ``_dry``: float32 [n_vocab] -> the same)
        over the candidates ``(ids, vals)``: their new values (the other ids -inf in between)."""
        full = np.full(self.n_vocab, np.float32(-np.inf), np.float32)
        full[ids] = vals
        return fn(full)[ids]

    @property
    def _greedy_chain(self) -> bool:
        """The default chain at temperature <= 0 (typical_p, XTC, dynamic temperature and
        Mirostat off): top_k / top_p / min_p always keep the best logit, so the chain is the
        argmax of the biased, penalized logits."""
        p = self.params
        return (p.temperature <= 0.0 and p.typical_p >= 1.0 and not self._xtc_on and p.dynatemp_range <= 0
                and not p.mirostat and (p.samplers is None or tuple(p.samplers) == DEFAULT_CHAIN))

    def take_argmax(self, token: int, max_logit: float) -> int:
        """``sample``'s choice for an ``argmax_only`` sampler given the row's argmax ``token`` and
        its maximum ``max_logit`` (NaN if the row has one; ``ban_ids`` masked). Does not ``accept`` it.
        Raises ValueError when the maximum is not finite (NaN / +inf / all -inf logits), as
        ``sample``: ``SamplingParamsError`` where the ban left no finite logit."""
        if not np.isfinite(max_logit):
            if self._ban.size and max_logit == -np.inf:
                raise SamplingParamsError(_BIAS_LOGITS)
            raise ValueError(_BAD_LOGITS)
        return int(token)

    def sample(self, logits: np.ndarray) -> int:
        """Choose the next token from one row of logits (float32 [n_vocab], not modified).

        Returns the token id (int). Does not ``accept`` it. Raises ValueError on
        a wrong shape or NaN/+inf/all -inf logits (``SamplingParamsError`` when the request's
        bias / penalties made them so). With a grammar: the chain's
        choice if the grammar allows it, else a second draw from the chain over
        the grammar-masked logits (llama.cpp ``common_sampler_sample``).
        """
        self._xtc_u = None  # a new step: XTC draws again, mirostat's cut is redone
        self._mirostat_kept = None
        token = self._sample_chain(logits)
        if self.grammar is None or self.grammar.is_allowed(token):
            return token
        masked = self.apply_grammar(logits)
        if self._ban.size:
            # the grammar allows only banned ids once the user's logit_bias applies (under
            # ignore_eos: only end-of-generation): the best of them wins; none: the chain's error
            ended = self.apply_grammar(self.apply_bias(logits, ban=False))
            if np.isfinite(ended.max()) and np.isin(np.flatnonzero(np.isfinite(ended)), self._ban).all():
                self.grammar_ended = True
                return int(np.argmax(ended))
        with np.errstate(invalid="ignore", over="ignore"):
            token = self._sample_chain(masked)
        if not np.isfinite(masked[token]):  # cannot happen with a finite allowed logit; belt and braces
            token = int(np.argmax(masked))
        return token

    def _sample_chain(self, logits: np.ndarray) -> int:
        if self.params.mirostat:
            return self._mirostat_sample(logits)
        if self._greedy_chain:  # top_k / top_p / min_p always keep the best logit: skipped
            x = self.apply_penalties(logits)
            i = int(np.argmax(x))  # NumPy's argmax returns the first NaN if there is one
            if not np.isfinite(x[i]):
                raise _nonfinite_error(logits)
            return i
        ids, vals = self.candidates(logits)
        u = self._rng.random()
        if ids.size == 1:
            return int(ids[0])
        pr = np.exp(vals.astype(np.float64) - float(np.max(vals)))
        cum = np.cumsum(pr)
        i = int(np.searchsorted(cum, u * cum[-1], side="right"))
        return int(ids[min(i, ids.size - 1)])


def _min_keep(keep: np.ndarray, vals: np.ndarray, min_keep: int) -> np.ndarray:
    """min_p's survivors ``keep`` (indices into ``vals``), or with fewer than ``min_keep`` of
    them the ``min_keep`` highest logits, highest first (llama.cpp ``llama_sampler_min_p``)."""
    if keep.size >= min_keep or keep.size == vals.size:
        return keep
    return _top_sorted(vals, min(min_keep, vals.size))


def _top_sorted(vals: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` (1 <= n <= size) highest of ``vals``, highest first; ties by lower
    index (``top_k_ids``, no full sort unless n is the whole row)."""
    sel = top_k_ids(vals, n) if n < vals.size else np.arange(vals.size)
    return sel[np.argsort(-vals[sel], kind="stable")]


def _apply_temperature(ids: np.ndarray, vals: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp ``llama_sampler_temp_impl``: ``t <= 0`` keeps the first highest logit, else the
    logits divided by ``t`` (``_divide_logits``)."""
    if t <= 0.0:
        best = int(np.argmax(vals))  # first maximum in candidate order
        return ids[best:best + 1], vals[best:best + 1]
    return ids, _divide_logits(vals, t)


def _divide_logits(vals: np.ndarray, t: float) -> np.ndarray:
    """float32 logits ``vals`` divided by a temperature ``t`` > 0: ``vals / float32(t)``, or,
    where that leaves float32's range (a temperature near 0 or past 3.4e38: inf, or -inf / inf =
    NaN), ``(vals - max) / t`` in float64, the same distribution (the best logit 0, the others
    below, -inf staying -inf)."""
    tf = np.float32(t) if t < 3.4e38 else np.float32(np.inf)
    if 0 < tf < np.inf:
        with np.errstate(over="ignore"):
            out = (vals / tf).astype(np.float32, copy=False)
        fin = np.isfinite(vals)
        if np.isfinite(out[fin]).all():
            return out
    v = vals.astype(np.float64)
    top = float(v[np.isfinite(v)].max()) if np.isfinite(v).any() else 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        return ((v - top) / t).astype(np.float32)


def _top_n_sigma_keep(vals: np.ndarray, n: float) -> np.ndarray:
    """llama.cpp ``llama_sampler_top_n_sigma_apply``: bool mask [m] of the logits
    ``>= max - n * sigma``, max / mean / population std over the finite logits
    (float32 sums as there; -inf logits are never kept)."""
    finite = vals != -np.inf
    if not finite.any():
        return finite
    v = vals[finite].astype(np.float32)
    mean = np.float32(np.sum(v, dtype=np.float32) / np.float32(v.size))
    std = np.float32(np.sqrt(np.float32(np.sum((v - mean).astype(np.float64) ** 2) / v.size)))
    return vals >= np.float32(np.max(v)) - np.float32(n) * std
