"""Quantised matrix product on the CPU: ``y = x @ W.T`` with W kept in its GGML format.

W is never expanded to float32 as a whole; it is dequantised row by row (small T) or a
tile of rows at a time (large T) inside the product.

Paths, chosen by ``matmul``:

* **Fused** (any type, ``T <= FUSED_MAX_T``: decode, verify and tree widths).  One numba
  kernel, parallel over chunks of output rows; each weight row is read once, dequantised
  into a per-thread float32 row buffer (L1/L2 resident) and dotted against every
  activation row.
* **Tiled** (quantised, F16, BF16 W, ``T > FUSED_MAX_T``: prefill).  ``tile_rows_for(n_in)``
  rows at a time are dequantised (single-threaded) into a reusable per-thread float32
  scratch, then ``x @ tile.T`` by numpy's BLAS, which has the cores meanwhile.  A parallel
  dequantiser here would alternate numba's thread pool with BLAS's spinning threads on the
  same cores (seen on the 2-core dev VM: up to ~8 ms per tile); at these widths the GEMM
  dominates and one thread dequantises fast enough.
* **Direct** (F32 W, ``T > FUSED_MAX_T``): the raw bytes viewed as float32, handed to BLAS.

Accumulation in the fused kernel (the choice the design asked for): each dot product is
one float32 reduction over the row, vectorised by LLVM (fast-math reassociation and FMA
contraction are enabled in this kernel only, never in the dequantisers), i.e. the sum is
split into strided float32 partial sums (vector lanes x interleaved accumulators, e.g.
8 x 4 = 32 with AVX2) added by a fixed tree at the end.  Per-block float32 partials added
into a float64 total were measured 5-20x slower: the nested reduction defeats LLVM's loop
vectoriser.  Each float32 partial sums ~n_in/32 products, so the relative error stays
~1e-7..1e-6 for n_in up to ~20k (tested at 17408).

**Batch invariance.**  Every activation row runs through the same compiled loop, so the
fused path's result for an activation row does not depend on T, on the other rows, or on
the thread count (tested bit for bit).  Greedy speculative decoding relies on this: a
position's logits must be identical whether computed alone (T = 1) or inside a verify
batch (T = 16, or a DDTree of up to 23 nodes), hence ``FUSED_MAX_T = 32``.  That is also
about where the paths cost the same on one core (4096x4096 Q4_K/Q8_0/Q6_K: the fused
kernel is faster up to T = 16 and even at T = 32).  The tiled and direct paths (BLAS)
are not batch-invariant; they serve prefill.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numba
import numpy as np
from gguf import GGMLQuantizationType

from kernels.ggml_quants import (
    _F16_TABLE,
    _FLOAT_CODES,
    _IQ4NL_VALUES,
    _N16,
    QuantLayoutError,
    _dequant_float_rows,
    _dequant_row,
    _dequant_rows_kernel,
    _dequant_rows_serial,
    _readonly_c,
    quant_spec,
    quantize,
    row_bytes,
)

__all__ = ["FUSED_MAX_T", "MatmulShapeError", "QuantizedWeight", "RowIndexError", "embedding_rows",
           "matmul", "tile_rows_for"]

# Widest activation block the fused (batch-invariant) kernel takes; above it, tiles + BLAS.
FUSED_MAX_T = 32
# Output rows per parallel work item of the fused kernel.
_FUSED_ROWS_PER_CHUNK = 16
# Tiled path: aim for ~1 MiB of float32 per tile, between 64 and 256 rows.
_TILE_TARGET_ELEMS = 1 << 18
_TILE_MIN_ROWS, _TILE_MAX_ROWS = 64, 256


class MatmulShapeError(ValueError):
    """Activations, weight or output buffer have incompatible shapes or dtypes."""


class RowIndexError(IndexError):
    """A requested row (token id) lies outside the weight."""


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight matrix ``(n_out, n_in)`` kept in its GGML format.

    ``raw`` is uint8 ``(n_out, row_bytes)``; it may be a read-only ``np.memmap`` slice and
    is never copied (except that a non-C-contiguous array gets one contiguous byte copy).
    """

    raw: np.ndarray
    qtype: GGMLQuantizationType
    n_out: int
    n_in: int
    _kernel_raw: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        spec = quant_spec(self.qtype)
        object.__setattr__(self, "qtype", spec.qtype)
        object.__setattr__(self, "n_out", int(self.n_out))
        object.__setattr__(self, "n_in", int(self.n_in))
        expected = (self.n_out, row_bytes(spec.qtype, self.n_in))
        raw = self.raw
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.shape != expected:
            desc = f"{raw.dtype}{list(raw.shape)}" if isinstance(raw, np.ndarray) else type(raw).__name__
            raise QuantLayoutError(f"{spec.qtype.name} weight ({self.n_out}, {self.n_in}) needs uint8 raw of shape "
                                   f"{list(expected)}, got {desc}")
        object.__setattr__(self, "_kernel_raw", _readonly_c(raw))

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @classmethod
    def from_float(cls, w: np.ndarray, qtype) -> "QuantizedWeight":
        """Quantise a float matrix ``(n_out, n_in)`` (types `ggml_quants.quantize` supports)."""
        raw = quantize(w, qtype)                 # validates w: 2-D float, row length fits the type
        n_out, n_in = np.shape(w)
        return cls(raw, quant_spec(qtype).qtype, n_out, n_in)


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------

