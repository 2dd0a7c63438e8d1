"""Does a Hopper warpgroup MMA (wgmma, A from registers, B from shared memory) give the same bits as
the chain of mma.sync m16n8k16 that the decode matmuls run, and does its result for a column depend
on the instruction's width N?

Why it matters: verify rows must be bit-identical to decode steps (speculative output = greedy
output), so a wide product may move to wgmma (one instruction a k-step for all 23 activation rows,
B read by the tensor cores from shared memory: no B loads, a third of the MMA instructions at
NT = 3) only if its sums round exactly like decode's mma.sync chain, or if decode moves too and the
sums do not depend on N (tests/bench/GPU_NOTES.md, next steps).

The probe: one warpgroup, A = 64 x 16*KS f16 (each warp's 16 rows as the mma.sync A fragment),
B = N x 16*KS f16, f32 accumulators starting from C0; D by KS chained mma.sync per 8-column tile
and by KS chained wgmma.m64nNk16 (B in the no-swizzle K-major layout), compared bit for bit for
N = 8, 16, 24, 32, against each other and against a float64 product. Needs sm_90a (NVRTC
`-arch=sm_90a`). H200, 2026-12-03: every result bit-identical, columns independent of N.

    python3 tests/bench/wgmma_probe.py [--ks 32] [--trials 4]
"""
import argparse
import sys

import numpy as np

SRC = r"""
typedef unsigned int u32;
typedef unsigned short u16;
__device__ __forceinline__ u32 pack2(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }
__device__ __forceinline__ void afrag(const u16* A, int ldA, int w, int lane, int s, u32 (&a)[4]) {
    const int g = lane >> 2, c = lane & 3, r0 = 16 * w + g, k0 = 16 * s + 2 * c;
    a[0] = pack2(A[r0 * ldA + k0], A[r0 * ldA + k0 + 1]);
    a[1] = pack2(A[(r0 + 8) * ldA + k0], A[(r0 + 8) * ldA + k0 + 1]);
    a[2] = pack2(A[r0 * ldA + k0 + 8], A[r0 * ldA + k0 + 9]);
    a[3] = pack2(A[(r0 + 8) * ldA + k0 + 8], A[(r0 + 8) * ldA + k0 + 9]);
}
// D[64][N] = C0 + A B^T by mma.sync, per warp 16 rows, per 8-column tile a chain over the k-steps.
extern "C" __global__ void by_mma(const u16* A, const u16* B, const float* C0, float* D, int KS) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, ld = 16 * KS;
    for (int j = 0; j < NN / 8; ++j) {
        const int r0 = 16 * w + g, col = 8 * j + 2 * c;
        float d[4] = {C0[r0 * NN + col], C0[r0 * NN + col + 1], C0[(r0 + 8) * NN + col], C0[(r0 + 8) * NN + col + 1]};
        for (int s = 0; s < KS; ++s) {
            u32 a[4];
            afrag(A, ld, w, lane, s, a);
            const int n = 8 * j + g, k0 = 16 * s + 2 * c;
            const u32 b0 = pack2(B[n * ld + k0], B[n * ld + k0 + 1]), b1 = pack2(B[n * ld + k0 + 8], B[n * ld + k0 + 9]);
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        }
        D[r0 * NN + col] = d[0]; D[r0 * NN + col + 1] = d[1];
        D[(r0 + 8) * NN + col] = d[2]; D[(r0 + 8) * NN + col + 1] = d[3];
    }
}
// The same by wgmma.m64nNk16 (A from registers, B from shared memory in the no-swizzle K-major
// layout: 8 x 16-byte core matrices, core (k-half h, n-group j) of k-step s at
// ((s * 2 + h) * (NN / 8) + j) * 128 bytes). The descriptor's leading byte offset is the k-half step,
// its stride byte offset the 8-column step (PTX ISA; exchanged, the tensor cores read past the
// operand: an illegal-address fault from N = 16 on).
extern "C" __global__ void by_wgmma(const u16* A, const u16* B, const float* C0, float* D, int KS) {
    extern __shared__ __align__(128) unsigned char sb[];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, ld = 16 * KS;
    u16* sbh = (u16*)sb;
    for (int e = threadIdx.x; e < NN * ld; e += blockDim.x) {
        const int n = e / ld, k = e % ld, s = k / 16, h = (k % 16) / 8;
        const int core = (s * 2 + h) * (NN / 8) + n / 8;
        sbh[core * 64 + (n % 8) * 8 + (k % 8)] = B[e];
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    float d[NN / 2];
#pragma unroll
    for (int j = 0; j < NN / 8; ++j) {
        const int r0 = 16 * w + g, col = 8 * j + 2 * c;
        d[4 * j] = C0[r0 * NN + col]; d[4 * j + 1] = C0[r0 * NN + col + 1];
        d[4 * j + 2] = C0[(r0 + 8) * NN + col]; d[4 * j + 3] = C0[(r0 + 8) * NN + col + 1];
    }
    const unsigned long long lbo = (NN / 8) * 128, sbo = 128;     // k-half step, 8-column step
    const unsigned base = (unsigned)__cvta_generic_to_shared(sb);
    for (int s = 0; s < KS; ++s) {
        u32 a[4];
        afrag(A, ld, w, lane, s, a);
        const unsigned addr = base + (unsigned)(s * 2 * lbo);
        const unsigned long long desc = ((unsigned long long)((addr & 0x3FFFF) >> 4)) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        WGMMA_CALL
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
#pragma unroll
    for (int j = 0; j < NN / 8; ++j) {
        const int r0 = 16 * w + g, col = 8 * j + 2 * c;
        D[r0 * NN + col] = d[4 * j]; D[r0 * NN + col + 1] = d[4 * j + 1];
        D[(r0 + 8) * NN + col] = d[4 * j + 2]; D[(r0 + 8) * NN + col + 1] = d[4 * j + 3];
    }
}
"""


