"""Every CUDA module the backend builds compiles under NVRTC 12.0, the oldest runtime compiler
cupy-cuda12x runs with (the ``cuda`` extra), for sm_80 (A100) and sm_90 (H100 / H200). No GPU
needed: NVRTC is a host library; the dev extra installs ``nvidia-cuda-nvrtc-cu12==12.0.76``
(23 MB, Linux x86_64). The GPU runs use the device's own NVRTC (13.0 with cupy-cuda13x); a
kernel that needs a newer PTX feature than CUDA 12.0 has, or NVRTC-12-only syntax trouble,
fails here first.

Each compile uses the backend's exact source (``cuda_kernels.read_source`` / ``cuda_kv``) and
options (``cuda_kernels.OPTIONS`` plus ``--gpu-architecture=sm_XY``, as ``_compile_cubin``); the
CUBIN (an ELF file: one ``.text.<kernel>`` section per kernel) must hold the module's kernel
count and the kernels a decode step launches (names as ncu lists them on the H200).
"""

from __future__ import annotations

import ctypes
import importlib.util
import locale
import platform
import struct
from pathlib import Path

import pytest

from opencoti.engine.backend import cuda_kernels, cuda_kv
from opencoti.engine.kv_tiers import TIER_NAMES

# module -> (kernels in its CUBIN, some it must hold): gemma-3 / Qwen2.5 decode kernels
MODULES = {
    "kernels.cu": (167, {"rope_kv_write", "rms_norm", "post_norm_add_norm", "gemv1r8_8", "gemv_gated_6", "gemv1_6",
                         "get_rows_8", "get_rows_t16_12", "dequant_f16_t16_14"}),
    "attention.cu": ({80: 34, 90: 36}, {"attn_partial_d256_g1", "attn_partial_d256_g1_l8", "attn_stream_d128", "attn_stream_d128_h16",
                          "attn_merge_digits"}),
    "gemv_int.cu": (77, {"gemvi_12_n1_s2_r2_t16", "gemvi_14_n1_s2_t16", "gemvi_duo_12r2_14r1_t16", "xq_digits"}),
    "mmq.cu": (14, {"mmq_12", "mmq_14", "mmq_reduce"}),
    "shared_prefix.cu": (6, {"sp_attn_d128", "sp_attn_d256", "sp_merge_digits"}),
    "recurrent.cu": (5, {"ssm_conv", "gated_delta_net_r1"}),
    "kv_write": (98, {"kv_quant_KQ8_0", "kv_quant_KIQ4_NL", "kv_dequant_KQ4_1_d64", "kv_quant_KTurbo3_d128",
                      "kv_dequant_KQ4_0_d256"}),
}
# sm_90 only (thread-block clusters): module -> kernels
SM90_KERNELS = {"attention.cu": {"attn_merge_c", "attn_merge_digits_c"}}
TIER_KERNELS = {"attn_kv_stream"} | {f"attn_kv_g{g}{lanes}" for g in (1, 2, 4) for lanes in ("", "_l", "_l8")}


