"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions`` and
llama.cpp's ``/apply-template``.

Request fields and response shapes follow the OpenAI API reference (Chat
Completions, Completions, their streaming chunk objects) as llama.cpp's server
implements them (``server-common.cpp`` ``oaicompat_chat_params_parse`` /
``oaicompat_completion_params_parse``, ``server-task.cpp`` ``to_json_oaicompat*``).

Chat prompts: the messages are rendered with the chat template chosen at
startup, a leading BOS text is dropped when the tokenizer adds BOS itself, and
the text is tokenized with special tokens parsed (llama.cpp behaviour).
"""

from __future__ import annotations

import json
import secrets
import string
import time
from itertools import chain
from typing import Any, Iterator, Optional, Union

import regex

from opencoti.engine.api import FinishEvent, ProgressEvent, TokenEvent
from opencoti.http import generate as gen
from opencoti.http.polykv_routes import request_defaults
from opencoti.http.errors import invalid_request
from opencoti.http.routes import (
    Request,
    Response,
    StreamResponse,
    first_event,
    submit_all,
)
from opencoti.http.sse import SSE_DONE, sse_event
from opencoti.http.state import ServerState
from opencoti.http.validate import (
    ParsedCompletion,
    check_text_fits,
    get_bool,
    get_int,
    parse_completion,
    tokenize_prompts,
)

_ALNUM = string.ascii_letters + string.digits


def random_id(prefix: str) -> str:
    """``prefix`` + 32 random letters/digits (llama.cpp ``gen_chatcmplid``)."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(32))


def finish_reason(fin: FinishEvent) -> str:
    """OpenAI finish_reason: "stop" for an end-of-generation token or a stop
    string, "length" for the n_predict / context limit."""
    return "stop" if fin.stop_type in ("eos", "word") else "length"


def usage_json(*results: gen.Result, n_cmpl: int = 1) -> dict:
    """OpenAI ``usage`` of one or more finished generations (llama.cpp ``usage_json_oaicompat``):
    token counts summed, a prompt's counted once for its ``n_cmpl`` completions (``results``
    prompt-major, as ``submit_all``), ``prompt_tokens_details.cached_tokens`` the prompt tokens
    reused from the KV cache (not evaluated again)."""
    firsts = results[::n_cmpl]
    done, prompt = sum(r.n_predicted for r in results), sum(r.n_prompt for r in firsts)
    return {"completion_tokens": done, "prompt_tokens": prompt, "total_tokens": done + prompt,
            "prompt_tokens_details": {"cached_tokens": sum(r.n_cached for r in firsts)}}


# ---------------------------------------------------------------------------
# chat prompt


