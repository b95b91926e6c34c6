"""The terminal front end: one raw completion (``-p``) or an interactive chat.

``-p TEXT`` behaves like ``llama-cli -no-cnv -p TEXT`` / ``llamafile -p TEXT``:
the prompt is tokenized as raw text (BOS added when the model wants it, special
token text such as ``<start_of_turn>`` parsed as special tokens, as llama.cpp's
completion tool does), echoed (unless ``--no-display-prompt``), and the
continuation is streamed to stdout as the engine releases text. ``-n`` tokens
at most; the default ``-1`` stops at an end-of-generation token or when the
context is full. Ctrl-C stops generation (exit status 130).

Without ``-p`` it is a chat REPL: each line you type becomes a user message,
the conversation is rendered with the model's chat template
(``template_for_model``: ``--chat-template``/``--chat-template-file``, else the
GGUF's, else the architecture's built-in), and the reply streams back. History
is kept across turns, and because every turn resubmits the whole conversation
with ``cache_prompt`` the engine only computes the new tokens. ``/exit`` (or
``/quit``) or Ctrl-D leaves; Ctrl-C during a reply stops that reply; Ctrl-C at
the prompt leaves; a stopped reply stays in the history as far as it got. When the
conversation and the room for a reply (``-n``, else a quarter of the context) no longer fit a
slot's context, its oldest messages (after the system prompt) are dropped, with a note on
stderr, until they do (or only the newest message is left).
"""

from __future__ import annotations

import queue
import sys
from typing import Optional, TextIO

from opencoti.engine.api import CompletionRequest, ErrorEvent, FinishEvent, TokenEvent
from opencoti.params import Params

EXIT_COMMANDS = ("/exit", "/quit")


def _resolve_model_path(params: Params) -> str:
    """``-m`` if given, else the embedded default model (assembled on first use)."""
    if params.model:
        return params.model
    from opencoti.model.default_model import default_model_path

    return str(default_model_path())


def _log(params: Params, msg: str) -> None:
    if params.verbose:
        print(f"opencoti: {msg}", file=sys.stderr, flush=True)


def _stream(engine, handle, out: TextIO) -> tuple[str, Optional[FinishEvent], Optional[ErrorEvent], bool]:
    """Write a request's text to ``out`` as it arrives; Ctrl-C cancels the request.

    Returns (text written, finish event or None, error event or None,
    interrupted). After Ctrl-C the request is cancelled and its remaining events
    are drained, so the engine is idle again when this returns.
    """
    parts: list[str] = []
    finish: Optional[FinishEvent] = None
    error: Optional[ErrorEvent] = None

    def consume(events) -> None:
        nonlocal finish, error
        for ev in events:
            if isinstance(ev, TokenEvent):
                text = ev.text
            elif isinstance(ev, FinishEvent):
                text, finish = ev.text, ev
            else:
                text, error = "", ev
            if text:
                parts.append(text)
                out.write(text)
                out.flush()

    try:
        consume(handle.events())
    except KeyboardInterrupt:
        handle.cancel()
        # A bound request is finished by the engine ("limit"); one still waiting is dropped
        # without an event (engine/api.py RequestHandle.cancel), so stop draining once nothing
        # arrives and no slot holds the request any more.
        while finish is None and error is None:
            try:
                consume(handle.events(timeout=0.2))
            except queue.Empty:
                if not any(getattr(s, "handle", None) is handle for s in getattr(engine, "slots", ())):
                    break
            except KeyboardInterrupt:  # a second Ctrl-C while draining: keep draining
                continue
        return "".join(parts), finish, error, True
    return "".join(parts), finish, error, False


def _print_timings(params: Params, finish: Optional[FinishEvent]) -> None:
    if not params.verbose or finish is None or not finish.timings:
        return
    t = finish.timings
    print(
        f"opencoti: prompt {t.get('prompt_n', finish.n_prompt_tokens)} tokens "
        f"({t.get('prompt_per_second', 0.0):.1f} tok/s, {t.get('cache_n', finish.n_cached)} cached), "
        f"generated {t.get('predicted_n', finish.n_predicted)} tokens "
        f"({t.get('predicted_per_second', 0.0):.1f} tok/s), stop: {finish.stop_type}",
        file=sys.stderr,
        flush=True,
    )


def run_completion(engine, model, params: Params, out: TextIO = sys.stdout) -> int:
    """Run one raw completion of ``params.prompt``; returns the exit status (0, or 1 on error)."""
    tok = model.tokenizer
    prompt = params.prompt or ""
    tokens = tok.tokenize(prompt, add_special=True, parse_special=True)
    if not tokens:
        print("opencoti: error: the prompt is empty after tokenization", file=sys.stderr)
        return 1
    _log(params, f"prompt: {len(tokens)} tokens")
    req = CompletionRequest(prompt_tokens=tokens, n_predict=params.n_predict, sampling=params.sampling,
                            cache_prompt=True)
    if params.display_prompt:
        out.write(prompt)
        out.flush()
    handle = engine.submit(req)
    _text, finish, error, interrupted = _stream(engine, handle, out)
    out.write("\n")
    out.flush()
    if interrupted:
        return 130
    if error is not None:
        print(f"opencoti: error: {error.message}", file=sys.stderr)
        return 1
    _print_timings(params, finish)
    return 0


