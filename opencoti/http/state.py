"""What the HTTP layer knows about the running server: parameters, the loaded
model's read-only parts (tokenizer, chat template, metadata), the engine, and
whether loading has finished.

Handler threads read this object; only ``set_ready`` (called once, by the
thread that loaded the model) writes it.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Optional

from opencoti.http.metrics import ServerMetrics
from opencoti.params import Params
from opencoti.version import full_version


def model_display_name(params: Params, model: Any = None) -> str:
    """The model id clients see: ``--alias`` if set, else the model file's name
    (llama.cpp ``common_params_model::get_name``)."""
    if params.alias:
        return params.alias
    path = getattr(model, "path", None) or params.model
    if path:
        return os.path.basename(str(path))
    name = getattr(model, "name", None)
    return str(name) if name else "model"


class ServerState:
    """Shared, read-mostly state of one server.

    params: the run's Params. model: the loaded model (``.tokenizer``,
    ``.metadata``, ``.path``, ``.chat_template_source``) or None while loading.
    engine: the running Engine or None while loading. chat_template: the
    ChatTemplate chosen once at startup (None while loading).

    Also kept here: ``metrics`` (request counters for ``/metrics``), the
    requests in flight (weakly: a finished handle drops out by itself; used to
    fail them on shutdown), each slot's last request (``/slots`` ``params``),
    and ``shutting_down`` (new requests get 503).
    """

    def __init__(self, params: Params):
        self.params = params
        self.model: Any = None
        self.engine: Any = None
        self.tokenizer: Any = None
        self.chat_template: Any = None
        self.model_name: str = model_display_name(params)
        self.build_info: str = full_version()
        self._ready = threading.Event()
        self.load_error: Optional[str] = None
        self.metrics = ServerMetrics()
        self.shutting_down = False
        self.last_request: dict[int, Any] = {}  # id_slot -> the CompletionRequest it ran last
        self._inflight: "weakref.WeakSet" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._control_tokens: Optional[list[tuple[str, int]]] = None

    # ------------------------------------------------------------------
    def set_ready(self, model: Any, engine: Any, chat_template: Any) -> None:
        """Publish the loaded model and running engine; requests are served from now on."""
        self.model = model
        self.engine = engine
        self.tokenizer = model.tokenizer
        self.chat_template = chat_template
        self.model_name = model_display_name(self.params, model)
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    # ------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        """Number of slots (parallel sequences) the engine serves."""
        n = getattr(self.engine, "n_slots", None)
        return int(n) if n else max(1, int(self.params.n_parallel))

    @property
    def n_ctx_slot(self) -> int:
        """Context size (tokens) available to one slot.

        Uses the engine's ``n_ctx_slot`` if it has one, else ``n_ctx`` divided over
        the slots unless the KV cache is unified (llama.cpp ``llama_n_ctx_seq``).
        """
        eng = self.engine
        per_slot = getattr(eng, "n_ctx_slot", None)
        if per_slot:
            return int(per_slot)
        n_ctx = int(getattr(eng, "n_ctx", 0) or self.params.n_ctx)
        if self.params.kv_unified:
            return n_ctx
        return max(1, n_ctx // self.n_slots)

    # ------------------------------------------------------------------
    def track(self, handle: Any) -> None:
        """Remember an engine request in flight (for shutdown) and account it in
        ``/metrics`` when it finishes, read to the end or not (a client that left
        mid-stream still had its prompt evaluated and tokens generated)."""
        with self._lock:
            self._inflight.add(handle)
        request = handle.request
        handle.on_finish(lambda ev: self.on_finish(request, ev))

    def inflight(self) -> list:
        """The tracked requests that have not had their final event yet."""
        with self._lock:
            return [h for h in self._inflight if not h.done]

    def on_finish(self, request: Any, fin: Any) -> None:
        """A request finished: count it (``/metrics``) and note it as its slot's last."""
        self.metrics.on_finish(getattr(fin, "timings", None) or {})
        id_slot = getattr(fin, "id_slot", -1)
        if id_slot is not None and id_slot >= 0:
            self.last_request[id_slot] = request

    def fail_inflight(self, status: int, type: str, message: str) -> int:
        """Give every request in flight a final error event and cancel it in the
        engine (graceful shutdown: the handler threads answer at once instead of
        waiting for an engine that is going away). Returns how many."""
        from opencoti.engine.api import ErrorEvent

        n = 0
        for h in self.inflight():
            h.push(ErrorEvent(status, type, message))
            h.cancel()
            n += 1
        return n

    def control_tokens(self) -> list[tuple[str, int]]:
        """``(text, id)`` of the tokens only ``parse_special`` recognises (CONTROL and
        UNKNOWN, llama-vocab.cpp ``tokenizer_st_partition``), longest text first;
        computed once."""
        if self._control_tokens is None:
            from opencoti.model.tokenizer import ATTR_CONTROL, ATTR_UNKNOWN

            tok = self.tokenizer
            found = []
            for tid in range(tok.n_vocab):
                if tok.token_attr(tid) & (ATTR_CONTROL | ATTR_UNKNOWN):
                    text = tok.token_text(tid)
                    if text:
                        found.append((text, tid))
            found.sort(key=lambda x: -len(x[0]))
            self._control_tokens = found
        return self._control_tokens
