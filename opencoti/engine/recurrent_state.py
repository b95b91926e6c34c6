"""Per-sequence recurrent state of a hybrid model's linear-attention layers.

Modelled on llama.cpp's recurrent memory (``src/llama-memory-recurrent.cpp``,
used next to the KV cache by ``src/llama-memory-hybrid.cpp``). A gated
delta-net layer (Yang et al. 2024, "Gated Delta Networks: Improving Mamba2
with Delta Rule") does not keep one entry per token: it keeps, per sequence,

- a *conv state*: the last ``d_conv - 1`` inputs of its short causal
  depthwise convolution, float32 ``[d_conv - 1, n_channels]``, and
- an *ssm state*: the delta-rule matrix memory, float32
  ``[n_v_heads, d_k, d_v]`` (``S[h]`` maps a key to a value: ``o = S[h]^T q``),

both summarising every token the sequence has consumed so far. Hence the
semantics differ from the cell cache (``kv_cache.py``):

- the state of ``seq_id`` covers positions ``[0, n_pos[seq_id])`` and only
  ever grows by the tokens of the next ubatch, in order;
- removing a *suffix* that the state already absorbed is impossible
  (``seq_rm`` answers False and changes nothing); the caller must reprocess
  from position 0 (llama.cpp's server does the same when
  ``llama_memory_seq_rm`` fails);
- sharing is an exact, full-state copy (``seq_cp`` of the whole range); a
  partial copy cannot be represented, so the destination is left empty
  (``seq_cp`` answers False) and must be recomputed.

Storage: one state slot per seq_id (``n_seq_max`` slots), allocated once at
boot with the backend's ``zeros``. The bookkeeping (``n_pos``) stays NumPy;
the backend ops ``ssm_conv`` / ``gated_delta_net`` read and update the slots
of the sequences in a ubatch through an ``RSPlan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class RecurrentStateError(ValueError):
    """A ubatch does not continue a sequence's recurrent state (a scheduler bug); nothing changed."""


@dataclass
class RSView:
    """One sequence of a ubatch: ``rows`` (int ``[T_s]``, in position order) and its state ``slot``."""

    rows: np.ndarray
    slot: int
    seq_id: int


@dataclass
class RSPlan:
    """The sequences of a ubatch in the recurrent store (built by ``prepare``)."""

    views: list[RSView] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)  # slots whose state starts empty (zeroed by apply)


