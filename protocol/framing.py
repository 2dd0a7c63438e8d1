"""Multipart framing of protocol messages, and thin ZeroMQ helpers.

A message is the frame list ``[type, body, *buffers]`` (PROTOCOL.md "Frames"):

- ``type``: the ASCII message name, e.g. ``b"GENERATE"``;
- ``body``: a msgpack map (``Message.to_body()``) in which every numpy array is replaced by an
  array ref ``{"__nd__": i, "dtype": "<i4", "shape": [n]}`` pointing at ``buffers[i]``, or, for
  arrays under ``INLINE_ARRAY_BYTES``, ``{"__nd__": <bin>, ...}`` holding the bytes inline;
- ``buffers``: the raw array memory, sent without copying (``send_multipart(copy=False)``).

``decode`` is written for hostile input: every limit is checked before the work it bounds, msgpack
runs with explicit length caps and a container budget, nothing is ever unpickled, and every failure
is a ``ProtocolError`` with a code from the fixed list.
"""
from __future__ import annotations

import re
from typing import Any, Collection, Sequence

import msgpack
import numpy as np
import zmq

from protocol.messages import (
    ALLOWED_DTYPES,
    MAX_INLINE_ARRAY_BYTES,
    MAX_WIRE_LIST_LEN,
    MESSAGE_TYPES,
    REQUEST_ID_RE,
    WORKER_ID_RE,
    ErrorCode,
    Message,
    ProtocolError,
)

__all__ = [
    "MAX_FRAMES", "MAX_BUFFERS", "MAX_TYPE_BYTES", "MAX_BODY_BYTES", "MAX_BUFFER_BYTES",
    "MAX_MAP_LEN", "MAX_CONTAINERS", "INLINE_ARRAY_BYTES",
    "encode", "decode", "send", "recv", "router_socket", "dealer_socket",
]

MAX_BUFFERS = 16
MAX_FRAMES = 2 + MAX_BUFFERS  # type + body + buffers (a ROUTER's identity frame comes on top)
MAX_TYPE_BYTES = 32
MAX_BODY_BYTES = 8 << 20
MAX_BUFFER_BYTES = 256 << 20  # also the sockets' ZMQ_MAXMSGSIZE: a peer sending more is cut off
MAX_MAP_LEN = 256
# msgpack containers (maps + arrays) one body may hold.  msgpack preallocates a container from its
# header, and Python containers cost ~60 bytes even when empty, so both the per-container caps and
# this total keep the memory a hostile body can make bounded (a few MB), whatever its byte size.
MAX_CONTAINERS = 4096
INLINE_ARRAY_BYTES = 256  # arrays smaller than this travel inside the body

_TYPE_RE = re.compile(rb"[A-Z][A-Z0-9_]*")


# ---- encode ---------------------------------------------------------------------------------------

def _array_ref(arr: np.ndarray, buffers: list) -> dict[str, Any]:
    dtype = arr.dtype
    if dtype.byteorder == ">":  # only little-endian travels; swap (a copy) on a big-endian host
        arr = arr.astype(dtype.newbyteorder("<"))
        dtype = arr.dtype
    if dtype.str not in ALLOWED_DTYPES:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"arrays of dtype {dtype.str} cannot be sent")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)  # the one unavoidable copy
    raw = arr.reshape(-1).view(np.uint8)  # a byte view of the same memory
    shape = [int(d) for d in arr.shape]
    if arr.nbytes < INLINE_ARRAY_BYTES:
        return {"__nd__": raw.data, "dtype": dtype.str, "shape": shape}
    if len(buffers) >= MAX_BUFFERS:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"a message carries at most {MAX_BUFFERS} buffer frames")
    if arr.nbytes > MAX_BUFFER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"an array of {arr.nbytes} bytes exceeds {MAX_BUFFER_BYTES}")
    buffers.append(raw.data)
    return {"__nd__": len(buffers) - 1, "dtype": dtype.str, "shape": shape}


def encode(msg: Message) -> list[bytes | memoryview]:
    """``[type, body, *buffers]`` for ``msg``; array buffers are views of the arrays' memory.

    The arrays must not be modified until the frames have been sent.
    """
    if not isinstance(msg, Message):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"cannot encode {type(msg).__name__}: not a protocol message")
    buffers: list[memoryview] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return _array_ref(obj, buffers)
        raise TypeError(f"{type(obj).__name__} is not a wire type")

    try:
        body = msgpack.packb(msg.to_body(), default=default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{msg.TYPE}: body cannot be packed: {e}") from None
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{msg.TYPE} body is {len(body)} bytes, at most {MAX_BODY_BYTES}")
    return [msg.TYPE.encode("ascii"), body, *buffers]


# ---- decode ---------------------------------------------------------------------------------------

def _byte_view(frame: Any, index: int) -> memoryview:
    """A flat byte view of one received frame (bytes, bytearray, memoryview or zmq.Frame)."""
    try:
        view = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    except TypeError:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame {index} is {type(frame).__name__}, not bytes") from None
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"frame {index} is not contiguous memory")
        view = view.cast("B")
    return view


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _unpack_body(view: memoryview) -> Any:
    budget = [MAX_CONTAINERS]

    def count(container: Any) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"more than {MAX_CONTAINERS} maps/arrays")
        return container

    try:
        return msgpack.unpackb(
            view, raw=False, strict_map_key=True, use_list=True, timestamp=0,
            object_hook=count, list_hook=count, ext_hook=_no_ext,
            max_str_len=MAX_BODY_BYTES, max_bin_len=MAX_INLINE_ARRAY_BYTES,
            max_array_len=MAX_WIRE_LIST_LEN, max_map_len=MAX_MAP_LEN, max_ext_len=0,
        )
    except Exception as e:  # untrusted bytes: every msgpack failure mode is a bad frame
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack within limits: {type(e).__name__}: {e}") from None