def _render(template, tok, messages: list[dict]) -> list[int]:
    """The conversation as prompt tokens (the chat template's text, BOS where the model adds one,
    special-token text parsed). Raises ValueError (ChatTemplateError) from the template."""
    text = template.render_prompt(messages, add_bos=bool(tok.add_bos), add_generation_prompt=True)
    return tok.tokenize(text, add_special=True, parse_special=True)


def _drop_oldest_turn(messages: list[dict]) -> bool:
    """Drop the oldest message after the system prompt, and an assistant reply it leaves at
    the front (the conversation keeps starting with a user turn); False when only the newest
    user message is left to drop."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    if len(messages) - first <= 1:
        return False
    del messages[first]
    while len(messages) - first > 1 and messages[first]["role"] == "assistant":
        del messages[first]
    return True


def run_chat(engine, model, params: Params, inp: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """Interactive chat on ``inp``/``out`` until ``/exit``, EOF or Ctrl-C at the prompt."""
    from opencoti.model.chat_template import template_for_model

    tok = model.tokenizer
    template = template_for_model(model.metadata, override_name=params.chat_template,
                                  override_file=params.chat_template_file)
    messages: list[dict] = []
    if params.system_prompt:
        messages.append({"role": "system", "content": params.system_prompt})
    interactive = inp.isatty() if hasattr(inp, "isatty") else False
    if interactive:
        print(f"opencoti chat with {getattr(model, 'name', '') or 'the model'}: "
              f"type a message, /exit or Ctrl-D to leave, Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        out.write("> ")
        out.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        if not line:  # EOF (Ctrl-D)
            out.write("\n")
            out.flush()
            return 0
        line = line.rstrip("\r\n")
        if line.strip() in EXIT_COMMANDS:
            return 0
        if not line.strip():
            continue
        if not interactive:  # echo piped input so a transcript reads naturally
            out.write(line + "\n")
        messages.append({"role": "user", "content": line})
        try:
            kept = list(messages)
            tokens = _render(template, tok, kept)
            n_ctx = engine.n_ctx_slot
            # room for the reply: -n, else a quarter of the context
            reserve = min(params.n_predict, n_ctx - 1) if params.n_predict > 0 else n_ctx // 4
            while len(tokens) + reserve > n_ctx and _drop_oldest_turn(kept):  # the context is full: forget
                tokens = _render(template, tok, kept)
            if len(tokens) < n_ctx:  # else the engine refuses it, and the history stays whole
                n_dropped, messages[:] = len(messages) - len(kept), kept
            else:
                n_dropped = 0
        except ValueError as e:  # ChatTemplateError is a ValueError
            print(f"opencoti: error: {e}", file=sys.stderr)
            messages.pop()
            continue
        if n_dropped:
            print(f"opencoti: the conversation filled the context ({n_ctx} tokens): dropped its {n_dropped} "
                  f"oldest message{'s' if n_dropped > 1 else ''}", file=sys.stderr)
        _log(params, f"conversation: {len(tokens)} tokens")
        req = CompletionRequest(prompt_tokens=tokens, n_predict=params.n_predict, sampling=params.sampling,
                                cache_prompt=True)
        handle = engine.submit(req)
        reply, finish, error, interrupted = _stream(engine, handle, out)
        out.write("\n")
        out.flush()
        if error is not None and not interrupted:
            print(f"opencoti: error: {error.message}", file=sys.stderr)
            messages.pop()  # the turn did not happen
            continue
        # a reply stopped by Ctrl-C stays in the history as far as it got
        messages.append({"role": "assistant", "content": reply})
        _print_timings(params, finish)


def run_cli(params: Params) -> int:
    """Load the model, start the engine, run ``-p`` or the chat, stop the engine; returns the exit status.

    Raises ``DefaultModelUnavailable`` (no -m and no model package) and the
    loader's errors; ``opencoti.cli.main`` turns them into one-line messages.
    """
    path = _resolve_model_path(params)  # first: a missing model is reported before heavy imports
    from opencoti.engine.engine import Engine
    from opencoti.model.loader import load_model

    _log(params, f"loading {path}")
    model = load_model(path, params)
    engine = Engine(model, params)
    if params.verbose:
        from opencoti.engine.kv_report import kv_layout_lines

        for line in kv_layout_lines(engine):
            _log(params, line)
    engine.start()
    try:
        if params.prompt is not None:
            return run_completion(engine, model, params)
        return run_chat(engine, model, params)
    finally:
        engine.stop()
