"""Run dflashd's CUDA kernel sources on the CPU (see emu_runtime.h): build them with g++ and
-DDFLASH_EMU into a shared library and launch them through ctypes with the same (grid, block, args,
shared_mem) call CuPy's RawKernel takes, on numpy arrays standing in for device memory.

`EmuDevice` is the small backend `kernels.fused_gpu.FusedGpu` needs (xp, _kernel, ptr,
synchronize), so the GPU step's own Python code and kernels run unchanged in the CPU suite.

Builds are cached under the system temp directory, keyed by the sources and flags; the first build
of mma_matmul.cu's instantiations takes a minute or two on 2 cores.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
EMU_DIR = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")

__all__ = ["EmuDevice", "emu_unavailable_reason", "MM_CONFIGS"]

# The mma_matmul.cu instantiations the emulated library holds: (qtype, NT, mode). A launch of two types
# (mm_tc_parts, MM_QT2), or one with a benchmark's variant defines (MM_STAGES=3, ...), is built on its
# first use, as a library of its own.
MM_CONFIGS = tuple((qt, nt, mode) for qt in (1, 8, 12, 13, 14, 23) for nt in (1, 2, 3, 4) for mode in (0, 1, 2))
MM_TYPES = frozenset(qt for qt, _, _ in MM_CONFIGS)


def emu_unavailable_reason() -> str | None:
    if shutil.which(CXX) is None:
        return f"no C++ compiler ({CXX})"
    return None


def _kernel_names(preprocessed: str) -> list[str]:
    """Names of the `extern "C" __global__` kernels a build defines (emu_runtime.h turns __global__
    into __attribute__((used)), which survives preprocessing and so sees #if and macros)."""
    return re.findall(r'extern\s+"C"\s+__attribute__\s*\(\(used\)\)\s+void\s+(\w+)\s*\(', preprocessed)


class _Library:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_config.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_ulonglong]
        self.lib.emu_block_order.argtypes = [ctypes.c_int]
        self.lib.emu_skew.argtypes = [ctypes.c_int]
        self.lib.emu_cluster_config.argtypes = [ctypes.c_uint] * 3
        self.reverse_blocks = False
        self.skew = False
        self._lock = threading.Lock()

    def kernel(self, symbol: str) -> "_EmuKernel":
        fn = getattr(self.lib, f"emu_ptr_{symbol}")
        fn.restype = ctypes.c_void_p
        return _EmuKernel(self, symbol, fn())


def _ctype_of(a: Any):
    if a is None:
        return ctypes.c_void_p, None
    if isinstance(a, np.ndarray):
        return ctypes.c_void_p, a.ctypes.data
    if isinstance(a, (np.int32, np.intc)):
        return ctypes.c_int, int(a)
    if isinstance(a, np.uint32):
        return ctypes.c_uint, int(a)
    if isinstance(a, np.int64):
        return ctypes.c_longlong, int(a)
    if isinstance(a, np.uint64):
        return ctypes.c_ulonglong, int(a)
    if isinstance(a, np.float32):
        return ctypes.c_float, float(a)
    if isinstance(a, np.float64):
        return ctypes.c_double, float(a)
    if isinstance(a, _DevPtr):
        return ctypes.c_void_p, a.value
    raise TypeError(f"emulator: cannot pass {type(a).__name__} to a kernel (use numpy arrays and numpy scalars)")


class _DevPtr:
    """A raw address (what a CuPy kernel receives for an array offset)."""

    def __init__(self, value: int):
        self.value = int(value)


def cluster_shape(symbol: str) -> tuple[int, int, int]:
    """The thread-block cluster a kernel runs in, from its name: kernels/*.cu give a kernel compiled
    with `__cluster_dims__` a name ending in `_clx<N>` (N blocks along x) or `_cly<N>` (along y), which
    the emulator (where the attribute is compiled out) runs as such a cluster."""
    m = re.search(r"_cl([xy])(\d+)$", symbol)
    if m is None:
        return (1, 1, 1)
    n = int(m.group(2))
    return (n, 1, 1) if m.group(1) == "x" else (1, n, 1)


# Kernels whose blocks wait for each other (persistent: mma_matmul.cu mm_chain), which the emulator runs
# as one cluster of the whole grid, side by side (blocks one after another would wait forever).
CORESIDENT = frozenset({"mm_chain"})


