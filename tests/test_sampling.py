"""Tests for daemons/sampling.py: the sampler chain, its truncation sets, penalties, RNG determinism."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from daemons.sampling import Sampler, SamplingError, SamplingParams, argmax_lowest

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def logits_strategy(min_size=2, max_size=40):
    # Small integers/eighths make ties frequent (they are what tie-breaking bugs hide behind).
    return st.lists(st.integers(-40, 40).map(lambda v: v / 8.0), min_size=min_size,
                    max_size=max_size).map(lambda xs: np.asarray(xs, dtype=np.float32))


def support(p: np.ndarray) -> set[int]:
    return set(np.flatnonzero(p > 0).tolist())


def ranked(logits: np.ndarray) -> list[int]:
    """Token ids by (logit desc, id asc), the documented tie order."""
    return sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))


# ---- greedy -------------------------------------------------------------------------------------

@FAST
@given(logits_strategy())
def test_greedy_picks_lowest_index_among_ties(logits):
    # Bug guarded: a tie-break that is not the lowest index (e.g. last max, or unstable sort) breaks
    # "bit-exact greedy" between AR and speculative decoding.
    expected = min(i for i in range(len(logits)) if logits[i] == logits.max())
    assert argmax_lowest(logits) == expected
    assert Sampler(SamplingParams()).sample(logits, []) == expected
    p = Sampler(SamplingParams()).probs(logits, [])
    assert p[expected] == 1.0 and p.sum() == 1.0


def test_greedy_tie_explicit_and_rng_untouched():
    s = Sampler(SamplingParams(seed=5))
    before = s.get_state()
    logits = np.array([0, 3, 1, 3, 3], dtype=np.float32)
    assert [s.sample(logits, []) for _ in range(5)] == [1] * 5
    # Greedy draws no uniform, so the RNG position (saved in worker snapshots) does not move.
    assert s.get_state() == before


# ---- penalties ----------------------------------------------------------------------------------

def reference_penalties(logits, history, p: SamplingParams):
    out = logits.astype(np.float32).copy()
    if p.repeat_last_n == 0:
        return out
    window = list(history) if p.repeat_last_n == -1 else list(history)[-p.repeat_last_n:]
    counts: dict[int, int] = {}
    for t in window:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        v = out[t]
        pen = np.float32(p.repeat_penalty)
        v = v / pen if v > 0 else v * pen
        v = np.float32(v) - (np.float32(c) * np.float32(p.frequency_penalty)
                             + np.float32(p.presence_penalty))
        out[t] = v
    return out


@FAST
@given(
    data=st.data(),
    pen=st.sampled_from([1.0, 1.1, 1.5, 0.8]),
    freq=st.sampled_from([0.0, 0.25, -0.5]),
    pres=st.sampled_from([0.0, 0.5, -0.25]),
    last_n=st.sampled_from([-1, 0, 1, 3, 64]),
)
def test_penalties_change_exactly_the_intended_logits(data, pen, freq, pres, last_n):
    # Bugs guarded: penalising per occurrence instead of per distinct token, the wrong sign rule for
    # negative logits, a window off by one, or touching tokens outside the window.
    logits = data.draw(logits_strategy(min_size=5, max_size=30))
    history = data.draw(st.lists(st.integers(0, len(logits) - 1), max_size=20))
    p = SamplingParams(repeat_penalty=pen, frequency_penalty=freq, presence_penalty=pres,
                       repeat_last_n=last_n)
    got = Sampler(p).penalized_logits(logits, history)
    np.testing.assert_array_equal(got, reference_penalties(logits, history, p))
    window = set(history if last_n == -1 else (history[-last_n:] if last_n else []))
    untouched = [i for i in range(len(logits)) if i not in window]
    np.testing.assert_array_equal(got[untouched], logits[untouched])


def test_penalty_window_and_signs_by_hand():
    logits = np.array([2.0, -2.0, 1.0, 4.0, 0.0], dtype=np.float32)
    history = [3, 0, 1, 1, 4]  # last 4: 0, 1, 1, 4 (token 3 falls out of the window)
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=4)
    got = Sampler(p).penalized_logits(logits, history)
    np.testing.assert_allclose(got, [2 / 2 - 0.75, -2 * 2 - 1.25, 1.0, 4.0, 0 * 2 - 0.75])
    assert Sampler(p).penalized_logits(logits, []) is not None
    # Input not modified in place (the caller may reuse the model's logits buffer).
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0, 4.0, 0.0])


def test_greedy_with_penalties_uses_penalised_argmax():
    logits = np.array([1.0, 5.0, 4.5], dtype=np.float32)
    p = SamplingParams(repeat_penalty=1.5)
    assert not p.is_greedy and SamplingParams().is_greedy
    assert Sampler(p).sample(logits, [1]) == 2  # 5/1.5 < 4.5


# ---- truncation sets ----------------------------------------------------------------------------

@FAST
@given(logits=logits_strategy(), k=st.integers(1, 45))
def test_top_k_keeps_the_k_largest_with_low_id_ties(logits, k):
    p = Sampler(SamplingParams(temperature=1.0, top_k=k)).probs(logits, [])
    assert support(p) == set(ranked(logits)[:k])
    assert math.isclose(p.sum(), 1.0, rel_tol=1e-12)


def reference_top_p(logits: np.ndarray, top_p: float) -> tuple[set[int], float]:
    order = ranked(logits)
    x = logits.astype(np.float64)
    pr = np.exp(x - x.max())
    pr /= pr.sum()
    cum = 0.0
    kept = []
    margin = math.inf
    for i in order:
        cum += pr[i]
        kept.append(i)
        margin = min(margin, abs(cum - top_p))
        if cum >= top_p:
            break
    return set(kept), margin


@FAST
@given(logits=logits_strategy(), top_p=st.floats(0.05, 0.99))
def test_top_p_keeps_the_smallest_prefix_reaching_p(logits, top_p):
    expected, margin = reference_top_p(logits, top_p)
    assume(margin > 1e-9)  # rounding at the exact boundary may legitimately go either way
    p = Sampler(SamplingParams(temperature=1.0, top_p=top_p)).probs(logits, [])
    assert support(p) == expected


@pytest.mark.parametrize("scale", [8.0, 0.01])
def test_top_p_large_vocab_matches_full_sort(scale):
    # scale 0.01: nearly flat, the nucleus is far larger than the 1024-token head, so the fallback to
    # a bigger head / full sort must kick in; scale 8: the head path alone.
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(6000) * scale).astype(np.float32)
    logits[100:110] = logits[100]  # a tie block
    expected, margin = reference_top_p(logits, 0.9)
    assert margin > 1e-9
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.9)).probs(logits, [])
    assert support(p) == expected


@FAST
@given(logits=logits_strategy(), min_p=st.floats(0.01, 1.0))
def test_min_p_keeps_tokens_above_fraction_of_max(logits, min_p):
    x = logits.astype(np.float64)
    pr = np.exp(x - x.max())
    ratio = pr / pr.max()
    assume(np.all(np.abs(ratio - min_p) > 1e-9))
    expected = set(np.flatnonzero(ratio >= min_p).tolist())
    p = Sampler(SamplingParams(temperature=1.0, min_p=min_p)).probs(logits, [])
    assert support(p) == expected


@pytest.mark.parametrize("temperature", [0.05, 1.0, 100.0])
def test_truncation_uses_untempered_logits_like_llama_cpp(temperature):
    # Bug guarded: applying temperature before top_p/min_p (lucebox's order) instead of llama.cpp's.
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)  # softmax ≈ .644 .237 .087 .032
    assert support(Sampler(SamplingParams(temperature=temperature, top_p=0.8)).probs(logits)) == {0, 1}
    assert support(Sampler(SamplingParams(temperature=temperature, min_p=0.3)).probs(logits)) == {0, 1}


def test_top_p_applies_within_the_renormalised_top_k_set():
    # Bug guarded: top_p computed over the full vocabulary (lucebox without top_k) after top_k.
    logits = np.array([3.0, 2.9, 2.8, 0.0, -5.0, 2.95], dtype=np.float32)
    p = SamplingParams(temperature=0.5, top_k=3, top_p=0.6, min_p=0.0)
    got = Sampler(p).probs(logits)
    # top_k keeps {0, 5, 1}; top_p over that renormalised set: p0 ≈ .351, +p5 ≈ .685 >= .6 -> {0, 5}.
    assert support(got) == {0, 5}
    x = np.array([3.0, 2.95], dtype=np.float32).astype(np.float64) / 0.5
    w = np.exp(x - x.max())
    np.testing.assert_allclose(got[[0, 5]], w / w.sum(), rtol=1e-12)


def test_neg_inf_logits_never_drawn():
    logits = np.full(10, -np.inf, dtype=np.float32)
    logits[[2, 7]] = [0.0, 0.5]
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert {s.sample(logits) for _ in range(300)} == {2, 7}
    assert support(s.probs(logits)) == {2, 7}


# ---- RNG determinism and state -----------------------------------------------------------------

def test_seeded_determinism_and_state_roundtrip():
    rng = np.random.default_rng(7)
    logits = [rng.standard_normal(50).astype(np.float32) for _ in range(40)]
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    a, b = Sampler(params), Sampler(params)
    seq_a = [a.sample(x) for x in logits]
    assert seq_a == [b.sample(x) for x in logits]
    assert len(set(seq_a)) > 5  # the draw really is random, not stuck

    s = Sampler(params)
    for x in logits[:10]:
        s.sample(x)
    saved = json.loads(json.dumps(s.get_state()))  # must survive a JSON/msgpack snapshot
    tail = [s.sample(x) for x in logits[10:]]
    s.set_state(saved)
    assert [s.sample(x) for x in logits[10:]] == tail
    other = Sampler(SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=99))
    other.set_state(saved)
    assert [other.sample(x) for x in logits[10:]] == tail
    assert other.seed == 1234

    with pytest.raises(SamplingError):
        s.set_state({"bit_generator": "MT19937"})
    with pytest.raises(SamplingError):
        s.set_state({"bit_generator": "PCG64", "state": "zz", "inc": "1", "has_uint32": 0, "uinteger": 0})


def test_random_seed_is_resolved_and_reported():
    a = Sampler(SamplingParams(temperature=1.0))
    b = Sampler(SamplingParams(temperature=1.0, seed=a.seed))
    logits = np.linspace(0, 1, 64, dtype=np.float32)
    assert [a.sample(logits) for _ in range(30)] == [b.sample(logits) for _ in range(30)]


def test_empirical_distribution_matches_probs():
    # Bugs guarded: an inverse-CDF off by one, drawing from the untruncated or untempered
    # distribution, or a draw order that differs from the documented one.
    logits = np.array([1.2, -0.3, 0.8, 2.0, 0.1, -2.0, 1.9, 0.5], dtype=np.float32)
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.93, seed=2024)
    s = Sampler(params)
    p = s.probs(logits)
    n = 20000
    counts = np.bincount([s.sample(logits) for _ in range(n)], minlength=len(logits))
    assert set(np.flatnonzero(counts).tolist()) <= support(p)
    nz = p > 0
    chi2 = float((((counts - n * p) ** 2)[nz] / (n * p[nz])).sum())
    dof = int(nz.sum()) - 1
    assert dof == 4
    assert chi2 < 23.5, chi2  # chi-square 0.9999 quantile at 4 dof ≈ 23.51 (seeded: no flakes)
    assert 0.5 * np.abs(counts / n - p).sum() < 0.015


def test_sample_equals_draw_of_probs_at_same_rng_position():
    # The speculative sampler will draw from probs() itself; it must agree token for token with sample.
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=1.3, top_p=0.9, min_p=0.02, seed=11)
    a, b = Sampler(params), Sampler(params)
    for _ in range(500):
        x = rng.standard_normal(37).astype(np.float32)
        assert a.sample(x) == b.draw(b.probs(x))


# ---- speed (no per-vocabulary Python loops) -----------------------------------------------------

def test_large_vocab_is_vectorised():
    v = 250_000
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(v) * 3).astype(np.float32)
    history = rng.integers(0, v, 300).tolist()
    configs = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=0.2, repeat_last_n=-1, seed=1),
        SamplingParams(),
    ]
    t0 = time.perf_counter()
    for params in configs:
        s = Sampler(params)
        for _ in range(5):
            tok = s.sample(logits, history)
            assert 0 <= tok < v
    elapsed = time.perf_counter() - t0
    # A Python loop over 250k logits costs ~0.1 s per call; 20 vectorised calls take a few tens of ms.
    assert elapsed < 1.5, elapsed


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"repeat_penalty": 0.0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"presence_penalty": "x"}, "presence_penalty"),
    ({"seed": -5}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"top_k": True}, "top_k"),
])
def test_invalid_params_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_from_mapping_reads_llama_server_names():
    body = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1,
            "repeat_last_n": 128, "frequency_penalty": 0.1, "presence_penalty": 0.2, "seed": -1,
            "n_predict": 10, "prompt": "hi"}
    p = SamplingParams.from_mapping(body)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n,
            p.frequency_penalty, p.presence_penalty, p.seed) == (0.7, 40, 0.9, 0.05, 1.1, 128, 0.1, 0.2, None)
    assert SamplingParams.from_mapping({"seed": 3}, base=p).top_k == 40
    assert set(p.to_dict()) == {"temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                "repeat_last_n", "frequency_penalty", "presence_penalty", "seed"}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_mapping({"top_p": 2})


def test_bad_logits_and_history_raise():
    s = Sampler(SamplingParams(temperature=1.0, repeat_penalty=1.2))
    with pytest.raises(SamplingError, match="NaN"):
        s.sample(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(SamplingError, match="vocabulary"):
        s.sample(np.zeros(4, dtype=np.float32), [4])
    with pytest.raises(SamplingError, match="-inf"):
        s.sample(np.full(4, -np.inf, dtype=np.float32))
    with pytest.raises(SamplingError, match="1-D"):
        s.sample(np.zeros((2, 4), dtype=np.float32))
    # [1, V] (what model.forward returns) is accepted.
    assert s.sample(np.array([[0.0, 9.0, 0.0]], dtype=np.float32)) in (0, 1, 2)


# ---- candidates selected elsewhere (a GPU's top-k): the same token as the whole row --------------
def test_sampling_from_the_needed_candidates_equals_sampling_the_row():
    """Guards the device top-k path of generation: with top_k on and penalties that only lower
    logits, sampling from the top_k + H largest logits (H = distinct penalised tokens) must pick the
    very token, RNG step for RNG step, that sampling the whole row picks — ties at the k-th value,
    penalised tokens dropping out of the top, -inf tails and all."""
    from daemons.sampling import top_candidates
    rng = np.random.default_rng(11)
    V = 3000
    settings_ = [dict(temperature=0.8, top_k=40), dict(temperature=1.3, top_k=5, top_p=0.9),
                 dict(temperature=0.7, top_k=64, min_p=0.05, repeat_penalty=3.0, repeat_last_n=64),
                 dict(temperature=1.0, top_k=1), dict(temperature=1.1, top_k=20, frequency_penalty=0.5,
                                                      presence_penalty=0.3, repeat_last_n=-1)]
    for params in settings_:
        a, b = Sampler(SamplingParams(seed=5, **params)), Sampler(SamplingParams(seed=5, **params))
        for step in range(60):
            logits = rng.standard_normal(V).astype(np.float32) * 3
            logits[rng.integers(0, V, 50)] = 2.5                 # ties
            logits[rng.integers(0, V, 30)] = -np.inf
            history = list(rng.integers(0, 200, 40))             # penalised ids crowd the top ...
            logits[np.array(history)] += 12                      # ... and fall out of it
            logits[:200] += 1
            k = a.candidates_needed(history, V)
            assert 0 < k <= V
            ids, vals = top_candidates(logits, k)
            assert a.sample(logits, history) == b.sample_candidates(ids, vals, V, history), (params, step)


def test_candidates_needed_refuses_what_can_raise_a_logit():
    history = [1, 2, 2, 3]
    assert Sampler(SamplingParams(temperature=0.0, top_k=40)).candidates_needed(history, 1000) == 0
    assert Sampler(SamplingParams(temperature=0.8, top_k=0)).candidates_needed(history, 1000) == 0
    assert Sampler(SamplingParams(temperature=0.8, top_k=40, repeat_penalty=0.9)).candidates_needed(history, 1000) == 0
    assert Sampler(SamplingParams(temperature=0.8, top_k=40, presence_penalty=-0.5)).candidates_needed(history, 1000) == 0
    assert Sampler(SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.2)).candidates_needed(history, 1000) == 43
    assert Sampler(SamplingParams(temperature=0.8, top_k=40)).candidates_needed(history, 1000) == 40
    assert Sampler(SamplingParams(temperature=0.8, top_k=990, repeat_penalty=1.2)).candidates_needed(history, 1000) == 993
    assert Sampler(SamplingParams(temperature=0.8, top_k=999, repeat_penalty=1.2)).candidates_needed(history, 1000) == 1000
