"""The CUDA backend's launch-shape choices, which are plain host arithmetic (no GPU needed):
decode attention's split count (``CUDABackend._attn_splits``) and the warps per 16-row tile of
the one-token K-quant GEMV (``CUDABackend._gemvi_warps``), on an H200's figures (132 SMs,
228 KiB of shared memory per SM, 227 KiB per block) and a smaller GPU's (sm_86: 100 / 99 KiB)."""

from __future__ import annotations

import itertools

import pytest

from opencoti.engine.backend import cuda as cu


class Device:
    """The backend's device figures and the methods under test (no CUDA context)."""

    _attn_splits = cu.CUDABackend._attn_splits
    _attn_lanes8 = cu.CUDABackend._attn_lanes8
    _attn_stream_splits = cu.CUDABackend._attn_stream_splits
    _gemvi_warps = cu.CUDABackend._gemvi_warps
    _gemvi_warps_auto = cu.CUDABackend._gemvi_warps_auto
    _blocks_per_sm = cu.CUDABackend._blocks_per_sm
    _stream_pin_smem = cu.CUDABackend._stream_pin_smem

    def __init__(self, n_sm: int, smem_per_sm: int, smem_per_block: int, threads_per_sm: int = 2048,
                 blocks_per_sm: int = 32):
        self.n_sm, self.smem_per_sm, self.smem_per_block = n_sm, smem_per_sm, smem_per_block
        self.regs_per_sm, self.threads_per_sm, self.blocks_per_sm, self.smem_reserved = 65536, threads_per_sm, \
            blocks_per_sm, 1024


H200 = Device(132, 233472, 232448)
SM86 = Device(84, 102400, 101376, 1536, 16)


def splits(dev, n_cells, base, lo, rows):
    return dev._attn_splits(n_cells, base, lo, rows)


def test_attn_splits_long_single_sequence():
    """One sequence (the 7B: 4 kv heads x 4 head groups = 16 blocks per split): short lists get
    ~2 blocks per SM (17 splits), long ones splits of <= ATTN_SPLIT_CELLS cells up to
    ATTN_MAX_SPLITS; never fewer than 32 cells per split."""
    assert cu.ATTN_SPLIT_CELLS == 256 and cu.ATTN_MAX_SPLITS == 256
    assert splits(H200, 512, 16, 1, 1) == 16  # 32 cells each
    assert splits(H200, 2048, 16, 1, 1) == 17
    assert splits(H200, 8192, 16, 1, 1) == 32
    assert splits(H200, 32768, 16, 1, 1) == 128
    assert splits(H200, 1 << 20, 16, 1, 1) == 256
    assert splits(H200, 64, 16, 1, 1) == 2


def test_attn_lanes8_short_rows():
    """The _l8 kernels take splits of <= 16 cells where the grid bound leaves them: gemma-3-270m's
    sliding layers (1 kv head x 4 one-head blocks; 512 cells eager, a 1,024-cell bucket in a graph)
    get 32 / 64 splits; rows the bound cuts to longer splits, other head sizes and pairs without
    _l8 kernels keep the 4-lane kernels' split count."""
    assert cu.ATTN_L8_CELLS == 16 and cu.ATTN_L8_DIMS == (256, 512)
    assert H200._attn_lanes8(512, 4, 1, 256, True) == (32, True)
    assert H200._attn_lanes8(1024, 4, 1, 256, True) == (64, True)
    assert H200._attn_lanes8(520, 4, 1, 512, True) == (33, True)  # ceil(520 / 33) = 16
    assert H200._attn_lanes8(512, 4, 1, 256, False) == (16, False)
    assert H200._attn_lanes8(512, 4, 1, 128, True) == (16, False)
    assert H200._attn_lanes8(8192, 4, 1, 256, True) == (66, False)  # 125-cell splits: two 4-lane tiles each
    assert H200._attn_lanes8(1500, 10, 5, 256, True) == (27, False)
    assert H200._attn_lanes8(27, 10, 5, 256, True) == (2, True)  # splits of 14 cells
    assert H200._attn_lanes8(16, 10, 5, 256, True) == (1, True)
    assert H200._attn_lanes8(0, 4, 1, 256, True) == (1, True)  # no cells: one empty split, as _attn_splits


