"""The chained decode step (qwen35_gpu.CHAIN_STEP) on a model of the 27B's widths with few layers: for each
level, decode steps run op by op with a sync after each launch (no programmatic dependent launch; a failing
launch is named), then from captured graphs (programmatic dependent launch unless --no-pdl), followed by
GreedyChain decoding as the serving loop runs it; logits and tokens compared bit for bit with the
launch-per-op step's.

    python3 tests/bench/chain_step_check_gpu.py [--layers 8] [--levels 1,2,3] [--modes eager,graphs]
        [--no-pdl] [--chain-no-pdl] [--no-cooperative] [--give-up] [--flag]
    python3 tests/bench/chain_step_check_gpu.py --device emu --narrow --layers 4   (a smoke test on the CPU)

Why (GPU_NOTES, fortieth session): on an H100 the chained step at level 3 ran bit-identical as plain launches
and failed (CUDA_ERROR_LAUNCH_FAILED: the chain wait's trap) from captured graphs with programmatic dependent
launch; --no-pdl asks whether the failure needs it, --give-up (fused_gpu.MM_CHAIN_GIVE_UP) prints which
chain, phase and block waited for a count that never came, and what the count was. The suspected cause: a
multiprocessor whose L1 / shared split a neighbour's blocks left below the 228 KB that four chain blocks need
(it changes only while idle), so fewer than the grid's blocks can ever be resident; that session had every
kernel of the chained plan prefer the largest carveout; --chain-no-pdl launches the chains on drained
multiprocessors instead (fused_gpu.MM_CHAIN_PDL).
Forty-first session: the preference did not remove the hang (H200: a phase-0 count one block short of the
grid, with and without it), --chain-no-pdl ran bit-identical, and --give-up's record, which now says which
blocks had not started and what each multiprocessor held, named the last block never started beside a
multiprocessor holding three (H100). The chains are now launched as cooperative grids
(fused_gpu.MM_CHAIN_COOPERATIVE: every block resident at once is CUDA's guarantee), which ran levels 1 and 3
bit-identical where the same machine hung without it; --no-cooperative launches them as before.
Forty-second session (H100): cooperative chains ran levels 1-3 at 8 layers and 1, 3 at 24 bit-identical, and
levels 1, 3 without the carveout preference too, which then went; ordinary grids hung again (a block never
started). The chained step lost its A/B (decode +0.33 ms at level 1, +3.9 ms at level 3): closed as a lever.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class _GaveUp(Exception):
    """A chain's wait gave up in the step named (--give-up): the level's run stops there."""


class _Watched:
    """A GreedyChain event whose synchronize waits through the watchdog."""

    def __init__(self, event, watch):
        self.event, self.watch = event, watch

    def record(self, stream=None) -> None:
        self.event.record(stream)

    def synchronize(self) -> None:
        self.watch(self.event)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--narrow", action="store_true", help="n_embd 256 instead of the 27B's widths (a smoke test)")
    ap.add_argument("--levels", default="1,2,3")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dir", default=None, help="where the model file goes (default: the temp directory)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--greedy", type=int, default=32, help="tokens of GreedyChain decoding after the steps")
    ap.add_argument("--modes", default="eager,graphs", help="eager (a sync after each launch), graphs, or both")
    ap.add_argument("--no-pdl", action="store_true", help="graphs without programmatic dependent launch")
    ap.add_argument("--no-ref", action="store_true", help="skip the launch-per-op reference (a failure hunt)")
    ap.add_argument("--give-up", action="store_true",
                    help="chains built with MM_CHAIN_GIVE_UP: a wait that runs out of patience is reported, not a trap")
    ap.add_argument("--flag", action="store_true", help="chains whose waiters look at a flag (fused_gpu.MM_CHAIN_FLAG)")
    ap.add_argument("--chain-no-pdl", action="store_true",
                    help="chains launched plainly (fused_gpu.MM_CHAIN_PDL = False), the other launches with PDL")
    ap.add_argument("--no-cooperative", action="store_true",
                    help="chains launched as ordinary grids (fused_gpu.MM_CHAIN_COOPERATIVE = False: the hang)")
    ap.add_argument("--watchdog", type=float, default=30.0,
                    help="seconds a step may keep the device busy before the records are read and the run ends")
    ap.add_argument("--device", default="cuda", help="cuda, or emu (the CPU emulator: slow, few layers)")
    args = ap.parse_args()
    from dataclasses import replace
    from daemons import qwen35_gpu
    from daemons.bench import write_synthetic_gguf
    from daemons.qwen35 import Qwen35Model
    from daemons.synthetic import PRESETS
    from kernels import fused_gpu
    fused_gpu.MM_CHAIN_GIVE_UP = args.give_up
    fused_gpu.MM_CHAIN_PDL = not args.chain_no_pdl
    fused_gpu.MM_CHAIN_COOPERATIVE = not args.no_cooperative
    fused_gpu.MM_CHAIN_FLAG = args.flag
    from kernels.cuda_backend import CudaBackend  # noqa: F401  (imports without a GPU)
    shape = replace(PRESETS["qwen35-27b"], n_layer=args.layers)
    if args.narrow:                             # every matrix whole 256-column superblocks (Q4_K / Q6_K)
        shape = replace(shape, n_embd=256, n_ff=512, n_head=2, n_head_kv=1, head_dim=128, n_k_heads=2, n_v_heads=4,
                        ssm_head_dim=64, n_rot=32)
    path = os.path.join(args.dir or tempfile.gettempdir(),
                        f"chain_check_{args.layers}{'_narrow' if args.narrow else ''}_{args.vocab}.gguf")
    if not os.path.exists(path):
        write_synthetic_gguf(path, shape, mix="q4_k_m", n_vocab=args.vocab, seed=5)
    if args.device == "emu":
        from tests.emu import EmuBackend
        backend = EmuBackend()
    else:
        backend = CudaBackend()
        if args.no_pdl:
            backend.pdl = False
    state_len = 7 + args.steps + args.greedy + 8
    prompt = list(np.random.default_rng(1).integers(0, args.vocab, 7))

    def decode(level: int, graphs: bool):
        qwen35_gpu.CHAIN_STEP = level
        dev = Qwen35Model.load(path, backend)
        step = dev.gpu_step
        step.graphs = graphs and step.graphs
        if not graphs:                          # a sync after each launch: a failure names its launch
            def launch(key, build):
                ops, _ = step._runner(key, build)
                for op in ops:
                    t0 = time.perf_counter()
                    try:
                        op()
                        backend.synchronize()
                    except Exception as e:      # noqa: BLE001
                        print(f"level {level}: launch {op.label!r} (grid {getattr(op, 'grid', '?')}) failed after "
                              f"{time.perf_counter() - t0:.2f} s: {e}", flush=True)
                        raise SystemExit(1)
            step._launch = launch
        ops = step.ops_for(1)
        print(f"level {level} graphs={graphs}: {len(ops)} launches a decode step, "
              f"{sum('chain of' in o.label for o in ops)} chains", flush=True)

        def stuck(when: str, side=None) -> None:     # --give-up: the chains' records of waits that gave up
            if not args.give_up:
                return
            if side is None:
                backend.synchronize()
            gave_up = False
            for ops_, _ in list(step._plans.values()):
                for op in ops_:
                    if "chain of" in op.label:
                        rec = backend.fused.chain_stuck(op, stream=side)
                        if rec is not None:
                            print(f"level {level} graphs={graphs} {when}: {op.label!r} (grid {op.grid}, "
                                  f"{int(op.args[1])} phases) gave up: {rec}", flush=True)
                            gave_up = True
            if side is None and gave_up:        # (each later step would wait seconds again)
                raise _GaveUp(when)

        def watch(event) -> None:              # a launch that never ends: report, then leave the process
            t0 = time.perf_counter()
            while not event.done:
                if time.perf_counter() - t0 > args.watchdog:
                    print(f"level {level} graphs={graphs}: the device is still busy after {args.watchdog} s "
                          f"(a wait that gave up does not end it: a block waits elsewhere)", flush=True)
                    stuck("watchdog", side=backend.xp.cuda.Stream(non_blocking=True))
                    os._exit(3)
                time.sleep(0.005)

        if args.device != "emu":               # every read of a step's result waits through `watch`
            to_host = step._to_host

            def watched_to_host(a):
                ev = backend.xp.cuda.Event(disable_timing=True)
                ev.record()
                watch(ev)
                return to_host(a)
            step._to_host = watched_to_host

        state = dev.new_state(state_len)
        rows = [np.asarray(backend.to_host(dev.forward(prompt, state)))]
        stuck("prompt")
        for i in range(args.steps):
            rows.append(np.asarray(backend.to_host(dev.forward([int(np.argmax(rows[-1]))], state))))
            stuck(f"step {i}")
        backend.synchronize()
        if graphs:                              # and as the serving loop decodes (GreedyChain: one step ahead)
            toks = [int(np.argmax(rows[-1]))]
            with step.greedy_chain(state) as chain:
                if args.device != "emu":
                    chain._events = [_Watched(e, watch) for e in chain._events]
                for i in range(args.greedy):
                    toks.append(chain.next(toks[-1], ahead=i + 1 < args.greedy))
                    stuck(f"greedy {i}")
            rows.append(np.asarray(toks, dtype=np.float32))
        return rows

    ref = None if args.no_ref else decode(0, True)
    for level in [int(v) for v in args.levels.split(",")]:
        for graphs in [m == "graphs" for m in args.modes.split(",")]:
            t0 = time.perf_counter()
            try:
                got = decode(level, graphs)
            except _GaveUp as e:
                print(f"level {level} graphs={graphs}: stopped at {e} (a wait gave up: its results are wrong)", flush=True)
                continue
            except Exception as e:              # noqa: BLE001
                print(f"level {level} graphs={graphs}: failed after {time.perf_counter() - t0:.2f} s: {e}", flush=True)
                raise SystemExit(1)
            if ref is None:
                print(f"level {level} graphs={graphs}: ran", flush=True)
                continue
            same = [np.array_equal(a, b) for a, b in zip(got, ref)]
            print(f"level {level} graphs={graphs}: logits of {sum(same)}/{len(same)} steps bit-identical"
                  + (f", greedy tokens {'the same' if np.array_equal(got[-1], ref[-1]) else 'DIFFERENT'}" if graphs else ""),
                  flush=True)


if __name__ == "__main__":
    main()
