"""The OpenAI-compatible routes driven by the official ``openai`` Python client
against an in-process server on the real gemma-3-270m model.

Checks real content (not just shapes): non-empty greedy text, the same text
streamed and not, usage numbers equal to the token count of the rendered chat
prompt (``/apply-template`` + ``/tokenize``), log-probabilities consistent with
the greedy choice, and ``/v1/completions`` against llama.cpp's reference.
"""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from opencoti.http.server import make_server, start_in_thread, stop_server
from opencoti.params import Params

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def post(port: int, path: str, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    return resp.status, (json.loads(data) if ctype.startswith("application/json") else data)


@pytest.fixture(scope="module")
def ref(shared_dir):
    with open(shared_dir / "data" / "ref" / "gemma3_270m_llamacpp_greedy.json", encoding="utf-8") as f:
        data = json.load(f)
    return {c["name"]: c for c in data["cases"]}


@pytest.fixture(scope="module")
def server(model_path):
    from opencoti.model.loader import load_model

    params = Params(model=model_path, n_ctx=1024, n_parallel=1, port=0)
    model = load_model(model_path, params)
    httpd, engine = make_server(model, params)
    start_in_thread(httpd)
    yield httpd.server_address[1]
    stop_server(httpd, engine)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_prompt_tokens(server):
    status, body = post(server, "/apply-template", {"messages": MESSAGES})
    assert status == 200
    prompt = body["prompt"]
    # gemma's turn markup; the BOS text is left to the tokenizer
    assert prompt.startswith("<start_of_turn>user\n") and prompt.endswith("<start_of_turn>model\n")
    # gemma has no system role: the system message opens the first user turn (llama.cpp's gemma)
    assert prompt == ("<start_of_turn>user\nYou are a helpful assistant.\n\nWhat is the capital of France?"
                      "<end_of_turn>\n<start_of_turn>model\n")
    status, tok = post(server, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})
    assert status == 200
    return tok["tokens"]


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["gemma-3-270m-q4_k_m.gguf"]


def test_chat_non_stream(client, chat_prompt_tokens):
    r = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "gemma-3-270m-q4_k_m.gguf" and r.system_fingerprint.startswith("opencoti-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(chat_prompt_tokens)
    assert chat_prompt_tokens[0] == 2  # exactly one BOS, added by the tokenizer
    assert chat_prompt_tokens.count(2) == 1
    assert 1 <= r.usage.completion_tokens <= 24
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.logprobs is None


def test_chat_stream_matches_non_stream(client, chat_prompt_tokens):
    full = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last_choice, usage_chunk = chunks
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == full.choices[0].message.content and text.strip()
    assert all(c.choices[0].finish_reason is None for c in body)
    assert last_choice.choices[0].finish_reason == full.choices[0].finish_reason
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == len(chat_prompt_tokens)
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.total_tokens == len(chat_prompt_tokens) + full.usage.completion_tokens
    # the same prompt again: its tokens but the last come from the KV cache (llama.cpp's
    # usage.prompt_tokens_details.cached_tokens, the timings' cache_n)
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == len(chat_prompt_tokens) - 1
    assert usage_chunk.model_extra["timings"]["cache_n"] == len(chat_prompt_tokens) - 1


def test_chat_stream_raw_sse_shape(server):
    status, payload = post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True})
    assert status == 200
    blocks = [b for b in payload.decode().split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    assert blocks[-1] == "data: [DONE]"
    events = [json.loads(b[6:]) for b in blocks[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    final = events[-1]
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] in ("stop", "length")
    assert final["timings"]["predicted_n"] >= 1
    assert "usage" not in final  # only with stream_options.include_usage
    assert all("timings" not in ev for ev in events[:-1])
    status, payload = post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True, "timings_per_token": True,
        "ignore_eos": True})
    events = [json.loads(b[6:]) for b in payload.decode().split("\n\n") if b and b != "data: [DONE]"]
    per_token = [ev["timings"]["predicted_n"] for ev in events[1:-1]]
    assert per_token == list(range(1, len(per_token) + 1)) and len(per_token) >= 2
    # return_progress: a role chunk with prompt_progress (llama.cpp's shape), then the content
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Hi"})):
        status, payload = post(server, path, {**body, "max_tokens": 2, "temperature": 0, "stream": True,
                                              "return_progress": True, "cache_prompt": False})
        events = [json.loads(b[6:]) for b in payload.decode().split("\n\n") if b and b != "data: [DONE]"]
        prog = [ev for ev in events if "prompt_progress" in ev]
        assert len(prog) == 1 and prog[0]["prompt_progress"]["processed"] == prog[0]["prompt_progress"]["total"] > 1
        choice = prog[0]["choices"][0]
        assert choice["delta"] == {"role": "assistant", "content": None} if "chat" in path else choice["text"] == ""


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = ""
    for entry in content:
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace").startswith(entry.token)
        text += entry.token
    if r.choices[0].finish_reason == "length":
        assert text == r.choices[0].message.content
    # logprobs without a count: only the chosen token's log-probability
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in r.choices[0].logprobs.content)


