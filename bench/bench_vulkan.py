"""llama-bench-style table for the Vulkan backend, beside CUDA and llama.cpp.

    python bench/bench_vulkan.py [-m model.gguf] [-mg 0] [-r 3] [--pp 512] [--tg 128]
                                 [--depths 0] [--seqs 1] [--cuda]

Rows (as llama-bench): ``pp<N>`` prefill of an N-token prompt in ubatches of 512
with logits for the last token only; ``tg<N>`` decode of N tokens one at a time
(each step returns its logits to the host, so the wall clock covers the device
work), optionally at a KV depth; ``decode xS``: aggregate decode of S sequences
(512-token prompts, then 128 steps that decode one token of each in one ubatch,
unified KV), like llama-batched-bench. Each test: one warm-up, then ``-r`` runs,
mean ± stddev. ``--cuda`` runs the same tests on the CUDA backend in the same
process for a side-by-side column; the last column is llama.cpp on the H200
(../shared/BENCHMARKS.md, same model file). Also printed: the Vulkan device,
dispatches recorded and submits per decode step. ``OPENCOTI_VK_GRAPHS=0`` runs
decode eagerly (every step recorded anew) for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.backend import get_backend  # noqa: E402
from opencoti.engine.batch import UBatch  # noqa: E402
from opencoti.engine.runner import ModelRunner  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402
from common import llama_cpp_refs, prefill, timed, token  # noqa: E402

def run_tests(model, backend, a) -> dict:
    """``{test name: [tokens/s per run]}`` on ``backend``."""
    rows: dict = {}
    depths = [int(x) for x in a.depths.split(",") if x]
    runner = ModelRunner(model, backend, n_ctx=max(depths + [0]) + max(a.tg, 512) + 256, n_ubatch=512)
    for n in [int(x) for x in a.pp.split(",") if x]:
        if n + 256 > runner.kv.n_ctx:
            runner = ModelRunner(model, backend, n_ctx=n + 256, n_ubatch=512)

        def pp(n=n, runner=runner):
            runner.kv.clear()
            t = time.perf_counter()
            prefill(runner, n)
            return n / (time.perf_counter() - t)
        rows[f"pp{n}"] = timed(pp, a.repetitions)
    runner = ModelRunner(model, backend, n_ctx=max(depths + [0]) + a.tg + 256, n_ubatch=512)
    for d in depths:
        def tg(d=d, runner=runner):
            runner.kv.clear()
            if d:
                prefill(runner, d)
            t = time.perf_counter()
            for i in range(a.tg):
                runner.decode(UBatch.build([token(runner, i)], [d + i], [0], [0]))
            return a.tg / (time.perf_counter() - t)
        rows[f"tg{a.tg}" + (f" @ d{d}" if d else "")] = timed(tg, a.repetitions)
    del runner
    for ns in [int(x) for x in a.seqs.split(",") if x]:
        r = ModelRunner(model, backend, n_ctx=ns * 640 + 256, n_seq_max=ns, kv_unified=True, n_ubatch=512)

        def agg(r=r, ns=ns):
            r.kv.clear()
            for s in range(ns):
                prefill(r, 512, seq=s, seed=s)
            t = time.perf_counter()
            for i in range(128):
                r.decode(UBatch.build([token(r, i + s) for s in range(ns)], [512 + i] * ns, list(range(ns)),
                                      list(range(ns))))
            return ns * 128 / (time.perf_counter() - t)
        rows[f"decode x{ns}"] = timed(agg, max(1, a.repetitions - 1))
        del r
    return rows


def _fmt(vals) -> str:
    if not vals:
        return ""
    mean = statistics.mean(vals)
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{mean:,.1f} ± {sd:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded gemma-3-270m)")
    ap.add_argument("-mg", "--main-gpu", type=int, default=0, help="Vulkan device index")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--pp", default="512", help="prefill lengths, comma-separated")
    ap.add_argument("--tg", type=int, default=128, help="decoded tokens per tg test")
    ap.add_argument("--depths", default="0", help="KV depths of the tg test, comma-separated")
    ap.add_argument("--seqs", default="", help="concurrent sequences for aggregate decode, e.g. 1,8,32")
    ap.add_argument("--cuda", action="store_true", help="also run the tests on the CUDA backend")
    a = ap.parse_args()

    model = load_model(a.model, with_tokenizer=False)
    vk = get_backend("vulkan", a.main_gpu)
    t0 = time.perf_counter()
    model.network(vk)
    load_s = time.perf_counter() - t0
    res = {"vulkan": run_tests(model, vk, a)}
    if a.cuda:
        res["cuda"] = run_tests(model, get_backend("cuda", a.main_gpu), a)

    # dispatches recorded and submits of a first and a second decode step (graphs record once)
    r = ModelRunner(model, vk, n_ctx=512, n_ubatch=512)
    prefill(r, 64)
    per_step = []
    for i in range(2):
        d0, s0 = vk.rt.n_dispatches, vk.rt.n_submits
        r.decode(UBatch.build([token(r, i)], [64 + i], [0], [0]))
        per_step.append((vk.rt.n_dispatches - d0, vk.rt.n_submits - s0))

    print(f"\nopencoti bench: Vulkan device {a.main_gpu}: {vk.device_name}; model {model.name}, "
          f"{os.path.getsize(model.path) / 2**20:.1f} MiB; weights uploaded in {load_s:.2f} s; "
          f"decode step: {per_step[0][0]} dispatches recorded the first time, {per_step[1][0]} the next "
          f"(graphs {'on' if vk.graphs else 'off'}), {per_step[1][1]} submit(s) per step\n")
    cols = ["vulkan"] + (["cuda"] if a.cuda else [])
    print("| test | " + " | ".join(f"opencoti {c} t/s" for c in cols) + " | llama.cpp CUDA t/s (H200) |")
    print("| --- | " + " | ".join("---:" for _ in cols) + " | ---: |")
    refs = llama_cpp_refs(model.name)
    for name in res["vulkan"]:
        ref = refs.get(name)
        print(f"| {name} | " + " | ".join(_fmt(res[c].get(name)) for c in cols)
              + f" | {f'{ref:,}' if ref else ''} |")


if __name__ == "__main__":
    main()
