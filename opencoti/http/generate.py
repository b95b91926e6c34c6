"""Front-end side of one generation: submit to the engine, wait for events while
watching the client, and gather the events into a result.

Runs on HTTP handler threads. It touches only the engine's thread-safe
``submit`` and the request's ``RequestHandle``, plus the read-only tokenizer
(for token pieces in log-probability output); the model and KV cache stay on
the engine thread (DESIGN.md "How a request flows").
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

from opencoti.engine.api import (
    CompletionRequest,
    ErrorEvent,
    FinishEvent,
    ProgressEvent,
    RequestHandle,
    TokenEvent,
)
from opencoti.http.errors import HTTPError, exceed_context, server_error
from opencoti.http.sse import ClientDisconnected, sse_event

# How often a waiting handler checks whether its client is still there (s).
POLL_S = 0.25


def utf8_complete_len(b: bytes) -> int:
    """Length of ``b`` without a multi-byte UTF-8 sequence cut off at its end.

    Same rule as llama.cpp ``validate_utf8`` (server-common.cpp): only the last
    1-3 bytes are inspected for a lead byte whose sequence is incomplete.
    """
    n = len(b)
    for i in range(1, min(4, n) + 1):
        c = b[n - i]
        if (c & 0xE0) == 0xC0 and i < 2:
            return n - i
        if (c & 0xF0) == 0xE0 and i < 3:
            return n - i
        if (c & 0xF8) == 0xF0 and i < 4:
            return n - i
    return n


def piece_json(tokenizer, token_id: int, logprob: float) -> dict:
    """One llama.cpp probability entry: ``{id, token, bytes, logprob}``.

    ``token`` is the token's piece (special tokens render as "" as in llama.cpp's
    default ``special = false``) with an incomplete trailing UTF-8 sequence cut;
    ``bytes`` is the full piece as a list of byte values (OpenAI's ``bytes``).
    """
    b = tokenizer.token_to_piece(int(token_id), special=False)
    text = b[: utf8_complete_len(b)].decode("utf-8", errors="replace")
    return {"id": int(token_id), "token": text, "bytes": list(b), "logprob": float(logprob)}


def _as_prob(entry: dict) -> dict:
    """A ``piece_json`` entry with ``logprob`` turned into ``prob`` (= exp(logprob))."""
    lp = entry.pop("logprob")
    entry["prob"] = math.exp(lp) if lp > -math.inf else 0.0
    return entry


def token_probs_json(tokenizer, ev: TokenEvent, n_top: int, post_sampling: bool = False) -> Optional[dict]:
    """llama.cpp's per-token entry of ``completion_probabilities`` (and of OpenAI
    ``logprobs.content``): ``{id, token, bytes, logprob, top_logprobs: [...]}``.

    ``n_top`` limits ``top_logprobs`` (0 = empty list). Returns None when the
    engine sent no log-probabilities for this token. ``post_sampling``: the
    engine's numbers are the sampler's final distribution; report them as
    probabilities, ``{id, token, bytes, prob, top_probs: [{id, token, bytes,
    prob}]}`` (llama.cpp ``probs_vector_to_json`` with ``post_sampling_probs``).
    """
    if ev.logprob is None:
        return None
    entry = piece_json(tokenizer, ev.token, ev.logprob)
    top = [piece_json(tokenizer, p.id, p.logprob) for p in (ev.top or [])[:n_top]]
    if post_sampling:
        _as_prob(entry)
        entry["top_probs"] = [_as_prob(t) for t in top]
    else:
        entry["top_logprobs"] = top
    return entry


TIMINGS_KEYS = (
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
)


def timings_json(fin: FinishEvent) -> dict:
    """llama.cpp's ``timings`` object from the engine's finish event; keys the
    engine did not fill are derived from the counts (ms are wall time)."""
    t = dict(fin.timings or {})
    t.setdefault("cache_n", fin.n_cached)
    t.setdefault("prompt_n", max(fin.n_prompt_tokens - fin.n_cached, 0))
    t.setdefault("prompt_ms", 0.0)
    t.setdefault("predicted_n", fin.n_predicted)
    t.setdefault("predicted_ms", 0.0)
    for kind in ("prompt", "predicted"):
        n, ms = t[f"{kind}_n"], float(t[f"{kind}_ms"])
        t.setdefault(f"{kind}_per_token_ms", ms / n if n > 0 else 0.0)
        t.setdefault(f"{kind}_per_second", 1e3 * n / ms if ms > 0 else 0.0)
    return {k: t[k] for k in TIMINGS_KEYS} | {k: v for k, v in t.items() if k not in TIMINGS_KEYS}


def submit(engine, req: CompletionRequest, n_ctx_slot: int) -> RequestHandle:
    """Hand ``req`` to the engine after checking it fits the slot's context.

    Raises HTTPError 400 ``exceed_context_size_error`` when the prompt has
    ``n_ctx_slot`` tokens or more (llama.cpp's check), 400 when the engine
    rejects the request as invalid (ValueError), 503 when it cannot take it now.
    """
    if len(req.prompt_tokens) >= n_ctx_slot:
        raise exceed_context(len(req.prompt_tokens), n_ctx_slot)
    try:
        return engine.submit(req)
    except HTTPError:
        raise
    except ValueError as e:
        raise HTTPError(400, "invalid_request_error", str(e)) from None
    except RuntimeError as e:  # e.g. engine stopped
        raise HTTPError(503, "unavailable_error", str(e)) from None


def iter_events(handle: RequestHandle, is_disconnected: Callable[[], bool]) -> Iterator:
    """Yield ``handle``'s events until its Finish/Error event.

    At most every ``POLL_S`` seconds (whether or not events are flowing) checks
    whether the client has gone; if so, cancels the request (the engine frees
    the slot and carries on with other requests) and raises
    ``ClientDisconnected``.
    """
    last_check = time.monotonic()

    def gone() -> bool:
        nonlocal last_check
        last_check = time.monotonic()
        if is_disconnected():
            handle.cancel()
            return True
        return False

    while True:
        try:
            for ev in handle.events(timeout=POLL_S):
                yield ev
                if isinstance(ev, (FinishEvent, ErrorEvent)):
                    return
                if time.monotonic() - last_check >= POLL_S and gone():
                    raise ClientDisconnected("client closed the connection")
            return
        except queue.Empty:
            if gone():
                raise ClientDisconnected("client closed the connection") from None


def error_from_event(ev: ErrorEvent) -> HTTPError:
    """The HTTPError for an engine ``ErrorEvent`` (a 429 admission refusal carries
    ``Retry-After``, RFC 9110 §10.2.3, in seconds)."""
    headers = {}
    retry = getattr(ev, "retry_after", None)
    if retry is not None:
        headers["Retry-After"] = str(max(0, int(retry)))
    return HTTPError(ev.status or 500, ev.type or "server_error", ev.message or "generation failed",
                     headers=headers)


def admission_headers(handles) -> dict[str, str]:
    """``X-KV-Pool-Saturated: <pool>`` when any of ``handles`` was admitted over the
    KV pool's capacity (``--admission-poolless warn``, or a pool's settled
    admission in warn/advisory mode), plus PolyKV's ``X-Session-TPS`` and
    ``X-Sessions-Remaining``. The engine sets these handle fields before the
    request's first event."""
    out: dict[str, str] = {}
    for h in handles:
        adm = getattr(h, "admission", None)
        if adm and adm.get("saturated"):
            out["X-KV-Pool-Saturated"] = str(adm.get("pool") or "poolless")
        tps = getattr(h, "session_tps", None)  # PolyKV: the pool's mean decode rate per session
        if tps is not None:
            out["X-Session-TPS"] = f"{tps:.2f}"
        left = getattr(h, "sessions_remaining", None)  # PolyKV settled admission headroom
        if left is not None:
            out["X-Sessions-Remaining"] = str(left)
    return out


