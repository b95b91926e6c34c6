"""Vulkan backend: KV tiers, mixture of experts and the hybrid (gated delta-net) ops,
each against the CPU backend (the reference), then tiny random-weight models end to end.

- KV tiers (``kv_store.comp``, ``kv_rot.comp``, ``attn.comp`` KV_ANY): the bytes Vulkan
  writes equal the CPU tier's ``quantize`` exactly (rows that end mid-word, all-zero blocks,
  ties for the largest magnitude, scales over 8 decades; for the rotated tiers also one-hot
  rows, whose rotated values all have one magnitude, so Viterbi path costs tie), and attention read from those same bytes equals the CPU's to float32
  rounding (2e-5 relative); models with ``-ctk`` / ``-ctv`` give the CPU's greedy tokens
  and logits (K shift included), the rotated tiers too.
- MoE (``moe.comp``, ``mul_mat_vec.comp`` MUL_MAT_ID): both layouts, three weight
  types, decode and prefill sizes, both GEMV layouts; Gemma-4 MoE end to end.
- Hybrid: ``sigmoid``, ``softplus``, ``l2_norm``, ``ssm_conv`` and ``gated_delta_net`` with
  two sequences in one ubatch (state updated in place); qwen35, qwen35moe and qwen3next
  end to end (prefill, decode graphs, two sequences, a full-state ``seq_cp``).

Model tolerance as ``test_vulkan.py``: max |logit difference| < 2e-3 * max(1, max |logit|)
(measured on lavapipe: hybrid 7e-5 of 4.2, Gemma-4 MoE 1.5e-3 of 8.7, quantized KV 0.014
of 45 after a K shift whose requantization may round one code differently).
"""

from __future__ import annotations

import numpy as np
import pytest
from decode_runs import greedy_run
from vk_guard import vulkan_devices

vulkan_devices()

import gguf  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from opencoti.engine.batch import UBatch  # noqa: E402
from opencoti.engine.kv_cache import KVCache  # noqa: E402
from opencoti.engine.kv_tiers import get_tier  # noqa: E402
from opencoti.engine.recurrent_state import RSPlan, RSView  # noqa: E402
from opencoti.engine.runner import ModelRunner, iter_logits  # noqa: E402

pytestmark = pytest.mark.vulkan

ROTATED_TIERS = ("turbo8", "turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq")


def _close(got, want, what=""):
    err = float(np.max(np.abs(got - want)))
    assert err < 2e-3 * max(1.0, float(np.max(np.abs(want)))), (what, err)


# ---------------------------------------------------------------------------------------
# KV tiers
# ---------------------------------------------------------------------------------------
def _kv_values(rng, T, n_kv, d):
    """K/V rows with scales from 1e-3 to 1e3 (f16 scale fields stay finite), an all-zero head row, and rows whose largest
    magnitude occurs twice with opposite signs (the first one sets a signed scale)."""
    x = rng.standard_normal((T, n_kv, d)) * 10.0 ** rng.uniform(-3, 3, (T, n_kv, 1))
    x = x.astype(np.float32)
    x[1, 0] = 0.0
    x[2, 0, 7] = -np.abs(x[2, 0]).max() * 1.5
    x[2, 0, 3] = -x[2, 0, 7]  # a tie: value 3 comes first
    return x


