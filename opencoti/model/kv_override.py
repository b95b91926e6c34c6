"""``--override-kv KEY=TYPE:VALUE``: replace GGUF metadata values at load time.

As llama.cpp (``common/common.cpp`` ``string_parse_kv_override``,
``common/arg.cpp`` ``--override-kv``, ``src/llama-model-loader.cpp``
``validate_override``): TYPE is ``int``, ``float``, ``bool`` (``true`` /
``false``) or ``str``; one flag may carry several comma-separated overrides
(CSV quoting, so a ``str`` value may contain a comma inside double quotes) and
the flag may be repeated. Keys are at most 127 characters, ``str`` values at
most 127 bytes (llama.cpp's ``char[128]`` fields). An override of a key that
the file has must match its type (``int`` for every integer type); a key the
file lacks is added (as llama.cpp, where the loader finds an override for any
key it asks for, so an optional key the file omits can be supplied); a key that
is neither in the file nor read while loading matched nothing and gets a WARN
at boot naming it (``unmatched_overrides``). Overrides apply to the metadata before hparams, the
tokenizer and the chat template are read, e.g.
``gemma4.context_length=int:1048576``.

Stricter than llama.cpp on purpose: a value that does not parse as its type
(``int:12x``) is an error here, where ``atol`` would read 12.
"""

from __future__ import annotations

import csv
import difflib
import numbers
from dataclasses import dataclass
from typing import Iterable, Union

Value = Union[int, float, bool, str]
TYPES = ("int", "float", "bool", "str")
_MAX = 127  # llama_model_kv_override: char key[128], char val_str[128]


class KVOverrideError(ValueError):
    """A malformed ``--override-kv`` spec, or one whose type does not fit the file's key."""


@dataclass(frozen=True)
class KVOverride:
    """One override: ``key``, ``type`` (one of ``TYPES``) and the parsed ``value``."""

    key: str
    type: str
    value: Value

    def __str__(self) -> str:
        v = str(self.value).lower() if self.type == "bool" else self.value
        return f"{self.key}={self.type}:{v}"


def parse_kv_override(spec: str) -> KVOverride:
    """Parse one ``KEY=TYPE:VALUE``. Raises ``KVOverrideError`` naming what is wrong."""
    key, eq, rest = spec.partition("=")
    if not eq or not key:
        raise KVOverrideError(f"malformed KV override {spec!r}: expected KEY=TYPE:VALUE "
                              f"with TYPE one of {', '.join(TYPES)}")
    if len(key) > _MAX:
        raise KVOverrideError(f"malformed KV override {spec!r}: key longer than {_MAX} characters")
    typ, colon, raw = rest.partition(":")
    if not colon or typ not in TYPES:
        raise KVOverrideError(f"invalid type for KV override {spec!r}: expected one of "
                              f"{', '.join(t + ':' for t in TYPES)} after '='")
    value: Value
    try:
        if typ == "int":
            value = int(raw.strip())
        elif typ == "float":
            value = float(raw.strip())
        elif typ == "bool":
            if raw not in ("true", "false"):
                raise ValueError
            value = raw == "true"
        else:
            if len(raw.encode("utf-8")) > _MAX:
                raise KVOverrideError(f"malformed KV override {spec!r}: value longer than {_MAX} bytes")
            value = raw
    except ValueError as e:
        if isinstance(e, KVOverrideError):
            raise
        want = {"int": "an integer", "float": "a number", "bool": "true or false"}[typ]
        raise KVOverrideError(f"invalid value for KV override {spec!r}: {raw!r} is not {want}") from None
    return KVOverride(key, typ, value)


def parse_kv_overrides(values: Iterable[str]) -> list[KVOverride]:
    """Parse the values of every ``--override-kv`` flag (each may hold a CSV list)."""
    out: list[KVOverride] = []
    for v in values:
        items = next(csv.reader([v]), []) if v else [v]
        for item in items:
            out.append(parse_kv_override(item))
    return out


def _file_type(v) -> str:
    """The override type that fits a metadata value (llama.cpp ``GGUFMeta`` type classes).
    (No NumPy import here: the CLI parses overrides before NumPy may load, see ``cli.set_cpu_threads``.)"""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return "bool"
    if isinstance(v, numbers.Integral):
        return "int"
    if isinstance(v, numbers.Real):
        return "float"
    if isinstance(v, str):
        return "str"
    return "array"


def apply_kv_overrides(metadata: dict, overrides: Iterable[KVOverride], path: str = "<gguf>") -> dict:
    """A copy of ``metadata`` with ``overrides`` applied (the input is not modified).

    Raises ``KVOverrideError`` when an override's type does not match the file's value
    (llama.cpp: "Bad metadata override type"), or targets an array key.
    """
    md = dict(metadata)
    for o in overrides:
        if o.key in md:
            have = _file_type(md[o.key])
            if have == "array":
                raise KVOverrideError(f"{path}: KV override {o}: {o.key!r} is an array in the file; "
                                      f"only scalar keys can be overridden")
            if have != o.type:
                raise KVOverrideError(f"{path}: bad metadata override type for {o.key!r}: "
                                      f"the file has {have}, the override is {o.type}")
        md[o.key] = o.value
    return md


class ReadTracker(dict):
    """A metadata dict that records every key looked up (``[]``, ``get``, ``in``) in
    ``read``, so the loader can tell which overrides anything asked for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def unmatched_overrides(overrides: Iterable[KVOverride], file_metadata: dict, read: set) -> list[str]:
    """One warning line per override that matched nothing: its key is not in the
    file (``file_metadata``, before overrides) and was never looked up while
    loading (``read``, from ``ReadTracker``), so it has no effect. A close file key,
    if any, is suggested (a likely misspelling)."""
    out = []
    for o in overrides:
        if o.key in file_metadata or o.key in read:
            continue
        near = difflib.get_close_matches(o.key, list(file_metadata), n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]!r}?)" if near else " (check the key's spelling)"
        out.append(f"--override-kv {o}: key {o.key!r} is not in the model file and nothing reads it; "
                   f"the override has no effect{hint}")
    return out
