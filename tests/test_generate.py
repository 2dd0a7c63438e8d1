"""Tests for daemons/generate.py: the generation loop over fake deterministic models."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemons.generate import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationError,
    GenerationRequest,
    StopStringMatcher,
    generate,
    generate_all,
)
from daemons.sampling import Sampler, SamplingParams


# ---- fakes --------------------------------------------------------------------------------------

class FakeState:
    def __init__(self, max_ctx: int) -> None:
        self.max_ctx = max_ctx
        self.tokens: list[int] = []

    def extend(self, ids) -> None:
        self.tokens.extend(int(t) for t in ids)
        if len(self.tokens) > self.max_ctx:
            raise AssertionError(f"state overflow: {len(self.tokens)} > {self.max_ctx}")


class FakeModel:
    """Logits are a deterministic function of every token in the state: ``next_token(tokens)`` gets a
    clear maximum over a fixed, tie-free background."""

    def __init__(self, vocab: int, next_token: Callable[[list[int]], int], *,
                 prefill_sleep: float = 0.0, step_sleep: float = 0.0) -> None:
        self.vocab = vocab
        self.next_token = next_token
        self.prefill_sleep = prefill_sleep
        self.step_sleep = step_sleep
        self.prefill_calls: list[list[int]] = []
        self.forward_calls: list[list[int]] = []

    def new_state(self, max_ctx: int) -> FakeState:
        return FakeState(max_ctx)

    def _logits(self, state: FakeState) -> np.ndarray:
        x = -np.linspace(0.0, 1.0, self.vocab, dtype=np.float32)
        x[self.next_token(state.tokens)] = 10.0
        return x[None, :]

    def prefill(self, ids, state):
        self.prefill_calls.append(list(ids))
        state.extend(ids)
        time.sleep(self.prefill_sleep)
        return self._logits(state)

    def forward(self, ids, state):
        self.forward_calls.append(list(ids))
        state.extend(ids)
        time.sleep(self.step_sleep)
        return self._logits(state)


def scripted(prompt_len: int, script: list[int], filler: int = 0) -> Callable[[list[int]], int]:
    """next token = script[number of tokens generated so far]."""
    return lambda toks: script[len(toks) - prompt_len] if len(toks) - prompt_len < len(script) else filler


class PieceTokenizer:
    """Token id i decodes to pieces[i] (str); the stream decoder returns each piece whole."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


class PieceStreamDecoder:
    def __init__(self, tokenizer: PieceTokenizer) -> None:
        self.tokenizer = tokenizer

    def push(self, token_id: int) -> str:
        return self.tokenizer.pieces[token_id]

    def flush(self) -> str:
        return ""


@pytest.fixture(scope="module")
def real_tokenizer():
    synthetic = pytest.importorskip("daemons.synthetic")
    tokenizer_mod = pytest.importorskip("daemons.tokenizer")
    tokens, types, merges = synthetic.byte_vocab()
    return tokenizer_mod.Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>")})


def run_events(model, tokenizer, request, **kw):
    events = list(generate(model, tokenizer, request, **kw))
    assert events and events[-1].is_final and not any(e.is_final for e in events[:-1])
    return events[:-1], events[-1]


# ---- EOS / length --------------------------------------------------------------------------------

def test_stops_at_eos_without_emitting_it(real_tokenizer):
    # Bugs guarded: decoding the EOS token into the output, reporting it as a content token, or
    # emitting a partial UTF-8 character (the 'ö' is two byte tokens).
    tok = real_tokenizer
    prompt = tok.encode("Hi", add_special=False)
    answer = tok.encode("Hello wörld", add_special=False)
    eos = tok.eos_id
    model = FakeModel(tok.vocab_size, scripted(len(prompt), answer + [eos]))
    req = GenerationRequest(prompt, max_tokens=50, stop_ids=tok.stop_ids)
    token_events, final = run_events(model, tok, req)  # default decoder: daemons.tokenizer.StreamDecoder
    assert [e.token_ids for e in token_events] == [(t,) for t in answer]
    assert "".join(e.text for e in token_events) + final.text == "Hello wörld"
    assert "\ufffd" not in "".join(e.text for e in token_events)
    assert final.finish_reason == FINISH_STOP and final.stop_token == eos and final.stop_string is None
    assert final.stats.generated_tokens == len(answer) + 1
    # The state holds the prompt and every generated token except the last sampled one (EOS).
    assert final.state.tokens == prompt + answer and final.n_state_tokens == len(prompt) + len(answer)


