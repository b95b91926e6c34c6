"""KV cache tiers: the storage formats of cached K and V, one storage class per format.

Every tier implements ``KVTier`` (``base.py``): ``name``, ``block_size`` (values per
block), ``block_bytes``, ``bits_per_value``, ``bytes_per_row(d)``, ``quantize(x f32
[..., d]) -> [..., row]`` and ``dequantize(row) -> f32 [..., d]``. A cell row (one cell,
one KV head) is a whole number of blocks, contiguous; each module documents its block's
bytes exactly, for kernels that decode in registers.

- ``scalar.py``: f32, f16 (native float arrays, what the cache stored before tiers),
  bf16, and ggml's q8_0, q6_0, q5_1, q5_0, q4_1, q4_0 and iq4_nl with their exact block
  layouts and reference rounding.
- ``turbo.py``: turbo2/3/4/8 — TurboQuant: sign-flipped Walsh–Hadamard rotation of the
  head vector, then per 64-value block an f16 least-squares scale and Lloyd–Max codes.
- ``tcq.py``: turbo2_tcq, turbo3_tcq — the same rotation and scale, values coded by a
  tail-biting 256-state bitshift trellis (Viterbi on write, table lookup on read).
- ``codebooks.py`` generates the rotation signs and codebooks once; ``_tables.py`` ships them.

The tier is chosen per cache half at boot (``-ctk`` / ``-ctv``; ``-ctkt`` / ``-ctvt`` for
the spilled tail, converted with ``convert``) and a cell is quantized once, when written.

Measured quality — teacher-forced against the f16 cache of the same model, CPU backend
(``python -m opencoti.tools.kv_tier_quality --model gemma|synth128``; the gates in
``tests/test_kv_tier_quality.py`` bound exactly these runs; gemma's on an AMD EPYC with numpy
2.4.6, the CI's machine). gemma: gemma-3-270m Q4_K_M
(iSWA, head_dim 256, 1 KV head), the reference cases ``code`` + ``long_swa`` (767 tokens,
past the 512-token window), 159 scored positions. synth: a random-weight dense llama-style
model with head_dim 128 (2 layers, 2 KV heads), two 160-token sequences, 318 positions.
KLD = mean KL(P_f16 || P_tier) in nats; top-1 = agreement of the argmax with f16. KV MiB
is the whole cache of one sequence at n_ctx 32768 (gemma's sliding-window cache stays at
1024 cells)::

    type_k / type_v          bits/value   KV MiB gemma / synth   gemma KLD  top-1   synth KLD  top-1
    f16 / f16                16, 16         111.0 /  64.0           0       1.0000       0      1.0000
    f32 / f32                32, 32         222.0 / 128.0        7.14e-08   1.0000   5.78e-08   1.0000
    bf16 / bf16              16, 16         111.0 /  64.0        1.82e-05   1.0000   3.45e-06   0.9906
    q8_0 / q8_0              8.5, 8.5        59.0 /  34.0         0.00112   1.0000   3.33e-05   0.9937
    q6_0 / q6_0              6.5, 6.5        45.1 /  26.0         0.00745   0.9811    0.00053   0.9340
    q5_1 / q5_1              6, 6            41.6 /  24.0          0.0227   0.9811    0.00164   0.8648
    q5_0 / q5_0              5.5, 5.5        38.2 /  22.0          0.0232   0.9811    0.00197   0.8868
    q4_0 / q4_0              4.5, 4.5        31.2 /  18.0          0.0493   0.9623    0.00883   0.7799
    q4_1 / q4_1 (*)          5, 5            34.7 /  20.0          0.0591   0.9245    0.00724   0.8616
    iq4_nl / iq4_nl (*)      4.5, 4.5        31.2 /  18.0          0.0361   0.9623    0.00713   0.8176
    turbo8 / turbo8          8.25, 8.25      57.2 /  33.0        0.000498   0.9937   4.38e-05   0.9780
    turbo4 / turbo4          4.25, 4.25      29.5 /  17.0          0.0478   0.9686     0.0101   0.7925
    turbo3 / turbo3          3.25, 3.25      22.5 /  13.0           0.343   0.8931      0.036   0.6226
    turbo2 / turbo2          2.25, 2.25      15.6 /   9.0            2.74   0.4088      0.121   0.4119
    turbo3_tcq / turbo3_tcq  3.25, 3.25      22.5 /  13.0           0.266   0.8868     0.0255   0.6698
    turbo2_tcq / turbo2_tcq  2.25, 2.25      15.6 /   9.0            1.55   0.6604      0.089   0.4465
    f16 / q4_0               16, 4.5         71.1 /  41.0         0.00350   0.9874    0.00548   0.8050
    q4_0 / f16               4.5, 16         71.1 /  41.0          0.0919   0.9434    0.00344   0.8616
    q8_0 / turbo3            8.5, 3.25       40.8 /  23.5         0.00862   0.9874      0.023   0.7075
    turbo3 / q8_0            3.25, 8.5       40.8 /  23.5           0.344   0.8868     0.0141   0.7327

(*) gemma's column for q4_1 and iq4_nl was measured on an Intel Xeon (numpy 2.4.6), where q4_0
read 0.0452 / 0.9623; the synth column is the same on both machines.

The gemma KLDs of the lossy rotated tiers are sensitive to float rounding: scaling every K/V
row by 1 +- 2^-22 before turbo3 (which changes no code mathematically, only roundings) moves
its KLD between 0.317 and 0.361 and top-1 by 0.006; the rotated rows above were re-measured
when the write arithmetic was fixed (butterfly rotation, pairwise sums; before: 0.281 / 0.9182
for turbo3), the synth column did not move; and again when the Lloyd-Max levels were rounded to
f16 numbers (each moved by at most 4.4e-4 relative; before, gemma turbo3 0.361 / 0.8931,
turbo4 0.0531 / 0.9497, turbo2 2.93 / 0.3333, turbo3 / q8_0 0.392 / 0.9119; the synth column
moved in its third digit).

The gemma column also moves with the float environment, most where the KLD is small: it is a
mean over 159 positions that a few dominate (turbo8: position 41 of ``code`` alone gives
0.029-0.051 of that case's KLD sum of 0.038-0.059). On the same machine with numpy 2.3.5
instead of 2.4.6 it read f32 1.86e-07, bf16 2.84e-05, q8_0 0.00065, q5_1 0.0144, turbo8
0.000421, turbo3 0.351, turbo3 / q8_0 0.311 (top-1 within 0.02); another machine had recorded
turbo8 0.000265 and turbo3 0.322. The synth column did not move. The gates allow 3x below
1e-3 nats and 1.5x above.

Past gemma-3's window (first 1024 tokens of ``long_2k``, 64 positions from 512): q8_0/q8_0
KLD 2.2e-06, top-1 1.0; q4_0/q4_0 KLD 0.00909, top-1 1.0 (another machine: 2.38e-06 /
0.00817). (The random model's top-1 is low for every lossy tier because its logits are nearly
tied; its KLD is the informative column.)

Reading it: q8_0 and turbo8 are near-lossless. turbo4 matches q4_0 at 4.25 instead of 4.5
bits. iq4_nl beats q4_0 at the same 4.5 bits on both models (its 16 levels are denser near 0, and
its scale is fitted by least squares). q4_1 spends half a bit more than q4_0 on a per-block
offset: better on synth (0.00724 against 0.00883), worse on gemma (0.0591 against q4_0's 0.0452
on the same machine; on a block symmetric about 0 its step, (max - min) / 15, is wider than q4_0's
max / 8).

turbo3 does *not* beat q4_0: on gemma-3 its KLD is ~6-7x q4_0's. Checked: the
codebooks are Lloyd–Max optimal (per-value MSE 0.0325 at 3 bits, the theory's value for this
density), the rotation makes the error independent of gemma's outlier channels (q4_0's error
doubles on them, turbo's does not move), and the scale choice does not matter (least-squares,
norm-preserving and inner-product-unbiased scales give attention KLs within 1%). The limit is
information: q4_0's relative MSE on gemma-3 keys (0.0157) already equals the Shannon bound of
any 3-bit code for Gaussianized data (2^-6 = 0.0156), and gemma-3's attention turns K error
into KLD steeply (q4_0 on K alone: 0.092; on V alone: 0.0035). The trellis closes part of the
gap (turbo3_tcq's MSE is 0.022 vs turbo3's 0.0325). The rotated tiers pay off on V:
q8_0 / turbo3 keeps KLD < 0.01 at 37% of the f16 cache.
"""

