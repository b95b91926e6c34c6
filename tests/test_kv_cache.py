"""Unit tests of the cell/membership KV cache (llama.cpp llama-kv-cells semantics)."""

import numpy as np
import pytest

from opencoti.engine.kv_cache import KVCache, KVCacheFullError, KVCacheSet
from opencoti.model.hparams import HParams


def _cache(n_cells=16, n_stream=1, n_seq=3, n_swa=0):
    return KVCache([0, 1], n_cells, n_stream, n_seq, n_head_kv=1, d_k=4, d_v=4, n_swa=n_swa)


def _put(c, seq, positions, fill=None):
    seq_ids = np.full(len(positions), seq)
    pos = np.asarray(positions, dtype=np.int32)
    plan = c.prepare(seq_ids, pos)
    c.apply(plan, seq_ids, pos)
    val = np.asarray(positions if fill is None else fill, np.float32)[:, None, None] * np.ones((1, 1, 4), np.float32)
    for il in c.layers:
        c.write(il, plan, val, val)
    return plan


def test_write_and_views():
    c = _cache()
    plan = _put(c, 0, range(5))
    assert c.n_used() == 5
    (view,) = plan.views
    assert sorted(view.cell_pos.tolist()) == [0, 1, 2, 3, 4]
    assert view.rows.tolist() == [0, 1, 2, 3, 4]
    assert c.seq_pos_min(0) == 0 and c.seq_pos_max(0) == 4
    assert c.seq_pos_max(1) == -1


def test_seq_cp_is_membership_in_one_stream():
    c = _cache()
    _put(c, 0, range(6))
    c.seq_cp(0, 1, 0, 4)  # share the first 4 positions
    assert c.n_used() == 6  # no new cells
    assert c.seq_pos_max(1) == 3
    shared = c.seq[0][0] & c.seq[0][1]
    assert int(shared.sum()) == 4
    # removing the source keeps the shared cells alive for seq 1
    c.seq_rm(0)
    assert c.n_used() == 4 and c.seq_pos_max(0) == -1 and c.seq_pos_max(1) == 3
    c.seq_rm(1, 2, -1)
    assert c.n_used() == 2


def test_seq_cp_across_streams_copies_data():
    c = _cache(n_cells=8, n_stream=3)
    _put(c, 0, range(3), fill=[10, 11, 12])
    c.seq_cp(0, 2)
    assert c.n_used(0) == 3 and c.n_used(2) == 3
    cells = np.nonzero(c.seq[2][2])[0]
    got = sorted(c.k[0][2, cells, 0, 0].tolist())
    assert got == [10.0, 11.0, 12.0]


def test_split_streams_are_hard_limits():
    c = _cache(n_cells=4, n_stream=2, n_seq=2)
    _put(c, 0, range(4))
    with pytest.raises(KVCacheFullError):
        c.prepare(np.array([0]), np.array([4], np.int32))
    # the other stream is unaffected
    _put(c, 1, range(4))
    assert c.n_used(1) == 4


def test_prepare_failure_changes_nothing():
    c = _cache(n_cells=4)
    _put(c, 0, range(3))
    before = (c.pos.copy(), c.seq.copy())
    with pytest.raises(KVCacheFullError):
        c.prepare(np.array([1, 1]), np.array([0, 1], np.int32))
    assert np.array_equal(before[0], c.pos) and np.array_equal(before[1], c.seq)


def test_seq_keep_and_seq_add():
    c = _cache()
    _put(c, 0, range(4))
    _put(c, 1, range(2))
    c.seq_keep(1)
    assert c.n_used() == 2 and c.seq_pos_max(0) == -1
    shift = c.seq_add(1, 0, -1, 5)
    assert c.seq_pos_min(1) == 5 and c.seq_pos_max(1) == 6
    assert sorted(shift[shift != 0].tolist()) == [5, 5]
    c.seq_add(1, 0, -1, -6)  # position 5 -> -1 is dropped
    assert c.n_used() == 1 and c.seq_pos_min(1) == 0


def test_seq_add_refuses_shared_cells():
    c = _cache()
    _put(c, 0, range(3))
    c.seq_cp(0, 1)
    with pytest.raises(ValueError):
        c.seq_add(0, 0, -1, 1)


