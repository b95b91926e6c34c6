"""Chat templates: turn an OpenAI-style message list into the prompt text a model expects.

A GGUF carries its template as Jinja source under ``tokenizer.chat_template``
(the same text as the Hugging Face ``tokenizer_config.json`` ``chat_template``).
We render it the way transformers does (``transformers/utils/chat_template_utils.py``,
``_cached_compile_jinja_template`` and ``render_jinja_template``), because that is
the renderer the templates are written and tested against:

- ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks``,
  ``lstrip_blocks`` and the ``loopcontrols`` extension (``{% break %}``,
  ``{% continue %}``);
- globals ``raise_exception(msg)``, ``strftime_now(fmt)``, ``dict`` and a
  ``namespace`` that refuses underscore names; a ``tojson`` filter that does not
  HTML-escape and takes ``ensure_ascii`` / ``indent`` / ``separators`` / ``sort_keys``;
- render variables ``messages``, ``tools`` (``None`` when absent), ``documents``
  (``None``), ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any
  extra context (e.g. ``enable_thinking``);
- messages are copied, keys whose value is ``None`` are dropped, and a message's
  reasoning (``reasoning_content`` / ``thinking`` / ``reasoning``) is visible under
  both ``reasoning_content`` and ``thinking``.

Two things follow llama.cpp instead (``common/chat.cpp``):

- a content given as a list of parts (``[{"type": "text", "text": ...}, ...]``)
  is flattened to one string, text parts joined with ``"\\n"``
  (``common_chat_msg::to_json_oaicompat(concat_typed_text=true)``); other part
  types (images, audio) are refused, since no multimodal projector is loaded;
- ``render_prompt(..., add_bos=True)`` removes a leading BOS text (and with
  ``add_eos`` a trailing EOS text) because the tokenizer adds those tokens itself
  (``common_chat_template_direct_apply``).

When a GGUF has no template, a built-in one stands in, chosen by
``general.architecture``: ``gemma`` (Gemma turns; a system message is merged into
the first user turn, as the Gemma-3 template and llama.cpp's built-in ``gemma``
do), ``chatml`` (Qwen and the fallback) and ``llama3`` (Llama-3 headers).
The built-ins are Jinja sources rendered by the same machinery; for a valid
conversation they produce exactly what the model's official template produces
and, after ``render_prompt``'s BOS removal, what llama.cpp's built-in C++
formatter of the same name produces (``src/llama-chat.cpp``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "BUILTIN_TEMPLATES",
    "builtin_template",
    "builtin_name_for_architecture",
    "normalize_messages",
    "template_for_model",
]


class ChatTemplateError(jinja2.exceptions.TemplateError, ValueError):
    """A chat template refused the conversation or could not be compiled/rendered.

    ``str(err)`` is the template's own message when the template called
    ``raise_exception(msg)`` (``from_template`` is then True), otherwise a
    description of the syntax or rendering failure. It is a ``ValueError`` so that
    front ends can answer it as bad input (HTTP 400).
    """

    def __init__(self, message: str, from_template: bool = False):
        super().__init__(message)
        self.from_template = from_template

    def __str__(self) -> str:  # jinja2's TemplateError.__str__ returns its .message
        return self.message or ""


# ---------------------------------------------------------------------------
# The Jinja environment (transformers-compatible)
# ---------------------------------------------------------------------------


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(str(message), from_template=True)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, &, ' and sorts keys; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _TemplateDict:
    """``dict(...)`` inside templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace (got {name!r})")


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses dunder/underscore attribute names (sandbox hygiene)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as jinja2
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_environment()


# ---------------------------------------------------------------------------
# Message normalisation
# ---------------------------------------------------------------------------

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """Deep copy into plain JSON-like Python types (str, int, float, bool, None, dict, list)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _flatten_content(content: Any, index: int) -> Any:
    """A list of content parts -> one string of its text parts joined by "\\n" (llama.cpp)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ValueError(f"messages[{index}].content: each part must be an object, got {part!r}")
        ptype = part.get("type", "text")
        if ptype == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{index}].content: a text part needs a string 'text'")
            texts.append(text)
        else:
            raise ValueError(
                f"messages[{index}].content: part type {ptype!r} is not supported "
                "(only text parts; this model has no multimodal projector loaded)")
    return "\n".join(texts)


