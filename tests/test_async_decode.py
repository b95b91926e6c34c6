"""Asynchronous decode steps (``Engine._run_ahead``) on the CPU engine: the same tokens as the
synchronous engine, and no KV cell left behind by a row rolled back.

On the CPU the chained step reads the previous step's ids on the host (``ModelRunner.launch``),
so the engine's part (queueing ahead, settling, rollback) runs here exactly as on CUDA, where
``test_cuda.py`` checks the device chaining."""

import threading

import pytest

from opencoti.engine.api import CompletionRequest, FinishEvent, SamplingParams, TokenEvent
from opencoti.engine.engine import Engine
from opencoti.model.loader import load_model
from opencoti.params import Params

GREEDY = SamplingParams(temperature=0)
PROMPTS = ["1, 2, 3,", "The sky is", "def fib(n):", "Bonjour, je"]


@pytest.fixture(scope="module")
def model(model_path):
    return load_model(str(model_path))


def _engine(model, ahead: bool, **kw) -> Engine:
    e = Engine(model, Params(**{"n_ctx": 1024, "n_parallel": 4, "kv_unified": True, "n_ubatch": 64, **kw}))
    assert not e.async_decode  # the CPU backend does not chain steps: forced here
    e.async_decode = ahead
    return e.start()


def _run_all(e: Engine, reqs: list[dict]) -> list[tuple[list[int], FinishEvent]]:
    """Submit every request at once (its ``delay`` in steps of the engine first, if any) and
    collect (tokens, finish event) per request."""
    out = [None] * len(reqs)

    def go(i, kw):
        try:
            kw = dict(kw)
            delay = kw.pop("delay", 0)
            while e.n_steps < delay:
                threading.Event().wait(0.002)
            h = e.submit(CompletionRequest(**kw))
            evs = list(h.events(timeout=300))
            out[i] = ([ev.token for ev in evs if isinstance(ev, TokenEvent)], evs[-1])
        except Exception as ex:  # re-raised on the test's thread
            out[i] = ex

    ths = [threading.Thread(target=go, args=(i, kw)) for i, kw in enumerate(reqs)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    for o in out:
        if isinstance(o, Exception):
            raise o
        assert isinstance(o[1], FinishEvent), o[1]
    return out


def _kv_matches_slots(e: Engine) -> None:
    """Every slot's KV holds exactly its cached tokens' positions (no rolled-back cell left)."""
    kv = e.runner.kv
    for s in e.slots:
        cells = kv.base.cells_of(s.seq_id)
        assert len(cells) == len(s.cache_tokens), (s.id, len(cells), len(s.cache_tokens))
        assert kv.seq_pos_max(s.seq_id) == len(s.cache_tokens) - 1


def test_ahead_steps_equal_synchronous_steps(model):
    """Four greedy sessions ending at different steps (n_predict 5 / 9 / 14, a stop string), one
    arriving while the others decode, then a second turn on every slot's cached prompt: the same
    tokens and finish reasons with steps queued ahead as without, steps were queued ahead, and
    the KV holds no cell of a rolled-back row."""
    tok = model.tokenizer.tokenize
    toks = [tok(p, add_special=True) for p in PROMPTS]
    first = [dict(prompt_tokens=toks[0], n_predict=5, sampling=GREEDY, id_slot=0),
             dict(prompt_tokens=toks[1], n_predict=9, sampling=GREEDY, id_slot=1),
             dict(prompt_tokens=toks[2], n_predict=14, sampling=GREEDY, id_slot=2, stop=["\n"]),
             dict(prompt_tokens=toks[3], n_predict=12, sampling=GREEDY, id_slot=3, delay=6)]
    results = {}
    for ahead in (False, True):
        e = _engine(model, ahead)
        try:
            one = _run_all(e, first)
            _kv_matches_slots(e)
            # a second turn reuses each slot's cached prompt + generated text
            second = [dict(prompt_tokens=r["prompt_tokens"] + o[0], n_predict=6, sampling=GREEDY, id_slot=r["id_slot"])
                      for r, o in zip(first, one)]
            two = _run_all(e, second)
            _kv_matches_slots(e)
            results[ahead] = (one, two, e.n_steps_ahead)
        finally:
            e.stop()
    (one_s, two_s, n_s), (one_a, two_a, n_a) = results[False], results[True]
    assert n_s == 0 and n_a >= 10
    for (ts, fs), (ta, fa) in zip(one_s + two_s, one_a + two_a):
        assert ta == ts
        assert (fa.stop_type, fa.n_predicted, fa.n_cached) == (fs.stop_type, fs.n_predicted, fs.n_cached)
    assert [len(t) for t, _ in one_a][:2] == [5, 9]
    assert all(f.n_cached > 0 for _, f in two_a)  # the second turns reused the cache


def test_ahead_steps_cancel_and_context_limit(model):
    """A request cancelled mid-decode stops without hurting the others, and a session reaching
    its slot's context (n_ctx 64 per slot) stops truncated at the same token as synchronously:
    rows near the limit are never queued ahead."""
    tok = model.tokenizer.tokenize
    toks = [tok(p, add_special=True) for p in PROMPTS[:3]]
    results = {}
    for ahead in (False, True):
        e = _engine(model, ahead, n_ctx=192, n_parallel=3, kv_unified=False)
        try:
            h = e.submit(CompletionRequest(toks[0], n_predict=200, sampling=GREEDY, id_slot=0))
            got = []
            for ev in h.events(timeout=300):
                if isinstance(ev, TokenEvent):
                    got.append(ev.token)
                    if len(got) == 4:
                        h.cancel()
            full = _run_all(e, [dict(prompt_tokens=toks[1], n_predict=200, sampling=GREEDY, id_slot=1),
                                dict(prompt_tokens=toks[2], n_predict=7, sampling=GREEDY, id_slot=2)])
            _kv_matches_slots(e)
            results[ahead] = (got[:4], full)
        finally:
            e.stop()
    (c_s, f_s), (c_a, f_a) = results[False], results[True]
    assert c_a == c_s
    for (ts, fs), (ta, fa) in zip(f_s, f_a):
        assert ta == ts and (fa.stop_type, fa.truncated) == (fs.stop_type, fs.truncated)
    assert f_a[0][1].truncated and f_a[0][1].stop_type == "limit"


def test_ahead_rollback_keeps_the_sliding_window(model):
    """A row queued ahead and rolled back leaves its sequence's sliding-window cells as the step
    before left them (the queued step prunes one position late): resending exactly a slot's
    cache past gemma-3's 512-token window reuses it (full-prompt hit, last token re-evaluated)
    as the synchronous engine does."""
    base = model.tokenizer.tokenize("The quick brown fox jumps over the lazy dog. " * 60, add_special=True)[:516]
    got = {}
    for ahead in (False, True):
        e = _engine(model, ahead, n_ctx=1024, n_parallel=1, n_ubatch=512)
        try:
            (t1, _), = _run_all(e, [dict(prompt_tokens=base, n_predict=3, sampling=GREEDY, id_slot=0)])
            swa_min = e.runner.kv.swa.seq_pos_min(e.slots[0].seq_id)
            (t2, f2), = _run_all(e, [dict(prompt_tokens=list(e.slots[0].cache_tokens), n_predict=2,
                                          sampling=GREEDY, id_slot=0)])
            _kv_matches_slots(e)
            got[ahead] = (t1, swa_min, t2, f2.n_cached, e.n_steps_ahead)
        finally:
            e.stop()
    assert got[True][:4] == got[False][:4]
    assert got[False][3] == len(base) + 1 and got[True][4] >= 1


def test_ahead_step_failures_fail_requests_not_the_engine(model, monkeypatch):
    """A queued step whose result fails while a control call waits, and a postprocess that
    raises after the next step was queued: the requests get a 500, the engine thread lives and
    serves the next request with the same tokens, the control call is answered, and no queued
    row's cell is left behind."""
    from opencoti.engine.api import ErrorEvent
    from opencoti.engine.batch import StepResult

    toks = model.tokenizer.tokenize("The sky is", add_special=True)
    e = _engine(model, True, n_parallel=2)
    try:
        (want, _), = _run_all(e, [dict(prompt_tokens=toks, n_predict=8, sampling=GREEDY, cache_prompt=False)])
        launch, calls, ctl = e.runner.launch, [], []

        def failing_launch(ub, on_launch=None, after=None):
            res = launch(ub, on_launch=on_launch, after=after)
            calls.append(1)
            if len(calls) == 3:  # a control call arrives while this step is in flight, which then fails
                ctl.append(e.call(lambda eng: "answered"))

                def boom():
                    raise RuntimeError("injected device error")
                return StepResult(wait=boom, fetch=lambda: None)
            return res

        monkeypatch.setattr(e.runner, "launch", failing_launch)
        evs = list(e.submit(CompletionRequest(toks, n_predict=8, sampling=GREEDY, cache_prompt=False)).events(timeout=300))
        assert isinstance(evs[-1], ErrorEvent) and evs[-1].status == 500
        assert ctl[0].result(timeout=60) == "answered" and e.is_alive()
        monkeypatch.setattr(e.runner, "launch", launch)

        post = e._postprocess

        def failing_post(ub, owners, logits, argmax=False):  # fails once slot 0 has just finished
            post(ub, owners, logits, argmax)
            if any(s.id == 0 and not s.busy for s, _, _ in owners):
                raise RuntimeError("injected postprocess failure")

        monkeypatch.setattr(e, "_postprocess", failing_post)
        ha = e.submit(CompletionRequest(toks, n_predict=3, sampling=GREEDY, id_slot=0, cache_prompt=False))
        hb = e.submit(CompletionRequest(toks, n_predict=12, sampling=GREEDY, id_slot=1, cache_prompt=False))
        list(ha.events(timeout=300)), list(hb.events(timeout=300))
        e.call(lambda eng: None).result(timeout=60)
        _kv_matches_slots(e)
        monkeypatch.setattr(e, "_postprocess", post)
        (again, _), = _run_all(e, [dict(prompt_tokens=toks, n_predict=8, sampling=GREEDY, cache_prompt=False)])
        assert again == want and e.is_alive()
    finally:
        e.stop()


def test_ahead_steps_end_and_hear_cancelled_waiters(model):
    """A request cancelled while it waits for the only slot finishes within a few steps while the
    busy slot decodes ahead; once every request is done no step stays in flight, and the step
    count equals the synchronous engine's."""
    tok = model.tokenizer.tokenize
    a, b = tok("The sky is", add_special=True), tok("def fib(n):", add_special=True)
    steps = {}
    for ahead in (False, True):
        e = _engine(model, ahead, n_parallel=1, n_ctx=256)
        try:
            ha = e.submit(CompletionRequest(a, n_predict=14, sampling=GREEDY))
            while e.n_steps < 2:
                threading.Event().wait(0.002)
            hb = e.submit(CompletionRequest(b, n_predict=4, sampling=GREEDY))
            while hb not in e._waiting:
                threading.Event().wait(0.001)
            s0 = e.n_steps
            hb.cancel()
            evb = list(hb.events(timeout=300))
            assert isinstance(evb[-1], FinishEvent) and e.n_steps - s0 <= 2
            list(ha.events(timeout=300))
            threading.Event().wait(0.3)
            assert e._inflight is None
            steps[ahead] = (e.n_steps, e.n_tokens_processed)
        finally:
            e.stop()
    assert steps[True] == steps[False]