class _EmuKernel:
    def __init__(self, lib: _Library, symbol: str, address: int):
        self.lib, self.symbol, self.address = lib, symbol, address
        self.cluster = cluster_shape(symbol)
        self._fn_cache: dict[tuple, Any] = {}

    def __call__(self, grid, block, args: Sequence[Any], shared_mem: int = 0,
                 enable_cooperative_groups: bool = False) -> None:
        # (a cooperative grid, CuPy's flag: CORESIDENT kernels' blocks already run side by side here)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        conv = [_ctype_of(a) for a in args]
        types = tuple(t for t, _ in conv)
        fn = self._fn_cache.get(types)
        if fn is None:
            fn = ctypes.CFUNCTYPE(None, *types)(self.address)
            self._fn_cache[types] = fn
        with self.lib._lock:
            self.lib.lib.emu_block_order(1 if self.lib.reverse_blocks else 0)
            self.lib.lib.emu_skew(1 if self.lib.skew else 0)
            self.lib.lib.emu_config(*(int(g) for g in grid), *(int(b) for b in block), int(shared_mem))
            self.lib.lib.emu_cluster_config(*(grid if self.symbol in CORESIDENT else self.cluster))
            fn(*[v for _, v in conv])


def _inline_includes(code: str) -> str:
    """Every `#include "x.cuh"` of a kernels/ header replaced by its text (as kernels/cuda_backend.py
    does for CuPy), so the build cache key covers the headers too."""
    return re.sub(r'^\s*#include "(\w+\.cuh)"\s*$', lambda m: _inline_includes((KERNELS / m.group(1)).read_text()),
                  code, flags=re.MULTILINE)            # (headers include headers)


def _flags(extra: Iterable[str] = ()) -> list[str]:
    # -fno-gnu-unique: a `__shared__` object is a function template's static, which g++ otherwise emits
    # as a GNU unique symbol that the dynamic linker binds to the first library loaded with that name:
    # a variant build's kernel would then use the default build's objects, with their alignment
    return ["-O1", "-std=c++20", "-pthread", "-fPIC", "-fno-gnu-unique", "-DDFLASH_EMU", "-w", f"-I{EMU_DIR}",
            *extra]


