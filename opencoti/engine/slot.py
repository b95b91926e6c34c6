"""A server slot: one sequence's request state between the scheduler and the
front end (llama.cpp ``server_slot``).

The slot owns the text side of generation: incremental UTF-8 decoding, stop
strings (full matches end generation; a possible partial match at the end of
the text is held back, as llama.cpp's ``find_stopping_strings``), limits and
timings. The KV side (which tokens are cached for ``seq_id``) is
``cache_tokens``; the scheduler keeps it equal to what the KV cache holds.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Optional

from opencoti.engine.api import FinishEvent, ProgressEvent, RequestHandle, TokenEvent


class SlotState(Enum):
    IDLE = "idle"
    PROMPT = "prompt"  # prompt tokens still to prefill
    GENERATING = "generating"


def find_stop(text: str, stops: list[str], search_from: int = 0) -> tuple[int, str]:
    """Earliest full match of any stop string in ``text[search_from:]``:
    ``(index, stop)`` or ``(-1, "")``."""
    best, word = -1, ""
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, search_from))
        if i >= 0 and (best < 0 or i < best):
            best, word = i, s
    return best, word


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string
    (that much text must be held back until the next token decides)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


class Slot:
    """Per-slot state. ``seq_id`` equals the slot id (pools take ids above the slots)."""

    def __init__(self, id: int, n_ctx: int):
        self.id = id
        self.seq_id = id
        self.n_ctx = n_ctx  # hard per-slot context (cells this sequence may use)
        self.state = SlotState.IDLE
        self.cache_tokens: list[int] = []  # tokens whose KV is in the cache, in position order
        self.session_id: Optional[str] = None  # the session whose KV this slot holds
        self.pool_id: Optional[int] = None  # PolyKV pool whose prefix cells this slot shares
        self.n_shared = 0  # leading cells shared with that pool (or a manual pool slot)
        self.t_last_used = 0.0
        self._reset_request()

    def _reset_request(self) -> None:
        self.handle: Optional[RequestHandle] = None
        self.prompt: list[int] = []
        self.n_past = 0  # tokens in KV for this request (== len(cache_tokens) while busy)
        self.n_cached = 0
        self.pending: Optional[int] = None  # sampled token not yet in the KV
        self.sampler = None
        self.decoder = None
        self.n_decoded = 0
        self.text = ""  # generated text, stop strings not yet cut
        self.n_sent = 0  # chars of ``text`` already emitted
        self.nl_scan = 0  # n_indent: the lines of ``text`` after its newline at or past this are unchecked
        self.t_start = 0.0
        self.t_prompt_done = 0.0
        self.truncated = False  # the context was shifted (or generation hit the limit)

    @property
    def footprint(self) -> int:
        """Cells this request is projected to hold: its prompt plus ``n_predict``
        (what it holds now, if that is more). 0 when idle."""
        if self.handle is None:
            return 0
        req = self.handle.request
        return max(self.n_past + 1, len(self.prompt) + max(req.n_predict, 0)) - self.n_shared

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE

    def start(self, handle: RequestHandle, n_past: int, sampler, decoder) -> None:
        """Bind a request; ``n_past`` prompt tokens are already in the KV."""
        self._reset_request()
        self.handle = handle
        handle.id_slot = self.id
        self.prompt = list(handle.request.prompt_tokens)
        self.n_past = self.n_cached = n_past
        self.cache_tokens = self.prompt[:n_past]
        self.sampler = sampler
        self.decoder = decoder
        self.state = SlotState.PROMPT
        self.t_start = time.perf_counter()

    def next_prompt_chunk(self, budget: int) -> list[int]:
        """Up to ``budget`` prompt tokens not yet in the KV."""
        return self.prompt[self.n_past:self.n_past + budget]

    # -- generation bookkeeping -------------------------------------------------------
    def on_token(self, token: int, is_eog: bool, logprob=None, top=None) -> Optional[FinishEvent]:
        """Account a sampled token: emit its text (stop-string aware); returns the
        FinishEvent when generation ends with it, else None."""
        req = self.handle.request
        if self.n_decoded == 0:
            self.t_prompt_done = time.perf_counter()
        self.n_decoded += 1
        if is_eog and (not req.ignore_eos or self.sampler.grammar_ended):
            self._push(token, "", logprob, top)
            return self.finish("eos")
        piece = self.decoder.feed(token)
        self.text += piece
        if req.stop:
            longest = max(len(s) for s in req.stop)
            i, word = find_stop(self.text, req.stop, self.n_sent - longest)
            if i >= 0:
                out = self.text[self.n_sent:i]
                self.text = self.text[:i]
                self.n_sent = len(self.text)
                self._push(token, out, logprob, top)
                return self.finish("word", word)
            hold = partial_stop_len(self.text, req.stop)
        else:
            hold = 0
        cut = self._under_indented() if req.n_indent > 0 else -1
        if cut >= 0:
            self.text = self.text[:cut]
            self.decoder, hold = None, 0  # nothing after the cut, not even bytes the decoder holds
        end = max(self.n_sent, len(self.text) - hold)
        self._push(token, self.text[self.n_sent:end], logprob, top)
        self.n_sent = end
        self.pending = token
        if cut >= 0 or (req.n_predict >= 0 and self.n_decoded >= req.n_predict):
            return self.finish("limit")
        if (req.t_max_predict_ms > 0 and "\n" in piece
                and (time.perf_counter() - self.t_prompt_done) * 1e3 > req.t_max_predict_ms):
            return self.finish("limit")
        return None

    def _under_indented(self) -> int:
        """``n_indent``: the index in ``text`` of the first character (not space or tab) of a
        generated line, after the first, indented by fewer than ``n_indent`` characters; -1 if
        every line decided so far has its indent (llama.cpp ``process_token``)."""
        n_indent = self.handle.request.n_indent
        while True:
            nl = self.text.find("\n", self.nl_scan)
            if nl < 0:
                return -1
            i = nl + 1
            while i < len(self.text) and self.text[i] in " \t":
                i += 1
            if i == len(self.text):
                return -1  # the line's indent is not known yet
            if i - nl - 1 < n_indent:
                return i
            self.nl_scan = nl + 1

    def _push(self, token: int, text: str, logprob, top) -> None:
        """Send one token's event, with the timings so far when the request asked for them
        (``timings_per_token``)."""
        timings = self.timings(time.perf_counter()) if self.handle.request.timings_per_token else None
        self.handle.push(TokenEvent(token, text, logprob, top, timings))

    def progress(self) -> ProgressEvent:
        """The prompt's progress now (``ProgressEvent``; ``return_progress``)."""
        return ProgressEvent(len(self.prompt), self.n_cached, self.n_past,
                             int((time.perf_counter() - self.t_start) * 1e3))

    def timings(self, now: float) -> dict:
        """llama.cpp's ``timings`` of the running request at ``now`` (``time.perf_counter()``):
        cache_n, prompt_n / _ms / _per_token_ms / _per_second (the prompt tokens evaluated, not
        cached), predicted_n / _ms / ... (tokens sampled so far; ms from the first one)."""
        t_prompt = (self.t_prompt_done or now) - self.t_start
        t_gen = now - self.t_prompt_done if self.t_prompt_done else 0.0
        # prompt tokens evaluated: all of the prompt, or (cancelled during prefill) what got in
        n_eval = self.n_past if self.state is SlotState.PROMPT else len(self.prompt)
        n_prompt_new = max(n_eval - self.n_cached, 0)
        n_gen = self.n_decoded
        return {
            "cache_n": self.n_cached,
            "prompt_n": n_prompt_new,
            "prompt_ms": t_prompt * 1e3,
            "prompt_per_token_ms": t_prompt * 1e3 / max(n_prompt_new, 1),
            "prompt_per_second": n_prompt_new / t_prompt if t_prompt > 0 else 0.0,
            "predicted_n": n_gen,
            "predicted_ms": t_gen * 1e3,
            "predicted_per_token_ms": t_gen * 1e3 / max(n_gen, 1),
            "predicted_per_second": n_gen / t_gen if t_gen > 0 else 0.0,
        }

    @property
    def context_full(self) -> bool:
        """The pending token would not fit: shift the context or stop (llama.cpp's test)."""
        return self.n_past + 1 >= self.n_ctx

    def finish(self, stop_type: str, word: str = "", truncated: bool = False) -> FinishEvent:
        """Build the final event (text still held back is released unless a stop
        string was matched) and return the slot to IDLE."""
        now = time.perf_counter()
        if stop_type != "word" and self.decoder is not None:
            self.text += self.decoder.flush()
        rest = self.text[self.n_sent:] if stop_type != "word" else ""
        ev = FinishEvent(
            stop_type=stop_type,
            stopping_word=word,
            text=rest,
            truncated=truncated or self.truncated,
            n_prompt_tokens=len(self.prompt),
            n_cached=self.n_cached,
            n_predicted=self.n_decoded,
            id_slot=self.id,
            n_past=self.n_past,
            timings=self.timings(now),
        )
        handle = self.handle
        self.pending = None
        self.state = SlotState.IDLE
        self.t_last_used = now
        self.handle = None
        handle.push(ev)
        return ev
