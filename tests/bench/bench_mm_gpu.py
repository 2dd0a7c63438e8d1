"""The tensor-core matmul alone on the 27B's shapes (GPU): GB/s of weights per launch for the
projections one decode / verify step runs, against the copy bandwidth measured in the same run.

    python3 tests/bench/bench_mm_gpu.py [--widths 1,23] [--ncu-once]

--ncu-once runs each case once and exits (for `ncu --kernel-name mm_tc`, which then profiles them).
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
        y = cp.zeros((32, n_out), dtype=cp.float32)
        ws = MmWorkspace(cp, *fg.workspace_need(ws_, mode))
        variants = [()] + [tuple(v.split(",")) for v in args.variants.split(";") if v]
        for T, variant in [(T, v) for T in widths for v in variants]:
            segs = [(w, None if mode == MODE_SWIGLU else y, 0, n_out) for w in ws_]
            op = fg.op_mm(label, segs, act, T, mode, ws, out_act=out_act, variant=variant)
            if args.ncu_once:
                op()
                continue
            for _ in range(3):
                op()
            ts = []
            for _ in range(20):
                ev0.record(); op(); ev1.record(); ev1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(ev0, ev1))
            ms = float(np.median(ts))
            nbytes = sum(w.nbytes for w in ws_)
            print(f"{label:18s} {','.join(variant) or 'default':24s} T={T:2d} grid {str(op.grid):12s} smem {op.smem // 1024:3d} KB  {ms * 1e3:8.1f} us  "
                  f"{nbytes / (ms / 1e3) / 1e9:6.0f} GB/s  ({100 * nbytes / (ms / 1e3) / 1e9 / copy_gbs:4.1f}% of copy)")
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
