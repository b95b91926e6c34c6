"""Command line: llama.cpp / llamafile's flags and their ``LLAMA_ARG_*`` environment twins.

``opencoti [flags]`` runs one raw completion with ``-p``, an interactive chat
without it, and the HTTP server with ``--server``. Flag names, short forms and
environment variables follow llama.cpp's ``common/arg.cpp``:

- where llama.cpp declares an environment variable for a flag (``set_env``) we
  use exactly that name: ``LLAMA_ARG_MODEL``, ``LLAMA_ARG_CTX_SIZE``,
  ``LLAMA_ARG_N_PREDICT``, ``LLAMA_ARG_BATCH``, ``LLAMA_ARG_UBATCH``,
  ``LLAMA_ARG_THREADS``, ``LLAMA_ARG_TOP_K``, ``LLAMA_ARG_N_PARALLEL``,
  ``LLAMA_ARG_KV_UNIFIED``, ``LLAMA_ARG_CACHE_TYPE_K``, ``LLAMA_ARG_CACHE_TYPE_V``,
  ``LLAMA_ARG_CONTEXT_SHIFT``, ``LLAMA_ARG_CACHE_IDLE_SLOTS``,
  ``LLAMA_ARG_HOST``, ``LLAMA_ARG_PORT``, ``LLAMA_ARG_TIMEOUT``, ``LLAMA_ARG_ENDPOINT_SLOTS``,
  ``LLAMA_ARG_ENDPOINT_METRICS``, ``LLAMA_ARG_N_GPU_LAYERS``, ``LLAMA_ARG_FLASH_ATTN``,
  ``LLAMA_ARG_MAIN_GPU``, ``LLAMA_API_KEY``, ``LLAMA_ARG_ALIAS``,
  ``LLAMA_ARG_CHAT_TEMPLATE``, ``LLAMA_ARG_CHAT_TEMPLATE_FILE``;
- flags llama.cpp gives no variable (``-p``, ``-s``, ``--temp``, ``--top-p``,
  ``--min-p``, ``--typical``, the penalties, XTC, dynamic temperature, Mirostat,
  ``--min-keep``, ``-sys``, ``-v``) and llamafile's
  own flags (``--server``, ``--gpu``, ``--admission-poolless``, ``-ctkt``, ``-ctvt``) get
  ``LLAMA_ARG_<FLAG>``: the long flag
  name upper-cased with ``-`` -> ``_`` (``--repeat-penalty`` ->
  ``LLAMA_ARG_REPEAT_PENALTY``). See ``ENV_NAMES``.

opencoti's own knobs without a flag are plain variables, read here into ``Params``:
``OPENCOTI_KV_AUTO_TIER`` (boolean) and ``OPENCOTI_KV_BUDGET_MIB`` (a positive number), see
``opencoti/engine/kv_auto_tier.py``.

A flag on the command line beats its variable. Multi-letter single-dash flags
(``-ub``, ``-np``, ``-ngl``, ``-fa``, ``-sys``, ``-kvu``) are click "long"
options with a one-dash prefix, so ``-ub 256`` parses as llama.cpp does. As in
llama.cpp, ``--ctx_size`` is read as ``--ctx-size`` (underscores in ``--``
flags become dashes).

Every usage problem (unknown flag, bad value, missing file) is reported as one
line on stderr, ``opencoti: error: ...``, with exit status 2; a runtime failure
(e.g. an unreadable model) is one line with exit status 1. No tracebacks unless
``-v`` is given.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional, Sequence

import click

from opencoti.engine.api import SamplingParams
from opencoti.engine.kv_tiers import TIER_NAMES
from opencoti.model.kv_override import KVOverrideError, parse_kv_overrides
from opencoti.params import Params
from opencoti.version import full_version

PROG = "opencoti"

# Flag (long name) -> environment twin. llama.cpp's own names where it has one.
ENV_NAMES: dict[str, tuple[str, ...]] = {
    "model": ("LLAMA_ARG_MODEL",),
    "prompt": ("LLAMA_ARG_PROMPT",),
    "n_predict": ("LLAMA_ARG_N_PREDICT",),
    "ctx_size": ("LLAMA_ARG_CTX_SIZE",),
    "batch_size": ("LLAMA_ARG_BATCH",),
    "ubatch_size": ("LLAMA_ARG_UBATCH",),
    "threads": ("LLAMA_ARG_THREADS",),
    "seed": ("LLAMA_ARG_SEED",),
    "temp": ("LLAMA_ARG_TEMP",),
    "top_k": ("LLAMA_ARG_TOP_K",),
    "top_p": ("LLAMA_ARG_TOP_P",),
    "min_p": ("LLAMA_ARG_MIN_P",),
    "typical": ("LLAMA_ARG_TYPICAL",),
    "repeat_penalty": ("LLAMA_ARG_REPEAT_PENALTY",),
    "repeat_last_n": ("LLAMA_ARG_REPEAT_LAST_N",),
    "presence_penalty": ("LLAMA_ARG_PRESENCE_PENALTY",),
    "frequency_penalty": ("LLAMA_ARG_FREQUENCY_PENALTY",),
    "xtc_probability": ("LLAMA_ARG_XTC_PROBABILITY",),
    "xtc_threshold": ("LLAMA_ARG_XTC_THRESHOLD",),
    "dynatemp_range": ("LLAMA_ARG_DYNATEMP_RANGE",),
    "dynatemp_exp": ("LLAMA_ARG_DYNATEMP_EXP",),
    "mirostat": ("LLAMA_ARG_MIROSTAT",),
    "mirostat_lr": ("LLAMA_ARG_MIROSTAT_LR",),
    "mirostat_ent": ("LLAMA_ARG_MIROSTAT_ENT",),
    "min_keep": ("LLAMA_ARG_MIN_KEEP",),
    "parallel": ("LLAMA_ARG_N_PARALLEL",),
    "kv_unified": ("LLAMA_ARG_KV_UNIFIED",),
    "cache_type_k": ("LLAMA_ARG_CACHE_TYPE_K",),
    "cache_type_v": ("LLAMA_ARG_CACHE_TYPE_V",),
    "cache_type_k_tail": ("LLAMA_ARG_CACHE_TYPE_K_TAIL",),
    "cache_type_v_tail": ("LLAMA_ARG_CACHE_TYPE_V_TAIL",),
    "context_shift": ("LLAMA_ARG_CONTEXT_SHIFT",),
    "cache_idle_slots": ("LLAMA_ARG_CACHE_IDLE_SLOTS",),
    "admission_poolless": ("LLAMA_ARG_ADMISSION_POOLLESS",),
    "polykv_max_pools": ("LLAMA_ARG_POLYKV_MAX_POOLS",),
    "host": ("LLAMA_ARG_HOST",),
    "port": ("LLAMA_ARG_PORT",),
    "timeout": ("LLAMA_ARG_TIMEOUT",),
    "gpu_layers": ("LLAMA_ARG_N_GPU_LAYERS",),
    "flash_attn": ("LLAMA_ARG_FLASH_ATTN",),
    "gpu": ("LLAMA_ARG_GPU",),
    "main_gpu": ("LLAMA_ARG_MAIN_GPU",),
    "override_kv": ("LLAMA_ARG_OVERRIDE_KV",),
    "server": ("LLAMA_ARG_SERVER",),
    "slots": ("LLAMA_ARG_ENDPOINT_SLOTS",),
    "metrics": ("LLAMA_ARG_ENDPOINT_METRICS",),
    "props": ("LLAMA_ARG_ENDPOINT_PROPS",),
    # llama.cpp reads LLAMA_API_KEY; LLAMA_ARG_API_KEY is accepted as well.
    "api_key": ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY"),
    "alias": ("LLAMA_ARG_ALIAS",),
    "chat_template": ("LLAMA_ARG_CHAT_TEMPLATE",),
    "chat_template_file": ("LLAMA_ARG_CHAT_TEMPLATE_FILE",),
    "jinja": ("LLAMA_ARG_JINJA",),
    "system_prompt": ("LLAMA_ARG_SYSTEM_PROMPT",),
    "display_prompt": ("LLAMA_ARG_DISPLAY_PROMPT",),
    "verbose": ("LLAMA_ARG_VERBOSE",),
}

GPU_CHOICES = ("auto", "nvidia", "vulkan", "vk", "amd", "intel", "apple", "disable")
ADMISSION_CHOICES = ("off", "warn", "enforced")

# llama.cpp common/arg.cpp is_truthy / is_falsey / is_autoy
_TRUTHY = ("on", "enabled", "true", "1")
_FALSEY = ("off", "disabled", "false", "0")
_AUTOY = ("auto", "-1")


class _IntRange(click.IntRange):
    """click's IntRange whose bad-value message reads "'abc' is not a valid integer" (click's
    own says "integer range")."""

    name = "integer"


class _KVType(click.ParamType):
    """``-ctk``/``-ctv``/``-ctkt``/``-ctvt`` value: a KV tier name (case-insensitive). The
    names come from a NumPy-free tuple, so parsing loads no NumPy (see ``set_cpu_threads``)."""

    name = "TYPE"

    def convert(self, value: Any, param, ctx) -> str:
        v = str(value).strip().lower()
        if v not in TIER_NAMES:
            self.fail(f"{value!r} is not a KV cache type (allowed: {', '.join(TIER_NAMES)})", param, ctx)
        return v


class _FlashAttn(click.ParamType):
    """``-fa`` value: on/off/auto and llama.cpp's synonyms (enabled/true/1 …)."""

    name = "[on|off|auto]"

    def convert(self, value: Any, param, ctx) -> str:
        v = str(value).strip().lower()
        if v in _TRUTHY:
            return "on"
        if v in _FALSEY:
            return "off"
        if v in _AUTOY:
            return "auto"
        self.fail(f"{value!r} is not one of on, off, auto", param, ctx)


