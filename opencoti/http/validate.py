"""Strict parsing of request bodies: typed field getters, prompt tokenization and
the llama.cpp ``/completion`` parameter set.

Every getter raises ``HTTPError`` 400 (``invalid_request_error``) with a message
naming the field when the value has the wrong JSON type or is out of range. A
JSON ``null`` counts as "not given" (OpenAI clients send explicit nulls).

Field names, aliases and defaults follow llama.cpp's
``tools/server/server-task.cpp`` (``params_from_json_cmpl``) and
``server-common.cpp`` (``tokenize_mixed``, ``tokenize_input_prompts``); unlike
llama.cpp, which silently falls back to the default on a type mismatch, we
reject it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from opencoti.engine.api import CHAIN_NAMES, INT32_MAX, CompletionRequest, SamplingParams, sampling_error
from opencoti.engine.dry import sampler_breakers
from opencoti.http.errors import exceed_context, invalid_request

log = logging.getLogger("opencoti.http")

# llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed".
DEFAULT_SEED = 0xFFFFFFFF


def _is_int(v: Any) -> bool:
    # bool is an int subclass in Python but not an integer in JSON.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A finite JSON number (an integer too large for a float is not: it would overflow)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def require_object(body: Any, what: str = "request body") -> dict:
    """Return ``body`` if it is a JSON object, else raise 400."""
    if not isinstance(body, dict):
        raise invalid_request(f"{what} must be a JSON object")
    return body


def get_bool(body: dict, key: str, default: bool) -> bool:
    """``body[key]`` as a bool (JSON true/false); ``default`` when absent or null."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid_request(f'"{key}" must be a boolean')
    return v


def get_int(
    body: dict,
    key: str,
    default: Optional[int],
    min: Optional[int] = None,
    max: Optional[int] = None,
) -> Optional[int]:
    """``body[key]`` as an int; integral floats (``32.0``) are accepted.

    Raises 400 for other types or a value outside ``[min, max]`` (by default llama.cpp's int32
    range: its fields are int32, and a value past it is refused, not carried into the engine).
    """
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and not isinstance(v, bool) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise invalid_request(f'"{key}" must be an integer')
    min = -INT32_MAX - 1 if min is None else min
    max = INT32_MAX if max is None else max
    if v < min:
        raise invalid_request(f'"{key}" must be >= {min}')
    if v > max:
        raise invalid_request(f'"{key}" must be <= {max}')
    return v


def get_number(
    body: dict,
    key: str,
    default: Optional[float],
    min: Optional[float] = None,
    max: Optional[float] = None,
) -> Optional[float]:
    """``body[key]`` as a finite float (JSON number); 400 otherwise or out of ``[min, max]``."""
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v):
        raise invalid_request(f'"{key}" must be a number')
    v = float(v)
    if min is not None and v < min:
        raise invalid_request(f'"{key}" must be >= {min}')
    if max is not None and v > max:
        raise invalid_request(f'"{key}" must be <= {max}')
    return v


