"""The stdin/stream-fd line transport, compatible with the reference daemon (PROTOCOL.md "Stdio").

- stdin: one command per line (``parse_command``);
- stdout: exactly one reply line per command except ``quit`` (``format_*``);
- ``--stream-fd N``: token ids as little-endian int32, and exactly one ``-1`` terminator for every
  generation, park, unpark or unrecognised line (``TokenStream``).

Generation commands become ``messages.Generate`` (``GenerateCommand.to_message``) so the worker core
serves both transports with one code path.  This module parses and formats only; it runs nothing.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterable

import numpy as np

from daemons.sampling import SamplingError, SamplingParams
from protocol.messages import (
    MAX_CONTEXT,
    MAX_SLOTS,
    ErrorCode,
    FinishReason,
    Generate,
    ParkTarget,
    ProtocolError,
    SnapshotInstructions,
)

__all__ = [
    "MAX_LINE_CHARS", "REFERENCE_REPEAT_LAST_N", "TERMINATOR",
    "CommandError", "Command", "GenerateCommand", "SnapshotCommand", "FreeSnapshotCommand",
    "ListSlotsCommand", "ParkCommand", "UnparkCommand", "CancelCommand", "QuitCommand",
    "parse_command", "parse_samp", "looks_like_path", "read_prompt_file",
    "format_ok", "format_err", "format_generate_ok", "format_slots", "format_snapshot", "format_freed",
    "format_park_ok", "format_unpark_ok", "format_cancel_ok",
    "TokenStream", "RequestStream",
]

MAX_LINE_CHARS = 64 << 10
# The reference sampler's penalty window (SamplerCfg::rep_window); samp= has no field for it.
REFERENCE_REPEAT_LAST_N = 256
TERMINATOR = -1

_UINT = re.compile(r"[0-9]{1,18}")
_INT = re.compile(r"-?[0-9]{1,20}")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")
_OPTION = re.compile(r"[A-Za-z_]+=")  # a key=value word (paths start with / or . or hold no '=')
_SNAP = re.compile(r"([0-9]{1,18}):([0-9]{1,18})")


class CommandError(ProtocolError):
    """A stdin line that cannot be run.  ``emits_terminator`` says whether the reply includes one
    ``-1`` on the token stream (true for generation, park, unpark and unrecognised lines)."""

    def __init__(self, code: ErrorCode | str, message: str, *, emits_terminator: bool):
        super().__init__(code, message)
        self.emits_terminator = emits_terminator


# ---- commands -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    EMITS_TERMINATOR: ClassVar[bool] = False


@dataclass(frozen=True)
class GenerateCommand(Command):
    """``<prompt.bin> <n_gen> [snap=L:S]`` or ``RESTORE <slot> <prompt.bin> <n_gen> [snap=L:S]``."""

    EMITS_TERMINATOR: ClassVar[bool] = True
    prompt_path: str
    n_gen: int
    restore_slot: int | None = None
    snap_at: int | None = None  # snap=L:S -> save slot S holding the state after L prompt tokens
    snap_slot: int | None = None
    sampling: SamplingParams | None = None  # None: no samp= tail, greedy

    def to_message(self, request_id: str, prompt_ids: np.ndarray) -> Generate:
        """The framed GENERATE this command stands for (the prompt already read from its file)."""
        snapshot = None
        if self.restore_slot is not None or self.snap_slot is not None:
            snapshot = SnapshotInstructions(save_slot=self.snap_slot, save_at=self.snap_at,
                                            restore_slot=self.restore_slot)
        return Generate(request_id=request_id, prompt_ids=prompt_ids, max_tokens=self.n_gen,
                        sampling=self.sampling if self.sampling is not None else SamplingParams(),
                        snapshot=snapshot)


@dataclass(frozen=True)
class SnapshotCommand(Command):
    slot: int


@dataclass(frozen=True)
class FreeSnapshotCommand(Command):
    slot: int


@dataclass(frozen=True)
class ListSlotsCommand(Command):
    pass


@dataclass(frozen=True)
class ParkCommand(Command):
    EMITS_TERMINATOR: ClassVar[bool] = True
    target: ParkTarget = ParkTarget.ALL


@dataclass(frozen=True)
class UnparkCommand(Command):
    EMITS_TERMINATOR: ClassVar[bool] = True
    target: ParkTarget = ParkTarget.ALL


@dataclass(frozen=True)
class CancelCommand(Command):
    pass


@dataclass(frozen=True)
class QuitCommand(Command):
    pass


# ---- parsing --------------------------------------------------------------------------------------

def looks_like_path(word: str) -> bool:
    """The reference's test for a bare prompt command: starts with ``/`` or ``.``, or contains ``/``."""
    return word.startswith(("/", ".")) or "/" in word


