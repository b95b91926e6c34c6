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

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import sys
import time
from importlib import resources

# OPENCOTI_CUDA_PDL_EARLY=0 builds the kernels with OPENCOTI_PDL_EARLY 0 (pdl.cuh): a kernel's
# dependents launch only as it completes (as gemv_int.cu's gemmi's always do), and gemvi_ring
# fetches its weights after its wait, as before the early trigger
PDL_EARLY = os.environ.get("OPENCOTI_CUDA_PDL_EARLY", "1") != "0"
OPTIONS = ("-std=c++17", "--use_fast_math") + (() if PDL_EARLY else ("-DOPENCOTI_PDL_EARLY=0",))
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)


def read_source(name: str) -> str:
    """Source of ``opencoti/cuda_src/<name>`` with local includes inlined (once each)."""
    seen: set[str] = set()

    def load(n: str) -> str:
        text = resources.files("opencoti.cuda_src").joinpath(n).read_text(encoding="utf-8")

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


@contextlib.contextmanager
def thread_locale_kept():
    """Give the calling thread its C locale back after the block (glibc / BSD ``uselocale``;
    elsewhere a no-op). NVRTC 12.0's ``nvrtcCompileProgram`` leaves the thread on a "C" locale
    of its own, after which ``locale.getpreferredencoding()`` -- the default encoding of
    ``open()`` -- reads ASCII and UTF-8 text files fail to load (tests/test_cuda_nvrtc12.py
    found it; NVRTC 12.9 leaves the locale alone)."""
    try:
        use = ctypes.CDLL(None).uselocale
    except (OSError, AttributeError):  # pragma: no cover - no uselocale in this libc
        yield
        return
    use.restype, use.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    saved = use(None)
    try:
        yield
    finally:
        use(saved)


def _compile_cubin(src: str, name: str, arch: str) -> bytes:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(src, name, [], [])
    try:
        try:
            with thread_locale_kept():
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
    return load_source(read_source(name), name.rsplit(".", 1)[0], quiet)


def load_source(src: str, tag: str, quiet: bool = False):
    """``cupy.RawModule`` for the CUDA source text ``src`` (a generated module, e.g. a KV tier
    pair's attention kernels, ``cuda_kv.py``), cached as ``<tag>-sm_XY-<hash>.cubin`` like
    ``load_module``. Raises ``RuntimeError`` with NVRTC's log when compilation fails."""
    import cupy

    cc = cupy.cuda.Device().compute_capability  # e.g. "90"
    key = hashlib.sha256("\0".join([src, " ".join(OPTIONS), cc, _nvrtc_version()]).encode()).hexdigest()[:16]
    path = _cache_root() / f"{tag}-sm_{cc}-{key}.cubin"
    if path.exists():
        return cupy.RawModule(path=str(path))
    if not quiet:
        print(f"opencoti: compiling CUDA kernels {tag} for sm_{cc} (first run only) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        cubin = _compile_cubin(src, tag, cc)
    except ImportError:  # pragma: no cover - fall back to CuPy's compiler + cache
        os.environ.setdefault("CUPY_CACHE_DIR", str(_cache_root().parent / "cupy"))
        return cupy.RawModule(code=src, options=OPTIONS)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cubin)
    os.replace(tmp, path)  # atomic: a concurrent start sees the whole file or none
    if not quiet:
        print(f"opencoti: compiled {tag} in {time.perf_counter() - t0:.1f} s -> {path}", file=sys.stderr, flush=True)
    return cupy.RawModule(path=str(path))


# -- launches ------------------------------------------------------------------------------
# OPENCOTI_CUDA_PDL=0 turns programmatic dependent launch off (Kernel below)
PDL = os.environ.get("OPENCOTI_CUDA_PDL", "1") != "0"
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


def _driver_launch_ex():
    """``cuLaunchKernelEx`` of the CUDA driver (12.0+) with its ctypes structures, or None
    when the driver lacks it."""
    import ctypes

    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None

    class Attr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("val", ctypes.c_int * 16)]

    class Config(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attr)), ("n_attrs", ctypes.c_uint)]

    fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    attr = Attr()
    attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.val[0] = 1  # programmaticStreamSerializationAllowed
    scalars = {"int8": ctypes.c_int8, "uint8": ctypes.c_uint8, "int16": ctypes.c_int16, "uint16": ctypes.c_uint16,
               "int32": ctypes.c_int32, "uint32": ctypes.c_uint32, "int64": ctypes.c_int64,
               "uint64": ctypes.c_uint64, "float32": ctypes.c_float, "float64": ctypes.c_double}
    return fn, Config, ctypes.pointer(attr), scalars


