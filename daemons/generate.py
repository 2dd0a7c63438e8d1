"""Architecture-independent autoregressive generation loop.

Works over any model with this API (the qwen35 model follows it):

    state  = model.new_state(max_ctx)
    logits = model.prefill(token_ids, state)   # float32 [1, V]: logits of the last prompt position
    logits = model.forward(token_ids, state)   # float32 [1, V]; advances the state by the tokens

and a tokenizer with ``decode(ids)``; text is streamed through a ``StreamDecoder(tokenizer)`` (``push(id)
-> str``, ``flush() -> str``) from ``daemons.tokenizer`` unless the caller passes ``decoder_factory``.

``generate`` yields one ``GenerationEvent`` per committed token, then a final event carrying
``finish_reason`` and ``GenerationStats``.  Conventions (the OpenAI / llama-server ones):

* A token in ``stop_ids`` (EOS/EOT) ends generation with ``finish_reason="stop"``; it is not decoded
  into text and not reported in ``token_ids``; the final event names it in ``stop_token``.
* A stop string ends generation with ``"stop"``; the emitted text ends just before the earliest match.
  Text that could still become the start of a stop string is held back until it cannot, so no event
  ever carries part of a stop string.  Token ids are reported when committed (they are in the model
  state), so the tokens that produced a stop string do appear in ``token_ids``.
* ``max_tokens`` sampled tokens (stop token included) or a full context ends with ``"length"``.
* ``should_stop()`` returning true before a model step ends with ``"cancelled"``; held-back text is
  then flushed (no stop string completed, so it is ordinary output).

The model state after the loop holds the prompt and every committed token except the last one
sampled (its logits were never needed); the final event reports ``state`` and ``n_state_tokens``
so a caller can keep it (prefix caching) or feed the last token itself.

Speculative decoding plugs in through one argument, ``speculative`` (a
``daemons.speculative.SpeculativeDecoder``): each model step then yields several sampled tokens (the
accepted draft tokens and the bonus), which go through exactly the per-token handling above, in order;
the step's tokens are reported in one event. When generation ends in the middle of a step (stop token,
stop string), the state and the sampler's RNG are cut back to what autoregressive decoding would hold,
so the final event, the state and the RNG position are the same as without speculation. The final
stats then carry ``spec`` (drafted, accepted, accepted_per_position, steps, acceptance_length).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from daemons.sampling import Sampler, SamplingParams

__all__ = [
    "GenerationError",
    "GenerationRequest",
    "GenerationStats",
    "GenerationEvent",
    "GenerationResult",
    "StopStringMatcher",
    "generate",
    "generate_all",
    "FINISH_STOP",
    "FINISH_LENGTH",
    "FINISH_CANCELLED",
]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"


class GenerationError(ValueError):
    """A malformed generation request (empty prompt, bad max_tokens, empty stop string, ...)."""


class _StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    # Context size for a state created by generate(); None = len(prompt) + max_tokens.  Generation
    # ends with "length" when the state would need more.
    max_ctx: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "stop_ids", frozenset(int(t) for t in self.stop_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if len(self.prompt_ids) == 0:
            raise GenerationError("the prompt is empty: at least one token is needed to predict the next")
        if any(t < 0 for t in self.prompt_ids):
            raise GenerationError("prompt token ids must be >= 0")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)) \
                or self.max_tokens < 1:
            raise GenerationError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise GenerationError("sampling must be a SamplingParams")
        for s in self.stop_strings:
            if not isinstance(s, str) or s == "":
                raise GenerationError(f"stop strings must be non-empty strings, got {s!r}")
        if self.max_ctx is not None and self.max_ctx <= len(self.prompt_ids):
            raise GenerationError(
                f"max_ctx {self.max_ctx} leaves no room after the {len(self.prompt_ids)}-token prompt")


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int  # tokens in the prompt
    cached_tokens: int  # prompt tokens already in the supplied state (not prefilled)
    generated_tokens: int  # sampled tokens, a final stop token included (llama.cpp's n_decoded)
    prefill_s: float  # time in model.prefill
    prefill_tok_s: float  # prefilled tokens / prefill_s
    decode_s: float  # from the first sampled token to the last one (model steps + sampling)
    decode_tok_s: float  # tokens sampled after the first / decode_s (0 when only one token)
    ttft_s: float  # time to first token: from the call to the first sampled token
    total_s: float
    # speculative decoding counters (SpecStats.to_dict()), None for autoregressive decoding
    spec: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The timing figures (``spec`` is reported separately)."""
        return {k: v for k, v in self.__dict__.items() if k != "spec"}

    def to_llama_timings(self) -> dict[str, float | int]:
        """The same figures under llama-server's ``timings`` names."""
        prefilled = self.prompt_tokens - self.cached_tokens
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": prefilled,
            "prompt_ms": self.prefill_s * 1e3,
            "prompt_per_token_ms": self.prefill_s * 1e3 / prefilled if prefilled else 0.0,
            "prompt_per_second": self.prefill_tok_s,
            "predicted_n": self.generated_tokens,
            "predicted_ms": self.decode_s * 1e3,
            "predicted_per_token_ms": (self.decode_s * 1e3 / (self.generated_tokens - 1)
                                       if self.generated_tokens > 1 else 0.0),
            "predicted_per_second": self.decode_tok_s,
        }


