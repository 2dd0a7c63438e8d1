"""Memory-mapped, bounds-checked GGUF reader.

The whole file is mapped read-only; metadata is parsed into Python values and tensors are indexed
in their stored quantisation (`GGUFTensor.raw` is a view into the map, never a copy). Every problem
with the file raises one `GGUFError` subclass whose message is a single line naming the file and
the problem, so the CLI can print it and exit 2 instead of showing a traceback.

We parse the format ourselves instead of using `gguf.GGUFReader` because a server must survive
hostile files: every length and count is checked against the bytes that remain before anything is
allocated, so a corrupted count cannot make us allocate gigabytes or loop for minutes.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_NESTING = 2
MAX_STRING_BYTES = 1 << 26  # 64 MiB: a chat template or a merge list item is never this long


class GGUFError(Exception):
    """Base of every error about a GGUF file. `str(err)` is one line: '<file>: <problem>'."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = str(path)
        self.problem = problem.replace("\n", " ")
        super().__init__(f"{self.path}: {self.problem}")


class GGUFFormatError(GGUFError):
    """The bytes do not form a valid GGUF file (magic, version, truncation, bad counts or types)."""


class GGUFMetadataError(GGUFError):
    """A metadata key is missing, duplicated, or has the wrong type or value."""


class GGUFTensorError(GGUFError):
    """A tensor is missing, duplicated, of an unsupported type or a wrong shape, or lies past the end."""


class UnknownArchitectureError(GGUFError):
    """`general.architecture` names an architecture no dflashd worker knows."""


# GGUF metadata value types (gguf spec): id -> (name, struct format or None for compound types).
_VT_SCALARS = {
    0: ("u8", "<B"), 1: ("i8", "<b"), 2: ("u16", "<H"), 3: ("i16", "<h"),
    4: ("u32", "<I"), 5: ("i32", "<i"), 6: ("f32", "<f"), 7: ("bool", "<?"),
    10: ("u64", "<Q"), 11: ("i64", "<q"), 12: ("f64", "<d"),
}
_VT_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
             10: "<u8", 11: "<i8", 12: "<f8"}
