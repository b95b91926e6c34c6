"""What the llama-bench-style GPU benches share: the llama.cpp reference figures
(../shared/BENCHMARKS.md, one H200) and the prompt / timing helpers."""

from __future__ import annotations

import numpy as np

from opencoti.engine.batch import UBatch

# gemma-3-270m Q4_K_M, llama-bench / llama-batched-bench on one H200
LLAMA_CPP_H200 = {"pp512": 49823, "pp4096": 39022, "tg128": 939, "tg128 @ d8192": 844,
                  "decode x1": 825, "decode x8": 3987, "decode x32": 7561, "decode x64": 9391}
# Qwen2.5-7B Q4_K_M (synthetic, same shapes and types) on the same H200
LLAMA_CPP_H200_7B = {"pp512": 9467, "tg128": 251, "decode x1": 244, "decode x8": 971, "decode x32": 3398}


def llama_cpp_refs(model_name: str) -> dict:
    """The llama.cpp figures measured on the same model (by name), else ``{}``."""
    if "7B" in model_name:
        return LLAMA_CPP_H200_7B
    return LLAMA_CPP_H200 if "270m" in model_name.lower() else {}


def prefill(runner, n: int, seq: int = 0, pos0: int = 0, seed: int = 0) -> None:
    """Decode ``n`` random tokens (ids in ``[100, min(20000, n_vocab))``) of sequence ``seq``
    from position ``pos0`` in ubatches of ``runner.n_ubatch``, logits for the last row only."""
    hi = min(20000, runner.model.hparams.n_vocab)
    toks = np.random.default_rng(seed).integers(min(100, hi - 1), hi, n)
    for s in range(0, n, runner.n_ubatch):
        c = toks[s:s + runner.n_ubatch]
        m = len(c)
        runner.decode(UBatch.build(c, np.arange(pos0 + s, pos0 + s + m), [seq] * m, [m - 1]))


def timed(fn, reps: int) -> list:
    """``fn()``'s results over ``reps`` runs after one warm-up run (compiles, graph captures,
    allocations)."""
    return [fn() for _ in range(reps + 1)][1:]


def token(runner, i: int) -> int:
    """The ``i``-th decode input token: 1000 + i, wrapped into the model's vocabulary."""
    return (1000 + i) % runner.model.hparams.n_vocab
