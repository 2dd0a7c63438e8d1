"""The framed transport: a worker's DEALER socket connected to the router's ROUTER (PROTOCOL.md).

Threads:

- the **I/O thread** (the caller of ``ZmqWorker.serve``, normally the main thread) owns the DEALER
  socket: it decodes incoming frames and hands them to the core (CANCEL, STATS and SHUTDOWN act at
  once, even mid-generation), answers undecodable frames with ERROR (never with a crash), forwards
  the compute thread's replies, sends a HEARTBEAT every interval whatever the compute loop is doing,
  and watches that loop: a step running longer than ``stall_timeout_s`` means the worker is hung, so
  it reports WORKER_DEAD and exits instead of heartbeating for a loop that never returns;
- the **compute thread** runs ``WorkerCore.run``.  Its replies reach the I/O thread through an
  ``inproc`` PUSH/PULL pair (ZeroMQ sockets are not thread-safe), frames passed without copying.

HELLO goes out only after the weights are loaded.  A fatal error (model load failure, a crashed or
stalled compute loop) sends WORKER_DEAD before the process exits; SHUTDOWN and SIGTERM send
WORKER_DEAD with code ``shutdown``.

``HeartbeatMonitor`` (from ``protocol.liveness``) is the peer-side liveness tracker the router reuses.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import signal
import threading
import time
from typing import Any

import zmq

from daemons.worker import (
    WorkerConfig,
    WorkerCore,
    WorkerStartupError,
    create_runtime,
    default_worker_id,
)
from protocol import framing
from protocol.liveness import HeartbeatMonitor
from protocol.messages import (
    WORKER_ACCEPTS,
    ErrorCode,
    ErrorMessage,
    Heartbeat,
    Message,
    ProtocolError,
    WorkerDead,
    one_line,
)

__all__ = ["ZmqWorker", "HeartbeatMonitor", "run_zmq_worker", "EXIT_OK", "EXIT_FATAL", "EXIT_STARTUP"]

log = logging.getLogger("dflashd.worker")

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_STARTUP = 2
_IO_SLICE_S = 0.1  # the I/O loop wakes at least this often to check signals and the compute thread
_MAX_RX_BURST = 256  # frames handled per wake-up before heartbeats and the outbox get a turn
_inproc_ids = itertools.count()


class ZmqWorker:
    """One worker process's framed transport around a ``WorkerCore`` (see the module docstring)."""

    def __init__(self, config: WorkerConfig, endpoint: str, ctx: zmq.Context | None = None):
        self.config = config
        self.endpoint = endpoint
        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else zmq.Context()
        self.core: WorkerCore | None = None
        self.worker_id = config.worker_id or ""
        self._dealer: zmq.Socket | None = None
        self._pull: zmq.Socket | None = None
        self._inproc = f"inproc://dflashd-worker-out-{os.getpid()}-{next(_inproc_ids)}"
        self._io_thread = threading.get_ident()
        self._local = threading.local()
        self._compute: threading.Thread | None = None
        self._compute_done = threading.Event()
        self._fatal: tuple[ErrorCode, str] | None = None
        self._signal: int | None = None
        self._router_heartbeats = False  # the router heartbeats us: its silence then means it is gone
        self._last_router_rx = time.monotonic()
        self._router_lost = False
        self._last_hello = 0.0
        self.frames_rejected = 0

    # -- sending ------------------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        """Send ``msg`` to the router; callable from any thread (the core's sink)."""
        frames = framing.encode(msg)
        if threading.get_ident() == self._io_thread:
            self._send_frames(frames, msg.TYPE)
            return
        push = getattr(self._local, "push", None)
        if push is None:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 100_000)
            push.connect(self._inproc)
            self._local.push = push
        push.send_multipart(frames, copy=False)

    def _send_frames(self, frames: list[Any], what: str) -> None:
        try:
            self._dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            # Tens of thousands of frames queued: the router is gone or far behind.  Dropping keeps
            # the I/O thread (and so the heartbeats and CANCEL handling) alive.
            log.warning("router not reading: dropped an outgoing %s frame", what)

    def _forward_outbox(self) -> None:
        while True:
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) == 1 and len(frames[0]) == 0:
                continue  # the compute thread's wake-up call
            self._send_frames(frames, bytes(frames[0].buffer[:32]).decode("ascii", "replace"))

    def _wake_io(self) -> None:
        """From the compute thread: make the I/O loop look at the compute thread's state now."""
        try:
            push = getattr(self._local, "push", None)
            if push is None:
                push = self.ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.connect(self._inproc)
                self._local.push = push
            push.send_multipart([b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- lifecycle ----------------------------------------------------------------------------------
    def serve(self) -> int:
        """Connect, load, HELLO, serve until SHUTDOWN / a signal / a fatal error; the exit status."""
        self._io_thread = threading.get_ident()
        runtime = None
        try:
            runtime = create_runtime(self.config)
        except WorkerStartupError as e:
            failure = e
        else:
            failure = None
        if not self.worker_id:
            arch = runtime.architecture if runtime is not None else "worker"
            self.worker_id = default_worker_id(arch, self.config.device)
        self._dealer = framing.dealer_socket(self.ctx, self.endpoint, self.worker_id)
        self._dealer.setsockopt(zmq.SNDHWM, 100_000)
        self._dealer.setsockopt(zmq.RCVHWM, 100_000)
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        self._pull.bind(self._inproc)
        try:
            if failure is None:
                self.core = WorkerCore(dataclasses.replace(self.config, worker_id=self.worker_id), runtime, self.send)
                try:
                    self.core.start()
                except WorkerStartupError as e:
                    failure = e
            if failure is not None:
                log.error("cannot start: %s", failure)
                self._dead(failure.code, str(failure))
                return EXIT_STARTUP
            self._install_signals()
            self.send(self.core.hello())
            self._last_hello = time.monotonic()
            log.info("worker %s connected to %s (pid %d)", self.worker_id, self.endpoint, os.getpid())
            self._compute = threading.Thread(target=self._compute_main, name="dflashd-compute", daemon=True)
            self._compute.start()
            return self._io_loop()
        finally:
            self._teardown()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum, frame):  # only a flag: the I/O loop acts on it
            self._signal = signum

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _compute_main(self) -> None:
        try:
            self.core.run()
        except BaseException as e:  # noqa: BLE001 - anything escaping the loop is fatal
            log.exception("compute loop crashed")
            code = ErrorCode.OUT_OF_MEMORY if isinstance(e, MemoryError) else ErrorCode.INTERNAL
            self._fatal = (code, f"compute loop crashed: {type(e).__name__}: {e}")
        finally:
            self._compute_done.set()
            self._wake_io()

    def _dead(self, code: ErrorCode, reason: str) -> None:
        try:
            self._send_frames(framing.encode(WorkerDead(worker_id=self.worker_id, code=code,
                                                        reason=one_line(reason))), "WORKER_DEAD")
        except zmq.ZMQError as e:
            log.error("could not send WORKER_DEAD: %s", e)

    def _teardown(self, timeout_s: float = 5.0) -> None:
        """Close the sockets and, when the context is ours, terminate it: that is what waits for
        queued frames (WORKER_DEAD) to leave, up to the dealer's linger.  Bounded by ``timeout_s``
        so a stuck compute thread's socket cannot hold the exit."""
        for sock in (self._pull, self._dealer):
            if sock is not None:
                sock.close()  # the dealer keeps its linger (framing.dealer_socket)
        self._pull = self._dealer = None
        if self._own_ctx:
            # destroy() also closes the compute thread's inproc socket (linger 0), then terminates.
            t = threading.Thread(target=self.ctx.destroy, kwargs={"linger": None}, daemon=True)
            t.start()
            t.join(timeout_s)

    # -- the I/O loop -------------------------------------------------------------------------------
    def _io_loop(self) -> int:
        cfg, core = self.config, self.core
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        interval = cfg.heartbeat_interval_s
        next_hb = time.monotonic() + interval
        shutting = False
        while True:
            now = time.monotonic()
            timeout = max(0.0, min(next_hb - now, _IO_SLICE_S))
            events = dict(poller.poll(timeout * 1000))
            if self._pull in events:
                self._forward_outbox()
            if self._dealer in events:
                self._receive_burst()
            now = time.monotonic()
            if now >= next_hb:
                self._heartbeat(now)
                next_hb = max(next_hb + interval, now)  # no burst of catch-up beats after a stall
            if self._signal is not None and not shutting:
                log.info("signal %d: shutting down", self._signal)
                shutting = True
                core.shutdown(drain=False)
            busy = core.busy_since
            if cfg.stall_timeout_s and busy is not None and now - busy > cfg.stall_timeout_s:
                reason = f"compute loop stalled: one step has run for {now - busy:.0f} s (stall timeout {cfg.stall_timeout_s:g} s)"
                log.error(reason)
                self._forward_outbox()
                self._dead(ErrorCode.INTERNAL, reason)
                self._teardown()
                # The stuck step cannot be interrupted; leave without waiting for it.
                os._exit(EXIT_FATAL)
            if self._compute_done.is_set():
                self._forward_outbox()
                if self._fatal is not None:
                    self._dead(*self._fatal)
                    return EXIT_FATAL
                self._dead(ErrorCode.SHUTDOWN, "shutdown" if self._signal is None else f"signal {self._signal}")
                return EXIT_OK

    def _heartbeat(self, now: float) -> None:
        core, cfg = self.core, self.config
        timeout = cfg.heartbeat_interval_s * cfg.heartbeat_liveness
        if self._router_heartbeats and not self._router_lost and now - self._last_router_rx > timeout:
            self._router_lost = True
            n = core.cancel_all()
            log.warning("router silent for %.1f s: cancelled %d request(s), re-sending HELLO every interval",
                        now - self._last_router_rx, n)
        if self._router_lost:
            self.send(core.hello())
        self.send(core.heartbeat())

    def _receive_burst(self) -> None:
        for _ in range(_MAX_RX_BURST):
            try:
                frames = self._dealer.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_router_rx = time.monotonic()
            if self._router_lost:
                self._router_lost = False
                log.info("router is back")
            try:
                self._handle(frames)
            except Exception as e:  # a bug handling one frame must not take the worker down
                log.exception("internal error handling a frame")
                self.send(ErrorMessage.make(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = framing.decode(frames, accept=WORKER_ACCEPTS)
        except ProtocolError as e:
            self.frames_rejected += 1
            head = bytes(frames[0].buffer[:40]) if frames else b""
            if head == b"ERROR":  # nobody answers an ERROR with an ERROR
                log.warning("dropped an undecodable ERROR frame: %s", e)
                return
            log.warning("rejected frame %r (%d parts): %s", head, len(frames), e)
            self.send(ErrorMessage.from_exception(e))
            return
        if isinstance(msg, Heartbeat):
            self._router_heartbeats = True
            return
        if isinstance(msg, ErrorMessage):
            if msg.code == ErrorCode.UNKNOWN_WORKER and msg.request_id is None:
                now = time.monotonic()
                if now - self._last_hello >= self.config.heartbeat_interval_s / 2:
                    self._last_hello = now
                    log.info("router does not know this worker: sending HELLO")
                    self.send(self.core.hello())
            else:
                log.warning("router reports %s%s: %s", msg.code.value,
                            f" for {msg.request_id}" if msg.request_id else "", msg.message)
            return
        self.core.submit(msg)


def run_zmq_worker(config: WorkerConfig, endpoint: str) -> int:
    """Serve over ZeroMQ until shutdown; returns the process exit status."""
    return ZmqWorker(config, endpoint).serve()