@pytest.mark.parametrize("type_k,type_v,d,n_kv", [
    ("q8_0", "q8_0", 32, 1),   # 34-byte rows: cells share words
    ("q6_0", "q6_0", 64, 2),
    ("q5_1", "q5_1", 32, 3),
    ("q5_0", "q5_0", 32, 1),
    ("q4_0", "q4_0", 64, 1),
    ("q4_1", "q4_1", 32, 3),   # 20-byte rows
    ("iq4_nl", "iq4_nl", 64, 2),
    ("iq4_nl", "q4_1", 128, 1),
    ("bf16", "bf16", 64, 2),
    ("q4_0", "f16", 64, 2),    # mixed tiers: one dispatch per half, the any-tier attention
    ("f32", "q8_0", 32, 2),
    ("turbo3", "turbo3", 64, 1),         # rotated tiers: 26-byte rows share words
    ("turbo4", "turbo8", 128, 2),
    ("turbo2", "q8_0", 256, 1),          # only K rotated
    ("turbo3_tcq", "turbo2_tcq", 64, 2),
    ("q8_0", "turbo3_tcq", 512, 1),      # only V rotated, the largest head size
])
def test_kv_tier_bytes_and_attention_equal_cpu(vk, cpu, type_k, type_v, d, n_kv):
    """kv_write stores the CPU tier's exact bytes; attention over those bytes (plain and
    split-K) equals the CPU's dequantize-then-attend."""
    rng = np.random.default_rng(11)
    T, n_head = 37, 2 * n_kv
    caches = [KVCache([0], 64, 1, 1, n_head_kv=n_kv, d_k=d, d_v=d, type_k=type_k, type_v=type_v, zeros=z)
              for z in (vk.zeros, np.zeros)]
    seqs, pos = np.zeros(T, np.int64), np.arange(T, dtype=np.int32)
    plans = []
    for c in caches:
        plans.append(c.prepare(seqs, pos))
        c.apply(plans[-1], seqs, pos)
    k, v = _kv_values(rng, T, n_kv, d), _kv_values(rng, T, n_kv, d)
    vk.kv_write(caches[0], 0, plans[0], vk.asarray(k), vk.asarray(v))
    caches[1].write(0, plans[1], k, v)
    for a, b in ((caches[0].k[0], caches[1].k[0]), (caches[0].v[0], caches[1].v[0])):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), b.view(np.uint8))
    q = rng.standard_normal((T, n_head, d)).astype(np.float32)
    tiers = dict(type_k=caches[1].tier_k, type_v=caches[1].tier_v)
    want = cpu.attention_cells(q, pos, caches[1].k[0], caches[1].v[0], plans[1], 0.1, **tiers)
    saved = vk.attn_target_groups, vk.attn_split_cells
    try:
        for groups, split in ((1, 256), (512, 8)):
            vk.attn_target_groups, vk.attn_split_cells = groups, split
            got = vk.to_host(vk.attention_cells(vk.asarray(q), pos, caches[0].k[0], caches[0].v[0], plans[0], 0.1,
                                                **tiers))
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))
    finally:
        vk.attn_target_groups, vk.attn_split_cells = saved


def _vk_stored_k(vk, type_k, x):
    """K rows ``x`` float32 [T, n_kv, d] written by the device's kv_write into a ``type_k`` cache
    -> its stored rows (uint8 [T, n_kv, row bytes], or the float array for f32 / f16)."""
    T, n_kv, d = x.shape
    cache = KVCache([0], T, 1, 1, n_head_kv=n_kv, d_k=d, d_v=d, type_k=type_k, type_v="f16", zeros=vk.zeros)
    seqs, pos = np.zeros(T, np.int64), np.arange(T, dtype=np.int32)
    plan = cache.prepare(seqs, pos)
    cache.apply(plan, seqs, pos)
    vk.kv_write(cache, 0, plan, vk.asarray(x), vk.asarray(np.zeros_like(x)))
    return np.asarray(cache.k[0])[0, plan.cell]


