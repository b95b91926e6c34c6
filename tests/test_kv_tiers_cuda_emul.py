"""The CUDA KV-tier kernels' math, proven on the CPU (no GPU needed; the GPU tests are in
test_cuda.py, ``-k kv_tier``).

- ``tables_prefix`` carries the rotated tiers' tables into the CUDA source exactly.
- A NumPy port of each tier's single-value decoder ``val(row, i)`` in ``kv_tiers.cuh`` (the
  byte offsets, nibble/bit placement and the trellis window) equals the tier's own
  ``dequantize`` (``dequantize_rotated`` for the rotated tiers).
- The rotation trick of the attention kernel: rotate q by the butterfly WHT, score against
  the stored rotated rows, accumulate P.V rotated and un-rotate the output once; this equals
  ``CPUBackend.attention`` over the dequantized cells (float32 rounding apart).
- Where nvcc is installed, the KV modules compile for sm_90 (the write/read module and an
  attention module of each kind of tier pair).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from opencoti.engine.backend import cuda_kv
from opencoti.engine.backend.cpu import CPUBackend
from opencoti.engine.kv_tiers import TIER_NAMES, get_tier, turbo


def _consts(src: str) -> dict:
    out = {}
    for name, body in re.findall(r"__constant__ float (\w+)\[\d+\] = \{([^}]*)\}", src):
        out[name] = np.array([float.fromhex(v.strip()[:-1]) for v in body.split(",")], dtype=np.float32)
    return out


def test_tables_prefix_is_exact():
    src = cuda_kv.tables_prefix()
    c = _consts(src)
    for bits in (2, 3, 4, 8):
        t = get_tier(f"turbo{bits}")
        np.testing.assert_array_equal(c[f"KV_LM{bits}"], t.levels)
        np.testing.assert_array_equal(c[f"KV_TH{bits}"], t.thresholds)
    for k in (2, 3):
        np.testing.assert_array_equal(c[f"KV_TCQ{k}"], get_tier(f"turbo{k}_tcq").levels)
    words = re.search(r"KV_SIGNS\[16\] = \{([^}]*)\}", src).group(1)
    w = np.array([int(x.strip().rstrip("u"), 16) for x in words.split(",")], dtype=np.uint32)
    bits = (w[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_array_equal(np.where(bits.reshape(-1), -1.0, 1.0).astype(np.float32), turbo.SIGNS)
    for d in cuda_kv.KV_HEAD_DIMS:
        lit = re.search(rf"d == {d} \? (\S+)f", src).group(1)
        assert np.float32(float.fromhex(lit)) == np.float32(1.0 / np.sqrt(d))
    assert set(cuda_kv.TIER_STRUCTS) == set(TIER_NAMES)


def _h2f(b, o):
    return np.ascontiguousarray(b[:, o:o + 2]).view(np.float16)[:, 0].astype(np.float32)


def _val(t, b: np.ndarray, i: int) -> np.ndarray:
    """NumPy port of ``T::val(row, i, tab)`` (kv_tiers.cuh) over rows ``b`` uint8 ``[N, row]``."""
    n, j = t.name, i & 31
    b32 = b.astype(np.uint32)
    if n == "f32":
        return np.ascontiguousarray(b).view(np.float32)[:, i]
    if n == "f16":
        return np.ascontiguousarray(b).view(np.float16)[:, i].astype(np.float32)
    if n == "bf16":
        return (np.ascontiguousarray(b).view(np.uint16)[:, i].astype(np.uint32) << 16).view(np.float32)
    if n == "q8_0":
        o = 34 * (i >> 5)
        return _h2f(b, o) * b[:, o + 2 + j].view(np.int8).astype(np.float32)
    if n == "q6_0":
        o, jj = 26 * (i >> 5), j & 15
        qs, qhb = b32[:, o + 10 + jj], b32[:, o + 2 + (j & 7)]
        h = (qhb >> (4 * (jj >> 3))) & 15
        q = ((qs & 15) | ((h & 3) << 4)) if j < 16 else ((qs >> 4) | (((h >> 2) & 3) << 4))
        return _h2f(b, o) * (q.astype(np.float32) - 32)
    if n in ("q5_1", "q5_0", "q4_0"):
        o = {"q5_1": 24, "q5_0": 22, "q4_0": 18}[n] * (i >> 5)
        qs_at = {"q5_1": 8, "q5_0": 6, "q4_0": 2}[n]
        qs = b32[:, o + qs_at + (j & 15)]
        q = (qs & 15) if j < 16 else (qs >> 4)
        if n != "q4_0":
            qh_at = 4 if n == "q5_1" else 2
            q = q | (((b32[:, o + qh_at + (j >> 3)] >> (j & 7)) & 1) << 4)
        if n == "q5_1":
            return _h2f(b, o) * q.astype(np.float32) + _h2f(b, o + 2)
        return _h2f(b, o) * (q.astype(np.float32) - (16 if n == "q5_0" else 8))
    o, j = t.block_bytes * (i >> 6), i & 63
    if t.family == "turbo":
        bits = t.bits
        if bits == 8:
            idx = b32[:, o + 2 + j]
        elif bits == 4:
            idx = (b32[:, o + 2 + (j >> 1)] >> (4 * (j & 1))) & 15
        else:
            idx = (b32[:, o + 2 + (j >> 2)] >> (2 * (j & 3))) & 3
            if bits == 3:
                idx = idx | (((b32[:, o + 18 + (j >> 3)] >> (j & 7)) & 1) << 2)
        return _h2f(b, o) * t.levels[idx]
    k, nsb = t.k, 8 * t.k
    p = j * k
    s = (b32[:, o + 2 + (p >> 3)] | (b32[:, o + 2 + ((p >> 3) + 1) % nsb] << 8)) >> (p & 7)
    return _h2f(b, o) * t.levels[s & 255]


@pytest.mark.parametrize("name", TIER_NAMES)
def test_kernel_value_decoder_matches_tier(name):
    t = get_tier(name)
    rng = np.random.default_rng(3)
    d = 128
    x = rng.standard_normal((20, d)).astype(np.float32)
    x[3, 5] = 30.0
    q = t.quantize(x)
    b = np.ascontiguousarray(q).view(np.uint8).reshape(len(x), -1)
    got = np.stack([_val(t, b, i) for i in range(d)], axis=1)
    want = t.dequantize_rotated(q) if t.family in ("turbo", "tcq") else t.dequantize(q)
    np.testing.assert_array_equal(got, want)


def _fwht(v: np.ndarray, inverse: bool) -> np.ndarray:
    """``fwht_shared`` (kv_tiers.cuh) over the last axis: forward y = H (s x) / sqrt(d),
    inverse x = s (H y) / sqrt(d)."""
    d = v.shape[-1]
    s = turbo.SIGNS[:d]
    v = np.array(v, dtype=np.float32).reshape(-1, d)
    if not inverse:
        v = v * s
    h = 1
    while h < d:
        p = v.reshape(len(v), d // (2 * h), 2, h)
        v = np.stack([p[:, :, 0] + p[:, :, 1], p[:, :, 0] - p[:, :, 1]], axis=2).reshape(len(v), d)
        h *= 2
    v = v * np.float32(1.0 / np.sqrt(d))
    return v * s if inverse else v


@pytest.mark.parametrize("tk,tv,d", [("turbo3", "turbo3", 256), ("q8_0", "turbo3", 128),
                                     ("turbo3_tcq", "q4_0", 64), ("turbo8", "turbo2_tcq", 512)])
def test_rotation_trick_equals_cpu_attention(tk, tv, d):
    """The attention kernel's rotated-domain math (turbo.py: q.k = (Rq).(Rk), o = R^T sum p y)
    gives CPUBackend.attention over the dequantized cells, with GQA and a causal mask."""
    rng = np.random.default_rng(9)
    Tk, Tv = get_tier(tk), get_tier(tv)
    C, n_kv, n_head, T = 70, 2, 6, 3
    kq = Tk.quantize(rng.standard_normal((C, n_kv, d)).astype(np.float32))
    vq = Tv.quantize(rng.standard_normal((C, n_kv, d)).astype(np.float32))
    q = rng.standard_normal((T, n_head, d)).astype(np.float32)
    q_pos = np.array([40, 55, 69])
    kv_pos = np.arange(C)
    scale = 1 / np.sqrt(d)
    want = CPUBackend.attention(q, q_pos, Tk.dequantize(kq), Tv.dequantize(vq), kv_pos, scale)

    rot = lambda t: t.family in ("turbo", "tcq")  # noqa: E731
    kr = Tk.dequantize_rotated(kq) if rot(Tk) else Tk.dequantize(kq)  # what the kernel decodes
    vr = Tv.dequantize_rotated(vq) if rot(Tv) else Tv.dequantize(vq)
    qs = (q * np.float32(scale)).reshape(T * n_head, d)
    if rot(Tk):
        qs = _fwht(qs, inverse=False)  # rotate the queries once
    qs = qs.reshape(T, n_kv, n_head // n_kv, d)
    s = np.einsum("tkgd,ckd->tkgc", qs, kr)
    s = np.where(kv_pos[None, None, None, :] <= q_pos[:, None, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("tkgc,ckd->tkgd", p, vr) / p.sum(-1, keepdims=True)
    o = o.reshape(T * n_head, d)
    if rot(Tv):
        o = _fwht(o, inverse=True)  # un-rotate the output once per head
    np.testing.assert_allclose(o.reshape(T, -1), want, rtol=1e-4, atol=1e-5)


def test_turbo_rotate_is_the_orthonormal_rotation():
    """turbo.rotate (butterflies, the order the write kernels repeat) is R = H diag(s) / sqrt(d)."""
    rng = np.random.default_rng(1)
    for d in cuda_kv.KV_HEAD_DIMS:
        x = rng.standard_normal((4, d)).astype(np.float32)
        np.testing.assert_allclose(turbo.rotate(x), x @ turbo.rotation(d), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_fwht(turbo.rotate(x), inverse=True), x, rtol=1e-5, atol=1e-5)


NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("what", ["write", ("q8_0", "turbo3", 256), ("turbo3_tcq", "q5_1", 128), ("f16", "bf16", 512)])
def test_kv_modules_compile_sm90(tmp_path, what):
    """The exact sources the backend compiles (tables prefix + inlined includes) build for sm_90
    with the backend's options."""
    src = cuda_kv.write_source() if what == "write" else cuda_kv.attention_source(*what)
    f = tmp_path / "m.cu"
    f.write_text(src)
    r = subprocess.run([NVCC, "-std=c++17", "--use_fast_math", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "m.cubin"),
                        str(f)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
