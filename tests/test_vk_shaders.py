"""The committed SPIR-V of the Vulkan backend is fresh and ships with the package.

Needs no Vulkan device. ``opencoti.vk_shaders.build.check`` compares each
variant's source hash (the ``.comp``, its includes, defines and glslc options)
with ``manifest.json`` and the ``.spv`` bytes with their recorded hash; where
glslc of the recorded version is installed (CI installs it) it also recompiles
every variant and compares bytes. Rebuild with ``python -m opencoti.vk_shaders.build``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from opencoti.vk_shaders import build, load_spv, variants


def test_spirv_is_fresh():
    """Every .spv was built from the current sources (hashes; needs no compiler)."""
    problems = build.check(recompile=False)
    assert problems == [], "stale SPIR-V (run python -m opencoti.vk_shaders.build):\n" + "\n".join(problems)


def test_spirv_recompiles_identically():
    """With glslc installed (CI installs it): every variant compiles, and with the glslc
    version the manifest records the output is byte-for-byte the committed .spv."""
    if shutil.which("glslc") is None:
        pytest.skip("glslc not installed (only CI and developers have it): source hashes checked above")
    man = json.loads(build.MANIFEST.read_text())
    same = build.glslc_version() == man["glslc"]
    for name, (src, defines) in sorted(variants().items()):
        spv = build.compile_one(src, defines)
        assert spv[:4] == b"\x03\x02\x23\x07", name
        if same:
            assert spv == load_spv(name), f"{name}: recompiling gives other bytes; rebuild the .spv"


def test_check_detects_a_stale_source(tmp_path, monkeypatch):
    """Editing a shader source without rebuilding is reported."""
    work = tmp_path / "vk_shaders"
    shutil.copytree(build.HERE, work, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(build, "HERE", work)
    monkeypatch.setattr(build, "MANIFEST", work / "manifest.json")
    assert build.check(recompile=False) == []
    src = work / "rope.comp"
    src.write_text(src.read_text() + "\n// edited\n")
    inc = work / "quants.glsl"
    inc.write_text(inc.read_text() + "\n// edited\n")
    problems = build.check(recompile=False)
    assert any(p.startswith("rope:") for p in problems)
    assert any(p.startswith("mul_mat_vec_q4_k:") for p in problems)  # through the include
    assert not any(p.startswith("attn_f16:") for p in problems)


def test_every_variant_loads_as_spirv():
    for name in variants():
        spv = load_spv(name)
        assert spv[:4] == b"\x03\x02\x23\x07" and len(spv) % 4 == 0, name  # SPIR-V magic, little-endian
