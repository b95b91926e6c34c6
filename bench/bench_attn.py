"""The f16 decode attention kernel alone on a GPU: microseconds per call by cells and split count.

    python bench/bench_attn.py [--cells 32,128,512,2048,8192] [--splits 1,2,4,...,128] [--layouts ...] [--reps 20]
                               [--tiers q8_0,q4_0,turbo3]

One query row (a decode step of one sequence) over N cells of f16 K/V, for two head layouts
(Qwen2.5-7B: 28 query heads, 4 KV heads, head dim 128; gemma-3-270m: 4 / 1 / 256), timed
inside a captured CUDA graph (``bench_gemv._graph_time``): ``attn_partial`` for each split count
(those with >= 8 cells per split), plus ``attn_merge`` when it splits, and the same for the
streaming kernel ``attn_stream`` (head dims 64-256). Prints one row per (kernel, layout, N): us
per call for each split count and the K/V bytes per second of the best; the backend picks its
counts in ``CUDABackend._attn_splits`` / ``_attn_stream_splits``.

``--tiers``: then, per layout and N, the streaming kernel over each KV tier pair (``-ctk`` =
``-ctv``; ``attn_kv_stream`` of the pair's module, rows quantized by the CPU tier) at the
backend's split count (which depends on the kernel's resident blocks per SM) and shared memory
(``_stream_pin_smem``), against f16 at its own: us per call, bytes per second, and the
time relative to f16. ``--split-cells 256,512,1024`` adds rows at N / 256, N / 512, ... splits:
a tier's time against its cells per block separates the block's fixed cost (tables, rotations,
merge) from its per-cell decode.

Each call reads K / V cold, as a decode step's layer does (each layer its own cache, the others'
reads in between): the graph's calls cycle over enough copies of K / V to fill twice the GPU's
L2 (``--copies N`` sets the count; 1 replays one cache, which then stays in L2 when it fits: at
32k cells a 7B layer's q8_0 cache is 34 MB against the H200's 50 MB L2, and was timed 8 % faster
than f16 that way while the decode step ran it 4 % slower).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# heads, kv heads, dim, kernel G (query heads per block: G < heads / kv heads takes several blocks)
LAYOUTS = {"qwen2.5-7b": (28, 4, 128, 8), "gemma-3-270m": (4, 1, 256, 4),
           "qwen2.5-7b, G 2": (28, 4, 128, 2), "gemma-3-270m, G 1": (4, 1, 256, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="32,128,512,2048,8192")
    ap.add_argument("--splits", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--layouts", default=";".join(LAYOUTS), help="';'-separated list of: " + "; ".join(LAYOUTS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiers", default="", help="comma-separated KV tiers for the streaming kernel (e.g. q8_0,turbo3)")
    ap.add_argument("--copies", type=int, default=0, help="K / V copies the calls cycle over (0: enough for "
                    "twice the L2, so that every call reads a cold cache)")
    ap.add_argument("--split-cells", default="", help="with --tiers: comma-separated cells per split to time besides "
                    "the backend's count (a block's fixed cost vs its per-cell cost)")
    a = ap.parse_args()
    import cupy as cp
    from bench_gemv import _graph_time

    from opencoti.engine.backend import cuda as cu

    be = cu.CUDABackend()
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    print(f"\nbench_attn: {be.device_name}, one query row, f16 K/V, {a.reps} calls in one CUDA graph, "
          f"K / V read cold ({'copies to fill 2 x L2 = %d MB' % (2 * l2 >> 20) if a.copies <= 0 else a.copies})\n")
    splits = [int(v) for v in a.splits.split(",")]
    for name in a.layouts.split(";"):
        H, nkv, D, g = LAYOUTS[name.strip()]
        print(f"{name}: {H} heads, {nkv} kv heads, head dim {D}\n")
        print("| kernel | cells | " + " | ".join(f"s{s}" for s in splits) + " | GB/s (best) |")
        print("| --- | ---: |" + " ---: |" * (len(splits) + 1))
        fns = {"partial": (be._fn("a", f"attn_partial_d{D}_g{g}"), nkv * -(-H // nkv // g), 0)}
        if D in cu.AS_HEAD_DIMS:
            hn = cu._as_heads(H // nkv)
            smem = cu._as_smem(D, 2 * D, 2 * D, hn=hn)
            fns["stream"] = (be._big_smem_fn("a", f"attn_stream_d{D}{cu._as_suffix(hn)}", smem),
                             nkv * -(-H // nkv // hn), smem)
        threads = {"partial": 128, "stream": 2 * cu._as_tile(D, 2 * D, 2 * D)}  # the stream's: 2 per tile cell
        for L in (int(v) for v in a.cells.split(",")):
            q = cp.random.standard_normal((1, H, D), dtype=cp.float32)
            K = (cp.random.standard_normal((L, nkv, D), dtype=cp.float32) * 0.5).astype(cp.float16).view(cp.uint16)
            V = cp.random.standard_normal((L, nkv, D), dtype=cp.float32).astype(cp.float16).view(cp.uint16)
            kvs = _kv_copies(cp, K, V, a.copies, l2, a.reps)
            qpos, rv, vo = cp.array([L], cp.int32), cp.zeros(1, cp.int32), cp.array([0, L], cp.int32)
            cells, cpos = cp.arange(L, dtype=cp.int32), cp.arange(L, dtype=cp.int32)
            for kname, (fn, gy, smem) in fns.items():
                row, best = [], None
                for ns in splits:
                    if ns > max(1, L // 8):
                        row.append("")
                        continue
                    call = _decode_call(cp, be, fn, (1, gy, ns), threads[kname], smem,
                                        [(q, qpos, rv, vo, cells, cpos, k, v) for k, v in kvs], H, nkv, D, ns)
                    us = _graph_time(cp, call, a.reps)
                    best = us if best is None else min(best, us)
                    row.append(f"{us:.1f}")
                gbs = 2 * L * nkv * D * 2 / (best * 1e3)  # K and V bytes per microsecond -> GB/s
                print(f"| {kname} | {L:,} | " + " | ".join(row) + f" | {gbs:,.0f} |", flush=True)
        if "stream" in fns:
            print("\nthe backend's stream split count at each length: "
                  + ", ".join(f"{L:,}: s{be._attn_stream_splits(L, fns['stream'][1], 1)}"
                              for L in (int(v) for v in a.cells.split(","))))
        print()
        if a.tiers and D in cu.AS_HEAD_DIMS:
            _tier_table(be, cp, cu, a, H, nkv, D, l2)


def _kv_copies(cp, K, V, copies: int, l2: int, most: int) -> list:
    """``[(K, V), ...]``: the arrays and ``copies - 1`` copies of them (``copies`` <= 0: as many as
    make at least twice ``l2`` bytes, so that cycling over them reads each cold, but at most
    ``most``: the calls of one graph)."""
    n = copies if copies > 0 else min(most, max(1, -(-2 * l2 // (K.nbytes + V.nbytes))))
    return [(K, V)] + [(K.copy(), V.copy()) for _ in range(n - 1)]


def _decode_call(cp, be, fn, grid: tuple, threads: int, smem: int, inputs: list, H: int, nkv: int, D: int,
                 ns: int, extra: tuple = (), v_signs=np.uint64(0)):
    """A closure launching decode kernel ``fn`` (grid, threads, shared memory) with ``ns`` splits,
    plus backend ``be``'s ``attn_merge`` when it splits (its cluster form where the backend takes
    it), into buffers of its own; call i reads ``inputs[i % len]``
    (each a tuple q, q_pos, row_view, view_off, cells, cell_pos, K, V: copies of one cache);
    ``extra``: arguments after the output buffers (a tier kernel's q_rot); ``v_signs``: the merge's
    (a rotated V tier's sign words where the merge un-rotates, cuda_kv.merge_unrotates)."""
    out = cp.empty((1, H * D), cp.float32)
    pa, pm = cp.empty((H * ns * D,), cp.float32), cp.empty((H * ns * 2,), cp.float32)
    turn = [0]

    def call():
        args = inputs[turn[0] % len(inputs)]
        turn[0] += 1
        fn(grid, (threads,), args + (np.int32(H), np.int32(nkv), np.float32(D ** -0.5), np.int32(0), np.float32(0),
                                     np.int32(ns), out, pa, pm) + extra, shared_mem=smem)
        if ns > 1:
            be._merge("a", "attn_merge", out, H, D, (pa, pm, out, np.int32(H), np.int32(D), np.int32(ns), v_signs))

    return call


def _tier_table(be, cp, cu, a, H: int, nkv: int, D: int, l2: int) -> None:
    """The streaming kernel over each tier of ``--tiers`` (K and V) at the backend's split
    count for each ``--cells`` length, against f16: one table (``l2``: the GPU's L2 bytes,
    ``_kv_copies``)."""
    from bench_gemv import _graph_time

    from opencoti.engine.backend import cuda_kv
    from opencoti.engine.kv_tiers import get_tier

    tiers = ["f16"] + [t for t in a.tiers.split(",") if t and t != "f16"]
    print(f"streaming kernel by KV tier ({H} heads, {nkv} kv heads, head dim {D})\n")
    print("| -ctk/-ctv | cells | splits | us | GB/s | vs f16 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for L in (int(v) for v in a.cells.split(",")):
        kf = (rng.standard_normal((L, nkv, D)) * 0.5).astype(np.float32)
        vf = rng.standard_normal((L, nkv, D)).astype(np.float32)
        q = cp.random.standard_normal((1, H, D), dtype=cp.float32)
        qpos, rv, vo = cp.array([L], cp.int32), cp.zeros(1, cp.int32), cp.array([0, L], cp.int32)
        cells, cpos = cp.arange(L, dtype=cp.int32), cp.arange(L, dtype=cp.int32)
        base: dict = {}
        for t in tiers:
            T = get_tier(t)
            K, V = cp.asarray(T.quantize(kf)), cp.asarray(T.quantize(vf))
            kvs = _kv_copies(cp, K, V, a.copies, l2, a.reps)
            rb = K.shape[-1] * K.dtype.itemsize
            hn = cu._as_heads(H // nkv, D, t != "f16")
            gy = nkv * -(-H // nkv // hn)
            if t == "f16":
                smem = cu._as_smem(D, rb, rb, hn=hn)
                fn = be._big_smem_fn("a", f"attn_stream_d{D}{cu._as_suffix(hn)}", smem)
            else:
                smem = cu._as_smem(D, rb, rb, cuda_kv.stream_table_bytes(t, True), cuda_kv.stream_table_bytes(t, False),
                                   hn, True)
                fn = be._kv_attn_fn(t, t, D, 0, smem=smem, hn=hn)
            threads = 2 * cu._as_tile(D, rb, rb, t != "f16")
            fit = be._blocks_per_sm(threads, fn.raw.num_regs, smem)
            counts = [be._attn_stream_splits(L, gy, 1, fit)] + [max(1, L // int(c)) for c in a.split_cells.split(",") if c]
            for i, ns in enumerate(dict.fromkeys(counts)):
                launch = be._stream_pin_smem(smem, fit, gy * ns)  # as attention_cells launches it
                cu._raise_smem(fn, launch)
                call = _decode_call(cp, be, fn, (1, gy, ns), threads, launch,
                                    [(q, qpos, rv, vo, cells, cpos, k, v) for k, v in kvs], H, nkv, D, ns,
                                    () if t == "f16" else (np.int32(0),),
                                    be._merge_signs(t, D, ns))
                us = _graph_time(cp, call, a.reps)
                key = "auto" if i == 0 else ns  # the backend's count against f16's own
                if t == "f16":
                    base[ns] = us
                    base[key] = us
                gbs = 2 * L * nkv * rb / (us * 1e3)
                print(f"| {t} | {L:,} | {ns} | {us:.1f} | {gbs:,.0f} | {us / base.get(key, us):.2f} |", flush=True)
    print()


if __name__ == "__main__":
    main()
