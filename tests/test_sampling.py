"""Sampler chain: each stage against its definition on hand-made logits, the chain's
order, seeded reproducibility, and the sampled frequencies against the softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opencoti.engine.api import SamplingParams
from opencoti.engine.sampling import Sampler, SamplingParamsError, rows_argmax, token_logprob, top_logprobs

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)


def params(**kw) -> SamplingParams:
    base = dict(OFF, temperature=1.0, seed=1234)
    base.update(kw)
    return SamplingParams(**base)


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def cand_set(sampler: Sampler, logits) -> set[int]:
    ids, _ = sampler.candidates(logits)
    return set(int(i) for i in ids)


# ---------------------------------------------------------------- greedy / top_k


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for temp in (0.0, -1.0):
        for seed in (1, 2, -1):
            s = Sampler(SamplingParams(temperature=temp, seed=seed), 1000)  # default top_k/p/min_p
            for _ in range(20):
                x = rng.standard_normal(1000).astype(np.float32)
                assert s.sample(x) == int(np.argmax(x))


def test_argmax_only_samplers_and_rows_argmax():
    """``argmax_only`` holds exactly when ``sample`` is the row's argmax whatever the logits
    (greedy, default chain, no bias / penalties / grammar); ``take_argmax`` on ``rows_argmax``
    then gives ``sample``'s token, and refuses a row with NaN / +inf / all -inf as ``sample`` does."""
    rng = np.random.default_rng(3)
    lg = rng.standard_normal((5, 50)).astype(np.float32)
    lg[2, [7, 31]] = 9.0  # a tie: the first index, as NumPy's argmax
    ids, mx = rows_argmax(lg)
    assert ids.dtype == np.int64 and mx.dtype == np.float32
    assert ids.tolist() == [int(np.argmax(r)) for r in lg] and ids[2] == 7
    np.testing.assert_array_equal(mx, lg.max(axis=1))
    g = Sampler(params(temperature=0.0), 50)
    assert g.argmax_only
    assert [g.take_argmax(int(i), float(m)) for i, m in zip(ids, mx)] == [g.sample(r) for r in lg]
    for kw in (dict(temperature=0.7), dict(temperature=0.0, logit_bias={3: 1.0}),
               dict(temperature=0.0, repeat_penalty=1.1, repeat_last_n=64), dict(temperature=0.0, typical_p=0.9),
               dict(temperature=0.0, samplers=["min_p", "top_k", "temperature"])):
        assert not Sampler(params(**kw), 50).argmax_only, kw
    assert not Sampler(params(temperature=0.0), 50, grammar=object()).argmax_only
    # a ban (ignore_eos's end-of-generation ids): still argmax_only; rows_argmax masks the banned
    # ids of the banned rows only, leaves its input as it was, and gives the banning sampler's choice
    b = Sampler(params(temperature=0.0), 50, ban=[int(ids[0]), 7, 99, -1])
    assert b.argmax_only and b.ban_ids.tolist() == sorted({int(ids[0]), 7})
    before = lg.copy()
    bids, bmx = rows_argmax(lg, (np.array([0, 2]), b.ban_ids))
    np.testing.assert_array_equal(lg, before)
    for r in range(5):
        if r in (0, 2):
            assert bids[r] not in b.ban_ids and b.take_argmax(int(bids[r]), float(bmx[r])) == b.sample(lg[r])
        else:
            assert bids[r] == ids[r] and bmx[r] == mx[r]
    assert bids[2] == 31  # the tie's second index once the first is banned
    # a row the ban left all -inf: the request's doing (a 400), as sample() says it; not without a ban
    allban = Sampler(params(temperature=0.0), 3, ban=[0, 1, 2])
    row = np.array([1.0, 2.0, 3.0], np.float32)
    bid, bmx = rows_argmax(row[None], (np.array([0]), allban.ban_ids))
    assert bmx[0] == -np.inf
    with pytest.raises(SamplingParamsError):
        allban.take_argmax(int(bid[0]), float(bmx[0]))
    with pytest.raises(SamplingParamsError):
        allban.sample(row)
    with pytest.raises(ValueError) as e:
        g.take_argmax(0, float("-inf"))
    assert not isinstance(e.value, SamplingParamsError)
    bad = lg[:2].copy()
    bad[0, 4] = np.nan
    bad[1] = -np.inf
    for i, m in zip(*rows_argmax(bad)):
        with pytest.raises(ValueError):
            g.take_argmax(int(i), float(m))
    for row in bad:
        with pytest.raises(ValueError):
            g.sample(row)


def test_top_k_1_equals_greedy_at_any_temperature():
    rng = np.random.default_rng(1)
    for temp in (0.1, 1.0, 5.0, 100.0):
        s = Sampler(params(top_k=1, temperature=temp, seed=7), 5000)
        for _ in range(20):
            x = (rng.standard_normal(5000) * 0.01).astype(np.float32)  # nearly flat
            assert s.sample(x) == int(np.argmax(x))


def test_top_k_keeps_k_highest():
    x = np.array([0.1, 3.0, -2.0, 2.5, 2.9, 0.0, 1.0], dtype=np.float32)
    ids, vals = Sampler(params(top_k=3), 7).candidates(x)
    assert list(ids) == [1, 4, 3]  # the three highest, best first
    np.testing.assert_array_equal(vals, np.array([3.0, 2.9, 2.5], np.float32))
    assert cand_set(Sampler(params(top_k=0), 7), x) == set(range(7))
    assert cand_set(Sampler(params(top_k=100), 7), x) == set(range(7))


# ---------------------------------------------------------------- truncation by definition


def _softmax(v):
    m = max(v)
    e = [math.exp(a - m) for a in v]
    s = sum(e)
    return [a / s for a in e]


def ref_top_p(logits, p):
    """Shortest prefix (by probability, descending) with mass >= p."""
    pr = _softmax([float(a) for a in logits])
    order = sorted(range(len(pr)), key=lambda i: -pr[i])
    kept, cum = [], 0.0
    for i in order:
        kept.append(i)
        cum += pr[i]
        if cum >= p:
            break
    return set(kept)


def ref_min_p(logits, p):
    pr = _softmax([float(a) for a in logits])
    return {i for i, q in enumerate(pr) if q >= p * max(pr)}


