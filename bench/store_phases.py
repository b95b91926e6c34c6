"""Where a fused rope + KV store block's time goes, phase by phase, in a decode graph's replay.

    python bench/store_phases.py -m model.gguf [--tiers f16,turbo3] [--depth 4096] [--replays 30]

The fused rope + KV store kernels (kernels.cu ``rope_kv_write`` for f16 caches, rope_store.cu
``rope_kv_write_q`` for the tiers) are built from their sources with ``clock64()`` stamps inserted
at fixed points (``STAMPS``: text inserted before / after anchors of the inlined source, each of
which must occur exactly once -- a moved anchor fails here instead of stamping the wrong place).
Thread 0 of blocks 0-63 writes stamp i to ``g_probe[block][i]``; a stamp that follows a value
first branches on it, so the clock is read once that value is ready (a plain read would be
issued before an outstanding load completes). Per tier a runner is prefilled to ``--depth``
cells, decodes a few steps (graph capture), and its last step's graph is replayed; after each
replay the stamps of the last layer's store are read back. Printed: per block of the store's grid
(q rows, then K rows, then the tiers' V rows), the median over replays of each stamp in cycles
after the block's first (SM clocks: compare within a block, not across). Stamps: ``pre`` the
values read before the PDL wait (rope_pre), ``wait`` the wait's return (the q / k / v product
done), ``load`` the row's value (with RS_K_NORM_LATE a turbo K row's value and its rope partner's),
``norm`` the norm's scale, ``rope`` rope's output; the turbo
tiers' encoder (kv_store.cuh ``turbo_row``): ``fwht`` the rotation, ``n`` the block norm,
``codes`` the indices, ``pack`` the payload stored (written after the scale's sums in the source,
and interleaved with them), ``scale`` the block scale; ``end`` f16's V store. The stamps cost a
few instructions each and move the code: a profile of the phases, not of the kernel's exact time.
CUDA only (CuPy, an NVIDIA GPU).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kv_tiers import _decode, replay_step  # noqa: E402
from common import prefill  # noqa: E402

from opencoti.engine.backend import cuda as cuda_backend  # noqa: E402
from opencoti.engine.backend import cuda_kernels, cuda_kv  # noqa: E402
from opencoti.engine.runner import ModelRunner  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402

PROBE_DEFS = r"""
__device__ long long g_probe[64 * 16];
__device__ int g_probe_sink;
#define PROBE(i) do { if (threadIdx.x == 0 && blockIdx.x < 64) g_probe[blockIdx.x * 16 + (i)] = clock64(); } while (0)
#define PROBE_V(i, pv_) do { if (threadIdx.x == 0 && blockIdx.x < 64) { \
    if (__float_as_uint(pv_) == 0x7fc01234u) g_probe_sink = 1; g_probe[blockIdx.x * 16 + (i)] = clock64(); } } while (0)
