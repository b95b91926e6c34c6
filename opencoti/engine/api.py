"""The engine's request/event vocabulary: what HTTP and CLI threads hand to the
engine thread and what comes back.

A front end builds a ``CompletionRequest`` (prompt already tokenized), calls
``Engine.submit(req)`` and gets a ``RequestHandle``; it then iterates
``handle.events()``, which yields ``TokenEvent`` for each generated token and
ends with exactly one ``FinishEvent`` or ``ErrorEvent``. Names follow
llama.cpp's server (``n_predict``, ``n_probs``, ``cache_prompt``, ``id_slot``,
``stop_type`` …).
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union


@dataclass
class SamplingParams:
    """Sampler-chain settings, llama.cpp's names and defaults (common/common.h).

    ``temperature <= 0`` means greedy. ``seed`` < 0 (llama.cpp's LLAMA_DEFAULT_SEED
    0xFFFFFFFF is also accepted) picks a random seed. ``n_probs`` > 0 asks for
    the top-n tokens with their log-probabilities at every step.
    ``grammar``: GBNF text constraining the output (llama.cpp's ``grammar``
    field; a JSON schema is converted to GBNF by ``opencoti.engine.json_schema``
    before it gets here); None or "" = unconstrained.
    ``top_n_sigma`` (> 0): keep the tokens whose logit is >= max - n * sigma of the
    candidates' logits (llama.cpp ``top_n_sigma``; <= 0 = off).
    ``samplers``: the chain in order, llama.cpp's canonical names (``CHAIN_NAMES``);
    None = the default chain (``DEFAULT_CHAIN``). A name absent from the list is a
    sampler that does not run, as in llama.cpp (no ``temperature``: no scaling).
    ``xtc_probability`` / ``xtc_threshold``: XTC (0 / any > 0.5 = off); ``dynatemp_range`` /
    ``dynatemp_exponent``: entropy-scaled temperature in [temperature - range, temperature +
    range] (0 = off); ``mirostat`` 1 / 2 with ``mirostat_tau`` (target surprise, bits) and
    ``mirostat_eta`` (learning rate): Mirostat v1 / v2 instead of the chain (0 = off);
    ``min_keep``: typical_p, top_p, min_p and XTC keep at least this many candidates.
    ``dry_multiplier`` (0 = off), ``dry_base``, ``dry_allowed_length``, ``dry_penalty_last_n``
    (-1 = every accepted token, 0 = off) and ``dry_sequence_breakers`` (strings): DRY
    (``opencoti.engine.dry``). Semantics: ``sampling.py``.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    n_probs: int = 0
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit (-inf bans it)
    grammar: Optional[str] = None
    top_n_sigma: float = -1.0
    samplers: Optional[tuple] = None  # of CHAIN_NAMES; None = DEFAULT_CHAIN
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple = ("\n", ":", '"', "*")  # llama.cpp common_params_sampling's


INT32_MAX = 2 ** 31 - 1
MAX_DRY_BREAKERS = 64  # per request (llama.cpp has no limit; each new list costs a scan of the vocabulary)


