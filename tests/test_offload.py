"""Partial GPU offload (``-ngl N``, ``opencoti/engine/backend/offload.py``).

The placement rule (llama.cpp ``load_tensors``: ``i_gpu_start = max(n_layer - N, 0)``,
the output layer offloaded only when ``N > n_layer``, embeddings on the CPU) and its boot
line are checked on the CPU. The split itself runs on Vulkan (CI: Mesa's lavapipe, as
``test_vulkan.py``; skipped without a Vulkan device unless ``OPENCOTI_REQUIRE_VULKAN=1``):
tiny random-weight models with ``-ngl`` 1, n_layer - 1 and n_layer + 1 give the CPU
backend's greedy tokens and its logits within ``test_vulkan.py``'s tiny-model tolerance
(2e-3 of the largest logit), each layer's weights and KV living on its backend; Gemma-4
E-series (KV-sharing layers across the boundary, per-layer inputs) and a hybrid Qwen3.5
(recurrent state per layer) too; ``Engine``'s boot line; and a server completion on a split.
CUDA takes the same path (``tests/test_cuda.py -k ngl``).
"""

from __future__ import annotations

import numpy as np
import pytest

from opencoti.engine.backend import get_backend, select_backend
from opencoti.engine.backend.cpu import CPUBackend
from opencoti.engine.backend.offload import LayerSplit, make_split, offload_message
from decode_runs import greedy_run, write_ngl_model
from vk_guard import DEVICE, vulkan_devices


class _FakeGPU(CPUBackend):
    """A second backend object (named like a GPU) for the placement arithmetic only."""

    name = "fakegpu"


# ---------------------------------------------------------------------------------------
# placement (CPU only)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_layer,ngl,i_gpu_start,out_gpu", [(8, 1, 7, False), (8, 7, 1, False),
                                                              (8, 8, 0, False), (26, 10, 16, False)])
def test_split_placement_follows_llamacpp(n_layer, ngl, i_gpu_start, out_gpu):
    cpu, gpu = get_backend("cpu"), _FakeGPU()
    s = make_split(gpu, n_layer, ngl)
    assert isinstance(s, LayerSplit) and s.cpu is cpu and s.gpu is gpu
    assert s.i_gpu_start == i_gpu_start
    assert [s.layer(il) is gpu for il in range(n_layer)] == [il >= i_gpu_start for il in range(n_layer)]
    assert (s.output is gpu) == out_gpu and s.input is cpu
    assert s.describe().startswith(f"offloaded {ngl}/{n_layer + 1} layers to GPU")


def test_no_split_for_default_all_layers_or_cpu():
    gpu = _FakeGPU()
    assert make_split(gpu, 8, -1) is None  # default: everything on the GPU backend
    assert make_split(gpu, 8, 9) is None  # n_layer + 1: every layer and the output
    assert make_split(gpu, 8, 999) is None
    assert make_split(get_backend("cpu"), 8, 3) is None  # nothing to split on the CPU
    with pytest.raises(ValueError):
        make_split(gpu, 8, 0)
    assert select_backend("vulkan", 0).name == "cpu"  # -ngl 0: the CPU backend
    assert select_backend("nvidia", 0).name == "cpu"


def test_offload_message():
    assert offload_message(8, -1) == "offloaded 9/9 layers to GPU"
    assert offload_message(8, 3) == "offloaded 3/9 layers to GPU"
    assert offload_message(8, 100) == "offloaded 9/9 layers to GPU"
    assert offload_message(18, 0) == "offloaded 0/19 layers to GPU"


# ---------------------------------------------------------------------------------------
# Vulkan splits
# ---------------------------------------------------------------------------------------


def _vulkan():
    vulkan_devices(module_level=False)
    return get_backend("vulkan", DEVICE)


@pytest.fixture(scope="module")
def vk():
    return _vulkan()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch, **over) -> a random-weight Q8_0 model (cached), as test_vulkan.py's."""
    pytest.importorskip("transformers")
    from opencoti.model.loader import load_model

    root, cache = tmp_path_factory.mktemp("ngl"), {}

    def get(arch, variant=None, tokenizer=False):
        key = (arch, variant, tokenizer)
        if key not in cache:
            path = root / f"{arch}-{variant}.gguf"
            write_ngl_model(path, arch, variant)
            cache[key] = load_model(str(path), with_tokenizer=tokenizer)
        return cache[key]
    return get


def _run(model, backend, ngl, prompt, n_gen, shift=False):
    """``greedy_run`` with ``-ngl ngl``: (runner, greedy tokens, logits of every step)."""
    return greedy_run(model, backend, prompt, n_gen, shift=shift, n_gpu_layers=ngl)


def _close(got, want):
    err = float(np.max(np.abs(got - want)))
    assert err < 2e-3 * max(1.0, float(np.max(np.abs(want)))), err  # test_vulkan.py's tiny-model tolerance