@dataclass(frozen=True)
class GenerationEvent:
    token_ids: tuple[int, ...]  # newly committed tokens
    text: str  # text now safe to emit
    finish_reason: str | None = None  # set on the final event only
    stats: GenerationStats | None = None  # final event only
    stop_token: int | None = None  # final event: the stop id that ended generation
    stop_string: str | None = None  # final event: the stop string that ended generation
    state: Any = None  # final event: the model state
    n_state_tokens: int = 0  # final event: tokens held by `state`

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    stats: GenerationStats
    stop_token: int | None = None
    stop_string: str | None = None


class StopStringMatcher:
    """Holds back streamed text until it can no longer be the start of a stop string.

    Invariant: every suffix of the text seen so far that is a proper prefix of a stop string lies in the
    held-back part, so a match can only start inside it and emitted text never contains any part of one.
    Generation stops at the first push after which the text holds a stop string; if several are present
    then, the earliest occurrence wins (llama-server's rule; which one completes first can depend on
    where the token boundaries fall).
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self.stop_strings = tuple(stop_strings)
        self._pending = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, the stop string matched or None).

        After a match, the returned text is everything before the earliest match, and the matcher is
        done (further pushes are a caller error)."""
        pending = self._pending + text
        if not self.stop_strings:
            self._pending = ""
            return pending, None
        best_pos, best = -1, None
        for s in self.stop_strings:
            pos = pending.find(s)
            if pos != -1 and (best_pos == -1 or pos < best_pos):
                best_pos, best = pos, s
        if best is not None:
            self._pending = ""
            return pending[:best_pos], best
        hold = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:n]):
                    hold = n
                    break
        cut = len(pending) - hold
        self._pending = pending[cut:]
        return pending[:cut], None

    def flush(self) -> str:
        """No more text will come: release what was held back."""
        out, self._pending = self._pending, ""
        return out


def _default_decoder_factory(tokenizer: Any) -> _StreamDecoder:
    from daemons.tokenizer import StreamDecoder

    return StreamDecoder(tokenizer)


def _sample_next(model: Any, state: Any, token: int, sampler: Sampler, history: Sequence[int]) -> int:
    """Forward one token and sample the next. Where the model selects candidates on the device (a
    GPU step) and the sampling settings need only the largest few logits (top_k on, penalties that
    only lower logits: Sampler.candidates_needed), only those cross to the host; the token is the
    one `sample` over the whole row gives."""
    vocab = int(getattr(model, "n_vocab", 0) or 0)
    k_max = int(getattr(model, "device_topk_max", 0) or 0)
    k = sampler.candidates_needed(history, vocab) if k_max and vocab else 0
    if 0 < k <= k_max:
        out = model.forward([token], state, logits="topk_last", top_k=k)
        if isinstance(out, tuple):
            ids, vals = out
            return sampler.sample_candidates(ids, vals, vocab, history)
        return sampler.sample(_last_logits(out), history)      # a NaN / +inf row: the sampler says so
    return sampler.sample(_last_logits(model.forward([token], state)), history)


