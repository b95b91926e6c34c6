"""Where a decode step's time goes on a GPU backend (issue 4 measurements).

    python bench/profile_decode.py [-m model.gguf] [--seqs 1,8,32,64] [--steps 64]

For N concurrent sequences (each prefilled with 512 tokens, unified KV) it runs
decode steps through ``ModelRunner``'s graph path and splits the wall time of a
step into: KV plan + apply (NumPy bookkeeping), the rest of ``run_graph`` on the
host (index staging, launch), GPU replay of the captured graph (CUDA events),
and the logits copy to the host. Prints a table, one row per N (milliseconds
per step, mean over ``--steps``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.batch import UBatch  # noqa: E402
from opencoti.engine.runner import ModelRunner  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--seqs", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--depth", type=int, default=512)
    a = ap.parse_args()
    import cupy as cp

    model = load_model(a.model, with_tokenizer=False)
    print(f"\nprofile: {model.name}, depth {a.depth}, {a.steps} steps\n")
    print("| seqs | step ms | tok/s | plan+apply ms | run_graph host ms | GPU replay ms | logits D2H ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ns in [int(x) for x in a.seqs.split(",") if x]:
        r = ModelRunner(model, "cuda", n_ctx=ns * (a.depth + a.steps + 64) + 256, n_seq_max=ns, n_ubatch=512)
        for s in range(ns):
            toks = np.random.default_rng(s).integers(100, 20000, a.depth)
            for o in range(0, a.depth, 512):
                c = toks[o:o + 512]
                r.decode(UBatch.build(c, np.arange(o, o + len(c)), [s] * len(c), [len(c) - 1]))
        b = r.backend
        t_plan = t_rg = t_gpu = t_d2h = t_all = 0.0
        n = 0
        for i in range(a.steps + 4):
            ub = UBatch.build([1000 + i + s for s in range(ns)], [a.depth + i] * ns, list(range(ns)), list(range(ns)))
            t0 = time.perf_counter()
            ub.plans = r.kv.prepare(ub.seq_id, ub.pos)
            r.kv.apply(ub.plans, ub.seq_id, ub.pos, ub.share_src)
            t1 = time.perf_counter()
            b.run_graph(ub, r.kv.caches, lambda ub=ub: r.net.forward(ub, r.kv), r.graphs)
            t2 = time.perf_counter()
            if i < 4:  # captures and warm-up
                continue
            key = [k for k in r.graphs if k[0] == ns]
            if key:  # replay the step's graph alone, timed with events, then its logits copy
                g = r.graphs[key[-1]]
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                st = cp.cuda.get_current_stream()
                e0.record(st)
                g["graph"].launch(stream=st)
                e1.record(st)
                e1.synchronize()
                gpu = cp.cuda.get_elapsed_time(e0, e1) / 1e3
                t3 = time.perf_counter()
                b._pinned_host(g["out"])
                t4 = time.perf_counter()
            else:  # an eager step (no graph for this size): GPU and host time are not separable
                gpu = t3 = t4 = 0.0
            t_plan += t1 - t0
            t_all += t2 - t0
            t_gpu += gpu
            t_d2h += t4 - t3
            t_rg += (t2 - t1)
            n += 1
        ms = lambda v: 1e3 * v / n  # noqa: E731
        host_rg = ms(t_rg) - ms(t_gpu) - ms(t_d2h)
        print(f"| {ns} | {ms(t_all):.3f} | {ns * n / t_all:,.0f} | {ms(t_plan):.3f} | {host_rg:.3f} | "
              f"{ms(t_gpu):.3f} | {ms(t_d2h):.3f} |")


if __name__ == "__main__":
    main()
