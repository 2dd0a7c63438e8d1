"""Token sampling shared by the AR generation loop, the speculative decoder and the workers.

The chain follows llama.cpp's default sampler order (``common_params_sampling.samplers``:
penalties -> top_k -> top_p -> min_p -> temperature -> dist), restricted to the stages we support:

1. **Penalties** over the last ``repeat_last_n`` tokens of the history (prompt + generated; ``-1`` =
   the whole history, ``0`` = no penalties).  For every *distinct* token in that window:
   repetition ``logit > 0 -> logit / repeat_penalty``, otherwise ``logit * repeat_penalty``;
   then ``logit -= frequency_penalty * count + presence_penalty``.  Done in float32, like llama.cpp.
2. **Greedy** (``temperature <= 0``): the argmax of the penalised logits, ties to the lowest index.
   No random number is drawn, so greedy steps do not move the RNG.
3. **top_k** (``0 < top_k < #candidates``): keep the k largest logits; ties at the k-th value go to
   the lowest token ids, so the kept set is a function of the logits alone.
4. **top_p** (``top_p < 1``): softmax over the remaining candidates of the *untempered* logits (the
   temperature stage comes later in llama.cpp's chain), sort by (logit desc, id asc) and keep the
   shortest prefix whose cumulative probability reaches ``top_p`` (at least one token).
5. **min_p** (``min_p > 0``): keep candidates with ``p >= min_p * p_max`` over the untempered
   remaining set, i.e. ``logit >= max_logit + log(min_p)``.
6. **Temperature**: ``(logit - max) / temperature``; softmax in float64 gives the final distribution.
7. **Draw**: one uniform ``r ∈ [0, 1)`` from ``numpy.random.Generator(PCG64(seed))``, and the token is
   the first one, walking the candidates in ascending token id, whose cumulative probability exceeds
   ``r``.  Because the walk order is the vocabulary order, a draw is a function of (final
   distribution, r) only: ``Sampler.sample`` equals ``Sampler.draw(Sampler.probs(...))`` for the same
   RNG position, which the lossless speculative sampler relies on.

Decision recorded here (the design notes flag the lucebox sampler as applying temperature before top_p
and lacking min_p): we follow llama.cpp's order, not lucebox's.  Exact samples are therefore
reproducible only within this implementation; across implementations only in distribution.

Everything over the vocabulary is vectorised numpy; V = 250k costs well under a few milliseconds for the
common settings (top_k / min_p use ``argpartition`` / masks; top_p sorts only the head of the
distribution that can hold the nucleus and falls back to a full sort when it cannot).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = [
    "SamplingError",
    "SamplingParams",
    "Sampler",
    "argmax_lowest",
    "top_candidates",
]


class SamplingError(ValueError):
    """Invalid sampling parameters, logits or history (a user or caller error, not a crash)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, named like llama-server's completion JSON so the router can pass them through.

    The defaults switch every stage off: greedy decoding, the project's default (speculative decoding
    is bit-exact only in greedy mode).  Instances are validated on construction.
    """

    temperature: float = 0.0  # 0 (or less is rejected) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64  # llama.cpp default; -1 = the whole history; 0 = no penalties
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None = a random seed chosen when the Sampler is built

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise SamplingError (a ValueError) naming the first out-of-range field."""
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty",
                     "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(float(value)):
                raise SamplingError(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "repeat_last_n"):
            value = getattr(self, name)
            if not _is_int(value):
                raise SamplingError(f"{name} must be an integer, got {value!r}")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.repeat_penalty <= 0:
            raise SamplingError(f"repeat_penalty must be > 0 (1 = off), got {self.repeat_penalty!r}")
        if self.repeat_last_n < -1:
            raise SamplingError(
                f"repeat_last_n must be >= -1 (-1 = whole history, 0 = off), got {self.repeat_last_n!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise SamplingError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        """True when the output is the plain argmax of the model's logits (what speculative decoding
        reproduces bit-exactly): temperature <= 0 and no penalty active."""
        return self.temperature <= 0 and not self.has_penalties

    @classmethod
    def from_mapping(cls, body: Mapping[str, Any], base: "SamplingParams | None" = None) -> "SamplingParams":
        """Build from a llama-server / OpenAI style request body.

        Only this dataclass's field names are read (other keys of a completion body are the router's
        business); missing keys keep ``base``'s values (default: the greedy defaults).  ``seed: -1``
        (llama-server's "random") and ``null`` mean a random seed.
        """
        values = asdict(base) if base is not None else {}
        for f in fields(cls):
            if f.name in body:
                values[f.name] = body[f.name]
        if values.get("seed") == -1:
            values["seed"] = None
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def argmax_lowest(logits: np.ndarray) -> int:
    """Index of the largest value; ties go to the lowest index (numpy's argmax returns the first)."""
    return int(np.argmax(logits))


def _top_k_mask_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Positions (into ``values``) of the k largest values, ties at the k-th value to the lowest position.

    Returned in ascending position order.
    """
    n = values.shape[0]
    kth = np.partition(values, n - k)[n - k]  # the k-th largest value
    above = np.flatnonzero(values > kth)
    tied = np.flatnonzero(values == kth)
    chosen = np.concatenate([above, tied[: k - above.shape[0]]])
    chosen.sort()
    return chosen


def top_candidates(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids ascending, values) of the k largest of a row of logits, ties at the k-th value to the
    lowest ids (the top_k rule; -0.0 and 0.0 tie). What a GPU computes on the device
    (kernels/fused.cu topk_row) so that only k candidates cross to the host."""
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    k = min(int(k), x.shape[0])
    ids = _top_k_mask_indices(x, k) if k < x.shape[0] else np.arange(x.shape[0])
    return ids.astype(np.int64), x[ids]


def _descending_order(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``positions`` (ascending) sorted by (value desc, position asc): a stable sort keeps ties in
    ascending position order."""
    order = np.argsort(-values[positions], kind="stable")
    return positions[order]


class Sampler:
    """Stateful sampler for one sequence: the parameters plus a seeded PCG64 RNG.

    ``sample`` consumes exactly one uniform per non-greedy token and none per greedy token, so the RNG
    position is a function of the number of sampled tokens; ``get_state``/``set_state`` capture it for
    worker snapshots.
    """

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params if params is not None else SamplingParams()
        self.params.validate()
        # Resolve a random seed once so it can be reported and the sequence replayed.
        self.seed: int = self.params.seed if self.params.seed is not None else secrets.randbits(64)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))

    # ---- RNG state -------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The RNG position as a msgpack/JSON-safe dict (PCG64's 128-bit words as hex strings)."""
        st = self._rng.bit_generator.state
        return {
            "bit_generator": st["bit_generator"],
            "state": format(st["state"]["state"], "x"),
            "inc": format(st["state"]["inc"], "x"),
            "has_uint32": int(st["has_uint32"]),
            "uinteger": int(st["uinteger"]),
            "seed": self.seed,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a position captured by ``get_state``."""
        try:
            if state["bit_generator"] != "PCG64":
                raise SamplingError(f"sampler state is for {state['bit_generator']!r}, expected 'PCG64'")
            raw = {
                "bit_generator": "PCG64",
                "state": {"state": int(state["state"], 16), "inc": int(state["inc"], 16)},
                "has_uint32": int(state["has_uint32"]),
                "uinteger": int(state["uinteger"]),
            }
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SamplingError):
                raise
            raise SamplingError(f"malformed sampler state: {exc!r}") from None
        self._rng.bit_generator.state = raw
        if "seed" in state and state["seed"] is not None:
            self.seed = int(state["seed"])

    # ---- the chain -------------------------------------------------------------------------------
    def penalized_logits(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Stage 1: a float32 copy of ``logits`` with the repetition/frequency/presence penalties applied
        (the input itself when no penalty is active)."""
        x = self._check_logits(logits)
        p = self.params
        if not p.has_penalties or len(history) == 0:
            return x
        window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n:]
        ids = np.asarray(window, dtype=np.int64)
        if ids.ndim != 1:
            raise SamplingError("history must be a flat sequence of token ids")
        if ids.size and (ids.min() < 0 or ids.max() >= x.shape[0]):
            raise SamplingError(f"history holds a token id outside the vocabulary [0, {x.shape[0]})")
        tokens, counts = np.unique(ids, return_counts=True)
        out = x.copy()
        vals = out[tokens]
        if p.repeat_penalty != 1.0:
            pen = np.float32(p.repeat_penalty)
            vals = np.where(vals > 0, vals / pen, vals * pen).astype(np.float32)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            vals = vals - (counts.astype(np.float32) * np.float32(p.frequency_penalty)
                           + np.float32(p.presence_penalty))
        out[tokens] = vals
        return out

    def _candidates(self, logits: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | int:
        """Run stages 1-6. Returns the greedy token id, or (ids ascending, final probabilities float64)."""
        p = self.params
        x = self.penalized_logits(logits, history)
        if p.temperature <= 0:
            return argmax_lowest(x)
        ids = np.arange(x.shape[0])  # candidate token ids, kept ascending between stages
        vals = x  # their (penalised, untempered) logits
        finite = vals > -np.inf  # NaN and +inf were rejected already
        if not finite.all():
            # Tokens at -inf can never be drawn; dropping them keeps every later stage finite.
            keep = np.flatnonzero(finite)
            if keep.size == 0:
                raise SamplingError("every logit is -inf after the penalties; nothing can be sampled")
            ids, vals = ids[keep], vals[keep]

        if 0 < p.top_k < ids.shape[0]:
            keep = _top_k_mask_indices(vals, p.top_k)
            ids, vals = ids[keep], vals[keep]

        if p.top_p < 1.0 and ids.shape[0] > 1:
            keep = self._top_p_positions(vals, p.top_p)
            ids, vals = ids[keep], vals[keep]

        if p.min_p > 0.0 and ids.shape[0] > 1:
            threshold = np.float64(vals.max()) + math.log(p.min_p)
            keep = np.flatnonzero(vals.astype(np.float64) >= threshold)
            ids, vals = ids[keep], vals[keep]

        v64 = vals.astype(np.float64)
        w = np.exp((v64 - v64.max()) / p.temperature)
        return ids, w / w.sum()

    @staticmethod
    def _top_p_positions(vals: np.ndarray, top_p: float) -> np.ndarray:
        """Positions of the nucleus (smallest (logit desc, id asc) prefix with mass >= top_p), ascending."""
        n = vals.shape[0]
        v64 = vals.astype(np.float64)
        vmax = v64.max()
        z = np.exp(v64 - vmax).sum()
        # Try the head first: sort only the m largest (closed under ties so the order matches a full
        # sort), and fall back to sorting everything when the head does not reach top_p.
        m = 1024
        while True:
            if m >= n:
                head = np.arange(n)
            else:
                kth = np.partition(vals, n - m)[n - m]
                head = np.flatnonzero(vals >= kth)
            order = _descending_order(vals, head)
            cum = np.cumsum(np.exp(v64[order] - vmax)) / z
            reached = np.flatnonzero(cum >= top_p)
            if reached.size:
                keep = order[: reached[0] + 1]
                break
            if head.shape[0] >= n:  # rounding left the total just below top_p: keep everything
                keep = order
                break
            m *= 8
        keep = np.sort(keep)
        return keep

    def candidates_needed(self, history: Sequence[int], vocab: int) -> int:
        """How many of the largest logits decide the next sampled token, or 0 when any logit can.

        With top_k on, the kept set lies within the top_k + H largest raw logits, H = the distinct
        tokens the penalties touch, as long as the penalties can only lower a logit (repeat_penalty
        >= 1, frequency / presence >= 0): a token outside them has top_k larger untouched ones above
        it. `sample_candidates` on those equals `sample` on the whole row. Greedy, top_k off or a
        penalty that can raise a logit: 0 (the whole row is needed)."""
        p = self.params
        if p.temperature <= 0 or p.top_k <= 0:
            return 0
        h = 0
        if p.has_penalties and len(history):
            if p.repeat_penalty < 1.0 or p.frequency_penalty < 0.0 or p.presence_penalty < 0.0:
                return 0
            window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n:]
            h = int(np.unique(np.asarray(window, dtype=np.int64)).shape[0])
        return min(int(vocab), p.top_k + h)

    def sample_candidates(self, ids: np.ndarray, vals: np.ndarray, vocab: int, history: Sequence[int] = ()) -> int:
        """`sample` over a row known only at `ids` (the `candidates_needed` largest logits, e.g. from
        the GPU's top-k): the other logits count as -inf, which the chain drops first."""
        full = np.full(int(vocab), -np.inf, dtype=np.float32)
        full[np.asarray(ids, dtype=np.int64)] = np.asarray(vals, dtype=np.float32)
        return self.sample(full, history)

    def probs(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The final distribution (float64 [V], sums to 1); one-hot at the argmax when greedy.

        Does not touch the RNG."""
        vocab = np.asarray(logits).shape[-1]
        out = np.zeros(vocab, dtype=np.float64)
        cand = self._candidates(logits, history)
        if isinstance(cand, int):
            out[cand] = 1.0
        else:
            ids, pr = cand
            out[ids] = pr
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Next token id for ``logits`` (float32 [V]) given the token history (prompt + generated)."""
        cand = self._candidates(logits, history)
        if isinstance(cand, int):
            return cand
        ids, pr = cand
        return int(ids[_inverse_cdf(pr, self._rng.random())])

    def draw(self, probs: np.ndarray) -> int:
        """Draw from an explicit distribution over the vocabulary with one uniform of this sampler's RNG,
        by the same inverse-CDF walk in token-id order as ``sample``."""
        pr = np.asarray(probs, dtype=np.float64)
        if pr.ndim != 1 or pr.size == 0:
            raise SamplingError("probs must be a non-empty 1-D array")
        if not (pr >= 0).all() or not np.isfinite(pr).all() or pr.sum() <= 0:
            raise SamplingError("probs must be finite, non-negative and not all zero")
        return _inverse_cdf(pr, self._rng.random())

    def uniform(self) -> float:
        """One uniform in [0, 1) from this sampler's RNG (for acceptance tests in speculative sampling)."""
        return float(self._rng.random())

    @staticmethod
    def _check_logits(logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits)
        if x.ndim == 2 and x.shape[0] == 1:
            x = x[0]
        if x.ndim != 1 or x.shape[0] == 0:
            raise SamplingError(f"logits must be a 1-D array [vocab], got shape {np.shape(logits)}")
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        # NaN fails both comparisons; +inf fails the first. -inf is a legitimate mask.
        if not (x < np.inf).all():
            raise SamplingError("logits contain NaN or +inf")
        return x


def _inverse_cdf(pr: np.ndarray, r: float) -> int:
    """Index of the first entry whose cumulative sum exceeds r * total (zero entries are never chosen)."""
    cdf = np.cumsum(pr)
    j = int(np.searchsorted(cdf, r * cdf[-1], side="right"))
    if j >= pr.shape[0]:  # r * total rounded up to the total: take the last entry with mass
        j = int(np.flatnonzero(pr > 0)[-1])
    return j
