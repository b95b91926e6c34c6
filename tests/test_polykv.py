"""PolyKV pools on the CPU engine: zero-copy sharing, forks, release, refcounts."""

import threading

import numpy as np
import pytest

from opencoti.engine.api import CompletionRequest, ErrorEvent, FinishEvent, SamplingParams, TokenEvent
from opencoti.engine.engine import Engine
from opencoti.engine.polykv import PoolError, PoolRegistry
from opencoti.model.loader import load_model
from opencoti.params import Params

GREEDY = SamplingParams(temperature=0)
SYSTEM = ("You are a careful assistant for a logistics company. Answer with short factual sentences. "
          "Tools: get_route(from, to), get_weather(city), book_truck(id, date). ") * 6


@pytest.fixture(scope="module")
def model(model_path):
    return load_model(str(model_path))


def run(engine, toks, **kw):
    h = engine.submit(CompletionRequest(list(toks), **kw))
    evs = list(h.events(timeout=300))
    return [e.token for e in evs if isinstance(e, TokenEvent)], evs[-1]


def test_registry_tree_semantics():
    reg = PoolRegistry(first_seq_id=4, max_pools=3)
    a = reg.create([1, 2, 3, 4])
    a.state = "ready"
    b = reg.create([1, 2, 3, 4, 5, 6], parent_id=a.id)
    assert b.branch_pos == 4 and b.n_past == 4 and a.children == {b.id}
    b.state = "ready"
    c = reg.create([1, 2, 9], parent_id=a.id, branch_pos=2)
    assert c.branch_pos == 2
    with pytest.raises(PoolError) as e:
        reg.create([5, 6], parent_id=a.id)  # suffix-only fork
    assert e.value.status == 400
    with pytest.raises(PoolError) as e:
        reg.create([7])  # no seq ids left
    assert e.value.status == 503
    # releasing the parent keeps it while children live
    assert reg.release(a.id, {}) == []
    assert a.id in reg.pools and a.released
    b.pinned = True
    assert reg.orphaned_pin(b)
    with pytest.raises(PoolError) as e:
        reg.release(b.id, {})
    assert e.value.status == 409
    b.pinned = False
    assert [p.id for p in reg.release(b.id, {c.id: 0})] == [b.id]
    assert a.id in reg.pools  # c still lives
    gone = reg.release(c.id, {})
    assert sorted(p.id for p in gone) == sorted([a.id, c.id])
    assert reg.pools == {}
    with pytest.raises(PoolError) as e:
        reg.get(a.id)
    assert e.value.status == 404


@pytest.mark.parametrize("unified", [True, False])
def test_sessions_share_one_pool(model, unified):
    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)
    P = len(prefix)
    n = 4 if unified else 3
    e = Engine(model, Params(n_ctx=(P + 64) * (n + 1) if not unified else 2048, n_parallel=n,
                             kv_unified=unified, n_ubatch=128, polykv_max_pools=1)).start()
    try:
        info = e.create_pool(prefix, pin=True).result(timeout=300)
        assert info["state"] == "ready" and info["n_tokens"] == P
        questions = [" Q: route from Lyon to Paris? A:", " Q: weather in Oslo? A:", " Q: book truck 7? A:",
                     " Q: what tools exist? A:"][:n]
        prompts = [prefix + tok(q, add_special=False) for q in questions]
        out = [None] * n

        def go(i):
            out[i] = run(e, prompts[i], n_predict=8, sampling=GREEDY, pool_id=info["id"], session_id=f"s{i}")

        ths = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        kv = e.runner.kv.base
        for i, (ids, fin) in enumerate(out):
            assert isinstance(fin, FinishEvent) and fin.n_cached >= P
        if unified:
            # zero-copy: P cells for the prefix + each session's own suffix, not n * P
            suffix = sum(len(p) - P + 8 - 1 for p in prompts)
            assert kv.n_used() == P + suffix
            members = kv.seq[0][:n].sum(axis=0)
            assert int(np.count_nonzero(members == n)) == P
        else:
            assert all(kv.n_used(st) >= P for st in range(n))  # copied per stream
        # each session's greedy output equals the same prompt served without the pool
        for i in range(n):
            e.erase_slot(i).result(timeout=30)
        for i in range(n):
            ids, fin = run(e, prompts[i], n_predict=8, sampling=GREEDY, cache_prompt=False)
            assert fin.n_cached == 0
            assert ids == out[i][0], i
    finally:
        e.stop()


