"""Shared pytest fixtures.

- ``repo_root``: the checkout's root directory (``Path``).
- ``shared_dir``: the read-only reference data folder: ``$OPENCOTI_SHARED`` when
  set, else ``../shared`` next to the checkout (CI clones the repo into a fresh
  folder with ``shared/`` beside it). Reference data lives under
  ``shared_dir / "data"`` (``ref/``, ``vocab/``, ``templates/``).
- ``model_path``: the real default model (gemma-3-270m Q4_K_M) as a ``str`` path,
  assembled once into the runtime cache dir by
  ``opencoti.model.default_model.default_model_path`` (a few seconds the first
  time on a machine, a ``stat`` afterwards). Session-scoped.
- ``synth128_path``: a dense random-weight llama-style model with head_dim 128
  (``opencoti.tools.kv_tier_quality.SYNTH128``), written once per session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_path() -> Path:
    """The shared reference folder (see module doc); usable outside fixtures, e.g. at import time."""
    env = os.environ.get("OPENCOTI_SHARED")
    return Path(env).resolve() if env else (REPO_ROOT.parent / "shared").resolve()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    path = shared_path()
    if not (path / "data").is_dir():
        pytest.fail(f"shared reference data not found at {path} (set OPENCOTI_SHARED to the shared/ folder)")
    return path


@pytest.fixture(scope="session")
def model_path() -> str:
    from opencoti.model.default_model import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def synth128_path(tmp_path_factory) -> str:
    """A dense llama-style random-weight model with head_dim 128 (``kv_tier_quality.SYNTH128``),
    written once per session as F16 GGUF."""
    from opencoti.tools.kv_tier_quality import write_synth128

    return write_synth128(tmp_path_factory.mktemp("synth128") / "synth128.gguf")


# -- Vulkan test modules (they skip first through vk_guard.vulkan_devices) ----------------
@pytest.fixture(scope="module")
def vk():
    from vk_guard import DEVICE

    from opencoti.engine.backend import get_backend

    return get_backend("vulkan", DEVICE)


@pytest.fixture(scope="module")
def cpu():
    from opencoti.engine.backend.cpu import CPUBackend

    return CPUBackend()


@pytest.fixture
def gpu_paths(vk):
    """Force the code paths a GPU takes (32 lanes per GEMV row, tiled GEMM past 8
    tokens, split-K attention, here from 16 cells per split) on whatever device runs
    the tests; restored after."""
    saved = (vk.gemv_lanes, vk.gemv_max_tokens, vk.attn_target_groups, vk.attn_split_cells)
    vk.gemv_lanes, vk.gemv_max_tokens, vk.attn_target_groups, vk.attn_split_cells = 32, 8, 512, 16
    yield vk
    vk.gemv_lanes, vk.gemv_max_tokens, vk.attn_target_groups, vk.attn_split_cells = saved


@pytest.fixture(scope="module")
def server(model_path):
    """A server on the default model (n_ctx 1024, 2 slots, /metrics on), one per test module,
    on a free port: ``{"port", "base", "httpd", "engine", "model", "params"}``. Modules that need
    other settings define their own ``server``."""
    from opencoti.http.server import make_server, start_in_thread, stop_server
    from opencoti.model.loader import load_model
    from opencoti.params import Params

    params = Params(model=model_path, n_ctx=1024, n_parallel=2, port=0, endpoint_metrics=True)
    model = load_model(model_path, params)
    httpd, engine = make_server(model, params)
    start_in_thread(httpd)
    port = httpd.server_address[1]
    yield {"port": port, "base": f"http://127.0.0.1:{port}", "httpd": httpd, "engine": engine, "model": model,
           "params": params}
    stop_server(httpd, engine)
