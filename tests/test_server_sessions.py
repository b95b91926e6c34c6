"""Many sessions on one server, end to end over HTTP on the real gemma-3-270m
model: concurrent sessions equal the same requests served one at a time (on
both KV layouts), a session's second turn reuses its KV and equals a cold run,
the per-slot context limit (overflow, n_predict -1 / -2), and the KV admission
gate (429 + Retry-After before any prefill, warn, off, overcommit).

Two servers share one loaded model: ``unified`` (8 slots over one 1024-cell
stream, ``--kv-unified``) and ``split`` (8 slots, 256 cells cut into eight
32-cell streams). Prompts are short and generations a few tokens, so the module
runs in well under a minute on two cores.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from opencoti.http.server import make_server, start_in_thread, stop_server
from opencoti.params import Params

PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "Once upon a time",
    "My favourite colour is",
    "def add(a, b):",
    "The sun rises in the",
    "Water boils at",
    "Ingredients for pancakes:",
]
N_PREDICT = 6


def call(port: int, method: str, path: str, body=None):
    """One request; returns (status, headers with lower-case keys, JSON body or raw bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    resp = conn.getresponse()
    payload = resp.read()
    headers = {k.lower(): v for k, v in resp.getheaders()}
    conn.close()
    if headers.get("content-type", "").startswith("application/json"):
        return resp.status, headers, json.loads(payload)
    return resp.status, headers, payload


def completion(port: int, prompt, **kw) -> dict:
    body = {"prompt": prompt, "temperature": 0, "n_predict": N_PREDICT, "return_tokens": True, **kw}
    status, _, out = call(port, "POST", "/completion", body)
    assert status == 200, out
    return out


def open_stream(port: int, body: dict) -> socket.socket:
    """Start a streamed /completion on a raw socket; returns once its first event arrived."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200")
    return sock


def wait_idle(engine, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and any(s.busy for s in engine.slots):
        time.sleep(0.02)
    assert not any(s.busy for s in engine.slots)


@pytest.fixture(scope="module")
def model(model_path):
    from opencoti.model.loader import load_model

    return load_model(model_path, Params(model=model_path))


def _serve(model, model_path, **kw):
    params = Params(model=model_path, port=0, n_parallel=8, n_ubatch=128, endpoint_metrics=True, **kw)
    httpd, engine = make_server(model, params, host="127.0.0.1", port=0)
    start_in_thread(httpd)
    return {"port": httpd.server_address[1], "httpd": httpd, "engine": engine, "params": params}


@pytest.fixture(scope="module")
def unified(model, model_path):
    srv = _serve(model, model_path, n_ctx=1024, kv_unified=True)
    yield srv
    stop_server(srv["httpd"], srv["engine"])


@pytest.fixture(scope="module")
def split(model, model_path):
    srv = _serve(model, model_path, n_ctx=256, kv_unified=False)
    yield srv
    stop_server(srv["httpd"], srv["engine"])


@pytest.fixture(scope="module")
def one_at_a_time(unified):
    """Each prompt alone (greedy), no other request in flight: the reference."""
    return [completion(unified["port"], p, cache_prompt=False)["tokens"] for p in PROMPTS]


# ---------------------------------------------------------------------------


def test_layouts_reported(unified, split):
    for srv, unified_, n_ctx_slot, n_stream in ((unified, True, 1024, 1), (split, False, 32, 8)):
        props = call(srv["port"], "GET", "/props")[2]
        assert props["total_slots"] == 8
        assert props["default_generation_settings"]["n_ctx"] == n_ctx_slot
        kv = props["opencoti"]["kv"]
        assert kv["unified"] is unified_ and kv["n_ctx_slot"] == n_ctx_slot and kv["n_seq_max"] == 8
        assert kv["caches"][0]["n_stream"] == n_stream and kv["caches"][0]["n_cells"] == n_ctx_slot
        slots = call(srv["port"], "GET", "/slots")[2]
        assert [s["n_ctx"] for s in slots] == [n_ctx_slot] * 8


@pytest.mark.parametrize("layout", ["unified", "split"])
def test_eight_concurrent_sessions_equal_one_at_a_time(layout, request, one_at_a_time):
    srv = request.getfixturevalue(layout)
    engine = srv["engine"]
    results: list = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def run(i):
        barrier.wait()
        results[i] = completion(srv["port"], PROMPTS[i], session_id=f"{layout}-{i}")

    steps0 = engine.n_steps
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    steps = engine.n_steps - steps0
    for i, r in enumerate(results):
        assert r is not None and r["tokens"] == one_at_a_time[i], PROMPTS[i]
    assert len({r["id_slot"] for r in results}) == 8  # every session got its own slot
    # they were batched: far fewer engine steps than 8 requests x (prefill + 6 tokens) one by one
    assert steps < 4 * (N_PREDICT + 1), steps
    # each session is bound to the slot that holds its KV
    bound = {s["opencoti"]["session_id"]: s["id"] for s in call(srv["port"], "GET", "/slots")[2]}
    assert all(bound[f"{layout}-{i}"] == r["id_slot"] for i, r in enumerate(results))


def test_session_second_turn_reuses_its_kv_and_equals_cold(unified):
    port = unified["port"]
    tok = call(port, "POST", "/tokenize", {"content": "User: name three fruits.\nAssistant:", "add_special": True})
    turn1 = tok[2]["tokens"]
    first = completion(port, turn1, session_id="chat-A")
    assert first["timings"]["cache_n"] <= 1  # at most the BOS another slot's cache starts with
    # other sessions in between, on other slots
    for i in range(3):
        completion(port, f"Unrelated request number {i}", session_id=f"other-{i}", n_predict=2)
    more = call(port, "POST", "/tokenize", {"content": " Apples.\nUser: and two more?\nAssistant:"})[2]["tokens"]
    turn2 = turn1 + first["tokens"] + more
    second = completion(port, turn2, session_id="chat-A")
    assert second["id_slot"] == first["id_slot"]
    assert second["timings"]["cache_n"] >= len(turn1)
    assert second["timings"]["prompt_n"] == len(turn2) - second["timings"]["cache_n"]
    cold = completion(port, turn2, cache_prompt=False)
    assert cold["timings"]["cache_n"] == 0
    assert cold["tokens"] == second["tokens"] and cold["content"] == second["content"]
    # a full prefix hit still evaluates the last prompt token (there must be logits to sample)
    again = completion(port, turn2, session_id="chat-A")
    assert again["timings"]["cache_n"] == len(turn2) - 1 and again["timings"]["prompt_n"] == 1
    assert again["tokens"] == cold["tokens"]


def test_split_slot_context_limits(split):
    port = split["port"]
    # a prompt that cannot fit its slot's 32 cells
    status, _, body = call(port, "POST", "/completion", {"prompt": [2] + [9259] * 39})
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error"
    assert body["error"]["n_prompt_tokens"] == 40 and body["error"]["n_ctx"] == 32
    # -2 fills the slot's context; -1 (past EOS) stops there too, truncated, without context shift
    prompt = [2, 818, 5279, 529, 7001]  # BOS "The capital of France"
    out = {}

    def run(n):
        out[n] = completion(port, prompt, n_predict=n, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(n,)) for n in (-2, -1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for n in (-2, -1):
        r = out[n]
        assert r["tokens_predicted"] == 32 - len(prompt), n
        assert r["truncated"] is True and r["stop_type"] == "limit", n
    # n_predict N gives at most N
    assert completion(port, prompt, n_predict=3)["tokens_predicted"] == 3


def test_admission_gate_over_http(unified):
    """enforced: 429 + Retry-After, before any prefill; overcommit bypasses it;
    warn: admitted with X-KV-Pool-Saturated (streamed and not); off: no gate."""
    port, engine, params = unified["port"], unified["engine"], unified["params"]
    wait_idle(engine)
    for s in engine.slots:  # start from an empty cache so nothing is reused
        engine.erase_slot(s.id).result(timeout=60)
    # one long session holds 9 + 1012 projected cells of the 1024: 3 left
    bg_prompt = [2] + [9259, 1902] * 4
    sock = open_stream(port, {"prompt": bg_prompt, "n_predict": 1012, "ignore_eos": True, "temperature": 0})
    try:
        assert engine.kv_headroom() == 1024 - (len(bg_prompt) + 1012) == 3
        # 8 prompt tokens + n_predict 8 = 16 cells > 3 (later runs reuse the 8 cached ones: 8 > 3)
        probe = [2, 818, 7001, 529, 5279, 563, 496, 3207]
        body = {"prompt": probe, "n_predict": 8, "temperature": 0}
        metrics0 = call(port, "GET", "/metrics")[2].decode()
        refused0 = engine.n_admissions_refused
        for stream in (False, True):
            status, h, err = call(port, "POST", "/completion", {**body, "stream": stream})
            assert status == 429, err
            assert err["error"]["code"] == 429 and "saturated" in err["error"]["message"]
            assert 1 <= int(h["retry-after"]) <= 60
        status, h, err = call(port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert status == 429 and "retry-after" in h
        assert engine.n_admissions_refused == refused0 + 3
        # refused before prefill: no slot ever held the probe's tokens
        assert all(s.cache_tokens[:len(probe)] != probe for s in engine.slots)
        metrics1 = call(port, "GET", "/metrics")[2].decode()

        def refused(text):
            return float(next(line.split()[1] for line in text.splitlines()
                              if line.startswith("opencoti:admissions_refused_total ")))

        assert refused(metrics1) - refused(metrics0) == 3
        # overcommit: admitted anyway, no saturation header
        status, h, out = call(port, "POST", "/completion", {**body, "overcommit": True})
        assert status == 200 and out["tokens_predicted"] >= 1 and "x-kv-pool-saturated" not in h
        # warn: admitted, with the header naming the pool
        params.admission_poolless = "warn"
        status, h, out = call(port, "POST", "/completion", body)
        assert status == 200 and out["tokens_predicted"] >= 1
        assert h["x-kv-pool-saturated"] == "poolless"
        status, h, payload = call(port, "POST", "/completion", {**body, "stream": True})
        assert status == 200 and h["x-kv-pool-saturated"] == "poolless"
        assert payload.endswith(b"\n\n") and b'"stop":true' in payload
        status, h, out = call(port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 200 and h["x-kv-pool-saturated"] == "poolless"
        # off: no gate, no header
        params.admission_poolless = "off"
        status, h, out = call(port, "POST", "/completion", body)
        assert status == 200 and "x-kv-pool-saturated" not in h
        assert engine.n_admissions_refused == refused0 + 3
    finally:
        params.admission_poolless = "enforced"
        sock.close()
    wait_idle(engine)
    # with the long session gone, the same request is admitted under enforcement
    status, h, out = call(port, "POST", "/completion", body)
    assert status == 200 and "x-kv-pool-saturated" not in h
