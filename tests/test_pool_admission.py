"""Settled admission (P7) decisions, with an explicit clock."""

from opencoti.engine.pool_admission import SettledAdmission


def gate(**cfg):
    g = SettledAdmission()
    g.configure(cfg)
    return g


def test_no_target_admits():
    d = gate().decide(n_active=10, mean_tps=1.0, settle_tokens_done=0, now=0.0)
    assert d.admit and not d.saturated


def test_projection_n_over_n_plus_1_then_measured_drop():
    g = gate(target_tps_per_session=30, mode="enforced")
    # 3 sessions at 44 tok/s: 44 * 3/4 = 33 >= 30 -> admit; sessions_remaining = int(44*3/30) - 3 = 1
    d = g.decide(3, 44.0, 10**9, now=0.0)
    assert d.admit and not d.saturated and abs(d.projected_tps - 33.0) < 1e-9 and d.sessions_remaining == 1
    # 4 sessions at 36: 36 * 4/5 = 28.8 < 30 -> reject with Retry-After
    d = g.decide(4, 36.0, 10**9, now=0.0)
    assert not d.admit and d.saturated and d.retry_after >= 1
    # a measured drop replaces the projection: mean 40 before, 37 after -> drop 3
    g.on_admit(40.0, id_slot=2, now=0.0)
    g.observe(37.0, settle_tokens_done=48, n_active=4, now=1.0)
    assert g.drop_per_admit_ewma == 3.0 and g.settling_since is None
    d = g.decide(4, 34.0, 10**9, now=2.0)  # 34 - 3 = 31 >= 30
    assert d.admit and abs(d.projected_tps - 31.0) < 1e-9


def test_settle_window_defers_new_sessions():
    g = gate(target_tps_per_session=1, mode="enforced", settle_tokens=48, settle_max_ms=5000)
    g.on_admit(100.0, id_slot=0, now=10.0)
    d = g.decide(2, 100.0, settle_tokens_done=10, now=11.0)  # 4 s of the window left
    assert not d.admit and d.reason == "settling" and d.retry_after == 4
    # the window closes on tokens ...
    assert g.decide(2, 100.0, settle_tokens_done=48, now=11.0).admit
    # ... or on time
    assert g.decide(2, 100.0, settle_tokens_done=0, now=15.5).admit


def test_guarantee_and_modes():
    g = gate(target_tps_per_session=1000, mode="enforced", guarantee_min_sessions=2)
    assert g.decide(0, 0.0, 10**9, now=0).admit
    assert g.decide(1, 5.0, 10**9, now=0).admit  # still under the guarantee
    assert not g.decide(2, 5.0, 10**9, now=0).admit
    g.configure({"on_saturation": "warn"})
    d = g.decide(2, 5.0, 10**9, now=0)
    assert d.admit and d.saturated
    g.configure({"mode": "advisory", "on_saturation": "reject"})
    d = g.decide(2, 5.0, 10**9, now=0)
    assert d.admit and d.saturated
