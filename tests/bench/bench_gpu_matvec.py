"""GPU matvec bandwidth: Q8_0 / Q4_K weights x T activation rows, against the device copy ceiling.

    python tests/bench/bench_gpu_matvec.py [--json OUT.json] [--quick]

For each weight shape (n_out x n_in) and type, the weight is uploaded in enough copies to span
several times the L2 cache, and the kernel is timed rotating over the copies (so every launch reads
its weight from HBM). Launches are captured in a CUDA graph and the graph is replayed, which takes
Python's launch cost (~6 us) out of the figure; a plain launch loop is timed too. GB/s counts the
weight bytes read once per launch (x and y are < 1% of that). Every T in --t is tried with each
(rows per block R, column passes per iteration U) in `MATVEC_CONFIGS`, to choose
`kernels.cuda_backend.matvec_config`.
Also times the DeltaNet recurrent step at the 27B layer's shape.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from daemons.gguf_reader import GGUFTensor  # noqa: E402
from kernels import ggml_quants  # noqa: E402
from kernels.cuda_backend import MATVEC_CONFIGS, CudaBackend, matvec_config  # noqa: E402

L2_SPAN_BYTES = 512 << 20     # rotate over >= this many weight bytes (H200 L2: ~60 MB)
NOMINAL_CEILING = 4.3e12      # device copy bandwidth measured on the H200 (../shared/design/gpu-notes.md)


def time_graph(cp, launches, n_rep=15):
    """Median seconds per launch of `launches` (a list of zero-arg callables), replayed as a graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in launches[:3]:
            f()                                   # warm-up (module load) outside capture
        stream.synchronize()
        stream.begin_capture()
        for f in launches:
            f()
        graph = stream.end_capture()
        graph.upload()
        graph.launch()
        stream.synchronize()
        times = []
        for _ in range(n_rep):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            graph.launch()
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / len(launches))
    return statistics.median(times)


def time_loop(cp, launches, n_rep=5):
    times = []
    for _ in range(n_rep):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for f in launches:
            f()
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / len(launches))
    return statistics.median(times)


