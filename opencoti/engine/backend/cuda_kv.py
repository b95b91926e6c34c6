"""KV cache tiers on CUDA: which tiers have kernels, and the sources those kernels compile from.

The device code is ``opencoti/cuda_src/kv_tiers.cuh`` (decoders and encoders of every tier,
one ``struct`` per tier), ``kv_write.cu`` (quantize new K/V rows into cells, dequantize
gathered cells), ``rope_store.cu`` (an attention layer's rope + KV store in one launch, compiled
per (K tier, V tier) with ``RS_TK`` / ``RS_TV`` / ``RS_D`` defined) and the tier-generic
attention kernel of ``attention.cu`` (compiled per (K tier, V tier, head size) with ``KV_TK`` /
``KV_TV`` / ``KV_D`` defined). The rotated tiers' tables (``kv_tiers._tables``: rotation
signs, Lloyd-Max levels and their decision thresholds, trellis codebooks) are not copied into
the ``.cuh``: ``tables_prefix`` renders them from the Python tiers as C hex-float literals
(exact float32 values), and every KV module is compiled with that prefix, so the GPU and the
CPU always share one table.

Byte layouts and rounding are the CPU tiers' (``opencoti/engine/kv_tiers``): the write
kernels store the same bytes as ``KVTier.quantize`` -- bit for bit for every tier (the
scalar tiers follow ggml's reference rounding; the rotated tiers repeat ``turbo.py``'s fixed
float32 arithmetic -- ``fwht`` stage by stage, ``block_sum``'s pairwise order, correctly
rounded sqrt and division -- with IEEE round-to-nearest PTX instructions that keep subnormals
(no .ftz / .approx / fma despite --use_fast_math), and the trellis tiers run ``trellis.py``'s
Viterbi search with the same tie-breaking). Proven on the CPU by an op-by-op NumPy port of the
write kernels and a PTX check (tests/test_kv_tiers_cuda_emul.py); valid for finite inputs whose
block sums of squares do not overflow.
"""

from __future__ import annotations

import numpy as np

from opencoti.engine.backend.cuda_kernels import read_source
from opencoti.engine.kv_tiers import get_tier

# tier name -> C struct in kv_tiers.cuh (every name of kv_tiers.TIER_NAMES)
TIER_STRUCTS = {
    "f32": "KF32", "f16": "KF16", "bf16": "KBF16", "q8_0": "KQ8_0", "q6_0": "KQ6_0", "q5_1": "KQ5_1",
    "q5_0": "KQ5_0", "q4_1": "KQ4_1", "q4_0": "KQ4_0", "iq4_nl": "KIQ4_NL", "turbo8": "KTurbo8", "turbo4": "KTurbo4",
    "turbo3": "KTurbo3", "turbo2": "KTurbo2", "turbo3_tcq": "KTcq3", "turbo2_tcq": "KTcq2",
}
KV_TYPES = tuple(TIER_STRUCTS)  # what CUDABackend.kv_types lists
# head sizes the tier kernels are built for (the rotated tiers need a power of two in [64, 512])
KV_HEAD_DIMS = (64, 128, 256, 512)
# tiers of rope_store.cu's rope_kv_write_q (rope + quantized store in one launch, a module per pair)
ROPE_STORE_TIERS = ("f32", "f16", "bf16", "q8_0", "q6_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "turbo8", "turbo4",
                    "turbo3", "turbo2")
# the rotated ones among them (a block's threads are a row's values: head sizes up to 256)
ROPE_STORE_ROTATED = ("turbo8", "turbo4", "turbo3", "turbo2")
SCALAR_FAMILY = ("float", "scalar")


# tiers whose codes the streaming attention kernel feeds to the MMAs as f16 operands (kv_codes.cuh
# KvCodes<T>::ON)
STREAM_CODE_TIERS = ("q8_0", "q4_1", "q4_0", "iq4_nl", "turbo2", "turbo3", "turbo4")
# ... of them those with a block minimum (KvCodes<T>::MIN: the heads' block sums of q in the K table's bytes)
STREAM_MIN_TIERS = ("q4_1",)


