"""CUDA backend: the op set on an NVIDIA GPU through CuPy.

Weights stay in their GGUF block format in device memory (``QTensor``: the
tensor's raw bytes, uploaded once). Kernels from ``opencoti/cuda_src`` are
compiled with NVRTC on first use and cached (``cuda_kernels.py``):

- ``mul_mat`` with up to ``GEMV_MAX_TOKENS`` activation rows (decode): Q4_K / Q6_K weights on the
  integer tensor cores (``gemv_int.cu``: the activations as three int8 digits per value with one
  scale per 256 elements, the weight's codes as they are, float32 accuracy; a GEMV for up to
  ``IMMA_MAX_ROWS`` rows, the tiled ``gemmi`` beyond); every other type a GEMV that dequantizes
  the weight's blocks in registers (warps per output row, coalesced units as ggml-cuda
  ``mul_mat_vec_q``) for up to ``GEMV_TILE`` rows, and from ``MMQ_MIN_ROWS`` rows a tensor-core
  kernel that stages each weight tile once in shared memory for all rows (``mmq.cu``: f16 hi/lo
  operand splits keep float32 accuracy; float32 weights stay in the float32 GEMV); prefill: the
  weight is dequantized into an f16 hi / lo pair and multiplied by cuBLAS on the f16 tensor
  cores at float32 accuracy (``_gemm_f16x3``; ``OPENCOTI_CUDA_PREFILL_GEMM`` picks float32
  SGEMM or a single f16 product instead).
- ``attention_cells``: split-K online-softmax attention that reads K/V through the cache
  plan's per-sequence cell lists (``attention.cu``): f16 K/V in the f16 kernels, every other
  KV tier (``-ctk`` / ``-ctv``, any pair) in the tier-generic kernel, which dequantizes the
  tier's blocks in registers (``cuda_kv.py``, ``kv_tiers.cuh``). A plan with PolyKV
  shared-prefix groups (``plan.groups``, f16 KV) reads each group's prefix once for all its
  sharers' query rows (``shared_prefix.cu``: tensor-core tiles, f32-accurate through f16
  hi/lo operand splits) and merges with each row's private cells by log-sum-exp
  (``_attention_groups``; ``OPENCOTI_CUDA_SHARED_PREFIX=0`` turns it off).
- ``rms_norm``, ``rope`` (norm/neox, freq factors, YaRN), activations, ``kv_write`` (quantizes
  into the cache's tiers on the device, the same bytes as the CPU tiers, ``kv_write.cu``),
  ``kv_read`` / ``kv_store`` (a quantized K through float32 for the context shift).
- mixture of experts (``moe_ffn``, ``moe_ffn_gate_up``): 3-D expert tensors stay in
  their block format (``QExperts``); routing (softmax, top-k) runs on the device. Up to
  ``GEMV_MAX_TOKENS`` rows every (token, slot) pair runs an expert GEMV that reads its
  expert through the routed ids (no host sync: graph-safe); more rows (prefill) copy
  the routing to the host, group the rows per expert and run each expert's GEMM.
- the gated delta-net ops of the hybrid models (``ssm_conv``, ``gated_delta_net``,
  ``recurrent.cu``) with the per-sequence states on the device, updated in place;
  ``sigmoid``, ``softplus``, ``l2_norm``.

CUDA graphs (``run_graph``): every op above is graph-safe for the ubatches that are
captured (at most ``GEMV_MAX_TOKENS`` rows): nothing reads device data on the host,
and the recurrent plans' index arrays are staged like the KV plans'.

Activations are float32 CuPy arrays ``[n_tokens, n]``; only logits (the rows
that need them) come back to the host (``to_host``). Per step, the ubatch's
token ids, positions and output rows go to the device once
(``begin_ubatch``), and each cache plan's index arrays once (first use).

Errors: ``RuntimeError`` when CuPy or a GPU is missing (from the registry's
creator), ``NotImplementedError`` for a head size / GQA ratio without a
kernel (the quantized KV tiers need head size 64, 128, 256 or 512), ``ValueError`` for a KV
tier without kernels (``kv_types``: every tier of ``kv_tiers.TIER_NAMES``; the runner checks
it at boot).
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from opencoti.engine.backend import cuda_kv
from opencoti.engine.backend.cpu import rope_kv_write, yarn_corr_dims
from opencoti.engine.backend.cuda_kernels import Kernel, load_module, load_source, pdl_supported, read_source
from opencoti.engine.backend.experts import ExpertRows
from opencoti.engine.batch import StepResult
from opencoti.engine.sampling import rows_argmax
from opencoti.model.gguf_file import GGUFFile

GEMV_MAX_TOKENS = 64  # rows up to this run inside decode graphs
GEMV_TILE = 8
# one-token GEMV over weights of at least this many elements: two rows per warp (gemv1r2_*),
# the x loads shared by both rows; measured on the H200: 7B ffn_up 818 -> 1,141 GB/s, q/o
# 611 -> 710, while the small matrices of a 270m model lose (fewer warps, longer chains)
GEMV_RPW2_MIN_ELEMENTS = 4 << 20
# ... and, among those, eight rows per warp over weights of at least this many rows of at most
# GEMV_RPW8_MAX_COLS columns (an output head of a small model: gemma-3-270m's 262,144 x 640 Q8_0,
# 97 -> 89 us on the H200), whose warps would otherwise each read only two short rows
GEMV_RPW8_MIN_ROWS = int(os.environ.get("OPENCOTI_CUDA_GEMV_RPW8_MIN_ROWS", str(1 << 16)))
GEMV_RPW8_MAX_COLS = 2048
# From this many activation rows (up to GEMV_MAX_TOKENS) mul_mat runs the tensor-core kernel
# of mmq.cu, which reads the weight once for all rows, instead of the GEMV tiles of GEMV_TILE
# rows, which read it once per tile. OPENCOTI_CUDA_MMQ_MIN_ROWS=0 turns it off.
MMQ_MIN_ROWS = int(os.environ.get("OPENCOTI_CUDA_MMQ_MIN_ROWS", "9"))
MMQ_BM, MMQ_BK, MMQ_LD = 128, 128, 136  # mmq.cu's MQ_BM, MQ_BK, MQ_LD
# Q4_K / Q6_K weights with up to this many activation rows run on the integer tensor cores
# (gemv_int.cu: activations as three int8 digits per value, float32 accuracy) instead of the
# float GEMV / mmq.cu. OPENCOTI_CUDA_IMMA_MAX_ROWS=0 turns it off.
IMMA_MAX_ROWS = int(os.environ.get("OPENCOTI_CUDA_IMMA_MAX_ROWS", "8"))
# ... and from IMMA_MAX_ROWS + 1 to GEMV_MAX_TOKENS rows the tiled variant (gemv_int.cu gemmi: 64
# weight rows x 16 or 32 tokens per block, digits staged in shared memory) instead of mmq.cu.
# OPENCOTI_CUDA_IMMA_BATCH=0 turns that off.
IMMA_BATCH = os.environ.get("OPENCOTI_CUDA_IMMA_BATCH", "1") != "0"
# gemmi compiled for 2, 3 or 4 resident blocks per SM (register cap); 3 measured best on the H200
# (7B ffn_up, 32 rows: 115 / 98 / 105 us; Q6_K the same within 2 %)
GEMMI_BLOCKS = int(os.environ.get("OPENCOTI_CUDA_GEMMI_BLOCKS", "3"))
if GEMMI_BLOCKS not in (2, 3, 4):
    raise ValueError(f"OPENCOTI_CUDA_GEMMI_BLOCKS={GEMMI_BLOCKS}: expected 2, 3 or 4")
# gemmi's weights: streamed through shared-memory stages beside the digit columns (gemv_int.cu
# gemmi_ring; 3 stages with 2 digits, 2 with 3: ``gemmi_ring_stages``) rather than prefetched into
# registers (gemmi_impl at GEMMI_BLOCKS per SM). Measured on the H200 (bench_gemv, 7B shapes, 32
# rows, 2 digits, us, registers -> 2 / 3 / 4 stages): ffn_up 62.0 -> 55.6 / 55.5 / 54.5, Q6_K
# ffn_down 98.0 -> 82.7 / 81.1 / 91.5, Q6_K output 631.7 -> 471.4 / 492.3 / 562.6; 3 digits:
# ffn_up 77.1 -> 69.0 / 68.6, ffn_down 119.2 -> 102.0 / 110.9; 64 rows, 3 stages: ffn_up 102.8 ->
# 92.7, ffn_down 180.2 -> 153.6. OPENCOTI_CUDA_GEMMI_RING=N forces N stages, 0 the register kernel.
_GR = os.environ.get("OPENCOTI_CUDA_GEMMI_RING", "")
GEMMI_RING = int(_GR) if _GR else None
GEMMI_RING_KERNELS = {4: (2, 3, 4), 6: (2, 3), 8: (2, 3)}  # column tiles -> stage counts built
if GEMMI_RING not in (None, 0, 2, 3, 4):
    raise ValueError(f"OPENCOTI_CUDA_GEMMI_RING={GEMMI_RING}: expected 0, 2, 3 or 4")
# the attention merges (attn_merge / sp_merge) write the output projection's digits themselves
# (attn_merge_digits / sp_merge_digits) instead of an xq_digits pass after them.
# OPENCOTI_CUDA_MERGE_DIGITS=0: the pass.
MERGE_DIGITS = os.environ.get("OPENCOTI_CUDA_MERGE_DIGITS", "1") != "0"
# gemmi's tokens per block with 2 digits, for steps of more than 16 rows: 16 (4 column tiles) or
# 32 (8 tiles, gemmi_ring only: each weight fragment and scale is decoded once for twice the
# tokens, and a 32-row step reads each weight row in one block instead of two), per weight type.
# Measured on the H200 (bench_gemv, 7B shapes, 2 digits, us, 16 -> 32 tokens, 2 / 3 stages):
# Q6_K ffn_down 32 rows 82.0 / 80.9 -> 77.9 / 68.8, 64 rows 149.9 / 155.0 -> 122.2 / 133.4; Q4_K
# ffn_up 32 rows 55.3 / 55.0 -> 57.2 / 62.8, 64 rows 97.8 / 93.7 -> 95.1 / 108.2. The digit
# columns are laid out the same either way (token t's digit i is column D t + i; only the
# padding differs), so one activation's digits serve both kernels. OPENCOTI_CUDA_GEMMI_TOKENS=16
# or 32 forces one width for every type.
_GT = os.environ.get("OPENCOTI_CUDA_GEMMI_TOKENS", "")
GEMMI_TOKENS = int(_GT) if _GT else None
GEMMI_TYPE_TOKENS = {12: 16, 14: 32}  # Q4_K, Q6_K
if GEMMI_TOKENS not in (None, 16, 32):
    raise ValueError(f"OPENCOTI_CUDA_GEMMI_TOKENS={GEMMI_TOKENS}: expected 16 or 32")


def gemmi_ring_stages(nt: int) -> int:
    """Shared-memory stages of gemmi_ring for ``nt`` column tiles (4 or 8: 2 digits, 6: 3), 0
    for the register-prefetch gemmi_impl: GEMMI_RING where that kernel is built, else 3 for 4
    and 8 tiles and 2 for 6."""
    if GEMMI_RING is not None:
        return GEMMI_RING if GEMMI_RING in GEMMI_RING_KERNELS.get(nt, ()) else 0
    return {4: 3, 6: 2, 8: 3}.get(nt, 0)


def gemmi_ring_smem(nt: int, stages: int, ggml_type: int) -> int:
    """Dynamic shared memory bytes of gemv_int.cu's gemmi_ring: ``stages`` x (GmStage of 8 ``nt``
    digit columns + the 64 rows' blocks, 240 bytes per Q6_K block's chunks, 144 per Q4_K)."""
    cw = 8 * nt
    return stages * (17 * cw * 16 + cw * 4 + 64 * (240 if ggml_type == 14 else 144))


def _gemmi_ring8_fits(ggml_type: int, smem_per_block: int) -> bool:
    """Whether an 8-tile (32-token) gemmi_ring kernel is built (``gemmi_ring_stages``) and its
    stages for a weight of ``ggml_type`` fit ``smem_per_block`` bytes."""
    st = gemmi_ring_stages(8)
    return st > 0 and gemmi_ring_smem(8, st, ggml_type) <= smem_per_block


def gemmi_tiles(n: int, nd: int, smem_per_block: int) -> int:
    """MMA column tiles of the digit layout of ``n`` activation rows of ``nd`` digits for gemmi:
    8 (32-token groups) with 2 digits and more than 16 rows where a weight type takes 32-token
    blocks (GEMMI_TOKENS, else GEMMI_TYPE_TOKENS) and the 8-tile ring kernel fits for either
    type (``_gemmi_ring8_fits`` of Q6_K, the larger), else 2 ``nd`` (16 tokens).
    ``gemmi_kernel_tiles`` picks each weight's kernel for the layout."""
    wide = GEMMI_TOKENS == 32 or (GEMMI_TOKENS is None and 32 in GEMMI_TYPE_TOKENS.values())
    if nd == 2 and n > 16 and wide and _gemmi_ring8_fits(14, smem_per_block):
        return 8
    return 2 * nd


def gemmi_kernel_tiles(nt: int, nd: int, ggml_type: int, smem_per_block: int) -> int:
    """Column tiles of the gemmi kernel that multiplies a weight of ``ggml_type`` with digits laid
    out in ``nt``-tile groups (``gemmi_tiles``): 8 where that type takes 32-token blocks and the
    8-tile kernel fits (``_gemmi_ring8_fits``), else 2 ``nd`` (a 16-token kernel reads the 32-token
    layout as two groups each)."""
    wide = (GEMMI_TOKENS or GEMMI_TYPE_TOKENS.get(ggml_type, 16)) == 32
    return 8 if nt == 8 and wide and _gemmi_ring8_fits(ggml_type, smem_per_block) else 2 * nd


IMMA_TYPES = (12, 14)  # Q4_K, Q6_K
# ... except one-row products with weights of fewer elements: the float GEMV in one launch beats the
# digit pass + integer GEMV there (two latency-bound launches; H200, gemma-3-270m attn_output 640 x
# 1,024 and ffn_down 640 x 2,048: tg128 875 -> 1,006; also a 7B's attn_k / attn_v, 512 x 3,584,
# which measured the same either way). OPENCOTI_CUDA_IMMA_MIN_WEIGHT=0: the integer path for every size.
IMMA_MIN_WEIGHT = int(os.environ.get("OPENCOTI_CUDA_IMMA_MIN_WEIGHT", str(1 << 21)))
# 16-row tiles (quants.cuh qrow; QTensor.tiled): a Q4_K / Q6_K matrix of rows a multiple of 16 is
# uploaded with each 16 rows' blocks interleaved super-block by super-block, so that a one-token
# GEMV warp's super-block of its 16 rows is one 16 x 144 (210) byte run and its run of super-blocks
# one stretch of memory instead of 16 rows' pieces 15.5 KB apart (a Q6_K ffn_down). Every kernel
# that reads such a weight has a _t16 twin (gemv_int.cu's, the dequantize and get_rows kernels);
# the float GEMV units have none, so a weight is tiled only while the integer path serves all its
# one- to GEMV_MAX_TOKENS-row products (IMMA_MAX_ROWS, IMMA_BATCH), and a tiled weight takes it
# also for one row without digits (_imma: where IMMA_MIN_WEIGHT would pick the float GEMV; a
# decode step's weights have digits anyway). Measured on the H200 (7B shapes, one row, graph-
# replayed, us, rows -> tiles): gate + up 29.6 -> 24.0, Q6_K ffn_down 32.1 -> 26.7, q + k 7.1 ->
# 6.1, output 156 -> 142; bench_cuda tg128 (7B) 339.7 / 355.1 -> 403.7 / 401.5 (bench/CUDA_NOTES.md,
# session 23). OPENCOTI_CUDA_TILED=0 keeps GGUF rows.
TILED = os.environ.get("OPENCOTI_CUDA_TILED", "1") != "0"
TILED_BLOCK_BYTES = {12: 144, 14: 210}  # ggml type -> super-block bytes (Q4_K, Q6_K)
# the kernels.cu kernels with a _t16 twin (CUDABackend._qfn)
TILED_KERNELS = frozenset({"dequant_f32", "dequant_f16", "dequant_f16x2", "get_rows"})