"""
NAMES = ["start", "pre", "wait", "load", "norm", "rope", "fwht", "n", "codes", "pack", "scale", "end"]
_PRE = "    const RopePre pre = ROPE_PRE();  // (before the wait: rope.cuh ROPE_ANGLE_PRE)\n"
_WAIT = "    GRID_DEP_WAIT();\n"
_SIGN = "    const u32 sw = rs_sign_word();   // (before the wait: a constant)\n"
# (sources: "f16" kernels.cu, "tier" rope_store.cu, or "both"; anchor; inserted before it; inserted after it)
STAMPS = [
    ("f16", _PRE + _WAIT, "    PROBE(0);\n", "    PROBE(2);\n"),
    ("tier", _PRE + _SIGN + _WAIT, "    PROBE(0);\n", "    PROBE(2);\n"),
    ("both", _PRE, "", "    PROBE_V(1, pre.cs.x);\n"),
    ("both", "            buf[i] = x;\n        }\n", "", "        PROBE_V(3, x);\n"),
    ("both", "            r = rsqrtf(s / D + eps);\n        } else {\n            __syncthreads();\n        }\n", "",
     "        PROBE_V(4, r);\n"),
    ("both", "        return;\n    }\n    for (int i = threadIdx.x; i < D; i += blockDim.x) {  // the row (+ bias), once\n",
     "        PROBE(5);\n", ""),
    ("both", "    if (i < n_rot) xp = slab_sum(xr, ip, ns, slab);  // (both loads in flight together)\n", "",
     "    PROBE_V(3, x);\n"),
    ("tier", "    fwht_column<D, GAIN>(x, sw, sc, v, gss, gsh);\n    if (b >= D / 64) return;\n", "",
     "    PROBE_V(6, v[D / 32 - 1]);\n"),
    ("tier", "    const float n = xsqrt(nn);\n", "", "    PROBE_V(7, n);\n"),
    ("tier", "    // the scale's two sums, and the payload", "    PROBE_V(8, yc[1]);\n", ""),
    ("tier", "        if (j + 32 * k < T::BB - 2) dst[2 + j + 32 * k] = (u8)byte;\n    }\n", "", "    PROBE(9);\n"),
    ("tier", "    if (j == 0) st16(dst, f2h(scale));\n", "", "    PROBE_V(10, scale);\n"),
    ("f16", "    if (v_reg && (int)threadIdx.x < dv) V[c * dv + threadIdx.x] = f2h(vx);\n", "", "    PROBE(11);\n"),
]


def stamped(src: str, kind: str) -> str:
    """``src`` (an inlined kernels.cu or rope_store.cu module, ``kind`` "f16" or "tier") with
    PROBE_DEFS and its STAMPS, applied in order (an anchor may contain an earlier stamp's anchor).
    Raises ValueError naming an anchor that does not occur exactly once."""
    for where, anchor, before, after in STAMPS:
        if where not in ("both", kind):
            continue
        if src.count(anchor) != 1:
            raise ValueError(f"store_phases: anchor {anchor.strip()[:60]!r} occurs {src.count(anchor)} times "
                             f"in the {kind} source")
        src = src.replace(anchor, before + anchor + after)
    return PROBE_DEFS + src


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tiers", default="f16,turbo3")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=30)
    a = ap.parse_args()

    read = cuda_kernels.read_source
    kinds = {"kernels.cu": "f16", "rope_store.cu": "tier"}
    mods: dict = {}
    load = cuda_backend.load_source

    def read_stamped(name: str) -> str:
        s = read(name)
        return stamped(s, kinds[name]) if name in kinds else s

    def load_kept(src, tag, *args, **kw):
        mods[tag] = m = load(src, tag, *args, **kw)
        return m

    cuda_backend.read_source = cuda_kv.read_source = read_stamped
    cuda_backend.load_source = load_kept
    import cupy as cp

    model = load_model(a.model, with_tokenizer=False)
    for spec in [t for t in a.tiers.split(",") if t]:
        tk, tv = spec.split("/") if "/" in spec else (spec, spec)
        runner = ModelRunner(model, "cuda", n_ctx=a.depth + 512, n_ubatch=512, type_k=tk, type_v=tv)
        if a.depth:
            prefill(runner, a.depth)
        _decode(runner, a.depth, 8, 0)  # graph capture
        tag = "kernels" if tk == "f16" and tv == "f16" else next(t for t in mods if t.startswith("rope_store"))
        g = mods[tag].get_global("g_probe")
        cfg = runner.model.hparams
        n_blocks = cfg.n_head + (1 if tag == "kernels" else 2) * cfg.n_head_kv
        stamps = []
        for _ in range(a.replays):
            probe = cp.ndarray((64, 16), dtype=cp.int64, memptr=g)
            probe.fill(0)  # (the stamps a block's path skips stay 0; the prefill's would linger)
            replay_step(runner, 1)
            stamps.append(probe.get()[:n_blocks, :len(NAMES)])
        st = np.array(stamps)  # [replay, block, stamp]
        seen = (st != 0).all(axis=0)  # the stamps this block's path passes
        rel = np.median(st - st[:, :, :1], axis=0)
        cols = [i for i in range(1, len(NAMES)) if seen[:, i].any()]
        print(f"\n{spec} at depth {a.depth}, {model.name}: cycles after the block's start (median of {a.replays} "
              f"replays, the last layer's store)\n")
        print("| block | " + " | ".join(NAMES[i] for i in cols) + " |")
        print("| --- |" + " ---: |" * len(cols))
        for b in range(n_blocks):
            role = "q" if b < cfg.n_head else "K" if b < cfg.n_head + cfg.n_head_kv else "V"
            cells = [f"{rel[b, i]:,.0f}" if seen[b, i] else "" for i in cols]
            print(f"| {b} ({role}) | " + " | ".join(cells) + " |")
        del runner


if __name__ == "__main__":
    main()
