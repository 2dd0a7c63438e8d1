"""When the GPU tests run: only where CuPy imports and a CUDA/HIP device answers (the GPU machine).
On the dev/CI machines they are skipped at collection, with the reason."""
from __future__ import annotations

import importlib.util

import pytest


def gpu_unavailable_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    from kernels.backend import BackendError
    from kernels.cuda_backend import CudaBackend
    try:
        CudaBackend()
    except BackendError as exc:
        return str(exc)
    return None


NO_GPU = gpu_unavailable_reason()
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU backend: {NO_GPU}")]
