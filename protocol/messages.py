"""Typed messages of the dflashd worker protocol, version 1.

``protocol/PROTOCOL.md`` is the specification; this module is its executable form.  Every message is
a frozen, keyword-only dataclass with a ``TYPE`` (the ASCII name carried in frame 0), ``to_body()``
(a msgpack-ready map whose numpy arrays ``protocol.framing`` moves into buffer frames) and
``from_body(body, buffers)`` (strict validation of a decoded map).

Validation is declared once per field (a codec in the field's metadata) and runs both when a message
is built in Python (``__post_init__``) and when one is decoded, so a peer can never send what it
would refuse to receive.  Every failure is a ``ProtocolError`` carrying an ``ErrorCode``.

Unknown-field policy: fields a receiver does not know are ignored (forward compatibility: a newer
peer may add optional fields without a version bump); unknown message types and unknown error codes
are rejected.  ``null`` for an optional field means "absent"; for a required field it is an error.
"""
from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from daemons.sampling import SamplingError, SamplingParams

__all__ = [
    "PROTOCOL_VERSION", "MAX_SLOTS", "HEARTBEAT_INTERVAL_S", "HEARTBEAT_LIVENESS",
    "ErrorCode", "ProtocolError", "FinishReason", "ParkTarget",
    "WireStruct", "Message", "MESSAGE_TYPES", "WORKER_ACCEPTS", "ROUTER_ACCEPTS",
    "SamplingParams", "Capacity", "DraftInfo", "Load", "SnapshotInstructions", "SpeculativeOptions",
    "Usage", "Timings", "SpecStats", "SlotInfo",
    "Hello", "Heartbeat", "Generate", "Tokens", "Done", "ErrorMessage", "Cancel", "Snapshot",
    "Restore", "FreeSnapshot", "ListSlots", "Slots", "Park", "Parked", "Unpark", "Unparked", "Stats",
    "StatsReply", "Shutdown", "WorkerDead",
    "decode_array_ref", "one_line",
]

PROTOCOL_VERSION = 1

# Snapshot slots are numbered 0..MAX_SLOTS-1 (the reference daemon's kMaxSlots).
MAX_SLOTS = 64
# Liveness defaults (Paranoid Pirate): a HEARTBEAT every interval; a peer silent for
# LIVENESS intervals is dead.  Any message counts as a sign of life.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 3

# ---- size limits (PROTOCOL.md "Limits") ---------------------------------------------------------
MAX_CONTEXT = 1 << 24  # bound for token counts and positions (n_ctx, max_tokens, save_at, ...)
MAX_ARRAY_ELEMENTS = 1 << 24  # elements of one array ref
MAX_WIRE_LIST_LEN = 1024  # msgpack arrays; longer token lists must travel as array refs
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_IDS = 1024
MAX_NAME_CHARS = 256
MAX_ERROR_MESSAGE_CHARS = 4096
MAX_TEXT_CHARS = 8 << 20  # prompt_text and a TOKENS text chunk (the body limit binds first)
MAX_DRAFT_TOKENS = 256
MAX_BYTES_VALUE = (1 << 63) - 1
MAX_INLINE_ARRAY_BYTES = 64 << 10  # an array inlined as msgpack bin (the encoder inlines < 256 B)
# dtypes an array ref may name: little-endian numeric only (bfloat16 travels as "<u2").
ALLOWED_DTYPES = frozenset({"|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<i8", "<f2", "<f4"})
MAX_NDIM = 8

REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")
WORKER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,63}")
DEVICE_RE = re.compile(r"cpu|(?:cuda|hip):[0-9]{1,3}")