def _utf8(s: str) -> bool:
    """Whether ``s`` encodes as UTF-8 (a JSON string may carry a lone surrogate, ``"\\ud800"``)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# The sampler names a chain may hold (llama.cpp ``common_sampler_types_from_names``,
# canonical names), and the default order (llama.cpp's ``common_params_sampling::samplers``).
CHAIN_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DEFAULT_CHAIN = CHAIN_NAMES


def sampling_error(p) -> str | None:
    """Why sampler settings ``p`` (a ``SamplingParams``) are unusable, or None. The one
    range check shared by the HTTP layer (400), the CLI (usage error) and ``Sampler``:
    temperature finite; top_p >= 0 and typical_p >= 0 (1 or more = off); min_p in
    [0, 1]; repeat_penalty > 0 (1 = off); repeat_last_n >= -1; penalties and
    top_n_sigma finite; ``samplers`` only of ``CHAIN_NAMES``; the XTC, dynamic temperature
    and Mirostat numbers finite, dynatemp_range >= 0, mirostat 0, 1 or 2, min_keep >= 0; DRY's
    multiplier and base finite, repeat_last_n and dry_penalty_last_n in [-1, 2^31 - 1] (llama.cpp's
    int32), at most ``MAX_DRY_BREAKERS`` sequence breakers, strings."""
    def finite(v) -> bool:
        return isinstance(v, (int, float)) and math.isfinite(v)

    for name in ("temperature", "presence_penalty", "frequency_penalty", "top_n_sigma", "xtc_probability",
                 "xtc_threshold", "dynatemp_exponent", "mirostat_tau", "mirostat_eta", "dry_multiplier",
                 "dry_base"):
        if not finite(getattr(p, name)):
            return f"{name} must be a finite number, got {getattr(p, name)}"
    for name in ("top_k", "min_keep", "dry_allowed_length"):
        if not -INT32_MAX - 1 <= getattr(p, name) <= INT32_MAX:
            return f"{name} must be a 32-bit integer, got {getattr(p, name)}"
    for name in ("top_p", "typical_p"):
        v = getattr(p, name)
        if not (finite(v) and v >= 0):
            return f"{name} must be >= 0, got {v}"
    if not (finite(p.min_p) and 0 <= p.min_p <= 1):
        return f"min_p must be in [0, 1], got {p.min_p}"
    if not (finite(p.repeat_penalty) and p.repeat_penalty > 0):
        return f"repeat_penalty must be > 0, got {p.repeat_penalty}"
    if not -1 <= p.repeat_last_n <= INT32_MAX:
        return f"repeat_last_n must be in [-1, {INT32_MAX}], got {p.repeat_last_n}"
    if not (finite(p.dynatemp_range) and p.dynatemp_range >= 0):
        return f"dynatemp_range must be >= 0, got {p.dynatemp_range}"
    if p.mirostat not in (0, 1, 2):
        return f"mirostat must be 0 (off), 1 or 2, got {p.mirostat}"
    if p.min_keep < 0:
        return f"min_keep must be >= 0, got {p.min_keep}"
    if not -1 <= p.dry_penalty_last_n <= INT32_MAX:
        return f"dry_penalty_last_n must be in [-1, {INT32_MAX}], got {p.dry_penalty_last_n}"
    if not all(isinstance(b, str) and _utf8(b) for b in p.dry_sequence_breakers):
        return "dry_sequence_breakers must be strings of valid Unicode (no lone surrogates)"
    if len(p.dry_sequence_breakers) > MAX_DRY_BREAKERS:
        return f"dry_sequence_breakers: at most {MAX_DRY_BREAKERS} strings, got {len(p.dry_sequence_breakers)}"
    bad = [n for n in (p.samplers or ()) if n not in CHAIN_NAMES]
    if bad:
        return f"unknown sampler {bad[0]!r} (known: {', '.join(CHAIN_NAMES)})"
    return None



@dataclass
class CompletionRequest:
    """One completion for the engine.

    prompt_tokens: token ids, BOS already added where the model wants it.
    n_predict: max tokens to generate; -1 = until EOG or the context is full.
    stop: strings that end generation (excluded from the text).
    cache_prompt: reuse the longest common prefix already in the slot's KV.
    id_slot: slot to use, -1 = any.
    ignore_eos: end-of-generation ids are banned (-inf logits, llama.cpp's ``logit_bias_eog``)
        and do not end generation; a grammar that allows nothing else still ends it.
    n_keep: with context shift, prompt tokens kept at the start (-1 = the whole
        prompt; BOS is kept on top, as llama.cpp).
    n_discard: tokens dropped per shift (0 = half of what is not kept).
    session_id: binds the request to the slot holding this session's KV.
    overcommit: bypass the KV admission gate.
    post_sampling_probs: with ``sampling.n_probs`` > 0, report probabilities from the
        sampler's final distribution (after top-k/top-p/min-p/temperature; cut tokens
        have probability 0) instead of the model's full softmax (llama.cpp field).
    timings_per_token: every ``TokenEvent`` carries the timings so far (llama.cpp field).
    return_progress: a ``ProgressEvent`` after each ubatch of the prompt (llama.cpp field;
        the HTTP layer sets it for streamed requests only, as llama.cpp).
    n_indent: > 0: every generated line after the first needs at least this many leading
        spaces / tabs; the first that has fewer ends generation ("limit") and is cut before
        its first other character (llama.cpp field, for code infill).
    t_max_predict_ms: > 0: generation ends ("limit") at the first new line generated once
        this many ms have passed since the first token (llama.cpp field).
    pool_id: attach to PolyKV pool K: the longest token-exact common prefix of
        the prompt and the pool is shared, not recomputed.
    shared_pool_slot, shared_prefix_n_tokens: the manual path: share the first
        P cells of slot N's sequence (token-exact with the prompt, else they are
        recomputed).
    """

    prompt_tokens: list[int]
    n_predict: int = -1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True
    id_slot: int = -1
    ignore_eos: bool = False
    n_keep: int = 0
    n_discard: int = 0
    session_id: Optional[str] = None
    overcommit: bool = False
    post_sampling_probs: bool = False
    timings_per_token: bool = False
    return_progress: bool = False
    n_indent: int = 0
    t_max_predict_ms: int = 0
    pool_id: Optional[int] = None
    shared_pool_slot: int = -1
    shared_prefix_n_tokens: int = 0


@dataclass
class TokenProb:
    """A token and its log-probability under the model's full distribution (natural log)."""

    id: int
    logprob: float
    text: str = ""


