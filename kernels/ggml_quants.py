"""GGML weight formats on the CPU: block layouts, dequantisation, quantisation.

A GGUF tensor with ``ne=[n_cols, n_rows]`` is stored row by row; each row is a run of
blocks of ``block_size`` elements, each block ``block_bytes`` bytes.  Here a tensor's
data is always handled as a ``uint8`` array of shape ``(n_rows, row_bytes)`` (a view on
the memory-mapped file; nothing is copied), and ``n_cols`` (elements per row) is passed
alongside.

The dequantisers follow ggml's reference bit layouts (``dequantize_row_*`` in
ggml-quants.c) and do the same float32 operations in the same order, so results are
bit-identical to ggml's reference and to gguf-py's numpy dequantisers (the tests hold
them equal bit for bit).  Per-block scales are IEEE half floats, decoded exactly.
F32/F16/BF16 rows go through the same row dispatch (used by the fused matmul); whole
float tensors are converted with numpy.

Numba compiles every kernel once per machine (``cache=True``; the cache lives next to
this file in ``__pycache__``).  Dequantisation kernels run without fast-math so that
LLVM may not contract ``d*q - m`` into an FMA, which would change the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "QuantLayoutError",
    "QuantSpec",
    "SUPPORTED_TYPES",
    "UnsupportedQuantType",
    "dequantize",
    "dequantize_rows",
    "quant_spec",
    "quantize",
    "QUANTIZABLE_TYPES",
    "random_raw",
    "row_bytes",
]


class UnsupportedQuantType(ValueError):
    """A GGML type this module does not handle (or cannot quantise to)."""


class QuantLayoutError(ValueError):
    """Raw bytes, row length or output buffer do not match the type's block layout."""


@dataclass(frozen=True)
class QuantSpec:
    qtype: GGMLQuantizationType
    block_size: int      # elements per block
    block_bytes: int     # bytes per block
    # Byte offsets, inside one block, of the IEEE half-float scale fields (d, dmin, m).
    # Part of the format description; used to build valid random blocks.
    f16_fields: tuple[int, ...]
    # Integer code the numba kernels dispatch on (our own numbering, see _QCODE_*).
    kernel_code: int


# Kernel dispatch codes (our own numbering).
_QCODE_Q4_0 = 1
_QCODE_Q4_1 = 2
_QCODE_Q5_0 = 3
_QCODE_Q5_1 = 4
_QCODE_Q8_0 = 5
_QCODE_Q4_K = 6
_QCODE_Q5_K = 7
_QCODE_Q6_K = 8
_QCODE_IQ4_XS = 9
_QCODE_F32 = 10
_QCODE_F16 = 11
_QCODE_BF16 = 12
_FLOAT_CODES = (_QCODE_F32, _QCODE_F16, _QCODE_BF16)

_Q = GGMLQuantizationType


def _spec(qtype: GGMLQuantizationType, f16_fields: tuple[int, ...], code: int) -> QuantSpec:
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    return QuantSpec(qtype, block_size, block_bytes, f16_fields, code)


# Block structs (ggml-common.h), byte offsets:
#   Q4_0  {f16 d; u8 qs[16]}                                   18 B / 32
#   Q4_1  {f16 d; f16 m; u8 qs[16]}                            20 B / 32
#   Q5_0  {f16 d; u8 qh[4]; u8 qs[16]}                         22 B / 32
#   Q5_1  {f16 d; f16 m; u8 qh[4]; u8 qs[16]}                  24 B / 32
#   Q8_0  {f16 d; i8 qs[32]}                                   34 B / 32
#   Q4_K  {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}        144 B / 256
#   Q5_K  {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}  176 B / 256
#   Q6_K  {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}       210 B / 256
#   IQ4_XS {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}  136 B / 256
SUPPORTED_TYPES: dict[GGMLQuantizationType, QuantSpec] = {
    s.qtype: s
    for s in (
        _spec(_Q.F32, (), _QCODE_F32),
        _spec(_Q.F16, (), _QCODE_F16),
        _spec(_Q.BF16, (), _QCODE_BF16),
        _spec(_Q.Q8_0, (0,), _QCODE_Q8_0),
        _spec(_Q.Q4_0, (0,), _QCODE_Q4_0),
        _spec(_Q.Q4_1, (0, 2), _QCODE_Q4_1),
        _spec(_Q.Q5_0, (0,), _QCODE_Q5_0),
        _spec(_Q.Q5_1, (0, 2), _QCODE_Q5_1),
        _spec(_Q.Q4_K, (0, 2), _QCODE_Q4_K),
        _spec(_Q.Q5_K, (0, 2), _QCODE_Q5_K),
        _spec(_Q.Q6_K, (208,), _QCODE_Q6_K),
        _spec(_Q.IQ4_XS, (0,), _QCODE_IQ4_XS),
    )
}

