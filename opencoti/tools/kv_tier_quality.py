"""Teacher-forced quality of KV tiers against the f16 cache (the gates of issue 6).

For a token sequence, the model runs once with an f16 KV cache (the reference) and once
with the tier pair under test, on the same backend; at each scored position it compares
the next-token distributions: KL divergence ``KL(P_f16 || P_tier)`` (nats) and whether
the top-1 token agrees. Teacher forcing (both runs read the same tokens) keeps one
near-tie from derailing the rest (DESIGN.md "Testing").

``python -m opencoti.tools.kv_tier_quality [--model gemma|synth128|PATH] [--tiers ...]``
prints the table (tier, bits/value, KV MiB at a context, mean KLD, top-1 agreement) that
``opencoti/engine/kv_tiers/__init__.py`` publishes and ``tests/test_kv_tier_quality.py``
bounds. The default model set and sequences are exactly the tests'.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from opencoti.engine.batch import UBatch
from opencoti.engine.kv_cache import KVCacheSet
from opencoti.engine.runner import ModelRunner

MIB = 1024 * 1024


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of float32 logits ``[n, n_vocab]`` -> float32 (sums in float64)."""
    x = np.asarray(x, dtype=np.float32)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32) + m
    return x - lse


def scored_logprobs(runner: ModelRunner, tokens: Sequence[int], rows: np.ndarray) -> np.ndarray:
    """Feed ``tokens`` to sequence 0 of a cleared ``runner`` in ubatches of ``runner.n_ubatch``
    and return the log-probabilities (float32 ``[len(rows), n_vocab]``) predicted at positions
    ``rows`` (sorted; row i predicts token i+1); only those rows get logits."""
    runner.kv.clear()
    out = []
    rows = np.asarray(rows)
    for s in range(0, len(tokens), runner.n_ubatch):
        chunk = list(tokens[s:s + runner.n_ubatch])
        n = len(chunk)
        want = rows[(rows >= s) & (rows < s + n)] - s
        ub = UBatch.build(chunk, np.arange(s, s + n), [0] * n, want)
        lg = runner.decode(ub)
        if len(want):
            out.append(log_softmax(lg))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


@dataclass
class Quality:
    """Mean KL(P_ref || P_tier) in nats, top-1 agreement (fraction) and the number of scored positions."""

    kld: float
    top1: float
    n: int


