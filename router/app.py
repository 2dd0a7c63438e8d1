"""The router's HTTP API: OpenAI- and Anthropic-compatible endpoints in front of the workers.

Endpoints (the same paths without `/v1` work too, as in llama-server):

  POST /v1/chat/completions        OpenAI chat (SSE with stream=true); tools, reasoning_content, timings
  POST /v1/completions             OpenAI text completions (prompt as text or token ids)
  POST /v1/messages                Anthropic Messages (SSE with stream=true); tool_use blocks
  POST /v1/messages/count_tokens   Anthropic token count of a conversation
  GET  /v1/models                  models with their status: loading, ready, failed
  GET  /health                     200 while at least one worker is healthy, else 503 with the reason
  GET  /metrics                    Prometheus text (router/metrics.py)
  GET  /props                      models, workers, defaults (no request content)

Errors are JSON objects in the API's own shape: OpenAI's `{"error": {"message", "type", "param",
"code"}}`, and Anthropic's `{"type": "error", "error": {"type", "message"}}` under /v1/messages.  A
request the router cannot take gets a 4xx before any worker is involved; a failure after a stream
began ends the stream with an error event (OpenAI: a `data: {"error": ...}` chunk before `[DONE]`;
Anthropic: `event: error`), never with a silent, truncated success.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from daemons.sampling import SamplingError, SamplingParams
from protocol.messages import Done, SpeculativeOptions
from router import anthropic as anth
from router.chat import ChatError, ModelText, OutputParser, ToolCall, normalize_messages, parse_output, \
    prompt_opens_reasoning
from router.config import Config
from router.dispatch import Chunk, DispatchError, Dispatcher, Finished, GenerationJob, Restart
from router.metrics import Metrics
from router.registry import ModelEntry, Registry, WorkerHub
from router.schemas import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
)

__all__ = ["RouterService", "create_app", "ApiError"]

log = logging.getLogger("dflashd.router")
VERSION = "0.1.0"
_PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
                    502: "api_error", 503: "overloaded_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages") or path.startswith("/messages")


def error_body(path: str, status: int, message: str, type_: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    if _is_anthropic(path):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(path: str, status: int, message: str, type_: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, type_, code, param), status_code=status, headers=headers)


def _sse(data: Any, event: str | None = None) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode("utf-8")


# ---- the ASGI gate: API keys and body size ----------------------------------------------------------

class _BodyTooLarge(Exception):
    pass


class Gate:
    """Pure ASGI middleware (no buffering of streamed responses): API keys and request size.

    A key is accepted as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic
    clients); comparison is constant-time.  /health stays open for load balancers and systemd."""

    def __init__(self, app, *, api_keys: tuple[str, ...], max_body_bytes: int, metrics: Metrics):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_body = max_body_bytes
        self.metrics = metrics

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        offered = []
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            offered.append(auth[7:].strip())
        if b"x-api-key" in headers:
            offered.append(headers[b"x-api-key"].strip())
        ok = False
        for o in offered:
            for k in self.keys:
                ok |= hmac.compare_digest(o, k)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if self.keys and path not in _PUBLIC_PATHS and not self._authorized(headers):
            self.metrics.auth_failures += 1
            return await error_response(path, 401, "invalid or missing API key (send Authorization: Bearer KEY "
                                        "or x-api-key: KEY)", "authentication_error", "invalid_api_key",
                                        headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                return await error_response(path, 400, "bad Content-Length header")(scope, receive, send)
            if too_big:
                return await error_response(path, 413, f"request body exceeds {self.max_body} bytes",
                                            code="request_too_large")(scope, receive, send)
        if scope.get("method") == "POST" and b"json" not in headers.get(b"content-type", b"json"):
            # Every POST body here is JSON; read it as such whatever the client declared (as
            # llama-server does: `curl -d` sends application/x-www-form-urlencoded).
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + \
                [(b"content-type", b"application/json")]
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise _BodyTooLarge()
            return msg

        async def tracked_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await error_response(path, 413, f"request body exceeds {self.max_body} bytes",
                                     code="request_too_large")(scope, receive, send)


class EventStreamResponse(StreamingResponse):
    """SSE response that notices a client going away even while no event is being written, and
    always closes its body generator (whose `finally` sends CANCEL to the worker)."""

    def __init__(self, content: AsyncIterator[bytes], on_disconnect: Callable[[], None] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send):
        async def listen() -> None:
            while True:
                if (await receive())["type"] == "http.disconnect":
                    return

        streamer = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(listen())
        disconnected = False
        try:
            done, _ = await asyncio.wait({streamer, listener}, return_when=asyncio.FIRST_COMPLETED)
            if streamer in done:
                try:
                    streamer.result()
                except OSError:
                    disconnected = True
            else:
                disconnected = True
        finally:
            for t in (streamer, listener):
                t.cancel()
            await asyncio.gather(streamer, listener, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if disconnected and self.on_disconnect is not None:
                self.on_disconnect()


# ---- prepared requests ------------------------------------------------------------------------------

@dataclass
class Prepared:
    endpoint: str
    entry: ModelEntry
    request_id: str
    job: GenerationJob
    t0: float
    parse_tools: bool = False
    in_reasoning: bool = False
    split_reasoning: bool = True
    forced_prefix: str = ""
    stops: tuple[str, ...] = ()


@dataclass
class Outcome:
    text: str
    ids: np.ndarray
    done: Done
    worker_id: str
    ttft_s: float | None
    attempts: int
    parsed: Any = None
    stop_sequence: str | None = None

    @property
    def finish_reason(self) -> str:
        return self.done.finish_reason.value


def llama_timings(done: Done) -> dict[str, Any]:
    """A llama-server `timings` object from a DONE message (plus ttft_ms and speculative counts)."""
    u, t = done.usage, done.timings
    prompt_n = max(0, u.prompt_tokens - u.cached_tokens)
    out: dict[str, Any] = {
        "cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": t.prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": t.prompt_per_second,
        "predicted_n": u.completion_tokens, "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": t.predicted_ms / u.completion_tokens if u.completion_tokens else 0.0,
        "predicted_per_second": t.predicted_per_second, "ttft_ms": t.ttft_ms,
    }
    if done.spec is not None:
        # llama-server's two names, then the rest of the worker's SpecStats under the same prefix
        s = done.spec
        out["draft_n"] = s.drafted
        out["draft_n_accepted"] = s.accepted
        out["draft_n_steps"] = s.steps
        out["draft_accepted_per_position"] = list(s.accepted_per_position)
        out["draft_acceptance_length"] = s.acceptance_length
    return out


def speculative_stats(done: Done) -> dict[str, Any] | None:
    s = done.spec
    if s is None:
        return None
    return {"draft_tokens": s.drafted, "accepted_tokens": s.accepted, "drafts": s.steps,
            "accepted_per_position": list(s.accepted_per_position),
            "acceptance_rate": s.accepted / s.drafted if s.drafted else 0.0,
            "acceptance_length": s.acceptance_length}


def openai_usage(done: Done) -> dict[str, Any]:
    u = done.usage
    usage: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                             "total_tokens": u.prompt_tokens + u.completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
                             "timings": llama_timings(done)}
    spec = speculative_stats(done)
    if spec is not None:
        usage["speculative"] = spec
    return usage


def _finish_openai(outcome: Outcome, n_calls: int) -> str:
    if outcome.finish_reason == "length":
        return "length"
    return "tool_calls" if n_calls else "stop"


# ---- the service ------------------------------------------------------------------------------------

class RouterService:
    """Registry + hub + dispatcher (+ supervisor) behind the HTTP app; one per process."""

    def __init__(self, config: Config, *, supervise: bool = False):
        s = config.server
        self.config = config
        self.registry = Registry(liveness_s=s.heartbeat_interval_s * s.heartbeat_liveness,
                                 max_inflight=s.max_inflight_per_worker)
        self.dispatcher = Dispatcher(self.registry, admission_timeout_s=s.admission_timeout_s,
                                     max_attempts=s.max_attempts)
        self.metrics = Metrics()
        self.hub = WorkerHub(self.registry, s.bind, heartbeat_interval_s=s.heartbeat_interval_s,
                             on_request_message=self.dispatcher.on_request_message,
                             on_lost=self.dispatcher.on_lost)
        self.dispatcher.hub = self.hub
        for m in config.models:
            text = ModelText.from_gguf(m.path) if m.path is not None else None
            self.registry.add_model(ModelEntry(id=m.id, aliases=m.aliases, text=text, sampling=m.sampling))
        self.supervisor = None
        if supervise and any(m.workers for m in config.models):
            from router.supervisor import Supervisor
            self.supervisor = Supervisor(config, self.registry, self.hub)
        self.started_at = time.time()
        self._on_ready: list[Callable[[], None]] = []

    async def start(self) -> None:
        self.hub.start()
        log.info("worker socket: %s", self.hub.endpoint)
        if self.supervisor is not None:
            self.supervisor.start(self.hub.endpoint)

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        await self.hub.stop()

    # ---- request preparation -------------------------------------------------------------------------
    def model_for(self, name: str | None) -> ModelEntry:
        entry = self.registry.resolve(name)
        if entry is None:
            known = ", ".join(sorted(self.registry.models)) or "none"
            raise ApiError(404, f"model {name!r} is not served here (models: {known})", code="model_not_found",
                           param="model")
        return entry

    def sampling_for(self, entry: ModelEntry, body: Any, names: tuple[str, ...]) -> SamplingParams:
        given = {n: getattr(body, n) for n in names if n in body.model_fields_set and getattr(body, n) is not None}
        try:
            return SamplingParams.from_mapping(given, base=entry.sampling or SamplingParams())
        except SamplingError as e:
            raise ApiError(400, str(e), code="invalid_value") from None

    @staticmethod
    def speculative_for(body: Any) -> SpeculativeOptions | None:
        """The GENERATE's speculative options from a body's `speculative` object and/or llama-server's
        flat `speculative.n_max` / `.n_min` / `.p_min` keys (absent = the worker's default).  One
        knob given twice with different values is a 400."""
        nested = getattr(body, "speculative", None)
        values: dict[str, Any] = {}

        def give(knob: str, value: Any, param: str) -> None:
            if value is None:
                return
            if knob in values and values[knob][0] != value:
                raise ApiError(400, f"{param} = {value!r} contradicts {values[knob][1]} = {values[knob][0]!r}",
                               param=param)
            values[knob] = (value, param)

        if nested is not None:
            give("draft_max", nested.n_max, "speculative.n_max")
            give("draft_min", nested.n_min, "speculative.n_min")
            give("draft_margin", nested.p_min, "speculative.p_min")
            give("draft_margin", nested.margin, "speculative.margin")
        give("draft_max", getattr(body, "speculative_n_max", None), "speculative.n_max")
        give("draft_min", getattr(body, "speculative_n_min", None), "speculative.n_min")
        give("draft_margin", getattr(body, "speculative_p_min", None), "speculative.p_min")
        if not values:
            return None
        dmax, dmin = values.get("draft_max", (None,))[0], values.get("draft_min", (None,))[0]
        if dmax is not None and dmin is not None and dmin > dmax:
            raise ApiError(400, "speculative.n_min exceeds speculative.n_max", param="speculative.n_min")
        margin = values.get("draft_margin", (None,))[0]
        return SpeculativeOptions(draft_max=dmax, draft_min=dmin,
                                  draft_margin=float(margin) if margin is not None else None)

    def _text(self, entry: ModelEntry) -> ModelText:
        if entry.text is None:
            raise ApiError(400, f"the router has no model file for {entry.id!r} (it joined as a remote worker): "
                           f"start the router with --model PATH for it to render chats and count tokens",
                           code="model_metadata_missing")
        return entry.text

    def _prompt_ids(self, entry: ModelEntry, prompt: str) -> np.ndarray:
        text = self._text(entry)
        try:
            ids = text.encode(prompt)
        except ChatError as e:
            raise ApiError(400, str(e), code="invalid_prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", code="empty_prompt", param="prompt")
        return np.asarray(ids, dtype=np.int32)

    def _max_tokens(self, *values: int | None) -> int | None:
        for v in values:
            if v is not None and v != -1:
                return v
        return None

    def _check_prompt_fits(self, entry: ModelEntry, n_prompt: int) -> None:
        biggest = self.registry.max_ctx(entry.id)
        if biggest is not None and n_prompt >= biggest:
            raise ApiError(400, f"the prompt has {n_prompt} tokens; the context of this model's workers holds "
                           f"{biggest} (prompt plus at least one generated token)", code="context_length_exceeded")

    def render_chat(self, entry: ModelEntry, messages: list[dict], tools: list | None, tool_choice: Any,
                    enable_thinking: bool | None, template_kwargs: dict | None,
                    split_reasoning: bool) -> tuple[str, bool, bool, str]:
        """(prompt text, parse_tools, in_reasoning, forced_prefix)."""
        text = self._text(entry)
        use_tools = bool(tools) and tool_choice != "none"
        try:
            prompt = text.render(messages, tools=tools if use_tools else None, add_generation_prompt=True,
                                 enable_thinking=enable_thinking, template_kwargs=template_kwargs)
        except ChatError as e:
            raise ApiError(400, str(e), code="invalid_messages", param="messages") from None
        in_reasoning = split_reasoning and prompt_opens_reasoning(prompt)
        forced = ""
        if use_tools and tool_choice not in (None, "auto"):
            # No grammar sampling here: force the call by writing its opening into the assistant turn.
            if tool_choice == "required":
                forced = "<tool_call>\n"
            else:
                name = tool_choice["function"]["name"]
                if name not in {t["function"]["name"] for t in tools}:
                    raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools",
                                   param="tool_choice")
                forced = "<tool_call>\n{\"name\": " + json.dumps(name) + ", \"arguments\": "
            if in_reasoning:
                forced = "\n</think>\n\n" + forced
        return prompt + forced, use_tools, in_reasoning, forced

    def chat_prompt(self, entry: ModelEntry, messages: list[dict], tools: list | None, tool_choice: Any,
                    enable_thinking: bool | None, template_kwargs: dict | None, split_reasoning: bool
                    ) -> tuple[str, bool, bool, str, np.ndarray]:
        """render_chat plus the prompt's token ids."""
        prompt, parse_tools, in_reasoning, forced = self.render_chat(entry, messages, tools, tool_choice,
                                                                     enable_thinking, template_kwargs, split_reasoning)
        return prompt, parse_tools, in_reasoning, forced, self._prompt_ids(entry, prompt)

    def new_job(self, entry: ModelEntry, rid: str, ids: np.ndarray, *, max_tokens: int | None,
                sampling: SamplingParams, stops: tuple[str, ...], speculative: SpeculativeOptions | None,
                restartable: bool) -> GenerationJob:
        self._check_prompt_fits(entry, int(ids.size))
        return GenerationJob(request_id=rid, model=entry.id, n_prompt=int(ids.size), max_tokens=max_tokens,
                             prompt_ids=ids, sampling=sampling, stop=stops, speculative=speculative,
                             restartable=restartable, n_predict_cap=self.config.server.n_predict)

    def log_prompt(self, rid: str, prompt: str) -> None:
        if self.config.server.log_prompts:
            log.info("request %s prompt: %r", rid, prompt)

    # ---- running -------------------------------------------------------------------------------------
    async def _race_disconnect(self, request: Request, work: Awaitable[Any]) -> Any:
        """Await `work`, cancelling it if the client disconnects first (then ClientGone)."""
        task = asyncio.ensure_future(work)

        async def watch() -> None:
            while True:
                if (await request.receive())["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.metrics.client_disconnects += 1
            raise ClientGone()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def collect(self, request: Request, prep: Prepared) -> Outcome:
        async def work() -> Outcome:
            texts: list[str] = []
            ids: list[np.ndarray] = []
            ttft = None
            async for ev in self.dispatcher.run(prep.job):
                if isinstance(ev, Chunk):
                    if ttft is None:
                        ttft = time.perf_counter() - prep.t0
                    texts.append(ev.text)
                    ids.append(ev.ids)
                elif isinstance(ev, Restart):
                    texts.clear()
                    ids.clear()
                    ttft = None
                elif isinstance(ev, Finished):
                    return Outcome(text="".join(texts), ids=np.concatenate(ids) if ids else np.zeros(0, np.int32),
                                   done=ev.done, worker_id=ev.worker_id, ttft_s=ttft, attempts=ev.attempts)
            raise DispatchError("the generation ended without DONE")

        outcome = await self._race_disconnect(request, work())
        outcome.parsed = parse_output(prep.forced_prefix + outcome.text, parse_tools=prep.parse_tools,
                                      in_reasoning=prep.in_reasoning, split_reasoning=prep.split_reasoning,
                                      id_prefix="toolu_" if prep.endpoint == "messages" else "call_")
        outcome.stop_sequence = self._matched_stop(prep, outcome)
        self.finish_metrics(prep, outcome)
        return outcome

    def _matched_stop(self, prep: Prepared, outcome: Outcome) -> str | None:
        """Which stop string ended the output (the worker strips it from the text)."""
        if outcome.finish_reason != "stop" or not prep.stops or prep.entry.text is None:
            return None
        full = prep.entry.text.decode(outcome.ids.tolist())
        tail = full[len(outcome.text):] if full.startswith(outcome.text) else full[-(2048 + 64):]
        hits = [(tail.find(s), s) for s in prep.stops if s in tail]
        return min(hits)[1] if hits else None

    def finish_metrics(self, prep: Prepared, outcome: Outcome) -> None:
        d = outcome.done
        dur = time.perf_counter() - prep.t0
        self.metrics.completion(prep.entry.id, prompt_tokens=d.usage.prompt_tokens,
                                completion_tokens=d.usage.completion_tokens, prompt_ms=d.timings.prompt_ms,
                                predicted_ms=d.timings.predicted_ms, ttft_s=outcome.ttft_s, duration_s=dur,
                                spec=d.spec)
        log.info("%s %s model=%s worker=%s prompt=%d completion=%d finish=%s ttft=%s total=%.0fms%s",
                 prep.endpoint, prep.request_id, prep.entry.id, outcome.worker_id, d.usage.prompt_tokens,
                 d.usage.completion_tokens, outcome.finish_reason,
                 f"{outcome.ttft_s * 1000:.0f}ms" if outcome.ttft_s is not None else "-", dur * 1000,
                 f" attempts={outcome.attempts}" if outcome.attempts > 1 else "")

    async def open_stream(self, request: Request, prep: Prepared, fmt: "_StreamFormat") -> Response:
        """Wait for the first event (errors until then are plain HTTP errors), then stream."""
        gen = self.dispatcher.run(prep.job)
        try:
            first = await self._race_disconnect(request, gen.__anext__())
        except BaseException:
            await gen.aclose()
            raise
        return EventStreamResponse(self._stream(prep, fmt, first, gen),
                                   on_disconnect=lambda: self._client_left(prep))

    def _client_left(self, prep: Prepared) -> None:
        self.metrics.client_disconnects += 1
        log.info("%s %s: client disconnected; generation cancelled", prep.endpoint, prep.request_id)

    async def _stream(self, prep: Prepared, fmt: "_StreamFormat", first: Any, gen: AsyncIterator[Any]
                      ) -> AsyncIterator[bytes]:
        parser = OutputParser(parse_tools=prep.parse_tools, in_reasoning=prep.in_reasoning,
                              split_reasoning=prep.split_reasoning,
                              id_prefix="toolu_" if prep.endpoint == "messages" else "call_")
        ttft = None
        texts: list[str] = []
        ids: list[np.ndarray] = []
        try:
            yield fmt.start()
            if prep.forced_prefix:
                for ev in parser.feed(prep.forced_prefix):
                    yield fmt.event(*ev)
            ev = first
            while True:
                if isinstance(ev, Chunk):
                    if ttft is None:
                        ttft = time.perf_counter() - prep.t0
                    texts.append(ev.text)
                    ids.append(ev.ids)
                    for out in parser.feed(ev.text):
                        yield fmt.event(*out)
                elif isinstance(ev, Finished):
                    for out in parser.finish():
                        yield fmt.event(*out)
                    outcome = Outcome(text="".join(texts), ids=np.concatenate(ids) if ids else np.zeros(0, np.int32),
                                      done=ev.done, worker_id=ev.worker_id, ttft_s=ttft, attempts=ev.attempts)
                    outcome.stop_sequence = self._matched_stop(prep, outcome)
                    self.finish_metrics(prep, outcome)
                    yield fmt.finish(outcome)
                    return
                elif isinstance(ev, Restart):  # streaming jobs are not restartable; defensive
                    raise DispatchError(f"the worker failed mid-stream: {ev.reason}")
                ev = await gen.__anext__()
        except DispatchError as e:
            self.metrics.stream_error(prep.entry.id)
            log.warning("%s %s: stream ended by an error: %s", prep.endpoint, prep.request_id, e.message)
            yield fmt.error(e)
        except StopAsyncIteration:
            self.metrics.stream_error(prep.entry.id)
            yield fmt.error(DispatchError("the generation ended without DONE"))
        finally:
            await gen.aclose()  # type: ignore[attr-defined]


# ---- stream formats ---------------------------------------------------------------------------------

class _StreamFormat:
    def start(self) -> bytes: ...
    def event(self, kind: str, value: Any) -> bytes: ...
    def finish(self, outcome: Outcome) -> bytes: ...
    def error(self, e: DispatchError) -> bytes: ...


class _OpenAIChatStream(_StreamFormat):
    def __init__(self, rid: str, model: str, include_usage: bool):
        self.rid, self.model, self.include_usage = rid, model, include_usage
        self.created = int(time.time())
        self.n_calls = 0

    def _chunk(self, delta: dict, finish: str | None = None, **extra: Any) -> dict:
        body = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        body.update(extra)
        return body

    def start(self) -> bytes:
        return _sse(self._chunk({"role": "assistant", "content": ""}))

    def event(self, kind: str, value: Any) -> bytes:
        if kind == "content":
            return _sse(self._chunk({"content": value}))
        if kind == "reasoning":
            return _sse(self._chunk({"reasoning_content": value}))
        call: ToolCall = value
        self.n_calls += 1
        return _sse(self._chunk({"tool_calls": [{"index": self.n_calls - 1, "id": call.id, "type": "function",
                                                 "function": {"name": call.name, "arguments": call.arguments}}]}))

    def finish(self, outcome: Outcome) -> bytes:
        out = _sse(self._chunk({}, _finish_openai(outcome, self.n_calls), timings=llama_timings(outcome.done)))
        if self.include_usage:
            out += _sse({"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model, "choices": [], "usage": openai_usage(outcome.done)})
        return out + _sse("[DONE]")

    def error(self, e: DispatchError) -> bytes:
        return _sse({"error": {"message": e.message, "type": e.type, "code": e.code or "worker_failed",
                               "param": None}}) + _sse("[DONE]")


class _OpenAICompletionStream(_OpenAIChatStream):
    def _chunk(self, text: str, finish: str | None = None, **extra: Any) -> dict:  # type: ignore[override]
        body = {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        body.update(extra)
        return body

    def start(self) -> bytes:
        return b""

    def event(self, kind: str, value: Any) -> bytes:
        return _sse(self._chunk(value)) if value else b""

    def finish(self, outcome: Outcome) -> bytes:
        out = _sse(self._chunk("", outcome.finish_reason, timings=llama_timings(outcome.done)))
        if self.include_usage:
            out += _sse({"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                         "choices": [], "usage": openai_usage(outcome.done)})
        return out + _sse("[DONE]")


class _AnthropicStream(_StreamFormat):
    def __init__(self, rid: str, model: str, n_prompt: int):
        self.rid, self.model, self.n_prompt = rid, model, n_prompt
        self.index = -1
        self.open: str | None = None  # type of the open content block
        self.has_calls = False

    def start(self) -> bytes:
        return _sse({"type": "message_start", "message": {
            "id": self.rid, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}}, "message_start")

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":
            out += _sse({"type": "content_block_delta", "index": self.index,
                         "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta")
        self.open = None
        return out + _sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def _open(self, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + _sse({"type": "content_block_start", "index": self.index, "content_block": block},
                          "content_block_start")

    def event(self, kind: str, value: Any) -> bytes:
        out = b""
        if kind == "content":
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
            return out + _sse({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "text_delta", "text": value}}, "content_block_delta")
        if kind == "reasoning":
            if self.open != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            return out + _sse({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "thinking_delta", "thinking": value}}, "content_block_delta")
        call: ToolCall = value
        self.has_calls = True
        out += self._open({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        out += _sse({"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "input_json_delta", "partial_json": call.arguments}}, "content_block_delta")
        return out + self._close()

    def finish(self, outcome: Outcome) -> bytes:
        out = self._close()
        reason = anth.stop_reason(outcome.finish_reason, self.has_calls, outcome.stop_sequence)
        out += _sse({"type": "message_delta",
                     "delta": {"stop_reason": reason, "stop_sequence": outcome.stop_sequence},
                     "usage": {"input_tokens": outcome.done.usage.prompt_tokens,
                               "output_tokens": outcome.done.usage.completion_tokens},
                     "timings": llama_timings(outcome.done)}, "message_delta")
        return out + _sse({"type": "message_stop"}, "message_stop")

    def error(self, e: DispatchError) -> bytes:
        return _sse({"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.status, "api_error"),
                                                "message": e.message}}, "error")


# ---- the app ----------------------------------------------------------------------------------------

_SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
                   "frequency_penalty", "presence_penalty", "seed")


async def _off_loop(fn: Callable, *args: Any) -> Any:
    """Run prompt work (template rendering, tokenizing: CPU-bound, long for long prompts) in a
    thread, so the event loop keeps streaming other responses and heartbeating workers."""
    return await asyncio.to_thread(fn, *args)


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def create_app(service: RouterService, *, manage_service: bool = True) -> FastAPI:
    """The ASGI app.  With `manage_service`, the app's lifespan starts and stops the service;
    `run_server` starts it itself first, so that a socket that cannot be bound is a plain error."""
    svc = service

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_service:
            await svc.start()
        try:
            yield
        finally:
            if manage_service:
                await svc.stop()

    app = FastAPI(title="dflashd router", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = svc

    # ---- errors ----------------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        kind = first.get("type", "")
        if kind in ("json_invalid", "json_type"):
            message = "the request body is not valid JSON"
        else:
            # the message names the field and the rule, never the offending value (it may be prompt text)
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more problem(s))"
        svc.metrics.request(_endpoint(request.url.path), "-", 400)
        return error_response(request.url.path, 400, message, code="invalid_value", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no endpoint {request.url.path}", 405: f"method {request.method} is not allowed here"}.get(
            exc.status_code, str(exc.detail))
        return error_response(request.url.path, exc.status_code, message,
                              "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        svc.metrics.request(_endpoint(request.url.path), "-", exc.status)
        return error_response(request.url.path, exc.status, exc.message, exc.type, exc.code, exc.param)

    @app.exception_handler(DispatchError)
    async def on_dispatch_error(request: Request, exc: DispatchError):
        svc.metrics.request(_endpoint(request.url.path), "-", exc.status)
        headers = {"Retry-After": "5"} if exc.status == 503 else None
        return error_response(request.url.path, exc.status, exc.message, exc.type, exc.code, headers=headers)

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: Exception):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        svc.metrics.request(_endpoint(request.url.path), "-", 500)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}", "server_error")

    # ---- status endpoints ------------------------------------------------------------------------------
    def health_body() -> tuple[int, dict]:
        reg = svc.registry
        healthy = reg.healthy_workers()
        models = {}
        for mid in sorted(reg.models):
            status, reason = reg.model_status(mid)
            models[mid] = {"status": status, "reason": reason}
        if healthy:
            return 200, {"status": "ok", "workers_healthy": len(healthy), "models": models}
        if not reg.models:
            reason = "no model is configured and no worker has joined"
        else:
            reason = "; ".join(f"{m}: {v['status']}: {v['reason']}" for m, v in models.items())
        return 503, {"status": "unavailable", "reason": reason, "workers_healthy": 0, "models": models,
                     "error": {"code": 503, "message": reason, "type": "unavailable_error"}}

    @app.get("/health")
    async def health():
        status, body = health_body()
        return JSONResponse(body, status_code=status)

    app.add_api_route("/v1/health", health, methods=["GET"], include_in_schema=False)

    def model_card(mid: str) -> dict:
        reg = svc.registry
        entry = reg.models[mid]
        status, reason = reg.model_status(mid)
        workers = [w for w in reg.workers.values() if w.model == mid]
        text = entry.text
        return {"id": mid, "object": "model", "created": entry.created, "owned_by": "dflashd",
                "aliases": list(entry.aliases),
                "status": {"value": status, "reason": reason},
                "meta": {"architecture": text.architecture if text else
                         (workers[0].hello.architecture if workers else None),
                         "n_ctx_train": text.n_ctx_train if text else None,
                         "n_ctx": reg.max_ctx(mid),
                         "n_vocab": text.tokenizer.vocab_size if text and text.tokenizer else None,
                         "workers_healthy": sum(w.healthy for w in workers), "workers": len(workers)}}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(m) for m in sorted(svc.registry.models)]}

    app.add_api_route("/models", list_models, methods=["GET"], include_in_schema=False)

    def speculative_props(mid: str) -> dict | None:
        """The draft settings of a model: the speculative defaults its local workers were started
        with (the workers' own defaults where the config says nothing: draft_max = block size - 1,
        draft_min = 0, draft_margin = 0 = off), and what the workers' HELLOs report.  Workers that
        joined from elsewhere have defaults the router does not know (null)."""
        spec = next((m for m in svc.config.models if m.id == mid), None)
        hellos = [w.hello.draft for w in svc.registry.workers.values() if w.model == mid and w.hello.draft is not None]
        local = spec is not None and spec.draft is not None and bool(spec.workers)
        if not local and not hellos:
            return None
        block = max((d.block_size for d in hellos if d.block_size is not None), default=None)
        draft_max = spec.draft_max if local else None
        if local and draft_max is None and block is not None:
            draft_max = block - 1
        return {"draft": str(spec.draft) if local else None, "draft_models": sorted({d.model_id for d in hellos}),
                "block_size": block, "draft_max": draft_max,
                "draft_min": (spec.draft_min or 0) if local else None,
                "draft_margin": (spec.draft_margin or 0.0) if local else None}

    @app.get("/props")
    async def props():
        reg = svc.registry
        s = svc.config.server
        models = []
        for mid in sorted(reg.models):
            entry = reg.models[mid]
            card = model_card(mid)
            card["default_generation_settings"] = (entry.sampling or SamplingParams()).to_dict()
            card["chat_template"] = entry.text.template.source if entry.text and entry.text.template else None
            card["drafts"] = sorted({w.hello.draft.model_id for w in reg.workers.values()
                                     if w.model == mid and w.hello.draft is not None})
            card["speculative"] = speculative_props(mid)
            models.append(card)
        return {"build_info": f"dflashd {VERSION}", "uptime_s": time.time() - svc.started_at,
                "worker_endpoint": svc.hub.endpoint, "n_predict": s.n_predict,
                "admission_timeout_s": s.admission_timeout_s, "max_attempts": s.max_attempts,
                "max_inflight_per_worker": s.max_inflight_per_worker,
                "api_key_required": bool(s.api_keys), "log_prompts": s.log_prompts,
                "models": models, "workers": [w.describe() for w in sorted(reg.workers.values(),
                                                                           key=lambda w: w.worker_id)]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(svc.metrics.render(svc.registry, svc.dispatcher),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- OpenAI chat -----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        t0 = time.perf_counter()
        if body.n not in (None, 1):
            raise ApiError(400, "n > 1 is not supported", code="unsupported_parameter", param="n")
        if body.logprobs:
            raise ApiError(400, "logprobs are not supported", code="unsupported_parameter", param="logprobs")
        if body.response_format is not None and body.response_format.type != "text":
            raise ApiError(400, f"response_format {body.response_format.type!r} is not supported (no constrained "
                           f"decoding)", code="unsupported_parameter", param="response_format")
        entry = svc.model_for(body.model)
        try:
            messages = normalize_messages([m.model_dump(exclude_none=True) for m in body.messages])
        except ChatError as e:
            raise ApiError(400, str(e), code="unsupported_content", param="messages") from None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
        if choice not in (None, "auto", "none") and not tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        thinking = body.enable_thinking
        kwargs = dict(body.chat_template_kwargs or {})
        if "enable_thinking" in kwargs:
            if not isinstance(kwargs["enable_thinking"], bool):
                raise ApiError(400, "chat_template_kwargs.enable_thinking must be a boolean",
                               param="chat_template_kwargs.enable_thinking")
            thinking = kwargs.pop("enable_thinking") if thinking is None else thinking
            kwargs.pop("enable_thinking", None)
        split = body.reasoning_format != "none"
        prompt, parse_tools, in_reasoning, forced, ids = await _off_loop(
            svc.chat_prompt, entry, messages, tools, choice, thinking, kwargs, split)
        rid = "chatcmpl-" + secrets.token_hex(12)
        svc.log_prompt(rid, prompt)
        job = svc.new_job(entry, rid, ids,
                          max_tokens=svc._max_tokens(body.max_completion_tokens, body.max_tokens, body.n_predict),
                          sampling=svc.sampling_for(entry, body, _SAMPLING_NAMES), stops=_stops(body.stop),
                          speculative=svc.speculative_for(body), restartable=not body.stream)
        prep = Prepared("chat", entry, rid, job, t0, parse_tools, in_reasoning, split, forced, job.stop)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            resp = await svc.open_stream(request, prep, _OpenAIChatStream(rid, entry.id, include_usage))
            svc.metrics.request("chat", entry.id, 200)
            resp.headers["X-Request-Id"] = rid
            return resp
        out = await svc.collect(request, prep)
        p = out.parsed
        message: dict[str, Any] = {"role": "assistant", "content": p.content if (p.content or not p.tool_calls) else None}
        if p.reasoning:
            message["reasoning_content"] = p.reasoning
        if p.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in p.tool_calls]
        svc.metrics.request("chat", entry.id, 200)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": entry.id,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_openai(out, len(p.tool_calls))}],
            "usage": openai_usage(out.done), "timings": llama_timings(out.done),
            "system_fingerprint": f"dflashd-{VERSION}",
        }, headers={"X-Request-Id": rid, "X-Worker-Id": out.worker_id})

    app.add_api_route("/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)

    # ---- OpenAI completions ----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.perf_counter()
        for name, bad in (("n", body.n not in (None, 1)), ("best_of", body.best_of not in (None, 1)),
                          ("echo", bool(body.echo)), ("suffix", body.suffix is not None),
                          ("logprobs", body.logprobs not in (None, 0))):
            if bad:
                raise ApiError(400, f"{name} is not supported", code="unsupported_parameter", param=name)
        entry = svc.model_for(body.model)
        rid = "cmpl-" + secrets.token_hex(12)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            svc.log_prompt(rid, prompt)
            ids = await _off_loop(svc._prompt_ids, entry, prompt)
        else:
            ids = np.asarray(prompt, dtype=np.int32)
            vocab = entry.text.tokenizer.vocab_size if entry.text and entry.text.tokenizer else None
            if vocab is not None and int(ids.max()) >= vocab:
                raise ApiError(400, f"prompt holds a token id >= the vocabulary size {vocab}", param="prompt")
        job = svc.new_job(entry, rid, ids, max_tokens=svc._max_tokens(body.max_tokens, body.n_predict),
                          sampling=svc.sampling_for(entry, body, _SAMPLING_NAMES), stops=_stops(body.stop),
                          speculative=svc.speculative_for(body), restartable=not body.stream)
        prep = Prepared("completions", entry, rid, job, t0, split_reasoning=False, stops=job.stop)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            resp = await svc.open_stream(request, prep, _OpenAICompletionStream(rid, entry.id, include_usage))
            svc.metrics.request("completions", entry.id, 200)
            resp.headers["X-Request-Id"] = rid
            return resp
        out = await svc.collect(request, prep)
        svc.metrics.request("completions", entry.id, 200)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": entry.id,
            "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}],
            "usage": openai_usage(out.done), "timings": llama_timings(out.done),
            "system_fingerprint": f"dflashd-{VERSION}",
        }, headers={"X-Request-Id": rid, "X-Worker-Id": out.worker_id})

    app.add_api_route("/completions", completions, methods=["POST"], include_in_schema=False)

    # ---- Anthropic Messages ----------------------------------------------------------------------------
    def anthropic_prompt(body: Any, entry: ModelEntry) -> tuple[str, bool, bool, str, np.ndarray]:
        try:
            conv = anth.to_chat(body)
            messages = normalize_messages(conv.messages)
        except ChatError as e:
            raise ApiError(400, str(e), param="messages") from None
        if conv.tool_choice not in ("auto", "none") and not conv.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return svc.chat_prompt(entry, messages, conv.tools, conv.tool_choice, conv.enable_thinking, None, True)

    @app.post("/v1/messages")
    async def messages(body: AnthropicMessagesRequest, request: Request):
        t0 = time.perf_counter()
        entry = svc.model_for(body.model)
        prompt, parse_tools, in_reasoning, forced, ids = await _off_loop(anthropic_prompt, body, entry)
        rid = "msg_" + secrets.token_hex(12)
        svc.log_prompt(rid, prompt)
        job = svc.new_job(entry, rid, ids, max_tokens=body.max_tokens,
                          sampling=svc.sampling_for(entry, body, ("temperature", "top_p", "top_k")),
                          stops=tuple(body.stop_sequences or ()), speculative=svc.speculative_for(body),
                          restartable=not body.stream)
        prep = Prepared("messages", entry, rid, job, t0, parse_tools, in_reasoning, True, forced, job.stop)
        if body.stream:
            resp = await svc.open_stream(request, prep, _AnthropicStream(rid, entry.id, int(ids.size)))
            svc.metrics.request("messages", entry.id, 200)
            return resp
        out = await svc.collect(request, prep)
        p = out.parsed
        content: list[dict[str, Any]] = []
        if p.reasoning:
            content.append({"type": "thinking", "thinking": p.reasoning, "signature": ""})
        if p.content:
            content.append({"type": "text", "text": p.content})
        for c in p.tool_calls:
            content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments_object()})
        svc.metrics.request("messages", entry.id, 200)
        return JSONResponse({
            "id": rid, "type": "message", "role": "assistant", "model": entry.id, "content": content,
            "stop_reason": anth.stop_reason(out.finish_reason, bool(p.tool_calls), out.stop_sequence),
            "stop_sequence": out.stop_sequence,
            "usage": {"input_tokens": out.done.usage.prompt_tokens, "output_tokens": out.done.usage.completion_tokens,
                      "cache_read_input_tokens": out.done.usage.cached_tokens},
            "timings": llama_timings(out.done),
        }, headers={"X-Request-Id": rid, "X-Worker-Id": out.worker_id})

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: AnthropicCountTokensRequest):
        entry = svc.model_for(body.model)
        n = int((await _off_loop(anthropic_prompt, body, entry))[4].size)
        svc.metrics.request("count_tokens", entry.id, 200)
        return {"input_tokens": n}

    app.add_api_route("/messages", messages, methods=["POST"], include_in_schema=False)
    app.add_api_route("/messages/count_tokens", count_tokens, methods=["POST"], include_in_schema=False)

    wrapped = Gate(app, api_keys=svc.config.server.api_keys, max_body_bytes=svc.config.server.max_body_bytes,
                   metrics=svc.metrics)
    wrapped.fastapi = app  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]


def _endpoint(path: str) -> str:
    p = path[3:] if path.startswith("/v1/") else path
    return {"/chat/completions": "chat", "/completions": "completions", "/messages": "messages",
            "/messages/count_tokens": "count_tokens"}.get(p, "other")
