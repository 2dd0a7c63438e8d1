"""The DeltaNet step kernels alone on the 27B's shape (GPU): gdn_conv and gdn_recur (kernels/fused.cu)
per launch, at decode / verify widths and beyond one staging chunk.

    python3 tests/bench/bench_gdn_gpu.py [--widths 1,8,16,23,32,64] [--modes verify,advance,commit]
                                         [--baseline OLD_FUSED_CU] [--ncu-once] [--device emu]

Qwen3.5-27B: nk = 16 key heads, nv = 48 value heads, d_k = d_v = 128, Kc = 4 conv taps. The forms are
the step's (daemons/qwen35_gpu.py): verify = conv with write_state 0 and the state copied to the
front of the layer's record (state_save), recurrence with no state written (S_out = 0) and a backup
of it; advance = both states updated in place; commit (recurrence only) = replay n = T tokens from
the backup, n read on the device. Each figure is the mean of 20 launches queued back to back between
two events (as in a graph: no host gap), the median of 3 such runs.

gdn_conv reads the projections as int64 fixed-point sums and clears them, so launches after the first of a
timed run read zeros (the same bytes). --baseline needs a fused.cu whose kernels take the same arguments.
--baseline times a second copy of fused.cu (e.g. `git show HEAD:kernels/fused.cu > /tmp/fused_old.cu`;
its #include "x.cuh" lines are read from kernels/) on the same buffers, and checks that both give
the same bits (rec, conv state, outputs, recurrent state) at every width. --ncu-once runs each case
once and exits (for `ncu --kernel-name regex:gdn_`). `--device emu` runs the same code on the CPU
emulator (tests/emu, host clock: a smoke test of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from kernels.fused_gpu import FusedGpu                       # noqa: E402

NK, NV, DK, DV, KC = 16, 48, 128, 128, 4
EPS = 1e-6
MODES = ("verify", "advance", "commit")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="1,8,16,23,32,64", help="tokens per launch, comma-separated")
    ap.add_argument("--modes", default="verify,advance", help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--kernels", default="conv,recur", help="comma-separated subset of conv,recur")
    ap.add_argument("--n", type=int, default=20, help="launches per timed run")
    ap.add_argument("--baseline", default="", help="another fused.cu to time (and compare bits) against this one")
    ap.add_argument("--ncu-once", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "emu"), help="emu: the CPU emulator (smoke test)")
    args = ap.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",") if w]
    args.modes = [m for m in args.modes.split(",") if m]
    args.kernels = [k for k in args.kernels.split(",") if k]
    if not args.widths or min(args.widths) < 1:
        ap.error("--widths: positive token counts")
    if any(m not in MODES for m in args.modes):
        ap.error(f"--modes: {args.modes} (choose from {MODES})")
    if any(k not in ("conv", "recur") for k in args.kernels):
        ap.error(f"--kernels: {args.kernels} (choose from conv, recur)")
    if args.baseline and not Path(args.baseline).is_file():
        ap.error(f"--baseline: no file {args.baseline}")
    if args.baseline and args.device != "cuda":
        ap.error("--baseline compiles with CuPy: the GPU only")
    return args


class _OtherFused:
    """The CUDA backend with kernels/fused.cu replaced by another file (FusedGpu's device interface:
    xp, _kernel, ptr, multiprocessors)."""

    def __init__(self, gpu, path: str):
        from kernels import cuda_backend
        self.gpu, self.xp, self.multiprocessors = gpu, gpu.xp, gpu.multiprocessors
        self.code = cuda_backend._inline_includes(Path(path).read_text())
        self._mods: dict = {}

    def ptr(self, a) -> int:
        return self.gpu.ptr(a)

    def _kernel(self, source: str, name: str, defines: tuple[str, ...] = ()):
        if source != "fused.cu":
            return self.gpu._kernel(source, name, defines)
        mod = self._mods.get(defines)
        if mod is None:
            mod = self._mods[defines] = self.xp.RawModule(code=self.code, options=("--std=c++17",) + tuple(
                f"-D{d}" for d in defines))
        return mod.get_function(name)


class Buffers:
    """One layer's inputs and states at the widest T, filled once from a seeded generator; `reset`
    puts the states back (so every version starts from the same bits)."""

    def __init__(self, xp, t_max: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.xp = xp
        self.C = C = 2 * NK * DK + NV * DV
        self.R = C + 2 * NV
        f32 = np.float32
        self.h_qkv = rng.standard_normal((t_max, C)).astype(f32)
        # the projections as their matmul leaves them: int64 fixed-point sums, cleared by the kernel
        self.h_qkv_fx = np.rint(self.h_qkv.astype(np.float64) * 2.0 ** 32).astype(np.int64)
        self.h_ab_fx = np.rint(rng.standard_normal((t_max, 2 * NV)) * 2.0 ** 32).astype(np.int64)
        self.h_conv = rng.standard_normal((KC - 1, C)).astype(f32)
        self.h_S = (rng.standard_normal((NV, DK, DV)) * 0.1).astype(f32)
        self.conv_w = xp.asarray((rng.standard_normal((C, KC)) / 2).astype(f32))
        self.ab = xp.asarray(self.h_ab_fx)
        self.dt_bias = xp.asarray(rng.standard_normal(NV).astype(f32))
        self.ssm_a = xp.asarray(-np.exp(rng.uniform(-1, 1, NV)).astype(f32))
        self.qkv = xp.array(self.h_qkv_fx)                                 # the projection's rows
        self.record = xp.zeros((KC - 1 + t_max, C), dtype=xp.float32)       # verify: [conv state; rows]
        self.conv_state = xp.array(self.h_conv)
        self.rec = xp.zeros((t_max, self.R), dtype=xp.float32)
        self.S = xp.array(self.h_S)
        self.bak = xp.array(self.h_S)
        self.out = xp.zeros((t_max, NV * DV), dtype=xp.float32)
        self.params = xp.zeros(2, dtype=xp.int32)

    def reset(self) -> None:
        self.qkv[...] = self.xp.array(self.h_qkv_fx)
        self.ab[...] = self.xp.array(self.h_ab_fx)
        self.conv_state[...] = self.xp.array(self.h_conv)
        self.S[...] = self.xp.array(self.h_S)
        self.bak[...] = self.xp.array(self.h_S)
        self.record[...] = 0.0
        self.rec[...] = 0.0
        self.out[...] = 0.0


def make_ops(fg: FusedGpu, b: Buffers, T: int, mode: str, kernels) -> list:
    """(label, op) of the cases asked for at width T in one mode."""
    xp = b.xp
    ops = []
    if "conv" in kernels and mode != "commit":
        tbl = xp.asarray(np.array([fg.ptr(b.conv_state)], dtype=np.uint64))
        if mode == "verify":
            op = fg.op_gdn_conv("gdn_conv", b.qkv, b.C, tbl, 0, b.conv_w, b.ab, b.dt_bias, b.ssm_a, b.rec,
                                T, NK, NV, DK, DV, KC, EPS, write_state=False, state_save=b.record,
                                qkv_save=b.record[KC - 1:])
        else:
            op = fg.op_gdn_conv("gdn_conv", b.qkv, b.C, tbl, 0, b.conv_w, b.ab, b.dt_bias, b.ssm_a, b.rec, T, NK, NV,
                                DK, DV, KC, EPS, write_state=True)
        op.keep = op.keep + (tbl,)
        ops.append(("gdn_conv", op))
    if "recur" in kernels:
        n_dev = None
        if mode == "verify":
            row = (b.rec, b.S, None, b.bak)
        elif mode == "advance":
            row = (b.rec, b.S, b.S, None)
        else:
            row = (b.rec, b.bak, b.S, None)
            b.params[1] = T
            n_dev = b.params[1:]
        tbl = xp.asarray(np.array([0 if a is None else fg.ptr(a) for a in row], dtype=np.uint64))
        op = fg.op_gdn_recur("gdn_recur", tbl, 1, 0 if mode == "commit" else T, n_dev,
                             None if mode == "commit" else b.out, NK, NV, DK, DV)
        op.keep = op.keep + (tbl,)
        ops.append(("gdn_recur", op))
    return ops


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def timed_us(dev, fn, n: int) -> float:
    """Microseconds per call of fn, n calls queued back to back between two events (median of 3;
    the host clock on the emulator)."""
    cp = dev.xp
    out = []
    for _ in range(3):
        if hasattr(cp, "cuda"):
            ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
            ev0.record()
            for _ in range(n):
                fn()
            ev1.record()
            ev1.synchronize()
            out.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / n)
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            dev.synchronize()
            out.append((time.perf_counter() - t0) * 1e6 / n)
    return float(np.median(out))


def fill_rec(fg: FusedGpu, b: Buffers, t_max: int):
    """Realistic recurrence inputs (normalised q / k, gates) in every row of rec: one advance conv
    from the initial state, which is then put back. Returns a copy of rec."""
    b.reset()
    make_ops(fg, b, t_max, "advance", ("conv",))[0][1]()
    b.conv_state[...] = b.xp.array(b.h_conv)
    return b.rec.copy()


def same_bits(fgs, b: Buffers, T: int, mode: str, kernels, rec_in) -> list[str]:
    """The buffers whose bits differ between the versions after one launch of each case from the
    same start, the recurrence on the same inputs rec_in (an empty list: bit-identical)."""
    results = []
    for fg in fgs:
        b.reset()
        snap = {}
        for label, op in make_ops(fg, b, T, mode, kernels):
            if label == "gdn_recur":
                b.rec[...] = rec_in
            op()
            names = ("rec", "conv_state", "record") if label == "gdn_conv" else ("S", "bak", "out")
            snap.update({f"{label}.{k}": host(getattr(b, k)).view(np.uint32) for k in names})
        results.append(snap)
    return [k for k in results[0] if not np.array_equal(results[0][k], results[1][k])]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "emu":
        from tests.emu import EmuDevice
        gpu = EmuDevice()
    else:
        from kernels.cuda_backend import CudaBackend
        gpu = CudaBackend()
    cp = gpu.xp
    versions = [("current", FusedGpu(gpu))]
    if args.baseline:
        versions.append(("baseline", FusedGpu(_OtherFused(gpu, args.baseline))))
    t_max = max(args.widths)
    b = Buffers(cp, t_max)
    rec_in = fill_rec(versions[0][1], b, t_max)
    print(f"27B DeltaNet layer: nk={NK} nv={NV} dk={DK} dv={DV} Kc={KC}; us per launch (mean of {args.n}, "
          f"median of 3 runs)")
    per_token: dict = {}
    for mode in args.modes:
        for T in args.widths:
            for vname, fg in versions:
                for label, op in make_ops(fg, b, T, mode, args.kernels):
                    if args.ncu_once:
                        op()
                        continue
                    for _ in range(3):
                        op()
                    us = timed_us(gpu, op, args.n)
                    per_token.setdefault((vname, mode, label), []).append((T, us))
                    print(f"{label:10s} {mode:8s} {vname:9s} T={T:3d}  grid {str(op.grid):14s} dyn smem {op.smem // 1024:3d} KB"
                          f"  {us:8.2f} us")
            if len(versions) == 2 and not args.ncu_once:
                diff = same_bits([fg for _, fg in versions], b, T, mode, args.kernels, rec_in)
                print(f"{'':10s} {mode:8s} T={T:3d}  current vs baseline: "
                      f"{'bit-identical' if not diff else 'DIFFERENT: ' + ', '.join(diff)}")
                fill_rec(versions[0][1], b, t_max)
    gpu.synchronize()
    if args.ncu_once:
        return
    for (vname, mode, label), rows in per_token.items():
        rows = dict(rows)
        if 1 in rows and len(rows) > 1:
            slopes = ", ".join(f"T={T}: {(us - rows[1]) / (T - 1):.3f}" for T, us in rows.items() if T > 1)
            print(f"{label:10s} {mode:8s} {vname:9s} us per extra token over T=1: {slopes}")


if __name__ == "__main__":
    main()