class ErrorCode(str, Enum):
    """The fixed list of error codes (PROTOCOL.md "Error codes"); adding one bumps PROTOCOL_VERSION."""

    # generation / backend codes (the reference's GenerateErrorCode)
    INCOMPLETE = "incomplete"
    ADAPTER_UNAVAILABLE = "adapter_unavailable"
    CONTEXT_OVERFLOW = "context_overflow"
    SAMPLING_UNSUPPORTED = "sampling_unsupported"
    PREFILL_FAILED = "prefill_failed"
    DECODE_SEED_MISSING = "decode_seed_missing"
    DECODE_FAILED = "decode_failed"
    INVALID_SNAPSHOT_SLOT = "invalid_snapshot_slot"
    MODEL_PARKED = "model_parked"
    BACKEND_SPECIFIC = "backend_specific"
    # command-loop codes (the reference's daemon loop)
    BAD_ARGS = "bad_args"
    EMPTY_PROMPT = "empty_prompt"
    EMPTY_SLOT = "empty_slot"
    WRITE_OUT = "write_out"
    NO_STREAM_FD = "no_stream_fd"
    UNKNOWN_COMMAND = "unknown_command"
    # framed-protocol codes
    BAD_FRAME = "bad_frame"
    BAD_MESSAGE = "bad_message"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_MESSAGE_TYPE = "unknown_message_type"
    TOO_LARGE = "too_large"
    BUSY = "busy"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    # worker lifecycle
    UNKNOWN_WORKER = "unknown_worker"
    OUT_OF_MEMORY = "out_of_memory"
    SHUTDOWN = "shutdown"


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


class ParkTarget(str, Enum):
    ALL = "all"
    TARGET = "target"
    DRAFT = "draft"