def test_fork_branch_release_and_errors(model):
    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)
    e = Engine(model, Params(n_ctx=2048, n_parallel=2, kv_unified=True, n_ubatch=128, polykv_max_pools=3)).start()
    try:
        root = e.create_pool(prefix).result(timeout=300)
        child_tokens = prefix + tok(" Extra instructions: be brief.", add_special=False)
        child = e.create_pool(child_tokens, parent=root["id"]).result(timeout=300)
        assert child["parent"] == root["id"] and child["branch_pos"] == len(prefix)
        kv = e.runner.kv.base
        # the child shares the root's cells: only its suffix is new
        assert kv.n_used() == len(child_tokens)
        branch = e.create_pool(prefix[:20] + tok(" Different tail", add_special=False),
                               parent=root["id"], branch_pos=20).result(timeout=300)
        assert branch["branch_pos"] == 20
        with pytest.raises(PoolError) as ex:
            e.create_pool(tok(" only a suffix", add_special=False), parent=root["id"]).result(timeout=60)
        assert ex.value.status == 400
        with pytest.raises(PoolError):
            e.create_pool([1, 2, 3]).result(timeout=60)  # all 3 pool seq_ids taken
        # a session on the child, then release everything
        ids, fin = run(e, child_tokens + tok(" Go:", add_special=False), n_predict=4, sampling=GREEDY,
                       pool_id=child["id"])
        assert fin.n_cached >= len(child_tokens)
        assert e.release_pool(root["id"]).result(timeout=30) == []  # children alive
        assert e.pool_info(root["id"]).result(timeout=30)["released"] is True
        e.release_pool(branch["id"]).result(timeout=30)
        e.erase_slot(fin.id_slot).result(timeout=30)
        gone = e.release_pool(child["id"]).result(timeout=30)
        assert sorted(gone) == sorted([child["id"], root["id"]])
        assert e.pool_info().result(timeout=30) == []
        assert kv.n_used() == 0
        # unknown pool on a request
        _, ev = run(e, prefix, n_predict=1, pool_id=99)
        assert isinstance(ev, ErrorEvent) and ev.status == 404
    finally:
        e.stop()


def test_pools_off_by_default(model):
    e = Engine(model, Params(n_ctx=256, n_parallel=1)).start()
    try:
        with pytest.raises(PoolError) as ex:
            e.pool_info().result(timeout=30)
        assert ex.value.status == 404
        _, ev = run(e, [2, 100], n_predict=1, pool_id=1)
        assert isinstance(ev, ErrorEvent) and ev.status == 404
    finally:
        e.stop()


def test_split_cache_with_pools_says_what_each_slot_gets(model, caplog):
    """On the split cache pools take streams of their own: boot warns with the cells per
    slot, and refuses a layout that leaves a slot almost no context."""
    import logging

    with caplog.at_level(logging.WARNING, logger="opencoti.engine"):
        e = Engine(model, Params(n_ctx=1024, n_parallel=4, kv_unified=False, polykv_max_pools=2,
                                 cache_idle_slots=False), backend="cpu")
    assert e.n_ctx_slot == 170
    assert any("170 cells per slot" in r.getMessage() and "--kv-unified" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="too few to serve"):
        Engine(model, Params(n_ctx=512, n_parallel=4, kv_unified=False, polykv_max_pools=100,
                             cache_idle_slots=False), backend="cpu")