def test_lanes8_ok_tiers():
    """Which tier modules have _l8 kernels (cuda_kv.lanes8_ok, attention.cu KV_L8_OK: a lane's eighth
    of a K row whole blocks, or part of a turbo block): the float and 32-value scalar tiers and
    turbo at head sizes 256 and 512, the trellis tiers at 512 only (their 64-value blocks have no
    part decode), none below 256."""
    from opencoti.engine.backend import cuda_kv

    want = {t: (256, 512) for t in ("f32", "f16", "bf16", "q8_0", "q6_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl",
                                   "turbo8", "turbo4", "turbo3", "turbo2")}
    want.update({"turbo3_tcq": (512,), "turbo2_tcq": (512,)})
    assert set(want) == set(cuda_kv.TIER_STRUCTS)
    for t, dims in want.items():
        assert tuple(d for d in (64, 128, 256, 512) if cuda_kv.lanes8_ok(t, d)) == dims, t


def test_attn_splits_batched_graph_bucket():
    """In a captured graph the cell count is the bucket of all rows' cells together: the length
    term takes the mean row, so 64 rows of ~1,000 cells (bucket 65,536) do not ask for 256
    splits; a grid that already fills two blocks per SM keeps ``lo``."""
    assert splits(H200, 65536, 256, 1, 64) == 4  # 7B x64: 64 rows x 4 kv heads
    assert splits(H200, 32768, 128, 1, 32) == 4  # 7B x32
    assert splits(H200, 32768, 32, 1, 32) == 9  # 270m x32: ~2 blocks per SM as before
    assert splits(H200, 65536, 264, 1, 64) == 1
    assert splits(H200, 65536, 264, 2, 64) == 2  # the shared-prefix caller's minimum


@pytest.mark.parametrize("dev", [H200, SM86])
def test_gemvi_warps(monkeypatch, dev):
    """Warps per tile: about GEMVI_WARPS_PER_SM warps per SM in all, at most 8 and one per
    super-block, halved while the grid would not be resident at once if that makes it so, and
    always few enough that a block's ring fits the device's shared memory per block."""
    monkeypatch.setattr(cu, "GEMVI_WARPS", 0)
    q4, q6 = 2 * 16 * 144, 2 * 16 * 240  # 2 ring slots of 16 rows
    w = lambda blocks, nsb, wb, regs=64: dev._gemvi_warps(blocks, nsb, wb, regs)  # noqa: E731
    if dev is H200:
        assert w(1184, 14, q4) == 2  # 7B ffn_up: 18,944 rows
        assert w(224, 14, q4) == 8  # 7B attn_q: 3,584 rows
        assert w(224, 74, q6, 80) == 8  # 7B ffn_down (Q6_K, 18,944 columns)
        assert w(9504, 14, q6, 80) == 1  # 7B output head
        assert w(2, 1, q4) == 1  # one super-block per row: one warp
    for blocks, nsb, wb in ((224, 74, 4 * 16 * 240), (3, 74, 6 * 16 * 240)):
        ks = w(blocks, nsb, wb)
        assert ks >= 1 and ks * wb <= dev.smem_per_block
    monkeypatch.setattr(cu, "GEMVI_WARPS", 64)  # forced: still a block that fits (<= 32 warps)
    ks = w(224, 74, q6)
    assert ks <= 32 and ks * q6 <= dev.smem_per_block
    monkeypatch.setattr(cu, "GEMVI_WARPS", 13)  # forced, two row tiles of Q6_K: 13 x 32 x 168 registers > 65,536
    assert w(112, 74, 2 * 32 * 240, 168) == 6


def test_attn_group_heads_per_block():
    """Query heads per block: decode-size grids split a kv head's heads (ATTN_SMALL_GRID blocks),
    long rows (ATTN_GROUP_CELLS cells each) and big grids keep them all; head size 512 stops at 4."""
    assert cu.ATTN_SMALL_GRID == 16 and cu.ATTN_GROUP_CELLS == 4096
    group = cu.CUDABackend._attn_group
    assert group(1, 4, 7, 128, 512) == 2  # the 7B, one sequence: 4 kv heads x 4 blocks of 2
    assert group(1, 1, 4, 256, 512) == 1  # gemma-3-270m
    assert group(1, 4, 7, 128, 4096) == 8  # a long row: all 7 heads (kernel MAXG 8)
    assert group(1, 1, 4, 256, 32768) == 4
    assert group(8, 4, 7, 128, 8 * 4095) == 8  # a big grid: all heads
    assert group(2, 1, 4, 256, 2 * 4095) == 1  # 2 rows x 1 kv head x 4 blocks of 1 <= 16
    assert group(2, 1, 4, 256, 2 * 4096) == 4  # the bucket of 2 rows of 4,096 cells
    assert group(1, 2, 16, 512, 100) == 2  # 2 kv heads x 8 blocks of 2 <= 16
    assert group(4, 2, 16, 512, 100) == 4  # head size 512: 4 heads at most
    assert group(1, 2, 16, 512, 1 << 20) == 4


