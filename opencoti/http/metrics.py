"""Server metrics: counters fed by finished requests, and the Prometheus text
exposition of ``GET /metrics``.

Metric names, kinds and meanings follow llama.cpp's server (``server-context.cpp``,
``server_metrics`` and the ``/metrics`` handler): totals are counters since start;
``prompt_tokens_seconds`` / ``predicted_tokens_seconds`` are gauges averaged over
the requests finished since the previous scrape (llama.cpp's "bucket", reset on
every ``/metrics`` call). KV numbers come from the engine's cache (read without
locking: monitoring values, at worst one step stale). opencoti adds
``opencoti:admissions_refused_total`` (429s of the KV admission gate) and the KV
pool's size and headroom.

Format: Prometheus text exposition format 0.0.4 (``# HELP``, ``# TYPE``, then
``name value`` lines; ``Content-Type: text/plain; version=0.0.4``).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

CONTENT_TYPE = "text/plain; version=0.0.4"


class ServerMetrics:
    """Thread-safe request counters (handler threads call ``on_finish``).

    Totals: ``n_prompt_tokens_total`` (prompt tokens evaluated, cache hits
    excluded), ``t_prompt_ms_total``, ``n_predicted_total``,
    ``t_predicted_ms_total``, ``n_requests_total``. The bucket (``n_prompt``,
    ``t_prompt_ms``, ``n_predicted``, ``t_predicted_ms``) covers the requests
    finished since the last ``take_bucket``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.n_prompt_tokens_total = 0
        self.t_prompt_ms_total = 0.0
        self.n_predicted_total = 0
        self.t_predicted_ms_total = 0.0
        self.n_requests_total = 0
        self._bucket = [0, 0.0, 0, 0.0]

    def on_finish(self, timings: dict) -> None:
        """Account one finished request from its ``timings`` (llama.cpp keys)."""
        n_p = int(timings.get("prompt_n", 0) or 0)
        t_p = float(timings.get("prompt_ms", 0.0) or 0.0)
        n_g = int(timings.get("predicted_n", 0) or 0)
        t_g = float(timings.get("predicted_ms", 0.0) or 0.0)
        with self._lock:
            self.n_prompt_tokens_total += n_p
            self.t_prompt_ms_total += t_p
            self.n_predicted_total += n_g
            self.t_predicted_ms_total += t_g
            self.n_requests_total += 1
            b = self._bucket
            b[0] += n_p
            b[1] += t_p
            b[2] += n_g
            b[3] += t_g

    def take_bucket(self) -> tuple[int, float, int, float]:
        """(prompt tokens, prompt ms, predicted tokens, predicted ms) since the last call; resets it."""
        with self._lock:
            out = tuple(self._bucket)
            self._bucket = [0, 0.0, 0, 0.0]
        return out  # type: ignore[return-value]

    def totals(self) -> dict:
        with self._lock:
            return {
                "n_prompt_tokens_total": self.n_prompt_tokens_total,
                "t_prompt_ms_total": self.t_prompt_ms_total,
                "n_predicted_total": self.n_predicted_total,
                "t_predicted_ms_total": self.t_predicted_ms_total,
                "n_requests_total": self.n_requests_total,
            }


def kv_usage(engine: Any) -> dict:
    """KV occupancy of the engine's global-layer cache: ``cells`` (all streams),
    ``used`` (non-empty cells = tokens held, idle slots' prompt cache included)
    and ``ratio``."""
    kv = getattr(getattr(engine, "runner", None), "kv", None)
    base = getattr(kv, "base", None)
    if base is None:
        return {"cells": 0, "used": 0, "ratio": 0.0}
    cells = int(base.n_cells) * int(base.n_stream)
    used = int(base.n_used())
    return {"cells": cells, "used": used, "ratio": used / cells if cells else 0.0}


def engine_queue_counts(engine: Any) -> tuple[int, int]:
    """(requests processing = busy slots, requests deferred = admitted but waiting for a slot)."""
    slots = list(getattr(engine, "slots", []) or [])
    processing = sum(1 for s in slots if getattr(s, "busy", False))
    deferred = len(list(getattr(engine, "_waiting", []) or []))
    return processing, deferred


