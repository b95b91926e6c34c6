"""Per-op GPU time of one eager decode step (issue 4 measurements).

    python bench/profile_ops.py [-m model.gguf] [--seqs 1] [--depth 512]

Wraps every op of the CUDA backend: synchronize, time the op, synchronize;
subtracts the time of the same wrapper around an empty kernel (launch +
sync overhead) and prints total microseconds per op name over one decode
step (mean of 20 steps), largest first. Rough (single-launch latency
included), but it shows which ops dominate a step's GPU time.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.batch import UBatch  # noqa: E402
from opencoti.engine.runner import ModelRunner  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402

OPS = ["mul_mat", "gated_ffn", "get_rows", "rms_norm", "rope", "kv_write", "attention_cells", "gelu_tanh", "silu"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--depth", type=int, default=512)
    a = ap.parse_args()
    import cupy as cp

    model = load_model(a.model, with_tokenizer=False)
    ns = a.seqs
    r = ModelRunner(model, "cuda", n_ctx=ns * (a.depth + 64) + 256, n_seq_max=ns, n_ubatch=512)
    b = r.backend
    b.graphs = False
    for s in range(ns):
        toks = np.random.default_rng(s).integers(100, 20000, a.depth)
        r.decode(UBatch.build(toks, np.arange(a.depth), [s] * a.depth, [a.depth - 1]))
    dev = cp.cuda.Device()
    z = cp.zeros(1)
    base = []
    for _ in range(200):
        dev.synchronize()
        t = time.perf_counter()
        z += 0
        dev.synchronize()
        base.append(time.perf_counter() - t)
    t0 = float(np.median(base))
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    orig = {}
    for name in OPS:
        f = getattr(b, name)
        orig[name] = f

        def wrap(*args, _f=f, _n=name, **kw):
            dev.synchronize()
            t = time.perf_counter()
            out = _f(*args, **kw)
            dev.synchronize()
            shape = ""
            if _n == "mul_mat":
                shape = f" {args[1].shape}" if hasattr(args[1], "shape") else ""
            tot[_n + shape] += max(0.0, time.perf_counter() - t - t0)
            cnt[_n + shape] += 1
            return out
        setattr(b, name, wrap)
    steps = 20
    dev.synchronize()
    tw = time.perf_counter()
    for i in range(steps):
        r.decode(UBatch.build([1000 + i + s for s in range(ns)], [a.depth + i] * ns, list(range(ns)), list(range(ns))))
    dev.synchronize()
    wall = (time.perf_counter() - tw) / steps
    for name, f in orig.items():
        setattr(b, name, f)
    print(f"\nper-op GPU time, {model.name}, {ns} seq(s), depth {a.depth}; launch+sync baseline {t0 * 1e6:.1f} us "
          f"subtracted; wall per instrumented step {wall * 1e3:.2f} ms\n")
    print("| op | calls/step | us/step | us/call |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in sorted(tot.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {cnt[k] / steps:.0f} | {v / steps * 1e6:.1f} | {v / cnt[k] * 1e6:.1f} |")
    print(f"| sum | | {sum(tot.values()) / steps * 1e6:.1f} | |")


if __name__ == "__main__":
    main()
