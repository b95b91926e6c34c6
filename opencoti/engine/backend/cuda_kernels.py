"""CUDA kernel build and cache: NVRTC through CuPy, cubins cached per build.

The sources live in ``opencoti/cuda_src/*.cu`` (read with ``importlib.resources``
so they also load from inside a .pyz). A module's source has its local
``#include "x.cuh"`` lines inlined, then is compiled by NVRTC for the
device's exact architecture (``sm_XY``, machine code, no PTX JIT at start)
and written to ``cache_dir()/cuda/<module>-sm_XY-<hash>.cubin``. The hash
covers the source, the options and NVRTC's version, so a second start loads
the cubin and compiles nothing; a changed kernel gets a new file. A progress
line goes to stderr while compiling (llamafile prints one too).

If the low-level NVRTC binding is unavailable, ``cupy.RawModule(code=...)``
compiles instead, with CuPy's own kernel cache pointed at
``cache_dir()/cupy``.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from importlib import resources

OPTIONS = ("-std=c++17", "--use_fast_math")
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)


def read_source(name: str) -> str:
    """Source of ``opencoti/cuda_src/<name>`` with local includes inlined (once each)."""
    seen: set[str] = set()

    def load(n: str) -> str:
        text = resources.files("opencoti.cuda_src").joinpath(n).read_text()

        def sub(m):
            inc = m.group(1)
            if inc in seen:
                return ""
            seen.add(inc)
            return load(inc)

        return _INCLUDE.sub(sub, text)

    return load(name)


def _cache_root():
    from opencoti.version import cache_dir

    d = cache_dir() / "cuda"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _nvrtc_version() -> str:
    try:
        from cupy_backends.cuda.libs import nvrtc

        return "%d.%d" % nvrtc.getVersion()
    except Exception:  # pragma: no cover - depends on the CuPy build
        return "?"


def _compile_cubin(src: str, name: str, arch: str) -> bytes:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(src, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(OPTIONS) + [f"--gpu-architecture=sm_{arch}"])
        except Exception as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"CUDA kernel compile failed ({name}): {e}\n{log}") from None
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def load_module(name: str, quiet: bool = False):
    """``cupy.RawModule`` for ``cuda_src/<name>``, compiled on first use and cached.

    Raises ``RuntimeError`` with NVRTC's log when compilation fails.
    """
    import cupy

    src = read_source(name)
    cc = cupy.cuda.Device().compute_capability  # e.g. "90"
    key = hashlib.sha256("\0".join([src, " ".join(OPTIONS), cc, _nvrtc_version()]).encode()).hexdigest()[:16]
    path = _cache_root() / f"{name.rsplit('.', 1)[0]}-sm_{cc}-{key}.cubin"
    if path.exists():
        return cupy.RawModule(path=str(path))
    if not quiet:
        print(f"opencoti: compiling CUDA kernels {name} for sm_{cc} (first run only) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        cubin = _compile_cubin(src, name, cc)
    except ImportError:  # pragma: no cover - fall back to CuPy's compiler + cache
        os.environ.setdefault("CUPY_CACHE_DIR", str(_cache_root().parent / "cupy"))
        return cupy.RawModule(code=src, options=OPTIONS)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cubin)
    os.replace(tmp, path)  # atomic: a concurrent start sees the whole file or none
    if not quiet:
        print(f"opencoti: compiled {name} in {time.perf_counter() - t0:.1f} s -> {path}", file=sys.stderr, flush=True)
    return cupy.RawModule(path=str(path))