def _message_class(view: memoryview) -> type[Message]:
    if not 0 < view.nbytes <= MAX_TYPE_BYTES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"type frame has {view.nbytes} bytes, expected 1..{MAX_TYPE_BYTES}")
    name = view.tobytes()
    if not _TYPE_RE.fullmatch(name):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"type frame {name!r} is not a message name")
    cls = MESSAGE_TYPES.get(name.decode("ascii"))
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_MESSAGE_TYPE, f"unknown message type {name.decode('ascii')!r}")
    return cls


def decode(frames: Sequence[Any], accept: Collection[type[Message]] | None = None) -> Message:
    """The message in ``[type, body, *buffers]`` (no identity frame).

    ``accept``: the message classes this peer takes (``WORKER_ACCEPTS`` / ``ROUTER_ACCEPTS``); a
    known type outside it is ``unknown_message_type``.  Decoded arrays are read-only views of the
    buffer frames.  Raises ProtocolError only; ``request_id`` is set on it when the body had one.
    """
    try:
        n = len(frames)
    except TypeError:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frames must be a sequence, got {type(frames).__name__}") from None
    if n < 2:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a message has at least 2 frames (type, body), got {n}")
    if n > MAX_FRAMES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"a message has at most {MAX_FRAMES} frames, got {n}")
    views = [_byte_view(f, i) for i, f in enumerate(frames)]
    cls = _message_class(views[0])
    if accept is not None and cls not in accept:
        raise ProtocolError(ErrorCode.UNKNOWN_MESSAGE_TYPE, f"{cls.TYPE} is not accepted by this peer")
    if views[1].nbytes > MAX_BODY_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"body has {views[1].nbytes} bytes, at most {MAX_BODY_BYTES}")
    for i, v in enumerate(views[2:], start=2):
        if v.nbytes > MAX_BUFFER_BYTES:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"frame {i} has {v.nbytes} bytes, at most {MAX_BUFFER_BYTES}")
    body = _unpack_body(views[1])
    if type(body) is not dict:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{cls.TYPE} body must be a map, got {type(body).__name__}")
    rid = body.get("request_id")
    request_id = rid if isinstance(rid, str) and REQUEST_ID_RE.fullmatch(rid) else None
    try:
        return cls.from_body(body, views[2:])
    except ProtocolError as e:
        if e.request_id is None:
            e.request_id = request_id
        raise
    except Exception as e:  # a validation bug must not take a worker down; the fuzz tests forbid it
        raise ProtocolError(ErrorCode.INTERNAL, f"{cls.TYPE}: unexpected {type(e).__name__} while validating: {e}",
                            request_id=request_id) from e


# ---- ZeroMQ helpers -------------------------------------------------------------------------------

def send(socket: zmq.Socket, msg: Message, identity: bytes | None = None, flags: int = 0) -> None:
    """Send ``msg`` (prefixed by ``identity`` on a ROUTER) without copying its array buffers."""
    if (identity is not None) != (socket.type == zmq.ROUTER):
        raise ValueError("a ROUTER socket needs the worker's identity; other sockets take none")
    frames = encode(msg)
    if identity is not None:
        frames.insert(0, identity)
    socket.send_multipart(frames, flags=flags, copy=False)


def recv(socket: zmq.Socket, flags: int = 0,
         accept: Collection[type[Message]] | None = None) -> tuple[bytes | None, Message]:
    """Receive one message: ``(identity, message)`` on a ROUTER, ``(None, message)`` otherwise.

    A frame that does not decode raises ProtocolError with ``identity`` set, so the caller can
    answer the sender.  Frames are received without copying; decoded arrays view them.
    """
    frames = socket.recv_multipart(flags=flags, copy=False)
    identity = None
    if socket.type == zmq.ROUTER:
        identity = frames[0].bytes
        frames = frames[1:]
    try:
        return identity, decode(frames, accept)
    except ProtocolError as e:
        e.identity = identity
        raise


def router_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """The router's ROUTER socket, bound to ``endpoint`` (``tcp://host:0`` picks a port: read
    ``LAST_ENDPOINT``).  MANDATORY: sending to an unknown worker raises instead of vanishing;
    HANDOVER: a restarted worker reclaims its identity."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BUFFER_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def dealer_socket(ctx: zmq.Context, endpoint: str, worker_id: str, linger_ms: int = 2000) -> zmq.Socket:
    """A worker's DEALER socket with routing id ``worker_id``, connected to the router at
    ``endpoint``.  ``linger_ms`` lets a final WORKER_DEAD leave before the process exits."""
    if not WORKER_ID_RE.fullmatch(worker_id):
        raise ProtocolError(ErrorCode.BAD_ARGS, f"worker id {worker_id!r} must match {WORKER_ID_RE.pattern!r}")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, worker_id.encode("ascii"))
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BUFFER_BYTES)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.connect(endpoint)
    return sock