def _env(name: str) -> tuple[str, ...]:
    return ENV_NAMES[name]


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(full_version())
    ctx.exit(0)


def _normalize_argv(argv: Sequence[str]) -> list[str]:
    """``--ctx_size=5`` -> ``--ctx-size=5`` (llama.cpp accepts underscores in ``--`` flags).

    Stops at ``--`` and leaves values (non-flag words) alone.
    """
    out = []
    for i, a in enumerate(argv):
        if a == "--":
            out.extend(argv[i:])
            break
        if a.startswith("--") and "_" in a.split("=", 1)[0]:
            name, eq, val = a.partition("=")
            a = name.replace("_", "-") + eq + val
        out.append(a)
    return out


_CONTEXT = dict(help_option_names=["-h", "--help"], max_content_width=100)

# llama.cpp options this build does not offer: given, they are a one-line usage error that
# names them (else click reads "-md x" as "-m d", "-ts 1,1" as "-t s"). (flags, takes a value, what)
_NOT_OFFERED = (
    (("-md", "--model-draft"), True, "speculative decoding with a draft model"),
    (("-cd", "--ctx-size-draft"), True, "speculative decoding with a draft model"),
    (("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"), True, "speculative decoding with a draft model"),
    (("--draft", "--draft-n", "--draft-max"), True, "speculative decoding"),
    (("--draft-min", "--draft-n-min"), True, "speculative decoding"),
    (("-ts", "--tensor-split"), True, "splitting tensors over several GPUs"),
    (("-sm", "--split-mode"), True, "splitting the model over several GPUs"),
    (("-nkvo", "--no-kv-offload"), False, "a KV cache kept on the CPU beside GPU weights"),
    (("-mm", "--mmproj"), True, "multimodal input"),
    (("--lora",), True, "LoRA adapters"),
    (("--embedding", "--embeddings"), False, "an embeddings mode"),
    (("--reranking", "--rerank"), False, "a reranking mode"),
)