def one_line(text: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """``text`` on one line (control characters become spaces), cut to ``limit`` characters."""
    flat = "".join(ch if ch >= " " and ch != "\x7f" else " " for ch in str(text))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _show(value: Any) -> str:
    """A short repr for error messages, so a hostile 8 MB string is not echoed back."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ProtocolError(ValueError):
    """A frame, message or command that breaks the protocol.

    ``code`` is an ``ErrorCode``; ``request_id`` is filled when the offending message carried a
    readable one (so the ERROR reply can name it); ``identity`` is the ZeroMQ routing id of the
    sender when the error came out of ``framing.recv`` on a ROUTER socket.
    """

    def __init__(self, code: ErrorCode | str, message: str, *, request_id: str | None = None):
        self.code = ErrorCode(code)
        self.message = one_line(message, 512)
        self.request_id = request_id
        self.identity: bytes | None = None
        super().__init__(f"{self.code.value}: {self.message}")


# ---- field codecs --------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


class _Codec:
    """Validates one field.  ``check`` takes a Python-side value, ``decode`` a msgpack-decoded one;
    both return the normalised value or raise ProtocolError.  ``encode`` gives the body value."""

    def check(self, value: Any, path: str) -> Any:
        raise NotImplementedError

    def decode(self, value: Any, path: str, buffers: Sequence[memoryview]) -> Any:
        return self.check(value, path)

    def encode(self, value: Any) -> Any:
        return value


class _Int(_Codec):
    def __init__(self, lo: int = 0, hi: int = MAX_BYTES_VALUE, range_code: ErrorCode = ErrorCode.BAD_MESSAGE):
        self.lo, self.hi, self.range_code = lo, hi, range_code

    def check(self, value, path):
        if not _is_int(value):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be an integer, got {_show(value)}")
        v = int(value)
        if not self.lo <= v <= self.hi:
            raise ProtocolError(self.range_code, f"{path} must be in [{self.lo}, {self.hi}], got {v}")
        return v


class _Float(_Codec):
    def __init__(self, lo: float = 0.0, hi: float = math.inf):
        self.lo, self.hi = lo, hi

    def check(self, value, path):
        if not _is_real(value):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be a number, got {_show(value)}")
        v = float(value)
        if not math.isfinite(v) or not self.lo <= v <= self.hi:
            raise ProtocolError(ErrorCode.BAD_MESSAGE,
                                f"{path} must be a finite number in [{self.lo}, {self.hi}], got {v!r}")
        return v


class _Bool(_Codec):
    def check(self, value, path):
        if not isinstance(value, (bool, np.bool_)):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be a boolean, got {_show(value)}")
        return bool(value)


class _Str(_Codec):
    def __init__(self, max_len: int = MAX_NAME_CHARS, min_len: int = 1, pattern: re.Pattern | None = None):
        self.max_len, self.min_len, self.pattern = max_len, min_len, pattern

    def check(self, value, path):
        if not isinstance(value, str):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be a string, got {_show(value)}")
        if not self.min_len <= len(value) <= self.max_len:
            raise ProtocolError(ErrorCode.BAD_MESSAGE,
                                f"{path} must hold {self.min_len}..{self.max_len} characters, got {len(value)}")
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise ProtocolError(ErrorCode.BAD_MESSAGE,
                                f"{path} must match {self.pattern.pattern!r}, got {_show(value)}")
        return value


class _Choice(_Codec):
    def __init__(self, enum: type[Enum]):
        self.enum = enum

    def check(self, value, path):
        if isinstance(value, self.enum):
            return value
        if isinstance(value, str):
            try:
                return self.enum(value)
            except ValueError:
                pass
        allowed = ", ".join(m.value for m in self.enum)
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be one of {{{allowed}}}, got {_show(value)}")

    def encode(self, value):
        return value.value


class _Nested(_Codec):
    def __init__(self, cls: type["WireStruct"]):
        self.cls = cls

    def check(self, value, path):
        if not isinstance(value, self.cls):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be a {self.cls.__name__}, got {_show(value)}")
        return value

    def decode(self, value, path, buffers):
        return self.cls._decode(value, buffers, path)

    def encode(self, value):
        return value.to_body()


class _List(_Codec):
    def __init__(self, item: _Codec, max_len: int):
        self.item, self.max_len = item, max_len

    def _items(self, value, path):
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be a list, got {_show(value)}")
        if len(value) > self.max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{path} holds {len(value)} items, at most {self.max_len}")
        return value

    def check(self, value, path):
        return tuple(self.item.check(v, f"{path}[{i}]") for i, v in enumerate(self._items(value, path)))

    def decode(self, value, path, buffers):
        return tuple(self.item.decode(v, f"{path}[{i}]", buffers) for i, v in enumerate(self._items(value, path)))

    def encode(self, value):
        return [self.item.encode(v) for v in value]


def decode_array_ref(ref: Any, buffers: Sequence[memoryview], path: str, *,
                     dtypes: Iterable[str] = ALLOWED_DTYPES,
                     max_elements: int = MAX_ARRAY_ELEMENTS) -> np.ndarray:
    """Rebuild the array an array ref ``{"__nd__": index | bin, "dtype": ..., "shape": [...]}`` names.

    The array is a read-only view of the buffer frame (or of the inline bin): no copy.  It pins the
    whole received frame for as long as it lives.
    """
    if type(ref) is not dict or "__nd__" not in ref:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be an array ref {{'__nd__', 'dtype', 'shape'}}")
    dtype = ref.get("dtype")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}.dtype {_show(dtype)} is not an allowed dtype")
    if dtype not in dtypes:
        raise ProtocolError(ErrorCode.BAD_MESSAGE,
                            f"{path}.dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    shape = ref.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}.shape must be a list of at most {MAX_NDIM} sizes")
    n = 1
    for dim in shape:
        if not _is_int(dim) or dim < 0:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}.shape holds {_show(dim)}, not a size")
        n *= dim
    if n > max_elements:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{path} has {n} elements, at most {max_elements}")
    where = ref["__nd__"]
    if _is_int(where):
        if not 0 <= where < len(buffers):
            raise ProtocolError(ErrorCode.BAD_MESSAGE,
                                f"{path} refers to buffer {where}, the message has {len(buffers)}")
        data = buffers[where]
    elif isinstance(where, bytes):
        data = where
    else:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}.__nd__ must be a buffer index or bin data")
    dt = np.dtype(dtype)
    nbytes = memoryview(data).nbytes
    if nbytes != n * dt.itemsize:
        raise ProtocolError(ErrorCode.BAD_MESSAGE,
                            f"{path}: shape {shape} of {dtype} needs {n * dt.itemsize} bytes, the buffer has {nbytes}")
    arr = np.frombuffer(data, dtype=dt, count=n).reshape(shape)
    arr.flags.writeable = False  # a view of a received frame is never written through
    return arr


class _TokenIds(_Codec):
    """A 1-D array of token ids (int32, >= 0).  On the wire: an array ref of dtype "<i4", or a plain
    msgpack list of at most MAX_WIRE_LIST_LEN integers.  In Python: an int32 ndarray."""

    def __init__(self, max_len: int = MAX_CONTEXT):
        self.max_len = max_len

    def _finish(self, arr: np.ndarray, path: str) -> np.ndarray:
        if arr.ndim != 1:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be 1-D, got shape {arr.shape}")
        if arr.shape[0] > self.max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{path} holds {arr.shape[0]} ids, at most {self.max_len}")
        if arr.size and int(arr.min()) < 0:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} holds a negative token id")
        return arr

    def _from_list(self, value, path) -> np.ndarray:
        if len(value) > self.max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{path} holds {len(value)} ids, at most {self.max_len}")
        for i, v in enumerate(value):
            if not _is_int(v) or not 0 <= v <= 0x7FFFFFFF:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}[{i}] is not a token id: {_show(v)}")
        return np.array(value, dtype=np.int32)

    def check(self, value, path):
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "iu":
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must hold integers, got dtype {value.dtype}")
            if value.dtype != np.int32:
                if value.size and (int(value.min()) < 0 or int(value.max()) > 0x7FFFFFFF):
                    raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} holds ids outside [0, 2**31)")
                value = value.astype(np.int32)
            return self._finish(value, path)
        if isinstance(value, (list, tuple)):
            return self._finish(self._from_list(value, path), path)
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be an int32 array or a list of ids")

    def decode(self, value, path, buffers):
        if type(value) is dict:
            return self._finish(decode_array_ref(value, buffers, path, dtypes=("<i4",),
                                                 max_elements=self.max_len), path)
        if isinstance(value, list):
            # msgpack already capped the list at MAX_WIRE_LIST_LEN items.
            return self._finish(self._from_list(value, path), path)
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be an array ref or a list of ids")


class _Sampling(_Codec):
    """daemons.sampling.SamplingParams (llama-server field names); unknown keys ignored."""

    def check(self, value, path):
        if not isinstance(value, SamplingParams):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be a SamplingParams, got {_show(value)}")
        try:
            value.validate()
        except SamplingError as e:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}: {e}") from None
        return value

    def decode(self, value, path, buffers):
        if type(value) is not dict:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be a map")
        try:
            return SamplingParams.from_mapping(value)
        except SamplingError as e:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}: {e}") from None

    def encode(self, value):
        return {k: v for k, v in value.to_dict().items() if v is not None}


def _field(codec: _Codec, default: Any = MISSING, default_factory: Any = MISSING):
    """A dataclass field validated by ``codec``; required when it has no default."""
    required = default is MISSING and default_factory is MISSING
    return field(default=default, default_factory=default_factory,
                 metadata={"codec": codec, "required": required})


# ---- base classes --------------------------------------------------------------------------------

class WireStruct:
    """Base of messages and their nested maps: per-field codecs, to_body / from_body, equality that
    understands numpy arrays."""

    def __post_init__(self) -> None:
        path = self._path()
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                if f.metadata["required"]:
                    raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}.{f.name} is required")
                continue
            object.__setattr__(self, f.name, f.metadata["codec"].check(value, f"{path}.{f.name}"))
        self._validate()

    @classmethod
    def _path(cls) -> str:
        return getattr(cls, "TYPE", cls.__name__)

    def _validate(self) -> None:
        """Cross-field rules; runs after every field passed its codec."""

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                body[f.name] = f.metadata["codec"].encode(value)
        return body

    @classmethod
    def from_body(cls, body: Any, buffers: Sequence[memoryview] = ()):
        """Build from a decoded msgpack map; ``buffers`` are the message's buffer frames."""
        return cls._decode(body, buffers, cls._path())

    @classmethod
    def _decode(cls, body: Any, buffers: Sequence[memoryview], path: str):
        if type(body) is not dict:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path} must be a map, got {type(body).__name__}")
        obj = object.__new__(cls)
        for f in fields(cls):
            raw = body.get(f.name)
            if raw is None:
                if f.metadata["required"]:
                    raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{path}.{f.name} is required")
                value = f.default_factory() if f.default_factory is not MISSING else f.default
            else:
                value = f.metadata["codec"].decode(raw, f"{path}.{f.name}", buffers)
            object.__setattr__(obj, f.name, value)
        obj._validate()
        return obj

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                        and a.dtype == b.dtype and np.array_equal(a, b)):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        # Arrays are summarised: a log line must not print a 100k-token prompt.
        def show(v: Any) -> str:
            if isinstance(v, np.ndarray):
                return f"<{v.dtype}{list(v.shape)}>"
            return repr(v)
        inner = ", ".join(f"{f.name}={show(getattr(self, f.name))}" for f in fields(self)
                          if getattr(self, f.name) is not None)
        return f"{type(self).__name__}({inner})"


