"""PolyKV benchmark: N sessions on one shared prefix, private copies vs a pool.

    python bench/bench_polykv.py [-m model.gguf] [--prefix 5000] [--sessions 8 24] [--gen 32]

For each N: KV cells used, time for N sessions to join (their prompts
prefilled: the shared prefix + a short private question), steady batched
decode tokens/s (tokens per second while all N sessions decode together; nan if
they never overlap: raise --gen), and a multi-turn re-query
(every session asks a second question) tokens/s. "naive" = each session
prefills its own copy of the prefix; "pool" = the prefix is built once as a
PolyKV pool and sessions attach by ``pool_id`` (zero-copy membership on the
unified cache). Prints a markdown table; compare with the seed's figures in
../shared/BENCHMARKS.md (6.9x fewer cells, ~5x faster joining at N = 8).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.api import CompletionRequest, FinishEvent, SamplingParams, TokenEvent  # noqa: E402
from opencoti.engine.engine import Engine  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402
from opencoti.params import Params  # noqa: E402


def run_all(engine, prompts, n_gen, **kw):
    """Submit all prompts at once; returns (join_s, decode_tps, finishes, generated tokens)."""
    t0 = time.perf_counter()
    handles = [engine.submit(CompletionRequest(p, n_predict=n_gen, sampling=SamplingParams(temperature=0),
                                               session_id=f"s{i}", **kw)) for i, p in enumerate(prompts)]
    first_token = [None] * len(handles)
    fins = [None] * len(handles)
    tokens = [[] for _ in handles]
    stamps = [[] for _ in handles]

    def drain(i, h):
        for ev in h.events(timeout=3600):
            if isinstance(ev, TokenEvent):
                tokens[i].append(ev.token)
                stamps[i].append(time.perf_counter())
                if first_token[i] is None:
                    first_token[i] = stamps[i][-1]
            if isinstance(ev, FinishEvent):
                fins[i] = ev

    ths = [threading.Thread(target=drain, args=(i, h)) for i, h in enumerate(handles)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    t_end = time.perf_counter()
    t_all = max(first_token)  # every session is decoding from here on
    join = t_all - t0
    # steady batched decode: only tokens produced while all sessions run (earlier starters'
    # tokens before t_all would inflate the rate of staggered joins)
    t_stop = min(st[-1] for st in stamps)  # until the first session finishes
    n_window = sum(1 for st in stamps for t in st if t_all < t <= t_stop)
    decode_tps = n_window / (t_stop - t_all) if t_stop > t_all and n_window else float("nan")
    return join, decode_tps, fins, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--prefix", type=int, default=5000, help="shared prefix length in tokens")
    ap.add_argument("--sessions", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--backend", default=None)
    a = ap.parse_args()
    model = load_model(a.model)
    tok = model.tokenizer
    text = ("You are an agent of a logistics company. Policies: be exact, cite the manual. "
            "Tools: get_route, get_weather, book_truck, cancel_booking. ") * 400
    prefix = tok.tokenize(text, add_special=True)[:a.prefix]
    rows = []
    for n in a.sessions:
        questions = [tok.tokenize(f" Question {i}: how long from depot {i} to city {i + 1}? Answer:",
                                  add_special=False) for i in range(n)]
        follow = [tok.tokenize(f" And back to depot {i}? Answer:", add_special=False) for i in range(n)]
        n_ctx = (len(prefix) + 200) * (n + 1)
        for mode in ("naive", "pool"):
            params = Params(n_ctx=n_ctx, n_parallel=n, kv_unified=True, n_ubatch=512,
                            polykv_max_pools=1 if mode == "pool" else 0, admission_poolless="off")
            engine = Engine(model, params, backend=a.backend).start()
            try:
                kw = {}
                t_pool = 0.0
                if mode == "pool":
                    t = time.perf_counter()
                    info = engine.create_pool(prefix, pin=True).result(timeout=3600)
                    t_pool = time.perf_counter() - t
                    kw = {"pool_id": info["id"]}
                prompts = [prefix + q for q in questions]
                join, tps, fins, answers = run_all(engine, prompts, a.gen, **kw)
                cells = engine.runner.kv.base.n_used()
                # multi-turn: each session re-queries with its history (its answer included) + a follow-up
                hist = [prompts[i] + answers[i] + f for i, f in enumerate(follow)]
                t = time.perf_counter()
                _, tps2, fins2, _ = run_all(engine, hist, a.gen, **kw)
                requery = sum(f.n_predicted for f in fins2) / (time.perf_counter() - t)
                rows.append((n, mode, cells, t_pool + join, tps, requery))
            finally:
                engine.stop()
    print(f"\nPolyKV bench: {model.name}, prefix {len(prefix)} tokens, {a.gen} generated per turn, "
          f"backend {a.backend or 'cpu'}, {os.cpu_count()} cores\n")
    print("| sessions | mode | KV cells used | join s (prefill all) | decode tok/s (aggregate) | re-query tok/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n, mode, cells, join, tps, rq in rows:
        print(f"| {n} | {mode} | {cells} | {join:.2f} | {tps:.1f} | {rq:.1f} |")


if __name__ == "__main__":
    main()
