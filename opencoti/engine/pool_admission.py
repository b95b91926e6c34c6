"""Settled admission (P7) for PolyKV pools: admit a new session only while the
sessions already on the pool keep their target decode rate.

Per pool (``POST /polykv/pools/{id}/admission``):

- ``target_tps_per_session``: the decode tokens/s each session should keep.
- ``mode``: ``advisory`` (decide, report, admit anyway) or ``enforced``.
- ``on_saturation``: ``reject`` (HTTP 429 + Retry-After) or ``warn`` (admit,
  flag the response) when enforced and saturated.
- ``guarantee_min_sessions`` (1): this many sessions are always admitted.
- ``settle_tokens`` (48), ``settle_max_ms`` (5000): after an admission the
  pool is *settling* until the newest session has decoded ``settle_tokens``
  tokens or ``settle_max_ms`` passed; meanwhile rates are not yet comparable,
  so further new sessions wait (429 with the remaining settle time).

Projection of the mean per-session rate with one more session: with ``n``
sessions at mean ``m``, ``m * n / (n + 1)`` (a shared, saturated device) until
a measurement exists; after each settled admission the measured drop
``m_before - m_after`` feeds an EWMA, and the projection becomes
``m - drop_per_admit_ewma``. Continuing sessions (already attached) are never
gated; ``overcommit: true`` bypasses the gate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

DEFAULTS = {
    "target_tps_per_session": 0.0,
    "mode": "advisory",
    "on_saturation": "reject",
    "guarantee_min_sessions": 1,
    "settle_tokens": 48,
    "settle_max_ms": 5000,
}
EWMA_ALPHA = 0.5


@dataclass
class Decision:
    """``admit``: let the session in; ``saturated``: the projection misses the
    target; ``retry_after`` (s) for a refusal; ``sessions_remaining``: how many
    more sessions the projection allows (None when there is no target)."""

    admit: bool
    saturated: bool
    reason: str
    retry_after: int = 0
    sessions_remaining: Optional[int] = None
    projected_tps: float = 0.0


@dataclass
class SettledAdmission:
    """Per-pool admission state (engine thread only)."""

    config: dict = field(default_factory=lambda: dict(DEFAULTS))
    drop_per_admit_ewma: Optional[float] = None
    settling_since: Optional[float] = None  # perf_counter of the last admission
    settle_seq: Optional[int] = None  # the slot whose tokens end the settle window
    mean_before: float = 0.0

    def configure(self, fields: dict) -> None:
        self.config.update(fields)

    @property
    def enabled(self) -> bool:
        return float(self.config.get("target_tps_per_session") or 0) > 0

    def projected(self, n: int, mean_tps: float) -> float:
        """Mean per-session rate projected with one more session."""
        if n == 0:
            return math.inf
        if self.drop_per_admit_ewma is not None:
            return mean_tps - self.drop_per_admit_ewma
        return mean_tps * n / (n + 1)

    def settle_remaining_ms(self, now: float, settle_tokens_done: int) -> int:
        if self.settling_since is None:
            return 0
        left_ms = self.config["settle_max_ms"] - (now - self.settling_since) * 1e3
        if left_ms <= 0 or settle_tokens_done >= self.config["settle_tokens"]:
            return 0
        return int(left_ms)

    def decide(self, n_active: int, mean_tps: float, settle_tokens_done: int,
               now: Optional[float] = None) -> Decision:
        """Decide for a NEW session given ``n_active`` sessions decoding on the
        pool at mean ``mean_tps`` (tokens/s each)."""
        now = time.perf_counter() if now is None else now
        cfg = self.config
        if not self.enabled:
            return Decision(True, False, "no target")
        target = float(cfg["target_tps_per_session"])
        proj = self.projected(n_active, mean_tps)
        remaining = self._remaining(n_active, mean_tps, target)
        if n_active < int(cfg["guarantee_min_sessions"]):
            return Decision(True, False, "guaranteed", sessions_remaining=remaining, projected_tps=proj)
        settle_ms = self.settle_remaining_ms(now, settle_tokens_done)
        if settle_ms > 0:
            reason = "settling"
            retry = max(1, math.ceil(settle_ms / 1000))
        elif proj < target:
            reason = f"projected {proj:.1f} tok/s per session < target {target:g}"
            retry = max(1, math.ceil(cfg["settle_max_ms"] / 1000))
        else:
            return Decision(True, False, "ok", sessions_remaining=remaining, projected_tps=proj)
        enforce = cfg["mode"] == "enforced"
        if enforce and cfg["on_saturation"] == "reject":
            return Decision(False, True, reason, retry, remaining, proj)
        return Decision(True, True, reason, 0, remaining, proj)

    def _remaining(self, n: int, mean_tps: float, target: float) -> int:
        """More sessions the projection allows before the mean drops under target."""
        if n == 0 or mean_tps <= 0:
            return max(0, int(self.config["guarantee_min_sessions"]) - n)
        if self.drop_per_admit_ewma:
            return max(0, int((mean_tps - target) / self.drop_per_admit_ewma))
        # m * n / (n + k) >= target  <=>  k <= m * n / target - n
        return max(0, int(mean_tps * n / target) - n)

    def on_admit(self, mean_tps: float, id_slot: int, now: Optional[float] = None) -> None:
        """A new session was admitted: open the settle window."""
        self.settling_since = time.perf_counter() if now is None else now
        self.settle_seq = id_slot
        self.mean_before = mean_tps

    def observe(self, mean_tps: float, settle_tokens_done: int, n_active: int,
                now: Optional[float] = None) -> None:
        """Close a finished settle window: record the measured drop per admission."""
        if self.settling_since is None:
            return
        now = time.perf_counter() if now is None else now
        if self.settle_remaining_ms(now, settle_tokens_done) > 0:
            return
        if self.mean_before > 0 and n_active > 1:
            drop = max(0.0, self.mean_before - mean_tps)
            self.drop_per_admit_ewma = drop if self.drop_per_admit_ewma is None else (
                EWMA_ALPHA * drop + (1 - EWMA_ALPHA) * self.drop_per_admit_ewma)
        self.settling_since = None
        self.settle_seq = None
