"""The CUDA/HIP backend: `kernels.backend.Backend` on CuPy raw kernels.

Every operation of the interface runs on the device:

* quantised matrix products (`kernels/quant_matvec.cu`) for F32, F16, BF16, Q4_0, Q4_1, Q5_0,
  Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, reading the GGUF blocks directly; token embedding rows;
* RMSNorm, L2 norm, gated RMSNorm, SwiGLU, sigmoid gating, partial NeoX RoPE, the causal conv +
  silu and row argmax (`kernels/ops.cu`);
* attention over the KV cache for decode, verify (explicit mask) and prefill (`kernels/attention.cu`);
* the Gated DeltaNet recurrence (`kernels/deltanet.cu`). `deltanet_chunked` runs the same
  recurrent kernel over all T tokens in one launch (exact, not the chunked WY form: the state
  stays in registers across tokens; a tensor-core chunked kernel for long prefills is future work).

Weights are uploaded once, as the GGUF file's raw bytes in ggml's block layouts (`GpuWeight`).
`matmul` picks:

* T <= `MATVEC_LOOP_MAX_T` activation rows (decode, verify): the matvec kernels, up to
  `MATVEC_MAX_T` rows per launch (each launch reads the weight once). These are batch-invariant:
  a row's result does not depend on the other rows, so a verify batch reproduces decode exactly.
  Q8_0, Q4_K, F16, BF16 and F32 have their own kernels; the other block types share one generic
  kernel (`block_matvec`, compiled per type with -DMV_QTYPE).
* more rows (prefill): `DEQUANT_TILE_BYTES` worth of weight rows at a time dequantised to f32
  and multiplied by cuBLAS.

`load_matmul_weight` (what `daemons.qwen35` loads every matrix but the embedding with) instead
repacks Q4_K, Q5_K, Q6_K, IQ4_XS, Q8_0 and F16 matrices into the tensor-core layout of
`kernels/mma_matmul.cu` (`kernels.fused_gpu.TcWeight`: the same bytes, reordered); `matmul` runs
those through the tensor-core kernel, and a model whose matrices all have that layout runs its
steps through `daemons/qwen35_gpu.py` (fused kernels, CUDA graphs, `capture_graph` /
`launch_graph`, programmatic dependent launch where the driver allows it). From `WIDE_MIN_T` rows
on (prefill chunks), a tensor-core weight is instead dequantised to f16 a slice of rows at a time
(`WIDE_SCRATCH_BYTES`, mma_matmul.cu `units_f16_*`) and multiplied by cuBLAS (f16 in, f32
accumulate and out): compute-bound at hundreds of rows, where the tensor-core kernel would read
the weights again every 32 rows. Those rows are not bit-identical to the same rows of a narrower
batch (decode and verify, which never reach `WIDE_MIN_T`, are).

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

__all__ = ["CudaBackend", "GpuWeight", "MATVEC_CONFIGS", "MATVEC_MAX_T", "MATVEC_LOOP_MAX_T", "matvec_config",
           "SUPPORTED_GPU_TYPES"]

_KERNEL_DIR = Path(__file__).resolve().parent

# ggml type ids (ggml.h `enum ggml_type`); kept numeric so this module imports without gguf.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0 = 0, 1, 2, 3, 6, 7, 8
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K, GGML_IQ4_XS, GGML_BF16 = 12, 13, 14, 23, 30
_TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_BF16: "BF16", GGML_Q4_0: "Q4_0", GGML_Q4_1: "Q4_1",
               GGML_Q5_0: "Q5_0", GGML_Q5_1: "Q5_1", GGML_Q8_0: "Q8_0", GGML_Q4_K: "Q4_K", GGML_Q5_K: "Q5_K",
               GGML_Q6_K: "Q6_K", GGML_IQ4_XS: "IQ4_XS"}
SUPPORTED_GPU_TYPES = tuple(_TYPE_NAMES.values())
# (weights per block, bytes per block) of the types the GPU kernels read.
_BLOCKS = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_BF16: (1, 2), GGML_Q4_0: (32, 18), GGML_Q4_1: (32, 20),
           GGML_Q5_0: (32, 22), GGML_Q5_1: (32, 24), GGML_Q8_0: (32, 34), GGML_Q4_K: (256, 144),
           GGML_Q5_K: (256, 176), GGML_Q6_K: (256, 210), GGML_IQ4_XS: (256, 136)}
# Types with a kernel of their own (tuned R/U configs); the other block types use `block_matvec`.
_MATVEC_NAMES = {GGML_Q8_0: "q8_0_matvec", GGML_Q4_K: "q4_k_matvec", GGML_F16: "f16_matvec",
                 GGML_BF16: "bf16_matvec", GGML_F32: "f32_matvec"}
_GENERIC_MATVEC_TYPES = (GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q5_K, GGML_Q6_K, GGML_IQ4_XS)
_DEQUANT_NAMES = {GGML_Q8_0: "dequant_q8_0", GGML_Q4_K: "dequant_q4_k", GGML_F16: "dequant_f16",
                  GGML_BF16: "dequant_bf16", GGML_F32: "dequant_f32",
                  **{t: f"dequant_block_{_TYPE_NAMES[t].lower()}" for t in _GENERIC_MATVEC_TYPES}}

MATVEC_BLOCK = 128          # threads per block (MV_BLOCK in quant_matvec.cu)
MATVEC_GROUPS = 4           # 32-thread row groups per block of the generic kernel (GROUPS_PER_BLOCK)
MATVEC_MAX_T = 8            # activation rows one matvec launch handles
MATVEC_LOOP_MAX_T = 64      # up to this many rows, loop matvec launches; beyond, dequantise + GEMM
DEQUANT_TILE_BYTES = 64 << 20   # f32 bytes of weight rows dequantised at a time on the GEMM path
# Rows from which a tensor-core weight's product is f16 dequantise + cuBLAS, and a model forward leaves
# the step (`wide_batch_min`). H200, 27B Q4_K_M (`dflashd bench --short-prompts`, 2026-12-01): steps of
# 32 tokens take ~0.48 ms a token (32 ms for 64 tokens, 64 / 77 / 92 / 123 ms for 128 / 160 / 192 /
# 256), one wide forward 76-135 ms whatever the length (every weight dequantised again, ~3,800 calls
# from Python: it varies from run to run), so steps win up to ~190 tokens; at 160 they always won.
WIDE_MIN_T = 160
WIDE_SCRATCH_BYTES = 256 << 20  # f16 bytes of weight rows dequantised at a time on that path
WEIGHT_PAD_BYTES = 16       # 2-byte-aligned words are read as aligned 32-bit pairs: may touch 2 bytes past the end
DELTANET_COLS, DELTANET_PARTS = 32, 4   # DN_COLS, DN_PARTS in deltanet.cu
_DELTANET_RPT = (8, 16, 32, 64)         # instantiated rows-per-thread; d_k <= 4 * RPT
ATTENTION_THREADS, ATTENTION_SPAN, ATTENTION_MAX_D = 128, 256, 256   # attention.cu
ELEMENTWISE_BLOCK, ELEMENTWISE_MAX_GRID = 256, 8192
CONV_TOKENS = 16            # tokens per thread of causal_conv1d_silu_f32 (ops.cu CONV_TOKENS)
_CUDA_R_16F, _CUDA_R_32F = 2, 0           # cudaDataType (library_types.h)
_CUBLAS_GEMM_DEFAULT = -1                 # cublasGemmAlgo_t: cuBLAS picks


# (rows per block R, column passes per iteration U) the bench may choose from; each is tested.
MATVEC_CONFIGS = ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (4, 4))


def matvec_config(qtype: int, n_t: int) -> tuple[int, int]:
    """(R, U) for a matvec of `n_t` activation rows: R weight rows per block (each x register
    reused R times, R*U*2 weight words in flight per thread, more registers), U passes over the
    columns per iteration (more bytes in flight, fewer barriers). Any pair in MATVEC_CONFIGS is
    correct. Chosen from tests/bench/bench_gpu_matvec.py on the H200 (mean over 4096x4096,
    5120x17408, 17408x5120): Q4_K (8, 1) for T <= 2 and (4, 1) above; Q8_0 (4, 1). U = 2 measured
    ~10% faster at T = 3..4 but is left off until batch invariance across U is checked on a device.
    For the generic block kernel R is the rows per 32-thread group (U unused): 2 while the
    activations are few, 1 above (register pressure: 16 weights x R rows + 16 x values per lane)."""
    if qtype == GGML_Q4_K:
        return (8, 1) if n_t <= 2 else (4, 1)
    if qtype in _GENERIC_MATVEC_TYPES:
        return (2, 1) if n_t <= 4 else (1, 1)
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
        self.extra_defines: tuple[str, ...] = ()      # added to every module's (set_step_timeline)

    def get(self, cp, source: str, defines: tuple[str, ...] = ()):
        defines = tuple(defines) + self.extra_defines
        key = (source, defines)
        with self._lock:
            mod = self._cache.get(key)
            if mod is None:
                code = self._sources.get(source)
                if code is None:
                    code = _inline_includes((_KERNEL_DIR / source).read_text())
                    self._sources[source] = code
                options = ("--std=c++17",) + tuple(f"-D{d}" for d in defines)
                try:
                    mod = cp.RawModule(code=code, options=options)
                    mod.compile()
                except Exception as exc:  # NVRTC/hiprtc errors carry the compiler log
                    raise BackendError(f"compiling kernels/{source} {' '.join(options)} failed: "
                                       f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}") from exc
                self._cache[key] = mod
            return mod


_MODULES = _Modules()

TIMELINE_SLOTS, TIMELINE_FIELDS = 4096, 6       # kernels/timeline.cuh TL_SLOTS, TL_FIELDS


def set_step_timeline(on: bool) -> None:
    """Build every module from now on with the step timeline (kernels/timeline.cuh): a benchmark's
    switch (tests/bench/timeline_gpu_step.py), set before the kernels it times are first loaded."""
    _MODULES.extra_defines = ("STEP_TIMELINE",) if on else ()


def step_timeline_tables(cp) -> list:
    """The timeline table ([TIMELINE_SLOTS, TIMELINE_FIELDS] uint64, on the device) of every module
    built with the step timeline."""
    with _MODULES._lock:
        mods = [mod for (_src, defines), mod in _MODULES._cache.items() if "STEP_TIMELINE" in defines]
    tables = []
    for mod in mods:
        try:                      # modules that include no timeline.cuh (ops.cu, attention.cu, ...) have no table
            ptr = mod.get_global("tl_tab")
        except Exception:
            continue
        tables.append(cp.ndarray((TIMELINE_SLOTS, TIMELINE_FIELDS), dtype=cp.uint64, memptr=ptr))
    return tables


def _inline_includes(code: str) -> str:
    """Replace `#include "x.cuh"` of a file in kernels/ by its text: CuPy keys its compile cache on the
    source string, so a header must be part of it (an -I include would not invalidate the cache)."""
    out = []
    for line in code.splitlines():
        stripped = line.strip()
        if stripped.startswith('#include "') and stripped.endswith('.cuh"'):
            out.append(_inline_includes((_KERNEL_DIR / stripped[len('#include "'):-1]).read_text()))   # headers include headers
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _cublas_gemm_ex(*args) -> None:
    """cuBLAS / hipBLAS gemmEx through CuPy (a function of its own so a test can take it away)."""
    from cupy_backends.cuda.libs import cublas
    cublas.gemmEx(*args)


def _shape_str(a) -> str:
    return f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', ()))}"


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
        self._pos_cache: tuple[bytes, Any] | None = None
        self._clock_khz: int | None = None
        self._fused = None
        self._tc_scratch: dict[str, Any] = {}
        self._gemm_ex = True             # cuBLAS / hipBLAS gemmEx for the wide product (else an f32 GEMM)
        self.gemm_ex_error: str | None = None
        self.pdl = True                  # programmatic dependent launch in captured steps (sm_90)
        self.pdl_used = False            # whether the last captured graph got it
        self.pdl_error: str | None = None
        self._pdl = None

    supports_fused_step = True      # daemons/qwen35_gpu.py: the step as fused kernels
    wide_batch_min = WIDE_MIN_T     # daemons/qwen35.py: from this many tokens a forward leaves the step
    supports_graphs = True          # ... captured as CUDA graphs

    def __repr__(self) -> str:
        return f"CudaBackend(device={self.device!r})"

    @property
    def multiprocessors(self) -> int:
        return int(self._device.attributes.get("MultiProcessorCount", 132))

    def resident_blocks(self, kernel, threads: int, smem: int) -> int | None:
        """Blocks of `kernel` (a CuPy RawKernel) one multiprocessor holds at once with `threads` threads and
        `smem` bytes of dynamic shared memory (the driver's occupancy calculator), or None where it cannot
        be asked (HIP, no driver library). A persistent launch (fused_gpu.op_mm_chain) needs all its blocks
        resident together."""
        if self._cp.cuda.runtime.is_hip:
            return None
        try:
            import ctypes
            fn = getattr(kernel, "kernel", kernel)
            n = ctypes.c_int()
            rc = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(n), ctypes.c_void_p(fn.ptr), ctypes.c_int(threads), ctypes.c_size_t(smem))
            return n.value if rc == 0 else None
        except Exception:        # noqa: BLE001 - no driver library or symbol
            return None

    @property
    def supports_clusters(self) -> bool:
        """Thread-block clusters (kernels/fused.cu *_cly<N> kernels): CUDA sm_90 and later."""
        return not self._cp.cuda.runtime.is_hip and int(self._device.compute_capability) >= 90

    @staticmethod
    def ptr(array) -> int:
        """Device address of an array's first element."""
        return int(array.data.ptr)

    @property
    def fused(self):
        """kernels.fused_gpu.FusedGpu over this device (tensor-core weights and fused kernels)."""
        if self._fused is None:
            from kernels.fused_gpu import FusedGpu
            self._fused = FusedGpu(self)
        return self._fused

    def capture_graph(self, ops) -> Any:
        """Capture the launches `ops` (callables) as a CUDA graph. Every kernel is loaded and every
        buffer allocated beforehand: nothing may compile or allocate during the capture. Launches
        marked `pdl` go in with programmatic dependent launch (sm_90: a kernel starts while its
        predecessor drains and waits in-kernel, see kernels/tc_common.cuh); if the driver refuses
        that, the graph is captured again with plain launches."""
        cp = self._cp
        for op in ops:
            kern = getattr(op, "kernel", None)
            if kern is not None:
                _ = kern.num_regs            # loads the function (CUDA loads modules lazily)
        self._device.synchronize()
        use_pdl = self.pdl and self._pdl_launcher() is not None
        for attempt in ((True, False) if use_pdl else (False,)):
            stream = cp.cuda.Stream(non_blocking=True)
            graph, error = None, None
            with stream:
                stream.begin_capture()
                try:
                    for op in ops:
                        if attempt and getattr(op, "pdl", False):
                            self._launch_pdl(op, stream)
                        else:
                            op()
                except Exception as exc:        # noqa: BLE001 - retried without PDL below
                    error = exc
                finally:
                    try:
                        graph = stream.end_capture()
                    except Exception as exc:    # noqa: BLE001
                        error = error or exc
            self._device.synchronize()
            if error is None:
                self.pdl_used = attempt
                return graph
            if not attempt:
                raise error
            self.pdl = False                     # the driver refused: plain launches from now on
            self.pdl_error = f"{type(error).__name__}: {error}"
        raise RuntimeError("unreachable")

    # -- programmatic dependent launch (cuLaunchKernelEx through ctypes) -------------------------
    def _pdl_launcher(self):
        if self._pdl is None:
            self._pdl = False
            if not self._cp.cuda.runtime.is_hip and int(self._device.compute_capability) >= 90:
                try:
                    self._pdl = _PdlLauncher()
                except Exception as exc:         # noqa: BLE001 - no libcuda symbol: plain launches
                    self._pdl = False
                    self.pdl_error = f"{type(exc).__name__}: {exc}"
            elif not self._cp.cuda.runtime.is_hip:
                self.pdl_error = f"compute capability {self._device.compute_capability} < 9.0"
        return self._pdl or None

    def _launch_pdl(self, op, stream) -> None:
        fn = getattr(op.kernel, "kernel", op.kernel)      # RawKernel -> its cupy.cuda.function.Function
        self._pdl_launcher().launch(fn.ptr, op.grid, op.block, op.smem, stream.ptr, op.args,
                                    cooperative=getattr(op, "cooperative", False))

    def launch_graph(self, graph) -> None:
        graph.launch(self._cp.cuda.get_current_stream())

    def synchronize(self) -> None:
        """Wait for all work queued on the device (benchmarks)."""
        self._device.synchronize()

    def busy_wait(self, seconds: float) -> None:
        """Queue a kernel that keeps the device busy for about `seconds` (benchmarks: work queued
        behind it then runs back to back, so events around that work time the device alone)."""
        if self._clock_khz is None:
            self._clock_khz = int(self._device.attributes.get("ClockRate", 2_000_000)) or 2_000_000
        cycles = max(1, int(seconds * self._clock_khz * 1e3))
        self._kernel("ops.cu", "spin_wait")((1,), (1,), (np.int64(cycles),))

    # -- helpers ----------------------------------------------------------------------------------
    def _f32(self, a) -> Any:
        return self._cp.ascontiguousarray(self._cp.asarray(a), dtype=self._cp.float32)

    def _kernel(self, source: str, name: str, defines: tuple[str, ...] = ()):
        return _MODULES.get(self._cp, source, defines).get_function(name)

    def _matvec_kernel(self, qtype: int, n_t: int, n_rows: int, n_units: int):
        if qtype in _GENERIC_MATVEC_TYPES:
            return self._kernel("quant_matvec.cu", "block_matvec", (f"MV_T={n_t}", f"MV_R={n_rows}", f"MV_QTYPE={qtype}"))
        return self._kernel("quant_matvec.cu", _MATVEC_NAMES[qtype], (f"MV_T={n_t}", f"MV_R={n_rows}", f"MV_U={n_units}"))

    def _dequant_kernel(self, qtype: int):
        return self._kernel("quant_matvec.cu", _DEQUANT_NAMES[qtype])

    @staticmethod
    def _grid_1d(n: int) -> int:
        return max(1, min((n + ELEMENTWISE_BLOCK - 1) // ELEMENTWISE_BLOCK, ELEMENTWISE_MAX_GRID))

    def _int32_positions(self, positions, n_t: int, what: str):
        """positions [T] as a contiguous int32 device array. Host arrays are uploaded (the last one
        is kept: the model passes the same positions to both RoPEs and the attention of a layer)."""
        cp = self._cp
        if isinstance(positions, cp.ndarray):
            pos = cp.ascontiguousarray(positions.reshape(-1), dtype=cp.int32)
        else:
            host = np.ascontiguousarray(np.asarray(positions).reshape(-1), dtype=np.int32)
            key = host.tobytes()
            if self._pos_cache is not None and self._pos_cache[0] == key:
                pos = self._pos_cache[1]
            else:
                pos = cp.asarray(host)
                self._pos_cache = (key, pos)
        if pos.shape[0] != n_t:
            raise BackendError(f"{what}: {pos.shape[0]} positions for {n_t} tokens")
        return pos

    def _norm_rows(self, x) -> tuple[Any, int, int, int, int, int]:
        """(array, n_rows, D, n_inner, s_outer, s_inner) addressing the rows of x's last axis
        without a copy when x is a 1-3 dimensional view with a contiguous last axis (see ops.cu)."""
        cp = self._cp
        x = cp.asarray(x)
        if x.dtype != cp.float32:
            x = x.astype(cp.float32)
        if x.ndim == 0:
            raise BackendError("normalisation needs at least one axis")
        if x.ndim > 3 or (x.shape[-1] > 1 and x.strides[-1] != 4) or any(s < 0 or s % 4 for s in x.strides):
            x = cp.ascontiguousarray(x)
        D = x.shape[-1]
        n_rows = x.size // D if D else 0
        if x.ndim > 3:
            x = x.reshape(n_rows, D)
        if x.ndim == 1:
            return x, n_rows, D, 1, 0, 0
        if x.ndim == 2:
            return x, n_rows, D, max(x.shape[0], 1), 0, x.strides[0] // 4
        return x, n_rows, D, max(x.shape[1], 1), x.strides[0] // 4, x.strides[1] // 4

    def _norm(self, x, weight, z, eps: float, mode: int) -> Any:
        cp = self._cp
        shape = tuple(x.shape)
        xs, n_rows, D, n_inner, s_outer, s_inner = self._norm_rows(x)
        if weight is not None:
            weight = self._f32(weight).reshape(-1)
            if weight.shape[0] != D:
                raise BackendError(f"norm: weight of {weight.shape[0]} values for rows of {D}")
        if z is not None:
            z = self._f32(z)
            if tuple(z.shape) != shape:
                raise BackendError(f"gated_rms_norm: z{list(z.shape)} does not match x{list(shape)}")
        y = cp.empty(shape, dtype=cp.float32)
        if n_rows == 0 or D == 0:
            return y
        threads = 64 if D <= 256 else (128 if D <= 2048 else 256)
        self._kernel("ops.cu", "norm_rows")(
            (n_rows,), (threads,),
            (xs, weight, z, y, np.int32(n_rows), np.int32(D), np.int32(n_inner), np.int64(s_outer),
             np.int64(s_inner), np.float32(eps), np.int32(mode)))
        return y

    def _binary(self, name: str, a, b) -> Any:
        cp = self._cp
        a, b = cp.asarray(a), cp.asarray(b)
        if a.shape != b.shape:
            a, b = cp.broadcast_arrays(a, b)
        a, b = self._f32(a), self._f32(b)
        out = cp.empty(a.shape, dtype=cp.float32)
        n = out.size
        if n:
            self._kernel("ops.cu", name)((self._grid_1d(n),), (ELEMENTWISE_BLOCK,), (a, b, out, np.int64(n)))
        return out

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
                               f"implemented on the CUDA backend (have {', '.join(SUPPORTED_GPU_TYPES)})")
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

    def load_matmul_weight(self, tensor: Any) -> Any:
        """A matrix that is only multiplied (never looked up by rows): in the tensor-core layout
        (kernels/fused_gpu.TcWeight; F32 / BF16 as F16 units) when it has one, else as `load_weight`."""
        try:
            tc = self.fused.repack_tensor(tensor)
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        return tc if tc is not None else self.load_weight(tensor)

    def load_vector(self, tensor: Any) -> Any:
        return self._cp.asarray(np.ascontiguousarray(tensor.dequantize(), dtype=np.float32))

    def weight_nbytes(self, weight: GpuWeight) -> int:
        return weight.nbytes

    # -- linear algebra -------------------------------------------------------------------------
    def _matvec_ok(self, weight: GpuWeight) -> bool:
        if weight.qtype in _GENERIC_MATVEC_TYPES or weight.qtype in (GGML_Q8_0, GGML_Q4_K):
            return True
        return weight.n_in % 4 == 0      # F16/BF16/F32 rows are read 4 columns at a time

    def _tc_matmul(self, x, weight) -> Any:
        """x[T, n_in] @ W.T for a tensor-core weight: 32 rows at a time through the step's kernels."""
        from kernels.fused_gpu import MAX_T, MODE_STORE, ActBuffer, MmWorkspace
        cp = self._cp
        fg = self.fused
        act = self._tc_scratch.get(("act", weight.n_in))
        if act is None:
            act = self._tc_scratch[("act", weight.n_in)] = ActBuffer(cp, weight.n_in)
        n_f, n_c = fg.workspace_need([weight], MODE_STORE)
        ws = self._tc_scratch.get("ws")
        if ws is None or ws.ws.size < n_f or ws.counters.size < n_c:
            ws = self._tc_scratch["ws"] = MmWorkspace(cp, max(n_f, ws.ws.size if ws else 0),
                                                       max(n_c, ws.counters.size if ws else 0))
        n_t = x.shape[0]
        y = cp.empty((n_t, weight.n_out), dtype=cp.float32)
        for t0 in range(0, n_t, MAX_T):
            t1 = min(t0 + MAX_T, n_t)
            rows = cp.ascontiguousarray(x[t0:t1])
            fg.op_prep_rows("prep", rows, weight.n_in, 0, None, 0.0, weight.n_in, False, act, t1 - t0)()
            out = y[t0:t1]
            fg.op_mm("mm", [(weight, out, 0, weight.n_out)], act, t1 - t0, MODE_STORE, ws)()
        return y

    def _wide_matmul(self, x, weight) -> Any:
        """x[T, n_in] @ W.T for a tensor-core weight and many rows: slices of W dequantised to f16
        (the weights the tensor-core kernel multiplies, each rounded to f16 once) times x rounded to
        f16, by cuBLAS with f32 accumulation and output."""
        from cupy_backends.cuda.libs import cublas
        cp = self._cp
        n_t, n_in = x.shape
        ld = weight.n_sb * 256
        x16 = cp.ascontiguousarray(x, dtype=cp.float16)
        y = cp.empty((n_t, weight.n_out), dtype=cp.float32)
        tiles = max(1, min(weight.n_tiles, WIDE_SCRATCH_BYTES // (32 * ld)))
        need = 16 * tiles * ld
        scratch = self._tc_scratch.get("wide")
        if scratch is None or scratch.size < need:
            self._tc_scratch["wide"] = None
            scratch = self._tc_scratch["wide"] = cp.empty(need, dtype=cp.uint16)
        handle = cp.cuda.device.get_cublas_handle()
        one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
        x_r = None
        for t0 in range(0, weight.n_tiles, tiles):
            nt = min(tiles, weight.n_tiles - t0)
            w16 = scratch[:16 * nt * ld].reshape(16 * nt, ld)
            self.fused.units_to_f16(weight, w16, t0, nt)
            rows = min(16 * nt, weight.n_out - 16 * t0)
            r0 = 16 * t0
            if self._gemm_ex:
                try:
                    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
                    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
                    # column-major view: y.T[rows, T] (ld n_out) = w16[rows, n_in] (ld ld) @ x16.T[n_in, T]
                    _cublas_gemm_ex(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rows, n_t, n_in,
                                  one.ctypes.data, w16.data.ptr, _CUDA_R_16F, ld, x16.data.ptr, _CUDA_R_16F, n_in,
                                  zero.ctypes.data, y.data.ptr + 4 * r0, _CUDA_R_32F, weight.n_out,
                                  cublas.CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
                    continue
                except Exception as exc:     # a BLAS without gemmEx (or its f16 types): the f32 product below
                    self._gemm_ex = False
                    self.gemm_ex_error = f"{type(exc).__name__}: {exc}"
            if x_r is None:
                x_r = x16.astype(cp.float32)         # the rows as the GEMM sees them (rounded to f16)
            y[:, r0:r0 + rows] = x_r @ w16[:rows, :n_in].view(cp.float16).astype(cp.float32).T
        return y

    def matmul(self, x: Any, weight: GpuWeight) -> Any:
        cp = self._cp
        x = self._f32(x)
        if not isinstance(weight, GpuWeight):        # a tensor-core weight (kernels.fused_gpu.TcWeight)
            squeeze = x.ndim == 1
            x2 = x[None, :] if squeeze else x
            if x2.ndim != 2 or x2.shape[1] != weight.n_in:
                raise BackendError(f"matmul: x{list(x.shape)} does not match weight '{weight.name}' "
                                   f"({weight.n_out}, {weight.n_in})")
            if x2.shape[0] >= WIDE_MIN_T:
                y = self._wide_matmul(x2, weight)
            elif x2.shape[0]:
                y = self._tc_matmul(x2, weight)
            else:
                y = cp.empty((0, weight.n_out), dtype=cp.float32)
            return y[0] if squeeze else y
        squeeze = x.ndim == 1
        if squeeze:
            x = x[None, :]
        if x.ndim != 2 or x.shape[1] != weight.n_in:
            raise BackendError(f"matmul: x{list(x.shape)} does not match weight '{weight.name}' "
                               f"({weight.n_out}, {weight.n_in})")
        n_t = x.shape[0]
        y = cp.empty((n_t, weight.n_out), dtype=cp.float32)
        if n_t == 0 or weight.n_out == 0:
            pass
        elif n_t <= MATVEC_LOOP_MAX_T and self._matvec_ok(weight):
            for t0 in range(0, n_t, MATVEC_MAX_T):
                t1 = min(t0 + MATVEC_MAX_T, n_t)
                self._matvec(x[t0:t1], weight, y[t0:t1])
        elif weight.qtype == GGML_F32:
            cp.matmul(x, weight.data.T, out=y)
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
        rows_per_block = n_rows * (MATVEC_GROUPS if weight.qtype in _GENERIC_MATVEC_TYPES else 1)
        grid = (weight.n_out + rows_per_block - 1) // rows_per_block
        kern((grid,), (MATVEC_BLOCK,), (weight.data, x, y, np.int32(weight.n_out), np.int32(weight.n_in),
                                        np.int32(weight.row_bytes)))

    def _dequant_rows(self, weight: GpuWeight, out, row_start: int = 0, row_ids=None) -> None:
        """out[n, n_in] (f32, contiguous) = rows row_start.. (or row_ids) of W dequantised."""
        n_rows = out.shape[0]
        total = n_rows * weight.n_in
        if total == 0:
            return
        per_thread = 16 if weight.qtype in _GENERIC_MATVEC_TYPES else 1
        grid = min((total // per_thread + 255) // 256, 65535)
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
        out = cp.empty((ids.size, weight.n_in), dtype=cp.float32)
        if ids.size:
            self._dequant_rows(weight, out, row_ids=cp.asarray(ids.astype(np.int32)))
        return out

    # -- elementwise and normalisation --------------------------------------------------------
    def rms_norm(self, x: Any, weight: Any | None, eps: float) -> Any:
        return self._norm(x, weight, None, eps, 0)

    def l2_norm(self, x: Any, eps: float) -> Any:
        # x / sqrt(sum x^2 + eps): the form kernels/deltanet.py (the CPU backend) uses.
        return self._norm(x, None, None, eps, 1)

    def gated_rms_norm(self, x: Any, weight: Any, z: Any, eps: float) -> Any:
        return self._norm(x, weight, z, eps, 2)

    def silu_mul(self, gate: Any, up: Any) -> Any:
        return self._binary("silu_mul_f32", gate, up)

    def sigmoid_mul(self, x: Any, gate: Any) -> Any:
        return self._binary("sigmoid_mul_f32", x, gate)

    def rope_neox(self, x: Any, positions: Any, n_rot: int, theta: float) -> Any:
        cp = self._cp
        x = self._f32(x)
        if x.ndim != 3:
            raise BackendError(f"rope_neox expects x[T, H, D], got shape {list(x.shape)}")
        n_t, n_h, D = x.shape
        if n_rot % 2 or not 0 < n_rot <= D:
            raise BackendError(f"rope_neox: n_rot={n_rot} must be even and in 1..{D}")
        pos = self._int32_positions(positions, n_t, "rope_neox")
        y = cp.empty_like(x)
        if x.size:
            threads = 64 if D <= 64 else 128
            self._kernel("ops.cu", "rope_neox_f32")(
                (n_t * n_h,), (threads,), (x, y, pos, np.int32(n_h), np.int32(D), np.int32(n_rot), np.float64(theta)))
        return y

    # -- recurrent mixers -----------------------------------------------------------------------
    def causal_conv1d_silu(self, x: Any, conv_state: Any, weight: Any) -> tuple[Any, Any]:
        cp = self._cp
        x, conv_state, weight = self._f32(x), self._f32(conv_state), self._f32(weight)
        if x.ndim != 2 or weight.ndim != 2:
            raise BackendError(f"causal_conv1d_silu: x must be [T, C] and weight [C, K], got "
                               f"{list(x.shape)} and {list(weight.shape)}")
        n_t, C = x.shape
        K = weight.shape[1]
        if weight.shape[0] != C or K < 1 or tuple(conv_state.shape) != (K - 1, C):
            raise BackendError(f"causal_conv1d_silu: x[{n_t}, {C}], conv_state{list(conv_state.shape)} and "
                               f"weight{list(weight.shape)} do not match (need state[{K - 1}, {C}], weight[{C}, K])")
        y = cp.empty((n_t, C), dtype=cp.float32)
        new_state = cp.empty((K - 1, C), dtype=cp.float32)
        if C:
            self._kernel("ops.cu", "causal_conv1d_silu_f32")(
                ((C + 127) // 128, max(1, -(-n_t // CONV_TOKENS))), (128,),
                (x, conv_state, weight, y, new_state, np.int32(n_t), np.int32(C), np.int32(K)))
        return y, new_state

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
        if (not isinstance(state, cp.ndarray) or state.shape != (h_v, d_v, d_k) or state.dtype != cp.float32
                or not state.flags.c_contiguous):
            raise BackendError(f"deltanet: state must be a C-contiguous float32 device array [H_v={h_v}, d_v={d_v}, "
                               f"d_k={d_k}] (Sᵀ per head, updated in place), got {_shape_str(state)}")
        if checkpoints is not None and (
                not isinstance(checkpoints, cp.ndarray) or checkpoints.shape != (n_t, h_v, d_v, d_k)
                or checkpoints.dtype != cp.float32 or not checkpoints.flags.c_contiguous):
            raise BackendError(f"deltanet: checkpoints must be a C-contiguous float32 device array "
                               f"[{n_t}, {h_v}, {d_v}, {d_k}], got {_shape_str(checkpoints)}")
        rpt = next((r for r in _DELTANET_RPT if DELTANET_PARTS * r >= d_k), None)
        if rpt is None:
            raise BackendError(f"deltanet: d_k = {d_k} exceeds the kernel's {DELTANET_PARTS * _DELTANET_RPT[-1]}")
        out = cp.empty((n_t, h_v, d_v), dtype=cp.float32)
        if n_t == 0 or d_v == 0 or h_v == 0:
            return out
        kern = self._kernel("deltanet.cu", f"deltanet_recurrent_r{rpt}")
        grid = ((d_v + DELTANET_COLS - 1) // DELTANET_COLS, h_v)
        kern(grid, (DELTANET_COLS * DELTANET_PARTS,),
             (q, k, v, g, beta, state, checkpoints, out, np.int32(n_t), np.int32(h_k), np.int32(h_v),
              np.int32(d_k), np.int32(d_v), np.float32(1.0 / math.sqrt(d_k))))
        return out

    def deltanet_chunked(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any,
                         chunk_size: int = 64) -> Any:
        # The recurrent kernel walks all T tokens in one launch with the state in registers, which
        # is exact; chunk_size is accepted for the interface (the CPU's WY form uses it).
        if int(chunk_size) < 1:
            raise BackendError(f"deltanet: chunk_size must be positive, got {chunk_size}")
        return self.deltanet_recurrent(q, k, v, g, beta, state)

    # -- attention ------------------------------------------------------------------------------
    def attention(self, q: Any, k_cache: Any, v_cache: Any, q_positions: Any, kv_len: int,
                  scale: float, mask: Any | None = None) -> Any:
        cp = self._cp
        q = self._f32(q)
        if q.ndim != 3:
            raise BackendError(f"attention: q must be [T, H_q, D], got {list(q.shape)}")
        n_t, h_q, D = q.shape
        k_cache, v_cache = self._f32(k_cache), self._f32(v_cache)
        if k_cache.ndim != 3 or k_cache.shape != v_cache.shape or k_cache.shape[2] != D:
            raise BackendError(f"attention: k_cache{list(k_cache.shape)} / v_cache{list(v_cache.shape)} must be "
                               f"[H_kv, ctx, {D}]")
        h_kv, ctx = k_cache.shape[0], k_cache.shape[1]
        if h_kv == 0 or h_q % h_kv:
            raise BackendError(f"attention: {h_q} query heads is not a multiple of {h_kv} kv heads")
        kv_len = int(kv_len)
        if not 0 < kv_len <= ctx:
            raise BackendError(f"attention: kv_len {kv_len} outside 1..{ctx}")
        if D > ATTENTION_MAX_D:
            raise BackendError(f"attention: head dim {D} exceeds the kernel's {ATTENTION_MAX_D}")
        pos = self._int32_positions(q_positions, n_t, "attention")
        mask_dev = None
        if mask is not None:
            m = cp.asarray(mask)
            if m.size != n_t * kv_len:
                raise BackendError(f"attention: mask{list(m.shape)} must be [T={n_t}, kv_len={kv_len}]")
            mask_dev = cp.ascontiguousarray(m.reshape(n_t, kv_len).astype(cp.bool_)).view(cp.uint8)
        out = cp.empty((n_t, h_q, D), dtype=cp.float32)
        if n_t == 0:
            return out
        n_span = (kv_len + ATTENTION_SPAN - 1) // ATTENTION_SPAN
        part_o = part_ml = None
        if n_span > 1:
            part_o = cp.empty((n_t, h_q, n_span, D), dtype=cp.float32)
            part_ml = cp.empty((n_t, h_q, n_span, 2), dtype=cp.float32)
        self._kernel("attention.cu", "attention_f32")(
            (n_span, h_q, n_t), (ATTENTION_THREADS,),
            (q, k_cache, v_cache, pos, mask_dev, part_o, part_ml, out, np.int32(h_q), np.int32(h_kv),
             np.int32(D), np.int32(ctx), np.int32(kv_len), np.int32(n_span), np.float32(scale)))
        if n_span > 1:
            self._kernel("attention.cu", "attention_combine")(
                (h_q, n_t), (128,), (part_o, part_ml, out, np.int32(h_q), np.int32(D), np.int32(n_span)))
        return out

    # -- sampling support -----------------------------------------------------------------------
    def argmax_device(self, logits: Any) -> Any:
        """Row argmax of logits[T, V] (or [V]) as an int64 device array [T]: numpy's rules (the
        first NaN, else the lowest index of the maximum), computed on the device so only the ids
        cross to the host."""
        cp = self._cp
        x = self._f32(logits)
        x = x.reshape(1, -1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])
        n_rows, V = x.shape
        out = cp.empty((n_rows,), dtype=cp.int64)
        if n_rows and V:
            self._kernel("ops.cu", "argmax_rows_f32")((n_rows,), (256,), (x, out, np.int32(V)))
        elif n_rows:
            raise BackendError("argmax of an empty row")
        return out

    def argmax(self, logits: Any) -> np.ndarray:
        return self._cp.asnumpy(self.argmax_device(logits))


class _PdlLauncher:
    """cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (CuPy's launch has
    no launch attributes). Arguments are converted the way CuPy converts them: device arrays to
    their address, numpy scalars to their C type, None to a null pointer."""

    def __init__(self):
        import ctypes

        self.ct = ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        self.fn = lib.cuLaunchKernelEx
        self.fn.restype = ctypes.c_int

        class Attr(ctypes.Structure):
            _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("val", ctypes.c_ubyte * 64)]

        class Config(ctypes.Structure):
            _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                        ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint),
                        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attr)), ("n_attrs", ctypes.c_uint)]

        self.Attr, self.Config = Attr, Config
        self.attrs = (Attr * 2)()
        self.attrs[0].id = 6                     # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.attrs[0].val[0] = 1                 # programmaticStreamSerializationAllowed
        self.attrs[1].id = 2                     # CU_LAUNCH_ATTRIBUTE_COOPERATIVE (a cooperative launch only)
        self.attrs[1].val[0] = 1

    def _arg(self, a):
        ct = self.ct
        if a is None:
            return ct.c_void_p(0)
        if hasattr(a, "data") and hasattr(a.data, "ptr"):
            return ct.c_void_p(int(a.data.ptr))
        if isinstance(a, np.int32):
            return ct.c_int(int(a))
        if isinstance(a, np.int64):
            return ct.c_longlong(int(a))
        if isinstance(a, np.uint64):
            return ct.c_ulonglong(int(a))
        if isinstance(a, np.float32):
            return ct.c_float(float(a))
        if isinstance(a, np.float64):
            return ct.c_double(float(a))
        raise TypeError(f"cannot pass {type(a).__name__} to a kernel")

    def launch(self, func_ptr: int, grid, block, smem: int, stream_ptr: int, args, cooperative: bool = False) -> None:
        ct = self.ct
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        vals = [self._arg(a) for a in args]
        params = (ct.c_void_p * len(vals))(*[ct.cast(ct.pointer(v), ct.c_void_p) for v in vals])
        cfg = self.Config(*(int(g) for g in grid), *(int(b) for b in block), int(smem), ct.c_void_p(int(stream_ptr)),
                          ct.cast(self.attrs, ct.POINTER(self.Attr)), 2 if cooperative else 1)
        rc = self.fn(ct.byref(cfg), ct.c_void_p(int(func_ptr)), params, None)
        if rc != 0:
            raise BackendError(f"cuLaunchKernelEx failed with CUresult {rc}")