from __future__ import annotations

# Importable without NumPy (the CLI validates -ctk/-ctv before NumPy may load, see cli.py);
# tests check that the registry holds exactly these, in this order.
TIER_NAMES = ("f32", "f16", "bf16", "q8_0", "q6_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl",
              "turbo8", "turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq")

# auto-tier walks these, least compressing first (engine/kv_auto_tier.py)
AUTO_TIER_ORDER = ("f16", "q8_0", "q6_0", "q5_1", "q5_0", "q4_0")

_REGISTRY: dict = {}


def _registry() -> dict:
    """name -> ``KVTier``, built on first use (the rotated tiers load their shipped tables)."""
    if not _REGISTRY:
        from opencoti.engine.kv_tiers import scalar, tcq, turbo

        for t in scalar.TIERS + turbo.TIERS + tcq.TIERS:
            _REGISTRY[t.name] = t
    return _REGISTRY


def unknown_type_message(name) -> str:
    """The error text for a KV cache type that does not exist (names the allowed values)."""
    return f"unsupported KV cache type {name!r} (allowed: {', '.join(TIER_NAMES)})"


def get_tier(name):
    """The ``KVTier`` called ``name`` (a ``KVTier`` passes through). Raises ``ValueError``
    naming the allowed values for an unknown name."""
    from opencoti.engine.kv_tiers.base import KVTier

    if isinstance(name, KVTier):
        return name
    t = _registry().get(str(name).lower())
    if t is None:
        raise ValueError(unknown_type_message(name))
    return t


def convert(q, src, dst):
    """Re-encode stored rows ``q`` (``[..., src.row_len(d)]``) from tier ``src`` to tier
    ``dst`` (names or tiers) -> ``[..., dst.row_len(d)]``: dequantize to float32, quantize
    again; the same tier returns a copy. This moves cells into a more compressed tail tier
    (``-ctkt`` / ``-ctvt``); between two rotated tiers the round trip through the
    un-rotated domain is exact up to float32 rounding (the rotation is orthonormal)."""
    src, dst = get_tier(src), get_tier(dst)
    if src is dst:
        return q.copy()
    return dst.quantize(src.dequantize(q))


__all__ = ["AUTO_TIER_ORDER", "TIER_NAMES", "convert", "get_tier", "unknown_type_message"]