def test_swa_pruning_frees_cells_outside_every_window():
    c = _cache(n_cells=8, n_swa=4)
    _put(c, 0, range(6))
    c.prune_swa(np.array([0]), np.array([6], np.int32))  # query at 6 sees 3..6
    assert c.seq_pos_min(0) == 3 and c.n_used() == 3
    # a query position below the window start prunes nothing (regression: open-ended range)
    c2 = _cache(n_cells=8, n_swa=16)
    _put(c2, 0, range(6))
    c2.prune_swa(np.array([0]), np.array([6], np.int32))
    assert c2.n_used() == 6
    # a cell shared with a sequence that still needs it survives
    c3 = _cache(n_cells=8, n_swa=4)
    _put(c3, 0, range(6))
    c3.seq_cp(0, 1, 0, 2)
    c3.prune_swa(np.array([0]), np.array([6], np.int32))
    assert c3.n_used() == 5 and c3.seq_pos_min(1) == 0


def _hp(n_layer=6, n_swa=8):
    return HParams(
        arch="gemma3", n_vocab=10, n_ctx_train=64, n_embd=8, n_layer=n_layer, n_head=2, n_head_kv=1,
        n_embd_head_k=4, n_embd_head_v=4, n_ff=16, f_norm_rms_eps=1e-6, rope_type="neox",
        rope_freq_base=1e4, n_swa=n_swa, swa_layers=[il % 6 < 5 for il in range(n_layer)],
    )


def test_iswa_sizes_follow_llama_cpp():
    # unified: n_swa * n_seq_max + n_ubatch, padded to 256, at most the global size
    kv = KVCacheSet(_hp(n_swa=512), n_ctx=8192, n_seq_max=4, unified=True, n_ubatch=512)
    assert kv.base.n_cells == 8192 and kv.swa.n_cells == 2560
    assert kv.base.layers == [5] and kv.swa.layers == [0, 1, 2, 3, 4]
    # split streams: per stream n_swa + n_ubatch
    kv = KVCacheSet(_hp(n_swa=512), n_ctx=8192, n_seq_max=4, unified=False, n_ubatch=512)
    assert kv.base.n_stream == 4 and kv.base.n_cells == 2048 and kv.swa.n_cells == 1024
    kv = KVCacheSet(_hp(n_swa=512), n_ctx=512, n_seq_max=1, unified=True, n_ubatch=512)
    assert kv.swa.n_cells == 512


def test_can_reuse_after_swa_pruning():
    kv = KVCacheSet(_hp(n_swa=4), n_ctx=64, n_seq_max=1, unified=True, n_ubatch=8)
    for p in range(10):
        kv.apply(kv.prepare(np.array([0]), np.array([p], np.int32)), np.array([0]), np.array([p], np.int32))
    # the sliding cache now starts at position 6 (query 9 sees 6..9)
    assert kv.swa.seq_pos_min(0) == 6
    assert kv.can_reuse(0, 10) and kv.can_reuse(0, 9)
    assert not kv.can_reuse(0, 5)  # a query at 5 would need 2..5