def ref_typical(logits, p):
    pr = _softmax([float(a) for a in logits])
    h = -sum(q * math.log(q) for q in pr if q > 0)
    order = sorted(range(len(pr)), key=lambda i: abs(-math.log(pr[i]) - h))
    kept, cum = [], 0.0
    for i in order:
        kept.append(i)
        cum += pr[i]
        if cum > p:
            break
    return set(kept)


PROBS = [0.06, 0.4, 0.04, 0.2, 0.3]  # ids 1 > 4 > 3 > 0 > 2


def test_top_p_hand_example():
    x = logits_of(PROBS)
    # 0.4 (id 1), +0.3 (id 4) = 0.7 < 0.8, +0.2 (id 3) = 0.9 >= 0.8
    assert cand_set(Sampler(params(top_p=0.8), 5), x) == {1, 4, 3}
    assert cand_set(Sampler(params(top_p=0.35), 5), x) == {1}
    assert cand_set(Sampler(params(top_p=0.95), 5), x) == {1, 4, 3, 0}
    assert cand_set(Sampler(params(top_p=0.0), 5), x) == {1}


def test_min_p_hand_example():
    x = logits_of(PROBS)
    # threshold 0.2 * 0.4 = 0.08: keeps 0.4, 0.3, 0.2
    assert cand_set(Sampler(params(min_p=0.2), 5), x) == {1, 4, 3}
    # threshold 0.12: keeps 0.4, 0.3, 0.2
    assert cand_set(Sampler(params(min_p=0.3), 5), x) == {1, 4, 3}
    # threshold 0.24: keeps 0.4, 0.3
    assert cand_set(Sampler(params(min_p=0.6), 5), x) == {1, 4}
    # threshold 0.02: keeps everything
    assert cand_set(Sampler(params(min_p=0.05), 5), x) == set(range(5))


def test_typical_hand_example():
    x = logits_of(PROBS)
    # H = -sum p ln p = 1.3472; |-ln p - H|: 0.3 -> 0.143, 0.2 -> 0.262, 0.4 -> 0.431, 0.06 -> 1.466, 0.04 -> 1.872
    # typical_p 0.45: 0.3 (cum 0.3), 0.2 (cum 0.5 > 0.45) -> {id 4, id 3}: the most likely token is out
    assert cand_set(Sampler(params(typical_p=0.45), 5), x) == {4, 3}
    assert cand_set(Sampler(params(typical_p=0.85), 5), x) == {4, 3, 1}
    assert cand_set(Sampler(params(typical_p=0.95), 5), x) == {4, 3, 1, 0}
    # greedy after typical picks the best *surviving* token (llama.cpp: temp sampler after typical)
    s = Sampler(params(typical_p=0.45, temperature=0.0), 5)
    assert s.sample(x) == 4


@pytest.mark.parametrize("seed", range(6))
def test_truncation_matches_definitions_on_random_tiny_vectors(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(30):
        n = int(rng.integers(2, 12))
        x = (rng.standard_normal(n) * rng.uniform(0.3, 4)).astype(np.float32)
        p = float(rng.uniform(0.05, 0.98))
        pr = _softmax([float(a) for a in x])
        # skip draws that sit within float error of a boundary (the set is then ambiguous)
        cums = np.cumsum(sorted(pr, reverse=True))
        if np.min(np.abs(cums - p)) < 1e-5:
            continue
        assert cand_set(Sampler(params(top_p=p), n), x) == ref_top_p(x, p)
        if min(abs(q - p * max(pr)) for q in pr) > 1e-5:
            assert cand_set(Sampler(params(min_p=p), n), x) == ref_min_p(x, p)
        h = -sum(q * math.log(q) for q in pr)
        sh = sorted(pr, key=lambda q: abs(-math.log(q) - h))
        if np.min(np.abs(np.cumsum(sh) - p)) > 1e-5 and len(set(np.round(x, 5))) == n:
            assert cand_set(Sampler(params(typical_p=p), n), x) == ref_typical(x, p)


def test_chain_order_top_k_then_top_p():
    # top_p sees the distribution renormalised over top_k's survivors:
    # probs [0.5, 0.3, 0.2]; top_k 2 -> [0.625, 0.375]; top_p 0.6 keeps one token.
    # (top_p on the full distribution would keep two: 0.5 < 0.6.)
    x = logits_of([0.5, 0.3, 0.2])
    assert cand_set(Sampler(params(top_k=2, top_p=0.6), 3), x) == {0}
    assert cand_set(Sampler(params(top_p=0.6), 3), x) == {0, 1}


def test_chain_order_top_p_then_min_p():
    # top_p 0.95 keeps [0.5, 0.3, 0.15] (cum 0.95); min_p 0.35 (threshold 0.175) then drops 0.15
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    assert cand_set(Sampler(params(top_p=0.95, min_p=0.35), 4), x) == {0, 1}


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_top_p_full_vocab_matches_definition(shape):
    n = 262_144
    rng = np.random.default_rng(5)
    x = rng.standard_normal(n).astype(np.float32)
    if shape == "peaked":
        x[rng.choice(n, 30, replace=False)] += 12.0  # nucleus inside the first partial sort
    top_p = 0.9
    # reference by the definition: full sort in float64
    x64 = x.astype(np.float64)
    pr = np.exp(x64 - x64.max())
    pr /= pr.sum()
    order = np.argsort(-pr, kind="stable")
    cut = int(np.searchsorted(np.cumsum(pr[order]), top_p)) + 1
    expected = set(order[:cut].tolist())
    got = cand_set(Sampler(params(top_p=top_p), n), x)
    assert got == expected
    assert (len(got) < 256) == (shape == "peaked")


# ---------------------------------------------------------------- temperature and the draw


@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_sampled_frequencies_match_softmax(temp):
    x = np.array([1.0, 0.0, 2.0, -1.0, 0.5, 1.5], dtype=np.float32)
    expected_p = _softmax([float(a) / temp for a in x])
    s = Sampler(params(temperature=temp, seed=2024), x.size)
    n = 20_000
    draws = np.array([s.sample(x) for _ in range(n)])
    counts = np.bincount(draws, minlength=x.size)
    expected = n * np.asarray(expected_p)
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    np.testing.assert_allclose(counts / n, expected_p, atol=0.015)


def test_temperature_scales_candidate_logits():
    x = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    ids, vals = Sampler(params(temperature=0.5), 3).candidates(x)
    assert list(ids) == [0, 1, 2]
    np.testing.assert_allclose(vals, [2.0, -4.0, 1.0])


def test_sample_stays_inside_truncated_set():
    x = logits_of(PROBS)
    s = Sampler(params(top_p=0.8, temperature=3.0, seed=9), 5)
    draws = {s.sample(x) for _ in range(500)}
    assert draws == {1, 4, 3}


def test_seeded_reproducibility():
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(2000).astype(np.float32) for _ in range(40)]
    p = SamplingParams(temperature=1.5, seed=42)

    def run(sp):
        s = Sampler(sp, 2000)
        out = []
        for r in rows:
            t = s.sample(r)
            s.accept(t)
            out.append(t)
        return out

    a, b = run(p), run(SamplingParams(temperature=1.5, seed=42))
    assert a == b
    assert run(SamplingParams(temperature=1.5, seed=43)) != a
    assert Sampler(p, 10).seed == 42


