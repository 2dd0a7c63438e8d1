"""Prometheus text exposition for the router, without a client library.

Names follow llama-server's `--metrics` vocabulary with a `dflashd:` prefix where llama-server says
`llamacpp:` (prompt_tokens_total, tokens_predicted_total, requests_processing, and the speculative
counters spec_decode_num_draft_tokens_total, ..._num_accepted_tokens_total, ..._num_drafts_total and
..._num_accepted_tokens_per_pos_total{position="N"}), so dashboards built for llama-server carry
over.  Labels carry model and worker names only: never request content.
"""
from __future__ import annotations

import math
import threading
from typing import Iterable

__all__ = ["Metrics", "Histogram"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1


class Metrics:
    """Counters keyed by label tuples; `render(registry, dispatcher)` adds the live gauges."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], int] = {}  # (endpoint, model, status) -> n
        self.prompt_tokens: dict[str, int] = {}
        self.predicted_tokens: dict[str, int] = {}
        self.prompt_seconds: dict[str, float] = {}
        self.predicted_seconds: dict[str, float] = {}
        self.ttft: dict[str, Histogram] = {}
        self.duration: dict[str, Histogram] = {}
        self.spec_drafted: dict[str, int] = {}
        self.spec_accepted: dict[str, int] = {}
        self.spec_drafts: dict[str, int] = {}
        self.spec_accepted_per_pos: dict[tuple[str, int], int] = {}
        self.stream_errors: dict[str, int] = {}  # model -> errors sent after output had begun
        self.client_disconnects = 0
        self.auth_failures = 0

    def request(self, endpoint: str, model: str, status: int) -> None:
        with self._lock:
            key = (endpoint, model, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def completion(self, model: str, *, prompt_tokens: int, completion_tokens: int, prompt_ms: float,
                   predicted_ms: float, ttft_s: float | None, duration_s: float, spec=None) -> None:
        with self._lock:
            self.prompt_tokens[model] = self.prompt_tokens.get(model, 0) + prompt_tokens
            self.predicted_tokens[model] = self.predicted_tokens.get(model, 0) + completion_tokens
            self.prompt_seconds[model] = self.prompt_seconds.get(model, 0.0) + prompt_ms / 1000.0
            self.predicted_seconds[model] = self.predicted_seconds.get(model, 0.0) + predicted_ms / 1000.0
            if ttft_s is not None:
                self.ttft.setdefault(model, Histogram(_TTFT_BUCKETS)).observe(ttft_s)
            self.duration.setdefault(model, Histogram(_DURATION_BUCKETS)).observe(duration_s)
            if spec is not None:
                self.spec_drafted[model] = self.spec_drafted.get(model, 0) + spec.drafted
                self.spec_accepted[model] = self.spec_accepted.get(model, 0) + spec.accepted
                self.spec_drafts[model] = self.spec_drafts.get(model, 0) + spec.steps
                for pos, n in enumerate(spec.accepted_per_position):
                    key = (model, pos)
                    self.spec_accepted_per_pos[key] = self.spec_accepted_per_pos.get(key, 0) + n

    def stream_error(self, model: str) -> None:
        with self._lock:
            self.stream_errors[model] = self.stream_errors.get(model, 0) + 1

    def render(self, registry, dispatcher) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, list, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for suffix, labels, value in samples:
                out.append(f"{name}{suffix}{_labels(labels)} {_num(value)}")

        def per_model(d: dict) -> list:
            return [("", [("model", m)], v) for m, v in sorted(d.items())]

        def hist(h: dict[str, Histogram]) -> list:
            rows = []
            for m, hg in sorted(h.items()):
                for b, c in zip(hg.buckets, hg.counts):
                    rows.append(("_bucket", [("model", m), ("le", _num(b))], c))
                rows.append(("_bucket", [("model", m), ("le", "+Inf")], hg.total))
                rows.append(("_sum", [("model", m)], hg.sum))
                rows.append(("_count", [("model", m)], hg.total))
            return rows

        with self._lock:
            family("dflashd:requests_total", "counter", "HTTP requests by endpoint, model and status.",
                   [("", [("endpoint", e), ("model", m), ("status", s)], n)
                    for (e, m, s), n in sorted(self.requests.items())])
            family("dflashd:prompt_tokens_total", "counter", "Prompt tokens processed.", per_model(self.prompt_tokens))
            family("dflashd:tokens_predicted_total", "counter", "Completion tokens generated.",
                   per_model(self.predicted_tokens))
            family("dflashd:prompt_seconds_total", "counter", "Prompt processing time reported by workers.",
                   per_model(self.prompt_seconds))
            family("dflashd:tokens_predicted_seconds_total", "counter", "Generation time reported by workers.",
                   per_model(self.predicted_seconds))
            family("dflashd:time_to_first_token_seconds", "histogram",
                   "From request arrival at the router to the first token it received.", hist(self.ttft))
            family("dflashd:request_duration_seconds", "histogram", "From arrival to the last byte.",
                   hist(self.duration))
            family("dflashd:spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                   per_model(self.spec_drafted))
            family("dflashd:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   per_model(self.spec_accepted))
            family("dflashd:spec_decode_num_drafts_total", "counter", "Verify steps (drafts).",
                   per_model(self.spec_drafts))
            family("dflashd:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted draft tokens by position in the draft.",
                   [("", [("model", m), ("position", str(p))], n)
                    for (m, p), n in sorted(self.spec_accepted_per_pos.items())])
            family("dflashd:stream_errors_total", "counter",
                   "Responses ended by an error event after output had begun.", per_model(self.stream_errors))
            family("dflashd:client_disconnects_total", "counter", "Requests cancelled by the client going away.",
                   [("", [], self.client_disconnects)])
            family("dflashd:auth_failures_total", "counter", "Requests refused for a missing or wrong API key.",
                   [("", [], self.auth_failures)])
        family("dflashd:requests_processing", "gauge", "Generations in flight in the router.",
               [("", [], dispatcher.inflight)])
        family("dflashd:retries_total", "counter", "Requests moved to another worker.",
               [("", [], dispatcher.retries_total)])
        family("dflashd:cancels_total", "counter", "CANCEL messages sent to workers.",
               [("", [], dispatcher.cancels_total)])
        family("dflashd:worker_losses_total", "counter", "Requests whose worker died or vanished.",
               [("", [], dispatcher.worker_failures_total)])
        workers = sorted(registry.workers.values(), key=lambda w: w.worker_id)

        def wl(w) -> list:
            return [("worker", w.worker_id), ("model", w.model), ("device", w.hello.device)]

        family("dflashd:worker_healthy", "gauge", "1 while the worker is routable.",
               [("", wl(w), int(w.healthy)) for w in workers])
        family("dflashd:worker_inflight", "gauge", "Requests the router has outstanding on the worker.",
               [("", wl(w), len(w.inflight)) for w in workers])
        family("dflashd:worker_active", "gauge", "Requests generating, from the worker's heartbeat.",
               [("", wl(w), w.load_active) for w in workers])
        family("dflashd:worker_queued", "gauge", "Requests queued on the worker, from its heartbeat.",
               [("", wl(w), w.load_queued) for w in workers])
        family("dflashd:worker_requests_total", "counter", "Requests sent to the worker.",
               [("", wl(w), w.requests_total) for w in workers])
        family("dflashd:worker_failures_total", "counter", "Times the worker was marked unhealthy.",
               [("", wl(w), w.failures_total) for w in workers])
        status_rows = []
        for mid in sorted(registry.models):
            status, _ = registry.model_status(mid)
            for s in ("loading", "ready", "failed"):
                status_rows.append(("", [("model", mid), ("status", s)], int(status == s)))
        family("dflashd:model_status", "gauge", "1 for the model's current status.", status_rows)
        return "\n".join(out) + "\n"