def wgmma_call(n):
    nd = n // 2
    dl = ",".join(f"%{i}" for i in range(nd))
    al = ",".join(f"%{nd + i}" for i in range(4))
    asm = (f'"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n'
           f'wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{dl}}}, {{{al}}}, %{nd + 4}, p, 1, 1, 0;\\n}}\\n"')
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    ins = ", ".join([f'"r"(a[{i}])' for i in range(4)] + ['"l"(desc)', '"r"(1)'])
    return f"asm volatile({asm} : {outs} : {ins} : \"memory\");"


def test_data(rng, ks, n, kind):
    k = 16 * ks
    if kind == "q4k":      # what a Q4_K / Q5_K A fragment holds: sc * q, integers < 2048, exact in f16
        a = (rng.integers(0, 64, (64, k)) * rng.integers(0, 32, (64, k))).astype(np.float16)
    else:                  # general f16 weights over a wide exponent range
        a = (rng.standard_normal((64, k)) * 2.0 ** rng.integers(-10, 6, (64, k))).astype(np.float16)
    b = (rng.standard_normal((n, k)) * 2.0 ** rng.integers(-12, 4, (n, k))).astype(np.float16)
    c0 = (rng.standard_normal((64, n)) * 2.0 ** rng.integers(-4, 10, (64, n))).astype(np.float32)
    return a, b, c0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, default=32, help="k-steps of 16 chained (default 32: two superblocks)")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--widths", default="8,16,24,32", help="wgmma widths N to try")
    args = ap.parse_args()
    import cupy as cp

    rng = np.random.default_rng(0)
    data = [(kind, trial, test_data(rng, args.ks, 32, kind)) for kind in ("q4k", "f16") for trial in range(args.trials)]
    ok = True
    first8 = {}                  # (kind, trial) -> {N: wgmma's first 8 columns}
    for n in [int(v) for v in args.widths.split(",")]:
        src = SRC.replace("WGMMA_CALL", wgmma_call(n))
        mod = cp.RawModule(code=src, options=("--std=c++17", "-arch=sm_90a", f"-DNN={n}"))
        f_mma, f_wg = mod.get_function("by_mma"), mod.get_function("by_wgmma")
        smem = args.ks * n * 32
        f_wg.max_dynamic_shared_size_bytes = smem
        for kind, trial, (a, b32, c32) in data:
            b, c0 = np.ascontiguousarray(b32[:n]), np.ascontiguousarray(c32[:, :n])
            da, db, dc = cp.asarray(a.view(np.uint16)), cp.asarray(b.view(np.uint16)), cp.asarray(c0)
            ref = c0.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64).T
            scale = np.abs(ref).max()
            y_mma = cp.zeros((64, n), cp.float32)
            f_mma((1,), (128,), (da, db, dc, y_mma, np.int32(args.ks)))
            y_mma = y_mma.get()
            line = f"N={n:2d} {kind} trial {trial}: mma.sync err {np.abs(y_mma - ref).max() / scale:.1e}"
            y_wg = cp.zeros((64, n), cp.float32)
            f_wg((1,), (128,), (da, db, dc, y_wg, np.int32(args.ks)), shared_mem=smem)
            y_wg = y_wg.get()
            err = np.abs(y_wg - ref).max() / scale
            if err > 1e-3:
                line += f" | wgmma wrong (err {err:.1e}): descriptor or layout"
                ok = False
            else:
                diff = int((y_wg.view(np.uint32) != y_mma.view(np.uint32)).sum())
                line += f" | wgmma err {err:.1e}, {diff} of {y_wg.size} differ from mma.sync"
                ok &= diff == 0
                first8.setdefault((kind, trial), {})[n] = y_wg[:, :8].copy()
            print(line, flush=True)
    # wgmma's first 8 columns at N = 16, 24, 32 against N = 8 (the same A, B rows and C0 columns).
    n_var = 0
    for key, by_n in first8.items():
        for n, y in by_n.items():
            if 8 in by_n and n != 8:
                d = int((y.view(np.uint32) != by_n[8].view(np.uint32)).sum())
                n_var += d
                if d:
                    print(f"{key}: wgmma N={n} first 8 columns differ from N=8 in {d} of {y.size}")
    print(f"wgmma columns independent of N: {'yes' if n_var == 0 else 'NO'}")
    print("ALL BIT-IDENTICAL to mma.sync" if ok else "DIFFERENCES FROM mma.sync FOUND", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