def test_random_seed_when_unset():
    for seed in (-1, 0xFFFFFFFF):
        seeds = {Sampler(SamplingParams(seed=seed), 10).seed for _ in range(5)}
        assert len(seeds) == 5
        assert all(0 <= s < 0xFFFFFFFF for s in seeds)


# ---------------------------------------------------------------- penalties


def test_penalties_hand_example():
    x = np.array([2.0, -1.0, 0.5, 3.0, 0.0], dtype=np.float32)
    before = x.copy()
    s = Sampler(params(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=-1), 5)
    s.accept_many([0, 1, 1, 4, 0, 0])
    # counts: id0 x3, id1 x2, id4 x1
    # id0:  2.0 / 2 = 1.0,  - (3*0.5 + 0.25) -> -0.75
    # id1: -1.0 * 2 = -2.0, - (2*0.5 + 0.25) -> -3.25
    # id4:  0.0 * 2 = 0.0,  - (1*0.5 + 0.25) -> -0.75   (a zero logit is multiplied)
    np.testing.assert_allclose(s.apply_penalties(x), [-0.75, -3.25, 0.5, 3.0, -0.75])
    np.testing.assert_array_equal(x, before)  # the caller's logits are untouched

    w = Sampler(params(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=2), 5)
    w.accept_many([0, 1, 1, 4, 0, 0])
    assert w.history == [0, 0]
    # only the last two tokens (id0 twice): 1.0 - (2*0.5 + 0.25) = -0.25
    np.testing.assert_allclose(w.apply_penalties(x), [-0.25, -1.0, 0.5, 3.0, 0.0])

    off = Sampler(params(repeat_penalty=2.0, frequency_penalty=0.5, repeat_last_n=0), 5)
    off.accept_many([0, 1])
    assert off.history == []
    np.testing.assert_array_equal(off.apply_penalties(x), x)


def test_penalties_change_greedy_choice_and_sampling():
    x = np.array([5.0, 4.9, -3.0], dtype=np.float32)
    g = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=64), 3)
    assert g.sample(x) == 0
    g.accept(0)
    assert g.sample(x) == 1  # 5.0 / 1.1 = 4.545 < 4.9
    np.testing.assert_array_equal(x, np.array([5.0, 4.9, -3.0], dtype=np.float32))
    # presence penalty pushes an accepted token out of a top_k=1 chain at temperature 1
    s = Sampler(params(top_k=1, presence_penalty=1.0, repeat_last_n=64), 3)
    s.accept(0)
    assert s.sample(x) == 1


def test_penalty_window_slides():
    s = Sampler(params(frequency_penalty=1.0, repeat_last_n=3), 4)
    for t in [0, 0, 1, 2, 3]:
        s.accept(t)
    assert s.history == [1, 2, 3]
    np.testing.assert_allclose(s.apply_penalties(np.zeros(4, np.float32)), [0.0, -1.0, -1.0, -1.0])
    s.reset()
    assert s.history == []


# ---------------------------------------------------------------- logprobs


def test_top_logprobs_and_token_logprob():
    x = np.array([0.5, 2.0, -1.0, 2.0, 1.0], dtype=np.float32)
    lse = math.log(sum(math.exp(float(a)) for a in x))
    ids, lps = top_logprobs(x, 3)
    assert ids.dtype == np.int64 and lps.dtype == np.float32
    assert list(ids) == [1, 3, 4]  # tie 1/3 broken by lower id
    np.testing.assert_allclose(lps, [2.0 - lse, 2.0 - lse, 1.0 - lse], rtol=0, atol=1e-6)
    ids_all, lps_all = top_logprobs(x, 99)
    assert list(ids_all) == [1, 3, 4, 0, 2]
    assert abs(sum(math.exp(v) for v in lps_all) - 1.0) < 1e-6
    assert top_logprobs(x, 0)[0].size == 0
    assert abs(token_logprob(x, 2) - (-1.0 - lse)) < 1e-6
    with pytest.raises(ValueError, match="out of range"):
        token_logprob(x, 5)


def test_top_logprobs_full_vocab():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(262_144) * 4).astype(np.float32)
    ref = x.astype(np.float64) - np.log(np.sum(np.exp(x.astype(np.float64))))
    ids, lps = top_logprobs(x, 10)
    np.testing.assert_array_equal(ids, np.argsort(-ref, kind="stable")[:10])
    np.testing.assert_allclose(lps, ref[ids], rtol=0, atol=1e-5)
    assert abs(token_logprob(x, 12345) - ref[12345]) < 1e-5
    # the sampled token's logprob is its top_logprobs entry, to the bit (both float32 values)
    assert [token_logprob(x, int(i)) for i in ids] == [float(v) for v in lps]


# ---------------------------------------------------------------- errors and hygiene


def test_sample_does_not_modify_logits():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(1000).astype(np.float32)
    before = x.copy()
    s = Sampler(SamplingParams(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                               typical_p=0.9, seed=5), 1000)
    s.accept_many(range(0, 1000, 7))
    for _ in range(5):
        s.sample(x)
    np.testing.assert_array_equal(x, before)


