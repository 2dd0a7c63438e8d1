"""What some launches cost inside the captured step: `dflashd bench` on the 27B shape with every launch
of the named kinds (a label without its layer prefix: gdn_recur, post_norm, "mm ssm_out Q4_K", as
profile_gpu_step.py prints them) left out of the step. The results are wrong (the launches after them
read stale buffers); only the timing means something: the graph time against a plain `dflashd bench`
of the same build in the same session is what those launches add to the step's critical path
(profile_gpu_step.py, launches back to back, says only what each takes alone).

    python3 tests/bench/bench_drop_ops.py KIND[,KIND...] [--synthetic-path /tmp/qwen35-27b-q4km.gguf] [-- BENCH_ARGS]

(BENCH_ARGS: more `dflashd bench` options, e.g. `--no-profile --widths 1,23`.)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from daemons.bench import _op_kind      # noqa: E402


def drop_from_plans(step_cls, kinds: set[str]) -> set[str]:
    """Patch step_cls._plan to leave out the launches of `kinds`; returns the set (filled as plans are
    made) of the kinds actually left out."""
    plan = step_cls._plan
    seen: set[str] = set()

    def without(self, *args, **kw):
        kept = []
        for op in plan(self, *args, **kw):
            k = _op_kind(getattr(op, "label", ""))
            if k in kinds:
                seen.add(k)
            else:
                kept.append(op)
        return kept

    step_cls._plan = without
    return seen


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    kinds = set(sys.argv[1].split(","))
    path = "/tmp/qwen35-27b-q4km.gguf"
    if "--synthetic-path" in sys.argv:
        path = sys.argv[sys.argv.index("--synthetic-path") + 1]
    import daemons.qwen35_gpu as qwen35_gpu
    seen = drop_from_plans(qwen35_gpu.Qwen35GpuStep, kinds)
    from daemons.cli import main as cli_main
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    sys.argv = ["dflashd", "bench", "--synthetic", "qwen35-27b-q4km", "--device", "cuda:0", "--synthetic-path", path,
                *extra]
    try:
        cli_main()
    finally:
        missing = kinds - seen
        print(f"left out: {', '.join(sorted(seen)) or 'nothing'}"
              + (f"; no launch of kind {', '.join(sorted(missing))}" if missing else ""))


if __name__ == "__main__":
    main()