def kv_headroom(engine: Any) -> Optional[int]:
    """The admission gate's free cells (``Engine.kv_headroom``); None when there is
    no gate (split KV: each slot's stream is a hard limit) or no engine.
    Read from a handler thread: a racing step can make it one step stale."""
    fn = getattr(engine, "kv_headroom", None)
    kv = getattr(getattr(engine, "runner", None), "kv", None)
    if fn is None or not getattr(kv, "unified", False):
        return None
    for _ in range(3):  # the engine may be resizing a list we iterate; just read again
        try:
            return int(fn())
        except RuntimeError:
            continue
    return None


def render(metrics: ServerMetrics, engine: Any) -> str:
    """The ``/metrics`` body (Prometheus text format 0.0.4)."""
    tot = metrics.totals()
    n_p, t_p, n_g, t_g = metrics.take_bucket()
    processing, deferred = engine_queue_counts(engine)
    kv = kv_usage(engine)
    headroom = kv_headroom(engine)
    n_steps = int(getattr(engine, "n_steps", 0) or 0)  # the engine's llama_decode() calls
    rows: list[tuple[str, str, str, float]] = [
        ("counter", "llamacpp:prompt_tokens_total", "Number of prompt tokens processed.",
         tot["n_prompt_tokens_total"]),
        ("counter", "llamacpp:prompt_seconds_total", "Prompt process time",
         tot["t_prompt_ms_total"] / 1e3),
        ("counter", "llamacpp:tokens_predicted_total", "Number of generation tokens processed.",
         tot["n_predicted_total"]),
        ("counter", "llamacpp:tokens_predicted_seconds_total", "Predict process time",
         tot["t_predicted_ms_total"] / 1e3),
        ("counter", "llamacpp:n_decode_total", "Total number of llama_decode() calls", n_steps),
        ("counter", "llamacpp:n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         (getattr(engine, "n_busy_slots_total", 0) or 0) / max(n_steps, 1)),
        ("counter", "llamacpp:n_tokens_max", "Largest observed n_tokens.",
         int(getattr(engine, "n_tokens_max", 0) or 0)),
        ("gauge", "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
         1e3 * n_p / t_p if n_p and t_p > 0 else 0.0),
        ("gauge", "llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
         1e3 * n_g / t_g if n_g and t_g > 0 else 0.0),
        ("gauge", "llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
         kv["ratio"]),
        ("gauge", "llamacpp:kv_cache_tokens", "KV-cache tokens.", kv["used"]),
        ("gauge", "llamacpp:requests_processing", "Number of requests processing.", processing),
        ("gauge", "llamacpp:requests_deferred", "Number of requests deferred.", deferred),
        ("counter", "opencoti:admissions_refused_total",
         "Requests refused (HTTP 429) by the KV admission gate.",
         int(getattr(engine, "n_admissions_refused", 0) or 0)),
        ("counter", "opencoti:requests_total", "Requests finished.", tot["n_requests_total"]),
        ("gauge", "opencoti:kv_cells", "KV cells of the global-layer cache (all streams).", kv["cells"]),
    ]
    if getattr(engine, "pools", None) is not None:
        g = engine.call(lambda e: e.pool_gauges()).result(timeout=30)
        rows += [
            ("gauge", "opencoti:polykv_pools", "PolyKV pools alive.", g["pools"]),
            ("gauge", "opencoti:polykv_cells_pinned", "Cells held by pinned pools (a fork's shared prefix counted with its parent).", g["cells_pinned"]),
            ("gauge", "opencoti:polykv_sessions_attached", "Slots sharing a pool prefix.", g["sessions_attached"]),
        ]
    if headroom is not None:
        rows.append(("gauge", "opencoti:kv_headroom_cells",
                     "Cells the admission gate sees as free (not held or reserved).", headroom))
    out = []
    for kind, name, help_, value in rows:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name} {_num(value)}")
    return "\n".join(out) + "\n"


def _num(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