def _refuse(what: str):
    def callback(ctx: click.Context, param: click.Parameter, value) -> None:
        if value not in (None, False) and not ctx.resilient_parsing:
            raise click.UsageError(f"{'/'.join(param.opts)}: opencoti does not offer {what}")
    return callback


def _not_offered(f):
    """``_NOT_OFFERED``'s options, hidden from --help, each refusing itself."""
    for names, takes_value, what in reversed(_NOT_OFFERED):
        kind = {} if takes_value else {"is_flag": True}  # (is_flag=False would make the value optional)
        f = click.option(*names, hidden=True, expose_value=False, callback=_refuse(what), **kind)(f)
    return f


# SamplingParams fields whose flag is not the field's name with "-" for "_"
_FLAG_OF_FIELD = {"temperature": "temp", "typical_p": "typical", "mirostat_eta": "mirostat-lr",
                  "mirostat_tau": "mirostat-ent", "dynatemp_exponent": "dynatemp-exp"}


@click.command(name=PROG, context_settings=_CONTEXT,
               help="LLM inference on GGUF models: one completion (-p), a chat (no -p), "
                    "or llama.cpp's HTTP server (--server).")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print opencoti-<version>-<build tag> and exit.")
@click.option("-m", "--model", type=click.Path(exists=True, dir_okay=False), envvar=_env("model"),
              help="GGUF model file (default: the embedded gemma-3-270m Q4_K_M).")