def test_text_completions_match_reference(client, ref):
    case = ref["recipe"]
    r = client.completions.create(model="m", prompt=case["prompt"], max_tokens=32, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == case["content"] and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == case["n_prompt_tokens"] and r.usage.completion_tokens == 32
    chunks = list(client.completions.create(model="m", prompt=case["prompt"], max_tokens=10, temperature=0,
                                            stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == "".join(s["token"] for s in case["steps"][:10])
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="m", messages="hello", max_tokens=4)
    assert ei.value.status_code == 400
    for bad in ([{"role": 1, "content": "x"}], [{"role": "user"}], [], [{"role": "user", "content": 3}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]):
        status, body = post(server, "/v1/chat/completions", {"messages": bad})
        assert status == 400 and body["error"]["type"] == "invalid_request_error", bad
    for extra in ({"max_tokens": "many"}, {"temperature": [1]}, {"stop": 3}, {"logprobs": "yes"},
                  {"top_logprobs": 2}, {"stream": 1}, {"n": 2}, {"response_format": {"type": "json_schema"}},
                  {"response_format": {"type": "yaml"}}, {"session_id": 3}, {"overcommit": "yes"}):
        status, body = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra})
        assert status == 400 and body["error"]["code"] == 400, extra
    status, body = post(server, "/v1/completions", {"prompt": "x", "echo": True})
    assert status == 400
    # still serving
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_assistant_prefill_and_stop(client, server):
    # a final assistant message is continued, not closed (llama.cpp's prefill)
    status, body = post(server, "/apply-template", {"messages": [
        {"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2,"}]})
    assert status == 200 and body["prompt"].endswith("<start_of_turn>model\n1, 2,")
    r = client.chat.completions.create(model="m", max_tokens=16, temperature=0, stop=["4"], messages=[
        {"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2,"}])
    content = r.choices[0].message.content
    assert "4" not in content
    if r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 16:
        assert content  # stopped on the stop word or end of turn with some text first


def test_response_format_json_schema(client):
    """Constrained output through the official client: the reply parses as JSON and
    follows the schema, streamed or not (the grammar ends it with end-of-turn)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    msgs = [{"role": "user", "content": "What is the capital of France? Reply in JSON."}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=40, temperature=0, response_format=rf)
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"answer", "sure"} and isinstance(obj["answer"], str) and len(obj["answer"]) <= 12
    assert isinstance(obj["sure"], bool)
    chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=40, temperature=0,
                                                 response_format=rf, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    # json_object: any JSON object
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still the start of an object
        assert r.choices[0].message.content.lstrip().startswith("{")
    # a schema that cannot be compiled is a 400, never unconstrained text
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="m", messages=msgs, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert ei.value.status_code == 400


def test_completions_client_stream_and_logprobs(client):
    """openai client, /v1/completions: logprobs (an integer) and a streamed
    completion whose usage arrives in the last chunk before [DONE]."""
    r = client.completions.create(model="m", prompt="1, 2, 3, 4, 5,", max_tokens=5, temperature=0, logprobs=2)
    assert r.choices[0].text == " 6, 7"  # llama.cpp's greedy tokens: " ", "6", ",", " ", "7"
    content = r.choices[0].logprobs.model_extra["content"]
    assert [e["token"] for e in content] == [" ", "6", ",", " ", "7"]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in content)
    chunks = list(client.completions.create(model="m", prompt="1, 2, 3, 4, 5,", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " 6, 7"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1  # (the same prompt)


def test_completions_several_prompts_stream(client):
    """/v1/completions streams several prompts (llama.cpp): each chunk's choice carries its
    prompt's index, each prompt's text equals its non-streamed choice, and the usage counts
    both prompts."""
    prompts = ["1, 2, 3, 4, 5,", "a, b, c, d,"]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    chunks = list(client.completions.create(model="m", prompt=prompts, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == r.choices[i].text
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 8
