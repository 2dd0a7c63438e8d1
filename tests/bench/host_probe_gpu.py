"""Where the host time of a GPU decode step goes: `dflashd bench`'s host line (decode step minus its
graph's device time) says how much there is, 0.05-0.27 ms from run to run on the H200 machine; this
times the step's host-side pieces (binding the state, the params block's upload, the graph launch
call, the wait and copy of the id back) around greedy decode steps, then the bare graph launch call
and a one-int copy back on an idle device.

    python3 tests/bench/host_probe_gpu.py [--path /tmp/qwen35-27b-q4km.gguf] [--device cuda:0] [--steps 60]

The file is the one `dflashd bench --synthetic qwen35-27b-q4km` writes (run that first). Tenth
session (2026-12-02): step 6.815 ms, upload 0.041, launch call 0.024, bind 0.002, the id's wait and
copy 6.637 (the graph's ~6.63 ms device time included).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from daemons.qwen35 import Qwen35Model     # noqa: E402


def _timed(samples: dict[str, list[float]], name: str, obj, attr: str) -> None:
    """Wrap obj.attr so that each call's wall time lands in samples[name]."""
    inner = getattr(obj, attr)

    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            samples.setdefault(name, []).append(time.perf_counter() - t0)
    setattr(obj, attr, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="/tmp/qwen35-27b-q4km.gguf")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prefill", type=int, default=512)
    a = ap.parse_args()
    from kernels.cuda_backend import CudaBackend
    import cupy as cp
    model = Qwen35Model.load(a.path, CudaBackend(a.device))
    step = model.gpu_step
    if step is None:
        raise SystemExit(f"{a.path}: no GPU step for this model")
    samples: dict[str, list[float]] = {}
    _timed(samples, "bind", step, "_bind")
    _timed(samples, "params upload", step, "_upload")
    _timed(samples, "launch (plan lookup + graph launch call)", step, "_launch")
    _timed(samples, "id back (waits for the graph)", step, "_to_host")
    state = model.new_state(a.prefill + a.steps + 16)
    model.prefill(list(range(1, a.prefill + 1)), state, logits="last")
    tok = 5
    for _ in range(5):
        tok = int(model.forward([tok], state, logits="argmax_last")[0])
    samples.clear()
    steps = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        tok = int(model.forward([tok], state, logits="argmax_last")[0])
        steps.append(time.perf_counter() - t0)
    print(f"decode step          {statistics.median(steps) * 1e3:8.3f} ms (median of {a.steps})")
    for name, v in samples.items():
        print(f"  {name:<44} {statistics.median(v) * 1e3:8.3f} ms a call, {len(v) / a.steps:.0f} a step")
    _, graph = step._plans[step.plan_key(1, "advance", "last", state.n_past)]
    stream = cp.cuda.get_current_stream()
    calls = []
    for _ in range(20):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        graph.launch(stream)
        calls.append(time.perf_counter() - t0)
    cp.cuda.Device().synchronize()
    print(f"graph launch call on an idle device: {statistics.median(calls) * 1e3:.3f} ms")
    one = cp.zeros(1, dtype=cp.int32)
    copies = []
    for _ in range(50):
        t0 = time.perf_counter()
        cp.asnumpy(one)
        copies.append(time.perf_counter() - t0)
    print(f"one int copied back on an idle device: {statistics.median(copies) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