@click.option("-p", "--prompt", envvar=_env("prompt"),
              help="Prompt for one raw completion, streamed to stdout; without it, chat.")
@click.option("-n", "--n-predict", "--predict", "n_predict", type=_IntRange(min=-2), default=-1,
              show_default=True, envvar=_env("n_predict"),
              help="Tokens to generate (-1: until end of generation or context full, -2: until context full).")
@click.option("-c", "--ctx-size", type=_IntRange(min=0), default=4096, show_default=True,
              envvar=_env("ctx_size"), help="Context size in tokens (0: the model's training context).")
@click.option("-b", "--batch-size", type=_IntRange(min=1), default=2048, show_default=True,
              envvar=_env("batch_size"), help="Logical batch size.")
@click.option("-ub", "--ubatch-size", type=_IntRange(min=1), default=512, show_default=True,
              envvar=_env("ubatch_size"), help="Physical batch size (tokens per forward pass).")
@click.option("-t", "--threads", type=int, default=-1, show_default=True, envvar=_env("threads"),
              help="CPU threads (<= 0: all cores).")
@click.option("-s", "--seed", type=int, default=-1, show_default=True, envvar=_env("seed"),
              help="RNG seed (-1: random).")
@click.option("--temp", "--temperature", "temp", type=float, default=0.8, show_default=True,
              envvar=_env("temp"), help="Temperature (<= 0: greedy).")
@click.option("--top-k", type=int, default=40, show_default=True, envvar=_env("top_k"),
              help="Top-k sampling (0: off).")
@click.option("--top-p", type=float, default=0.95, show_default=True, envvar=_env("top_p"),
              help="Top-p sampling (1.0: off).")
@click.option("--min-p", type=float, default=0.05, show_default=True, envvar=_env("min_p"),
              help="Min-p sampling (0.0: off).")
@click.option("--typical", "--typical-p", "typical", type=float, default=1.0, show_default=True,
              envvar=_env("typical"), help="Locally typical sampling p (1.0: off).")
@click.option("--repeat-penalty", type=float, default=1.0, show_default=True, envvar=_env("repeat_penalty"),
              help="Repetition penalty (1.0: off).")
@click.option("--repeat-last-n", type=_IntRange(min=-1), default=64, show_default=True,
              envvar=_env("repeat_last_n"), help="Tokens the penalties look back over (0: off, -1: context).")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              envvar=_env("presence_penalty"), help="Presence penalty (0.0: off).")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              envvar=_env("frequency_penalty"), help="Frequency penalty (0.0: off).")
@click.option("--xtc-probability", type=float, default=0.0, show_default=True,
              envvar=_env("xtc_probability"),
              help="XTC: chance a step removes the top choices (0.0: off).")
@click.option("--xtc-threshold", type=float, default=0.1, show_default=True,
              envvar=_env("xtc_threshold"),
              help="XTC: probability at or above which a choice counts as a top one (> 0.5: off).")
@click.option("--dynatemp-range", type=float, default=0.0, show_default=True,
              envvar=_env("dynatemp_range"),
              help="Dynamic temperature: entropy-scaled in [temp - range, temp + range] (0.0: off).")
@click.option("--dynatemp-exp", type=float, default=1.0, show_default=True,
              envvar=_env("dynatemp_exp"),
              help="Dynamic temperature exponent.")
@click.option("--mirostat", type=_IntRange(0, 2), default=0, show_default=True,
              envvar=_env("mirostat"),
              help="Mirostat sampling (0: off, 1: Mirostat, 2: Mirostat 2.0); replaces the other samplers.")
@click.option("--mirostat-lr", type=float, default=0.1, show_default=True, envvar=_env("mirostat_lr"),
              help="Mirostat learning rate (eta).")
@click.option("--mirostat-ent", type=float, default=5.0, show_default=True,
              envvar=_env("mirostat_ent"),
              help="Mirostat target entropy (tau, bits).")
@click.option("--min-keep", type=_IntRange(min=0), default=0, show_default=True,
              envvar=_env("min_keep"),
              help="typical, top-p, min-p and XTC keep at least this many candidates.")