def test_bad_input():
    s = Sampler(SamplingParams(seed=1), 4)
    with pytest.raises(ValueError, match="expected n_vocab=4"):
        s.sample(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="one row"):
        s.sample(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        s.sample(np.array([0, np.nan, 1, 2], np.float32))
    with pytest.raises(ValueError, match="all -inf"):
        s.sample(np.full(4, -np.inf, np.float32))
    with pytest.raises(ValueError, match="repeat_last_n"):
        Sampler(SamplingParams(repeat_last_n=-2), 4)
    with pytest.raises(ValueError, match="top_p"):
        Sampler(SamplingParams(top_p=-0.1), 4)
    with pytest.raises(ValueError, match="n_vocab"):
        Sampler(SamplingParams(), 0)


def test_masked_tokens_never_sampled():
    x = np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf], dtype=np.float32)
    s = Sampler(params(seed=8), 5)
    assert {s.sample(x) for _ in range(200)} == {1, 3}
    # float64 input is accepted and converted
    assert Sampler(params(temperature=0.0), 3).sample(np.array([0.0, 1.0, 0.5])) == 1


# ---------------------------------------------------------------- top_n_sigma and the samplers order


def ref_top_n_sigma(x: np.ndarray, n: float) -> set[int]:
    """The definition in float64: keep finite logits >= max - n * std (population std)."""
    v = x[np.isfinite(x)].astype(np.float64)
    cut = v.max() - n * v.std()
    return set(int(i) for i in np.flatnonzero(np.isfinite(x) & (x.astype(np.float64) >= cut)))


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0, 3.5])
def test_top_n_sigma_matches_numpy_reference(n):
    rng = np.random.default_rng(int(n * 10))
    for trial in range(20):
        x = (rng.standard_normal(4000) * rng.uniform(0.5, 4)).astype(np.float32)
        x[rng.integers(0, 4000, 30)] = -np.inf  # banned tokens stay out of the statistics
        want = ref_top_n_sigma(x, n)
        s = Sampler(params(top_n_sigma=n), x.size)
        ids, vals = s.candidates(x)
        fin = np.isfinite(vals)
        assert set(ids[fin].tolist()) == want, (trial, int(fin.sum()), len(want))
        assert np.array_equal(vals[fin], x[ids[fin]])  # temperature 1: the surviving logits are the raw ones
        for _ in range(5):
            assert s.sample(x) in want


def finite_set(sampler: Sampler, logits) -> set[int]:
    """Candidates with a finite logit (top_n_sigma masks to -inf, as llama.cpp)."""
    ids, vals = sampler.candidates(logits)
    return set(int(i) for i, v in zip(ids, vals) if np.isfinite(v))


def test_top_n_sigma_hand_example_and_off():
    x = np.array([4.0, 3.0, 1.0, 0.0, -2.0], np.float32)  # mean 1.2, std ~2.1354
    std = float(np.std(x.astype(np.float64)))
    assert finite_set(Sampler(params(top_n_sigma=1.0), 5), x) == {i for i in range(5) if x[i] >= 4.0 - std}
    assert finite_set(Sampler(params(top_n_sigma=1.0), 5), x) == {0, 1}
    assert finite_set(Sampler(params(top_n_sigma=0.1), 5), x) == {0}
    for off in (0.0, -1.0):  # off: every token stays
        assert finite_set(Sampler(params(top_n_sigma=off), 5), x) == set(range(5))
    # with the default chain's other samplers too: top_n_sigma runs before top_k
    s = Sampler(params(top_n_sigma=1.0, top_k=3), 5)
    ids, vals = s.candidates(x)
    assert set(int(i) for i, v in zip(ids, vals) if np.isfinite(v)) == {0, 1}


def test_explicit_default_order_equals_the_default_chain():
    """``samplers`` naming the default chain runs the plain written-out path; it must
    pick the same candidates and logits as the optimised default path."""
    from opencoti.engine.api import DEFAULT_CHAIN

    rng = np.random.default_rng(7)
    for trial in range(40):
        kw = dict(temperature=float(rng.choice([0.0, 0.7, 1.3])), top_k=int(rng.choice([0, 5, 50])),
                  top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05, 0.2])),
                  typical_p=float(rng.choice([1.0, 0.8])), top_n_sigma=float(rng.choice([-1.0, 1.5])),
                  repeat_penalty=float(rng.choice([1.0, 1.3])), repeat_last_n=8, seed=3)
        x = (rng.standard_normal(600) * 2).astype(np.float32)
        hist = rng.integers(0, 600, 12)
        kw.update(dry_multiplier=float(rng.choice([0.0, 0.8])), dry_allowed_length=int(rng.choice([1, 2])))
        breakers = {int(hist[3]): ((),)}
        a = Sampler(SamplingParams(**kw), 600, dry_breakers=breakers)
        b = Sampler(SamplingParams(**kw, samplers=DEFAULT_CHAIN + ("xtc",)), 600, dry_breakers=breakers)
        hist = np.concatenate([hist, hist[2:7], hist[:5]])  # repeats for DRY to find
        a.accept_many(hist)
        b.accept_many(hist)
        ia, va = a.candidates(x)
        ib, vb = b.candidates(x)
        fa = {int(i): float(v) for i, v in zip(ia, va) if np.isfinite(v)}
        fb = {int(i): float(v) for i, v in zip(ib, vb) if np.isfinite(v)}
        assert fa == fb, (trial, kw)
        assert a.sample(x) == b.sample(x)  # same seed, same candidates, same draw


def test_samplers_order_and_subset_follow_the_list():
    """llama.cpp builds the chain from ``samplers`` alone: order matters and a sampler
    left out does not run (no "temperature": no scaling, no greedy)."""
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    # top_p 0.7 before temperature 0.25 keeps {0, 1}; after it (sharper) keeps {0}
    assert cand_set(Sampler(params(top_p=0.7, temperature=0.25, samplers=("top_p", "temperature")), 4), x) == {0, 1}
    assert cand_set(Sampler(params(top_p=0.7, temperature=0.25, samplers=("temperature", "top_p")), 4), x) == {0}
    # temperature 0 outside the chain: sampling from the raw softmax, not argmax
    s = Sampler(params(temperature=0.0, samplers=("top_k",), top_k=3), 4)
    ids, vals = s.candidates(x)
    assert sorted(ids.tolist()) == [0, 1, 2] and np.allclose(np.sort(vals), np.sort(x[:3]))
    draws = {s.sample(x) for _ in range(200)}
    assert draws == {0, 1, 2}
    # penalties only when named
    hist = [0, 0, 0]
    on = Sampler(params(repeat_penalty=10.0, temperature=0.0, samplers=("penalties", "temperature")), 4)
    off = Sampler(params(repeat_penalty=10.0, temperature=0.0, samplers=("temperature",)), 4)
    on.accept_many(hist)
    off.accept_many(hist)
    assert on.sample(x) == 1 and off.sample(x) == 0
    # an empty chain: dist over the (biased) logits only
    s = Sampler(params(temperature=0.0, samplers=(), logit_bias={3: -np.inf}), 4)
    ids, _ = s.candidates(x)
    assert sorted(int(i) for i, v in zip(*s.candidates(x)) if np.isfinite(v)) == [0, 1, 2]


