"""Shared helpers of the gemma-3-270m parity tests (CPU and CUDA)."""

import json

import numpy as np

from opencoti.engine.runner import iter_logits

CASES = ["capital", "count", "code", "unicode", "recipe", "story", "long_swa", "long_2k"]


def load_refs(shared_dir):
    """``(exact, llamacpp)``: the two reference files' cases by name (see ../shared/data/README.md)."""
    with open(shared_dir / "data/ref/gemma3_270m_transformers_f32.json", encoding="utf-8") as f:
        exact = json.load(f)
    with open(shared_dir / "data/ref/gemma3_270m_llamacpp_greedy.json", encoding="utf-8") as f:
        lcpp = json.load(f)
    return {c["name"]: c for c in exact["cases"]}, {c["name"]: c for c in lcpp["cases"]}


def logprobs(runner, tokens):
    """log-softmax rows [len(tokens), n_vocab] of a fresh run (float64 reduction, float32 storage)."""
    runner.kv.clear()
    out = []
    for _, lg in iter_logits(runner, tokens):
        m = lg.max(axis=1, keepdims=True)
        lse = np.log(np.exp((lg - m).astype(np.float64)).sum(axis=1, keepdims=True)) + m
        out.append((lg - lse).astype(np.float32))
    return np.concatenate(out)