class RecurrentState:
    """Conv + ssm state per sequence for the recurrent layers ``layers``.

    Args:
        layers: model layer indices with a recurrent state.
        n_seq_max: number of seq_ids (slots + pools); one state slot each.
        conv_shape: ``(d_conv - 1, n_channels)``.
        ssm_shape: ``(n_v_heads, d_k, d_v)``.
        zeros: the backend's allocator ``zeros(shape, dtype)``.
        zeros_for: per-layer allocator ``zeros_for(il) -> zeros`` (partial offload:
            a layer's state on its backend); None = ``zeros`` for every layer.
    """

    def __init__(self, layers: list[int], n_seq_max: int, conv_shape: tuple[int, int],
                 ssm_shape: tuple[int, int, int], zeros=np.zeros, zeros_for=None):
        self.layers = list(layers)
        self.n_seq_max = n_seq_max
        alloc = zeros_for or (lambda il: zeros)
        self.conv = {il: alloc(il)((n_seq_max, *conv_shape), np.float32) for il in self.layers}
        self.ssm = {il: alloc(il)((n_seq_max, *ssm_shape), np.float32) for il in self.layers}
        self.n_pos = np.zeros(n_seq_max, dtype=np.int64)  # tokens absorbed per seq; 0 = empty

    # -- geometry ---------------------------------------------------------------------
    def _check(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.n_seq_max})")

    def nbytes(self) -> int:
        """Bytes of every state, both kinds (``nbytes_r() + nbytes_s()``)."""
        return self.nbytes_r() + self.nbytes_s()

    def nbytes_r(self) -> int:
        """Bytes of the conv states (llama.cpp's R tensors; float32)."""
        return sum(a.nbytes for a in self.conv.values())

    def nbytes_s(self) -> int:
        """Bytes of the delta-net states (llama.cpp's S tensors; float32)."""
        return sum(a.nbytes for a in self.ssm.values())

    def seq_pos_max(self, seq_id: int) -> int:
        """Position of the last token the state absorbed, -1 if empty."""
        self._check(seq_id)
        return int(self.n_pos[seq_id]) - 1

    def can_reuse(self, seq_id: int, n_past: int) -> bool:
        """Whether keeping ``seq_id``'s first ``n_past`` positions is possible:
        only the whole state (``n_past == n_pos``) or nothing (``n_past == 0``)."""
        self._check(seq_id)
        return n_past == 0 or int(self.n_pos[seq_id]) == n_past

    # -- sequence operations (llama.cpp names) ----------------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)`` (-1 = open end) of ``seq_id`` (< 0: every sequence).

        Possible when the range starts at or after the state's end (nothing to
        do) or covers the whole state (the state is emptied). Any other range
        would cut into absorbed tokens: returns False and changes nothing.
        """
        if seq_id < 0:
            ok = [self.seq_rm(s, p0, p1) for s in range(self.n_seq_max)]
            return all(ok)
        self._check(seq_id)
        n = int(self.n_pos[seq_id])
        p0 = max(p0, 0)
        p1 = np.iinfo(np.int64).max if p1 < 0 else p1
        if n == 0 or p0 >= n or p1 <= p0:
            return True
        if p0 == 0 and p1 >= n:
            self.n_pos[seq_id] = 0
            return True
        return False

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> bool:
        """Give ``dst`` a copy of ``src``'s state when ``[p0, p1)`` covers all of
        it (True). A partial range cannot be copied: ``dst`` is emptied and the
        answer is False (the caller recomputes ``dst``)."""
        self._check(src)
        self._check(dst)
        if src == dst:
            return True
        n = int(self.n_pos[src])
        full = max(p0, 0) == 0 and (p1 < 0 or p1 >= n)
        if not full or n == 0:
            self.n_pos[dst] = 0
            return n == 0 and full
        for il in self.layers:
            self.conv[il][dst] = self.conv[il][src]
            self.ssm[il][dst] = self.ssm[il][src]
        self.n_pos[dst] = n
        return True

    def seq_keep(self, seq_id: int) -> None:
        """Empty every state but ``seq_id``'s."""
        self._check(seq_id)
        keep = self.n_pos[seq_id]
        self.n_pos[:] = 0
        self.n_pos[seq_id] = keep

    def clear(self) -> None:
        self.n_pos[:] = 0

    # -- per-ubatch planning ----------------------------------------------------------
    def prepare(self, seq_ids: np.ndarray, pos: np.ndarray) -> RSPlan:
        """The ubatch's sequences and their state slots; changes nothing.

        Each sequence's rows must continue its state: positions
        ``n_pos, n_pos + 1, ...`` in row order. Raises ``RecurrentStateError``
        otherwise (the scheduler must reprocess from 0 instead).
        """
        plan = RSPlan()
        order = dict.fromkeys(int(s) for s in seq_ids)  # first-appearance order
        for s in order:
            self._check(s)
            rows = np.nonzero(seq_ids == s)[0]
            n = int(self.n_pos[s])
            want = np.arange(n, n + len(rows))
            if not np.array_equal(pos[rows], want):
                raise RecurrentStateError(
                    f"seq {s}: the recurrent state holds {n} tokens, but the ubatch feeds positions "
                    f"{pos[rows][:4].tolist()}...; a recurrent state only grows in order (reprocess from 0)")
            plan.views.append(RSView(rows, s, s))
            if n == 0:
                plan.fresh.append(s)
        return plan

    def apply(self, plan: RSPlan) -> None:
        """Commit a plan: zero the states of sequences starting at position 0
        and count the ubatch's tokens as absorbed (the forward then updates the
        slots in place)."""
        for s in plan.fresh:
            for il in self.layers:
                self.conv[il][s] = 0
                self.ssm[il][s] = 0
        for v in plan.views:
            self.n_pos[v.slot] += len(v.rows)
