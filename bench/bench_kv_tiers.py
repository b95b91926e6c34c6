"""Decode speed per KV cache tier and context depth on a GPU backend (issue 6 part 2).

    python bench/bench_kv_tiers.py [-m model.gguf | --synth qwen2.5-7b-q4_k_m] \
        [--tiers f16,q8_0,q4_0,turbo3,turbo2] [--depths 0,8192,32768] [-n 64] [-r 3] \
        [--replay N] [--variant NAME:KNOB=VALUE[,KNOB=VALUE...]]...

For each tier (``name`` = the same tier for K and V, ``k/v`` = a pair) one runner with
``n_ctx`` = the largest depth + 512 cells is built, all of them up front; per depth each
runner's sequence is prefilled once (random tokens, ubatches of 512) and decoded once as a
warm-up, then ``-r`` rounds in which the tiers take turns, each run decoding ``-n`` tokens one per
step (graph-replayed decode, logits to the host every step); after each run the decoded cells
are removed again (``seq_rm``), so every run decodes at the same depth. Each step is timed
(it ends with its logits on the host); a cell prints tok/s as 1 / the median step over all of a
tier's runs at that depth (a stall of the host, one step in a run, moves a run's mean but not
the median), ± the stddev over runs of each run's 1 / median step, and the ratio to f16's
median at the same depth. ``--synth PRESET`` writes
``opencoti.tools.synth_shapes``'s random-weight model with that preset's exact shapes (e.g. the
7B-shaped ``qwen2.5-7b-q4_k_m``) to the cache dir first. Targets (issue 6): a quantized tier
costs at most 10% at short context and is at least f16's speed at 32k.

``--replay N``: after each run its last step's graph is replayed N times back to back between
two CUDA events, and a second table gives 1 / that GPU time a step (median over runs, ± stddev
over runs, ratios to three decimals). It leaves out the host's share of a step (planning,
staging, the logits' copy and sampling: on the synthetic gemma-3-270m at 32k about 0.55 of
~1.2 ms, and most of the tok/s spread), so it resolves the kernels' differences (± 0.1 %
where the tok/s cells spread ± 8 %).

``--variant`` (repeatable) adds, for every tier, a runner that runs with the backend module's
knobs set to other values (e.g. ``sb2:ATTN_STREAM_SM_BLOCKS=2,ATTN_STREAM_MIN_SPLIT=128``; the
names of ``opencoti.engine.backend.<backend>``'s module constants that it reads at call time,
values parsed as Python literals; no commas inside a value), set while that runner is built
and around its prefill and decode runs: it takes its turns in the same process as the others,
whose speed varies from process to process (the synthetic gemma-3-270m's f16 at 32k: 787-950
tok/s in four processes on one H200, CUDA_NOTES session 27), so a setting and the default
compare within one process. Its rows are labelled
``tier [NAME]``, their ratio is to the same variant's f16, and a last column gives the ratio to
the same tier without the variant. The model's weights are loaded once, at the defaults, and
the backend's compiled kernels are shared: knobs read while weights load or a kernel's source is
built do not vary.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import prefill  # noqa: E402

from opencoti.engine.batch import UBatch  # noqa: E402
from opencoti.engine.runner import ModelRunner  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402


def _model_path(a) -> str:
    if a.synth:
        from opencoti.tools import synth_shapes
        from opencoti.version import cache_dir

        path = cache_dir() / f"synth-{a.synth}.gguf"
        if not path.exists():
            print(f"writing {a.synth} to {path} ...", file=sys.stderr, flush=True)
            synth_shapes.write_model(a.synth, path)
        return str(path)
    if a.model:
        return a.model
    from opencoti.model.default_model import default_model_path

    return str(default_model_path())


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME:KNOB=VALUE[,KNOB=VALUE...]`` -> ``(NAME, {KNOB: value})``, each value a Python
    literal (``2``, ``128``, ``'x'``). Raises ``argparse.ArgumentTypeError`` for a malformed text
    (argparse prints its message)."""
    name, sep, body = text.partition(":")
    knobs = {}
    for item in body.split(",") if body else []:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise argparse.ArgumentTypeError(f"{text!r}: expected KNOB=VALUE, got {item!r}")
        try:
            knobs[k.strip()] = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"{text!r}: {v.strip()!r} is not a Python literal") from None
    if not sep or not name or not knobs:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:KNOB=VALUE[,KNOB=VALUE...]")
    return name, knobs


