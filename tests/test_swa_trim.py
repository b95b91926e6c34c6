"""Sliding-window caches under many sessions: a prefill leaves up to ``n_swa + n_ubatch - 1``
cells per sequence, so idle or just-prefilled sessions can fill the ``n_swa * n_seq +
n_ubatch``-cell SWA cache; before evicting a session or failing a request with 503 the
engine drops the window cells nobody can see again (``KVCacheSet.trim_swa``), which keeps
every session's prompt cache usable."""

from __future__ import annotations

import numpy as np
import pytest

from opencoti.engine.api import CompletionRequest, FinishEvent, SamplingParams, TokenEvent
from opencoti.engine.engine import Engine
from opencoti.model.loader import load_model
from opencoti.params import Params
from opencoti.tools import synth_gguf as sg


@pytest.fixture(scope="module")
def gemma3_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("swa") / "gemma3.gguf"
    sg.write_random_model("gemma3", path, "F32", seed=3)  # sliding window 8
    return load_model(str(path), Params())


def _run(engine, prompts, n):
    handles = [engine.submit(CompletionRequest(p, n_predict=n, sampling=SamplingParams(temperature=0),
                                               ignore_eos=True, session_id=f"s{i}")) for i, p in enumerate(prompts)]
    out = []
    for h in handles:
        evs = list(h.events(timeout=120))
        assert isinstance(evs[-1], FinishEvent), evs[-1]
        out.append(([e.token for e in evs if isinstance(e, TokenEvent)], evs[-1]))
    return out


def test_sessions_keep_their_cache_when_the_swa_cache_fills(gemma3_tiny):
    m = gemma3_tiny
    assert m.hparams.n_swa == 8
    n, plen = 6, 100
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, m.hparams.n_vocab, plen).tolist() for _ in range(n)]
    e = Engine(m, Params(n_ctx=n * 160, n_parallel=n, kv_unified=True, n_ubatch=64)).start()
    try:
        swa = next(c for c in e.runner.kv.caches if c.n_swa > 0)
        assert n * (swa.n_swa + 64 - 1) > swa.n_cells  # prefilled sessions alone would overflow it
        first = _run(e, prompts, 1)
        assert all(len(t) == 1 for t, _ in first)
        # every session continues from its cached prompt: nothing evicted, nothing failed
        second = _run(e, [p + t for p, (t, _) in zip(prompts, first)], 3)
        for toks, fin in second:
            assert len(toks) == 3 and fin.n_cached == plen
        held = [swa.cells_of(s.seq_id) for s in e.slots]
        assert all(len(h) <= swa.n_swa + 64 for h in held)
    finally:
        e.stop()
    # the same sessions served one at a time give the same tokens
    e = Engine(m, Params(n_ctx=n * 160, n_parallel=1, n_ubatch=64)).start()
    try:
        for i, p in enumerate(prompts):
            t1 = _run(e, [p], 1)[0][0]
            assert t1 == first[i][0]
            t2 = _run(e, [p + t1], 3)[0][0]
            assert t2 == second[i][0]
    finally:
        e.stop()