class Message(WireStruct):
    """A top-level message.  ``SENDER`` says who may send it: "worker", "router" or "both"."""

    TYPE: ClassVar[str]
    SENDER: ClassVar[str]


def _struct(cls):
    return dataclass(frozen=True, eq=False, repr=False, kw_only=True)(cls)


_REQUEST_ID = _Str(128, 1, REQUEST_ID_RE)
_WORKER_ID = _Str(64, 1, WORKER_ID_RE)
_SLOT = _Int(0, MAX_SLOTS - 1, ErrorCode.INVALID_SNAPSHOT_SLOT)
_TOKENS = _Int(0, MAX_CONTEXT)
_BYTES = _Int(0, MAX_BYTES_VALUE)
_COUNT = _Int(0, MAX_BYTES_VALUE)
_MS = _Float(0.0)
_NAME = _Str(MAX_NAME_CHARS)


# ---- nested maps ---------------------------------------------------------------------------------

@_struct
class Capacity(WireStruct):
    n_ctx: int = _field(_Int(1, MAX_CONTEXT))  # context length the worker serves
    n_slots: int = _field(_Int(0, MAX_SLOTS))  # snapshot slots it offers (0..64)
    snapshot_bytes: int = _field(_BYTES)  # host-memory byte budget for snapshots
    memory_bytes: int = _field(_BYTES)  # device memory the loaded worker holds (weights + state)


