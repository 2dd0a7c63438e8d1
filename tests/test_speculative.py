"""Tests for daemons/speculative.py and the speculative path of daemons/generate.py: chain
speculative decoding must produce exactly the tokens (and leave exactly the state and RNG position)
of autoregressive decoding by the same implementation.

The target is a tiny random qwen35 (4 layers: 3 Gated DeltaNet + 1 gated attention), so recurrent
state, conv state and KV cache are all rolled back. Proposals come from an oracle that knows the
greedy continuation and corrupts it at a random depth (every acceptance length and rollback path),
and from real (random) DFlash drafts in each file form.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from daemons.dflash import DFlashDraft, DFlashDrafter, DraftProposal
from daemons.generate import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, GenerationRequest, generate, generate_all
from daemons.sampling import Sampler, SamplingParams
from daemons.speculative import (PREFILL_CHUNK, OracleDrafter, SpecParams, SpeculativeConfigError, SpeculativeDecoder,
                                 cut_proposal)
from tests.dflash_fixtures import draft_forms
from tests.qwen35_fixtures import build_tiny_qwen35, prompt_ids, session_root

TARGET_CONFIG = {"num_hidden_layers": 4}


@pytest.fixture(autouse=True, scope="module")
def one_numba_thread():
    """The tiny models are latency-bound: numba's thread pool only adds wake-ups per kernel call (and
    stalls badly on a loaded machine). Results do not depend on the thread count."""
    import numba
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from daemons.qwen35 import Qwen35Model
    _, path, hf = build_tiny_qwen35(session_root(tmp_path_factory), TARGET_CONFIG, outtype="f32")
    return Qwen35Model.load(path), hf, path


class PieceDecoder:
    """Token id t decodes to the piece '<t>' (so stop strings can be built from token ids)."""

    def __init__(self, tokenizer=None) -> None:
        pass

    def push(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


def run(model, request, **kw):
    return generate_all(model, None, request, decoder_factory=PieceDecoder, **kw)


def final_event(model, request, **kw):
    events = list(generate(model, None, request, decoder_factory=PieceDecoder, **kw))
    return events, events[-1]


def states_equal(a, b) -> bool:
    """Bit-for-bit equality of two target states over their committed tokens."""
    if a.n_past != b.n_past:
        return False
    n = a.n_past
    return (all(np.array_equal(a.k_cache[i][:, :n], b.k_cache[i][:, :n]) and
                np.array_equal(a.v_cache[i][:, :n], b.v_cache[i][:, :n]) for i in a.k_cache) and
            all(np.array_equal(a.conv[i], b.conv[i]) and np.array_equal(a.ssm[i], b.ssm[i]) for i in a.conv))


# ---- verify + rollback -------------------------------------------------------------------------------

def test_verify_rows_and_rollback_states_are_bit_identical_to_decoding(target):
    # Bugs guarded: a batched verify whose logits differ from single-token decoding (chunked DeltaNet,
    # attention over padded rows), a rollback that restores the DeltaNet or conv state of the wrong
    # token, or rounds it (f16 checkpoints).
    model, hf, _ = target
    rng = np.random.default_rng(1)
    for trial in range(12):
        prompt = prompt_ids(hf, int(rng.integers(2, 30)), seed=100 + trial)
        state = model.new_state(64)
        first = int(np.argmax(model.prefill(prompt, state)[-1]))
        block = [first] + [int(t) for t in rng.integers(0, 1000, size=int(rng.integers(1, 16)))]
        ar_states, ar_logits = [state.copy()], []
        for tok in block:
            s = ar_states[-1].copy()
            ar_logits.append(model.forward([tok], s)[0])
            ar_states.append(s)
        logits, _, record = model.verify(block, state)
        assert all(np.array_equal(logits[i], ar_logits[i]) for i in range(len(block)))
        for keep in rng.permutation(len(block) + 1):
            model.rollback(state, record, int(keep))
            assert states_equal(state, ar_states[keep]), (trial, keep)
        # decoding on from a rolled-back state continues exactly as decoding from the AR state
        keep = int(rng.integers(1, len(block) + 1))
        model.rollback(state, record, keep)
        nxt = int(rng.integers(0, 1000))
        s = ar_states[keep].copy()
        assert np.array_equal(model.forward([nxt], state), model.forward([nxt], s))
        assert states_equal(state, s)


def test_rollback_rejects_a_moved_state(target):
    from daemons.qwen35 import ModelInputError, StateError
    model, hf, _ = target
    state = model.new_state(64)
    model.prefill(prompt_ids(hf, 5), state)
    _, _, record = model.verify([1, 2, 3], state)
    with pytest.raises(ModelInputError, match="keeps 4 tokens of a 3-token block"):
        model.rollback(state, record, 4)
    model.forward([7, 8, 9, 10], state)
    with pytest.raises(StateError, match="cannot be the state of the verified block"):
        model.rollback(state, record, 1)


# ---- token identity with an oracle proposer ----------------------------------------------------------

def test_oracle_proposals_give_exactly_the_greedy_tokens(target):
    # 120 prompts x 3 block sizes; each proposal is the true continuation corrupted at a random depth,
    # so every acceptance length 0..k and every rollback depth occurs. A third of the requests stop
    # on a stop token and a third on a stop string somewhere in the continuation, usually in the
    # middle of a speculative step (the state and RNG must then be cut back too).
    # Bugs guarded: off-by-one in acceptance or bonus, rollback to the wrong prefix, the pending
    # token fed twice or skipped, stop handling that emits tokens past a stop.
    model, hf, _ = target
    rng = np.random.default_rng(7)
    seen = {b: set() for b in (3, 5, 9)}
    mid_step_stops = 0
    for i in range(120):
        prompt = prompt_ids(hf, int(rng.integers(2, 24)), seed=1000 + i)
        n_new = int(rng.integers(2, 30))
        greedy = run(model, GenerationRequest(prompt_ids=prompt, max_tokens=n_new))
        kind = i % 3
        stop_ids, stops = frozenset(), ()
        if kind and len(greedy.token_ids) > 2:
            at = int(rng.integers(1, len(greedy.token_ids)))
            if kind == 1:
                stop_ids = frozenset({greedy.token_ids[at]})
            else:
                stops = (f"<{greedy.token_ids[at]}>",)
        request = GenerationRequest(prompt_ids=prompt, max_tokens=n_new, stop_ids=stop_ids, stop_strings=stops)
        events, ar_end = final_event(model, request)
        ar_tokens = [t for e in events for t in e.token_ids]
        for block in seen:
            oracle = OracleDrafter(len(prompt), greedy.token_ids, block, model.n_vocab, seed=i * 7 + block)
            spec = SpeculativeDecoder(model, oracle)
            sp_events, sp_end = final_event(model, request, speculative=spec)
            assert [t for e in sp_events for t in e.token_ids] == ar_tokens, (i, block)
            assert "".join(e.text for e in sp_events) == "".join(e.text for e in events)
            assert (sp_end.finish_reason, sp_end.stop_token, sp_end.stop_string, sp_end.n_state_tokens) == \
                   (ar_end.finish_reason, ar_end.stop_token, ar_end.stop_string, ar_end.n_state_tokens)
            assert sp_end.state.n_past == sp_end.n_state_tokens
            assert sp_end.stats.generated_tokens == ar_end.stats.generated_tokens
            if any(len(e.token_ids) > 1 for e in sp_events[:-1]) and sp_end.finish_reason == FINISH_STOP:
                mid_step_stops += 1
            seen[block].update(oracle.corrupted_at)
    for block, lengths in seen.items():
        assert lengths == set(range(block)), (block, sorted(lengths))   # acceptance 0..block-1 drafts
    assert mid_step_stops > 20


def test_final_state_equals_the_autoregressive_state(target):
    # The state a request leaves (for prefix caching) is the AR state, even when a stop token ended
    # generation in the middle of an accepted block.
    model, hf, _ = target
    prompt = prompt_ids(hf, 9, seed=5)
    greedy = run(model, GenerationRequest(prompt_ids=prompt, max_tokens=24))
    request = GenerationRequest(prompt_ids=prompt, max_tokens=24, stop_ids=frozenset({greedy.token_ids[13]}))
    _, ar_end = final_event(model, request)
    oracle = OracleDrafter(len(prompt), greedy.token_ids, 9, model.n_vocab, corrupt=False)
    _, sp_end = final_event(model, request, speculative=SpeculativeDecoder(model, oracle))
    assert sp_end.finish_reason == FINISH_STOP and sp_end.stop_token == greedy.token_ids[13]
    assert states_equal(sp_end.state, ar_end.state)


def test_stats_count_what_the_verifies_decided(target):
    # Bugs guarded: AL computed without the bonus, per-position counts shifted by one, steps that
    # verified nothing counted as verify steps.
    model, hf, _ = target
    prompt = prompt_ids(hf, 6, seed=11)
    greedy = run(model, GenerationRequest(prompt_ids=prompt, max_tokens=40))
    oracle = OracleDrafter(len(prompt), greedy.token_ids, 5, model.n_vocab, seed=3)
    result = run(model, GenerationRequest(prompt_ids=prompt, max_tokens=40),
                 speculative=SpeculativeDecoder(model, oracle))
    assert result.token_ids == greedy.token_ids
    # the oracle corrupted proposal i (of k_i tokens) at depth j_i: the target accepts exactly j_i
    ks = [k for k, _ in oracle.proposals]
    js = [j for _, j in oracle.proposals]
    per_pos = [sum(j > d for j in js) for d in range(max(ks))]
    while per_pos and per_pos[-1] == 0:
        per_pos.pop()
    assert result.stats.spec == {"drafted": sum(ks), "accepted": sum(js), "accepted_per_position": per_pos,
                                 "steps": len(ks), "acceptance_length": (sum(js) + len(ks)) / len(ks)}
    # the committed tokens of the steps (accepted + bonus), plus the prefill's token, are the output
    # (the last step may be a plain one-token step when one token of budget is left)
    assert 1 + sum(j + 1 for j in js) in (len(result.token_ids), len(result.token_ids) - 1)
    assert [len(c) - 1 for _, c in oracle.observed[1:]][:len(js)] == js


# ---- sampling at T > 0 ------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    dict(temperature=0.9, seed=1234),
    dict(temperature=1.3, top_k=40, top_p=0.9, repeat_penalty=1.3, repeat_last_n=16, seed=99),
])
def test_sampled_speculative_decoding_equals_sampled_decoding(target, params):
    # T > 0 verifies by exact target sampling: same sampler, same history, one uniform per token, so
    # the output is the autoregressive sample for the same seed, and the RNG ends where AR's ends
    # (also when a stop token cuts a step). Bug guarded: a silent change of the output
    # distribution (e.g. accepting draft tokens the target would not have sampled).
    model, hf, _ = target
    for i in range(10):
        prompt = prompt_ids(hf, 8 + i, seed=300 + i)
        req = GenerationRequest(prompt_ids=prompt, max_tokens=30, sampling=SamplingParams(**params))
        ar_sampler = Sampler(req.sampling)
        ar = run(model, req, sampler=ar_sampler)
        stop = frozenset({ar.token_ids[len(ar.token_ids) // 2]}) if i % 2 else frozenset()
        req = GenerationRequest(prompt_ids=prompt, max_tokens=30, sampling=SamplingParams(**params), stop_ids=stop)
        ar_sampler = Sampler(req.sampling)
        ar = run(model, req, sampler=ar_sampler)
        # the oracle proposes the sampled continuation, so long runs get accepted
        oracle = OracleDrafter(len(prompt), list(ar.token_ids) + [0] * 8, 6, model.n_vocab, seed=i)
        sp_sampler = Sampler(req.sampling)
        sp = run(model, req, sampler=sp_sampler, speculative=SpeculativeDecoder(model, oracle))
        assert sp.token_ids == ar.token_ids and sp.finish_reason == ar.finish_reason
        assert sp_sampler.get_state() == ar_sampler.get_state()
        assert sp.stats.spec["accepted"] > 0


def test_sampled_verify_from_top_k_rows_equals_whole_rows(target, monkeypatch):
    # A model that selects candidates itself (a GPU step: device_topk_max > 0) is asked, for sampling
    # that only the largest logits decide, for the top-k rows of a verify instead of whole rows, and
    # for the last row's top-k in AR decoding. Bug guarded: a k too small for a later row of the
    # block (penalties that grow with the drafts in the history) or candidates sampled differently
    # from the whole row: the output must be the whole-row AR sample for the same seed.
    from daemons.qwen35 import Qwen35Model
    model, hf, _ = target
    params = dict(temperature=1.1, top_k=20, top_p=0.95, repeat_penalty=1.2, repeat_last_n=8, seed=7)
    prompt = prompt_ids(hf, 10, seed=77)
    req = GenerationRequest(prompt_ids=prompt, max_tokens=30, sampling=SamplingParams(**params))
    ar = run(model, req, sampler=Sampler(req.sampling))                 # whole rows (no device top-k)
    monkeypatch.setattr(Qwen35Model, "device_topk_max", property(lambda self: 4096))
    modes = []
    real_verify = Qwen35Model.verify

    def verify(self, *a, **kw):
        modes.append((kw.get("logits"), kw.get("top_k")))
        return real_verify(self, *a, **kw)
    monkeypatch.setattr(Qwen35Model, "verify", verify)
    oracle = OracleDrafter(len(prompt), list(ar.token_ids) + [0] * 8, 6, model.n_vocab, seed=3)
    sp_sampler = Sampler(req.sampling)
    sp = run(model, req, sampler=sp_sampler, speculative=SpeculativeDecoder(model, oracle))
    assert sp.token_ids == ar.token_ids
    assert modes and all(m == "topk" and k > params["top_k"] for m, k in modes), modes
    assert sp.stats.spec["accepted"] > 0


# ---- dynamic draft length -----------------------------------------------------------------------

def test_margin_cut_and_minimum():
    prop = DraftProposal((5, 6, 7, 8, 9), (0.9, 0.6, 0.2, 0.9, 0.9))
    assert cut_proposal(prop, SpecParams(), 5) == [5, 6, 7, 8, 9]
    assert cut_proposal(prop, SpecParams(), 3) == [5, 6, 7]
    assert cut_proposal(prop, SpecParams(draft_margin=0.3), 5) == [5, 6]        # stops before the 0.2
    assert cut_proposal(prop, SpecParams(draft_margin=0.3, draft_min=3), 5) == []  # too short to verify
    assert cut_proposal(prop, SpecParams(draft_margin=0.95), 5) == []
    assert cut_proposal(DraftProposal((1, 2), None), SpecParams(draft_margin=0.5), 5) == [1, 2]


@pytest.mark.parametrize("kw, message", [
    (dict(draft_min=4, draft_max=2), "draft_min 4 exceeds draft_max 2"),
    (dict(draft_max=-1), "draft_max must be an integer >= 0"),
    (dict(draft_margin=1.5), "draft_margin must be a probability margin"),
    (dict(draft_min=True), "draft_min must be an integer"),
])
def test_spec_params_are_validated(kw, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpecParams(**kw)


class ScriptedMarginDrafter(OracleDrafter):
    """The oracle with fixed margins: depth 3 always looks uncertain."""

    def propose(self, n, anchor, max_tokens):
        p = super().propose(n, anchor, max_tokens)
        return DraftProposal(p.tokens, tuple(0.1 if i == 2 else 0.9 for i in range(len(p.tokens))))


def test_margin_cut_limits_verified_drafts(target):
    model, hf, _ = target
    prompt = prompt_ids(hf, 7, seed=21)
    greedy = run(model, GenerationRequest(prompt_ids=prompt, max_tokens=30))
    drafter = ScriptedMarginDrafter(len(prompt), greedy.token_ids, 8, model.n_vocab, corrupt=False)
    spec = SpeculativeDecoder(model, drafter, SpecParams(draft_margin=0.3))
    result = run(model, GenerationRequest(prompt_ids=prompt, max_tokens=30), speculative=spec)
    assert result.token_ids == greedy.token_ids
    assert max(len(c) for _, c in drafter.observed[1:]) == 3              # anchor + 2 drafts per step
    steps = result.stats.spec["steps"]
    assert 2 * (steps - 1) <= result.stats.spec["drafted"] <= 2 * steps   # the last may be budget-limited


def test_draft_max_zero_is_plain_decoding(target):
    model, hf, _ = target
    prompt = prompt_ids(hf, 7, seed=22)
    req = GenerationRequest(prompt_ids=prompt, max_tokens=10)
    oracle = OracleDrafter(len(prompt), [], 8, model.n_vocab)
    r = run(model, req, speculative=SpeculativeDecoder(model, oracle, SpecParams(draft_max=0)))
    assert r.token_ids == run(model, req).token_ids and r.stats.spec is None and oracle.observed == []


def test_cancellation_is_polled_between_steps(target):
    model, hf, _ = target
    prompt = prompt_ids(hf, 7, seed=23)
    greedy = run(model, GenerationRequest(prompt_ids=prompt, max_tokens=30))
    oracle = OracleDrafter(len(prompt), greedy.token_ids, 5, model.n_vocab, corrupt=False)
    polls = []

    def should_stop():
        polls.append(1)
        return len(polls) > 2                  # before the prefill, after the first token, after step 1

    events, end = final_event(model, GenerationRequest(prompt_ids=prompt, max_tokens=30),
                              speculative=SpeculativeDecoder(model, oracle), should_stop=should_stop)
    tokens = [t for e in events for t in e.token_ids]
    assert end.finish_reason == FINISH_CANCELLED
    assert tokens == list(greedy.token_ids[:len(tokens)]) and len(tokens) == 1 + 5   # first + 4 drafts + bonus
    assert end.n_state_tokens == len(prompt) + len(tokens) - 1 == end.state.n_past


def test_context_limit_is_respected(target):
    # Bug guarded: a verify block running past max_ctx (the state would overflow).
    model, hf, _ = target
    prompt = prompt_ids(hf, 10, seed=24)
    greedy = run(model, GenerationRequest(prompt_ids=prompt, max_tokens=40))
    req = GenerationRequest(prompt_ids=prompt, max_tokens=40, max_ctx=len(prompt) + 13)
    ar = run(model, req)
    oracle = OracleDrafter(len(prompt), greedy.token_ids, 9, model.n_vocab, corrupt=False)
    sp = run(model, req, speculative=SpeculativeDecoder(model, oracle))
    assert sp.token_ids == ar.token_ids and sp.finish_reason == ar.finish_reason == FINISH_LENGTH


def test_continuing_a_cached_prefix(target, tmp_path):
    # A worker's prefix cache hands generate a state holding the first n_cached prompt tokens; the
    # draft then has no features for them (its window starts at n_cached) but the output is unchanged.
    model, hf, path = target
    forms = draft_forms(tmp_path, model.hparams, name="cached")
    draft = DFlashDraft.load(forms["dflash"], model)
    prompt = prompt_ids(hf, 20, seed=31)
    req = GenerationRequest(prompt_ids=prompt, max_tokens=16)

    def cached_state():
        s = model.new_state(64)
        model.prefill(prompt[:12], s)
        return s
    ar = run(model, req, state=cached_state(), n_cached=12)
    spec = SpeculativeDecoder(model, DFlashDrafter(draft, context_window=32))
    sp = run(model, req, state=cached_state(), n_cached=12, speculative=spec)
    assert sp.token_ids == ar.token_ids == run(model, req).token_ids
    assert sorted(p for p in spec.drafter.ring.slot_pos.tolist() if p >= 0)[0] == 12


def test_long_prompt_prefill_matches_the_autoregressive_path(target, tmp_path):
    # The speculative prefill streams the prompt in chunks (features are not kept for all of it);
    # the chunks must be the autoregressive prefill's, or the chunked DeltaNet rounds differently.
    from daemons.qwen35 import Qwen35Model
    model, hf, path = target
    assert inspect.signature(Qwen35Model.prefill).parameters["chunk"].default == PREFILL_CHUNK
    forms = draft_forms(tmp_path, model.hparams, name="long")
    draft = DFlashDraft.load(forms["dflash"], model)
    prompt = prompt_ids(hf, PREFILL_CHUNK + 150, seed=41)
    req = GenerationRequest(prompt_ids=prompt, max_tokens=6)
    ar_events, ar_end = final_event(model, req)
    spec = SpeculativeDecoder(model, DFlashDrafter(draft, context_window=64))
    sp_events, sp_end = final_event(model, req, speculative=spec)
    assert [t for e in sp_events for t in e.token_ids] == [t for e in ar_events for t in e.token_ids]
    assert states_equal(sp_end.state, ar_end.state)
    assert spec.drafter.ring.rows_computed <= 64 + 6        # only the window's rows were computed


# ---- real DFlash drafts -----------------------------------------------------------------------------

def test_dflash_drafts_in_every_form_give_the_greedy_tokens(target, tmp_path):
    # (b) of the issue: a real (random) DFlash draft, loaded from each of the three forms, drives
    # speculative decoding to exactly the greedy output, and all forms draft the same tokens.
    model, hf, path = target
    forms = draft_forms(tmp_path, model.hparams, target_gguf=path)
    drafts = {k: DFlashDraft.load(p, model) for k, p in forms.items()}
    for i in range(4):
        prompt = prompt_ids(hf, 10 + 5 * i, seed=500 + i)
        req = GenerationRequest(prompt_ids=prompt, max_tokens=24)
        ar = run(model, req)
        per_form = {}
        for name, draft in drafts.items():
            params = SpecParams(draft_margin=0.05 * i, draft_max=[None, 3, 7, 5][i])
            spec = SpeculativeDecoder(model, DFlashDrafter(draft, context_window=[64, 16, 8, 64][i]), params)
            sp = run(model, req, speculative=spec)
            assert sp.token_ids == ar.token_ids, (name, i)
            per_form[name] = sp.stats.spec
        assert len({str(v) for v in per_form.values()}) == 1          # identical drafting in every form


def test_drafter_layers_must_exist_in_the_target(target):
    model = target[0]

    bad = OracleDrafter(1, [], 4, 10)
    bad.capture_layers = (1, 9)
    with pytest.raises(SpeculativeConfigError, match="reads target layer 9"):
        SpeculativeDecoder(model, bad)
