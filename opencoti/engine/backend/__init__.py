"""Backend registry: creator functions that import inside the function, so a
machine without CuPy or Vulkan imports cleanly (STYLE lesson 3)."""

from __future__ import annotations


def _cpu():
    from opencoti.engine.backend.cpu import CPUBackend

    return CPUBackend()


BACKENDS = {"cpu": _cpu}
_instances: dict = {}


def get_backend(backend=None):
    """A backend object: pass one through, or build by name (None -> "cpu").
    Raises ``ValueError`` for an unknown name."""
    if backend is None:
        backend = "cpu"
    if not isinstance(backend, str):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (available: {', '.join(BACKENDS)})")
    if backend not in _instances:
        _instances[backend] = BACKENDS[backend]()
    return _instances[backend]