def tile_rows16(raw, block_bytes: int):
    """GGUF rows ``raw`` (uint8 ``[rows, row_bytes]``, NumPy or CuPy; rows a multiple of 16,
    ``row_bytes`` a multiple of ``block_bytes``) in 16-row tiles: ``[rows, row_bytes]`` where the
    bytes of rows ``16 i .. 16 i + 15`` hold, in order, block 0 of each of the 16 rows, then block
    1 of each, ... (block j of row r at byte ``(r // 16) * 16 * row_bytes + (16 j + r % 16) *
    block_bytes``; gemv_int.cu / quants.cuh ``qrow``). A new array. Raises ValueError on a shape
    that does not tile."""
    rows, rb = raw.shape
    if rows % 16 or rb % block_bytes:
        raise ValueError(f"tile_rows16: {rows} rows of {rb} bytes do not tile by 16 rows of {block_bytes}-byte blocks")
    nb = rb // block_bytes
    return raw.reshape(rows // 16, 16, nb, block_bytes).transpose(0, 2, 1, 3).copy().reshape(rows, rb)


def tiles_weight(ggml_type: int, rows: int, cols: int) -> bool:
    """Whether a ``[rows, cols]`` weight of ``ggml_type`` is uploaded in 16-row tiles (TILED)."""
    return (TILED and int(ggml_type) in TILED_BLOCK_BYTES and rows % 16 == 0 and cols % 256 == 0
            and IMMA_MAX_ROWS > 0 and IMMA_BATCH)
# base-256 digits per activation value in gemv_int.cu: 3 (float32 accuracy, 2^-24 of a 256-element
# block's largest |x|) or 2 (2^-16, finer than f16's 2^-11: a third less integer work per token).
# Default (imma_digits): 2 for gemmi's rows of a batched decode step (ALU-bound; H200, 270m x64
# 8,947 -> 10,106 tok/s, 7B x32 2,276 -> 2,602), else 3: one-row GEMVs are bound by weight bytes
# (no gain from 2), and prompt chunks keep float32 accuracy (2-digit prompt chunks failed the real
# model's KV-tier CUDA-vs-CPU gate: quantized tiers turn last-bit differences into code flips). A
# batched step's K / V are 2-digit too, and a sequence's logits depend on whether it is decoded in
# a batch of more than 8 (as with llama.cpp's batch-size-dependent kernels). OPENCOTI_CUDA_IMMA_DIGITS
# =2 or 3 forces one count everywhere.
_ND = os.environ.get("OPENCOTI_CUDA_IMMA_DIGITS", "")
IMMA_DIGITS = int(_ND) if _ND else None
if IMMA_DIGITS not in (None, 2, 3):
    raise ValueError(f"OPENCOTI_CUDA_IMMA_DIGITS={IMMA_DIGITS}: expected 2 or 3")
# gemv_int.cu gemvi, one column tile (up to 8 / digits token rows: 2 with 3 digits; gemvi_ring): each warp streams its
# super-blocks through GEMVI_STAGES shared-memory slots (2 or 4; measured on the H200, bench_gemv 7B
# shapes, one row: 2 slots ffn_up 20.6 us, ffn_down 36.9, output 193; 4 slots 21.6 / 45.2 / 218),
# with enough warps per 16-row tile for about GEMVI_WARPS_PER_SM warps per SM in the grid (at most
# GEMVI_MAX_WARPS, one per super-block), halved while the grid would not be resident at once
# (_gemvi_warps); OPENCOTI_CUDA_GEMVI_WARPS=N forces N (bench_gemv). More rows up to IMMA_MAX_ROWS
# (3 or 6 column tiles): IMMA_WARPS warps per tile, each prefetching into registers (measured: 8 rows 4 warps
# 1,184 GB/s, 8 warps 847; the ring was slower there: ffn_down 8 rows 51 -> 70 us).
GEMVI_STAGES = int(os.environ.get("OPENCOTI_CUDA_GEMVI_STAGES", "2"))
if GEMVI_STAGES not in (2, 4):
    raise ValueError(f"OPENCOTI_CUDA_GEMVI_STAGES={GEMVI_STAGES}: expected 2 or 4")
# gemvi_ring's MMA row tiles per warp (gemv_int.cu ``_r2``: two 16-row tiles share each B
# fragment load and give a warp two independent MMA chains; 86 registers for Q4_K, 168 for Q6_K
# under nvcc sm_90, against 64 / 80). Default (0, ``gemvi_row_tiles``): two for Q4_K, and for Q6_K
# when the two-tile grid still has GEMVI_R2_Q6_BLOCKS blocks per SM; measured on the H200
# (bench_gemv, 7B shapes, one row, us, one tile -> two): Q4_K ffn_up 20.8 -> 19.2, attn_q 8.5 ->
# 8.0; Q6_K output (152,064 rows) 194.7 -> 161.6, ffn_down (3,584 rows) 37.3 -> 38.9.
# OPENCOTI_CUDA_GEMVI_ROW_TILES=1 or 2 forces one count (2 only with 2 slots: _r2 is built so).
GEMVI_ROW_TILES = int(os.environ.get("OPENCOTI_CUDA_GEMVI_ROW_TILES", "0"))
if GEMVI_ROW_TILES not in (0, 1, 2) or (GEMVI_ROW_TILES == 2 and GEMVI_STAGES != 2):
    raise ValueError(f"OPENCOTI_CUDA_GEMVI_ROW_TILES={GEMVI_ROW_TILES}: expected 1, or 2 with 2 stages")
GEMVI_R2_Q6_BLOCKS = 8
GEMVI_WARPS_PER_SM = int(os.environ.get("OPENCOTI_CUDA_GEMVI_WARPS_PER_SM", "16"))
GEMVI_MAX_WARPS = 8
GEMVI_WARPS = int(os.environ.get("OPENCOTI_CUDA_GEMVI_WARPS", "0"))
IMMA_WARPS = {3: 4, 6: 4}  # <= 4: gemv_int.cu gemvi_impl's reduction tile
# two one-token ring products of one activation (a layer's fused q + k and its v of another type:
# Qwen2.5-7B Q4_K_M's Q6_K attn_v layers) run as one grid (gemv_int.cu gemvi_duo; cuda.py
# _gemvi_duo): the small one's row tiles fill the SMs the large one leaves idle (the H200 ran the
# 7B's q + k as 128 blocks and its attn_v as 32, one launch after the other; session 21's ncu:
# 9.4 + 8.7 us at 1.35 GHz). OPENCOTI_CUDA_GEMVI_DUO=0 launches them one by one. The built pairs:
# (type, row tiles) of the first and of the second weight.
GEMVI_DUO = os.environ.get("OPENCOTI_CUDA_GEMVI_DUO", "1") != "0"
GEMVI_DUO_KERNELS = frozenset({(12, 2, 14, 1), (12, 1, 14, 1)})
# OPENCOTI_CUDA_F16_GEMM_MIN_ROWS=N (default 0: off): batches of N..GEMV_MAX_TOKENS rows take
# the f16 cuBLAS GEMM instead (weight dequantized to f16 in a scratch buffer, activations
# rounded to f16; eager, as cuBLAS is not captured through CuPy). Measured on the H200 before
# mmq.cu: 270m x32 1,250 vs 2,598 tok/s for graph-replayed GEMV tiles, x64 3,388 vs 1,922.
# Prefill (more than GEMV_MAX_TOKENS rows) of a quantized weight: OPENCOTI_CUDA_PREFILL_GEMM=
#   f16x3 (default): the split-f16 GEMM (_gemm_f16x3: weight and activations each as an f16
#         hi + lo pair, three f16 tensor-core products, float32 accuracy);
#   f32:   the weight dequantized to float32 and cuBLAS SGEMM;
#   f16:   one f16 product (activations and weight rounded to f16; = OPENCOTI_CUDA_F16_PREFILL=1).
# Measured on the H200 (bench_cuda pp512, Qwen2.5-7B-shaped Q4_K_M): see bench/CUDA_NOTES.md.
F16_GEMM_MIN_ROWS = int(os.environ.get("OPENCOTI_CUDA_F16_GEMM_MIN_ROWS", "0"))
PREFILL_GEMM = ("f16" if os.environ.get("OPENCOTI_CUDA_F16_PREFILL", "0") == "1"
                else os.environ.get("OPENCOTI_CUDA_PREFILL_GEMM", "f16x3"))
# f16x3 from this many weight elements (smaller weights keep float32 SGEMM): the split's five
# launches per product cost more than it saves on small matrices (H200, pp512: gemma-3-270m,
# 640 x 2,048 weights, 35,783 tok/s with SGEMM vs 18,795 all-f16x3; Qwen2.5-7B 2,864 vs 7,365)
F16X3_MIN_WEIGHT = int(os.environ.get("OPENCOTI_CUDA_F16X3_MIN_WEIGHT", str(1 << 22)))
if PREFILL_GEMM not in ("f16x3", "f32", "f16"):
    raise ValueError(f"OPENCOTI_CUDA_PREFILL_GEMM={PREFILL_GEMM!r}: expected f16x3, f32 or f16")
# a layer's q / k / v projections, and its FFN gate / up, each copied at load into one
# row-concatenated weight when their types match (fuse_rows; read by mul_mat_split and gated_ffn in
# one launch), and one-token norms / gated activations that feed the integer GEMV writing its
# digit columns themselves (no xq_digits launch); OPENCOTI_CUDA_FUSE=0: neither
FUSE = os.environ.get("OPENCOTI_CUDA_FUSE", "1") != "0"
ATTN_HEAD_DIMS = (32, 64, 128, 256, 512)
ATTN_GROUPS = (1, 2, 4, 8)  # query heads per block (kernel MAXG); head_dim 512 stops at 4 (shared memory)
# fewest heads per block such that rows x kv heads x head blocks stays within this (decode steps)
ATTN_SMALL_GRID = int(os.environ.get("OPENCOTI_CUDA_ATTN_SMALL_GRID", "16"))
ATTN_GROUP_CELLS = int(os.environ.get("OPENCOTI_CUDA_ATTN_GROUP_CELLS", "4096"))
# rope + a scalar- or turbo-tier KV store in one launch (rope_kv_write -> rope_store.cu rope_kv_write_q);
# OPENCOTI_CUDA_ROPE_KV_TIERS=0: rope, rope and the quantize kernels one by one
ROPE_KV_TIERS = os.environ.get("OPENCOTI_CUDA_ROPE_KV_TIERS", "1") != "0"
# the fused rope + KV stores compute rope's angles and read the q / k norms' weights and biases
# before their PDL wait (rope.cuh ROPE_ANGLE_PRE, rope_pre: the same bits; CUDA_NOTES sessions 36,
# 37); OPENCOTI_CUDA_ROPE_ANGLE_PRE=0: after the row's load and norm, as before. Read at the backend's
# start for the f16 kernels (kernels.cu), when a tier pair's module is built for the others
# (bench_kv_tiers --variant)
ROPE_ANGLE_PRE = os.environ.get("OPENCOTI_CUDA_ROPE_ANGLE_PRE", "1") != "0"
# the fused store's rotated K row with a k_norm is roped unnormed and encoded at once, the norm's
# scale applied to its block scales (rope_store.cu RS_K_NORM_LATE: its bytes equal the normed
# row's up to rounding); OPENCOTI_CUDA_ROPE_K_NORM_LATE=0: normed, roped, then encoded (the bits of
# the launches one by one). Read when a tier pair's module is built (bench_kv_tiers --variant)
ROPE_K_NORM_LATE = os.environ.get("OPENCOTI_CUDA_ROPE_K_NORM_LATE", "1") != "0"
# decode attention's splits (_attn_splits): at most ATTN_SPLIT_CELLS cells each while the grid is
# small, ATTN_MAX_SPLITS in all
ATTN_SPLIT_CELLS = int(os.environ.get("OPENCOTI_CUDA_ATTN_SPLIT_CELLS", "256"))
ATTN_MAX_SPLITS = int(os.environ.get("OPENCOTI_CUDA_ATTN_MAX_SPLITS", "256"))
# the tier attention kernels' splits of at most this many cells (per view) take up to 4 lanes per
# cell (attn_kv_g<G>_l), longer ones a lane per cell: a lane-per-cell warp's tile is 32 cells,
# so a short split left warps idle and each lane's row dot product long
ATTN_KV_LANES_CELLS = int(os.environ.get("OPENCOTI_CUDA_ATTN_KV_LANES_CELLS", "256"))
# head sizes 256 and 512: a split of at most ATTN_L8_CELLS cells takes the _l8 kernels (8 lanes per
# cell: a warp's tile of 4 cells, its serial QK and PV half the _l kernels'), with as many splits as
# that needs within _attn_splits' grid bound (gemma-3-270m's sliding layers at 512 cells: 32 splits
# of 16, not 16 of 32); 0 turns them off
ATTN_L8_CELLS = int(os.environ.get("OPENCOTI_CUDA_ATTN_L8_CELLS", "16"))
# a rotated V tier's output un-rotated once per head by attn_merge where a row splits (head sizes up
# to 256: cuda_kv.merge_unrotates) instead of by every split's block; 0: by the blocks
MERGE_UNROTATE = os.environ.get("OPENCOTI_CUDA_MERGE_UNROTATE", "1") != "0"
ATTN_L8_DIMS = (256, 512)
QTYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
          10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_NULL = np.uint64(0)
_NO_DIGITS = (_NULL, _NULL, _NULL, np.int32(0), np.int32(0))  # a kernel's digit arguments: none (_row_digits)
_CUDA_R_16F, _CUDA_R_32F = 2, 0  # cudaDataType_t
_CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t
_CUBLAS_GEMM_DEFAULT = -1
_OP_N, _OP_T, _PTR_MODE_HOST = 0, 1, 0  # cublasOperation_t, cublasPointerMode_t
SSM_MAX_CONV = 8  # ssm_conv kernel taps (recurrent.cu SSM_MAXK)
GDN_MAX_DK = 256  # gated_delta_net key head dim (recurrent.cu: 32 * largest MAXR)
GDN_COLS = 32  # value columns per gated_delta_net block (GDN_NW * GDN_CW)
# shared-prefix attention (shared_prefix.cu): head dim -> cells per K/V tile; queries per block
SP_TILE = {32: 64, 64: 64, 128: 64, 256: 32}
SP_QT = 64
# sp_attn splits a group's shared cells into parts of at least this many, as many as one wave
# of resident blocks holds (``_sp_splits``). H200, one 7B layer's attention_cells, 4,096 shared
# cells, us, parts of >= 256 / 128 cells at up to 4 blocks per SM: 8 sharers 41.2 / 31.6, 32
# sharers 47.5 / 57.9 (the second wave)
SP_SPLIT_CELLS = int(os.environ.get("OPENCOTI_CUDA_SP_SPLIT_CELLS", "128"))
if SP_SPLIT_CELLS < 1:
    raise ValueError(f"OPENCOTI_CUDA_SP_SPLIT_CELLS={SP_SPLIT_CELLS}: expected >= 1")
SHARED_PREFIX = os.environ.get("OPENCOTI_CUDA_SHARED_PREFIX", "1") != "0"
# a grouped (PolyKV) graph key's private-cell bucket is at least this many cells per grouped view: the
# private lists grow by one cell per sequence per step, and a bucket that crossed a power of two
# every few steps captured a new graph each time (a decode window of 8 sharers with ~20-85
# private cells each crossed 256 -> 512 once). 0: the plain bucket of the lists' sum.
GROUP_PRIVATE_CELLS = int(os.environ.get("OPENCOTI_CUDA_GROUP_PRIVATE_CELLS", "256"))
# a grouped plan's private-cell attn_partial runs on a second stream beside the groups' sp_attn
# (a parallel branch of the decode graph; both read only q and the KV, sp_merge joins them):
# the private part is latency-bound (~20-150 cells per row) and hides behind the shared part.
# 0: one stream, private part first
SP_FORK = os.environ.get("OPENCOTI_CUDA_SP_FORK", "1") != "0"
# prefill (more than GEMV_MAX_TOKENS query rows, f16 KV, head dims of SP_TILE): each sequence's
# rows through shared_prefix.cu's tensor-core tiles with the causal / window masks
# (_attention_prefill); OPENCOTI_CUDA_PREFILL_TC_ATTN=0: attention.cu's per-row kernel
PREFILL_TC_ATTN = os.environ.get("OPENCOTI_CUDA_PREFILL_TC_ATTN", "1") != "0"
PREFILL_TC_ROWS = 16  # query rows per sequence (mean over the ubatch) from which that path is taken
# decode attention over long rows (attention.cu attn_stream_d<D> for f16 K/V, attn_kv_stream for a
# tier pair: K / V tiles streamed through shared memory with cp.async, tensor-core products): taken
# when the rows' cells average at least ATTN_STREAM_CELLS (0: never); its splits give about
# ATTN_STREAM_SM_BLOCKS blocks per SM, each at least ATTN_STREAM_MIN_SPLIT cells (one block per SM
# measured best on the H200, bench_attn: Qwen2.5-7B heads at 32k cells, 4-warp blocks, 34.3 us at
# one block per SM, 37.8 at two; a tier pair's two to four blocks per SM were slower too: fewer,
# longer splits pay less prologue and merge; both measured before the merge took ~5 us at any
# split count, CUDA_NOTES session 26); never more blocks per SM than the kernel fits at once
# (_attn_stream_splits' fit)
ATTN_STREAM_CELLS = int(os.environ.get("OPENCOTI_CUDA_ATTN_STREAM_CELLS", "2048"))
ATTN_STREAM_SM_BLOCKS = float(os.environ.get("OPENCOTI_CUDA_ATTN_STREAM_SM_BLOCKS", "1"))
ATTN_STREAM_MIN_SPLIT = int(os.environ.get("OPENCOTI_CUDA_ATTN_STREAM_MIN_SPLIT", "256"))
# ... and launched with their shared memory padded so that no more than those blocks fit an SM
# (_stream_pin_smem; 0: as the kernel needs)
ATTN_STREAM_PIN = int(os.environ.get("OPENCOTI_CUDA_ATTN_STREAM_PIN", "1"))
# ... and for a step of several query rows (batched decode) from ATTN_STREAM_BATCH_CELLS cells per
# row on average, when a split's grid has at least ATTN_STREAM_BATCH_BLOCKS blocks (rows x kv heads
# x head groups): attn_partial walks each row's cells with one block per (row, kv head, split),
# latency-bound. H200, bench_cuda, rows of 512-640 cells, tok/s, stream from 2,048 -> 256 cells:
# 7B x8 1,411 -> 1,663, x32 3,347 -> 3,816, PolyKV 32 sessions 2,087 -> 2,304; synthetic
# gemma-3-270m (1 kv head) x32 9,765 -> 10,936, x64 12,149 -> 13,405, but x8 (8 blocks per split)
# 4,029 -> 3,638, hence the grid floor.
ATTN_STREAM_BATCH_CELLS = int(os.environ.get("OPENCOTI_CUDA_ATTN_STREAM_BATCH_CELLS", "256"))
ATTN_STREAM_BATCH_BLOCKS = int(os.environ.get("OPENCOTI_CUDA_ATTN_STREAM_BATCH_BLOCKS", "32"))
AS_CT, AS_CT_BIG, AS_BIG_BYTES = 64, 128, 196608  # tiles (attn_stream.cuh AS_CT, AS_CT_BIG, AS_BIG_BYTES)
AS_BIG_D = 128  # the f16 module's largest head size of AS_CT_BIG tiles (attn_stream.cuh AS_BIG_D)
# ... and a KV tier pair's (cuda_kv.attention_source's big_d): 256, so gemma's head size 256 takes
# 8-warp blocks of 128-cell tiles, whose decode is spread over twice the warps (attn_stream.cuh;
# graph replay of the synthetic gemma-3-270m at 32k, H200: turbo3's streaming kernel 18.6 -> 16.1
# us a call, q8_0's 19.7 -> 18.3); 128: 4 warps there, as f16
ATTN_STREAM_BIG_D = int(os.environ.get("OPENCOTI_CUDA_ATTN_STREAM_BIG_D", "256"))
AS_HEAD_DIMS = (64, 128, 256)
# the short-row attention kernels with tiles of up to 8 cells (attn_partial*, and attn_kv_g*_l /
# _l8 with 4 or 8 lanes per cell: the sliding layers, short contexts) ask for a tile's V rows
# before its QK (attention.cu prefetch_row): 1 into L1, 2 into L2, 0 not
# (OPENCOTI_CUDA_ATTN_V_PREFETCH). The f16 module takes the value at the backend's start, a tier
# module when it builds (so a bench_kv_tiers --variant of it changes the tiers' rows, not f16's).
_V_PREFETCH_ENV = os.environ.get("OPENCOTI_CUDA_ATTN_V_PREFETCH", "1")
if _V_PREFETCH_ENV not in ("0", "1", "2"):
    raise ValueError(f"OPENCOTI_CUDA_ATTN_V_PREFETCH={_V_PREFETCH_ENV!r}: expected 0, 1 or 2")
ATTN_V_PREFETCH = int(_V_PREFETCH_ENV)
# the short-row attention kernels (attn_partial*, attn_kv_g*) ask for their first tile's K and V
# rows into L1 before their PDL wait, while the layer's KV store still runs (attention.cu
# early_rows: only cells no running kernel writes; the same bits), and the streaming kernels copy
# their first NS - 1 tiles' rows of those cells into shared memory (attn_stream.cuh);
# OPENCOTI_CUDA_ATTN_EARLY=0: after the wait, as before. Read as ATTN_V_PREFETCH is.
ATTN_EARLY = os.environ.get("OPENCOTI_CUDA_ATTN_EARLY", "1") != "0"


def imma_digits(n: int, decode: bool) -> int:
    """Base-256 digits per activation value of gemv_int.cu for ``n`` token rows (``IMMA_DIGITS``):
    2 only for a batched decode step (``decode``: every row its own sequence's one token) of more
    than IMMA_MAX_ROWS rows; prompts (whose K / V every later token reads) and direct op calls keep
    3, float32 accuracy."""
    return IMMA_DIGITS or (2 if decode and n > IMMA_MAX_ROWS else 3)


def gemvi_warp_bytes(w: "QTensor", rt: int) -> int:
    """Shared memory per warp of gemv_int.cu's one-token ring GEMV (gemvi_ring) on ``w`` with
    ``rt`` 16-row tiles per warp: GEMVI_STAGES slots of 16 rt rows' super-blocks (a Q6_K row's
    210 bytes take 240 in GGUF rows, as the 16-byte chunks that hold them; 210 in 16-row tiles)."""
    seg = 144 if w.ggml_type != 14 else 210 if w.tiled else 240
    return GEMVI_STAGES * 16 * rt * seg


def gemvi_row_tiles(ggml_type: int, rows: int, n_sm: int) -> int:
    """16-row MMA tiles per warp of gemv_int.cu's one-token ring GEMV (``GEMVI_ROW_TILES``; the
    two-tile kernels are built with 2 ring slots only): 2 for Q4_K (type 12), 2 for Q6_K (14)
    when ``rows`` give at least GEMVI_R2_Q6_BLOCKS two-tile blocks per SM of ``n_sm``, else 1."""
    if GEMVI_STAGES != 2:
        return 1
    if GEMVI_ROW_TILES:
        return GEMVI_ROW_TILES
    return 2 if ggml_type == 12 or rows >= 32 * GEMVI_R2_Q6_BLOCKS * n_sm else 1


def gemmi_splits(nb: int, nsb: int, n_sm: int, per_sm: int = 0) -> int:
    """Super-block splits of gemv_int.cu's gemmi grid of ``nb`` (token group, 64-row) blocks over
    ``nsb`` super-blocks on ``n_sm`` SMs (``per_sm`` resident per SM, default GEMMI_BLOCKS): the
    fewest that give >= 2 blocks per SM; when that grid fills at least one wave of resident
    blocks, the count up to twice that whose last wave is fullest instead, i.e. the least ``ceil(nb * s / slots) / s``
    (time in waves of one unsplit block; the fewer splits on a tie). A 7B's ffn_up alone at 32
    rows: 592 blocks for 396 slots take 2 splits (2.99 waves), where 1 left a half-empty second
    wave (1.49)."""
    lo = max(1, min(nsb, -(-2 * n_sm // nb)))
    slots = (per_sm or GEMMI_BLOCKS) * n_sm
    if nb * lo < slots:
        return lo
    return min(range(lo, min(nsb, 2 * lo) + 1), key=lambda s: (-(-nb * s // slots) / s, s))


class SplitK:
    """A product left as gemmi's split-K partial slabs (``CUDABackend.mul_mat_partials``,
    ``mul_mat_split_partials``): ``slabs [n_split, n, ...]`` float32 (a column slice of a fused
    product's slabs: strided), whose sum in split order is the product. Only
    ``CUDABackend.add_rms_norm`` and ``rope_kv_write`` take one."""

    __slots__ = ("slabs", "n_split")

    def __init__(self, slabs, n_split: int):
        self.slabs, self.n_split = slabs, n_split

    @property
    def shape(self) -> tuple:
        return tuple(self.slabs.shape[1:])

    def reshape(self, *shape) -> "SplitK":
        """The same partials with each slab reshaped (a view where CuPy can make one)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return SplitK(self.slabs.reshape((self.n_split,) + shape), self.n_split)

    def sum(self):
        """The product: the slabs added in split order (``mmq_reduce``'s bits), C-contiguous."""
        y = self.slabs[0].copy()
        for z in range(1, self.n_split):
            y += self.slabs[z]
        return y

    def kernel_args(self) -> tuple:
        """``(first slab, n_split, slab stride in floats)`` for a kernel that sums the slabs
        itself (rope.cuh ``slab_sum``)."""
        return self.slabs[0], self.n_split, self.slabs.strides[0] // self.slabs.itemsize


def _decode_rows(ub) -> int:
    """``ub``'s row count when every row is a different sequence's (a batched decode step), else 0."""
    T = len(ub.seq_id)
    return T if T and len(np.unique(ub.seq_id)) == T else 0


def _sp_smem(d: int) -> int:
    """Dynamic shared memory bytes of ``sp_attn_d<d>`` (shared_prefix.cu ``SP_SMEM``)."""
    ct = SP_TILE[d]
    return (2 * SP_QT + 2 * ct) * (d + 8) * 2 + 4 * (ct + 2 * SP_QT)


MERGE_GROUPS = 4  # lse_merge.cuh LSE_GROUPS: 256-thread groups of a merge block
# on sm_90+ the attention merges of split rows run as thread-block clusters (attn_merge_c /
# attn_merge_digits_c: a 256-element window's four summation chains in four 256-thread blocks of
# a cluster instead of one 1,024-thread block; the same bits). Such a block fits on an SM beside a
# KV tier's 8-warp streaming block, where the 1,024-thread one waits for that kernel to end, and
# the chains' loads spread over four SMs. H200, synthetic gemma-3-270m, GPU time a step, on / off
# in one process (CUDA_NOTES session 35): depth 0 f16 1.003, q8_0 1.000, turbo3 1.010; depth
# 32,768 f16 1.007, q8_0 1.020, turbo3 1.019. OPENCOTI_CUDA_MERGE_CLUSTER=0: one block a window.
MERGE_CLUSTER = os.environ.get("OPENCOTI_CUDA_MERGE_CLUSTER", "1") != "0"
CLUSTER_MERGES = {"attn_merge"}  # the merge kernels with a cluster form (``name`` + ``_c``)


def merge_launch(T: int, H: int, D: int, cluster: bool = False) -> tuple:
    """``(grid, block)`` of the attention merges (attn_merge, sp_merge and their ``_digits``
    forms; lse_merge.cuh) for ``T`` rows of ``H`` heads of size ``D``: a block per 256-element
    window of a row, ``256 * MERGE_GROUPS`` threads; ``cluster``: the cluster kernels' (attn_merge_c,
    attn_merge_digits_c), ``MERGE_GROUPS`` blocks of 256 threads along z per window. Raises
    ValueError unless ``D`` is a multiple of 32 (a window then touches at most 8 heads, the
    kernel's per-head slots)."""
    if D <= 0 or D % 32:
        raise ValueError(f"attention merge: head size {D} is not a multiple of 32")
    if cluster:
        return (T, -(-H * D // 256), MERGE_GROUPS), (256,)
    return (T, -(-H * D // 256)), (256 * MERGE_GROUPS,)


def _as_srb(rb: int) -> int:
    """Shared-memory stride of a ``rb``-byte K / V row in the streaming kernels (attn_stream.cuh
    ``as_srb``): 16-aligned, an odd multiple of 16."""
    a = -(-rb // 16) * 16
    return a + 16 if a % 32 == 0 else a


def _as_big_d(tiers: bool = False) -> int:
    """The streaming module's ``AS_BIG_D`` (attn_stream.cuh): a KV tier pair's
    ATTN_STREAM_BIG_D (``tiers``; read at call time, as ``_kv_attn_fn`` builds the module with
    it), else f16's AS_BIG_D."""
    return ATTN_STREAM_BIG_D if tiers else AS_BIG_D


def _as_tile(d: int, rb_k: int, rb_v: int, tiers: bool = False) -> int:
    """Cells per tile of the streaming kernels at head size ``d`` for K / V rows of ``rb_k`` /
    ``rb_v`` bytes (attn_stream.cuh ``AsLayout::CT``; the block has ``2 * tile`` threads) in f16's
    module or (``tiers``) a tier pair's: AS_CT_BIG up to head size ``_as_big_d(tiers)`` where two
    stages of it take at most AS_BIG_BYTES, else AS_CT."""
    big = d <= _as_big_d(tiers) and 2 * AS_CT_BIG * (_as_srb(rb_k) + _as_srb(rb_v)) <= AS_BIG_BYTES
    return AS_CT_BIG if big else AS_CT


def _as_smem(d: int, rb_k: int, rb_v: int, tab_k: int = 0, tab_v: int = 0, hn: int = 8, tiers: bool = False) -> int:
    """Dynamic shared memory bytes of attention.cu's streaming kernels at head size ``d`` for K /
    V rows of ``rb_k`` / ``rb_v`` bytes, K / V tables of ``tab_k`` / ``tab_v`` bytes
    (``cuda_kv.stream_table_bytes``) and ``hn`` (8 or 16) query heads per block, in f16's module
    or (``tiers``) a tier pair's (attn_stream.cuh ``AsLayout::BYTES``)."""
    ct = _as_tile(d, rb_k, rb_v, tiers)
    nw = ct // 16
    sb = ct * (_as_srb(rb_k) + _as_srb(rb_v))
    ns = 3 if 3 * sb <= 110592 else 2
    return (2 * hn * (d + 8) * 2 + max(ns * sb, nw * hn * d * 4 + 2 * nw * hn * 4) + ns * ct * 4 + 64
            + tab_k + tab_v)


def _as_heads(g: int, d: int = 0, tiers: bool = False) -> int:
    """Query heads per block of the streaming kernels for ``g`` query heads per kv head at head
    size ``d`` (``tiers``: a KV tier pair's module, else f16's): 8 (one n8 tile of the MMAs'
    columns, attn_stream.cuh) up to 8, else 16 (the ``_h16`` kernels), but 8 for a tier pair above
    head size 128, whose 16-head kernel runs out of registers (nvcc 13, sm_90: 251-255 registers,
    q8_0 / q8_0 spilling 80 bytes): its blocks take 8 heads each and read the K / V rows once per
    8 heads."""
    return 16 if g > 8 and not (tiers and d > 128) else 8


def _as_suffix(hn: int) -> str:
    """The name suffix of a streaming kernel / tier module of ``hn`` query heads per block
    (``_as_heads``): ``_h16`` for 16, none for 8."""
    return "_h16" if hn == 16 else ""


def _raise_smem(f, smem: int):
    """Kernel ``f`` with its dynamic shared memory limit raised to ``smem`` bytes where that
    exceeds the default 48 KiB; returns ``f``."""
    if smem > 48 * 1024:
        f.max_dynamic_shared_size_bytes = smem
    return f


def _bucket(n: int) -> int:
    """Cell-list capacity of a graph key: a power of two >= 256."""
    return max(256, 1 << (max(n, 1) - 1).bit_length())


def stage_parts(parts: list, slots: list[int], out: np.ndarray) -> np.ndarray:
    """Write int arrays ``parts`` into one int32 buffer ``out`` (``sum(slots)`` long), part i at
    offset ``sum(slots[:i])``; a part may be shorter than its slot (a plan's cell list in its
    power-of-two slot), the rest of the slot keeps whatever it held: the kernels read a view's
    cells only inside its ``view_off`` range. Returns the offsets (``len(slots) + 1``, int64).
    Raises ``ValueError`` when a part is longer than its slot or the buffer is too short.
    ``run_graph`` stages a decode step's index arrays this way into a pinned buffer kept per
    graph (no padded copies, no concatenation, one DMA)."""
    o = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(slots, out=o[1:])
    if len(parts) != len(slots) or out.size < o[-1]:
        raise ValueError(f"stage_parts: {len(parts)} parts for {len(slots)} slots, buffer {out.size} < {o[-1]}")
    for a, b, x in zip(o[:-1].tolist(), o[1:].tolist(), parts):
        if len(x) > b - a:
            raise ValueError(f"stage_parts: a part of {len(x)} does not fit its slot of {b - a}")
        out[a:a + len(x)] = x
    return o


def _row_threads(n: int) -> int:
    """Threads of a row kernel (rms_norm, post_norm_add_norm: kernels.cu ``NV`` = 8 values per
    thread in registers) for rows of ``n`` floats: a multiple of 32 in [32, 1024]."""
    return min(1024, max(32, -(-n // (8 * 32)) * 32))


def _warps_per_row(rows: int, cols: int) -> int:
    """Warps per output row of the GEMV: more for long rows of few-row weights (a 7B
    model's ffn_down: 3,584 rows of 18,944), so that enough loads are in flight to
    stream the weight at memory bandwidth; each warp keeps >= 4 units per lane."""
    wpr = 1
    while wpr < 8 and rows * wpr < 16384 and cols // 8 // (64 * wpr) >= 4:
        wpr *= 2
    return wpr


class RotatedQ:
    """Queries ``q [T, n_head, d]`` float32 (RoPE applied) that the fused rope + KV store
    (``CUDABackend.rope_kv_write``, rope_store.cu) has already rotated into its rotated K tier's
    domain, R q (turbo.py's Walsh-Hadamard rotation, bit for bit): the attention kernels score
    them against the stored rotated K rows as they are, where they would otherwise rotate q in
    every block (once per split: 32 to 128 times a layer in a decode step). Only
    ``CUDABackend.attention_cells`` takes one; ``shape`` is q's."""

    __slots__ = ("q",)

    def __init__(self, q):
        self.q = q

    @property
    def shape(self) -> tuple:
        return tuple(self.q.shape)

    def __array__(self, *a, **kw):
        raise TypeError("a RotatedQ holds queries in a rotated K tier's domain, for attention_cells only: "
                        "take .q to read them")


class QTensor:
    """A 2-D GGUF weight on the GPU in its block format.

    ``data``: uint8 CuPy array of the tensor's bytes (row r at ``r * row_bytes``);
    ``ggml_type``: ggml type id; ``shape``: NumPy shape ``(rows, cols)`` =
    ``reversed(ne)`` (``[out, in]`` for a matrix). ``parent``: the row-concatenated weight
    (``CUDABackend.fuse_rows``) whose rows ``row0 ..`` this one is a view of, else None.
    ``tiled``: the rows lie in 16-row tiles (``tile_rows16``: rows ``16 i ..`` still at
    ``16 i * row_bytes``, their blocks interleaved), read only by kernels with a ``_t16`` twin.
    """

    def __init__(self, data, ggml_type: int, shape: tuple[int, int], row_bytes: int, parent=None, row0: int = 0,
                 tiled: bool = False):
        self.data = data
        self.ggml_type = int(ggml_type)
        self.shape = shape
        self.row_bytes = int(row_bytes)
        self.parent = parent
        self.row0 = int(row0)
        self.tiled = bool(tiled)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def to_tiles(self) -> "QTensor":
        """This weight in GGUF rows as a new one in 16-row tiles (``tile_rows16`` on the device):
        the same type, shape and row bytes, no parent. Raises ValueError for a weight already
        tiled, a type without tiled kernels (TILED_BLOCK_BYTES) or rows that are not whole tiles."""
        if self.tiled or self.ggml_type not in TILED_BLOCK_BYTES:
            raise ValueError(f"to_tiles: a {'tiled ' if self.tiled else ''}weight of ggml type {self.ggml_type}")
        rows = self.shape[0]
        t = tile_rows16(self.data.reshape(rows, self.row_bytes), TILED_BLOCK_BYTES[self.ggml_type])
        return QTensor(t.reshape(-1), self.ggml_type, self.shape, self.row_bytes, tiled=True)


class QExperts(ExpertRows):
    """A 3-D GGUF expert tensor ``[n_expert, rows, cols]`` on the GPU in its block format.

    ``data``: uint8 CuPy array of the whole tensor's bytes (expert e at ``e *
    expert_bytes``, its row r at ``+ r * row_bytes``); ``row0``/``shape[1]``: the rows
    this object covers inside each expert (a row slice such as ``gate_up[:, :n_ff]``
    shares ``data``). ``x[e]`` is expert e as a 2-D ``QTensor`` view (no copy), so the
    GEMV / dequantize kernels work per expert; ``x[:, a:b]`` narrows the rows.
    """

    tiled = False  # experts keep GGUF rows (QTensor.tiled); their per-expert views too

    def __init__(self, data, ggml_type: int, shape: tuple[int, int, int], row_bytes: int, expert_bytes: int,
                 row0: int = 0):
        super().__init__(ggml_type, shape, row_bytes, expert_bytes, row0)
        self.data = data

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def base(self):
        """Bytes from row ``row0`` of expert 0 on (the expert GEMV adds ``e * expert_bytes``)."""
        return self.data[self.row0 * self.row_bytes:]

    def __getitem__(self, key):
        n_exp, rows, cols = self.shape
        if isinstance(key, (int, np.integer)):
            e = int(key)
            if not 0 <= e < n_exp:
                raise IndexError(f"expert {e} out of range [0, {n_exp})")
            a = e * self.expert_bytes + self.row0 * self.row_bytes
            return QTensor(self.data[a:a + rows * self.row_bytes], self.ggml_type, (rows, cols), self.row_bytes)
        view = self.row_slice(key)
        if view is not None:
            return view
        raise TypeError(f"QExperts supports [expert] and [:, row_slice], not {key!r}")


class CUDABackend:
    """CuPy implementation of the op interface (DESIGN.md "Backends: one op set").

    Args:
        device: CUDA device index (``--main-gpu``).
    """

    name = "cuda"
    kv_types = cuda_kv.KV_TYPES  # KV tiers with kernels here (all of kv_tiers.TIER_NAMES)
    # run_graph(argmax=True): greedy steps' logits rows reduced on the device before the copy
    # (OPENCOTI_CUDA_DEVICE_ARGMAX=0: copied, then reduced on the host)
    argmax_on_device = os.environ.get("OPENCOTI_CUDA_DEVICE_ARGMAX", "1") != "0"
    # run_graph(wait=False, after=...): a greedy step queued before the previous one is read, its
    # tokens chained from that step's device argmax (ModelRunner.launch)
    async_argmax = argmax_on_device

    def __init__(self, device: int = 0):
        import cupy as cp

        self.cp = cp
        self.xp = cp
        self.device = cp.cuda.Device(device)
        self.device.use()
        self._mods = {"k": load_source(("" if ROPE_ANGLE_PRE else "#define ROPE_ANGLE_PRE 0\n") + read_source("kernels.cu"),
                                       "kernels"),
                      "a": load_source(cuda_kv.f16_attention_source(ATTN_V_PREFETCH, ATTN_EARLY), "attention"),
                      "r": load_module("recurrent.cu"), "s": load_module("shared_prefix.cu"),
                      "m": load_module("mmq.cu"), "i": load_module("gemv_int.cu")}
        self._fns: dict = {}
        self._fits: dict = {}  # streaming attention kernel -> its resident blocks per SM
        self._smem_raised: dict = {}  # streaming attention kernel -> the pinned shared memory it allows
        self._ban_cache: dict = {}  # _ban_index: (rows, ids, n, n_vocab) -> device flat indices
        self._kv_mods: dict = {}  # KV tier modules, compiled on first use (cuda_kv.py)
        self._ub = None
        self._decode_rows = 0  # rows of the current ubatch when each is its own sequence's token, else 0
        # the rotated tiers' sign words for attn_merge (uploaded here: never inside a graph capture)
        self._kv_signs_dev = cp.asarray(cuda_kv.sign_words())
        self._dev: dict = {}
        self._meta: dict = {}
        self._staged = False
        self._capturing = False
        # programmatic dependent launches inside graph captures (cuda_kernels.Kernel)
        self._pdl = pdl_supported(self.device.compute_capability, cp.cuda.runtime.driverGetVersion())
        self._clusters = int(self.device.compute_capability) >= 90  # thread-block clusters (the merges)
        self._side = None  # second stream of forked launches (_fork), made on first use
        self.graphs = os.environ.get("OPENCOTI_CUDA_GRAPHS", "1") != "0"
        # (id of the caller's graph store, key) of the graph that run_graph last ran (benchmarks replay it)
        self.last_graph_key = None
        self._w16 = None  # f16 scratch of _gemm_f16
        self._digits_of = (None, None)  # (array, its gemv_int.cu digits): _digits
        self._digit_cols: set = set()  # row lengths of the loaded K-quant matrices (_row_digits)
        self._split_of = (None, None)  # (array, its f16 split): _gemm_f16x3
        self._f16_ok = True  # False while a prefill-size MoE runs its expert GEMMs
        self._one, self._zero = np.ones(1, np.float32), np.zeros(1, np.float32)  # host alpha / beta
        self._lo_scale = np.full(1, 2.0 ** -12, np.float32)  # _gemm_f16x3's lo terms
        props = cp.cuda.runtime.getDeviceProperties(device)
        self.n_sm = props["multiProcessorCount"]
        self.smem_per_sm = props["sharedMemPerMultiprocessor"]
        self.regs_per_sm = props["regsPerMultiprocessor"]
        self.threads_per_sm = props["maxThreadsPerMultiProcessor"]
        self.blocks_per_sm = props.get("maxBlocksPerMultiProcessor", 32)  # CuPy built for CUDA >= 11
        self.smem_reserved = props.get("reservedSharedMemPerBlock", 1024)
        self.smem_per_block = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                                 device)
        self.device_name = props["name"].decode()

    # -- plumbing -----------------------------------------------------------------------
    def _fn(self, mod: str, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self._kernel(self._mods[mod], name)
        return f

    def _kernel(self, module, name: str) -> Kernel:
        """Kernel ``name`` of a compiled module, launched with PDL while a graph is captured
        (``cuda_kernels.Kernel``)."""
        return Kernel(module.get_function(name), self._pdl_now)

    def _pdl_now(self) -> bool:
        return self._capturing and self._pdl

    def _qfn(self, prefix: str, w: QTensor):
        if w.ggml_type not in QTYPES:
            raise NotImplementedError(f"CUDA backend: no kernels for ggml type {w.ggml_type}")
        if w.tiled:
            if prefix not in TILED_KERNELS:
                raise NotImplementedError(f"CUDA backend: {prefix} cannot read a weight in 16-row tiles")
            return self._fn("k", f"{prefix}_t16_{w.ggml_type}")
        return self._fn("k", f"{prefix}_{w.ggml_type}")

    def zeros(self, shape, dtype):
        """Zero-filled device array (KV storage)."""
        return self.cp.zeros(shape, dtype=dtype)

    def asarray(self, a, dtype=None):
        """Upload a host array (``dtype`` converts first): the receiving end of
        ``offload.transfer`` (partial offload, ``-ngl``)."""
        return self.cp.asarray(a, dtype=dtype)

    def free_memory(self) -> int:
        """Free bytes on the device (``cudaMemGetInfo``), for auto-tier's KV budget."""
        return int(self.cp.cuda.runtime.memGetInfo()[0])

    def to_host(self, x) -> np.ndarray:
        """Device array -> NumPy (synchronizes). While a graph is captured or run
        through ``run_graph`` the device array itself (the graph's output) is returned."""
        if self._staged or isinstance(x, np.ndarray):
            return x
        return self._pinned_host(self.cp.ascontiguousarray(x))

    def _rows_argmax(self, x, ban=None) -> tuple[np.ndarray, np.ndarray]:
        """``sampling.rows_argmax`` of device logits ``x [n, n_vocab]`` (``ban``: ``UBatch.argmax_ban``
        or None), reduced on the device and
        copied as one ``[2, n]`` float64 array (ids < 2^53 and float32 values exact). CuPy's argmax
        takes the first maximum as NumPy's and lands on a NaN (some NaN, not the first) or +inf
        where a row has one, so the logit gathered there is the row's maximum for
        ``Sampler.take_argmax`` in every case. A host array goes to the NumPy version."""
        if isinstance(x, np.ndarray):
            return rows_argmax(x, ban)
        both = self._argmax_pair(x, ban)[1].get()
        return both[0].astype(np.int64), both[1].astype(np.float32)

    def _argmax_pair(self, x, ban=None):
        """Each row's argmax id (device int64 ``[n]``) and the device ``[2, n]`` float64 of ids
        and their logits (``_rows_argmax``). ``ban``'s logits are first set to -inf in ``x``
        itself (a step's output buffer, rewritten by the next step)."""
        cp = self.cp
        if ban is not None:
            x = cp.ascontiguousarray(x)  # (a graph's output is: then x.ravel() is a view of it)
            x.ravel()[self._ban_index(ban, *x.shape)] = -cp.inf
        ids = cp.argmax(x, axis=-1)
        return ids, cp.stack([ids.astype(cp.float64), x[cp.arange(x.shape[0]), ids].astype(cp.float64)])

    def _ban_index(self, ban, n: int, n_vocab: int):
        """The flat indices (device int64 ``[m k]``) of ``UBatch.argmax_ban``'s ``(rows, ids)`` in
        a contiguous ``[n, n_vocab]`` logits buffer, uploaded once per distinct ban (a decode
        batch keeps its rows from step to step; at most 64 are kept). Raises ValueError for a
        row or id outside the buffer (the device write is not bounds-checked)."""
        rows, ids = (np.asarray(a, dtype=np.int64) for a in ban)
        if ((rows < 0) | (rows >= n)).any() or ((ids < 0) | (ids >= n_vocab)).any():
            raise ValueError(f"argmax_ban outside the logits [{n}, {n_vocab}]: rows {rows.tolist()}, ids {ids.tolist()}")
        key = (rows.tobytes(), ids.tobytes(), int(n), int(n_vocab))
        dev = self._ban_cache.pop(key, None)
        if dev is None:
            dev = self.cp.asarray((rows[:, None] * n_vocab + ids[None, :]).ravel())
            while len(self._ban_cache) >= 64:
                self._ban_cache.pop(next(iter(self._ban_cache)))
        self._ban_cache[key] = dev  # most recent last
        return dev

    def _argmax_async(self, x, st, ban=None):
        """``_rows_argmax`` of device logits ``x`` without waiting: a ``runner.StepResult`` whose
        pair is copied into pinned memory on stream ``st`` (read after an event on it), with the
        ids kept on the device (``ids_dev``) for a chained step."""
        import cupyx

        cp = self.cp
        ids, both = self._argmax_pair(x, ban)
        host = cupyx.empty_pinned(both.shape, dtype=np.float64)
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, both.data.ptr, both.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, st.ptr)
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(st)

        def fetch(both=both):  # ``both`` lives until the copy has ended
            return host[0].astype(np.int64), host[1].astype(np.float32)

        return StepResult(wait=ev.synchronize, fetch=fetch, ids_dev=ids)

    def _pinned_host(self, x) -> np.ndarray:
        """Device -> host copy into page-locked memory from CuPy's pinned pool (a DMA at
        full link speed, no staging copy); the returned array owns that memory."""
        import cupyx

        if isinstance(x, np.ndarray):  # a forward that produced no logits returns a host array
            return x
        out = cupyx.empty_pinned(x.shape, dtype=x.dtype)
        x.get(out=out)
        return out

    def begin_ubatch(self, ub) -> None:
        """Upload the ubatch's token ids, positions and output rows (one copy)."""
        cp = self.cp
        if self._staged:  # run_graph staged them in fixed buffers already
            return
        self._decode_rows = _decode_rows(ub)
        host = np.concatenate([ub.tokens, ub.pos, ub.out_rows]).astype(np.int32)
        dev = cp.asarray(host)
        n, m = len(ub.tokens), len(ub.out_rows)
        self._ub = ub
        self._dev = {id(ub.tokens): dev[:n], id(ub.pos): dev[n:2 * n], id(ub.out_rows): dev[2 * n:2 * n + m]}
        self._meta = {}

    def _idx(self, a):
        """int32 device copy of an index array (the ubatch's arrays are uploaded already)."""
        if isinstance(a, self.cp.ndarray):
            return a.astype(self.cp.int32, copy=False)
        ub = self._ub
        if ub is not None and (a is ub.tokens or a is ub.pos or a is ub.out_rows):
            return self._dev[id(a)]
        return self.cp.asarray(np.asarray(a, dtype=np.int32))

    # -- weights ------------------------------------------------------------------------
    def load_weight(self, gguf: GGUFFile, name: str):
        """A matrix as a ``QTensor`` (raw GGUF blocks on the device); a 3-D expert tensor
        ``[n_expert, rows, cols]`` as a ``QExperts``; a vector (norm weights, biases, rope
        factors) as a float32 CuPy array, and so is a matrix the block kernels cannot
        read (one row, or a row length that is not a multiple of 32: e.g. the
        ``ssm_conv1d`` taps ``[channels, 4]``, the shared-expert gate ``[1, n_embd]``)."""
        info = gguf.tensors[name]
        if len(info.ne) == 1:
            return self.cp.asarray(gguf.dequantize(name, np.float32))
        if len(info.ne) not in (2, 3):
            raise NotImplementedError(f"CUDA backend: {name} has {len(info.ne)} dims")
        cols = info.ne[0]
        if len(info.ne) == 2 and (info.ne[1] == 1 or cols % 32):
            return self.cp.asarray(gguf.dequantize(name, np.float32))
        if int(info.ggml_type) not in QTYPES:
            raise NotImplementedError(f"CUDA backend: {name} has unsupported type {info.ggml_type.name}")
        if cols % 32:
            raise NotImplementedError(f"CUDA backend: {name}: expert rows of {cols} (not a multiple of 32)")
        raw = gguf.raw(name)  # [rows (all experts), row_bytes]
        data = self.cp.asarray(np.ascontiguousarray(raw).reshape(-1))
        row_bytes = raw.shape[1] if raw.shape[0] else 0
        if len(info.ne) == 3:
            n_exp, rows = info.ne[2], info.ne[1]
            return QExperts(data, int(info.ggml_type), (n_exp, rows, cols), row_bytes, rows * row_bytes)
        if int(info.ggml_type) in IMMA_TYPES and name.startswith("blk."):
            self._digit_cols.add(cols)  # a layer's input length: one-row norms feeding it write digits
        return self._matrix(data, int(info.ggml_type), info.ne[1], cols, row_bytes)

    def _matrix(self, data, ggml_type: int, rows: int, cols: int, row_bytes: int) -> QTensor:
        """A ``QTensor`` of GGUF rows ``data`` (uint8 device array), in 16-row tiles when
        ``tiles_weight`` says so (the GGUF-row upload freed)."""
        w = QTensor(data, ggml_type, (rows, cols), row_bytes)
        return w.to_tiles() if tiles_weight(ggml_type, rows, cols) else w

    def fuse_rows(self, gguf: GGUFFile, names: list):
        """Load matrices ``names`` of ``gguf`` (one ggml type and row length, e.g. a layer's q / k /
        v projections or its FFN gate and up) as one row-concatenated weight, uploaded once, so
        that ``mul_mat_split`` and ``gated_ffn`` read them in one launch (vLLM's merged QKV /
        gate-up linear layers; GGUF rows are independent runs of blocks, so the bytes are the
        rows' own). Returns one ``QTensor`` view per name (its type,
        shape and bytes; ``parent`` = the fused weight, ``row0`` = its first row there), or None,
        loading nothing, when they cannot be fused: ``OPENCOTI_CUDA_FUSE=0``, fewer than two,
        types or row lengths that differ, a matrix ``load_weight`` keeps dense."""
        if not FUSE or len(names) < 2:
            return None
        infos = [gguf.tensors[n] for n in names]
        keys = {(int(t.ggml_type), tuple(t.ne[:1]), len(t.ne)) for t in infos}
        t, (cols,), nd = next(iter(keys))
        if len(keys) != 1 or nd != 2 or t not in QTYPES or cols % 32 or any(i.ne[1] == 1 for i in infos):
            return None
        raws = [gguf.raw(n) for n in names]  # [rows, row_bytes] each
        return self._fused_weight(raws, t, cols, register=names[0].startswith("blk."))

    def _fused_weight(self, raws: list, ggml_type: int, cols: int, register: bool = True) -> list:
        """``fuse_rows`` on host block bytes ``raws`` (uint8 ``[rows_i, row_bytes]`` each, one type
        ``ggml_type`` and row length ``cols``): the views. ``register``: the rows' length joins
        ``_digit_cols`` (a layer's K-quant weight)."""
        cp = self.cp
        rb = raws[0].shape[1]
        rows = [r.shape[0] for r in raws]
        data = cp.asarray(np.concatenate([np.ascontiguousarray(r).reshape(-1) for r in raws]))
        # in 16-row tiles only when every view is whole tiles (its rows a multiple of 16), so that
        # each view's bytes are a tiled weight of its own
        if all(n % 16 == 0 for n in rows):
            parent = self._matrix(data, ggml_type, sum(rows), cols, rb)
        else:
            parent = QTensor(data, ggml_type, (sum(rows), cols), rb)
        data = parent.data
        views, r = [], 0
        for n in rows:
            views.append(QTensor(data[r * rb:(r + n) * rb], ggml_type, (n, cols), rb, parent=parent, row0=r,
                                 tiled=parent.tiled))
            r += n
        if register and ggml_type in IMMA_TYPES:
            self._digit_cols.add(cols)
        return views

    @staticmethod
    def _fused_run(ws, i: int) -> int:
        """End of the run of ``ws[i:]`` that are, in order, the views of one fused weight
        (``fuse_rows``) covering it whole; ``i + 1`` when there is none."""
        P = getattr(ws[i], "parent", None)
        if P is None or ws[i].row0:
            return i + 1
        j, r = i, 0
        while j < len(ws) and getattr(ws[j], "parent", None) is P and ws[j].row0 == r:
            r += ws[j].shape[0]
            j += 1
        return j if r == P.shape[0] else i + 1

    def dequantize(self, w: QTensor, dtype=np.float32):
        """Whole weight as a dense ``[rows, cols]`` device array (float32 or float16)."""
        cp = self.cp
        rows, cols = w.shape
        half = np.dtype(dtype) == np.float16
        out = cp.empty((rows, cols), dtype=np.float16 if half else np.float32)
        n = rows * (cols // 32)
        self._qfn("dequant_f16" if half else "dequant_f32", w)(
            ((n + 255) // 256,), (256,), (w.data, np.int64(w.row_bytes), out, np.int32(rows), np.int32(cols)))
        return out

    # -- matmul / rows --------------------------------------------------------------------
    def mul_mat(self, x, w):
        """``x [n, k] @ w[out, k].T`` -> ``[n, out]`` float32. ``w``: a ``QTensor`` or a dense
        device array; a dense float32 matrix with rows of a multiple of 8 goes through the
        F32 GEMV (units of 8 floats) for up to ``GEMV_MAX_TOKENS`` rows, so no cuBLAS call
        lands in a captured decode graph (e.g. Qwen's shared-expert gate ``[1, n_embd]``,
        a small per-layer projection); anything else goes to cuBLAS."""
        return self._mul_mat(x, w, False)

    def mul_mat_partials(self, x, w):
        """``mul_mat`` for a product that ``add_rms_norm`` takes next (the arch's ``project``):
        gemmi's split-K partials come back unsummed as a ``SplitK``, which only ``add_rms_norm``
        reads (it sums them in its own kernel: one launch fewer), else the product ``[n, out]``."""
        y, n_split = self.mul_mat_parts(x, w)
        return SplitK(y, n_split) if n_split > 1 else y

    def mul_mat_parts(self, x, w) -> tuple:
        """``mul_mat`` leaving gemmi's split-K partial slabs unsummed for a consumer that adds
        them itself (in split order, as ``mmq_reduce``: the same bits): ``(slabs [n_split, n,
        out] float32, n_split)``, or ``(y [n, out], 1)`` where nothing is split."""
        r = self._mul_mat(x, w, True)
        return r if isinstance(r, tuple) else (r, 1)

    def _mul_mat(self, x, w, parts: bool):
        cp = self.cp
        if not isinstance(w, QTensor):
            if (x.shape[0] > GEMV_MAX_TOKENS or w.ndim != 2 or w.dtype != np.float32 or w.shape[1] % 8
                    or not w.flags.c_contiguous):
                return cp.matmul(x, w.T)
            w = QTensor(w.reshape(-1).view(cp.uint8), 0, tuple(w.shape), 4 * w.shape[1])
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n, k = x.shape
        rows, cols = w.shape
        if k != cols:
            raise ValueError(f"mul_mat: x has {k} columns, weight {cols}")
        # float32 weights (MoE routers, small projections) are never rounded to f16, as in
        # llama.cpp: a router's near-tied experts flip under f16 inputs (the qwen3next finding)
        f16 = PREFILL_GEMM == "f16" if n > GEMV_MAX_TOKENS else bool(F16_GEMM_MIN_ROWS) and n >= F16_GEMM_MIN_ROWS
        if (f16 and cols % 32 == 0 and w.ggml_type != 0 and self._f16_ok and not self._capturing):
            return self._gemm_f16(x, w)
        if n > GEMV_MAX_TOKENS:
            # (bf16 weights may lie outside the f16 range: float32; small weights: float32, as
            # the split's extra launches cost more than its arithmetic saves)
            if (PREFILL_GEMM == "f16x3" and cols % 32 == 0 and w.ggml_type not in (0, 30)
                    and rows * cols >= F16X3_MIN_WEIGHT):
                return self._gemm_f16x3(x, w)
            return cp.matmul(x, self.dequantize(w).T)
        if self._imma(n, w, FUSE and x is self._digits_of[0]):
            return self._gemvi(self._digits(x), w, parts)
        if MMQ_MIN_ROWS and n >= MMQ_MIN_ROWS and w.ggml_type != 0:
            return self._mmq(x, w)
        y = cp.empty((n, rows), dtype=cp.float32)
        rpw = 1  # rows per warp (one token): a warp's rows share x loads
        if n == 1 and rows * cols >= GEMV_RPW2_MIN_ELEMENTS:
            rpw = 8 if GEMV_RPW8_MIN_ROWS and rows >= GEMV_RPW8_MIN_ROWS and cols <= GEMV_RPW8_MAX_COLS else 2
        fn = self._qfn("gemv8" if n > 1 else f"gemv1r{rpw}" if rpw > 1 else "gemv1", w)
        groups = (rows + rpw - 1) // rpw
        wpr = _warps_per_row(groups, cols)
        fn(((n + GEMV_TILE - 1) // GEMV_TILE, (groups * wpr + 7) // 8), (256,),
           (w.data, np.int64(w.row_bytes), x, y, np.int32(rows), np.int32(cols), np.int32(n), np.int32(wpr)))
        return y

    def mul_mat_split(self, x, ws, bs=None) -> list:
        """``[x @ w.T + b for w, b in zip(ws, bs)]`` (``bs`` None: no biases; a None bias: none),
        each ``[n, rows_i]`` float32. Consecutive views covering one fused weight (``fuse_rows``)
        run as one product and come back as column slices of its output (contiguous for one row;
        a bias makes its slice a new array); prompt
        chunks (more than ``GEMV_MAX_TOKENS`` rows) take the weights one by one."""
        return self._mul_mat_split(x, ws, bs, False)

    def mul_mat_split_partials(self, x, ws) -> list:
        """``mul_mat_split(x, ws)`` (no biases) for products that ``rope_kv_write`` takes next (the
        arch's attention): a product that gemmi splits comes back as ``SplitK`` column slices of
        its unsummed slabs (the kernel sums them: one ``mmq_reduce`` launch fewer), the others as
        ``mul_mat_split`` returns them."""
        return self._mul_mat_split(x, ws, None, True)

    def _mul_mat_split(self, x, ws, bs, partials: bool) -> list:
        bs = list(bs) if bs is not None else [None] * len(ws)
        out, i = [], 0
        duo = self._duo(x, ws)
        while i < len(ws):
            # (prompt-size products one weight at a time: their dequantized scratch stays a weight's)
            j = self._fused_run(ws, i) if x.shape[0] <= GEMV_MAX_TOKENS else i + 1
            w = ws[i] if j == i + 1 else ws[i].parent
            if i in duo:
                y, n_split = duo[i], 1
            else:
                y, n_split = self.mul_mat_parts(x, w) if partials else (self.mul_mat(x, w), 1)
            for v, bias in zip(ws[i:j], bs[i:j]):
                a, b = (v.row0, v.row0 + v.shape[0]) if j > i + 1 else (0, y.shape[-1])
                if n_split > 1:
                    part = SplitK(y[:, :, a:b], n_split)
                elif y.shape[0] == 1:  # one row: a contiguous slice
                    part = y.reshape(-1)[a:b].reshape(1, -1)
                else:
                    part = y[:, a:b]
                out.append(part if bias is None else part + bias)
            i = j
        return out

    def _digits(self, x):
        """float32 activations ``x [n, k]`` (k a multiple of 256, n <= 64) as gemv_int.cu's
        digit columns: ``(xq, xs, xm, n, nt, nd)`` (layout in gemv_int.cu's header; ``nd`` digits
        per value, ``imma_digits``: 2 for gemmi in a batched decode step, else 3; ``nt`` MMA
        column tiles per block: 1 for up to 8 / nd rows, 3 up to 24 / nd, else 6, and
        ``gemmi_tiles`` for gemmi beyond ``IMMA_MAX_ROWS``). The last input's digits are kept (with a
        reference to the array, so its memory is not reused) and returned again for the same array
        object: attention's q / k / v projections quantize their input once. Relies on the op
        set's rule that ops never write their inputs in place."""
        if x is self._digits_of[0]:
            return self._digits_of[1]
        key = x  # cached under the caller's array, also when a misaligned one is copied below
        if x.data.ptr % 16:  # xq_digits reads float4s
            x = x.copy()
        n, k = x.shape
        d = self._digit_arrays(n, k)
        xq, xs, xm, _, nt, nd = d
        cw = 8 * nt
        ng = xs.shape[1] // cw
        self._fn("i", "xq_digits")((k // 256, ng * -(-cw // nd)), (32,),
                                   (x, xq, xs, xm, np.int32(n), np.int32(k), np.int32(cw), np.int32(xs.shape[1]),
                                    np.int32(nd)))
        self._digits_of = (key, d)
        return d

    def _digit_arrays(self, n: int, k: int) -> tuple:
        """Empty digit arrays for ``n`` rows of ``k`` values: ``(xq, xs, xm, n, nt, nd)`` as
        ``_digits`` returns them (``nd`` from ``imma_digits``; ``nt`` column tiles)."""
        cp = self.cp
        nd = imma_digits(n, self._decode_rows == n)
        # gemmi (more than IMMA_MAX_ROWS rows) takes tiles of 16 or 32 tokens (gemmi_tiles)
        if n > IMMA_MAX_ROWS:
            nt = gemmi_tiles(n, nd, self.smem_per_block)
        else:
            nt = 6 if n > 24 // nd else 3 if n > 8 // nd else 1
        cw = 8 * nt
        ncp = -(-n // (cw // nd)) * cw
        return (cp.empty((ncp, k), dtype=cp.int8), cp.empty((k // 256, ncp), dtype=cp.float32),
                cp.empty((k // 256, ncp, 16), dtype=cp.int8), n, nt, nd)

    def _row_digits(self, y):
        """For ``y [n, k]`` that an integer GEMV will read (``k`` among the loaded layers' K-quant
        weights' row lengths, ``_digit_cols``; one row, or the rows of gemmi, whose layouts put row
        t's digit i in column D t + i): digit arrays (``_digit_arrays``) for the kernel writing
        ``y`` to fill (the rows' digit columns; the others stay unset, which gemv_int.cu never reads
        into a result), registered as ``y``'s (``_digits_of``); returns the kernel's trailing
        arguments ``(xq, xs, xm, ncp, D)``, else ``_NO_DIGITS``."""
        n, k = y.shape
        gemmi = IMMA_BATCH and IMMA_MAX_ROWS < n <= GEMV_MAX_TOKENS
        if not (FUSE and IMMA_MAX_ROWS and (n == 1 or gemmi) and k % 256 == 0 and k in self._digit_cols
                and y.data.ptr % 16 == 0):
            return _NO_DIGITS
        d = self._digit_arrays(n, k)
        self._digits_of = (y, d)
        return (d[0], d[1], d[2], np.int32(d[1].shape[1]), np.int32(d[5]))

    @staticmethod
    def _imma(n: int, w, digits: bool = False) -> bool:
        """Whether ``n`` activation rows times ``w`` run on the integer tensor cores (gemv_int.cu;
        its Q4_K loads are 16-byte vectors, so the weight's bytes must start 16-byte aligned, as
        every tensor upload and expert / row slice of one does). ``digits``: the activations'
        digits exist already (no digit pass to pay), so small one-row weights take it too; a weight
        in 16-row tiles always does (the float GEMV cannot read it)."""
        return (isinstance(w, QTensor) and w.ggml_type in IMMA_TYPES and 0 < n and w.data.data.ptr % 16 == 0
                and (n > 1 or digits or w.tiled or w.shape[0] * w.shape[1] >= IMMA_MIN_WEIGHT)
                and (n <= IMMA_MAX_ROWS or (IMMA_MAX_ROWS > 0 and IMMA_BATCH and n <= GEMV_MAX_TOKENS)))

    def _gemvi(self, digits, w: QTensor, parts: bool = False):
        """``x @ w.T`` -> ``[n, rows]`` float32 for a Q4_K / Q6_K ``w`` and ``x`` given as
        ``_digits(x)``, on the integer tensor cores (gemv_int.cu): up to ``IMMA_MAX_ROWS`` rows 16
        weight rows per block (one column tile: 16 GEMVI_ROW_TILES), the super-blocks split over
        up to 8 warps (``_gemvi_warps``; one column tile streams them through shared memory,
        ``gemvi_ring``) and summed in warp order;
        more rows (up to 64) the tiled ``gemmi`` (64 weight rows x 16 or 32 tokens per block,
        ``gemmi_tiles``; weights and
        digits through shared-memory stages, ``gemmi_ring_stages``; the super-blocks split over
        blocks, ``gemmi_splits``, partial sums added in split order by ``mmq_reduce``, or by the
        consumer: ``parts``).
        Deterministic either way. ``parts``: gemmi returns ``(slabs, n_split)``, its partial
        slabs unsummed (``mul_mat_parts``); the other paths return ``y`` as always.
        Relative error ~3e-7 of the largest |x w| term against float64 (float32 level) with 3
        digits; with 2 the activations carry 2^-16 of their block maximum (test_gemvi_matches_reference).
        Graph-safe."""
        cp = self.cp
        xq, xs, xm, n, nt, nd = digits
        rows, k = w.shape
        tl = "_t16" if w.tiled else ""  # the kernels' twins for a weight in 16-row tiles
        if n > IMMA_MAX_ROWS:  # batched decode: the tiled kernel
            nt = gemmi_kernel_tiles(nt, nd, w.ggml_type, self.smem_per_block)
            stages = gemmi_ring_stages(nt)
            smem = gemmi_ring_smem(nt, stages, w.ggml_type)
            ntok = -(-n // (8 * nt // nd))  # token groups of 16 or 32 tokens
            kw = {}
            if stages and smem <= self.smem_per_block:
                kw["shared_mem"] = smem
                fn = self._big_smem_fn("i", f"gemmi_{w.ggml_type}_s{stages}_n{nt}{tl}", kw["shared_mem"])
                per_sm = max(1, self._blocks_per_sm(128, fn.raw.num_regs, smem))
            else:
                fn, per_sm = self._fn("i", f"gemmi_{w.ggml_type}_o{GEMMI_BLOCKS}_n{nt}{tl}"), GEMMI_BLOCKS
            nr = -(-rows // 64)  # row blocks
            n_split = gemmi_splits(ntok * nr, k // 256, self.n_sm, per_sm)
            out = cp.empty((n, rows) if n_split == 1 else (n_split, n, rows), dtype=cp.float32)
            fn((ntok, nr, n_split), (128,),
               (w.data, np.int64(w.row_bytes), xq, xs, xm, out, np.int32(rows), np.int32(k), np.int32(n),
                np.int32(xs.shape[1]), np.int32(nd)), **kw)
            if parts:
                return out, n_split
            if n_split == 1:
                return out
            y = cp.empty((n, rows), dtype=cp.float32)
            self._fn("m", "mmq_reduce")(((y.size + 255) // 256,), (256,),
                                        (out, y, np.int64(y.size), np.int32(n_split)))
            return y
        nsb, ncb = k // 256, xs.shape[1] // (8 * nt)
        y = cp.empty((n, rows), dtype=cp.float32)
        args = (w.data, np.int64(w.row_bytes), xq, xs, xm, y, np.int32(rows), np.int32(k), np.int32(n),
                np.int32(xs.shape[1]), np.int32(nd))
        if nt > 1:
            ks = max(1, min(IMMA_WARPS[nt], nsb))
            self._fn("i", f"gemvi_{w.ggml_type}_n{nt}{tl}")((ncb, -(-rows // 16)), (32 * ks,), args)
            return y
        rt = gemvi_row_tiles(w.ggml_type, rows, self.n_sm)
        ntiles = -(-rows // (16 * rt))
        # limit raised once to the device's: _gemvi_warps keeps every block within it
        fn = self._big_smem_fn("i", f"gemvi_{w.ggml_type}_n1_s{GEMVI_STAGES}" + ("_r2" if rt == 2 else "") + tl,
                               self.smem_per_block)
        warp_bytes = gemvi_warp_bytes(w, rt)
        ks = self._gemvi_warps(ntiles * ncb, nsb, warp_bytes, fn.raw.num_regs)
        fn((ncb, ntiles), (32 * ks,), args, shared_mem=ks * warp_bytes)
        return y

    def _duo(self, x, ws) -> dict:
        """``{index in ws: product}`` for the first two products of ``mul_mat_split(x, ws)`` (a
        fused weight's run of views counts as one) when one token row times both runs as one
        gemvi_duo grid (``_gemvi_duo``): each the one-row ring GEMV ``mul_mat`` would take, of a
        type pair built (GEMVI_DUO_KERNELS); else ``{}`` and ``mul_mat_split`` takes them one by
        one."""
        if not (GEMVI_DUO and GEMVI_STAGES == 2 and x.shape[0] == 1 and len(ws) >= 2 and FUSE
                and not (F16_GEMM_MIN_ROWS and 1 >= F16_GEMM_MIN_ROWS)):  # as _mul_mat's f16 choice
            return {}
        j1 = self._fused_run(ws, 0)
        if j1 >= len(ws):
            return {}
        j2 = self._fused_run(ws, j1)
        w1 = ws[0] if j1 == 1 else ws[0].parent
        w2 = ws[j1] if j2 == j1 + 1 else ws[j1].parent
        # the activation's digits written by the norm before (FUSE): mul_mat would take the
        # integer GEMV for both; anything else keeps mul_mat's own choice
        if x is not self._digits_of[0] or not all(
                isinstance(w, QTensor) and w.shape[1] == x.shape[1] and self._imma(1, w, True) for w in (w1, w2)):
            return {}
        d = self._digits_of[1]
        if d[4] != 1:  # one column tile: the ring GEMV
            return {}
        ys = self._gemvi_duo(d, w1, w2)
        return {} if ys is None else {0: ys[0], j1: ys[1]}

    def _gemvi_duo(self, digits, w1: QTensor, w2: QTensor):
        """``(x @ w1.T, x @ w2.T)``, ``[1, rows_i]`` float32 each, for one token row ``x`` given
        as ``_digits(x)``, in one gemv_int.cu gemvi_duo grid: w1's row tiles then w2's, each
        tile as gemvi_ring computes it alone (the same kernel code and super-block split per
        warp for the same warp count: the same bits when ``_gemvi_warps`` gives the pair's grid
        the warps it gives each weight's); None when the (type, row tiles) pair is not built
        (GEMVI_DUO_KERNELS) or one weight is in 16-row tiles and the other not."""
        cp = self.cp
        xq, xs, xm, n, nt, nd = digits
        k = w1.shape[1]
        rts = [gemvi_row_tiles(w.ggml_type, w.shape[0], self.n_sm) for w in (w1, w2)]
        key = (w1.ggml_type, rts[0], w2.ggml_type, rts[1])
        if key not in GEMVI_DUO_KERNELS or w2.shape[1] != k or w1.tiled != w2.tiled:
            return None
        nsb, ncb = k // 256, xs.shape[1] // 8
        ny = [-(-w.shape[0] // (16 * rt)) for w, rt in zip((w1, w2), rts)]
        fn = self._big_smem_fn("i", "gemvi_duo_{}r{}_{}r{}".format(*key) + ("_t16" if w1.tiled else ""),
                               self.smem_per_block)
        warp_bytes = max(gemvi_warp_bytes(w, rt) for w, rt in zip((w1, w2), rts))
        ks = self._gemvi_warps((ny[0] + ny[1]) * ncb, nsb, warp_bytes, fn.raw.num_regs)
        y1 = cp.empty((n, w1.shape[0]), dtype=cp.float32)
        y2 = cp.empty((n, w2.shape[0]), dtype=cp.float32)
        fn((ncb, ny[0] + ny[1]), (32 * ks,),
           (w1.data, np.int64(w1.row_bytes), xq, xs, xm, y1, np.int32(w1.shape[0]), np.int32(k), np.int32(n),
            np.int32(xs.shape[1]), np.int32(nd), w2.data, np.int64(w2.row_bytes), y2, np.int32(w2.shape[0]),
            np.int32(ny[0])), shared_mem=ks * warp_bytes)
        return y1, y2

    def _gemvi_warps(self, blocks: int, nsb: int, warp_bytes: int, regs: int) -> int:
        """Warps per row tile (16 GEMVI_ROW_TILES rows) of gemv_int.cu's gemvi for a grid of
        ``blocks`` tiles of ``nsb`` super-blocks, ``warp_bytes`` of shared memory per warp and
        ``regs`` registers per thread: the power of two nearest GEMVI_WARPS_PER_SM warps per SM in
        all (<= GEMVI_MAX_WARPS, <= nsb), halved while the grid would not be resident at once
        (registers, shared memory) if a smaller one would be; a forced count (GEMVI_WARPS) is
        halved until one block fits the SM (``_blocks_per_sm``) and its shared memory per block."""
        if GEMVI_WARPS:
            ks = max(1, min(GEMVI_WARPS, nsb, 32))
        else:
            ks = self._gemvi_warps_auto(blocks, nsb, warp_bytes, regs)
        # one block must fit (e.g. 4 slots on sm_86; a forced count of a many-register kernel)
        def fits(ks: int) -> bool:
            return ks * warp_bytes <= self.smem_per_block and self._blocks_per_sm(32 * ks, regs, ks * warp_bytes) > 0

        while ks > 1 and not fits(ks):
            ks //= 2
        return ks

    def _gemvi_warps_auto(self, blocks: int, nsb: int, warp_bytes: int, regs: int) -> int:
        # the power of two nearest the wanted warps per tile, then the residency halving
        want = self.n_sm * GEMVI_WARPS_PER_SM / blocks
        ks = 1
        while 2 * ks <= min(GEMVI_MAX_WARPS, nsb) and 2 * ks <= 1.5 * want:
            ks *= 2

        def resident(ks: int) -> int:
            return self._blocks_per_sm(32 * ks, regs, ks * warp_bytes)

        while ks > 1 and blocks > self.n_sm * resident(ks) and blocks <= self.n_sm * resident(ks // 2):
            ks //= 2
        return ks

    def _blocks_per_sm(self, threads: int, regs: int, smem: int) -> int:
        """Resident blocks per SM of ``threads`` threads of ``regs`` registers each and ``smem``
        bytes of shared memory, by the CUDA toolkit's occupancy rules for compute capability
        8.0-9.0 (cuda_occupancy.h, cudaOccMaxBlocksPerSMRegsLimit and its shared memory, thread
        and block limits): a warp's registers are allocated in units of 256 within each of the
        SM's 4 register sub-partitions (so the warps they allow come in groups of 4); shared
        memory in units of 128 bytes plus what the runtime reserves per block
        (``smem_reserved``: 1 KiB); at most the SM's threads (``threads_per_sm``: 2,048 on sm_80
        / sm_90, 1,536 on sm_86 / sm_89) and blocks (``blocks_per_sm``: 32, 16 on sm_86, 24 on
        sm_89). 0 when one block does not fit."""
        warps = -(-threads // 32)
        reg_warps = self.regs_per_sm // (-(-max(regs, 1) * 32 // 256) * 256) // 4 * 4
        smem_alloc = -(-smem // 128) * 128 + self.smem_reserved
        return min(self.blocks_per_sm, reg_warps // warps, self.threads_per_sm // (32 * warps),
                   self.smem_per_sm // smem_alloc)

    def _mmq(self, x, w: QTensor):
        """``x [n, k] @ w.T`` -> ``[n, rows]`` float32 for ``n <= GEMV_MAX_TOKENS`` rows on tensor
        cores (``mmq.cu``): blocks of ``MMQ_BM`` weight rows, the columns split so that the grid
        has at least two blocks per SM, partial slabs summed in split order (deterministic).
        Graph-safe (no host sync, no cuBLAS). Precondition: |x| < 65504 (the f16 range of the
        operands' high terms)."""
        if w.tiled:
            raise NotImplementedError("CUDA backend: mmq cannot read a weight in 16-row tiles")
        cp = self.cp
        n, cols = x.shape
        rows = w.shape[0]
        nb = (rows + MMQ_BM - 1) // MMQ_BM
        nst = (cols + MMQ_BK - 1) // MMQ_BK
        want = min(nst, max(1, -(-2 * self.n_sm // nb)))  # column splits for >= 2 blocks per SM
        sps = (nst + want - 1) // want  # stages per split
        n_split = (nst + sps - 1) // sps
        f = self._mmq_fn(w.ggml_type)
        smem = (2 * MMQ_BM + 2 * ((n + 7) & ~7)) * MMQ_LD * 2
        y = cp.empty((n, rows), dtype=cp.float32)
        out = y if n_split == 1 else cp.empty((n_split, n, rows), dtype=cp.float32)
        f((nb, n_split), (256,), (w.data, np.int64(w.row_bytes), x, out, np.int32(rows), np.int32(cols), np.int32(n),
                                  np.int32(sps)), shared_mem=smem)
        if n_split > 1:
            self._fn("m", "mmq_reduce")(((y.size + 255) // 256,), (256,),
                                        (out, y, np.int64(y.size), np.int32(n_split)))
        return y

    def _mmq_fn(self, ggml_type: int):
        """``mmq_<type>`` with its dynamic shared memory limit raised (once) to the 64-row maximum."""
        return self._big_smem_fn("m", f"mmq_{ggml_type}", (2 * MMQ_BM + 2 * GEMV_MAX_TOKENS) * MMQ_LD * 2)

    def _gemm_f16(self, x, w: QTensor):
        """``x [n, k] @ w.T`` through cuBLAS ``gemmEx``: the weight dequantized to f16 into the
        persistent scratch (``_scratch16``), ``x`` rounded to f16, f32 accumulation
        (CUBLAS_COMPUTE_32F) and f32 output ``[n, rows]``."""
        rows, cols = w.shape
        n = x.shape[0]
        w16 = self._dequant_scratch("dequant_f16", w, 1)
        x16 = x.astype(self.cp.float16)
        y = self.cp.empty((n, rows), dtype=self.cp.float32)
        self._gemm_ex(rows, n, cols, self._one, w16.data.ptr, cols, x16.data.ptr, cols, self._zero, y)
        return y

    def _scratch16(self, need: int):
        """The persistent f16 scratch of the prefill GEMMs, at least ``need`` halves (one per
        backend, grown to the largest weight seen; raw cudaMalloc, allowed under relaxed stream
        capture; replays and prefills are serialized on one stream, so sharing it is safe)."""
        cp = self.cp
        if self._w16 is None or self._w16.size < need:
            self._w16 = None
            mem = cp.cuda.Memory(2 * need)
            self._w16 = cp.ndarray((need,), dtype=cp.float16, memptr=cp.cuda.MemoryPointer(mem, 0))
        return self._w16[:need]

    def _dequant_scratch(self, kernel: str, w: QTensor, halves_per_value: int):
        """``w`` dequantized by kernels.cu's ``kernel`` (``dequant_f16`` / ``dequant_f16x2``) into
        the f16 scratch: ``halves_per_value * rows * cols`` halves."""
        rows, cols = w.shape
        out = self._scratch16(halves_per_value * rows * cols)
        nch = rows * (cols // 32)
        self._qfn(kernel, w)(((nch + 255) // 256,), (256,),
                             (w.data, np.int64(w.row_bytes), out, np.int32(rows), np.int32(cols)))
        return out

    def _gemm_ex(self, rows: int, n: int, k: int, alpha, a: int, lda: int, b: int, ldb: int, beta, y) -> None:
        """One cuBLAS ``gemmEx`` in the row-major terms of ``mul_mat``: ``y [n, rows]`` (float32)
        = alpha * B @ A^T + beta * y, where A is ``[rows, k]`` f16 at device address ``a`` with
        row stride ``lda`` halves and B ``[n, k]`` f16 at ``b`` with row stride ``ldb``; f32
        accumulation (CUBLAS_COMPUTE_32F); ``alpha`` / ``beta`` host float32 arrays of one value."""
        from cupy_backends.cuda.libs import cublas

        handle = self.cp.cuda.device.get_cublas_handle()
        mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, _PTR_MODE_HOST)
        try:  # column-major: y^T [rows, n] = (A^T as [k, rows])^T @ (B^T as [k, n])
            cublas.gemmEx(handle, _OP_T, _OP_N, rows, n, k, alpha.ctypes.data, a, _CUDA_R_16F, lda, b, _CUDA_R_16F,
                          ldb, beta.ctypes.data, y.data.ptr, _CUDA_R_32F, rows, _CUBLAS_COMPUTE_32F,
                          _CUBLAS_GEMM_DEFAULT)
        finally:
            cublas.setPointerMode(handle, mode)

    def _gemm_f16x3(self, x, w: QTensor):
        """``x [n, k] @ w.T`` -> ``[n, rows]`` float32 at float32 accuracy on the f16 tensor cores
        (the split-f16 scheme: each operand as hi + lo f16 parts, the product as
        hi.hi + hi.lo + lo.hi; the lo.lo term, ~2^-22 of the product, is dropped). The weight is
        dequantized into ``[rows, 2k]`` halves ``[hi | lo * 2^12]`` (kernels.cu ``dequant_f16x2``),
        each row of ``x`` scaled by a power of two into the f16 range and split into
        ``[lo * 2^12, hi]`` (``split_f16_rows``; the lo parts scaled out of the f16 subnormals);
        two cuBLAS ``gemmEx`` calls with f32 accumulation: ``y = w_hi . x_hi``, then
        ``y += 2^-12 [w_hi | w_lo] . [x_lo ; x_hi]``; the rows' scales applied to ``y`` last.
        The split of the last input is kept for the same array object (as ``_digits``).
        Error against float64 ~1.3e-6 of sum |x w| on the H200 (test_prefill_gemm_matches_reference;
        ~6e-8 with exact accumulation: the rest is cuBLAS's f16 tensor-core accumulation). Eager
        (cuBLAS is not captured through CuPy)."""
        cp = self.cp
        rows, cols = w.shape
        n = x.shape[0]
        w2 = self._dequant_scratch("dequant_f16x2", w, 2)
        if x is self._split_of[0]:  # q / k / v and gate / up: one split of their shared input
            xa, sc = self._split_of[1]
        else:
            xa = cp.empty((n, 2 * cols), dtype=cp.float16)
            sc = cp.empty((n, 1), dtype=cp.float32)
            self._fn("k", "split_f16_rows")((n,), (256,), (x, xa, sc, np.int32(cols)))
            self._split_of = (x, (xa, sc))
        y = cp.empty((n, rows), dtype=cp.float32)
        # hi . hi: the first k halves of each weight row and the last k of each activation row
        self._gemm_ex(rows, n, cols, self._one, w2.data.ptr, 2 * cols, xa.data.ptr + 2 * cols, 2 * cols,
                      self._zero, y)
        self._gemm_ex(rows, n, 2 * cols, self._lo_scale, w2.data.ptr, 2 * cols, xa.data.ptr, 2 * cols, self._one, y)
        y *= sc
        return y

    def gated_ffn(self, x, gate, up, act: str):
        """``act(x @ gate.T) * (x @ up.T)`` -> ``[n, n_ff]`` float32; act "gelu_tanh" or "silu".
        One token with gate and up of one type: a single fused GEMV."""
        cp = self.cp
        a = 1 if act == "gelu_tanh" else 0
        P = gate.parent if self._fused_run([gate, up], 0) == 2 else None
        n = x.shape[0]
        if P is not None and n <= GEMV_MAX_TOKENS and (n > 1 or self._imma(1, P, x is self._digits_of[0])):
            # gate and up fused (fuse_rows): one product [n, 2 n_ff] (one-token float GEMVs keep gemv_gated)
            x = cp.ascontiguousarray(x, dtype=cp.float32)
            gu, ns = self.mul_mat_parts(x, P)  # gemmi's split partials are summed by the activation
            nf = gate.shape[0]
            y = cp.empty((n, nf), dtype=cp.float32)
            dg = self._row_digits(y)
            sl = (np.int32(ns), np.int64(n * 2 * nf))
            if dg[0] is not _NULL:
                self._fn("k", "gated_act_digits")((nf // 256, n), (32,), (gu, y, np.int32(nf), np.int32(a)) + sl + dg)
            else:
                self._fn("k", "gated_act_cat")(((y.size + 255) // 256,), (256,),
                                               (gu, y, np.int64(y.size), np.int32(nf), np.int32(a)) + sl)
            return y
        if self._imma(x.shape[0], gate) and self._imma(x.shape[0], up):
            d = self._digits(cp.ascontiguousarray(x, dtype=cp.float32))  # one quantization for both
            g, u = self._gemvi(d, gate), self._gemvi(d, up)
            y = cp.empty_like(g)
            self._fn("k", "gated_act")(((g.size + 255) // 256,), (256,), (g, u, y, np.int64(g.size), np.int32(a)))
            return y
        if (x.shape[0] == 1 and isinstance(gate, QTensor) and isinstance(up, QTensor)
                and gate.ggml_type == up.ggml_type and gate.shape == up.shape and gate.row_bytes == up.row_bytes):
            x = cp.ascontiguousarray(x, dtype=cp.float32)
            rows, cols = gate.shape
            y = cp.empty((1, rows), dtype=cp.float32)
            self._qfn("gemv_gated", gate)(((rows * 32 + 255) // 256,), (256,),
                                          (gate.data, up.data, np.int64(gate.row_bytes), x, y,
                                           np.int32(rows), np.int32(cols), np.int32(a)))
            return y
        g = self.mul_mat(x, gate)
        u = self.mul_mat(x, up)
        y = cp.empty_like(g)
        n = g.size
        self._fn("k", "gated_act")(((n + 255) // 256,), (256,), (g, u, y, np.int64(n), np.int32(a)))
        return y

    def get_rows(self, table, ids):
        """Rows ``ids`` of ``table`` (a ``QTensor``, dequantized on the fly, or a device
        array) -> ``[n, cols]`` float32."""
        cp = self.cp
        ids_d = self._idx(ids)
        if not isinstance(table, QTensor):
            return cp.ascontiguousarray(table[ids_d], dtype=cp.float32)
        n = int(ids_d.size)
        rows, cols = table.shape
        out = cp.empty((n, cols), dtype=cp.float32)
        if n:
            self._qfn("get_rows", table)((n,), (min(256, max(32, cols // 32)),),
                                         (table.data, np.int64(table.row_bytes), ids_d, out, np.int32(cols)))
        return out

    # -- elementwise / norms ----------------------------------------------------------------
    def rms_norm(self, x, w, eps: float):
        """RMSNorm over the last axis, times ``w`` if given (same shape as ``x``)."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = x.shape[-1]
        rows = x.size // n
        y = cp.empty_like(x)
        nt = _row_threads(n)
        dg, smem = self._norm_digits(y, nt)
        self._fn("k", "rms_norm")((rows,), (nt,), (x, w if w is not None else _NULL, y, np.int32(n), np.float32(eps)) + dg,
                                  shared_mem=smem)
        return y

    def add_rms_norm(self, x, h, w_post, w_next, eps: float):
        """``x + rms_norm(h, w_post)`` and ``rms_norm(that, w_next)`` in one kernel (see
        ``CPUBackend.add_rms_norm``); ``h`` may be a ``SplitK`` (``mul_mat_partials``), whose
        slabs the kernel sums itself (``mmq_reduce``'s bits). Returns ``(x_out, h_out or None)``."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if isinstance(h, SplitK):
            sl = h.slabs
            if sl.shape[1:] != x.shape or sl.dtype != cp.float32 or not sl.flags.c_contiguous:
                raise ValueError(f"add_rms_norm: partial slabs {sl.shape} {sl.dtype} for x {x.shape}")
            h, n_split, slab = h.kernel_args()
        else:
            h, n_split, slab = cp.ascontiguousarray(h, dtype=cp.float32), 1, 0
        n = x.shape[-1]
        rows = x.size // n
        xo = cp.empty_like(x)
        ho = cp.empty_like(x) if w_next is not None else None
        nt = _row_threads(n)
        dg, smem = self._norm_digits(ho, nt)
        self._fn("k", "post_norm_add_norm")((rows,), (nt,),
                                            (x, h, w_post if w_post is not None else _NULL,
                                             w_next if w_next is not None else _NULL, xo,
                                             ho if ho is not None else _NULL, np.int32(n), np.float32(eps),
                                             np.int32(n_split), np.int64(slab)) + dg,
                                            shared_mem=smem)
        return xo, ho

    def _norm_digits(self, y, nt: int) -> tuple:
        """``_row_digits`` of a row kernel's output ``y`` (rms_norm, post_norm_add_norm: ``nt``
        threads holding kernels.cu's NV = 8 values each, staged through 4 bytes of shared memory
        per value for the digits): ``(trailing arguments, dynamic shared memory bytes)``."""
        if y is None or y.ndim != 2 or y.shape[1] > 8 * nt:
            return _NO_DIGITS, 0
        dg = self._row_digits(y)
        return dg, (4 * y.shape[1] if dg[0] is not _NULL else 0)

    def _unary(self, name: str, x):
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        y = cp.empty_like(x)
        self._fn("k", name)(((x.size + 255) // 256,), (256,), (x, y, np.int64(x.size)))
        return y

    def gelu_tanh(self, x):
        """GELU, tanh approximation."""
        return self._unary("gelu_tanh", x)

    def silu(self, x):
        """x * sigmoid(x)."""
        return self._unary("silu", x)

    def sigmoid(self, x):
        """Logistic ``1 / (1 + e^-x)`` elementwise (as ``CPUBackend.sigmoid``); float32, same shape."""
        return self._unary("sigmoid", x)

    def softplus(self, x):
        """``ln(1 + e^x)`` elementwise, overflow-free (as ``CPUBackend.softplus``); float32, same shape."""
        return self._unary("softplus", x)

    def l2_norm(self, x, eps: float):
        """``x / max(||x||_2, eps)`` over the last axis (ggml_l2_norm); float32, same shape."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = x.shape[-1]
        y = cp.empty_like(x)
        if x.size:
            self._fn("k", "l2_norm")((x.size // n,), (min(256, (n + 31) // 32 * 32),),
                                     (x, y, np.int32(n), np.float32(eps)))
        return y

    def rope(self, x, pos, n_rot: int, base: float, freq_scale: float = 1.0, mode: str = "norm",
             freq_factors=None, norm=None, eps: float = 0.0, yarn=None):
        """RoPE on ``x [T, H, D]`` float32 (see ``CPUBackend.rope``), with the optional per-head
        RMSNorm fused into the same kernel and YaRN (``yarn``: ``hparams.RopeYarn`` or None;
        ggml ``rope_yarn``: ramp over ``yarn_corr_dims``, cos/sin scaled by ``attn_factor *
        (1 + 0.1 ln(1/freq_scale))``). Returns a new array."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        T, H, D = x.shape
        y = cp.empty_like(x)
        if x.size:
            mode_i, ff, tail = self._rope_args(n_rot, base, freq_scale, mode, freq_factors, eps, yarn)
            self._fn("k", "rope")((T * H,), (min(256, (D + 31) // 32 * 32),),
                                  (x, self._idx(pos), y, np.int32(H), np.int32(D), np.int32(n_rot),
                                   np.float32(base), np.float32(freq_scale), mode_i, ff,
                                   norm if norm is not None else _NULL) + tail, shared_mem=4 * D)
        return y

    @staticmethod
    def _rope_args(n_rot: int, base: float, freq_scale: float, mode: str, freq_factors, eps: float, yarn):
        """``(mode, freq_factors, (eps, ext_factor, corr_lo, corr_hi, mscale))`` kernel arguments
        of the rope kernels (kernels.cu ``rope_row``)."""
        ext, lo, hi, msc = 0.0, 0.0, 0.0, 1.0
        if yarn is not None:
            msc = yarn.attn_factor
            if yarn.ext_factor != 0.0:
                lo, hi = yarn_corr_dims(n_rot, yarn.n_ctx_orig, base, yarn.beta_fast, yarn.beta_slow)
                ext = yarn.ext_factor
                msc = yarn.attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
        return (np.int32(2 if mode == "neox" else 0), freq_factors if freq_factors is not None else _NULL,
                (np.float32(eps), np.float32(ext), np.float32(lo), np.float32(hi), np.float32(msc)))

    def rope_kv_write(self, q, k, v, pos, cache, il: int, plan, q_norm=None, k_norm=None, bias=None, *, n_rot: int,
                      base: float, freq_scale: float = 1.0, mode: str = "norm", freq_factors=None, eps: float = 0.0,
                      yarn=None):
        """``cpu.rope_kv_write`` (rope q, rope k, store k and v into the layer's cells) in one
        launch with the bits of the separate ones: f16 K and V of one head size by kernels.cu's
        ``rope_kv_write``; any other pair of ``cuda_kv.ROPE_STORE_TIERS`` (f32, f16, bf16, q8_0,
        q6_0, q5_1, q5_0, q4_1, q4_0, iq4_nl with head sizes of a multiple of 32; turbo8 / 4 / 3 / 2 with head
        sizes 64, 128 or 256, d_v = d_k for a rotated V) by rope_store.cu's ``rope_kv_write_q`` (a
        module per tier pair, ``_rope_store_fn``)
        (``OPENCOTI_CUDA_ROPE_KV_TIERS=0``: the composition); the trellis tiers and other shapes
        run the composition. ``q [T, n_head, D]``, ``k [T, n_kv, D]``,
        ``v [T, n_kv, dv]`` float32, each with unit strides inside a token (the token stride is
        free: column slices of one fused q / k / v product are read in place), or a ``SplitK``
        of such slices (``mul_mat_split_partials``: the kernels sum the slabs); ``bias``: the
        projections' biases ``(bq, bk, bv)`` (any None), added first, in the kernel. Returns the
        RoPE'd q ``[T, n_head, D]``; from the fused store of a rotated K tier a ``RotatedQ`` (q in
        that tier's domain: ``attention_cells`` takes it as it is)."""
        cp = self.cp
        K, V = cache.k[il], cache.v[il]
        tk, tv = getattr(cache, "tier_k", None), getattr(cache, "tier_v", None)
        nk, nv = "f16" if tk is None else tk.name, "f16" if tv is None else tv.name
        T, Hq, D = q.shape
        Hk, dv = k.shape[1], v.shape[2]
        f16 = nk == nv == "f16" and K.dtype == np.float16 and V.dtype == np.float16
        rot_k, rot_v = nk in cuda_kv.ROPE_STORE_ROTATED, nv in cuda_kv.ROPE_STORE_ROTATED
        tiers = (ROPE_KV_TIERS and tk is not None and tv is not None and not nk == nv == "f16"
                 and nk in cuda_kv.ROPE_STORE_TIERS and nv in cuda_kv.ROPE_STORE_TIERS and D % 32 == 0
                 and dv % 32 == 0 and V.shape[2] == Hk and K.shape[3] == tk.row_len(D)
                 and V.shape[3] == tv.row_len(dv)
                 and (not (rot_k or rot_v) or D in (64, 128, 256)) and (not rot_v or dv == D))
        if not (f16 or tiers) or not T or k.shape[2] != D or Hk != K.shape[2]:
            q, k, v = (a.sum() if isinstance(a, SplitK) else a for a in (q, k, v))
            return rope_kv_write(self, q, k, v, pos, cache, il, plan, q_norm, k_norm, bias, n_rot=n_rot, base=base,
                                 freq_scale=freq_scale, mode=mode, freq_factors=freq_factors, eps=eps, yarn=yarn)
        # split-K partials (mul_mat_split_partials) are summed by the kernel as it reads them
        (q, nsq, slq), (k, nsk, slk), (v, nsv, slv) = (a.kernel_args() if isinstance(a, SplitK) else (a, 1, 0)
                                                       for a in (q, k, v))
        (q, ldq), (k, ldk), (v, ldv) = (self._token_rows(a) for a in (q, k, v))
        bq, bk, bv = ((_NULL if b is None else cp.ascontiguousarray(b, dtype=cp.float32)) for b in (bias or (None,) * 3))
        meta = self._plan_meta(plan, K.shape[1])
        y = cp.empty((T, Hq, D), dtype=cp.float32)
        mode_i, ff, tail = self._rope_args(n_rot, base, freq_scale, mode, freq_factors, eps, yarn)
        args = (q, k, v, bq, bk, bv, ldq, ldk, ldv, self._idx(pos), y, K, V, meta["write"], np.int32(T), np.int32(Hq),
                np.int32(Hk), np.int32(D),
                np.int32(dv), np.int32(n_rot), np.float32(base), np.float32(freq_scale), mode_i, ff,
                q_norm if q_norm is not None else _NULL, k_norm if k_norm is not None else _NULL) + tail + (
                np.int32(nsq), np.int32(nsk), np.int32(nsv), np.int64(slq), np.int64(slk), np.int64(slv))
        block = (min(256, (D + 31) // 32 * 32),)  # rope's threads
        if f16:
            self._fn("k", "rope_kv_write")((T * (Hq + Hk),), block, args, shared_mem=4 * D)
        else:  # a block per q head row, per K row and per V row
            rot = rot_k or rot_v
            self._rope_store_fn(nk, nv, D if rot else 0)((T * (Hq + 2 * Hk),), block, args,
                                                         shared_mem=(16 if rot else 8) * D)
            if rot_k:
                return RotatedQ(y)
        return y

    def _token_rows(self, a):
        """``a [T, ...]`` float32 as ``(array, token stride in floats)`` for a kernel that reads each
        token's values contiguously: in place when only the token axis is strided (a column slice
        of a wider product), else a contiguous copy."""
        cp = self.cp
        if a.dtype != cp.float32:
            a = a.astype(cp.float32)
        inner = int(np.prod(a.shape[1:]))
        if a.flags.c_contiguous:
            return a, np.int64(inner)
        if a[0:1].flags.c_contiguous and a.strides[0] % 4 == 0 and a.strides[0] >= 4 * inner:
            return a, np.int64(a.strides[0] // 4)
        return cp.ascontiguousarray(a), np.int64(inner)

    # -- mixture of experts ----------------------------------------------------------------
    def moe_ffn(self, x, gate_inp, up_exps, gate_exps, down_exps, n_expert_used: int, norm_w: bool = True,
                act: str = "silu", w_scale: float = 0.0):
        """Routed experts, Qwen layout (``CPUBackend.moe_ffn``): ``x [T, n_embd]`` float32;
        ``gate_inp [n_expert, n_embd]`` (router); ``up_exps``/``gate_exps`` ``QExperts
        [n_expert, n_ff_exp, n_embd]``; ``down_exps`` ``[n_expert, n_embd, n_ff_exp]``.
        Softmax over ``x @ gate_inp.T``, top ``n_expert_used`` (ties: lower id), weights
        renormalised when ``norm_w``, times ``w_scale`` when non-zero. Returns ``[T, n_embd]``."""
        logits = self.mul_mat(x, gate_inp)
        return self._moe(x, logits, gate_exps, up_exps, down_exps, n_expert_used, act, norm_w, w_scale, None)

    def moe_ffn_gate_up(self, x, logits, gate_up_exps, down_exps, n_expert_used: int, act: str = "gelu_tanh",
                        norm_w: bool = True, down_scale=None):
        """Routed experts, Gemma-4 layout (``CPUBackend.moe_ffn_gate_up``): router ``logits
        [T, n_expert]``; fused ``gate_up_exps [n_expert, 2 n_ff_exp, n_embd]`` (gate rows
        first); ``down_exps [n_expert, n_embd, n_ff_exp]``; ``down_scale [n_expert]``
        float32 or None. Returns ``[T, n_embd]`` float32."""
        f = gate_up_exps.shape[1] // 2
        return self._moe(x, logits, gate_up_exps[:, :f], gate_up_exps[:, f:], down_exps, n_expert_used, act,
                         norm_w, 0.0, down_scale)

    def _moe(self, x, logits, gate, up, down, k: int, act: str, norm_w: bool, w_scale: float, down_scale):
        """Route on the device (``moe_route``: ``sel``/``w [T, k]``), run the selected experts
        (``_moe_pairs`` for up to ``GEMV_MAX_TOKENS`` rows, else ``_moe_grouped``) into
        per-pair outputs ``[T*k, n_embd]``, and sum them weighted (``moe_combine``)."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        logits = cp.ascontiguousarray(logits, dtype=cp.float32)
        T, n_embd = x.shape
        n_exp, n_ff, _ = gate.shape
        if (tuple(up.shape) != tuple(gate.shape) or tuple(gate.shape[::2]) != (n_exp, n_embd)
                or tuple(down.shape) != (n_exp, n_embd, n_ff) or logits.shape != (T, n_exp)):
            raise ValueError(f"moe: shapes do not fit: x {x.shape}, logits {logits.shape}, gate {gate.shape}, "
                             f"up {up.shape}, down {down.shape}")
        if not 0 < k <= n_exp:
            raise ValueError(f"moe: {k} experts per token of {n_exp}")
        out = cp.empty((T, n_embd), dtype=cp.float32)
        if T == 0:
            return out
        sel = cp.empty((T, k), dtype=cp.int32)
        w = cp.empty((T, k), dtype=cp.float32)
        self._fn("k", "moe_route")((T,), (32,), (logits, np.int32(n_exp), np.int32(k), np.int32(bool(norm_w)),
                                               np.float32(w_scale), sel, w), shared_mem=4 * n_exp)
        experts = (gate, up, down)
        if T <= GEMV_MAX_TOKENS and all(isinstance(e, QExperts) for e in experts):
            y = self._moe_pairs(x, sel, gate, up, down, act)
        else:
            y = self._moe_grouped(x, sel, gate, up, down, act)
        self._fn("k", "moe_combine")((T,), (min(256, (n_embd + 31) // 32 * 32),),
                                     (y, w, sel, down_scale if down_scale is not None else _NULL, out,
                                      np.int32(k), np.int32(n_embd)))
        return out

    def _gemv_id(self, w: QExperts, ids, x, x_div: int):
        """Pair p of ``ids [P]``: ``w[ids[p]] @ x[p // x_div]`` -> ``[P, rows]`` float32."""
        cp = self.cp
        P = int(ids.size)
        _, rows, cols = w.shape
        y = cp.empty((P, rows), dtype=cp.float32)
        wpr = _warps_per_row(rows * P, cols)
        self._qfn("gemv_id", w)((P, (rows * wpr + 7) // 8), (256,),
                                (w.base, np.int64(w.row_bytes), np.int64(w.expert_bytes), ids, x, np.int32(x_div),
                                 y, np.int32(rows), np.int32(cols), np.int32(wpr)))
        return y

    def _moe_pairs(self, x, sel, gate: QExperts, up: QExperts, down: QExperts, act: str):
        """Decode-size MoE without host sync: for every (token, slot) pair p = t*k + slot,
        ``h[p] = act(gate_e x_t) * (up_e x_t)`` with e = ``sel[t, slot]`` (one fused
        gated GEMV when gate and up share type and layout, else two GEMVs), then
        ``y[p] = down_e h[p]``. Returns ``[T*k, n_embd]`` float32."""
        cp = self.cp
        T, k = sel.shape
        ids = sel.reshape(-1)
        P = T * k
        n_ff, n_embd = gate.shape[1], gate.shape[2]
        a = 1 if act == "gelu_tanh" else 0
        if (gate.ggml_type == up.ggml_type and gate.row_bytes == up.row_bytes
                and gate.expert_bytes == up.expert_bytes):
            h = cp.empty((P, n_ff), dtype=cp.float32)
            self._qfn("gemv_id_gated", gate)((P, (n_ff * 32 + 255) // 256), (256,),
                                             (gate.base, up.base, np.int64(gate.row_bytes),
                                              np.int64(gate.expert_bytes), ids, x, np.int32(k), h,
                                              np.int32(n_ff), np.int32(n_embd), np.int32(a)))
        else:
            g = self._gemv_id(gate, ids, x, k)
            u = self._gemv_id(up, ids, x, k)
            h = cp.empty_like(g)
            self._fn("k", "gated_act")(((h.size + 255) // 256,), (256,), (g, u, h, np.int64(h.size), np.int32(a)))
        return self._gemv_id(down, ids, h, 1)

    def _moe_grouped(self, x, sel, gate, up, down, act: str):
        """Prefill-size MoE: the routing comes to the host (one sync), the pairs are sorted
        by expert, and each expert hit runs ``gated_ffn`` + ``mul_mat`` on its rows (GEMV
        or dequantize + cuBLAS). Not graph-safe: ``run_graph`` never captures a ubatch
        this size. Returns ``[T*k, n_embd]`` float32 in pair order."""
        cp = self.cp
        if self._capturing:
            raise RuntimeError("moe: the grouped (host-routed) path cannot run inside a CUDA graph capture")
        T, k = sel.shape
        P = T * k
        n_exp, n_ff, n_embd = gate.shape
        sel_h = cp.asnumpy(sel).reshape(-1)
        order = np.argsort(sel_h, kind="stable")
        counts = np.bincount(sel_h, minlength=n_exp)
        order_d = cp.asarray(order.astype(np.int32))
        xs = x[order_d // k]
        ys = cp.empty((P, n_embd), dtype=cp.float32)
        o = 0
        self._f16_ok = PREFILL_GEMM == "f16"  # a prefill: the expert GEMMs follow the prefill precision policy
        try:
            for e in np.nonzero(counts)[0]:
                c = int(counts[e])
                h = self.gated_ffn(xs[o:o + c], gate[int(e)], up[int(e)], act)
                ys[o:o + c] = self.mul_mat(h, down[int(e)])
                o += c
        finally:
            self._f16_ok = True
        y = cp.empty_like(ys)
        y[order_d] = ys
        return y

    # -- recurrent layers (gated delta-net) -------------------------------------------------
    @staticmethod
    def _rs_host(plan) -> list:
        """Host arrays of a recurrent-state plan (``recurrent_state.RSPlan``): ``view_off
        [n_views + 1]``, the views' ``rows`` concatenated, ``slots [n_views]``."""
        off = np.zeros(len(plan.views) + 1, dtype=np.int64)
        off[1:] = np.cumsum([len(v.rows) for v in plan.views])
        rows = (np.concatenate([np.asarray(v.rows, dtype=np.int64) for v in plan.views]) if plan.views
                else np.zeros(0, np.int64))
        return [off, rows, np.asarray([v.slot for v in plan.views], dtype=np.int64)]

    def _rs_meta(self, plan):
        """Device index arrays of a recurrent-state plan (uploaded once per ubatch; staged
        by ``run_graph``)."""
        hit = self._meta.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        host = self._rs_host(plan)
        dev = self.cp.asarray(np.concatenate(host).astype(np.int32))
        o = np.cumsum([0] + [len(h) for h in host])
        m = {"view_off": dev[o[0]:o[1]], "rows": dev[o[1]:o[2]], "slots": dev[o[2]:o[3]]}
        self._meta[id(plan)] = (plan, m)
        return m

    def _state(self, a, what: str):
        if not isinstance(a, self.cp.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError(f"{what}: the recurrent state must be a C-contiguous float32 device array")
        return a

    def ssm_conv(self, x, conv_states, w, plan):
        """Short causal depthwise convolution with a per-sequence carry (``CPUBackend.ssm_conv``).

        x: ``[T, C]`` float32; conv_states: the layer's device store float32 ``[n_seq_max,
        K-1, C]``, updated in place; w: ``[C, K]`` (K <= ``SSM_MAX_CONV``); plan:
        ``recurrent_state.RSPlan``. One thread per (sequence, channel) walks that
        sequence's rows in order. Returns y ``[T, C]`` float32 (no activation)."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        w = cp.ascontiguousarray(w, dtype=cp.float32)
        self._state(conv_states, "ssm_conv")
        T, C = x.shape
        K = w.shape[1]
        if w.shape[0] != C or not 1 <= K <= SSM_MAX_CONV or conv_states.shape[1:] != (K - 1, C):
            raise ValueError(f"ssm_conv: x {x.shape}, w {w.shape}, state {conv_states.shape} do not fit "
                             f"(at most {SSM_MAX_CONV} taps)")
        y = cp.empty_like(x)
        if T and plan.views:
            m = self._rs_meta(plan)
            self._fn("r", "ssm_conv")((len(plan.views), (C + 127) // 128), (128,),
                                      (x, conv_states, w, m["view_off"], m["rows"], m["slots"], y,
                                       np.int32(C), np.int32(K)))
        return y

    def gated_delta_net(self, q, k, v, g, beta, ssm_states, plan, scale: float):
        """Gated delta rule over each sequence of the ubatch (``CPUBackend.gated_delta_net``).

        q, k: ``[T, H, d_k]`` float32 (L2-normalised; d_k <= ``GDN_MAX_DK``); v: ``[T, H,
        d_v]``; g (log decay), beta: ``[T, H]``; ssm_states: the layer's device store
        float32 ``[n_seq_max, H, d_k, d_v]``, updated in place; plan: ``RSPlan``.
        Sequential over each sequence's tokens (grid: sequence x head x 32 value columns,
        the state in registers), so a long prefill runs one token after another per
        block; the CPU's chunked form gives the same result. Returns ``[T, H, d_v]``."""
        cp = self.cp
        q, k, v, g, beta = (cp.ascontiguousarray(a, dtype=cp.float32) for a in (q, k, v, g, beta))
        self._state(ssm_states, "gated_delta_net")
        T, H, dk = q.shape
        dv = v.shape[-1]
        if (k.shape != q.shape or v.shape[:2] != (T, H) or g.shape != (T, H) or beta.shape != (T, H)
                or ssm_states.shape[1:] != (H, dk, dv)):
            raise ValueError(f"gated_delta_net: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
                             f"beta {beta.shape}, state {ssm_states.shape} do not fit")
        if dk > GDN_MAX_DK:
            raise NotImplementedError(f"gated_delta_net: key head dim {dk} > {GDN_MAX_DK}")
        r = next(r for r in (1, 2, 4, 8) if 32 * r >= dk)
        out = cp.empty((T, H, dv), dtype=cp.float32)
        if T and plan.views:
            m = self._rs_meta(plan)
            self._fn("r", f"gated_delta_net_r{r}")(
                (len(plan.views), H, (dv + GDN_COLS - 1) // GDN_COLS), (128,),
                (q, k, v, g, beta, ssm_states, m["view_off"], m["rows"], m["slots"], out, np.int32(H),
                 np.int32(dk), np.int32(dv), np.float32(scale)))
        return out

    # -- KV cache -------------------------------------------------------------------------
    def _plan_meta(self, plan, n_cells: int):
        """Device index arrays of a cache plan (uploaded once per ubatch):
        write cells, and per-view cell lists for attention."""
        hit = self._meta.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        parts = plan.flat(n_cells)
        dev = self.cp.asarray(np.concatenate(parts).astype(np.int32))
        o = np.cumsum([0] + [len(p) for p in parts])
        m = {"write": dev[o[0]:o[1]], "row_view": dev[o[1]:o[2]], "view_off": dev[o[2]:o[3]],
             "cells": dev[o[3]:o[4]], "cell_pos": dev[o[4]:o[5]],
             "max_len": int(plan.view_lens().max(initial=0))}
        self._meta[id(plan)] = (plan, m)  # the plan is kept alive so its id cannot be reused meanwhile
        return m

    # -- shared-prefix groups (PolyKV) ------------------------------------------------------
    _GROUP_PARTS = ("p_off", "p_cells", "p_pos", "row_slot", "g_rows", "g_len", "g_cells", "g_pos")

    @staticmethod
    def _group_caps(plan, exact: bool) -> tuple:
        """``(pcap, scaps)``: capacity of the private cell lists (all views together) and of
        each group's shared list; exact lengths (eager) or ``_bucket``s (graph keys; the private
        one of at least GROUP_PRIVATE_CELLS per grouped view)."""
        grouped = {i for g in plan.groups for i in g.views}
        n_priv = sum(len(v.private) if i in grouped else len(v.cells) for i, v in enumerate(plan.views))
        if exact:
            return n_priv, tuple(len(g.cells) for g in plan.groups)
        return (_bucket(max(n_priv, GROUP_PRIVATE_CELLS * len(grouped))),
                tuple(_bucket(len(g.cells)) for g in plan.groups))

    @classmethod
    def _group_host(cls, plan, n_cells: int, pcap: int, scaps: tuple) -> tuple[list, dict]:
        """Host arrays of a plan's shared-prefix groups (``kv_cache.SharedGroup``), in
        ``_GROUP_PARTS`` order: ``p_off [n_views + 1]`` / ``p_cells`` / ``p_pos`` (``pcap``):
        per view the cells attention reads besides a shared prefix (a grouped view's
        ``private`` cells, every other view's ``cells``); ``row_slot [T]``: a row's index
        among all groups' rows (-1 outside groups); ``g_rows``: each group's rows (its
        views' rows in order); ``g_len [n_groups]``: shared cells per group; ``g_cells`` /
        ``g_pos``: each group's shared cells padded to its ``scaps`` entry. Cells are flat
        (``stream * n_cells + cell``). Also returns ``{"R": rows per group, "pcap", "scaps",
        "p_max": longest private list}``."""
        views = plan.views
        row_slot = np.full(len(plan.cell), -1, dtype=np.int64)
        grouped: set = set()
        g_rows, g_cells, g_pos, R = [], [], [], []
        for g, cap in zip(plan.groups, scaps):
            rows = np.concatenate([np.asarray(views[i].rows, dtype=np.int64) for i in g.views])
            row_slot[rows] = sum(R) + np.arange(len(rows))
            R.append(len(rows))
            g_rows.append(rows)
            grouped.update(g.views)
            pad = cap - len(g.cells)
            g_cells.append(np.concatenate([g.stream * n_cells + np.asarray(g.cells, np.int64), np.zeros(pad, np.int64)]))
            g_pos.append(np.concatenate([np.asarray(g.cell_pos, np.int64), np.zeros(pad, np.int64)]))
        off, p_cells, p_pos = [0], [], []
        for i, v in enumerate(views):
            c, cpos = (v.private, v.private_pos) if i in grouped else (v.cells, v.cell_pos)
            p_cells.append(v.stream * n_cells + np.asarray(c, dtype=np.int64))
            p_pos.append(np.asarray(cpos, dtype=np.int64))
            off.append(off[-1] + len(c))
        pad = pcap - off[-1]
        p_cells.append(np.zeros(pad, np.int64))
        p_pos.append(np.zeros(pad, np.int64))
        parts = [np.asarray(off), np.concatenate(p_cells), np.concatenate(p_pos), row_slot, np.concatenate(g_rows),
                 np.asarray([len(g.cells) for g in plan.groups]), np.concatenate(g_cells), np.concatenate(g_pos)]
        p_max = int(np.diff(off).max()) if len(off) > 1 else 0
        return parts, {"R": R, "pcap": pcap, "scaps": scaps, "p_max": p_max}

    def _group_views(self, dev, parts: list, info: dict) -> dict:
        """Name the slices of ``dev`` (the concatenated ``parts``) as ``_GROUP_PARTS``."""
        o = np.cumsum([0] + [len(a) for a in parts])
        m = {n: dev[o[i]:o[i + 1]] for i, n in enumerate(self._GROUP_PARTS)}
        m.update(info)
        return m

    def _group_meta(self, plan, n_cells: int) -> dict:
        """Device arrays of ``plan.groups`` (``_group_host``), uploaded on first use per
        ubatch (eager) or staged by ``run_graph`` with bucketed capacities."""
        m = self._plan_meta(plan, n_cells)
        if "grp" not in m:
            pcap, scaps = self._group_caps(plan, exact=True)
            parts, info = self._group_host(plan, n_cells, pcap, scaps)
            m["grp"] = self._group_views(self.cp.asarray(np.concatenate(parts).astype(np.int32)), parts, info)
        return m["grp"]

    # -- CUDA graphs ----------------------------------------------------------------------
    def run_graph(self, ub, caches, forward, graphs: dict, argmax: bool = False, on_launch=None,
                  wait: bool = True, after=None):
        """Run ``forward()`` (the network on ``ub``) as a replayed CUDA graph.

        Decode steps launch ~200 small kernels; from Python each costs ~9 us, inside a
        graph ~1 us (DESIGN.md). Everything a step changes (token ids, positions,
        cell lists, the recurrent plan's rows and state slots) is copied into buffers
        fixed per graph key before replay, in one host->device copy; kernels read them
        through pointers. The key is (n_tokens, n_out, per KV cache: views, cell-list
        bucket, per recurrent plan: views, per KV cache: its shared-prefix group layout or
        None): cell lists are padded to a power of two >= 256, and attention's split count
        follows the bucket, so one graph serves every step until a sequence outgrows its
        bucket. A group layout is the private-cell bucket and, per group, the shared-cell
        bucket and its number of query rows (``_group_host`` stages the group arrays after
        the others); it changes only when sessions attach, leave or join the ubatch. ``caches``: the KV caches, whose
        plans lead ``ub.plans`` (a hybrid model's ``RSPlan`` follows them).
        ``graphs``: the caller's graph store (one per runner: a graph holds that
        network's weights, KV and recurrent-state addresses, so it must never serve
        another runner). Returns host logits; with ``argmax``, ``sampling.rows_argmax`` of them
        computed on the device (only the two short arrays are copied). ``on_launch()`` (optional)
        runs once the step is queued on the device: a replay calls it between the graph's
        launch and the wait for it; the other paths before the forward.

        ``wait=False`` (with ``argmax``; ``ModelRunner.launch``): return a ``runner.StepResult``
        at once for a replay (the argmax pair comes back by an asynchronous copy into pinned
        memory, read after an event); ``after``: the ``StepResult`` of the step queued before
        this one, whose device ids become this step's tokens (row i <- its out row i) by a
        device copy into the staged buffer after the upload, so this step is queued without
        waiting for ``after``. Where the step does not replay a graph (a new key, the eager
        path) or ``after`` has no device ids, ``after.result()`` fills ``ub.tokens`` first. A
        key's pinned stage is rewritten only once its previous upload has ended (an event).

        A new key runs the forward once eagerly on the capture stream (warm-up: compiles
        CuPy kernels, fills the graph's pool), captures it, and returns the warm-up's
        logits: the step is applied exactly once, which matters for the in-place
        recurrent-state updates. Falls back to eager execution over ``GEMV_MAX_TOKENS`` rows
        (prefill, the host-routed MoE path) and, when ``OPENCOTI_CUDA_F16_GEMM_MIN_ROWS`` is
        set, from that many rows (their matmuls are cuBLAS, which CuPy refuses inside a stream
        capture); every op is graph-safe below that size (``mmq.cu`` included).
        """
        cp = self.cp
        T = ub.n_tokens
        if T > GEMV_MAX_TOKENS or (F16_GEMM_MIN_ROWS and T >= F16_GEMM_MIN_ROWS):
            if after is not None:
                ub.tokens[:] = after.result()[0][:T]
            if on_launch is not None:
                on_launch()
            lg = forward()  # cuBLAS (f16 GEMM, prefill) cannot be captured through CuPy
            if not wait:
                return StepResult.done(rows_argmax(lg, ub.argmax_ban))
            return rows_argmax(lg, ub.argmax_ban) if argmax else lg
        n_kv = len(caches)
        kv_plans, rs_plans = ub.plans[:n_kv], ub.plans[n_kv:]
        ncells = [c.k[c.layers[0]].shape[1] for c in caches]
        tot = [int(p.view_lens().sum()) for p in kv_plans]
        caps = [max(256, 1 << (t - 1).bit_length()) for t in tot]
        gcaps = [self._group_caps(p, exact=False) if p.groups else None for p in kv_plans]
        self._decode_rows = _decode_rows(ub)  # gemv_int.cu's digits (imma_digits): part of the key
        key = (T, self._decode_rows, len(ub.out_rows), tuple((p.n_views, cap) for p, cap in zip(kv_plans, caps)),
               tuple(len(p.views) for p in rs_plans),
               tuple(None if gc is None else (gc, tuple(sum(len(p.views[i].rows) for i in g.views) for g in p.groups))
                     for p, gc in zip(kv_plans, gcaps)))
        host = [ub.tokens, ub.pos, ub.out_rows]
        slots = [len(h) for h in host]
        for p, n, cap in zip(kv_plans, ncells, caps):
            parts = p.flat(n)  # cells / cell_pos unpadded: staged into slots of ``cap``
            host += parts
            slots += [len(parts[0]), len(parts[1]), len(parts[2]), cap, cap]
        for p in rs_plans:
            parts = self._rs_host(p)
            host += parts
            slots += [len(x) for x in parts]
        grp = []  # (plan index, first part, parts, info) of the shared-prefix groups, staged last
        for i, (p, n, gc) in enumerate(zip(kv_plans, ncells, gcaps)):
            if gc is not None:
                parts, info = self._group_host(p, n, *gc)
                grp.append((i, len(host), parts, info))
                host += parts
                slots += [len(x) for x in parts]
        g = graphs.get(key)
        if after is not None and (g is None or after.ids_dev is None):
            ub.tokens[:] = after.result()[0][:T]  # staged from the host below
            after = None
        if g is None:
            import cupyx

            stage = cupyx.empty_pinned(int(sum(slots)), dtype=np.int32)
            buf = cp.empty(stage.size, dtype=cp.int32)
        else:
            stage, buf = g["stage"], g["buf"]
            g["uploaded"].synchronize()  # a step queued without waiting may still read the stage
        o = stage_parts(host, slots, stage)
        st = cp.cuda.get_current_stream()
        # CuPy copies on the current stream and, from pinned memory, may return before the copy
        # ends: a replay records an event after it (waited for above before the stage is
        # rewritten); the other paths synchronize the stream
        buf.set(stage, stream=st)
        if g is not None:  # replay: the graph reads buf through the addresses it was captured with
            if slots != g["slots"]:  # slots follow the key; a change would leave the captured views stale
                raise RuntimeError(f"run_graph: graph {key} was captured for slots {g['slots']}, got {slots}")
            try:
                if after is not None:  # this step's tokens: the previous step's argmax, device to device
                    buf[int(o[0]):int(o[0]) + T] = after.ids_dev[:T]
                g["uploaded"].record(st)
                g["graph"].launch(stream=st)
                self.last_graph_key = (id(graphs), key)
                # the argmax pair is queued before on_launch wakes the threads of the previous
                # step's events, so its few launches do not wait for the interpreter behind them
                pending = self._argmax_async(g["out"], st, ub.argmax_ban) if argmax and not wait else None
                if on_launch is not None:
                    on_launch()
                if pending is not None:
                    return pending
                if argmax:
                    return self._rows_argmax(g["out"], ub.argmax_ban)
                if isinstance(g["out"], np.ndarray):  # no logits to copy: finish the step here
                    st.synchronize()
                return self._pinned_host(g["out"])
            except BaseException:
                with contextlib.suppress(Exception):
                    st.synchronize()  # the stage's copy is done before anything rewrites it
                raise
        # a new key: views of the staged buffer stand in for begin_ubatch / _plan_meta / _rs_meta
        # uploads while the forward runs once eagerly and once under capture
        io, kv_m, rs_m = self._staged_views(buf, o, caps, len(rs_plans))
        self._ub = ub
        self._dev = {id(ub.tokens): io[0], id(ub.pos): io[1], id(ub.out_rows): io[2]}
        self._meta = {id(p): (p, m) for p, m in zip(kv_plans, kv_m)}
        self._meta.update({id(p): (p, m) for p, m in zip(rs_plans, rs_m)})
        for i, j, parts, info in grp:
            self._meta[id(kv_plans[i])][1]["grp"] = self._group_views(buf[o[j]:o[j + len(parts)]], parts, info)
        self._staged = True
        try:
            if on_launch is not None:
                on_launch()
            st.synchronize()
            stream = cp.cuda.Stream(non_blocking=True)
            # a private pool per graph (as PyTorch's graph pools): the graph's scratch
            # memory is never handed to anything else while the graph lives
            pool = cp.cuda.MemoryPool()
            with cp.cuda.using_allocator(pool.malloc), stream:
                warm = forward()  # this step's result; compiles CuPy kernels, fills the pool
                stream.synchronize()
                self._capturing = True
                try:
                    stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
                except (AttributeError, TypeError):
                    stream.begin_capture()
                try:
                    out = forward()  # recorded, not executed
                except BaseException:  # leave the stream usable (no capture left open)
                    with contextlib.suppress(Exception):
                        stream.end_capture()
                    raise
                graph = stream.end_capture()
            self._capturing = False
            graphs[key] = {"buf": buf, "stage": stage, "graph": graph, "out": out, "pool": pool, "stream": stream,
                           "slots": slots, "uploaded": cp.cuda.Event(disable_timing=True)}
            self.last_graph_key = (id(graphs), key)
            if not wait:
                return StepResult.done(self._rows_argmax(warm, ub.argmax_ban))
            return self._rows_argmax(warm, ub.argmax_ban) if argmax else self._pinned_host(warm)
        finally:
            self._staged = False
            self._capturing = False

    @staticmethod
    def _staged_views(buf, o, caps: list, n_rs: int) -> tuple:
        """Device views of ``run_graph``'s staged buffer ``buf`` (parts at offsets ``o``, as
        ``stage_parts`` returns them): the ubatch's (tokens, pos, out_rows), per KV plan its
        ``_plan_meta`` dict (index arrays, ``max_len`` = its cell-list slot ``caps[i]``), per
        recurrent plan its ``_rs_meta`` dict."""
        v = [buf[a:b] for a, b in zip(o[:-1].tolist(), o[1:].tolist())]
        kv = [{"write": v[j], "row_view": v[j + 1], "view_off": v[j + 2], "cells": v[j + 3], "cell_pos": v[j + 4],
               "max_len": cap} for j, cap in zip(range(3, 3 + 5 * len(caps), 5), caps)]
        j0 = 3 + 5 * len(caps)
        rs = [{"view_off": v[j], "rows": v[j + 1], "slots": v[j + 2]} for j in range(j0, j0 + 3 * n_rs, 3)]
        return v[:3], kv, rs

    def kv_write(self, cache, il: int, plan, k, v) -> None:
        """Store K ``[T, n_head_kv, d_k]`` / V of a layer into the plan's cells, quantized to the
        cache's tiers (``cache.tier_k`` / ``tier_v``) on the device: f16 / f16 by the f16 kernel,
        any other pair by the tier kernels (``kv_write.cu``; the bytes equal ``KVTier.quantize``)."""
        cp = self.cp
        K, V = cache.k[il], cache.v[il]
        meta = self._plan_meta(plan, K.shape[1])
        k = cp.ascontiguousarray(k, dtype=cp.float32)
        v = cp.ascontiguousarray(v, dtype=cp.float32)
        T = k.shape[0]
        if not T:
            return
        tk, tv = getattr(cache, "tier_k", None), getattr(cache, "tier_v", None)
        if (tk is None or tk.name == "f16") and (tv is None or tv.name == "f16"):
            if K.dtype != np.float16 or V.dtype != np.float16:
                raise ValueError(f"kv_write: f16 KV storage expected, got {K.dtype} / {V.dtype}")
            self._fn("k", "kv_write")((T,), (256,), (k, v, K, V, meta["write"],
                                                     np.int32(k.size // T), np.int32(v.size // T)))
            return
        n_kv = K.shape[2]
        self._kv_quant(K, tk, k.reshape(T, n_kv, -1), meta["write"])
        self._kv_quant(V, tv, v.reshape(T, n_kv, -1), meta["write"])

    # -- KV tiers (cuda_kv.py) -------------------------------------------------------------
    def _kv_tier(self, tier, store, what: str):
        """The ``KVTier`` of a storage array (None -> f16 for a float16 array); ``ValueError``
        for a tier without kernels here."""
        from opencoti.engine.kv_tiers import get_tier

        if tier is None:
            if store.dtype != np.float16:
                raise ValueError(f"{what}: KV storage of dtype {store.dtype} needs its tier (type_k / type_v)")
            return get_tier("f16")
        if tier.name not in self.kv_types:
            raise ValueError(f"the CUDA backend has no kernels for KV cache type {tier.name} "
                             f"(supported: {', '.join(self.kv_types)})")
        return tier

    def _kv_write_fn(self, name: str):
        m = self._kv_mods.get("write")
        if m is None:
            m = self._kv_mods["write"] = load_source(cuda_kv.write_source(), "kv_write")
        key = ("kvw", name)
        f = self._fns.get(key)
        if f is None:
            f = self._fns[key] = self._kernel(m, name)
        return f

    def _rope_store_fn(self, type_k: str, type_v: str, d_rot: int):
        """``rope_kv_write_q`` of the (K tier, V tier) pair's rope_store module, compiled on first
        use: ``d_rot`` the head size of a rotated tier, 0 for a pair without one
        (``cuda_kv.rope_store_source``)."""
        key = ("rope_store", type_k, type_v, d_rot, ROPE_ANGLE_PRE, ROPE_K_NORM_LATE)
        f = self._fns.get(key)
        if f is None:
            m = load_source(cuda_kv.rope_store_source(type_k, type_v, d_rot, ROPE_ANGLE_PRE, ROPE_K_NORM_LATE),
                            f"rope_store_{type_k}_{type_v}_d{d_rot}")
            f = self._fns[key] = self._kernel(m, "rope_kv_write_q")
        return f

    def _kv_quant(self, store, tier, x, cells) -> None:
        """Quantize float32 ``x [N, n_kv, d]`` (device, C-contiguous) into the rows of the
        flat cells ``cells`` (int32 device ``[N]``: stream * n_cells + cell) of ``store``
        (``[n_stream, n_cells, n_kv, row]``) in ``tier``'s bytes (``KVTier.quantize``)."""
        N, n_kv, d = x.shape
        if not N:
            return
        tier.check_dim(d)
        if store.shape[2] != n_kv or store.shape[3] != tier.row_len(d):
            raise ValueError(f"KV write: rows of {d} values do not fit {tier.name} storage {tuple(store.shape)}")
        name, nt = cuda_kv.write_kernel(tier, d)
        fn = self._kv_write_fn(name)
        rows = N * n_kv
        if tier.family in cuda_kv.SCALAR_FAMILY:
            n_warps = rows * (d // 32)
            fn(((n_warps * 32 + nt - 1) // nt,), (nt,), (x, store, cells, np.int32(rows), np.int32(n_kv), np.int32(d)))
        elif tier.family == "turbo":
            fn((rows,), (nt,), (x, store, cells, np.int32(n_kv)))
        else:
            fn((rows, d // 64), (nt,), (x, store, cells, np.int32(n_kv)))

    def _flat_cells(self, store, stream: int, cells):
        return self.cp.asarray((int(stream) * store.shape[1] + np.asarray(cells, dtype=np.int64)).astype(np.int32))

    def kv_read(self, store, tier, stream: int, cells):
        """Rows of ``cells`` (host int array) in ``stream`` of a layer's KV storage ``store``
        ``[n_stream, n_cells, n_kv, row]`` (tier ``tier``), dequantized on the device (the rotated
        tiers un-rotated): float32 ``[C, n_kv, d]`` (``KVCache.read_k`` on a GPU)."""
        cp = self.cp
        n_kv = store.shape[2]
        d = tier.dim_of(store.shape[3])
        C = len(cells)
        out = cp.empty((C, n_kv, d), dtype=cp.float32)
        if C:
            if d not in cuda_kv.KV_HEAD_DIMS:
                raise NotImplementedError(f"CUDA KV read: head size {d} (kernels for {cuda_kv.KV_HEAD_DIMS})")
            fn = self._kv_write_fn(f"kv_dequant_{cuda_kv.TIER_STRUCTS[tier.name]}_d{d}")
            fn((C * n_kv,), (d,), (store, self._flat_cells(store, stream, cells), np.int32(n_kv), out))
        return out

    def kv_store(self, store, tier, stream: int, cells, x) -> None:
        """Overwrite the rows of ``cells`` in ``stream`` with float ``x [C, n_kv, d]`` quantized to
        ``tier`` on the device (``KVCache.store_k`` on a GPU: the context shift's requantize)."""
        x = self.cp.ascontiguousarray(x, dtype=self.cp.float32)
        self._kv_quant(store, tier, x, self._flat_cells(store, stream, cells))

    def _kv_attn_fn(self, tk: str, tv: str, d: int, g: int, lanes: bool | str = False, smem: int = 0, hn: int = 8):
        """The tier attention kernel of (K tier, V tier, head size) for ``g`` query heads per
        block: ``attn_kv_g<g>`` (a lane per cell) or, ``lanes``, ``attn_kv_g<g>_l`` (up to 4
        lanes per cell: short splits; ``lanes="l8"``: ``attn_kv_g<g>_l8``, 8 lanes per cell,
        where ``cuda_kv.lanes8_ok``); with ``smem`` (its dynamic shared memory bytes) the
        streaming ``attn_kv_stream`` instead (long rows), of ``hn`` query heads per block (16:
        the pair's ``_h16`` module)."""
        key = ("kva", tk, tv, d, hn, MERGE_UNROTATE, _as_big_d(True), ATTN_V_PREFETCH, ATTN_EARLY)
        m = self._kv_mods.get(key)
        if m is None:
            m = self._kv_mods[key] = load_source(cuda_kv.attention_source(tk, tv, d, hn, MERGE_UNROTATE,
                                                                          _as_big_d(True), ATTN_V_PREFETCH,
                                                                          ATTN_EARLY),
                                                 f"attn_{tk}_{tv}_d{d}{_as_suffix(hn)}")
        fkey = key + ((-1, smem) if smem else (g, lanes))
        f = self._fns.get(fkey)
        if f is None:
            f = self._fns[fkey] = _raise_smem(
                self._kernel(m, "attn_kv_stream" if smem else f"attn_kv_g{g}" + ("_l8" if lanes == "l8" else
                                                                                    "_l" if lanes else "")), smem)
        return f

    def attention_cells(self, q, q_pos, k_store, v_store, plan, scale: float, n_swa: int = 0,
                        softcap: float = 0.0, type_k=None, type_v=None):
        """Attention of the ubatch's queries ``q [T, n_head, d]`` over each row's sequence
        cells in the plan (``plan.views``), reading ``k_store``/``v_store``
        ``[n_stream, n_cells, n_head_kv, row]`` in their tiers ``type_k`` / ``type_v``
        (``KVTier``; None = f16 storage). f16 / f16 runs the f16 kernels; any other pair the
        tier-generic kernel (module per pair and head size, compiled on first use), which
        needs head size 64, 128, 256 or 512. Rows of ATTN_STREAM_CELLS cells or more (the
        mean; ATTN_STREAM_BATCH_CELLS for several query rows, ``_stream_rows``) take the
        streaming kernel (attn_stream.cuh; head sizes 64-256, rows of a multiple of 4 bytes, not
        the f32 / bf16 tiers). Masks as ``CPUBackend.attention``. Returns
        ``[T, n_head * d]`` float32. ``q`` may be a ``RotatedQ`` (``rope_kv_write``'s, for a rotated
        K tier: the kernels skip their rotation of q). Raises ``ValueError`` for a tier without
        kernels, or for a ``RotatedQ`` with a K tier that is not rotated."""
        cp = self.cp
        tk = self._kv_tier(type_k, k_store, "attention_cells")
        tv = self._kv_tier(type_v, v_store, "attention_cells")
        q_rot = isinstance(q, RotatedQ)
        if q_rot:
            if tk.name not in cuda_kv.ROPE_STORE_ROTATED:
                raise ValueError(f"attention_cells: queries rotated for a rotated K tier, but K is {tk.name}")
            q = q.q
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        T, H, D = q.shape
        n_kv = k_store.shape[2]
        if tk.dim_of(k_store.shape[3]) != D or tv.dim_of(v_store.shape[3]) != D:
            raise NotImplementedError("CUDA attention needs d_k == d_v")
        G = H // n_kv
        quant = not (tk.name == "f16" and tv.name == "f16")
        dims = cuda_kv.KV_HEAD_DIMS if quant else ATTN_HEAD_DIMS
        if D not in dims or H % n_kv:
            raise NotImplementedError(f"CUDA attention: head_dim {D} with {H} heads / {n_kv} kv heads not "
                                      f"supported (head_dim {dims} for KV {tk.name}/{tv.name}, n_head a "
                                      f"multiple of n_head_kv)")
        meta = self._plan_meta(plan, k_store.shape[1])
        g = self._attn_group(T, n_kv, G, D, meta["max_len"])
        n_hg = (G + g - 1) // g
        # shared-prefix groups: f16 / f16 only; any other tier pair reads every view's cells (the
        # groups' shared cells included) through the per-sequence tier kernel below
        if getattr(plan, "groups", None) and SHARED_PREFIX and D in SP_TILE and not quant:
            return self._attention_groups(q, q_pos, k_store, v_store, plan, scale, n_swa, softcap, g, n_hg)
        # prompt-shaped ubatches (>= PREFILL_TC_ROWS rows per sequence on average) through the tensor-core
        # tiles; a mixed ubatch of many one-row sequences keeps the per-row kernel (one launch, not one per view)
        if (PREFILL_TC_ATTN and T > GEMV_MAX_TOKENS and T >= PREFILL_TC_ROWS * plan.n_views and D in SP_TILE
                and not quant and not self._capturing):
            return self._attention_prefill(q, q_pos, k_store, v_store, plan, meta, scale, n_swa, softcap)
        out = cp.empty((T, H * D), dtype=cp.float32)
        # long rows (eager: the longest row's cells / T; in a graph: the bucket of all rows' cells /
        # T, the mean): the streaming kernel, for rows of a multiple of 4 bytes (its copy chunks)
        # whose values fit f16's range (not the f32 / bf16 tiers) and a block that fits the SM
        rb_k, rb_v = k_store.shape[3] * k_store.dtype.itemsize, v_store.shape[3] * v_store.dtype.itemsize
        hn = _as_heads(G, D, quant)
        stream = (D in AS_HEAD_DIMS and rb_k % 4 == 0 and rb_v % 4 == 0 and not {tk.name, tv.name} & {"f32", "bf16"}
                  and self._stream_rows(meta["max_len"], T, n_kv * -(-G // hn)))
        if stream:
            smem = _as_smem(D, rb_k, rb_v, cuda_kv.stream_table_bytes(tk.name, True),
                            cuda_kv.stream_table_bytes(tv.name, False), hn, quant)
            stream = smem <= self.smem_per_block
        if stream:
            n_hg = -(-G // hn)
            threads = 2 * _as_tile(D, rb_k, rb_v, quant)
            sfn = self._kv_attn_fn(tk.name, tv.name, D, 0, smem=smem, hn=hn) if quant else \
                self._big_smem_fn("a", f"attn_stream_d{D}{_as_suffix(hn)}", smem)
            fit = self._fits.get(sfn)
            if fit is None:  # once per kernel: num_regs is a driver query
                fit = self._fits[sfn] = self._blocks_per_sm(threads, sfn.raw.num_regs, smem)
            n_split = self._attn_stream_splits(meta["max_len"], T * n_kv * n_hg, T, fit)
            pinned = self._stream_pin_smem(smem, fit, T * n_kv * n_hg * n_split)
            if pinned != smem:
                if self._smem_raised.get(sfn, 0) < pinned:  # a driver call: once per kernel and size
                    self._smem_raised[sfn] = pinned
                    _raise_smem(sfn, pinned)
                smem = pinned
        else:
            n_split, l8 = self._attn_lanes8(meta["max_len"], T * n_kv * n_hg, T, D,
                                            not quant or cuda_kv.lanes8_ok(tk.name, D))
        if n_split > 1:
            part_acc = cp.empty((T * H * n_split * D,), dtype=cp.float32)
            part_ml = cp.empty((T * H * n_split * 2,), dtype=cp.float32)
        else:
            part_acc = part_ml = out
        # tier kernels: splits of up to ATTN_KV_LANES_CELLS cells take several lanes per cell
        lanes = -(-meta["max_len"] // n_split) <= ATTN_KV_LANES_CELLS
        args = (q, self._idx(q_pos), meta["row_view"], meta["view_off"], meta["cells"], meta["cell_pos"],
                k_store, v_store, np.int32(H), np.int32(n_kv), np.float32(scale), np.int32(n_swa),
                np.float32(softcap), np.int32(n_split), out, part_acc, part_ml)
        if quant:  # the tier kernels' q_rot
            args += (np.int32(q_rot),)
        if stream:
            sfn((T, n_kv * n_hg, n_split), (threads,), args, shared_mem=smem)
        else:
            fn = (self._kv_attn_fn(tk.name, tv.name, D, g, "l8" if l8 else lanes) if quant else
                  self._fn("a", f"attn_partial_d{D}_g{g}" + ("_l8" if l8 else "")))
            fn((T, n_kv * n_hg, n_split), (128,), args)
        if n_split > 1:
            self._merge("a", "attn_merge", out, H, D, (part_acc, part_ml, out, np.int32(H), np.int32(D),
                                                       np.int32(n_split), self._merge_signs(tv.name, D, n_split)))
        return out

    def _merge_signs(self, type_v: str, d: int, n_split: int):
        """attn_merge's ``v_signs`` for a row of ``n_split`` splits: the rotated tiers' sign words
        on the device (``cuda_kv.sign_words``, uint32 [16]) where the merge un-rotates V tier
        ``type_v``'s output (MERGE_UNROTATE and ``cuda_kv.merge_unrotates``), else a null pointer."""
        return self._kv_signs_dev if MERGE_UNROTATE and cuda_kv.merge_unrotates(type_v, d, n_split) else _NULL

    def _merge(self, mod: str, name: str, out, H: int, D: int, args: tuple) -> None:
        """Launch attention merge kernel ``name`` of module ``mod`` (attn_merge, sp_merge; grid
        and block: ``merge_launch``) into ``out [T, H * D]``, or its ``_digits`` form that also
        writes the output projection's digits (``_row_digits``; MERGE_DIGITS); on sm_90+ with
        MERGE_CLUSTER, a kernel of CLUSTER_MERGES as its cluster form (``name`` + ``_c``)."""
        cluster = self._clusters and MERGE_CLUSTER and name in CLUSTER_MERGES
        dg = self._row_digits(out) if MERGE_DIGITS else _NO_DIGITS
        launch = merge_launch(out.shape[0], H, D, cluster)
        suffix = "_c" if cluster else ""
        if dg[0] is not _NULL:
            self._fn(mod, name + "_digits" + suffix)(*launch, args + dg)
        else:
            self._fn(mod, name + suffix)(*launch, args)

    def _attention_prefill(self, q, q_pos, k_store, v_store, plan, meta: dict, scale: float, n_swa: int,
                           softcap: float):
        """``attention_cells`` for a prefill ubatch with f16 K/V: each view's (sequence's) query
        rows x the query heads of a kv head through ``sp_attn_d<D>`` (shared_prefix.cu: K/V
        tiles staged once in shared memory for 64 queries, tensor-core MMA on f16 hi / lo
        operand splits, f32 accumulation; masked by position as attention.cu: causal and
        sliding window), over the view's own cell list, as split partials; ``sp_merge`` with
        no private part normalizes them. No host sync (sp_attn rescales a query whose range
        would overflow the f16 hi term); the row order is uploaded once per plan. Eager only.
        Returns ``[T, n_head * d]`` float32, equal to the per-row kernel up to float32
        summation order (test_prefill_attention_matches)."""
        cp = self.cp
        T, H, D = q.shape
        n_kv = k_store.shape[2]
        G = H // n_kv
        if "prefill" not in meta:  # once per plan: every layer's call reuses it
            rows = [np.asarray(v.rows, dtype=np.int64) for v in plan.views]
            lens = plan.view_lens()
            order = np.concatenate(rows)
            row_slot = np.full(T, -1, dtype=np.int32)
            row_slot[order] = np.arange(len(order), dtype=np.int32)
            dev = cp.asarray(np.concatenate([order.astype(np.int32), row_slot, lens.astype(np.int32)]))
            off = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(lens, out=off[1:])
            meta["prefill"] = ([len(r) for r in rows], off, lens, dev[:len(order)],
                               dev[len(order):len(order) + T], dev[len(order) + T:])
        R, off, lens, g_rows, slot_d, len_d = meta["prefill"]
        blocks = sum(-(-r * G // SP_QT) for r in R) * n_kv
        n_ss = self._sp_splits(int(lens.max()), blocks, D)
        s_acc = cp.empty((sum(R) * H * n_ss * D,), dtype=cp.float32)
        s_ml = cp.empty((sum(R) * H * n_ss * 2,), dtype=cp.float32)
        qp = self._idx(q_pos)
        fn = self._sp_fn(D)
        r0 = 0
        for i, r in enumerate(R):
            if r:
                fn((-(-r * G // SP_QT), n_kv, n_ss), (128,),
                   (q, qp, g_rows[r0:r0 + r], meta["cells"][int(off[i]):int(off[i + 1])],
                    meta["cell_pos"][int(off[i]):int(off[i + 1])], len_d[i:i + 1], k_store, v_store, np.int32(r),
                    np.int32(H), np.int32(n_kv), np.float32(scale), np.int32(n_swa), np.float32(softcap),
                    np.int32(n_ss), s_acc[r0 * H * n_ss * D:], s_ml[r0 * H * n_ss * 2:]), shared_mem=_sp_smem(D))
            r0 += r
        out = cp.empty((T, H * D), dtype=cp.float32)
        self._fn("s", "sp_merge")(*merge_launch(T, H, D),
                                  (s_acc, s_ml, np.int32(0), s_acc, s_ml, np.int32(n_ss), slot_d, out, np.int32(H),
                                   np.int32(D)))
        return out

    @staticmethod
    def _attn_group(rows: int, n_kv: int, G: int, D: int, n_cells: int) -> int:
        """Query heads per attention block (the kernels' MAXG, one of ATTN_GROUPS; 4 at most at
        head size 512) for ``rows`` query rows of ``G`` heads per kv head whose views hold up to
        ``n_cells`` cells: all of a kv head's (up to 8) when the grid is big; few rows (decode)
        take blocks of 1 or 2 heads while the blocks stay few (ATTN_SMALL_GRID), so each block's
        serial work shrinks (bench_attn.py, H200, 512 cells: gemma-3-270m's 4 heads per block
        13.8 us, 1 per block 7.9; Qwen2.5-7B's 7 heads 13.7 us, 2 per block 9.9) -- unless the
        rows are long (``n_cells`` >= ATTN_GROUP_CELLS per row: eager, the longest view; in a
        graph, the bucket of all views' cells): their splits fill the grid anyway, and a block
        per head would read (and dequantize) the kv head's cells once per head."""
        groups = [x for x in ATTN_GROUPS if D < 512 or x <= 4]
        g_all = next((x for x in groups if x >= G), groups[-1])
        if n_cells >= ATTN_GROUP_CELLS * rows:
            return g_all
        return next((x for x in groups if rows * n_kv * -(-G // x) <= ATTN_SMALL_GRID), g_all)

    def _attn_splits(self, n_cells: int, base: int, lo: int, rows: int, tile: int = 32) -> int:
        """Split count of ``attn_partial`` when ``base`` blocks (rows x kv heads x head groups) are
        launched per split for ``rows`` query rows whose views hold up to ``n_cells`` cells (eager:
        the longest view; in a graph: the bucket of all views' cells together): ``lo`` if they
        already fill two blocks per SM, else enough splits for that and for splits of at most
        ATTN_SPLIT_CELLS of ``n_cells / rows`` cells (a block walks its split serially: a long
        context needs more of them; the mean, as a graph's bucket bounds the views' sum), at most
        ``n_cells / tile`` (32: the cells of one round of the block's 4 warps, the f16 kernel's
        tiles of 8 and the tier kernels' of 8 or 16; ``_attn_lanes8`` bounds its own) and
        ATTN_MAX_SPLITS, ``lo`` at least."""
        if base >= 2 * self.n_sm:
            return lo
        want = max(-(-2 * self.n_sm // base), -(-n_cells // (ATTN_SPLIT_CELLS * max(1, rows))))
        return int(max(lo, min(n_cells // tile, want, ATTN_MAX_SPLITS)))

    def _attn_lanes8(self, n_cells: int, base: int, rows: int, d: int, ok: bool) -> tuple[int, bool]:
        """``(n_split, l8)`` of the short-row attention kernels (``_attn_splits``' arguments; ``d`` the
        head size, ``ok`` whether the kernel pair has _l8 kernels: f16, or ``cuda_kv.lanes8_ok``):
        the _l8 kernels (8 lanes per cell) with splits of at most ATTN_L8_CELLS cells where the grid
        bound leaves that many splits, at head sizes ATTN_L8_DIMS; else the 4-lane kernels' split
        count. 8 lanes per cell make a warp's tile 4 cells (the 4-lane kernels' 8): with 16-cell
        splits each warp reads one tile, so a block's serial work halves, where 32-cell splits
        would leave each warp two tiles, as before."""
        n_split = self._attn_splits(n_cells, base, 1, rows)
        if ATTN_L8_CELLS <= 0 or d not in ATTN_L8_DIMS or not ok:
            return n_split, False
        n8 = max(1, min(self._attn_splits(n_cells, base, 1, rows, tile=1), -(-n_cells // ATTN_L8_CELLS)))
        return (n8, True) if -(-n_cells // n8) <= ATTN_L8_CELLS else (n_split, False)

    @staticmethod
    def _stream_rows(n_cells: int, rows: int, heads: int) -> bool:
        """Whether ``rows`` query rows whose views hold ``n_cells`` cells (as ``_attn_splits``)
        with ``heads`` blocks per row (kv heads x head groups) take the streaming kernel: one
        row from ATTN_STREAM_CELLS cells, several from ATTN_STREAM_BATCH_CELLS per row on
        average when they give ATTN_STREAM_BATCH_BLOCKS blocks per split (else
        ATTN_STREAM_CELLS)."""
        if ATTN_STREAM_CELLS <= 0:
            return False
        batch = rows > 1 and rows * heads >= ATTN_STREAM_BATCH_BLOCKS
        return n_cells >= (ATTN_STREAM_BATCH_CELLS if batch else ATTN_STREAM_CELLS) * max(1, rows)

    def _stream_pin_smem(self, smem: int, fit: int, blocks: int) -> int:
        """Dynamic shared memory bytes to launch a grid of ``blocks`` streaming attention blocks
        that need ``smem`` bytes and of which ``fit`` are resident per SM (``_blocks_per_sm``)
        with: with ATTN_STREAM_PIN, padded so that nb = ceil(ATTN_STREAM_SM_BLOCKS) blocks fit an
        SM where more would and the grid is one wave of at most nb per SM, else ``smem`` (a larger
        grid, e.g. a batched step's rows, keeps every resident slot). The splits
        (``_attn_stream_splits``) are sized as that wave; where more fit, the block scheduler may
        stack a second block on one SM while another SM stays idle, the kernel's time that of
        the stacked SM (H200, Qwen2.5-7B shapes at 32k cells, q4_0 / q4_0, whose block fits twice:
        297 -> 326 tok/s; the tiers whose block fits once did not move, CUDA_NOTES session 28).
        Never more than the device's per-block maximum."""
        nb = max(1, math.ceil(ATTN_STREAM_SM_BLOCKS))
        if not ATTN_STREAM_PIN or fit <= nb or blocks > nb * self.n_sm:
            return smem
        # (nb + 1) (pad + reserved) > smem_per_sm >= nb (pad + reserved), pad a multiple of 128
        pad = -(-(self.smem_per_sm // (nb + 1) + 1 - self.smem_reserved) // 128) * 128
        return max(smem, min(pad, self.smem_per_block))

    def _attn_stream_splits(self, n_cells: int, base: int, rows: int, fit: int = 1) -> int:
        """Split count of the streaming kernels when ``base`` blocks (rows x kv heads x head
        groups, ``_as_heads``) are launched per split for ``rows`` query rows of ``n_cells`` cells (as
        ``_attn_splits``), for a kernel of which ``fit`` blocks are resident per SM
        (``_blocks_per_sm``): about min(ATTN_STREAM_SM_BLOCKS, fit) blocks per SM, one wave,
        splits of at least ATTN_STREAM_MIN_SPLIT of the mean row's cells, at most
        ATTN_MAX_SPLITS, at least 1."""
        want = -(-int(min(ATTN_STREAM_SM_BLOCKS, max(1, fit)) * self.n_sm) // base)
        longest = n_cells // (max(1, rows) * max(1, ATTN_STREAM_MIN_SPLIT))
        return int(max(1, min(want, longest, ATTN_MAX_SPLITS)))

    def _attention_groups(self, q, q_pos, k_store, v_store, plan, scale: float, n_swa: int, softcap: float,
                          g: int, n_hg: int):
        """``attention_cells`` for a plan with shared-prefix groups (``plan.groups``), f16 K/V.

        1. Private part: ``attn_partial`` (attention.cu) over each view's private cells (a
           grouped view) or all its cells (any other view), always as split partials.
        2. Shared part: per group, ``sp_attn_d<D>`` (shared_prefix.cu) reads the prefix's K/V
           tiles once into shared memory for all the group's rows x the query heads of a kv
           head (tensor-core MMA on f16 hi/lo splits, f32 accumulation), as split partials.
        3. ``sp_merge`` combines both by log-sum-exp per (row, head) (``sp_merge_digits``
           also writes the rows' digits for the output projection, ``_row_digits``).
        Graph-safe: every launch shape follows the plan's group layout and cell buckets,
        which ``run_graph`` puts in its key. Returns ``[T, n_head * d]`` float32, equal to the
        per-sequence path up to float32 summation order."""
        cp = self.cp
        T, H, D = q.shape
        n_kv = k_store.shape[2]
        G = H // n_kv
        gm = self._group_meta(plan, k_store.shape[1])
        qp = self._idx(q_pos)
        f32 = cp.float32
        # 1. private cells (partials even for one split, so the merge below sees one format)
        n_sp = self._attn_splits(gm["pcap"] if self._staged else gm["p_max"], T * n_kv * n_hg, 2, T)
        p_acc = cp.empty((T * H * n_sp * D,), dtype=f32)
        p_ml = cp.empty((T * H * n_sp * 2,), dtype=f32)
        # 2. shared prefix of each group: its sizes and scratch first, so that between the fork of
        # part 1 (on the side stream, _fork) and its join only launches run; a finally joins even
        # when one raises
        R = gm["R"]
        s_len = gm["scaps"] if self._staged else [int(n) for n in (len(gr.cells) for gr in plan.groups)]
        blocks = sum(-(-r * G // SP_QT) for r in R) * n_kv
        n_ss = self._sp_splits(max(s_len), blocks, D)
        r_tot = sum(R)
        s_acc = cp.empty((r_tot * H * n_ss * D,), dtype=f32)
        s_ml = cp.empty((r_tot * H * n_ss * 2,), dtype=f32)
        fn = self._sp_fn(D)
        joined = self._fork(
            self._fn("a", f"attn_partial_d{D}_g{g}"), (T, n_kv * n_hg, n_sp), (128,),
            (q, qp, self._plan_meta(plan, k_store.shape[1])["row_view"], gm["p_off"], gm["p_cells"], gm["p_pos"],
             k_store, v_store, np.int32(H), np.int32(n_kv), np.float32(scale), np.int32(n_swa),
             np.float32(softcap), np.int32(n_sp), p_acc, p_acc, p_ml))
        try:
            r0 = c0 = 0
            for i, (r, cap) in enumerate(zip(R, gm["scaps"])):
                fn((-(-r * G // SP_QT), n_kv, n_ss), (128,),
                   (q, qp, gm["g_rows"][r0:r0 + r], gm["g_cells"][c0:c0 + cap], gm["g_pos"][c0:c0 + cap],
                    gm["g_len"][i:i + 1], k_store, v_store, np.int32(r), np.int32(H), np.int32(n_kv),
                    np.float32(scale), np.int32(n_swa), np.float32(softcap), np.int32(n_ss),
                    s_acc[r0 * H * n_ss * D:], s_ml[r0 * H * n_ss * 2:]), shared_mem=_sp_smem(D))
                r0 += r
                c0 += cap
        finally:
            joined()
        # 3. merge
        out = cp.empty((T, H * D), dtype=f32)
        self._merge("s", "sp_merge", out, H, D, (p_acc, p_ml, np.int32(n_sp), s_acc, s_ml, np.int32(n_ss),
                                                 gm["row_slot"], out, np.int32(H), np.int32(D)))
        return out

    def _fork(self, fn: Kernel, grid, block, args: tuple):
        """Launch ``fn(grid, block, args)`` on a second stream that starts after the work queued
        so far on the current one (SP_FORK; inside a graph capture it becomes a parallel
        branch), and return a call that makes the current stream wait for it. The launch is a
        plain one (no PDL: its only dependency is the fork's event); the caller keeps the
        arguments alive until the join. With SP_FORK off it launches in order and the join is a
        no-op. Errors are CuPy's (``CUDARuntimeError``)."""
        if not SP_FORK:
            fn(grid, block, args)
            return lambda: None
        cp = self.cp
        main = cp.cuda.get_current_stream()
        if self._side is None:
            self._side = cp.cuda.Stream(non_blocking=True)
        forked = cp.cuda.Event(disable_timing=True)
        forked.record(main)
        self._side.wait_event(forked)
        fn.raw(grid, block, args, stream=self._side)
        done = cp.cuda.Event(disable_timing=True)
        done.record(self._side)
        return lambda: main.wait_event(done)

    def _sp_splits(self, n_cells: int, blocks: int, d: int) -> int:
        """Split count of ``sp_attn_d<d>`` over ``n_cells`` cells when ``blocks`` blocks (query
        tiles x kv heads) are launched per split: as many as one wave of resident blocks (the
        kernel's registers and shared memory) holds, splits of at least SP_SPLIT_CELLS cells, at
        most 64, at least 1."""
        fn = self._sp_fn(d)
        slots = self.n_sm * max(1, self._blocks_per_sm(128, fn.raw.num_regs, _sp_smem(d)))
        return int(max(1, min(n_cells // SP_SPLIT_CELLS, slots // max(1, blocks), 64)))

    def _sp_fn(self, d: int):
        """``sp_attn_d<d>`` with its dynamic shared memory limit raised (once) to what it uses."""
        return self._big_smem_fn("s", f"sp_attn_d{d}", _sp_smem(d))

    def _big_smem_fn(self, mod: str, name: str, smem: int):
        """Kernel ``name`` of module ``mod`` with its dynamic shared memory limit raised (once,
        when first fetched) to ``smem`` bytes where that exceeds the default 48 KiB."""
        f = self._fns.get(name)
        if f is None:
            f = _raise_smem(self._fn(mod, name), smem)
        return f