@contextlib.contextmanager
def knobs_set(module, knobs: dict):
    """Module constants ``knobs`` set on ``module`` for the block, the old values restored after.
    Raises ``AttributeError`` for a name the module does not have (a typo would otherwise measure
    the default)."""
    old = {k: getattr(module, k) for k in knobs}
    try:
        for k, v in knobs.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _label(spec: str, variant: str) -> str:
    """A table row's label: the tier spec, with ``[variant]`` for a --variant's runner."""
    return f"{spec} [{variant}]" if variant else spec


def _decode(runner, depth: int, n: int, replay: int = 0) -> tuple[list[float], float | None]:
    """Decodes ``n`` tokens one per step after ``depth`` cells and removes them again; returns
    each step's seconds (host clock: a step returns with its logits on the host) and, with
    ``replay`` > 0, the GPU's seconds a step (``replay_step``'s) of the last step, else None."""
    steps = []
    n_vocab = runner.model.hparams.n_vocab
    for i in range(n):
        t = time.perf_counter()
        runner.decode(UBatch.build([(1000 + i) % n_vocab], [depth + i], [0], [0]))
        steps.append(time.perf_counter() - t)
    gpu = replay_step(runner, replay) if replay else None
    runner.kv.seq_rm(0, depth, -1)
    return steps, gpu


def replay_step(runner, n: int) -> float:
    """The GPU's seconds a decode step: the graph that the runner's last step ran (the backend's
    ``last_graph_key``) replayed ``n`` times back to back between two CUDA events, divided by ``n``.
    A replay re-runs that step on the same staged inputs: its K / V store writes the same bytes to
    the same cell, so a KV cache is unchanged (a recurrent layer's state would advance: a model
    with recurrent layers decodes its later runs from another state). The host's share of a step
    (planning, staging, the logits' copy) is not in it. Raises RuntimeError when the graph that
    the backend ran last is not this runner's (a backend without graphs; the bench's one-token
    decode steps always run as graphs on CUDA)."""
    store, key = getattr(runner.backend, "last_graph_key", None) or (None, None)
    if store != id(runner.graphs) or key not in runner.graphs:
        raise RuntimeError("replay_step: the runner's last step ran no graph (--replay needs a graph backend)")
    g = runner.graphs[key]
    import cupy as cp

    st = cp.cuda.get_current_stream()
    g["graph"].launch(stream=st)  # the graph's first replay after others' may find colder caches
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(st)
    for _ in range(n):
        g["graph"].launch(stream=st)
    e1.record(st)
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) / 1e3 / n