def test_unknown_sampler_name_is_a_settings_error():
    with pytest.raises(ValueError, match="unknown sampler 'nope'"):
        Sampler(params(samplers=("top_k", "nope")), 4)
    with pytest.raises(ValueError, match="top_n_sigma must be a finite number"):
        Sampler(params(top_n_sigma=float("nan")), 4)


@pytest.mark.parametrize("n,k", [(262144, 40), (262144, 1), (262144, 4096), (151936, 100), (16384, 256),
                                 (16383, 40), (1000, 999), (50, 50)])
@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "sorted"])
def test_top_k_ids_is_the_exact_top_k_with_low_id_ties(n, k, kind):
    """``top_k_ids`` returns exactly the k best ids under (value descending, id ascending),
    grouped "greater than the k-th value" then "equal", each in ascending id — whether the
    strided-sample threshold narrows the candidates (large n) or not: heavy ties (logits on a
    coarse grid), a grammar-like mask (most logits -inf, fewer than k finite in some cases)
    and logits sorted by id (the strided sample then sees a biased subset)."""
    from opencoti.engine.sampling import top_k_ids

    rng = np.random.default_rng(n + k)
    x = rng.standard_normal(n).astype(np.float32) * 3
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "masked":
        keep = rng.random(n) < (30 / n if k == 40 else 0.01)
        x = np.where(keep, x, np.float32(-np.inf)).astype(np.float32)
    elif kind == "sorted":
        x = np.sort(x)
    got = top_k_ids(x, k)
    want = np.lexsort((np.arange(n), -x))[:k]
    assert got.dtype == np.int64 and len(got) == k
    assert sorted(got.tolist()) == sorted(want.tolist())
    kth = x[want[-1]]
    g = got[x[got] > kth]
    assert got[:len(g)].tolist() == sorted(g.tolist()) and (np.diff(got[len(g):]) > 0).all()


@pytest.mark.parametrize("over", [dict(logit_bias={2: 1e39}), dict(presence_penalty=-1e308),
                                  dict(repeat_penalty=1e-308), dict(logit_bias={i: -np.inf for i in range(4)})])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overflowing_bias_or_penalties_are_the_requests_fault(over, temperature):
    """A bias / penalty that overflows float32 (or bans every token) raises SamplingParamsError
    (HTTP 400), not the plain ValueError of non-finite model logits (500)."""
    s = Sampler(params(temperature=temperature, **over), 4)
    s.accept(1)  # a history for the penalties
    x = logits_of([0.4, 0.3, 0.2, 0.1]) + np.float32(5)  # positive: repeat_penalty divides them
    with pytest.raises(SamplingParamsError):
        s.sample(x)
    bad = x.copy()
    bad[0] = np.nan
    with pytest.raises(ValueError) as ei:
        Sampler(params(temperature=temperature), 4).sample(bad)
    assert not isinstance(ei.value, SamplingParamsError)


# -- XTC, dynamic temperature, Mirostat (llama.cpp llama-sampling.cpp) --------------------------

def test_xtc_cuts_the_top_choices_but_the_least_probable_of_them():
    """XTC (probability 1: every step): the candidates at or above the threshold leave except the
    least probable of them; off at a threshold above 0.5, at probability 0, when only the first
    token is above, and when fewer than min_keep would remain; at temperature 0 the choice is the
    argmax of what is left (the greedy shortcut is off)."""
    x = logits_of([0.4, 0.3, 0.2, 0.1])
    assert cand_set(Sampler(params(xtc_probability=1.0, xtc_threshold=0.15), 4), x) == {2, 3}
    assert cand_set(Sampler(params(xtc_probability=1.0, xtc_threshold=0.25), 4), x) == {1, 2, 3}
    for kw in (dict(xtc_threshold=0.51), dict(xtc_probability=0.0), dict(xtc_threshold=0.35), dict(min_keep=3)):
        assert cand_set(Sampler(params(**{"xtc_probability": 1.0, "xtc_threshold": 0.15, **kw}), 4), x) == {0, 1, 2, 3}
    assert cand_set(Sampler(params(xtc_probability=1.0, xtc_threshold=0.15, min_keep=2), 4), x) == {2, 3}
    s = Sampler(params(xtc_probability=1.0, xtc_threshold=0.15, temperature=0.0), 4)
    assert not s.argmax_only and s.sample(x) == 2
    # in an explicit chain too, where the chain names it
    assert cand_set(Sampler(params(xtc_probability=1.0, xtc_threshold=0.15, samplers=("xtc", "temperature")), 4),
                    x) == {2, 3}
    assert cand_set(Sampler(params(xtc_probability=1.0, xtc_threshold=0.15, samplers=("temperature",)), 4),
                    x) == {0, 1, 2, 3}


def test_xtc_fires_with_its_probability_and_holds_for_the_step():
    """With xtc_probability 0.3 about 30 % of the steps cut (one uniform draw a step, > p: no
    cut); candidates() after sample() sees the step's decision (post_sampling_top)."""
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    s = Sampler(params(xtc_probability=0.3, xtc_threshold=0.2, seed=11), 4)
    cuts = 0
    for _ in range(4000):
        tok = s.sample(x)
        cut = cand_set(s, x) == {1, 2, 3}
        assert cut or cand_set(s, x) == {0, 1, 2, 3}
        assert cut or tok in (0, 1, 2, 3)
        assert not cut or tok != 0
        cuts += cut
    assert abs(cuts / 4000 - 0.3) < 0.03, cuts


def _entropy_temp(vals, t, d, e):
    p = np.exp(vals.astype(np.float64) - vals.max())
    p /= p.sum()
    h = -np.sum(p[p > 0] * np.log(p[p > 0]))
    lo, hi = max(0.0, t - d), t + d
    return lo + (hi - lo) * (h / np.log(vals.size)) ** e