def test_manual_shared_pool_slot(model):
    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)
    e = Engine(model, Params(n_ctx=2048, n_parallel=2, kv_unified=True, n_ubatch=128,
                             cache_idle_slots=False)).start()
    try:
        run(e, prefix, n_predict=1, sampling=GREEDY, id_slot=0)  # slot 0 holds the prefix
        prompt = prefix + tok(" Q: hi? A:", add_special=False)
        ids, fin = run(e, prompt, n_predict=6, sampling=GREEDY, id_slot=1, shared_pool_slot=0,
                       shared_prefix_n_tokens=len(prefix))
        assert fin.n_cached == len(prefix)
        # zero-copy: the prefix cells once, then slot 1's suffix and its 5 decoded tokens
        assert e.runner.kv.base.n_used() == len(prefix) + (len(prompt) - len(prefix)) + 5
        e.erase_slot(1).result(timeout=30)
        cold, _ = run(e, prompt, n_predict=6, sampling=GREEDY, id_slot=1, cache_prompt=False)
        assert cold == ids
        for kw, msg in (({"id_slot": 0, "shared_pool_slot": 0}, "is the request's own id_slot"),
                        ({"shared_pool_slot": 5}, "out of range [0, 2)")):
            _, ev = run(e, prompt, n_predict=1, shared_prefix_n_tokens=4, **kw)
            assert isinstance(ev, ErrorEvent) and ev.status == 400 and msg in ev.message
    finally:
        e.stop()
    e = Engine(model, Params(n_ctx=256, n_parallel=2)).start()
    try:
        _, ev = run(e, [2, 5], n_predict=1, shared_pool_slot=0, shared_prefix_n_tokens=1)
        assert isinstance(ev, ErrorEvent) and "no-cache-idle-slots" in ev.message
    finally:
        e.stop()


def test_shared_prefix_attention_equals_per_sequence(model):
    """Reading the pool's cells once for all sharers (LSE merge) gives the same
    logits as attending each sequence over all its cells."""
    from opencoti.engine.batch import UBatch
    from opencoti.engine.runner import ModelRunner, iter_logits

    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)[:120]
    P = len(prefix)
    suffixes = [tok(" Q: a? A:", add_special=False), tok(" Q: something longer here? A:", add_special=False)]

    def build():
        r = ModelRunner(model, n_ctx=1024, n_seq_max=3, n_ubatch=64, type_k="f32", type_v="f32")
        list(iter_logits(r, prefix, seq_id=2))  # the pool
        for s, suf in enumerate(suffixes):
            r.kv.seq_cp(2, s, 0, P)
            list(iter_logits(r, suf, seq_id=s, pos0=P))
        return r

    def step(r, share):
        ub = UBatch.build([100, 200], [P + len(suffixes[0]), P + len(suffixes[1])], [0, 1], [0, 1])
        if share:
            ub.share_src = {0: 2, 1: 2}
        out = r.decode(ub)
        return out, ub

    plain, ub0 = step(build(), False)
    shared, ub1 = step(build(), True)
    assert all(not p.groups for p in ub0.plans)
    assert any(p.groups and len(p.groups[0].cells) == P for p in ub1.plans)
    np.testing.assert_allclose(shared, plain, atol=2e-4)
    assert (shared.argmax(axis=1) == plain.argmax(axis=1)).all()


def test_enforced_pool_admission_gates_new_sessions_only(model):
    import time

    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)[:64]
    e = Engine(model, Params(n_ctx=2048, n_parallel=3, kv_unified=True, n_ubatch=128, polykv_max_pools=1)).start()
    try:
        pool = e.create_pool(prefix).result(timeout=300)
        e.call(lambda eng: eng.pools.get(pool["id"]).gate.configure(
            {"target_tps_per_session": 1e6, "mode": "enforced", "guarantee_min_sessions": 1})).result(timeout=30)
        q = prefix + tok(" Q: hi? A:", add_special=False)
        h1 = e.submit(CompletionRequest(q, n_predict=1000, sampling=GREEDY, pool_id=pool["id"], session_id="one",
                                        ignore_eos=True))
        deadline = time.time() + 120
        while not any(s.n_decoded >= 2 and s.busy for s in e.slots) and time.time() < deadline:
            time.sleep(0.05)  # wait until session one is decoding (it runs until cancelled)
        cap = e.call(lambda eng: eng.polykv.capacity(pool["id"], 8, eng.kv_headroom())).result(timeout=30)
        _, ev = run(e, q, n_predict=4, sampling=GREEDY, pool_id=pool["id"], session_id="two")
        assert isinstance(ev, ErrorEvent) and ev.status == 429 and ev.retry_after >= 1
        # GET .../capacity says the same as the gate (the settle window or the projection)
        assert cap["can_admit"] is False and cap["headroom_sessions"] == 0
        assert cap["reason"].split()[0] in ev.message  # "settling" or "projected ... < target"
        assert cap["settling"] == (cap["settle_remaining_ms"] > 0)
        # overcommit bypasses; the continuing session is never gated
        _, ev = run(e, q, n_predict=2, sampling=GREEDY, pool_id=pool["id"], session_id="three", overcommit=True)
        assert isinstance(ev, FinishEvent)
        h1.cancel()
        assert isinstance(list(h1.events(timeout=300))[-1], FinishEvent)
        h1b = e.submit(CompletionRequest(q, n_predict=30, sampling=GREEDY, pool_id=pool["id"], session_id="one"))
        _, ev = run(e, q, n_predict=2, sampling=GREEDY, pool_id=pool["id"], session_id="one")
        assert isinstance(ev, FinishEvent)  # same session queued behind itself: never refused
        list(h1b.events(timeout=300))
    finally:
        e.stop()


