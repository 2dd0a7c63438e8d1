"""The reference-compatible line transport: commands on stdin, replies on stdout, token ids on a
stream fd (PROTOCOL.md §6; ``protocol.stdio`` parses and formats).

It drives the same ``WorkerCore`` as the framed transport: every command becomes the protocol
message it stands for (a generation line becomes GENERATE, ``SNAPSHOT 3`` becomes SNAPSHOT, ...),
so both transports share one code path.  Threads:

- the **reader** (the caller of ``serve``) reads stdin; ``cancel`` acts at once, every other line
  joins a FIFO;
- the **dispatcher** runs that FIFO one command at a time: it submits the message, waits for the
  core's answer and prints the one reply line (and the one ``-1`` on the stream where the command
  kind has one);
- the **compute** thread runs ``WorkerCore.run``; the core's TOKENS go straight to the stream fd.

Logs go to stderr; stdout carries only the ready banner and reply lines.

With a draft (``--draft``) every generation is speculative by default, as in the reference daemon
(the stdio commands carry no per-request options: the worker's ``--draft-max/-min/-margin`` apply),
and its ``ok`` line ends with the speculative counters (``format_spec_fields``).
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
from typing import IO

from daemons.worker import WorkerConfig, WorkerCore, WorkerStartupError, create_runtime
from protocol.messages import (
    Done,
    ErrorCode,
    ErrorMessage,
    FreeSnapshot,
    ListSlots,
    Message,
    Park,
    Parked,
    Slots,
    Snapshot,
    SpecStats,
    Tokens,
    Unpark,
    Unparked,
)
from protocol.stdio import (
    CancelCommand,
    Command,
    CommandError,
    FreeSnapshotCommand,
    GenerateCommand,
    ListSlotsCommand,
    ParkCommand,
    QuitCommand,
    RequestStream,
    SnapshotCommand,
    TokenStream,
    UnparkCommand,
    format_cancel_ok,
    format_err,
    format_freed,
    format_generate_ok,
    format_park_ok,
    format_slots,
    format_snapshot,
    format_unpark_ok,
    parse_command,
    read_prompt_file,
)

__all__ = ["StdioWorker", "run_stdio_worker", "format_spec_fields", "READY_BANNER"]

log = logging.getLogger("dflashd.worker")

READY_BANNER = "[daemon] ready"
_QUIT = object()


class _Refused:
    """A stdin line that did not parse, waiting its turn for its reply."""

    def __init__(self, error: CommandError, snapshot_slot: int | None):
        self.error = error
        self.snapshot_slot = snapshot_slot


def _snapshot_slot_word(line: str) -> int | None:
    """The slot of a ``SNAPSHOT <n> ...`` line whose slot is a number (its failure reply names it)."""
    words = line.split()
    if len(words) >= 2 and words[0] == "SNAPSHOT" and words[1].isdigit() and len(words[1]) <= 18:
        return int(words[1])
    return None


class _Pending:
    """One command waiting for the core's final answer (DONE, ERROR, SLOTS, PARKED, UNPARKED)."""

    def __init__(self, stream: RequestStream | None):
        self.stream = stream
        self.final: Message | None = None
        self.write_failed = False
        self.event = threading.Event()


