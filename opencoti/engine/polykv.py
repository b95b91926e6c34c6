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

This module is bookkeeping only (the registry, as mini-sglang's prefix cache
sits behind a narrow interface: create, get, attach/detach, release); all of
it runs on the engine thread, which owns the KV cache.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from opencoti.engine.pool_admission import SettledAdmission


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