PROMPT = [(i * 37 + 11) % 300 for i in range(20)]


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_split_matches_cpu(tiny, vk, arch):
    """-ngl 1, n_layer - 1 (layers on both backends, output on the CPU) and n_layer + 1 (no
    split: the all-Vulkan network): the CPU backend's greedy tokens and logits, prefill in
    ubatches of 16 and single-token decode, then a context shift (K re-rotated on each
    layer's backend). Each layer's weights and K/V live on its backend."""
    from opencoti.engine.backend.vulkan import QTensor, VkTensor

    model = tiny(arch)
    n = model.hparams.n_layer
    _, want_toks, want = _run(model, "cpu", -1, PROMPT, 4, shift=True)
    for ngl in (1, n - 1, n + 1):
        r, toks, got = _run(model, vk, ngl, PROMPT, 4, shift=True)
        assert toks == want_toks, ngl
        _close(got, want)
        if ngl > n:
            assert r.split is None and r.net is model.network(vk)  # today's all-GPU path
            continue
        g0 = n - ngl
        assert r.split.i_gpu_start == g0 and r.net.backend_out.name == "cpu"
        assert isinstance(r.net.tok_embd, np.ndarray) and isinstance(r.net.output, np.ndarray)
        for il, L in enumerate(r.net.layers):
            on_gpu = il >= g0
            assert isinstance(L.wq, QTensor if on_gpu else np.ndarray), (ngl, il)
            c = r.kv.layer_cache[il]
            assert isinstance(c.k[il], VkTensor if on_gpu else np.ndarray), (ngl, il)
            assert isinstance(c.v[il], VkTensor if on_gpu else np.ndarray), (ngl, il)


@pytest.mark.parametrize("arch,variant,ngl", [("gemma4", "e_series", 2), ("qwen35", None, 2)])
def test_split_special_layers_match_cpu(tiny, vk, arch, variant, ngl):
    """Gemma-4 E-series with -ngl 2: GPU layers 6, 7 reuse the KV of CPU layers 2, 3 (a copy
    per ubatch) and read per-layer inputs computed on the CPU; Qwen3.5 hybrid with -ngl 2:
    a recurrent and an attention layer on each backend. CPU tokens and logits."""
    model = tiny(arch, variant)
    _, want_toks, want = _run(model, "cpu", -1, PROMPT, 3)
    r, toks, got = _run(model, vk, ngl, PROMPT, 3)
    assert r.split is not None and toks == want_toks
    _close(got, want)


def test_engine_boot_line(tiny, vk, capsys):
    """Engine prints llama.cpp's ``offloaded N/M layers to GPU`` (M = n_layer + 1) for a
    split, for the all-GPU default and for -ngl 0 (which runs on the CPU backend)."""
    from opencoti.engine.engine import Engine
    from opencoti.params import Params

    model = tiny("gemma3")
    n = model.hparams.n_layer
    for ngl, want, backend in ((3, f"offloaded 3/{n + 1} layers to GPU", "vulkan"),
                               (-1, f"offloaded {n + 1}/{n + 1} layers to GPU", "vulkan"),
                               (0, f"offloaded 0/{n + 1} layers to GPU", "cpu")):
        eng = Engine(model, Params(n_ctx=64, n_parallel=1, gpu="vulkan", main_gpu=DEVICE, n_gpu_layers=ngl))
        err = capsys.readouterr().err
        assert want in err, err
        assert eng.runner.backend.name == backend
        assert (eng.runner.split is not None) == (ngl == 3)
    assert f"cpu: layers 0-{n - 4} and token embeddings; vulkan: layers {n - 3}-{n - 1}; output: cpu" in \
        Engine(model, Params(n_ctx=64, gpu="vulkan", main_gpu=DEVICE, n_gpu_layers=3)).runner.split.describe()


def test_server_completion_on_a_split(tiny, vk):
    """A server started with --gpu vulkan -ngl 2 answers /completion with the CPU
    backend's greedy tokens."""
    import test_server as ts

    from opencoti.http.server import make_server, start_in_thread, stop_server
    from opencoti.params import Params

    model = tiny("gemma3", tokenizer=True)
    _, want, _ = _run(model, "cpu", -1, PROMPT, 5)
    params = Params(n_ctx=64, n_parallel=1, port=0, gpu="vulkan", main_gpu=DEVICE, n_gpu_layers=2)
    httpd, engine = make_server(model, params)
    start_in_thread(httpd)
    try:
        assert engine.runner.split is not None and engine.runner.split.i_gpu_start == model.hparams.n_layer - 2
        status, _, body = ts.call(httpd.server_address[1], "POST", "/completion",
                                  {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "return_tokens": True})
        assert status == 200, body
        assert body["tokens"] == want
    finally:
        stop_server(httpd, engine)
