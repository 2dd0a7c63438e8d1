"""What a kernel boundary costs inside a captured step: a chain of small launches, each depending on
the one before, either through programmatic dependent launch (`griddepcontrol.wait`: the whole
previous grid complete and its memory flushed) or through a counter that every block of the previous
launch increments with release semantics as its last act (the next launch's blocks spin on it with
acquire loads instead of waiting). Both chains are captured as CUDA graphs with PDL; the difference
per launch is what replacing the grid-completion wait by counters could take off each boundary.

    python3 tests/bench/boundary_probe.py [--launches 200] [--blocks 7,132,528]
"""
from __future__ import annotations

import argparse

import numpy as np

from kernels.cuda_backend import CudaBackend
from kernels.fused_gpu import Op

SRC = r"""
extern "C" __global__ void k_wait(int* buf, int i, const int* flags, int* out, int expect) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0) buf[blockIdx.x] += i;
}
extern "C" __global__ void k_flag(int* buf, int i, const int* flags, int* out, int expect) {
    asm volatile("griddepcontrol.launch_dependents;");
    if (threadIdx.x == 0 && flags != nullptr) {
        int v;
        do {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flags) : "memory");
        } while (v < expect);
    }
    __syncthreads();
    if (threadIdx.x == 0) buf[blockIdx.x] += i;
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(out) : "memory");
}
extern "C" __global__ void k_none(int* buf, int i, const int* flags, int* out, int expect) {
    asm volatile("griddepcontrol.launch_dependents;");
    if (threadIdx.x == 0) buf[blockIdx.x] += i;
}
"""


class _Zero:
    def __init__(self, a):
        self.a, self.label, self.weight_bytes = a, "zero", 0

    def __call__(self):
        self.a.fill(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--blocks", default="7,132,528")
    args = ap.parse_args()
    b = CudaBackend()
    cp = b.xp
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    n = args.launches
    buf = cp.zeros(4096, dtype=cp.int32)
    flags = cp.zeros(n + 1, dtype=cp.int32)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    for nb in [int(x) for x in args.blocks.split(",")]:
        res = {}
        for kind in ("none", "wait", "flag"):
            kern = mod.get_function(f"k_{kind}")
            ops = [_Zero(flags)]
            for i in range(n):
                prev = flags[i - 1:i] if i > 0 else None
                ops.append(Op(f"{kind}{i}", kern, (nb,), (128,),
                              (buf, np.int32(i), prev, flags[i:i + 1], np.int32(nb))))
            g = b.capture_graph(ops)
            for _ in range(3):
                b.launch_graph(g)
            times = []
            for _ in range(10):
                b.busy_wait(2e-3)
                ev0.record()
                b.launch_graph(g)
                ev1.record()
                ev1.synchronize()
                times.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / n)
            res[kind] = float(np.median(times))
        print(f"{nb:4d} blocks a launch, {n} launches (PDL used: {b.pdl_used}): no dependency {res['none']:.2f} us, "
              f"griddepcontrol.wait {res['wait']:.2f} us, counters {res['flag']:.2f} us a launch")


if __name__ == "__main__":
    main()
