"""Everything above the backend on a tiny Gemma-4 model, end to end over HTTP.

One random-weight model carries every Gemma-4 feature at once (sliding head dim 256 /
global 512 with V = K, a dense MLP + routed experts, per-layer embeddings, the last 4
of 8 layers reusing earlier layers' KV) and the real gemma-4 chat template. Two
servers share it: ``unified`` (4 slots over one 512-cell stream) and ``split`` (4 slots,
four 64-cell streams). Claims: concurrent sessions give the tokens each gives alone,
on both layouts; a session's second turn reuses its KV (``cache_n``) and equals a cold
run; the KV layout reports a global and a sliding cache with their own head shapes;
the chat endpoints render through the model's gemma-4 template.

The sliding window is 128 here (longer than every conversation) so the prompt cache
can be reused: with the parity tests' window of 8 the sliding cache prunes cells a
second turn would need, and the engine (as llama.cpp) reprocesses instead.
"""

from __future__ import annotations

import threading

import pytest

from opencoti.http.server import make_server, start_in_thread, stop_server
from opencoti.model.chat_template import ChatTemplate
from opencoti.model.loader import load_model
from opencoti.params import Params
from opencoti.tools import synth_gguf as sg

from test_server_sessions import call

PROMPTS = ["the quick brown fox", "a model reads tokens and", "there is a small house on the hill",
           "numbers like 1, 2, 3"]
N_PREDICT = 5
ALL_FEATURES = dict(sg.GEMMA4_VARIANTS["e_series"], num_key_value_heads=2, num_global_key_value_heads=1,
                    attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
                    moe_intermediate_size=32, sliding_window=128)


@pytest.fixture(scope="module")
def template_source(shared_dir):
    return (shared_dir / "data" / "templates" / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, template_source):
    path = tmp_path_factory.mktemp("g4srv") / "gemma4-all.gguf"
    sg.write_random_model("gemma4", path, "Q8_0", seed=3, chat_template=template_source, **ALL_FEATURES)
    return str(path)


@pytest.fixture(scope="module")
def model(model_file):
    return load_model(model_file, Params(model=model_file))


def _serve(model, model_file, **kw):
    params = Params(model=model_file, port=0, n_parallel=4, n_ubatch=32, **kw)
    httpd, engine = make_server(model, params, host="127.0.0.1", port=0)
    start_in_thread(httpd)
    return {"port": httpd.server_address[1], "httpd": httpd, "engine": engine}


@pytest.fixture(scope="module")
def unified(model, model_file):
    srv = _serve(model, model_file, n_ctx=512, kv_unified=True)
    yield srv
    stop_server(srv["httpd"], srv["engine"])


@pytest.fixture(scope="module")
def split(model, model_file):
    srv = _serve(model, model_file, n_ctx=256, kv_unified=False)
    yield srv
    stop_server(srv["httpd"], srv["engine"])


def completion(port: int, prompt, **kw) -> dict:
    body = {"prompt": prompt, "temperature": 0, "n_predict": N_PREDICT, "return_tokens": True,
            "ignore_eos": True, **kw}
    status, _, out = call(port, "POST", "/completion", body)
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def one_at_a_time(unified):
    return [completion(unified["port"], p, cache_prompt=False)["tokens"] for p in PROMPTS]


def test_kv_layout_reported(unified, split):
    for srv, n_cells in ((unified, 512), (split, 64)):
        kv = call(srv["port"], "GET", "/props")[2]["opencoti"]["kv"]
        glob, swa = kv["caches"]
        assert (glob["layers"], swa["layers"]) == (1, 3)  # layers 3 and 0-2 store KV; 4-7 reuse them
        assert swa["n_swa"] == 128 and glob["n_cells"] == n_cells
    cache = unified["engine"].runner.kv.caches
    assert cache[0].k[3].shape[-2:] == (1, 512) and cache[1].k[0].shape[-2:] == (2, 256)


@pytest.mark.parametrize("layout", ["unified", "split"])
def test_concurrent_sessions_equal_one_at_a_time(layout, request, one_at_a_time):
    srv = request.getfixturevalue(layout)
    results: list = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def run(i):
        barrier.wait()
        results[i] = completion(srv["port"], PROMPTS[i], session_id=f"{layout}-{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, r in enumerate(results):
        assert r is not None and r["tokens"] == one_at_a_time[i], PROMPTS[i]
        assert len(r["tokens"]) == N_PREDICT
    assert len({r["id_slot"] for r in results}) == len(PROMPTS)


def test_second_turn_reuses_kv_and_equals_cold(unified):
    port = unified["port"]
    turn1 = call(port, "POST", "/tokenize", {"content": "the sun rises in the", "add_special": True})[2]["tokens"]
    first = completion(port, turn1, session_id="g4-chat")
    completion(port, "unrelated words here", session_id="g4-other")
    more = call(port, "POST", "/tokenize", {"content": " and the river runs under the bridge"})[2]["tokens"]
    turn2 = turn1 + first["tokens"] + more
    second = completion(port, turn2, session_id="g4-chat")
    assert second["id_slot"] == first["id_slot"]
    assert second["timings"]["cache_n"] >= len(turn1)
    cold = completion(port, turn2, cache_prompt=False)
    assert cold["timings"]["cache_n"] == 0 and cold["tokens"] == second["tokens"]
    again = completion(port, turn2, session_id="g4-chat")
    assert again["timings"]["cache_n"] == len(turn2) - 1 and again["tokens"] == cold["tokens"]


def test_chat_renders_the_gemma4_template(unified, model, template_source):
    port = unified["port"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    status, _, out = call(port, "POST", "/apply-template", {"messages": messages})
    assert status == 200
    rendered = ChatTemplate(template_source, "<bos>", "<eos>").render(messages, add_generation_prompt=True)
    assert rendered.startswith("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nName a fruit.<turn|>\n"
                               "<|turn>model\n")
    want = rendered.removeprefix("<bos>")  # the tokenizer adds BOS (llama.cpp strips the template's)
    assert out["prompt"] == want
    status, _, chat = call(port, "POST", "/v1/chat/completions",
                           {"messages": messages, "max_tokens": 3, "temperature": 0})
    assert status == 200, chat
    assert chat["usage"]["completion_tokens"] <= 3
    # the prompt went through the tokenizer (BOS added) with the turn markers as control tokens
    toks = model.tokenizer.tokenize(want, add_special=True, parse_special=True)
    assert chat["usage"]["prompt_tokens"] == len(toks)
    assert model.tokenizer.token_id("<|turn>") in toks
