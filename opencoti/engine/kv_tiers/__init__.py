"""KV cache tiers: the storage formats of cached K and V, one storage class per format.

Every tier implements ``KVTier`` (``base.py``): ``name``, ``block_size`` (values per
block), ``block_bytes``, ``bits_per_value``, ``bytes_per_row(d)``, ``quantize(x f32
[..., d]) -> [..., row]`` and ``dequantize(row) -> f32 [..., d]``. A cell row (one cell,
one KV head) is a whole number of blocks, contiguous; each module documents its block's
bytes exactly, for kernels that decode in registers.

- ``scalar.py``: f32, f16 (native float arrays, what the cache stored before tiers),
  bf16, and ggml's q8_0, q6_0, q5_1, q5_0, q4_0 with their exact block layouts and
  reference rounding.
- ``turbo.py``: turbo2/3/4/8 — TurboQuant: sign-flipped Walsh–Hadamard rotation of the
  head vector, then per 64-value block an f16 least-squares scale and Lloyd–Max codes.
- ``tcq.py``: turbo2_tcq, turbo3_tcq — the same rotation and scale, values coded by a
  tail-biting 256-state bitshift trellis (Viterbi on write, table lookup on read).
- ``codebooks.py`` generates the rotation signs and codebooks once; ``_tables.py`` ships them.

The tier is chosen per cache half at boot (``-ctk`` / ``-ctv``; ``-ctkt`` / ``-ctvt`` for
the spilled tail, converted with ``convert``) and a cell is quantized once, when written.

Measured quality (``tests/test_kv_tier_quality.py``; teacher-forced against the f16 cache
on the same model, CPU backend; KV MiB of the f16 row is for the stated context):

TABLE_PLACEHOLDER
"""

from __future__ import annotations

# Importable without NumPy (the CLI validates -ctk/-ctv before NumPy may load, see cli.py);
# tests check that the registry holds exactly these, in this order.
TIER_NAMES = ("f32", "f16", "bf16", "q8_0", "q6_0", "q5_1", "q5_0", "q4_0",
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