def _check_messages(messages: Any) -> list:
    """Type checks on ``messages`` before the template sees them (400 on failure)."""
    if messages is None:
        raise invalid_request('"messages" is required')
    if not isinstance(messages, list):
        raise invalid_request('"messages" must be an array of message objects')
    if not messages:
        raise invalid_request('"messages" must not be empty')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid_request(f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise invalid_request(f'messages[{i}].role must be a non-empty string')
        content = m.get("content")
        if role != "assistant" and "content" not in m:
            raise invalid_request("All non-assistant messages must contain 'content'")
        if role == "assistant" and content is None and not m.get("tool_calls"):
            raise invalid_request("Assistant message must contain either 'content' or 'tool_calls'")
        if content is not None and not isinstance(content, (str, list)):
            raise invalid_request(f"messages[{i}].content must be a string or an array of content parts")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise invalid_request(f"messages[{i}].content parts must be objects")
                ptype = part.get("type")
                if ptype in ("image_url", "input_audio"):
                    raise invalid_request(f"{ptype} input is not supported: this server has no multimodal projector loaded")
                if ptype != "text" or not isinstance(part.get("text"), str):
                    raise invalid_request(f"messages[{i}].content: unsupported content part (only text parts with a string 'text')")
        tcs = m.get("tool_calls")
        if tcs is not None:
            if not isinstance(tcs, list):
                raise invalid_request(f"messages[{i}].tool_calls must be an array")
            for j, tc in enumerate(tcs):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise invalid_request(f'messages[{i}].tool_calls[{j}] must be {{"type": "function", '
                                          f'"function": {{"name": ..., "arguments": ...}}}}')
                args = fn.get("arguments")
                if args is not None and not isinstance(args, (str, dict)):
                    raise invalid_request(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string")
    return messages


def prepare_messages(messages: list) -> list:
    """Copies of OpenAI messages in the form chat templates expect (llama.cpp's
    ``common_chat_msgs_parse_oaicompat`` + minja's polyfills do the same):

    - an assistant turn that has ``tool_calls`` and no ``content`` (absent or
      null, as OpenAI sends it) gets ``content: ""`` (templates read it);
    - ``function.arguments`` given as a JSON string (OpenAI's form) becomes the
      object it encodes, which templates render with ``tojson`` (a string would
      come out double-encoded); a string that is not a JSON object stays as is;
    - a ``developer`` message (OpenAI's newer name for the system role) is a ``system``
      one, as llama.cpp renders it for templates that do not know the role.
    """
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        tcs = m.get("tool_calls")
        if tcs:
            if m.get("content") is None:
                m["content"] = ""
            new_tcs = []
            for tc in tcs:
                tc = dict(tc)
                fn = dict(tc.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                tc["function"] = fn
                new_tcs.append(tc)
            m["tool_calls"] = new_tcs
        out.append(m)
    return out


def _content_text(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):  # text parts, joined as the template sees them (normalize_messages)
        return "\n".join(p.get("text", "") for p in c if isinstance(p, dict))
    return c if isinstance(c, str) else ""


_MARK = "\ue000{}\ue001"  # a message's content stand-in (private-use characters around its index)


def marked_spans(text: str, messages: list, render) -> Optional[list[tuple[int, int]]]:
    """Where the messages' contents sit in ``text`` (``render(messages)``), found exactly:
    ``render`` again with every content replaced by a stand-in marker gives the template's own
    text around the contents, and ``text`` must be that text with each marker replaced by its
    content, whole or stripped (templates that ``trim``). Templates may move a content
    (Mistral's system text in the last user turn) or drop it (no span). Returns the spans
    ``[(start, end)]`` in text order, or None when the two renders do not fit that (the
    template rewrote a content, or branched on it), or the marked render fails."""
    marked, contents = [], []
    for i, m in enumerate(messages):
        c = _content_text(m)
        if c:
            marked.append({**m, "content": _MARK.format(i)})
            contents.append((_MARK.format(i), c))
        else:
            marked.append(m)
    try:
        mtext = render(marked)
    except Exception:  # the template may refuse a stand-in it inspects
        return None
    if any(mtext.count(mk) > 1 for mk, _ in contents):
        return None
    found = sorted((mtext.find(mk), mk, c) for mk, c in contents if mk in mtext)
    spans, pos_m, pos_t = [], 0, 0
    for k, (j, mk, c) in enumerate(found):
        seg = mtext[pos_m:j]  # the template's text before this content
        if not text.startswith(seg, pos_t):
            return None
        pos_t, pos_m = pos_t + len(seg), j + len(mk)
        last = k + 1 == len(found)
        after = mtext[pos_m:] if last else mtext[pos_m:found[k + 1][0]]
        for cand in (c, c.strip()):
            if text.startswith(cand + after, pos_t) and (not last or len(text) == pos_t + len(cand + after)):
                if cand:
                    spans.append((pos_t, pos_t + len(cand)))
                pos_t += len(cand)
                break
        else:
            return None
    return spans if text[pos_t:] == mtext[pos_m:] else None


def content_spans(state: ServerState, text: str, messages: list, render) -> list[tuple[int, int]]:
    """Where each message's content sits in the rendered prompt ``text`` (``render(messages)``):
    ``[(start, end)]`` in text order, for ``tokenize_chat`` to keep as text. Exact
    (``marked_spans``); where the template rewrote a content so that it cannot be located, no
    content may hold control-token text (then none needs a span: the whole text is parsed, as
    llama.cpp does), else 400: which copy of the markup is the template's cannot be told."""
    spans = marked_spans(text, messages, render)
    if spans is not None:
        return spans
    controls = [t for t, _ in state.control_tokens()]
    for m in messages:
        c = _content_text(m)
        hit = next((t for t in controls if t in c), None)
        if hit is not None:
            raise invalid_request(
                f"a {m.get('role')} message contains the control-token text {hit!r}, and the chat template "
                "rewrites the messages so that its text cannot be told from the template's markup")
    return []


def render_chat_spans(state: ServerState, body: dict) -> tuple[str, list[tuple[int, int]]]:
    """Render the request's messages to prompt text with the server's template;
    returns ``(text, content_spans)``.

    Handles ``tools``, ``chat_template_kwargs``, ``add_generation_prompt`` and a
    final assistant message (prefilled: rendered without it, its content then
    appended, as llama.cpp does). Raises 400 for malformed messages or when the
    template refuses the conversation.
    """
    messages = prepare_messages(_check_messages(body.get("messages")))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid_request('"tools" must be an array')
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        # tools reach the template, but output is not parsed into tool_calls: a call cannot be forced
        raise invalid_request('"tool_choice" supports "auto" and "none": the tools are given to the chat '
                              'template, tool calls are not parsed from the output')
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid_request('"chat_template_kwargs" must be an object')
    add_gen = get_bool(body, "add_generation_prompt", True)
    # chat_template_kwargs are template variables that override the defaults (llama.cpp):
    # add_generation_prompt and tools included; any other name, whatever it is, is a variable
    kwargs = dict(kwargs)
    if "add_generation_prompt" in kwargs:
        add_gen = get_bool(kwargs, "add_generation_prompt", True)
        del kwargs["add_generation_prompt"]
    if "tools" in kwargs:
        kw_tools = kwargs.pop("tools")
        if kw_tools is not None and not isinstance(kw_tools, list):
            raise invalid_request('"chat_template_kwargs.tools" must be an array')
        tools = kw_tools
    prefill: Optional[str] = None
    last = messages[-1]
    content = last.get("content")
    text_parts = isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content)
    if last.get("role") == "assistant" and not last.get("tool_calls") and (isinstance(content, str) or text_parts):
        # prefilled: a string, or text parts joined as llama.cpp's oaicompat_chat_params_parse
        prefill = _content_text(last)
        messages = messages[:-1]
        if messages and messages[-1].get("role") == "assistant":
            raise invalid_request("Cannot have 2 or more assistant messages at the end of the list.")
        add_gen = True  # an assistant message alone is a prefill of an empty conversation (llama.cpp)
    tok = state.tokenizer

    def render(msgs: list) -> str:
        return state.chat_template.render_prompt(
            msgs, add_bos=bool(tok.add_bos), add_eos=bool(tok.add_eos),
            add_generation_prompt=add_gen, tools=tools or None, extra_context=kwargs)

    try:
        text = render(messages)
    except ValueError as e:  # ChatTemplateError is a ValueError
        raise invalid_request(str(e) or "the chat template refused the conversation") from None
    spans = content_spans(state, text, messages, render)
    if prefill:
        spans.append((len(text), len(text) + len(prefill)))
        text += prefill
    return text, spans


def render_chat(state: ServerState, body: dict) -> str:
    """The rendered chat prompt text (see ``render_chat_spans``)."""
    return render_chat_spans(state, body)[0]


def tokenize_chat(state: ServerState, text: str, spans: Optional[list[tuple[int, int]]] = None) -> list[int]:
    """Tokenize rendered chat text: BOS added by the tokenizer (``render_prompt``
    already removed a BOS text); control-token text written by the template
    (``<start_of_turn>``, ``<|im_end|>`` …) becomes those tokens, while inside a
    message's content (``spans``) it stays plain text, so a user cannot forge
    turn markup.

    Without content text that looks like a control token this is exactly
    ``tokenize(text, add_special=True, parse_special=True)``: the text is cut at
    the template's control tokens and the pieces between are tokenized alone, as
    the tokenizer's own special-token partition does (llama-vocab.cpp
    ``tokenizer_st_partition``).
    """
    tok = state.tokenizer
    try:
        if not spans:
            ids = tok.tokenize(text, add_special=True, parse_special=True)
        else:
            ids = _tokenize_outside_spans(state, text, spans)
    except ValueError as e:
        raise invalid_request(f"the chat prompt could not be tokenized: {e}") from None
    if not ids:
        raise invalid_request("the rendered chat prompt is empty")
    return ids


def _tokenize_outside_spans(state: ServerState, text: str, spans: list[tuple[int, int]]) -> list[int]:
    tok = state.tokenizer
    present = [(t, i) for t, i in state.control_tokens() if t in text]  # longest first
    pattern = regex.compile("|".join(regex.escape(t) for t, _ in present)) if present else None
    ids_of = dict(present)
    frags: list = []  # str pieces and control-token ids, in order
    buf: list[str] = []

    def template_part(a: int, b: int) -> None:
        pos = a
        if pattern is not None:
            for m in pattern.finditer(text, a, b):
                buf.append(text[pos:m.start()])
                frags.append("".join(buf))
                buf.clear()
                frags.append(ids_of[m.group(0)])
                pos = m.end()
        buf.append(text[pos:b])

    pos = 0
    for a, b in sorted(spans):
        if a < pos:
            continue
        template_part(pos, a)
        buf.append(text[a:b])  # content: never cut
        pos = b
    template_part(pos, len(text))
    frags.append("".join(buf))
    out: list[int] = [tok.bos_id] if tok.add_bos else []
    for f in frags:
        if isinstance(f, int):
            out.append(f)
        elif f:
            out.extend(tok.tokenize(f, add_special=False, parse_special=False))
    if tok.add_eos:
        out.append(tok.eos_id)
    return out


def _parse_chat_body(state: ServerState, body: dict) -> tuple[list[int], ParsedCompletion, int]:
    """Validate a chat body; returns (prompt ids, parsed params, top_logprobs count)."""
    parsed = parse_completion(body, *request_defaults(state, body),
                              state.n_ctx_slot, state.n_slots, state.tokenizer)
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, min=0, max=20)
    if top is not None and not want_logprobs:
        raise invalid_request("top_logprobs requires logprobs to be set to true")
    n_top = parsed.options.n_probs  # an explicit llama.cpp n_probs wins
    if want_logprobs and body.get("n_probs") is None:
        n_top = top or 0
    if want_logprobs or n_top > 0:
        parsed.request.sampling.n_probs = max(n_top, 1)
        parsed.options.want_logprobs = True
    parsed.options.n_probs = n_top
    text, spans = render_chat_spans(state, body)
    check_text_fits(state.tokenizer, text, state.n_ctx_slot)
    prompt = tokenize_chat(state, text, spans)
    return prompt, parsed, n_top


# ---------------------------------------------------------------------------
# /v1/chat/completions


def _chunk(cid: str, created: int, model: str, choices: list, **extra: Any) -> dict:
    return {"choices": choices, "created": created, "id": cid, "model": model,
            "system_fingerprint": extra.pop("fingerprint"), "object": "chat.completion.chunk", **extra}


def post_chat_completions(state: ServerState, req: Request) -> Union[Response, StreamResponse]:
    """``POST /v1/chat/completions``: OpenAI chat completion, plain or streamed.

    Non-stream: ``{id, object: "chat.completion", created, model,
    system_fingerprint, choices: [{index, message: {role, content},
    finish_reason, logprobs}], usage, timings}``. Stream: ``chat.completion.chunk``
    objects (first delta carries ``role``), a final chunk with ``finish_reason``,
    an optional usage chunk (``stream_options.include_usage``), then ``[DONE]``.
    """
    body = req.json()
    prompt, parsed, n_top = _parse_chat_body(state, body)
    opts = parsed.options
    handles = submit_all(state, parsed, [prompt])
    cid = random_id("chatcmpl-")
    created = int(time.time())
    model = state.model_name
    fp = state.build_info

    if not opts.stream:
        results = gen.collect_many(state.tokenizer, handles, req.is_disconnected, n_top=n_top,
                                   want_probs=opts.want_logprobs)
        choices = [{
            "finish_reason": finish_reason(r.finish),
            "index": i,
            "message": {"role": "assistant", "content": r.content},
            "logprobs": {"content": r.probs} if opts.want_logprobs else None,
        } for i, r in enumerate(results)]
        return Response({
            "choices": choices, "created": created, "model": model, "system_fingerprint": fp,
            "object": "chat.completion", "usage": usage_json(*results, n_cmpl=opts.n_cmpl), "id": cid,
            "timings": gen.timings_json(results[0].finish),
        }, headers=gen.admission_headers(handles))

    first, events = first_event(handles, req)
    collectors = [gen.Collector(state.tokenizer, prompt, n_top, opts.want_logprobs) for _ in handles]
    finished: list = []

    def role_chunk(i: int, **extra) -> bytes:  # choice i's opening role delta
        return sse_event(_chunk(cid, created, model, [{
            "finish_reason": None, "index": i, "delta": {"role": "assistant", "content": None}}],
            fingerprint=fp, **extra))

    def render(i: int, ev) -> Iterator[bytes]:  # i: the choice
        collector = collectors[i]
        if isinstance(ev, ProgressEvent):  # llama.cpp: the role delta again, with prompt_progress
            yield role_chunk(i, prompt_progress=ev.to_json())
            return
        if isinstance(ev, TokenEvent):
            entry = collector.add(ev)
            if not ev.text and entry is None:
                return
            choice: dict = {"finish_reason": None, "index": i, "delta": {"content": ev.text}}
            if entry is not None:
                choice["logprobs"] = {"content": [entry]}
            extra = {} if ev.timings is None else {"timings": ev.timings}
            yield sse_event(_chunk(cid, created, model, [choice], fingerprint=fp, **extra))
            return
        collector.add(ev)  # FinishEvent
        finished.append(i)
        if ev.text:
            yield sse_event(_chunk(cid, created, model, [{
                "finish_reason": None, "index": i, "delta": {"content": ev.text}}], fingerprint=fp))
        final = _chunk(cid, created, model, [{
            "finish_reason": finish_reason(ev), "index": i, "delta": {}}], fingerprint=fp)
        if not opts.include_usage:
            final["timings"] = gen.timings_json(ev)
        yield sse_event(final)
        if len(finished) < len(handles):
            return
        if opts.include_usage:  # after the last choice: the usage of them all
            results = [c.result for c in collectors]
            yield sse_event(_chunk(cid, created, model, [], fingerprint=fp,
                                   usage=usage_json(*results, n_cmpl=opts.n_cmpl),
                                   timings=gen.timings_json(results[0].finish)))
        yield SSE_DONE

    return StreamResponse(gen.sse_events(handles, chain([first], events), render,
                                         prefix=[role_chunk(i) for i in range(len(handles))]),
                          headers=gen.admission_headers(handles))


# ---------------------------------------------------------------------------
# /v1/completions


def post_completions_oai(state: ServerState, req: Request) -> Union[Response, StreamResponse]:
    """``POST /v1/completions``: OpenAI text completion.

    ``logprobs`` (an integer, the number of top tokens) maps to ``n_probs``;
    ``echo``, ``best_of`` and ``suffix`` are refused as in llama.cpp. Several
    prompts, and ``n`` completions of each, give several choices (prompt-major; streamed, their
    chunks interleave, each with its index).
    """
    body = req.json()
    if body.get("prompt") is None:
        raise invalid_request('"prompt" is required')
    if get_bool(body, "echo", False):
        raise invalid_request("Only no echo is supported")
    for p in ("best_of", "suffix"):
        if body.get(p) is not None:
            raise invalid_request(f"Unsupported param: {p}")
    lp = get_int(body, "logprobs", None, min=0)
    if lp is not None and body.get("n_probs") is None:  # OpenAI's logprobs is llama.cpp's n_probs
        body = {**body, "n_probs": lp}
    parsed = parse_completion(body, *request_defaults(state, body),
                              state.n_ctx_slot, state.n_slots, state.tokenizer)
    opts = parsed.options
    want_probs = opts.n_probs > 0
    prompts = tokenize_prompts(state.tokenizer, body["prompt"], n_ctx=state.n_ctx_slot)
    handles = submit_all(state, parsed, prompts)
    cid = random_id("cmpl-")
    created = int(time.time())
    model = state.model_name
    fp = state.build_info

    def obj(choices: list, **extra: Any) -> dict:
        return {"choices": choices, "created": created, "model": model, "system_fingerprint": fp,
                "object": "text_completion", "id": cid, **extra}

    if not opts.stream:
        results = gen.collect_many(state.tokenizer, handles, req.is_disconnected,
                                   n_top=opts.n_probs, want_probs=want_probs)
        choices = [{"text": r.content, "index": i,
                    "logprobs": {"content": r.probs} if want_probs else None,
                    "finish_reason": finish_reason(r.finish)} for i, r in enumerate(results)]
        return Response(obj(choices, usage=usage_json(*results, n_cmpl=opts.n_cmpl),
                            timings=gen.timings_json(results[0].finish)),
                        headers=gen.admission_headers(handles))

    first, events = first_event(handles, req)
    collectors = [gen.Collector(state.tokenizer, h.request.prompt_tokens, opts.n_probs, want_probs)
                  for h in handles]
    finished: list = []

    def render(i: int, ev) -> Iterator[bytes]:  # i: the choice
        collector = collectors[i]
        if isinstance(ev, ProgressEvent):
            yield sse_event(obj([{"text": "", "index": i, "logprobs": None, "finish_reason": None}],
                                prompt_progress=ev.to_json()))
            return
        if isinstance(ev, TokenEvent):
            entry = collector.add(ev)
            if ev.text or entry is not None:
                extra = {} if ev.timings is None else {"timings": ev.timings}
                yield sse_event(obj([{"text": ev.text, "index": i,
                                      "logprobs": {"content": [entry]} if entry is not None else None,
                                      "finish_reason": None}], **extra))
            return
        collector.add(ev)  # FinishEvent
        finished.append(i)
        if ev.text:
            yield sse_event(obj([{"text": ev.text, "index": i, "logprobs": None, "finish_reason": None}]))
        if len(finished) < len(handles):  # the last choice's finish carries the usage of them all
            yield sse_event(obj([{"text": "", "index": i, "logprobs": None, "finish_reason": finish_reason(ev)}]))
            return
        results = [c.result for c in collectors]
        yield sse_event(obj([{"text": "", "index": i, "logprobs": None, "finish_reason": finish_reason(ev)}],
                            usage=usage_json(*results, n_cmpl=opts.n_cmpl), timings=gen.timings_json(ev)))
        yield SSE_DONE

    return StreamResponse(gen.sse_events(handles, chain([first], events), render),
                          headers=gen.admission_headers(handles))


# ---------------------------------------------------------------------------
# /apply-template


def post_apply_template(state: ServerState, req: Request) -> Response:
    """``POST /apply-template`` ``{messages, ...}`` -> ``{"prompt": text}``: the chat
    prompt exactly as ``/v1/chat/completions`` would tokenize it (llama.cpp)."""
    body = req.json()
    return Response({"prompt": render_chat(state, body)})