def _stats(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row KL(ref || got) (float64) and top-1 agreement of log-prob rows ``[n, n_vocab]``."""
    kl = (np.exp(ref) * (ref - got)).sum(axis=1, dtype=np.float64)
    return kl, ref.argmax(axis=1) == got.argmax(axis=1)


def compare(ref: np.ndarray, got: np.ndarray) -> Quality:
    """``Quality`` of log-prob rows ``got`` against ``ref`` (both ``[n, n_vocab]``)."""
    kl, top1 = _stats(ref, got)
    return Quality(float(kl.mean()), float(top1.mean()), len(ref))


def tier_quality(model, sequences: Sequence[tuple[Sequence[int], np.ndarray]], pairs: Sequence[tuple[str, str]],
                 n_ctx: int, n_ubatch: int = 512, backend=None) -> dict:
    """``{(type_k, type_v): Quality}`` over ``sequences`` = ``[(tokens, scored rows), ...]``,
    pooled over all scored positions, each pair against the f16/f16 run of the same runner
    geometry (``n_ctx`` cells, one sequence). One sequence's reference rows are held at a time."""
    runners = {p: ModelRunner(model, backend, n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=p[0], type_v=p[1])
               for p in [("f16", "f16"), *pairs]}
    acc: dict = {p: ([], []) for p in pairs}
    for toks, rows in sequences:
        ref = scored_logprobs(runners[("f16", "f16")], toks, rows)
        for p in pairs:
            kl, top1 = _stats(ref, scored_logprobs(runners[p], toks, rows))
            acc[p][0].append(kl)
            acc[p][1].append(top1)
    return {p: Quality(float(np.concatenate(a[0]).mean()), float(np.concatenate(a[1]).mean()),
                       int(sum(len(x) for x in a[0]))) for p, a in acc.items()}


def kv_mib(hp, n_ctx: int, type_k: str, type_v: str) -> float:
    """KV MiB (K + V, every cache) of one unified sequence of ``n_ctx`` cells in these tiers."""
    kb, vb = KVCacheSet.estimate_bytes(hp, n_ctx, 1, True, 512, type_k, type_v)
    return (kb + vb) / MIB


# -- the gates' fixed inputs -------------------------------------------------------------
GEMMA_CASES = ("code", "long_swa")  # long_swa: 767 tokens, past the 512-token window
LONG_CASE, LONG_TOKENS, LONG_FROM = "long_2k", 1024, 512  # past the window: 1024 tokens, scored from 512
SYNTH128 = dict(arch="llama", head_dim=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=384, seed=7)


def score_rows(n: int, every: int = 8, tail: int = 32, start: int = 0) -> np.ndarray:
    """Positions scored in a sequence of ``n`` tokens: every ``every``-th position from
    ``start`` plus the last ``tail`` predictions (the reference cases' greedy steps)."""
    i = np.arange(start, n - 1)
    return i[(i % every == 0) | (i >= n - 1 - tail)]


def gemma_sequences(shared_data: Path, cases=GEMMA_CASES) -> list:
    """The reference cases' prompt + greedy tokens (``ref/gemma3_270m_transformers_f32.json``)
    with their ``score_rows``."""
    by = _gemma_cases(shared_data)
    seqs = []
    for name in cases:
        toks = by[name]["prompt_tokens"] + [s["id"] for s in by[name]["steps"]]
        seqs.append((toks, score_rows(len(toks))))
    return seqs


def gemma_long_sequence(shared_data: Path) -> list:
    """The first ``LONG_TOKENS`` prompt tokens of ``LONG_CASE``, scored every 8th position from
    ``LONG_FROM`` (the sliding window): ``[(tokens, rows)]``."""
    toks = _gemma_cases(shared_data)[LONG_CASE]["prompt_tokens"][:LONG_TOKENS]
    return [(toks, score_rows(len(toks), tail=0, start=LONG_FROM))]


def _gemma_cases(shared_data: Path) -> dict:
    with open(Path(shared_data) / "ref" / "gemma3_270m_transformers_f32.json", encoding="utf-8") as f:
        return {c["name"]: c for c in json.load(f)["cases"]}


def synth_sequences(n_vocab: int = 384) -> list:
    """Two fixed pseudo-random 160-token sequences for the synthetic model, every position scored."""
    rng = np.random.default_rng(11)
    return [(rng.integers(0, n_vocab, 160).tolist(), np.arange(159)) for _ in range(2)]


def write_synth128(path) -> str:
    """Write the head_dim-128 dense llama-style random model (``SYNTH128``) as F16 GGUF; returns the path."""
    from opencoti.tools import synth_gguf as sg

    cfg = dict(SYNTH128)
    arch, seed = cfg.pop("arch"), cfg.pop("seed")
    sg.write_random_model(arch, path, "F16", seed=seed, **cfg)
    return str(path)


# asymmetric pairs measured too: which half is more sensitive (auto-tier walks V first)
ASYMMETRIC = (("f16", "q4_0"), ("q4_0", "f16"), ("q8_0", "turbo3"), ("turbo3", "q8_0"))


def all_pairs() -> list[tuple[str, str]]:
    """Every tier symmetric (K and V the same) except the f16 reference, then ``ASYMMETRIC``."""
    from opencoti.engine.kv_tiers import TIER_NAMES

    return [(t, t) for t in TIER_NAMES if t != "f16"] + list(ASYMMETRIC)


def table(hp, q: dict, ctx_for_mib: int) -> list[str]:
    """Markdown table rows of ``tier_quality``'s result ``q`` for a model with hparams ``hp``."""
    from opencoti.engine.kv_tiers import get_tier

    f16 = kv_mib(hp, ctx_for_mib, "f16", "f16")
    lines = [f"| type_k / type_v | bits/value (K, V) | KV MiB @ n_ctx {ctx_for_mib} | mean KLD (nats) | top-1 agree |",
             "| --- | --- | --- | --- | --- |",
             f"| f16 / f16 | 16, 16 | {f16:.1f} | 0 | 1 |"]
    for (tk, tv), r in q.items():
        bk, bv = get_tier(tk).bits_per_value, get_tier(tv).bits_per_value
        lines.append(f"| {tk} / {tv} | {bk:g}, {bv:g} | {kv_mib(hp, ctx_for_mib, tk, tv):.1f} | "
                     f"{r.kld:.3g} | {r.top1:.4f} |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma", help="gemma (the default model), synth128, or a GGUF path")
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2].parent / "shared" / "data"))
    ap.add_argument("--pairs", nargs="*", help="type_k/type_v pairs (default: every tier symmetric)")
    ap.add_argument("--ctx-for-mib", type=int, default=32768)
    ap.add_argument("--raw", action="store_true", help="also print the unrounded results")
    ap.add_argument("--long", action="store_true",
                    help="gemma: the long check (LONG_CASE, positions past the 512-token window only)")
    args = ap.parse_args(argv)
    from opencoti.model.loader import load_model

    if args.model == "gemma":
        from opencoti.model.default_model import default_model_path

        model = load_model(str(default_model_path()), with_tokenizer=False)
        seqs = gemma_long_sequence(Path(args.shared)) if args.long else gemma_sequences(Path(args.shared))
    elif args.model == "synth128":
        import tempfile

        path = write_synth128(Path(tempfile.mkdtemp()) / "synth128.gguf")
        model = load_model(path, with_tokenizer=False)
        seqs = synth_sequences()
    else:
        model = load_model(args.model, with_tokenizer=False)
        seqs = synth_sequences(model.hparams.n_vocab)
    pairs = [tuple(p.split("/")) for p in args.pairs] if args.pairs else all_pairs()
    n_ctx = {"gemma": 1280 if args.long else 1024, "synth128": 256}.get(
        args.model, max(256, max(len(t) for t, _ in seqs)))
    t0 = time.time()
    q = tier_quality(model, seqs, pairs, n_ctx)
    for line in table(model.hparams, q, args.ctx_for_mib):
        print(line)
    if args.raw:  # the exact values, for the tests' bounds
        print({p: (r.kld, r.top1) for p, r in q.items()})
    print(f"({sum(len(r) for _, r in seqs)} scored positions, {time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
