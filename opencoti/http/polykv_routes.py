"""PolyKV control plane over REST (``--polykv-max-pools M``; with M = 0 every
route answers 404).

    POST /polykv/pools                 create from prompt | tokens | from_session | from_slot [, pin]
    GET  /polykv/pools                 list
    GET  /polykv/pools/{id}            one pool (incl. orphaned_pin)
    POST /polykv/pools/{id}/fork       child with its FULL prefix [, branch_pos, pin]
    POST /polykv/pools/{id}/pin        pin / unpin / release
    POST /polykv/pools/{id}/sampling   store per-pool sampling defaults
    POST /polykv/pools/{id}/admission  store per-pool admission settings
    GET  /polykv/pools/{id}/capacity   ?expected_tokens=N: can a new session fit
    GET  /polykv/tps                   SSE stream of per-session decode rates (?once=1: one snapshot)

Pool mutations and reads run on the engine thread (``Engine.create_pool`` etc.,
or ``Engine.call`` into the pool manager ``Engine.polykv``); handlers wait on the
returned Future. Errors are llama.cpp-style JSON (``PoolError``
carries the status).
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

from opencoti.engine.polykv import PoolError
from opencoti.engine.pool_admission import DEFAULTS as ADMISSION_DEFAULTS
from opencoti.http.errors import HTTPError, invalid_request
from opencoti.http.sse import sse_event
from opencoti.http.validate import tokenize_mixed

WAIT_S = 600  # a pool build is a prefill: allow it the HTTP timeout
SETTLE_MAX_MS = 3_600_000  # an admission settle window of at most an hour (Retry-After <= 3600 s)

ADMISSION_KEYS = {
    "target_tps_per_session": (int, float), "mode": str, "on_saturation": str,
    "guarantee_min_sessions": int, "settle_tokens": int, "settle_max_ms": int,
}
SAMPLING_KEYS = {
    "temperature": (int, float), "top_k": int, "top_p": (int, float), "min_p": (int, float),
    "typical_p": (int, float), "repeat_penalty": (int, float), "repeat_last_n": int,
    "presence_penalty": (int, float), "frequency_penalty": (int, float), "seed": int, "n_predict": int,
    "top_n_sigma": (int, float), "xtc_probability": (int, float), "xtc_threshold": (int, float),
    "dynatemp_range": (int, float), "dynatemp_exponent": (int, float), "mirostat": int,
    "mirostat_tau": (int, float), "mirostat_eta": (int, float), "min_keep": int,
    "dry_multiplier": (int, float), "dry_base": (int, float), "dry_allowed_length": int,
    "dry_penalty_last_n": int, "dry_sequence_breakers": list,
}


def _engine(state):
    eng = state.engine
    if eng is None or eng.pools is None:
        raise HTTPError(404, "not_found_error", "File Not Found")
    return eng


def _wait(fut):
    try:
        return fut.result(timeout=WAIT_S)
    except PoolError as e:
        typ = {404: "not_found_error", 503: "unavailable_error"}.get(e.status, "invalid_request_error")
        raise HTTPError(e.status, typ, str(e)) from None
    except (ValueError, RuntimeError) as e:
        raise invalid_request(str(e)) from None


def _pool_id(req) -> int:
    raw = req.path_params["id"]
    if not raw.isascii() or not raw.isdigit():  # int() would take "1_0", " 1", "+1"
        raise HTTPError(404, "not_found_error", f"no pool {raw!r}")
    return int(raw)


def _prefix_tokens(state, body: dict) -> list[int]:
    """The prefix of a create/fork body: exactly one of prompt, tokens, from_session, from_slot."""
    given = [k for k in ("prompt", "tokens", "from_session", "from_slot") if body.get(k) is not None]
    if len(given) != 1:
        raise invalid_request('give exactly one of "prompt", "tokens", "from_session", "from_slot"')
    key = given[0]
    val = body[key]
    if key == "prompt":
        if not isinstance(val, (str, list)):
            raise invalid_request('"prompt" must be a string or a list of strings and token ids')
        if all(p == "" for p in (val if isinstance(val, list) else [val])):
            # not a pool of the start token alone (as "tokens": [] is refused)
            raise invalid_request('"prompt" is empty')
        return tokenize_mixed(state.tokenizer, val, True, True, "prompt")
    if key == "tokens":
        if not isinstance(val, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in val):
            raise invalid_request('"tokens" must be a list of token ids')
        return list(val)
    eng = state.engine

    def slot_tokens(engine) -> list[int]:
        for s in engine.slots:
            if (key == "from_session" and s.session_id == val) or (key == "from_slot" and s.id == val):
                return list(s.cache_tokens)
        raise PoolError(f"no slot holds {key} {val!r}", 404)

    if key == "from_session" and not isinstance(val, str):
        raise invalid_request('"from_session" must be a string')
    if key == "from_slot" and (not isinstance(val, int) or isinstance(val, bool)):
        raise invalid_request('"from_slot" must be an integer')
    if key == "from_slot" and not 0 <= val < state.n_slots:  # as /slots/{id}: a bad id is the request's
        raise invalid_request(f'"from_slot" {val} out of range [0, {state.n_slots})')
    return _wait(eng.call(slot_tokens))


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise invalid_request(f'"{key}" must be a boolean')
    return v


def post_pools(state, req):
    from opencoti.http.routes import Response

    eng = _engine(state)
    body = req.json()
    tokens = _prefix_tokens(state, body)
    info = _wait(eng.create_pool(tokens, pin=_bool(body, "pin")))
    return Response(info, status=201)


def get_pools(state, req):
    from opencoti.http.routes import Response

    eng = _engine(state)
    return Response({"object": "list", "data": _wait(eng.pool_info())})


def get_pool(state, req):
    """One pool; ``?tokens=1`` adds its token list (for forks by tokens)."""
    from opencoti.http.routes import Response

    eng = _engine(state)
    pid = _pool_id(req)
    info = _wait(eng.pool_info(pid))
    if req.query.get("tokens") in ("1", "true"):
        info["tokens"] = _wait(eng.call(lambda e: list(e.pools.get(pid).tokens)))
    return Response(info)


def post_fork(state, req):
    from opencoti.http.routes import Response

    eng = _engine(state)
    parent = _pool_id(req)
    _wait(eng.pool_info(parent))  # 404 for an unknown parent before the body is judged
    body = req.json()
    tokens = _prefix_tokens(state, body)
    bp = body.get("branch_pos")
    if bp is not None and (not isinstance(bp, int) or isinstance(bp, bool)):
        raise invalid_request('"branch_pos" must be an integer')
    info = _wait(eng.create_pool(tokens, parent=parent, branch_pos=bp, pin=_bool(body, "pin")))
    return Response(info, status=201)


def post_pin(state, req):
    from opencoti.http.routes import Response

    return Response(_wait(_engine(state).pin_pool(_pool_id(req), True)))


def post_unpin(state, req):
    from opencoti.http.routes import Response

    return Response(_wait(_engine(state).pin_pool(_pool_id(req), False)))


def post_release(state, req):
    from opencoti.http.routes import Response

    pid = _pool_id(req)
    eng = _engine(state)
    gone = _wait(eng.release_pool(pid))
    out = {"id": pid, "released": True, "reclaimed": gone}
    if pid not in gone:  # what keeps it: live children, sessions sharing its cells
        info = _wait(eng.pool_info(pid))
        out["held_by"] = {"children": info["children"], "sessions_attached": info["sessions_attached"]}
    return Response(out)


def _store(state, req, attr: str, allowed: dict):
    from opencoti.http.routes import Response

    eng = _engine(state)
    body = req.json()
    for k, v in body.items():
        if k not in allowed:
            raise invalid_request(f"unknown {attr} field {k!r} (allowed: {', '.join(sorted(allowed))})")
        if v is None:  # null: back to the default
            continue
        if isinstance(v, bool) or not isinstance(v, allowed[k]):
            raise invalid_request(f'"{k}" has the wrong type')
        if isinstance(v, float) and not math.isfinite(v):
            raise invalid_request(f'"{k}" must be a finite number')
        if attr == "admission" and isinstance(v, (int, float)) and v < 0:
            raise invalid_request(f'"{k}" must be >= 0')
        if attr == "admission" and k == "settle_max_ms" and v > SETTLE_MAX_MS:
            raise invalid_request(f'"settle_max_ms" must be <= {SETTLE_MAX_MS}')
    clear = [k for k, v in body.items() if v is None]
    body = {k: v for k, v in body.items() if v is not None}
    if attr == "sampling":  # the same range checks a request's own fields get (400 here, not later)
        from opencoti.engine.api import SamplingParams
        from opencoti.http.validate import parse_n_predict, parse_sampling

        parse_sampling(body, SamplingParams(), 1)
        parse_n_predict(body, -1)
    if attr == "admission":
        if body.get("mode", "advisory") not in ("advisory", "enforced"):
            raise invalid_request('"mode" must be "advisory" or "enforced"')
        if body.get("on_saturation", "reject") not in ("reject", "warn"):
            raise invalid_request('"on_saturation" must be "reject" or "warn"')
    pid = _pool_id(req)

    def apply(engine):
        p = engine.pools.get(pid)
        store = getattr(p, attr)
        store.update(body)
        for k in clear:
            if attr == "admission":  # the gate's settings: back to their defaults
                store[k] = ADMISSION_DEFAULTS[k]
            else:
                store.pop(k, None)
        return {"id": pid, attr: dict(store)}

    return Response(_wait(eng.call(apply)))


def post_sampling(state, req):
    return _store(state, req, "sampling", SAMPLING_KEYS)


def post_admission(state, req):
    return _store(state, req, "admission", ADMISSION_KEYS)


def get_capacity(state, req):
    """Can a new session of ``expected_tokens`` (suffix + generation) join pool {id} now?"""
    from opencoti.http.routes import Response

    eng = _engine(state)
    pid = _pool_id(req)
    raw = req.query.get("expected_tokens", "256")
    try:
        expected = int(raw)
        if expected <= 0:
            raise ValueError
    except ValueError:
        raise invalid_request('"expected_tokens" must be a positive integer') from None

    def cap(engine):
        engine.pools.get(pid)  # 404 for an unknown pool before the headroom is judged
        headroom = engine.kv_headroom() if engine.runner.kv.unified else sum(
            s.n_ctx for s in engine.slots if not s.busy)
        return engine.polykv.capacity(pid, expected, headroom)

    return Response(_wait(eng.call(cap)))


def get_tps(state, req):
    """``GET /polykv/tps``: SSE, one snapshot per second (bounded by the HTTP
    timeout); ``?once=1`` answers a single JSON snapshot."""
    from opencoti.http.routes import Response, StreamResponse

    eng = _engine(state)

    def snap() -> dict:
        return {"time": time.time(), "sessions": _wait(eng.call(lambda e: e.polykv.session_rates()))}

    once = req.query.get("once", "0").lower()
    if once not in ("0", "1", "true", "false"):
        raise invalid_request('"once" must be 1 / true or 0 / false')
    if once in ("1", "true"):
        return Response(snap())

    def stream() -> Iterator[bytes]:
        deadline = time.monotonic() + max(1, state.params.timeout)
        while time.monotonic() < deadline and not req.is_disconnected():
            yield sse_event(snap())
            time.sleep(1.0)

    return StreamResponse(stream())


def request_defaults(state, body: dict):
    """``(SamplingParams, n_predict)`` defaults for a completion request: the
    server's, overridden by the per-pool ``sampling`` defaults when the body
    attaches to a pool (``pool_id``); the request's own fields still win."""
    from dataclasses import replace

    sp, n_predict = state.params.sampling, state.params.n_predict
    pid = body.get("pool_id") if isinstance(body, dict) else None
    if isinstance(pid, float) and pid.is_integer():  # as get_int reads it
        pid = int(pid)
    eng = state.engine
    if not isinstance(pid, int) or isinstance(pid, bool) or eng is None or eng.pools is None:
        return sp, n_predict
    pool = eng.pools.pools.get(pid)  # a plain dict read: at worst one step stale
    if pool is None or not pool.sampling:
        return sp, n_predict
    fields = dict(pool.sampling)
    n_predict = int(fields.pop("n_predict", n_predict))
    if "dry_sequence_breakers" in fields:  # a JSON list; SamplingParams holds a tuple
        fields["dry_sequence_breakers"] = tuple(fields["dry_sequence_breakers"])
    if fields.get("dry_base", 1.0) < 1.0:  # as a request's: below 1 means the server's default
        del fields["dry_base"]
    for k, v in fields.items():  # JSON 0 for a float field echoes as 0.0, as llama.cpp's
        if isinstance(getattr(sp, k), float):
            fields[k] = float(v)
    return replace(sp, **fields), n_predict


def register(router: Any) -> None:
    """Add the PolyKV routes to ``router`` (an ``opencoti.http.routes.Router``)."""
    router.add("POST", "/polykv/pools", post_pools)
    router.add("GET", "/polykv/pools", get_pools)
    router.add("GET", "/polykv/pools/{id}", get_pool)
    router.add("POST", "/polykv/pools/{id}/fork", post_fork)
    router.add("POST", "/polykv/pools/{id}/pin", post_pin)
    router.add("POST", "/polykv/pools/{id}/unpin", post_unpin)
    router.add("POST", "/polykv/pools/{id}/release", post_release)
    router.add("POST", "/polykv/pools/{id}/sampling", post_sampling)
    router.add("POST", "/polykv/pools/{id}/admission", post_admission)
    router.add("GET", "/polykv/pools/{id}/capacity", get_capacity)
    router.add("GET", "/polykv/tps", get_tps)
