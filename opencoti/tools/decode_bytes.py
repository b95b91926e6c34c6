"""Weight bytes a one-token decode step reads, and the tok/s bound they set.

A single-sequence decode step multiplies one activation row by every weight
matrix once, so at best it streams each weight's bytes from memory once:
the step time is at least ``bytes_per_token / bandwidth``. What a step touches:

- every tensor of the trunk in full (attention, dense FFN, shared experts,
  routers, norms, recurrent-layer weights, ``rope_freqs``), except:
- routed expert tensors (3-D, ``ne[2] == expert_count``): only the
  ``expert_used_count`` experts the router picks, i.e. ``n_used / n_expert``
  of the tensor (each expert's slice is ``n_bytes / n_expert``);
- ``token_embd`` (and ``per_layer_token_embd``): one row for the input token;
  when the output is tied to ``token_embd`` the output head reads all of it too;
- NextN / MTP blocks (``blk.{n}`` for n >= the trunk's layer count): not read
  by plain decoding.

KV-cache and recurrent-state reads are not counted (small at depth 0; add
``2 * n_ctx * n_embd_kv * bytes`` per attention layer for a deep context), nor
activations. The bound is ``bandwidth / bytes_per_token`` (H200: 4.8 TB/s
HBM3e, NVIDIA's data sheet). Used by ``bench/bench_cuda.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

H200_BW_TBS = 4.8


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes read per decoded token, by part (all ints, bytes).

    experts: the routed experts' share; embd_rows: input embedding row(s);
    output: the output head (all of ``token_embd`` when tied); other: the rest of
    the trunk; total: the sum. file_total: every tensor's bytes, for reference.
    """

    experts: int
    embd_rows: int
    output: int
    other: int
    file_total: int

    @property
    def total(self) -> int:
        return self.experts + self.embd_rows + self.output + self.other

    def bound_tok_s(self, bw_tb_s: float = H200_BW_TBS) -> float:
        """tok/s at which reading ``total`` bytes per token takes all of ``bw_tb_s`` TB/s (1e12 B/s)."""
        return bw_tb_s * 1e12 / self.total


def decode_bytes(tensors: Iterable[tuple[str, tuple[int, ...], int]], n_expert: int = 0, n_expert_used: int = 0,
                 n_layer: int | None = None) -> DecodeBytes:
    """Bytes one decode step reads, from ``(name, ne, n_bytes)`` of every tensor
    (GGUF ``ne`` order: ``ne[0]`` = row length). ``n_expert`` / ``n_expert_used``:
    the model's ``expert_count`` / ``expert_used_count`` (0: dense); ``n_layer``:
    the trunk's layer count (blocks at or above it are NextN/MTP and skipped; None:
    keep all). Raises ``ValueError`` for ``n_expert_used`` outside ``1..n_expert``
    on a model with experts."""
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise ValueError(f"expert_used_count {n_expert_used} out of range 1..{n_expert}")
    tensors = list(tensors)
    names = {n for n, _, _ in tensors}
    tied = "output.weight" not in names
    experts = embd = output = other = total = 0
    for name, ne, nb in tensors:
        total += nb
        if n_layer is not None and name.startswith("blk.") and int(name.split(".")[1]) >= n_layer:
            continue
        if name in ("token_embd.weight", "per_layer_token_embd.weight"):
            rows = int(np.prod(ne[1:]))
            embd += nb // rows
            if tied and name == "token_embd.weight":
                output += nb
        elif name == "output.weight":
            output += nb
        elif n_expert > 1 and len(ne) == 3 and ne[2] == n_expert:
            experts += nb // n_expert * n_expert_used
        else:
            other += nb
    return DecodeBytes(experts, embd, output, other, total)


def gguf_decode_bytes(g) -> DecodeBytes:
    """``decode_bytes`` of an open ``GGUFFile`` (``opencoti.model.gguf_file``), with
    the expert counts and trunk depth from its ``<arch>.*`` metadata."""
    md = g.metadata
    a = md.get("general.architecture", "")
    n_exp = int(md.get(f"{a}.expert_count", 0) or 0)
    n_used = int(md.get(f"{a}.expert_used_count", 0) or 0)
    n_layer = md.get(f"{a}.block_count")
    if n_layer is not None:
        n_layer = int(n_layer) - int(md.get(f"{a}.nextn_predict_layers", 0) or 0)
    return decode_bytes(((n, tuple(int(x) for x in t.ne), int(t.n_bytes)) for n, t in g.tensors.items()),
                        n_exp, n_used, n_layer)
