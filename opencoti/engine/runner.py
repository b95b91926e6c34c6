"""Model runner: the network on a backend plus its KV cache; runs ubatches.

The runner owns device state (weights, KV storage) for the engine thread.
``decode`` follows llama.cpp's plan-then-apply order (``llama-memory.h``):
cells are chosen first, and only a plan that fits is committed.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import numpy as np

from opencoti.engine.backend import get_backend
from opencoti.engine.backend.offload import make_split
from opencoti.engine.batch import StepResult, UBatch
from opencoti.engine.kv_cache import KVCacheSet
from opencoti.engine.sampling import rows_argmax


class ModelRunner:
    """Network + KV cache.

    Args:
        model: ``opencoti.model.loader.Model``.
        backend: a backend object or name ("cpu"); None -> CPU.
        n_ctx: KV cells (all streams together).
        n_seq_max: sequences (slots + pools).
        kv_unified: one shared stream (True) or one stream per sequence.
        n_ubatch: max tokens per forward (sizes the SWA cache).
        type_k, type_v: KV tiers of the two cache halves (``kv_tiers.TIER_NAMES``);
            type_k_tail, type_v_tail: the spilled tail's (None = the same).
        kv_policy: instead of ``type_k`` / ``type_v``, a function ``(hparams, n_ctx,
            n_seq_max, kv_unified, n_ubatch, backend) -> KVTierDecision`` called after the
            weights are loaded (``kv_auto_tier.decide_kv_types``); kept as ``kv_decision``.
        n_gpu_layers: ``-ngl``. On a GPU backend, ``0 < n_gpu_layers <= n_layer`` splits the
            model (``backend/offload.py``: the first ``n_layer - n_gpu_layers`` layers, the
            embeddings and the output on the CPU, each layer's weights and KV on its backend;
            kept as ``split``); -1 (default) or more than ``n_layer``: all on ``backend``.
    Raises ``ValueError`` for an unknown tier or one the backend cannot run.
    """

    def __init__(self, model, backend=None, n_ctx: int = 4096, n_seq_max: int = 1,
                 kv_unified: bool = True, n_ubatch: int = 512, type_k: str = "f16", type_v: str = "f16",
                 type_k_tail: Optional[str] = None, type_v_tail: Optional[str] = None,
                 kv_policy: Optional[Callable] = None, n_gpu_layers: int = -1):
        self.model = model
        self.backend = get_backend(backend)
        self.split = make_split(self.backend, model.hparams.n_layer, n_gpu_layers)  # None: one backend
        if kv_policy is None:
            check_kv_types(self.backend, type_k, type_v)
        self.net = model.network(self.split or self.backend)
        self.kv_decision = None
        if kv_policy is not None:  # decided once the weights hold their memory (auto-tier's budget)
            self.kv_decision = kv_policy(model.hparams, n_ctx, n_seq_max, kv_unified, n_ubatch, self.backend)
            type_k, type_v = self.kv_decision.type_k, self.kv_decision.type_v
            check_kv_types(self.backend, type_k, type_v)
        self.n_ubatch = n_ubatch
        self.graphs: dict = {}  # captured decode graphs (device backends), tied to this runner's KV
        zeros_for = (lambda il: self.net.layer_backend(il).zeros) if self.split is not None else None
        self.kv = KVCacheSet(model.hparams, n_ctx, n_seq_max, kv_unified, n_ubatch, type_k, type_v,
                             zeros=self.backend.zeros, type_k_tail=type_k_tail, type_v_tail=type_v_tail,
                             zeros_for=zeros_for, kv_ops=_kv_ops(self.backend),
                             kv_ops_for=(lambda il: _kv_ops(self.net.layer_backend(il))) if self.split else None)

    def decode(self, ub: UBatch, argmax: bool = False, on_launch=None):
        """Plan cells, commit, run the forward. Returns logits float32
        ``[len(ub.out_rows), n_vocab]``; with ``argmax``, ``rows_argmax`` of them instead
        (``(ids int64 [n_out], max float32 [n_out])``), reduced on the device where the backend
        can (``argmax_on_device``: the logits never cross to the host), ``ub.argmax_ban`` masked. Raises
        ``KVCacheFullError`` (nothing changed) when the cache has no room for the ubatch. A split
        (``-ngl``) runs eagerly: its GPU part is not captured as a graph (the hidden state leaves
        the device mid-step). ``on_launch``: called once the step's work is queued on the device
        (a replayed graph: before waiting for it; otherwise before the forward), e.g. the
        engine's delivery of the previous step's events."""
        ub.plans = self.kv.prepare(ub.seq_id, ub.pos)
        self.kv.apply(ub.plans, ub.seq_id, ub.pos, ub.share_src)
        return self._run(ub, argmax, on_launch)

    def _run(self, ub: UBatch, argmax: bool, on_launch):
        """``decode``'s forward of a committed ``ub``."""
        if self.split is None and getattr(self.backend, "graphs", False):  # device backends replay graphs
            fwd = lambda: self.net.forward(ub, self.kv)  # noqa: E731
            if argmax and getattr(self.backend, "argmax_on_device", False):
                return self.backend.run_graph(ub, self.kv.caches, fwd, self.graphs, argmax=True, on_launch=on_launch)
            logits = self.backend.run_graph(ub, self.kv.caches, fwd, self.graphs, on_launch=on_launch)
        else:
            if on_launch is not None:
                on_launch()
            logits = self.net.forward(ub, self.kv)
        return rows_argmax(logits, ub.argmax_ban) if argmax else logits

    @property
    def chains_steps(self) -> bool:
        """Whether ``launch`` queues a step without waiting and chains its tokens on the device
        (the backend replays graphs with ``async_argmax``; not under an ``-ngl`` split)."""
        be = self.backend
        return self.split is None and bool(getattr(be, "graphs", False)) and bool(getattr(be, "async_argmax", False))

    def launch(self, ub: UBatch, on_launch=None, after: Optional[StepResult] = None) -> StepResult:
        """``decode(ub, argmax=True)`` without waiting for the device: plan and commit the cells,
        queue the forward, and return its ``StepResult`` (``result()`` gives ``(ids int64
        [n_out], max float32 [n_out])`` as ``rows_argmax``). ``after``: a step launched before
        this one whose out rows, in order, give the token of every row of ``ub`` (``ub``'s rows
        are the next token of each of ``after``'s rows): on a backend that chains steps
        (``async_argmax``: the CUDA backend) the ids go from its argmax to this step's token
        buffer on the device, so this step is queued before ``after`` is read; elsewhere
        ``after.result()`` fills ``ub.tokens`` first. Either way the caller fills ``ub.tokens``
        with the real ids once it has read ``after`` (``Engine._run_ahead``). Raises
        ``KVCacheFullError`` (nothing changed) as ``decode``. vLLM's asynchronous scheduling
        overlaps the host's next step with the device the same way. A chained step prunes
        sliding-window cells one position late (``KVCacheSet.prepare``'s ``prune_pos``), so a
        rolled-back row leaves its window as ``after`` left it."""
        ub.plans = self.kv.prepare(ub.seq_id, ub.pos, None if after is None else ub.pos - 1)
        self.kv.apply(ub.plans, ub.seq_id, ub.pos, ub.share_src)
        if self.chains_steps:
            fwd = lambda: self.net.forward(ub, self.kv)  # noqa: E731
            return self.backend.run_graph(ub, self.kv.caches, fwd, self.graphs, argmax=True, on_launch=on_launch,
                                          wait=False, after=after)
        if after is not None:
            ub.tokens[:] = after.result()[0][:ub.n_tokens]
        return StepResult.done(self._run(ub, True, on_launch))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift a sequence's positions (llama.cpp ``llama_memory_seq_add``) and
        re-rotate the cached K of the moved cells so attention stays exact."""
        for cache, stream, shift in self.kv.seq_add(seq_id, p0, p1, delta):
            cells = np.nonzero(shift)[0]
            self.net.shift_k(cache, stream, cells, shift[cells])


def _kv_ops(backend):
    """``backend`` when it reads / requantizes quantized KV rows in its own memory
    (``kv_read`` / ``kv_store``: the CUDA backend), else None (the tiers' NumPy code)."""
    return backend if hasattr(backend, "kv_read") else None


def check_kv_types(backend, *types) -> None:
    """Raise ``ValueError`` when ``backend`` has no kernels for one of the KV tier names
    (``backend.kv_types``: a tuple, or None for every tier) or a name is unknown."""
    from opencoti.engine.kv_tiers import get_tier

    for t in types:
        name = get_tier(t).name
        allowed = getattr(backend, "kv_types", None)
        if allowed is not None and name not in allowed:
            raise ValueError(f"the {backend.name} backend does not support KV cache type {name} yet "
                             f"(supported there: {', '.join(allowed)}); use --gpu disable to run it on the CPU")


def iter_logits(runner: ModelRunner, tokens: list[int], seq_id: int = 0, pos0: int = 0
                ) -> Iterator[tuple[int, np.ndarray]]:
    """Feed ``tokens`` to sequence ``seq_id`` in ubatches of ``runner.n_ubatch``,
    yielding ``(first_row, logits [n_chunk, n_vocab])`` for every position."""
    for s in range(0, len(tokens), runner.n_ubatch):
        chunk = tokens[s:s + runner.n_ubatch]
        n = len(chunk)
        ub = UBatch.build(chunk, np.arange(pos0 + s, pos0 + s + n), [seq_id] * n, np.arange(n))
        yield s, runner.decode(ub)


def eval_logits(model, tokens: list[int], n_ubatch: int = 512, backend=None,
                n_ctx: Optional[int] = None, type_k: str = "f16", type_v: str = "f16") -> np.ndarray:
    """Logits for every position of ``tokens`` (fresh KV, one sequence):
    float32 ``[len(tokens), n_vocab]``; row i predicts token i+1. ``type_k`` /
    ``type_v`` pick the KV tier (f32 for exact-math comparisons)."""
    runner = ModelRunner(model, backend, n_ctx=n_ctx or max(256, len(tokens)), n_ubatch=n_ubatch,
                         type_k=type_k, type_v=type_v)
    return np.concatenate([lg for _, lg in iter_logits(runner, tokens)], axis=0)
