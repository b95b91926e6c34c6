"""PolyKV: shared-prefix KV pools.

A pool is an immutable, token-exact prefix (system prompt, tool schemas)
whose KV lives in the cache under a reserved seq_id above the slots'
(``n_parallel .. n_parallel + max_pools - 1``). Sessions attach by
*membership*: ``seq_cp(pool_seq, slot_seq, 0, n)`` adds the slot's seq_id to
the pool's cells, so eight agents reading one prefix read one set of cells
with nine members (DESIGN.md "KV cache: cells with sequence membership").
On the split cache (one stream per sequence) ``seq_cp`` copies the cells
physically, so sharing still saves prefill but not memory.

Pools form a tree: a fork's prefix starts with its parent's full token list
(or, with ``branch_pos`` D, shares only ``[0, D)``: a copy-on-write branch),
and its shared cells are, again, membership. A pool lives while it is not
released or while any descendant lives (ancestors outlive descendants); its
cells are reclaimed when its subtree is gone. Sessions attached to a pool
keep their membership of the shared cells, so reclaiming a pool never
disturbs a running session.

Two layers, both on the engine thread (the only owner of the KV cache):

- ``PoolRegistry``: bookkeeping only, the tree and its seq_ids (create, get,
  release, collect), no KV access.
- ``PolyKV``: the pool manager the engine calls through a narrow interface
  (as mini-sglang's prefix cache: match, insert, evict, lock): it binds the
  registry to the KV cache and the slots, and says in each method's doc
  whether it mutates.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from opencoti.engine.api import ErrorEvent
from opencoti.engine.pool_admission import SettledAdmission
from opencoti.engine.slot import SlotState

log = logging.getLogger("opencoti.engine.polykv")


class PoolError(ValueError):
    """A pool request that cannot be honoured; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Pool:
    """One shared prefix.

    id: the public pool id; seq_id: its KV sequence; tokens: the full prefix;
    parent: parent pool id or None; branch_pos: cells ``[0, branch_pos)``
    are shared with the parent (0 for a root); n_past: tokens whose KV is
    built (== len(tokens) once ``ready``).
    """

    id: int
    seq_id: int
    tokens: list[int]
    parent: Optional[int] = None
    branch_pos: int = 0
    pinned: bool = False
    released: bool = False
    state: str = "building"  # building -> ready | failed
    n_past: int = 0
    children: set = field(default_factory=set)
    created: float = field(default_factory=time.time)
    sampling: dict = field(default_factory=dict)
    admission: dict = field(default_factory=dict)
    future: Optional[Future] = None  # resolved when the build finishes
    t_start: float = field(default_factory=time.perf_counter)
    gate: SettledAdmission = field(default_factory=SettledAdmission)

    def __post_init__(self) -> None:
        self.admission = self.gate.config  # one dict: the REST route updates the gate's config

    def next_chunk(self, budget: int) -> list[int]:
        return self.tokens[self.n_past:self.n_past + budget]