def _count(text: str) -> int:
    """argparse type: an integer >= 0 (ArgumentTypeError otherwise)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return n


def step_stats(runs: list[list[float]]) -> tuple[float, float]:
    """``(tok/s, spread)`` of one tier at one depth from its runs' step seconds: 1 / the median
    step over all runs, and the stddev over runs of 1 / each run's median step (0 for one run)."""
    rates = [1.0 / statistics.median(r) for r in runs]
    return 1.0 / statistics.median([t for r in runs for t in r]), (statistics.stdev(rates) if len(rates) > 1 else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--synth", default=None, help="a synth_shapes preset instead of -m (e.g. qwen2.5-7b-q4_k_m)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tiers", default="f16,q8_0,q4_0,turbo3,turbo2")
    ap.add_argument("--depths", default="0,8192,32768")
    ap.add_argument("-n", "--steps", type=int, default=64)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--replay", type=_count, default=0, metavar="N",
                    help="after each run, its last step's graph replayed N times: a second table of GPU time a step")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant,
                    help="NAME:KNOB=VALUE[,...]: every tier also with the backend module's knobs set (repeatable)")
    a = ap.parse_args()
    backend_mod = importlib.import_module(f"opencoti.engine.backend.{a.backend}")
    variants = [("", {})] + a.variant
    names = [n for n, _ in a.variant]
    if len(set(names)) < len(names):
        ap.error(f"--variant names repeat: {', '.join(names)}")
    for vname, knobs in a.variant:  # before the model loads: a typo would measure the default
        missing = [k for k in knobs if not hasattr(backend_mod, k)]
        if missing:
            ap.error(f"--variant {vname}: {backend_mod.__name__} has no {', '.join(missing)}")

    model = load_model(_model_path(a), with_tokenizer=False)
    depths = [int(x) for x in a.depths.split(",") if x]
    specs = [t for t in a.tiers.split(",") if t]
    runners = {}  # label -> (runner, knobs); a variant's runners are built under its knobs
    for vname, knobs in variants:
        with knobs_set(backend_mod, knobs):
            for spec in specs:
                tk, tv = spec.split("/") if "/" in spec else (spec, spec)
                runner = ModelRunner(model, a.backend, n_ctx=max(depths) + 512, n_ubatch=512, type_k=tk, type_v=tv)
                runners[_label(spec, vname)] = (runner, knobs)
    labels = list(runners)
    if a.replay and not getattr(runners[labels[0]][0].backend, "graphs", False):
        ap.error(f"--replay: the {a.backend} backend replays no graphs")
    res: dict = {(lb, d): [] for lb in labels for d in depths}
    gpu: dict = {(lb, d): [] for lb in labels for d in depths}  # --replay: each run's GPU seconds a step
    for d in depths:
        for runner, knobs in runners.values():
            with knobs_set(backend_mod, knobs):
                runner.kv.clear()
                if d:
                    prefill(runner, d)
                _decode(runner, d, a.steps, a.replay)  # warm-up: graph capture, module compile
        # the tiers take turns, run by run: a drift of the device's clocks over the call (the
        # first tier's rows measured low in earlier one-tier-after-another runs) hits them alike
        for _ in range(a.repetitions):
            for lb, (runner, knobs) in runners.items():
                with knobs_set(backend_mod, knobs):
                    steps, g = _decode(runner, d, a.steps, a.replay)
                    res[(lb, d)].append(steps)
                    if g is not None:
                        gpu[(lb, d)].append(g)
        for lb in labels:
            print(f"{lb} @ {d}: {step_stats(res[(lb, d)])[0]:,.1f} tok/s", file=sys.stderr, flush=True)

    from opencoti.engine.backend import get_backend

    b = get_backend(a.backend)
    print(f"\nopencoti KV tiers: backend {b.name} ({getattr(b, 'device_name', 'host')}), model {model.name}, "
          f"decode {a.steps} tokens x {a.repetitions}\n")
    print_table(depths, specs, variants, {key: step_stats(runs) for key, runs in res.items()}, "tg")
    if a.replay:
        print(f"\nGPU time a step (the last step's graph replayed {a.replay} times after each run; "
              f"1 / the median over runs, ± the stddev over runs):\n")
        # (one GPU time a run: step_stats of one-step runs)
        print_table(depths, specs, variants, {key: step_stats([[x] for x in v]) for key, v in gpu.items()}, "GPU", 3)


def print_table(depths: list[int], specs: list[str], variants: list, stats: dict, what: str, digits: int = 2) -> None:
    """One markdown table: a row per (variant, tier spec), per depth ``stats[(label, depth)]`` =
    (tok/s, spread) and its ratio to the same variant's f16 (and, with variants, to the same tier
    without one) to ``digits`` decimals; ``what`` heads the columns (``tg``: decode, ``GPU``:
    replayed steps)."""
    extra = len(variants) > 1
    print("| -ctk/-ctv | " + " | ".join(f"{what} @ d{d} t/s | vs f16" + (" | vs default" if extra else "")
                                        for d in depths) + " |")
    print("| --- |" + (" ---: | ---: | ---: |" if extra else " ---: | ---: |") * len(depths))
    for vname, _ in variants:
        for spec in specs:
            lb = _label(spec, vname)
            cells = []
            for d in depths:
                m, sd = stats[(lb, d)]
                ref = stats.get((_label("f16", vname), d))
                cell = f"{m:,.1f} ± {sd:,.1f} | " + (f"{m / ref[0]:.{digits}f}" if ref else "")
                if extra:
                    cell += f" | {m / stats[(spec, d)][0]:.{digits}f}"
                cells.append(cell)
            print(f"| {lb} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
