"""bench/profile_timeline.py's arithmetic on kernel records (no GPU needed): exposed time, the
per-step sums and the kernel roles that its tables print."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import profile_timeline as pt  # noqa: E402


def test_exposed_adds_up_to_the_span():
    """A kernel's exposed time is how far it moves the latest end (the first: its duration; a gap
    before a kernel counts as its own; one that ends inside an earlier kernel's run: 0), and the
    exposed times add up to first start .. last end."""
    recs = [(1000, 6000, "a"), (2000, 9000, "b"), (12000, 15000, "c"), (13000, 14000, "d"), (14500, 17000, "e")]
    rows = pt.exposed(recs)
    assert [r[0] for r in rows] == ["a", "b", "c", "d", "e"]
    assert [r[1] for r in rows] == [5.0, 7.0, 3.0, 1.0, 2.5]  # durations, us
    # d ends inside c's run: it exposes nothing, and e is charged from c's end
    assert [r[2] for r in rows] == [5.0, 3.0, 6.0, 0.0, 2.0]
    assert sum(r[2] for r in rows) == pytest.approx((17000 - 1000) / 1e3)


def test_per_step_means():
    """per_step: calls a step, mean duration and exposed time a step, by key."""
    rows = [("x", 2.0, 1.0), ("y", 4.0, 3.0), ("x", 4.0, 2.0), ("y", 2.0, 1.0)]
    got = pt.per_step(rows, 2, lambda n: n)
    assert got == {"x": (1.0, 3.0, 1.5), "y": (1.0, 3.0, 2.0)}
    assert pt.per_step(rows, 2, lambda n: "all") == {"all": (2.0, 3.0, 3.5)}


@pytest.mark.parametrize("name,want", [
    ("rope_kv_write", "store"), ("rope_kv_write_q", "store"), ("kv_quant_KTurbo3_d256", "store"),
    ("attn_stream_d256", "stream"), ("attn_stream_d128_h16", "stream"), ("attn_kv_stream", "stream"),
    ("attn_partial_d256_g1_l8", "short"), ("attn_kv_g1_l8", "short"), ("attn_kv_g4_l", "short"),
    ("attn_merge_digits", "merge"), ("sp_merge", "merge"), ("gemvi_12_n1_s2_r2_t16", "proj"),
    ("gemv1r8_8", "proj"), ("mmq_12", "proj"), ("post_norm_add_norm", "other"), ("xq_digits", "other")])
def test_roles(name, want):
    """The kernel names of a gemma-3 decode step (f16 and tier modules) map to their roles."""
    assert pt.role(name) == want