def test_dynatemp_scales_by_the_normalized_entropy():
    """dynatemp_range d: the logits are divided by t0 + (t1 - t0) (H / log m)^exponent (llama.cpp
    temp_ext): a flat row gets t + d, a peaked one nearly max(0, t - d); one candidate stays as it
    is; at temperature 0 with a range the greedy shortcut is off."""
    rng = np.random.default_rng(5)
    for t, d, e in ((1.0, 0.5, 1.0), (0.7, 0.3, 2.0), (0.2, 0.5, 0.5)):
        x = (rng.standard_normal(50) * 2).astype(np.float32)
        ids, vals = Sampler(params(temperature=t, dynatemp_range=d, dynatemp_exponent=e), 50).candidates(x)
        assert list(ids) == list(range(50))
        np.testing.assert_allclose(vals, x / np.float32(_entropy_temp(x, t, d, e)), rtol=1e-6)
    flat = np.zeros(8, np.float32)
    _, vals = Sampler(params(temperature=1.0, dynatemp_range=0.5), 8).candidates(flat + 3)
    np.testing.assert_allclose(vals, 3 / 1.5, rtol=1e-6)
    ids, vals = Sampler(params(temperature=1.0, dynatemp_range=0.5, top_k=1), 8).candidates(np.arange(8, dtype=np.float32))
    assert list(ids) == [7] and vals[0] == 7  # one candidate: unscaled
    s = Sampler(params(temperature=0.0, dynatemp_range=1.0, seed=3), 4)
    assert not s.argmax_only
    assert len({s.sample(logits_of([0.3, 0.3, 0.2, 0.2])) for _ in range(200)}) > 1


def test_mirostat_v2_cuts_at_mu_and_learns():
    """Mirostat 2 (llama.cpp mirostat_v2): mu starts at 2 tau; the candidates are the most
    probable up to the first with -log2 p > mu (at least one); the draw is from their softmax and
    mu -= eta (-log2 p_token - tau). Penalties and top_k do not run (the chain is replaced)."""
    probs = [0.5, 0.25, 0.125, 0.0625, 0.0625]
    x = logits_of(probs)
    tau, eta = 1.2, 0.3
    s = Sampler(params(mirostat=2, mirostat_tau=tau, mirostat_eta=eta, top_k=1, repeat_penalty=2.0, seed=9), 5)
    s.accept_many([0, 0, 0])
    mu = 2 * tau
    for _ in range(30):
        keep = [i for i in range(5)]
        first_over = next((i for i, p in enumerate(probs) if -math.log2(p) > mu), 5)
        keep = keep[:max(first_over, 1)]
        tok = s.sample(x)
        assert cand_set(s, x) == set(keep) and tok in keep
        q = np.asarray(probs)[keep] / np.sum(np.asarray(probs)[keep])
        mu -= eta * (-math.log2(q[keep.index(tok)]) - tau)
        assert s.mu == pytest.approx(mu, rel=1e-6)
    s.reset()
    assert s.mu == 2 * tau


def test_mirostat_v1_keeps_the_estimated_top_k():
    """Mirostat 1 (llama.cpp mirostat, m = 100): s from the top tokens' log-ratios, k = (e 2^mu /
    (1 - n^-e))^(1/s) with e = s - 1, the draw from the top max(int(k), 1), mu updated as v2."""
    rng = np.random.default_rng(2)
    n = 300
    x = np.sort(rng.standard_normal(n) * 3).astype(np.float32)[::-1].copy()
    p = np.exp(x.astype(np.float64) - x.max())
    p /= p.sum()
    tau, eta = 4.0, 0.2
    s = Sampler(params(mirostat=1, mirostat_tau=tau, mirostat_eta=eta, seed=4), n)
    mu = 2 * tau
    for _ in range(10):
        i = np.arange(99, dtype=np.float64)
        ti, bi = np.log((i + 2) / (i + 1)), np.log(p[:99] / p[1:100])
        sh = np.sum(ti * bi) / np.sum(ti * ti)
        k = max(int(((sh - 1) * 2 ** mu / (1 - n ** -(sh - 1))) ** (1 / sh)), 1)
        tok = s.sample(x)
        assert cand_set(s, x) == set(range(k)) and tok < k
        q = p[:k] / p[:k].sum()
        mu -= eta * (-math.log2(q[tok]) - tau)
        assert s.mu == pytest.approx(mu, rel=1e-9)


def test_mirostat_degenerate_rows_do_not_raise():
    """Mirostat 1 on a flat row (s estimated 0: k infinite), with one finite logit, and both
    versions with mu driven far out (a huge eta): a token every step, no exception (llama.cpp's
    float arithmetic gives inf / nan there; here they keep every candidate, or the first)."""
    flat = np.zeros(64, np.float32)
    one = np.full(64, -np.inf, np.float32)
    one[9] = 0.0
    for v in (1, 2):
        s = Sampler(params(mirostat=v, mirostat_eta=1e300, mirostat_tau=1e3, seed=1), 64)
        for x in (flat, one, flat, logits_of(np.linspace(1, 2, 64) / np.linspace(1, 2, 64).sum())):
            tok = s.sample(x)
            assert 0 <= tok < 64 and (x is not one or tok == 9)


def test_mirostat_temperature_zero_is_greedy_and_bad_values_refused():
    s = Sampler(params(mirostat=2, temperature=0.0, mirostat_tau=5.0, mirostat_eta=0.1), 4)
    x = logits_of([0.1, 0.6, 0.2, 0.1])
    assert s.sample(x) == 1 and s.mu == pytest.approx(10.0 + 0.1 * 5.0)
    for kw in (dict(mirostat=3), dict(dynatemp_range=-1.0), dict(min_keep=-1), dict(xtc_threshold=float("nan")),
               dict(mirostat_tau=float("inf"))):
        with pytest.raises(ValueError):
            Sampler(params(**kw), 4)


