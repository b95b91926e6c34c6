"""The KV cache's decode fast paths (``KVCache.fast``: the flat layout of the last decode
step, SWA pruning on it, the free-cell hint, ``CachePlan.flat`` of array plans) against the
general code (``fast = False``), on random interleavings of decode steps, prefill chunks,
shared-prefix decode, ``seq_rm`` / ``seq_cp`` / ``seq_add`` / ``seq_keep`` and a full cache:
every plan, every error and every piece of cell state must be identical."""

import numpy as np
import pytest

from opencoti.engine.kv_cache import KVCache, KVCacheFullError


def _pair(n_cells, n_stream, n_seq, n_swa):
    mk = lambda: KVCache([0], n_cells, n_stream, n_seq, n_head_kv=1, d_k=4, d_v=4,  # noqa: E731
                         type_k="f32", type_v="f32", n_swa=n_swa)
    fast, ref = mk(), mk()
    ref.fast = False
    return fast, ref


def _new_cells_end_each_view(plan, n_cells):
    """The ubatch's new cells end each view's list (``CachePlan.flat``): view v's last cells are
    the cells its rows write, in row order, and none of its other cells is written by any row.
    The CUDA short-row attention kernels read a view's first len - T cells before their PDL wait
    (attention.cu ``early_rows``), while the store of those new cells may still run."""
    write, row_view, off, cells, _ = plan.flat(n_cells)
    new = set(write.tolist())
    for v in range(len(off) - 1):
        rows = np.flatnonzero(row_view == v)
        end = int(off[v + 1])
        assert cells[end - len(rows):end].tolist() == write[rows].tolist()
        assert not new & set(cells[off[v]:end - len(rows)].tolist())


def _same_plan(a, b, n_cells):
    _new_cells_end_each_view(a, n_cells)
    _new_cells_end_each_view(b, n_cells)
    assert a.stream.tolist() == b.stream.tolist()
    assert a.cell.tolist() == b.cell.tolist()
    assert a.n_views == b.n_views
    assert a.view_lens().tolist() == b.view_lens().tolist()
    for cap in (None, 4 * n_cells):
        for x, y in zip(a.flat(n_cells, cap), b.flat(n_cells, cap)):
            assert x.dtype == y.dtype == np.int64
            assert x.tolist() == y.tolist()
    for va, vb in zip(a.views, b.views):
        assert (va.seq_id, va.stream) == (vb.seq_id, vb.stream)
        assert np.asarray(va.rows).tolist() == np.asarray(vb.rows).tolist()
        assert va.cells.tolist() == vb.cells.tolist()  # the same order, not only the same set
        assert va.cell_pos.tolist() == vb.cell_pos.tolist()
        for x, y in ((va.private, vb.private), (va.private_pos, vb.private_pos)):
            assert (x is None) == (y is None) and (x is None or x.tolist() == y.tolist())
    assert len(a.groups) == len(b.groups)
    for ga, gb in zip(a.groups, b.groups):
        assert (ga.views, ga.stream) == (gb.views, gb.stream)
        assert ga.cells.tolist() == gb.cells.tolist() and ga.cell_pos.tolist() == gb.cell_pos.tolist()


def _same_state(fast, ref):
    assert np.array_equal(fast.pos, ref.pos)
    assert np.array_equal(fast.seq, ref.seq)
    for s in range(fast.n_seq_max):
        assert fast.cells_of(s).tolist() == ref.cells_of(s).tolist()
        assert (fast.seq_pos_min(s), fast.seq_pos_max(s)) == (ref.seq_pos_min(s), ref.seq_pos_max(s))
    assert fast.n_used() == ref.n_used()


def _both(fast, ref, fn):
    """Run ``fn(cache)`` on both; the same result or the same exception (type and message)."""
    out = []
    for c in (fast, ref):
        try:
            out.append(("ok", fn(c)))
        except (KVCacheFullError, ValueError) as e:
            out.append((type(e), str(e)))
    if out[0][0] == "ok":
        assert out[1][0] == "ok"
        return out[0][1], out[1][1]
    assert out[0] == out[1]
    return None


@pytest.mark.parametrize("n_stream,n_swa,seed", [(1, 6, 0), (1, 6, 1), (1, 0, 2), (1, 1, 3),
                                                 (4, 6, 4), (4, 0, 5)])