def _uint(word: str, what: str, terminator: bool) -> int:
    if not _UINT.fullmatch(word):
        raise CommandError(ErrorCode.BAD_ARGS, f"{what} must be a non-negative integer, got {word[:40]!r}",
                           emits_terminator=terminator)
    return int(word)


def _slot(word: str, terminator: bool) -> int:
    slot = _uint(word, "slot", terminator)
    if slot >= MAX_SLOTS:
        raise CommandError(ErrorCode.INVALID_SNAPSHOT_SLOT, f"slot {slot} is outside 0..{MAX_SLOTS - 1}",
                           emits_terminator=terminator)
    return slot


def _float(word: str, what: str) -> float:
    if not _FLOAT.fullmatch(word):
        raise CommandError(ErrorCode.BAD_ARGS, f"samp: {what} must be a number, got {word[:40]!r}",
                           emits_terminator=True)
    return float(word)


def parse_samp(value: str) -> SamplingParams:
    """``temp,top_p,top_k,rep_pen,seed[,freq,pres]`` (the text after ``samp=``) as SamplingParams.

    Values are read the way the reference sampler reads them: temp <= 0 is greedy, top_k <= 0 and
    top_p outside (0, 1) switch those stages off, rep_pen <= 1 is no repetition penalty, the seed is
    an unsigned 64-bit number (``-1`` wraps to 2**64 - 1), and the penalty window is 256 tokens.
    """
    parts = value.split(",")
    if len(parts) not in (5, 6, 7):
        raise CommandError(ErrorCode.BAD_ARGS,
                           f"samp= takes temp,top_p,top_k,rep_pen,seed[,freq,pres]; got {len(parts)} values",
                           emits_terminator=True)
    temp = _float(parts[0], "temp")
    top_p = _float(parts[1], "top_p")
    if not _INT.fullmatch(parts[2]):
        raise CommandError(ErrorCode.BAD_ARGS, f"samp: top_k must be an integer, got {parts[2][:40]!r}",
                           emits_terminator=True)
    top_k = int(parts[2])
    rep_pen = _float(parts[3], "rep_pen")
    if not _INT.fullmatch(parts[4]) or not -(1 << 63) <= int(parts[4]) < (1 << 64):
        raise CommandError(ErrorCode.BAD_ARGS, f"samp: seed must be a 64-bit integer, got {parts[4][:40]!r}",
                           emits_terminator=True)
    seed = int(parts[4]) % (1 << 64)
    freq = _float(parts[5], "freq") if len(parts) > 5 else 0.0
    pres = _float(parts[6], "pres") if len(parts) > 6 else 0.0
    try:
        return SamplingParams(
            temperature=max(temp, 0.0),
            top_p=top_p if 0.0 < top_p < 1.0 else 1.0,
            top_k=max(top_k, 0),
            repeat_penalty=rep_pen if rep_pen > 1.0 else 1.0,
            repeat_last_n=REFERENCE_REPEAT_LAST_N,
            frequency_penalty=freq,
            presence_penalty=pres,
            seed=seed,
        )
    except SamplingError as e:  # e.g. an exponent that overflows to inf
        raise CommandError(ErrorCode.BAD_ARGS, f"samp: {e}", emits_terminator=True) from None


