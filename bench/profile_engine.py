"""The engine's host work per decode step, without the network (issues 4 and 5 measurements).

    python bench/profile_engine.py -m model.gguf [--sessions 32] [--gen 64] [--temp 0] [--top 25]

Starts an ``Engine`` on the CPU backend with the network's forward replaced by a stand-in that
returns fixed random logits (float32 ``[rows, n_vocab]``, copied per step as a device backend's
logits arrive), submits ``--sessions`` requests of 40 prompt tokens with ``n_predict=--gen``
(once to warm up, once measured) and prints the wall time per engine step, then the measured
steps' cProfile (cumulative, ``--top`` rows): KV planning, sampling, detokenization and the
per-token event queues: everything a step costs besides the GPU.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine import engine as engine_mod  # noqa: E402
from opencoti.engine.api import CompletionRequest, SamplingParams  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402
from opencoti.params import Params  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device-argmax", action="store_true",
                    help="greedy rows' argmax as a GPU backend returns it (ids only; the stand-in's "
                         "host argmax over the vocabulary not counted)")
    a = ap.parse_args()
    model = load_model(a.model)
    n = a.sessions
    e = engine_mod.Engine(model, Params(n_ctx=n * (a.gen + 200), n_parallel=n, kv_unified=True, n_ubatch=512),
                          backend="cpu")
    rng = np.random.default_rng(0)
    fixed = (rng.standard_normal((64, model.hparams.n_vocab)) * 3).astype(np.float32)
    forwards = [0]

    def stand_in(ub, kv):
        forwards[0] += 1
        n = len(ub.out_rows)
        if a.device_argmax and n <= len(fixed):
            return fixed[:n]  # a view: only the ids are used (no logits copy, as on a GPU)
        return fixed[np.arange(n) % len(fixed)]

    e.runner.net.forward = stand_in
    if a.device_argmax:
        from opencoti.engine import runner as runner_mod

        ids, mx = fixed.argmax(axis=1), fixed.max(axis=1)
        runner_mod.rows_argmax = lambda lg: (ids[np.arange(len(lg)) % len(ids)], mx[np.arange(len(lg)) % len(mx)])
    e.start()

    def run():
        handles = [e.submit(CompletionRequest(list(rng.integers(100, 5000, 40)), n_predict=a.gen, ignore_eos=True,
                                              sampling=SamplingParams(temperature=a.temp), session_id=f"s{i}"))
                   for i in range(n)]

        def drain(h):
            collections.deque(h.events(timeout=600), maxlen=0)  # consume every event

        threads = [threading.Thread(target=drain, args=(h,)) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run()
    prof = cProfile.Profile()
    step = engine_mod.Engine.step

    def profiled(self, *args, **kwargs):
        prof.enable()
        try:
            return step(self, *args, **kwargs)
        finally:
            prof.disable()

    engine_mod.Engine.step = profiled
    f0, t0 = forwards[0], time.perf_counter()
    run()
    dt = time.perf_counter() - t0
    engine_mod.Engine.step = step
    e.stop()
    steps = forwards[0] - f0
    print(f"\nprofile_engine: {model.name}, {n} sessions, {a.gen} tokens each, temperature {a.temp}: "
          f"{steps} steps in {dt:.2f} s, {1e3 * dt / steps:.2f} ms per step\n")
    pstats.Stats(prof).sort_stats("cumtime").print_stats(a.top)


if __name__ == "__main__":
    main()