@_struct
class DraftInfo(WireStruct):
    model_id: str = _field(_NAME)
    model_hash: str = _field(_Str(128))
    architecture: str = _field(_Str(64))
    block_size: int | None = _field(_Int(1, MAX_DRAFT_TOKENS), default=None)


@_struct
class Load(WireStruct):
    active: int = _field(_COUNT)  # requests being generated
    queued: int = _field(_COUNT)  # requests waiting behind them


@_struct
class SnapshotInstructions(WireStruct):
    save_slot: int | None = _field(_SLOT, default=None)
    save_at: int | None = _field(_Int(1, MAX_CONTEXT), default=None)
    restore_slot: int | None = _field(_SLOT, default=None)

    def _validate(self) -> None:
        if self.save_slot is None and self.restore_slot is None:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "snapshot needs save_slot and/or restore_slot")
        if self.save_at is not None and self.save_slot is None:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "snapshot.save_at needs snapshot.save_slot")


@_struct
class SpeculativeOptions(WireStruct):
    draft_max: int | None = _field(_Int(0, MAX_DRAFT_TOKENS), default=None)  # 0 = no speculation
    draft_min: int | None = _field(_Int(0, MAX_DRAFT_TOKENS), default=None)
    draft_margin: float | None = _field(_Float(0.0), default=None)  # 0 = no margin cut

    def _validate(self) -> None:
        if self.draft_max is not None and self.draft_min is not None and self.draft_min > self.draft_max:
            raise ProtocolError(ErrorCode.BAD_MESSAGE,
                                f"speculative.draft_min {self.draft_min} > draft_max {self.draft_max}")


@_struct
class Usage(WireStruct):
    prompt_tokens: int = _field(_TOKENS)
    completion_tokens: int = _field(_TOKENS)
    cached_tokens: int = _field(_TOKENS, default=0)  # prompt tokens taken from a restored snapshot

    def _validate(self) -> None:
        if self.cached_tokens > self.prompt_tokens:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "usage.cached_tokens exceeds usage.prompt_tokens")


