"""Shared test runs of a model on a backend: the random-weight models of the ``-ngl`` tests
and a prefill + greedy decode (+ context shift) run whose logits tests compare across
backends (test_offload.py, test_vulkan_coverage.py, test_cuda.py)."""

from __future__ import annotations

import numpy as np

from opencoti.engine.batch import UBatch
from opencoti.engine.runner import ModelRunner, iter_logits


def write_ngl_model(path, arch: str, variant=None) -> None:
    """The -ngl tests' random-weight Q8_0 model of ``arch`` at ``path``: Gemma-4 by
    ``synth_gguf.GEMMA4_VARIANTS[variant]`` (seed 1), Qwen3.5 from its transformers config
    (seed 3), other architectures at hidden 256 / ffn 512 / head_dim 64 (seed 3)."""
    from opencoti.tools import synth_gguf as sg

    if arch == "gemma4":
        sg.write_random_model(arch, path, "Q8_0", seed=1, **sg.GEMMA4_VARIANTS[variant])
    elif arch == "qwen35":
        sg.write_gguf(sg.random_hf_model(arch, seed=3), path, "Q8_0")
    else:
        sg.write_random_model(arch, path, "Q8_0", seed=3, hidden_size=256, intermediate_size=512, head_dim=64)


def greedy_run(model, backend, prompt: list[int], n_gen: int, feed: list[int] | None = None, shift: bool = False,
               n_ctx: int = 64, n_ubatch: int = 16, **runner_kw):
    """Prefill ``prompt`` (sequence 0) in ubatches of ``n_ubatch``, then ``n_gen`` single-token
    steps feeding the greedy token (or ``feed[i]``: teacher forcing); with ``shift``: then drop
    positions [2, 6), shift the rest down by 4 (K re-rotated) and decode token 5 once more.
    ``runner_kw`` go to ``ModelRunner`` (n_gpu_layers, type_k, type_v). Returns (runner,
    tokens fed, float32 logits of every prompt position and step)."""
    r = ModelRunner(model, backend, n_ctx=n_ctx, n_ubatch=n_ubatch, **runner_kw)
    out = [np.concatenate([lg for _, lg in iter_logits(r, prompt)])]
    n, toks = len(prompt), []
    for i in range(n_gen):
        toks.append(int(np.argmax(out[-1][-1])) if feed is None else feed[i])
        out.append(r.decode(UBatch.build([toks[-1]], [n + i], [0], [0])))
    if shift:
        r.kv.seq_rm(0, 2, 6)
        r.seq_add(0, 6, n + n_gen, -4)
        out.append(r.decode(UBatch.build([5], [n + n_gen - 4], [0], [0])))
    return r, toks, np.concatenate(out)