def test_min_keep_holds_in_typical_top_p_min_p():
    """min_keep (llama.cpp passes it to typical, top_p and min_p): each keeps at least that many
    candidates, the most probable (typical: the most typical); 0 changes nothing; the explicit
    chain agrees; top_p's partial sort over a large row widens when min_keep exceeds it."""
    x = logits_of([0.5, 0.3, 0.1, 0.05, 0.05])
    assert cand_set(Sampler(params(top_p=0.5), 5), x) == {0}
    assert cand_set(Sampler(params(top_p=0.5, min_keep=3), 5), x) == {0, 1, 2}
    assert cand_set(Sampler(params(min_p=0.5), 5), x) == {0, 1}
    assert cand_set(Sampler(params(min_p=0.5, min_keep=4), 5), x) == {0, 1, 2, 3}  # a tie: the lower id
    assert cand_set(Sampler(params(min_p=0.5, min_keep=9), 5), x) == {0, 1, 2, 3, 4}
    base = cand_set(Sampler(params(typical_p=0.3), 5), x)
    wide = cand_set(Sampler(params(typical_p=0.3, min_keep=4), 5), x)
    assert len(base) < 4 and len(wide) == 4 and base <= wide
    for kw in (dict(top_p=0.5, min_keep=3), dict(min_p=0.5, min_keep=4), dict(typical_p=0.3, min_keep=4)):
        name = {"top_p": "top_p", "min_p": "min_p", "typical_p": "typ_p"}[next(iter(kw))]
        assert cand_set(Sampler(params(**kw, samplers=(name, "temperature")), 5), x) == \
            cand_set(Sampler(params(**kw), 5), x), kw
    rng = np.random.default_rng(8)
    big = (rng.standard_normal(5000) * 4).astype(np.float32)
    assert len(cand_set(Sampler(params(top_p=0.3), 5000), big)) < 300
    got = Sampler(params(top_p=0.3, min_keep=300), 5000).candidates(big)[0]
    assert set(got.tolist()) == set(np.argsort(-big, kind="stable")[:300].tolist())


def test_extreme_temperatures_keep_the_distribution():
    """A temperature whose quotient leaves float32 (1e-300: the logits / t overflow; 1e300: t
    itself does) still samples its limit: the argmax, or uniformly over the finite logits,
    never a banned (-inf) token; dynamic temperature reaches them too."""
    x = np.array([3, 2.9, 2.5, -0.5, 1.0, -np.inf], np.float32)
    for kw in (dict(temperature=1e-300), dict(temperature=0.0, dynatemp_range=1e-300)):
        s = Sampler(params(**kw, seed=1), 6)
        assert {s.sample(x) for _ in range(100)} == {0}, kw
    for kw in (dict(temperature=1e300), dict(temperature=1.0, dynatemp_range=1e300)):
        s = Sampler(params(**kw, seed=1), 6)
        got = [s.sample(x) for _ in range(2000)]
        assert set(got) == {0, 1, 2, 3, 4}, kw
        assert min(np.bincount(got)) > 300, kw
        assert np.isfinite(s.candidates(x)[1][:5]).all()


# ---------------------------------------------------------------- DRY