def has_table(name: str) -> bool:
    """Whether tier ``name``'s values decode through a code table (kv_tiers.cuh ``NT > 0``: the
    rotated turbo and trellis tiers)."""
    return TIER_STRUCTS[name].startswith(("KTurbo", "KTcq"))


def stream_table_bytes(name: str, as_k: bool) -> int:
    """Shared-memory bytes of tier ``name``'s table in the streaming attention kernel, as the K
    tier (``as_k``) or the V tier (attention.cu ``AsTier::TBK`` / ``TBV``): the turbo2/3/4 pair
    table (an f16 pair, 4 bytes, per pair of indices) for K and V alike (kv_codes.cuh), the other
    table tiers' float32 levels (256 of them at most: 1 KiB), a minimum tier's (q4_1) block sums of
    q as the K tier (16 heads x 8 blocks of float32 at most: 512 bytes), else 0."""
    if name in STREAM_MIN_TIERS:
        return 512 if as_k else 0
    if name in STREAM_CODE_TIERS and has_table(name):
        return 4 << (2 * int(name[-1]))
    return 1024 if has_table(name) else 0


def _hexf(v) -> str:
    """A float32 value as an exact C hex-float literal (``0x1.8p-1f``)."""
    f = float(np.float32(v))
    if f == 0.0:
        return "0.0f" if np.copysign(1.0, f) > 0 else "-0.0f"
    return f.hex() + "f"


def _arr(name: str, vals) -> str:
    vals = list(vals)
    body = ", ".join(_hexf(v) for v in vals)
    return f"__constant__ float {name}[{len(vals)}] = {{{body}}};\n"


def _imm(name: str, vals) -> str:
    """``name(i)``: entry i of ``vals`` (float32) as a constexpr chain of literals, so that an
    unrolled loop's constant index makes each an instruction's immediate operand (no load)."""
    body = " : ".join(f"i == {i} ? {_hexf(v)}" for i, v in enumerate(vals))
    return f"__device__ __forceinline__ constexpr float {name}(int i) {{ return {body} : 0.0f; }}\n"


def sign_words() -> np.ndarray:
    """The rotated tiers' sign flips (turbo.py's rotation) as uint32 ``[16]``: bit i % 32 of word
    i // 32 set = sign -1 at dim i, for head sizes up to 512 (``KV_SIGNS``; attn_merge's
    ``v_signs``)."""
    from opencoti.engine.kv_tiers import _tables

    return np.frombuffer(bytes.fromhex(_tables.SIGNS_HEX), dtype="<u4").astype(np.uint32)


def merge_unrotates(type_v: str, d: int, n_split: int) -> bool:
    """Whether ``attn_merge`` un-rotates a rotated V tier's output (the attention kernels then
    leave their split partials rotated): several splits and head size up to 256, so the merge's
    256-element windows hold whole heads (attn_stream.cuh ``merge_unrotates``; a module built
    with ``merge_unrotate=False`` never does)."""
    from opencoti.engine.kv_tiers import get_tier

    return get_tier(type_v).family in ("turbo", "tcq") and n_split > 1 and d <= 256