def kernel_names(cubin: bytes) -> set:
    """Kernel names of an ELF64 CUBIN: its ``.text.<name>`` sections."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    strtab = struct.unpack_from("<IIQQQ", cubin, shoff + shstrndx * shentsize)[4]
    names = set()
    for i in range(shnum):
        at = strtab + struct.unpack_from("<I", cubin, shoff + i * shentsize)[0]
        name = cubin[at:cubin.index(b"\0", at)].decode()
        if name.startswith(".text."):
            names.add(name[6:])
    return names


def _nvrtc12_path() -> Path:
    try:  # a dotted name imports its parent: no ``nvidia`` package at all raises
        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        if platform.system() == "Linux" and platform.machine() == "x86_64":
            pytest.fail("nvidia-cuda-nvrtc-cu12 is not installed: pip install '.[dev]'")
        pytest.skip("nvidia-cuda-nvrtc-cu12 has wheels for Linux x86_64 only")
    return Path(list(spec.submodule_search_locations)[0]) / "lib" / "libnvrtc.so.12"


@pytest.fixture(scope="module")
def nvrtc12():
    lib = ctypes.CDLL(str(_nvrtc12_path()))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _compile(lib, src: str, name: str, arch: int) -> bytes:
    """CUBIN of ``src`` compiled by ``lib`` (NVRTC's C API) with the backend's options; raises
    ``AssertionError`` with NVRTC's log when the compile fails."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    try:
        opts = [o.encode() for o in cuda_kernels.OPTIONS] + [f"--gpu-architecture=sm_{arch}".encode()]
        with cuda_kernels.thread_locale_kept():  # as _compile_cubin: NVRTC 12.0 resets it
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, f"{name} sm_{arch}: {lib.nvrtcGetErrorString(rc).decode()}\n{log.value.decode()[-3000:]}"
        size = ctypes.c_size_t()
        assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0
        cubin = ctypes.create_string_buffer(size.value)
        assert lib.nvrtcGetCUBIN(prog, cubin) == 0
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _kernels(lib, src: str, name: str, arch: int) -> set:
    cubin = _compile(lib, src, name, arch)
    assert cubin[:4] == b"\x7fELF", name
    return kernel_names(cubin)


def test_compile_keeps_the_thread_locale(nvrtc12):
    """NVRTC 12.0 leaves the compiling thread on a "C" locale (``open()``'s default encoding then
    reads ASCII); ``cuda_kernels.thread_locale_kept``, around every compile of the backend, gives
    the thread its locale back."""
    src, opts = b'extern "C" __global__ void k() {}', (ctypes.c_char_p * 1)(b"--gpu-architecture=sm_90")
    before = locale.getpreferredencoding(False)
    prog = ctypes.c_void_p()
    assert nvrtc12.nvrtcCreateProgram(ctypes.byref(prog), src, b"k", 0, None, None) == 0
    try:
        with cuda_kernels.thread_locale_kept():
            assert nvrtc12.nvrtcCompileProgram(prog, 1, opts) == 0
            changed = locale.getpreferredencoding(False)  # inside the guard: NVRTC's locale
    finally:
        nvrtc12.nvrtcDestroyProgram(ctypes.byref(prog))
    assert locale.getpreferredencoding(False) == before
    if before.upper().replace("-", "") == "UTF8":
        assert changed != before  # NVRTC 12.0's behaviour, which the guard undoes
    _compile(nvrtc12, src.decode(), "k", 90)
    assert locale.getpreferredencoding(False) == before


def test_nvrtc12_is_the_oldest_cuda12(nvrtc12):
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert nvrtc12.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
    assert (major.value, minor.value) == (12, 0)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("module", list(MODULES))
def test_module_compiles_nvrtc12(nvrtc12, module, arch):
    src = cuda_kv.write_source() if module == "kv_write" else cuda_kernels.read_source(module)
    got = _kernels(nvrtc12, src, module, arch)
    count, some = MODULES[module]
    count = count[arch] if isinstance(count, dict) else count
    sm90 = SM90_KERNELS.get(module, set())
    assert len(got) == count, (module, arch, len(got))
    want = some | (sm90 if arch >= 90 else set())
    assert want <= got, (module, arch, sorted(want - got))
    assert not (arch < 90 and sm90 & got), (module, arch)


@pytest.mark.parametrize("name", TIER_NAMES)
def test_tier_attention_compiles_nvrtc12(nvrtc12, name):
    """Each KV tier's attention module (the tier for K and V), at a head size that rotates over
    the four the tier kernels are built for, sm_90."""
    d = cuda_kv.KV_HEAD_DIMS[TIER_NAMES.index(name) % len(cuda_kv.KV_HEAD_DIMS)]
    got = _kernels(nvrtc12, cuda_kv.attention_source(name, name, d), f"attn_{name}_{name}_d{d}", 90)
    assert TIER_KERNELS <= got, (name, d, sorted(TIER_KERNELS - got))


@pytest.mark.parametrize("tk,tv,d,arch", [("q8_0", "q8_0", 256, 90), ("q8_0", "turbo3", 256, 80),
                                          ("q4_0", "f16", 128, 80), ("turbo2_tcq", "q5_1", 512, 90)])
def test_tier_pair_compiles_nvrtc12(nvrtc12, tk, tv, d, arch):
    """Mixed K / V tiers, sm_80 and the gemma head size 256 (which the rotation above gives no
    scalar tier)."""
    got = _kernels(nvrtc12, cuda_kv.attention_source(tk, tv, d), f"attn_{tk}_{tv}_d{d}", arch)
    assert TIER_KERNELS <= got, (tk, tv, d, arch, sorted(TIER_KERNELS - got))


@pytest.mark.parametrize("tk,tv,d,arch", [("q8_0", "q8_0", 128, 90), ("q4_0", "turbo3", 256, 80),
                                          ("turbo2", "turbo4", 64, 90), ("f32", "bf16", 512, 80),
                                          ("q5_1", "q6_0", 128, 80), ("turbo8", "q5_0", 128, 90)])
def test_rope_store_compiles_nvrtc12(nvrtc12, tk, tv, d, arch):
    """The fused rope + KV store module of a tier pair (rope_store.cu, cuda_kv.rope_store_source):
    exactly its one kernel, for scalar, float and rotated tiers and mixed pairs."""
    got = _kernels(nvrtc12, cuda_kv.rope_store_source(tk, tv, d), f"rope_store_{tk}_{tv}_d{d}", arch)
    assert got == {"rope_kv_write_q"}, (tk, tv, d, arch, sorted(got))
