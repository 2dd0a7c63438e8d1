"""The CUDA/HIP backend: `kernels.backend.Backend` on CuPy raw kernels (first GPU path).

Implemented on the device: the quantised matrix product for Q8_0, Q4_K, F16, BF16 (and F32
through cuBLAS), token embedding rows, the Gated DeltaNet recurrent step, and the cheap
elementwise / normalisation operations. The rest of the interface (RoPE, causal conv, chunked
DeltaNet, attention) raises `BackendError` until the full GPU backend lands.

Weights are uploaded once, as the GGUF file's raw bytes in ggml's block layouts (`GpuWeight`);
the kernels in `kernels/quant_matvec.cu` read those blocks directly. `matmul` picks:

* T <= `MATVEC_MAX_T` activation rows: the matvec kernels, 8 rows per launch (each launch reads
  the weight once; a launch for T rows is a separate compiled instance, see `_matvec_kernel`);
* more rows (prefill): `DEQUANT_TILE_BYTES` worth of weight rows at a time dequantised to f32
  and multiplied by cuBLAS.

Kernel sources are CUDA C++ that also compiles for HIP (see the .cu headers); each module is
compiled once per process (CuPy also keeps a disk cache) and looked up by name. Importing this
module needs no CuPy; creating a `CudaBackend` without CuPy or without a device raises
`BackendError`.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kernels.backend import BackendError

__all__ = ["CudaBackend", "GpuWeight", "MATVEC_CONFIGS", "MATVEC_MAX_T", "MATVEC_LOOP_MAX_T", "matvec_config"]

_KERNEL_DIR = Path(__file__).resolve().parent

# ggml type ids (ggml.h `enum ggml_type`); kept numeric so this module imports without gguf.
GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q4_K, GGML_BF16 = 0, 1, 8, 12, 30
_TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_Q8_0: "Q8_0", GGML_Q4_K: "Q4_K", GGML_BF16: "BF16"}
# (weights per block, bytes per block) of the types the GPU kernels read.
_BLOCKS = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_BF16: (1, 2), GGML_Q8_0: (32, 34), GGML_Q4_K: (256, 144)}
_MATVEC_NAMES = {GGML_Q8_0: "q8_0_matvec", GGML_Q4_K: "q4_k_matvec", GGML_F16: "f16_matvec", GGML_BF16: "bf16_matvec"}
_DEQUANT_NAMES = {GGML_Q8_0: "dequant_q8_0", GGML_Q4_K: "dequant_q4_k", GGML_F16: "dequant_f16", GGML_BF16: "dequant_bf16"}

MATVEC_BLOCK = 128          # threads per block (MV_BLOCK in quant_matvec.cu)
MATVEC_MAX_T = 8            # activation rows one matvec launch handles
MATVEC_LOOP_MAX_T = 64      # up to this many rows, loop matvec launches; beyond, dequantise + GEMM
DEQUANT_TILE_BYTES = 64 << 20   # f32 bytes of weight rows dequantised at a time on the GEMM path
WEIGHT_PAD_BYTES = 16       # Q8_0 words are read as aligned 32-bit pairs: may touch 2 bytes past the end
DELTANET_COLS, DELTANET_PARTS = 32, 4   # DN_COLS, DN_PARTS in deltanet.cu
_DELTANET_RPT = (8, 16, 32, 64)         # instantiated rows-per-thread; d_k <= 4 * RPT


# (rows per block R, column passes per iteration U) the bench may choose from; each is tested.
MATVEC_CONFIGS = ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (4, 4))


def matvec_config(qtype: int, n_t: int) -> tuple[int, int]:
    """(R, U) for a matvec of `n_t` activation rows: R weight rows per block (each x register
    reused R times, R*U*2 weight words in flight per thread, more registers), U passes over the
    columns per iteration (more bytes in flight, fewer barriers). Any pair in MATVEC_CONFIGS is
    correct. Chosen from tests/bench/bench_gpu_matvec.py on the H200 (mean over 4096x4096,
    5120x17408, 17408x5120): Q4_K (8, 1) for T <= 2 and (4, 1) above; Q8_0 (4, 1). U = 2 measured
    ~10% faster at T = 3..4 but is left off until batch invariance across U is checked on a device."""
    if qtype == GGML_Q4_K:
        return (8, 1) if n_t <= 2 else (4, 1)
    return (4, 1)


@dataclass(frozen=True, eq=False)
class GpuWeight:
    """A weight matrix (n_out, n_in) on the device in its GGUF quantisation.

    `data` is the raw bytes (uint8, `WEIGHT_PAD_BYTES` zero bytes past the end) for quantised
    and 16-bit types, or a float32 (n_out, n_in) array for F32."""

    name: str
    qtype: int
    n_out: int
    n_in: int
    row_bytes: int
    nbytes: int
    data: Any

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES.get(self.qtype, f"type{self.qtype}")


class _Modules:
    """Compiled RawModules, one per (source, defines), shared by every backend in the process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._sources: dict[str, str] = {}

    def get(self, cp, source: str, defines: tuple[str, ...] = ()):
        key = (source, defines)
        with self._lock:
            mod = self._cache.get(key)
            if mod is None:
                code = self._sources.get(source)
                if code is None:
                    code = (_KERNEL_DIR / source).read_text()
                    self._sources[source] = code
                options = tuple(f"-D{d}" for d in defines)
                try:
                    mod = cp.RawModule(code=code, options=options)
                    mod.compile()
                except Exception as exc:  # NVRTC/hiprtc errors carry the compiler log
                    raise BackendError(f"compiling kernels/{source} {' '.join(options)} failed: "
                                       f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}") from exc
                self._cache[key] = mod
            return mod