def test_fast_paths_match_the_general_code(n_stream, n_swa, seed):
    rng = np.random.default_rng(seed)
    n_seq = 4
    n_cells = 96 if n_stream == 1 else 40
    fast, ref = _pair(n_cells, n_stream, n_seq, n_swa)
    n_past = [0] * n_seq
    held = prune_first = 0
    real_prune_first = fast._prune_first

    def count_prune_first(k):
        nonlocal prune_first
        prune_first += 1
        real_prune_first(k)

    fast._prune_first = count_prune_first

    def ubatch(seq_ids, pos, share_src=None):
        nonlocal held
        seq_ids, pos = np.asarray(seq_ids, dtype=np.int64), np.asarray(pos, dtype=np.int32)
        lay = fast._lay
        if lay is not None and lay.holds(np.sort(seq_ids)) and len(set(seq_ids.tolist())) == len(seq_ids):
            held += 1

        def step(c):
            c.prune_swa(seq_ids, pos)  # as KVCacheSet.prepare: pruning stays even when prepare fails
            plan = c.prepare(seq_ids, pos)
            c.apply(plan, seq_ids, pos, share_src)
            return plan

        got = _both(fast, ref, step)
        if got is None:  # the cache is full: make room as a server would (drop a sequence)
            s = int(rng.integers(n_seq))
            _both(fast, ref, lambda c: c.seq_rm(s))
            n_past[s] = 0
        else:
            _same_plan(*got, n_cells)
            for s in seq_ids.tolist():
                n_past[s] = max(n_past[s], int(pos[seq_ids == s].max()) + 1)
        _same_state(fast, ref)

    for it in range(500):
        r = rng.random()
        if r < 0.65:  # decode: a subset of the sequences, often all in ascending order
            if rng.random() < 0.75:
                seqs = np.arange(n_seq)
            else:
                seqs = rng.permutation(n_seq)[: rng.integers(1, n_seq + 1)]
                if rng.random() < 0.5:
                    seqs = np.sort(seqs)
            share = {int(s): 0 for s in seqs if s != 0} if rng.random() < 0.25 else None
            gap = rng.integers(0, 4, len(seqs)) * (rng.random() < 0.15)  # skipped positions now and then
            if rng.random() < 0.06:  # or earlier positions again: lists whose positions do not ascend
                gap = -rng.integers(1, 4, len(seqs))
            ubatch(seqs, [max(0, n_past[s] + g) for s, g in zip(seqs, gap)], share)
        elif r < 0.74:  # a prefill chunk of one sequence, or chunks of two
            s = int(rng.integers(n_seq))
            n = int(rng.integers(2, 9))
            if rng.random() < 0.3:
                t = (s + 1) % n_seq
                ubatch([s] * n + [t] * 2, list(range(n_past[s], n_past[s] + n)) + [n_past[t], n_past[t] + 1])
            else:
                ubatch([s] * n, range(n_past[s], n_past[s] + n))
        elif r < 0.82:  # rewind a sequence (speculative rollback / a new prompt)
            s = int(rng.integers(n_seq))
            p0 = int(rng.integers(0, n_past[s] + 1))
            _both(fast, ref, lambda c: c.seq_rm(s, p0, -1))
            n_past[s] = p0
        elif r < 0.88:  # share a prefix (zero-copy in one stream, copied across streams)
            src, dst = (int(x) for x in rng.choice(n_seq, 2, replace=False))
            p1 = int(rng.integers(0, n_past[src] + 1))

            def cp(c):
                c.seq_rm(dst)
                c.seq_cp(src, dst, 0, p1)

            if _both(fast, ref, cp) is not None:
                n_past[dst] = p1
            else:  # the copy failed across streams: dst is empty in both
                n_past[dst] = 0
        elif r < 0.92:  # context shift of a sequence's tail
            s = int(rng.integers(n_seq))
            d = int(rng.integers(-3, 4))
            p0 = int(rng.integers(0, n_past[s] + 1))
            if _both(fast, ref, lambda c: c.seq_add(s, p0, -1, d)) is not None:
                n_past[s] = max(0, fast.seq_pos_max(s) + 1)
        elif r < 0.95:
            s = int(rng.integers(n_seq))
            _both(fast, ref, lambda c: c.seq_keep(s))
            n_past = [n if i == s else 0 for i, n in enumerate(n_past)]
        elif r < 0.96:
            _both(fast, ref, lambda c: c.clear())
            n_past = [0] * n_seq
        elif it > 400:  # late: a negative position (no layouts afterwards, until clear)
            s = int(rng.integers(n_seq))
            ubatch([s], [-1])
        _same_state(fast, ref)
    assert held > 40  # the layout served many steps
    if n_swa > 1:
        assert prune_first > 3  # and pruned some of them by each list's first cell