def normalize_messages(messages: Iterable[Any]) -> list[dict]:
    """Validate and copy OpenAI-style messages into what templates receive.

    Each message must be a dict with a string ``role``. Returns new dicts (the
    caller's objects are never modified): keys with ``None`` values dropped,
    list-of-parts content flattened to a string (text parts joined by ``"\\n"``),
    reasoning aliased to both ``reasoning_content`` and ``thinking``.

    Raises ValueError with the offending message index on malformed input.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise ValueError("messages must be a list of message objects")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {msg!r}")
        m = {k: v for k, v in _plain(msg).items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a string 'role'")
        if "content" in m:
            content = _flatten_content(m["content"], i)
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
            m["content"] = content
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# ---------------------------------------------------------------------------
# ChatTemplate
# ---------------------------------------------------------------------------


class ChatTemplate:
    """A compiled chat template.

    ``source``: Jinja text. ``bos_token`` / ``eos_token``: the model's BOS/EOS
    token *text* (e.g. ``"<bos>"``), visible to the template as ``bos_token`` /
    ``eos_token``. ``name``: where it came from (a built-in name, ``"gguf"``,
    ``"file"``, ``"inline"``), for logs and ``/props``. ``clock``: returns the
    time ``strftime_now`` formats (default ``datetime.now``; tests pin it).

    Raises ChatTemplateError (a ValueError) if the source does not compile.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *,
                 name: str = "inline", clock: Optional[Callable[[], datetime]] = None):
        if not isinstance(source, str):
            raise ValueError("chat template source must be a string")
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.name = name
        self._clock = clock or datetime.now

        def strftime_now(fmt: str) -> str:
            return self._clock().strftime(fmt)

        try:
            self._template = _ENV.from_string(source, globals={"strftime_now": strftime_now})
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template ({name}) has a syntax error at line {e.lineno}: {e.message}") from None

    def render(self, messages: Iterable[Any], /, add_generation_prompt: bool = True,
               tools: Optional[list] = None, **extra_context: Any) -> str:
        """Render ``messages`` to prompt text, exactly as transformers' renderer would.

        messages: OpenAI-style dicts (``role``, ``content`` str or list of text parts,
        ``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content`` …).
        tools: OpenAI tool schemas, or None (an empty list counts as None, as in llama.cpp).
        extra_context: more template variables (``enable_thinking``, ``date_string`` …);
        they may override ``bos_token`` / ``eos_token``; keys named ``messages``,
        ``tools`` or ``add_generation_prompt`` are ignored (the arguments win).

        Returns the text, BOS text included where the template writes it.
        Raises ValueError for malformed messages and ChatTemplateError when the
        template refuses the conversation (its own message) or fails to render.
        """
        msgs = normalize_messages(messages)
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(_plain(extra_context))
        context.update(
            messages=msgs,
            tools=_plain(list(tools)) if tools else None,
            documents=context.get("documents"),
            add_generation_prompt=bool(add_generation_prompt),
        )
        try:
            return self._template.render(context)  # a dict: any variable name (even "self") is fine
        except ChatTemplateError:
            raise
        except jinja2.exceptions.TemplateError as e:  # undefined, security, runtime template errors
            raise ChatTemplateError(f"chat template ({self.name}) failed to render: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ChatTemplateError(
                f"chat template ({self.name}) failed to render: {type(e).__name__}: {e}") from None

    def render_prompt(self, messages: Iterable[Any], /, *, add_bos: bool, add_eos: bool = False,
                      add_generation_prompt: bool = True, tools: Optional[list] = None,
                      extra_context: Optional[dict] = None) -> str:
        """``render`` for tokenizing with special tokens added by the tokenizer.

        When ``add_bos`` (the tokenizer will prepend BOS) a leading ``bos_token`` text
        is removed, and when ``add_eos`` a trailing ``eos_token`` text, so the prompt
        does not get them twice (llama.cpp ``common_chat_template_direct_apply``).
        ``extra_context``: more template variables, any names (a request's
        ``chat_template_kwargs``); as in ``render``, ``messages`` / ``tools`` /
        ``add_generation_prompt`` there are ignored.
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           **(extra_context or {}))
        if add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"


# ---------------------------------------------------------------------------
# Built-in templates
# ---------------------------------------------------------------------------

# Gemma (2/3): turns "<start_of_turn>{user|model}\n{trimmed content}<end_of_turn>\n".
# System text (untrimmed, followed by a blank line) opens the next user turn, as in the
# Gemma-3 template. Unlike that template it does not insist on alternating roles:
# system messages anywhere are merged into the following non-model turn and other roles
# keep their name (llama.cpp LLM_CHAT_TEMPLATE_GEMMA), so a server never refuses a chat.
_GEMMA = """{{ bos_token }}
{%- set ns = namespace(prefix='') -%}
{%- for message in messages -%}
    {%- set content = message['content'] if message['content'] is string else '' -%}
    {%- if message['role'] == 'system' -%}
        {%- set ns.prefix = ns.prefix + content + '\\n\\n' -%}
    {%- else -%}
        {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
        {{- '<start_of_turn>' + role + '\\n' -}}
        {%- if role != 'model' -%}
            {{- ns.prefix -}}
            {%- set ns.prefix = '' -%}
        {%- endif -%}
        {{- content | trim -}}
        {{- '<end_of_turn>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

# ChatML (Qwen and many others): "<|im_start|>{role}\n{content}<|im_end|>\n"
# (llama.cpp LLM_CHAT_TEMPLATE_CHATML; no default system prompt, content untrimmed).
_CHATML = """{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\\n' -}}
    {{- message['content'] if message['content'] is string else '' -}}
    {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# Llama 3: "<|start_header_id|>{role}<|end_header_id|>\n\n{trimmed content}<|eot_id|>",
# BOS before the first message (Meta's Llama-3-Instruct template; llama.cpp
# LLM_CHAT_TEMPLATE_LLAMA_3 relies on the tokenizer's BOS instead).
_LLAMA3 = """{%- for message in messages -%}
    {%- if loop.first -%}
        {{- bos_token -}}
    {%- endif -%}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}
    {{- (message['content'] if message['content'] is string else '') | trim -}}
    {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- endif -%}
"""

#: Built-in template sources by llama.cpp's ``--chat-template`` name.
BUILTIN_TEMPLATES: dict[str, str] = {"gemma": _GEMMA, "chatml": _CHATML, "llama3": _LLAMA3}


def builtin_template(name: str, bos_token: str = "", eos_token: str = "", *,
                     clock: Optional[Callable[[], datetime]] = None) -> ChatTemplate:
    """The built-in template called ``name`` (``gemma``, ``chatml``, ``llama3``).

    Raises ValueError naming the known templates when ``name`` is unknown.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in BUILTIN_TEMPLATES:
        raise ValueError(
            f"unknown chat template {name!r}; built-in templates: {', '.join(sorted(BUILTIN_TEMPLATES))}")
    return ChatTemplate(BUILTIN_TEMPLATES[key], bos_token, eos_token, name=key, clock=clock)


def builtin_name_for_architecture(arch: Optional[str]) -> str:
    """Built-in template name for a GGUF ``general.architecture``.

    ``gemma*`` -> gemma, ``qwen*`` -> chatml, ``llama`` -> llama3, anything else -> chatml.
    """
    a = (arch or "").lower()
    if a.startswith("gemma"):
        return "gemma"
    if a.startswith("qwen"):
        return "chatml"
    if a == "llama":
        return "llama3"
    return "chatml"


def _token_text(metadata: Mapping[str, Any], key: str) -> str:
    tokens = metadata.get("tokenizer.ggml.tokens")
    tid = metadata.get(key)
    if tokens is None or tid is None:
        return ""
    try:
        tid = int(tid)
    except (TypeError, ValueError):
        return ""
    if 0 <= tid < len(tokens):
        tok = tokens[tid]
        return tok.decode("utf-8", "replace") if isinstance(tok, bytes) else str(tok)
    return ""


def _looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text or "{#" in text


def template_for_model(metadata: Mapping[str, Any], override_name: Optional[str] = None,
                       override_file: Optional[str] = None, *,
                       clock: Optional[Callable[[], datetime]] = None) -> ChatTemplate:
    """Choose the chat template for a model, in llama.cpp's order of precedence.

    1. ``override_file`` (``--chat-template-file F``): the file's text (UTF-8).
    2. ``override_name`` (``--chat-template X``): a built-in name, or, when ``X``
       contains Jinja syntax (``{{``, ``{%``, ``{#``), the template source itself.
    3. The GGUF's ``tokenizer.chat_template``.
    4. The built-in for ``general.architecture`` (see ``builtin_name_for_architecture``).

    ``bos_token`` / ``eos_token`` are the texts of ``tokenizer.ggml.tokens`` at
    ``tokenizer.ggml.bos_token_id`` / ``eos_token_id`` ("" when missing).

    Raises ValueError when both overrides are given, the file cannot be read, the
    name is neither a built-in nor a template, or the template does not compile.
    """
    bos = _token_text(metadata, "tokenizer.ggml.bos_token_id")
    eos = _token_text(metadata, "tokenizer.ggml.eos_token_id")
    if override_file is not None and override_name is not None:
        raise ValueError("give either --chat-template or --chat-template-file, not both")
    if override_file is not None:
        try:
            source = Path(override_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read chat template file {override_file!r}: {e}") from None
        return ChatTemplate(source, bos, eos, name="file", clock=clock)
    if override_name is not None:
        if not isinstance(override_name, str) or not override_name.strip():
            raise ValueError("--chat-template needs a template name or Jinja source")
        if override_name.strip().lower() in BUILTIN_TEMPLATES:
            return builtin_template(override_name, bos, eos, clock=clock)
        if _looks_like_jinja(override_name):
            return ChatTemplate(override_name, bos, eos, name="inline", clock=clock)
        raise ValueError(
            f"unknown chat template {override_name!r}: not a built-in name "
            f"({', '.join(sorted(BUILTIN_TEMPLATES))}) and not Jinja source")
    source = metadata.get("tokenizer.chat_template")
    if isinstance(source, bytes):
        source = source.decode("utf-8", "replace")
    if isinstance(source, str) and source.strip():
        return ChatTemplate(source, bos, eos, name="gguf", clock=clock)
    name = builtin_name_for_architecture(metadata.get("general.architecture"))
    return builtin_template(name, bos, eos, clock=clock)
