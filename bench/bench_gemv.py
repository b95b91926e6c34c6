"""One quantized matmul on a GPU, per kernel path: GPU time and weight bandwidth (issue 4).

    python bench/bench_gemv.py [--preset qwen2.5-7b] [--rows 1,8,32,64] [--reps 20]

For each weight of the preset's shapes (random valid blocks of the model's quant types)
and each activation row count it times the CUDA backend's paths inside a captured CUDA
graph (so Python launch cost does not count): ``float`` (the float32 GEMV units for up to 8
rows, mmq.cu's tensor-core tiles from 9), ``imma`` (gemv_int.cu: integer tensor cores on
int8 digit columns, incl. the activation quantization), and prints microseconds per call,
GB/s of weight bytes, and each path's error against float64 on the dequantized weight
(max |err| / max |y|). The integer paths read the weights in the 16-row tiles a model's weights
upload in (cuda.py ``tiles_weight``; ``--rows-layout``: GGUF rows). ``--duo``: instead, a layer's fused q + k (Q4_K) and its Q6_K v times one
row on digits made once (as a norm leaves them): the two ring products launched one by one
against one gemvi_duo grid.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# name -> (ggml type, rows, cols)
PRESETS = {
    "qwen2.5-7b": [("attn_q / attn_output", 12, 3584, 3584), ("attn_k", 12, 512, 3584),
                   ("attn_q+k fused", 12, 4096, 3584), ("attn_v q6", 14, 512, 3584),
                   ("ffn_up / ffn_gate", 12, 18944, 3584), ("ffn_gate+up fused", 12, 37888, 3584),
                   ("ffn_down", 14, 3584, 18944), ("output", 14, 152064, 3584)],
    "gemma-3-270m": [("ffn_down", 12, 640, 2048), ("ffn_down q6", 14, 640, 2048)],
}
F16_FIELDS = {12: [0, 2], 14: [208]}  # byte offsets of the f16 scales in a block (ggml-common.h)


def random_weight(cp, t: int, rows: int, cols: int):
    """Random valid blocks of ggml type ``t`` ``uint8 [rows, row_bytes]`` on the device (random
    bits, the f16 scales set to sane values: random f16 bits can be NaN)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blk, size = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
    offs = F16_FIELDS[t]
    nb = cols // blk
    raw = cp.random.randint(0, 256, (rows, nb, size), dtype=cp.int32).astype(cp.uint8)
    for off in offs:
        d = cp.random.uniform(0.002, 0.05, (rows, nb)).astype(cp.float16)
        raw[:, :, off:off + 2] = d.view(cp.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-7b", choices=sorted(PRESETS))
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warps", default="0", help="gemv_int.cu warps per row tile, one token row, to try (comma list; 0: the default)")
    ap.add_argument("--stages", default="0", help="gemv_int.cu ring slots per warp, one token row, to try (2, 4; 0: the default)")
    ap.add_argument("--gemmi-blocks", default="0", help="gemmi blocks per SM variants to try (comma list; 0: the default)")
    ap.add_argument("--digits", default="0", help="digits per activation value to try (comma list of 2, 3; 0: the default)")
    ap.add_argument("--row-tiles", default="0", help="gemv_int.cu 16-row MMA tiles per warp, one token row, to try "
                    "(comma list of 1, 2; 0: the default)")
    ap.add_argument("--gemmi-ring", default="0", help="gemmi shared-memory stages to try (comma list; 0: the "
                    "default, -1: the register-prefetch kernel)")
    ap.add_argument("--gemmi-tokens", default="0", help="gemmi tokens per block to try (comma list of 16, 32; "
                    "0: the default)")
    ap.add_argument("--duo", action="store_true", help="time the q + k / v pair as two launches and as one gemvi_duo grid")
    ap.add_argument("--weights", default="", help="only the preset's weights whose name contains this")
    ap.add_argument("--rows-layout", action="store_true", help="the integer paths on GGUF rows, not in the 16-row "
                    "tiles a model's weights upload in (cuda.py tiles_weight)")
    a = ap.parse_args()
    import cupy as cp

    from opencoti.engine.backend import cuda as cu

    be = cu.CUDABackend()
    if a.duo:
        return _duo(cp, cu, be, a.reps)
    paths = {"float": lambda x, w: _without_imma(cu, lambda: be.mul_mat(x, w))}
    ints = lambda arg: [int(v) for v in arg.split(",")]  # noqa: E731
    for nw, ns, nb, nd, rt, rg, gt in itertools.product(ints(a.warps), ints(a.stages), ints(a.gemmi_blocks),
                                                        ints(a.digits), ints(a.row_tiles), ints(a.gemmi_ring),
                                                        ints(a.gemmi_tokens)):
        if rt == 2 and ns not in (0, 2):
            continue  # the two-tile kernels are built with 2 slots only
        paths[f"imma w{nw} s{ns} o{nb} d{nd}" + (f" r{rt}" if rt else "") + (f" g{rg}" if rg else "")
              + (f" t{gt}" if gt else "")] = (
            lambda x, w, nw=nw, ns=ns, nb=nb, nd=nd, rt=rt, rg=rg, gt=gt: _imma(cu, be, x, w, nw, ns, nb, nd, rt, rg, gt))
    print(f"\nbench_gemv: {be.device_name}, preset {a.preset}, >= {a.reps} calls in one CUDA graph, "
          "weights cycled through >= 150 MB of copies (no L2 reuse)\n")
    print("| weight | type | MB | rows | path | us | GB/s | max err / max y |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for name, t, rows, cols in PRESETS[a.preset]:
        if a.weights not in name:
            continue
        raw = random_weight(cp, t, rows, cols)
        mb = raw.nbytes / 1e6
        # copies of the weight cycled through by the graph's calls, >= 150 MB in all (H200 L2:
        # 60 MB), so every call streams its weight from memory as in a model's decode step
        ws = [cu.QTensor((raw if i == 0 else raw.copy()).reshape(-1), t, (rows, cols), raw.shape[1])
              for i in range(min(150, math.ceil(150 / mb)))]
        # the integer paths read the weight as a model uploads it (16-row tiles where it tiles)
        wt = ws if a.rows_layout or not cu.tiles_weight(t, rows, cols) else [v.to_tiles() for v in ws]
        reps = max(a.reps, len(ws))
        nref = min(rows, 2048)
        wref = be.dequantize(cu.QTensor(raw[:nref].reshape(-1), t, (nref, cols), raw.shape[1])).astype(cp.float64)
        for n in (int(v) for v in a.rows.split(",")):
            x = cp.random.standard_normal((n, cols), dtype=cp.float32)
            x[:, 7] *= 40.0  # an outlier channel, as real activations have
            want = x.astype(cp.float64) @ wref.T
            for pname, fn in paths.items():
                wp = ws if pname == "float" else wt
                y = fn(x, wp[0])
                err = float(cp.abs(y[:, :nref] - want).max() / cp.abs(want).max())
                it = iter(range(1 << 30))
                us = _graph_time(cp, lambda: fn(x, wp[next(it) % len(wp)]), reps)
                print(f"| {name} | {cu.QTYPES[t]} | {mb:,.1f} | {n} | {pname} | {us:,.1f} | {mb * 1e3 / us:,.0f} | "
                      f"{err:.1e} |", flush=True)


def _duo(cp, cu, be, reps: int) -> None:
    """The 7B's q + k (Q4_K 4,096 x 3,584) and v (Q6_K 512 x 3,584) for one token row: two launches
    against one gemvi_duo grid, weight copies cycled as in main()."""
    (t1, r1, c), (t2, r2, _) = (12, 4096, 3584), (14, 512, 3584)
    raws = [(random_weight(cp, t1, r1, c), random_weight(cp, t2, r2, c)) for _ in range(16)]  # 16 x 9.8 MB
    pairs = [tuple(cu.QTensor(r.reshape(-1), t, (rows, c), r.shape[1]) for r, t, rows in zip(p, (t1, t2), (r1, r2)))
             for p in raws]
    tiled = [tuple(w.to_tiles() for w in p) for p in pairs]
    x = cp.random.standard_normal((1, c), dtype=cp.float32)
    d = be._digits(x)
    ways = {"two launches": lambda w: (be._gemvi(d, w[0]), be._gemvi(d, w[1])),
            "gemvi_duo": lambda w: be._gemvi_duo(d, w[0], w[1])}
    ref = [cp.asnumpy(y) for y in ways["two launches"](pairs[0])]
    ways.update({f"{k}, 16-row tiles": v for k, v in ways.items()})
    mb = sum(r.nbytes for r in raws[0]) / 1e6
    print(f"\nbench_gemv --duo: {be.device_name}, q + k Q4_K and v Q6_K, one row, {mb:.1f} MB\n")
    print("| path | us | GB/s | equal to two launches |")
    print("| --- | ---: | ---: | --- |")
    for name, f in ways.items():
        ps = tiled if name.endswith("tiles") else pairs
        same = all((cp.asnumpy(y) == r).all() for y, r in zip(f(ps[0]), ref))
        it = iter(range(1 << 30))
        us = _graph_time(cp, lambda: f(ps[next(it) % len(ps)]), max(reps, len(ps)))
        print(f"| {name} | {us:,.1f} | {mb * 1e3 / us:,.0f} | {same} |", flush=True)


def _without_imma(cu, f):
    keep = cu.IMMA_MAX_ROWS
    cu.IMMA_MAX_ROWS = 0
    try:
        return f()
    finally:
        cu.IMMA_MAX_ROWS = keep


def _imma(cu, be, x, w, nw: int, ns: int, nb: int, nd: int, rt: int = 0, rg: int = 0, gt: int = 0):
    keep = (cu.GEMVI_WARPS, cu.GEMVI_STAGES, cu.GEMMI_BLOCKS, cu.IMMA_DIGITS, cu.GEMVI_ROW_TILES, cu.GEMMI_RING,
            cu.GEMMI_TOKENS)
    cu.GEMVI_WARPS = nw
    if ns:
        cu.GEMVI_STAGES = ns
    if nb:
        cu.GEMMI_BLOCKS = nb
    if nd:
        cu.IMMA_DIGITS = nd
    if rt:
        cu.GEMVI_ROW_TILES = rt
    if rg:
        cu.GEMMI_RING = max(rg, 0)  # -1: the register kernel
    if gt:
        cu.GEMMI_TOKENS = gt
    try:
        be._digits_of = (None, None)  # time the activation quantization as well
        return be._gemvi(be._digits(x), w)
    finally:
        (cu.GEMVI_WARPS, cu.GEMVI_STAGES, cu.GEMMI_BLOCKS, cu.IMMA_DIGITS, cu.GEMVI_ROW_TILES, cu.GEMMI_RING,
         cu.GEMMI_TOKENS) = keep


def _graph_time(cp, f, reps: int) -> float:
    """Microseconds per call of ``f`` replayed ``reps`` times inside one CUDA graph."""
    s = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()  # as run_graph: a private pool, relaxed capture
    with cp.cuda.using_allocator(pool.malloc), s:
        f()
        s.synchronize()
        s.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        for _ in range(reps):
            f()
        g = s.end_capture()
        g.launch(s)
        s.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(3):
            g.launch(s)
        e1.record(s)
        e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / (3 * reps)


if __name__ == "__main__":
    main()
