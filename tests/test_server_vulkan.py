"""The HTTP server on the Vulkan backend: a representative subset of
``test_server.py``'s end-to-end tests, run unchanged against a server whose
engine was built with ``gpu="vulkan"`` (``select_backend``, as ``--gpu vulkan``
does), plus checks of its own.

The subset, chosen to cover what differs on a device backend while staying short
on lavapipe (~1 decoded token per second): completions equal to llama.cpp's text
from a token prompt with a stop word; two prompts in one request decoded side by
side (two slots: two KV streams in one ubatch); ``n_predict`` 0 and 3 (prompt-only
forwards, cache reuse between requests); validation errors. Own checks:
``/props`` names the Vulkan backend; a streamed completion gives llama.cpp's
tokens; a chat completion. Skips like ``test_vulkan.py`` when no Vulkan device
exists (fails instead with ``OPENCOTI_REQUIRE_VULKAN=1``).
"""

from __future__ import annotations

import os

import pytest


from vk_guard import DEVICE, vulkan_devices  # noqa: E402

vulkan_devices()

import test_server as _ts  # noqa: E402

from opencoti.http.server import make_server, start_in_thread, stop_server  # noqa: E402
from opencoti.params import Params  # noqa: E402

call, sse_events = _ts.call, _ts.sse_events
# test_server's fixtures (over this module's ``server``) and the tests re-run here
ref, exact, port = _ts.ref, _ts.exact, _ts.port
test_completion_token_prompt_and_stop_word = _ts.test_completion_token_prompt_and_stop_word
test_completion_multiple_prompts = _ts.test_completion_multiple_prompts
test_n_predict_zero_and_n = _ts.test_n_predict_zero_and_n
test_error_cases = _ts.test_error_cases

pytestmark = pytest.mark.vulkan


@pytest.fixture(scope="module")
def server(request):
    from opencoti.model.loader import load_model

    model_path = os.environ.get("OPENCOTI_MODEL") or request.getfixturevalue("model_path")
    params = Params(model=model_path, n_ctx=1024, n_parallel=2, port=0, endpoint_metrics=True,
                    gpu="vulkan", main_gpu=DEVICE)
    model = load_model(model_path, params)
    httpd, engine = make_server(model, params)
    start_in_thread(httpd)
    yield {"port": httpd.server_address[1], "httpd": httpd, "engine": engine, "model": model, "params": params}
    stop_server(httpd, engine)


def test_props_name_the_vulkan_backend(server, port):
    status, _, props = call(port, "GET", "/props")
    assert status == 200 and props["opencoti"]["backend"] == "vulkan"
    assert server["engine"].runner.backend.name == "vulkan"
    assert props["total_slots"] == 2


def test_stream_gives_llamacpp_tokens(port, ref):
    case = ref["by_name"]["capital"]
    status, h, payload = call(port, "POST", "/completion", {
        "prompt": case["prompt"], "temperature": 0, "n_predict": 6, "stream": True, "n_probs": 2})
    assert status == 200 and h["content-type"] == "text/event-stream"
    *partials, final = sse_events(payload)
    assert [ev["tokens"][0] for ev in partials] == [s["id"] for s in case["steps"][:6]]
    for ev, st in zip(partials, case["steps"]):
        assert ev["completion_probabilities"][0]["logprob"] == pytest.approx(st["logprob"], abs=0.3)
    assert final["stop"] is True and final["tokens_predicted"] == 6


def test_chat_completion(port):
    status, _, body = call(port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    ch = body["choices"][0]
    assert ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str)
    assert body["usage"]["completion_tokens"] <= 4
