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