@click.option("--dry-multiplier", type=float, default=0.0, show_default=True,
              help="DRY: penalty multiplier for tokens that extend a repetition (0.0: off).")
@click.option("--dry-base", type=float, default=1.75, show_default=True,
              help="DRY: the penalty grows as base ** (repeat length - allowed length); values < 1 are ignored.")
@click.option("--dry-allowed-length", type=int, default=2, show_default=True,
              help="DRY: repetitions up to this long are not penalized.")
@click.option("--dry-penalty-last-n", type=_IntRange(min=-1), default=-1, show_default=True,
              help="DRY: tokens it looks back over (0: off, -1: context).")
@click.option("--dry-sequence-breaker", "dry_sequence_breaker", multiple=True, metavar="STRING",
              help="DRY: a sequence breaker, replacing the defaults ('\\n', ':', '\"', '*'); repeatable; "
                   "'none' for none.")
@click.option("-np", "--parallel", type=int, default=1, show_default=True, envvar=_env("parallel"),
              help="Server slots (-1: auto = 4 with a unified KV cache).")
@click.option("-kvu", "--kv-unified/--no-kv-unified", "kv_unified", default=False, envvar=_env("kv_unified"),
              help="One KV cache shared by all slots.")
@click.option("--spm-infill", is_flag=True, default=False,
              help="/infill: the suffix before the prefix (Suffix/Prefix/Middle), for models trained so "
                   "(default: Prefix/Suffix/Middle).")
@click.option("-ctk", "--cache-type-k", type=_KVType(), default=None, envvar=_env("cache_type_k"),
              help=f"KV cache type of K: {', '.join(TIER_NAMES)} (default: f16; with OPENCOTI_KV_AUTO_TIER=1 "
                   "K is held at this type while V is chosen to fit OPENCOTI_KV_BUDGET_MIB, default half the "
                   "free memory).")
@click.option("-ctv", "--cache-type-v", type=_KVType(), default=None, envvar=_env("cache_type_v"),
              help="KV cache type of V, same values (default: f16; giving it turns auto-tier off).")
@click.option("-ctkt", "--cache-type-k-tail", type=_KVType(), default=None, envvar=_env("cache_type_k_tail"),
              help="KV cache type of K cells in a spilled tail (default: as -ctk).")
@click.option("-ctvt", "--cache-type-v-tail", type=_KVType(), default=None, envvar=_env("cache_type_v_tail"),
              help="KV cache type of V cells in a spilled tail (default: as -ctv).")
@click.option("--context-shift/--no-context-shift", default=False, show_default=True,
              envvar=_env("context_shift"),
              help="When the context is full, drop old tokens and go on instead of stopping.")
@click.option("--cache-idle-slots/--no-cache-idle-slots", default=True, show_default=True,
              envvar=_env("cache_idle_slots"),
              help="Keep idle slots' KV as prompt cache, evicted when the cache needs room "
                   "(--no-cache-idle-slots: idle slots keep theirs, e.g. to share it).")
@click.option("--admission-poolless", type=click.Choice(ADMISSION_CHOICES, case_sensitive=False),
              default="enforced", show_default=True, envvar=_env("admission_poolless"),
              help="KV admission gate of the unified cache: enforced = HTTP 429 + Retry-After when a "
                   "request's prompt + n_predict does not fit, warn = admit with an X-KV-Pool-Saturated "
                   "header, off = no gate.")
@click.option("--polykv-max-pools", type=_IntRange(min=0), default=0, show_default=True,
              envvar=_env("polykv_max_pools"),
              help="PolyKV: shared-prefix KV pools (seq_ids reserved above the slots) and the "
                   "/polykv REST routes; 0 = off.")
@click.option("--host", default="127.0.0.1", show_default=True, envvar=_env("host"),
              help="Server listen address.")
@click.option("--port", type=_IntRange(0, 65535), default=8080, show_default=True, envvar=_env("port"),
              help="Server port.")
@click.option("-to", "--timeout", type=_IntRange(min=1), default=600, show_default=True,
              envvar=_env("timeout"), help="Server read/write timeout in seconds.")
@click.option("-ngl", "--gpu-layers", "--n-gpu-layers", "gpu_layers", type=int, default=-1,
              show_default=True, envvar=_env("gpu_layers"), help="Layers to put on the GPU: the last N repeating layers, the output too when "
                   "N > n_layer (llama.cpp); 0: CPU only; -1: all.")
