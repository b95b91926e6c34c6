"""Generators of the rotated tiers' fixed data: the rotation signs, the Lloyd–Max
codebooks (turbo2/3/4/8) and the trellis codebooks (turbo2_tcq, turbo3_tcq).

They run once, offline: ``python -m opencoti.engine.kv_tiers.codebooks`` writes
``_tables.py`` (a Python literal module, so the .pyz needs no data files), which
the tiers import. ``tests/test_kv_tiers.py`` checks that the shipped tables equal
what ``generate()`` returns. Everything here is deterministic (fixed seeds,
fixed iteration counts, float64 numerics rounded to float32 at the end; the Lloyd–Max
levels to float16 numbers, see ``lloyd_max``).

The distribution being quantized: a head vector rotated by a random orthogonal
map (here a sign-flipped Walsh–Hadamard transform, see ``turbo.py``) is close to
uniform on its sphere, and so is each block of ``BLOCK`` consecutive rotated
coordinates once divided by its own norm. A coordinate of a uniform point on
the unit sphere of R^B has density proportional to ``(1 - t^2)^((B-3)/2)`` on
[-1, 1] (TurboQuant, Zandieh et al. 2025, Lemma 1); scaled by sqrt(B) to unit
variance it is ``p(y) ∝ (1 - y^2/B)^((B-3)/2)``, a Gaussian with slightly
lighter tails. The codebooks are MSE-optimal for that density.
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np

BLOCK = 64  # rotated values per block of the turbo/tcq tiers (one f16 scale each)
D_MAX = 512  # largest head size the sign table covers
SIGNS_SEED = 0x7C0D1
LLOYD_MAX_BITS = (2, 3, 4, 8)
TCQ_K = (2, 3)  # bits per value of the trellis tiers
TCQ_L = 8  # trellis state bits: 256 states, the codebook has 2^L entries
TCQ_SEED = 0x7C0D2
TCQ_TRAIN_SEQS = 2048
TCQ_TRAIN_ITERS = 24


def rotation_signs(n: int = D_MAX, seed: int = SIGNS_SEED) -> np.ndarray:
    """The fixed random sign flips applied before the Walsh–Hadamard transform:
    int8 ``[n]`` of +1/-1 (``numpy.random.default_rng(seed)``, fair coin per entry)."""
    bits = np.random.default_rng(seed).integers(0, 2, size=n)
    return (1 - 2 * bits).astype(np.int8)


def _density_grid(block: int, n: int = 400_001):
    """Grid ``y`` over [-sqrt(B), sqrt(B)] and the normalized CDF ``F`` and partial first
    moment ``G`` (trapezoid rule) of ``p(y) ∝ (1 - y^2/B)^((B-3)/2)``, plus the CDF of
    ``p^(1/3)`` (Panter–Dite point density, used as the starting point)."""
    a = np.sqrt(block)
    y = np.linspace(-a, a, n)
    p = np.clip(1.0 - y * y / block, 0.0, None) ** ((block - 3) / 2.0)
    dy = y[1] - y[0]

    def cum(f):
        return np.concatenate([[0.0], np.cumsum((f[1:] + f[:-1]) * (dy / 2.0))])

    z = cum(p)[-1]
    p3 = cum(p ** (1.0 / 3.0))
    return y, cum(p) / z, cum(y * p) / z, p3 / p3[-1]


def lloyd_max(bits: int, block: int = BLOCK, iters: int = 20_000, tol: float = 1e-12) -> np.ndarray:
    """MSE-optimal scalar quantizer (Lloyd 1957 / Max 1960) with ``2**bits`` levels for the
    unit-variance block coordinate density (module doc). Starts from the Panter–Dite
    companding levels and iterates centroid = conditional mean between the midpoints,
    symmetrized, until the largest move is below ``tol`` or after ``iters`` rounds.
    Returns float32 ``[2**bits]`` ascending, each level rounded to the nearest float16
    (a relative move of at most 4.4e-4, far inside a level's cell): the CUDA streaming
    kernels take the levels as exact f16 tensor-core operands (kv_codes.cuh), so the GPU
    multiplies by the very numbers the CPU reference decodes to."""
    y, F, G, P3 = _density_grid(block)
    n = 1 << bits
    c = np.interp((np.arange(n) + 0.5) / n, P3, y)
    for _ in range(iters):
        t = (c[1:] + c[:-1]) / 2
        Fe = np.concatenate([[0.0], np.interp(t, y, F), [1.0]])
        Ge = np.concatenate([[G[0]], np.interp(t, y, G), [G[-1]]])
        cn = (Ge[1:] - Ge[:-1]) / (Fe[1:] - Fe[:-1])
        cn = (cn - cn[::-1]) / 2
        done = np.max(np.abs(cn - c)) < tol
        c = cn
        if done:
            break
    return c.astype(np.float16).astype(np.float32)


def sphere_blocks(n: int, block: int = BLOCK, seed: int = TCQ_SEED) -> np.ndarray:
    """``n`` points uniform on the sphere of radius sqrt(block) in R^block (float64 ``[n, block]``):
    the training distribution of the trellis codebooks."""
    x = np.random.default_rng(seed).standard_normal((n, block))
    return x / np.linalg.norm(x, axis=1, keepdims=True) * np.sqrt(block)


def tcq_codebook(k: int, L: int = TCQ_L, n_seq: int = TCQ_TRAIN_SEQS, iters: int = TCQ_TRAIN_ITERS,
                 seed: int = TCQ_SEED) -> np.ndarray:
    """Reconstruction values of the tail-biting bitshift trellis with ``2**L`` states and
    ``k`` bits per value (``tcq.py``), trained like a vector quantizer (generalized Lloyd:
    Linde, Buzo & Gray 1980): start from the 2^L Gaussian quantiles in a fixed random order,
    then repeat {encode the training blocks with the runtime Viterbi encoder; set each
    state's value to the mean of the samples coded with it}. Returns float32 ``[2**L]``."""
    from opencoti.engine.kv_tiers.trellis import trellis_encode

    S = 1 << L
    nd = NormalDist()
    q = np.array([nd.inv_cdf((i + 0.5) / S) for i in range(S)])
    cb = q[np.random.default_rng(seed).permutation(S)]
    x = sphere_blocks(n_seq, seed=seed)
    xf = x.astype(np.float32)
    for _ in range(iters):
        st = trellis_encode(xf, cb.astype(np.float32), k, L)
        sums = np.bincount(st.ravel(), weights=x.ravel(), minlength=S)
        cnt = np.bincount(st.ravel(), minlength=S)
        cb = np.where(cnt > 0, sums / np.maximum(cnt, 1), cb)
    return cb.astype(np.float32)


def generate() -> dict:
    """All shipped tables: ``{"signs": int8 [D_MAX], "lloyd_max": {bits: float32 [2^bits]},
    "tcq": {k: float32 [2^TCQ_L]}}``."""
    return {
        "signs": rotation_signs(),
        "lloyd_max": {b: lloyd_max(b) for b in LLOYD_MAX_BITS},
        "tcq": {k: tcq_codebook(k) for k in TCQ_K},
    }


def _floats(a: np.ndarray) -> str:
    vals = [repr(float(v)) for v in np.asarray(a, dtype=np.float32)]
    lines = []
    for i in range(0, len(vals), 6):
        lines.append("        " + ", ".join(vals[i:i + 6]) + ",")
    return "\n".join(lines)


def render(tables: dict) -> str:
    """The source text of ``_tables.py`` for ``tables`` (see ``generate``)."""
    signs = np.packbits((np.asarray(tables["signs"]) < 0).astype(np.uint8), bitorder="little")
    out = [
        '"""Shipped data of the rotated KV tiers. Generated by',
        "``python -m opencoti.engine.kv_tiers.codebooks`` (see ``codebooks.py``); do not edit.",
        "",
        "SIGNS_HEX: the rotation's sign flips for head sizes up to 512, bit i (byte i // 8,",
        "bit i % 8, least significant first) set = entry i is -1.",
        "LLOYD_MAX[bits]: 2^bits ascending reconstruction levels (unit-variance block coordinates).",
        f"TCQ[k]: 2^{TCQ_L} reconstruction values of the k-bit trellis, indexed by state.",
        '"""',
        "",
        f'SIGNS_HEX = "{signs.tobytes().hex()}"',
        "",
        "LLOYD_MAX = {",
    ]
    for b, c in tables["lloyd_max"].items():
        out += [f"    {b}: (", _floats(c), "    ),"]
    out += ["}", "", "TCQ = {"]
    for k, c in tables["tcq"].items():
        out += [f"    {k}: (", _floats(c), "    ),"]
    out += ["}", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    """Regenerate ``_tables.py`` next to this file (or print it with ``--print``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    text = render(generate())
    if "--print" in argv:
        sys.stdout.write(text)
        return 0
    path = Path(__file__).with_name("_tables.py")
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
