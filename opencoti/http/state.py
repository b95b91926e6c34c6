"""What the HTTP layer knows about the running server: parameters, the loaded
model's read-only parts (tokenizer, chat template, metadata), the engine, and
whether loading has finished.

Handler threads read this object; only ``set_ready`` (called once, by the
thread that loaded the model) writes it.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

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