def _preprocess(code: str) -> str:
    proc = subprocess.run([CXX, *_flags(), "-x", "c++", "-E", "-"], input=code, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"emulator: preprocessing failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def _build(name: str, body: str) -> Path:
    flags = _flags(["-shared"])
    runtime = (EMU_DIR / "emu_runtime.h").read_text() + (EMU_DIR / "emu.cpp").read_text()
    key = hashlib.sha1((body + runtime + " ".join(flags) + CXX).encode()).hexdigest()[:16]
    out_dir = Path(tempfile.gettempdir()) / "dflashd-emu"
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / f"{name}-{key}.so"
    if so.exists():
        return so
    # Source and library under this process's own names until each is whole: parallel test workers
    # (pytest -n) build the same key at once, and one rewriting the shared source file while another's
    # compiler reads it would hand that compiler a truncated file.
    src = out_dir / f"{name}-{key}.{os.getpid()}.cpp"
    src.write_text(body)
    tmp = so.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([CXX, *flags, str(src), "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"emulator build of {name} failed:\n{proc.stderr[-4000:]}")
    os.replace(tmp, so)
    os.replace(src, out_dir / f"{name}-{key}.cpp")     # kept beside the library: the source it was built from
    return so


class EmuDevice:
    """The emulated device: numpy memory, kernels from the emulated build of kernels/*.cu."""

    name = "emu"
    device = "emu:0"
    supports_graphs = False
    supports_clusters = True        # emu.cpp runs a cluster's blocks side by side
    multiprocessors = 4

    def __init__(self):
        self.xp = np
        self._libs: dict[str, _Library] = {}
        self._lock = threading.Lock()

    # -- the interface kernels.fused_gpu.FusedGpu uses --------------------------------------------
    def _kernel(self, source: str, name: str, defines: tuple[str, ...] = ()) -> _EmuKernel:
        if source == "mma_matmul.cu" and "MM_CHAIN=1" in defines:     # a chain of products: a build of its own
            return self._library(source, variant=tuple(defines)).kernel(name)
        if source == "mma_matmul.cu" and defines:
            d = dict(x.split("=", 1) for x in defines)
            cfg = (int(d["MM_QT"]), int(d.get("MM_QT2", 0)), int(d["MM_NT"]), int(d["MM_MODE"]))
            # a benchmark's variant defines (MM_STAGES=3, ...): a build of this one configuration with them
            variant = tuple(x for x in defines if x.split("=", 1)[0] not in ("MM_QT", "MM_QT2", "MM_NT", "MM_MODE"))
            if ((cfg[0], cfg[2], cfg[3]) not in MM_CONFIGS
                    or (cfg[1] and (cfg[1] not in MM_TYPES or cfg[3] == 2))):
                raise RuntimeError(f"emulator: mma_matmul config {defines} is not built")
            lib = self._library("mma_matmul.cu", cfg if (cfg[1] or variant) else None, variant)
            return lib.kernel("mm_tc__{}_{}_{}_{}".format(*cfg))
        if defines:                     # another source's variant (defines an A/B candidate builds with): a build of its own
            return self._library(source, variant=tuple(defines)).kernel(name)
        return self._library(source).kernel(name)

    def ptr(self, a: Any) -> int:
        return int(a.ctypes.data)

    def block_order(self, reverse: bool) -> None:
        """Run every later launch's blocks in grid order (the default) or last to first."""
        self._reverse_blocks = bool(reverse)
        for lib in self._libs.values():
            lib.reverse_blocks = self._reverse_blocks

    def skew_blocks(self, on: bool) -> None:
        """Run the blocks of a later launch that run side by side (clusters, co-resident grids) at
        different speeds (emu.cpp emu_skew), or all alike (the default)."""
        self._skew = bool(on)
        for lib in self._libs.values():
            lib.skew = self._skew

    def synchronize(self) -> None:
        pass

    # -- builds ---------------------------------------------------------------------------------
    def _library(self, source: str, mm_pair: tuple[int, int, int, int] | None = None,
                 variant: tuple[str, ...] = ()) -> _Library:
        """source's emulated build (mma_matmul.cu: every MM_CONFIGS instantiation, or only the
        launch mm_pair = (qtype, qtype2 or 0, NT, mode), compiled with the variant's NAME=VALUE defines)."""
        with self._lock:
            key = source if mm_pair is None and not variant else f"{source}:{mm_pair}:{variant}"
            lib = self._libs.get(key)
            if lib is None:
                code = _inline_includes((KERNELS / source).read_text())
                body = ['#include "emu.cpp"'] + ["#define {} {}".format(*v.split("=", 1)) for v in variant] + [code]
                if source == "mma_matmul.cu" and "MM_CHAIN=1" not in variant:
                    configs = [mm_pair] if mm_pair else [(qt, 0, nt, mode) for qt, nt, mode in MM_CONFIGS]
                    for qt, qt2, nt, mode in configs:
                        sym = f"mm_tc__{qt}_{qt2}_{nt}_{mode}"
                        body.append(
                            f'extern "C" __global__ void {sym}(const MmSeg* segs, int n_segs, const u16* x16, '
                            f'const u16* xs, int n_sb, int T, float* ws, int* counters, u16* out16, '
                            f'u16* outxs, int split, int n_segs_a, int n_rb_a) {{ mm_tc_parts<{qt}, {qt2}, {nt}, '
                            f'{mode}>(segs, n_segs, x16, xs, n_sb, T, ws, counters, out16, outxs, split, '
                            f'n_segs_a, n_rb_a); }}')
                names = _kernel_names(_preprocess("\n".join(body)))
                body += [f"EMU_EXPORT({n})" for n in names]
                stem = source.replace(".", "_") + ("" if mm_pair is None else "_{}_{}_{}_{}".format(*mm_pair))
                stem += "_chain" if "MM_CHAIN=1" in variant else ""
                if variant:
                    stem += "_" + hashlib.sha1(repr(variant).encode()).hexdigest()[:8]
                path = _build(stem, "\n".join(body))
                lib = self._libs[key] = _Library(path)
                lib.reverse_blocks = getattr(self, "_reverse_blocks", False)
                lib.skew = getattr(self, "_skew", False)
            return lib


class EmuBackend(EmuDevice):
    """Enough of a model backend for `daemons.qwen35.Qwen35Model` to load onto the emulated device
    and run through its GPU step (daemons/qwen35_gpu.py): weights in the GPU layouts (raw GGUF rows
    for the embedding, tensor-core units for the rest), vectors as float32 arrays.

    The backend operations (what a wide forward of `wide_batch_min` tokens or more, or a model off
    the step, runs) are the CPU backend's on the same numpy arrays, except the matrix products of
    tensor-core weights, which go the CUDA backend's way on the emulated kernels: below
    `wide_batch_min` rows the step's kernel 32 rows at a time, from it the units dequantised to f16
    (`units_f16_*`) and multiplied in float32 (standing in for cuBLAS, which accumulates in f32)."""

    supports_fused_step = True
    _CPU_OPS = ("rms_norm", "l2_norm", "rope_neox", "silu_mul", "sigmoid_mul", "gated_rms_norm",
                "causal_conv1d_silu", "deltanet_recurrent", "deltanet_chunked", "attention", "argmax")

    def __init__(self, wide_scratch_tiles: int = 4):
        super().__init__()
        from kernels.cpu_backend import CPUBackend
        from kernels.cuda_backend import WIDE_MIN_T
        from kernels.fused_gpu import FusedGpu
        self.fused = FusedGpu(self)
        self._cpu = CPUBackend()
        # A lower switch than the GPU's (WIDE_MIN_T, chosen by speed) so that the suite's wide-path tests
        # stay short on the emulator; the Python and kernels of both paths are the same.
        self.wide_batch_min = min(WIDE_MIN_T, 64)
        self.wide_scratch_tiles = wide_scratch_tiles     # tiles per dequantised slice (several slices per matrix)

    def __getattr__(self, name: str):
        cpu = self.__dict__.get("_cpu")
        if cpu is not None and name in EmuBackend._CPU_OPS:
            return getattr(cpu, name)
        raise AttributeError(name)

    def _plain(self, weight: Any):
        """A raw-layout GpuWeight as the CPU backend's QuantizedWeight (the same GGUF bytes)."""
        from kernels.matmul import QuantizedWeight
        raw = weight.data.view(np.uint8).reshape(-1)[:weight.nbytes].reshape(weight.n_out, -1)
        return QuantizedWeight(raw, weight.qtype, n_out=weight.n_out, n_in=weight.n_in)

    def embed(self, weight: Any, token_ids: Sequence[int]) -> np.ndarray:
        return self._cpu.embed(self._plain(weight), token_ids)

    def matmul(self, x: Any, weight: Any) -> np.ndarray:
        from kernels.fused_gpu import MAX_T, MODE_STORE, ActBuffer, MmWorkspace, TcWeight
        x = np.asarray(x, dtype=np.float32)
        if not isinstance(weight, TcWeight):
            return self._cpu.matmul(x, self._plain(weight))
        x2 = x[None, :] if x.ndim == 1 else x
        n_t, fg = x2.shape[0], self.fused
        y = np.zeros((n_t, weight.n_out), dtype=np.float32)
        if n_t >= self.wide_batch_min:
            ld, x_r = weight.n_sb * 256, x2.astype(np.float16).astype(np.float32)
            for t0 in range(0, weight.n_tiles, self.wide_scratch_tiles):
                nt = min(self.wide_scratch_tiles, weight.n_tiles - t0)
                w16 = np.zeros((16 * nt, ld), dtype=np.uint16)
                fg.units_to_f16(weight, w16, t0, nt)
                rows = min(16 * nt, weight.n_out - 16 * t0)
                y[:, 16 * t0:16 * t0 + rows] = x_r @ w16[:rows, :weight.n_in].view(np.float16).astype(np.float32).T
        else:
            act = ActBuffer(np, weight.n_in)
            ws = MmWorkspace(np, *fg.workspace_need([weight], MODE_STORE))
            for t0 in range(0, n_t, MAX_T):
                t1 = min(t0 + MAX_T, n_t)
                rows = np.ascontiguousarray(x2[t0:t1])
                fg.op_prep_rows("prep", rows, weight.n_in, 0, None, 0.0, weight.n_in, False, act, t1 - t0)()
                out = np.zeros((t1 - t0, weight.n_out), dtype=np.float32)
                fg.op_mm("mm", [(weight, out, 0, weight.n_out)], act, t1 - t0, MODE_STORE, ws)()
                y[t0:t1] = out
        return y[0] if x.ndim == 1 else y

    def asarray(self, host_array: Any, dtype: Any = None) -> np.ndarray:
        return np.array(host_array, dtype=dtype, copy=True)

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def load_weight(self, tensor: Any):
        from kernels.cuda_backend import _BLOCKS, WEIGHT_PAD_BYTES, GpuWeight
        n_in, n_out = (int(n) for n in tensor.ne)
        bw, bb = _BLOCKS[int(tensor.qtype)]
        row_bytes = n_in // bw * bb
        raw = np.ascontiguousarray(np.asarray(tensor.raw)).reshape(-1)
        data = np.zeros(raw.size + WEIGHT_PAD_BYTES, dtype=np.uint8)
        data[:raw.size] = raw
        if int(tensor.qtype) == 0:
            data = raw.view(np.float32).reshape(n_out, n_in).copy()
        return GpuWeight(str(tensor.name), int(tensor.qtype), n_out, n_in, row_bytes, n_out * row_bytes, data)

    def load_matmul_weight(self, tensor: Any):
        tc = self.fused.repack_tensor(tensor)
        return tc if tc is not None else self.load_weight(tensor)

    def load_vector(self, tensor: Any) -> np.ndarray:
        return np.ascontiguousarray(tensor.dequantize(), dtype=np.float32)

    def weight_nbytes(self, weight: Any) -> int:
        return weight.nbytes