def test_kv_store_rounding_edges_equal_cpu(vk):
    """The scalar encoders' edge cases byte for byte as the CPU tiers (whose bytes
    tests/test_kv_tiers.py pins by hand): exact halves (q8_0's roundf away from zero, q4_0 / q6_0's
    truncation after + 8.5 / + 32.5), a bf16 signalling NaN (quiet, not infinity), iq4_nl's
    levels, its midpoints and its block below 1e-15, and 65,536 q8_0 blocks whose amax / 127 differs from
    amax * (1 / 127) in float32 (a divide that is not correctly rounded changes their codes)."""
    from opencoti.engine.kv_tiers.scalar import IQ4_NL_LEVELS

    x = np.zeros((5, 1, 32), np.float32)
    x[0, 0, :8] = [127, 2.5, -2.5, 0.5, -0.5, 1.49, -126.6, 3.0]  # q8_0: d = 1
    x[1, 0, :5], x[1, 0, 16:18], x[1, 0, 31] = [-8, 7.4, 7.6, 0.49, -0.5], [3.0, -7.9], 0.5  # q4_0: d = 1
    x[2, 0] = 2 * np.arange(32) - 32  # q6_0: d = 1, codes 2j
    x[3, 0] = IQ4_NL_LEVELS[np.arange(32) % 16] / 4  # iq4_nl: codes j % 16, d = 1/4
    mids = (IQ4_NL_LEVELS[:-1] + IQ4_NL_LEVELS[1:]) / 2  # iq4_nl: x / d0 on every midpoint (ties go up)
    x[4, 0] = np.concatenate([[-127], mids, mids[::-1], [0]]) / 4
    nan = np.zeros((1, 1, 32), np.uint32)
    nan[0, 0, :4] = [0x7F800001, 0xFF800001, 0x7F800000, 0x3F800000]
    rows = {"q8_0": x, "q4_0": x, "q6_0": x, "q5_0": x, "q5_1": x, "q4_1": x, "iq4_nl": x,
            "bf16": np.concatenate([x, nan.view(np.float32)])}
    tiny = np.full((2, 1, 32), 9e-16, np.float32)
    tiny[1] = 0.0
    rows["iq4_nl"] = np.concatenate([x, tiny])
    for name, r in rows.items():
        got = _vk_stored_k(vk, name, r)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), get_tier(name).quantize(r).view(np.uint8),
                                      err_msg=name)
    rng = np.random.default_rng(21)
    amax = rng.uniform(0.5, 2.0, 1600000).astype(np.float32)
    amax = amax[(amax / np.float32(127)) != amax * (np.float32(1) / np.float32(127))][:65536]
    assert len(amax) == 65536
    b = rng.uniform(-1, 1, (65536, 32)).astype(np.float32) * amax[:, None]
    b[:, 0] = amax
    q8 = b.reshape(8192, 1, 256)
    np.testing.assert_array_equal(_vk_stored_k(vk, "q8_0", q8), get_tier("q8_0").quantize(q8))


def test_kv_types_declared(vk):
    """The backend declares every KV tier the engine has (scalar and rotated); the runner's boot
    check accepts them all and still rejects an unknown name."""
    from opencoti.engine.kv_tiers import TIER_NAMES
    from opencoti.engine.runner import check_kv_types

    assert vk.kv_types == TIER_NAMES
    check_kv_types(vk, *TIER_NAMES)
    with pytest.raises(ValueError, match="unsupported KV cache type"):
        check_kv_types(vk, "q4_k")


@pytest.mark.parametrize("name", ROTATED_TIERS)
def test_rotated_tier_bytes_bit_identical(vk, name):
    """What is guaranteed for the rotated tiers: for finite K/V whose per-block sums of squares
    are normal float32 numbers (every value of a non-zero block with |x| >= ~1e-18, and
    no overflow), ``kv_rot.comp`` writes exactly the bytes of the CPU tier's ``quantize``:
    it performs the same float32 operations in the same order (``turbo.py`` "Arithmetic"),
    with a correctly rounded division and sqrt and no contraction, and the trellis search
    breaks ties like NumPy's argmin. Subnormal intermediates are outside the guarantee (a
    device may flush them to zero). Checked at head sizes 64 and 512 over rows with scales
    1e-4 .. 1e4, all-zero blocks, sparse rows and one-hot rows (every rotated value of one
    magnitude, so many trellis paths cost exactly the same and the tie-break decides)."""
    rng = np.random.default_rng(7)
    for d, T in ((64, 24), (512, 6)):
        x = (rng.standard_normal((T, 2, d)) * 10.0 ** rng.uniform(-4, 4, (T, 2, 1))).astype(np.float32)
        x[0] = 0.0                                          # all-zero blocks
        x[1, 0, :64] = 0.0                                  # one zero block in a row
        x[2, 1] *= rng.uniform(0, 1, d) > 0.9               # sparse
        x[3] = 0.0
        x[3, 0, 5], x[3, 1, d - 1] = 1.0, -3.0              # one-hot: |R x| constant
        x[4] = np.round(x[4] * 4) / 4
        cache = KVCache([0], T, 1, 1, n_head_kv=2, d_k=d, d_v=d, type_k=name, type_v="f16", zeros=vk.zeros)
        seqs, pos = np.zeros(T, np.int64), np.arange(T, dtype=np.int32)
        plan = cache.prepare(seqs, pos)
        cache.apply(plan, seqs, pos)
        vk.kv_write(cache, 0, plan, vk.asarray(x), vk.asarray(x))
        got = np.asarray(cache.k[0])[0, plan.cell]
        np.testing.assert_array_equal(got, cache.tier_k.quantize(x), err_msg=f"{name} d={d}")