VT_STRING = 8
VT_ARRAY = 9
_KNOWN_TYPES = {int(t): t for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


def type_name(qtype: int) -> str:
    t = _KNOWN_TYPES.get(qtype)
    return t.name if t is not None else f"type{qtype}"


VALUE_TYPE_NAMES = {**{k: v[0] for k, v in _VT_SCALARS.items()}, VT_STRING: "string", VT_ARRAY: "array"}


@dataclass(frozen=True)
class MetadataValue:
    """One metadata entry: the decoded Python value and its GGUF type (for arrays, the item type)."""

    value: Any
    vtype: int
    item_type: int | None = None

    @property
    def type_name(self) -> str:
        if self.vtype == VT_ARRAY:
            return f"array[{VALUE_TYPE_NAMES.get(self.item_type, '?')}]"
        return VALUE_TYPE_NAMES[self.vtype]


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor in its stored quantisation.

    `ne` is ggml's order (ne[0] is the contiguous axis); `shape` is the numpy order (reversed).
    `raw` is a read-only uint8 view of shape (n_rows, row_bytes) into the file's memory map.
    """

    name: str
    qtype: int
    ne: tuple[int, ...]
    offset: int  # absolute file offset of the data
    nbytes: int
    raw: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64))

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    def dequantize(self) -> np.ndarray:
        """The whole tensor as float32 in numpy shape. For small tensors (norms, biases) and tests;
        big matrices go through `kernels.matmul` block by block instead."""
        from kernels import ggml_quants
        return ggml_quants.dequantize(self.raw, self.qtype, self.ne[0]).reshape(self.shape)

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the tensor viewed as (n_rows, ne[0]), as float32: a row-block,
        without touching the rest of the tensor."""
        from kernels import ggml_quants
        return ggml_quants.dequantize_rows(self.raw, self.qtype, self.ne[0], start, stop)


class _Cursor:
    """Bounds-checked little-endian reader over the mapped bytes."""

    __slots__ = ("buf", "pos", "end", "path")

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise GGUFFormatError(self.path, f"truncated file: {what} needs {n} bytes at offset "
                                             f"{self.pos}, file has {self.end}")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > MAX_STRING_BYTES:
            raise GGUFFormatError(self.path, f"{what} claims {n} bytes (limit {MAX_STRING_BYTES})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(self.path, f"{what} is not valid UTF-8") from None


class GGUFFile:
    """An open GGUF file: `metadata` (key -> Python value), `metadata_types`, `tensors` (name -> GGUFTensor).

    Opening parses the header, metadata and tensor index and checks every bound; it reads no
    tensor data. Use as a context manager or call `close()` to release the map (views into it held
    elsewhere keep it alive, as numpy arrays do).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._map: mmap.mmap | None = None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise GGUFFormatError(self.path, f"cannot open: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < 24:
                raise GGUFFormatError(self.path, f"truncated file: {size} bytes is smaller than a GGUF header")
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.file_size = size
        self._values: dict[str, MetadataValue] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self._parse()

    # -- public views -------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        return {k: v.value for k, v in self._values.items()}

    @property
    def metadata_types(self) -> dict[str, str]:
        return {k: v.type_name for k, v in self._values.items()}

    def metadata_entry(self, key: str) -> MetadataValue | None:
        return self._values.get(key)

    @property
    def architecture(self) -> str:
        return self.get_str("general.architecture")

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None) -> Any:
        v = self._values.get(key)
        return default if v is None else v.value

    def _require(self, key: str) -> MetadataValue:
        v = self._values.get(key)
        if v is None:
            raise GGUFMetadataError(self.path, f"missing required metadata key '{key}'")
        return v

    def get_str(self, key: str) -> str:
        v = self._require(key)
        if v.vtype != VT_STRING:
            raise GGUFMetadataError(self.path, f"metadata key '{key}' is {v.type_name}, expected string")
        return v.value

    def get_int(self, key: str, default: int | None = None, *, minimum: int | None = None) -> int:
        v = self._values.get(key)
        if v is None:
            if default is not None:
                return default
            raise GGUFMetadataError(self.path, f"missing required metadata key '{key}'")
        if v.vtype in (6, 7, 12, VT_STRING, VT_ARRAY):
            raise GGUFMetadataError(self.path, f"metadata key '{key}' is {v.type_name}, expected an integer")
        if minimum is not None and v.value < minimum:
            raise GGUFMetadataError(self.path, f"metadata key '{key}' = {v.value} is below {minimum}")
        return int(v.value)

    def get_float(self, key: str, default: float | None = None) -> float:
        v = self._values.get(key)
        if v is None:
            if default is not None:
                return default
            raise GGUFMetadataError(self.path, f"missing required metadata key '{key}'")
        if v.vtype in (7, VT_STRING, VT_ARRAY):
            raise GGUFMetadataError(self.path, f"metadata key '{key}' is {v.type_name}, expected a number")
        f = float(v.value)
        if not np.isfinite(f):
            raise GGUFMetadataError(self.path, f"metadata key '{key}' is not finite ({f})")
        return f

    def get_array(self, key: str, default: list | None = None, *, length: int | None = None) -> list:
        v = self._values.get(key)
        if v is None:
            if default is not None:
                return default
            raise GGUFMetadataError(self.path, f"missing required metadata key '{key}'")
        if v.vtype != VT_ARRAY:
            raise GGUFMetadataError(self.path, f"metadata key '{key}' is {v.type_name}, expected an array")
        if length is not None and len(v.value) != length:
            raise GGUFMetadataError(self.path, f"metadata key '{key}' has {len(v.value)} items, expected {length}")
        return v.value

    def tensor(self, name: str) -> GGUFTensor:
        t = self.tensors.get(name)
        if t is None:
            raise GGUFTensorError(self.path, f"missing tensor '{name}'")
        return t

    def expect_tensor(self, name: str, ne: tuple[int, ...], *, types: tuple[int, ...] | None = None) -> GGUFTensor:
        """The tensor `name`, checked to have ggml shape `ne` (and one of `types`, if given)."""
        t = self.tensor(name)
        if tuple(t.ne) != tuple(ne):
            raise GGUFTensorError(self.path, f"tensor '{name}' has shape {list(t.ne)}, expected {list(ne)}")
        if types is not None and t.qtype not in types:
            allowed = ", ".join(type_name(q) for q in types)
            raise GGUFTensorError(self.path, f"tensor '{name}' is {t.type_name}, expected one of {allowed}")
        return t

    def __iter__(self) -> Iterator[GGUFTensor]:
        return iter(self.tensors.values())

    def close(self) -> None:
        # numpy views into the map may outlive us; closing a map with exported buffers raises
        # BufferError, in which case the map is released when the last view goes.
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- parsing ------------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = memoryview(self._map)
        try:
            self._parse_buffer(buf)
        finally:
            buf.release()

    def _parse_buffer(self, buf: memoryview) -> None:
        path = self.path
        cur = _Cursor(buf, path)
        magic = bytes(buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(path, f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # Each KV needs >= 8 (key length) + 4 (type) + 1 bytes; each tensor info >= 8+4+8+4+8.
        remaining = cur.end - cur.pos
        if n_kv * 13 > remaining:
            raise GGUFFormatError(path, f"metadata count {n_kv} cannot fit in {remaining} remaining bytes")
        if n_tensors * 32 > remaining:
            raise GGUFFormatError(path, f"tensor count {n_tensors} cannot fit in {remaining} remaining bytes")

        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if not key:
                raise GGUFFormatError(path, f"metadata key #{i} is empty")
            if key in self._values:
                raise GGUFMetadataError(path, f"duplicate metadata key '{key}'")
            vtype = cur.u32(f"type of '{key}'")
            self._values[key] = self._read_value(cur, vtype, key, depth=0)

        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self._values:
            a = self._values["general.alignment"]
            if a.vtype != 4 or a.value == 0 or (a.value & (a.value - 1)) != 0:
                raise GGUFMetadataError(path, f"general.alignment must be a power-of-two u32, got {a.value!r}")
            alignment = a.value

        infos = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor #{i}")
            n_dims = cur.u32(f"dimension count of '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(path, f"tensor '{name}' has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            ne = tuple(cur.u64(f"dimension of '{name}'") for _ in range(n_dims))
            qtype = cur.u32(f"type of '{name}'")
            offset = cur.u64(f"offset of '{name}'")
            infos.append((name, ne, qtype, offset))

        data_start = -(-cur.pos // alignment) * alignment
        if data_start > cur.end and n_tensors:
            raise GGUFFormatError(path, "truncated file: tensor data section missing")
        data_size = cur.end - data_start
        for name, ne, qtype, offset in infos:
            if name in self.tensors:
                raise GGUFTensorError(path, f"duplicate tensor '{name}'")
            if any(d == 0 for d in ne) or any(d > (1 << 40) for d in ne):
                raise GGUFTensorError(path, f"tensor '{name}' has an invalid shape {list(ne)}")
            if qtype not in _KNOWN_TYPES:
                raise GGUFTensorError(path, f"tensor '{name}' has unknown ggml type {qtype}")
            block_size, block_bytes = GGML_QUANT_SIZES[_KNOWN_TYPES[qtype]]
            if ne[0] % block_size:
                raise GGUFTensorError(path, f"tensor '{name}' row length {ne[0]} is not a multiple of "
                                            f"the {type_name(qtype)} block size {block_size}")
            row_bytes = ne[0] // block_size * block_bytes
            n_rows = 1
            for d in ne[1:]:
                n_rows *= d
            nbytes = row_bytes * n_rows
            if offset % alignment:
                raise GGUFTensorError(path, f"tensor '{name}' data offset {offset} is not aligned to {alignment}")
            if offset + nbytes > data_size:
                raise GGUFTensorError(path, f"tensor '{name}' data ({nbytes} bytes at {offset}) runs past "
                                            f"the end of the file ({data_size} bytes of data)")
            raw = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=data_start + offset)
            raw = raw.reshape(n_rows, row_bytes)
            self.tensors[name] = GGUFTensor(name, qtype, ne, data_start + offset, nbytes, raw)

    def _read_value(self, cur: _Cursor, vtype: int, key: str, depth: int) -> MetadataValue:
        path = self.path
        if vtype in _VT_SCALARS:
            fmt = _VT_SCALARS[vtype][1]
            v = cur.unpack(fmt, struct.calcsize(fmt), f"value of '{key}'")
            return MetadataValue(v, vtype)
        if vtype == VT_STRING:
            return MetadataValue(cur.string(f"value of '{key}'"), vtype)
        if vtype == VT_ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise GGUFFormatError(path, f"metadata '{key}' nests arrays deeper than {MAX_ARRAY_NESTING}")
            item_type = cur.u32(f"array type of '{key}'")
            count = cur.u64(f"array length of '{key}'")
            if item_type in _VT_NUMPY:
                size = np.dtype(_VT_NUMPY[item_type]).itemsize
                if count > (cur.end - cur.pos) // size:
                    raise GGUFFormatError(path, f"truncated file: array '{key}' of {count} items runs past the end")
                arr = np.frombuffer(cur.buf, dtype=_VT_NUMPY[item_type], count=count, offset=cur.pos)
                cur.pos += count * size
                values = arr.astype(bool).tolist() if item_type == 7 else arr.tolist()
                return MetadataValue(values, vtype, item_type)
            if item_type == VT_STRING:
                if count > (cur.end - cur.pos) // 8:
                    raise GGUFFormatError(path, f"truncated file: array '{key}' of {count} strings runs past the end")
                return MetadataValue([cur.string(f"item of '{key}'") for _ in range(count)], vtype, item_type)
            if item_type == VT_ARRAY:
                if count > (cur.end - cur.pos) // 12:
                    raise GGUFFormatError(path, f"truncated file: array '{key}' of {count} arrays runs past the end")
                items = [self._read_value(cur, VT_ARRAY, key, depth + 1).value for _ in range(count)]
                return MetadataValue(items, vtype, item_type)
            raise GGUFFormatError(path, f"metadata '{key}' is an array of unknown type {item_type}")
        raise GGUFFormatError(path, f"metadata '{key}' has unknown value type {vtype}")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)


def metadata_summary(md: Mapping[str, Any], limit: int = 8) -> dict[str, Any]:
    """Metadata with long arrays shortened (for printing)."""
    out = {}
    for k, v in md.items():
        if isinstance(v, list) and len(v) > limit:
            out[k] = v[:limit] + [f"... ({len(v)} items)"]
        else:
            out[k] = v
    return out