def test_max_tokens_gives_length(real_tokenizer):
    tok = real_tokenizer
    prompt = tok.encode("abc", add_special=False)
    model = FakeModel(tok.vocab_size, lambda toks: 97 + (toks[-1] - 96) % 26)  # a->b->c... successor
    res = generate_all(model, tok, GenerationRequest(prompt, max_tokens=5, stop_ids=tok.stop_ids))
    assert res.finish_reason == FINISH_LENGTH
    assert res.text == "defgh" and len(res.token_ids) == 5
    assert len(model.forward_calls) == 4  # the 5th token's logits are never needed
    assert res.stats.generated_tokens == 5


def test_eos_as_last_allowed_token_is_stop_not_length():
    pieces = ["a", "b", "<eos>"]
    model = FakeModel(3, scripted(1, [0, 1, 2]))
    res = generate_all(model, PieceTokenizer(pieces), GenerationRequest([0], max_tokens=3, stop_ids={2}),
                       decoder_factory=PieceStreamDecoder)
    assert (res.finish_reason, res.text, res.token_ids, res.stop_token) == (FINISH_STOP, "ab", (0, 1), 2)


def test_context_limit_ends_with_length_without_overflowing_the_state():
    model = FakeModel(5, lambda toks: 1)
    req = GenerationRequest([0, 0], max_tokens=100, max_ctx=5)
    res = generate_all(model, PieceTokenizer(list("abcde")), req, decoder_factory=PieceStreamDecoder)
    # 5 positions: 2 prompt + 3 fed tokens; a 4th token is sampled from the last position's logits.
    assert res.finish_reason == FINISH_LENGTH and len(res.token_ids) == 4


# ---- stop strings --------------------------------------------------------------------------------

def test_stop_string_split_across_tokens_is_cut_exactly():
    pieces = ["Hel", "lo", " wo", "rld<", "en", "d>x", "tail", "<eos>"]
    model = FakeModel(len(pieces), scripted(1, [0, 1, 2, 3, 4, 5, 6, 7]))
    req = GenerationRequest([0], max_tokens=50, stop_ids={7}, stop_strings=("<end>",))
    token_events, final = run_events(model, PieceTokenizer(pieces), req, decoder_factory=PieceStreamDecoder)
    texts = [e.text for e in token_events]
    # "<" is held back from the 'rld<' event; nothing after the stop string is produced.
    assert texts == ["Hel", "lo", " wo", "rld", "", ""]
    assert final.text == "" and final.finish_reason == FINISH_STOP and final.stop_string == "<end>"
    assert [e.token_ids[0] for e in token_events] == [0, 1, 2, 3, 4, 5]  # the tokens were committed
    assert len(model.forward_calls) == 5  # generation stopped at the token completing the match


def test_false_start_of_stop_string_is_released():
    pieces = ["a<", "en", "x", "b", "<eos>"]
    model = FakeModel(len(pieces), scripted(1, [0, 1, 2, 3, 4]))
    req = GenerationRequest([3], max_tokens=50, stop_ids={4}, stop_strings=("<end>",))
    token_events, final = run_events(model, PieceTokenizer(pieces), req, decoder_factory=PieceStreamDecoder)
    assert [e.text for e in token_events] == ["a", "", "<enx", "b"]
    assert final.finish_reason == FINISH_STOP and final.stop_token == 4


def test_held_back_text_is_released_at_length():
    pieces = ["x", "<e"]
    model = FakeModel(2, scripted(1, [0, 1]))
    req = GenerationRequest([0], max_tokens=2, stop_strings=("<end>",))
    token_events, final = run_events(model, PieceTokenizer(pieces), req, decoder_factory=PieceStreamDecoder)
    assert [e.text for e in token_events] == ["x", ""] and final.text == "<e"
    assert final.finish_reason == FINISH_LENGTH


def test_stop_string_spanning_multibyte_tokens(real_tokenizer):
    tok = real_tokenizer
    answer = tok.encode("naïve café ends", add_special=False)
    model = FakeModel(tok.vocab_size, scripted(1, answer, filler=tok.eos_id))
    req = GenerationRequest([answer[0]], max_tokens=40, stop_ids=tok.stop_ids, stop_strings=("é e",))
    res = generate_all(model, tok, req)
    assert res.text == "naïve caf" and res.stop_string == "é e"