@_struct
class Timings(WireStruct):
    prompt_ms: float = _field(_MS)
    prompt_per_second: float = _field(_MS)
    predicted_ms: float = _field(_MS)
    predicted_per_second: float = _field(_MS)
    ttft_ms: float = _field(_MS)


@_struct
class SpecStats(WireStruct):
    drafted: int = _field(_COUNT)  # draft tokens proposed
    accepted: int = _field(_COUNT)  # of those, accepted by the target
    accepted_per_position: tuple[int, ...] = _field(_List(_COUNT, MAX_DRAFT_TOKENS), default=())
    steps: int = _field(_COUNT)  # verify steps
    acceptance_length: float = _field(_Float(0.0))  # mean tokens committed per verify step

    def _validate(self) -> None:
        if self.accepted > self.drafted:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "spec.accepted exceeds spec.drafted")
        if self.accepted_per_position:
            if sum(self.accepted_per_position) != self.accepted:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "spec.accepted_per_position does not sum to spec.accepted")
            if max(self.accepted_per_position) > self.steps:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "spec.accepted_per_position exceeds spec.steps")


@_struct
class SlotInfo(WireStruct):
    slot: int = _field(_SLOT)
    n_tokens: int = _field(_TOKENS)  # the saved state covers tokens[:n_tokens]
    bytes: int = _field(_BYTES)  # host memory the snapshot holds


# ---- messages ------------------------------------------------------------------------------------

@_struct
class Hello(Message):
    TYPE: ClassVar[str] = "HELLO"
    SENDER: ClassVar[str] = "worker"

    worker_id: str = _field(_WORKER_ID)
    protocol_version: int = _field(_Int(0, 0x7FFFFFFF))
    architecture: str = _field(_Str(64))
    model_id: str = _field(_NAME)
    model_hash: str = _field(_Str(128))
    backend: str = _field(_Str(8, 1, re.compile(r"cpu|cuda|hip")))
    device: str = _field(_Str(16, 1, DEVICE_RE))
    capacity: Capacity = _field(_Nested(Capacity))
    draft: DraftInfo | None = _field(_Nested(DraftInfo), default=None)
    pid: int | None = _field(_Int(1, 0x7FFFFFFF), default=None)
    hostname: str | None = _field(_Str(255), default=None)

    @classmethod
    def _decode(cls, body, buffers, path):
        # The version decides how the rest is read, so it is checked before anything else.
        if type(body) is dict:
            version = body.get("protocol_version")
            if _is_int(version) and version != PROTOCOL_VERSION:
                raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                                    f"protocol_version {version} is not supported (this peer speaks {PROTOCOL_VERSION})")
        return super()._decode(body, buffers, path)

    def _validate(self) -> None:
        if self.protocol_version != PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                                f"protocol_version {self.protocol_version} is not supported (this peer speaks {PROTOCOL_VERSION})")
        if self.device.split(":")[0] != self.backend:
            raise ProtocolError(ErrorCode.BAD_MESSAGE,
                                f"HELLO.device {self.device!r} does not belong to backend {self.backend!r}")


@_struct
class Heartbeat(Message):
    TYPE: ClassVar[str] = "HEARTBEAT"
    SENDER: ClassVar[str] = "both"

    worker_id: str = _field(_WORKER_ID)
    seq: int = _field(_COUNT)
    time: float = _field(_Float(0.0))  # sender's wall clock, seconds since the epoch
    load: Load | None = _field(_Nested(Load), default=None)  # always present from a worker