def test_released_pool_takes_no_new_sessions_and_is_reclaimed_when_they_leave(model):
    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)[:40]
    e = Engine(model, Params(n_ctx=1024, n_parallel=2, kv_unified=True, n_ubatch=64, polykv_max_pools=1)).start()
    try:
        pool = e.create_pool(prefix).result(timeout=300)
        ids, fin = run(e, prefix + tok(" Q1", add_special=False), n_predict=1, pool_id=pool["id"], session_id="A")
        assert isinstance(fin, FinishEvent)
        assert e.release_pool(pool["id"]).result(timeout=30) == []  # session A still shares it
        _, ev = run(e, prefix + tok(" Q2", add_special=False), n_predict=1, pool_id=pool["id"], session_id="B")
        assert isinstance(ev, ErrorEvent) and ev.status == 404
        with pytest.raises(PoolError) as ex:  # a released pool cannot be pinned back to life
            e.pin_pool(pool["id"], True).result(timeout=30)
        assert ex.value.status == 409
        assert e.pin_pool(pool["id"], False).result(timeout=30)["pinned"] is False
        # session A's slot moves on to unrelated work: the pool is reclaimed, its seq_id free again
        run(e, tok("unrelated", add_special=True), n_predict=1, session_id="A", cache_prompt=False)
        assert e.pool_info().result(timeout=30) == []
        assert e.create_pool(prefix).result(timeout=300)["state"] == "ready"
    finally:
        e.stop()


@pytest.mark.parametrize("failure", ["kv_full", "step_error"])
def test_failed_pooled_request_leaves_its_pool(model, failure):
    """A pooled request failed by a full cache (503, ``_on_kv_full``) or a failed engine step
    (500, ``_fail_all``) drops its slot's KV and its pool binding: the pool counts no session
    afterwards, so releasing it reclaims it at once (before, the slot stayed attached until it
    took other work)."""
    from opencoti.engine.kv_cache import KVCacheFullError

    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)[:40]
    e = Engine(model, Params(n_ctx=1024, n_parallel=2, kv_unified=True, n_ubatch=64, polykv_max_pools=1)).start()
    try:
        pool = e.create_pool(prefix).result(timeout=300)
        real = e.runner.decode
        calls = []

        def failing(ub, argmax=False, on_launch=None):  # the pooled request's first ubatch fails
            calls.append(ub.n_tokens)
            if failure == "kv_full":
                raise KVCacheFullError("no room (test)")
            raise RuntimeError("device lost (test)")

        trim, evict = e.runner.kv.trim_swa, e._evict_idle
        e.runner.kv.trim_swa, e._evict_idle = (lambda seqs: False), (lambda ub: False)
        e.runner.decode = failing
        _, ev = run(e, prefix + tok(" Q1", add_special=False), n_predict=4, pool_id=pool["id"], session_id="A")
        e.runner.decode, e.runner.kv.trim_swa, e._evict_idle = real, trim, evict
        assert calls and isinstance(ev, ErrorEvent) and ev.status == (503 if failure == "kv_full" else 500)
        assert e.call(lambda eng: eng.pool_attached()).result(timeout=30) == {}
        slot = next(s for s in e.slots if s.session_id == "A")
        assert (slot.pool_id, slot.n_shared, slot.n_past, slot.cache_tokens) == (None, 0, 0, [])
        assert e.release_pool(pool["id"]).result(timeout=30) == [pool["id"]]  # reclaimed now
        assert e.pool_info().result(timeout=30) == []
        ids, fin = run(e, prefix + tok(" Q1", add_special=False), n_predict=2, session_id="A")
        assert isinstance(fin, FinishEvent) and len(ids) == 2  # the engine goes on
    finally:
        e.stop()