def get_str(body: dict, key: str, default: Optional[str]) -> Optional[str]:
    """``body[key]`` as a string; 400 for other types."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid_request(f'"{key}" must be a string')
    return v


def get_stop(body: dict, key: str = "stop", default: Sequence[str] = ()) -> list[str]:
    """Stop strings: a string or a list of strings; empty strings are dropped
    (as llama.cpp does). Absent/null/empty -> ``default``."""
    v = body.get(key)
    if v is None:
        return list(default)
    if isinstance(v, str):
        words = [v]
    elif isinstance(v, list) and all(isinstance(w, str) for w in v):
        words = list(v)
    else:
        raise invalid_request(f'"{key}" must be a string or a list of strings')
    words = [w for w in words if w]
    return words if words else list(default)


# ---------------------------------------------------------------------------
# prompts


def _check_ids(ids: list[int], n_vocab: int, key: str) -> list[int]:
    for t in ids:
        if t < 0 or t >= n_vocab:
            raise invalid_request(f'"{key}" contains an invalid token id {t} (vocabulary has {n_vocab} tokens)')
    return ids


def check_text_fits(tokenizer, text: str, n_ctx: Optional[int]) -> None:
    """Before tokenizing ``text``: 400 ``exceed_context_size_error`` when it cannot fit
    ``n_ctx`` tokens whatever its tokens are (more characters than ``n_ctx`` tokens cover,
    ``Tokenizer.max_piece_chars``), so a huge prompt is refused at once, not after tokenizing
    it; its ``n_prompt_tokens`` is then a lower bound. None: no check."""
    if n_ctx is not None:
        at_least = len(text) // tokenizer.max_piece_chars()
        if at_least >= n_ctx:
            raise exceed_context(at_least, n_ctx, at_least=True)


def _tokenize(tokenizer, text: str, add_special: bool, parse_special: bool, key: str,
              n_ctx: Optional[int] = None) -> list[int]:
    check_text_fits(tokenizer, text, n_ctx)
    try:
        return tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)
    except ValueError as e:  # e.g. a lone surrogate (UnicodeEncodeError) in the JSON string
        raise invalid_request(f'"{key}" could not be tokenized: {e}') from None


def tokenize_mixed(tokenizer, value: Any, add_special: bool, parse_special: bool, key: str = "prompt",
                   n_ctx: Optional[int] = None) -> list[int]:
    """Tokenize a string, or a list mixing strings and token ids, into one id list.

    Only the first element of a list gets ``add_special`` (BOS); ids are copied
    as they are. Source: llama.cpp ``server-common.cpp`` ``tokenize_mixed``.
    Raises 400 for any other element type or an id outside the vocabulary; with ``n_ctx``,
    400 ``exceed_context_size_error`` for a string too long to fit it (``check_text_fits``).
    """
    if isinstance(value, str):
        return _tokenize(tokenizer, value, add_special, parse_special, key, n_ctx)
    if not isinstance(value, list):
        raise invalid_request(f'"{key}" must be a string or a list of strings and token ids')
    out: list[int] = []
    first = True
    for el in value:
        if isinstance(el, str):
            out.extend(_tokenize(tokenizer, el, add_special and first, parse_special, key, n_ctx))
        elif _is_int(el):
            out.append(el)
        else:
            raise invalid_request(f'"{key}" elements must be strings or integer token ids')
        first = False
    return _check_ids(out, tokenizer.n_vocab, key)


def _prompt_object(tokenizer, obj: dict, key: str, n_ctx: Optional[int] = None) -> list[int]:
    """A ``{"prompt_string": str, "multimodal_data": [...]}`` prompt (llama.cpp
    ``tokenize_input_subprompt``): its string tokenized as a text prompt. 400 when
    ``prompt_string`` is not a string, or with ``multimodal_data`` (this server loads no
    multimodal projector)."""
    text = obj.get("prompt_string")
    if not isinstance(text, str):
        raise invalid_request(f'a "{key}" object needs a "prompt_string" string')
    if obj.get("multimodal_data"):
        raise invalid_request("multimodal_data is not supported: this server has no multimodal projector (mmproj)")
    return tokenize_mixed(tokenizer, text, True, True, key, n_ctx)


def tokenize_prompts(tokenizer, prompt: Any, key: str = "prompt", n_ctx: Optional[int] = None) -> list[list[int]]:
    """Turn a ``prompt`` field into one token list per prompt.

    Accepted shapes (llama.cpp ``tokenize_input_prompts``):
    ``"text"``; ``[12, 34]`` (token ids); ``[12, "text", 34]`` (mixed, one prompt);
    ``["a", "b"]`` or ``["a", [1, 2]]`` (several prompts); ``{"prompt_string": "text"}``, alone
    or as an element (``_prompt_object``). Strings are tokenized
    with BOS (when the model adds one) and with special tokens parsed.
    Raises 400 for an empty list, an empty token list, or other shapes; with ``n_ctx`` (a
    slot's context), 400 ``exceed_context_size_error`` before tokenizing a string that cannot
    fit it.
    """
    if prompt is None:
        raise invalid_request(f'"{key}" is required')
    if isinstance(prompt, str):
        prompts = [tokenize_mixed(tokenizer, prompt, True, True, key, n_ctx)]
    elif isinstance(prompt, dict):
        prompts = [_prompt_object(tokenizer, prompt, key, n_ctx)]
    elif isinstance(prompt, list):
        if not prompt:
            raise invalid_request(f'"{key}" must not be empty')
        if any(_is_int(e) for e in prompt):
            prompts = [tokenize_mixed(tokenizer, prompt, True, True, key, n_ctx)]
        else:
            prompts = []
            for sub in prompt:
                if isinstance(sub, dict):
                    prompts.append(_prompt_object(tokenizer, sub, key, n_ctx))
                    continue
                if not isinstance(sub, (str, list)):
                    raise invalid_request(
                        f'"{key}" elements must be a string, a list of token ids, a list of mixed strings and '
                        'ids, or a {"prompt_string": ...} object'
                    )
                prompts.append(tokenize_mixed(tokenizer, sub, True, True, key, n_ctx))
    else:
        raise invalid_request(f'"{key}" must be a string, a list of token ids, or a list of prompts')
    for ids in prompts:
        if not ids:
            raise invalid_request(f'"{key}" tokenizes to no tokens; the model needs at least one input token')
    return prompts


# ---------------------------------------------------------------------------
# completion parameters


@dataclass
class ResponseOptions:
    """How to shape the response (not needed by the engine).

    stream: answer as server-sent events.
    n_probs: top-n log-probabilities to report per token (0 = none).
    return_tokens: include generated token ids in ``tokens`` (non-stream).
    include_usage: OpenAI ``stream_options.include_usage``.
    want_logprobs: OpenAI ``logprobs`` flag (chat): report the chosen token's
    log-probability even when ``n_probs`` is 0.
    post_sampling_probs: report ``prob`` / ``top_probs`` (probabilities after the
    sampler chain) instead of ``logprob`` / ``top_logprobs`` (llama.cpp).
    response_fields: llama.cpp's ``response_fields``: the final ``/completion`` result
    keeps only these paths (``"a/b"``: key ``b`` of object ``a``, answered under the key
    ``"a/b"``); empty: the whole result.
    n_cmpl: completions per prompt (OpenAI ``n``, llama.cpp ``n_cmpl``); copy j > 0 runs with
    seed + j when the seed is fixed (llama.cpp's child tasks); streamed, their chunks interleave
    (``generate.merged_events``), each with its index.
    """

    stream: bool = False
    n_probs: int = 0
    return_tokens: bool = False
    include_usage: bool = False
    want_logprobs: bool = False
    post_sampling_probs: bool = False
    response_fields: tuple = ()
    n_cmpl: int = 1


@dataclass
class ParsedCompletion:
    """A validated completion body: the engine request template (prompt still
    empty) and the response options."""

    request: CompletionRequest
    options: ResponseOptions
    extra: dict = field(default_factory=dict)


def parse_sampling(body: dict, defaults: SamplingParams, n_ctx_slot: int, tokenizer=None) -> SamplingParams:
    """Read the sampler fields of a request over the server's defaults.

    Fields (llama.cpp names): temperature, top_k, top_p, min_p, typical_p,
    repeat_penalty, repeat_last_n (-1 = the slot's context), presence_penalty,
    frequency_penalty, seed (-1 or 0xFFFFFFFF = random; an int64 wraps to 32 bits, as llama.cpp's
    uint32), n_probs, top_n_sigma
    (<= 0 = off), xtc_probability, xtc_threshold, dynatemp_range, dynatemp_exponent,
    mirostat (0, 1, 2), mirostat_tau, mirostat_eta, min_keep, dry_multiplier, dry_base (< 1:
    the default, as llama.cpp), dry_allowed_length, dry_penalty_last_n (-1 = the slot's
    context), dry_sequence_breakers (a non-empty list of strings), samplers (the chain's
    order, see ``parse_samplers``), logit_bias (``tokenizer``: text keys allowed, see
    ``parse_logit_bias``). Raises 400 on a wrong type or out-of-range value.
    """
    sp = replace(defaults)
    sp.temperature = get_number(body, "temperature", sp.temperature)
    sp.top_k = get_int(body, "top_k", sp.top_k)
    sp.top_p = get_number(body, "top_p", sp.top_p)
    sp.min_p = get_number(body, "min_p", sp.min_p)
    sp.typical_p = get_number(body, "typical_p", sp.typical_p)
    sp.repeat_penalty = get_number(body, "repeat_penalty", sp.repeat_penalty, min=0.0)
    sp.repeat_last_n = get_int(body, "repeat_last_n", sp.repeat_last_n, min=-1)
    if sp.repeat_last_n == -1:
        sp.repeat_last_n = n_ctx_slot
    sp.presence_penalty = get_number(body, "presence_penalty", sp.presence_penalty)
    sp.frequency_penalty = get_number(body, "frequency_penalty", sp.frequency_penalty)
    # llama.cpp reads the seed as a uint32 (any other int wraps; OpenAI clients send int64s)
    seed = get_int(body, "seed", sp.seed, min=-(2 ** 63), max=2 ** 64 - 1)
    seed = seed if seed == -1 else seed % (DEFAULT_SEED + 1)
    sp.seed = -1 if seed == DEFAULT_SEED else seed
    sp.n_probs = get_int(body, "n_probs", sp.n_probs, min=0)
    if tokenizer is not None:  # llama.cpp reports at most the vocabulary
        sp.n_probs = min(sp.n_probs, tokenizer.n_vocab)
    sp.logit_bias = parse_logit_bias(body.get("logit_bias"), tokenizer)
    sp.top_n_sigma = get_number(body, "top_n_sigma", sp.top_n_sigma)
    for name in ("xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent", "mirostat_tau",
                 "mirostat_eta"):
        setattr(sp, name, get_number(body, name, getattr(sp, name)))
    sp.mirostat = get_int(body, "mirostat", sp.mirostat, min=0, max=2)
    sp.min_keep = get_int(body, "min_keep", sp.min_keep, min=0)
    sp.dry_multiplier = get_number(body, "dry_multiplier", sp.dry_multiplier)
    sp.dry_base = get_number(body, "dry_base", sp.dry_base)
    if sp.dry_base < 1.0:  # llama.cpp params_from_json_cmpl: back to the server's default
        sp.dry_base = defaults.dry_base
    sp.dry_allowed_length = get_int(body, "dry_allowed_length", sp.dry_allowed_length)
    sp.dry_penalty_last_n = get_int(body, "dry_penalty_last_n", sp.dry_penalty_last_n, min=-1)
    if sp.dry_penalty_last_n == -1:
        sp.dry_penalty_last_n = n_ctx_slot
    if body.get("dry_sequence_breakers") is not None:
        breakers = body["dry_sequence_breakers"]
        if not (isinstance(breakers, list) and breakers and all(isinstance(b, str) for b in breakers)):
            raise invalid_request('"dry_sequence_breakers" must be a non-empty array of strings')
        sp.dry_sequence_breakers = tuple(breakers)
    check_samplers_field(body)
    if body.get("samplers") is not None:
        sp.samplers = parse_samplers(body["samplers"])
    err = sampling_error(sp)
    if err:
        raise invalid_request(err)
    if tokenizer is not None:
        # DRY's breakers as token sequences, made here on the request's thread (the engine's
        # Sampler then finds them cached): a new list scans the vocabulary, and the engine
        # thread, which serves every session, should not
        sampler_breakers(tokenizer, sp)
    return sp


def check_samplers_field(body: dict) -> None:
    """400 unless ``samplers`` is absent, a string, or a list of strings."""
    samplers = body.get("samplers")
    if samplers is not None and (not isinstance(samplers, (list, str)) or
                                 (isinstance(samplers, list) and not all(isinstance(x, str) for x in samplers))):
        raise invalid_request('"samplers" must be a list of sampler names')


# llama.cpp ``common_sampler_type_to_chr``: the one-letter form of ``samplers``
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
# samplers llama.cpp knows that this engine does not have: asking for one is a 400
UNSUPPORTED_CHAIN = ("infill", "adaptive_p")


def _sampler_name_map() -> dict:
    """Every name llama.cpp's ``common_sampler_types_from_names`` (common/sampling.cpp,
    current master) matches, lower case, to its canonical name: the canonical names,
    their kebab-case (``top-k``) and no-underscore (``topk``) forms, and ``nucleus``,
    ``temp``, ``typ``."""
    out = {}
    for name in CHAIN_NAMES + UNSUPPORTED_CHAIN:
        if "_" in name:
            out[name.replace("_", "-")] = name
            out[name.replace("_", "")] = name
    out.update(nucleus="top_p", temp="temperature", typ="typ_p")
    out.update({n: n for n in CHAIN_NAMES + UNSUPPORTED_CHAIN})
    return out


SAMPLER_NAMES = _sampler_name_map()


def parse_samplers(value) -> tuple:
    """The ``samplers`` request field as the chain to run (tuple of ``CHAIN_NAMES``):
    a list of names, or a string of letters (``SAMPLER_CHARS``), as llama.cpp's
    ``common_sampler_types_from_names`` / ``common_sampler_types_from_chars``: names
    match case-insensitively, with their aliases (``SAMPLER_NAMES``: ``Top-K``,
    ``topk``, ``temp``, ``nucleus`` ...); a name or letter it does not know is dropped
    with a WARN in the server log (the request runs without it). 400 for a wrong type,
    or for ``infill`` / ``adaptive_p`` (known to llama.cpp, not here)."""
    if isinstance(value, str):
        items, what = [SAMPLER_CHARS.get(c, c) for c in value], "char"
        unknown = [c for c in value if c not in SAMPLER_CHARS]
    elif isinstance(value, list) and all(isinstance(x, str) for x in value):
        items, what = [SAMPLER_NAMES.get(x.lower(), x.lower()) for x in value], "name"
        unknown = [x.lower() for x in value if x.lower() not in SAMPLER_NAMES]
    else:
        raise invalid_request('"samplers" must be a list of sampler names or a string of sampler letters')
    for u in unknown:
        log.warning("samplers: unable to match sampler by %s %r; it is left out of the chain", what, u)
    bad = [x for x in items if x in UNSUPPORTED_CHAIN]
    if bad:
        raise invalid_request(f'sampler "{bad[0]}" in "samplers" is not supported by this server '
                              f"(chain samplers: {', '.join(CHAIN_NAMES)})")
    return tuple(x for x in items if x in CHAIN_NAMES)


def parse_logit_bias(value, tokenizer=None) -> dict:
    """``logit_bias`` as llama.cpp / OpenAI send it: ``[[id, bias], …]`` or
    ``{"id": bias}``; bias ``false`` bans the token (-inf). A key that is text, not a
    token id, applies the bias to each of its tokens (as llama.cpp's server: tokenized
    without special tokens; 400 without a ``tokenizer``). Returns ``{id: bias}``."""
    if value is None:
        return {}
    pairs = value.items() if isinstance(value, dict) else value
    if not isinstance(value, (dict, list)):
        raise invalid_request('"logit_bias" must be an object or a list of [token, bias] pairs')
    out: dict = {}
    for item in pairs:
        if isinstance(value, list):
            if not isinstance(item, list) or len(item) != 2:
                raise invalid_request('"logit_bias" list items must be [token, bias] pairs')
        tok, bias = item
        if isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
            tok = int(tok)
        if bias is False:
            bias = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise invalid_request('"logit_bias" values must be numbers or false')
        if isinstance(tok, str) and tok and tokenizer is not None:
            for t in tokenizer.tokenize(tok, add_special=False):
                out[int(t)] = float(bias)
            continue
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise invalid_request('"logit_bias" keys must be token ids or text')
        if tok < 0 or tok > (tokenizer.n_vocab - 1 if tokenizer is not None else INT32_MAX):
            continue  # llama.cpp drops an id outside the vocabulary
        out[tok] = float(bias)
    return out


def _session_id(body: dict) -> Optional[str]:
    """``session_id``: a non-empty string (an empty one would bind a session named "")."""
    sid = get_str(body, "session_id", None)
    if sid == "":
        raise invalid_request('"session_id" must not be empty')
    return sid


def parse_n_predict(body: dict, default: int) -> int:
    """``n_predict`` over ``max_completion_tokens`` over ``max_tokens`` (llama.cpp's
    precedence); -1 = until end-of-generation (or the context is full), -2 = until
    the context is full, 0 = evaluate the prompt only."""
    n = get_int(body, "max_tokens", default, min=-2)
    n = get_int(body, "max_completion_tokens", n, min=-2)
    return get_int(body, "n_predict", n, min=-2)


def parse_completion(
    body: dict,
    sampling_defaults: SamplingParams,
    n_predict_default: int,
    n_ctx_slot: int,
    n_slots: int,
    tokenizer=None,
) -> ParsedCompletion:
    """Validate the llama.cpp ``/completion`` fields of ``body`` (not the prompt).

    Besides the sampler fields: ``n_predict`` (``max_tokens``), ``stop``,
    ``cache_prompt``, ``id_slot``, ``ignore_eos``, ``n_keep``, ``n_discard``,
    ``session_id`` (string: bind to the slot holding this session's KV),
    ``overcommit`` (bool: bypass the KV admission gate), ``post_sampling_probs``,
    ``timings_per_token`` (each streamed chunk carries the timings so far),
    ``return_progress`` (a streamed chunk with ``prompt_progress`` after each prompt ubatch),
    ``n_indent``, ``t_max_predict_ms`` (see ``CompletionRequest``), ``lora`` (only ``[]``:
    no adapter is loaded),
    and constrained output: ``grammar`` (GBNF), ``json_schema``, or OpenAI
    ``response_format`` (``json_object`` / ``json_schema``), compiled here so a
    bad one is a 400 before anything runs (``opencoti.engine.json_schema``).

    Returns the engine request template (``prompt_tokens`` empty) and the
    response options. Raises 400 for wrong types or values, and for features
    this server does not offer instead of silently ignoring them. ``n_cmpl`` (or
    OpenAI's ``n``): completions per prompt, at most the server's slots.
    Unknown fields are ignored.
    """
    require_object(body)
    sampling = parse_sampling(body, sampling_defaults, n_ctx_slot, tokenizer)
    sampling.grammar = parse_grammar(body)
    key = "n_cmpl" if body.get("n_cmpl") is not None else "n"
    n_cmpl = get_int(body, key, 1, min=1)
    if n_cmpl > n_slots:
        raise invalid_request(f'"{key}" must be <= {n_slots} (completions per prompt run side by side, '
                              f"one slot each; the server has {n_slots})")
    id_slot = get_int(body, "id_slot", -1, min=-1)
    if id_slot >= n_slots:
        raise invalid_request(f'"id_slot" must be < {n_slots} (the server has {n_slots} slots)')
    req = CompletionRequest(
        prompt_tokens=[],
        n_predict=parse_n_predict(body, n_predict_default),
        sampling=sampling,
        stop=get_stop(body),
        cache_prompt=get_bool(body, "cache_prompt", True),
        id_slot=id_slot,
        ignore_eos=get_bool(body, "ignore_eos", False),
        n_keep=get_int(body, "n_keep", 0, min=-1),
        n_discard=get_int(body, "n_discard", 0, min=0),
        session_id=_session_id(body),
        overcommit=get_bool(body, "overcommit", False),
        pool_id=get_int(body, "pool_id", None, min=0),
        shared_pool_slot=get_int(body, "shared_pool_slot", -1, min=-1),
        shared_prefix_n_tokens=get_int(body, "shared_prefix_n_tokens", 0, min=0),
        post_sampling_probs=get_bool(body, "post_sampling_probs", False),
        timings_per_token=get_bool(body, "timings_per_token", False),
        return_progress=get_bool(body, "return_progress", False),
        n_indent=get_int(body, "n_indent", 0),
        t_max_predict_ms=get_int(body, "t_max_predict_ms", 0),
    )
    lora = body.get("lora")
    if lora is not None:
        if not isinstance(lora, list):
            raise invalid_request('"lora" must be a list of {"id", "scale"} objects')
        if lora:  # llama.cpp parse_lora_request: an id outside the loaded adapters
            raise invalid_request("invalid adapter id (no LoRA adapter is loaded)")
    stream_opts = body.get("stream_options")
    if stream_opts is not None and not isinstance(stream_opts, dict):
        raise invalid_request('"stream_options" must be an object')
    opts = ResponseOptions(
        stream=get_bool(body, "stream", False),
        n_probs=sampling.n_probs,
        return_tokens=get_bool(body, "return_tokens", False),
        include_usage=get_bool(stream_opts or {}, "include_usage", False),
        post_sampling_probs=req.post_sampling_probs,
        response_fields=_response_fields(body),
        n_cmpl=n_cmpl,
    )
    req.return_progress = req.return_progress and opts.stream  # progress rides on stream chunks only
    return ParsedCompletion(req, opts)


def _response_fields(body: dict) -> tuple:
    """``response_fields``: a list of strings (llama.cpp ``json_value(data, "response_fields",
    std::vector<std::string>())``); 400 for another type."""
    v = body.get("response_fields")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise invalid_request('"response_fields" must be a list of strings')
    return tuple(v)


def parse_grammar(body: dict) -> Optional[str]:
    """The GBNF grammar a body asks for (``grammar``, ``json_schema`` or
    ``response_format``), compiled once to prove it is valid; None when
    unconstrained. Raises 400 when it is malformed or does not compile, so a
    constrained request never runs unconstrained."""
    from opencoti.engine.grammar import GrammarError
    from opencoti.engine.json_schema import grammar_from_request

    try:
        return grammar_from_request(body)
    except GrammarError as e:
        msg = str(e)
        if not msg.startswith(('"', "either", "response_format")):  # a field-shape message stays as is
            msg = f"failed to parse grammar: {msg}"
        raise invalid_request(msg) from None
    except RecursionError:
        raise invalid_request("failed to parse grammar: nested too deeply") from None