def _dry_reference(hist, breakers, multiplier, base, allowed, last_n):
    """DRY's logit deltas {token: penalty} after ``hist``, a plain transcription of the four
    steps of llama.cpp's ``llama_sampler_dry_apply`` (restart limit; the reverse Z-algorithm with
    its Z-box; the longest repeat per following token; the clamped penalty, single-token breakers
    spared), token by token in float32 / double as there."""
    h = list(hist)[-last_n:] if last_n > 0 else list(hist)
    n = len(h)
    if n <= allowed:
        return {}
    rat = lambda i: h[n - 1 - i]  # noqa: E731
    rep_limit = n
    for i in range(n):
        tails = breakers.get(rat(i))
        if not tails:
            continue
        longest = -1
        for tail in tails:
            if longest < len(tail) <= i and all(tail[o] == rat(i - o - 1) for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    count = [0] * n
    last, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p = k - lt
            if count[last - p] < rt - k + 1:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    best = {}
    for i in range(n - 1):
        if count[i] >= allowed:
            t = rat(n - 2 - i)
            best[t] = max(best.get(t, count[i]), count[i])
    max_exp = 0
    if np.float32(base) > np.float32(1.000001):
        max_exp = int(np.float32(88.7228391) / np.log(np.float32(base)))
    out = {}
    for t, length in best.items():
        if () in breakers.get(t, ()):
            continue
        e = length - allowed
        if max_exp > 0 and e > max_exp:
            e = max_exp
        out[t] = np.float32(float(np.float32(multiplier)) * float(np.float32(base)) ** e)
    return out


@pytest.mark.parametrize("case", [
    # llama.cpp tests/test-sampling.cpp test_dry: probs, history, expected, multiplier, base, allowed, last_n, breakers
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
])
def test_dry_llama_cpp_cases(case):
    probs, hist, want, mult, base, allowed, last_n, seqs = case
    breakers = {}
    for seq in seqs:
        breakers.setdefault(seq[0], []).append(tuple(seq[1:]))
    s = Sampler(params(dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n),
                len(probs), dry_breakers={h: tuple(t) for h, t in breakers.items()})
    s.accept_many(hist)
    ids, vals = s.candidates(logits_of(probs))
    got = np.zeros(len(probs))
    got[ids] = np.exp(vals - vals.max()) / np.exp(vals - vals.max()).sum()
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_dry_matches_llama_cpp_z_algorithm():
    """Random repetitive histories (a small alphabet, copied runs, one- and multi-token breakers,
    bases from 1 to past float range's clamp, allowed lengths 0-4, windows): the vectorised
    penalties equal the transcription's, token for token and bit for bit."""
    from opencoti.engine.dry import dry_penalties

    rng = np.random.default_rng(11)
    checked = 0
    for trial in range(300):
        n_vocab = int(rng.integers(3, 12))
        hist = list(rng.integers(0, n_vocab, int(rng.integers(1, 60))))
        for _ in range(int(rng.integers(0, 4))):  # paste earlier runs again: long repeats
            a = int(rng.integers(0, len(hist)))
            hist += hist[a:a + int(rng.integers(1, 30))]
        breakers = {}
        for _ in range(int(rng.integers(0, 3))):
            tail = tuple(int(t) for t in rng.integers(0, n_vocab, int(rng.integers(0, 3))))
            breakers.setdefault(int(rng.integers(0, n_vocab)), set()).add(tail)
        breakers = {h: tuple(sorted(t)) for h, t in breakers.items()}
        mult = float(rng.choice([0.8, 2.0, -0.5]))
        base = float(rng.choice([1.0, 1.0000005, 1.1, 1.75, 3.0, 1e30]))
        allowed = int(rng.integers(0, 5))
        last_n = int(rng.choice([0, 5, 17, 1000]))  # 0 here: the whole history
        want = _dry_reference(hist, breakers, mult, base, allowed, last_n)
        window = hist[-last_n:] if last_n > 0 else hist
        ids, pen = dry_penalties(window, breakers, mult, base, allowed)
        got = {int(t): p for t, p in zip(ids, pen)}
        assert got.keys() == want.keys(), (trial, hist, breakers, allowed)
        for t in want:
            assert got[t] == want[t], (trial, t, got[t], want[t])
        checked += len(want)
    assert checked > 300
    # one token repeated far past the clamp (base 1.75: exponent <= 158): the same penalties
    hist = [1] * 500 + [2] + [1] * 400
    ids, pen = dry_penalties(hist, {}, 1.0, 1.75, 2)
    want = _dry_reference(hist, {}, 1.0, 1.75, 2, 0)
    assert dict(zip(ids.tolist(), pen.tolist())) == {t: float(p) for t, p in want.items()}
    assert want[1] == np.float32(1.75 ** 158) and want[2] == np.float32(1.75 ** 158)


def test_dry_off_means_off_and_its_history():
    """Multiplier 0, base < 1 or last_n 0: the chain's output is the plain one and the sampler may
    take the backend's argmax; on, DRY looks at the prompt and the accepted tokens, the last
    ``dry_penalty_last_n`` of them, and greedy picks around the penalty."""
    x = logits_of([0.3, 0.25, 0.2, 0.15, 0.1])
    hist = [0, 1, 2, 0, 1]  # 0 1 was followed by 2: 2 would repeat "0 1 2"
    for off in (dict(dry_multiplier=0.0), dict(dry_multiplier=5.0, dry_base=0.9),
                dict(dry_multiplier=5.0, dry_penalty_last_n=0)):
        plain, s = Sampler(params(temperature=0.0), 5), Sampler(params(temperature=0.0, **off), 5)
        s.accept_many(hist)
        assert s.argmax_only and np.array_equal(s.apply_penalties(x), x)
        assert s.sample(x) == plain.sample(x) == 0
    s = Sampler(params(temperature=0.0, dry_multiplier=5.0, dry_allowed_length=1), 5)
    assert not s.argmax_only
    s.accept_many([3, 0])
    s.accept(3)  # "3 0" then "3": 0 would repeat "3 0" (length 1 + 1)
    y = s.apply_penalties(x)
    assert y[0] == x[0] - np.float32(5.0) and np.array_equal(y[1:], x[1:]) and s.sample(x) == 1
    s.reset()
    assert np.array_equal(s.apply_penalties(x), x)
    w = Sampler(params(dry_multiplier=5.0, dry_allowed_length=1, dry_penalty_last_n=2), 5)
    w.accept_many([3, 0, 4, 3])  # the window "4 3" holds no earlier "3"
    assert np.array_equal(w.apply_penalties(x), x)
    # a single-token breaker is never penalized and stops the match
    b = Sampler(params(dry_multiplier=5.0, dry_allowed_length=1), 5, dry_breakers={0: ((),)})
    b.accept_many([3, 0, 3])
    assert np.array_equal(b.apply_penalties(x), x)
    with pytest.raises(ValueError, match="dry_penalty_last_n"):
        Sampler(params(dry_penalty_last_n=-2), 5)


def test_dry_breakers_follow_the_vocabulary(shared_dir):
    """llama.cpp's overlapping token sequences on a real vocabulary (GPT-2): a token containing
    the breaker is a breaker alone; a token ending in a proper prefix of it heads the rest,
    tokenized; empty breakers are skipped; the result is cached per breaker list."""
    from opencoti.engine.dry import process_breakers
    from opencoti.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(str(shared_dir / "data/vocab/ggml-vocab-gpt-2.gguf"))
    nl = process_breakers(tok, ["\n", ""])
    assert nl[tok.tokenize("\n", add_special=False)[0]] == ((),)
    assert all(b"\n" in tok.detokenize_bytes([h], special=True) and t == ((),) for h, t in nl.items())
    assert len(nl) == sum(b"\n" in tok.detokenize_bytes([i], special=True) for i in range(tok.n_vocab))
    user = process_breakers(tok, ["User:"])
    u = tok.token_id("U")
    assert user[u] == (tuple(tok.tokenize("ser:", add_special=False)),)
    for h, tails in user.items():
        word = tok.detokenize_bytes([h], special=True)
        for t in tails:
            assert b"User:" in word if t == () else any(
                word.endswith(b"User:"[:k]) and tuple(tok.tokenize("User:"[k:], add_special=False)) == t
                for k in range(1, 5))
    assert process_breakers(tok, ["User:"]) is user
    # the vectorised scan against a plain one over every token (llama.cpp's loop, as sets)
    words = [tok.detokenize_bytes([i], special=True) for i in range(tok.n_vocab)]
    for breaker in ("User:", "é!", "\n\n", ", and"):
        s, want = breaker.encode(), {}
        for tid, word in enumerate(words):
            if s in word:
                want.setdefault(tid, set()).add(())
                continue
            for pos in range(len(word)):
                n = len(word) - pos
                if n < len(s) and word[pos:] == s[:n]:
                    rest = s[n:].decode("utf-8", errors="replace")
                    want.setdefault(tid, set()).add(tuple(tok.tokenize(rest, add_special=False)))
        got = process_breakers(tok, [breaker])
        assert {h: set(t) for h, t in got.items()} == want, breaker
    with pytest.raises(ValueError, match="at most 64"):
        Sampler(params(dry_sequence_breakers=tuple(str(i) for i in range(65))), 5)
    with pytest.raises(ValueError, match="dry_penalty_last_n must be in"):
        Sampler(params(dry_penalty_last_n=2 ** 63), 5)
    with pytest.raises(ValueError, match="dry_allowed_length must be a 32-bit integer"):
        Sampler(params(dry_allowed_length=-10 ** 20), 5)
    with pytest.raises(ValueError, match="no lone surrogates"):
        Sampler(params(dry_sequence_breakers=("\ud800",)), 5)