@dataclass
class TokenEvent:
    """One generated token.

    text: the text this token releases, only complete UTF-8 characters and
    never part of a possible stop string (may be ""; held text comes out with
    a later token or the finish).
    logprob: log-probability of ``token`` (set when ``n_probs`` > 0).
    top: the ``n_probs`` most likely tokens (set when ``n_probs`` > 0).
    timings: llama.cpp's ``timings`` so far (``FinishEvent.timings``' keys), with the
    request's ``timings_per_token``; else None.
    """

    token: int
    text: str
    logprob: Optional[float] = None
    top: Optional[list[TokenProb]] = None
    timings: Optional[dict] = None


@dataclass
class FinishEvent:
    """End of a request.

    stop_type: "eos" (end-of-generation token), "limit" (n_predict or context
    full), "word" (a stop string matched).
    text: any text still held back at the finish (emit it after the last token).
    timings: llama.cpp's ``timings`` object (prompt_n, prompt_ms,
    prompt_per_second, predicted_n, predicted_ms, predicted_per_second, cache_n …).
    """

    stop_type: str
    stopping_word: str = ""
    text: str = ""
    truncated: bool = False
    n_prompt_tokens: int = 0
    n_cached: int = 0
    n_predicted: int = 0
    id_slot: int = -1
    timings: dict = field(default_factory=dict)
    n_past: int = -1  # tokens in the slot's cache at the finish (after any context shift); -1: unknown


@dataclass
class ErrorEvent:
    """A request failed; ``status`` is the HTTP status, ``type`` llama.cpp's error type.

    ``retry_after`` (seconds) is set on 429 admission refusals (``Retry-After`` header).
    """

    status: int
    type: str
    message: str
    retry_after: Optional[int] = None


@dataclass
class ProgressEvent:
    """Prompt processing progress, sent after each ubatch of a request's prompt when it asked
    for ``return_progress`` (llama.cpp's ``prompt_progress``): ``total`` prompt tokens,
    ``cache`` of them reused from the cache, ``processed`` in the cache now (cached ones
    included), ``time_ms`` since the request took its slot (ms, integer)."""

    total: int
    cache: int
    processed: int
    time_ms: int

    def to_json(self) -> dict:
        """llama.cpp ``result_prompt_progress::to_json``."""
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


Event = Union[TokenEvent, FinishEvent, ErrorEvent, ProgressEvent]


