"""The shape bookkeeping of a 3-D GGUF expert tensor ``[n_expert, rows, cols]`` kept on a
device in its block format, shared by the CUDA and Vulkan backends' ``QExperts`` (which
add where the bytes live: one CuPy array, or Vulkan buffer parts)."""

from __future__ import annotations

import copy


class ExpertRows:
    """``ggml_type``; ``shape`` ``(n_expert, rows, cols)``: the rows this object covers inside
    each expert, starting at row ``row0`` (a row slice such as a fused ``gate_up``'s gate half
    shares the bytes); ``row_bytes``: bytes of one row; ``expert_bytes``: bytes from one
    expert to the next (a whole expert, all its rows)."""

    def __init__(self, ggml_type: int, shape, row_bytes: int, expert_bytes: int, row0: int = 0):
        self.ggml_type = int(ggml_type)
        self.shape = tuple(int(v) for v in shape)
        self.row_bytes = int(row_bytes)
        self.expert_bytes = int(expert_bytes)
        self.row0 = int(row0)

    def row_slice(self, key):
        """``x[:, a:b]`` (step 1) as a view on the same bytes, or None when ``key`` is not
        of that form."""
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and isinstance(key[1], slice)
                and key[1].step in (None, 1)):
            return None
        n_exp, rows, cols = self.shape
        a, b, _ = key[1].indices(rows)
        view = copy.copy(self)
        view.shape = (n_exp, max(a, b) - a, cols)
        view.row0 = self.row0 + a
        return view