def test_stream_tile_and_shared_memory(monkeypatch):
    """The streaming attention kernel's tile (``_as_tile``, attn_stream.cuh ``AsLayout::CT``) and
    shared memory (``_as_smem``): 128-cell tiles of 8 warps up to head size 128 (a tier module
    built with ``AS_BIG_D`` 256: up to 256) where two stages fit AS_BIG_BYTES, 64 cells otherwise; every stream-eligible tier pair's block fits an H200
    block (so the kernel is taken), and the turbo tables add their bytes (kv_codes.cuh)."""
    import numpy as np

    from opencoti.engine.backend import cuda_kv
    from opencoti.engine.kv_tiers import get_tier

    assert cu._as_tile(128, 256, 256) == 128  # f16, 7B heads
    assert cu._as_tile(256, 512, 512) == 64  # f16, gemma-3-270m heads
    assert cu._as_tile(256, 272, 272) == 64  # q8_0's rows under the f16 module's rule: 4 warps
    assert cu._as_tile(64, 68, 68) == 128
    # a tier module built with AS_BIG_D 256 (ATTN_STREAM_BIG_D): turbo3 / q8_0 rows at 256 take
    # 8 warps (two stages 57,344 / 139,264 bytes), f16's never (270,336)
    monkeypatch.setattr(cu, "ATTN_STREAM_BIG_D", 256)
    assert cu._as_tile(256, 104, 104, True) == 128 and cu._as_tile(256, 272, 272, True) == 128
    assert cu._as_tile(256, 512, 512, True) == 64
    assert cu._as_smem(256, 104, 104, 256, 256, tiers=True) == 8448 + 3 * 128 * 224 + 3 * 128 * 4 + 64 + 512
    # ... which the tier module is built with (the backend's ATTN_STREAM_BIG_D, in its module key)
    assert "#define AS_BIG_D 256\n" in cuda_kv.attention_source("turbo3", "turbo3", 256, big_d=256)
    assert "#define AS_BIG_D 128\n" in cuda_kv.attention_source("turbo3", "turbo3", 256, big_d=128)
    assert cu.AS_BIG_D == 128
    # f16 / f16 at 128, 8 heads a block: queries 4,352 (hi + lo, 8 x 136 halves) + 2 stages of 128 x
    # (272 + 272) + positions 1,024 + 64; 16 heads a block: queries 8,704
    assert cu._as_smem(128, 256, 256) == 4352 + 2 * 128 * 544 + 2 * 128 * 4 + 64
    assert cu._as_smem(128, 256, 256, hn=16) == 8704 + 2 * 128 * 544 + 2 * 128 * 4 + 64
    # q8_0 / q8_0 at 128: rows of 136 bytes, stride 144; three stages fit 110,592
    assert cu._as_smem(128, 136, 136) == 4352 + 3 * 128 * 288 + 3 * 128 * 4 + 64
    # rows of 36 bytes (turbo2 at 128, stride 48): 3 stages take 36,864; at 16 heads a block the warps'
    # merge tile (8 warps x 16 heads x 128 dims + their m / l) is larger and sets the size
    assert cu._as_smem(128, 36, 36) == 4352 + 3 * 128 * 96 + 3 * 128 * 4 + 64
    assert cu._as_smem(128, 36, 36, hn=16) == 8704 + 8 * 16 * 128 * 4 + 2 * 8 * 16 * 4 + 3 * 128 * 4 + 64
    assert [cu._as_heads(g) for g in (1, 4, 7, 8, 9, 16, 20)] == [8, 8, 8, 8, 16, 16, 16]
    assert cu._as_heads(16, 256) == 16 and cu._as_heads(16, 128, True) == 16
    assert cu._as_heads(16, 256, True) == 8  # a tier pair's 16-head kernel spills at 256
    # turbo: an f16 pair per pair table entry, K's and V's alike (kv_codes.cuh TBK / TBV)
    assert cuda_kv.stream_table_bytes("turbo3", True) == 256 and cuda_kv.stream_table_bytes("turbo3", False) == 256
    assert cuda_kv.stream_table_bytes("turbo4", True) == 1024 and cuda_kv.stream_table_bytes("q8_0", True) == 0
    assert cuda_kv.stream_table_bytes("turbo2_tcq", False) == 1024
    for d in cu.AS_HEAD_DIMS:
        for name in cuda_kv.KV_TYPES:
            if name in ("f32", "bf16"):
                continue
            x = get_tier(name).quantize(np.zeros((1, d), np.float32))
            rb = x.shape[-1] * x.dtype.itemsize
            if rb % 4:
                continue
            for hn, big_d in itertools.product((8, 16), (128, 256)):
                monkeypatch.setattr(cu, "ATTN_STREAM_BIG_D", big_d)
                smem = cu._as_smem(d, rb, rb, cuda_kv.stream_table_bytes(name, True),
                                   cuda_kv.stream_table_bytes(name, False), hn, True)
                assert smem <= H200.smem_per_block, (name, d, hn, big_d, smem)