@pytest.mark.parametrize("n_swa", [0, 5])
def test_pooled_decode_steps_match_the_general_code(n_swa):
    """Decode steps of sequences sharing a pool's prefix (``share_src``) take the array path
    (``_apply_decode``) and then form their ``SharedGroup``s, cutting each member's private
    cells from the flat lists: the same views, groups, private cells / positions and state as
    the general code, while members join, leave (``seq_rm``), skip a step and a non-member
    decodes beside them; two pools (two groups) in one ubatch; a sliding window prunes."""
    n_cells, n_seq = 160, 8
    fast, ref = _pair(n_cells, 1, n_seq, n_swa)
    pools = {6: 12, 7: 9}  # pool seq -> prefix length
    past = {}
    for c in (fast, ref):
        for p, n in pools.items():
            c.apply(c.prepare(np.full(n, p), np.arange(n)), np.full(n, p), np.arange(n, dtype=np.int32))
    members = {0: 6, 1: 6, 2: 6, 3: 7, 4: 7}  # seq -> pool; seq 5 decodes unpooled
    for s, p in members.items():
        _both(fast, ref, lambda c: c.seq_cp(p, s))
        past[s] = pools[p]
    past[5] = 0
    n_groups = 0
    for step in range(14):
        if step == 5:  # seq 1 leaves (its cells freed), then rejoins the same pool
            _both(fast, ref, lambda c: c.seq_rm(1))
            _both(fast, ref, lambda c: c.seq_cp(6, 1))
            past[1] = pools[6]
        seqs = [s for s in sorted(past) if not (step == 8 and s == 2)]  # seq 2 skips a step
        pos = [past[s] for s in seqs]
        share = {s: members[s] for s in seqs if s in members}

        def run(c):
            q, ps = np.asarray(seqs, dtype=np.int64), np.asarray(pos, dtype=np.int32)
            c.prune_swa(q, ps)
            plan = c.prepare(q, ps)
            c.apply(plan, q, ps, share)
            return plan

        a, b = _both(fast, ref, run)
        assert a.arrays is not None  # the array path served the pooled step
        _same_plan(a, b, n_cells)
        for g in a.groups:  # private positions in the cache's dtype, as the general code's
            assert all(a.views[i].private_pos.dtype == b.views[i].private_pos.dtype for i in g.views)
        _same_state(fast, ref)
        n_groups += len(a.groups)
        for s in seqs:
            past[s] += 1
    # both pools' groups in every step without a window; with one, until it prunes the prefixes
    assert n_groups == 28 if n_swa == 0 else n_groups >= 4, n_groups


def test_free_cell_hint_follows_freed_cells():
    """Cells freed far below the hint (``seq_rm``, SWA pruning, ``seq_add`` below 0) are
    chosen first again, as the general search over all cells does."""
    fast, ref = _pair(64, 1, 2, 0)
    for c in (fast, ref):
        for s in (0, 1):
            p = c.prepare(np.full(20, s), np.arange(20))
            c.apply(p, np.full(20, s), np.arange(20))
    assert fast._lo[0] >= 20
    for c in (fast, ref):
        c.seq_rm(0, 3, 5)  # frees cells 3 and 4
    assert fast._lo[0] == 3
    plans = [c.prepare(np.array([1, 1, 1]), np.arange(20, 23)) for c in (fast, ref)]
    assert plans[0].cell.tolist() == plans[1].cell.tolist() == [3, 4, 40]
    for c in (fast, ref):
        c.seq_add(1, 0, 2, -5)  # positions 0, 1 of sequence 1 go below 0: cells 20, 21 freed
    assert fast._lo[0] == 0
    plans = [c.prepare(np.array([0, 0, 0]), np.arange(3, 6)) for c in (fast, ref)]
    assert plans[0].cell.tolist() == plans[1].cell.tolist() == [3, 4, 20]
    with pytest.raises(KVCacheFullError, match="stream 0 has 28 free cells, ubatch needs 29"):
        fast.prepare(np.zeros(29, dtype=np.int64), np.arange(29))


def test_swa_pruning_of_lists_out_of_position_order():
    """A sequence's list recomputed from membership runs in cell order, which after cells are
    reused is not position order: its oldest cell is not its first, and the layout must
    prune it all the same."""
    fast, ref = _pair(24, 1, 2, 6)

    def put(c, s, positions):
        positions = np.asarray(positions, dtype=np.int32)
        ids = np.full(len(positions), s, dtype=np.int64)
        c.prune_swa(ids, positions)
        plan = c.prepare(ids, positions)
        c.apply(plan, ids, positions)
        return plan

    for c in (fast, ref):
        put(c, 0, range(8))  # cells 0..7
        put(c, 1, range(4))  # cells 8..11
        c.seq_rm(0, 0, 4)  # frees cells 0..3
        put(c, 1, [4])  # cell 0
        c.seq_rm(1, 100, -1)  # removes nothing; sequence 1's list is recomputed: cell order
    assert fast.cells_of(1).tolist() == [0, 8, 9, 10, 11]
    assert fast.pos[0, fast.cells_of(1)].tolist() == [4, 0, 1, 2, 3]
    for p in range(5, 12):
        _same_plan(put(fast, 1, [p]), put(ref, 1, [p]), 24)
        _same_state(fast, ref)
        assert fast._lay is not None and fast._lay.holds(np.array([1]))
        assert fast._lay.asc is False
        assert sorted(fast.pos[0, fast.cells_of(1)].tolist()) == list(range(max(0, p - 5), p + 1))
