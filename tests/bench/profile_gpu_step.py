"""Where the GPU's time goes: the GPU step per kind of launch at any width, and a wide prefill per
backend operation (the per-kernel figures of the README's 27B rows come from this).

    python3 tests/bench/profile_gpu_step.py [--widths 1,23] [--prefill 512] [--synthetic qwen35-27b-q4km]
                                            [--device cuda:0]

Step widths: the launch list of a decode step (T = 1, advance) or a verify block (T > 1) on a
256-token context, run back to back behind a busy-wait, each launch between two events, summed by
kind over the layers (what `dflashd bench` prints for T = 1). Prefill: --prefill tokens from an
empty state, first timed whole (best of two, one chunk), then once with every backend operation
synchronised and timed alone (a forward of `WIDE_MIN_T` (160) or more tokens leaves the step: daemons/qwen35.py; `--prefill` below that runs as steps).
`--device emu` runs the same code on the CPU emulator (tests/emu, host clock) as a smoke test of
this script, with a small preset (`--synthetic embedded`).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from daemons.bench import (_ProfilingBackend, _file_name, _op_kind, _presets, _sync, _weight_labels,  # noqa: E402
                           write_synthetic_gguf)
from daemons.qwen35 import Qwen35Model                                                                # noqa: E402


def _model(synthetic: str, path: str | None, device: str) -> Qwen35Model:
    preset = _presets()[synthetic]
    name = f"dflashd-bench-{synthetic}-seed0"          # the file `dflashd bench --synthetic` writes
    path = path or os.path.join(tempfile.gettempdir(), f"{synthetic}.gguf")
    if not (os.path.exists(path) and _file_name(path) == name):
        print(f"writing {synthetic} to {path}", flush=True)
        write_synthetic_gguf(path, preset.shape, mix=preset.mix, n_vocab=preset.n_vocab, seed=0, name=name)
    if device == "emu":
        from tests.emu import EmuBackend
        backend = EmuBackend()
    else:
        from kernels import get_backend
        backend = get_backend(device)
    return Qwen35Model.load(path, backend)


def _print_rows(title: str, agg: dict[str, list]) -> None:
    total = sum(v[1] for v in agg.values())
    print(f"== {title}: {total:.2f} ms")
    for label, (n, ms, nbytes) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        rate = f"  {nbytes / ms / 1e6:6.0f} GB/s" if nbytes and ms > 0 else ""
        print(f"   {label:40s} n={n:4d} {ms:8.3f} ms{rate}")


def profile_step(model: Qwen35Model, T: int, context) -> None:
    b, step = model.backend, model.gpu_step
    mode, logits = ("advance", "last") if T == 1 else ("verify", "all")
    ops = step.ops_for(T, mode, logits, n_keys=context.n_past + T)
    state = context.copy()
    step._bind(state)
    cp = b.xp if hasattr(b.xp, "cuda") else None
    times = []
    for _ in range(2):                                  # the first pass warms caches and compiles
        times.clear()
        if cp is not None:
            evs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in ops]
            _sync(b)
            b.busy_wait(20e-3)
            for op, (e0, e1) in zip(ops, evs):
                e0.record()
                op()
                e1.record()
            evs[-1][1].synchronize()
            times = [cp.cuda.get_elapsed_time(e0, e1) for e0, e1 in evs]
        else:
            for op in ops:
                t0 = time.perf_counter()
                op()
                times.append((time.perf_counter() - t0) * 1e3)
    agg: dict[str, list] = {}
    for op, ms in zip(ops, times):
        a = agg.setdefault(_op_kind(op.label), [0, 0.0, 0])
        a[0] += 1
        a[1] += ms
        a[2] += getattr(op, "weight_bytes", 0)
    _print_rows(f"step T={T} ({mode}), launches back to back", agg)


def profile_prefill(model: Qwen35Model, n: int, rng) -> None:
    b = model.backend
    ids = rng.integers(0, model.n_vocab, n).tolist()
    model.prefill(ids[:min(n, 64)], model.new_state(n + 8), chunk=n, logits="last")     # compile
    best = float("inf")
    for _ in range(2):
        st = model.new_state(n + 8)
        _sync(b)
        t0 = time.perf_counter()
        model.prefill(ids, st, chunk=n, logits="last")
        _sync(b)
        best = min(best, time.perf_counter() - t0)
    print(f"== prefill {n} tokens: {best * 1e3:.1f} ms = {n / best:.0f} tok/s")
    labels, _, _ = _weight_labels(model)
    prof = _ProfilingBackend(b, labels)
    st = model.new_state(n + 8)
    model.backend = prof
    try:
        model.prefill(ids, st, chunk=n, logits="last")
    finally:
        model.backend = b
    agg: dict[str, list] = {}
    for label, dev, _host in prof.records:
        a = agg.setdefault(label, [0, 0.0, 0])
        a[0] += 1
        a[1] += dev * 1e3
    _print_rows(f"prefill {n} tokens, each backend operation alone (device time)", agg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,23", help="step widths to profile (1..32)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill profile (0: none)")
    ap.add_argument("--synthetic", default="qwen35-27b-q4km", choices=sorted(_presets()))
    ap.add_argument("--path", default=None, help="where the synthetic GGUF is kept (default: the temp folder)")
    ap.add_argument("--device", default="cuda:0", help="cuda:N, hip:N, or emu (the CPU emulator)")
    args = ap.parse_args()
    model = _model(args.synthetic, args.path, args.device)
    if model.gpu_step is None:
        sys.exit(f"{args.synthetic} on {args.device}: the model does not run through the GPU step")
    rng = np.random.default_rng(0)
    context = model.new_state(256 + 40)
    model.prefill(rng.integers(0, model.n_vocab, 256).tolist(), context, logits="last")
    for T in (int(w) for w in args.widths.split(",") if w.strip()):
        profile_step(model, T, context)
    if args.prefill:
        profile_prefill(model, args.prefill, rng)


if __name__ == "__main__":
    main()