def _tiny(tmp_path, arch, qtype, **over):
    pytest.importorskip("transformers")
    from opencoti.model.loader import load_model
    from opencoti.tools import synth_gguf as sg

    path = tmp_path / f"{arch}-{qtype}.gguf"
    sg.write_random_model(arch, path, qtype, seed=3, **over)
    return load_model(str(path), with_tokenizer=False)


def _greedy(model, backend, prompt, n_gen, type_k="f16", type_v="f16", shift=False):
    """``greedy_run`` in one prefill ubatch (graphs on Vulkan) with the KV tiers: (tokens,
    all logits)."""
    _, toks, logits = greedy_run(model, backend, prompt, n_gen, shift=shift, n_ubatch=512, type_k=type_k,
                                 type_v=type_v)
    return toks, logits


@pytest.mark.parametrize("type_k,type_v", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q5_1", "f16"),
                                           ("bf16", "q6_0"), ("q5_0", "f32"), ("iq4_nl", "q4_1")])
def test_tiny_model_kv_tiers_vulkan_matches_cpu(tmp_path, vk, cpu, type_k, type_v):
    """-ctk / -ctv on a tiny llama: Vulkan's greedy tokens equal the CPU's and its logits
    agree (prefill, graph-replayed decode, K shift through dequantize-rotate-quantize)."""
    model = _tiny(tmp_path, "llama", "Q8_0", hidden_size=128, intermediate_size=256, head_dim=32)
    prompt = [(i * 37 + 11) % 300 for i in range(16)]
    want_t, want = _greedy(model, cpu, prompt, 4, type_k, type_v, shift=True)
    got_t, got = _greedy(model, vk, prompt, 4, type_k, type_v, shift=True)
    assert got_t == want_t
    _close(got, want, (type_k, type_v))


@pytest.mark.parametrize("type_k,type_v", [("turbo3", "turbo3"), ("q8_0", "turbo3_tcq")])
def test_tiny_model_rotated_kv_vulkan_matches_cpu(tmp_path, vk, cpu, type_k, type_v):
    """-ctk / -ctv with the rotated tiers on a tiny llama (head_dim 64): Vulkan's greedy tokens
    equal the CPU's and its logits agree (prefill, graph-replayed decode, K shift)."""
    model = _tiny(tmp_path, "llama", "Q8_0", hidden_size=128, intermediate_size=256, head_dim=64)
    prompt = [(i * 37 + 11) % 300 for i in range(16)]
    want_t, want = _greedy(model, cpu, prompt, 4, type_k, type_v, shift=True)
    got_t, got = _greedy(model, vk, prompt, 4, type_k, type_v, shift=True)
    assert got_t == want_t
    _close(got, want, (type_k, type_v))


# ---------------------------------------------------------------------------------------
# mixture of experts
# ---------------------------------------------------------------------------------------
def _experts(vk, rng, qname, shape):
    """Random experts ``[E, rows, cols]`` -> (QExperts on the device, float32 dequantized)."""
    from opencoti.tools.synth_gguf import quantize_tensor

    a = (rng.standard_normal(shape) / np.sqrt(shape[2])).astype(np.float32)
    raw = quantize_tensor(a.reshape(-1, shape[2]), qname)
    deq = gguf.quants.dequantize(raw, GGMLQuantizationType[qname]).reshape(shape).astype(np.float32)
    q = vk.upload_experts(raw.view(np.uint8).reshape(shape[0] * shape[1], -1), int(GGMLQuantizationType[qname]),
                          *shape)
    return q, deq


@pytest.mark.parametrize("qname,path", [("Q8_0", "device"), ("Q4_K", "device"), ("F16", "device"),
                                        ("Q5_0", "gpu")])
