"""The life of one generation request between the HTTP handler and a worker.

`Dispatcher.run(job)` is an async generator of events: `Chunk` (token ids and text from a TOKENS
message), `Restart` (output so far is void: the request moved to another worker) and finally
`Finished` (the DONE message).  Failures are `DispatchError`s with the HTTP status they stand for.

The rules (issue 5, "Dispatch"):

* A request waits in the router (up to `admission_timeout_s`) for a healthy worker of its model with
  a free in-flight slot; the least loaded one gets it.  No worker in time is a 503.
* A worker that dies, becomes unreachable or refuses with a transient error *before anything was
  delivered to the client* costs nothing visible: the request is sent to another worker (at most
  `max_attempts` workers in all).  A non-streaming request has delivered nothing until it ends, so
  it is retried even after tokens (`job.restartable`; the consumer drops what it had on `Restart`).
* After the first delivered token, a dead worker is a `WorkerFailed` (502) that the HTTP layer turns
  into an error event: never a silently truncated success.  The worker itself is marked unhealthy
  by the registry until it says HELLO again.
* A consumer that stops iterating (client disconnect) or is cancelled makes the generator's
  `finally` send CANCEL for the running GENERATE.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from protocol.messages import (
    Cancel,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Message,
    SamplingParams,
    SpeculativeOptions,
    Tokens,
)
from router.registry import Registry, WorkerHub, WorkerRecord

__all__ = ["DispatchError", "NoWorkerAvailable", "WorkerFailed", "RequestRejected", "GenerationJob",
           "Chunk", "Restart", "Finished", "Dispatcher"]

log = logging.getLogger("dflashd.router")


class DispatchError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        if status is not None:
            self.status = status


class NoWorkerAvailable(DispatchError):
    status = 503
    type = "unavailable_error"


class WorkerFailed(DispatchError):
    """The worker failed after the client had received output (or on every attempt)."""
    status = 502
    type = "worker_error"


class RequestRejected(DispatchError):
    """The worker (or the router's context check) refused the request as given: a client error."""
    status = 400
    type = "invalid_request_error"


# Worker errors that say nothing about the request itself: try another worker.
_RETRY_ELSEWHERE = {ErrorCode.MODEL_PARKED, ErrorCode.OUT_OF_MEMORY, ErrorCode.ADAPTER_UNAVAILABLE,
                    ErrorCode.INTERNAL, ErrorCode.PREFILL_FAILED, ErrorCode.DECODE_FAILED,
                    ErrorCode.DECODE_SEED_MISSING, ErrorCode.BACKEND_SPECIFIC, ErrorCode.INCOMPLETE,
                    ErrorCode.CANCELLED, ErrorCode.UNKNOWN_WORKER, ErrorCode.SHUTDOWN}
# Worker errors about the request: the client's to fix.
_CLIENT_ERRORS = {ErrorCode.CONTEXT_OVERFLOW: "context_length_exceeded", ErrorCode.EMPTY_PROMPT: "empty_prompt",
                  ErrorCode.SAMPLING_UNSUPPORTED: "sampling_unsupported", ErrorCode.BAD_MESSAGE: "invalid_value",
                  ErrorCode.TOO_LARGE: "too_large", ErrorCode.BAD_FRAME: "invalid_value",
                  ErrorCode.INVALID_SNAPSHOT_SLOT: "invalid_value", ErrorCode.EMPTY_SLOT: "invalid_value"}


@dataclass
class GenerationJob:
    request_id: str
    model: str  # catalogue id
    n_prompt: int
    max_tokens: int | None  # None: as many as the worker's context leaves
    prompt_ids: np.ndarray | None = None
    prompt_text: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    speculative: SpeculativeOptions | None = None
    restartable: bool = False  # nothing reaches the client before the end (non-streaming)
    n_predict_cap: int = -1  # the server's cap on completion tokens (-1 = none)


@dataclass
class Chunk:
    ids: np.ndarray
    text: str
    worker_id: str


@dataclass
class Restart:
    reason: str


@dataclass
class Finished:
    done: Done
    worker_id: str
    attempts: int


@dataclass
class _Lost:
    reason: str


@dataclass
class _Pending:
    queue: asyncio.Queue
    worker_id: str
    incarnation: int


class Dispatcher:
    def __init__(self, registry: Registry, *, admission_timeout_s: float = 30.0, max_attempts: int = 3):
        self.registry = registry
        self.hub: WorkerHub | None = None
        self.admission_timeout_s = admission_timeout_s
        self.max_attempts = max_attempts
        self._pending: dict[str, _Pending] = {}
        self._waiters: list[asyncio.Future] = []
        self.retries_total = 0
        self.cancels_total = 0
        self.worker_failures_total = 0
        registry.subscribe(self._wake)

    # ---- hub callbacks -----------------------------------------------------------------------------
    def on_request_message(self, rec: WorkerRecord, msg: Message) -> None:
        rid = getattr(msg, "request_id", None)
        pend = self._pending.get(rid) if rid is not None else None
        if pend is None or pend.worker_id != rec.worker_id or pend.incarnation != rec.incarnation:
            return  # a late message for a request that already ended (cancelled, retried elsewhere)
        pend.queue.put_nowait(msg)

    def on_lost(self, gen_ids: list[str], reason: str) -> None:
        for gid in gen_ids:
            pend = self._pending.get(gid)
            if pend is not None:
                pend.queue.put_nowait(_Lost(reason))

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    @property
    def inflight(self) -> int:
        return len(self._pending)

    # ---- admission ---------------------------------------------------------------------------------
    async def _acquire(self, job: GenerationJob, deadline: float, exclude: set[tuple[str, int]]) -> WorkerRecord:
        loop = asyncio.get_running_loop()
        min_ctx = job.n_prompt + (job.max_tokens if job.max_tokens else 1)
        while True:
            rec = self.registry.pick(job.model, min_ctx, exclude)
            if rec is not None:
                return rec
            healthy = self.registry.healthy_workers(job.model)
            if healthy and all(w.n_ctx < min_ctx for w in healthy):
                biggest = max(w.n_ctx for w in healthy)
                raise RequestRejected(
                    f"the prompt ({job.n_prompt} tokens) plus max_tokens ({job.max_tokens or 1}) exceeds the "
                    f"context of every worker for this model ({biggest} tokens)", code="context_length_exceeded")
            status, reason = self.registry.model_status(job.model)
            if status == "failed":
                raise NoWorkerAvailable(f"model {job.model} is unavailable: {reason}", code="model_failed")
            remaining = deadline - loop.time()
            if remaining <= 0:
                if healthy:
                    why = "every worker for it is busy"
                else:
                    why = reason or "no healthy worker"
                raise NoWorkerAvailable(f"no worker for model {job.model} could take the request within "
                                        f"{self.admission_timeout_s:g} s: {why}", code="no_worker")
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass  # re-check: heartbeat expiry does not always notify

    # ---- the request -------------------------------------------------------------------------------
    async def run(self, job: GenerationJob) -> AsyncIterator[Chunk | Restart | Finished]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.admission_timeout_s
        exclude: set[tuple[str, int]] = set()
        attempts = 0
        last_failure: str | None = None
        delivered_any = False  # anything yielded to the consumer, over all attempts
        while True:
            if attempts >= self.max_attempts:
                raise WorkerFailed(f"the request failed on {attempts} worker(s); last: {last_failure}",
                                   code="worker_failed")
            rec = await self._acquire(job, deadline, exclude)
            attempts += 1
            gen_id = f"{job.request_id}.{attempts}"
            max_tokens = job.max_tokens if job.max_tokens is not None else rec.n_ctx - job.n_prompt
            if job.n_predict_cap > 0:
                max_tokens = min(max_tokens, job.n_predict_cap)
            pend = _Pending(asyncio.Queue(), rec.worker_id, rec.incarnation)
            self._pending[gen_id] = pend
            self.registry.acquire(rec, gen_id, time.monotonic())
            ended = False  # DONE/ERROR/loss seen: nothing to cancel
            delivered = False  # this attempt yielded tokens
            retry_reason: str | None = None
            try:
                msg = Generate(request_id=gen_id, max_tokens=max(0, max_tokens), prompt_ids=job.prompt_ids,
                               prompt_text=job.prompt_text, sampling=job.sampling, stop=job.stop,
                               stop_ids=job.stop_ids, speculative=job.speculative)
                assert self.hub is not None
                if not self.hub.send(rec.identity, msg):
                    ended = True
                    lost = self.registry.mark_unhealthy(rec.worker_id, "unreachable (send failed)")
                    self.on_lost([g for g in lost if g != gen_id], f"worker {rec.worker_id} became unreachable")
                    retry_reason = f"worker {rec.worker_id} unreachable"
                backlog: collections.deque = collections.deque()
                while retry_reason is None:
                    if not backlog:
                        backlog.append(await pend.queue.get())
                        while not pend.queue.empty():
                            backlog.append(pend.queue.get_nowait())
                    item = backlog.popleft()
                    if isinstance(item, Tokens):
                        # TOKENS that queued up while the consumer was busy go out as one chunk:
                        # per-event costs (JSON, SSE write) then shrink exactly when they bind.
                        ids, texts = [item.ids], [item.text]
                        while backlog and isinstance(backlog[0], Tokens):
                            more = backlog.popleft()
                            ids.append(more.ids)
                            texts.append(more.text)
                        text = "".join(texts)
                        merged = ids[0] if len(ids) == 1 else np.concatenate(ids)
                        if merged.size or text:
                            delivered = delivered_any = True
                            yield Chunk(merged, text, rec.worker_id)
                    elif isinstance(item, Done):
                        ended = True
                        if item.finish_reason == FinishReason.CANCELLED:
                            # The router did not cancel it (the consumer is still here): the worker
                            # dropped it (lost the router, SHUTDOWN).  Not a success.
                            retry_reason = f"worker {rec.worker_id} cancelled the generation"
                            exclude.add((rec.worker_id, rec.incarnation))
                            continue
                        yield Finished(item, rec.worker_id, attempts)
                        return
                    elif isinstance(item, ErrorMessage):
                        ended = True
                        code = item.code
                        if code == ErrorCode.BUSY and not delivered:
                            # full queue on that worker: wait for a slot anywhere, this try is free
                            if loop.time() > deadline:
                                raise NoWorkerAvailable(f"every worker for model {job.model} stayed busy for "
                                                        f"{self.admission_timeout_s:g} s", code="no_worker")
                            attempts -= 1
                            retry_reason = "busy"
                            await asyncio.sleep(0.05)
                        elif code in _CLIENT_ERRORS and not delivered:
                            raise RequestRejected(f"{item.message or code.value}", code=_CLIENT_ERRORS[code])
                        elif code in _RETRY_ELSEWHERE or code == ErrorCode.BUSY:
                            retry_reason = f"worker {rec.worker_id} failed: {code.value}: {item.message}"
                            exclude.add((rec.worker_id, rec.incarnation))
                        else:
                            raise WorkerFailed(f"worker {rec.worker_id} failed: {code.value}: {item.message}",
                                               code=code.value)
                    elif isinstance(item, _Lost):
                        ended = True
                        self.worker_failures_total += 1
                        retry_reason = item.reason
                        exclude.add((rec.worker_id, rec.incarnation))
                if retry_reason is not None and retry_reason != "busy":
                    last_failure = retry_reason
                    if delivered_any and not job.restartable:
                        raise WorkerFailed(f"{retry_reason}; the response is incomplete",
                                           code="worker_failed")
                    self.retries_total += 1
                    log.warning("request %s: %s; retrying on another worker", job.request_id, retry_reason)
                    if delivered_any:
                        delivered_any = False
                        yield Restart(retry_reason)
            finally:
                self._pending.pop(gen_id, None)
                self.registry.release(rec.worker_id, gen_id)
                if not ended and self.hub is not None:
                    self.cancels_total += 1
                    self.hub.send(rec.identity, Cancel(request_id=gen_id))