def _park_target(args: list[str], head: str) -> ParkTarget:
    if len(args) > 1:
        raise CommandError(ErrorCode.BAD_ARGS, f"{head} takes at most one target", emits_terminator=True)
    if not args:
        return ParkTarget.ALL
    try:
        return ParkTarget(args[0])
    except ValueError:
        raise CommandError(ErrorCode.BAD_ARGS, f"{head} target must be all, target or draft, got {args[0][:40]!r}",
                           emits_terminator=True) from None


def _generation(head: str, args: list[str], sampling: SamplingParams | None) -> GenerateCommand:
    options = [a for a in args if _OPTION.match(a)]
    positional = [a for a in args if not _OPTION.match(a)]
    snaps = [a for a in options if a.startswith("snap=")]
    others = [a for a in options if not a.startswith("snap=")]
    if others:
        raise CommandError(ErrorCode.BAD_ARGS, f"unknown option {others[0][:40]!r}", emits_terminator=True)
    if len(snaps) > 1:
        raise CommandError(ErrorCode.BAD_ARGS, "snap= given twice", emits_terminator=True)
    restore_slot = None
    if head == "RESTORE":
        if len(positional) != 3:
            raise CommandError(ErrorCode.BAD_ARGS, "usage: RESTORE <slot> <prompt.bin> <n_gen> [snap=L:S]",
                               emits_terminator=True)
        restore_slot = _slot(positional[0], True)
        path, n_word = positional[1], positional[2]
    else:
        if len(positional) != 1:
            raise CommandError(ErrorCode.BAD_ARGS, "usage: <prompt.bin> <n_gen> [snap=L:S]", emits_terminator=True)
        path, n_word = head, positional[0]
    n_gen = _uint(n_word, "n_gen", True)
    if not 1 <= n_gen <= MAX_CONTEXT:
        raise CommandError(ErrorCode.BAD_ARGS, f"n_gen must be in 1..{MAX_CONTEXT}, got {n_gen}", emits_terminator=True)
    snap_at = snap_slot = None
    if snaps:
        m = _SNAP.fullmatch(snaps[0][len("snap="):])
        if not m:
            raise CommandError(ErrorCode.BAD_ARGS, f"snap= takes L:S, got {snaps[0][:40]!r}", emits_terminator=True)
        snap_at = int(m.group(1))
        if not 1 <= snap_at <= MAX_CONTEXT:
            raise CommandError(ErrorCode.BAD_ARGS, f"snap= position must be in 1..{MAX_CONTEXT}, got {snap_at}",
                               emits_terminator=True)
        snap_slot = _slot(m.group(2), True)
    return GenerateCommand(prompt_path=path, n_gen=n_gen, restore_slot=restore_slot, snap_at=snap_at,
                           snap_slot=snap_slot, sampling=sampling)


def parse_command(line: str) -> Command | None:
    """One stdin line as a Command; ``None`` for a blank line.  Raises CommandError.

    The ``samp=`` word is taken out first, wherever it stands (as the reference does); it is
    allowed on generation commands only.  Words are separated by whitespace, so prompt paths
    cannot contain spaces.
    """
    if len(line) > MAX_LINE_CHARS:
        raise CommandError(ErrorCode.TOO_LARGE, f"command line longer than {MAX_LINE_CHARS} characters",
                           emits_terminator=True)
    words = line.split()
    if not words:
        return None
    head, rest = words[0], words[1:]
    samp_words = [w for w in rest if w.startswith("samp=")]
    args = [w for w in rest if not w.startswith("samp=")]
    is_generation = head == "RESTORE" or looks_like_path(head)

    if is_generation:
        if len(samp_words) > 1:
            raise CommandError(ErrorCode.BAD_ARGS, "samp= given twice", emits_terminator=True)
        sampling = parse_samp(samp_words[0][len("samp="):]) if samp_words else None
        return _generation(head, args, sampling)
    if head in ("park", "unpark"):
        if samp_words:
            raise CommandError(ErrorCode.BAD_ARGS, f"{head} takes no samp=", emits_terminator=True)
        target = _park_target(args, head)
        return ParkCommand(target) if head == "park" else UnparkCommand(target)

    simple = {"LIST_SLOTS": ListSlotsCommand, "cancel": CancelCommand, "quit": QuitCommand, "exit": QuitCommand}
    with_slot = {"SNAPSHOT": SnapshotCommand, "FREE_SNAPSHOT": FreeSnapshotCommand}
    if head in simple or head in with_slot:
        if samp_words:
            raise CommandError(ErrorCode.BAD_ARGS, f"{head} takes no samp=", emits_terminator=False)
        if head in simple:
            if args:
                raise CommandError(ErrorCode.BAD_ARGS, f"{head} takes no arguments", emits_terminator=False)
            return simple[head]()
        if len(args) != 1:
            raise CommandError(ErrorCode.BAD_ARGS, f"usage: {head} <slot>", emits_terminator=False)
        return with_slot[head](_slot(args[0], False))
    raise CommandError(ErrorCode.UNKNOWN_COMMAND, f"unknown command {head[:40]!r}", emits_terminator=True)


