"""PolyKV REST control plane and the Python client against a live server."""

import asyncio
import json

import httpx
import pytest

from opencoti.client import AsyncPolykvClient, OpencotiHTTPError, PolykvClient, PoolSaturatedError
from opencoti.http.server import make_server, start_in_thread, stop_server
from opencoti.model.loader import load_model
from opencoti.params import Params

SYSTEM = "You are a terse assistant. Tools: search(q), open(url), summarize(text). Rules: cite sources. " * 3


def _serve(model_path, **kw):
    params = Params(model=model_path, n_ctx=1024, n_parallel=2, kv_unified=True, port=0, endpoint_metrics=True, **kw)
    model = load_model(model_path, params)
    httpd, engine = make_server(model, params)
    start_in_thread(httpd)
    return httpd, engine


@pytest.fixture(scope="module")
def server(model_path):
    httpd, engine = _serve(model_path, polykv_max_pools=3)
    yield f"http://127.0.0.1:{httpd.server_address[1]}", engine
    stop_server(httpd, engine)


def test_routes_404_when_off(model_path):
    httpd, engine = _serve(model_path)
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        for method, path in [("GET", "/polykv/pools"), ("POST", "/polykv/pools"), ("GET", "/polykv/pools/1"),
                             ("POST", "/polykv/pools/1/fork"), ("GET", "/polykv/tps")]:
            r = httpx.request(method, base + path, json={"prompt": "x"}, timeout=30)
            assert r.status_code == 404, path
            assert r.json()["error"]["type"] == "not_found_error"
        r = httpx.post(base + "/completion", json={"prompt": "hi", "pool_id": 1, "n_predict": 1}, timeout=30)
        assert r.status_code == 404
    finally:
        stop_server(httpd, engine)


def test_pool_lifecycle_and_attach(server):
    base, engine = server
    with PolykvClient(base) as c:
        pool = c.create_pool(prompt=SYSTEM, pin=True)
        P = pool["n_tokens"]
        assert pool["state"] == "ready" and pool["pinned"] and pool["n_cells"] == P
        assert [p["id"] for p in c.list_pools()] == [pool["id"]]
        prompt = SYSTEM + " Question: what tools do you have? Answer:"
        out = c.complete(prompt, pool_id=pool["id"], session_id="a1", n_predict=6, temperature=0)
        assert out["timings"]["cache_n"] >= P - 1 and out["tokens_predicted"] == 6
        assert c.get_pool(pool["id"])["sessions_attached"] == 1
        props = httpx.get(base + "/props", timeout=30).json()["opencoti"]["rest_kv"]
        assert props["enabled"] and props["pools"] == 1 and props["cells_pinned"] == P and props["sessions_attached"] == 1
        metrics = httpx.get(base + "/metrics", timeout=30).text
        assert "opencoti:polykv_pools 1" in metrics and f"opencoti:polykv_cells_pinned {P}" in metrics
        slots = httpx.get(base + "/slots", timeout=30).json()
        assert any(s["opencoti"]["pool"] and s["opencoti"]["pool"]["id"] == pool["id"]
                   and s["opencoti"]["n_pool_shared"] >= P - 1 for s in slots)
        r = httpx.post(base + "/completion", json={"prompt": prompt, "pool_id": pool["id"], "session_id": "a1",
                                                   "n_predict": 2}, timeout=120)
        assert r.status_code == 200 and float(r.headers["X-Session-TPS"]) >= 0
        cold = c.complete(prompt, n_predict=6, temperature=0, cache_prompt=False, id_slot=1)
        assert cold["content"] == out["content"] and cold["timings"]["cache_n"] == 0
        # fork by tokens: the child's full prefix; a suffix-only fork is a 400
        suffix = c.tokenize(" Extra rule: be polite.")
        child = c.fork_by_tokens(pool["id"], suffix)
        assert child["parent"] == pool["id"] and child["branch_pos"] == P and child["n_tokens"] == P + len(suffix)
        with pytest.raises(OpencotiHTTPError) as e:
            c.fork(pool["id"], tokens=suffix)
        assert e.value.status == 400
        # capacity and tps snapshots
        cap = c.capacity(pool["id"], expected_tokens=64)
        assert cap["can_admit"] is True and cap["headroom_sessions"] >= 1 and cap["free_cells"] > 0
        snap = c.tps()
        assert any(s["session_id"] == "a1" for s in snap["sessions"])
        # pinned pools are not released; after unpin the release keeps it while the child lives
        with pytest.raises(OpencotiHTTPError) as e:
            c.release(pool["id"])
        assert e.value.status == 409
        c.unpin(pool["id"])
        rel = c.release(pool["id"])
        assert rel["reclaimed"] == [] and rel["held_by"]["children"] == [child["id"]]  # why it stays
        assert c.get_pool(child["id"])["orphaned_pin"] is False
        assert c.set_sampling(child["id"], temperature=0.2)["sampling"] == {"temperature": 0.2}
        assert c.set_admission(child["id"], mode="enforced", target_tps_per_session=10)["admission"]["mode"] == "enforced"
        with pytest.raises(OpencotiHTTPError):
            c.set_admission(child["id"], mode="sometimes")
        rel = c.release(child["id"])
        assert sorted(rel["reclaimed"]) == sorted([child["id"]])  # the root stays: session a1 shares its cells
        assert "held_by" not in rel
        with pytest.raises(OpencotiHTTPError) as e:
            c.get_pool(child["id"])
        assert e.value.status == 404