_LAUNCH_EX = None


class Kernel:
    """A compiled kernel (``cupy.RawKernel``), called like one: ``k(grid, block, args,
    shared_mem=0)`` with ``args`` CuPy arrays (passed as pointers) and NumPy scalars.

    While ``pdl()`` is true (the CUDA backend captures a decode graph on sm_90+) the launch goes
    through ``cuLaunchKernelEx`` with programmatic stream serialization (PDL): the kernel's
    blocks may start while the previous kernel in the stream finishes, and its leading
    ``GRID_DEP_WAIT()`` (cuda_src/pdl.cuh) holds them until that kernel's writes are visible.
    Every kernel of opencoti/cuda_src starts with that wait (but gemvi_ring, which fetches its
    constant weights first; test_cuda_sources). Other launches, and any argument
    of another type, take CuPy's launch."""

    __slots__ = ("raw", "_pdl", "_n_params")

    def __init__(self, raw, pdl):
        self.raw = raw
        self._pdl = pdl  # () -> bool
        self._n_params = kernel_param_count(raw.kernel.ptr)  # None: the driver cannot say

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int) -> None:
        if hasattr(self.raw, "max_dynamic_shared_size_bytes"):
            self.raw.max_dynamic_shared_size_bytes = n
        else:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            import cupy

            cupy.cuda.driver.funcSetAttribute(self.raw.kernel.ptr, 8, n)

    def __call__(self, grid, block, args, shared_mem: int = 0):
        if self._n_params is not None and len(args) != self._n_params:
            # the driver reads as many argument pointers as the kernel has parameters: a short
            # list would launch on whatever lies past it (a crash, or worse, silent garbage)
            raise TypeError(f"{self.raw.name} takes {self._n_params} arguments, {len(args)} given")
        if not (self._pdl() and self._launch_pdl(grid, block, args, shared_mem)):
            self.raw(grid, block, args, shared_mem=shared_mem)

    def _launch_pdl(self, grid, block, args, shared_mem: int) -> bool:
        """Launch with the PDL attribute; False (nothing launched) when an argument is neither
        a CuPy array nor a NumPy scalar. ``RuntimeError`` when the driver refuses the launch."""
        import ctypes

        import cupy
        import numpy as np

        fn, Config, attr, scalars = _LAUNCH_EX
        vals = []
        for a in args:
            if isinstance(a, cupy.ndarray):
                vals.append(ctypes.c_void_p(a.data.ptr))
            elif isinstance(a, np.generic) and a.dtype.name in scalars:
                vals.append(scalars[a.dtype.name](a.item()))
            else:
                return False
        grid = (tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)) + (1, 1)
        block = (tuple(block) if isinstance(block, (tuple, list)) else (block,)) + (1, 1)
        cfg = Config((ctypes.c_uint * 3)(*grid[:3]), (ctypes.c_uint * 3)(*block[:3]), shared_mem,
                     cupy.cuda.get_current_stream().ptr, attr, 1)
        params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        rc = fn(ctypes.byref(cfg), self.raw.kernel.ptr, params, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx failed for {self.raw.name}: CUresult {rc}")
        return True


@functools.cache
def _driver_param_info():
    """The CUDA driver's ``cuFuncGetParamInfo`` (12.4+) with its ctypes signature, or None."""
    import ctypes

    try:
        fn = ctypes.CDLL("libcuda.so.1").cuFuncGetParamInfo
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    return fn


def kernel_param_count(func_ptr: int) -> int | None:
    """The number of parameters of the kernel ``func_ptr`` (a ``CUfunction``), read through the
    driver's ``cuFuncGetParamInfo`` (CUDA 12.4+; it fails past the last parameter); None when
    the driver lacks it."""
    import ctypes

    fn = _driver_param_info()
    if fn is None:
        return None
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    n = 0
    while n < 4096 and fn(func_ptr, n, ctypes.byref(offset), ctypes.byref(size)) == 0:
        n += 1
    return n if n else None


def pdl_supported(compute_capability: str, driver_version: int) -> bool:
    """Whether PDL launches are on: ``OPENCOTI_CUDA_PDL`` not 0, an sm_90+ device and a driver
    of CUDA 12.3+ (``driver_version`` as ``cudaDriverGetVersion``: stream capture records
    programmatic edges from 12.3) with ``cuLaunchKernelEx`` (loaded here once)."""
    global _LAUNCH_EX
    if not PDL or int(compute_capability) < 90 or driver_version < 12030:
        return False
    if _LAUNCH_EX is None:
        _LAUNCH_EX = _driver_launch_ex() or False
    return bool(_LAUNCH_EX)