def _last_logits(out: Any) -> np.ndarray:
    arr = np.asarray(out)
    if arr.ndim == 0:
        raise GenerationError("the model returned a scalar instead of logits")
    return arr.reshape(-1, arr.shape[-1])[-1]


def generate(
    model: Any,
    tokenizer: Any,
    request: GenerationRequest,
    state: Any = None,
    *,
    n_cached: int = 0,
    should_stop: Callable[[], bool] | None = None,
    sampler: Sampler | None = None,
    decoder_factory: Callable[[Any], _StreamDecoder] | None = None,
    speculative: Any = None,
) -> Iterator[GenerationEvent]:
    """Generate from ``request`` and stream events (see the module docstring for the conventions).

    ``state``: a model state to continue; its first ``n_cached`` tokens must equal the prompt's first
    ``n_cached`` (the caller's prefix cache guarantees it) and only the rest of the prompt is prefilled.
    At least one prompt token must remain to be prefilled, since its logits give the first token.
    ``None`` creates ``model.new_state(max_ctx)``.
    ``sampler``: to continue an RNG position (worker snapshots); default ``Sampler(request.sampling)``.
    ``should_stop``: polled before the prefill and before every decode step.
    ``speculative``: a ``daemons.speculative.SpeculativeDecoder`` over this model (None, or one with
    draft_max = 0: autoregressive decoding).
    """
    t_start = time.perf_counter()
    prompt = request.prompt_ids
    if not 0 <= n_cached < len(prompt):
        raise GenerationError(
            f"n_cached={n_cached} must be in [0, {len(prompt)}): the last prompt token must be prefilled")
    if state is None:
        if n_cached:
            raise GenerationError("n_cached > 0 needs the state holding those tokens")
        max_ctx = request.max_ctx if request.max_ctx is not None else len(prompt) + request.max_tokens
        state = model.new_state(max_ctx)
    else:
        max_ctx = request.max_ctx  # None: the model enforces its own capacity
    if sampler is None:
        sampler = Sampler(request.sampling)
    if speculative is not None and not speculative.active:
        speculative = None
    decoder = (decoder_factory or _default_decoder_factory)(tokenizer)
    matcher = StopStringMatcher(request.stop_strings)

    history: list[int] = list(prompt)
    n_state = n_cached
    generated = 0
    prefill_s = 0.0
    t_first: float | None = None

    def finish(reason: str, *, stop_token: int | None = None, stop_string: str | None = None,
               tail: str = "") -> GenerationEvent:
        t_end = time.perf_counter()
        prefilled = len(prompt) - n_cached
        decode_s = (t_end - t_first) if t_first is not None else 0.0
        stats = GenerationStats(
            prompt_tokens=len(prompt),
            cached_tokens=n_cached,
            generated_tokens=generated,
            prefill_s=prefill_s,
            prefill_tok_s=prefilled / prefill_s if prefill_s > 0 else 0.0,
            decode_s=decode_s,
            decode_tok_s=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            ttft_s=(t_first - t_start) if t_first is not None else 0.0,
            total_s=t_end - t_start,
            spec=speculative.stats.to_dict() if speculative is not None else None,
        )
        return GenerationEvent(token_ids=(), text=tail, finish_reason=reason, stats=stats,
                               stop_token=stop_token, stop_string=stop_string,
                               state=state, n_state_tokens=n_state)

    def flush_text() -> tuple[str, str | None]:
        """Decoder and matcher tails at the end of the stream."""
        text, hit = matcher.push(decoder.flush())
        if hit is not None:
            return text, hit
        return text + matcher.flush(), None

    if should_stop is not None and should_stop():
        yield finish(FINISH_CANCELLED)
        return

    t0 = time.perf_counter()
    rest = list(prompt[n_cached:])
    if speculative is not None:
        logits = _last_logits(speculative.prefill(rest, state, n_cached))
    else:
        logits = _last_logits(model.prefill(rest, state))
    prefill_s = time.perf_counter() - t0
    n_state = len(prompt)

    # `tokens`: what the last model step sampled (one token, or a speculative step's accepted drafts
    # and bonus). Token j of a step is handled exactly as autoregressive decoding handles it, with the
    # state then holding `n_state` = the step's base + j tokens.
    tokens = [sampler.sample(logits, history)]
    greedy_ids = sampler.params.is_greedy and getattr(model, "gpu_step", None) is not None
    # Greedy on a GPU step: the host one step behind the device (daemons/qwen35_gpu.py GreedyChain).
    # The step it queues ahead is undone by close(), which runs before the state is handed on (the
    # end event carries it) and on any other way out of this generator.
    chain = None
    try:
        while True:
            ids: list[int] = []
            texts: list[str] = []
            for j, token in enumerate(tokens):
                if j:
                    n_state += 1
                generated += 1
                if t_first is None:
                    t_first = time.perf_counter()
                end: GenerationEvent | None = None

                if token in request.stop_ids:
                    text, hit = flush_text()
                    end = finish(FINISH_STOP, stop_token=token, stop_string=hit, tail=text)
                else:
                    history.append(token)
                    text, hit = matcher.push(decoder.push(token))
                    ids.append(token)
                    texts.append(text)
                    if hit is not None:
                        end = finish(FINISH_STOP, stop_string=hit)
                    elif generated >= request.max_tokens or (max_ctx is not None and n_state + 1 > max_ctx):
                        text, hit = flush_text()
                        end = finish(FINISH_STOP if hit is not None else FINISH_LENGTH, stop_string=hit, tail=text)
                if end is not None:
                    if chain is not None:
                        chain.close()
                    if speculative is not None and j + 1 < len(tokens):
                        speculative.truncate(state, sampler, j + 1)
                    if ids:
                        yield GenerationEvent(token_ids=tuple(ids), text="".join(texts))
                    yield end
                    return
            yield GenerationEvent(token_ids=tuple(ids), text="".join(texts))

            if should_stop is not None and should_stop():
                if chain is not None:
                    chain.close()
                text, hit = flush_text()
                yield finish(FINISH_STOP if hit is not None else FINISH_CANCELLED, stop_string=hit, tail=text)
                return

            if speculative is not None:
                base = n_state
                tokens = speculative.step(state, tokens[-1], sampler, history, request.max_tokens - generated, max_ctx)
                n_state = base + 1
            elif greedy_ids:
                # greedy: the model's own argmax (on a GPU only the id crosses to the host), the step
                # after it queued first unless the token returned now is the last one wanted
                if chain is None:
                    chain = model.gpu_step.greedy_chain(state)
                ahead = generated + 1 < request.max_tokens and (max_ctx is None or n_state + 2 <= max_ctx)
                tokens = [chain.next(tokens[-1], ahead=ahead)]
                n_state += 1
            else:
                tokens = [_sample_next(model, state, tokens[-1], sampler, history)]
                n_state += 1
    finally:
        if chain is not None:
            chain.close()


def generate_all(model: Any, tokenizer: Any, request: GenerationRequest, state: Any = None,
                 **kwargs: Any) -> GenerationResult:
    """Run ``generate`` to completion and collect the tokens and text."""
    ids: list[int] = []
    parts: list[str] = []
    for ev in generate(model, tokenizer, request, state, **kwargs):
        ids.extend(ev.token_ids)
        parts.append(ev.text)
        if ev.is_final:
            assert ev.stats is not None and ev.finish_reason is not None
            return GenerationResult(token_ids=tuple(ids), text="".join(parts),
                                    finish_reason=ev.finish_reason, stats=ev.stats,
                                    stop_token=ev.stop_token, stop_string=ev.stop_string)
    raise RuntimeError("generate() ended without a final event")  # a bug in generate itself
