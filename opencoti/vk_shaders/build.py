"""Compile the Vulkan backend's GLSL shaders to the committed SPIR-V.

Usage::

    python -m opencoti.vk_shaders.build          # rebuild every .spv + manifest.json
    python -m opencoti.vk_shaders.build --check  # exit 1 when a .spv is stale

Each variant of ``opencoti.vk_shaders.variants()`` is compiled by ``glslc``
(shaderc; Debian package ``glslc``) with ``OPTIONS`` and its ``-D`` defines, run
from the shader folder with relative paths and no debug info, so the output
depends only on the sources and the glslc version. ``manifest.json`` records,
per variant, the sha256 of its sources (the ``.comp`` file, every file it
``#include``s, the defines and the options) and of the ``.spv``, plus the glslc
version. ``--check`` (and the CI test) recomputes the source hashes, which needs
no compiler; with glslc of the recorded version present it also recompiles and
compares bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from opencoti.vk_shaders import variants

HERE = Path(__file__).resolve().parent
OPTIONS = ["-fshader-stage=compute", "--target-env=vulkan1.0", "-O"]
MANIFEST = HERE / "manifest.json"
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.M)


class ShaderBuildError(RuntimeError):
    """glslc is missing or failed; the message has its output."""


def source_files(src: str) -> list[str]:
    """``src`` and every file it includes, transitively, in first-seen order."""
    seen: list[str] = []

    def walk(name: str) -> None:
        if name in seen:
            return
        seen.append(name)
        for inc in _INCLUDE.findall((HERE / name).read_text()):
            walk(inc)

    walk(src)
    return seen


def source_hash(src: str, defines: dict[str, str]) -> str:
    """sha256 over the sources (name + bytes), the defines and the compile options."""
    h = hashlib.sha256()
    for name in source_files(src):
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    h.update(json.dumps(sorted(defines.items())).encode())
    h.update(" ".join(OPTIONS).encode())
    return h.hexdigest()


def glslc_version(glslc: str = "glslc") -> str:
    """First line of ``glslc --version`` (e.g. ``shaderc v2023.2 v2023.2``)."""
    out = subprocess.run([glslc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip()


def compile_one(src: str, defines: dict[str, str], glslc: str = "glslc") -> bytes:
    """SPIR-V bytes of ``src`` with ``defines``. Raises ``ShaderBuildError`` with glslc's message."""
    cmd = [glslc, *OPTIONS, *(f"-D{k}={v}" for k, v in sorted(defines.items())), src, "-o", "-"]
    r = subprocess.run(cmd, cwd=HERE, capture_output=True)
    if r.returncode != 0:
        raise ShaderBuildError(f"glslc failed on {src} {defines}:\n{r.stderr.decode(errors='replace')}")
    return r.stdout


def build(glslc: str = "glslc", log=sys.stderr) -> dict:
    """Compile every variant, write ``<name>.spv`` and ``manifest.json``; returns the manifest."""
    if shutil.which(glslc) is None:
        raise ShaderBuildError(f"{glslc} not found (apt-get install glslc)")
    manifest = {"glslc": glslc_version(glslc), "options": OPTIONS, "shaders": {}}
    names = variants()
    for old in HERE.glob("*.spv"):
        if old.stem not in names:
            old.unlink()
    for name, (src, defines) in sorted(names.items()):
        spv = compile_one(src, defines, glslc)
        (HERE / f"{name}.spv").write_bytes(spv)
        manifest["shaders"][name] = {"source": src, "defines": defines,
                                     "source_sha256": source_hash(src, defines),
                                     "spv_sha256": hashlib.sha256(spv).hexdigest()}
        print(f"  {name}.spv ({len(spv)} bytes)", file=log)
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def check(glslc: str = "glslc", recompile: bool = True) -> list[str]:
    """Problems that make the committed SPIR-V stale (empty list = fresh).

    Always: every variant is in the manifest with the current source hash and its
    ``.spv`` has the recorded hash; no ``.spv`` lacks a variant. With ``recompile``
    and glslc of the manifest's version on PATH: recompiled bytes equal the file.
    """
    problems: list[str] = []
    if not MANIFEST.exists():
        return ["manifest.json missing: run python -m opencoti.vk_shaders.build"]
    man = json.loads(MANIFEST.read_text())
    names = variants()
    for name, (src, defines) in sorted(names.items()):
        ent = man["shaders"].get(name)
        spv_path = HERE / f"{name}.spv"
        if ent is None or not spv_path.exists():
            problems.append(f"{name}: not built")
            continue
        if ent["source_sha256"] != source_hash(src, defines):
            problems.append(f"{name}: sources changed since the .spv was built")
        if ent["spv_sha256"] != hashlib.sha256(spv_path.read_bytes()).hexdigest():
            problems.append(f"{name}: .spv differs from the one recorded in manifest.json")
    for extra in sorted(set(p.stem for p in HERE.glob("*.spv")) - set(names)):
        problems.append(f"{extra}.spv: no such variant")
    if recompile and not problems and shutil.which(glslc) and glslc_version(glslc) == man["glslc"]:
        for name, (src, defines) in sorted(names.items()):
            if compile_one(src, defines, glslc) != (HERE / f"{name}.spv").read_bytes():
                problems.append(f"{name}: recompiling gives different bytes")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compile opencoti's Vulkan shaders to SPIR-V (glslc).")
    ap.add_argument("--check", action="store_true", help="exit 1 when a committed .spv is stale")
    ap.add_argument("--glslc", default="glslc", help="the glslc binary")
    ns = ap.parse_args(argv)
    try:
        if ns.check:
            problems = check(ns.glslc)
            for p in problems:
                print(f"stale: {p}", file=sys.stderr)
            return 1 if problems else 0
        man = build(ns.glslc)
    except ShaderBuildError as e:
        print(f"vk_shaders.build: error: {e}", file=sys.stderr)
        return 1
    print(f"built {len(man['shaders'])} SPIR-V modules with {man['glslc']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