def test_gemvi_row_tiles(monkeypatch):
    """Row tiles per warp of the one-token ring GEMV (``gemvi_row_tiles``): two for Q4_K, for
    Q6_K only when the two-tile grid keeps GEMVI_R2_Q6_BLOCKS blocks per SM (the 7B's 152,064-row
    output, not its 3,584-row ffn_down); one with 4 ring slots (no _r2 kernels); a forced count
    wins."""
    monkeypatch.setattr(cu, "GEMVI_ROW_TILES", 0)
    monkeypatch.setattr(cu, "GEMVI_STAGES", 2)
    assert cu.gemvi_row_tiles(12, 512, 132) == 2 and cu.gemvi_row_tiles(12, 18944, 132) == 2
    assert cu.gemvi_row_tiles(14, 3584, 132) == 1 and cu.gemvi_row_tiles(14, 152064, 132) == 2
    assert cu.gemvi_row_tiles(14, 32 * 8 * 132 - 1, 132) == 1 and cu.gemvi_row_tiles(14, 32 * 8 * 132, 132) == 2
    monkeypatch.setattr(cu, "GEMVI_ROW_TILES", 1)
    assert cu.gemvi_row_tiles(12, 18944, 132) == 1
    monkeypatch.setattr(cu, "GEMVI_ROW_TILES", 0)
    monkeypatch.setattr(cu, "GEMVI_STAGES", 4)
    assert cu.gemvi_row_tiles(12, 18944, 132) == 1 and cu.gemvi_row_tiles(14, 152064, 132) == 1


def test_gemmi_splits(monkeypatch):
    """gemmi's super-block splits (``gemmi_splits``) on 132 SMs at 3 blocks per SM (396 slots),
    7B shapes at 32 rows (2 token groups): ffn_up alone (592 blocks) splits in 2 (2.99 waves, not
    1.49); the fused gate / up (1,184 blocks, 2.99 waves) and the output (4,752 blocks, 12 waves)
    are not split; q / k / v (144 blocks) and attn_output / ffn_down (112), less than a wave,
    keep the >= 2 blocks per SM; never more splits than super-blocks."""
    monkeypatch.setattr(cu, "GEMMI_BLOCKS", 3)
    assert cu.gemmi_splits(2 * 296, 14, 132) == 2
    assert cu.gemmi_splits(2 * 592, 14, 132) == 1
    assert cu.gemmi_splits(2 * 2376, 14, 132) == 1
    assert cu.gemmi_splits(2 * 72, 14, 132) == 2
    assert cu.gemmi_splits(2 * 56, 14, 132) == 3 and cu.gemmi_splits(2 * 56, 74, 132) == 3
    assert cu.gemmi_splits(1, 2, 132) == 2 and cu.gemmi_splits(4, 1, 132) == 1
    assert cu.gemmi_splits(600, 1, 132) == 1


def test_gemmi_ring_stages(monkeypatch):
    """gemmi_ring's stage count (``gemmi_ring_stages``): by default 3 for 2-digit tiles (4 column
    tiles), 2 for 3-digit ones (6); a forced count where that kernel is built, else (and for 0)
    the register-prefetch kernel."""
    monkeypatch.setattr(cu, "GEMMI_RING", None)
    assert cu.gemmi_ring_stages(4) == 3 and cu.gemmi_ring_stages(6) == 2 and cu.gemmi_ring_stages(8) == 3
    monkeypatch.setattr(cu, "GEMMI_RING", 4)
    assert cu.gemmi_ring_stages(4) == 4 and cu.gemmi_ring_stages(6) == 0
    monkeypatch.setattr(cu, "GEMMI_RING", 0)
    assert cu.gemmi_ring_stages(4) == 0 and cu.gemmi_ring_stages(6) == 0