@_struct
class Generate(Message):
    TYPE: ClassVar[str] = "GENERATE"
    SENDER: ClassVar[str] = "router"

    request_id: str = _field(_REQUEST_ID)
    max_tokens: int = _field(_TOKENS)  # 0 = prefill only (e.g. to save a snapshot)
    prompt_ids: np.ndarray | None = _field(_TokenIds(), default=None)
    prompt_text: str | None = _field(_Str(MAX_TEXT_CHARS, 0), default=None)
    sampling: SamplingParams = _field(_Sampling(), default_factory=SamplingParams)
    stop: tuple[str, ...] = _field(_List(_Str(MAX_STOP_CHARS), MAX_STOP_STRINGS), default=())
    stop_ids: tuple[int, ...] = _field(_List(_Int(0, 0x7FFFFFFF), MAX_STOP_IDS), default=())
    snapshot: SnapshotInstructions | None = _field(_Nested(SnapshotInstructions), default=None)
    speculative: SpeculativeOptions | None = _field(_Nested(SpeculativeOptions), default=None)

    def _validate(self) -> None:
        if (self.prompt_ids is None) == (self.prompt_text is None):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "GENERATE needs exactly one of prompt_ids and prompt_text",
                                request_id=self.request_id)
        if (self.prompt_ids is not None and self.prompt_ids.size == 0) or self.prompt_text == "":
            raise ProtocolError(ErrorCode.EMPTY_PROMPT, "GENERATE has an empty prompt", request_id=self.request_id)


@_struct
class Tokens(Message):
    TYPE: ClassVar[str] = "TOKENS"
    SENDER: ClassVar[str] = "worker"

    request_id: str = _field(_REQUEST_ID)
    offset: int = _field(_TOKENS)  # completion tokens sent before this chunk
    ids: np.ndarray = _field(_TokenIds())
    text: str = _field(_Str(MAX_TEXT_CHARS, 0), default="")


@_struct
class Done(Message):
    TYPE: ClassVar[str] = "DONE"
    SENDER: ClassVar[str] = "worker"

    request_id: str = _field(_REQUEST_ID)
    finish_reason: FinishReason = _field(_Choice(FinishReason))
    usage: Usage = _field(_Nested(Usage))
    timings: Timings = _field(_Nested(Timings))
    spec: SpecStats | None = _field(_Nested(SpecStats), default=None)
    saved: SlotInfo | None = _field(_Nested(SlotInfo), default=None)  # the snapshot snapshot.save_slot made


@_struct
class ErrorMessage(Message):
    TYPE: ClassVar[str] = "ERROR"
    SENDER: ClassVar[str] = "both"

    code: ErrorCode = _field(_Choice(ErrorCode))
    request_id: str | None = _field(_REQUEST_ID, default=None)
    message: str = _field(_Str(MAX_ERROR_MESSAGE_CHARS, 0), default="")

    @classmethod
    def make(cls, code: ErrorCode | str, message: str, request_id: str | None = None) -> "ErrorMessage":
        """An ERROR whose message is flattened to one line and cut to the length limit."""
        return cls(code=ErrorCode(code), message=one_line(message), request_id=request_id)

    @classmethod
    def from_exception(cls, exc: ProtocolError) -> "ErrorMessage":
        return cls.make(exc.code, exc.message, exc.request_id)


@_struct
class Cancel(Message):
    TYPE: ClassVar[str] = "CANCEL"
    SENDER: ClassVar[str] = "router"

    request_id: str = _field(_REQUEST_ID)


@_struct
class Snapshot(Message):
    TYPE: ClassVar[str] = "SNAPSHOT"
    SENDER: ClassVar[str] = "router"

    slot: int = _field(_SLOT)
    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class Restore(Message):
    TYPE: ClassVar[str] = "RESTORE"
    SENDER: ClassVar[str] = "router"

    slot: int = _field(_SLOT)
    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class FreeSnapshot(Message):
    TYPE: ClassVar[str] = "FREE_SNAPSHOT"
    SENDER: ClassVar[str] = "router"

    slot: int = _field(_SLOT)
    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class ListSlots(Message):
    TYPE: ClassVar[str] = "LIST_SLOTS"
    SENDER: ClassVar[str] = "router"

    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class Slots(Message):
    TYPE: ClassVar[str] = "SLOTS"
    SENDER: ClassVar[str] = "worker"

    slots: tuple[SlotInfo, ...] = _field(_List(_Nested(SlotInfo), MAX_SLOTS))  # ascending slot order
    used_bytes: int = _field(_BYTES)
    budget_bytes: int = _field(_BYTES)
    current_tokens: int = _field(_TOKENS)  # tokens the worker's current state covers (0 = none)
    request_id: str | None = _field(_REQUEST_ID, default=None)

    def _validate(self) -> None:
        numbers = [s.slot for s in self.slots]
        if numbers != sorted(set(numbers)):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "SLOTS.slots must be in ascending slot order, each slot once")