@dataclass
class Result:
    """Everything one finished generation produced.

    content: the generated text (stop string excluded).
    tokens: the generated token ids, in order.
    probs: per-token probability entries (``token_probs_json``), when requested.
    finish: the engine's finish event.
    """

    prompt_tokens: list[int]
    content: str = ""
    tokens: list[int] = field(default_factory=list)
    probs: list[dict] = field(default_factory=list)
    finish: Optional[FinishEvent] = None

    @property
    def n_predicted(self) -> int:
        return self.finish.n_predicted if self.finish and self.finish.n_predicted else len(self.tokens)

    @property
    def n_prompt(self) -> int:
        return (self.finish.n_prompt_tokens if self.finish and self.finish.n_prompt_tokens
                else len(self.prompt_tokens))

    @property
    def n_cached(self) -> int:
        """Prompt tokens reused from the KV cache (0 before the finish event)."""
        return self.finish.n_cached if self.finish else 0


class Collector:
    """Accumulates events of one request into a ``Result`` (text, ids, probs).

    ``post_sampling``: probability entries in llama.cpp's ``post_sampling_probs``
    shape. ``on_finish``: called with the FinishEvent (server metrics).
    """

    def __init__(self, tokenizer, prompt_tokens: list[int], n_top: int, want_probs: bool,
                 post_sampling: bool = False, on_finish: Optional[Callable[[FinishEvent], None]] = None):
        self.tokenizer = tokenizer
        self.n_top = n_top
        self.want_probs = want_probs
        self.post_sampling = post_sampling
        self.on_finish = on_finish
        self.result = Result(prompt_tokens=list(prompt_tokens))
        self._parts: list[str] = []

    def add(self, ev) -> Optional[dict]:
        """Take one event; returns the probability entry for a token event (or None).

        Raises HTTPError for an ErrorEvent.
        """
        if isinstance(ev, TokenEvent):
            self.result.tokens.append(ev.token)
            if ev.text:
                self._parts.append(ev.text)
            if self.want_probs:
                entry = token_probs_json(self.tokenizer, ev, self.n_top, self.post_sampling)
                if entry is not None:
                    self.result.probs.append(entry)
                return entry
            return None
        if isinstance(ev, FinishEvent):
            if ev.text:
                self._parts.append(ev.text)
            if ev.stop_type == "word" and ev.stopping_word and self.result.probs:
                # as llama.cpp (non-streamed): drop the entries of the stop word's tokens, which
                # are not in the content (its tokens counted by tokenizing the word alone)
                n = len(self.tokenizer.tokenize(ev.stopping_word, add_special=False))
                del self.result.probs[max(0, len(self.result.probs) - n):]
            self.result.finish = ev
            self.result.content = "".join(self._parts)
            if self.on_finish is not None:
                self.on_finish(ev)
            return None
        if isinstance(ev, ErrorEvent):
            raise error_from_event(ev)
        if isinstance(ev, ProgressEvent):  # a stream's render sends it; nothing to collect
            return None
        raise server_error(f"unexpected engine event {type(ev).__name__}")


