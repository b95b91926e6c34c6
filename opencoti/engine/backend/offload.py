"""Partial GPU offload (``-ngl N`` / ``--n-gpu-layers N``): which backend runs which layer.

llama.cpp's layer placement (``llama_model::load_tensors``, ``src/llama-model.cpp``):
``i_gpu_start = max(n_layer - n_gpu_layers, 0)``; repeating layers ``il < i_gpu_start``
run on the CPU, the last ``n_gpu_layers`` on the GPU; the output layer (final norm and
vocabulary projection) is offloaded only when ``n_gpu_layers > n_layer``; the input layer
(token embeddings) always stays on the CPU. The boot line is llama.cpp's
``offloaded {min(N, n_layer + 1)}/{n_layer + 1} layers to GPU``.

(Newer llama.cpp counts the output layer as the first one offloaded:
``i_gpu_start = max(n_layer + 1 - N, 0)``. opencoti follows the older rule above, where
``-ngl n_layer`` puts every repeating layer on the GPU and the head on the CPU.)

A network built over a ``LayerSplit`` holds each layer's weights on that layer's backend,
the KV cache allocates each layer's K/V (and recurrent state) with that layer's backend, and
the forward moves the hidden state across each boundary with ``transfer`` (a host <-> device
copy, once per boundary per ubatch). ``-ngl -1`` (the default) and ``-ngl >= n_layer + 1``
build no split: the whole model on the GPU backend, as before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSplit:
    """A model's repeating layers split between the CPU backend and one GPU backend.

    Args:
        cpu: the CPU backend (input layer, layers ``[0, i_gpu_start)``, output unless
            ``n_gpu_layers > n_layer``).
        gpu: the GPU backend (layers ``[i_gpu_start, n_layer)``).
        n_layer: repeating layers of the model.
        n_gpu_layers: ``-ngl``, ``0 < n_gpu_layers <= n_layer`` (``make_split`` builds no
            split for the other values).
    """

    cpu: object
    gpu: object
    n_layer: int
    n_gpu_layers: int

    @property
    def i_gpu_start(self) -> int:
        """First layer on the GPU (llama.cpp ``i_gpu_start``)."""
        return max(self.n_layer - self.n_gpu_layers, 0)

    def layer(self, il: int):
        """The backend of repeating layer ``il`` (``0 <= il``; layers past ``n_layer``,
        e.g. MTP heads, go with the output)."""
        if il >= self.n_layer:
            return self.output
        return self.gpu if il >= self.i_gpu_start else self.cpu

    @property
    def input(self):
        """The backend of the token embeddings: the CPU, as in llama.cpp."""
        return self.cpu

    @property
    def output(self):
        """The backend of the final norm and vocabulary projection: the GPU only when
        ``n_gpu_layers > n_layer``."""
        return self.gpu if self.n_gpu_layers > self.n_layer else self.cpu

    @property
    def backends(self) -> tuple:
        """The distinct backends in use (CPU first)."""
        return (self.cpu, self.gpu)

    @property
    def name(self) -> str:
        """The GPU backend's name, so per-backend refusals at load (e.g. an architecture not
        supported on CUDA) still apply to a split."""
        return self.gpu.name

    @property
    def key(self) -> tuple:
        """Cache key of a network built over this split (``Model.network``)."""
        return (self.gpu.name, id(self.gpu), "ngl", self.n_gpu_layers)

    def describe(self) -> str:
        """llama.cpp's boot line: ``offloaded N/M layers to GPU`` (M = n_layer + 1, the output
        layer counted) plus where the layers run."""
        g0 = self.i_gpu_start
        cpu = f"layers 0-{g0 - 1} and " if g0 > 0 else ""
        return offload_message(self.n_layer, self.n_gpu_layers) + (
            f" (cpu: {cpu}token embeddings; {self.gpu.name}: layers {g0}-{self.n_layer - 1}; "
            f"output: {self.output.name})")


def offload_message(n_layer: int, n_gpu_layers: int) -> str:
    """``offloaded {min(n_gpu_layers, n_layer + 1)}/{n_layer + 1} layers to GPU``
    (``n_gpu_layers < 0`` means all; llama.cpp ``load_tensors``)."""
    n = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
    return f"offloaded {n}/{n_layer + 1} layers to GPU"


def make_split(backend, n_layer: int, n_gpu_layers: int):
    """The ``LayerSplit`` for ``-ngl n_gpu_layers`` on ``backend``, or None when one backend
    runs everything: a CPU backend, ``n_gpu_layers < 0`` (default: all) or
    ``n_gpu_layers > n_layer`` (all layers and the output; unchanged all-GPU path).
    ``n_gpu_layers == 0`` on a GPU backend raises ``ValueError`` (``select_backend``
    answers the CPU backend for it)."""
    if getattr(backend, "name", "cpu") == "cpu" or n_gpu_layers < 0 or n_gpu_layers > n_layer:
        return None
    if n_gpu_layers == 0:
        raise ValueError("-ngl 0 runs on the CPU backend (select_backend), not on a split")
    from opencoti.engine.backend import get_backend

    return LayerSplit(get_backend("cpu"), backend, n_layer, n_gpu_layers)


def transfer(x, src, dst):
    """Move activation ``x`` (float32, any shape) from backend ``src`` to backend ``dst``:
    ``src.to_host`` (a device -> host copy, waiting for the work that produced ``x``) then
    ``dst.asarray`` (host -> device). Returns ``x`` itself when ``src is dst``."""
    if src is dst:
        return x
    return dst.asarray(src.to_host(x))
