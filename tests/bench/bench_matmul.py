"""CPU quantised matmul throughput: GB/s of weight bytes read per second.

Run:  .venv/bin/python tests/bench/bench_matmul.py [--n 4096] [--t 1 16] [--repeats 20] [--threads N]

For each supported GGML type, a random valid (n x n) weight is multiplied by T activation
rows with `kernels.matmul.matmul`; the script prints the median and the best time per call
over the repeats, and weight bytes / time for each (on a shared machine the two differ).
F32 rows show the plain float32 path for scale.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numba
import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from gguf import GGMLQuantizationType  # noqa: E402

from kernels.ggml_quants import SUPPORTED_TYPES, random_raw  # noqa: E402
from kernels.matmul import FUSED_MAX_T, QuantizedWeight, matmul  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="weight is n x n (multiple of 256)")
    parser.add_argument("--t", type=int, nargs="+", default=[1], help="activation rows (T) to time")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="numba threads (default: all cores)")
    args = parser.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)

    rng = np.random.default_rng(0)
    print(f"weight {args.n}x{args.n}, numba threads {numba.get_num_threads()} "
          f"({_threading_layer()}), fused path for T <= {FUSED_MAX_T}")
    print(f"{'type':8s} {'T':>4s} {'MB':>7s} {'ms med':>8s} {'ms best':>8s} {'GB/s med':>9s} {'GB/s best':>10s}")
    for qtype in SUPPORTED_TYPES:
        raw = random_raw(qtype, args.n, args.n, rng)
        weight = QuantizedWeight(raw, qtype, args.n, args.n)
        for n_t in args.t:
            x = rng.standard_normal((n_t, args.n)).astype(np.float32)
            out = np.empty((n_t, args.n), dtype=np.float32)
            matmul(x, weight, out=out)          # compile / warm caches
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                matmul(x, weight, out=out)
                times.append(time.perf_counter() - t0)
            med, best = float(np.median(times)), min(times)
            print(f"{qtype.name:8s} {n_t:4d} {weight.nbytes / 1e6:7.2f} {med * 1e3:8.3f} {best * 1e3:8.3f} "
                  f"{weight.nbytes / med / 1e9:9.2f} {weight.nbytes / best / 1e9:10.2f}")


def _threading_layer() -> str:
    # numba names its threading layer only after a parallel kernel has run once.
    q8 = GGMLQuantizationType.Q8_0
    matmul(np.zeros((1, 32), np.float32), QuantizedWeight(random_raw(q8, 1, 32, np.random.default_rng(0)), q8, 1, 32))
    return numba.threading_layer()


if __name__ == "__main__":
    main()
