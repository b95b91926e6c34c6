"""The ubatch: one forward pass worth of tokens, and the per-step context
that travels with it (STYLE lesson 13: batch metadata in one object).

A ubatch mixes tokens of several sequences: the next token of each decoding
slot and chunks of prompts being prefilled. Rows are independent except
through the KV cache; ``out_rows`` says which rows need logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
