"""Compute kernels: CPU (numpy/numba) and GPU (CuPy raw kernels) behind `kernels.backend.Backend`."""
from __future__ import annotations

import os
from typing import Any

# numba's OpenMP threads spin at barriers by default. A worker runs the model on a compute thread
# that is not the main thread, and prefill also runs BLAS threads, so spinning teams compete for the
# cores: measured on 2 cores, a tiny model's first 30-token request took 12 s instead of 0.4 s.
# Sleeping waiters cost a futex wake per parallel region, small next to a decode step. This must be
# set before numba loads libgomp (it reads it once), hence here, ahead of every kernel module; an
# operator's explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