def test_gemmi_tiles(monkeypatch):
    """gemmi's digit layout (``gemmi_tiles``) and each weight's kernel (``gemmi_kernel_tiles``):
    by default 32-token groups (8 tiles) for 2-digit steps of more than 16 rows, where the
    8-tile ring kernel fits the device's shared memory per block, with Q6_K on 32-token blocks
    and Q4_K on 16-token ones (2 nd tiles); GEMMI_TOKENS forces one width for both; the register
    kernel (GEMMI_RING 0) has no 8-tile form."""
    monkeypatch.setattr(cu, "GEMMI_RING", None)
    monkeypatch.setattr(cu, "GEMMI_TOKENS", None)
    big = 232448
    assert [cu.gemmi_tiles(n, nd, big) for n, nd in ((9, 2), (16, 2), (17, 2), (64, 2), (32, 3))] == [4, 4, 8, 8, 6]
    assert [cu.gemmi_kernel_tiles(8, 2, t, big) for t in (12, 14)] == [4, 8]
    assert [cu.gemmi_kernel_tiles(4, 2, t, big) for t in (12, 14)] == [4, 4] and cu.gemmi_kernel_tiles(6, 3, 14, big) == 6
    monkeypatch.setattr(cu, "GEMMI_TOKENS", 16)
    assert [cu.gemmi_tiles(n, nd, big) for n, nd in ((9, 2), (32, 2), (64, 2), (32, 3))] == [4, 4, 4, 6]
    monkeypatch.setattr(cu, "GEMMI_TOKENS", 32)
    assert cu.gemmi_tiles(32, 2, big) == 8 and [cu.gemmi_kernel_tiles(8, 2, t, big) for t in (12, 14)] == [8, 8]
    # 3 stages of 64 digit columns and 64 Q6_K rows: 3 x (17,408 + 256 + 15,360) bytes
    assert cu.gemmi_ring_smem(8, 3, 14) == 99072 and cu.gemmi_ring_smem(4, 3, 12) == 3 * (8704 + 128 + 9216)
    assert cu.gemmi_tiles(32, 2, 99072) == 8 and cu.gemmi_tiles(32, 2, 99071) == 4
    monkeypatch.setattr(cu, "GEMMI_RING", 0)
    assert cu.gemmi_tiles(32, 2, big) == 4


def test_group_caps_private_floor(monkeypatch):
    """A grouped plan's graph-key capacities (``_group_caps``): the private lists' bucket is at
    least GROUP_PRIVATE_CELLS per grouped view (a view outside the groups counts its cells only),
    so 8 sharers whose private cells grow from ~20 to ~85 keep one key (a plain bucket moved 256 ->
    512 on the way); exact lengths for the eager path; shared lists a plain bucket; 0 restores the
    plain bucket."""
    from types import SimpleNamespace as NS

    def plan(n_priv, n_views=8, n_other=0):
        views = [NS(private=range(n_priv), cells=range(5000 + n_priv)) for _ in range(n_views)]
        views += [NS(private=range(0), cells=range(n_other))]  # a view outside the group
        return NS(views=views, groups=[NS(views=list(range(n_views)), cells=range(5000))])

    caps = cu.CUDABackend._group_caps
    monkeypatch.setattr(cu, "GROUP_PRIVATE_CELLS", 256)
    assert caps(plan(21, n_other=3), exact=True) == (8 * 21 + 3, (5000,))
    assert {caps(plan(n), exact=False) for n in range(21, 86)} == {(2048, (8192,))}  # 8 sharers x 256
    assert {caps(plan(n, n_other=2000), exact=False)[0] for n in range(21, 86)} == {4096}  # + 2,000 cells
    assert caps(plan(300), exact=False) == (4096, (8192,)) and caps(plan(600), exact=False) == (8192, (8192,))
    monkeypatch.setattr(cu, "GROUP_PRIVATE_CELLS", 0)
    assert caps(plan(21), exact=False)[0] == 256 and caps(plan(40), exact=False)[0] == 512


