"""What each kernel adds to the GPU step inside its CUDA graph (issue 8: "time each kernel in the graph").

    python3 tests/bench/timeline_gpu_step.py [--widths 1,23] [--reps 8] [--path /tmp/qwen35-27b-q4km.gguf]

With programmatic dependent launch a kernel starts while the one before it drains, so neither its
time alone (`profile_gpu_step.py`: launches back to back, each between two events) nor a step with
it left out (`bench_drop_ops.py`) says where the step's time goes. Here every module is built with
the step timeline (kernels/timeline.cuh: each launch records its first block's start, its first and
last block's return from the dependency wait and its last block's end, in %globaltimer ns) and the
captured step is replayed as the bench replays it. Per kind of launch, summed over the layers and
averaged over the replays:

  adds      how far the launch moves the step's end: its end minus the latest end of the launches
            before it (0 when it ends under an earlier one); the column sums to the step
  lag       its first block's release from the dependency wait minus the end of the launch before
            it: what a launch boundary costs on the step's path
  run       its end minus that release: its own critical time
  early     that release minus its first block's start: how early it was resident (time it could
            use to request weights)

%globaltimer ticks coarsely (~1 us here), so single launches are quantised; the sums over layers
and replays are not. Recording costs each block of every launch a few atomics: compare the step
line with `dflashd bench`'s graph time of the same build.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from daemons.bench import _op_kind, _presets, _sync                      # noqa: E402
from kernels import cuda_backend as cb                                   # noqa: E402

from tests.bench.profile_gpu_step import _model                         # noqa: E402

NEVER = np.uint64(0xFFFFFFFFFFFFFFFF)


def _clear(tables) -> None:
    for t in tables:
        t.fill(0)
        t[:, 1] = NEVER
        t[:, 2] = NEVER


def _records(cp, tables) -> np.ndarray:
    """[n, 6] uint64 (grid id, start, released first, released last, end, blocks), by grid id."""
    rows = []
    for t in tables:
        h = cp.asnumpy(t)
        rows.append(h[h[:, 5] > 0])
    recs = np.concatenate(rows) if rows else np.zeros((0, 6), dtype=np.uint64)
    return recs[np.argsort(recs[:, 0], kind="stable")]


def breakdown(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Per launch of one replay (records by grid id, int64 ns; a launch that never waited has
    released = -1): (adds, lag, run, early) as the module docstring defines them, and the step's
    time from the first start to the last end."""
    start, rel, end = r[:, 1], r[:, 2], r[:, 4]
    rel = np.where(rel != -1, rel, start)              # a launch without the wait (embed) runs at once
    latest = np.maximum.accumulate(end)
    prev_latest = np.concatenate([[start[0]], latest[:-1]])
    prev_end = np.concatenate([[start[0]], end[:-1]])
    return (np.maximum(end - prev_latest, 0), rel - prev_end, end - rel, rel - start, int(latest[-1] - start[0]))


def timeline(model, T: int, context, reps: int) -> None:
    b, step = model.backend, model.gpu_step
    cp = b.xp
    mode, logits = ("advance", "last") if T == 1 else ("verify", "all")
    ops = step.ops_for(T, mode, logits, n_keys=context.n_past + T)
    key = step.plan_key(T, mode, logits, context.n_past + T)
    timed = [op for op in ops if getattr(op, "kernel", None) is not None]   # launches that record
    state = context.copy()
    step._bind(state)
    tables = cb.step_timeline_tables(cp)
    for _ in range(2):                                  # warm: caches, lazy loads
        state.copy_from(context)
        step._launch(key, None)
    _sync(b)
    kinds = [_op_kind(op.label) for op in timed]
    sums = {k: np.zeros(4) for k in kinds}
    counts = {k: 0 for k in kinds}
    step_ns, good = [], 0
    for _ in range(reps):
        state.copy_from(context)
        _clear(tables)
        _sync(b)
        step._launch(key, None)
        _sync(b)
        r = _records(cp, tables).astype(np.int64)
        if len(r) != len(timed):
            print(f"   T={T}: {len(r)} launches recorded for {len(timed)} kernel launches in the plan; replay skipped")
            continue
        good += 1
        adds, lag, run, early, ns = breakdown(r)
        step_ns.append(ns)
        for i, k in enumerate(kinds):
            sums[k] += (adds[i], lag[i], run[i], early[i])
            counts[k] += 1
    if not good:
        return
    total = np.mean(step_ns) / 1e6
    print(f"== step T={T} ({mode}) in its graph: {total:.3f} ms, first start to last end ({good} replays)")
    print(f"   {'launch':40s} {'n':>4s} {'adds ms':>8s} {'lag us':>7s} {'run us':>7s} {'early us':>8s}")
    for k in sorted(sums, key=lambda k: -sums[k][0]):
        n = counts[k] // good
        s = sums[k] / good
        per = s / max(n, 1) / 1e3
        print(f"   {k:40s} {n:4d} {s[0] / 1e6:8.3f} {per[1]:7.2f} {per[2]:7.2f} {per[3]:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,23", help="step widths (1..32)")
    ap.add_argument("--reps", type=int, default=8, help="replays of each step")
    ap.add_argument("--synthetic", default="qwen35-27b-q4km", choices=sorted(_presets()))
    ap.add_argument("--path", default=None, help="where the synthetic GGUF is kept (default: the temp folder)")
    ap.add_argument("--device", default="cuda:0", help="cuda:N")
    args = ap.parse_args()
    cb.set_step_timeline(True)                          # before any kernel is built
    model = _model(args.synthetic, args.path, args.device)
    if model.gpu_step is None or not hasattr(model.backend.xp, "cuda"):
        sys.exit(f"{args.synthetic} on {args.device}: no CUDA GPU step to time")
    rng = np.random.default_rng(0)
    context = model.new_state(256 + 40)
    model.prefill(rng.integers(0, model.n_vocab, 256).tolist(), context, logits="last")
    for T in (int(w) for w in args.widths.split(",") if w.strip()):
        timeline(model, T, context, args.reps)


if __name__ == "__main__":
    main()
