"""Per-kernel GPU time of one decode step, through Nsight Compute (issue 4 measurements).

    ncu --nvtx --nvtx-include step/ --metrics gpu__time_duration.sum \\
        --cache-control none --clock-control none --csv \\
        python bench/profile_kernels.py -m model.gguf --seqs 1 > step.csv
    python bench/profile_kernels.py --summarize step.csv

The first form prefills ``--seqs`` sequences to ``--depth`` tokens on the CUDA backend, runs
three eager decode steps (CUDA graphs off, so every kernel is its own launch) and a fourth
inside an NVTX range named ``step``, which the ncu command above profiles kernel by kernel
(``--cache-control none --clock-control none``: warm caches and real clocks, as in a graph
replay; ncu's defaults flush the caches and lock the clocks, which inflates small kernels).
``--shared N``: every sequence first shares an N-token pool prefix (PolyKV's shared-prefix
attention). ``--prefill N`` profiles one N-token prefill ubatch instead. ``-ctk`` / ``-ctv`` pick the KV
cache tiers (default f16 / f16). ``--summarize`` aggregates such a
CSV by kernel name and grid: calls, total and mean microseconds, largest first.
``--graph``: the steps run as the server's do, the first capturing a CUDA graph and the fourth
replaying it (ncu's default ``--graph-profiling node`` times each kernel node of the replay).
A graph's launch shapes follow its cell buckets (a power of two, ``cuda._bucket``), not the
step's exact lengths, so its split counts, and with them some kernels' times, differ from the
eager step's. (The fourth step replays what an earlier step captured only if its rows are in that
step's bucket: at ``--depth`` 2^k - 3 it crosses into the next one and captures instead.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def step(model_path: str, n_seq: int, depth: int, type_k: str = "f16", type_v: str = "f16", shared: int = 0,
         graph: bool = False) -> None:
    import cupy as cp
    from cupy.cuda import nvtx

    from common import prefill

    from opencoti.engine.batch import UBatch
    from opencoti.engine.runner import ModelRunner
    from opencoti.model.loader import load_model

    model = load_model(model_path, with_tokenizer=False)
    r = ModelRunner(model, "cuda", n_ctx=n_seq * (depth + 64) + shared + 256, n_seq_max=n_seq + 1, n_ubatch=512,
                    type_k=type_k, type_v=type_v)
    r.backend.graphs = graph
    if shared:  # a pool's prefix (seq n_seq) that every sequence shares (PolyKV, unified cache)
        prefill(r, shared, seq=n_seq, seed=n_seq)
    for s in range(n_seq):
        if shared:
            r.kv.seq_cp(n_seq, s, 0, shared)
        prefill(r, depth, seq=s, pos0=shared, seed=s)
    for i in range(4):
        if i == 3:
            nvtx.RangePush("step")
        ub = UBatch.build([1000 + i + s for s in range(n_seq)], [shared + depth + i] * n_seq, list(range(n_seq)),
                          list(range(n_seq)))
        ub.share_src.update({s: n_seq for s in range(n_seq)} if shared else {})
        r.decode(ub)
        cp.cuda.Device().synchronize()
        if i == 3:
            nvtx.RangePop()


def prefill_step(model_path: str, n: int) -> None:
    """One prefill ubatch of ``n`` tokens inside the NVTX range ``step`` (after one unprofiled
    ubatch of the same size: compiles, scratch allocations)."""
    import cupy as cp
    from cupy.cuda import nvtx

    from common import prefill

    from opencoti.engine.runner import ModelRunner
    from opencoti.model.loader import load_model

    model = load_model(model_path, with_tokenizer=False)
    r = ModelRunner(model, "cuda", n_ctx=2 * n + 256, n_seq_max=2, n_ubatch=n)
    prefill(r, n, seq=0)
    cp.cuda.Device().synchronize()
    nvtx.RangePush("step")
    prefill(r, n, seq=1, seed=1)
    cp.cuda.Device().synchronize()
    nvtx.RangePop()


def summarize(path: str) -> None:
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    h = rows[0]
    ki, gi, mi, ui, vi = (h.index(k) for k in ("Kernel Name", "Grid Size", "Metric Name", "Metric Unit",
                                                "Metric Value"))
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    agg: dict = collections.defaultdict(list)
    for r in rows[1:]:
        if r[mi] == "gpu__time_duration.sum":
            agg[(r[ki].split("(")[0], r[gi])].append(float(r[vi].replace(",", "")) * scale[r[ui]])
    total = sum(sum(v) for v in agg.values())
    print(f"\n{sum(len(v) for v in agg.values())} kernels, {total:,.1f} us in all\n")
    print("| kernel | grid | calls | us | us / call |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (k, g), v in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {k} | {g} | {len(v)} | {sum(v):,.1f} | {sum(v) / len(v):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="profile one N-token prefill ubatch instead")
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", default="f16")
    ap.add_argument("--shared", type=int, default=0, metavar="N",
                    help="every sequence shares an N-token pool prefix before its --depth tokens (PolyKV)")
    ap.add_argument("--graph", action="store_true", help="profile a CUDA graph replay of the step (as served)")
    ap.add_argument("--summarize", metavar="CSV", default=None, help="aggregate an ncu --csv dump instead")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
    elif a.model and a.prefill:
        prefill_step(a.model, a.prefill)
    elif a.model:
        step(a.model, a.seqs, a.depth, a.cache_type_k, a.cache_type_v, a.shared, a.graph)
    else:
        ap.error("-m MODEL (run a step) or --summarize CSV")


if __name__ == "__main__":
    main()