def test_stream_rows(monkeypatch):
    """Which decode rows take the streaming attention kernel (``_stream_rows``; cells as the
    bucket of all rows): one row from ATTN_STREAM_CELLS (2,048) cells; several from 256 per row
    when they give >= 32 blocks per split (the 7B's 4 kv heads at 8 rows, the 270m's 1 at 32),
    else the one-row rule (the 270m at 8 rows); none with ATTN_STREAM_CELLS = 0."""
    assert cu.ATTN_STREAM_CELLS == 2048 and cu.ATTN_STREAM_BATCH_CELLS == 256 and cu.ATTN_STREAM_BATCH_BLOCKS == 32
    rows = cu.CUDABackend._stream_rows
    assert not rows(2047, 1, 4) and rows(2048, 1, 4)
    assert rows(8 * 256, 8, 4) and not rows(8 * 255, 8, 4)
    assert not rows(8 * 600, 8, 1) and rows(8 * 2048, 8, 1)
    assert rows(32 * 512, 32, 1)
    monkeypatch.setattr(cu, "ATTN_STREAM_CELLS", 0)
    assert not rows(1 << 20, 1, 4) and not rows(1 << 20, 32, 4)


def test_tile_rows16_places_blocks():
    """``tile_rows16``: block j of row r lands at ``(r // 16) * 16 * row_bytes + (16 j + r % 16) *
    block_bytes`` (the address quants.cuh ``qrow`` computes), each tile keeping its 16 rows' bytes,
    for Q4_K- and Q6_K-sized blocks; shapes that do not tile raise ValueError."""
    import numpy as np

    rng = np.random.default_rng(0)
    for bs in (144, 210):
        rows, nb = 48, 5
        raw = rng.integers(0, 256, (rows, nb * bs), dtype=np.uint8)
        t = cu.tile_rows16(raw, bs)
        assert t.shape == raw.shape and t.dtype == np.uint8
        flat = t.reshape(-1)
        for r in range(rows):
            for j in range(nb):
                a = (r // 16) * 16 * raw.shape[1] + (16 * j + r % 16) * bs
                assert (flat[a:a + bs] == raw[r, j * bs:(j + 1) * bs]).all(), (bs, r, j)
        for i in range(rows // 16):  # a tile's bytes are its own rows' bytes, permuted
            assert sorted(t[16 * i:16 * i + 16].reshape(-1)) == sorted(raw[16 * i:16 * i + 16].reshape(-1))
    with pytest.raises(ValueError):
        cu.tile_rows16(np.zeros((40, 144), np.uint8), 144)  # 40 rows: not whole tiles
    with pytest.raises(ValueError):
        cu.tile_rows16(np.zeros((16, 200), np.uint8), 144)  # not whole blocks


def test_tiles_weight(monkeypatch):
    """Which weights upload in 16-row tiles: Q4_K / Q6_K with rows a multiple of 16, while the
    integer kernels take every GEMV row count; never with OPENCOTI_CUDA_TILED=0."""
    assert cu.tiles_weight(12, 18944, 3584) and cu.tiles_weight(14, 3584, 18944) and cu.tiles_weight(14, 512, 3584)
    assert cu.tiles_weight(12, 1024, 768)  # small ones too: a tiled weight always takes the integer path
    assert not cu.tiles_weight(8, 18944, 3584)  # Q8_0: no tiled kernels
    assert not cu.tiles_weight(12, 18936, 3584)  # rows not a multiple of 16
    monkeypatch.setattr(cu, "IMMA_MAX_ROWS", 0)
    assert not cu.tiles_weight(12, 1024, 768)
    monkeypatch.setattr(cu, "IMMA_MAX_ROWS", 8)
    monkeypatch.setattr(cu, "IMMA_BATCH", False)
    assert not cu.tiles_weight(12, 1024, 768)
    monkeypatch.setattr(cu, "IMMA_BATCH", True)
    monkeypatch.setattr(cu, "TILED", False)
    assert not cu.tiles_weight(12, 18944, 3584)


def test_merge_launch_windows():
    """The attention merges take a block per 256-element window of a row (lse_merge.cuh), with
    LSE_GROUPS groups of 256 threads, the define the host mirrors as MERGE_GROUPS: a window may
    hold part of a head (512), several heads (64), and a row's last window may be partial (28
    heads of 32: 896 elements, 4 windows)."""
    import re
    from importlib import resources

    src = resources.files("opencoti.cuda_src").joinpath("lse_merge.cuh").read_text()
    assert int(re.search(r"#define LSE_GROUPS (\d+)", src).group(1)) == cu.MERGE_GROUPS
    assert cu.merge_launch(1, 4, 256) == ((1, 4), (256 * cu.MERGE_GROUPS,))
    assert cu.merge_launch(12, 28, 128) == ((12, 14), (1024,))
    assert cu.merge_launch(3, 8, 512) == ((3, 16), (1024,))
    assert cu.merge_launch(1, 12, 64) == ((1, 3), (1024,))
    assert cu.merge_launch(2, 28, 32) == ((2, 4), (1024,))
    assert cu.merge_launch(1, 5, 96) == ((1, 2), (1024,))  # 96: a window touches 3 heads
    # the cluster kernels: the window's four chains as four 256-thread blocks along z
    assert cu.merge_launch(1, 4, 256, cluster=True) == ((1, 4, cu.MERGE_GROUPS), (256,))
    assert cu.merge_launch(12, 28, 128, cluster=True) == ((12, 14, 4), (256,))
    assert "__cluster_dims__(1, 1, LSE_GROUPS)" in src
    for d in (0, 16, 33, 80):  # a head size below 32 or off its multiples could touch a 9th head
        with pytest.raises(ValueError, match="multiple of 32"):
            cu.merge_launch(1, 8, d)


def test_attn_stream_splits_resident_blocks(monkeypatch):
    """The streaming kernels' splits fill one wave: min(ATTN_STREAM_SM_BLOCKS, the blocks of the
    kernel resident per SM) per SM, so a knob above what fits does not make a second wave (the
    270m's f16 block fits once per SM by its shared memory, a q4_0 block twice)."""
    monkeypatch.setattr(cu, "ATTN_STREAM_MIN_SPLIT", 128)
    monkeypatch.setattr(cu, "ATTN_MAX_SPLITS", 256)
    monkeypatch.setattr(cu, "ATTN_STREAM_SM_BLOCKS", 1.0)
    assert H200._attn_stream_splits(65536, 1, 1, 2) == 132
    monkeypatch.setattr(cu, "ATTN_STREAM_SM_BLOCKS", 2.0)
    assert H200._attn_stream_splits(65536, 1, 1, 1) == 132
    assert H200._attn_stream_splits(65536, 1, 1, 2) == 256  # 264 wanted, ATTN_MAX_SPLITS
    assert H200._attn_stream_splits(16384, 1, 1, 2) == 128  # splits of at least 128 cells
    assert H200._attn_stream_splits(65536, 4, 1, 2) == 66
    assert H200._attn_stream_splits(65536, 4, 1, 0) == 33  # no fit reported: one block per SM


def test_blocks_per_sm_occupancy_rules():
    """Resident blocks per SM (``_blocks_per_sm``) by the occupancy calculator's rules, on the
    kernels it sizes: registers per warp in units of 256 with warps in groups of 4, the SM's
    thread limit, shared memory in 128-byte units plus 1 KiB per block, 32 blocks."""
    # registers alone (no shared memory): the 7B's q8_0 streaming block, 184 registers x 8 warps
    # (47,104 of 65,536, but a warp's 5,888 allow 2 warps per sub-partition: 8 warps, one block);
    # the 270m's turbo3 block, 255 x 4 warps (8,192 a warp: 8 warps, two blocks)
    assert H200._blocks_per_sm(256, 184, 0) == 1
    assert H200._blocks_per_sm(128, 255, 0) == 2
    # 168 registers x 4 warps: 5,376 a warp, 3 per sub-partition, 3 blocks; at 170 a warp takes
    # 5,632 (2 per sub-partition): 2 blocks, where registers / (threads x regs) said 3
    assert H200._blocks_per_sm(128, 168, 0) == 3
    assert H200._blocks_per_sm(128, 170, 0) == 2
    # 96 registers x 1,024 threads: 3,072 a warp, 5 per sub-partition, 20 warps: a 32-warp block
    # does not fit; at 16 registers the registers hold 4 such blocks, the SM's threads 2 (sm_90)
    # or 1 (sm_86's 1,536)
    assert H200._blocks_per_sm(1024, 96, 0) == 0
    assert H200._blocks_per_sm(1024, 16, 0) == 2 and SM86._blocks_per_sm(1024, 16, 0) == 1
    # shared memory: 113 KiB + the reserved 1 KiB twice fit 228 KiB, 1 byte more rounds up to 128
    assert H200._blocks_per_sm(128, 32, 113 * 1024) == 2
    assert H200._blocks_per_sm(128, 32, 113 * 1024 + 1) == 1
    # the block limits: 32 blocks on sm_90, 16 on sm_86
    assert H200._blocks_per_sm(32, 16, 0) == 32 and SM86._blocks_per_sm(32, 16, 0) == 16
    assert SM86._blocks_per_sm(128, 32, 101 * 1024) == 0  # does not fit at all


def test_gemvi_forced_warps_fit_registers(monkeypatch):
    """A forced GEMVI_WARPS is halved until one block fits the SM by the occupancy rules: at 170
    registers a warp takes 5,632, 2 per sub-partition, 8 warps per SM, so a forced 16 (nsb 12:
    12 warps, which 12 x 32 x 170 <= 65,536 would have let through) halves to 6, and 16 to 8;
    6 warps at 96 registers fit as they are."""
    monkeypatch.setattr(cu, "GEMVI_WARPS", 16)
    assert H200._gemvi_warps(132, 12, 0, 170) == 6
    assert H200._gemvi_warps(132, 16, 0, 170) == 8
    assert H200._gemvi_warps(132, 6, 0, 96) == 6


@pytest.mark.parametrize("dev", [H200, SM86])
def test_stream_pin_smem(dev, monkeypatch):
    """``_stream_pin_smem``: a streaming block that fits an SM more often than the splits' one wave
    (ceil(ATTN_STREAM_SM_BLOCKS) blocks per SM) launches with its shared memory padded to exactly
    that many per SM; a block that fits no more often, a grid larger than that wave (a batched
    step's rows) or ATTN_STREAM_PIN=0 keeps its bytes."""
    monkeypatch.setattr(cu, "ATTN_STREAM_SM_BLOCKS", 1)
    smem = 40 * 1024  # 125 registers x 256 threads: two blocks per SM by registers (q4_0 / q4_0 at 128)
    fit = dev._blocks_per_sm(256, 125, smem)
    assert fit >= 2
    pinned = dev._stream_pin_smem(smem, fit, dev.n_sm)
    assert pinned > smem and pinned % 128 == 0 and pinned <= dev.smem_per_block
    assert dev._blocks_per_sm(256, 125, pinned) == 1
    assert dev._stream_pin_smem(smem, fit, dev.n_sm + 1) == smem  # two waves pinned: keep both slots
    assert dev._stream_pin_smem(smem, 1, dev.n_sm) == smem
    big = dev.smem_per_sm // 2  # fits once already
    assert dev._stream_pin_smem(big, dev._blocks_per_sm(256, 125, big), dev.n_sm) == big
    monkeypatch.setattr(cu, "ATTN_STREAM_SM_BLOCKS", 1.5)  # two blocks per SM of a block that fits more
    small = 8 * 1024
    padded = dev._stream_pin_smem(small, dev._blocks_per_sm(128, 64, small), 2 * dev.n_sm)
    assert dev._blocks_per_sm(128, 64, padded) == 2
    monkeypatch.setattr(cu, "ATTN_STREAM_PIN", 0)
    assert dev._stream_pin_smem(smem, fit, dev.n_sm) == smem


def test_merge_signs_where_the_merge_unrotates(monkeypatch):
    """attn_merge gets the rotated tiers' sign words (``_merge_signs``) exactly where the tier
    modules leave a rotated V tier's partials rotated: a turbo or trellis V tier, several splits,
    head size up to 256 (attn_stream.cuh ``merge_unrotates``, built into each module as
    ``KV_MERGE_UNROTATE``); a null pointer otherwise, and everywhere with MERGE_UNROTATE off."""
    from opencoti.engine.backend import cuda_kv

    class Backend:
        _merge_signs = cu.CUDABackend._merge_signs
        _kv_signs_dev = object()

    be = Backend()
    on = [(tv, d, n) for tv in ("turbo3", "turbo2_tcq", "q8_0", "f16") for d in (64, 256, 512) for n in (1, 5)
          if be._merge_signs(tv, d, n) is be._kv_signs_dev]
    assert on == [("turbo3", 64, 5), ("turbo3", 256, 5), ("turbo2_tcq", 64, 5), ("turbo2_tcq", 256, 5)]
    assert be._merge_signs("q8_0", 256, 5) == cu._NULL
    monkeypatch.setattr(cu, "MERGE_UNROTATE", False)
    assert be._merge_signs("turbo3", 256, 5) == cu._NULL
    assert "#define KV_MERGE_UNROTATE 0\n" in cuda_kv.attention_source("q8_0", "turbo3", 128, merge_unrotate=False)
    assert "#define KV_MERGE_UNROTATE 1\n" in cuda_kv.attention_source("q8_0", "turbo3", 128)