class StdioWorker:
    def __init__(self, config: WorkerConfig, stream_fd: int | None, stdin: IO[str] | None = None,
                 stdout: IO[str] | None = None):
        self.config = config
        self.stream = TokenStream(stream_fd)
        self.stream_fd = stream_fd
        self.stdin = stdin if stdin is not None else sys.stdin
        self.stdout = stdout if stdout is not None else sys.stdout
        self.core: WorkerCore | None = None
        self._out_lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._commands: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._running_generation: str | None = None  # request id of the generation now running

    # -- output -------------------------------------------------------------------------------------
    def reply(self, line: str) -> None:
        with self._out_lock:
            self.stdout.write(line + "\n")
            self.stdout.flush()

    def _sink(self, msg: Message) -> None:
        """The core's replies (compute or reader thread)."""
        rid = getattr(msg, "request_id", None)
        with self._pending_lock:
            pending = self._pending.get(rid) if rid is not None else None
        if pending is None:
            log.debug("stdio: no command waits for %s %s", msg.TYPE, rid)
            return
        if isinstance(msg, Tokens):
            if pending.stream is not None and not pending.write_failed and msg.ids.size:
                try:
                    pending.stream.write(msg.ids)
                except OSError as e:  # the reader of the stream went away
                    pending.write_failed = True
                    log.error("stream fd %s: %s; cancelling %s", self.stream_fd, e, rid)
                    self.core.cancel(rid)
            return
        pending.final = msg
        pending.event.set()

    # -- lifecycle ----------------------------------------------------------------------------------
    def serve(self) -> int:
        if self.stream_fd is not None:
            try:
                os.fstat(self.stream_fd)
            except OSError as e:
                log.error("--stream-fd %d is not an open file descriptor: %s", self.stream_fd, e.strerror)
                return 2
        try:
            runtime = create_runtime(self.config)
            self.core = WorkerCore(self.config, runtime, self._sink)
            self.core.start()
        except WorkerStartupError as e:
            log.error("cannot start: %s", e)
            return 2
        compute = threading.Thread(target=self._compute_main, name="dflashd-compute", daemon=True)
        compute.start()
        dispatcher = threading.Thread(target=self._dispatch_main, name="dflashd-stdio", daemon=True)
        dispatcher.start()
        self.reply(READY_BANNER)
        try:
            self._read_loop()
        finally:
            self._commands.put(_QUIT)
            dispatcher.join()
            self.core.shutdown(drain=True)
            compute.join(timeout=60)
        return 0

    def _compute_main(self) -> None:
        try:
            self.core.run()
        except BaseException:  # noqa: BLE001
            log.exception("compute loop crashed")
            os._exit(1)

    def _read_loop(self) -> None:
        for line in self.stdin:
            try:
                cmd = parse_command(line.rstrip("\r\n"))
            except CommandError as e:
                # Parse errors still wait their turn so replies stay in command order.
                self._commands.put(_Refused(e, _snapshot_slot_word(line)))
                continue
            if cmd is None:
                continue
            if isinstance(cmd, CancelCommand):
                rid = self._running_generation
                found = rid is not None and self.core.cancel(rid)
                self.reply(format_cancel_ok(found))
                continue
            if isinstance(cmd, QuitCommand):
                return
            self._commands.put(cmd)

    def _dispatch_main(self) -> None:
        while True:
            item = self._commands.get()
            if item is _QUIT:
                return
            try:
                if isinstance(item, _Refused):
                    if item.snapshot_slot is not None:  # SNAPSHOT failures keep the reference's form
                        self.reply(format_snapshot(item.snapshot_slot, -1, item.error.code))
                    else:
                        self._error(item.error.code, item.error.emits_terminator)
                else:
                    self._run(item)
            except Exception:  # a bug must not wedge the command loop
                log.exception("command failed")
                self._error(ErrorCode.INTERNAL, getattr(item, "EMITS_TERMINATOR", False))

    def _error(self, code: ErrorCode, terminator: bool) -> None:
        self.reply(format_err(code))
        if terminator:
            self._terminate()

    def _terminate(self) -> None:
        try:
            self.stream.terminate()
        except OSError as e:
            log.error("stream fd %s: %s", self.stream_fd, e)

    # -- commands -----------------------------------------------------------------------------------
    def _submit(self, msg: Message, stream: RequestStream | None = None) -> Message:
        rid = msg.request_id
        pending = _Pending(stream)
        with self._pending_lock:
            self._pending[rid] = pending
        try:
            self.core.submit(msg)
            pending.event.wait()
        finally:
            with self._pending_lock:
                self._pending.pop(rid, None)
        if pending.write_failed and isinstance(pending.final, Done):
            return ErrorMessage.make(ErrorCode.WRITE_OUT, "writing the token stream failed", rid)
        return pending.final

    def _rid(self) -> str:
        return f"stdio-{next(self._ids)}"

    def _run(self, cmd: Command) -> None:
        if isinstance(cmd, GenerateCommand):
            self._generate(cmd)
        elif isinstance(cmd, SnapshotCommand):
            reply = self._submit(Snapshot(slot=cmd.slot, request_id=self._rid()))
            if isinstance(reply, Slots):
                pos = next((s.n_tokens for s in reply.slots if s.slot == cmd.slot), -1)
                self.reply(format_snapshot(cmd.slot, pos))
            else:
                self.reply(format_snapshot(cmd.slot, -1, reply.code))
        elif isinstance(cmd, FreeSnapshotCommand):
            reply = self._submit(FreeSnapshot(slot=cmd.slot, request_id=self._rid()))
            self.reply(format_freed(cmd.slot) if isinstance(reply, Slots) else format_err(reply.code))
        elif isinstance(cmd, ListSlotsCommand):
            reply = self._submit(ListSlots(request_id=self._rid()))
            self.reply(format_slots(s.slot for s in reply.slots) if isinstance(reply, Slots)
                       else format_err(reply.code))
        elif isinstance(cmd, ParkCommand):
            reply = self._submit(Park(target=cmd.target, request_id=self._rid()))
            self.reply(format_park_ok(reply.target, reply.released_bytes) if isinstance(reply, Parked)
                       else format_err(reply.code))
            self._terminate()
        elif isinstance(cmd, UnparkCommand):
            reply = self._submit(Unpark(target=cmd.target, request_id=self._rid()))
            self.reply(format_unpark_ok(reply.target, reply.loaded_bytes) if isinstance(reply, Unparked)
                       else format_err(reply.code))
            self._terminate()
        else:
            log.error("stdio: no handler for %r", cmd)
            self._error(ErrorCode.UNKNOWN_COMMAND, cmd.EMITS_TERMINATOR)

    def _generate(self, cmd: GenerateCommand) -> None:
        if self.stream_fd is None:
            self._error(ErrorCode.NO_STREAM_FD, True)
            return
        try:
            prompt = read_prompt_file(cmd.prompt_path)
        except CommandError as e:
            self._error(e.code, True)
            return
        rid = self._rid()
        msg = cmd.to_message(rid, prompt)
        stream = self.stream.request()
        self._running_generation = rid
        try:
            reply = self._submit(msg, stream)
        finally:
            self._running_generation = None
            try:
                stream.close()
            except OSError as e:
                log.error("stream fd %s: %s", self.stream_fd, e)
        if isinstance(reply, Done):
            line = format_generate_ok(
                n_prompt=reply.usage.prompt_tokens, n_gen=reply.usage.completion_tokens,
                prefill_s=reply.timings.prompt_ms / 1e3, decode_s=reply.timings.predicted_ms / 1e3,
                finish_reason=reply.finish_reason, stream_fd=self.stream_fd, restore_slot=cmd.restore_slot,
                prefix_len=reply.usage.cached_tokens,
                snap_slot=reply.saved.slot if reply.saved is not None else None,
                snap_pos=reply.saved.n_tokens if reply.saved is not None else None)
            if reply.spec is not None:
                line += format_spec_fields(reply.spec)
            self.reply(line)
        else:
            self.reply(format_err(reply.code))


def format_spec_fields(spec: SpecStats) -> str:
    """The speculative counters appended to a generation's ``ok`` line (llama-server's timings
    names for drafted / accepted): `` draft_n=.. draft_n_accepted=.. spec_steps=.. accept_len=..``."""
    return (f" draft_n={spec.drafted} draft_n_accepted={spec.accepted} spec_steps={spec.steps}"
            f" accept_len={spec.acceptance_length:.3f}")


def run_stdio_worker(config: WorkerConfig, stream_fd: int | None) -> int:
    """Serve stdin/stdout (and the stream fd) until ``quit`` or EOF; returns the exit status."""
    return StdioWorker(config, stream_fd).serve()
