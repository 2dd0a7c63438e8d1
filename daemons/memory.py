"""Process memory measurements for workers: resident set size, mapped files, bytes held by a state.

PARK reports the resident memory it released, so it measures RSS (psutil) before and after dropping
the weights; `release_freed_memory` makes that figure honest by collecting garbage and asking glibc
to hand freed heap pages back to the kernel before the second reading.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from typing import Any, Mapping

import numpy as np
import psutil

__all__ = ["rss_bytes", "release_freed_memory", "mapped_file_bytes", "host_nbytes", "parse_byte_size"]

_PROCESS: psutil.Process | None = None
_LIBC: Any = None
_LIBC_LOADED = False


def _process() -> psutil.Process:
    global _PROCESS
    if _PROCESS is None or _PROCESS.pid != os.getpid():  # a forked child gets its own handle
        _PROCESS = psutil.Process()
    return _PROCESS


def rss_bytes() -> int:
    """Resident set size of this process (anonymous + file-backed pages in memory)."""
    return int(_process().memory_info().rss)


def _libc() -> Any:
    global _LIBC, _LIBC_LOADED
    if not _LIBC_LOADED:
        _LIBC_LOADED = True
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _LIBC = lib if lib is not None and hasattr(lib, "malloc_trim") else None
        except OSError:
            _LIBC = None
    return _LIBC


def release_freed_memory() -> None:
    """Collect unreachable objects (cycles may hold the last reference to a memory map) and return
    free heap pages to the OS (glibc ``malloc_trim``; a no-op elsewhere)."""
    gc.collect()
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


def mapped_file_bytes(path: str | os.PathLike) -> int:
    """Resident bytes of this process's mappings of ``path`` (0 when it is not mapped).

    Used to check that PARK really unmapped the weights file: a reference left anywhere keeps the
    map, and its pages, alive."""
    target = os.path.realpath(path)
    total = 0
    try:
        for m in _process().memory_maps(grouped=True):
            if m.path and os.path.realpath(m.path) == target:
                total += int(m.rss)
    except (psutil.AccessDenied, psutil.NoSuchProcess, NotImplementedError):
        return 0
    return total


def host_nbytes(obj: Any) -> int:
    """Bytes of the numpy arrays in a (nested) mapping / list / tuple; other leaves count 0."""
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, Mapping):
        return sum(host_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(host_nbytes(v) for v in obj)
    return 0


_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40,
             "TIB": 1 << 40}


def parse_byte_size(text: str) -> int:
    """``"4096"``, ``"512M"``, ``"2GiB"``, ``"1.5G"`` -> bytes (binary multiples).  ValueError otherwise."""
    s = str(text).strip().upper().replace("_", "")
    num = s.rstrip("KMGTIB")
    suffix = s[len(num):]
    if suffix not in _SUFFIXES or not num:
        raise ValueError(f"not a byte size: {text!r} (examples: 4096, 512M, 2G)")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (examples: 4096, 512M, 2G)") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"byte size must be a non-negative number, got {text!r}")
    return int(value * _SUFFIXES[suffix])