def read_prompt_file(path: str | os.PathLike, max_tokens: int = MAX_CONTEXT) -> np.ndarray:
    """A raw little-endian int32 prompt file (no header) as an int32 array.

    Missing/unreadable files, sizes that are not a multiple of 4 and negative ids are ``bad_args``;
    an empty file is ``empty_prompt``; more than ``max_tokens`` ids is ``too_large``.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise CommandError(ErrorCode.BAD_ARGS, f"prompt file {str(p)[:200]!r} is not a regular file",
                               emits_terminator=True)
    except OSError as e:
        raise CommandError(ErrorCode.BAD_ARGS, f"prompt file {str(p)[:200]!r}: {e.strerror or e}",
                           emits_terminator=True) from None
    if size == 0:
        raise CommandError(ErrorCode.EMPTY_PROMPT, f"prompt file {str(p)[:200]!r} is empty", emits_terminator=True)
    if size % 4:
        raise CommandError(ErrorCode.BAD_ARGS,
                           f"prompt file {str(p)[:200]!r} has {size} bytes, not a multiple of 4 (raw int32)",
                           emits_terminator=True)
    if size // 4 > max_tokens:
        raise CommandError(ErrorCode.TOO_LARGE, f"prompt file holds {size // 4} tokens, at most {max_tokens}",
                           emits_terminator=True)
    try:
        ids = np.fromfile(p, dtype="<i4")
    except OSError as e:
        raise CommandError(ErrorCode.BAD_ARGS, f"prompt file {str(p)[:200]!r}: {e.strerror or e}",
                           emits_terminator=True) from None
    if ids.shape[0] != size // 4:  # the file changed under us
        raise CommandError(ErrorCode.BAD_ARGS, f"prompt file {str(p)[:200]!r} changed while being read",
                           emits_terminator=True)
    if int(ids.min()) < 0:
        raise CommandError(ErrorCode.BAD_ARGS, f"prompt file {str(p)[:200]!r} holds a negative token id",
                           emits_terminator=True)
    return ids.astype(np.int32, copy=False)


# ---- reply lines ----------------------------------------------------------------------------------

def _value(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if hasattr(v, "value"):  # enums
        return str(v.value)
    return str(v)


def format_ok(*words: object, **fields: object) -> str:
    """``ok <words> k=v ...`` (floats with 3 decimals; no newline)."""
    parts = ["ok", *(_value(w) for w in words), *(f"{k}={_value(v)}" for k, v in fields.items())]
    return " ".join(parts)


def format_err(code: ErrorCode | str) -> str:
    return f"err {ErrorCode(code).value}"


def format_generate_ok(*, n_prompt: int, n_gen: int, prefill_s: float, decode_s: float,
                       finish_reason: FinishReason | str, stream_fd: int | None,
                       restore_slot: int | None = None, prefix_len: int | None = None,
                       snap_slot: int | None = None, snap_pos: int | None = None) -> str:
    """The reply line of a finished generation: the reference's fields first, ours appended.

    bare:    ``ok N=.. gen=.. prefill_s=.. decode_s=.. decode_tok_s=.. stream_fd=.. finish=..``
    RESTORE: ``ok N=.. gen=.. prefix_len=P (RESTORE slot=S) stream_fd=.. prefill_s=.. ... finish=..``
    plus `` snap_slot=S snap_pos=P`` when snap= saved a snapshot.
    """
    fd = -1 if stream_fd is None else stream_fd
    rate = f"{n_gen / max(decode_s, 1e-9):.1f}"
    timing = f"prefill_s={prefill_s:.3f} decode_s={decode_s:.3f} decode_tok_s={rate}"
    if restore_slot is not None:
        line = (f"ok N={n_prompt} gen={n_gen} prefix_len={prefix_len if prefix_len is not None else 0} "
                f"(RESTORE slot={restore_slot}) stream_fd={fd} {timing}")
    else:
        line = f"ok N={n_prompt} gen={n_gen} {timing} stream_fd={fd}"
    line += f" finish={FinishReason(finish_reason).value}"
    if snap_slot is not None:
        line += f" snap_slot={snap_slot} snap_pos={snap_pos if snap_pos is not None else -1}"
    return line


def format_slots(slots: Iterable[int]) -> str:
    """LIST_SLOTS reply, the reference's line: ``[snap] slots=0,3`` (empty list: ``[snap] slots=``)."""
    return "[snap] slots=" + ",".join(str(s) for s in sorted(slots))