class PoolRegistry:
    """The pool tree and its seq_id allocation.

    Args:
        first_seq_id: the first reserved seq_id (``n_parallel``).
        max_pools: how many pools may exist at once (``--polykv-max-pools``).
    """

    def __init__(self, first_seq_id: int, max_pools: int):
        self.first_seq_id = first_seq_id
        self.max_pools = max_pools
        self.pools: dict[int, Pool] = {}
        self._free_seq = list(range(first_seq_id, first_seq_id + max_pools))
        self._next_id = 1

    def get(self, pool_id: int) -> Pool:
        """The live pool ``pool_id``; ``PoolError`` 404 if there is none."""
        p = self.pools.get(pool_id)
        if p is None:
            raise PoolError(f"pool {pool_id} not found", 404)
        return p

    def create(self, tokens: list[int], parent_id: Optional[int] = None,
               branch_pos: Optional[int] = None, pin: bool = False) -> Pool:
        """Register a pool (state "building"); the engine then shares the
        parent's cells and prefills the rest.

        A fork's ``tokens`` must be its FULL prefix: they must start with the
        parent's tokens, token for token (or with its first ``branch_pos``).
        Raises ``PoolError``: 400 for an empty prefix, a suffix-only or
        mismatching fork, or a bad branch_pos; 404 for an unknown parent;
        409 for a released or unbuilt parent; 503 when all pool seq_ids are taken.
        """
        if not tokens:
            raise PoolError("a pool needs a non-empty token prefix")
        share = 0
        if parent_id is not None:
            parent = self.get(parent_id)
            if parent.released:
                raise PoolError(f"parent pool {parent_id} is released", 409)
            if parent.state != "ready":
                raise PoolError(f"parent pool {parent_id} is not ready ({parent.state})", 409)
            share = len(parent.tokens) if branch_pos is None else branch_pos
            if not 0 < share <= len(parent.tokens):
                raise PoolError(f"branch_pos {branch_pos} out of range [1, {len(parent.tokens)}]")
            if len(tokens) < share or tokens[:share] != parent.tokens[:share]:
                n = _common_prefix(tokens, parent.tokens)
                raise PoolError(
                    f"fork prefix must start with the parent's first {share} tokens "
                    f"(they agree on {n}); send the child's full prefix, not only its suffix"
                )
        elif branch_pos is not None:
            raise PoolError("branch_pos needs a parent pool")
        if not self._free_seq:
            raise PoolError(f"all {self.max_pools} pool seq_ids are in use (--polykv-max-pools)", 503)
        pool = Pool(id=self._next_id, seq_id=self._free_seq.pop(0), tokens=list(tokens),
                    parent=parent_id, branch_pos=share, pinned=pin, n_past=share)
        self._next_id += 1
        self.pools[pool.id] = pool
        if parent_id is not None:
            self.pools[parent_id].children.add(pool.id)
        return pool

    def building(self) -> list[Pool]:
        return [p for p in self.pools.values() if p.state == "building"]

    def release(self, pool_id: int, attached: dict[int, int]) -> list[Pool]:
        """Mark a pool released and return the pools whose cells can be
        reclaimed now: released pools with no live children and no attached
        session (``attached``: pool id -> sessions bound), walking up the tree.

        Raises ``PoolError`` 409 if the pool is pinned.
        """
        pool = self.get(pool_id)
        if pool.pinned:
            raise PoolError(f"pool {pool_id} is pinned; unpin it first", 409)
        pool.released = True
        return self.collect(attached)

    def collect(self, attached: dict[int, int]) -> list[Pool]:
        """Remove and return every released pool whose subtree is gone."""
        gone = []
        changed = True
        while changed:
            changed = False
            for p in list(self.pools.values()):
                if p.released and not p.children and attached.get(p.id, 0) == 0:
                    self._drop(p)
                    gone.append(p)
                    changed = True
        return gone

    def drop_failed(self, pool: Pool) -> None:
        self._drop(pool)

    def _drop(self, p: Pool) -> None:
        del self.pools[p.id]
        self._free_seq.append(p.seq_id)
        self._free_seq.sort()
        if p.parent is not None and p.parent in self.pools:
            self.pools[p.parent].children.discard(p.id)

    def orphaned_pin(self, p: Pool) -> bool:
        """A pinned pool whose parent was released: it alone keeps its ancestors alive."""
        return p.pinned and p.parent is not None and self.pools[p.parent].released

    def info(self, p: Pool, attached: dict[int, int], n_cells_held: int) -> dict:
        """JSON view of a pool (``GET /polykv/pools/{id}``)."""
        return {
            "id": p.id,
            "seq_id": p.seq_id,
            "state": p.state,
            "n_tokens": len(p.tokens),
            "n_built": p.n_past,
            "parent": p.parent,
            "branch_pos": p.branch_pos,
            "children": sorted(p.children),
            "pinned": p.pinned,
            "released": p.released,
            "orphaned_pin": self.orphaned_pin(p),
            "sessions_attached": attached.get(p.id, 0),
            "n_cells": n_cells_held,
            "created": p.created,
            "sampling": p.sampling,
            "admission": p.admission,
        }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- the manager: the pool tree bound to the KV cache and the slots ---------------------------