@click.option("-fa", "--flash-attn", type=_FlashAttn(), default="auto", show_default=True,
              envvar=_env("flash_attn"), help="Flash attention: on, off or auto.")
@click.option("--gpu", type=click.Choice(GPU_CHOICES, case_sensitive=False), default="auto",
              show_default=True, envvar=_env("gpu"), help="GPU backend (llamafile's flag).")
@click.option("-mg", "--main-gpu", type=_IntRange(min=0), default=0, show_default=True,
              envvar=_env("main_gpu"), help="Index of the GPU to use.")
@click.option("--override-kv", "override_kv", multiple=True, metavar="KEY=TYPE:VALUE,...",
              envvar=_env("override_kv"),
              help="Override GGUF metadata by key (repeatable, or comma-separated); TYPE is int, float, "
                   "bool or str, e.g. --override-kv gemma4.context_length=int:1048576.")
@click.option("--server", is_flag=True, default=False, envvar=_env("server"),
              help="Run the HTTP server (llama.cpp's API and the OpenAI API).")
@click.option("--slots/--no-slots", default=True, show_default=True, envvar=_env("slots"),
              help="Serve the GET /slots monitoring endpoint (llama.cpp's default: on).")
@click.option("--metrics", is_flag=True, default=False, envvar=_env("metrics"),
              help="Serve Prometheus metrics at GET /metrics.")
@click.option("--props", is_flag=True, default=False, envvar=_env("props"),
              help="Accept POST /props (llama.cpp's: it acknowledges and changes nothing; 501 without).")
@click.option("--api-key", envvar=_env("api_key"), help="Server API key (Bearer token).")
@click.option("-a", "--alias", envvar=_env("alias"), help="Model name the server reports.")
@click.option("--chat-template", envvar=_env("chat_template"),
              help="Built-in chat template name or inline Jinja template.")
@click.option("--chat-template-file", type=click.Path(exists=True, dir_okay=False),
              envvar=_env("chat_template_file"), help="Jinja chat template file.")
@click.option("--jinja/--no-jinja", default=True, envvar=_env("jinja"),
              help="Accepted for llama.cpp compatibility: chat templates always render with Jinja.")
@click.option("-sys", "--system-prompt", envvar=_env("system_prompt"), help="System prompt for the chat.")
@click.option("--display-prompt/--no-display-prompt", default=True, show_default=True,
              envvar=_env("display_prompt"), help="Echo the -p prompt before its completion.")
@click.option("-v", "--verbose", is_flag=True, default=False, envvar=_env("verbose"),
              help="Log details to stderr.")
@_not_offered
def _command(**kw: Any) -> Params:
    return _params_from_options(kw)


def _dry_base_and_breakers(kw: dict) -> dict:
    """``--dry-base`` (a value < 1 leaves the default, as llama.cpp's flag) and the
    ``--dry-sequence-breaker`` list ('none' clears it; given at all, the defaults go)."""
    out = {}
    if kw["dry_base"] >= 1.0:
        out["dry_base"] = kw["dry_base"]
    given = kw["dry_sequence_breaker"]
    if given:
        breakers = []
        for b in given:
            breakers = [] if b == "none" else breakers + [b]
        out["dry_sequence_breakers"] = tuple(breakers)
    return out