_MODULES = _Modules()


class CudaBackend:
    """CuPy implementation of `kernels.backend.Backend` (see that module for the contract)."""

    def __init__(self, device: int | str = 0):
        """`device`: a device index, or "cuda:N" / "hip:N" / "rocm:N" (as `kernels.get_backend` passes)."""
        if isinstance(device, str):
            kind, _, index = device.strip().lower().partition(":")
            if kind not in ("cuda", "hip", "rocm") or not (index == "" or index.isdigit()):
                raise BackendError(f"unknown GPU device '{device}' (expected cuda:N or hip:N)")
            device_id = int(index or 0)
        else:
            device_id = int(device)
        try:
            import cupy as cp
        except Exception as exc:  # ImportError, or CuPy failing to find its CUDA/ROCm libraries
            raise BackendError(f"the CUDA backend needs CuPy (pip install 'dflashd[cuda]' or "
                               f"'dflashd[rocm]'): {type(exc).__name__}: {exc}") from exc
        try:
            n_devices = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise BackendError(f"no usable GPU: {type(exc).__name__}: {exc}") from exc
        if n_devices == 0:
            raise BackendError("no usable GPU: CuPy sees 0 devices")
        if not 0 <= device_id < n_devices:
            raise BackendError(f"GPU {device_id} does not exist (CuPy sees {n_devices})")
        self._cp = cp
        self.xp = cp
        self._device = cp.cuda.Device(device_id)
        self._device.use()
        self.name = "hip" if cp.cuda.runtime.is_hip else "cuda"
        self.device = f"{self.name}:{device_id}"

    def __repr__(self) -> str:
        return f"CudaBackend(device={self.device!r})"

    # -- helpers ----------------------------------------------------------------------------------
    def _f32(self, a) -> Any:
        return self._cp.ascontiguousarray(self._cp.asarray(a), dtype=self._cp.float32)

    def _matvec_kernel(self, qtype: int, n_t: int, n_rows: int, n_units: int):
        mod = _MODULES.get(self._cp, "quant_matvec.cu", (f"MV_T={n_t}", f"MV_R={n_rows}", f"MV_U={n_units}"))
        return mod.get_function(_MATVEC_NAMES[qtype])

    def _dequant_kernel(self, qtype: int):
        return _MODULES.get(self._cp, "quant_matvec.cu").get_function(_DEQUANT_NAMES[qtype])

    # -- data movement ------------------------------------------------------------------------
    def asarray(self, host_array: Any, dtype: Any = None) -> Any:
        return self._cp.array(host_array, dtype=dtype, copy=True)

    def to_host(self, array: Any) -> np.ndarray:
        if isinstance(array, self._cp.ndarray):
            return self._cp.asnumpy(array)
        return np.asarray(array)

    def load_weight(self, tensor: Any) -> GpuWeight:
        ne = tuple(int(n) for n in tensor.ne)
        if len(ne) != 2:
            raise BackendError(f"weight '{tensor.name}' must be a matrix, has shape {list(ne)}")
        qtype = int(tensor.qtype)
        if qtype not in _BLOCKS:
            raise BackendError(f"weight '{tensor.name}': type {getattr(tensor, 'type_name', qtype)} is not "
                               f"implemented on the CUDA backend yet (have {', '.join(_TYPE_NAMES.values())})")
        n_in, n_out = ne
        block_weights, block_bytes = _BLOCKS[qtype]
        if n_in % block_weights:
            raise BackendError(f"weight '{tensor.name}': {n_in} columns is not a multiple of the "
                               f"{_TYPE_NAMES[qtype]} block size {block_weights}")
        row_bytes = n_in // block_weights * block_bytes
        raw = np.asarray(tensor.raw)
        if raw.dtype != np.uint8 or raw.shape != (n_out, row_bytes):
            raise BackendError(f"weight '{tensor.name}': raw bytes {raw.dtype}{list(raw.shape)} do not match "
                               f"{_TYPE_NAMES[qtype]} ({n_out}, {n_in}) = uint8[{n_out}, {row_bytes}]")
        nbytes = n_out * row_bytes
        cp = self._cp
        if qtype == GGML_F32:
            data = cp.asarray(np.ascontiguousarray(raw).view(np.float32).reshape(n_out, n_in))
        else:
            data = cp.zeros(nbytes + WEIGHT_PAD_BYTES, dtype=cp.uint8)
            data[:nbytes].set(np.ascontiguousarray(raw).reshape(-1))
        return GpuWeight(str(tensor.name), qtype, n_out, n_in, row_bytes, nbytes, data)

    def load_vector(self, tensor: Any) -> Any:
        return self._cp.asarray(np.ascontiguousarray(tensor.dequantize(), dtype=np.float32))

    def weight_nbytes(self, weight: GpuWeight) -> int:
        return weight.nbytes

    # -- linear algebra -------------------------------------------------------------------------
    def matmul(self, x: Any, weight: GpuWeight) -> Any:
        cp = self._cp
        x = self._f32(x)
        squeeze = x.ndim == 1
        if squeeze:
            x = x[None, :]
        if x.ndim != 2 or x.shape[1] != weight.n_in:
            raise BackendError(f"matmul: x{list(x.shape)} does not match weight '{weight.name}' "
                               f"({weight.n_out}, {weight.n_in})")
        n_t = x.shape[0]
        if weight.qtype == GGML_F32:
            y = cp.ascontiguousarray(x @ weight.data.T)
        else:
            y = cp.empty((n_t, weight.n_out), dtype=cp.float32)
            if n_t == 0 or weight.n_out == 0:
                pass
            elif n_t <= MATVEC_LOOP_MAX_T and weight.qtype in _MATVEC_NAMES and weight.n_in % 4 == 0:
                for t0 in range(0, n_t, MATVEC_MAX_T):
                    t1 = min(t0 + MATVEC_MAX_T, n_t)
                    self._matvec(x[t0:t1], weight, y[t0:t1])
            else:
                self._dequant_gemm(x, weight, y)
        return y[0] if squeeze else y

    def _matvec(self, x, weight: GpuWeight, y, config: tuple[int, int] | None = None) -> None:
        """y[T, n_out] = x[T, n_in] @ W.T for T <= MATVEC_MAX_T; x and y contiguous device arrays.
        `config` = (R, U) overrides `matvec_config` (tests and the bench)."""
        n_t = x.shape[0]
        n_rows, n_units = config or matvec_config(weight.qtype, n_t)
        if not (1 <= n_t <= MATVEC_MAX_T and 1 <= n_rows <= 8 and 1 <= n_units <= 4):
            raise BackendError(f"matvec: T={n_t} (1..{MATVEC_MAX_T}), rows per block {n_rows} (1..8), "
                               f"passes per iteration {n_units} (1..4)")
        kern = self._matvec_kernel(weight.qtype, n_t, n_rows, n_units)
        grid = (weight.n_out + n_rows - 1) // n_rows
        kern((grid,), (MATVEC_BLOCK,), (weight.data, x, y, np.int32(weight.n_out), np.int32(weight.n_in),
                                        np.int32(weight.row_bytes)))

    def _dequant_rows(self, weight: GpuWeight, out, row_start: int = 0, row_ids=None) -> None:
        """out[n, n_in] (f32, contiguous) = rows row_start.. (or row_ids) of W dequantised."""
        n_rows = out.shape[0]
        total = n_rows * weight.n_in
        if total == 0:
            return
        grid = min((total + 255) // 256, 65535)
        self._dequant_kernel(weight.qtype)(
            (grid,), (256,), (weight.data, row_ids, np.int32(row_start), out, np.int32(n_rows),
                              np.int32(weight.n_in), np.int32(weight.row_bytes)))

    def _dequant_gemm(self, x, weight: GpuWeight, y) -> None:
        cp = self._cp
        tile_rows = max(1, min(weight.n_out, DEQUANT_TILE_BYTES // (4 * weight.n_in)))
        tile = cp.empty((tile_rows, weight.n_in), dtype=cp.float32)
        for r0 in range(0, weight.n_out, tile_rows):
            r1 = min(r0 + tile_rows, weight.n_out)
            w_rows = tile[: r1 - r0]
            self._dequant_rows(weight, w_rows, row_start=r0)
            y[:, r0:r1] = x @ w_rows.T

    def dequantize(self, weight: GpuWeight) -> Any:
        """The whole weight as f32 (n_out, n_in) on the device (tests and small tensors)."""
        cp = self._cp
        if weight.qtype == GGML_F32:
            return weight.data.copy()
        out = cp.empty((weight.n_out, weight.n_in), dtype=cp.float32)
        self._dequant_rows(weight, out)
        return out

    def embed(self, weight: GpuWeight, token_ids: Sequence[int]) -> Any:
        cp = self._cp
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= weight.n_out):
            bad = int(ids[(ids < 0) | (ids >= weight.n_out)][0])
            raise BackendError(f"embed: token id {bad} outside 0..{weight.n_out - 1}")
        if weight.qtype == GGML_F32:
            return weight.data[cp.asarray(ids)]
        out = cp.empty((ids.size, weight.n_in), dtype=cp.float32)
        self._dequant_rows(weight, out, row_ids=cp.asarray(ids.astype(np.int32)))
        return out

    # -- elementwise and normalisation --------------------------------------------------------
    def rms_norm(self, x: Any, weight: Any | None, eps: float) -> Any:
        cp = self._cp
        x = self._f32(x)
        ms = cp.mean(cp.square(x.astype(cp.float64)), axis=-1, keepdims=True)
        y = x * (1.0 / cp.sqrt(ms + eps)).astype(cp.float32)
        return y if weight is None else y * self._f32(weight)

    def l2_norm(self, x: Any, eps: float) -> Any:
        # x / sqrt(sum x^2 + eps): the form kernels/deltanet.py (the CPU backend) uses.
        cp = self._cp
        x = self._f32(x)
        ss = cp.sum(cp.square(x.astype(cp.float64)), axis=-1, keepdims=True)
        return x * (1.0 / cp.sqrt(ss + eps)).astype(cp.float32)

    def silu_mul(self, gate: Any, up: Any) -> Any:
        gate = self._f32(gate)
        return gate / (1.0 + self._cp.exp(-gate)) * self._f32(up)

    def sigmoid_mul(self, x: Any, gate: Any) -> Any:
        return self._f32(x) / (1.0 + self._cp.exp(-self._f32(gate)))

    def gated_rms_norm(self, x: Any, weight: Any, z: Any, eps: float) -> Any:
        return self.silu_mul(z, self.rms_norm(x, weight, eps))

    def rope_neox(self, x: Any, positions: Any, n_rot: int, theta: float) -> Any:
        raise BackendError("rope_neox is not implemented on the CUDA backend yet")

    # -- recurrent mixers -----------------------------------------------------------------------
    def causal_conv1d_silu(self, x: Any, conv_state: Any, weight: Any) -> tuple[Any, Any]:
        raise BackendError("causal_conv1d_silu is not implemented on the CUDA backend yet")

    def deltanet_recurrent(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any,
                           checkpoints: Any | None = None) -> Any:
        cp = self._cp
        q, k, v, g, beta = (self._f32(a) for a in (q, k, v, g, beta))
        if q.ndim != 3 or k.shape != q.shape:
            raise BackendError(f"deltanet: q and k must both be [T, H_k, d_k], got {q.shape} and {k.shape}")
        n_t, h_k, d_k = q.shape
        if v.ndim != 3 or v.shape[0] != n_t:
            raise BackendError(f"deltanet: v must be [T={n_t}, H_v, d_v], got {v.shape}")
        h_v, d_v = v.shape[1], v.shape[2]
        if h_v % h_k:
            raise BackendError(f"deltanet: {h_v} value heads is not a multiple of {h_k} key heads")
        if g.shape != (n_t, h_v) or beta.shape != (n_t, h_v):
            raise BackendError(f"deltanet: g and beta must be [T={n_t}, H_v={h_v}], got {g.shape} and {beta.shape}")
        if (not isinstance(state, cp.ndarray) or state.shape != (h_v, d_k, d_v) or state.dtype != cp.float32
                or not state.flags.c_contiguous):
            raise BackendError(f"deltanet: state must be a C-contiguous float32 device array [{h_v}, {d_k}, {d_v}] "
                               f"(updated in place), got {getattr(state, 'dtype', type(state).__name__)}"
                               f"{list(getattr(state, 'shape', ()))}")
        if checkpoints is not None and (
                not isinstance(checkpoints, cp.ndarray) or checkpoints.shape != (n_t, h_v, d_k, d_v)
                or checkpoints.dtype != cp.float32 or not checkpoints.flags.c_contiguous):
            raise BackendError(f"deltanet: checkpoints must be a C-contiguous float32 device array "
                               f"[{n_t}, {h_v}, {d_k}, {d_v}], got {getattr(checkpoints, 'dtype', '?')}"
                               f"{list(getattr(checkpoints, 'shape', ()))}")
        rpt = next((r for r in _DELTANET_RPT if DELTANET_PARTS * r >= d_k), None)
        if rpt is None:
            raise BackendError(f"deltanet: d_k = {d_k} exceeds the kernel's {DELTANET_PARTS * _DELTANET_RPT[-1]}")
        out = cp.empty((n_t, h_v, d_v), dtype=cp.float32)
        if n_t == 0 or d_v == 0 or h_v == 0:
            return out
        kern = _MODULES.get(cp, "deltanet.cu").get_function(f"deltanet_recurrent_r{rpt}")
        grid = ((d_v + DELTANET_COLS - 1) // DELTANET_COLS, h_v)
        kern(grid, (DELTANET_COLS * DELTANET_PARTS,),
             (q, k, v, g, beta, state, checkpoints, out, np.int32(n_t), np.int32(h_k), np.int32(h_v),
              np.int32(d_k), np.int32(d_v), np.float32(1.0 / math.sqrt(d_k))))
        return out

    def deltanet_chunked(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any,
                         chunk_size: int = 64) -> Any:
        raise BackendError("deltanet_chunked is not implemented on the CUDA backend yet")

    # -- attention ------------------------------------------------------------------------------
    def attention(self, q: Any, k_cache: Any, v_cache: Any, q_positions: Any, kv_len: int,
                  scale: float, mask: Any | None = None) -> Any:
        raise BackendError("attention is not implemented on the CUDA backend yet")

    # -- sampling support -----------------------------------------------------------------------
    def argmax(self, logits: Any) -> np.ndarray:
        # cupy.argmax, like numpy's, returns the first maximum: the lowest index on ties.
        cp = self._cp
        return cp.asnumpy(cp.argmax(cp.atleast_2d(cp.asarray(logits)), axis=-1))
