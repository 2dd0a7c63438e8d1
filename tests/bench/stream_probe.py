"""How fast can 528 blocks stream a decode product's weights into shared memory, by copy mechanism?

A question the T = 1 products raise (GPU_NOTES, twenty-sixth session): mm_tc with its arithmetic
removed (`MM_NO_COMPUTE`) still streams gate|up's 100 MB at only ~2.5-3 TB/s in the decode graph, and
every way of putting more bytes in flight (a fourth stage, a fifth block a multiprocessor, L2
prefetches) made the step slower. This probe times the copy pipeline alone, outside the model, with
each block streaming its contiguous share of a matrix of about --mb MB (rounded down so that every
stage size below divides a block's share) the way mm_tc's separate issuer does:

  tma      one warp issues each stage as one bulk copy (cp.async.bulk, TMA) completing on the
           stage's "full" mbarrier; four consumer warps wait on it and release it on "empty"
           (mm_tc at T = 1 with no arithmetic)
  ldgsts   the same pipeline, the issuer's 32 lanes copying 16 bytes each at a time with cp.async
           (LDGSTS), each lane's copies completing on the full barrier (cp.async.mbarrier.arrive)
  ldg      no pipeline: every thread of the block loads its share with 16-byte loads, 8 in flight,
           into registers (what a plain read stream reaches)

Usage (GPU machine): python3 tests/bench/stream_probe.py [--mb 100] [--blocks-per-sm 4]
Prints GB/s per mechanism and stage shape; nothing here is used by dflashd.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# The pipeline's barriers and bulk copy are mm_tc's own (tc_common.cuh), so the probe times the same
# instructions; only the cp.async path is the probe's.
SRC = r"""
#include "tc_common.cuh"
typedef unsigned long long u64;
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// MODE 0: TMA bulk copy a stage; MODE 1: cp.async 16 B a lane, each lane's copies arriving on full.
template <int MODE>
__device__ void pipe(const unsigned char* __restrict__ w, long long total, int stage_bytes, int n_stages,
                     unsigned* __restrict__ sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 full[8], empty[8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long per = total / gridDim.x;
    const long long b0 = (long long)blockIdx.x * per;
    const int n = (int)(per / stage_bytes);
    if (threadIdx.x == 0)
        for (int k = 0; k < n_stages; ++k) { mbar_init(&full[k], MODE == 0 ? 1 : 32); mbar_init(&empty[k], 4); }
    __syncthreads();
    if (warp == 4) {
        for (int i = 0; i < n; ++i) {
            const int k = i % n_stages, r = i / n_stages;
            if (r > 0) mbar_wait(&empty[k], (unsigned)(r - 1) & 1u);
            unsigned char* st = smem + k * stage_bytes;
            const unsigned char* src = w + b0 + (long long)i * stage_bytes;
            if (MODE == 0) {
                if (lane == 0) {
                    mbar_expect(&full[k], (unsigned)stage_bytes);
                    bulk_copy(st, src, (unsigned)stage_bytes, &full[k]);
                }
            } else {
                for (int o = lane * 16; o < stage_bytes; o += 512)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa(st + o)), "l"(src + o) : "memory");
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(sa(&full[k])) : "memory");
            }
        }
        return;
    }
    unsigned acc = 0;
    for (int i = 0; i < n; ++i) {
        const int k = i % n_stages, r = i / n_stages;
        mbar_wait(&full[k], (unsigned)r & 1u);
        acc ^= *(const unsigned*)(smem + k * stage_bytes + warp * 64 + lane * 4);
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_ref(&empty[k]));
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;     // keeps the reads
}
extern "C" __global__ void __launch_bounds__(160) stream_tma(const unsigned char* w, long long total, int sb, int ns,
                                                           unsigned* sink) { pipe<0>(w, total, sb, ns, sink); }
extern "C" __global__ void __launch_bounds__(160) stream_ldgsts(const unsigned char* w, long long total, int sb, int ns,
                                                              unsigned* sink) { pipe<1>(w, total, sb, ns, sink); }
extern "C" __global__ void __launch_bounds__(160) stream_ldg(const unsigned char* __restrict__ w, long long total,
                                                           int, int, unsigned* sink) {
    const long long per = total / gridDim.x;
    const uint4* p = (const uint4*)(w + (long long)blockIdx.x * per);
    const int n = (int)(per / 16);
    unsigned acc = 0;
    for (int base = threadIdx.x; base < n; base += 8 * blockDim.x) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = base + u * blockDim.x;
            v[u] = i < n ? __ldcs(p + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}
"""


def main() -> None:
    import cupy as cp
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=100.0, help="bytes a launch streams (MB; gate|up Q4_K: 100)")
    ap.add_argument("--blocks-per-sm", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = cp.cuda.Device()
    n_sm = dev.attributes["MultiProcessorCount"]
    grid = args.blocks_per_sm * n_sm
    from kernels.cuda_backend import _inline_includes
    mod = cp.RawModule(code=_inline_includes(SRC), options=("-std=c++17",))
    unit = 55296                                       # every stage size below divides a block's share
    total = int(args.mb * 1e6) // (grid * unit) * (grid * unit)
    n_slices = max(4, int(2.0e9 // total))              # launches walk slices: nothing left in L2
    buf = cp.zeros(total * n_slices, dtype=cp.uint8)
    sink = cp.zeros(grid, dtype=cp.uint32)
    print(f"{n_sm} SMs, grid {grid} blocks, {total / 1e6:.1f} MB a launch, {n_slices} slices")

    def time_it(name: str, sb: int, ns: int) -> None:
        k = mod.get_function(name)
        smem = sb * ns if name != "stream_ldg" else 0
        if smem > 48 * 1024:
            k.max_dynamic_shared_size_bytes = smem
        args_of = lambda s: (buf[s * total:].data.ptr, cp.int64(total), cp.int32(sb), cp.int32(ns), sink)
        for s in range(n_slices):                      # warm-up (and compile)
            k((grid,), (160,), args_of(s), shared_mem=smem)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for r in range(args.reps):
            k((grid,), (160,), args_of(r % n_slices), shared_mem=smem)
        e1.record()
        e1.synchronize()
        us = cp.cuda.get_elapsed_time(e0, e1) * 1e3 / args.reps
        print(f"{name:14s} stage {sb:6d} B x {ns}: {us:7.1f} us a launch, {total / us / 1e3:7.0f} GB/s")

    time_it("stream_ldg", 0, 0)
    for sb, ns in ((9216, 3), (9216, 4), (9216, 6), (13824, 3), (4608, 6), (18432, 3)):
        time_it("stream_tma", sb, ns)
        time_it("stream_ldgsts", sb, ns)


if __name__ == "__main__":
    main()
