"""Version, build tag and the per-build runtime cache directory.

The full version string is ``opencoti-<ver>-<tag>``: ``<ver>`` is the package
version, ``<tag>`` the build tag written by ``build_zipapp.py`` into
``opencoti/_build_tag.py`` (the git commit the .pyz was built from). A source
checkout without that file uses the tag ``dev``.

The runtime cache (assembled default model, compiled CUDA kernels) lives in
``~/.llamafile/v/opencoti-<ver>-<tag>/``, one directory per build, as
llamafile keeps one per version.
"""

from __future__ import annotations

import os
from pathlib import Path

__version__ = "0.1.0"

try:  # written by build_zipapp.py; absent in a source checkout
    from opencoti._build_tag import BUILD_TAG  # type: ignore
except ImportError:  # pragma: no cover - depends on how we were installed
    BUILD_TAG = "dev"


def full_version() -> str:
    """Return ``opencoti-<ver>-<tag>``, the string ``--version`` prints."""
    return f"opencoti-{__version__}-{BUILD_TAG}"


def cache_dir(create: bool = True) -> Path:
    """Return the runtime cache directory ``~/.llamafile/v/opencoti-<ver>-<tag>/``.

    ``HOME`` decides the location (``Path.home()``); the directory is created
    when ``create`` is true. Raises ``OSError`` if it cannot be created.
    """
    path = Path.home() / ".llamafile" / "v" / full_version()
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def env_flag(name: str) -> bool:
    """True when environment variable ``name`` is set to a truthy value (1/true/yes/on)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
