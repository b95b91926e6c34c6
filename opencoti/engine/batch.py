"""The ubatch: one forward pass worth of tokens, and the per-step context
that travels with it (STYLE lesson 13: batch metadata in one object), and
``StepResult``, a launched step's greedy result.

A ubatch mixes tokens of several sequences: the next token of each decoding
slot and chunks of prompts being prefilled. Rows are independent except
through the KV cache; ``out_rows`` says which rows need logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class UBatch:
    """tokens, pos, seq_id: int ``[n_tokens]``; out_rows: int ``[n_out]`` (rows to compute logits for)."""

    tokens: np.ndarray
    pos: np.ndarray
    seq_id: np.ndarray
    out_rows: np.ndarray
    plans: list = field(default_factory=list)  # kv_cache.CachePlan per cache, set by the runner
    # seq_id -> the PolyKV pool seq whose prefix cells it shares (shared-prefix attention hint)
    share_src: dict = field(default_factory=dict)
    # (rows int64 [m] of the logits rows, ids int64 [k]): logits a greedy step's argmax takes as
    # -inf (``Sampler.ban_ids``: ignore_eos's end-of-generation ids), or None
    argmax_ban: Optional[tuple] = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @staticmethod
    def build(tokens, pos, seq_id, out_rows) -> "UBatch":
        return UBatch(
            np.asarray(tokens, dtype=np.int64),
            np.asarray(pos, dtype=np.int32),
            np.asarray(seq_id, dtype=np.int64),
            np.asarray(out_rows, dtype=np.int64),
        )


class StepResult:
    """A launched step's greedy result (``ModelRunner.launch``): ``result()`` waits for it and
    returns ``(ids int64 [n_out], max float32 [n_out])`` (``sampling.rows_argmax``'s pair), the
    same pair on every later call. ``ids_dev``: the ids on the device (int64 ``[n_out]``) for a
    step chained after this one, None on the host. Built by ``done`` (already known) or by a
    backend with its own ``wait`` (a device event) and ``fetch`` (the pair once it is there)."""

    __slots__ = ("_pair", "_wait", "_fetch", "ids_dev")

    def __init__(self, wait=None, fetch=None, ids_dev=None):
        self._pair, self._wait, self._fetch, self.ids_dev = None, wait, fetch, ids_dev

    @staticmethod
    def done(pair) -> "StepResult":
        r = StepResult()
        r._pair = (np.asarray(pair[0], dtype=np.int64), np.asarray(pair[1], dtype=np.float32))
        return r

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self._pair is None:
            self._wait()
            self._pair = self._fetch()
            self._wait = self._fetch = None
        return self._pair
