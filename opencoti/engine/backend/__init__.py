"""Backend registry: creator functions that import inside the function, so a
machine without CuPy or Vulkan imports cleanly (STYLE lesson 3).

``select_backend`` turns the CLI's ``--gpu`` / ``-ngl`` / ``--main-gpu`` into a
backend (llamafile's ``--gpu {auto,nvidia,...}``): ``auto`` tries CUDA, then
Vulkan (a GPU, not a CPU software driver), then falls back to the CPU, saying
which it chose on stderr.
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


def _vulkan(device: int = 0):
    from opencoti.engine.backend.vulkan import VulkanBackend

    return VulkanBackend(device)


BACKENDS = {"cpu": _cpu, "cuda": _cuda, "vulkan": _vulkan}
VULKAN_ALIASES = ("vulkan", "vk", "amd", "intel")  # --gpu values served by the Vulkan backend
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
    ``vulkan`` (``vk``, ``amd``, ``intel``) -> Vulkan device ``main_gpu`` (GPUs first,
    then CPU devices such as Mesa's lavapipe) or ``BackendUnavailable``.
    ``auto`` -> CUDA when it works, else a Vulkan GPU, else CPU: a Vulkan device
    that is itself a CPU (lavapipe, SwiftShader) is passed over, because the NumPy
    backend is faster on the same cores. Any ``-ngl`` other than 0 answers the GPU
    backend; a partial ``-ngl`` (``0 < N <= n_layer``) is applied by ``ModelRunner``,
    which splits the layers (``offload.make_split``). ``apple`` has no backend
    (``BackendUnavailable``). The decision for ``auto`` is written to ``log``
    (default stderr).
    """
    gpu = (gpu or "auto").lower()
    if gpu == "disable" or n_gpu_layers == 0:
        return get_backend("cpu")
    if gpu == "nvidia":
        return get_backend("cuda", main_gpu)
    if gpu in VULKAN_ALIASES:
        b = get_backend("vulkan", main_gpu)
        _say(f"opencoti: --gpu {gpu}: using Vulkan device {main_gpu} ({b.device_name})", log)
        return b
    if gpu == "auto":
        try:
            b = get_backend("cuda", main_gpu)
        except BackendUnavailable as e:
            why_cuda = str(e)
        else:
            _say(f"opencoti: --gpu auto: using CUDA device {main_gpu} ({b.device_name})", log)
            return b
        try:
            b = _auto_vulkan(main_gpu)
        except BackendUnavailable as e:
            _say(f"opencoti: --gpu auto: using the CPU ({why_cuda}; Vulkan: {e})", log)
            return get_backend("cpu")
        _say(f"opencoti: --gpu auto: using Vulkan device {main_gpu} ({b.device_name})", log)
        return b
    raise BackendUnavailable(f"--gpu {gpu}: no such backend in this build "
                             f"(available: auto, nvidia, {', '.join(VULKAN_ALIASES)}, disable)")


def _auto_vulkan(main_gpu: int):
    """The Vulkan backend on device ``main_gpu`` if that device is a GPU; raises
    ``BackendUnavailable`` (saying why) otherwise."""
    from opencoti.engine.backend.vk_runtime import describe, list_devices

    devs = list_devices()
    if not devs:
        raise BackendUnavailable("no Vulkan device")
    if not 0 <= main_gpu < len(devs):
        raise BackendUnavailable(f"--main-gpu {main_gpu} out of range: {len(devs)} Vulkan device(s)")
    if devs[main_gpu].is_cpu:
        raise BackendUnavailable(f"only a CPU Vulkan driver ({describe(devs[main_gpu])}); "
                                 "--gpu vulkan uses it anyway")
    return get_backend("vulkan", main_gpu)