@_struct
class Park(Message):
    TYPE: ClassVar[str] = "PARK"
    SENDER: ClassVar[str] = "router"

    target: ParkTarget = _field(_Choice(ParkTarget), default=ParkTarget.ALL)
    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class Parked(Message):
    TYPE: ClassVar[str] = "PARKED"
    SENDER: ClassVar[str] = "worker"

    target: ParkTarget = _field(_Choice(ParkTarget))
    released_bytes: int = _field(_BYTES)
    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class Unpark(Message):
    TYPE: ClassVar[str] = "UNPARK"
    SENDER: ClassVar[str] = "router"

    target: ParkTarget = _field(_Choice(ParkTarget), default=ParkTarget.ALL)
    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class Unparked(Message):
    TYPE: ClassVar[str] = "UNPARKED"
    SENDER: ClassVar[str] = "worker"

    target: ParkTarget = _field(_Choice(ParkTarget))
    loaded_bytes: int = _field(_BYTES)
    load_ms: float = _field(_MS)
    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class Stats(Message):
    TYPE: ClassVar[str] = "STATS"
    SENDER: ClassVar[str] = "router"

    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class StatsReply(Message):
    TYPE: ClassVar[str] = "STATS_REPLY"
    SENDER: ClassVar[str] = "worker"

    worker_id: str = _field(_WORKER_ID)
    uptime_s: float = _field(_Float(0.0))
    requests_completed: int = _field(_COUNT)  # ended with DONE (any finish_reason)
    requests_failed: int = _field(_COUNT)  # ended with ERROR
    active: int = _field(_COUNT)
    queued: int = _field(_COUNT)
    prompt_tokens_total: int = _field(_COUNT)
    completion_tokens_total: int = _field(_COUNT)
    parked: tuple[ParkTarget, ...] = _field(_List(_Choice(ParkTarget), 2), default=())  # "target", "draft"
    rss_bytes: int = _field(_BYTES)
    device_bytes: int | None = _field(_BYTES, default=None)
    snapshot_bytes_used: int = _field(_BYTES, default=0)
    spec: SpecStats | None = _field(_Nested(SpecStats), default=None)  # totals since start
    request_id: str | None = _field(_REQUEST_ID, default=None)

    def _validate(self) -> None:
        if ParkTarget.ALL in self.parked or len(set(self.parked)) != len(self.parked):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "STATS_REPLY.parked lists each of target/draft at most once")


@_struct
class Shutdown(Message):
    TYPE: ClassVar[str] = "SHUTDOWN"
    SENDER: ClassVar[str] = "router"

    drain: bool = _field(_Bool(), default=True)  # finish running and queued work first
    request_id: str | None = _field(_REQUEST_ID, default=None)


@_struct
class WorkerDead(Message):
    TYPE: ClassVar[str] = "WORKER_DEAD"
    SENDER: ClassVar[str] = "worker"

    worker_id: str = _field(_WORKER_ID)
    code: ErrorCode = _field(_Choice(ErrorCode))
    reason: str = _field(_Str(MAX_ERROR_MESSAGE_CHARS, 0))


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Heartbeat, Generate, Tokens, Done, ErrorMessage, Cancel, Snapshot, Restore,
                FreeSnapshot, ListSlots, Slots, Park, Parked, Unpark, Unparked, Stats, StatsReply,
                Shutdown, WorkerDead)
}
# What each side accepts; decode(..., accept=...) answers other types with unknown_message_type.
WORKER_ACCEPTS = frozenset(c for c in MESSAGE_TYPES.values() if c.SENDER in ("router", "both"))
ROUTER_ACCEPTS = frozenset(c for c in MESSAGE_TYPES.values() if c.SENDER in ("worker", "both"))
