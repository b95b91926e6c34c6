"""KV cache report: geometry, tiers, memory accounting and the tier decision, read from
the live cache (``/props`` ``opencoti.kv``, the server's boot log, ``-v`` in the CLI)."""

from __future__ import annotations

from typing import Any

MIB = 1024 * 1024


def kv_props(engine: Any) -> dict:
    """The KV cache geometry, tiers and memory (``/props`` ``opencoti.kv`` and the boot log),
    read from the live cache.

    ``caches``: one entry per cache (``global`` and, on iSWA models, ``swa``):
    ``layers`` (count), ``n_cells`` per stream, ``n_stream`` (1 unified, else one
    per sequence), ``n_swa`` (sliding window, 0 = none), ``bytes`` (K+V storage).
    ``n_ctx``: cells of the global cache over all streams; ``n_ctx_slot``: what
    one slot may use (all of it when unified, else ``n_ctx / n_seq_max``).
    ``type_k`` / ``type_v`` / ``type_k_tail`` / ``type_v_tail``: the tiers.
    ``memory``: per cache and tier half, ``{name, type_k, type_v, k_bytes, v_bytes, k_mib,
    v_mib}``, and the totals: ``k_bytes``, ``v_bytes``, ``recurrent_bytes`` (a hybrid model's
    per-sequence float32 states, conv (R) + delta-net (S), else 0) and ``total_bytes``, their
    sum (also ``bytes``). ``effective``: ``KVCacheSet.effective()`` (type_k, type_v,
    n_cells, n_cells_resident, n_layers_spilling, fully_resident, is_iswa). ``auto_tier``:
    the boot's tier decision (``kv_auto_tier.KVTierDecision``), or ``{"enabled": false}``.
    """
    kv = getattr(getattr(engine, "runner", None), "kv", None)
    if kv is None:
        return {}
    caches, memory = [], []
    iswa = len(kv.caches) > 1
    for c in kv.caches:
        name = "swa" if iswa and c.n_swa > 0 else "global"
        caches.append({
            "name": name,
            "layers": len(c.layers),
            "n_cells": int(c.n_cells),
            "n_stream": int(c.n_stream),
            "n_swa": int(c.n_swa),
            "bytes": int(c.nbytes()),
        })
        kb, vb = int(c.nbytes_k()), int(c.nbytes_v())
        memory.append({"name": name, "type_k": c.type_k, "type_v": c.type_v, "k_bytes": kb, "v_bytes": vb,
                       "k_mib": round(kb / MIB, 3), "v_mib": round(vb / MIB, 3)})
    base = kv.caches[0]
    rec = kv.recurrent
    decision = getattr(engine, "kv_decision", None)
    return {
        "type_k": base.type_k,
        "type_v": base.type_v,
        "type_k_tail": base.tier_k_tail.name,
        "type_v_tail": base.tier_v_tail.name,
        "n_ctx": int(getattr(engine, "n_ctx", kv.n_ctx)),
        "n_ctx_slot": int(kv.n_ctx_seq),
        "n_seq_max": int(kv.n_seq_max),
        "unified": bool(kv.unified),
        "caches": caches,
        "bytes": int(kv.nbytes()),
        "memory": {
            "caches": memory,
            "k_bytes": int(kv.nbytes_k()),
            "v_bytes": int(kv.nbytes_v()),
            "recurrent_bytes": int(rec.nbytes()) if rec is not None else 0,
            "total_bytes": int(kv.nbytes()),
            "total_mib": round(kv.nbytes() / MIB, 3),
        },
        "effective": kv.effective(),
        "auto_tier": decision.as_dict() if decision is not None else {"enabled": False},
    }


def kv_layout_lines(engine: Any) -> list[str]:
    """The KV report as llama.cpp-style boot log lines (``llama_kv_cache: ...``): geometry,
    MiB per cache and tier half (K and V), totals, tail tiers (the auto-tier decision is
    logged by the engine when it is made, ``/props`` carries it)."""
    kv = kv_props(engine)
    if not kv:
        return []
    lines = [f"llama_context: n_ctx = {kv['n_ctx']}, n_ctx_slot = {kv['n_ctx_slot']}, "
             f"n_seq_max = {kv['n_seq_max']}, kv_unified = {'true' if kv['unified'] else 'false'}"]
    for c, m in zip(kv["caches"], kv["memory"]["caches"]):
        swa = f", n_swa = {c['n_swa']}" if c["n_swa"] else ""
        lines.append(f"llama_kv_cache: {c['name']:>6}: {c['n_cells']:6d} cells x {c['n_stream']} stream(s), "
                     f"{c['layers']:3d} layers, K ({m['type_k']}): {m['k_bytes'] / MIB:8.2f} MiB, "
                     f"V ({m['type_v']}): {m['v_bytes'] / MIB:8.2f} MiB{swa}")
    mem = kv["memory"]
    rec = engine.runner.kv.recurrent
    if rec is not None:  # (llama.cpp's llama_memory_recurrent: R the conv states, S the delta-net states)
        lines.append(f"llama_memory_recurrent: {len(rec.layers):3d} layers, {rec.n_seq_max} seqs, "
                     f"R (f32): {rec.nbytes_r() / MIB:8.2f} MiB, S (f32): {rec.nbytes_s() / MIB:8.2f} MiB")
    recurrent = f", recurrent state {mem['recurrent_bytes'] / MIB:.2f} MiB" if rec is not None else ""
    lines.append(f"llama_kv_cache: total {kv['bytes'] / MIB:.2f} MiB (K {mem['k_bytes'] / MIB:.2f} MiB, "
                 f"V {mem['v_bytes'] / MIB:.2f} MiB{recurrent})")
    if kv["type_k_tail"] != kv["type_k"] or kv["type_v_tail"] != kv["type_v"]:
        lines.append(f"llama_kv_cache: tail tiers K ({kv['type_k_tail']}), V ({kv['type_v_tail']}) "
                     f"(no tail allocated yet)")
    return lines