def test_generation_stops_truncated_when_pools_fill_the_cache(model):
    """A pinned pool holds cells of the one cache, so an unlimited request (n_predict -1) fills
    the cache before its slot's context: it stops there with truncated=true and keeps its text
    (it got a 503 "KV cache full" and lost everything it had generated)."""
    tok = model.tokenizer.tokenize
    e = Engine(model, Params(n_ctx=128, n_parallel=1, kv_unified=True, n_ubatch=64, polykv_max_pools=1)).start()
    try:
        pool = e.create_pool(tok(SYSTEM, add_special=True)[:17], pin=True).result(timeout=300)
        ids, fin = run(e, tok("Once upon a time", add_special=True), n_predict=-1, sampling=GREEDY,
                       ignore_eos=True)
        assert isinstance(fin, FinishEvent), fin
        assert fin.truncated and fin.stop_type == "limit"
        assert len(ids) == fin.n_predicted and fin.n_past + 17 >= 127  # the cache's usable cells, used up
        assert e.pool_info(pool["id"]).result(timeout=30)["state"] == "ready"  # the pool is untouched
    finally:
        e.stop()


def test_forks_count_their_shared_prefix_once(model):
    """Under --kv-unified a fork shares its parent's cells: the admission gate's pooled cells
    (cells_reserved) and the pinned-cells gauge count the root's prefix once plus each fork's
    own suffix, not each fork's full prefix again."""
    tok = model.tokenizer.tokenize
    root = tok(SYSTEM, add_special=True)[:40]
    e = Engine(model, Params(n_ctx=1024, n_parallel=2, kv_unified=True, n_ubatch=64, polykv_max_pools=3)).start()
    try:
        p = e.create_pool(root, pin=True).result(timeout=300)
        for extra in (" alpha", " beta gamma"):
            e.create_pool(root + tok(extra, add_special=False), parent=p["id"], pin=True).result(timeout=300)
        own = sum(len(tok(x, add_special=False)) for x in (" alpha", " beta gamma"))
        reserved, gauges = e.call(lambda eng: (eng.polykv.cells_reserved(), eng.pool_gauges())).result(timeout=30)
        assert reserved == 40 + own and gauges["cells_pinned"] == 40 + own
        cells = e.call(lambda eng: len(np.unique(np.concatenate(
            [eng.runner.kv.base.cells_of(q.seq_id) for q in eng.polykv.registry.pools.values()])))).result(timeout=30)
        assert cells == reserved  # the cells the pools physically hold
    finally:
        e.stop()


def test_session_whose_cache_covers_the_pool_counts_as_attached(model):
    """A session that attached to a fork and then asks for the fork's parent: its own cache
    already covers the parent's prefix, and those cells are the parent's (shared through the
    fork), so the slot counts as attached to the parent with that many shared cells (it showed
    no pool and 0 shared cells although the cells were shared)."""
    tok = model.tokenizer.tokenize
    root = tok(SYSTEM, add_special=True)[:40]
    e = Engine(model, Params(n_ctx=1024, n_parallel=2, kv_unified=True, n_ubatch=64, polykv_max_pools=2)).start()
    try:
        r = e.create_pool(root, pin=True).result(timeout=300)
        f = e.create_pool(root + tok(" Extra rule.", add_special=False), parent=r["id"], pin=True).result(timeout=300)
        fork_tokens = e.pool_info(f["id"]).result(timeout=30)["n_tokens"]
        prompt = root + tok(" Extra rule. Question: hi", add_special=False)
        _, fin = run(e, prompt, n_predict=1, pool_id=f["id"], session_id="s", sampling=GREEDY)
        assert isinstance(fin, FinishEvent) and fin.timings["cache_n"] >= fork_tokens - 1
        _, fin = run(e, prompt, n_predict=1, pool_id=r["id"], session_id="s", sampling=GREEDY)
        assert isinstance(fin, FinishEvent)
        slot, attached = e.call(lambda eng: (next(x for x in eng.slots if x.session_id == "s"),
                                             eng.pool_attached())).result(timeout=30)
        assert slot.pool_id == r["id"] and slot.n_shared == 40
        assert attached == {r["id"]: 1}
    finally:
        e.stop()