class RequestHandle:
    """The front end's side of a submitted request (thread-safe).

    ``events()`` blocks and yields events until the final Finish/Error event.
    ``cancel()`` asks the engine to stop the request (e.g. the client went away);
    the engine then finishes it with stop_type "limit" or drops it unstarted.
    """

    def __init__(self, request: CompletionRequest):
        self.request = request
        self.id_task = -1  # set by Engine.submit: the engine's running task number (llama.cpp id_task)
        self.id_slot = -1  # set by the engine when the request binds to a slot
        # set by the engine before the first event: {"pool": name, "saturated": bool}
        # when the request was admitted over capacity in warn mode (X-KV-Pool-Saturated)
        self.admission: Optional[dict] = None
        self.session_tps: Optional[float] = None  # pool requests: the pool's mean decode rate (X-Session-TPS)
        self.sessions_remaining: Optional[int] = None  # settled admission's headroom (X-Sessions-Remaining)
        self._queue: "queue.Queue[Event]" = queue.Queue()
        self._cancelled = threading.Event()
        self._finish_lock = threading.Lock()
        self._finished: Optional["FinishEvent"] = None
        self._on_finish: Optional[Callable[["FinishEvent"], None]] = None
        self._done = False

    # engine side
    def push(self, event: Event) -> None:
        """Queue ``event`` for the reader; while the pushing thread holds events (``EventHold``)
        it is kept, in order with every other held event, until the hold's ``release``."""
        if isinstance(event, (FinishEvent, ErrorEvent)):
            self._done = True  # pushed, if not yet delivered: no other thread fails this request now
        held = getattr(_HOLD, "items", None)
        if held is not None:
            held.append((self, event))
            return
        self._deliver(event)

    def _deliver(self, event: Event) -> None:
        if isinstance(event, (FinishEvent, ErrorEvent)):
            self._done = True
        if isinstance(event, FinishEvent):
            with self._finish_lock:
                first, fn = self._finished is None, self._on_finish
                if first:
                    self._finished = event
            if first and fn is not None:
                _call_hook(fn, event)
        self._queue.put(event)

    def on_finish(self, fn: Callable[["FinishEvent"], None]) -> None:
        """Call ``fn(finish_event)`` once when the request finishes, whether or not
        anyone still reads the events (a cancelled request's FinishEvent carries
        what it ran: server metrics count it). Runs on the pushing thread (the
        engine's) before the event is queued, or at once if it already finished.
        Exceptions from ``fn`` are logged, never raised into the engine."""
        with self._finish_lock:
            self._on_finish = fn
            done = self._finished
        if done is not None:
            _call_hook(fn, done)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        """True once the final event (Finish or Error) has been pushed (it may still be held
        for delivery, ``EventHold``)."""
        return self._done

    # front-end side
    def cancel(self) -> None:
        self._cancelled.set()

    def events(self, timeout: Optional[float] = None) -> Iterator[Event]:
        while True:
            ev = self._queue.get(timeout=timeout)
            yield ev
            if isinstance(ev, (FinishEvent, ErrorEvent)):
                return


_HOLD = threading.local()  # the current thread's held events (EventHold), or no attribute / None


class EventHold:
    """Events that handles' ``push`` receives on one thread between ``hold()`` and ``release()``,
    delivered in push order at ``release()``. The engine holds a step's token and finish events
    until its next step is running on the device, so the readers it wakes (HTTP / client
    threads) take the interpreter while the engine thread only waits for the device, instead of
    contending with the step's host work (cell planning, staging). vLLM overlaps output
    processing with the next step for the same reason. Use from one thread."""

    def hold(self) -> None:
        """Start holding this thread's pushes (no-op while already holding)."""
        if getattr(_HOLD, "items", None) is None:
            _HOLD.items = []

    def release(self) -> None:
        """Stop holding and deliver what was held, in order (all of it, also when a delivery
        raises: the first exception is re-raised afterwards)."""
        items = getattr(_HOLD, "items", None)
        _HOLD.items = None
        err = None
        for h, ev in items or ():
            try:
                h._deliver(ev)
            except BaseException as e:  # noqa: BLE001 - delivered the rest first
                err = err or e
        if err is not None:
            raise err

    @property
    def holding(self) -> bool:
        return getattr(_HOLD, "items", None) is not None


def _call_hook(fn, event) -> None:
    try:
        fn(event)
    except Exception:  # a front end's bookkeeping must not fail the engine thread
        import logging

        logging.getLogger("opencoti.engine").exception("finish hook failed")
