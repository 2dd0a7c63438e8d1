"""An upper bound for the matmul epilogues: `dflashd bench` on the 27B shape with every mm_tc launch
(or only those of one mode: the residual adds, the SwiGLU gate|up) compiled with MM_NO_EXCHANGE, i.e. without its epilogue and the
exchange of cut row blocks. The results are wrong; only the timing means something. (Every tile's
sums stay alive in that build, so the compiler keeps the MMAs at every width: NVRTC 13.5, sm_90, the
Q4_K SwiGLU T = 23 build without its epilogue is 17.4 KB of .text against 10.6 KB for its copies alone
and 39.0 KB whole; before that keep, wider builds lost their MMAs.)
`swiglu-copies`: the gate|up launches also without their MMAs and dequantisation (MM_NO_COMPUTE: the
pipeline's copies alone), the floor for the largest matmul inside the step.

    python3 tests/bench/bench_epilogue_bound.py all|add|swiglu|swiglu-copies [--synthetic-path /tmp/qwen35-27b-q4km.gguf] [bench options]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import kernels.fused_gpu as fused_gpu     # noqa: E402


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("all", "add", "swiglu", "swiglu-copies"):
        sys.exit(__doc__)
    which = sys.argv[1]
    rest = sys.argv[2:]
    if "--synthetic-path" not in rest:
        rest += ["--synthetic-path", "/tmp/qwen35-27b-q4km.gguf"]
    op_mm = fused_gpu.FusedGpu.op_mm

    def without_epilogue(self, label, segs, act, T, mode, ws, out_act=None, variant=()):
        if which == "all" or mode == {"add": fused_gpu.MODE_ADD, "swiglu": fused_gpu.MODE_SWIGLU,
                                      "swiglu-copies": fused_gpu.MODE_SWIGLU}[which]:
            variant = tuple(variant) + ("MM_NO_EXCHANGE=1",) + (("MM_NO_COMPUTE=1",) if which == "swiglu-copies" else ())
        return op_mm(self, label, segs, act, T, mode, ws, out_act=out_act, variant=variant)

    fused_gpu.FusedGpu.op_mm = without_epilogue
    from daemons.cli import main as cli_main
    sys.argv = ["dflashd", "bench", "--synthetic", "qwen35-27b-q4km", "--device", "cuda:0", *rest]
    cli_main()


if __name__ == "__main__":
    main()
