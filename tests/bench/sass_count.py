"""Instructions per 16x256 unit of an mm_tc instantiation, from its SASS: the main loop's stretch
from the stage wait (SYNCS...TRYWAIT) to the last MMA, counted by opcode. Needs nvcc and nvdisasm
(the GPU machine has both; elsewhere `pip download nvidia-cuda-nvdisasm` holds the binary).

    python3 tests/bench/sass_count.py QT NT MODE [-DMM_...]     e.g. 12 1 2  (Q4_K, T <= 8, SwiGLU)
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    qt, nt, mode, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    disasm = shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "mm.cubin")
        r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", cubin, "-std=c++17", "-I", KERNELS, f"-DMM_QT={qt}",
                            f"-DMM_NT={nt}", f"-DMM_MODE={mode}", "-Xptxas", "-v", *extra,
                            os.path.join(KERNELS, "mma_matmul.cu")], capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr)
        print(" ".join(l.split(":", 1)[-1].strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l))
        sass = subprocess.run([disasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(.*?);", sass)]
    mma = [i for i, t in enumerate(ins) if "HMMA" in t]
    if not mma:
        sys.exit("no MMA in the kernel")
    j = mma[0]
    while j > 0 and "TRYWAIT" not in ins[j]:
        j -= 1
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in ins[j:mma[-1] + 1])
    print(f"stage wait -> last MMA: {mma[-1] + 1 - j} instructions, {len(mma)} HMMA")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