_COPY_SRC = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def copy_bandwidth(cp) -> dict:
    """Bytes read + written per second by a 2 GiB device copy: cudaMemcpy, and a plain 16-byte
    grid-stride copy kernel (the practical ceiling for a streaming kernel)."""
    n = 2 << 30
    a = cp.ones(n, dtype=cp.uint8)
    b = cp.empty_like(a)
    kern = cp.RawKernel(_COPY_SRC, "copy16")
    n16 = np.uint64(n // 16)
    grid = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"] * 8
    t_memcpy = time_graph(cp, [lambda: b.data.copy_from_device_async(a.data, n)] * 10, n_rep=5)
    t_kernel = time_graph(cp, [lambda: kern((grid,), (512,), (a, b, n16))] * 10, n_rep=5)
    ok = bool(cp.array_equal(a, b))
    del a, b
    return {"memcpy": 2 * n / t_memcpy, "kernel": 2 * n / t_kernel, "kernel_copy_correct": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write all figures here")
    ap.add_argument("--quick", action="store_true", help="default R only")
    ap.add_argument("--t", default="1,2,4,8", help="activation rows to time")
    args = ap.parse_args()
    be = CudaBackend()
    cp = be.xp
    rng = np.random.default_rng(0)
    ts = [int(v) for v in args.t.split(",")]
    copies = copy_bandwidth(cp)
    ceiling = max(copies["memcpy"], copies["kernel"])
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}  copy (read+write): "
          f"memcpy {copies['memcpy'] / 1e12:.2f} TB/s, 16-byte kernel {copies['kernel'] / 1e12:.2f} TB/s "
          f"(copy correct: {copies['kernel_copy_correct']})", flush=True)
    results = {"copy_bytes_per_s": copies, "matvec": [], "deltanet": []}
    shapes = [(4096, 4096), (5120, 17408), (17408, 5120)]
    for qtype in (QT.Q8_0, QT.Q4_K):
        for n_out, n_in in shapes:
            raw = ggml_quants.random_raw(qtype, n_out, n_in, rng)
            tensor = GGUFTensor("w", int(qtype), (n_in, n_out), 0, raw.nbytes, raw)
            n_copies = max(2, math.ceil(L2_SPAN_BYTES / raw.nbytes))
            weights = [be.load_weight(tensor) for _ in range(n_copies)]
            for n_t in ts:
                x = cp.asarray(rng.standard_normal((n_t, n_in)).astype(np.float32))
                y = cp.empty((n_t, n_out), dtype=cp.float32)
                default = matvec_config(int(qtype), n_t)
                for cfg in ([default] if args.quick else MATVEC_CONFIGS):
                    launches = [lambda w=w, cfg=cfg: be._matvec(x, w, y, config=cfg) for w in weights]
                    t_graph = time_graph(cp, launches)
                    t_loop = time_loop(cp, launches)
                    rec = {"type": qtype.name, "n_out": n_out, "n_in": n_in, "T": n_t, "R": cfg[0], "U": cfg[1],
                           "bytes": raw.nbytes, "us_graph": t_graph * 1e6, "us_loop": t_loop * 1e6,
                           "GBps_graph": raw.nbytes / t_graph / 1e9, "GBps_loop": raw.nbytes / t_loop / 1e9,
                           "default": cfg == default}
                    results["matvec"].append(rec)
                    print(f"{qtype.name:5s} {n_out:6d}x{n_in:<6d} T={n_t} R={cfg[0]} U={cfg[1]} {rec['us_graph']:8.2f} us "
                          f"{rec['GBps_graph']:7.0f} GB/s ({rec['GBps_graph'] * 1e9 / ceiling:5.1%} of copy, "
                          f"{rec['GBps_graph'] * 1e9 / NOMINAL_CEILING:5.1%} of 4.3 TB/s)  "
                          f"loop {rec['us_loop']:7.2f} us{'  *' if rec['default'] else ''}", flush=True)
            del weights

    # DeltaNet recurrent step, 27B layer shape: H_k=16, H_v=48, d_k=d_v=128.
    for n_t, ck in ((1, False), (1, True), (16, True)):
        q = cp.asarray(rng.standard_normal((n_t, 16, 128)).astype(np.float32) / 11.3)
        v = cp.asarray(rng.standard_normal((n_t, 48, 128)).astype(np.float32))
        g = cp.asarray(-rng.uniform(0, 1, (n_t, 48)).astype(np.float32))
        b = cp.asarray(rng.uniform(0, 1, (n_t, 48)).astype(np.float32))
        states = [cp.zeros((48, 128, 128), dtype=cp.float32) for _ in range(40)]
        ckpt = cp.empty((n_t, 48, 128, 128), dtype=cp.float32) if ck else None
        launches = [lambda s=s: be.deltanet_recurrent(q, q, v, g, b, s, ckpt) for s in states]
        t = time_graph(cp, launches)
        moved = 2 * 48 * 128 * 128 * 4 * (1 + (n_t if ck else 0) / 2)
        results["deltanet"].append({"T": n_t, "checkpoints": ck, "us": t * 1e6, "GBps": moved / t / 1e9})
        print(f"deltanet T={n_t:2d} checkpoints={ck!s:5s} {t * 1e6:7.2f} us  ({moved / t / 1e9:6.0f} GB/s of state traffic)",
              flush=True)

    print("\nbest (R, U) per (type, shape, T):")
    best: dict = {}
    for rec in results["matvec"]:
        key = (rec["type"], rec["n_out"], rec["n_in"], rec["T"])
        if key not in best or rec["us_graph"] < best[key]["us_graph"]:
            best[key] = rec
    for key, rec in best.items():
        dflt = next(r for r in results["matvec"] if r["default"] and
                    (r["type"], r["n_out"], r["n_in"], r["T"]) == key)
        print(f"  {key[0]:5s} {key[1]:6d}x{key[2]:<6d} T={key[3]}: R={rec['R']} U={rec['U']} {rec['GBps_graph']:7.0f} GB/s "
              f"({rec['GBps_graph'] * 1e9 / NOMINAL_CEILING:5.1%} of 4.3 TB/s); default R={dflt['R']} U={dflt['U']} "
              f"{dflt['GBps_graph']:7.0f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