OFF_MESSAGE = "PolyKV is off (start with --polykv-max-pools M)"


def attach_prefix(kv, dst_seq: int, src_seq: int, src_tokens: list[int], prompt: list[int],
                  n_past: int, src_name: str = "pool") -> tuple[int, int]:
    """Give sequence ``dst_seq`` the KV of a shared prefix when that beats its own
    cached prefix of ``n_past`` tokens (engine thread; mutates ``kv``).

    Shares ``min(common prefix of src_tokens and prompt, len(prompt) - 1)`` cells of
    ``src_seq`` by membership (``kv.seq_cp``; a physical copy on the split cache):
    the last prompt token is always recomputed so there are logits to sample.
    Returns the new ``(n_past, n_shared)`` in tokens: ``(n_past, k)`` when the share
    is no longer than what ``dst_seq`` already holds (``k``: the first cells it already
    shares with ``src_seq`` by membership, e.g. from an earlier attach to a fork of the
    source; 0 when it computed them itself), ``(n_past, 0)`` when a hybrid model's
    recurrent state cannot be cut at the share (WARN, the prompt is reprocessed
    without it); ``(0, 0)`` (WARN, ``dst_seq`` emptied) when the sliding-window cache
    no longer holds the cells the share needs. ``src_name`` names the source in the
    warnings ("pool" or "source slot"). Raises nothing.
    """
    share = min(_common_prefix(src_tokens, prompt), len(prompt) - 1)
    if share <= n_past:
        return n_past, kv.base.shared_len(dst_seq, src_seq, share)
    rs = kv.recurrent  # issue 7b: a recurrent state is shared only as an exact full copy
    if rs is not None and int(rs.n_pos[src_seq]) != share:
        log.warning("pool share not possible on this hybrid model: the %s's recurrent state covers %d tokens, "
                    "the shared prefix is %d (a recurrent state can only be shared whole); reprocessing the "
                    "prompt without the pool", src_name, int(rs.n_pos[src_seq]), share)
        return n_past, 0
    kv.seq_rm(dst_seq)
    kv.seq_cp(src_seq, dst_seq, 0, share)
    if not kv.can_reuse(dst_seq, share):
        log.warning("pool share of %d tokens needs sliding-window cells the source no longer "
                    "holds; recomputing the prompt", share)
        kv.seq_rm(dst_seq)
        return 0, 0
    return share, share


