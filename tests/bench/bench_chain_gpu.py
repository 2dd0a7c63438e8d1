"""What a persistent decode step would save on its products (GPU): the decode step's tensor-core products
alone, in order, as a captured graph of their own launches (programmatic dependent launch, as in the
step) against the same products as one persistent launch (mma_matmul.cu mm_chain), in the same run.

    python3 tests/bench/bench_chain_gpu.py [--synthetic qwen35-27b-q4km] [--reps 50] [--ffn-only] [--spread 1 8 flag]
    python3 tests/bench/bench_chain_gpu.py --device emu --synthetic embedded     (a smoke test on the CPU)

Both forms run every product on its own launch's grid and stripes (the same bits:
tests/test_fused_kernels.py test_mm_chain_runs_products_and_preps_as_their_launches), reading the
activation buffers as the step left them (no prep or DeltaNet / attention kernel runs between the
products here, so this times the products and their boundaries only). Two sets: all the step's
products, then gate|up and ffn_down alone (128 products; --ffn-only: that set only). Printed per set:
ms per replay of each graph (median of --rounds rounds of --reps replays), and their difference in
total and per product boundary. The step itself with chains: `ab_bench.sh def:CHAIN_STEP=1`.

Why: the thirty-eighth session's model (persist_probe.py) put a persistent step 0.18-0.95 ms below the
launch chain at decode, the one measured lever of the decode target's size left; this measures the
products' part of that gain with the real kernels before a whole-step kernel is written.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_gpu_step import _model                    # noqa: E402


def _timed_graph(b, cp, graph, reps: int, rounds: int) -> float:
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    out = []
    for _ in range(rounds):
        b.busy_wait(0.002)                       # the replays queue behind it: device time only
        ev0.record()
        for _ in range(reps):
            b.launch_graph(graph)
        ev1.record()
        ev1.synchronize()
        out.append(cp.cuda.get_elapsed_time(ev0, ev1) / reps)
    return float(np.median(out))


def _emu_check(prods, chain) -> None:
    """--device emu (a smoke test of this script, tests/test_bench.py): the products in order, then the
    chain from the same buffers: every buffer they touch ends bit-identical."""
    arrays = {id(a): a for op in prods for a in list(op.args) + list(op.keep) if isinstance(a, np.ndarray)}
    before = {k: a.copy() for k, a in arrays.items()}
    for op in prods:
        op()
    after = {k: a.copy() for k, a in arrays.items()}
    for k, a in arrays.items():
        a[...] = before[k]
    chain()
    same = all(np.array_equal(arrays[k], after[k]) for k in arrays)
    print(f"emulator: {len(prods)} products in order and as mm_chain (grid {chain.grid[0]}): "
          f"{'bit-identical' if same else 'DIFFERENT'} in {len(arrays)} buffers")
    if not same:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default="qwen35-27b-q4km")
    ap.add_argument("--gguf", default=None, help="the synthetic file's path (default: the temp directory)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ffn-only", action="store_true")
    ap.add_argument("--spread", nargs="+", default=None,
                    help="chains with each of these fused_gpu.MM_CHAIN_SPREAD values, or 'flag' (fused_gpu.MM_CHAIN_FLAG: "
                         "the waiters look at a flag the last arrival raises); default: the module's")
    args = ap.parse_args()
    model = _model(args.synthetic, args.gguf, args.device)
    b = model.backend
    cp = b.xp
    fg = b.fused
    step_ops = model.gpu_step.ops_for(1, "advance", "last", n_keys=256)
    prods = [op for op in step_ops if getattr(op, "mm_kind", ())]
    sets = [("all products", prods), ("ffn only", [op for op in prods if "ffn_" in op.label])]
    if args.ffn_only:
        sets = sets[1:]
    for name, ops in sets:
        print(f"== {name}: {len(ops)} products of the {len(step_ops)} launches of a decode step; kinds "
              f"{sorted({op.mm_kind[:3] for op in ops})}")
        from kernels import fused_gpu
        for spread in args.spread or [str(fused_gpu.MM_CHAIN_SPREAD)]:
            fused_gpu.MM_CHAIN_FLAG = spread == "flag"
            fused_gpu.MM_CHAIN_SPREAD = 1 if spread == "flag" else int(spread)   # a phase's counts on this many lines
            chain = fg.op_mm_chain("chain", ops)
            if args.device == "emu":
                _emu_check(ops, chain)
                continue
            print(f"-- {'MM_CHAIN_FLAG' if spread == 'flag' else f'MM_CHAIN_SPREAD = {spread}'}")
            _compare(b, cp, ops, chain, args.reps, args.rounds)


def _compare(b, cp, prods, chain, reps: int, rounds: int) -> None:
    per_sm = b.resident_blocks(chain.kernel, chain.block[0], chain.smem) or 0
    print(f"mm_chain: grid {chain.grid[0]}, {chain.smem} B dynamic shared memory, "
          f"{getattr(chain.kernel, 'num_regs', 0)} registers, {per_sm} blocks a multiprocessor "
          f"({per_sm * b.multiprocessors} resident)")
    if chain.grid[0] > per_sm * b.multiprocessors:
        raise SystemExit("mm_chain: not every block can be resident (it would wait forever)")
    g_launches = b.capture_graph(prods)
    pdl = b.pdl_used
    g_chain = b.capture_graph([chain])
    for g in (g_launches, g_chain):              # warm
        for _ in range(3):
            b.launch_graph(g)
    b.synchronize()
    nbytes = sum(op.weight_bytes for op in prods)
    t_l = _timed_graph(b, cp, g_launches, reps, rounds)
    t_c = _timed_graph(b, cp, g_chain, reps, rounds)
    t_l2 = _timed_graph(b, cp, g_launches, reps, rounds)    # again: drift between the two
    print(f"launches ({'PDL' if pdl else 'plain'}): {t_l:.3f} ms, again {t_l2:.3f} ms "
          f"({nbytes / 1e9:.2f} GB: {nbytes / (min(t_l, t_l2) / 1e3) / 1e9:.0f} GB/s)")
    print(f"mm_chain: {t_c:.3f} ms ({nbytes / (t_c / 1e3) / 1e9:.0f} GB/s)")
    d = t_c - (t_l + t_l2) / 2
    print(f"chain - launches: {d:+.3f} ms ({1e3 * d / max(1, len(prods) - 1):+.2f} us a product boundary)")

if __name__ == "__main__":
    main()
