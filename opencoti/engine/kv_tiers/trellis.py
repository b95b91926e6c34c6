"""The Viterbi encoder of the tail-biting right-shift trellis used by ``tcq.py`` (runtime)
and ``codebooks.py`` (codebook training). Kept apart from ``tcq.py`` so that the codebook
generator does not need the shipped tables it produces. See ``tcq.py`` for the trellis."""

from __future__ import annotations

import numpy as np

from opencoti.engine.kv_tiers.codebooks import TCQ_L

WRAP_WINDOW = 8  # values on each side of the wrap searched to choose the shared bits
_CHUNK = 1024  # blocks per Viterbi pass (cache-sized working set; back-pointers ~2 MiB)


def _viterbi(y: np.ndarray, cb: np.ndarray, k: int, L: int, first_low=None, last_high=None) -> np.ndarray:
    """Best state path of the right-shift trellis for targets ``y`` float32 ``[R, n]``.

    ``cb`` float32 ``[2^L]``. ``first_low`` / ``last_high`` (int ``[R]`` or None) fix the
    low L-k bits of the first state / high L-k bits of the last one. Returns int64 ``[R, n]``.
    """
    R, n = y.shape
    S, G, K = 1 << L, 1 << (L - k), 1 << k
    states = np.arange(S)
    cost = np.square(y[:, :1] - cb[None, :])
    if first_low is not None:
        cost[(states[None, :] & (G - 1)) != first_low[:, None]] = np.inf
    back = np.empty((n, R, G), dtype=np.uint8)
    nxt = np.empty((R, K, G), dtype=np.float32)  # state s = hi*G + g, hi < K
    for t in range(1, n):
        # the predecessors of state s are g*K + j (j < K) with g = s & (G-1): one group of K
        grp = cost.reshape(R, G, K)
        j = grp.argmin(axis=2)
        back[t] = j
        best = np.take_along_axis(grp, j[:, :, None], axis=2)
        np.subtract(y[:, t, None], cb[None, :], out=nxt.reshape(R, S))
        np.square(nxt, out=nxt)
        nxt += best.reshape(R, 1, G)
        cost, nxt = nxt.reshape(R, S), cost.reshape(R, K, G)
    if last_high is not None:
        cost[(states[None, :] >> k) != last_high[:, None]] = np.inf
    s = cost.argmin(axis=1)
    path = np.empty((R, n), dtype=np.int64)
    path[:, -1] = s
    rows = np.arange(R)
    for t in range(n - 1, 0, -1):
        g = s & (G - 1)
        s = g * K + back[t][rows, g]
        path[:, t - 1] = s
    return path


def trellis_encode(u: np.ndarray, cb: np.ndarray, k: int, L: int = TCQ_L) -> np.ndarray:
    """Tail-biting Viterbi encode of unit-RMS blocks ``u`` float32 ``[R, 64]`` with codebook
    ``cb`` float32 ``[2^L]`` at ``k`` bits per value. Returns the states int64 ``[R, 64]``:
    consecutive states follow the shift rule and the last state's high L-k bits equal the
    first state's low ones, so the k low bits of each state form the circular stream."""
    u = np.asarray(u, dtype=np.float32)
    cb = np.asarray(cb, dtype=np.float32)
    G = 1 << (L - k)
    w = WRAP_WINDOW
    out = np.empty(u.shape, dtype=np.int64)
    for a in range(0, len(u), _CHUNK):
        y = u[a:a + _CHUNK]
        wrap = _viterbi(np.concatenate([y[:, -w:], y[:, :w]], axis=1), cb, k, L)
        shared = wrap[:, w] & (G - 1)
        out[a:a + _CHUNK] = _viterbi(y, cb, k, L, shared, shared)
    return out
