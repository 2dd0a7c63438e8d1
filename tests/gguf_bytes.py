"""A byte-level GGUF builder for tests, independent of both our writer and the gguf library.

It can write what a correct writer never would (duplicate keys, bad offsets, odd versions), which is
what the reader's error tests need.
"""
from __future__ import annotations

import struct
from typing import Any

# GGUF value type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}


def pack_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def pack_value(vtype: int, value: Any, item_type: int | None = None) -> bytes:
    if vtype in _FMT:
        return struct.pack(_FMT[vtype], value)
    if vtype == STRING:
        return pack_string(value)
    if vtype == ARRAY:
        assert item_type is not None
        out = struct.pack("<IQ", item_type, len(value))
        return out + b"".join(pack_value(item_type, v) for v in value)
    if isinstance(value, bytes):  # an unknown type id: write the given bytes as its "value"
        return value
    raise ValueError(vtype)


def build_gguf(kvs: list[tuple], tensors: list[tuple[str, tuple[int, ...], int, bytes]] = (),
               *, version: int = 3, alignment: int = 32, magic: bytes = b"GGUF",
               offsets: list[int] | None = None) -> bytes:
    """kvs: (key, vtype, value[, item_type]); tensors: (name, ne, ggml_type, data bytes)."""
    out = bytearray(magic + struct.pack("<IQQ", version, len(tensors), len(kvs)))
    for kv in kvs:
        key, vtype, value = kv[:3]
        item_type = kv[3] if len(kv) > 3 else None
        out += pack_string(key) + struct.pack("<I", vtype) + pack_value(vtype, value, item_type)
    pos = 0
    computed = []
    for name, ne, qtype, data in tensors:
        computed.append(pos)
        pos += -(-len(data) // alignment) * alignment
    offsets = computed if offsets is None else offsets
    for (name, ne, qtype, data), off in zip(tensors, offsets):
        out += pack_string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", qtype, off)
    out += b"\0" * (-len(out) % alignment)
    for (name, ne, qtype, data), off in zip(tensors, computed):
        out += data + b"\0" * (-len(data) % alignment)
    return bytes(out)