def _params_from_options(kw: dict) -> Params:
    """Turn click's option dict into ``Params`` (llama.cpp's semantics for odd values)."""
    if kw["parallel"] == 0 or kw["parallel"] < -1:
        raise click.BadParameter("must be >= 1, or -1 for auto", param_hint="'-np' / '--parallel'")
    if kw["chat_template"] is not None and kw["chat_template_file"] is not None:
        raise click.UsageError("give either --chat-template or --chat-template-file, not both")
    try:
        kv_overrides = parse_kv_overrides(kw["override_kv"] or ())
    except KVOverrideError as e:
        raise click.BadParameter(str(e), param_hint="'--override-kv'") from None
    n_parallel, kv_unified = kw["parallel"], kw["kv_unified"]
    if n_parallel == -1:  # llama.cpp server: auto -> 4 slots sharing one unified KV cache
        n_parallel, kv_unified = 4, True
    kv_auto_tier, kv_budget_mib = _kv_env()
    seed = kw["seed"]
    if seed == 0xFFFFFFFF:  # LLAMA_DEFAULT_SEED
        seed = -1
    sampling = SamplingParams(
        temperature=max(kw["temp"], 0.0),
        top_k=kw["top_k"],
        top_p=kw["top_p"],
        min_p=kw["min_p"],
        typical_p=kw["typical"],
        repeat_penalty=kw["repeat_penalty"],
        repeat_last_n=kw["repeat_last_n"],
        presence_penalty=kw["presence_penalty"],
        frequency_penalty=kw["frequency_penalty"],
        seed=seed,
        xtc_probability=kw["xtc_probability"],
        xtc_threshold=kw["xtc_threshold"],
        dynatemp_range=kw["dynatemp_range"],
        dynatemp_exponent=kw["dynatemp_exp"],
        mirostat=kw["mirostat"],
        mirostat_tau=kw["mirostat_ent"],
        mirostat_eta=kw["mirostat_lr"],
        min_keep=kw["min_keep"],
        dry_multiplier=kw["dry_multiplier"],
        dry_allowed_length=kw["dry_allowed_length"],
        dry_penalty_last_n=kw["dry_penalty_last_n"],
        **_dry_base_and_breakers(kw),
    )
    from opencoti.engine.api import sampling_error

    err = sampling_error(sampling)
    if err:  # the flag's name for the field's
        field_name = err.split(" ", 1)[0]
        flag = _FLAG_OF_FIELD.get(field_name, field_name.replace("_", "-"))
        raise click.UsageError(f"--{flag}{err[len(field_name):]}" if field_name.isidentifier() else err)
    params = Params(
        model=kw["model"],
        prompt=kw["prompt"],
        n_predict=kw["n_predict"],
        n_ctx=kw["ctx_size"],
        n_batch=kw["batch_size"],
        n_ubatch=kw["ubatch_size"],
        n_threads=kw["threads"] if kw["threads"] > 0 else -1,
        n_parallel=n_parallel,
        kv_unified=kv_unified,
        spm_infill=kw["spm_infill"],
        cache_type_k=kw["cache_type_k"],
        cache_type_v=kw["cache_type_v"],
        cache_type_k_tail=kw["cache_type_k_tail"],
        cache_type_v_tail=kw["cache_type_v_tail"],
        kv_auto_tier=kv_auto_tier,
        kv_budget_mib=kv_budget_mib,
        ctx_shift=kw["context_shift"],
        cache_idle_slots=kw["cache_idle_slots"],
        admission_poolless=kw["admission_poolless"].lower(),
        polykv_max_pools=kw["polykv_max_pools"],
        n_gpu_layers=kw["gpu_layers"],
        main_gpu=kw["main_gpu"],
        gpu=kw["gpu"].lower(),
        flash_attn=kw["flash_attn"],
        kv_overrides=kv_overrides,
        sampling=sampling,
        server=kw["server"],
        endpoint_slots=kw["slots"],
        endpoint_metrics=kw["metrics"],
        endpoint_props=kw["props"],
        host=kw["host"],
        port=kw["port"],
        api_key=kw["api_key"],
        alias=kw["alias"],
        timeout=kw["timeout"],
        chat_template=kw["chat_template"],
        chat_template_file=kw["chat_template_file"],
        system_prompt=kw["system_prompt"],
        verbose=kw["verbose"],
    )
    # Not a Params field (CLI-only presentation setting); chat_cli reads it with getattr.
    params.display_prompt = kw["display_prompt"]
    return params


def _kv_env() -> tuple[bool, Optional[float]]:
    """``OPENCOTI_KV_AUTO_TIER`` (boolean) and ``OPENCOTI_KV_BUDGET_MIB`` (positive MiB).
    Raises ``click.UsageError`` naming the variable for a bad value."""
    auto = os.environ.get("OPENCOTI_KV_AUTO_TIER", "").strip().lower()
    if auto in ("",) + _FALSEY + ("no",):
        on = False
    elif auto in _TRUTHY + ("yes",):
        on = True
    else:
        raise click.UsageError(f"OPENCOTI_KV_AUTO_TIER={auto!r} is not a boolean (1/true/yes/on or 0/false/no/off)")
    raw = os.environ.get("OPENCOTI_KV_BUDGET_MIB", "").strip()
    budget = None
    if raw:
        try:
            budget = float(raw)
        except ValueError:
            budget = -1.0
        if not budget > 0 or budget != budget or budget == float("inf"):
            raise click.UsageError(f"OPENCOTI_KV_BUDGET_MIB={raw!r} is not a positive number of MiB")
    return on, budget


