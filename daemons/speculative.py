"""Speculative decoding, chain form: draft a block, verify it in one target forward, keep the longest
accepted prefix plus one target token, roll the target state back to exactly that.

Math: ../shared/design/qwen35-dflash-ddtree-math.md §6 and §8. One step, with n tokens in the target
state and ℓ the pending token (sampled, not yet fed):

1. The drafter proposes d_1..d_k for positions n+1..n+k (`Drafter.propose`); `SpecParams` limits k
   (`draft_max`), cuts the chain before the first token whose draft top-1 − top-2 probability margin
   is below `draft_margin` (dynamic length; the seed notes measured this at +31% on code and +61% on
   prose, Test 13/17), and drops a chain shorter than `draft_min` (llama.cpp's n_min: too short to be
   worth a verify; such a step is a plain one-token step).
2. `model.verify([ℓ, d_1..d_k])` runs the block at positions n..n+k in one forward, capturing the
   drafter's target layers, with every row bit-identical to a one-token decode step (see
   `daemons.qwen35.Qwen35Model.verify`).
3. Acceptance walks the block with the request's own sampler: s_i = sample(logits_i, history + s_0..s_{i-1});
   while s_i = d_{i+1} the draft token is accepted, and the first s_i that differs (or s_k) is the
   bonus. So a step yields a+1 tokens s_0..s_a (a = accepted drafts) and commits ℓ, d_1..d_a to the
   target; s_a becomes the next pending token.
4. `model.rollback(state, record, a+1)` cuts the target state to n+a+1 tokens from the per-token float32
   checkpoints the verify stored, and the drafter gets the features of the committed positions.

**Rollback: per-token float32 checkpoints, not snapshot-and-replay.** The verify keeps, per DeltaNet
layer, the state after every block token ([T, H_v, d_v, d_k] float32: T times one layer's state, e.g.
~2.4 GB per 16-token block on the 27B: 48 DeltaNet layers x 3 MB x 16) and the conv inputs; rollback copies one
checkpoint and three conv rows per layer. It costs no second forward (replay would re-run a+1 tokens
on every partially accepted step) and is exact: the rolled-back state is bit-for-bit the state
autoregressive decoding of the same tokens reaches (tested), because the verify runs the same
token-by-token recurrence. KV rows past the kept prefix are never read (causal attention) and are
overwritten by the next block.

**Sampling (T > 0) is exact target sampling**, not rejection sampling: step 3 draws each token from the
target's own distribution at its position with the same sampler, the same history and the same RNG
draws (one uniform per token, none past the bonus) as autoregressive decoding, on bit-identical
logits. Speculative output is therefore token-for-token the autoregressive output for the same seed,
greedy or not, penalties included; the draft only changes how many tokens one forward yields. (The
draft proposes its argmax; at T > 0 a mismatch is simply more likely than under Leviathan rejection
sampling, which would need the draft's probabilities and would not reproduce AR's exact samples.)

Stats (`SpecStats`, llama.cpp's vocabulary): `drafted` tokens verified, `accepted` of those,
`accepted_per_position[i]` = steps whose draft token at depth i+1 was accepted, `steps` = verify steps
(steps that verified at least one draft token), `acceptance_length` = tokens committed per verify
step including the bonus = (accepted + steps) / steps. They count what the verifies decided, also for
tokens of a last step that a stop string or stop token then discarded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from daemons.dflash import DraftProposal
from daemons.generate import GenerationError
from kernels.matmul import FUSED_MAX_T

__all__ = ["SpeculativeConfigError", "SpecParams", "SpecStats", "Drafter", "DraftProposal", "SpeculativeDecoder",
           "OracleDrafter", "cut_proposal", "MAX_VERIFY_TOKENS", "PREFILL_CHUNK"]


# The widest verify block: the CPU matmul is batch-invariant (row results independent of the other
# rows) up to kernels.matmul.FUSED_MAX_T rows, which the bit-exactness of verify relies on.
MAX_VERIFY_TOKENS = FUSED_MAX_T
# Prompt chunk of the speculative prefill: Qwen35Model.prefill's default chunk, so that the prompt is
# processed in the same pieces (hence to the same bits) as on the autoregressive path.
PREFILL_CHUNK = 512


class SpeculativeConfigError(GenerationError):
    """Bad speculative-decoding settings (draft_min > draft_max, negative margin, a drafter that needs
    target layers the model does not have)."""


@dataclass(frozen=True)
class SpecParams:
    """Per-request speculative settings (protocol `SpeculativeOptions`).

    draft_max: most draft tokens per step; None = the drafter's block size − 1; 0 = plain
      autoregressive decoding.
    draft_min: a chain shorter than this after the margin cut is not verified (0 or 1: every chain is).
    draft_margin: cut the chain before the first token whose draft top-1 − top-2 probability is below
      this (0 = off: static length)."""

    draft_max: int | None = None
    draft_min: int = 0
    draft_margin: float = 0.0

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        if self.draft_max is not None and (not is_int(self.draft_max) or self.draft_max < 0):
            raise SpeculativeConfigError(f"draft_max must be an integer >= 0 (0 = no speculation), got {self.draft_max!r}")
        if not is_int(self.draft_min) or self.draft_min < 0:
            raise SpeculativeConfigError(f"draft_min must be an integer >= 0, got {self.draft_min!r}")
        if self.draft_max is not None and self.draft_min > self.draft_max:
            raise SpeculativeConfigError(f"draft_min {self.draft_min} exceeds draft_max {self.draft_max}")
        if isinstance(self.draft_margin, bool) or not isinstance(self.draft_margin, (int, float, np.floating)) \
                or not math.isfinite(float(self.draft_margin)) or not 0.0 <= float(self.draft_margin) <= 1.0:
            raise SpeculativeConfigError(f"draft_margin must be a probability margin in [0, 1] (0 = off), "
                                         f"got {self.draft_margin!r}")


@dataclass
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def record(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted == 0:
            return
        self.steps += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        for lst, n in ((self.drafted_per_position, n_drafted), (self.accepted_per_position, n_accepted)):
            if len(lst) < n_drafted:
                lst.extend([0] * (n_drafted - len(lst)))
            for i in range(n):
                lst[i] += 1

    def to_dict(self) -> dict[str, Any]:
        """The protocol's / CLI's `spec` object."""
        per_pos = list(self.accepted_per_position)
        while per_pos and per_pos[-1] == 0:
            per_pos.pop()
        return {"drafted": self.drafted, "accepted": self.accepted, "accepted_per_position": per_pos,
                "steps": self.steps, "acceptance_length": self.acceptance_length}


class Drafter(Protocol):
    """What the loop needs from a draft (`daemons.dflash.DFlashDrafter`, `OracleDrafter`)."""

    capture_layers: Sequence[int]      # target layers whose outputs `observe` wants (may be empty)
    max_draft: int                     # most tokens one proposal can hold

    def start(self, n_cached: int) -> None:
        """A new sequence whose first n_cached positions are already in the target state."""

    def observe(self, start: int, token_ids: Sequence[int], features: Any) -> None:
        """Positions start..start+len-1 (these tokens) are committed; features [len, Σ widths] are their
        captured layer outputs concatenated in capture_layers order (None if none captured)."""

    def propose(self, n: int, anchor: int, max_tokens: int) -> DraftProposal:
        """Tokens for positions n+1.. after the pending token `anchor` at position n (at most max_tokens)."""


def cut_proposal(proposal: DraftProposal, params: SpecParams, limit: int) -> list[int]:
    """The chain to verify: at most `limit` tokens, cut before the first margin below draft_margin,
    dropped entirely when shorter than draft_min."""
    tokens = list(proposal.tokens[:max(0, limit)])
    if params.draft_margin > 0 and proposal.margins is not None:
        for i, m in enumerate(proposal.margins[:len(tokens)]):
            if m < params.draft_margin:
                tokens = tokens[:i]
                break
    return tokens if len(tokens) >= params.draft_min else []


class SpeculativeDecoder:
    """Speculative decoding of one sequence over `model` (qwen35: `prefill`, `verify`, `rollback`) with
    `drafter`. `daemons.generate.generate(..., speculative=this)` drives it; `stats` counts per request."""

    def __init__(self, model: Any, drafter: Drafter, params: SpecParams | None = None):
        self.model, self.drafter = model, drafter
        self.params = params if params is not None else SpecParams()
        n_layer = model.hparams.n_layer
        bad = [i for i in drafter.capture_layers if not 0 <= int(i) < n_layer]
        if bad:
            raise SpeculativeConfigError(f"the draft reads target layer {bad[0]}, the target has layers 0..{n_layer - 1}")
        self.capture_layers = tuple(int(i) for i in drafter.capture_layers)
        self.stats = SpecStats()
        self._record: Any = None          # the last step's verify record (for truncate)
        self._buffers: Any = None         # a verify record whose checkpoint buffers may be reused
        self._rng_after: list[Any] = []

    @property
    def active(self) -> bool:
        """False when draft_max = 0 (the caller then decodes autoregressively)."""
        return self.params.draft_max != 0 and self.drafter.max_draft > 0

    def _features(self, captured: dict[int, np.ndarray], rows: int) -> np.ndarray | None:
        if not self.capture_layers:
            return None
        return np.concatenate([captured[il][:rows] for il in self.capture_layers], axis=1)

    def prefill(self, token_ids: Sequence[int], state: Any, n_cached: int = 0) -> np.ndarray:
        """Prefill the prompt tokens after the first n_cached (already in `state`), capturing the
        drafter's features; returns the last position's logits [1, V]. Resets the stats."""
        self.stats = SpecStats()
        self._record = None
        self.drafter.start(n_cached)
        ids = list(token_ids)
        if not self.capture_layers:
            start = state.n_past
            logits = self.model.prefill(ids, state)
            self.drafter.observe(start, ids, None)
            return logits
        # Chunk by chunk, so a long prompt's features never exist all at once (the drafter keeps the
        # last context_window positions). The chunks are the ones `prefill` itself uses, so the
        # state is bit-identical to the autoregressive path's.
        logits = None
        for c0 in range(0, len(ids), PREFILL_CHUNK):
            part = ids[c0:c0 + PREFILL_CHUNK]
            last = c0 + PREFILL_CHUNK >= len(ids)
            start = state.n_past
            logits, captured = self.model.prefill(part, state, chunk=PREFILL_CHUNK, logits="last" if last else "none",
                                                  capture_layers=self.capture_layers)
            self.drafter.observe(start, part, self._features(captured, len(part)))
        return logits

    def step(self, state: Any, anchor: int, sampler: Any, history: Sequence[int], max_new: int,
             max_ctx: int | None = None) -> list[int]:
        """One draft + verify step from the pending token `anchor` (already in `history`, not yet in
        the state). Returns the a+1 sampled tokens s_0..s_a (s_i = d_{i+1} for i < a, s_a the bonus);
        afterwards the state holds n + a + 1 tokens. At most `max_new` tokens are sampled, and the
        state never exceeds `max_ctx` (default: its own capacity)."""
        n = state.n_past
        ctx = min(state.max_ctx, max_ctx) if max_ctx is not None else state.max_ctx
        limit = min(max_new - 1, ctx - n - 1, self.drafter.max_draft, MAX_VERIFY_TOKENS - 1,
                    self.params.draft_max if self.params.draft_max is not None else self.drafter.max_draft)
        drafts: list[int] = []
        if limit >= 1 and self.active:
            drafts = cut_proposal(self.drafter.propose(n, anchor, limit), self.params, limit)
        block = [int(anchor)] + drafts
        # Greedy sampling is the argmax of each row: ask the model for the ids (on a GPU only they
        # cross to the host); the sampler would pick the same token from the logits. Sampling that
        # only the largest k logits decide (top_k on, penalties that only lower logits) asks for
        # those k per row, selected on the device where the model can (Sampler.candidates_needed).
        greedy = sampler.params.is_greedy
        k = 0 if greedy else self._candidates_needed(sampler, history, drafts)
        mode = "argmax" if greedy else ("topk" if k else "all")
        logits, captured, record = self.model.verify(block, state, capture_layers=self.capture_layers,
                                                     reuse=self._buffers, logits=mode,
                                                     **({"top_k": k} if k else {}))
        self._buffers = record            # its checkpoint buffers serve the next verify (grown when needed)

        track_rng = sampler.params.temperature > 0          # greedy sampling draws no random numbers
        penalties = sampler.params.has_penalties
        hist = list(history) if penalties else history
        vocab = int(getattr(self.model, "n_vocab", 0) or 0)
        sampled: list[int] = []
        self._rng_after = []
        for i in range(len(block)):
            if greedy:
                s = int(logits[i])
            elif k and isinstance(logits[i], tuple):
                s = int(sampler.sample_candidates(logits[i][0], logits[i][1], vocab, hist))
            else:                         # the whole row (no top-k, or a NaN / +inf row the sampler rejects)
                s = int(sampler.sample(logits[i], hist))
            sampled.append(s)
            if track_rng:
                self._rng_after.append(sampler.get_state())
            if i < len(drafts) and s == drafts[i]:
                if penalties:
                    hist.append(s)
                continue
            break
        a = len(sampled) - 1
        self.model.rollback(state, record, a + 1)
        self._record = record
        self.drafter.observe(n, block[:a + 1], self._features(captured, a + 1))
        self.stats.record(len(drafts), a)
        return sampled

    def _candidates_needed(self, sampler: Any, history: Sequence[int], drafts: Sequence[int]) -> int:
        """The k for a verify with top-k rows, or 0 for whole rows: the most candidates any row of
        the block needs (row i samples after history + drafts[:i]), when the model selects them on
        the device (`device_topk_max`) and every row needs only some."""
        k_max = int(getattr(self.model, "device_topk_max", 0) or 0)
        vocab = int(getattr(self.model, "n_vocab", 0) or 0)
        if not k_max or not vocab:
            return 0
        if not sampler.params.has_penalties:            # the history does not matter
            k = sampler.candidates_needed(history, vocab)
        else:
            hist, k = list(history), 0
            for i in range(len(drafts) + 1):
                need = sampler.candidates_needed(hist, vocab)
                if need == 0:
                    return 0
                k = max(k, need)
                if i < len(drafts):
                    hist.append(int(drafts[i]))
        return k if 0 < k <= k_max else 0

    def truncate(self, state: Any, sampler: Any, n_used: int) -> None:
        """Generation ended at the n_used-th token the last `step` returned: cut the state to the
        tokens before it (what autoregressive decoding would hold) and put the sampler's RNG where
        autoregressive sampling would have left it."""
        if self._record is None:
            raise RuntimeError("truncate() without a step")
        self.model.rollback(state, self._record, n_used)
        if self._rng_after:
            sampler.set_state(self._rng_after[n_used - 1])


class OracleDrafter:
    """A proposer that knows the answer, for tests and for measuring the loop's own overhead: it
    proposes `continuation` (the tokens the target will generate after the prompt) from the right
    offset, each proposal corrupted at one position drawn uniformly from 0..k (k = no corruption), so
    every acceptance length 0..k occurs. `corrupt=False` gives the all-accepted upper bound."""

    def __init__(self, prompt_len: int, continuation: Sequence[int], block_size: int, n_vocab: int,
                 seed: int = 0, corrupt: bool = True):
        self.prompt_len, self.continuation = int(prompt_len), [int(t) for t in continuation]
        self.max_draft, self.n_vocab, self.corrupt = int(block_size) - 1, int(n_vocab), corrupt
        self.capture_layers: tuple[int, ...] = ()
        self.rng = np.random.default_rng(seed)
        self.observed: list[tuple[int, tuple[int, ...]]] = []   # (start, committed tokens) per observe
        self.corrupted_at: list[int] = []                        # per non-empty proposal: depth j (k = none)
        self.proposals: list[tuple[int, int]] = []               # per non-empty proposal: (k, j)

    def start(self, n_cached: int) -> None:
        self.observed = []

    def observe(self, start: int, token_ids: Sequence[int], features: Any) -> None:
        self.observed.append((int(start), tuple(int(t) for t in token_ids)))

    def propose(self, n: int, anchor: int, max_tokens: int) -> DraftProposal:
        # the anchor at position n is continuation[n - prompt_len]; proposals follow it
        i0 = n - self.prompt_len + 1
        tokens = self.continuation[i0:i0 + min(max_tokens, self.max_draft)]
        if self.corrupt and tokens:
            j = int(self.rng.integers(0, len(tokens) + 1))
            if j < len(tokens):
                tokens = list(tokens)
                tokens[j] = (tokens[j] + 1 + int(self.rng.integers(0, self.n_vocab - 1))) % self.n_vocab
            self.corrupted_at.append(j)
            self.proposals.append((len(tokens), j))
        return DraftProposal(tuple(tokens), None)
