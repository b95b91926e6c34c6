"""Auto-tier: choose the KV tiers at boot so that the whole KV cache fits a memory budget.

On with ``OPENCOTI_KV_AUTO_TIER=1`` (``Params.kv_auto_tier``). It walks scalar tier pairs
from the least to the most compressing and takes the first whose K + V storage (every
cache, layer, stream and cell: ``KVCacheSet.estimate_bytes``, exactly what is then
allocated) fits the budget. Walk order: V leads and K follows one step behind, because
attention is more sensitive to K error than to V error: a K error moves every softmax
weight of the query. Measured on gemma-3-270m (``opencoti/engine/kv_tiers/__init__.py``):
q4_0 on K alone costs a mean KLD of ~0.092 nats against f16, q4_0 on V alone ~0.0035; the
random-weight model, whose attention is nearly uniform, shows no such gap, so the order
follows the real model (and llama.cpp users' habit of -ctk q8_0 with a smaller V)::

    f16/f16, f16/q8_0, q8_0/q8_0, q8_0/q6_0, q6_0/q6_0, q6_0/q5_1, q5_1/q5_1,
    q5_1/q5_0, q5_0/q5_0, q5_0/q4_0, q4_0/q4_0                        (type_k/type_v)

Each step strictly shrinks the cache. An explicit ``-ctv`` turns auto-tier off (the user
chose); an explicit ``-ctk`` holds K and walks V alone (f16, q8_0, ... q4_0). Pairs the
backend has no kernels for (``backend.kv_types``) are skipped, and so are pairs whose
blocks cannot hold the model's head size (a block tier needs a head size that is a
multiple of its 32-value blocks; ``KVTier.check_dim``). When not even the last pair fits,
the last pair is used and the decision says so (a warning).

Budget: ``OPENCOTI_KV_BUDGET_MIB`` (``Params.kv_budget_mib``) when set, else
``BUDGET_FRACTION`` of the memory the backend reports free once the weights are loaded
(``backend.free_memory()``: MemAvailable of /proc/meminfo on the CPU, the device's free
memory on a GPU). With neither, auto-tier keeps f16 and says why.

Only dense full-attention models: an iSWA model (Gemma-3) keeps most layers in a
sliding-window cache whose size does not follow the context (only its few global layers'
does), and a sliding-window model's KV does not grow with n_ctx at all, so the single
"whole KV grows with n_ctx" budget walk does not describe them; a hybrid recurrent model
(Qwen3.5 / Qwen3-Next: gated delta-net layers) keeps a float32 state per sequence beside its
few attention layers' KV, which no KV tier shrinks and the walk's K + V sizes leave out.
For all of these auto-tier reports that it does not apply and keeps the types it was given
(f16, or an explicit -ctk).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Optional

from opencoti.engine.kv_cache import KVCacheSet
from opencoti.engine.kv_tiers import AUTO_TIER_ORDER

log = logging.getLogger("opencoti.engine")

BUDGET_FRACTION = 0.5  # of free memory after the weights, when no explicit budget is given
MIB = 1024 * 1024


def _mib(n: int) -> str:
    """``n`` bytes as MiB for the decision's log line, with the bytes themselves where two
    decimals of MiB could not tell a size from the budget (``0.20 MiB (212,992 bytes)``)."""
    return f"{n / MIB:.2f} MiB" if n >= 100 * MIB else f"{n / MIB:.2f} MiB ({n:,} bytes)"


def staircase(order=AUTO_TIER_ORDER) -> list[tuple[str, str]]:
    """The pair walk with K one step behind V: ``[(type_k, type_v), ...]`` (module doc)."""
    pairs = [(order[0], order[0])]
    for i in range(1, len(order)):
        pairs += [(order[i - 1], order[i]), (order[i], order[i])]
    return pairs


@dataclass
class KVTierDecision:
    """What the boot chose for the KV tiers and why (``/props`` ``opencoti.kv.auto_tier``).

    enabled: auto-tier was requested; applied: it picked the types; type_k / type_v:
    the result; budget_bytes / budget_source: the budget and where it came from;
    kv_bytes: K + V bytes of the chosen pair; fits: kv_bytes <= budget; reason: one line;
    tried: ``[[type_k, type_v, bytes], ...]`` in walk order up to the chosen pair.
    """

    enabled: bool
    applied: bool
    type_k: str
    type_v: str
    reason: str
    budget_bytes: Optional[int] = None
    budget_source: Optional[str] = None
    kv_bytes: Optional[int] = None
    fits: Optional[bool] = None
    tried: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def decide_kv_types(hp, n_ctx: int, n_seq_max: int, unified: bool, n_ubatch: int, backend,
                    type_k: Optional[str] = None, type_v: Optional[str] = None, auto: bool = False,
                    budget_mib: Optional[float] = None) -> KVTierDecision:
    """The KV tiers to allocate.

    ``type_k`` / ``type_v``: the explicit choices (None = not given: f16 unless auto-tier
    picks). ``auto``: auto-tier requested; ``budget_mib``: explicit budget in MiB.
    The cache geometry arguments are ``KVCacheSet``'s. Never raises for a budget problem;
    unknown type names raise ``ValueError`` (from ``kv_tiers.get_tier``).
    """
    k0, v0 = type_k or "f16", type_v or "f16"

    def size(k, v):
        kb, vb = KVCacheSet.estimate_bytes(hp, n_ctx, n_seq_max, unified, n_ubatch, k, v)
        return kb + vb

    if not auto:
        return KVTierDecision(False, False, k0, v0, "auto-tier off")
    if type_v is not None:
        return KVTierDecision(True, False, k0, v0, f"explicit -ctv {type_v} turns auto-tier off")
    if hp.is_iswa or hp.n_swa > 0:
        kind = "iSWA (sliding-window layers with a fixed-size cache)" if hp.is_iswa else "sliding-window"
        return KVTierDecision(True, False, k0, v0,
                              f"auto-tier does not apply: {hp.arch} is {kind}, not dense full attention "
                              f"(its sliding-window layers' KV does not follow n_ctx as the budget walk "
                              f"assumes); keeping {k0}/{v0}")
    if hp.is_recurrent:
        return KVTierDecision(True, False, k0, v0,
                              f"auto-tier does not apply: {hp.arch} is hybrid recurrent (its gated delta-net "
                              f"layers keep a per-sequence state beside the KV, which the budget walk does "
                              f"not size), not dense full attention; keeping {k0}/{v0}")
    if budget_mib is not None:
        budget, source = int(budget_mib * MIB), "OPENCOTI_KV_BUDGET_MIB"
    else:
        free_fn = getattr(backend, "free_memory", None)
        free = free_fn() if free_fn is not None else None
        if free is None:
            return KVTierDecision(True, False, k0, v0, f"the {backend.name} backend does not report free "
                                  "memory; set OPENCOTI_KV_BUDGET_MIB")
        budget = int(free * BUDGET_FRACTION)
        source = f"{BUDGET_FRACTION:.0%} of {free / MIB:.0f} MiB free on {backend.name}"
    allowed = getattr(backend, "kv_types", None)
    walk = [(type_k, v) for v in AUTO_TIER_ORDER] if type_k is not None else staircase()
    walk = [p for p in walk if allowed is None or (p[0] in allowed and p[1] in allowed)]
    tried, unfit = [], []
    for k, v in walk:
        try:
            b = size(k, v)
        except ValueError:  # the head size is not a multiple of a tier's block (check_dim)
            unfit.append(f"{k}/{v}")
            continue
        tried.append([k, v, b])
        if b <= budget:
            held = f" (K held at {type_k} by -ctk)" if type_k is not None else ""
            return KVTierDecision(True, True, k, v,
                                  f"auto-tier: type_k={k} type_v={v}{held}: KV {_mib(b)} "
                                  f"<= budget {_mib(budget)} ({source})",
                                  budget, source, b, True, tried)
    k, v, b = tried[-1] if tried else (k0, v0, size(k0, v0))
    skipped = f" ({len(unfit)} pairs skipped: this model's head size does not fit their blocks)" if unfit else ""
    return KVTierDecision(True, True, k, v,
                          f"auto-tier: even type_k={k} type_v={v} needs {_mib(b)}, over the budget "
                          f"of {_mib(budget)} ({source}); using it anyway{skipped}",
                          budget, source, b, False, tried)
