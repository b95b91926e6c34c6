"""KV cache: cells with positions and sequence membership, in streams.

Modelled on llama.cpp's cell cache (``src/llama-kv-cells.h``,
``src/llama-kv-cache.cpp``, ``src/llama-kv-cache-iswa.cpp``):

- A *stream* holds ``n_cells`` cells. Cell ``i`` has a position ``pos[i]``
  (-1 = empty) and a membership set ``seq[:, i]`` (bool per seq_id; stored
  seq-major, ``seq[stream, seq_id, cell]``, so one sequence's cells are one
  contiguous row). A cell is empty exactly when no sequence is a member.
- A query token of sequence ``s`` at position ``p`` attends every cell of its
  stream with ``seq[s, c]`` and ``pos[c] <= p`` (and ``p - pos[c] < n_swa`` on
  a sliding-window layer).
- Sharing is membership: ``seq_cp(src, dst)`` adds ``dst`` to ``src``'s cells;
  nothing is copied. ``seq_rm`` / ``seq_keep`` / ``seq_add`` as in llama.cpp.
- ``--kv-unified``: one stream of ``n_ctx`` cells for every sequence.
  Otherwise one stream per sequence, ``n_ctx / n_seq`` cells each, and
  ``seq_cp`` across streams copies the cells' data physically.
- iSWA models (Gemma-3/4) get two caches: one for global layers and one for
  sliding-window layers, whose cells are pruned once they fall out of every
  member's window. Each cache has its own K/V head shape (Gemma-4's global
  layers have a larger head dim and fewer KV heads).
- KV-sharing layers (Gemma-4 E-series: ``hp.kv_reuse``) store nothing; they
  attend over an earlier layer's cells (``layer_cache[il]`` is that layer's cache).
- Hybrid models (Qwen3.5 / Qwen3-next) keep KV cells for their attention
  layers only; their gated delta-net layers keep one recurrent state per
  sequence (``recurrent_state.RecurrentState``, llama.cpp's
  ``llama_memory_hybrid``). Such a state can only be shared or kept whole, so
  ``seq_rm`` of an absorbed suffix answers False and ``can_reuse`` holds only
  for the state's exact length.

The cache owns all bookkeeping; backends only read the index arrays that
``prepare`` hands them (paged attention at cell granularity).

Storage per layer: ``k[il]`` ``[n_stream, n_cells, n_head_kv, row_k]`` and
``v[il]`` ``[n_stream, n_cells, n_head_kv, row_v]`` in the cache half's tier
(``opencoti.engine.kv_tiers``): for f32 / f16 a float array with ``row = d``, for
every other tier uint8 with ``row = tier.bytes_per_row(d)``. A cell is quantized
once, when it is written (``write``); ``seq_cp`` across streams copies its bytes;
``read_k`` / ``read_v`` dequantize gathered cells to float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opencoti.engine.kv_tiers import convert, get_tier
from opencoti.engine.recurrent_state import RecurrentState

N_PAD = 256  # llama.cpp pads cache sizes to 256 cells



def _one_row_each(seq_ids: np.ndarray) -> bool:
    """True when no sequence id repeats in ``seq_ids`` (int ``[n]``): a decode step, whose
    bookkeeping skips the grouping by sequence."""
    return len(seq_ids) == 1 or len(set(seq_ids.tolist())) == len(seq_ids)

class KVCacheFullError(RuntimeError):
    """No free cells for a ubatch; nothing was changed."""


def pad_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass
class SeqView:
    """What attention needs for one sequence in one cache for one ubatch.

    rows: ubatch token rows of this sequence, int ``[T_s]``.
    stream: the stream the sequence lives in.
    cells: the sequence's cell indices in that stream after the ubatch's
        writes, int ``[C_s]`` (attention masks by position), the ubatch's new cells
        (``rows``' cells, in row order) last and nowhere else.
    cell_pos: ``pos`` of those cells, int ``[C_s]``.
    """

    rows: np.ndarray
    stream: int
    cells: np.ndarray
    cell_pos: np.ndarray
    seq_id: int = -1
    private: np.ndarray | None = None  # set when in a SharedGroup: cells not shared with the group
    private_pos: np.ndarray | None = None


@dataclass
class SharedGroup:
    """Sequences of one ubatch that share a pool prefix: ``views`` (indices into
    ``CachePlan.views``), the ``stream``, the shared ``cells`` and their ``cell_pos``."""

    views: list[int]
    stream: int
    cells: np.ndarray
    cell_pos: np.ndarray


@dataclass
class ViewArrays:
    """A decode step's views as arrays (one row per sequence; ``KVCache.apply``'s fast path):
    view i is sequence ``seq[i]`` in ``stream[i]``, ubatch row ``row[i]``, its cells
    ``cells[off[i]:off[i + 1]]`` with positions ``cell_pos[...]``. All int64; views in
    ascending seq_id order (as ``CachePlan.views``)."""

    row: np.ndarray
    stream: np.ndarray
    seq: np.ndarray
    off: np.ndarray
    cells: np.ndarray
    cell_pos: np.ndarray


class _Layout:
    """The cell lists of the last decode step's sequences, flat (``KVCache``'s decode fast path):
    sequence ``seqs[i]`` (ascending; ``sl`` as a list) of stream ``streams[i]`` holds
    ``cells[off[i]:off[i + 1]]`` (its cached list, in order) at positions ``cpos[...]``; all
    int64. ``seg``: the common length of the lists, -1 when they differ. ``asc``: every list's
    positions ascend (tracked for sliding-window caches, whose pruning then reads the first
    cells of each list only; False = unknown). ``idx[s]``: i for a
    held sequence, -1 for one that is not (never held, or dropped when its cells changed
    otherwise). ``intact``: every sequence of the step is still held. The arrays are never
    written in place (the steps' ``ViewArrays`` and ``cells_of`` slices share them); a step
    binds new ones."""

    __slots__ = ("seqs", "sl", "streams", "off", "cells", "cpos", "seg", "asc", "idx", "intact", "rows", "step")

    def __init__(self, seqs, streams, off, cells, cpos, n_seq_max: int, track_asc: bool = False):
        n = len(seqs)
        self.seqs, self.sl, self.streams = seqs, seqs.tolist(), streams
        self.off, self.cells, self.cpos = off, cells, cpos
        self.rows, self.step = np.arange(n), np.arange(n + 1)  # a step's row order; off's growth
        self.idx = np.full(n_seq_max, -1, dtype=np.int64)
        self.idx[seqs] = self.rows
        self.intact = True
        self.set_seg()
        self.asc = track_asc and self.ascending()

    def set_seg(self) -> None:
        lens = self.off[1:] - self.off[:-1]
        self.seg = int(lens[0]) if len(lens) and bool((lens == lens[0]).all()) else -1

    def ascending(self) -> bool:
        """Whether every list's positions strictly ascend (one pass over ``cpos``)."""
        cpos, off = self.cpos, self.off
        if len(cpos) < 2:
            return True
        up = cpos[1:] > cpos[:-1]
        b = off[1:-1]  # pair (b - 1, b) spans two lists
        up[b[(b > 0) & (b < len(cpos))] - 1] = True
        return bool(up.all())

    def appends_ascend(self, new_pos: np.ndarray) -> bool:
        """Whether appending ``new_pos[i]`` to list i keeps every list ascending (given ``asc``)."""
        if self.seg == 0:
            return True
        if self.seg > 0:
            return bool((new_pos > self.cpos[self.off[1:] - 1]).all())
        nz = self.off[1:] > self.off[:-1]
        return bool((new_pos[nz] > self.cpos[self.off[1:][nz] - 1]).all())

    def holds(self, seqs: np.ndarray) -> bool:
        """True when the layout is intact and holds exactly ``seqs`` (int64, ascending)."""
        return self.intact and len(seqs) == len(self.seqs) and bool((seqs == self.seqs).all())


def _append_each(a: np.ndarray, off: np.ndarray, x: np.ndarray, seg: int) -> np.ndarray:
    """Segments ``a[off[i]:off[i + 1]]`` (int64, ``off [n + 1]`` from 0 to ``len(a)``) with
    ``x[i]`` appended to segment i, concatenated: int64 ``[len(a) + n]`` (``np.insert`` at
    ``off[1:]``, without its overhead). ``seg``: every segment's length (a 2-D copy), or -1."""
    n = len(x)
    out = np.empty(len(a) + n, dtype=np.int64)
    if seg >= 0:
        o2 = out.reshape(n, seg + 1)
        o2[:, :seg] = a.reshape(n, seg)
        o2[:, seg] = x
        return out
    at = off[1:] + np.arange(n)
    keep = np.ones(len(out), dtype=bool)
    keep[at] = False
    out[keep] = a
    out[at] = x
    return out


class CachePlan:
    """The cells a ubatch writes in one cache: ``stream[t]``, ``cell[t]`` for token row t.

    After ``KVCache.apply``: ``views`` (a ``SeqView`` per sequence of the ubatch, ascending
    seq_id) and ``groups`` (PolyKV ``SharedGroup``s). A decode step (one row per sequence, with
    or without sharers) is committed as ``arrays`` (``ViewArrays``) instead, so a device backend stages it
    without a Python object per sequence; ``views`` is then built from them on first access."""

    def __init__(self, stream: np.ndarray, cell: np.ndarray, views: list | None = None,
                 groups: list | None = None):
        self.stream = stream
        self.cell = cell
        self._views = views if views is not None else []
        self.groups = groups if groups is not None else []
        self.arrays: ViewArrays | None = None

    @property
    def views(self) -> list[SeqView]:
        if self._views is None:
            a = self.arrays
            off = a.off.tolist()
            self._views = [SeqView(a.row[i:i + 1], int(a.stream[i]), a.cells[off[i]:off[i + 1]],
                                   a.cell_pos[off[i]:off[i + 1]], int(a.seq[i])) for i in range(len(a.seq))]
        return self._views

    @views.setter
    def views(self, views: list[SeqView]) -> None:
        self._views = views
        self.arrays = None

    def set_arrays(self, arrays: ViewArrays) -> None:
        """Commit the views as ``arrays`` (``views`` is built from them when read)."""
        self.arrays = arrays
        self._views = None

    @property
    def n_views(self) -> int:
        return len(self.arrays.seq) if self.arrays is not None else len(self._views)

    def view_lens(self) -> np.ndarray:
        """Cells per view, int64 ``[n_views]``."""
        if self.arrays is not None:
            off = self.arrays.off
            return off[1:] - off[:-1]
        return np.fromiter((len(v.cells) for v in self._views), dtype=np.int64, count=len(self._views))

    def flat(self, n_cells: int, cap: int | None = None) -> list[np.ndarray]:
        """The plan as the five int64 index arrays device attention kernels read (cells flat:
        ``stream * n_cells + cell``): ``write [T]`` (the cell each token row writes),
        ``row_view [T]`` (the view of each row), ``view_off [n_views + 1]`` (view i's cells are
        ``cells[view_off[i]:view_off[i + 1]]``), ``cells`` and ``cell_pos`` (all views' cell
        lists and their positions, in view order). Each view's list ends with the cells its rows
        write (one a row) and holds no other written cell, so a view's first ``len - T`` cells
        are not written by this ubatch: the CUDA short-row attention kernels ask for them before
        their PDL wait, while the KV store may still run (attention.cu ``early_rows``).
        ``cap``: pad ``cells`` / ``cell_pos`` with
        zeros to this length (a captured graph's fixed buffer). Raises ``ValueError`` when the
        cell lists are longer than ``cap``."""
        if self.arrays is not None and len(self.arrays.seq):
            return self._flat_arrays(n_cells, cap)
        lens = self.view_lens()
        n_views = len(lens)
        off = np.zeros(n_views + 1, dtype=np.int64)
        np.cumsum(lens, out=off[1:])
        total = int(off[-1])
        if cap is not None and total > cap:
            raise ValueError(f"the plan's cell lists ({total}) exceed the buffer ({cap})")
        n = total if cap is None else cap
        cells, cpos = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        row_view = np.zeros(len(self.cell), dtype=np.int64)
        if n_views:
            a = self.arrays
            if a is not None:
                cells[:total], cpos[:total], streams = a.cells, a.cell_pos, a.stream
                row_view[a.row] = np.arange(n_views)
            else:
                views = self._views
                cells[:total] = np.concatenate([v.cells for v in views])
                cpos[:total] = np.concatenate([v.cell_pos for v in views])
                streams = np.fromiter((v.stream for v in views), dtype=np.int64, count=n_views)
                n_rows = [len(v.rows) for v in views]
                row_view[np.concatenate([np.asarray(v.rows, dtype=np.int64) for v in views])] = \
                    np.repeat(np.arange(n_views), n_rows)
            if streams.any():
                cells[:total] += np.repeat(streams, lens) * n_cells
        write = np.asarray(self.stream, dtype=np.int64) * n_cells + np.asarray(self.cell, dtype=np.int64)
        return [write, row_view, off, cells, cpos]

    def _flat_arrays(self, n_cells: int, cap: int | None) -> list[np.ndarray]:
        """``flat`` of a plan committed as ``arrays``: copies of the flat lists, no gathering."""
        a = self.arrays
        off = a.off.copy()  # from 0: the lists are concatenated in view order
        total = int(off[-1])
        if cap is not None and total > cap:
            raise ValueError(f"the plan's cell lists ({total}) exceed the buffer ({cap})")
        if cap is None:
            cells, cpos = np.array(a.cells, dtype=np.int64), np.array(a.cell_pos, dtype=np.int64)
        else:
            cells, cpos = np.zeros(cap, dtype=np.int64), np.zeros(cap, dtype=np.int64)
            cells[:total], cpos[:total] = a.cells, a.cell_pos
        if a.stream.any():
            cells[:total] += np.repeat(a.stream, off[1:] - off[:-1]) * n_cells
        row_view = np.zeros(len(self.cell), dtype=np.int64)
        row_view[a.row] = np.arange(len(a.seq))
        write = np.asarray(self.stream, dtype=np.int64) * n_cells + np.asarray(self.cell, dtype=np.int64)
        return [write, row_view, off, cells, cpos]


class KVCache:
    """One cell cache over a subset of the model's layers.

    Args:
        layers: model layer indices stored here.
        n_cells: cells per stream.
        n_stream: 1 (unified) or ``n_seq_max`` (one stream per sequence).
        n_seq_max: number of seq_ids (slots + pools).
        n_head_kv, d_k, d_v: per-layer K/V shape.
        type_k, type_v: storage tier of each half (a name from ``kv_tiers.TIER_NAMES``
            or a ``KVTier``).
        type_k_tail, type_v_tail: tier of a spilled tail (None = the same as the
            main tier); no tail storage is allocated here, ``to_tail`` converts cells.
        n_swa: sliding window (0 = global layers; > 0 enables pruning).
        zeros: allocator ``zeros(shape, dtype)`` for K/V storage (the backend's:
            NumPy on the CPU, device memory on a GPU); the bookkeeping stays NumPy.
        zeros_for: per-layer allocator ``zeros_for(il) -> zeros`` (partial offload,
            ``-ngl``: each layer's K/V on that layer's backend); None = ``zeros`` for all.
        kv_ops: for device storage, the backend whose ``kv_read(store, tier, stream, cells)``
            / ``kv_store(store, tier, stream, cells, x)`` dequantize / quantize a quantized
            tier's rows there (``read_k`` / ``read_v`` / ``store_k``); None = the tier's NumPy
            code (CPU storage; the native float tiers work on device arrays as they are).
        kv_ops_for: per-layer ``kv_ops_for(il) -> kv_ops`` (partial offload: the backend that
            holds layer ``il``'s storage, None for a CPU layer); None = ``kv_ops`` for all.
    Raises ``ValueError`` for an unknown tier or a head size the tier cannot store.

    Decode steps take fast paths (``fast``; False = the general code alone, which the tests
    compare against): the last decode step's cell lists stay flat (``_Layout``), so the next
    step of the same sequences prunes and appends on two arrays instead of gathering every
    list and position again, and free cells are searched from ``_lo``, below which no cell
    is free.
    """

    fast = True

    def __init__(
        self,
        layers: list[int],
        n_cells: int,
        n_stream: int,
        n_seq_max: int,
        n_head_kv: int,
        d_k: int,
        d_v: int,
        type_k="f16",
        type_v="f16",
        n_swa: int = 0,
        zeros=np.zeros,
        type_k_tail=None,
        type_v_tail=None,
        zeros_for=None,
        kv_ops=None,
        kv_ops_for=None,
    ):
        self.tier_k, self.tier_v = get_tier(type_k), get_tier(type_v)
        self.tier_k_tail = self.tier_k if type_k_tail is None else get_tier(type_k_tail)
        self.tier_v_tail = self.tier_v if type_v_tail is None else get_tier(type_v_tail)
        for t, tail, d, flag in ((self.tier_k, self.tier_k_tail, d_k, "-ctk"),
                                 (self.tier_v, self.tier_v_tail, d_v, "-ctv")):
            t.check_dim(d)
            try:
                tail.check_dim(d)
            except ValueError as e:  # the tail's type came from its own flag: say which
                raise ValueError(f"{flag}t (the spilled tail's type): {e}") from None
        self.layers = list(layers)
        self.n_cells = n_cells
        self.n_stream = n_stream
        self.n_seq_max = n_seq_max
        self.n_swa = n_swa
        self.n_head_kv, self.d_k, self.d_v = n_head_kv, d_k, d_v
        self.pos = np.full((n_stream, n_cells), -1, dtype=np.int32)
        self.seq = np.zeros((n_stream, n_seq_max, n_cells), dtype=bool)  # [stream, seq_id, cell]
        # member cells per seq_id (None = recompute from ``seq``): a decode step then
        # costs O(cells of the ubatch's sequences), not O(n_seq * n_cells)
        self._cells: list[np.ndarray | None] = [None] * n_seq_max
        self._lay: _Layout | None = None  # the last decode step's lists (override ``_cells``)
        self._lo = [0] * n_stream  # per stream: every cell below is in use (pos >= 0)
        self._neg = False  # a negative position was written: no layouts (their positions are cached)
        shape_k = (n_stream, n_cells, n_head_kv, self.tier_k.row_len(d_k))
        shape_v = (n_stream, n_cells, n_head_kv, self.tier_v.row_len(d_v))
        alloc = zeros_for or (lambda il: zeros)
        self.k = {il: alloc(il)(shape_k, self.tier_k.dtype) for il in layers}
        self.v = {il: alloc(il)(shape_v, self.tier_v.dtype) for il in layers}
        ops = kv_ops_for or (lambda il: kv_ops)
        self.kv_ops = {il: ops(il) for il in layers}  # per layer: device backend or None

    @property
    def type_k(self) -> str:
        return self.tier_k.name

    @property
    def type_v(self) -> str:
        return self.tier_v.name

    # -- geometry ---------------------------------------------------------------------
    def stream_of(self, seq_id: int) -> int:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.n_seq_max})")
        return 0 if self.n_stream == 1 else seq_id

    def nbytes_k(self) -> int:
        """Bytes of K storage (all layers and streams)."""
        return sum(int(a.nbytes) for a in self.k.values())

    def nbytes_v(self) -> int:
        """Bytes of V storage (all layers and streams)."""
        return sum(int(a.nbytes) for a in self.v.values())

    def nbytes(self) -> int:
        return self.nbytes_k() + self.nbytes_v()

    @property
    def n_cells_resident(self) -> int:
        """Cells per stream whose K/V live in this cache's storage (all of them: nothing
        spills until rolling-KV residency exists)."""
        return self.n_cells

    def n_used(self, stream: int | None = None) -> int:
        """Number of non-empty cells (in one stream or all)."""
        p = self.pos if stream is None else self.pos[stream]
        return int(np.count_nonzero(p >= 0))

    # -- sequence operations (llama.cpp names) ----------------------------------------
    def _range(self, seq_id: int, p0: int, p1: int):
        st = self.stream_of(seq_id)
        p0 = np.iinfo(np.int32).min if p0 < 0 else p0  # (from the first: a negative position too)
        p1 = np.iinfo(np.int32).max if p1 < 0 else p1
        pos = self.pos[st]
        m = self.seq[st, seq_id] & (pos >= p0) & (pos < p1)
        return st, m

    def _gc(self, st: int, cells: np.ndarray | None = None) -> None:
        """Mark cells without members empty (all cells, or only ``cells``)."""
        if cells is None:
            self.pos[st, ~self.seq[st].any(axis=0)] = -1
            self._lo[st] = 0
        elif len(cells):
            gone = cells[~self.seq[st][:, cells].any(axis=0)]
            self.pos[st, gone] = -1
            if len(gone):
                self._lo[st] = min(self._lo[st], int(gone.min()))

    def cells_of(self, seq_id: int) -> np.ndarray:
        """Cell indices (in ``seq_id``'s stream, any order) that ``seq_id`` is a member
        of (cached; do not modify the returned array)."""
        lay = self._lay
        if lay is not None:
            i = lay.idx[seq_id]
            if i >= 0:
                return lay.cells[lay.off[i]:lay.off[i + 1]]
        c = self._cells[seq_id]
        if c is None:
            c = self._cells[seq_id] = np.nonzero(self.seq[self.stream_of(seq_id), seq_id])[0]
        return c

    def shared_len(self, a: int, b: int, n: int) -> int:
        """The longest ``k <= n`` such that at every position ``p < k`` sequence ``a``'s cell is
        also a member of sequence ``b`` (shared by membership, not copied; 0 across streams).
        Raises ``ValueError`` for a seq_id out of range."""
        st = self.stream_of(a)
        if self.stream_of(b) != st or n <= 0:
            return 0
        ca = self.cells_of(a)
        pa = self.pos[st, ca]
        m = (pa >= 0) & (pa < n)
        shared = np.zeros(n, dtype=bool)
        shared[pa[m][self.seq[st, b, ca[m]]]] = True
        return n if shared.all() else int(np.argmin(shared))

    def _set_cells(self, seq_id: int, cells: np.ndarray | None) -> None:
        """Cache ``cells`` as ``seq_id``'s list (None: recompute from membership when next read),
        dropping the sequence from the layout."""
        lay = self._lay
        if lay is not None and lay.idx[seq_id] >= 0:
            lay.idx[seq_id] = -1
            lay.intact = False
        self._cells[seq_id] = cells

    def _set_layout(self, lay: _Layout | None) -> None:
        """Replace the layout; the sequences the old one held and the new one does not get their
        lists back in ``_cells``."""
        old = self._lay
        if old is not None:
            held = np.nonzero(old.idx >= 0)[0]
            if lay is not None:
                held = held[lay.idx[held] < 0]
            off = old.off.tolist()
            for s, i in zip(held.tolist(), old.idx[held].tolist()):
                self._cells[s] = old.cells[off[i]:off[i + 1]]
        self._lay = lay

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Remove ``seq_id`` from its cells with position in ``[p0, p1)`` (-1 = open end).

        ``seq_id`` < 0 removes every sequence in the range.
        """
        if seq_id < 0:
            for s in range(self.n_seq_max):
                self.seq_rm(s, p0, p1)
            return
        st, m = self._range(seq_id, p0, p1)
        cells = np.nonzero(m)[0]
        self.seq[st, seq_id, cells] = False
        self._set_cells(seq_id, None)
        self._gc(st, cells)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` a member of ``src``'s cells in ``[p0, p1)``.

        Same stream: membership only (zero-copy). Different streams: the cells'
        positions and K/V data are copied into free cells of ``dst``'s stream.
        Raises ``KVCacheFullError`` when the destination stream lacks room.
        """
        st_s, m = self._range(src, p0, p1)
        st_d = self.stream_of(dst)
        if st_s == st_d:
            self.seq[st_s, dst, m] = True
            self._set_cells(dst, None)
            return
        src_cells = np.nonzero(m)[0]
        free = np.nonzero(self._free_mask(st_d))[0]
        if len(free) < len(src_cells):
            raise KVCacheFullError(f"seq_cp: stream {st_d} has {len(free)} free cells, need {len(src_cells)}")
        dst_cells = free[: len(src_cells)]
        self.pos[st_d, dst_cells] = self.pos[st_s, src_cells]
        self.seq[st_d, dst, dst_cells] = True
        self._set_cells(dst, None)
        for il in self.layers:
            self.k[il][st_d, dst_cells] = self.k[il][st_s, src_cells]
            self.v[il][st_d, dst_cells] = self.v[il][st_s, src_cells]

    def seq_keep(self, seq_id: int) -> None:
        """Remove every sequence but ``seq_id`` from every cell."""
        for s in range(self.n_seq_max):
            if s != seq_id:
                self.seq_rm(s)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> np.ndarray:
        """Shift positions of ``seq_id``'s cells in ``[p0, p1)`` by ``delta``.

        Cells shifted below 0 are removed. Returns the per-cell shift applied in
        ``seq_id``'s stream (int32 ``[n_cells]``), which the caller must apply to
        the cached K (re-rotation) before the next attention. Only cells whose
        sole member is ``seq_id`` may be shifted (as in llama.cpp, shifting a
        shared cell would move it for every member); a shared cell raises ``ValueError``.
        """
        st, m = self._range(seq_id, p0, p1)
        if np.any(self.seq[st][:, m].sum(axis=0) > 1):
            raise ValueError("seq_add on cells shared with another sequence")
        shift = np.zeros(self.n_cells, dtype=np.int32)
        shift[m] = delta
        if m.any():  # positions move: the list stays, out of the layout (which caches positions)
            self._set_cells(seq_id, self.cells_of(seq_id))
        self.pos[st, m] += delta
        gone = m & (self.pos[st] < 0)
        if gone.any():
            self.seq[st, :, gone] = False
            self._set_cells(seq_id, None)
            self._lo[st] = 0
        self.pos[st, gone] = -1
        shift[gone] = 0
        return shift

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id``'s cells, -1 if it has none."""
        p = self.pos[self.stream_of(seq_id)][self.cells_of(seq_id)]
        return int(p.min()) if p.size else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id``'s cells, -1 if it has none."""
        p = self.pos[self.stream_of(seq_id)][self.cells_of(seq_id)]
        return int(p.max()) if p.size else -1

    def clear(self) -> None:
        self.pos[:] = -1
        self.seq[:] = False
        self._cells = [None] * self.n_seq_max
        self._lay = None
        self._lo = [0] * self.n_stream
        self._neg = False

    # -- per-ubatch planning ----------------------------------------------------------
    def prune_swa(self, seq_ids: np.ndarray, pos: np.ndarray) -> None:
        """Drop membership of cells that fell out of the window of every later query.

        For each sequence s in the ubatch with smallest query position p_min,
        a cell at position q with ``p_min - q >= n_swa`` can never be seen again
        by s (positions only grow), so s leaves it. No-op for global caches.
        """
        if self.n_swa <= 0 or len(seq_ids) == 0:
            return
        seq_ids, pos = np.asarray(seq_ids, dtype=np.int64), np.asarray(pos, dtype=np.int64)
        if _one_row_each(seq_ids):  # a decode step: each sequence's one position is its minimum
            if self._lay is not None and self.fast and self._prune_layout(seq_ids, pos):
                return
            seqs, p_min = seq_ids, pos
        else:
            seqs, inv = np.unique(seq_ids, return_inverse=True)
            p_min = np.full(len(seqs), np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(p_min, inv, pos)
        p_end = p_min - self.n_swa + 1  # prune positions < p_end
        keep = p_end > 0
        seqs, p_end = seqs[keep], p_end[keep]
        if len(seqs) == 0:
            return
        sl = seqs.tolist()
        lists = [self.cells_of(s) for s in sl]
        lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        streams = self._streams(seqs)
        allc = np.concatenate(lists)
        old = self._pos_at(streams, lens, allc) < np.repeat(p_end, lens)  # all sequences at once
        if not old.any():
            return
        rep_st = np.repeat(streams, lens)
        n_old = np.bincount(np.repeat(np.arange(len(sl)), lens)[old], minlength=len(sl))
        self.seq[rep_st[old], np.repeat(seqs, lens)[old], allc[old]] = False
        kept = allc[~old]
        koff = np.r_[0, np.cumsum(lens - n_old)].tolist()
        for j in np.nonzero(n_old)[0].tolist():
            self._set_cells(sl[j], kept[koff[j]:koff[j + 1]])
        for st in np.unique(rep_st[old]).tolist():
            self._gc(st, np.unique(allc[old & (rep_st == st)]))

    def _prune_layout(self, seq_ids: np.ndarray, pos: np.ndarray) -> bool:
        """``prune_swa`` of a decode step whose sequences the layout holds (else False, nothing
        done): the held positions are compared with each sequence's window start in one pass,
        and the layout drops the pruned cells in place of the lists. Same cells, lists and
        order as the general code (a held cell's position is >= 0, so a sequence whose window
        starts at or below 0 loses nothing there either)."""
        lay = self._lay
        if self._neg or not lay.intact:
            return False
        if seq_ids.tolist() != lay.sl:
            order = np.argsort(seq_ids, kind="stable")
            if not lay.holds(seq_ids[order]):
                return False
            pos = pos[order]
        p_end = pos - (self.n_swa - 1)  # prune positions < p_end, per held sequence
        off, cells, cpos, n, seg = lay.off, lay.cells, lay.cpos, len(lay.sl), lay.seg
        if seg > 0 and lay.asc:  # ascending lists: their first cells are the oldest
            cp2 = cpos.reshape(n, seg)
            first = cp2[:, 0] < p_end
            if not first.any():
                return True
            if first.all() and (seg == 1 or not (cp2[:, 1] < p_end).any()):  # each list's first cell
                self._prune_first(1)
                return True
        if seg >= 0:  # equal lists: one 2-D comparison
            old2 = cpos.reshape(n, seg) < p_end[:, None]
            n_all = int(np.count_nonzero(old2))
            if not n_all:
                return True
            k, rem = divmod(n_all, n)
            if not rem and bool(old2[:, :k].all()):  # n * k old cells, each list's first k
                self._prune_first(k)
                return True
            old = old2.reshape(-1)
            n_old = np.count_nonzero(old2, axis=1)
        else:
            old = cpos < np.repeat(p_end, off[1:] - off[:-1])
            if not old.any():
                return True
            n_old = np.bincount(np.searchsorted(off, np.flatnonzero(old), side="right") - 1, minlength=n)
        view = np.repeat(lay.rows, n_old)  # the view of each pruned cell (in cell-list order)
        c_old = cells[old]
        keep = ~old
        lay.cells, lay.cpos = cells[keep], cpos[keep]
        lay.off = off.copy()
        lay.off[1:] -= np.cumsum(n_old)
        lay.set_seg()
        self._prune_members(view, c_old)
        return True

    def _prune_first(self, k: int) -> None:
        """Prune the first ``k`` cells of every held list (all of equal length ``seg >= k``)."""
        lay = self._lay
        n, seg = len(lay.sl), lay.seg
        cells2 = lay.cells.reshape(n, seg)
        c_old = cells2[:, :k].reshape(-1)
        lay.cells = cells2[:, k:].reshape(-1)
        lay.cpos = lay.cpos.reshape(n, seg)[:, k:].reshape(-1)
        lay.off = lay.off - lay.step * k
        lay.seg = seg - k
        self._prune_members(np.repeat(lay.rows, k), c_old)

    def _prune_members(self, view: np.ndarray, c_old: np.ndarray) -> None:
        """Membership side of ``_prune_layout``: held sequence ``view[j]`` leaves cell
        ``c_old[j]``; cells left without members become free."""
        lay = self._lay
        st_old = lay.streams[view]
        self.seq[st_old, lay.seqs[view], c_old] = False
        if self.n_stream == 1:  # (a cell listed twice is freed once all the same)
            self._gc(0, c_old)
        else:
            for st in np.unique(st_old).tolist():
                self._gc(st, c_old[st_old == st])

    def _pos_at(self, streams: np.ndarray, lens: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """Positions of ``cells`` (int64 [sum(lens)]: ``lens[i]`` cells of stream ``streams[i]``
        in a row), int32, through a flat ``np.take``: ~7x faster than the 2-D fancy index
        ``self.pos[np.repeat(streams, lens), cells]`` on the ~60k cells of a 64-sequence decode
        step."""
        if self.n_stream == 1:
            return np.take(self.pos[0], cells)
        return np.take(self.pos.reshape(-1), np.repeat(streams, lens) * self.n_cells + cells)

    def _streams(self, seq_ids: np.ndarray) -> np.ndarray:
        """``stream_of`` for an int64 array of seq_ids (``ValueError`` for one out of range)."""
        if len(seq_ids) and (seq_ids.min() < 0 or seq_ids.max() >= self.n_seq_max):
            bad = seq_ids[(seq_ids < 0) | (seq_ids >= self.n_seq_max)][0]
            raise ValueError(f"seq_id {bad} out of range [0, {self.n_seq_max})")
        return np.zeros(len(seq_ids), dtype=np.int64) if self.n_stream == 1 else seq_ids.astype(np.int64)

    def prepare(self, seq_ids: np.ndarray, pos: np.ndarray) -> CachePlan:
        """Choose free cells for each token of a ubatch; changes nothing.

        seq_ids, pos: int ``[n_tokens]``. Raises ``KVCacheFullError`` when a
        stream lacks free cells.
        """
        n = len(seq_ids)
        stream = self._streams(np.asarray(seq_ids, dtype=np.int64))
        if self.fast:
            if self.n_stream == 1:
                return CachePlan(stream=stream, cell=self._free(0, n))
            if _one_row_each(stream):  # one row per stream, streams in ascending order as below
                cell = np.empty(n, dtype=np.int64)
                for i in np.argsort(stream, kind="stable").tolist():
                    cell[i] = self._free(int(stream[i]), 1)[0]
                return CachePlan(stream=stream, cell=cell)
        cell = np.empty(n, dtype=np.int64)
        for st in np.unique(stream):
            rows = np.nonzero(stream == st)[0]
            if self.fast:
                cell[rows] = self._free(int(st), len(rows))
                continue
            free = np.nonzero(self._free_mask(int(st)))[0]
            if len(free) < len(rows):
                raise KVCacheFullError(
                    f"KV cache full: stream {st} has {len(free)} free cells, ubatch needs {len(rows)}"
                )
            cell[rows] = free[: len(rows)]
        return CachePlan(stream=stream, cell=cell)

    def _free_mask(self, st: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Which cells ``[lo, hi)`` of stream ``st`` are free (bool): a negative position and,
        once a negative position was written (``_neg``), no member sequence either (such a
        cell holds that token; reusing it would list it twice in its sequence's view and
        break ``CachePlan.flat``'s order: the ubatch's new cells end each view)."""
        f = self.pos[st, lo:hi] < 0
        if self._neg:
            f &= ~self.seq[st, :, lo:hi].any(axis=0)
        return f

    def _free(self, st: int, n: int) -> np.ndarray:
        """The first ``n`` free cells of stream ``st`` (int64, ascending; ``_free_mask``),
        searched from ``_lo[st]`` (a window of the next ``max(4n, 256)`` cells first, then the
        rest), which moves up to the first free cell found. ``KVCacheFullError`` when fewer
        are free."""
        lo = self._lo[st]
        hi = lo + max(4 * n, 256)
        f = np.flatnonzero(self._free_mask(st, lo, hi))
        if len(f) < n and hi < self.n_cells:
            f = np.flatnonzero(self._free_mask(st, lo))
        if len(f) < n:
            raise KVCacheFullError(f"KV cache full: stream {st} has {len(f)} free cells, ubatch needs {n}")
        if len(f):
            self._lo[st] = lo + int(f[0])
        return f[:n] + lo

    def apply(self, plan: CachePlan, seq_ids: np.ndarray, pos: np.ndarray,
              share_src: dict | None = None) -> None:
        """Commit a plan: set the cells' positions and membership, then build
        ``plan.views`` (per-sequence cell lists for attention) and, when
        ``share_src`` (seq -> pool seq) names sharers, ``plan.groups``."""
        self.pos[plan.stream, plan.cell] = pos
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        if not self._neg and len(plan.cell) and int(np.min(pos)) < 0:
            self._neg_pos()
        if not self.fast:
            self._apply_general(plan, seq_ids, share_src)
            return
        if _one_row_each(seq_ids):  # a decode step: the array path, then any sharers' groups
            self._apply_decode(plan, seq_ids)
            if share_src and not share_src.keys().isdisjoint(seq_ids.tolist()):
                plan.groups = self._shared_groups(plan.views, share_src, plan.arrays)
            return
        self._apply_general(plan, seq_ids, share_src)

    def _neg_pos(self) -> None:
        """A cell got a negative position: a member cell that looks free, whose reuse would
        change lists behind the layout's back. No layouts from here on (until ``clear``)."""
        self._neg = True
        self._set_layout(None)

    def _apply_general(self, plan: CachePlan, seq_ids: np.ndarray, share_src: dict | None) -> None:
        """``apply`` after the positions are written: a ``SeqView`` per sequence."""
        if _one_row_each(seq_ids):  # a decode step: row i is sequence seq_ids[i]'s only token
            order = np.argsort(seq_ids, kind="stable")
            seqs, rows_of = seq_ids[order], [order[i:i + 1] for i in range(len(order))]
        else:
            seqs, inv = np.unique(seq_ids, return_inverse=True)
            rows_of = np.split(np.argsort(inv, kind="stable"),
                               np.cumsum(np.bincount(inv, minlength=len(seqs)))[:-1])
        sl = seqs.tolist()
        lists = [self.cells_of(s) for s in sl]  # the cached lists, before membership changes
        self.seq[plan.stream, :, plan.cell] = False  # free cells: no members (kept for safety)
        self.seq[plan.stream, seq_ids, plan.cell] = True
        plan.views = []
        for s, rows, old in zip(sl, rows_of, lists):
            st = self.stream_of(s)
            cells = np.concatenate([old, plan.cell[rows]])
            self._set_cells(s, cells)
            plan.views.append(SeqView(rows, st, cells, self.pos[st, cells], s))
        plan.groups = self._shared_groups(plan.views, share_src or {})

    def _apply_decode(self, plan: CachePlan, seq_ids: np.ndarray) -> None:
        """``apply`` for one row per sequence (``apply`` adds any sharers' groups after it, from
        the arrays: ``_shared_groups``): every sequence's cell list grows
        by its one new cell, done on arrays (``ViewArrays``) instead of a ``SeqView`` object
        per sequence; same cells, positions and order as the general path. The arrays become
        the layout; a step of the sequences the layout holds appends to it without gathering."""
        lay = self._lay
        if lay is not None and lay.intact and seq_ids.tolist() == lay.sl:  # held, rows ascending
            order, seqs = lay.rows, lay.seqs
        else:
            order = np.argsort(seq_ids, kind="stable") if len(seq_ids) > 1 else np.zeros(1, dtype=np.int64)
            seqs = seq_ids[order]
        streams = np.asarray(plan.stream, dtype=np.int64)[order]
        new = np.asarray(plan.cell, dtype=np.int64)[order]
        new_pos = self.pos[streams, new].astype(np.int64)
        lay = self._lay
        held = lay is not None and (order is lay.rows or lay.holds(seqs))
        lists = None if held else [self.cells_of(s) for s in seqs.tolist()]  # before membership changes
        self.seq[plan.stream, :, plan.cell] = False  # free cells: no members (kept for safety)
        self.seq[plan.stream, seq_ids, plan.cell] = True
        if held:  # the held lists and positions, each with its new cell appended
            off = lay.off + lay.step
            if lay.asc:
                lay.asc = lay.appends_ascend(new_pos)
            cells = _append_each(lay.cells, lay.off, new, lay.seg)
            cpos = _append_each(lay.cpos, lay.off, new_pos, lay.seg)
            lay.off, lay.cells, lay.cpos = off, cells, cpos
            if lay.seg >= 0:
                lay.seg += 1
        elif len(lists) == 1:  # one sequence (single-stream decode): no insertion bookkeeping
            cells = np.concatenate((lists[0], new))
            off = np.array([0, len(cells)], dtype=np.int64)
            cpos = self.pos[streams[0], cells].astype(np.int64)
        else:
            lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
            cells = np.insert(np.concatenate(lists).astype(np.int64, copy=False), np.cumsum(lens), new)
            off = np.zeros(len(lists) + 1, dtype=np.int64)
            np.cumsum(lens + 1, out=off[1:])
            cpos = self._pos_at(streams, lens + 1, cells).astype(np.int64)
        plan.set_arrays(ViewArrays(order, streams, seqs, off, cells, cpos))
        plan.groups = []
        if held:
            return
        if self._neg:  # no layout: the lists go to ``_cells`` (slices of the step's arrays)
            ol = off.tolist()
            for i, s in enumerate(seqs.tolist()):
                self._set_cells(s, cells[ol[i]:ol[i + 1]])
        else:
            self._set_layout(_Layout(seqs, streams, off, cells, cpos, self.n_seq_max, self.n_swa > 0))

    def _shared_groups(self, views: list[SeqView], share_src: dict,
                       arrays: ViewArrays | None = None) -> list[SharedGroup]:
        """Group the ubatch's sequences that share one pool's prefix (same stream).

        A group's ``cells`` are the pool's cells that every member still holds;
        each member's ``private`` cells are the rest of its own. Attention may
        then read the shared cells once for all members' queries and merge by
        log-sum-exp (``SharedGroup``); ``view.cells`` stays complete, so a
        backend that ignores groups is still exact. ``arrays``: the views' flat lists (a decode
        step's ``ViewArrays``), from which the members' private cells and positions are cut with
        one mask over all lists instead of a gather per member.
        """
        by_src: dict[tuple[int, int], list[int]] = {}
        for i, v in enumerate(views):
            src = share_src.get(v.seq_id)
            if src is not None and 0 <= src < self.n_seq_max:
                by_src.setdefault((v.stream, int(src)), []).append(i)
        groups: list[SharedGroup] = []
        for (st, src), members in by_src.items():
            if len(members) < 2:
                continue
            # the pool's cells every member still holds: one gather of the members' membership
            # rows over the pool's cells (no per-member set operations: ~10x faster at 32 sharers)
            pool = self.cells_of(src)
            ids = np.array([views[i].seq_id for i in members], dtype=np.int64)
            shared = np.sort(pool[self.seq[st][ids][:, pool].all(axis=0)])
            if len(shared) == 0:
                continue
            in_shared = np.zeros(self.n_cells, dtype=bool)
            in_shared[shared] = True
            if arrays is not None:
                keep = ~in_shared[arrays.cells]
                off = arrays.off.tolist()
                for i in members:
                    k = keep[off[i]:off[i + 1]]
                    views[i].private = arrays.cells[off[i]:off[i + 1]][k]
                    views[i].private_pos = arrays.cell_pos[off[i]:off[i + 1]][k].astype(self.pos.dtype)
            else:
                for i in members:
                    v = views[i]
                    v.private = v.cells[~in_shared[v.cells]]
                    v.private_pos = self.pos[st, v.private]
            groups.append(SharedGroup(members, st, shared, self.pos[st, shared]))
        return groups

    # -- K/V data -----------------------------------------------------------------------
    def write(self, il: int, plan: CachePlan, k: np.ndarray, v: np.ndarray) -> None:
        """Store a layer's new K ``[n_tokens, n_head_kv, d_k]`` and V (float) into the planned
        cells, quantized to the tiers once, here."""
        self.k[il][plan.stream, plan.cell] = self.tier_k.quantize(k)
        self.v[il][plan.stream, plan.cell] = self.tier_v.quantize(v)

    def read_k(self, il: int, stream: int, cells: np.ndarray) -> np.ndarray:
        """K of ``cells`` in ``stream`` of layer ``il``, dequantized: float32 ``[C, n_head_kv, d_k]``."""
        ops = self.kv_ops[il]
        if ops is not None and not self.tier_k.native:
            return ops.kv_read(self.k[il], self.tier_k, stream, cells)
        return self.tier_k.dequantize(self.k[il][stream, cells])

    def read_v(self, il: int, stream: int, cells: np.ndarray) -> np.ndarray:
        """V of ``cells`` in ``stream`` of layer ``il``, dequantized: float32 ``[C, n_head_kv, d_v]``."""
        ops = self.kv_ops[il]
        if ops is not None and not self.tier_v.native:
            return ops.kv_read(self.v[il], self.tier_v, stream, cells)
        return self.tier_v.dequantize(self.v[il][stream, cells])

    def store_k(self, il: int, stream: int, cells: np.ndarray, k: np.ndarray) -> None:
        """Overwrite the K of existing cells with float ``k [C, n_head_kv, d_k]`` (requantized):
        the K re-rotation of ``seq_add`` goes dequantize -> rotate -> quantize, so a shifted
        cell of a quantized tier is rounded once more per shift."""
        ops = self.kv_ops[il]
        if ops is not None and not self.tier_k.native:
            ops.kv_store(self.k[il], self.tier_k, stream, cells, k)
            return
        self.k[il][stream, cells] = self.tier_k.quantize(k)

    def to_tail(self, il: int, stream: int, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The K and V rows of ``cells`` converted from the main tiers to the tail tiers
        (``kv_tiers.convert``): ``([C, n_head_kv, row_k_tail], [C, n_head_kv, row_v_tail])``
        as the tail storage would hold them. The cells themselves are not changed."""
        return (convert(self.k[il][stream, cells], self.tier_k, self.tier_k_tail),
                convert(self.v[il][stream, cells], self.tier_v, self.tier_v_tail))


def _kv_shape(hp, layers: list[int]) -> dict:
    """``n_head_kv`` / ``d_k`` / ``d_v`` shared by ``layers`` (one cache holds one shape;
    Gemma-4's global and sliding layers differ, but each kind is uniform). ``ValueError``
    if they differ."""
    shapes = {(hp.n_head_kv_l(il), hp.n_embd_head_k_l(il), hp.n_embd_head_v_l(il)) for il in layers}
    if len(shapes) > 1:
        raise ValueError(f"layers {layers} of one KV cache have different K/V shapes {sorted(shapes)}")
    n_kv, d_k, d_v = shapes.pop() if shapes else (hp.n_head_kv, hp.n_embd_head_k, hp.n_embd_head_v)
    return dict(n_head_kv=n_kv, d_k=d_k, d_v=d_v)


class KVCacheSet:
    """The model's caches and which layer reads which.

    A dense model has one ``KVCache``; an iSWA model (``hp.is_iswa``) has a
    global cache and a sliding-window cache sized ``n_swa * n_seq + n_ubatch``
    cells (``n_seq`` = n_seq_max when unified, else 1 per stream), padded to
    256 and at most the global size (llama.cpp ``llama_kv_cache_iswa``).

    Sequence operations apply to every cache. ``type_k`` / ``type_v`` (and the tail
    types) are the same for every cache of the set. ``zeros`` allocates K/V (and recurrent)
    storage; ``zeros_for(il)``, when given, the allocator of layer ``il`` instead (partial
    offload: a layer's storage lives on its backend). ``kv_ops`` / ``kv_ops_for`` go to
    every ``KVCache`` (see there).
    """

    def __init__(
        self,
        hp,
        n_ctx: int,
        n_seq_max: int,
        unified: bool,
        n_ubatch: int,
        type_k="f16",
        type_v="f16",
        zeros=np.zeros,
        type_k_tail=None,
        type_v_tail=None,
        zeros_for=None,
        kv_ops=None,
        kv_ops_for=None,
    ):
        self.unified = unified
        self.n_seq_max = n_seq_max
        geo = self.geometry(hp, n_ctx, n_seq_max, unified, n_ubatch)
        self.n_ctx_seq = geo[0]["n_cells"]  # hard per-sequence limit
        # the global cache's cells over all its streams: the n_ctx asked for, but on the split
        # cache n_seq_max x (n_ctx // n_seq_max), at least one cell each (llama.cpp's llama_context
        # also rounds n_ctx to a multiple of n_seq_max, after padding each share to 256 cells)
        self.n_ctx = self.n_ctx_seq * geo[0]["n_stream"]
        common = dict(n_seq_max=n_seq_max, type_k=type_k, type_v=type_v, type_k_tail=type_k_tail,
                      type_v_tail=type_v_tail, zeros=zeros, zeros_for=zeros_for, kv_ops=kv_ops,
                      kv_ops_for=kv_ops_for)
        self.caches: list[KVCache] = [KVCache(**g, **common) for g in geo]
        self.layer_cache: list[KVCache] = [None] * hp.n_layer  # type: ignore[list-item]
        for c in self.caches:
            for il in c.layers:
                self.layer_cache[il] = c
        for il in range(hp.n_layer):
            if self.layer_cache[il] is None and hp.kv_src(il) != il:  # KV-sharing layer: its source's cache
                self.layer_cache[il] = self.layer_cache[hp.kv_src(il)]
        # -- issue 7b: recurrent (gated delta-net) layers have no KV cells --
        rec = list(getattr(hp, "recurrent_layers", None) or [False] * hp.n_layer)
        self.recurrent: RecurrentState | None = None
        if any(rec):
            self.recurrent = RecurrentState(
                [il for il in range(hp.n_layer) if rec[il]], n_seq_max,
                (hp.ssm_d_conv - 1, hp.ssm_conv_channels), (hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim),
                zeros=zeros, zeros_for=zeros_for)

    @staticmethod
    def geometry(hp, n_ctx: int, n_seq_max: int, unified: bool, n_ubatch: int) -> list[dict]:
        """The caches a model gets, without allocating: one dict per cache with ``layers``,
        ``n_cells`` (per stream), ``n_stream``, ``n_swa`` and the K/V head shape
        (``n_head_kv``, ``d_k``, ``d_v``; see the class doc). Layers that reuse another
        layer's KV (Gemma-4 E-series) and recurrent layers (hybrid models) get no cells.
        Raises ``ValueError`` for a model without attention layers."""
        n_stream = 1 if unified else n_seq_max
        n_cells = n_ctx if unified else max(1, n_ctx // n_seq_max)
        rec = list(getattr(hp, "recurrent_layers", None) or [False] * hp.n_layer)
        own = [il for il in range(hp.n_layer) if hp.kv_src(il) == il and not rec[il]]
        if not own:
            raise ValueError(f"{hp.arch}: a model without attention layers is not supported")
        if hp.is_iswa:
            glob = [il for il in own if not hp.swa_layers[il]]
            swa = [il for il in own if hp.swa_layers[il]]
            n_swa_cells = min(n_cells, pad_to(hp.n_swa * (n_seq_max if unified else 1) + n_ubatch, N_PAD))
            return [dict(layers=glob, n_cells=n_cells, n_stream=n_stream, n_swa=0, **_kv_shape(hp, glob)),
                    dict(layers=swa, n_cells=n_swa_cells, n_stream=n_stream, n_swa=hp.n_swa, **_kv_shape(hp, swa))]
        return [dict(layers=own, n_cells=n_cells, n_stream=n_stream, n_swa=hp.n_swa, **_kv_shape(hp, own))]

    @classmethod
    def estimate_bytes(cls, hp, n_ctx: int, n_seq_max: int, unified: bool, n_ubatch: int,
                       type_k, type_v) -> tuple[int, int]:
        """(K bytes, V bytes) that a set with these arguments would allocate (auto-tier's
        size model; equal to ``nbytes_k`` / ``nbytes_v`` of the built set)."""
        tk, tv = get_tier(type_k), get_tier(type_v)
        k = v = 0
        for g in cls.geometry(hp, n_ctx, n_seq_max, unified, n_ubatch):
            cells = len(g["layers"]) * g["n_cells"] * g["n_stream"]
            k += cells * g["n_head_kv"] * tk.bytes_per_row(g["d_k"])
            v += cells * g["n_head_kv"] * tv.bytes_per_row(g["d_v"])
        return k, v

    @property
    def base(self) -> KVCache:
        return self.caches[0]

    @property
    def swa(self) -> KVCache | None:
        return self.caches[1] if len(self.caches) > 1 else None

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches) + (self.recurrent.nbytes() if self.recurrent else 0)

    def nbytes_k(self) -> int:
        return sum(c.nbytes_k() for c in self.caches)

    def nbytes_v(self) -> int:
        return sum(c.nbytes_v() for c in self.caches)

    @property
    def type_k(self) -> str:
        return self.base.type_k

    @property
    def type_v(self) -> str:
        return self.base.type_v

    @property
    def is_iswa(self) -> bool:
        return len(self.caches) > 1

    @property
    def n_layers_spilling(self) -> int:
        """Layers whose K/V partly live outside device storage (0 until rolling-KV spill exists)."""
        return 0

    def effective(self) -> dict:
        """The tiers and residency actually in use, read from the live caches (``/props``
        ``opencoti.kv.effective``): ``type_k``, ``type_v``, ``n_cells`` (global cache, all
        streams), ``n_cells_resident`` (of those, held in storage), ``n_layers_spilling``,
        ``fully_resident``, ``is_iswa``."""
        b = self.base
        n_cells = b.n_cells * b.n_stream
        resident = b.n_cells_resident * b.n_stream
        return {
            "type_k": b.type_k,
            "type_v": b.type_v,
            "n_cells": int(n_cells),
            "n_cells_resident": int(resident),
            "n_layers_spilling": int(self.n_layers_spilling),
            "fully_resident": bool(resident == n_cells and self.n_layers_spilling == 0),
            "is_iswa": self.is_iswa,
        }

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq_id`` from every cache. False (and
        nothing changed) when a recurrent state would have to lose absorbed tokens."""
        if self.recurrent is not None and not self.recurrent.seq_rm(seq_id, p0, p1):
            return False
        for c in self.caches:
            c.seq_rm(seq_id, p0, p1)
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> bool:
        """``seq_cp`` in every cache. On a hybrid model the recurrent state is copied
        only when the range covers all of it; otherwise ``dst``'s state is left
        empty and the answer is False (``can_reuse`` then fails for ``dst``)."""
        for c in self.caches:
            c.seq_cp(src, dst, p0, p1)
        return self.recurrent.seq_cp(src, dst, p0, p1) if self.recurrent is not None else True

    def seq_keep(self, seq_id: int) -> None:
        for c in self.caches:
            c.seq_keep(seq_id)
        if self.recurrent is not None:
            self.recurrent.seq_keep(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.base.seq_pos_max(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> list[tuple[KVCache, int, np.ndarray]]:
        """Shift ``seq_id``'s positions in ``[p0, p1)`` by ``delta`` in every cache.

        Returns ``[(cache, stream, shift)]`` where ``shift`` is the per-cell
        position delta (int32 ``[n_cells]``) that the caller must apply to the
        cached K of that cache's layers (``ModelRunner.seq_add`` does).
        """
        if self.recurrent is not None:
            raise ValueError("seq_add (context shift) is not possible on a recurrent state")
        out = []
        for c in self.caches:
            shift = c.seq_add(seq_id, p0, p1, delta)
            if shift.any():
                out.append((c, c.stream_of(seq_id), shift))
        return out

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position still cached for ``seq_id`` in any cache (the SWA
        cache prunes, so this tells how far back the sequence can be reused)."""
        return max(c.seq_pos_min(seq_id) for c in self.caches)

    def can_reuse(self, seq_id: int, n_past: int) -> bool:
        """Whether keeping ``seq_id``'s first ``n_past`` positions leaves every
        cell that the next query (at ``n_past``) needs: on a sliding cache those
        at positions ``>= n_past - n_swa + 1`` (llama.cpp server's SWA check)."""
        for c in self.caches:
            if c.n_swa > 0 and n_past > 0:
                pmin = c.seq_pos_min(seq_id)
                if pmin < 0 or pmin > max(0, n_past - c.n_swa + 1):
                    return False
        if self.recurrent is not None and not self.recurrent.can_reuse(seq_id, n_past):
            return False  # a recurrent state is reusable only whole
        return True

    def clear(self) -> None:
        for c in self.caches:
            c.clear()
        if self.recurrent is not None:
            self.recurrent.clear()

    def prepare(self, seq_ids: np.ndarray, pos: np.ndarray, prune_pos: np.ndarray | None = None) -> list:
        """Plan a ubatch in every cache (prunes SWA cells first, for queries at ``prune_pos``,
        default ``pos``): one ``CachePlan`` per KV cache, then (hybrid models) the ``RSPlan``
        of the recurrent state. Raises ``KVCacheFullError`` (or ``RecurrentStateError``)
        without committing anything but that pruning. A step queued ahead prunes at its
        rows' previous positions (``ModelRunner.launch``): a row rolled back then leaves its
        sequence's window as the step before left it."""
        rs = [self.recurrent.prepare(seq_ids, pos)] if self.recurrent is not None else []
        for c in self.caches:
            c.prune_swa(seq_ids, pos if prune_pos is None else prune_pos)
        return [c.prepare(seq_ids, pos) for c in self.caches] + rs

    def trim_swa(self, seq_ids) -> int:
        """Drop, in every sliding-window cache, the cells of ``seq_ids`` that no query at or
        after the sequence's last position can see (positions ``< pos_max - n_swa + 1``).

        Lossless for continuing a sequence, re-evaluating its last token included (the
        server's full-prompt-cache case): ``can_reuse`` still holds for ``n_past >=
        pos_max``; only a rewind further back is recomputed. A prefill leaves up to
        ``n_swa + n_ubatch - 1`` cells per sequence (pruning follows each ubatch's first
        position), which many idle or prefilled sequences can pile up past the
        ``n_swa * n_seq + n_ubatch`` cells of the cache. Returns the number of cells freed."""
        freed = 0
        for c in self.caches:
            if c.n_swa <= 0:
                continue
            last = {int(s): c.seq_pos_max(int(s)) for s in seq_ids}
            ids = [s for s, p in last.items() if p >= 0]
            if not ids:
                continue
            before = c.n_used()
            c.prune_swa(np.array(ids, dtype=np.int64), np.array([last[s] for s in ids], dtype=np.int64))
            freed += before - c.n_used()
        return freed

    def apply(self, plans: list, seq_ids: np.ndarray, pos: np.ndarray,
              share_src: dict | None = None) -> None:
        for c, p in zip(self.caches, plans):
            c.apply(p, seq_ids, pos, share_src)
        if self.recurrent is not None:
            self.recurrent.apply(plans[len(self.caches)])

    def rs_plan(self, plans: list):
        """The recurrent state's plan among ``prepare``'s plans (None without one)."""
        return plans[len(self.caches)] if self.recurrent is not None else None