def test_bad_bodies(server):
    base, _ = server
    for body in [{}, {"prompt": "a", "tokens": [1]}, {"tokens": ["x"]}, {"prompt": 5}, {"from_slot": "zero"},
                 {"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"tokens": []}, {"from_slot": 7}, {"from_slot": -1}]:
        r = httpx.post(base + "/polykv/pools", json=body, timeout=30)
        assert r.status_code == 400, body
    r = httpx.post(base + "/polykv/pools", json={"from_session": "nobody"}, timeout=30)
    assert r.status_code == 404
    r = httpx.get(base + "/polykv/pools/abc", timeout=30)
    assert r.status_code == 404
    # settings a request would be refused for are refused when stored (JSON NaN / Infinity too)
    pid = httpx.post(base + "/polykv/pools", json={"tokens": [2, 818, 5279]}, timeout=120).json()["id"]
    try:
        for raw in (b'{"n_predict": -7}', b'{"temperature": NaN}'):
            r = httpx.post(f"{base}/polykv/pools/{pid}/sampling", content=raw, timeout=30,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400, raw
        for raw in (b'{"target_tps_per_session": NaN}', b'{"target_tps_per_session": Infinity}',
                    b'{"settle_max_ms": 1000000000000000000000000000000}', b'{"settle_tokens": -1}'):
            r = httpx.post(f"{base}/polykv/pools/{pid}/admission", content=raw, timeout=30,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400, raw
        assert httpx.get(f"{base}/polykv/pools/{pid}", timeout=30).status_code == 200
        # null puts a setting back to its default
        r = httpx.post(f"{base}/polykv/pools/{pid}/sampling", json={"temperature": 0.5, "top_k": 7}, timeout=30)
        assert r.json()["sampling"] == {"temperature": 0.5, "top_k": 7}
        r = httpx.post(f"{base}/polykv/pools/{pid}/sampling", json={"temperature": None}, timeout=30)
        assert r.status_code == 200 and r.json()["sampling"] == {"top_k": 7}
        r = httpx.post(f"{base}/polykv/pools/{pid}/admission", json={"mode": "enforced"}, timeout=30)
        assert r.json()["admission"]["mode"] == "enforced"
        r = httpx.post(f"{base}/polykv/pools/{pid}/admission", json={"mode": None}, timeout=30)
        assert r.status_code == 200 and r.json()["admission"]["mode"] == "advisory"
        r = httpx.get(f"{base}/polykv/pools/{pid}_0", timeout=30)  # int() would read "1_0" as 10
        assert r.status_code == 404
        r = httpx.get(base + "/polykv/tps?once=yes", timeout=30)  # not a stream that never ends
        assert r.status_code == 400
        with PolykvClient(base) as c, pytest.raises(ValueError):
            c.complete("hi", pool_id=pid, stream=True)
    finally:
        httpx.post(f"{base}/polykv/pools/{pid}/release", timeout=30)


def test_async_client_and_429(server):
    base, engine = server

    async def go():
        async with AsyncPolykvClient(base) as c:
            p = await c.create_pool(tokens=[2, 818, 5279, 529], pin=False)
            assert p["n_tokens"] == 4
            assert (await c.get_pool(p["id"]))["state"] == "ready"
            await c.release(p["id"])

    asyncio.run(go())
    # a refusal raises PoolSaturatedError with Retry-After
    with PolykvClient(base) as c:
        with pytest.raises(PoolSaturatedError) as e:
            c.complete("x " * 400, n_predict=900)
        assert e.value.status == 429 and e.value.retry_after >= 1


def test_more_bad_inputs(server):
    base, _ = server
    r = httpx.post(base + "/polykv/pools/999/fork", json={"branch_pos": 2}, timeout=30)
    assert r.status_code == 404
    with PolykvClient(base) as c:
        p = c.create_pool(tokens=[2, 818, 5279])
        with pytest.raises(OpencotiHTTPError) as e:
            c.set_admission(p["id"], target_tps_per_session=-1)
        assert e.value.status == 400
        c.release(p["id"])
    big = b'{"prompt": "hi", "n_predict": 1' + b"0" * 5000 + b"}"
    r = httpx.post(base + "/completion", content=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_pool_sampling_defaults_apply_to_attached_requests(server):
    base, _ = server
    with PolykvClient(base) as c:
        p = c.create_pool(prompt=SYSTEM)
        c.set_sampling(p["id"], temperature=0, n_predict=3)
        out = c.complete(SYSTEM + " Q:", pool_id=p["id"])
        assert out["tokens_predicted"] == 3 and out["generation_settings"]["temperature"] == 0
        own = c.complete(SYSTEM + " Q:", pool_id=p["id"], n_predict=5)  # the request's field wins
        assert own["tokens_predicted"] == 5
        plain = c.complete(SYSTEM + " Q:", n_predict=2)  # not attached: server defaults
        assert plain["generation_settings"]["temperature"] != 0
        # every sampler field a request takes may be a pool default (XTC, Mirostat, DRY ...)
        knobs = {"xtc_probability": 0.5, "mirostat": 2, "mirostat_tau": 3.0, "min_keep": 2, "top_n_sigma": 1.5,
                 "dynatemp_range": 0.3, "dry_multiplier": 0.8, "dry_allowed_length": 3,
                 "dry_sequence_breakers": ["\n", "###"]}
        assert c.set_sampling(p["id"], **knobs)["sampling"] == {"temperature": 0, "n_predict": 3, **knobs}
        out = c.complete(SYSTEM + " Q:", pool_id=p["id"])
        assert {k: out["generation_settings"][k] for k in knobs} == knobs
        for bad in ({"dry_sequence_breakers": []}, {"dry_penalty_last_n": 2 ** 63}, {"repeat_last_n": 2 ** 40},
                    {"dry_allowed_length": -10 ** 20}, {"top_k": 10 ** 20}, {"n_predict": 2 ** 70},
                    {"dry_sequence_breakers": ["\ud800"]}):
            r = httpx.post(f"{base}/polykv/pools/{p['id']}/sampling", content=json.dumps(bad).encode(), timeout=30,
                           headers={"content-type": "application/json"})  # (json.dumps escapes the surrogate)
            assert r.status_code == 400, bad
        # as a request's: a dry_base below 1 is the server's default; float fields echo as floats
        c.set_sampling(p["id"], dry_base=0.5, top_n_sigma=2)
        out = c.complete(SYSTEM + " Q:", pool_id=p["id"])
        assert out["generation_settings"]["dry_base"] == 1.75 and out["generation_settings"]["temperature"] == 0.0
        assert isinstance(out["generation_settings"]["top_n_sigma"], float)
        c.release(p["id"])


def test_compact_by_refork(model_path):
    """compact_by_refork: a grown pool replaced by a fork of its ancestor plus a summary, its
    session re-homed (sharing the new prefix) and the old pool reclaimed; when re-homing fails
    (a session id the server refuses) the new fork is rolled back and the old pool is kept; the
    async client does the same."""
    httpd, engine = _serve(model_path, polykv_max_pools=4)
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        with PolykvClient(base) as c:
            root = c.create_pool(prompt=SYSTEM, pin=True)
            grown = c.fork_by_tokens(root["id"], c.tokenize(" Turn 1: the user asked about maps."), pin=True)
            prompt = c.get_pool_tokens(grown["id"]) + c.tokenize(" Answer:")
            c.complete(prompt, pool_id=grown["id"], session_id="s1", n_predict=2)
            new = c.compact_by_refork(grown["id"], root["id"], " Summary: maps.", session_ids=("s1",))
            assert new["parent"] == root["id"] and new["pinned"]
            assert sorted(p["id"] for p in c.list_pools()) == sorted([root["id"], new["id"]])  # old one reclaimed
            assert c.get_pool(new["id"])["sessions_attached"] == 1
            out = c.complete(c.get_pool_tokens(new["id"]) + c.tokenize(" Answer:"), pool_id=new["id"],
                             session_id="s1", n_predict=2)
            assert out["timings"]["cache_n"] >= new["n_tokens"] - 1
            with pytest.raises(OpencotiHTTPError) as e:
                c.compact_by_refork(new["id"], root["id"], " Summary two.", session_ids=("",))
            assert e.value.status == 400
            assert sorted(p["id"] for p in c.list_pools()) == sorted([root["id"], new["id"]])  # rolled back
            assert c.get_pool(new["id"])["pinned"]

        async def go():
            async with AsyncPolykvClient(base) as ac:
                return await ac.compact_by_refork(new["id"], root["id"], " Summary three.", session_ids=("s1",))

        newer = asyncio.run(go())
        with PolykvClient(base) as c:
            assert sorted(p["id"] for p in c.list_pools()) == sorted([root["id"], newer["id"]])
    finally:
        stop_server(httpd, engine)