def format_snapshot(slot: int, cur_pos: int, code: ErrorCode | str | None = None) -> str:
    """SNAPSHOT reply, the reference's line ``[snap] inline slot=S cur_pos=P``; a failure has
    ``cur_pos=-1`` (as in the reference) and `` err=<code>`` appended."""
    if code is None:
        return f"[snap] inline slot={slot} cur_pos={cur_pos}"
    return f"[snap] inline slot={slot} cur_pos=-1 err={ErrorCode(code).value}"


def format_freed(slot: int) -> str:
    """FREE_SNAPSHOT reply, the reference's line (freeing an empty slot is not an error)."""
    return f"[snap] freed slot={slot}"


def format_park_ok(target: ParkTarget | str, released_bytes: int) -> str:
    return format_ok("park", target=ParkTarget(target), released_bytes=released_bytes)


def format_unpark_ok(target: ParkTarget | str, loaded_bytes: int) -> str:
    return format_ok("unpark", target=ParkTarget(target), loaded_bytes=loaded_bytes)


def format_cancel_ok(active: bool) -> str:
    """``ok cancel active=1`` when a generation was running (it then ends with finish=cancelled),
    ``ok cancel active=0`` when there was nothing to cancel."""
    return format_ok("cancel", active=int(bool(active)))


# ---- token stream ---------------------------------------------------------------------------------

def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        n = os.write(fd, data)
        data = data[n:]


class RequestStream:
    """The token stream of one command: ``write`` ids, then exactly one ``-1`` from ``close``
    (idempotent; also run on leaving a ``with`` block, exception or not)."""

    def __init__(self, fd: int | None):
        self._fd = fd
        self.closed = False
        self.count = 0

    def write(self, ids: Iterable[int] | np.ndarray) -> None:
        if self.closed:
            raise RuntimeError("token stream already terminated")
        arr = np.asarray(ids)
        if arr.size == 0:
            return
        if arr.dtype.kind not in "iu" or arr.ndim != 1:
            raise ValueError("token ids must be a 1-D integer sequence")
        # A negative id would read as (or be mistaken for) the -1 terminator.
        if int(arr.min()) < 0 or int(arr.max()) > 0x7FFFFFFF:
            raise ValueError("token ids must be in [0, 2**31)")
        data = np.ascontiguousarray(arr, dtype="<i4")
        self.count += int(data.shape[0])
        if self._fd is not None:
            _write_all(self._fd, memoryview(data).cast("B"))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._fd is not None:
            _write_all(self._fd, memoryview(np.array([TERMINATOR], dtype="<i4")).cast("B"))

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TokenStream:
    """The ``--stream-fd`` channel (``fd=None``: none was given, writes go nowhere)."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def request(self) -> RequestStream:
        return RequestStream(self.fd)

    def terminate(self) -> None:
        """The lone ``-1`` of a command that streams no tokens (park, unpark, failures)."""
        self.request().close()
