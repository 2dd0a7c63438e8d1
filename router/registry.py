"""Workers and models the router knows, and the ZeroMQ hub through which workers join.

A worker becomes routable when it sends HELLO (PROTOCOL.md §3): its identity frame, architecture,
model id, backend/device and capacity go into a `WorkerRecord`.  Every frame from it proves it alive;
a worker silent for `liveness × interval`, or one that sends WORKER_DEAD, or whose process the
supervisor saw exit, is marked unhealthy and not routed to until it says HELLO again.  Marking a
worker unhealthy returns the GENERATE ids it had in flight, so the dispatcher can retry or fail them.

Requests name a model (`ModelEntry`: the id clients send, its aliases, and the `ModelText` read
from its GGUF file); `Registry.pick` chooses, among the model's healthy workers whose context fits
and which have a free in-flight slot, the least loaded one (least recently used on ties, which
spreads a burst over equal workers).

`WorkerHub` owns the ROUTER socket on the asyncio loop: it receives and validates frames, answers
what the protocol says the router answers (ERROR unsupported_version / bad_message for a bad HELLO,
ERROR unknown_worker for frames from an identity without HELLO), sends heartbeats, expires silent
workers, and hands request-bound messages (TOKENS, DONE, ERROR, ...) to the dispatcher.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq
import zmq.asyncio

from protocol.framing import decode, encode, router_socket
from protocol.messages import (
    PROTOCOL_VERSION,
    ROUTER_ACCEPTS,
    ErrorCode,
    ErrorMessage,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    WorkerDead,
)
from router.chat import ModelText

__all__ = ["WorkerRecord", "ModelEntry", "Registry", "WorkerHub", "MODEL_STATUSES"]

log = logging.getLogger("dflashd.router")

MODEL_STATUSES = ("loading", "ready", "failed")


@dataclass
class WorkerRecord:
    worker_id: str
    identity: bytes
    model: str  # the catalogue id requests are routed on
    hello: Hello
    incarnation: int  # +1 per HELLO: a restarted worker is a new incarnation
    registered_at: float
    last_seen: float
    healthy: bool = True
    unhealthy_reason: str | None = None
    inflight: set[str] = field(default_factory=set)  # GENERATE ids sent and not yet ended
    load_active: int = 0  # from the worker's heartbeats
    load_queued: int = 0
    last_pick: float = 0.0
    requests_total: int = 0
    failures_total: int = 0

    @property
    def n_ctx(self) -> int:
        return self.hello.capacity.n_ctx

    def describe(self) -> dict[str, Any]:
        h = self.hello
        return {
            "worker_id": self.worker_id, "model": self.model, "model_id": h.model_id,
            "architecture": h.architecture, "backend": h.backend, "device": h.device,
            "n_ctx": h.capacity.n_ctx, "n_slots": h.capacity.n_slots, "memory_bytes": h.capacity.memory_bytes,
            "draft": None if h.draft is None else {"model_id": h.draft.model_id, "architecture": h.draft.architecture,
                                                   "block_size": h.draft.block_size},
            "pid": h.pid, "hostname": h.hostname, "healthy": self.healthy,
            "unhealthy_reason": self.unhealthy_reason, "inflight": len(self.inflight),
            "active": self.load_active, "queued": self.load_queued,
            "requests_total": self.requests_total, "failures_total": self.failures_total,
        }


@dataclass
class ModelEntry:
    id: str
    aliases: tuple[str, ...] = ()
    text: ModelText | None = None
    # Local (supervised) worker states, kept up to date by the supervisor: worker_id -> one of
    # "starting", "ready", "backoff", "failed".  Empty for a model served only by remote workers.
    local_workers: dict[str, str] = field(default_factory=dict)
    failure: str | None = None  # the last reason a local worker failed (for /v1/models)
    sampling: Any = None  # daemons.sampling.SamplingParams defaults for this model
    created: int = field(default_factory=lambda: int(time.time()))


class Registry:
    def __init__(self, *, liveness_s: float = 3.0, max_inflight: int = 2):
        self.liveness_s = liveness_s
        self.max_inflight = max_inflight
        self.workers: dict[str, WorkerRecord] = {}
        self._by_identity: dict[bytes, str] = {}
        self.models: dict[str, ModelEntry] = {}
        self._names: dict[str, str] = {}  # id or alias -> id
        self._hello_names: dict[str, str] = {}  # model file stem -> id (for HELLO.model_id)
        self.expected: dict[str, str] = {}  # worker_id -> model id, for workers the supervisor starts
        self._incarnation = itertools.count(1)
        self._listeners: list[Callable[[], None]] = []

    # ---- models ------------------------------------------------------------------------------------
    def add_model(self, entry: ModelEntry) -> None:
        self.models[entry.id] = entry
        for name in (entry.id, *entry.aliases):
            self._names[name] = entry.id
        if entry.text is not None and entry.text.path is not None:
            # a worker names its model after the file (WorkerConfig.model_alias default): match that too
            self._hello_names.setdefault(entry.text.path.stem, entry.id)

    def resolve(self, name: str | None) -> ModelEntry | None:
        """The model a request names: an id or alias; with a single model, any name (as
        llama-server, which serves its one model whatever the client calls it)."""
        if name is not None and name in self._names:
            return self.models[self._names[name]]
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        return None

    def model_status(self, model_id: str) -> tuple[str, str | None]:
        """(status, reason): ready when a healthy worker serves it; failed when every local worker
        was given up; loading otherwise (starting, restarting, or waiting for a remote worker)."""
        entry = self.models[model_id]
        if any(w.healthy for w in self.workers.values() if w.model == model_id):
            return "ready", None
        states = list(entry.local_workers.values())
        if states and all(s == "failed" for s in states):
            return "failed", entry.failure or "every worker failed to start"
        if states and any(s == "backoff" for s in states) and entry.failure:
            return "loading", f"restarting after: {entry.failure}"
        return "loading", "waiting for a worker to load the model" if states else "waiting for a worker to join"

    # ---- change notification -------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def _changed(self) -> None:
        for cb in self._listeners:
            cb()

    # ---- workers -------------------------------------------------------------------------------------
    def by_identity(self, identity: bytes) -> WorkerRecord | None:
        wid = self._by_identity.get(identity)
        return self.workers.get(wid) if wid is not None else None

    def register(self, identity: bytes, hello: Hello, now: float) -> tuple[WorkerRecord, list[str]]:
        """Add or renew a worker.  Returns it and the GENERATE ids its previous incarnation had in
        flight (a worker says HELLO again only after a restart or after losing the router: those
        requests are gone either way)."""
        model = self.expected.get(hello.worker_id) or self._hello_names.get(hello.model_id) \
            or self._names.get(hello.model_id) or hello.model_id
        if model not in self.models:
            # a remote worker for a model the router has no file for: listed and routable, but
            # without a chat template or tokenizer in the router
            self.add_model(ModelEntry(id=model))
        lost: list[str] = []
        old = self.workers.get(hello.worker_id)
        if old is not None:
            lost = sorted(old.inflight)
            old.inflight.clear()
            self._by_identity.pop(old.identity, None)
        rec = WorkerRecord(worker_id=hello.worker_id, identity=identity, model=model, hello=hello,
                           incarnation=next(self._incarnation), registered_at=now, last_seen=now)
        if old is not None:
            rec.requests_total, rec.failures_total = old.requests_total, old.failures_total
        self.workers[hello.worker_id] = rec
        self._by_identity[identity] = hello.worker_id
        self._changed()
        return rec, lost

    def seen(self, rec: WorkerRecord, now: float, load: Any = None) -> None:
        rec.last_seen = now
        if load is not None:
            rec.load_active, rec.load_queued = load.active, load.queued

    def mark_unhealthy(self, worker_id: str, reason: str) -> list[str]:
        """Stop routing to a worker until its next HELLO; returns its in-flight GENERATE ids."""
        rec = self.workers.get(worker_id)
        if rec is None:
            return []
        lost = sorted(rec.inflight)
        rec.inflight.clear()
        if rec.healthy:
            rec.healthy = False
            rec.unhealthy_reason = reason
            rec.failures_total += 1
            log.warning("worker %s unhealthy: %s%s", worker_id, reason,
                        f" ({len(lost)} request(s) in flight)" if lost else "")
        self._changed()
        return lost

    def remove(self, worker_id: str) -> None:
        rec = self.workers.pop(worker_id, None)
        if rec is not None:
            self._by_identity.pop(rec.identity, None)
            self._changed()

    def worker_by_pid(self, pid: int) -> WorkerRecord | None:
        for rec in self.workers.values():
            if rec.hello.pid == pid:
                return rec
        return None

    def expire(self, now: float) -> list[tuple[WorkerRecord, list[str]]]:
        out = []
        for rec in list(self.workers.values()):
            if rec.healthy and now - rec.last_seen > self.liveness_s:
                lost = self.mark_unhealthy(rec.worker_id, f"no heartbeat for {now - rec.last_seen:.1f} s")
                out.append((rec, lost))
        return out

    def healthy_workers(self, model_id: str | None = None) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.healthy and (model_id is None or w.model == model_id)]

    def pick(self, model_id: str, min_ctx: int, exclude: set[tuple[str, int]] = frozenset()) -> WorkerRecord | None:
        """The least-loaded healthy worker of `model_id` with n_ctx >= min_ctx and a free in-flight
        slot, avoiding (worker_id, incarnation) pairs in `exclude`; None when there is none now."""
        best = None
        best_key = None
        for w in self.workers.values():
            if not w.healthy or w.model != model_id or w.n_ctx < min_ctx:
                continue
            if (w.worker_id, w.incarnation) in exclude or len(w.inflight) >= self.max_inflight:
                continue
            key = (len(w.inflight), w.load_active + w.load_queued, w.last_pick)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best

    def max_ctx(self, model_id: str) -> int | None:
        ctxs = [w.n_ctx for w in self.workers.values() if w.model == model_id and w.healthy]
        return max(ctxs) if ctxs else None

    def acquire(self, rec: WorkerRecord, gen_id: str, now: float) -> None:
        rec.inflight.add(gen_id)
        rec.last_pick = now
        rec.requests_total += 1

    def release(self, worker_id: str, gen_id: str) -> None:
        rec = self.workers.get(worker_id)
        if rec is not None and gen_id in rec.inflight:
            rec.inflight.discard(gen_id)
            self._changed()


class WorkerHub:
    """The router's ROUTER socket on the asyncio loop.  `on_request_message(rec, msg)` receives
    TOKENS / DONE / ERROR / control replies that name a request; `on_lost(ids, reason)` is told
    which GENERATE ids died with a worker."""

    def __init__(self, registry: Registry, endpoint: str, *, heartbeat_interval_s: float = 1.0,
                 on_request_message: Callable[[WorkerRecord, Message], None],
                 on_lost: Callable[[list[str], str], None]):
        self.registry = registry
        self.requested_endpoint = endpoint
        self.endpoint: str | None = None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.on_request_message = on_request_message
        self.on_lost = on_lost
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._hb_seq = 0
        self._unknown_answered: dict[bytes, float] = {}
        self.frames_in = 0
        self.bad_frames = 0

    def start(self) -> None:
        """Bind the socket (synchronously, so a bad endpoint fails at startup) and start the loops."""
        self._ctx = zmq.asyncio.Context()
        try:
            self._sock = router_socket(self._ctx, self.requested_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)  # closes the socket whose bind failed (term() would wait for it)
            raise OSError(f"cannot bind the worker socket {self.requested_endpoint}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._recv_loop(), name="hub-recv"),
                       loop.create_task(self._heartbeat_loop(), name="hub-heartbeat")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = None

    # ---- sending -----------------------------------------------------------------------------------
    def send(self, identity: bytes, msg: Message) -> bool:
        """Send without waiting; False when the worker is gone (ROUTER_MANDATORY) or its queue is full."""
        if self._sock is None:
            return False
        frames = encode(msg)
        frames.insert(0, identity)
        try:
            fut = self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        if fut.done():
            return fut.exception() is None
        return True

    def send_error(self, identity: bytes, code: ErrorCode, message: str) -> None:
        self.send(identity, ErrorMessage.make(code, message))

    # ---- receiving ---------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        burst = 0
        while True:
            frames = await sock.recv_multipart(copy=False)
            self.frames_in += 1
            burst += 1
            if burst >= 64:
                # A ready message makes the await above return without yielding to the loop: under a
                # steady stream of TOKENS this loop would starve the HTTP side and the heartbeats.
                burst = 0
                await asyncio.sleep(0)
            identity = frames[0].bytes
            try:
                msg = decode(frames[1:], accept=ROUTER_ACCEPTS)
            except ProtocolError as e:
                self._bad_frame(identity, frames, e)
                continue
            try:
                self._handle(identity, msg)
            except Exception:  # a bug handling one message must not stop the hub
                log.exception("error handling %s from %r", msg.TYPE, identity)

    def _bad_frame(self, identity: bytes, frames: list, e: ProtocolError) -> None:
        self.bad_frames += 1
        msg_type = frames[1].bytes[:32] if len(frames) > 1 else b""
        if e.code == ErrorCode.UNSUPPORTED_VERSION:
            log.warning("worker %r speaks another protocol version: %s", identity, e.message)
            self.send_error(identity, ErrorCode.UNSUPPORTED_VERSION,
                            f"{e.message}; this router speaks version {PROTOCOL_VERSION}")
        elif msg_type == b"HELLO":
            log.warning("bad HELLO from %r: %s", identity, e.message)
            self.send_error(identity, e.code if e.code != ErrorCode.INTERNAL else ErrorCode.BAD_MESSAGE, e.message)
        else:  # PROTOCOL.md: the router logs and drops undecodable frames (no error loops)
            log.warning("dropped an undecodable frame from %r: %s", identity, e)

    def _handle(self, identity: bytes, msg: Message) -> None:
        now = time.monotonic()
        reg = self.registry
        if isinstance(msg, Hello):
            if msg.worker_id.encode("ascii") != identity:
                self.send_error(identity, ErrorCode.BAD_MESSAGE,
                                f"HELLO.worker_id {msg.worker_id!r} differs from the socket identity {identity!r}")
                return
            rec, lost = reg.register(identity, msg, now)
            self._unknown_answered.pop(identity, None)
            log.info("worker %s joined: model %s (%s), %s on %s, n_ctx %d%s", msg.worker_id, rec.model,
                     msg.architecture, msg.backend, msg.device, msg.capacity.n_ctx,
                     f", draft {msg.draft.model_id}" if msg.draft else "")
            if lost:
                self.on_lost(lost, f"worker {msg.worker_id} restarted")
            return
        rec = reg.by_identity(identity)
        if rec is None or not rec.healthy:
            # Unknown, or quarantined until it says HELLO again: tell it so (once per interval).
            if isinstance(msg, ErrorMessage):
                return  # nobody answers an ERROR with an ERROR
            last = self._unknown_answered.get(identity, -1e9)
            if now - last >= self.heartbeat_interval_s:
                self._unknown_answered[identity] = now
                self.send_error(identity, ErrorCode.UNKNOWN_WORKER, "send HELLO first")
            return
        reg.seen(rec, now, getattr(msg, "load", None) if isinstance(msg, Heartbeat) else None)
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, WorkerDead):
            lost = reg.mark_unhealthy(rec.worker_id, f"worker exited: {msg.code.value}: {msg.reason}")
            if lost:
                self.on_lost(lost, f"worker {rec.worker_id} exited ({msg.code.value}: {msg.reason})")
            return
        if isinstance(msg, ErrorMessage) and msg.request_id is None:
            log.warning("worker %s reports %s: %s", rec.worker_id, msg.code.value, msg.message)
            return
        self.on_request_message(rec, msg)

    # ---- liveness ----------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            self.beat()

    def beat(self) -> None:
        now = time.monotonic()
        self._hb_seq += 1
        for rec in list(self.registry.workers.values()):
            if rec.healthy:
                if not self.send(rec.identity, Heartbeat(worker_id=rec.worker_id, seq=self._hb_seq, time=time.time())):
                    lost = self.registry.mark_unhealthy(rec.worker_id, "unreachable (socket gone)")
                    if lost:
                        self.on_lost(lost, f"worker {rec.worker_id} became unreachable")
        for rec, lost in self.registry.expire(now):
            if lost:
                self.on_lost(lost, f"worker {rec.worker_id} stopped answering ({rec.unhealthy_reason})")

    def worker_process_exited(self, worker_id: str, how: str) -> None:
        """The supervisor saw a local worker's process end: faster than waiting for heartbeats."""
        lost = self.registry.mark_unhealthy(worker_id, f"process {how}")
        if lost:
            self.on_lost(lost, f"worker {worker_id} {how}")
