"""Host time of a decode step's KV bookkeeping (no network, CPU only).

    python bench/profile_kv_host.py [-m /tmp/g270.gguf] [--seqs 1,8,32,64] [--steps 64]
                                    [--depth 512] [--profile N]

For N concurrent sequences (unified KV, each filled with ``--depth`` positions through
``KVCacheSet.prepare`` / ``apply`` alone, in ubatches of 512) it times what runs on the host
before every one-token-per-sequence decode step: ``prepare`` + ``apply`` (as
``ModelRunner.decode``) and the plans' ``flat`` / ``view_lens`` (as the CUDA backend's
``run_graph``). An iSWA model (gemma-3) has two caches, sliding and global. Prints a
markdown table of milliseconds per step (mean over ``--steps``). ``--profile N`` prints a
cProfile of the N-sequence steps instead.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.batch import UBatch  # noqa: E402
from opencoti.engine.runner import ModelRunner  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402


def setup(model, ns: int, depth: int, steps: int) -> ModelRunner:
    """A CPU runner for ``ns`` sequences whose KV holds positions ``[0, depth)`` of each."""
    r = ModelRunner(model, "cpu", n_ctx=ns * (depth + steps + 64) + 256, n_seq_max=ns, n_ubatch=512)
    for s in range(ns):
        for o in range(0, depth, 512):
            n = min(512, depth - o)
            ub = UBatch.build(np.full(n, 100), np.arange(o, o + n), [s] * n, [n - 1])
            plans = r.kv.prepare(ub.seq_id, ub.pos)
            r.kv.apply(plans, ub.seq_id, ub.pos, ub.share_src)
    return r


def step(r: ModelRunner, ns: int, p: int) -> None:
    """One decode step's host bookkeeping: every sequence writes position ``p``."""
    ub = UBatch.build([1000 + s for s in range(ns)], [p] * ns, list(range(ns)), list(range(ns)))
    ub.plans = r.kv.prepare(ub.seq_id, ub.pos)
    r.kv.apply(ub.plans, ub.seq_id, ub.pos, ub.share_src)
    for c, plan in zip(r.kv.caches, ub.plans):
        plan.flat(c.n_cells)
        int(plan.view_lens().max(initial=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="/tmp/g270.gguf")
    ap.add_argument("--seqs", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="timed passes (best kept)")
    ap.add_argument("--profile", type=int, default=0)
    a = ap.parse_args()
    model = load_model(a.model, with_tokenizer=False)
    if a.profile:
        r = setup(model, a.profile, a.depth, a.steps)
        pr = cProfile.Profile()
        pr.enable()
        for i in range(a.steps):
            step(r, a.profile, a.depth + i)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        return
    print(f"\nKV host bookkeeping: {model.name}, depth {a.depth}, {a.steps} steps, best of {a.reps}\n")
    print("| seqs | caches | prepare+apply+flat ms/step |")
    print("| ---: | ---: | ---: |")
    for ns in [int(x) for x in a.seqs.split(",") if x]:
        best = float("inf")
        for _ in range(a.reps):
            r = setup(model, ns, a.depth, a.steps)
            step(r, ns, a.depth)  # warm-up
            t0 = time.perf_counter()
            for i in range(1, a.steps + 1):
                step(r, ns, a.depth + i)
            best = min(best, (time.perf_counter() - t0) / a.steps)
        print(f"| {ns} | {len(r.kv.caches)} | {1e3 * best:.3f} |")


if __name__ == "__main__":
    main()