def test_moe_ops_match_cpu(request, vk, cpu, qname, path):
    """moe_ffn_gate_up (fused gate/up, per-expert scale) and moe_ffn (router, separate
    gate/up, no renormalisation, weight scale) on decode and prefill sizes; a full tie in
    the router picks the lower expert ids, as the CPU."""
    if path == "gpu":
        request.getfixturevalue("gpu_paths")
    rng = np.random.default_rng(5)
    E, K = 8, 3
    n, f = (256, 256) if qname == "Q4_K" else (64, 32)
    gu_q, gu = _experts(vk, rng, qname, (E, 2 * f, n))
    dn_q, dn = _experts(vk, rng, qname, (E, n, f))
    ds = rng.uniform(0.5, 2.0, E).astype(np.float32)
    gi = rng.standard_normal((E, n)).astype(np.float32)
    for T in (1, 6, 21):
        x = rng.standard_normal((T, n)).astype(np.float32)
        lg = (rng.standard_normal((T, E)) * 3).astype(np.float32)
        lg[0] = 0.5
        for act in ("gelu_tanh", "silu"):
            want = cpu.moe_ffn_gate_up(x, lg, gu, dn, K, act=act, down_scale=ds)
            got = vk.to_host(vk.moe_ffn_gate_up(vk.asarray(x), vk.asarray(lg), gu_q, dn_q, K, act=act,
                                                down_scale=vk.asarray(ds)))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
        want = cpu.moe_ffn(x, gi, gu[:, f:], gu[:, :f], dn, K, norm_w=False, w_scale=0.7)
        got = vk.to_host(vk.moe_ffn(vk.asarray(x), vk.asarray(gi), gu_q[:, f:], gu_q[:, :f], dn_q, K, norm_w=False,
                                    w_scale=0.7))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))


def test_tiny_gemma4_moe_vulkan_matches_cpu(tmp_path, vk, cpu):
    """Gemma-4 MoE (dense MLP + 8 routed experts, top 2, per-expert scale) on Vulkan:
    the CPU's logits in prefill ubatches of 16 and graph-replayed decode, and its greedy tokens."""
    from opencoti.tools import synth_gguf as sg

    model = _tiny(tmp_path, "gemma4", "Q8_0", **{k: v for k, v in sg.GEMMA4_VARIANTS["moe"].items()})
    toks = [(i * 37 + 11) % 300 for i in range(20)]
    r_c = ModelRunner(model, cpu, n_ctx=64, n_ubatch=16)
    want = np.concatenate([lg for _, lg in iter_logits(r_c, toks)])
    for ub in (16, 1):
        r_v = ModelRunner(model, vk, n_ctx=64, n_ubatch=ub)
        _close(np.concatenate([lg for _, lg in iter_logits(r_v, toks)]), want, ub)
    want_t, _ = _greedy(model, cpu, toks[:8], 4)
    got_t, _ = _greedy(model, vk, toks[:8], 4)
    assert got_t == want_t