def tables_prefix() -> str:
    """C source of the rotated tiers' tables, prepended to every KV kernel module:
    ``KV_SIGNS`` (512 sign bits as 16 u32, bit i set = sign -1), ``KV_LM{2,3,4,8}`` (Lloyd-Max
    levels) and ``KV_TH{2,3,4,8}`` (their float32 decision thresholds, ``TurboTier.thresholds``),
    the same levels and thresholds of turbo2/3/4 as immediates (``kv_lm{2,3,4}(i)``,
    ``kv_th{2,3,4}(i)``: kv_store.cuh turbo_row's code search), ``KV_TCQ{2,3}`` (trellis
    codebooks), and ``kv_isqrt(d)`` = float32(1/sqrt(d))."""
    from opencoti.engine.kv_tiers import get_tier

    words = sign_words()
    out = ["// generated by opencoti/engine/backend/cuda_kv.py (tables_prefix) from kv_tiers._tables\n",
           "__constant__ unsigned int KV_SIGNS[%d] = {%s};\n" % (len(words), ", ".join("0x%08xu" % w for w in words))]
    for bits in (2, 3, 4, 8):
        t = get_tier(f"turbo{bits}")
        out.append(_arr(f"KV_LM{bits}", t.levels))
        out.append(_arr(f"KV_TH{bits}", t.thresholds))
        if bits <= 4:
            out.append(_imm(f"kv_lm{bits}", t.levels))
            out.append(_imm(f"kv_th{bits}", t.thresholds))
    for k in (2, 3):
        out.append(_arr(f"KV_TCQ{k}", get_tier(f"turbo{k}_tcq").levels))
    isq = {d: _hexf(np.float32(1.0 / np.sqrt(d))) for d in KV_HEAD_DIMS}
    out.append("__device__ __forceinline__ constexpr float kv_isqrt(int d) { return "
               + " : ".join(f"d == {d} ? {v}" for d, v in isq.items()) + " : 0.0f; }\n")
    return "".join(out)


def write_source() -> str:
    """Full source of the KV write / read module (``kv_write.cu`` with the tables)."""
    return tables_prefix() + read_source("kv_write.cu")


def attention_source(type_k: str, type_v: str, d: int, hn: int = 8, merge_unrotate: bool = True,
                     big_d: int = 256, v_prefetch: int = 1, early: bool = True) -> str:
    """Full source of the tier-generic attention module for one (K tier, V tier, head size):
    ``attention.cu`` compiled with ``KV_TK`` / ``KV_TV`` / ``KV_D`` (kernels
    ``attn_kv_g{1,2,4,8}``, a lane per cell, ``attn_kv_g{1,2,4,8}_l``, up to 4 lanes per
    cell, and ``attn_kv_g{1,2,4,8}_l8``, 8 (``lanes8_ok``; elsewhere empty); 8 is left out at
    head size 512, as for f16; every kernel's last parameter ``q_rot``: q already rotated into a
    rotated K tier's domain) and ``KV_HN`` (``hn``, 8 or 16: the query
    heads per block of its streaming kernel ``attn_kv_stream``), and ``KV_MERGE_UNROTATE``
    (``merge_unrotate``: a rotated V tier's split partials are left rotated for attn_merge,
    ``merge_unrotates``; False: the kernels un-rotate them), and ``AS_BIG_D`` (``big_d``: the
    largest head size at which ``attn_kv_stream`` takes 128-cell tiles of 8 warps where two
    stages fit, attn_stream.cuh ``AsLayout::CT``; cuda.py ``_as_tile`` mirrors it), and
    ``ATTN_V_PREFETCH`` (``v_prefetch``: where the short-row kernels ask for a tile's V rows
    before its QK, attention.cu ``prefetch_row``: 1 L1, 2 L2, 0 not at all) and ``ATTN_EARLY``
    (``early``: the short-row kernels ask for their first tile's K / V rows before their PDL
    wait, attention.cu ``early_rows``)."""
    if hn not in (8, 16):
        raise ValueError(f"attn_kv_stream takes 8 or 16 query heads per block, not {hn}")
    return ("#define KV_TK %s\n#define KV_TV %s\n#define KV_D %d\n#define KV_HN %d\n#define KV_MERGE_UNROTATE %d\n"
            "#define AS_BIG_D %d\n"
            % (TIER_STRUCTS[type_k], TIER_STRUCTS[type_v], d, hn, int(merge_unrotate), big_d) + tables_prefix()
            + f16_attention_source(v_prefetch, early))


