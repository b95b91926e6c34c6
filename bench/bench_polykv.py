"""PolyKV benchmark: N sessions on one shared prefix, private copies vs a pool.

    python bench/bench_polykv.py [-m model.gguf] [--prefix 5000] [--sessions 8 24] [--gen 32]
    python bench/bench_polykv.py --gpu nvidia --synth qwen2.5-7b-q4_k_m --prefix 4096 --sessions 32 --gen 128

For each N: KV cells used, time for N sessions to join (their prompts
prefilled: the shared prefix + a short private question), steady batched
decode tokens/s (tokens per second while all N sessions decode together; nan if
they never overlap: raise --gen), and a multi-turn re-query
(every session asks a second question) tokens/s. "naive" = each session
prefills its own copy of the prefix; "pool" = the prefix is built once as a
PolyKV pool and sessions attach by ``pool_id`` (zero-copy membership on the
unified cache). On CUDA a pool's sharers read the prefix once per step for all of
them (shared_prefix.cu); "pool-perseq" (CUDA only) is the pool with that kernel off
(``OPENCOTI_CUDA_SHARED_PREFIX=0``: every sharer reads the prefix on its own), to
separate the kernel's gain from the pool's. Prints a markdown table; compare with
../shared/BENCHMARKS.md (seed: 6.9x fewer cells, ~5x faster joining at N = 8;
llama.cpp on the H200, 7B Q4_K_M, N = 32, 4,096-token prefix: 2,645 tok/s private
copies, 2,694 shared).

``--gpu`` picks the backend as the CLI flag does (nvidia -> CUDA; default: CPU).
``--synth PRESET`` writes (once, into ``--synth-dir``) a random-weight GGUF with a real
model's shapes and quant types (``opencoti.tools.synth_shapes``; e.g. the 7B-shaped
``qwen2.5-7b-q4_k_m``) and benchmarks it; ``--synth-layers`` keeps fewer layers.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.api import CompletionRequest, FinishEvent, SamplingParams, TokenEvent  # noqa: E402
from opencoti.engine.backend import get_backend  # noqa: E402
from opencoti.engine.engine import Engine  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402
from opencoti.params import Params  # noqa: E402


def run_all(engine, prompts, n_gen, **kw):
    """Submit all prompts at once; returns (join_s, decode_tps, finishes, generated tokens)."""
    t0 = time.perf_counter()
    handles = [engine.submit(CompletionRequest(p, n_predict=n_gen, sampling=SamplingParams(temperature=0),
                                               ignore_eos=True, session_id=f"s{i}", **kw))
               for i, p in enumerate(prompts)]
    first_token = [None] * len(handles)
    fins = [None] * len(handles)
    tokens = [[] for _ in handles]
    stamps = [[] for _ in handles]

    last = [None] * len(handles)

    def drain(i, h):
        for ev in h.events(timeout=3600):
            last[i] = ev
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
    failed = [i for i, f in enumerate(fins) if f is None or first_token[i] is None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(handles)} sessions produced no token "
                           f"(session {failed[0]} ended with {last[failed[0]]!r})")
    t_all = max(first_token)  # every session is decoding from here on
    join = t_all - t0
    # steady batched decode: only tokens produced while all sessions run (earlier starters'
    # tokens before t_all would inflate the rate of staggered joins)
    t_stop = min(st[-1] for st in stamps)  # until the first session finishes
    n_window = sum(1 for st in stamps for t in st if t_all < t <= t_stop)
    # tokens are stamped when a reader thread takes them, so a window shorter than about two
    # decode steps of every session measures thread wake-ups, not decoding: nan (raise --gen)
    ok = t_stop > t_all and n_window >= 2 * len(handles)
    decode_tps = n_window / (t_stop - t_all) if ok else float("nan")
    return join, decode_tps, fins, tokens


LLAMA_CPP_H200_7B_N32 = {"naive": 2645, "pool": 2694}  # BENCHMARKS.md: 4,096-token prefix, 32 sequences


def _synth_model(preset: str, out_dir: str, layers: int | None) -> str:
    """Path of the ``synth_shapes`` GGUF for ``preset`` (written once per preset/layers)."""
    from opencoti.tools import synth_shapes

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{preset}{f'-{layers}l' if layers else ''}.gguf")
    if not os.path.exists(path):
        t = time.perf_counter()
        tmp = path + f".tmp{os.getpid()}"
        synth_shapes.write_model(preset, tmp, **({"n_layer": layers} if layers else {}))
        os.replace(tmp, path)
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return path


def attn_micro(backend, n_head: int, n_kv: int, d: int, n_pre: int, n: int, reps: int = 20) -> tuple[float, float]:
    """One layer's ``attention_cells`` for a decode step of ``n`` sessions sharing an
    ``n_pre``-cell prefix (each with 40 private cells), on random f16 K/V: microseconds per
    call (``reps`` calls replayed in one CUDA graph, timed by CUDA events) of the per-sequence
    path and of the group path."""
    import copy

    import numpy as np

    from opencoti.engine.kv_cache import KVCache

    cp = backend.cp
    pool = n
    c = KVCache([0], n_pre + 48 * n + 256, 1, n + 1, n_head_kv=n_kv, d_k=d, d_v=d, zeros=np.zeros)
    seqs, pos = np.full(n_pre, pool), np.arange(n_pre, dtype=np.int32)
    c.apply(c.prepare(seqs, pos), seqs, pos)
    for s in range(n):
        c.seq_cp(pool, s)
        sq, p = np.full(40, s), np.arange(n_pre, n_pre + 40, dtype=np.int32)
        c.apply(c.prepare(sq, p), sq, p)
    ub_seq, ub_pos = np.arange(n), np.full(n, n_pre + 40, dtype=np.int32)
    plan = c.prepare(ub_seq, ub_pos)
    c.apply(plan, ub_seq, ub_pos, share_src={s: pool for s in range(n)})
    rng = np.random.default_rng(0)
    k = cp.asarray(rng.standard_normal(c.k[0].shape).astype(np.float16))
    v = cp.asarray(rng.standard_normal(c.v[0].shape).astype(np.float16))
    q = cp.asarray(rng.standard_normal((n, n_head, d)).astype(np.float32))
    qp = cp.asarray(ub_pos)
    out = []
    flat = copy.copy(plan)
    flat.groups = []
    for pl in (flat, plan):
        # as decode runs it: ``reps`` calls captured in one CUDA graph (no Python launch cost)
        backend._meta = {}
        stream = cp.cuda.Stream(non_blocking=True)
        mem = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(mem.malloc), stream:
            backend.attention_cells(q, qp, k, v, pl, d ** -0.5)  # warm-up: uploads the plan's arrays
            stream.synchronize()
            backend._capturing = True
            try:
                stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
                for _ in range(reps):
                    backend.attention_cells(q, qp, k, v, pl, d ** -0.5)
                graph = stream.end_capture()
            finally:
                backend._capturing = False
            graph.launch(stream)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
        out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--prefix", type=int, default=5000, help="shared prefix length in tokens")
    ap.add_argument("--sessions", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--backend", default=None, help="backend name (cpu, cuda, vulkan); overrides --gpu")
    ap.add_argument("--gpu", default="disable", help="as the CLI's --gpu: nvidia, vulkan, auto, disable (CPU)")
    ap.add_argument("--synth", default=None, metavar="PRESET", help="benchmark a synth_shapes model instead of -m")
    ap.add_argument("--synth-layers", type=int, default=None)
    ap.add_argument("--synth-dir", default=os.path.expanduser("~/.cache/opencoti-synth"))
    ap.add_argument("--modes", nargs="+", default=None, help="naive pool pool-perseq, or none "
                    "(default: all that apply)")
    ap.add_argument("--no-requery", action="store_true", help="skip the multi-turn re-query")
    ap.add_argument("--attn", action="store_true",
                    help="CUDA: also time one layer's attention alone, per-sequence vs shared-prefix kernel")
    a = ap.parse_args()
    if a.synth:
        a.model = _synth_model(a.synth, a.synth_dir, a.synth_layers)
    model = load_model(a.model)
    backend = a.backend
    if backend is None:
        from opencoti.engine.backend import select_backend

        backend = select_backend(a.gpu)
    bname = backend if isinstance(backend, str) else getattr(backend, "name", "?")
    modes = a.modes or (["naive", "pool", "pool-perseq"] if bname == "cuda" else ["naive", "pool"])
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
        for mode in [m for m in modes if m != "none"]:
            pooled = mode.startswith("pool")
            if bname == "cuda":
                from opencoti.engine.backend import cuda as cuda_mod

                cuda_mod.SHARED_PREFIX = mode != "pool-perseq"
            params = Params(n_ctx=n_ctx, n_parallel=n, kv_unified=True, n_ubatch=512,
                            polykv_max_pools=1 if pooled else 0, admission_poolless="off")
            engine = Engine(model, params, backend=backend).start()
            try:
                kw = {}
                t_pool = 0.0
                if pooled:
                    t = time.perf_counter()
                    info = engine.create_pool(prefix, pin=True).result(timeout=3600)
                    t_pool = time.perf_counter() - t
                    kw = {"pool_id": info["id"]}
                prompts = [prefix + q for q in questions]
                # join: every session prefills its prompt and samples one token; then all decode
                # together from their cached prompts (session reuse), so the decode window is
                # not cut short by staggered joins
                join, _, _, first = run_all(engine, prompts, 1, **kw)
                prompts = [p + f for p, f in zip(prompts, first)]
                _, tps, fins, answers = run_all(engine, prompts, a.gen, **kw)
                cells = engine.runner.kv.base.n_used()
                requery = float("nan")
                if not a.no_requery:
                    # multi-turn: each session re-queries with its history (its answer included) + a follow-up
                    hist = [prompts[i] + answers[i] + f for i, f in enumerate(follow)]
                    t = time.perf_counter()
                    _, tps2, fins2, _ = run_all(engine, hist, a.gen, **kw)
                    requery = sum(f.n_predicted for f in fins2) / (time.perf_counter() - t)
                rows.append((n, mode, cells, t_pool + join, tps, requery))
                print(f"  N={n} {mode}: decode {tps:.1f} tok/s", file=sys.stderr, flush=True)
            finally:
                engine.stop()
    micro = []
    if a.attn and bname == "cuda":
        from opencoti.engine.backend import cuda as cuda_mod

        cuda_mod.SHARED_PREFIX = True
        hp = model.hparams
        b = get_backend(backend)
        for n in a.sessions:
            micro.append((n, *attn_micro(b, hp.n_head, hp.n_head_kv, hp.n_embd_head_k, len(prefix), n)))
    dev = getattr(backend, "device_name", None) or getattr(get_backend(backend), "device_name", "host")
    print(f"\nPolyKV bench: {model.name}, prefix {len(prefix)} tokens, {a.gen} generated per turn, "
          f"backend {bname} ({dev}), {os.cpu_count()} cores\n")
    ref7b = bname == "cuda" and "7B" in model.name and len(prefix) == 4096
    print("| sessions | mode | KV cells used | join s (prefill all) | decode tok/s (aggregate) | vs naive "
          "| vs llama.cpp | re-query tok/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    naive = {n: tps for n, mode, _, _, tps, _ in rows if mode == "naive"}
    for n, mode, cells, join, tps, rq in rows:
        vs_naive = f"{tps / naive[n]:.2f}x" if naive.get(n) else ""
        ref = LLAMA_CPP_H200_7B_N32["pool" if mode.startswith("pool") else "naive"] if ref7b and n == 32 else None
        vs_ref = f"{tps / ref:.2f}x of {ref:,}" if ref else ""
        print(f"| {n} | {mode} | {cells} | {join:.2f} | {tps:.1f} | {vs_naive} | {vs_ref} | {rq:.1f} |")

    if micro:
        print(f"\nOne layer's attention, decode step, prefix {len(prefix)} + 40 private cells per session "
              f"({model.hparams.n_head} heads / {model.hparams.n_head_kv} kv, head dim "
              f"{model.hparams.n_embd_head_k}), us per call:\n")
        print("| sessions | per-sequence | shared-prefix kernel | speed-up |")
        print("| ---: | ---: | ---: | ---: |")
        for n, t_seq, t_grp in micro:
            print(f"| {n} | {t_seq:.1f} | {t_grp:.1f} | {t_seq / t_grp:.2f}x |")


if __name__ == "__main__":
    main()