def test_released_pool_held_only_as_idle_prompt_cache_goes(model):
    """A released pool that only an idle slot without a session shares (its prompt cache) is
    reclaimed at release, that slot's cache dropped, and its seq_id serves a new pool; a pool
    released while it builds fails its create at once (409) instead of leaving it waiting."""
    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)[:40]
    e = Engine(model, Params(n_ctx=1024, n_parallel=2, kv_unified=True, n_ubatch=16, polykv_max_pools=1)).start()
    try:
        pool = e.create_pool(prefix).result(timeout=300)
        want, _ = run(e, prefix + tok(" Q1", add_special=False), n_predict=2, sampling=GREEDY, id_slot=0)
        got, _ = run(e, prefix + tok(" Q1", add_special=False), n_predict=2, sampling=GREEDY, pool_id=pool["id"],
                     id_slot=1)
        assert got == want and e.slots[1].n_shared == len(prefix) and e.slots[1].session_id is None
        assert e.call(lambda eng: eng.pool_attached()).result(timeout=30) == {pool["id"]: 1}
        assert e.release_pool(pool["id"]).result(timeout=30) == [pool["id"]]
        assert e.pool_info().result(timeout=30) == []
        assert e.slots[1].n_shared == 0 and not e.slots[1].cache_tokens and e.slots[0].cache_tokens
        other = e.create_pool(tok("Another system prompt.", add_special=True)).result(timeout=300)
        assert other["state"] == "ready"
        assert e.release_pool(other["id"]).result(timeout=30) == [other["id"]]
        # released while building (a 240-token prefix takes 15 ubatches of 16)
        long_prefix = tok(SYSTEM, add_special=True)[:240]
        fut = e.create_pool(long_prefix)
        assert e.release_pool(other["id"] + 1).result(timeout=30) == [other["id"] + 1]
        with pytest.raises(PoolError) as ex:
            fut.result(timeout=30)
        assert ex.value.status == 409 and "released while it was building" in str(ex.value)
        assert e.create_pool(prefix).result(timeout=300)["state"] == "ready"  # its seq_id is free again
    finally:
        e.stop()


def test_capacity_counts_the_pool_prefix_against_a_slot_context(model):
    """``capacity``: a session joins a pool only if the pool's prefix plus its expected tokens
    fit a slot's context (the request would be a 400 otherwise), on the split cache too."""
    tok = model.tokenizer.tokenize
    prefix = tok(SYSTEM, add_special=True)[:100]
    e = Engine(model, Params(n_ctx=1024, n_parallel=2, kv_unified=False, polykv_max_pools=2)).start()
    try:
        assert e.n_ctx_slot == 256
        pool = e.create_pool(prefix).result(timeout=300)
        cap = lambda n: e.call(lambda eng: eng.polykv.capacity(pool["id"], n, 10_000)).result(timeout=30)  # noqa: E731
        assert cap(156)["can_admit"] and cap(156)["headroom_sessions"] == 2
        no = cap(157)
        assert not no["can_admit"] and no["headroom_sessions"] == 0 and "exceeds the slot's context" in no["reason"]
        _, ev = run(e, prefix + [236743] * 157, n_predict=0, pool_id=pool["id"])
        assert isinstance(ev, ErrorEvent) and ev.type == "exceed_context_size_error"  # what 157 would get
    finally:
        e.stop()