ALPHABET = "ab<>é"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.text(ALPHABET, min_size=0, max_size=4), min_size=1, max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_never_partially_emitted(pieces, stops):
    # Bugs guarded: emitting the first characters of a stop string before the rest arrives, cutting
    # at a later match instead of the earliest, or holding text back after it can no longer match.
    eos = len(pieces)
    vocab = pieces + ["<EOS>"]
    model = FakeModel(len(vocab), scripted(1, list(range(len(pieces))) + [eos]))
    req = GenerationRequest([0], max_tokens=100, stop_ids={eos}, stop_strings=tuple(stops))
    # Reference, by definition: generation stops at the first token after which the text holds a stop
    # string, and the output is cut at the earliest such occurrence (like llama-server).
    expected, stop_step, text = "".join(pieces), None, ""
    for i, piece in enumerate(pieces):
        text += piece
        found = [text.find(s) for s in stops if s in text]
        if found:
            expected, stop_step = text[: min(found)], i
            break
    emitted, seen = "", ""
    for ev in generate(model, PieceTokenizer(vocab), req, decoder_factory=PieceStreamDecoder):
        emitted += ev.text
        assert expected.startswith(emitted)  # never emits anything it would have to take back
        if ev.is_final:
            break
        seen += vocab[ev.token_ids[0]]
        if stop_step is None or len(ev.token_ids) and ev.token_ids[0] < stop_step:
            # Held-back text must be a proper prefix of some stop string (no needless holding).
            held = seen[len(emitted):]
            assert held == "" or any(s.startswith(held) and s != held for s in stops)
    assert emitted == expected
    assert ev.finish_reason == FINISH_STOP
    assert (ev.stop_string is not None) == (stop_step is not None)
    if stop_step is not None:
        assert len(model.forward_calls) == stop_step  # no step after the completing token


def test_stop_string_matcher_earliest_match_wins():
    m = StopStringMatcher(["cd", "bcdx", "b"])
    assert m.push("a") == ("a", None)
    assert m.push("xcdb") == ("x", "cd")  # "cd" at 1 comes before "b" at 3
    m2 = StopStringMatcher(["xyz", "yq"])
    assert m2.push("axy") == ("a", None)  # "xy" could start "xyz"
    assert m2.push("q") == ("x", "yq")


# ---- cancellation --------------------------------------------------------------------------------

def test_cancellation_stops_within_one_step():
    model = FakeModel(4, lambda toks: 1)
    cancelled = {"flag": False}
    req = GenerationRequest([0], max_tokens=100)
    gen = generate(model, PieceTokenizer(list("abcd")), req, should_stop=lambda: cancelled["flag"],
                   decoder_factory=PieceStreamDecoder)
    token_events = []
    for ev in gen:
        if ev.is_final:
            break
        token_events.append(ev)
        if len(token_events) == 3:
            cancelled["flag"] = True
    assert len(token_events) == 3 and ev.finish_reason == FINISH_CANCELLED
    assert len(model.forward_calls) == 2  # no model step after the flag was raised
    assert ev.stats.generated_tokens == 3


def test_cancel_before_prefill_runs_no_model_work():
    model = FakeModel(4, lambda toks: 1)
    res = generate_all(model, PieceTokenizer(list("abcd")), GenerationRequest([0, 1], max_tokens=5),
                       should_stop=lambda: True, decoder_factory=PieceStreamDecoder)
    assert res.finish_reason == FINISH_CANCELLED and res.token_ids == () and res.text == ""
    assert model.prefill_calls == [] and res.stats.generated_tokens == 0


# ---- stats ---------------------------------------------------------------------------------------

def test_stats_fields_present_and_sane():
    model = FakeModel(8, lambda toks: 3, prefill_sleep=0.03, step_sleep=0.01)
    prompt = [1, 2, 3, 4, 5, 6]
    res = generate_all(model, PieceTokenizer(list("abcdefgh")), GenerationRequest(prompt, max_tokens=6),
                       decoder_factory=PieceStreamDecoder)
    s = res.stats
    assert (s.prompt_tokens, s.cached_tokens, s.generated_tokens) == (6, 0, 6)
    assert s.prefill_s >= 0.03 and s.prefill_tok_s == pytest.approx(6 / s.prefill_s)
    assert s.decode_s >= 5 * 0.01 and 0 < s.decode_tok_s <= 5 / (5 * 0.01) + 1e-9
    assert s.decode_tok_s == pytest.approx(5 / s.decode_s)
    assert s.prefill_s <= s.ttft_s <= s.total_s and s.ttft_s + s.decode_s <= s.total_s + 1e-9
    assert s.total_s < 2.0
    t = s.to_llama_timings()
    assert t["prompt_n"] == 6 and t["predicted_n"] == 6 and t["predicted_per_second"] == s.decode_tok_s


