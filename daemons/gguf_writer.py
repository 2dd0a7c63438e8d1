"""Writing GGUF files (for the converter and for tests that build fixture models).

Metadata types follow llama.cpp's converter, because llama.cpp's loader checks them strictly:
non-negative ints are u32, negative ints i32, floats f32, lists of ints i32 arrays, lists of floats
f32 arrays. Pass `Typed(value, GGUFValueType.X)` to force another type.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type (for arrays: the item type in `item_type`)."""

    value: Any
    vtype: GGUFValueType
    item_type: GGUFValueType | None = None


@dataclass(frozen=True)
class TensorData:
    """A tensor to write.

    Either `data` is a float array in numpy shape and `qtype` the type to store it as (F32, F16,
    BF16, Q8_0, Q4_0 are quantised here), or `data` is already-quantised uint8 rows of shape
    (n_rows, row_bytes) and `shape` gives the tensor's numpy shape.
    """

    name: str
    data: np.ndarray
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32
    shape: tuple[int, ...] | None = None


def _infer(value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, (int, np.integer)):
        return (GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32), None
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        if not items:
            return GGUFValueType.ARRAY, GGUFValueType.INT32
        first = items[0]
        if isinstance(first, str):
            return GGUFValueType.ARRAY, GGUFValueType.STRING
        if isinstance(first, (bool, np.bool_)):
            return GGUFValueType.ARRAY, GGUFValueType.BOOL
        if all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items):
            return GGUFValueType.ARRAY, GGUFValueType.INT32
        return GGUFValueType.ARRAY, GGUFValueType.FLOAT32
    raise TypeError(f"cannot store a {type(value).__name__} in GGUF metadata")


def _encode_tensor(t: TensorData) -> tuple[np.ndarray, tuple[int, ...], GGMLQuantizationType]:
    """(bytes-or-array to write, numpy shape of the logical tensor, type)."""
    qtype = GGMLQuantizationType(t.qtype)
    if t.shape is not None:  # pre-quantised rows
        raw = np.ascontiguousarray(t.data, dtype=np.uint8)
        return raw, tuple(t.shape), qtype
    x = np.asarray(t.data, dtype=np.float32)
    shape = x.shape
    if qtype == GGMLQuantizationType.F32:
        return x, shape, qtype
    if qtype == GGMLQuantizationType.F16:
        return x.astype(np.float16), shape, qtype
    from kernels import ggml_quants  # quantisers for BF16, Q8_0, Q4_0, ...
    block = GGML_QUANT_SIZES[qtype][0]
    rows = x.reshape(-1, shape[-1])
    if shape[-1] % block:
        raise ValueError(f"tensor '{t.name}': row length {shape[-1]} is not a multiple of {qtype.name}'s block {block}")
    return ggml_quants.quantize(rows, qtype), shape, qtype


def write_gguf(path: str | os.PathLike, arch: str, metadata: Mapping[str, Any],
               tensors: Iterable[TensorData], *, alignment: int | None = None) -> None:
    """Write a GGUF v3 file: `general.architecture = arch`, then `metadata` in order, then tensors."""
    w = GGUFWriter(os.fspath(path), arch)
    if alignment is not None:
        w.data_alignment = alignment
        w.add_uint32("general.alignment", alignment)
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, Typed):
            vtype, item_type, value = value.vtype, value.item_type, value.value
        else:
            vtype, item_type = _infer(value)
        if vtype == GGUFValueType.ARRAY:
            if item_type is None:
                item_type = _infer(list(value))[1]
            w.add_key_value(key, list(value), vtype, sub_type=item_type)
        else:
            w.add_key_value(key, value, vtype)
    for t in tensors:
        data, shape, qtype = _encode_tensor(t)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) and t.shape is None:
            w.add_tensor(t.name, data)
        else:
            # gguf-py takes the *byte* shape of uint8 data and derives the element shape from it.
            byte_shape = tuple(shape[:-1]) + (data.shape[-1],) if data.dtype == np.uint8 else shape
            w.add_tensor(t.name, data, raw_shape=byte_shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