def test_shared_groups_match_set_semantics():
    """``plan.groups`` under random pool shares (two pools, cut prefixes, sliding-window
    pruning): a group's cells are exactly the pool cells every member still holds (sorted),
    and each member's private cells are its other cells, in its own order."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        N, P, swa = int(rng.integers(2, 9)), int(rng.integers(10, 300)), int(rng.choice([0, 40, 200]))
        c = KVCache([0], n_cells=4096, n_stream=1, n_seq_max=2 * N + 2, n_head_kv=1, d_k=8, d_v=8, n_swa=swa)
        pools = [2 * N, 2 * N + 1]
        for i, pool in enumerate(pools):
            n = P + 7 * i
            plan = c.prepare(np.full(n, pool), np.arange(n))
            c.apply(plan, np.full(n, pool), np.arange(n))
        share = {}
        for s in range(N):
            share[s] = pools[s % 2]
            cut = int(rng.integers(1, P + 1))
            c.seq_cp(share[s], s, 0, cut)
            pos = np.arange(cut, cut + int(rng.integers(1, 30)))
            plan = c.prepare(np.full(len(pos), s), pos)
            c.apply(plan, np.full(len(pos), s), pos)
        for _ in range(5):
            seqs = np.arange(N)
            pos = np.array([c.seq_pos_max(s) + 1 for s in seqs])
            c.prune_swa(seqs, pos)
            plan = c.prepare(seqs, pos)
            c.apply(plan, seqs, pos, share)
            n_groups = 0
            for pool in pools:
                members = [i for i, v in enumerate(plan.views) if share[v.seq_id] == pool]
                held = set(c.cells_of(pool).tolist())
                for i in members:
                    held &= set(plan.views[i].cells.tolist())
                if len(members) < 2 or not held:
                    continue
                g = plan.groups[n_groups]
                n_groups += 1
                assert g.views == members and g.cells.tolist() == sorted(held)
                for i in members:
                    v = plan.views[i]
                    assert v.private.tolist() == [x for x in v.cells.tolist() if x not in held]
                    assert v.private_pos.tolist() == c.pos[0, v.private].tolist()
            assert len(plan.groups) == n_groups


def test_plan_flat_index_arrays():
    """``CachePlan.flat``: flat write cells, row -> view, view offsets and the views' cell
    lists / positions in view order, on a split cache (several streams, several rows per
    sequence), padded to ``cap``; a list longer than ``cap`` is refused."""
    c = KVCache([0], n_cells=64, n_stream=3, n_seq_max=3, n_head_kv=1, d_k=8, d_v=8)
    for s, n in ((0, 5), (1, 9), (2, 3)):
        plan = c.prepare(np.full(n, s), np.arange(n))
        c.apply(plan, np.full(n, s), np.arange(n))
    seqs = np.array([2, 0, 2, 1, 0])
    pos = np.array([3, 5, 4, 9, 6])
    plan = c.prepare(seqs, pos)
    c.apply(plan, seqs, pos)
    write, row_view, off, cells, cpos = plan.flat(64)
    assert write.tolist() == (plan.stream * 64 + plan.cell).tolist()
    for i, v in enumerate(plan.views):
        assert (row_view[v.rows] == i).all()
        got = cells[off[i]:off[i + 1]]
        assert got.tolist() == (v.stream * 64 + np.asarray(v.cells)).tolist()
        assert cpos[off[i]:off[i + 1]].tolist() == np.asarray(v.cell_pos).tolist()
    assert sorted(row_view.tolist()) == sorted(i for i, v in enumerate(plan.views) for _ in v.rows)
    total = int(off[-1])
    assert total == 7 + 10 + 5  # each sequence's earlier cells plus this ubatch's rows
    padded = plan.flat(64, cap=32)
    assert len(padded[3]) == 32 and padded[3][:total].tolist() == cells.tolist() and not padded[3][total:].any()
    with pytest.raises(ValueError):
        plan.flat(64, cap=total - 1)


def test_stage_parts_places_the_flat_plan():
    """The CUDA backend stages a step's index arrays (``cuda.stage_parts``) into one reused
    int32 buffer, the cell lists unpadded in slots of the graph's capacity: every value the
    kernels read (each part's own length) equals the padded concatenation ``flat(n, cap)`` gave;
    a second, shorter step into the same buffer leaves only slot tails stale; parts longer than
    their slot and short buffers are refused."""
    from opencoti.engine.backend.cuda import stage_parts

    c = KVCache([0], n_cells=64, n_stream=1, n_seq_max=4, n_head_kv=1, d_k=4, d_v=4)
    for s, n in enumerate([5, 9, 3]):
        plan = c.prepare(np.full(n, s), np.arange(n))
        c.apply(plan, np.full(n, s), np.arange(n))
    buf = np.full(200, -7, dtype=np.int32)
    for step, seqs in enumerate(([0, 1, 2], [2, 0])):
        seqs = np.array(seqs)
        pos = np.array([c.seq_pos_max(s) + 1 for s in seqs])
        plan = c.prepare(seqs, pos)
        c.apply(plan, seqs, pos)
        tokens, out_rows = np.arange(len(seqs)) + 100, np.arange(len(seqs))
        parts = [tokens, pos, out_rows] + plan.flat(64)
        slots = [len(tokens), len(pos), len(out_rows), len(seqs), len(seqs), len(seqs) + 1, 32, 32]
        o = stage_parts(parts, slots, buf)
        padded = np.concatenate([tokens, pos, out_rows] + plan.flat(64, 32)).astype(np.int32)
        assert o.tolist() == np.cumsum([0] + slots).tolist()
        for i, x in enumerate(parts):
            assert buf[o[i]:o[i] + len(x)].tolist() == padded[o[i]:o[i] + len(x)].tolist() == list(x)
        assert (buf[o[-1]:] == -7).all()
    with pytest.raises(ValueError):
        stage_parts([np.arange(5)], [4], buf)
    with pytest.raises(ValueError):
        stage_parts([np.arange(5)], [5], np.zeros(4, dtype=np.int32))


@pytest.mark.parametrize("n_stream,n_swa", [(1, 0), (1, 6), (4, 0), (4, 6)])
def test_decode_step_arrays_equal_the_definition(n_stream, n_swa):
    """A decode step (one row per sequence, rows in any seq order, a subset of the
    sequences) is committed as ``ViewArrays``: its views (built on access) are, per sequence
    in ascending seq_id, exactly the cells the sequence is a member of with their positions,
    the ubatch row of the sequence; ``flat`` equals ``flat`` over those views as objects; the
    cached per-sequence cell lists stay equal to the membership matrix (also after SWA
    pruning, which drops one cell per sequence per step past the window)."""
    from opencoti.engine.kv_cache import CachePlan, SeqView

    rng = np.random.default_rng(7)
    c = KVCache([0], n_cells=128, n_stream=n_stream, n_seq_max=4, n_head_kv=1, d_k=4, d_v=4, n_swa=n_swa)
    n_past = [5, 9, 3, 7]
    for s, n in enumerate(n_past):
        plan = c.prepare(np.full(n, s), np.arange(n))
        c.apply(plan, np.full(n, s), np.arange(n))
        assert plan.arrays is None  # several rows per sequence: the general path
    for step in range(12):
        seqs = rng.permutation(4)[: rng.integers(1, 5)]
        pos = np.array([n_past[s] for s in seqs])
        c.prune_swa(seqs, pos)  # as KVCacheSet.prepare
        plan = c.prepare(seqs, pos)
        c.apply(plan, seqs, pos)
        for s in seqs:
            n_past[s] += 1
        assert plan.arrays is not None
        views = plan.views
        assert [v.seq_id for v in views] == sorted(seqs.tolist())
        for v in views:
            member = np.nonzero(c.seq[v.stream, v.seq_id])[0]
            assert sorted(v.cells.tolist()) == member.tolist()
            assert v.cell_pos.tolist() == c.pos[v.stream, v.cells].tolist()
            assert v.rows.tolist() == np.nonzero(seqs == v.seq_id)[0].tolist()
            assert v.stream == (0 if n_stream == 1 else v.seq_id)
            if n_swa:
                assert c.pos[v.stream, v.cells].min() > n_past[v.seq_id] - 1 - n_swa
        as_objects = CachePlan(plan.stream, plan.cell, views=[SeqView(v.rows, v.stream, v.cells, v.cell_pos, v.seq_id)
                                                             for v in views])
        for a, b in zip(plan.flat(128, cap=512), as_objects.flat(128, cap=512)):
            assert a.tolist() == b.tolist()
        assert plan.n_views == as_objects.n_views == len(seqs)
        for s in range(4):
            assert sorted(c.cells_of(s).tolist()) == np.nonzero(c.seq[c.stream_of(s), s])[0].tolist()


def test_shared_len_counts_cells_shared_by_membership():
    """shared_len(a, b, n): the positions from 0 at which a's cell is a member of b too: a copy
    by membership (seq_cp) is shared, cells a computed itself are not; split streams share none."""
    c = KVCache([0], 32, 1, 3, n_head_kv=1, d_k=4, d_v=4)
    pos = np.arange(10, dtype=np.int32)
    c.apply(c.prepare(np.zeros(10, np.int64), pos), np.zeros(10, np.int64), pos)
    c.seq_cp(0, 1, 0, 6)
    own = np.arange(6, 10, dtype=np.int32)
    c.apply(c.prepare(np.ones(4, np.int64), own), np.ones(4, np.int64), own)
    assert c.shared_len(1, 0, 10) == 6 and c.shared_len(1, 0, 4) == 4 and c.shared_len(0, 1, 10) == 6
    assert c.shared_len(2, 0, 5) == 0 and c.shared_len(1, 0, 0) == 0
    s = KVCache([0], 16, 2, 2, n_head_kv=1, d_k=4, d_v=4)
    p4 = np.arange(4, dtype=np.int32)
    s.apply(s.prepare(np.zeros(4, np.int64), p4), np.zeros(4, np.int64), p4)
    s.seq_cp(0, 1, 0, 4)  # a physical copy into stream 1
    assert s.shared_len(1, 0, 4) == 0


@pytest.mark.parametrize("fast", [True, False])
def test_a_member_at_a_negative_position_is_not_reused(fast):
    """A token written at a negative position stays its sequence's member: its cell is not handed
    out again as free (it was, by its position alone: the next token then overwrote it and its
    sequence's view listed the cell twice, once amid the old cells, which broke CachePlan.flat's
    order, the ubatch's new cells last). Decode steps (the fast path) and multi-row ubatches."""
    c = _cache(n_cells=8)
    c.fast = fast
    _put(c, 0, [0, 1])
    neg = _put(c, 0, [-1]).cell[0]
    plan = _put(c, 0, [2])  # one row: the decode path
    assert plan.cell[0] != neg
    plan2 = _put(c, 1, [0, 1])  # two rows of another sequence
    assert neg not in plan2.cell.tolist()
    (view,) = _put(c, 0, [3]).views
    assert sorted(view.cells.tolist()) == sorted(set(view.cells.tolist()))  # no cell twice
    assert sorted(view.cell_pos.tolist()) == [-1, 0, 1, 2, 3]
    c.seq_rm(0)  # removed (from the first position: the negative one too): free again
    assert neg in _put(c, 2, list(range(6))).cell.tolist()