def f16_attention_source(v_prefetch: int = 1, early: bool = True) -> str:
    """``attention.cu`` as the f16 module (and the tail of every tier module): its kernels with
    ``ATTN_V_PREFETCH`` ``v_prefetch`` (1 L1, 2 L2, 0 none; ``attention_source``) and, where
    ``early`` is False, ``ATTN_EARLY`` 0 (``early_rows`` asks for nothing). Raises
    ``ValueError`` for another ``v_prefetch``."""
    if v_prefetch not in (0, 1, 2):
        raise ValueError(f"ATTN_V_PREFETCH is 0, 1 or 2, not {v_prefetch}")
    return (f"#define ATTN_V_PREFETCH {v_prefetch}\n" + ("" if early else "#define ATTN_EARLY 0\n")
            + read_source("attention.cu"))


def lanes8_ok(type_k: str, d: int) -> bool:
    """Whether the tier attention module's ``attn_kv_g<G>_l8`` kernels (8 lanes per cell) run for
    K tier ``type_k`` at head size ``d`` (attention.cu ``KV_L8_OK``): ``d`` a multiple of 256, and
    each lane's eighth of a K row whole blocks, or a part of a turbo block (the tiers with a
    sub-block decode, kv_tiers.cuh ``SUB``). Elsewhere those kernels are empty."""
    t = get_tier(type_k)
    bs = 32 if t.family == "float" else t.block_size  # kv_tiers.cuh: the float tiers' virtual blocks
    return d % 256 == 0 and (d // 8 >= bs or (t.family == "turbo" and bs % (d // 8) == 0))


def rope_store_source(type_k: str, type_v: str, d: int, angle_pre: bool = True, k_norm_late: bool = True) -> str:
    """Full source of the fused rope + KV store module for one pair of ``ROPE_STORE_TIERS``
    (``rope_store.cu``'s ``rope_kv_write_q`` compiled with ``RS_TK`` / ``RS_TV`` / ``RS_D``):
    ``d`` is the head size of a rotated K or V tier (64, 128 or 256); a pair of float and scalar
    tiers gets one module for every head size (``RS_D`` 0). ``angle_pre``: the module's
    ``ROPE_ANGLE_PRE`` (rope.cuh: rope's angles before the kernel's PDL wait); ``k_norm_late``:
    its ``RS_K_NORM_LATE`` (rope_store.cu: a rotated K row's norm scale applied to its block
    scales). ``ValueError`` for a tier outside ``ROPE_STORE_TIERS`` or a rotated tier at another
    head size."""
    for name in (type_k, type_v):
        if name not in ROPE_STORE_TIERS:
            raise ValueError(f"no fused rope + KV store for KV cache type {name}")
    rot = type_k in ROPE_STORE_ROTATED or type_v in ROPE_STORE_ROTATED
    if rot and d not in (64, 128, 256):
        raise ValueError(f"the fused rope + KV store of a rotated tier needs head size 64, 128 or 256, not {d}")
    return ("#define RS_TK %s\n#define RS_TV %s\n#define RS_D %d\n"
            "#define ROPE_ANGLE_PRE %d\n#define RS_K_NORM_LATE %d\n"
            % (TIER_STRUCTS[type_k], TIER_STRUCTS[type_v], d if rot else 0, angle_pre, k_norm_late)
            + tables_prefix() + read_source("rope_store.cu"))


def write_kernel(tier, d: int) -> tuple[str, int]:
    """(kernel name, threads per block) of the quantize kernel of ``tier`` at head size ``d``
    (``kv_write.cu``): the scalar and float tiers take one warp per 32-value block (grid:
    rows * d / 32 / 4 blocks of 128 threads); turbo one block of ``d`` threads per row; the
    trellis tiers one block of 256 threads (the states) per 64-value block of a row."""
    s = TIER_STRUCTS[tier.name]
    if tier.family in SCALAR_FAMILY:
        return f"kv_quant_{s}", 128
    if tier.family == "turbo":
        return f"kv_quant_{s}_d{d}", d
    return f"kv_quant_{s}_d{d}", 256


__all__ = ["KV_HEAD_DIMS", "KV_TYPES", "STREAM_CODE_TIERS", "TIER_STRUCTS", "attention_source", "has_table",
           "rope_store_source", "stream_table_bytes", "tables_prefix", "write_kernel", "write_source"]
