"""llama-bench-style throughput table for opencoti.

    python bench/bench.py [-m model.gguf] [-p 512] [-n 128] [-r 3] [--depth 0]

pp<N>: prefill of an N-token prompt in ubatches of ``-ub`` (one forward per
ubatch, logits for the last token only, as llama-bench). tg<N>: N single-token
decode steps after a one-token prompt (at ``--depth`` cells of context). Each
test runs ``-r`` times after one warm-up; the table shows mean +- stddev
tokens/s, like llama-bench. Compare with ../shared/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.batch import UBatch  # noqa: E402
from opencoti.engine.runner import ModelRunner  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402


def prefill(runner: ModelRunner, n: int, pos0: int = 0) -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(100, 20000, n)
    for s in range(0, n, runner.n_ubatch):
        chunk = toks[s:s + runner.n_ubatch]
        m = len(chunk)
        runner.decode(UBatch.build(chunk, np.arange(pos0 + s, pos0 + s + m), [0] * m, [m - 1]))


def bench_pp(runner, n, reps):
    out = []
    for r in range(reps + 1):
        runner.kv.clear()
        t = time.perf_counter()
        prefill(runner, n)
        dt = time.perf_counter() - t
        if r:
            out.append(n / dt)
    return out


def bench_tg(runner, n, reps, depth):
    out = []
    for r in range(reps + 1):
        runner.kv.clear()
        if depth:
            prefill(runner, depth)
        t = time.perf_counter()
        for i in range(n):
            runner.decode(UBatch.build([1000 + i], [depth + i], [0], [0]))
        dt = time.perf_counter() - t
        if r:
            out.append(n / dt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded gemma-3-270m)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-ub", "--ubatch-size", type=int, default=512)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-d", "--depth", type=int, default=0, help="context depth for tg")
    ap.add_argument("--backend", default="cpu")
    a = ap.parse_args()

    model = load_model(a.model, with_tokenizer=False)
    n_ctx = max(a.n_prompt, a.depth + a.n_gen) + 16
    runner = ModelRunner(model, a.backend, n_ctx=n_ctx, n_ubatch=a.ubatch_size)
    size_mib = os.path.getsize(model.path) / 2**20
    n_params = sum(t.n_elements for t in model.gguf.tensors.values())
    threads = os.cpu_count()
    rows = []
    if a.n_prompt > 0:
        rows.append((f"pp{a.n_prompt}", bench_pp(runner, a.n_prompt, a.repetitions)))
    if a.n_gen > 0:
        name = f"tg{a.n_gen}" + (f" @ d{a.depth}" if a.depth else "")
        rows.append((name, bench_tg(runner, a.n_gen, a.repetitions, a.depth)))

    print(f"\nopencoti bench: {platform.processor() or platform.machine()}, {threads} cores, numpy {np.__version__}\n")
    print("| model | size | params | backend | threads | test | t/s |")
    print("| --- | ---: | ---: | --- | ---: | --- | ---: |")
    for name, vals in rows:
        mean = statistics.mean(vals)
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        print(f"| {model.hparams.arch} {model.name} | {size_mib:.2f} MiB | {n_params / 1e6:.2f} M | "
              f"{runner.backend.name} | {threads} | {name} | {mean:.2f} ± {sd:.2f} |")


if __name__ == "__main__":
    main()
