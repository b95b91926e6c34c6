"""Backend registry: creator functions that import inside the function, so a
machine without CuPy or Vulkan imports cleanly (STYLE lesson 3).

``select_backend`` turns the CLI's ``--gpu`` / ``-ngl`` / ``--main-gpu`` into a
backend (llamafile's ``--gpu {auto,nvidia,...}``): ``auto`` tries CUDA and
falls back to the CPU, saying which it chose on stderr.
"""

from __future__ import annotations

import sys


class BackendUnavailable(RuntimeError):
    """A requested backend cannot run here (library or device missing); the message says why."""


def _cpu(device: int = 0):
    from opencoti.engine.backend.cpu import CPUBackend

    return CPUBackend()


def _cuda(device: int = 0):
    try:
        import cupy
    except ImportError:
        raise BackendUnavailable("CUDA backend needs CuPy: pip install cupy-cuda12x (or cupy-cuda13x)") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # driver missing / no device: CuPy raises CUDARuntimeError
        raise BackendUnavailable(f"no usable CUDA device ({type(e).__name__}: {e})") from None
    if n == 0:
        raise BackendUnavailable("no CUDA device found")
    if not 0 <= device < n:
        raise BackendUnavailable(f"--main-gpu {device} out of range: {n} CUDA device(s)")
    from opencoti.engine.backend.cuda import CUDABackend

    return CUDABackend(device)


BACKENDS = {"cpu": _cpu, "cuda": _cuda}
_instances: dict = {}


def get_backend(backend=None, device: int = 0):
    """A backend object: pass one through, or build by name (None -> "cpu"), one
    instance per (name, device). Raises ``ValueError`` for an unknown name and
    ``BackendUnavailable`` when it cannot run here."""
    if backend is None:
        backend = "cpu"
    if not isinstance(backend, str):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (available: {', '.join(BACKENDS)})")
    key = (backend, device)
    if key not in _instances:
        _instances[key] = BACKENDS[backend](device)
    return _instances[key]


_said: set = set()


def _say(msg: str, log=None) -> None:
    """Print a backend decision once per process."""
    if msg not in _said:
        _said.add(msg)
        print(msg, file=log or sys.stderr)


def select_backend(gpu: str = "auto", n_gpu_layers: int = -1, main_gpu: int = 0, log=None):
    """The backend for ``--gpu`` / ``-ngl``.

    ``disable`` or ``-ngl 0`` -> CPU. ``nvidia`` -> CUDA or ``BackendUnavailable``.
    ``auto`` -> CUDA when it works, else CPU. ``-ngl`` is all-or-nothing for now:
    any value other than 0 offloads every layer. ``vulkan``/``amd``/``apple``
    have no backend yet (``BackendUnavailable``). The decision for ``auto`` is
    written to ``log`` (default stderr).
    """
    gpu = (gpu or "auto").lower()
    if gpu == "disable" or n_gpu_layers == 0:
        return get_backend("cpu")
    if gpu == "nvidia":
        return get_backend("cuda", main_gpu)
    if gpu == "auto":
        try:
            b = get_backend("cuda", main_gpu)
        except BackendUnavailable as e:
            _say(f"opencoti: --gpu auto: using the CPU ({e})", log)
            return get_backend("cpu")
        _say(f"opencoti: --gpu auto: using CUDA device {main_gpu} ({b.device_name})", log)
        return b
    raise BackendUnavailable(f"--gpu {gpu}: no such backend in this build (available: auto, nvidia, disable)")
