"""QA leftovers on the real server (gemma-3-270m, CPU), over real sockets:
malformed HTTP framing, sampler fields, and /metrics after a dropped stream."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from opencoti.http.server import MAX_BODY_BYTES


def raw_exchange(port: int, data: bytes) -> tuple[bytes, dict, bytes]:
    """Send ``data`` on a fresh connection and read until the server closes it.
    Returns (status line, headers with lower-case names, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        got = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return lines[0], headers, body


def assert_json_error(status_line: bytes, headers: dict, body: bytes, status: int) -> dict:
    assert status_line.startswith(b"HTTP/1.1 %d " % status), status_line
    assert headers["content-type"].startswith("application/json")
    assert headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    err = json.loads(body)["error"]
    assert err["code"] == status and err["type"] == "invalid_request_error" and err["message"]
    return err


# -- 2. Content-Length --------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-5", "abc", "+5", "5_0", "1e3", "0x10"])
def test_bad_content_length_is_json_400(server, value):
    st, h, body = raw_exchange(server["port"], b"POST /completion HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Type: application/json\r\nContent-Length: %s\r\n\r\n{}" % value.encode())
    err = assert_json_error(st, h, body, 400)
    assert "Content-Length" in err["message"] and value in err["message"]


def test_body_over_the_limit_is_json_413(server):
    st, h, body = raw_exchange(server["port"], b"POST /completion HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Length: %d\r\n\r\n{}" % (MAX_BODY_BYTES + 1))
    err = assert_json_error(st, h, body, 413)
    assert "too large" in err["message"]


def test_conflicting_content_lengths_are_json_400(server):
    """QA: two Content-Length fields that disagree (a CL.CL smuggling shape: the tail of
    the body as a pipelined request) used to be framed by the first and the rest read as
    the next request; RFC 9112 §6.3: 400 and close. Equal duplicates are one length."""
    tail = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b'{"content":"hi"}' + tail
    st, h, got = raw_exchange(server["port"], b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    err = assert_json_error(st, h, got, 400)
    assert "conflicting Content-Length" in err["message"] and b"HTTP/1.1" not in got  # no second reply
    st, h, got = raw_exchange(server["port"], b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\n"
                              b"Content-Length: 16\r\nConnection: close\r\n\r\n{\"content\":\"hi\"}")
    assert st.startswith(b"HTTP/1.1 200 ") and json.loads(got)["tokens"]


def test_transfer_encoding_framing(server):
    """QA: Transfer-Encoding as RFC 9112 §6.1 / §6.3: chunked with a Content-Length is read
    chunked and the connection closed after the reply (the pipelined request behind it is
    not served); a last coding other than chunked is a 400 (it used to be read as an
    empty body), another coding before chunked a 501; "chunkedx" is not chunked."""
    chunked = b"11\r\n{\"content\":\"hi\"}\n\r\n0\r\n\r\n"
    st, h, got = raw_exchange(server["port"], b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n" + chunked +
                              b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert st.startswith(b"HTTP/1.1 200 ") and h["connection"] == "close"
    assert json.loads(got)["tokens"] and b"HTTP/1.1" not in got
    for te in (b"gzip", b"chunkedx", b"chunked, gzip"):
        st, h, got = raw_exchange(server["port"], b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: %s\r\n"
                                  b"\r\n" % te + chunked + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        err = assert_json_error(st, h, got, 400)
        assert "Transfer-Encoding" in err["message"] and te.decode() in err["message"]
    st, h, got = raw_exchange(server["port"], b"POST /tokenize HTTP/1.1\r\nHost: x\r\n"
                              b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked)
    assert st.startswith(b"HTTP/1.1 501 ") and h["connection"] == "close"
    assert json.loads(got)["error"]["type"] == "not_supported_error"


# -- 3. garbage request lines -------------------------------------------------------------------

@pytest.mark.parametrize("line", [b"GARBAGE", b"GET /health", b"GET / HTTP/1.1 extra", b"GET /health FOO/1.0"])
def test_garbage_request_line_is_http11_json_400(server, line):
    st, h, body = raw_exchange(server["port"], line + b"\r\n\r\n")
    assert_json_error(st, h, body, 400)


def test_server_fine_after_malformed_requests(server):
    raw_exchange(server["port"], b"GARBAGE\r\n\r\n")
    r = httpx.get(server["base"] + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# -- 4. sampler fields: top_n_sigma is applied, samplers is the chain ---------------------------

def _complete(base: str, **body):
    r = httpx.post(base + "/completion", json={"prompt": "The capital of France is", "n_predict": 6,
                                                "ignore_eos": True, "return_tokens": True, **body}, timeout=120)
    return r.status_code, r.json()


def test_top_n_sigma_is_applied(server):
    base = server["base"]
    st, greedy = _complete(base, temperature=0)
    assert st == 200
    # a hot temperature, but a cut at max - 1e-4 * sigma leaves only the best token: greedy output
    for seed in (1, 2, 3):
        st, out = _complete(base, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, top_n_sigma=1e-4, seed=seed)
        assert st == 200 and out["tokens"] == greedy["tokens"], seed
        assert out["generation_settings"]["top_n_sigma"] == 1e-4
    # post-sampling probabilities show the cut: one candidate with probability 1
    st, out = _complete(base, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, top_n_sigma=1e-4, n_probs=3,
                        post_sampling_probs=True, n_predict=1)
    assert st == 200
    top = out["completion_probabilities"][0]["top_probs"]
    assert len(top) == 1 and top[0]["prob"] == pytest.approx(1.0)
    st, err = _complete(base, top_n_sigma="x")
    assert st == 400 and "top_n_sigma" in err["error"]["message"]


def test_samplers_list_and_letters(server, caplog):
    import logging

    base = server["base"]
    with caplog.at_level(logging.WARNING, logger="opencoti.http"):
        st, out = _complete(base, temperature=0, samplers=["top_k", "bogus", "temperature"])
    assert st == 200 and out["generation_settings"]["samplers"] == ["top_k", "temperature"]
    assert any("'bogus'" in r.getMessage() and "left out of the chain" in r.getMessage() for r in caplog.records)
    st, greedy = _complete(base, temperature=0)
    assert out["tokens"] == greedy["tokens"]  # top_k + greedy temperature: the greedy tokens
    st, out = _complete(base, temperature=0, samplers="ekzt")  # z: unknown letter, dropped
    assert st == 200 and out["generation_settings"]["samplers"] == ["penalties", "top_k", "temperature"]
    st, out = _complete(base, temperature=0)
    assert out["generation_settings"]["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p",
                                                      "min_p", "xtc", "temperature"]  # llama.cpp's default order
    for bad in (["infill"], "a", [1], {"x": 1}):
        st, err = _complete(base, samplers=bad)
        assert st == 400 and err["error"]["type"] == "invalid_request_error", bad


# -- 5. /metrics count what ran, also for a client that left mid-stream --------------------------

def scrape(base: str) -> dict:
    r = httpx.get(base + "/metrics", timeout=30)
    assert r.status_code == 200
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in r.text.splitlines() if not ln.startswith("#")}


def test_metrics_count_a_cancelled_stream(server):
    base, engine = server["base"], server["engine"]
    tok = engine.model.tokenizer.tokenize("Once upon a time", add_special=True)
    before = scrape(base)
    sock = socket.create_connection(("127.0.0.1", server["port"]), timeout=120)
    data = json.dumps({"prompt": tok, "n_predict": 400, "ignore_eos": True, "temperature": 0, "id_slot": 0,
                       "cache_prompt": False, "stream": True}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    got = b""
    while got.count(b"data: ") < 3:  # a few tokens streamed
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    sock.close()  # the client goes away mid-stream
    deadline = time.time() + 60
    after = scrape(base)
    while time.time() < deadline and after["opencoti:requests_total"] == before["opencoti:requests_total"]:
        time.sleep(0.05)
        after = scrape(base)
    slot = engine.slots[0]
    assert not slot.busy
    n_gen = slot.n_decoded
    assert 3 <= n_gen < 390  # it ran, and it was stopped early
    assert after["opencoti:requests_total"] - before["opencoti:requests_total"] == 1
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == n_gen
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == len(tok)
    # a normal request after it is counted once, as before
    r = httpx.post(base + "/completion", json={"prompt": tok, "n_predict": 2, "temperature": 0, "ignore_eos": True,
                                               "cache_prompt": False}, timeout=120)
    assert r.status_code == 200
    last = scrape(base)
    assert last["opencoti:requests_total"] - after["opencoti:requests_total"] == 1
    assert last["llamacpp:tokens_predicted_total"] - after["llamacpp:tokens_predicted_total"] == 2


def test_cancel_during_prefill_counts_only_evaluated_prompt_tokens():
    """Slot bookkeeping: a request finished while its prompt is still being prefilled
    reports the prompt tokens that went into the KV, not the whole prompt."""
    from opencoti.engine.api import CompletionRequest, FinishEvent, RequestHandle
    from opencoti.engine.slot import Slot, SlotState

    h = RequestHandle(CompletionRequest(list(range(100)), n_predict=5))
    seen = []
    h.on_finish(seen.append)
    s = Slot(0, 512)
    s.start(h, 10, sampler=None, decoder=None)  # 10 tokens from the prompt cache
    s.n_past = 42  # two chunks of 16 evaluated
    assert s.state is SlotState.PROMPT
    ev = s.finish("limit")
    assert ev.timings["prompt_n"] == 32 and ev.timings["cache_n"] == 10 and ev.timings["predicted_n"] == 0
    assert seen == [ev]  # the hook saw it once, before any reader
    h.push(FinishEvent(stop_type="limit"))  # a second final event is not accounted again
    assert seen == [ev]
    late = []
    h.on_finish(late.append)  # registered after the finish: called at once
    assert late == [ev]


def test_sampler_names_match_as_llama_cpp(server, caplog):
    """QA: llama.cpp (common_sampler_types_from_names, current master) lower-cases each
    name and takes its aliases (kebab-case, no underscore, nucleus / temp / typ); these
    were dropped as unknown. A dropped name is logged lower case, as llama.cpp does."""
    import logging

    from opencoti.http.validate import parse_samplers

    assert parse_samplers(["Top-K", "TOPP", "nucleus", "Temp", "typ", "typ-p", "min-p", "top-n-sigma",
                           "TEMPERATURE"]) == ("top_k", "top_p", "top_p", "temperature", "typ_p", "typ_p",
                                               "min_p", "top_n_sigma", "temperature")
    with caplog.at_level(logging.WARNING, logger="opencoti.http"):
        assert parse_samplers(["Bogus", "top_k"]) == ("top_k",)
    assert any("'bogus'" in r.getMessage() for r in caplog.records)
    st, out = _complete(server["base"], temperature=0, samplers=["Top-K", "temp"])
    assert st == 200 and out["generation_settings"]["samplers"] == ["top_k", "temperature"]
    for bad in (["Infill"], ["adaptive-p"]):
        st, err = _complete(server["base"], samplers=bad)
        assert st == 400 and "not supported" in err["error"]["message"], bad
    st, out = _complete(server["base"], temperature=0, samplers="edkt", dry_multiplier=0.5)
    assert st == 200 and out["generation_settings"]["samplers"] == ["penalties", "dry", "top_k", "temperature"]
    st, out = _complete(server["base"], temperature=0)
    assert out["generation_settings"]["dry_sequence_breakers"] == ["\n", ":", '"', "*"]


def test_request_line_over_64k_is_json_414(server):
    st, h, body = raw_exchange(server["port"], b"GET /health?" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    err = assert_json_error(st, h, body, 414)
    assert "65,536 bytes" in err["message"]