# Types `quantize` produces (through gguf-py's reference quantisers).  K-quants and IQ4_XS
# come from llama.cpp's quantiser, which picks scales by weighted search.
QUANTIZABLE_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1)

_FLOAT_DTYPES = {_Q.F32: np.float32, _Q.F16: np.float16}


def _type_name(qtype) -> str:
    try:
        return GGMLQuantizationType(int(qtype)).name
    except (ValueError, TypeError):
        return repr(qtype)


def quant_spec(qtype) -> QuantSpec:
    """Layout of a supported type; accepts the enum or its integer value."""
    try:
        key = GGMLQuantizationType(int(qtype))
    except (ValueError, TypeError):
        raise UnsupportedQuantType(f"unknown GGML type {qtype!r}") from None
    spec = SUPPORTED_TYPES.get(key)
    if spec is None:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise UnsupportedQuantType(f"GGML type {key.name} is not supported (supported: {supported})")
    return spec


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes one row of ``n_cols`` elements takes in ``qtype``."""
    spec = quant_spec(qtype)
    n_cols = int(n_cols)
    if n_cols <= 0 or n_cols % spec.block_size:
        raise QuantLayoutError(
            f"{spec.qtype.name} rows must hold a positive multiple of {spec.block_size} elements, got {n_cols}")
    return n_cols // spec.block_size * spec.block_bytes


def _check_raw(raw, spec: QuantSpec, n_cols: int) -> np.ndarray:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        desc = f"{raw.dtype}{list(raw.shape)}" if isinstance(raw, np.ndarray) else type(raw).__name__
        raise QuantLayoutError(f"raw {spec.qtype.name} data must be a 2-D uint8 array (n_rows, row_bytes), got {desc}")
    expected = row_bytes(spec.qtype, n_cols)
    if raw.shape[1] != expected:
        raise QuantLayoutError(
            f"{spec.qtype.name} rows of {n_cols} elements take {expected} bytes, raw rows have {raw.shape[1]}")
    return raw


def _readonly_c(raw: np.ndarray) -> np.ndarray:
    """A read-only, C-contiguous plain-ndarray view (no copy for memmap row slices).

    The numba kernels are compiled for read-only uint8 arrays only, so writable and
    read-only (memory-mapped) weights share one compiled specialisation.
    """
    view = np.ascontiguousarray(raw).view(np.ndarray)
    view.flags.writeable = False
    return view


# --------------------------------------------------------------------------------------
# numba kernels
# --------------------------------------------------------------------------------------

# Run-time trip count of the dequantisers' inner loops (see the note above _row_q4_0).
_N16 = 16
_IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.float32)
# Every binary16 bit pattern -> float32 (numpy's exact conversion; 256 KiB), used by the
# kernels for block scales and F16 rows.  Both tables are passed to the kernels as
# arguments: numba would freeze a global array into every compiled function as a constant.
_F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@numba.njit(cache=True)
def _f16(src, off, f16_table):
    """IEEE binary16 stored little-endian at src[off:off+2] -> float32 (exact)."""
    return f16_table[np.int32(src[off]) | (np.int32(src[off + 1]) << 8)]


@numba.njit(cache=True)
def _u32(src, off):
    return (np.int64(src[off]) | (np.int64(src[off + 1]) << 8)
            | (np.int64(src[off + 2]) << 16) | (np.int64(src[off + 3]) << 24))


@numba.njit(cache=True)
def _i8_as_f32(byte):
    v = np.int64(byte)
    return np.float32(v - ((v & 0x80) << 1))    # two's-complement int8 from its byte


# Every row dequantiser takes ``n16``, which is always 16, as a run-time argument and
# writes its inner loops as ``range(n16)`` / ``range(2 * n16)``.  With literal trip counts
# LLVM unrolls those loops fully before its loop vectoriser runs (and numba leaves the SLP
# vectoriser off), leaving scalar code; a run-time count keeps them loops, which vectorise
# (about 2.5x faster).  Quantised values go through int32 before float conversion because
# AVX2 has no vector int64 -> float32 conversion.

@numba.njit(cache=True)
def _row_q4_0(src, n_blocks, dst, n16, f16_table):
    for b in range(n_blocks):
        o = b * 18
        d = _f16(src, o, f16_table)
        y = b * 32
        for j in range(n16):
            v = np.int32(src[o + 2 + j])
            dst[y + j] = np.float32(np.int32((v & 0xF) - 8)) * d
            dst[y + j + 16] = np.float32(np.int32((v >> 4) - 8)) * d


@numba.njit(cache=True)
def _row_q4_1(src, n_blocks, dst, n16, f16_table):
    for b in range(n_blocks):
        o = b * 20
        d = _f16(src, o, f16_table)
        m = _f16(src, o + 2, f16_table)
        y = b * 32
        for j in range(n16):
            v = np.int32(src[o + 4 + j])
            dst[y + j] = np.float32(np.int32(v & 0xF)) * d + m
            dst[y + j + 16] = np.float32(np.int32(v >> 4)) * d + m


@numba.njit(cache=True)
def _row_q5_0(src, n_blocks, dst, n16, f16_table):
    for b in range(n_blocks):
        o = b * 22
        d = _f16(src, o, f16_table)
        qh = _u32(src, o + 2)
        y = b * 32
        for j in range(n16):
            v = np.int32(src[o + 6 + j])
            hi0 = np.int32(((qh >> j) << 4) & 0x10)     # 5th bit of element j
            hi1 = np.int32((qh >> (j + 12)) & 0x10)     # 5th bit of element j + 16
            dst[y + j] = np.float32(np.int32(((v & 0xF) | hi0) - 16)) * d
            dst[y + j + 16] = np.float32(np.int32(((v >> 4) | hi1) - 16)) * d


@numba.njit(cache=True)
def _row_q5_1(src, n_blocks, dst, n16, f16_table):
    for b in range(n_blocks):
        o = b * 24
        d = _f16(src, o, f16_table)
        m = _f16(src, o + 2, f16_table)
        qh = _u32(src, o + 4)
        y = b * 32
        for j in range(n16):
            v = np.int32(src[o + 8 + j])
            hi0 = np.int32(((qh >> j) << 4) & 0x10)
            hi1 = np.int32((qh >> (j + 12)) & 0x10)
            dst[y + j] = np.float32(np.int32((v & 0xF) | hi0)) * d + m
            dst[y + j + 16] = np.float32(np.int32((v >> 4) | hi1)) * d + m


@numba.njit(cache=True)
def _row_q8_0(src, n_blocks, dst, n16, f16_table):
    for b in range(n_blocks):
        o = b * 34
        d = _f16(src, o, f16_table)
        y = b * 32
        for j in range(2 * n16):
            v = np.int32(src[o + 2 + j])
            dst[y + j] = np.float32(np.int32(v - ((v & 0x80) << 1))) * d   # int8 from its byte


@numba.njit(cache=True)
def _k_scale_min(src, off, j):
    """6-bit scale and min of sub-block j (0..7) from the 12 packed bytes at src[off:]
    (ggml's get_scale_min_k4)."""
    if j < 4:
        sc = np.int64(src[off + j]) & 63
        mn = np.int64(src[off + j + 4]) & 63
    else:
        sc = (np.int64(src[off + j + 4]) & 0xF) | ((np.int64(src[off + j - 4]) >> 6) << 4)
        mn = (np.int64(src[off + j + 4]) >> 4) | ((np.int64(src[off + j]) >> 6) << 4)
    return sc, mn


@numba.njit(cache=True)
def _row_q4_k(src, n_blocks, dst, n16, f16_table):
    for b in range(n_blocks):
        o = b * 144
        d = _f16(src, o, f16_table)
        dmin = _f16(src, o + 2, f16_table)
        for g in range(4):                      # 64 elements: low nibbles, then high nibbles
            sc0, m0 = _k_scale_min(src, o + 4, 2 * g)
            sc1, m1 = _k_scale_min(src, o + 4, 2 * g + 1)
            d0 = d * np.float32(sc0)
            dm0 = dmin * np.float32(m0)
            d1 = d * np.float32(sc1)
            dm1 = dmin * np.float32(m1)
            q = o + 16 + 32 * g
            y = b * 256 + 64 * g
            for l in range(2 * n16):
                v = np.int32(src[q + l])
                dst[y + l] = d0 * np.float32(np.int32(v & 0xF)) - dm0
                dst[y + 32 + l] = d1 * np.float32(np.int32(v >> 4)) - dm1


@numba.njit(cache=True)
def _row_q5_k(src, n_blocks, dst, n16, f16_table):
    for b in range(n_blocks):
        o = b * 176
        d = _f16(src, o, f16_table)
        dmin = _f16(src, o + 2, f16_table)
        qh = o + 16
        for g in range(4):
            sc0, m0 = _k_scale_min(src, o + 4, 2 * g)
            sc1, m1 = _k_scale_min(src, o + 4, 2 * g + 1)
            d0 = d * np.float32(sc0)
            dm0 = dmin * np.float32(m0)
            d1 = d * np.float32(sc1)
            dm1 = dmin * np.float32(m1)
            q = o + 48 + 32 * g
            y = b * 256 + 64 * g
            for l in range(2 * n16):
                v = np.int32(src[q + l])
                h = np.int32(src[qh + l]) >> (2 * g)   # bit 2g: sub-block 2g, bit 2g+1: 2g+1
                dst[y + l] = d0 * np.float32(np.int32((v & 0xF) | ((h & 1) << 4))) - dm0
                dst[y + 32 + l] = d1 * np.float32(np.int32((v >> 4) | ((h & 2) << 3))) - dm1


@numba.njit(cache=True)
def _row_q6_k(src, n_blocks, dst, n16, f16_table):
    for b in range(n_blocks):
        o = b * 210
        d = _f16(src, o + 208, f16_table)
        for n in range(2):                      # two halves of 128 elements
            ql = o + 64 * n
            qh = o + 128 + 32 * n
            sc = o + 192 + 8 * n
            y = b * 256 + 128 * n
            # Scales of the four 32-element runs, for their first and second 16 elements.
            s0a, s0b = d * _i8_as_f32(src[sc]), d * _i8_as_f32(src[sc + 1])
            s1a, s1b = d * _i8_as_f32(src[sc + 2]), d * _i8_as_f32(src[sc + 3])
            s2a, s2b = d * _i8_as_f32(src[sc + 4]), d * _i8_as_f32(src[sc + 5])
            s3a, s3b = d * _i8_as_f32(src[sc + 6]), d * _i8_as_f32(src[sc + 7])
            for l in range(2 * n16):            # one 32-trip loop (selects) vectorises better than two of 16
                first = l < n16
                a = np.int32(src[ql + l])
                c = np.int32(src[ql + l + 32])
                h = np.int32(src[qh + l])
                dst[y + l] = (s0a if first else s0b) * np.float32(np.int32(((a & 0xF) | ((h & 3) << 4)) - 32))
                dst[y + l + 32] = (s1a if first else s1b) * np.float32(
                    np.int32(((c & 0xF) | (((h >> 2) & 3) << 4)) - 32))
                dst[y + l + 64] = (s2a if first else s2b) * np.float32(
                    np.int32(((a >> 4) | (((h >> 4) & 3) << 4)) - 32))
                dst[y + l + 96] = (s3a if first else s3b) * np.float32(
                    np.int32(((c >> 4) | (((h >> 6) & 3) << 4)) - 32))


@numba.njit(cache=True)
def _row_iq4_xs(src, n_blocks, dst, n16, f16_table, kvalues):
    for b in range(n_blocks):
        o = b * 136
        d = _f16(src, o, f16_table)
        scales_h = np.int64(src[o + 2]) | (np.int64(src[o + 3]) << 8)
        for ib in range(8):
            ls = ((np.int64(src[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            q = o + 8 + 16 * ib
            y = b * 256 + 32 * ib
            for j in range(n16):
                v = np.int32(src[q + j])
                dst[y + j] = dl * kvalues[v & 0xF]
                dst[y + j + 16] = dl * kvalues[v >> 4]


@numba.njit(cache=True)
def _row_f32(src, n, dst):
    vals = src.view(np.float32)
    for i in range(n):
        dst[i] = vals[i]


@numba.njit(cache=True)
def _row_f16(src, n, dst, f16_table):
    for i in range(n):
        dst[i] = _f16(src, 2 * i, f16_table)


@numba.njit(cache=True)
def _row_bf16(src, n, dst):
    bits = dst.view(np.uint32)              # bf16 is the top half of a binary32
    for i in range(n):
        bits[i] = (np.uint32(src[2 * i]) << 16) | (np.uint32(src[2 * i + 1]) << 24)


@numba.njit(cache=True)
def _dequant_row(code, src, n_blocks, dst, n16, kvalues, f16_table):
    """Dequantise one row (src: its bytes) into dst[:n_blocks * block_size]."""
    if code == _QCODE_Q4_0:
        _row_q4_0(src, n_blocks, dst, n16, f16_table)
    elif code == _QCODE_Q4_1:
        _row_q4_1(src, n_blocks, dst, n16, f16_table)
    elif code == _QCODE_Q5_0:
        _row_q5_0(src, n_blocks, dst, n16, f16_table)
    elif code == _QCODE_Q5_1:
        _row_q5_1(src, n_blocks, dst, n16, f16_table)
    elif code == _QCODE_Q8_0:
        _row_q8_0(src, n_blocks, dst, n16, f16_table)
    elif code == _QCODE_Q4_K:
        _row_q4_k(src, n_blocks, dst, n16, f16_table)
    elif code == _QCODE_Q5_K:
        _row_q5_k(src, n_blocks, dst, n16, f16_table)
    elif code == _QCODE_Q6_K:
        _row_q6_k(src, n_blocks, dst, n16, f16_table)
    elif code == _QCODE_IQ4_XS:
        _row_iq4_xs(src, n_blocks, dst, n16, f16_table, kvalues)
    elif code == _QCODE_F32:
        _row_f32(src, n_blocks, dst)
    elif code == _QCODE_F16:
        _row_f16(src, n_blocks, dst, f16_table)
    elif code == _QCODE_BF16:
        _row_bf16(src, n_blocks, dst)


@numba.njit(cache=True, parallel=True)
def _dequant_rows_kernel(code, raw, n_blocks, out, n16, kvalues, f16_table):
    for r in numba.prange(raw.shape[0]):
        _dequant_row(code, raw[r], n_blocks, out[r], n16, kvalues, f16_table)


@numba.njit(cache=True)
def _dequant_rows_serial(code, raw, n_blocks, out, n16, kvalues, f16_table):
    """Single-threaded variant, for callers that hand the other cores to BLAS."""
    for r in range(raw.shape[0]):
        _dequant_row(code, raw[r], n_blocks, out[r], n16, kvalues, f16_table)


@numba.njit(cache=True)
def _f16_bits_to_f32(bits_u8, out, f16_table):
    """Decode an array of little-endian binary16 values (2 bytes each); exposed for tests
    of the scale decoder."""
    for i in range(out.shape[0]):
        out[i] = _f16(bits_u8, 2 * i, f16_table)


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------

def _dequant_float_rows(raw_rows: np.ndarray, qtype: GGMLQuantizationType, out: np.ndarray) -> None:
    if qtype == _Q.BF16:
        # bf16 is the top half of a binary32: shift its bits up, reinterpret.
        np.left_shift(raw_rows.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = raw_rows.view(_FLOAT_DTYPES[qtype])


def dequantize_rows(raw: np.ndarray, qtype, n_cols: int, row_start: int, row_stop: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Dequantise rows ``row_start:row_stop`` of ``raw`` (uint8 (n_rows, row_bytes)) to
    float32 ``(row_stop - row_start, n_cols)``, written into ``out`` when given (a
    C-contiguous float32 buffer of exactly that shape).  Only those rows' bytes are read."""
    spec = quant_spec(qtype)
    _check_raw(raw, spec, n_cols)
    row_start, row_stop = int(row_start), int(row_stop)
    if not 0 <= row_start <= row_stop <= raw.shape[0]:
        raise QuantLayoutError(f"row range {row_start}:{row_stop} outside 0:{raw.shape[0]}")
    shape = (row_stop - row_start, n_cols)
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape
          or not out.flags.c_contiguous or not out.flags.writeable):
        desc = f"{out.dtype}{list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
        raise QuantLayoutError(f"out must be a writable C-contiguous float32 array of shape {list(shape)}, got {desc}")
    if shape[0] == 0:
        return out
    rows = _readonly_c(raw[row_start:row_stop])
    if spec.kernel_code in _FLOAT_CODES:
        _dequant_float_rows(rows, spec.qtype, out)
    else:
        _dequant_rows_kernel(spec.kernel_code, rows, n_cols // spec.block_size, out, _N16, _IQ4NL_VALUES, _F16_TABLE)
    return out


def dequantize(raw: np.ndarray, qtype, n_cols: int) -> np.ndarray:
    """Dequantise a whole tensor: uint8 ``(n_rows, row_bytes)`` -> float32 ``(n_rows, n_cols)``.
    Meant for small tensors (norms, biases) and tests; weights go through `kernels.matmul`."""
    spec = quant_spec(qtype)
    _check_raw(raw, spec, n_cols)
    return dequantize_rows(raw, spec.qtype, n_cols, 0, raw.shape[0])


def quantize(x: np.ndarray, qtype) -> np.ndarray:
    """float32 ``(n_rows, n_cols)`` -> raw uint8 ``(n_rows, row_bytes)`` in ``qtype``.

    F32/F16 are plain casts; BF16 rounds to nearest even (ggml_compute_fp32_to_bf16);
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 use gguf-py's ports of ggml's reference quantisers.
    """
    spec = quant_spec(qtype)
    if spec.qtype not in QUANTIZABLE_TYPES:
        raise UnsupportedQuantType(
            f"quantising to {spec.qtype.name} is not implemented here (use llama.cpp's quantiser)")
    x = np.asarray(x)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        raise QuantLayoutError(f"quantize expects a 2-D float array (n_rows, n_cols), got {x.dtype}{list(x.shape)}")
    n_rows, n_cols = x.shape
    nbytes = row_bytes(spec.qtype, n_cols)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if spec.qtype == _Q.F32:
        raw = x.copy().view(np.uint8)       # never alias the caller's array
    elif spec.qtype == _Q.F16:
        raw = x.astype(np.float16).view(np.uint8)
    else:
        raw = np.asarray(gguf.quants.quantize(x, spec.qtype)).view(np.uint8)
    return np.ascontiguousarray(raw).reshape(n_rows, nbytes)


def random_raw(qtype, n_rows: int, n_cols: int, rng: np.random.Generator,
               scale_range: tuple[float, float] = (2.0 ** -10, 2.0 ** -4)) -> np.ndarray:
    """Valid random data of a type, for tests and benchmarks: random bytes everywhere,
    with every f16 scale field set to a finite value of random sign whose magnitude lies
    in ``scale_range``; float types get finite random values of magnitude <= 4."""
    spec = quant_spec(qtype)
    nbytes = row_bytes(spec.qtype, n_cols)
    if spec.kernel_code in _FLOAT_CODES:
        values = rng.uniform(-4.0, 4.0, size=(n_rows, n_cols)).astype(np.float32)
        if spec.qtype == _Q.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_rows, nbytes)
        return np.ascontiguousarray(values.astype(_FLOAT_DTYPES[spec.qtype])).view(np.uint8).reshape(n_rows, nbytes)
    n_blocks = n_rows * (n_cols // spec.block_size)
    blocks = rng.integers(0, 256, size=(n_blocks, spec.block_bytes), dtype=np.uint8)
    lo, hi = scale_range
    for off in spec.f16_fields:
        mag = np.exp(rng.uniform(np.log(lo), np.log(hi), size=n_blocks))
        sign = rng.choice(np.array([-1.0, 1.0]), size=n_blocks)
        blocks[:, off:off + 2] = (mag * sign).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(n_rows, nbytes)
