"""``POST /infill``: fill-in-the-middle completion (llama.cpp's code-infill endpoint).

The prompt is laid out as llama.cpp's ``format_prompt_infill`` (``server-common.cpp``) does,
the repo-level FIM pattern of Qwen2.5-Coder (arXiv:2409.12186)::

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n chunk0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

``[FIM_REP]`` / ``[FIM_SEP]`` only where the vocabulary has them (without ``[FIM_SEP]`` a
chunk follows a plain-text "--- snippet ---" separator). The prefix keeps its last
``3 n_batch / 4`` tokens, the suffix its first ``n_batch / 4 - 2 - len(prompt)``, and the
extra chunks their last ``n_ctx - n_batch - 2 n_predict`` tokens, before BOS (where the model
adds one). The request then runs as ``/completion`` with every one of its fields.
"""

from __future__ import annotations

from typing import Any

from opencoti.http.errors import invalid_request, not_supported
from opencoti.http.validate import parse_completion, require_object, tokenize_mixed

_SNIPPET_SEP = "\n\n--- snippet ---\n\n"  # llama.cpp's chunk separator without [FIM_SEP]


def _text(tokenizer, text: str) -> list[int]:
    """``text`` as tokens: no BOS, special-token text not parsed (llama.cpp ``common_tokenize``
    with add_special and parse_special false)."""
    return tokenizer.tokenize(text, add_special=False, parse_special=False)


def check_fim_tokens(tokenizer) -> None:
    """501 ``not_supported_error`` when the vocabulary lacks a FIM prefix, suffix or middle
    token (llama.cpp's message, checked before the body is read)."""
    missing = "".join(f"{what} token is missing. " for what, tid in (
        ("prefix", tokenizer.fim_pre_id), ("suffix", tokenizer.fim_suf_id), ("middle", tokenizer.fim_mid_id))
        if tid is None)
    if missing:
        raise not_supported(f"Infill is not supported by this model: {missing}")


def check_infill_request(tokenizer, body: Any) -> None:
    """400 unless ``body`` is an object with ``input_prefix`` and ``input_suffix`` (strings or
    lists of strings and token ids), ``prompt`` (optional) a string, and ``input_extra``
    (optional) a list of ``{"text": str, "filename": str (optional)}`` (llama.cpp's
    messages)."""
    require_object(body)
    if body.get("prompt") is not None and not isinstance(body["prompt"], str):
        raise invalid_request('"prompt" must be a string')
    for key in ("input_prefix", "input_suffix"):
        if key not in body or body[key] is None:
            raise invalid_request(f'"{key}" is required')
    extra = body.get("input_extra")
    if extra is not None and not isinstance(extra, list):
        raise invalid_request('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra or []:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid_request('extra_context chunk must contain a "text" field with a string value')
        if chunk.get("filename") is not None and not isinstance(chunk["filename"], str):
            raise invalid_request('extra_context chunk\'s "filename" field must be a string')


def infill_prompt(tokenizer, body: dict, n_batch: int, n_predict: int, n_ctx: int,
                  spm: bool = False) -> list[int]:
    """The token ids of an infill request (the module's layout) from a body that passed
    ``check_infill_request``. ``n_batch``: the server's logical batch (-b); ``n_predict``: its
    default generation length (-1 counts as in llama.cpp: ``n_ctx - n_batch + 2`` extra
    tokens); ``n_ctx``: a slot's context; ``spm``: suffix first (``--spm-infill``). Raises 400
    for a prefix or suffix of another shape or an id outside the vocabulary."""
    prefix = tokenize_mixed(tokenizer, body["input_prefix"], False, False, "input_prefix")
    suffix = tokenize_mixed(tokenizer, body["input_suffix"], False, False, "input_suffix")
    prompt = tokenizer.tokenize(body.get("prompt") or "", add_special=False, parse_special=True)
    extra: list[int] = []
    if tokenizer.fim_rep_id is not None:
        extra += [tokenizer.fim_rep_id] + _text(tokenizer, "myproject\n")
    for chunk in body.get("input_extra") or []:
        if tokenizer.fim_sep_id is not None:
            extra += [tokenizer.fim_sep_id] + _text(tokenizer, (chunk.get("filename") or "tmp") + "\n")
        else:
            extra += _text(tokenizer, _SNIPPET_SEP)
        extra += _text(tokenizer, chunk["text"])
    if tokenizer.fim_sep_id is not None:
        extra += [tokenizer.fim_sep_id] + _text(tokenizer, "filename\n")
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    pre = [tokenizer.fim_pre_id] + prefix[len(prefix) - n_prefix:] + prompt
    suf = [tokenizer.fim_suf_id] + suffix[:n_suffix]
    first, last = (suf, pre) if spm else (pre, suf)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    return extra[len(extra) - n_extra:] + bos + first + last + [tokenizer.fim_mid_id]


def post_infill(state, req):
    """``POST /infill``: llama.cpp's fill-in-the-middle completion. Fields: ``input_prefix``,
    ``input_suffix`` (required), ``input_extra``, ``prompt`` (text after the prefix), and every
    ``/completion`` field; answers as ``/completion`` (stream or not). 501 when the model has no
    FIM tokens, 400 for a malformed body."""
    from opencoti.http.polykv_routes import request_defaults
    from opencoti.http.routes import run_completion

    check_fim_tokens(state.tokenizer)
    body = req.json()
    check_infill_request(state.tokenizer, body)
    parsed = parse_completion(body, *request_defaults(state, body), state.n_ctx_slot, state.n_slots,
                              state.tokenizer)
    p = state.params
    tokens = infill_prompt(state.tokenizer, body, p.n_batch, p.n_predict, state.n_ctx_slot, p.spm_infill)
    return run_completion(state, req, parsed, [tokens])