# ---------------------------------------------------------------------------------------
# hybrid (gated delta-net) ops and models
# ---------------------------------------------------------------------------------------
def test_sigmoid_softplus_l2_norm(vk, cpu):
    x = np.concatenate([np.random.default_rng(3).standard_normal(500) * 8, [0, -100, 100, 1e-30]]).astype(np.float32)
    X = x.reshape(63, 8)
    np.testing.assert_allclose(vk.to_host(vk.sigmoid(vk.asarray(X))), cpu.sigmoid(X), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(vk.to_host(vk.softplus(vk.asarray(X))), cpu.softplus(X), rtol=1e-5, atol=1e-6)
    m = x[:496].reshape(31, 16)
    m[3] = 0.0  # the eps floor
    np.testing.assert_allclose(vk.to_host(vk.l2_norm(vk.asarray(m), 1e-6)), cpu.l2_norm(m, 1e-6), rtol=1e-6,
                               atol=1e-7)


def _rs_plan():
    """Rows 0 and 4 are sequence 2's (slot 2, continuing its state); rows 1-3 and 5-6 sequence
    0's (slot 0); row 7 sequence 1's alone (a decode row)."""
    return RSPlan(views=[RSView(np.array([0, 4]), 2, 2), RSView(np.array([1, 2, 3, 5, 6]), 0, 0),
                         RSView(np.array([7]), 1, 1)])


def test_ssm_conv_and_gated_delta_net_match_cpu(vk, cpu):
    """Both recurrent ops over three sequences of one ubatch: outputs and the updated
    states (in place) equal the CPU's; the conv weight as the padded F32 QTensor that
    load_weight makes of it."""
    rng = np.random.default_rng(4)
    T, C, K, H, dk, dv = 8, 96, 4, 3, 16, 80
    plan = _rs_plan()
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    conv0 = rng.standard_normal((3, K - 1, C)).astype(np.float32)
    conv_v = vk.asarray(conv0)
    w_q = vk.upload_weight(w.view(np.uint8), 0, C, K)
    want = cpu.ssm_conv(x, conv_c := conv0.copy(), w, plan)
    got = vk.to_host(vk.ssm_conv(vk.asarray(x), conv_v, w_q, plan))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(conv_v), conv_c, rtol=1e-6)

    q = cpu.l2_norm(rng.standard_normal((T, H, dk)).astype(np.float32), 1e-6)
    k = cpu.l2_norm(rng.standard_normal((T, H, dk)).astype(np.float32), 1e-6)
    v = rng.standard_normal((T, H, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, (T, H)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (T, H)).astype(np.float32)
    s0 = rng.standard_normal((3, H, dk, dv)).astype(np.float32)
    s_v = vk.asarray(s0)
    want = cpu.gated_delta_net(q, k, v, g, beta, s_c := s0.copy(), plan, 0.25)
    got = vk.to_host(vk.gated_delta_net(*(vk.asarray(a) for a in (q, k, v, g, beta)), s_v, plan, 0.25))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    np.testing.assert_allclose(np.asarray(s_v), s_c, rtol=1e-4, atol=1e-4 * float(np.abs(s_c).max()))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """hybrid(arch) -> the tiny Q8_0 model (synth_gguf defaults: 4 layers, 2 recurrent), cached."""
    pytest.importorskip("transformers")
    from opencoti.model.loader import load_model
    from opencoti.tools import synth_gguf as sg

    root, cache = tmp_path_factory.mktemp("vk_hybrid"), {}

    def get(arch):
        if arch not in cache:
            path = root / f"{arch}.gguf"
            sg.write_gguf(sg.random_hf_model(arch, seed=3), path, "Q8_0")
            cache[arch] = load_model(str(path), with_tokenizer=False)
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_tiny_hybrid_vulkan_matches_cpu(hybrid, vk, cpu, arch):
    """A hybrid model on Vulkan: the CPU's logits for a prefill in ubatches of 16 and
    graph-replayed single-token decode, and for two sequences sharing ubatches after a
    full-state seq_cp (q8_0 KV on the attention layers)."""
    model = hybrid(arch)
    toks = [(i * 37 + 11) % 300 for i in range(24)]
    r_c = ModelRunner(model, cpu, n_ctx=64, n_ubatch=16)
    want = np.concatenate([lg for _, lg in iter_logits(r_c, toks)])
    for ub in (16, 1):
        r_v = ModelRunner(model, vk, n_ctx=64, n_ubatch=ub)
        _close(np.concatenate([lg for _, lg in iter_logits(r_v, toks)]), want, ub)
    outs = {}
    for name, be in (("cpu", cpu), ("vk", vk)):
        r = ModelRunner(model, be, n_ctx=64, n_seq_max=2, n_ubatch=64, type_k="q8_0", type_v="q8_0")
        res = [r.decode(UBatch.build(toks[:10], np.arange(10), [0] * 10, [9]))]
        assert r.kv.seq_cp(0, 1, 0, 10)  # the whole state: a copy on the device
        for i in range(3):
            res.append(r.decode(UBatch.build([3 + i, 40 + i], [10 + i, 10 + i], [0, 1], [0, 1])))
        outs[name] = np.concatenate(res)
    _close(outs["vk"], outs["cpu"], "two sequences")
