"""llama-bench-style table on a GPU backend (default CUDA), plus aggregate decode.

    python bench/bench_cuda.py [-m model.gguf] [--backend cuda] [-r 3] [--seqs 1,8,32,64] [--bw 4.8]

Rows: pp512, pp4096 (prefill in ubatches of 512, logits for the last token
only), tg128, tg128 at depth 8192, and aggregate decode with N concurrent
sequences (each prefilled with a 512-token prompt, then 128 steps that decode
one token of every sequence in one ubatch; unified KV), like
llama-batched-bench. Every step returns its logits to the host, so the
wall clock covers the GPU work. Each test: one warm-up, then ``-r`` runs, mean
± stddev. Compare with ../shared/BENCHMARKS.md (llama.cpp on the same H200).

Bound: the weight bytes one single-sequence decode step reads
(``opencoti.tools.decode_bytes``: routed experts at n_used/n_expert, one
embedding row, the output head, everything else in full; KV reads not
counted) and the tok/s that memory bandwidth ``--bw`` (TB/s, default 4.8: the
H200's HBM3e) allows; printed once, and as columns for the single-sequence
rows (tg128, decode x1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.batch import UBatch  # noqa: E402
from opencoti.engine.runner import ModelRunner  # noqa: E402
from opencoti.model.gguf_file import GGUFFile  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402
from common import llama_cpp_refs, prefill, timed, token  # noqa: E402
from opencoti.tools.decode_bytes import H200_BW_TBS, gguf_decode_bytes  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--seqs", default="1,8,32,64", help="concurrent sequences for aggregate decode")
    ap.add_argument("--pp", default="512,4096")
    ap.add_argument("--depths", default="0,8192")
    ap.add_argument("--bw", type=float, default=H200_BW_TBS, help="memory bandwidth for the bound, TB/s")
    a = ap.parse_args()

    model = load_model(a.model, with_tokenizer=False)
    rows = []

    runner = ModelRunner(model, a.backend, n_ctx=8192 + 256, n_ubatch=512)
    for n in [int(x) for x in a.pp.split(",") if x]:
        def pp(n=n):
            runner.kv.clear()
            t = time.perf_counter()
            prefill(runner, n)
            return n / (time.perf_counter() - t)
        rows.append((f"pp{n}", timed(pp, a.repetitions)))
    for d in [int(x) for x in a.depths.split(",") if x]:
        def tg(d=d):
            runner.kv.clear()
            if d:
                prefill(runner, d)
            t = time.perf_counter()
            for i in range(128):
                runner.decode(UBatch.build([token(runner, i)], [d + i], [0], [0]))
            return 128 / (time.perf_counter() - t)
        rows.append(("tg128" + (f" @ d{d}" if d else ""), timed(tg, a.repetitions)))
    runner = None  # free the KV before the aggregate runs

    for ns in [int(x) for x in a.seqs.split(",") if x]:
        r = ModelRunner(model, a.backend, n_ctx=ns * 640 + 256, n_seq_max=ns, kv_unified=True, n_ubatch=512)

        def agg(r=r, ns=ns):
            r.kv.clear()
            for s in range(ns):
                prefill(r, 512, seq=s, seed=s)
            t = time.perf_counter()
            for i in range(128):
                r.decode(UBatch.build([token(r, i + s) for s in range(ns)], [512 + i] * ns, list(range(ns)),
                                      list(range(ns))))
            return ns * 128 / (time.perf_counter() - t)
        rows.append((f"decode x{ns}", timed(agg, max(1, a.repetitions - 1))))
        r = None

    from opencoti.engine.backend import get_backend

    db = gguf_decode_bytes(GGUFFile(model.path))
    bound = db.bound_tok_s(a.bw)
    b = get_backend(a.backend)
    print(f"\nopencoti bench: backend {b.name} ({getattr(b, 'device_name', 'host')}), model {model.name}, "
          f"{os.path.getsize(model.path) / 2**20:.1f} MiB\n")
    print(f"bound: {db.total / 2**20:,.1f} MiB of weights read per decoded token (routed experts "
          f"{db.experts / 2**20:,.1f}, embedding row {db.embd_rows / 2**10:,.1f} KiB, output head "
          f"{db.output / 2**20:,.1f}, rest {db.other / 2**20:,.1f}; KV not counted) -> "
          f"{bound:,.0f} tok/s at {a.bw:g} TB/s\n")
    refs = llama_cpp_refs(model.name)
    print("| test | opencoti t/s | llama.cpp t/s (H200) | ratio | bound t/s | of bound |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, vals in rows:
        mean = statistics.mean(vals)
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        ref = refs.get(name)
        single = name.startswith("tg") or name == "decode x1"
        cols = [f"{mean:,.1f} ± {sd:,.1f}", f"{ref:,}" if ref else "", f"{mean / ref:.2f}" if ref else "",
                f"{bound:,.0f}" if single else "", f"{mean / bound:.0%}" if single else ""]
        print(f"| {name} | " + " | ".join(cols) + " |")

if __name__ == "__main__":
    main()