# ---- sampling through the loop -------------------------------------------------------------------

def test_penalty_history_includes_the_prompt():
    # Bug guarded: penalties computed over generated tokens only (llama-server feeds the prompt too).
    class Fixed(FakeModel):
        def _logits(self, state):
            x = np.zeros(self.vocab, dtype=np.float32)
            x[3], x[4] = 5.0, 4.9
            return x[None, :]

    tk = PieceTokenizer(list("abcde"))
    plain = generate_all(Fixed(5, None), tk, GenerationRequest([3], max_tokens=1),
                         decoder_factory=PieceStreamDecoder)
    penal = generate_all(Fixed(5, None), tk, GenerationRequest(
        [3], max_tokens=1, sampling=SamplingParams(repeat_penalty=1.5)), decoder_factory=PieceStreamDecoder)
    assert plain.token_ids == (3,) and penal.token_ids == (4,)


def test_penalty_history_includes_generated_tokens():
    # Bug guarded: the sampler's history not growing with the committed tokens.
    class Fixed(FakeModel):
        def _logits(self, state):
            x = np.zeros(self.vocab, dtype=np.float32)
            x[2], x[3], x[4] = 4.8, 5.0, 4.9
            return x[None, :]

    res = generate_all(Fixed(5, None), PieceTokenizer(list("abcde")), GenerationRequest(
        [0], max_tokens=3, sampling=SamplingParams(repeat_penalty=1.5)), decoder_factory=PieceStreamDecoder)
    assert res.token_ids == (3, 4, 2)


def test_seeded_sampling_reproducible_and_sampler_continuation():
    class Flat(FakeModel):
        def _logits(self, state):
            return np.linspace(0, 1, self.vocab, dtype=np.float32)[None, :]

    tk = PieceTokenizer([chr(97 + i) for i in range(16)])
    params = SamplingParams(temperature=1.0, seed=77)
    req = GenerationRequest([0], max_tokens=30, sampling=params)
    a = generate_all(Flat(16, None), tk, req, decoder_factory=PieceStreamDecoder)
    b = generate_all(Flat(16, None), tk, req, decoder_factory=PieceStreamDecoder)
    assert a.token_ids == b.token_ids and len(set(a.token_ids)) > 3
    # A sampler handed in continues from its RNG position (worker snapshot restore).
    s = Sampler(params)
    first = generate_all(Flat(16, None), tk, GenerationRequest([0], max_tokens=10, sampling=params),
                         sampler=s, decoder_factory=PieceStreamDecoder)
    rest = generate_all(Flat(16, None), tk, GenerationRequest([0], max_tokens=20, sampling=params),
                        sampler=s, decoder_factory=PieceStreamDecoder)
    assert first.token_ids + rest.token_ids == a.token_ids


def test_cached_prefix_prefills_only_the_rest():
    prompt = [1, 2, 3, 4, 5]
    succ = lambda toks: (sum(toks) * 7) % 11  # depends on the whole state, so a wrong prefix shows
    tk = PieceTokenizer([chr(97 + i) for i in range(11)])
    ref = generate_all(FakeModel(11, succ), tk, GenerationRequest(prompt, max_tokens=6),
                       decoder_factory=PieceStreamDecoder)
    model = FakeModel(11, succ)
    state = model.new_state(32)
    model.prefill(prompt[:3], state)
    res = generate_all(model, tk, GenerationRequest(prompt, max_tokens=6), state, n_cached=3,
                       decoder_factory=PieceStreamDecoder)
    assert model.prefill_calls[-1] == [4, 5]
    assert res.token_ids == ref.token_ids and res.stats.cached_tokens == 3


# ---- request validation --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"prompt_ids": [], "max_tokens": 3}, "empty"),
    ({"prompt_ids": [1], "max_tokens": 0}, "max_tokens"),
    ({"prompt_ids": [1], "max_tokens": 2, "stop_strings": ("",)}, "stop"),
    ({"prompt_ids": [1, 2], "max_tokens": 2, "max_ctx": 2}, "max_ctx"),
])
def test_invalid_requests_raise(kwargs, match):
    with pytest.raises(GenerationError, match=match):
        GenerationRequest(**kwargs)


def test_invalid_n_cached_raises():
    model = FakeModel(4, lambda toks: 1)
    req = GenerationRequest([0, 1], max_tokens=2)
    with pytest.raises(GenerationError, match="n_cached"):
        list(generate(model, PieceTokenizer(list("abcd")), req, model.new_state(8), n_cached=2,
                      decoder_factory=PieceStreamDecoder))