class PolyKV:
    """The PolyKV pool manager: the pool tree (``PoolRegistry``) bound to the KV
    cache and the engine's slots. It owns every KV change a pool makes (fork
    shares, reclaiming released pools, dropping a failed build) and every
    per-pool decision (validation, settled admission, capacity, decode rates).

    Engine thread only, like the cache it mutates; front ends reach it through
    ``Engine.call`` (``Engine.create_pool`` and friends wrap that hop). The
    interface, by what it changes:

    - queries (no change): ``get``, ``info``, ``attached``, ``cells``, ``gauges``,
      ``cells_reserved``, ``building``, ``check_request``, ``prefix_len``,
      ``source``, ``rates``, ``session_rates``, ``capacity``;
    - control (tree + KV): ``create``, ``release``, ``pin``, ``reclaim``;
    - request flow: ``admit`` (gate state), ``on_bind`` (slot binding),
      ``plan_builds`` / ``share_src`` (read-only planning of a ubatch),
      ``on_built`` / ``fail_build`` (after a forward), ``observe`` (gate state).

    Args:
        kv: the engine's ``KVCacheSet`` (``seq_cp``, ``seq_rm``, ``can_reuse``,
            ``recurrent``, ``base.cells_of``, ``base.n_cells``).
        slots: the engine's ``Slot`` list (read: ``pool_id``, ``n_shared``, state
            and rate fields; ``on_bind`` sets ``pool_id``). Pool seq_ids start at
            ``len(slots)``.
        max_pools: pools alive at once (``--polykv-max-pools``, > 0).
        n_ctx_slot: cells one sequence may use; a pool prefix must be shorter.
        n_vocab: token ids must lie in ``[0, n_vocab)``.
    """

    def __init__(self, kv, slots: list, max_pools: int, n_ctx_slot: int, n_vocab: int):
        self.kv = kv
        self.slots = slots
        self.registry = PoolRegistry(len(slots), max_pools)
        self.n_ctx_slot = n_ctx_slot
        self.n_vocab = n_vocab

    @staticmethod
    def check_split_layout(n_ctx: int, n_slots: int, max_pools: int, n_ctx_slot: int) -> None:
        """Boot check for pools on the split cache, where each pool takes a stream of
        its own and every sequence gets ``n_ctx_slot`` cells of the ``n_ctx`` total:
        WARN when that is fewer than ``n_ctx / n_slots``; ``ValueError`` when it is
        under 64 cells (or under ``n_ctx``, if that is smaller)."""
        n_seq = n_slots + max_pools
        msg = (f"split KV cache: -c {n_ctx} over {n_slots} slots + {max_pools} PolyKV pools = "
               f"{n_ctx_slot} cells per slot")
        if n_ctx_slot < min(n_ctx, 64):
            raise ValueError(f"{msg}, too few to serve (raise -c, lower --polykv-max-pools, or use "
                             "--kv-unified, where pools share the one stream)")
        if n_ctx_slot < n_ctx // n_slots:
            log.warning("%s (not %d: each of the %d sequences gets n_ctx / %d); --kv-unified lets "
                        "pools and slots share one stream", msg, n_ctx // n_slots, n_seq, n_seq)

    # -- queries ------------------------------------------------------------------------
    def get(self, pool_id: int) -> Pool:
        """The live pool ``pool_id``; ``PoolError`` 404 if there is none."""
        return self.registry.get(pool_id)

    def building(self) -> list[Pool]:
        """Pools whose prefix is still being prefilled (state "building")."""
        return self.registry.building()

    def attached(self) -> dict[int, int]:
        """pool id -> number of slots currently sharing its prefix (``n_shared`` > 0)."""
        out: dict[int, int] = {}
        for s in self.slots:
            if s.pool_id is not None and s.n_shared:
                out[s.pool_id] = out.get(s.pool_id, 0) + 1
        return out

    def cells(self, pool: Pool) -> int:
        """Cells of the base cache that ``pool``'s sequence is a member of."""
        return len(self.kv.base.cells_of(pool.seq_id))

    def own_cells(self, pool: Pool) -> int:
        """Cells ``pool`` holds (or will once built) beyond its parent's: its whole prefix, less
        the ``branch_pos`` cells a fork shares with its parent under ``--kv-unified`` (zero-copy
        membership; a split cache copies them into the fork's own stream)."""
        return len(pool.tokens) - (pool.branch_pos if self.kv.unified else 0)

    def cells_reserved(self) -> int:
        """Cells of every live pool, each shared cell once (the cells the admission gate counts
        as taken)."""
        return sum(self.own_cells(p) for p in self.registry.pools.values())

    def gauges(self) -> dict:
        """``{"pools", "cells_pinned" (cells of pinned pools, a fork's shared prefix counted with
        its parent), "sessions_attached"}``."""
        ps = list(self.registry.pools.values())
        return {
            "pools": len(ps),
            "cells_pinned": sum(self.own_cells(p) for p in ps if p.pinned),
            "sessions_attached": sum(self.attached().values()),
        }

    def info(self, pool_id: Optional[int] = None):
        """JSON view of one pool, or a list of all (``pool_id`` None); ``PoolError`` 404."""
        reg, att = self.registry, self.attached()
        if pool_id is not None:
            p = reg.get(pool_id)
            return reg.info(p, att, self.cells(p))
        return [reg.info(p, att, self.cells(p)) for p in reg.pools.values()]

    def check_request(self, pool_id: int) -> Optional[ErrorEvent]:
        """A 404 ``ErrorEvent`` when a request cannot attach to ``pool_id`` (unknown,
        not built yet, or released), else None."""
        p = self.registry.pools.get(pool_id)
        if p is None or p.state != "ready" or p.released:
            return ErrorEvent(404, "not_found_error", f"pool {pool_id} not found, not ready or released")
        return None

    def source(self, pool_id: int) -> tuple[int, list[int]]:
        """``(seq_id, built tokens)`` of a pool to share from; ``PoolError`` 404."""
        pool = self.registry.get(pool_id)
        return pool.seq_id, pool.tokens[:pool.n_past]

    def prefix_len(self, pool_id: int, prompt: list[int]) -> int:
        """Tokens of ``prompt`` that pool ``pool_id`` (live) already holds."""
        return _common_prefix(self.registry.pools[pool_id].tokens, prompt)

    def rates(self, pool_id: int, now: Optional[float] = None) -> tuple[int, float, int]:
        """``(sessions decoding on the pool, their mean decode rate in tokens/s,
        tokens decoded by the session whose admission opened the settle window)``;
        the last is 10**9 when no such session runs."""
        now = time.perf_counter() if now is None else now
        rates = [s.n_decoded / (now - s.t_prompt_done) for s in self.slots
                 if s.state is SlotState.GENERATING and s.pool_id == pool_id and s.t_prompt_done
                 and now > s.t_prompt_done]
        pool = self.registry.pools.get(pool_id)
        settle = pool.gate.settle_seq if pool is not None else None
        done = (self.slots[settle].n_decoded if settle is not None and settle >= 0 and self.slots[settle].busy
                else 10**9)
        return len(rates), (sum(rates) / len(rates) if rates else 0.0), done

    def session_rates(self, now: Optional[float] = None) -> list[dict]:
        """Per-slot decode rates (``GET /polykv/tps``): every slot that is busy or holds
        cached tokens, with ``tps_ewma`` (tokens/s since its prompt finished; 0 when
        idle) and its context use in tokens."""
        now = time.perf_counter() if now is None else now
        out = []
        for s in self.slots:
            if s.state is SlotState.IDLE and not s.cache_tokens:
                continue
            dt = now - s.t_prompt_done if s.t_prompt_done and s.busy else 0.0
            out.append({
                "id_slot": s.id,
                "session_id": s.session_id,
                "pool_id": s.pool_id,
                "is_processing": s.busy,
                "tps_ewma": (s.n_decoded / dt) if dt > 0 else 0.0,
                "ctx_used": s.n_past,
                "ctx_total": s.n_ctx,
                "ctx_headroom_tokens": s.n_ctx - s.n_past,
            })
        return out

    def capacity(self, pool_id: int, expected: int, headroom: int) -> dict:
        """Can a new session of ``expected`` tokens (suffix + generation) join pool
        ``pool_id`` now, given ``headroom`` free cells (``GET .../capacity``)? Needs the pool's
        prefix plus ``expected`` within a slot's context, a free cell budget, an idle slot and
        the pool's settled admission (the same decision ``admit`` takes: the settle window, the
        projected rate against the target; ``reason`` is its reason when it refuses or admits
        over a saturated projection). ``PoolError`` 404 for an unknown pool."""
        p = self.registry.get(pool_id)
        room = self.n_ctx_slot - len(p.tokens)  # what a session may add to the prefix
        busy = [s for s in self.slots if s.busy]
        rates = [r["tps_ewma"] for r in self.session_rates() if r["is_processing"]]
        mean_tps = sum(rates) / len(rates) if rates else 0.0
        idle_slots = len(self.slots) - len(busy)
        # the pool's settled admission, as ``admit`` would decide for a new session now
        now = time.perf_counter()
        n_pool, mean_pool, done = self.rates(p.id, now)
        d = p.gate.decide(n_pool, mean_pool, done, now)
        settle_ms = p.gate.settle_remaining_ms(now, done) if p.gate.enabled else 0
        can = expected <= min(headroom, room) and idle_slots > 0 and d.admit
        reason = ("no idle slot" if idle_slots == 0
                  else f"exceeds the slot's context ({len(p.tokens)} pool + {expected} > {self.n_ctx_slot})"
                  if expected > room else "kv pool saturated" if expected > headroom
                  else d.reason if not d.admit or d.saturated else "ok")
        sessions = min(max(headroom, 0) // expected, idle_slots)
        if d.sessions_remaining is not None:
            sessions = min(sessions, d.sessions_remaining)
        n = len(busy)
        return {
            "id": pool_id,
            "expected_tokens": expected,
            "can_admit": can,
            "reason": reason,
            "headroom_sessions": sessions if can else 0,
            "free_cells": max(headroom, 0),
            "mean_active_tps": mean_tps,
            "compaction_pressure": self.cells_reserved() / max(self.kv.base.n_cells, 1),
            "settling": settle_ms > 0,
            "settle_remaining_ms": settle_ms,
            "n_warming": sum(1 for s in busy if s.state is SlotState.PROMPT),
            "projected_mean_tps_next": (d.projected_tps if p.gate.enabled and n_pool
                                        else mean_tps * n / (n + 1) if n else 0.0),
            "sessions_attached": self.attached().get(p.id, 0),
        }

    # -- control (mutates the tree and the KV) ------------------------------------------
    def create(self, tokens: list[int], parent: Optional[int] = None, branch_pos: Optional[int] = None,
               pin: bool = False, future: Optional[Future] = None) -> Pool:
        """Register a pool and share its parent's cells ``[0, branch_pos)``; the rest
        is prefilled by the engine (``plan_builds``). ``future`` gets the pool's
        info when it is ready (at once when nothing is left to build).

        Raises ``PoolError``: 400 for a token id outside ``[0, n_vocab)`` or a prefix
        of ``n_ctx_slot`` tokens or more, and whatever ``PoolRegistry.create`` raises.
        A fork whose shared cells the cache no longer holds (sliding window, or a
        hybrid model's recurrent state) is rebuilt from position 0 (WARN on hybrids).
        """
        if any(not (0 <= t < self.n_vocab) for t in tokens):
            raise PoolError(f"token id out of range [0, {self.n_vocab})")
        if len(tokens) >= self.n_ctx_slot:
            raise PoolError(f"pool of {len(tokens)} tokens does not fit the context ({self.n_ctx_slot})")
        reg, kv = self.registry, self.kv
        pool = reg.create(tokens, parent, branch_pos, pin)
        pool.future = future
        if pool.parent is not None and pool.branch_pos:
            par = reg.pools[pool.parent]
            kv.seq_cp(par.seq_id, pool.seq_id, 0, pool.branch_pos)
            if not kv.can_reuse(pool.seq_id, pool.branch_pos):
                if kv.recurrent is not None:
                    log.warning("pool fork at %d of a %d-token parent on a hybrid model: a recurrent state "
                                "can only be shared whole; building the fork from position 0",
                                pool.branch_pos, len(par.tokens))
                kv.seq_rm(pool.seq_id)
                pool.n_past = 0
        if pool.n_past >= len(pool.tokens):
            self._ready(pool)
        return pool

    def release(self, pool_id: int) -> list[int]:
        """Release a pool; returns the ids of the pools reclaimed now (their cells
        are freed). ``PoolError`` 404 (unknown) or 409 (pinned)."""
        return [p.id for p in self._free(self.registry.release(pool_id, self.attached()))]

    def _free(self, gone: list[Pool]) -> list[Pool]:
        """Free the cells of pools the registry dropped; a build still waiting on one of them
        (released while building) fails with ``PoolError`` 409 at once. Returns ``gone``."""
        for p in gone:
            self.kv.seq_rm(p.seq_id)
            if p.future is not None and not p.future.done():
                p.state = "failed"
                p.future.set_exception(PoolError(f"pool {p.id} was released while it was building", 409))
        return gone

    def pin(self, pool_id: int, pinned: bool) -> dict:
        """Pin or unpin a pool (a pinned pool cannot be released); returns its info.
        ``PoolError`` 404 (unknown), 409 (pinning a released pool: it takes no sessions and
        goes when its sharers do; unpinning one is a no-op)."""
        p = self.registry.get(pool_id)
        if pinned and p.released:
            raise PoolError(f"pool {pool_id} is released; it cannot be pinned", 409)
        p.pinned = pinned
        return self.registry.info(p, self.attached(), self.cells(p))

    def reclaim(self) -> None:
        """Free the cells of released pools whose subtree and sessions are gone (call
        whenever a slot leaves a pool)."""
        self._free(self.registry.collect(self.attached()))

    # -- request flow -------------------------------------------------------------------
    def admit(self, h) -> Optional[ErrorEvent]:
        """Settled admission (P7) of request handle ``h`` (its ``pool_id`` passed
        ``check_request``). Continuing sessions (already attached under this
        ``session_id``), ``overcommit`` and pools without a target pass. Sets
        ``h.session_tps`` (tokens/s), ``h.sessions_remaining`` and, when admitted
        over a saturated projection, ``h.admission``. Returns None to admit, or a
        429 ``ErrorEvent`` whose ``retry_after`` (s) is the remaining settle time or
        one settle window."""
        req = h.request
        pool = self.registry.pools[req.pool_id]
        n, mean, done = self.rates(pool.id)
        h.session_tps = mean
        continuing = req.session_id is not None and any(
            s.session_id == req.session_id and s.pool_id == pool.id for s in self.slots)
        if continuing or req.overcommit or not pool.gate.enabled:
            return None
        d = pool.gate.decide(n, mean, done)
        h.sessions_remaining = d.sessions_remaining
        if not d.admit:
            return ErrorEvent(429, "unavailable_error",
                              f"pool {pool.id} saturated: {d.reason}", retry_after=d.retry_after)
        if d.saturated:
            h.admission = {"pool": f"pool-{pool.id}", "saturated": True}
        pool.gate.on_admit(mean, -1)
        return None

    def on_bind(self, slot, pool_id: Optional[int]) -> None:
        """``slot`` started a request (attached to ``pool_id``, or None): reclaim what
        it may have left, bind it, and let an open settle window follow it."""
        self.reclaim()
        if pool_id is not None:
            slot.pool_id = pool_id
            gate = self.registry.pools[pool_id].gate
            if gate.settling_since is not None and gate.settle_seq == -1:
                gate.settle_seq = slot.id

    def plan_builds(self, budget: int) -> list[tuple[Pool, list[int]]]:
        """Prefill chunks of building pools for one ubatch, at most ``budget`` tokens
        in all, oldest pool first: ``[(pool, tokens)]``. Changes nothing."""
        out = []
        for p in self.registry.building():
            if budget <= 0:
                break
            chunk = p.next_chunk(budget)
            out.append((p, chunk))
            budget -= len(chunk)
        return out

    def share_src(self, slots) -> dict[int, int]:
        """Shared-prefix attention hints for ``slots`` in a ubatch: slot seq_id -> the
        seq_id of the pool whose prefix cells it shares."""
        pools = self.registry.pools
        return {s.seq_id: pools[s.pool_id].seq_id for s in slots if s.n_shared and s.pool_id in pools}

    def on_built(self, pool: Pool, n: int) -> None:
        """``n`` more prefix tokens of ``pool`` are in the KV; resolves it when complete."""
        pool.n_past += n
        if pool.n_past == len(pool.tokens):
            self._ready(pool)

    def fail_build(self, pool: Pool, msg: str) -> None:
        """A build that does not fit the cache: free its cells, drop it, and fail its
        future with ``PoolError`` 503."""
        self.kv.seq_rm(pool.seq_id)
        self.registry.drop_failed(pool)
        pool.state = "failed"
        if pool.future is not None and not pool.future.done():
            pool.future.set_exception(PoolError(f"pool build failed: {msg}", 503))

    def observe(self) -> None:
        """After each step: close the settle windows that are over (measured rates)."""
        for p in self.registry.pools.values():
            if p.gate.settling_since is not None:
                n, mean, done = self.rates(p.id)
                p.gate.observe(mean, done, n)

    def _ready(self, pool: Pool) -> None:
        pool.state = "ready"
        if pool.future is not None and not pool.future.done():
            pool.future.set_result(self.registry.info(pool, self.attached(), self.cells(pool)))
