"""Compute kernels: CPU (numpy/numba) and GPU (CuPy raw kernels) behind `kernels.backend.Backend`."""
from __future__ import annotations

from typing import Any


def get_backend(device: str = "cpu") -> Any:
    """The backend for `device`: "cpu", or "cuda:N" / "hip:N" (CuPy; imported only when asked for).

    Raises `kernels.backend.BackendError` for an unknown device string or a GPU backend that
    cannot start (no CuPy, no device)."""
    from kernels.backend import BackendError

    dev = (device or "cpu").strip().lower()
    if dev == "cpu":
        from kernels.cpu_backend import CPUBackend
        return CPUBackend()
    kind, _, index = dev.partition(":")
    if kind in ("cuda", "hip", "rocm") and (index == "" or index.isdigit()):
        try:
            from kernels.cuda_backend import CudaBackend
        except ImportError as e:
            raise BackendError(f"device '{device}' needs the GPU backend, which cannot be imported: {e}") from None
        return CudaBackend(dev if index else f"{kind}:0")
    raise BackendError(f"unknown device '{device}' (expected cpu, cuda:N or hip:N)")
