"""Routes of llama.cpp's server API and the request/response types handlers use.

A handler is ``fn(state: ServerState, req: Request) -> Response | StreamResponse``.
It raises ``HTTPError`` for client errors; the server turns any other exception
into a 500 JSON error. Paths, field names and shapes follow llama.cpp's
``tools/server/server.cpp`` (route table), ``server-context.cpp`` (handlers,
``get_res_props``, ``get_res_models``) and ``server-task.cpp`` (result JSON).

The OpenAI-compatible routes live in ``opencoti.http.oai``.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Callable, Iterator, Optional, Union

from opencoti.engine.api import CompletionRequest, ErrorEvent, ProgressEvent, TokenEvent
from opencoti.engine.kv_report import kv_props
from opencoti.http import generate as gen
from opencoti.http.polykv_routes import request_defaults
from opencoti.http import metrics as metrics_mod
from opencoti.http.errors import HTTPError, invalid_request, not_supported
from opencoti.http.metrics import kv_headroom
from opencoti.http.sse import sse_event
from opencoti.http.state import ServerState
from opencoti.http.validate import (
    ParsedCompletion,
    get_bool,
    parse_completion,
    parse_sampling,
    require_object,
    tokenize_mixed,
    tokenize_prompts,
)
from opencoti.version import __version__

# ---------------------------------------------------------------------------
# request / response types


@dataclass
class Request:
    """One parsed HTTP request.

    path: without the query string. query: first value per query key.
    body: raw body bytes. is_disconnected: returns True once the client has
    closed its connection (checked while waiting on the engine).
    """

    method: str
    path: str
    query: dict[str, str]
    headers: Any
    body: bytes
    is_disconnected: Callable[[], bool] = lambda: False
    path_params: dict[str, str] = field(default_factory=dict)

    def json(self) -> dict:
        """The body as a JSON object; 400 if it is not valid JSON or not an object."""
        return require_object(self.json_value("a JSON object"))

    def json_value(self, what: str = "JSON") -> Any:
        """The body as any JSON value; 400 (naming ``what`` was expected) if it is empty or not
        valid JSON."""
        if not self.body.strip():
            raise invalid_request(f"request body is empty; expected {what}")
        try:
            data = json.loads(self.body.decode("utf-8"))
        except UnicodeDecodeError:
            raise invalid_request("request body is not valid UTF-8") from None
        except json.JSONDecodeError as e:
            raise invalid_request(f"invalid JSON in request body: {e.msg} at line {e.lineno} column {e.colno}") from None
        except RecursionError:
            raise invalid_request("invalid JSON in request body: nested too deeply") from None
        except ValueError as e:  # e.g. an integer literal over Python's 4300-digit limit
            raise invalid_request(f"invalid JSON in request body: {e}") from None
        return data


@dataclass
class Response:
    """A complete (non-streamed) response; ``body`` is JSON-serialized unless
    ``raw`` is given."""

    body: Any = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    raw: Optional[bytes] = None
    content_type: str = "application/json; charset=utf-8"


@dataclass
class StreamResponse:
    """A server-sent-events response: each item of ``chunks`` is one encoded event.

    The server closes the iterator (``close()``) when the client goes away, so a
    generator's ``finally`` can cancel its engine request.
    """

    chunks: Iterator[bytes]
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "text/event-stream"


Handler = Callable[[ServerState, Request], Union[Response, StreamResponse]]


class Router:
    """Route table: exact paths, plus templates with ``{name}`` segments
    (``/slots/{id_slot}``) whose values land in ``Request.path_params``."""

    def __init__(self) -> None:
        self.routes: dict[str, dict[str, Handler]] = {}
        self.templates: list[tuple["re.Pattern[str]", dict[str, Handler]]] = []

    def add(self, method: str, paths: Union[str, list[str]], fn: Handler) -> None:
        for p in [paths] if isinstance(paths, str) else paths:
            if "{" in p:
                rx = re.compile("^" + re.sub(r"\\{(\w+)\\}", r"(?P<\1>[^/]+)", re.escape(p)) + "$")
                for pat, methods in self.templates:
                    if pat.pattern == rx.pattern:
                        methods[method.upper()] = fn
                        break
                else:
                    self.templates.append((rx, {method.upper(): fn}))
            else:
                self.routes.setdefault(p, {})[method.upper()] = fn

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """``(handler, path_params)`` for ``method path``.

        Raises HTTPError 404 for an unknown path, 405 (with ``Allow``) for a
        known path and another method.
        """
        methods, params = self.routes.get(path), {}
        if methods is None:
            for rx, ms in self.templates:
                m = rx.match(path)
                if m:
                    methods, params = ms, m.groupdict()
                    break
        if methods is None:
            raise HTTPError(404, "not_found_error", "File Not Found")
        fn = methods.get(method.upper())
        if fn is None and method.upper() == "HEAD":
            fn = methods.get("GET")  # HEAD = GET without the body (the writer drops it)
        if fn is None:
            allow = ", ".join(sorted(methods))
            raise HTTPError(405, "invalid_request_error",
                            f"method {method} is not allowed on {path}; use {allow}",
                            headers={"Allow": allow})
        return fn, params

    def match(self, method: str, path: str) -> Handler:
        """The handler for ``method path`` (see ``resolve``)."""
        return self.resolve(method, path)[0]


# ---------------------------------------------------------------------------
# JSON shapes shared with the OpenAI routes


def sampler_names(chain=None) -> list[str]:
    """The sampler chain a request runs (``SamplingParams.samplers``; None = the
    engine's default chain), in llama.cpp's names and order."""
    from opencoti.engine.api import DEFAULT_CHAIN

    return list(DEFAULT_CHAIN if chain is None else chain)


def generation_settings(req: CompletionRequest, stream: bool, only_metrics: bool = False,
                        eog_ids=()) -> dict:
    """llama.cpp's ``task_params::to_json`` for the settings a request ran with
    (the fields this server implements; features it lacks report their "off" value).
    ``logit_bias`` (not with ``only_metrics``) lists ``{"bias", "token"}`` as llama.cpp: the
    request's, then under ``ignore_eos`` each of ``eog_ids`` at -inf; a non-finite bias is null
    (nlohmann's JSON of it)."""
    s = req.sampling
    biases = list((s.logit_bias or {}).items())
    if req.ignore_eos:
        biases += [(t, float("-inf")) for t in sorted(eog_ids)]
    out = {
        "seed": s.seed if s.seed >= 0 else 0xFFFFFFFF,
        "temperature": s.temperature,
        "dynatemp_range": s.dynatemp_range,
        "dynatemp_exponent": s.dynatemp_exponent,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "top_n_sigma": s.top_n_sigma,
        "xtc_probability": s.xtc_probability,
        "xtc_threshold": s.xtc_threshold,
        "typical_p": s.typical_p,
        "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "dry_multiplier": s.dry_multiplier,
        "dry_base": s.dry_base,
        "dry_allowed_length": s.dry_allowed_length,
        "dry_penalty_last_n": s.dry_penalty_last_n,
        "dry_sequence_breakers": list(s.dry_sequence_breakers),
        "mirostat": s.mirostat,
        "mirostat_tau": s.mirostat_tau,
        "mirostat_eta": s.mirostat_eta,
        "stop": list(req.stop),
        "max_tokens": req.n_predict,
        "n_predict": req.n_predict,
        "n_keep": req.n_keep,
        "n_discard": req.n_discard,
        "n_indent": req.n_indent,
        "t_max_predict_ms": req.t_max_predict_ms,
        "ignore_eos": req.ignore_eos,
        "stream": stream,
        "logit_bias": [{"bias": float(b) if math.isfinite(b) else None, "token": int(t)} for t, b in biases],
        "n_probs": s.n_probs,
        "min_keep": s.min_keep,
        "samplers": sampler_names(s.samplers),
        "cache_prompt": req.cache_prompt,
        "id_slot": req.id_slot,
        "post_sampling_probs": req.post_sampling_probs,
        "grammar": s.grammar or "",
        "session_id": req.session_id,
        "overcommit": req.overcommit,
    }
    if only_metrics:
        out.pop("stop")
        out.pop("grammar")
        out.pop("logit_bias")
    return out


def completion_final_json(state: ServerState, r: gen.Result, parsed: ParsedCompletion,
                          stream: bool, index: int = 0, request: Optional[CompletionRequest] = None) -> dict:
    """llama.cpp's final ``/completion`` result (``to_json_non_oaicompat``).

    In stream mode ``content`` and ``tokens`` are empty (they went out in the
    partial events) and no ``completion_probabilities`` are repeated. ``request``: the engine
    request this result ran (its seed: ``n_cmpl``'s copies differ); default ``parsed.request``.
    """
    fin = r.finish
    n_prompt = r.n_prompt
    n_pred = r.n_predicted
    out = {
        "index": index,
        "content": "" if stream else r.content,
        "tokens": r.tokens if (parsed.options.return_tokens and not stream) else [],
        "id_slot": fin.id_slot,
        "stop": True,
        "model": state.model_name,
        "tokens_predicted": n_pred,
        "tokens_evaluated": n_prompt,
        "generation_settings": generation_settings(request or parsed.request, stream,
                                                   eog_ids=state.tokenizer.eog_ids),
        "prompt": state.tokenizer.detokenize(r.prompt_tokens, special=True),
        "has_new_line": "\n" in r.content,
        "truncated": bool(fin.truncated),
        "stop_type": fin.stop_type,
        "stopping_word": fin.stopping_word,
        # tokens left in the slot's cache: the prompt plus the generated tokens fed back (the
        # last sampled one is never evaluated), less what a context shift discarded
        "tokens_cached": fin.n_past if fin.n_past >= 0 else n_prompt + max(n_pred - 1, 0),
        "timings": gen.timings_json(fin),
    }
    if not stream and r.probs:
        out["completion_probabilities"] = r.probs
    return nested_values(parsed.options.response_fields, out) if parsed.options.response_fields else out


def nested_values(paths, obj: dict) -> dict:
    """llama.cpp's ``json_get_nested_values``: for each path ``"a/b/c"`` whose keys all lead
    through objects of ``obj``, that value under the key ``"a/b/c"``; other paths are left out."""
    out = {}
    for path in paths:
        cur, ok = obj, True
        for k in path.split("/"):
            if isinstance(cur, dict) and k in cur:
                cur = cur[k]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out


def submit_all(state: ServerState, parsed: ParsedCompletion, prompts: list[list[int]]) -> list:
    """Submit ``n_cmpl`` engine requests per prompt (prompt-major: request ``i * n_cmpl + j`` is
    prompt i's copy j); if one submit fails, cancel the others.

    Copy j > 0 of a prompt runs with seed + j when the seed is fixed (llama.cpp's child tasks of
    ``n_cmpl``). Several requests of one body share its ``session_id`` only for the first
    (a session lives in one slot; the others run as plain requests).
    """
    handles = []
    n = parsed.options.n_cmpl
    try:
        for i, p in enumerate(q for q in prompts for _ in range(n)):
            req = replace(parsed.request, prompt_tokens=list(p),
                          sampling=replace(parsed.request.sampling), stop=list(parsed.request.stop))
            if i % n and req.sampling.seed >= 0:
                req.sampling.seed = (req.sampling.seed + i % n) % 0xFFFFFFFF
            if i > 0:
                req.session_id = None
            h = gen.submit(state.engine, req, state.n_ctx_slot)
            state.track(h)
            handles.append(h)
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    return handles


def first_event(handles: list, req: Request):
    """Start a stream: wait for the requests' first event so that an immediate
    engine error still becomes a plain HTTP error (llama.cpp does the same); on any failure
    every request is cancelled.

    Returns ``(first (index, event), iterator of the rest)`` (``gen.merged_events``).
    """
    events = gen.merged_events(handles, req.is_disconnected)
    try:
        try:
            first = next(events)
        except StopIteration:
            raise HTTPError(500, "server_error", "the engine ended the request without events") from None
        if isinstance(first[1], ErrorEvent):
            raise gen.error_from_event(first[1])
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    return first, events


# ---------------------------------------------------------------------------
# llama.cpp routes


def get_health(state: ServerState, req: Request) -> Response:
    """``GET /health``: ``{"status": "ok"}`` (the loading case is answered by the server)."""
    return Response({"status": "ok"})


def get_props(state: ServerState, req: Request) -> Response:
    """``GET /props``: server and model properties (llama.cpp ``get_res_props``),
    plus opencoti's own under ``"opencoti"``: the KV layout (``kv``), the
    admission gate, and every serving feature with ``enabled`` (features not
    built yet report ``{"enabled": false}``)."""
    tok = state.tokenizer
    params = state.params
    engine = state.engine
    dummy = default_request(state)
    tmpl = state.chat_template
    engine_props: dict = {}
    if hasattr(engine, "props"):
        engine_props = dict(engine.props() or {})
    slots = list(getattr(engine, "slots", []) or [])
    pools = getattr(engine, "pools", None)
    props = {
        "default_generation_settings": {
            "id": 0,
            "id_task": -1,
            "n_ctx": state.n_ctx_slot,
            "speculative": False,
            "is_processing": False,
            "params": generation_settings(dummy, False, only_metrics=True),
        },
        "total_slots": state.n_slots,
        "model_alias": state.model_name,
        "model_path": str(getattr(state.model, "path", None) or params.model or ""),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": bool(params.endpoint_slots),
        "endpoint_props": bool(params.endpoint_props),
        "endpoint_metrics": bool(params.endpoint_metrics),
        "chat_template": getattr(tmpl, "source", "") if tmpl is not None else "",
        "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None and tok.bos_id >= 0 else "",
        "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None and tok.eos_id >= 0 else "",
        "build_info": state.build_info,
        "is_sleeping": False,
        "opencoti": {
            "version": __version__,
            "build": state.build_info,
            "backend": engine_props.pop("backend", "cpu"),
            "chat_template_name": getattr(tmpl, "name", None),
            **engine_props,
            "kv": kv_props(engine),
            "admission": {
                "poolless": params.admission_poolless,
                "headroom_cells": kv_headroom(engine),
                "refused_total": int(getattr(engine, "n_admissions_refused", 0) or 0),
            },
            "kv_reuse": {
                "enabled": True,
                "cache_prompt": True,  # the request default
                "sessions": sorted(str(x.session_id) for x in slots if getattr(x, "session_id", None) is not None),
                "cache_idle_slots": bool(params.cache_idle_slots),
            },
            "rest_kv": ({"enabled": True, "max_pools": int(getattr(engine, "max_pools", 0)),
                         **engine.call(lambda e: e.pool_gauges()).result(timeout=30)}
                        if pools is not None else {"enabled": False}),
            "context_shift": {"enabled": bool(params.ctx_shift)},
            "residency": {"enabled": False},
            "dca": {"enabled": False},
            "sparse_attn": {"enabled": False},
            "speculative": {"enabled": False},
            "repeat_layers": {"enabled": False},
        },
    }
    return Response(props)


def model_info(state: ServerState) -> dict:
    """One entry of ``/v1/models`` (llama.cpp ``get_res_model_info``)."""
    md = getattr(state.model, "metadata", {}) or {}
    hp = getattr(state.model, "hparams", None)
    path = getattr(state.model, "path", None) or state.params.model
    try:
        size = os.path.getsize(path) if path else 0
    except OSError:
        size = 0
    return {
        "id": state.model_name,
        "aliases": [state.model_name],
        "tags": [],
        "object": "model",
        "created": int(time.time()),
        "owned_by": "llamacpp",
        "meta": {
            "vocab_type": state.tokenizer.vocab_type_id,  # (llama.cpp's enum: 1 SPM, 2 BPE)
            "n_vocab": state.tokenizer.n_vocab,
            "n_ctx": state.n_ctx_slot,
            "n_ctx_train": getattr(hp, "n_ctx_train", None),
            "n_embd": getattr(hp, "n_embd", None),
            "n_params": getattr(state.model, "n_params", None),
            "size": size,
            "architecture": md.get("general.architecture"),
        },
    }


def get_models(state: ServerState, req: Request) -> Response:
    """``GET /v1/models`` and ``/models``: OpenAI's list shape (plus llama.cpp's
    Ollama-style ``models`` array)."""
    info = model_info(state)
    return Response({
        "models": [{
            "name": state.model_name,
            "model": state.model_name,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                        "parameter_size": "", "quantization_level": ""},
        }],
        "object": "list",
        "data": [info],
    })


def default_request(state: ServerState) -> CompletionRequest:
    """A request of the server's default settings (``-n``, the sampling flags; a -1
    ``repeat_last_n`` / ``dry_penalty_last_n`` as the slot's context) and no prompt: what
    ``/props`` reports as ``default_generation_settings`` and ``/slots`` for a slot that has
    served nothing yet."""
    sp = parse_sampling({}, state.params.sampling, state.n_ctx_slot)  # a request that gives no field
    return CompletionRequest(prompt_tokens=[], n_predict=state.params.n_predict, sampling=sp)


def slot_json(state: ServerState, slot: Any) -> dict:
    """One ``GET /slots`` entry (llama.cpp ``server_slot::to_json``, metrics-only
    form: no prompt text; a slot that has served nothing reports the server's default settings,
    ``n_remain`` -1) plus ``opencoti``: the session bound to the slot, its
    pool binding (PolyKV; null when it shares no pool prefix), state, and KV use.

    Read from a handler thread without locking: plain values, at worst one
    engine step stale.
    """
    handle = getattr(slot, "handle", None)
    request = getattr(handle, "request", None) if handle is not None else None
    busy = bool(getattr(slot, "busy", False)) and request is not None
    if request is None:
        request = state.last_request.get(slot.id)
    fresh = request is None  # nothing served yet: the server's defaults, as llama.cpp's slot params
    if fresh:
        request = default_request(state)
    out: dict = {
        "id": slot.id,
        "id_task": int(getattr(handle, "id_task", -1)) if busy else -1,
        "n_ctx": int(slot.n_ctx),
        "speculative": False,
        "is_processing": busy,
    }
    n_decoded = 0 if fresh else int(getattr(slot, "n_decoded", 0))  # the current request's, else the last one's
    n_predict = request.n_predict
    out["params"] = generation_settings(request, False, only_metrics=True)
    out["next_token"] = [{
        "has_next_token": busy,
        "has_new_line": busy and "\n" in (getattr(slot, "text", "") or ""),
        "n_remain": -1 if fresh or n_predict < 0 else max(n_predict - n_decoded, 0),
        "n_decoded": n_decoded,
    }]
    pool_id = getattr(slot, "pool_id", None)
    state_ = getattr(slot, "state", None)
    out["opencoti"] = {
        "session_id": getattr(slot, "session_id", None),
        "pool": ({"id": pool_id, "n_shared": int(getattr(slot, "n_shared", 0))}
                 if pool_id is not None and getattr(slot, "n_shared", 0) else None),
        "n_pool_shared": int(getattr(slot, "n_shared", 0)),
        "state": getattr(state_, "value", str(state_)),
        "n_past": int(getattr(slot, "n_past", 0)),
        "n_cached_tokens": len(getattr(slot, "cache_tokens", []) or []),
    }
    return out


def post_props(state: ServerState, req: Request) -> Response:
    """``POST /props``: with ``--props`` ``{"success": true}`` (llama.cpp's handler changes no
    property either), else 501 ``not_supported_error`` with llama.cpp's message."""
    if not state.params.endpoint_props:
        raise not_supported("This server does not support changing global properties. Start it with `--props`")
    return Response({"success": True})


def get_lora_adapters(state: ServerState, req: Request) -> Response:
    """``GET /lora-adapters``: llama.cpp's list of loaded adapters (``{id, path, scale}``); this
    server loads none, so ``[]``."""
    return Response([])


def post_lora_adapters(state: ServerState, req: Request) -> Response:
    """``POST /lora-adapters`` ``[{id, scale}, ...]`` (llama.cpp: set the adapters' scales):
    with no adapter loaded only ``[]`` is valid (``{"success": true}``); a body that is not an
    array, or names an adapter id, is 400."""
    body = req.json_value("a JSON array")
    if not isinstance(body, list):
        raise invalid_request("Request body must be an array")
    if body:
        raise invalid_request("invalid adapter id (no LoRA adapter is loaded)")
    return Response({"success": True})


def get_slots(state: ServerState, req: Request) -> Response:
    """``GET /slots`` (``--slots``, on by default; 501 with ``--no-slots``, as
    llama.cpp): one ``slot_json`` per slot. ``?fail_on_no_slot=1`` answers 503
    when every slot is busy (llama.cpp)."""
    if not state.params.endpoint_slots:
        raise not_supported("This server does not support slots endpoint. Start it with `--slots`")
    slots = [slot_json(state, s) for s in list(getattr(state.engine, "slots", []) or [])]
    if req.query.get("fail_on_no_slot") not in (None, "", "0", "false"):
        if all(s["is_processing"] for s in slots):
            raise HTTPError(503, "unavailable_error", "no slot available")
    return Response(slots)


def post_slot_action(state: ServerState, req: Request) -> Response:
    """``POST /slots/{id_slot}?action=erase``: clear the slot's KV cache and
    cached tokens (and unbind its session) -> ``{"id_slot", "n_erased"}``.

    The erase runs on the engine thread (``Engine.erase_slot``); a busy slot is
    erased as soon as its request ends (llama.cpp defers it the same way). 400
    for a bad id or action; ``save`` / ``restore`` are 501 (slot files, llama.cpp's
    ``--slot-save-path``, are not implemented).
    """
    try:
        id_slot = int(req.path_params.get("id_slot", ""))
    except ValueError:
        raise invalid_request("Invalid slot ID") from None
    action = req.query.get("action", "")
    if action in ("save", "restore"):
        raise not_supported(f"slot action {action!r} is not supported by this server (slot files are not "
                            "implemented; llama.cpp's --slot-save-path has no equivalent here)")
    if action != "erase":
        raise invalid_request('Invalid action: use ?action=erase')
    if not 0 <= id_slot < state.n_slots:
        raise invalid_request(f"Invalid slot ID {id_slot}: the server has slots 0..{state.n_slots - 1}")
    deadline = time.monotonic() + max(1, int(state.params.timeout or 600))
    while True:
        try:
            n = state.engine.erase_slot(id_slot).result(timeout=60)
            break
        except RuntimeError as e:  # busy: wait for its request to end
            if "processing" not in str(e):
                raise HTTPError(503, "unavailable_error", str(e)) from None
            if req.is_disconnected() or time.monotonic() > deadline:
                raise HTTPError(503, "unavailable_error", f"slot {id_slot} stayed busy") from None
            time.sleep(0.05)
        except ValueError as e:
            raise invalid_request(str(e)) from None
    return Response({"id_slot": id_slot, "n_erased": int(n)})


def get_metrics(state: ServerState, req: Request) -> Response:
    """``GET /metrics``: Prometheus text (``--metrics``; 501 without, as llama.cpp)."""
    if not state.params.endpoint_metrics:
        raise not_supported("This server does not support metrics endpoint. Start it with `--metrics`")
    body = metrics_mod.render(state.metrics, state.engine)
    return Response(raw=body.encode("utf-8"), content_type=metrics_mod.CONTENT_TYPE)


def post_tokenize(state: ServerState, req: Request) -> Response:
    """``POST /tokenize`` ``{content, add_special=false, parse_special=true,
    with_pieces=false}`` -> ``{"tokens": [...]}``; with pieces each entry is
    ``{id, piece}`` where a piece that is not valid UTF-8 is a list of bytes."""
    body = req.json()
    tok = state.tokenizer
    if body.get("content") is None:
        return Response({"tokens": []})
    add_special = get_bool(body, "add_special", False)
    parse_special = get_bool(body, "parse_special", True)
    with_pieces = get_bool(body, "with_pieces", False)
    ids = tokenize_mixed(tok, body["content"], add_special, parse_special, key="content")
    if not with_pieces:
        return Response({"tokens": ids})
    out = []
    for t in ids:
        b = tok.token_to_piece(t, special=True)
        try:
            piece: Any = b.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(b)
        out.append({"id": t, "piece": piece})
    return Response({"tokens": out})


def post_detokenize(state: ServerState, req: Request) -> Response:
    """``POST /detokenize`` ``{tokens}`` -> ``{"content": text}``: the pieces joined
    (special tokens rendered, llama.cpp ``tokens_to_str``)."""
    body = req.json()
    tok = state.tokenizer
    ids = body.get("tokens")
    if ids is None:
        return Response({"content": ""})
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid_request('"tokens" must be a list of integer token ids')
    for t in ids:
        if t < 0 or t >= tok.n_vocab:
            raise invalid_request(f'"tokens" contains an invalid token id {t} (vocabulary has {tok.n_vocab} tokens)')
    data = b"".join(tok.token_to_piece(t, special=True) for t in ids)
    return Response({"content": data.decode("utf-8", errors="replace")})


def post_completion(state: ServerState, req: Request) -> Union[Response, StreamResponse]:
    """``POST /completion`` (and ``/completions``): llama.cpp's native completion.

    Non-stream: one result object (an array for several prompts). Stream: one
    SSE event per generated token ``{index, content, tokens, stop: false,
    id_slot, tokens_predicted, tokens_evaluated[, completion_probabilities]}``,
    then the final result with ``stop: true``; the stream has no ``[DONE]``.
    """
    body = req.json()
    parsed = parse_completion(body, *request_defaults(state, body),
                              state.n_ctx_slot, state.n_slots, state.tokenizer)
    if "prompt" not in body or body["prompt"] is None:
        raise invalid_request('"prompt" is required')
    prompts = tokenize_prompts(state.tokenizer, body["prompt"], n_ctx=state.n_ctx_slot)
    return run_completion(state, req, parsed, prompts)


def run_completion(state: ServerState, req: Request, parsed: ParsedCompletion,
                   prompts: list[list[int]]) -> Union[Response, StreamResponse]:
    """Run ``prompts`` (token id lists) as ``/completion`` does and answer in its shapes
    (``post_completion``; ``/infill`` too). Several prompts (times ``n_cmpl``) answer an
    array, or stream their events interleaved, each with its ``index``."""
    opts = parsed.options
    handles = submit_all(state, parsed, prompts)
    want_probs = opts.n_probs > 0
    if not opts.stream:
        results = gen.collect_many(state.tokenizer, handles, req.is_disconnected,
                                   n_top=opts.n_probs, want_probs=want_probs,
                                   post_sampling=opts.post_sampling_probs)
        objs = [completion_final_json(state, r, parsed, False, i, h.request)
                for i, (r, h) in enumerate(zip(results, handles))]
        return Response(objs[0] if len(objs) == 1 else objs, headers=gen.admission_headers(handles))

    first, events = first_event(handles, req)
    collectors = [gen.Collector(state.tokenizer, h.request.prompt_tokens, opts.n_probs, want_probs,
                                opts.post_sampling_probs) for h in handles]

    def render(i: int, ev) -> Iterator[bytes]:  # i: the completion (prompt-major, n_cmpl's copies)
        handle, collector = handles[i], collectors[i]
        n_prompt = len(handle.request.prompt_tokens)
        if isinstance(ev, ProgressEvent):  # llama.cpp: a partial without content, and prompt_progress
            yield sse_event({"index": i, "content": "", "tokens": [], "stop": False,
                             "id_slot": getattr(handle, "id_slot", -1), "tokens_predicted": 0,
                             "tokens_evaluated": n_prompt, "prompt_progress": ev.to_json()})
            return
        if isinstance(ev, TokenEvent):
            entry = collector.add(ev)
            partial = {
                "index": i,
                "content": ev.text,
                "tokens": [ev.token],
                "stop": False,
                "id_slot": getattr(handle, "id_slot", -1),
                "tokens_predicted": len(collector.result.tokens),
                "tokens_evaluated": n_prompt,
            }
            if entry is not None:
                partial["completion_probabilities"] = [entry]
            if ev.timings is not None:
                partial["timings"] = ev.timings
            yield sse_event(partial)
        else:  # FinishEvent
            collector.add(ev)
            if ev.text:  # text held back for a possible stop string, released at the end
                yield sse_event({"index": i, "content": ev.text, "tokens": [], "stop": False,
                                 "id_slot": ev.id_slot, "tokens_predicted": ev.n_predicted,
                                 "tokens_evaluated": n_prompt})
            yield sse_event(completion_final_json(state, collector.result, parsed, True, i, handle.request))

    return StreamResponse(gen.sse_events(handles, chain([first], events), render),
                          headers=gen.admission_headers(handles))


def post_embeddings(state: ServerState, req: Request) -> Response:
    """``POST /embedding(s)``, ``/v1/embeddings``: 501 ``not_supported_error``, as llama.cpp
    answers a server started without ``--embeddings`` (opencoti has no embeddings mode)."""
    raise not_supported("This server does not support embeddings (opencoti has no `--embeddings` mode)")


def post_rerank(state: ServerState, req: Request) -> Response:
    """``POST /rerank`` (and llama.cpp's aliases): 501 ``not_supported_error``, as llama.cpp
    answers a server started without ``--reranking`` (opencoti has no reranking mode)."""
    raise not_supported("This server does not support reranking (opencoti has no `--reranking` mode)")


def build_router() -> Router:
    """The full route table: llama.cpp routes plus the OpenAI-compatible ones."""
    from opencoti.http import infill, oai, polykv_routes

    r = Router()
    r.add("GET", ["/health", "/v1/health"], get_health)
    r.add("GET", "/props", get_props)
    r.add("POST", "/props", post_props)
    r.add("GET", "/lora-adapters", get_lora_adapters)
    r.add("POST", "/lora-adapters", post_lora_adapters)
    r.add("GET", ["/models", "/v1/models"], get_models)
    r.add("GET", "/slots", get_slots)
    r.add("POST", "/slots/{id_slot}", post_slot_action)
    r.add("GET", "/metrics", get_metrics)
    r.add("POST", ["/completion", "/completions"], post_completion)
    r.add("POST", "/infill", infill.post_infill)
    r.add("POST", ["/embedding", "/embeddings", "/v1/embeddings"], post_embeddings)
    r.add("POST", ["/rerank", "/reranking", "/v1/rerank", "/v1/reranking"], post_rerank)
    r.add("POST", "/tokenize", post_tokenize)
    r.add("POST", "/detokenize", post_detokenize)
    r.add("POST", "/apply-template", oai.post_apply_template)
    r.add("POST", ["/v1/chat/completions", "/chat/completions"], oai.post_chat_completions)
    r.add("POST", "/v1/completions", oai.post_completions_oai)
    polykv_routes.register(r)
    return r

# Routes that never need the API key (llama.cpp's public endpoints).
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models"})
