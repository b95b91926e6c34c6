"""The engine: one thread that owns the model runner and the KV cache.

Front ends (HTTP handler threads, the CLI) call ``submit`` from any thread;
the engine thread runs the step loop (DESIGN.md "How a request flows";
nano-vllm ``LLMEngine.step``):

    schedule  -> bind waiting requests to slots (prompt-cache reuse),
                 build one ubatch: the pending token of every generating slot
                 plus prefill chunks of prompts, at most ``n_ubatch`` tokens
    run       -> runner.decode(ubatch) -> logits for the rows that need them
    postprocess -> sample per slot, emit token events, finish slots

On a backend that chains steps (CUDA), a step of greedy decode rows only is
queued before the previous one is read (``_run_ahead``: vLLM's asynchronous
scheduling): its tokens go from the previous step's argmax to its input on the
device, and the host plans it, then postprocesses the previous step while the
device runs it. A row whose slot stopped in that postprocess is rolled back
(its one KV cell removed); anything else (a new request, a prompt, a control
call, a cancellation) first settles the step in flight.

Decoding slots are served first in every ubatch, so a long prompt arriving
never stalls running sessions (chunked prefill). Slot choice for a new
request follows llama.cpp's server: ``id_slot`` if given, else the idle slot
whose cached tokens share the longest prefix with the prompt, else the least
recently used idle slot.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

import numpy as np

from opencoti.engine.api import CompletionRequest, ErrorEvent, EventHold, FinishEvent, RequestHandle, TokenProb
from opencoti.engine.backend import select_backend
from opencoti.engine.backend.offload import offload_message
from opencoti.engine.batch import StepResult, UBatch
from opencoti.engine.dry import sampler_breakers
from opencoti.engine.grammar import GrammarError, GrammarMatcher, compile_grammar
from opencoti.engine.kv_auto_tier import decide_kv_types
from opencoti.engine.kv_cache import KVCacheFullError
from opencoti.engine.polykv import OFF_MESSAGE, PolyKV, Pool, PoolError, PoolRegistry, attach_prefix
from opencoti.engine.runner import ModelRunner
from opencoti.engine.sampling import Sampler, SamplingParamsError, token_logprob, top_logprobs
from opencoti.engine.slot import Slot, SlotState


log = logging.getLogger("opencoti.engine")


class _Control:
    """A control task for the engine thread (see ``Engine.call``)."""

    def __init__(self, fn, fut: Future):
        self.fn, self.fut = fn, fut

    def run(self, engine) -> None:
        if not self.fut.set_running_or_notify_cancel():
            return
        try:
            self.fut.set_result(self.fn(engine))
        except BaseException as e:  # delivered to the caller, never kills the engine
            self.fut.set_exception(e)


# -- post_sampling_probs (added for the HTTP layer's llama.cpp field; see _postprocess) --
def post_sampling_top(sampler: Sampler, logits: np.ndarray, token: int, n: int):
    """The top ``n`` tokens of the distribution the sampler drew from (llama.cpp
    ``populate_token_probs`` with ``post_sampling``: the candidates left after the
    chain, softmaxed after temperature; a grammar's mask applies first). Call it
    before ``accept`` (penalty history and grammar state as at the draw).

    Returns ``(ids int64 [m], logprobs float64 [m], token_logprob)``, m <= n,
    highest first, zero-probability tokens left out; a token the chain cut has
    probability 0 (log -inf), so the reported probabilities sum to <= 1. A token the
    grammar forced past ``ignore_eos``'s ban (``Sampler.grammar_ended``) had probability 1.
    """
    if sampler.grammar_ended:
        return np.array([token], np.int64), np.zeros(1), 0.0
    x = sampler.apply_grammar(logits) if sampler.grammar is not None else logits
    ids, vals = sampler.candidates(x)
    v = vals.astype(np.float64)
    p = np.exp(v - v.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")[:n]
    order = order[p[order] > 0]
    with np.errstate(divide="ignore"):
        lp = np.log(p)
    hit = np.flatnonzero(ids == token)
    return ids[order], lp[order], float(lp[hit[0]]) if hit.size else float("-inf")


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    i = int(np.argmax(x)) if x.any() else n
    return i


class _Inflight:
    """A step queued without waiting (``Engine._run_ahead``): its ubatch, owners (as
    ``_build_ubatch``'s), each owner's request handle at launch, its ``StepResult`` and launch
    time (``time.perf_counter``)."""

    __slots__ = ("ub", "owners", "handles", "result", "t0")

    def __init__(self, ub: UBatch, owners: list, result: StepResult, t0: float):
        self.ub, self.owners, self.result, self.t0 = ub, owners, result, t0
        self.handles = [s.handle for s, _, _ in owners]


class Engine:
    """Owns model runner + slots; thread-safe ``submit``.

    Args:
        model: ``opencoti.model.loader.Model``.
        params: ``opencoti.params.Params`` (n_ctx, n_batch, n_ubatch, n_parallel, kv_unified).
        backend: backend name/object (None -> chosen from ``params.gpu`` /
            ``n_gpu_layers`` / ``main_gpu`` by ``select_backend``).

    ``n_ctx`` is the total KV size; each slot may use ``n_ctx_slot`` cells
    (all of them when unified, else ``n_ctx / n_parallel``).
    """

    def __init__(self, model, params, backend=None):
        self.model = model
        self.params = params
        hp = model.hparams
        n_ctx = params.n_ctx if params.n_ctx > 0 else hp.n_ctx_train
        self.n_slots = max(1, params.n_parallel)
        self.n_ubatch = max(1, min(params.n_ubatch, params.n_batch))
        self.max_pools = max(0, params.polykv_max_pools)
        if params.ctx_shift and hp.is_recurrent:  # issue 7b: fail at load, naming the feature
            raise ValueError(f"--context-shift is not supported by architecture {hp.arch!r}: its gated delta-net "
                             "layers keep a recurrent state per sequence, which cannot drop old tokens "
                             "(start without --context-shift)")
        if self.max_pools and params.ctx_shift:
            log.warning("--context-shift with PolyKV pools: pooled sessions never shift (it would "
                        "corrupt every reader of the prefix); they stop with truncated=true")
        n_seq_max = self.n_slots + self.max_pools
        split = not (params.kv_unified or self.n_slots == 1)
        if split and n_ctx < n_seq_max:  # (llama.cpp: "n_ctx_seq == 0")
            pools = f" + {self.max_pools} PolyKV pools" if self.max_pools else ""
            raise ValueError(f"-c {n_ctx} is less than n_seq_max = {n_seq_max} ({self.n_slots} slots{pools}): the split "
                             f"KV cache would give each sequence no cell; raise -c or use --kv-unified")
        if backend is None:
            backend = select_backend(getattr(params, "gpu", "auto"), getattr(params, "n_gpu_layers", -1),
                                     getattr(params, "main_gpu", 0))
        self.runner = ModelRunner(
            model, backend, n_ctx=n_ctx, n_seq_max=n_seq_max, kv_unified=not split, n_ubatch=self.n_ubatch,
            type_k_tail=getattr(params, "cache_type_k_tail", None),
            type_v_tail=getattr(params, "cache_type_v_tail", None),
            kv_policy=functools.partial(decide_kv_types, type_k=getattr(params, "cache_type_k", None),
                                        type_v=getattr(params, "cache_type_v", None),
                                        auto=bool(getattr(params, "kv_auto_tier", False)),
                                        budget_mib=getattr(params, "kv_budget_mib", None)),
            n_gpu_layers=getattr(params, "n_gpu_layers", -1),
        )
        self._say_offload(getattr(params, "n_gpu_layers", -1))
        self.kv_decision = self.runner.kv_decision
        if self.kv_decision.enabled:  # once: the KV boot report leaves it out
            if self.kv_decision.applied and self.kv_decision.fits:
                print(f"opencoti: {self.kv_decision.reason}", file=sys.stderr)  # a boot line, as the others
            else:
                log.warning("%s", self.kv_decision.reason)
        self._say_tail_tiers()
        self._say_flash_attn(getattr(params, "flash_attn", "auto"))
        self.n_ctx = self.runner.kv.n_ctx  # the cells allocated (the split cache rounds n_ctx)
        self.n_ctx_slot = self.runner.kv.n_ctx_seq
        if self.n_ctx != n_ctx:  # (as llama.cpp llama_context warns)
            log.warning("n_ctx = %d is not divisible by n_seq_max = %d - rounding down to %d (n_ctx_slot = %d)",
                        n_ctx, n_seq_max, self.n_ctx, self.n_ctx_slot)
        if self.max_pools and not self.runner.kv.unified:  # pools take streams of their own
            PolyKV.check_split_layout(n_ctx, self.n_slots, self.max_pools, self.n_ctx_slot)
        self.slots = [Slot(i, self.n_ctx_slot) for i in range(self.n_slots)]
        # PolyKV (--polykv-max-pools): the pool manager, None when off; ``pools`` is its
        # pool tree (read it from other threads only as a possibly stale snapshot)
        self.polykv: Optional[PolyKV] = (PolyKV(self.runner.kv, self.slots, self.max_pools, self.n_ctx_slot,
                                                hp.n_vocab) if self.max_pools else None)
        self.pools: Optional[PoolRegistry] = self.polykv.registry if self.polykv is not None else None
        self._queue: "queue.Queue[Optional[RequestHandle]]" = queue.Queue()
        self._task_ids = itertools.count()  # submit's id_task (next() on a count is atomic in CPython)
        self._waiting: list[RequestHandle] = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._events = EventHold()  # a step's events, delivered once the next step runs (step)
        self.n_steps = 0
        self.n_tokens_processed = 0
        self.n_tokens_max = 0  # the largest step's tokens (llama.cpp's n_tokens_max)
        self.n_busy_slots_total = 0  # slots with rows in each step, summed over the steps
        self.n_admissions_refused = 0
        self.recent_tps = 0.0  # EWMA of tokens processed per second of step time
        # greedy decode steps queued before the previous one is read (module docstring): where the
        # runner chains them, not for recurrent state (a rolled-back row would have advanced it);
        # OPENCOTI_ASYNC_DECODE=0 turns it off
        self.async_decode = (os.environ.get("OPENCOTI_ASYNC_DECODE", "1") != "0" and not hp.is_recurrent
                             and self.runner.chains_steps)
        self._inflight: Optional[_Inflight] = None
        self.n_steps_ahead = 0  # steps queued by _run_ahead

    def _say_tail_tiers(self) -> None:
        """Warn (once, at boot) where a spilled tail's type (-ctkt / -ctvt) stores more bits per
        value than the cache's own type: a tail exists to take less memory than the cells it came
        from (the types are accepted as given)."""
        if not self.runner.kv.caches:
            return
        c = self.runner.kv.caches[0]
        for flag, t, tail in (("-ctk", c.tier_k, c.tier_k_tail), ("-ctv", c.tier_v, c.tier_v_tail)):
            if tail.bits_per_value > t.bits_per_value:
                log.warning("%st %s stores %.2f bits a value, more than %s %s (%.2f): a spilled tail would take "
                            "more memory than the cells it replaces", flag, tail.name, tail.bits_per_value, flag,
                            t.name, t.bits_per_value)

    def _say_flash_attn(self, flash_attn: str) -> None:
        """Warn (once, at boot) for ``-fa off`` with a quantized V cache: llama.cpp refuses that
        pair (llama_context: "V cache quantization requires flash_attn"); here attention always
        reads the cache in place, block by block, so it runs as with ``-fa on``."""
        if flash_attn != "off" or not self.runner.kv.caches:
            return
        tier_v = self.runner.kv.caches[0].tier_v
        if tier_v.family != "float":
            log.warning("-fa off with -ctv %s: llama.cpp refuses a quantized V cache without flash attention; "
                        "opencoti's attention always reads the cache in place, so -fa off changes nothing",
                        tier_v.name)

    def _say_offload(self, n_gpu_layers: int) -> None:
        """llama.cpp's boot line ``offloaded N/M layers to GPU`` on stderr: on a GPU backend
        (with where a ``-ngl`` split puts the layers), or for an explicit ``-ngl 0``."""
        split, n_layer = self.runner.split, self.model.hparams.n_layer
        if split is not None:
            msg = split.describe()
        elif self.runner.backend.name != "cpu":
            msg = offload_message(n_layer, n_gpu_layers)  # -1 or > n_layer: all of them
        elif n_gpu_layers == 0:
            msg = offload_message(n_layer, 0)
        else:
            return
        print(f"opencoti: load_tensors: {msg}", file=sys.stderr)

    # -- front-end API (any thread) -----------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="opencoti-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[["Engine"], object]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps (control tasks:
        erase a slot, create or release a pool, …) and return a Future with its
        result or exception. Raises ``RuntimeError`` if the engine is stopped."""
        if self._stop.is_set():
            raise RuntimeError("engine is stopped")
        fut: Future = Future()
        self._queue.put(_Control(fn, fut))
        return fut

    def erase_slot(self, id_slot: int) -> Future:
        """Clear an idle slot's KV and session (llama.cpp ``POST /slots/{id}?action=erase``).
        The Future raises ``ValueError`` for a bad id and ``RuntimeError`` if the slot is busy;
        its result is the number of tokens erased."""

        def erase(engine: "Engine") -> int:
            if not 0 <= id_slot < engine.n_slots:
                raise ValueError(f"id_slot {id_slot} out of range [0, {engine.n_slots})")
            s = engine.slots[id_slot]
            if s.busy:
                raise RuntimeError(f"slot {id_slot} is processing a request")
            n = len(s.cache_tokens)
            engine._forget_kv(s)
            s.session_id = None
            return n

        return self.call(erase)

    def submit(self, request: CompletionRequest) -> RequestHandle:
        """Queue a request; events arrive on the returned handle."""
        handle = RequestHandle(request)
        handle.id_task = next(self._task_ids)
        self._queue.put(handle)
        return handle

    def slots_info(self) -> list[dict]:
        """llama.cpp ``GET /slots``-style snapshot (read without locking; fields are
        plain values, so a racing read is at worst one step stale)."""
        out = []
        for s in self.slots:
            out.append({
                "id": s.id,
                "id_task": s.handle.id_task if s.busy and s.handle is not None else -1,
                "n_ctx": s.n_ctx,
                "is_processing": s.busy,
                "state": s.state.value,
                "n_past": s.n_past,
                "n_cached_tokens": len(s.cache_tokens),
            })
        return out

    def props(self) -> dict:
        kv = self.runner.kv
        return {
            "n_ctx": self.n_ctx,
            "n_ctx_slot": self.n_ctx_slot,
            "n_slots": self.n_slots,
            "n_ubatch": self.n_ubatch,
            "kv_unified": kv.unified,
            "kv_cells": [c.n_cells for c in kv.caches],
            "kv_bytes": kv.nbytes(),
            "backend": self.runner.backend.name,
        }

    # -- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run_loop()
        finally:
            try:
                self._settle(False)  # a step still in flight finishes its requests' tokens
            except Exception:
                log.exception("engine step failed")
            self._events.release()  # whatever ends the thread, what was held is delivered

    def _run_loop(self) -> None:
        while not self._stop.is_set():
            active = (any(s.busy for s in self.slots) or self._waiting
                      or (self.polykv is not None and self.polykv.building()))
            if not active:
                self._events.release()  # nothing runs next: deliver before waiting for work
            try:
                h = self._queue.get(block=not active, timeout=None if not active else 0)
            except queue.Empty:
                h = None
            if h is not None:
                self._guarded(self._settle, True)  # requests and control calls see no step in flight
            while h is not None:
                if isinstance(h, _Control):
                    h.run(self)
                else:
                    self._accept_guarded(h)
                try:
                    h = self._queue.get_nowait()
                except queue.Empty:
                    h = None
            if self._stop.is_set():
                break
            self._guarded(self.step, hold_events=True, ahead=self.async_decode)

    def _guarded(self, fn, *args, **kw) -> None:
        """Run a step (or the settling of one) so that its failure fails the running requests
        (500), never the engine thread."""
        try:
            fn(*args, **kw)
        except Exception as e:  # never let one bad step kill the server
            log.exception("engine step failed")
            self._inflight = None  # its requests fail below
            self._events.release()
            self._fail_all(500, "server_error", f"internal error: {type(e).__name__}: {e}")

    def _fail_all(self, status: int, typ: str, msg: str) -> None:
        for s in self.slots:
            if s.busy:
                s.handle.push(ErrorEvent(status, typ, msg))
                s.state = SlotState.IDLE
                s.handle = None
                self._forget_kv(s)  # its KV and what described it, pool binding included
        for h in self._waiting:
            h.push(ErrorEvent(status, typ, msg))
        self._waiting = []

    def step(self, hold_events: bool = False, ahead: bool = False) -> None:
        """One schedule -> run -> postprocess iteration (engine thread only).

        ``hold_events`` (the engine loop's steps): the events this step's postprocess pushes are
        held (``api.EventHold``) and delivered once the next step is queued on the device
        (``runner.decode``'s ``on_launch``), so the threads they wake run while this one waits
        for the device; a step that runs nothing delivers them at once, and so does ``_loop``
        before it blocks, fails requests or ends. Otherwise they are delivered when pushed.

        ``ahead`` (the engine loop's steps when ``async_decode``): a step of greedy decode rows
        only is queued and left in flight; the next call queues its successor first
        (``_run_ahead``), then postprocesses it. Without ``ahead`` a step in flight is settled
        first, so every call returns with its step's events pushed."""
        if self._inflight is not None:
            if ahead and self._can_run_ahead() and self._run_ahead(hold_events):
                return
            self._settle(hold_events)
        self._drop_cancelled()
        self._bind_waiting()
        ub, owners = self._build_ubatch()
        if ub is None:
            self._events.release()
            return
        t0 = time.perf_counter()
        argmax = self._argmax_step(ub, owners)
        launch = ahead and argmax and self._decode_only(ub, owners)
        while True:
            try:
                if launch:
                    self._inflight = _Inflight(ub, owners, self.runner.launch(ub, on_launch=self._events.release), t0)
                    self._events.release()
                    return
                logits = self.runner.decode(ub, argmax=argmax, on_launch=self._events.release)
                break
            except KVCacheFullError as e:
                # first drop sliding-window cells no slot can see again (lossless), then idle KV
                if not self.runner.kv.trim_swa([s.seq_id for s in self.slots]) and not self._evict_idle(ub):
                    self._events.release()
                    self._on_kv_full(owners, str(e))
                    return
        self._events.release()  # (a path that ran without calling on_launch)
        self._complete(ub, owners, logits, argmax, t0, hold_events)

    def _complete(self, ub: UBatch, owners, logits, argmax: bool, t0: float, hold_events: bool) -> None:
        """Count a step that ran (its ``logits`` or argmax pair in hand) and postprocess it,
        holding the events it pushes with ``hold_events``."""
        if hold_events:
            self._events.hold()
        self.n_steps += 1
        self.n_tokens_processed += ub.n_tokens
        self.n_tokens_max = max(self.n_tokens_max, ub.n_tokens)
        self.n_busy_slots_total += len(owners)
        if self.polykv is not None:
            self.polykv.observe()
        dt = time.perf_counter() - t0
        if dt > 0:
            self.recent_tps = 0.8 * self.recent_tps + 0.2 * (ub.n_tokens / dt) if self.recent_tps else ub.n_tokens / dt
        self._postprocess(ub, owners, logits, argmax)

    def _settle(self, hold_events: bool):
        """Wait for the step in flight, if any, and postprocess it; returns its argmax pair
        (``StepResult.result``), None when nothing was in flight."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return None
        pair = prev.result.result()
        self._complete(prev.ub, prev.owners, pair, True, prev.t0, hold_events)
        return pair

    def _decode_only(self, ub: UBatch, owners) -> bool:
        """Whether ``ub`` is one decode row per owner, every owner a generating slot, rows in
        owner order, and every generating slot has its row (``_run_ahead``'s shape)."""
        if len(owners) != ub.n_tokens or len(ub.out_rows) != ub.n_tokens:
            return False
        gen = [s for s in self.slots if s.state is SlotState.GENERATING]
        return len(gen) == len(owners) and all(
            isinstance(s, Slot) and s.state is SlotState.GENERATING and start == i and n == 1
            for i, (s, start, n) in enumerate(owners))

    def _can_run_ahead(self) -> bool:
        """Whether the step after the one in flight may be queued before it is read: nothing
        waits to be accepted, bound or built (no prompt, no pool build, no cancellation), every
        row of the step in flight is still its slot's (none rolled back), and each slot has room
        for two more tokens (its postprocess then never shifts the context under a queued
        step)."""
        prev = self._inflight
        if not self._queue.empty() or (self._waiting and any(not s.busy for s in self.slots)):
            return False
        if any(h.cancelled for h in self._waiting):  # its reader hears at the next ordinary step
            return False
        if self.polykv is not None and self.polykv.building():
            return False
        if not self._decode_only(prev.ub, prev.owners):  # also: no row was rolled back
            return False
        return all(s.handle is h and not h.cancelled and s.n_past + 2 < s.n_ctx
                   for (s, _, _), h in zip(prev.owners, prev.handles))

    def _run_ahead(self, hold_events: bool) -> bool:
        """Queue the next token of every row of the step in flight (its tokens: that step's
        argmax, chained on the device by ``runner.launch``), then wait for the step in flight and
        postprocess it; rows whose slot did not go on with exactly that token (finished, failed)
        are rolled back: their one cell is removed and the row is left out of the new step's
        owners. Returns False, with nothing changed, when the cache has no room for the step
        (the caller settles and takes the ordinary path, which trims or evicts)."""
        prev = self._inflight
        T = prev.ub.n_tokens
        ub = UBatch.build(np.zeros(T, dtype=np.int64), prev.ub.pos + 1, prev.ub.seq_id, np.arange(T))
        ub.argmax_ban = prev.ub.argmax_ban  # the same rows, in the same order
        if self.polykv is not None:
            ub.share_src.update(self.polykv.share_src(s for s, _, _ in prev.owners))
        t0 = time.perf_counter()
        try:
            result = self.runner.launch(ub, on_launch=self._events.release, after=prev.result)
        except KVCacheFullError:
            return False
        self._events.release()
        try:
            pair = self._settle(hold_events)
        except BaseException:  # the queued step goes with it (the loop fails the busy requests)
            self._drop_rows(ub, result, range(T))
            raise
        ub.tokens[:] = pair[0][:T]
        owners, gone = [], []
        for (s, i, n), h in zip(prev.owners, prev.handles):
            if s.state is SlotState.GENERATING and s.handle is h and s.pending == int(ub.tokens[i]):
                owners.append((s, i, n))
            else:  # stopped (or took another token): the queued row's cell goes
                gone.append(i)
        self.n_steps_ahead += 1
        if not owners:  # nothing left to read: the step ends here, not at the next request
            self._drop_rows(ub, result, gone)
            return True
        self._drop_rows(ub, None, gone)
        self._inflight = _Inflight(ub, owners, result, t0)
        return True

    def _drop_rows(self, ub: UBatch, result: Optional[StepResult], rows) -> None:
        """Remove the cells of queued rows ``rows`` of ``ub`` (``_run_ahead``'s rollback); with
        ``result``, the whole step is dropped: wait for it first, so nothing it copies lands in
        memory that is handed out again."""
        if result is not None:
            try:
                result.result()
            except Exception:  # a failed step: its cells go all the same
                log.exception("a dropped decode step failed")
        for i in rows:
            self.runner.kv.seq_rm(int(ub.seq_id[i]), int(ub.pos[i]), int(ub.pos[i]) + 1)

    def _argmax_step(self, ub: UBatch, owners) -> bool:
        """Whether every logits row of ``ub`` goes to a sampler that only takes the row's argmax
        (``Sampler.argmax_only``, no ``n_probs``): the runner then returns ``(argmax, max)`` per
        row instead of the logits (a GPU reduces the rows where they are: no logits copy). Sets
        ``ub.argmax_ban`` to the rows whose sampler bans ids (``ignore_eos``) and those ids; rows
        that ban different ids make it a full-logits step."""
        ub.argmax_ban = None
        if not len(ub.out_rows):
            return False
        outs = {int(r): i for i, r in enumerate(ub.out_rows.tolist())}
        rows, ids = [], None
        for s, start, n in owners:
            if isinstance(s, Pool) or start + n - 1 not in outs:
                continue
            if not s.sampler.argmax_only or s.handle.request.sampling.n_probs > 0:
                return False
            ban = s.sampler.ban_ids
            if ban.size:
                if ids is not None and not np.array_equal(ids, ban):
                    return False
                ids = ban
                rows.append(outs[start + n - 1])
        if rows:
            ub.argmax_ban = (np.array(rows, dtype=np.int64), ids)
        return True

    def _drop_cancelled(self) -> None:
        for s in self.slots:
            if s.busy and s.handle.cancelled:
                s.finish("limit")
        for h in self._waiting:
            if h.cancelled:  # never started: tell its reader so nothing waits forever
                h.push(FinishEvent(stop_type="limit", n_prompt_tokens=len(h.request.prompt_tokens)))
        self._waiting = [h for h in self._waiting if not h.cancelled]

    def _validate(self, h: RequestHandle) -> Optional[ErrorEvent]:
        req = h.request
        n = len(req.prompt_tokens)
        if n == 0:
            return ErrorEvent(400, "invalid_request_error", "the prompt is empty")
        n_vocab = self.model.hparams.n_vocab
        bad = [t for t in req.prompt_tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
        if bad:
            return ErrorEvent(400, "invalid_request_error", f"token {bad[0]!r} is not an integer token id")
        bad = [t for t in req.prompt_tokens if not (0 <= t < n_vocab)]
        if bad:
            return ErrorEvent(400, "invalid_request_error", f"token id {bad[0]} out of range [0, {n_vocab})")
        if n >= self.n_ctx_slot:
            return ErrorEvent(
                400, "exceed_context_size_error",
                f"the request exceeds the available context size: {n} prompt tokens, "
                f"context size {self.n_ctx_slot}",
            )
        if req.pool_id is not None:
            if self.polykv is None:
                return ErrorEvent(404, "not_found_error", OFF_MESSAGE)
            err = self.polykv.check_request(req.pool_id)
            if err is not None:
                return err
        if req.shared_pool_slot >= 0:
            if self.params.cache_idle_slots:
                return ErrorEvent(400, "invalid_request_error",
                                  "shared_pool_slot needs the server started with --no-cache-idle-slots")
            if req.shared_pool_slot >= self.n_slots:
                return ErrorEvent(400, "invalid_request_error",
                                  f"shared_pool_slot {req.shared_pool_slot} out of range [0, {self.n_slots})")
            if req.shared_pool_slot == req.id_slot:
                return ErrorEvent(400, "invalid_request_error",
                                  f"shared_pool_slot {req.shared_pool_slot} is the request's own id_slot")
        if req.id_slot >= self.n_slots:
            return ErrorEvent(400, "invalid_request_error", f"id_slot {req.id_slot} out of range [0, {self.n_slots})")
        # -- grammar (constrained output): reject a grammar that does not compile --
        if req.sampling.grammar:
            try:
                compile_grammar(req.sampling.grammar)
            except GrammarError as e:
                return ErrorEvent(400, "invalid_request_error", f"failed to parse grammar: {e}")
        return None

    def _pick_slot(self, req: CompletionRequest) -> Optional[Slot]:
        """The slot a request binds to now, or None (it waits).

        ``id_slot`` if given. A ``session_id`` already held by a slot goes to
        that slot (waiting while it is busy). Another request takes an idle slot
        that holds no session (the longest cached prefix wins, then the least
        recently used); when every idle slot holds a session, the least recently
        used one gives way, whatever prefix the others share with the prompt.
        """
        if req.id_slot >= 0:
            s = self.slots[req.id_slot]
            return None if s.busy else s
        if req.session_id is not None:
            for s in self.slots:
                if s.session_id == req.session_id:
                    return None if s.busy else s
        idle = [s for s in self.slots if not s.busy and s.id != req.shared_pool_slot]
        if not idle:
            return None
        free = [s for s in idle if s.session_id is None]
        if not free:
            return min(idle, key=lambda s: s.t_last_used)
        best = max(free, key=lambda s: (common_prefix(s.cache_tokens, req.prompt_tokens), -s.t_last_used))
        if common_prefix(best.cache_tokens, req.prompt_tokens) > 0:
            return best
        return min(free, key=lambda s: s.t_last_used)

    # -- admission (KV gate) ---------------------------------------------------------------
    def _accept_guarded(self, h: RequestHandle) -> None:
        """``_accept``, where an unexpected exception fails only this request (500), never the
        engine thread and the other sessions."""
        try:
            self._accept(h)
        except Exception as e:
            log.exception("engine: accepting a request failed")
            if not h.done:
                h.push(ErrorEvent(500, "server_error", f"internal error: {type(e).__name__}: {e}"))

    def _accept(self, h: RequestHandle) -> None:
        """A new request: validate, pass the KV admission gate, queue it."""
        err = self._validate(h)
        if err is None:
            err = self._admit(h)
        if err is not None:
            h.push(err)
            return
        self._waiting.append(h)

    def kv_headroom(self, taker: Optional[Slot] = None) -> int:
        """Cells of the unified cache not held or reserved by running and admitted
        requests, nor by pools. Idle slots' cells count as free (they are evicted on demand),
        except under ``--no-cache-idle-slots``, where they stay until their slot takes other
        work: then only ``taker``'s (the slot a new request will bind, freeing its cells) do."""
        held = sum(s.footprint for s in self.slots if s.busy)
        if not self.params.cache_idle_slots:
            held += sum(max(s.n_past - s.n_shared, 0) for s in self.slots if not s.busy and s is not taker)
        reserved = sum(getattr(h, "reservation", 0) for h in self._waiting)
        pooled = self.polykv.cells_reserved() if self.polykv is not None else 0
        return self.runner.kv.base.n_cells - held - reserved - pooled

    def _admit(self, h: RequestHandle) -> Optional[ErrorEvent]:
        """The poolless admission gate (``--admission-poolless``), unified cache only
        (split streams are hard per-slot limits, checked by ``_validate``).

        Demand = prompt tokens not served from a cached prefix + ``n_predict``
        when given (capped at the slot's context, where generation stops). Decided here, on the
        engine thread, so concurrent arrivals see each other's reservations; the reservation
        ends when the request binds to a slot. A request that finds no slot free queues for one
        and is checked against the cells it will find then: today's headroom plus the smallest
        footprint of the busy slots (one of which must end first), so with ``-np 1`` a second
        request waits instead of being refused.
        """
        req = h.request
        mode = self.params.admission_poolless
        h.reservation = 0
        if req.pool_id is not None:  # PolyKV settled admission
            err = self.polykv.admit(h)
            if err is not None:
                self.n_admissions_refused += 1
                return err
        if mode == "off" or not self.runner.kv.unified:
            return None
        cand = self._pick_slot(req)
        reuse = common_prefix(cand.cache_tokens, req.prompt_tokens) if cand is not None and req.cache_prompt else 0
        if req.pool_id is not None:  # validated: the pool exists and is ready
            reuse = max(reuse, self.polykv.prefix_len(req.pool_id, req.prompt_tokens))
        # generation stops at the slot's context, so no request needs more than that
        demand = min(len(req.prompt_tokens) + max(req.n_predict, 0), self.n_ctx_slot) - reuse
        headroom = self.kv_headroom(cand)
        if cand is None and any(s.busy for s in self.slots):
            # no slot for it now: it waits (as llama.cpp queues it) until a busy slot ends, and
            # the first to end frees at least the smallest projected footprint
            headroom += min(s.footprint for s in self.slots if s.busy)
        if demand <= headroom or req.overcommit:
            h.reservation = demand
            return None
        if mode == "warn":
            h.admission = {"pool": "poolless", "saturated": True}
            h.reservation = demand
            return None
        self.n_admissions_refused += 1
        shortfall = demand - max(headroom, 0)
        tps = max(self.recent_tps, 1.0)
        retry = max(1, min(60, int(shortfall / tps + 0.999)))
        return ErrorEvent(
            429, "unavailable_error",
            f"KV pool 'poolless' saturated: request needs {demand} cells, {max(headroom, 0)} free "
            f"of {self.runner.kv.base.n_cells}; retry later or send \"overcommit\": true",
            retry_after=retry,
        )

    def _bind_waiting(self) -> None:
        still = []
        for h in self._waiting:
            slot = self._pick_slot(h.request)
            if slot is None:
                still.append(h)
                continue
            h.reservation = 0
            try:
                self._bind(slot, h)
            except Exception as e:  # one request's bad settings fail that request only
                log.exception("request could not start")
                status = 400 if isinstance(e, ValueError) else 500
                h.push(ErrorEvent(status, "invalid_request_error" if status == 400 else "server_error",
                                  f"{type(e).__name__}: {e}"))
                if slot.handle is h:
                    slot.state, slot.handle = SlotState.IDLE, None
        self._waiting = still

    def _bind(self, slot: Slot, h: RequestHandle) -> None:
        req = h.request
        kv = self.runner.kv
        n_past = common_prefix(slot.cache_tokens, req.prompt_tokens) if req.cache_prompt else 0
        n_past = min(n_past, len(req.prompt_tokens) - 1)  # the last prompt token must be computed for logits
        if n_past > 0 and not kv.can_reuse(slot.seq_id, n_past):
            n_past = 0  # the sliding-window cache no longer holds what reuse needs (llama.cpp does the same)
        kv.seq_rm(slot.seq_id, n_past, -1)
        if n_past == 0:
            kv.seq_rm(slot.seq_id)
        # a session re-using its own cache keeps the pool cells it already shares
        kept = min(slot.n_shared, n_past) if req.pool_id is not None and slot.pool_id == req.pool_id else 0
        slot.pool_id, n_shared = None, 0
        if req.pool_id is not None or req.shared_pool_slot >= 0:
            n_past, n_shared = self._share_prefix(slot, req, n_past)
        n_shared = n_shared or kept
        # -- grammar (constrained output): the slot's sampler gets a matcher --
        grammar = None
        if req.sampling.grammar:
            grammar = GrammarMatcher(compile_grammar(req.sampling.grammar), self.model.tokenizer)
        if req.session_id is not None:
            for other in self.slots:  # a session lives in one slot
                if other is not slot and other.session_id == req.session_id:
                    other.session_id = None
        slot.session_id = req.session_id
        sampler = Sampler(req.sampling, self.model.hparams.n_vocab, grammar=grammar,
                          dry_breakers=sampler_breakers(self.model.tokenizer, req.sampling),
                          ban=self.model.tokenizer.eog_ids if req.ignore_eos else ())
        sampler.accept_many(req.prompt_tokens)
        from opencoti.model.tokenizer import StreamDecoder

        slot.start(h, n_past, sampler, StreamDecoder(self.model.tokenizer))
        slot.n_shared = n_shared
        if self.polykv is not None:  # the slot may have left a released pool; bind it to its new one
            self.polykv.on_bind(slot, req.pool_id)

    # -- PolyKV (the pool manager is opencoti.engine.polykv.PolyKV) ----------------------
    def _share_prefix(self, slot: Slot, req: CompletionRequest, n_past: int) -> tuple[int, int]:
        """Attach ``slot`` to the prefix of its pool (``pool_id``) or of a manual
        source slot (``shared_pool_slot``) when that beats its own cached prefix;
        returns the new ``(n_past, n_shared)`` (see ``polykv.attach_prefix``)."""
        if req.pool_id is not None:
            src_seq, src_tokens = self.polykv.source(req.pool_id)  # validated at admission
        else:
            src = self.slots[req.shared_pool_slot]
            src_seq, src_tokens = src.seq_id, src.cache_tokens[:max(0, req.shared_prefix_n_tokens)]
        return attach_prefix(self.runner.kv, slot.seq_id, src_seq, src_tokens, req.prompt_tokens, n_past,
                             "pool" if req.pool_id is not None else "source slot")

    def _reclaim_pools(self) -> None:
        """Reclaim released pools whose subtree and sessions are gone (called
        whenever a slot leaves a pool)."""
        if self.polykv is not None:
            self.polykv.reclaim()

    def pool_attached(self) -> dict[int, int]:
        """pool id -> number of slots currently sharing its prefix (engine thread)."""
        return self.polykv.attached() if self.polykv is not None else {}

    def pool_gauges(self) -> dict:
        """PolyKV gauges (engine thread): pools, pinned pools' prefix tokens, sessions attached."""
        if self.polykv is None:
            return {"pools": 0, "cells_pinned": 0, "sessions_attached": 0}
        return self.polykv.gauges()

    def _pool_call(self, fn: Callable[[PolyKV], object]) -> Future:
        """Run ``fn(manager)`` on the engine thread; the Future raises ``PoolError``
        404 when PolyKV is off."""

        def run(engine: "Engine"):
            if engine.polykv is None:
                raise PoolError(OFF_MESSAGE, 404)
            return fn(engine.polykv)

        return self.call(run)

    def create_pool(self, tokens: list[int], parent: Optional[int] = None,
                    branch_pos: Optional[int] = None, pin: bool = False) -> Future:
        """Create a pool from ``tokens`` (a fork of ``parent`` when given). The
        Future resolves with the pool's info once its KV is built, or raises
        ``PoolError`` (with an HTTP status; see ``PolyKV.create``)."""
        outer: Future = Future()

        def create(m: PolyKV):
            self._drop_idle_holders()  # a released pool kept only as prompt cache frees its seq_id
            return m.create(tokens, parent, branch_pos, pin, outer)

        inner = self._pool_call(create)
        inner.add_done_callback(lambda f: f.exception() and outer.set_exception(f.exception()))
        return outer

    def release_pool(self, pool_id: int) -> Future:
        """Release a pool; its cells are reclaimed once its subtree is gone.
        Result: the ids of the pools reclaimed now."""
        def release(m: PolyKV) -> list[int]:
            gone = m.release(pool_id)
            held = set(m.registry.pools)
            self._drop_idle_holders()
            return gone + sorted(held - set(m.registry.pools))

        return self._pool_call(release)

    def _drop_idle_holders(self) -> None:
        """Idle slots without a session that share a released pool's prefix hold it only as
        prompt cache (``--cache-idle-slots``): forget their KV, so that the pool goes (engine
        thread). Sessions keep theirs: a released pool waits for them."""
        if not self.params.cache_idle_slots:
            return
        pools = self.polykv.registry.pools
        for s in self.slots:
            if (not s.busy and s.session_id is None and s.n_shared and s.pool_id in pools
                    and pools[s.pool_id].released):
                self._forget_kv(s)

    def pin_pool(self, pool_id: int, pinned: bool) -> Future:
        """Pin or unpin a pool (a pinned pool cannot be released). Result: its info."""
        return self._pool_call(lambda m: m.pin(pool_id, pinned))

    def pool_info(self, pool_id: Optional[int] = None) -> Future:
        """Info of one pool, or a list of all (``pool_id`` None)."""
        return self._pool_call(lambda m: m.info(pool_id))

    def _build_ubatch(self):
        budget = self.n_ubatch
        tokens, pos, seqs, out_rows, owners = [], [], [], [], []
        for s in self.slots:
            if s.state is SlotState.GENERATING and budget > 0:
                out_rows.append(len(tokens))
                owners.append((s, len(tokens), 1))
                tokens.append(s.pending)
                pos.append(s.n_past)
                seqs.append(s.seq_id)
                budget -= 1
        for s in sorted((s for s in self.slots if s.state is SlotState.PROMPT), key=lambda s: s.t_start):
            if budget <= 0:
                break
            chunk = s.next_prompt_chunk(budget)
            start = len(tokens)
            tokens.extend(chunk)
            pos.extend(range(s.n_past, s.n_past + len(chunk)))
            seqs.extend([s.seq_id] * len(chunk))
            owners.append((s, start, len(chunk)))
            if s.n_past + len(chunk) == len(s.prompt):
                out_rows.append(len(tokens) - 1)
            budget -= len(chunk)
        for p, chunk in (self.polykv.plan_builds(budget) if self.polykv is not None else []):
            owners.append((p, len(tokens), len(chunk)))
            tokens.extend(chunk)
            pos.extend(range(p.n_past, p.n_past + len(chunk)))
            seqs.extend([p.seq_id] * len(chunk))
        if not tokens:
            return None, owners
        ub = UBatch.build(tokens, pos, seqs, out_rows)
        if self.polykv is not None:  # shared-prefix attention hint: who reads which pool's cells
            ub.share_src.update(self.polykv.share_src(s for s, _, _ in owners if isinstance(s, Slot)))
        return ub, owners

    def _evict_idle(self, ub: UBatch) -> bool:
        """Free the KV of the least recently used idle slot that holds cells in a
        stream this ubatch writes to. Returns False when there is none, or when
        ``--no-cache-idle-slots`` keeps idle slots' KV in place."""
        if not self.params.cache_idle_slots:
            return False
        kv = self.runner.kv
        streams = {kv.base.stream_of(int(q)) for q in np.unique(ub.seq_id)}
        idle = [s for s in self.slots if not s.busy and s.cache_tokens and kv.base.stream_of(s.seq_id) in streams]
        if not idle:
            return False
        self._forget_kv(min(idle, key=lambda s: s.t_last_used))
        return True

    def _forget_kv(self, s: Slot) -> None:
        """Drop idle slot ``s``'s KV and what described it (cached tokens, n_past, its pool
        binding), then reclaim pools it may have held (``erase_slot``, eviction, a request failed
        by a full cache or a failed step). Cells it shared with a pool stay: the pool is still a
        member."""
        self.runner.kv.seq_rm(s.seq_id)
        s.cache_tokens, s.n_past = [], 0
        s.pool_id, s.n_shared = None, 0
        self._reclaim_pools()

    def _on_kv_full(self, owners, msg: str) -> None:
        # Nothing was committed. Fail the youngest prompt in the batch so the rest can proceed;
        # with none, the cache is at its usable capacity for generation (pools hold part of it):
        # the youngest generating request stops there with truncated=true, keeping its text, as
        # at the slot's context limit.
        building = [p for p, _, _ in owners if isinstance(p, Pool)]
        if building:
            self.polykv.fail_build(building[-1], msg)
            return
        prompts = [s for s, _, _ in owners if s.state is SlotState.PROMPT]
        if not prompts:
            victim = max((s for s, _, _ in owners), key=lambda s: s.t_start)
            log.warning("KV cache full: slot %d stops generating (truncated): %s", victim.id, msg)
            victim.finish("limit", truncated=True)
            return
        victim = max(prompts, key=lambda s: s.t_start)
        log.warning("KV cache full: slot %d's prompt fails (503): %s", victim.id, msg)
        victim.handle.push(ErrorEvent(503, "unavailable_error", msg))
        victim.state = SlotState.IDLE
        victim.handle = None
        self._forget_kv(victim)  # a pooled victim leaves its pool (a released one can be reclaimed)

    def _postprocess(self, ub: UBatch, owners, logits, argmax: bool = False) -> None:
        """Feed each slot its ubatch rows and sample where it needs a token: ``logits`` float32
        ``[n_out, n_vocab]``, or with ``argmax`` (``_argmax_step``) the runner's
        ``(ids, max)`` per out row."""
        row_of = {int(r): i for i, r in enumerate(ub.out_rows)}
        tok = self.model.tokenizer
        for s, start, n in owners:
            if isinstance(s, Pool):
                self.polykv.on_built(s, n)
                continue
            fed = ub.tokens[start:start + n].tolist()
            s.cache_tokens.extend(fed)
            s.n_past += n
            if s.state is SlotState.PROMPT and s.handle.request.return_progress:
                s.handle.push(s.progress())
            last = start + n - 1
            if last not in row_of:
                continue  # a prompt chunk that is not the prompt's end
            s.state = SlotState.GENERATING
            if s.handle.request.n_predict == 0:
                s.finish("limit")
                continue
            r = row_of[last]
            try:
                if argmax:  # no n_probs, so lg is not needed below
                    token, post = s.sampler.take_argmax(int(logits[0][r]), float(logits[1][r])), None
                else:
                    lg = logits[r]
                    token = s.sampler.sample(lg)
                    post = (post_sampling_top(s.sampler, lg, token, s.handle.request.sampling.n_probs)
                            if s.handle.request.post_sampling_probs and s.handle.request.sampling.n_probs > 0
                            else None)  # -- post_sampling_probs: read before accept --
                s.sampler.accept(token)  # also advances the grammar
            except (GrammarError, SamplingParamsError) as e:  # the request's input: fails it only, 400
                what = "grammar" if isinstance(e, GrammarError) else "sampling"
                s.handle.push(ErrorEvent(400, "invalid_request_error", f"{what}: {e}"))
                s.state, s.handle, s.pending = SlotState.IDLE, None, None
                continue
            except Exception as e:  # a sampler failure fails this request only, never the others
                log.exception("sampling failed")
                s.handle.push(ErrorEvent(500, "server_error", f"sampling failed: {type(e).__name__}: {e}"))
                s.state, s.handle, s.pending = SlotState.IDLE, None, None
                continue
            logprob = top = None
            n_probs = s.handle.request.sampling.n_probs
            if n_probs > 0:
                ids, lps = top_logprobs(lg, n_probs) if post is None else post[:2]
                top = [TokenProb(int(i), float(lp), tok.token_to_piece(int(i)).decode("utf-8", "replace"))
                       for i, lp in zip(ids, lps)]
                logprob = token_logprob(lg, token) if post is None else post[2]
            if s.on_token(token, tok.is_eog(token), logprob, top) is None and s.context_full:
                if self.params.ctx_shift and s.handle.request.n_predict != -2 and not s.n_shared:
                    self._context_shift(s)
                else:
                    s.finish("limit", truncated=True)

    def _context_shift(self, s: Slot) -> None:
        """Drop the oldest non-kept tokens of a full slot (llama.cpp server's context
        shift): keep ``n_keep`` (+BOS), discard ``n_discard`` (default half of the
        rest), shift the remainder's positions down and re-rotate their K."""
        req = s.handle.request
        n_keep = len(s.prompt) if req.n_keep < 0 else req.n_keep + int(self.model.tokenizer.add_bos)
        n_keep = max(0, min(n_keep, s.n_past - 1))
        n_left = s.n_past - n_keep
        n_discard = req.n_discard if req.n_discard > 0 else n_left // 2
        n_discard = min(n_discard, n_left)
        if n_discard <= 0:
            s.finish("limit", truncated=True)
            return
        self.runner.kv.seq_rm(s.seq_id, n_keep, n_keep + n_discard)
        self.runner.seq_add(s.seq_id, n_keep + n_discard, s.n_past, -n_discard)
        del s.cache_tokens[n_keep:n_keep + n_discard]
        s.n_past -= n_discard
        s.truncated = True