def build_params(argv: Optional[Sequence[str]] = None) -> Params:
    """Parse ``argv`` (default ``sys.argv[1:]``) plus ``LLAMA_ARG_*`` variables into ``Params``.

    Raises ``click.UsageError`` (incl. ``BadParameter``, ``NoSuchOption``) for bad
    input and ``click.exceptions.Exit`` for ``--help`` / ``--version`` (after printing).
    """
    args = _normalize_argv(list(sys.argv[1:] if argv is None else argv))
    result = _command.main(args=args, prog_name=PROG, standalone_mode=False)
    if not isinstance(result, Params):  # click >= 8.2 returns ctx.exit()'s code instead of raising
        raise click.exceptions.Exit(result if isinstance(result, int) else 0)
    return result


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def _usage_error_line(e: click.UsageError) -> str:
    """One line for a usage error; names the environment variable when the bad value came from one."""
    msg = _one_line(e.format_message())
    param = getattr(e, "param", None)
    if e.ctx is not None and param is not None and param.name:
        if e.ctx.get_parameter_source(param.name) == click.core.ParameterSource.ENVIRONMENT:
            names = [n for n in (param.envvar if isinstance(param.envvar, (list, tuple)) else [param.envvar])
                     if n and n in os.environ]
            if names:
                msg += f" (from environment variable {names[0]})"
    return f"{PROG}: error: {msg} (see {PROG} --help)"


def run(params: Params) -> int:
    """Dispatch: ``--server`` -> the HTTP server, else the chat CLI. Returns the exit status."""
    if params.server:
        from opencoti.http.server import serve  # imported here: the server pulls in more

        result = serve(params)
        return result if isinstance(result, int) else 0
    from opencoti.chat_cli import run_cli

    return run_cli(params)


def set_cpu_threads(n_threads: int) -> None:
    """``-t N``: the CPU backend's BLAS threads. NumPy's BLAS reads its thread
    count when first loaded, so this must run before anything imports NumPy
    (``main`` calls it right after parsing); an explicit OPENBLAS/OMP/MKL
    setting in the environment wins. No-op for N <= 0 (all cores)."""
    if n_threads <= 0:
        return
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(n_threads))


class _LevelFormatter(logging.Formatter):
    """``opencoti: warning: message``: the shape of the CLI's own ``opencoti: error: ...`` lines.
    A record with an exception (an internal error) names it on the same line; its traceback
    follows only with ``tracebacks`` (``-v``, as the CLI's own errors)."""

    def __init__(self, tracebacks: bool = False):
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        line = f"{PROG}: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            e = record.exc_info[1]
            line += f": {type(e).__name__}: {_one_line(str(e))}" if e is not None else ""
            line += "\n" + self.formatException(record.exc_info) if self.tracebacks else " (-v: the traceback)"
        return line


def _log_to_stderr(verbose: bool = False) -> None:
    """The package's warnings (and errors) on stderr with their level, once per process
    (``verbose``: internal errors with their tracebacks)."""
    logger = logging.getLogger("opencoti")
    if not any(getattr(h, "_opencoti", False) for h in logger.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(_LevelFormatter(verbose))
        h.setLevel(logging.WARNING)
        h._opencoti = True
        logger.addHandler(h)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (``opencoti``, ``python -m opencoti``, the .pyz). Exits the process."""
    try:
        params = build_params(argv)
    except click.exceptions.Exit as e:  # --help / --version
        sys.exit(e.exit_code)
    except click.UsageError as e:
        print(_usage_error_line(e), file=sys.stderr)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(130)
    verbose = params.verbose
    set_cpu_threads(params.n_threads)
    _log_to_stderr(verbose)
    try:
        code = run(params)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # stdout closed early (e.g. `| head`): quiet exit as other CLI tools do
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        sys.exit(0)
    except Exception as e:  # noqa: BLE001 - the user gets one line, never a traceback
        if verbose:
            import traceback

            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(str(e)) or type(e).__name__}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code or 0)


if __name__ == "__main__":  # pragma: no cover
    main()