def collect(tokenizer, handle: RequestHandle, is_disconnected: Callable[[], bool],
            n_top: int = 0, want_probs: bool = False, post_sampling: bool = False,
            on_finish: Optional[Callable] = None) -> Result:
    """Wait for ``handle`` to finish and return its ``Result`` (non-streaming use).

    ``on_finish(request, finish_event)`` is called when it finishes (metrics).
    Raises HTTPError for an engine error, ClientDisconnected if the client left.
    """
    cb = (lambda ev: on_finish(handle.request, ev)) if on_finish is not None else None
    c = Collector(tokenizer, handle.request.prompt_tokens, n_top, want_probs, post_sampling, cb)
    for ev in iter_events(handle, is_disconnected):
        c.add(ev)
    if c.result.finish is None:
        raise server_error("the engine ended the request without a finish event")
    return c.result


def collect_many(tokenizer, handles: list[RequestHandle], is_disconnected: Callable[[], bool],
                 n_top: int = 0, want_probs: bool = False, post_sampling: bool = False,
                 on_finish: Optional[Callable] = None) -> list[Result]:
    """``collect`` for several requests submitted together; on any failure the
    requests still running are cancelled before the error propagates."""
    results: list[Result] = []
    try:
        for h in handles:
            results.append(collect(tokenizer, h, is_disconnected, n_top, want_probs, post_sampling, on_finish))
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    return results


def merged_events(handles: list[RequestHandle], is_disconnected: Callable[[], bool]) -> Iterator[tuple]:
    """The events of one or more requests as ``(index, event)`` in arrival order, until each
    has finished (``iter_events``' disconnect check; when the client has gone every request is
    cancelled and ``ClientDisconnected`` raised). Several requests are read by one thread each
    into a shared queue (they end with their request)."""
    if len(handles) == 1:
        for ev in iter_events(handles[0], is_disconnected):
            yield 0, ev
        return
    merged: "queue.Queue[tuple]" = queue.Queue()

    def pump(i: int, h: RequestHandle) -> None:
        for ev in h.events():
            merged.put((i, ev))

    for i, h in enumerate(handles):
        threading.Thread(target=pump, args=(i, h), name=f"opencoti-merge-{i}", daemon=True).start()
    left, last_check = len(handles), time.monotonic()
    while left:
        try:
            i, ev = merged.get(timeout=POLL_S)
        except queue.Empty:
            i, ev = -1, None
        if ev is not None:
            yield i, ev
            if isinstance(ev, (FinishEvent, ErrorEvent)):
                left -= 1
        if time.monotonic() - last_check >= POLL_S:
            last_check = time.monotonic()
            if is_disconnected():
                for h in handles:
                    h.cancel()
                raise ClientDisconnected("client closed the connection")


def sse_events(handles: list[RequestHandle], events, render: Callable,
               prefix: Iterable[bytes] = ()) -> Iterator[bytes]:
    """The event loop every streaming route shares: ``prefix`` chunks, then
    ``render(index, ev)`` (an iterable of encoded SSE chunks) for each ``(index, event)`` of
    ``events`` (``merged_events``); an ErrorEvent becomes the stream's last event and cancels
    the other requests. If the client leaves before the requests finished (the server closes
    this generator), the engine requests still running are cancelled."""
    done: set[int] = set()
    try:
        yield from prefix
        for i, ev in events:
            if isinstance(ev, ErrorEvent):
                done.add(i)
                yield sse_event(error_from_event(ev).body())
                return
            if isinstance(ev, FinishEvent):
                done.add(i)
            yield from render(i, ev)
    finally:
        for i, h in enumerate(handles):
            if i not in done:
                h.cancel()