@numba.njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _fused_rows(code, raw, row_start, row_stop, n_blocks, x, out, n16, kvalues, f16_table, w_row):
    """Rows row_start:row_stop of the fused product; w_row is this thread's row buffer."""
    n_in = x.shape[1]
    for r in range(row_start, row_stop):
        _dequant_row(code, raw[r], n_blocks, w_row, n16, kvalues, f16_table)
        for t in range(x.shape[0]):
            x_t = x[t]
            acc = np.float32(0.0)
            for i in range(n_in):
                acc += w_row[i] * x_t[i]
            out[t, r] = acc


@numba.njit(cache=True, parallel=True)
def _fused_matmul_kernel(code, raw, n_blocks, x, out, n16, kvalues, f16_table, rows_per_chunk):
    # The loop body is a call to a separately compiled function on purpose: code written
    # inline in a prange body ran 1.3-3x slower (numba outlines parfor bodies into gufuncs
    # that LLVM optimises less well).
    n_out = raw.shape[0]
    n_chunks = (n_out + rows_per_chunk - 1) // rows_per_chunk
    for c in numba.prange(n_chunks):
        w_row = np.empty(x.shape[1], dtype=np.float32)
        _fused_rows(code, raw, c * rows_per_chunk, min((c + 1) * rows_per_chunk, n_out), n_blocks, x, out,
                    n16, kvalues, f16_table, w_row)


# --------------------------------------------------------------------------------------
# scratch for the tiled path: one float32 buffer per Python thread, grown on demand
# --------------------------------------------------------------------------------------

_scratch_local = threading.local()


def _scratch(n_elems: int) -> np.ndarray:
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.size < n_elems:
        buf = np.empty(n_elems, dtype=np.float32)
        _scratch_local.buf = buf
    return buf[:n_elems]


def tile_rows_for(n_in: int) -> int:
    """Rows per dequantised tile in the tiled path."""
    return max(_TILE_MIN_ROWS, min(_TILE_MAX_ROWS, _TILE_TARGET_ELEMS // max(1, n_in)))


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------

def _check_activations(x, w: QuantizedWeight) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != w.n_in:
        desc = f"{x.dtype}{list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise MatmulShapeError(f"activations must be a 2-D array (T, {w.n_in}), got {desc}")
    if not np.issubdtype(x.dtype, np.floating):
        raise MatmulShapeError(f"activations must be floating point, got {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_out(out, shape: tuple[int, int]) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape
            or not out.flags.c_contiguous or not out.flags.writeable):
        desc = f"{out.dtype}{list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
        raise MatmulShapeError(f"out must be a writable C-contiguous float32 array of shape {list(shape)}, got {desc}")
    return out


def matmul(x: np.ndarray, w: QuantizedWeight, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T``: x float ``(T, n_in)`` -> float32 ``(T, n_out)`` (written into ``out``
    when given).  Batch-invariant for ``T <= FUSED_MAX_T`` (see the module docstring)."""
    x = _check_activations(x, w)
    n_t = x.shape[0]
    out = _check_out(out, (n_t, w.n_out))
    if n_t == 0 or w.n_out == 0:
        return out
    spec = quant_spec(w.qtype)
    raw = w._kernel_raw
    n_blocks = w.n_in // spec.block_size

    if n_t <= FUSED_MAX_T:
        _fused_matmul_kernel(spec.kernel_code, raw, n_blocks, x, out, _N16, _IQ4NL_VALUES, _F16_TABLE,
                             _FUSED_ROWS_PER_CHUNK)
        return out

    if w.qtype == GGMLQuantizationType.F32:
        np.matmul(x, raw.view(np.float32).T, out=out)
        return out

    tile_rows = tile_rows_for(w.n_in)
    scratch = _scratch(min(tile_rows, w.n_out) * w.n_in)
    for r0 in range(0, w.n_out, tile_rows):
        r1 = min(r0 + tile_rows, w.n_out)
        tile = scratch[: (r1 - r0) * w.n_in].reshape(r1 - r0, w.n_in)
        if spec.kernel_code in _FLOAT_CODES:
            _dequant_float_rows(raw[r0:r1], w.qtype, tile)
        else:
            _dequant_rows_serial(spec.kernel_code, raw[r0:r1], n_blocks, tile, _N16, _IQ4NL_VALUES, _F16_TABLE)
        np.matmul(x, tile.T, out=out[:, r0:r1])
    return out


def embedding_rows(w: QuantizedWeight, ids) -> np.ndarray:
    """Rows ``ids`` of W dequantised to float32 ``(len(ids), n_in)``; only those rows'
    bytes are read (token embeddings)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise RowIndexError(f"row ids must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
    ids = ids.astype(np.int64, copy=False)
    out = np.empty((ids.size, w.n_in), dtype=np.float32)
    if ids.size == 0:
        return out
    bad = (ids < 0) | (ids >= w.n_out)
    if bad.any():
        raise RowIndexError(f"row id {int(ids[np.argmax(bad)])} outside 0..{w.n_out - 1}")
    spec = quant_spec(w.qtype)
    rows = w._kernel_raw[ids]   # copies just the requested rows' bytes
    if spec.kernel_code in _FLOAT_CODES:
        _dequant_float_rows(rows, w.qtype, out)
    else:
        _dequant_rows_kernel(spec.kernel_code, _readonly_c(rows), w.n_in // spec.block_size, out, _N16,
                             _IQ4NL_VALUES, _F16_TABLE)
    return out
