"""The tensor-core matmul alone on the 27B's shapes (GPU): GB/s of weights per launch for the
projections one decode / verify step runs, against the copy bandwidth measured in the same run.

    python3 tests/bench/bench_mm_gpu.py [--widths 1,23] [--ncu-once]

--ncu-once runs each case once and exits (for `ncu --kernel-name mm_tc`, which then profiles them).
Each figure is the mean of 20 launches queued back to back between two events (as in a graph: no
host gap); `--stream` adds a plain read of the same bytes (16-byte loads, 2048 threads per
multiprocessor), the ceiling a kernel of that size can reach.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kernels import ggml_quants                              # noqa: E402
from kernels.cuda_backend import CudaBackend                 # noqa: E402
from kernels.fused_gpu import (MODE_ADD, MODE_STORE, MODE_SWIGLU, ActBuffer, FusedGpu, MmWorkspace)  # noqa: E402

CASES = [  # label, qtype, n_out, n_in, mode
    ("ffn_gate|up Q4_K", 12, 17408, 5120, MODE_SWIGLU),
    ("ffn_down Q6_K", 14, 5120, 17408, MODE_ADD),
    ("ffn_down Q4_K", 12, 5120, 17408, MODE_ADD),
    ("attn_qkv Q4_K", 12, 10240, 5120, MODE_STORE),
    ("ssm_out Q4_K", 12, 5120, 6144, MODE_ADD),
    ("output Q6_K", 14, 248320, 5120, MODE_STORE),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="1,23")
    ap.add_argument("--ncu-once", action="store_true")
    ap.add_argument("--cases", default="")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--variants", default="", help="';'-separated define sets, e.g. 'MM_STAGES=4;MM_NO_COMPUTE=1'")
    args = ap.parse_args()
    gpu = CudaBackend()
    cp = gpu.xp
    fg = FusedGpu(gpu)
    rng = np.random.default_rng(0)
    n = 1 << 28
    a = cp.ones(n, dtype=cp.float32)
    b = cp.empty_like(a)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    cp.copyto(b, a)
    ev0.record(); cp.copyto(b, a); ev1.record(); ev1.synchronize()
    copy_gbs = 2 * 4 * n / (cp.cuda.get_elapsed_time(ev0, ev1) / 1e3) / 1e9
    del a, b
    print(f"copy {copy_gbs:.0f} GB/s")
    widths = [int(w) for w in args.widths.split(",")]
    stream = cp.RawKernel(STREAM_SRC, "stream_read") if args.stream else None
    sink = cp.zeros(1, dtype=cp.uint32)
    sel = [c for c in CASES if not args.cases or any(k in c[0] for k in args.cases.split(","))]
    for label, qt, n_out, n_in, mode in sel:
        pool = ggml_quants.random_raw(qt, 256, n_in, rng, scale_range=(2.0 ** -16, 2.0 ** -13))
        raw = np.tile(pool, (n_out // 256 + 1, 1))[:n_out]
        ws_ = [fg.repack("w", qt, n_out, n_in, raw)]
        if mode == MODE_SWIGLU:
            ws_.append(fg.repack("u", qt, n_out, n_in, raw))
        act = ActBuffer(cp, n_in)
        act.x16[...] = cp.asarray(rng.standard_normal(act.x16.shape).astype(np.float16).view(np.uint16))
        out_act = ActBuffer(cp, n_out) if mode == MODE_SWIGLU else None
        y = cp.zeros((32, n_out), dtype=cp.int64 if mode == MODE_ADD else cp.float32)   # ADD: fixed-point sums
        need_f, need_c = fg.workspace_need(ws_, mode)
        ws = MmWorkspace(cp, 4 * need_f, need_c)       # room for --variants MM_GRID=<up to 16>
        variants = [()] + [tuple(v.split(",")) for v in args.variants.split(";") if v]
        for T, variant in [(T, v) for T in widths for v in variants]:
            segs = [(w, None if mode == MODE_SWIGLU else y, 0, n_out) for w in ws_]
            op = fg.op_mm(label, segs, act, T, mode, ws, out_act=out_act, variant=variant)
            if args.ncu_once:
                op()
                continue
            for _ in range(3):
                op()
            ms = _timed(cp, op, ev0, ev1)
            nbytes = sum(w.nbytes for w in ws_)
            print(f"{label:18s} {','.join(variant) or 'default':24s} T={T:2d} grid {str(op.grid):12s} smem {op.smem // 1024:3d} KB  regs {getattr(op.kernel, 'num_regs', 0):3d} local {getattr(op.kernel, 'local_size_bytes', 0):3d} "
                  f"{_blocks_per_sm(op)} /SM {ms * 1e3:8.1f} us  "
                  f"{nbytes / (ms / 1e3) / 1e9:6.0f} GB/s  ({100 * nbytes / (ms / 1e3) / 1e9 / copy_gbs:4.1f}% of copy)")
        if stream is not None:
            for w in ws_:
                n16 = w.data.size // 16
                grid = (gpu.multiprocessors * 8,)
                ms = _timed(cp, lambda: stream(grid, (256,), (w.data, np.int64(n16), sink)), ev0, ev1)
                print(f"{label:18s} {'stream read':24s}      {w.data.size / 1e6:8.1f} MB        {ms * 1e3:8.1f} us  "
                      f"{w.data.size / (ms / 1e3) / 1e9:6.0f} GB/s  ({100 * w.data.size / (ms / 1e3) / 1e9 / copy_gbs:4.1f}% of copy)")
    cp.cuda.Device().synchronize()


STREAM_SRC = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n, unsigned* out) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
        acc ^= a.x ^ b.y ^ c.z ^ d.w;
    }
    for (; i < n; i += stride) acc ^= __ldcs(p + i).x;
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def _blocks_per_sm(op) -> int:
    """Blocks of the launch that fit one multiprocessor (the driver's occupancy calculator; static
    and dynamic shared memory, registers): below 4 the launch's fixed grid runs in two waves."""
    try:
        import ctypes
        n = ctypes.c_int()
        rc = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), ctypes.c_void_p(op.kernel.kernel.ptr), ctypes.c_int(op.block[0]), ctypes.c_size_t(op.smem))
        return n.value if rc == 0 else -1
    except Exception:       # (no driver library, another CuPy)
        return -1


def _timed(cp, fn, ev0, ev1, n: int = 20) -> float:
    """Milliseconds per call of fn, n calls queued back to back between two events (median of 3)."""
    out = []
    for _ in range(3):
        ev0.record()
        for _ in range(n):
            fn()
        ev1.record()
        ev1.synchronize()
        out.append(cp.cuda.get_elapsed_time(ev0, ev1) / n)
    return float(np.median(out))


if __name__ == "__main__":
    main()
